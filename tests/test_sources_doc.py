"""docs/sources.md against the catalogue: every sentence that names a shipped recipe (or, after
one in its section, says "the recipe") is held by a claim below, checked against the recipe
files; a new such sentence without a claim fails, so the page cannot drift from the recipes
again (issue 36: "rigbook ships no GDN recipe" and a 60K statement the catalogue contradicted).
The seeds' item table is checked too: every row names where rigbook acts, or why not."""

from __future__ import annotations

import re
from collections.abc import Callable

from rigbook.core.cards import class_card
from rigbook.roles.recipes import (
    Recipe,
    card_warnings,
    catalogue,
    example_rig,
    installed_packages,
    measured_on_its_build,
)
from tests.conftest import ROOT

SOURCES = (ROOT / "docs" / "sources.md").read_text()
C = catalogue()


def gdn(name: str) -> bool:
    return C[name].model.gdn


def no_figure(name: str) -> bool:
    from rigbook.roles.recipes import FIGURE

    return not C[name].measured and not FIGURE.findall(C[name].description)


def fits(name: str) -> set[str]:
    return set(C[name].fits.gpu_class)


def sm(r: Recipe) -> set[tuple[int, int]]:
    return {class_card(c).compute_cap for c in r.fits.gpu_class if class_card(c)}


#: A fragment of a sentence of docs/sources.md -> what the catalogue must say for it to be true.
CLAIMS: dict[str, Callable[[], bool]] = {
    "`qwen36-27b-dual-20g`: Hardware notes, \"dual-turbo.yml on 20 GB Ampere": lambda: (
        C["qwen36-27b-dual-20g"].measured and C["qwen36-27b-dual-20g"].kv_cache_dtype
        == "fp8_e5m2" and C["qwen36-27b-dual-20g"].max_model_len == 262144
        and C["qwen36-27b-dual-20g"].gpu_memory_utilization == 0.82),
    "`qwen36-27b-5090`: Hardware notes, \"Cross-rig power-cap data": lambda: (
        C["qwen36-27b-5090"].measured and fits("qwen36-27b-5090") == {"rtx5090"}),
    "the recipe's 131072-token context and 0.92 share": lambda: (
        C["qwen36-27b-5090"].max_model_len == 131072
        and C["qwen36-27b-5090"].gpu_memory_utilization == 0.92
        and C["qwen36-27b-5090"].kv_cache_dtype is None),
    "`qwen36-27b-dual-3090` is **not** a measured configuration": lambda: (
        not C["qwen36-27b-dual-3090"].measured),
    "The recipe takes the stock settings the notes give for this hardware: TP=2": lambda: (
        C["qwen36-27b-dual-3090"].tensor_parallel_size == 2),
    "`fp8_e5m2` KV (the stock KV type": lambda: (
        C["qwen36-27b-dual-3090"].kv_cache_dtype == "fp8_e5m2"),
    "0.95 of each 24 GB card": lambda: C["qwen36-27b-dual-3090"].gpu_memory_utilization == 0.95,
    "and 65536 tokens, the top of the range": lambda: (
        C["qwen36-27b-dual-3090"].max_model_len == 65536
        and C["qwen36-27b-dual-3090"].env.get("NCCL_P2P_DISABLE") == "1"),
    "It quotes no figure.": lambda: no_figure("qwen36-27b-dual-3090"),
    "`qwen36-27b-llamacpp`: Hardware notes, \"Cross-rig power-cap data": lambda: (
        C["qwen36-27b-llamacpp"].measured and C["qwen36-27b-llamacpp"].engine == "llama.cpp"
        and fits("qwen36-27b-llamacpp") == {"rtx3090", "rtx4090"}),
    "0.95 on headless 24 GB pairs (`dual-3090-tp2`, `dual-3090-draft`, `wsl2-dual-3090-tp2`), "
    "0.82 on 20 GB pairs (`dual-20g-tp2`)": lambda: all(
        C[n].gpu_memory_utilization == 0.95 and C[n].fits.gpu_count == 2
        for n in ("dual-3090-tp2", "dual-3090-draft", "wsl2-dual-3090-tp2"))
        and C["dual-20g-tp2"].gpu_memory_utilization == 0.82,
    "`dual-20g-tp2` uses `fp8_e5m2`": lambda: C["dual-20g-tp2"].kv_cache_dtype == "fp8_e5m2",
    "rigbook ships the method (a separate draft model, `dual-3090-draft`)": lambda: (
        C["dual-3090-draft"].speculative.method == "draft_model"),
    "the recipe quotes none of the log's figures": lambda: no_figure("dual-3090-draft"),
    "`single-24g-long` (vLLM, 131072 tokens) fits SM89+ cards only (RTX 4090 / 5090)": lambda: (
        C["single-24g-long"].engine == "vllm" and C["single-24g-long"].max_model_len == 131072
        and fits("single-24g-long") == {"rtx4090", "rtx5090"}
        and min(sm(C["single-24g-long"])) >= (8, 9)),
    "`llamacpp-single` serves 32768 tokens and is not the notes'": lambda: (
        C["llamacpp-single"].max_model_len == 32768 and not C["llamacpp-single"].measured),
    "`qwen36-27b-llamacpp` is ([Measured configurations]": lambda: (
        C["qwen36-27b-llamacpp"].measured and C["qwen36-27b-llamacpp"].max_model_len > 60000),
    "`qwen36-27b-dual-3090` serves 65536 tokens on two SM86 cards (TP=2": lambda: (
        C["qwen36-27b-dual-3090"].max_model_len == 65536
        and C["qwen36-27b-dual-3090"].tensor_parallel_size == 2
        and sm(C["qwen36-27b-dual-3090"]) == {(8, 6)}
        and bool(card_warnings(C["qwen36-27b-dual-3090"], example_rig(
            C["qwen36-27b-dual-3090"]), class_card("rtx3090")))),  # "and gets that warning"
    "`single-24g-long` (one sequence) sets a larger `--max-num-batched-tokens`": lambda: (
        C["single-24g-long"].max_num_seqs == 1
        and C["single-24g-long"].max_num_batched_tokens > 2048),
    "(`qwen36-27b-dual-20g`, `qwen36-27b-5090` and `qwen36-27b-dual-3090` set `model.gdn`)":
        lambda: {n for n, r in C.items() if r.model.gdn and r.engine == "vllm"} == {
            "qwen36-27b-dual-20g", "qwen36-27b-5090", "qwen36-27b-dual-3090"},
    "None of them was measured on the engine build rigbook installs": lambda: not any(
        measured_on_its_build(r) for r in C.values() if r.measured),
    "rigbook the stock vLLM 0.33.0 wheel and llama-cpp-python 0.3.36": lambda: {
        p for r in C.values() if r.measured for p in installed_packages(r)} >= {
        "vllm==0.33.0", "llama-cpp-python[server]==0.3.36"},
}


def recipe_sentences() -> list[str]:
    """Every sentence of the page's prose that names a recipe, or says "the recipe" / "it
    quotes" after one in the same section (quotes, tables and code are the sources' words)."""
    found, last = [], None
    for block in re.split(r"\n\s*\n", SOURCES):
        if block.lstrip().startswith("#"):
            last = None
            continue
        if block.lstrip().startswith((">", "|", "    ")):
            continue
        for sentence in re.split(r"(?<=[.])\s+(?=[A-Z`(])", " ".join(block.split())):
            if any(name in C for name in re.findall(r"`([a-z0-9-]+)`", sentence)):
                last = sentence
                found.append(sentence)
            elif last and re.search(r"\b[Tt]he recipe('s)?\b|\bIt quotes\b", sentence):
                found.append(sentence)
    return found


def test_every_sentence_naming_a_recipe_property_is_held_by_a_claim():
    flat = " ".join(SOURCES.split())
    for fragment in CLAIMS:
        assert fragment in flat, f"stale claim: {fragment!r}"
    for sentence in recipe_sentences():
        held = [fragment for fragment in CLAIMS if fragment in sentence]
        assert held, f"no claim holds this sentence of docs/sources.md: {sentence!r}"
    false = [fragment for fragment, holds in CLAIMS.items() if not holds()]
    assert false == [], false


def test_the_false_statements_issue_36_named_are_gone():
    flat = " ".join(SOURCES.split())
    assert "rigbook ships no GDN recipe" not in flat
    assert "is the only one-card recipe past 60K" not in flat


def seed_rows() -> list[list[str]]:
    section = SOURCES.split("## The seeds item by item", 1)[1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split(" | ")]
            for line in section.splitlines() if re.match(r"\| \d+ \|", line)]


def test_the_seed_table_names_where_rigbook_acts_or_why_not_and_its_counts_hold():
    from rigbook.roles.recipes import anchor

    rows = seed_rows()
    assert [int(row[0]) for row in rows] == list(range(1, len(rows) + 1))
    assert {row[1] for row in rows} == {"Hardware notes", "Failure log", "Runbook"}
    headings = {anchor(line[3:]) for line in SOURCES.splitlines() if line.startswith("## ")}
    counts = {"done": 0, "partial": 0, "not for a tool": 0}
    for number, _seed, item, where, status in rows:
        kind, _, why = status.partition(": ")
        assert kind in counts, (number, status)
        counts[kind] += 1
        assert item and where, number
        if kind != "done":
            assert why, f"row {number}: a {kind} row says why"
        if where == "none":
            assert kind != "done", f"row {number}: done, but acts nowhere"
        for link in re.findall(r"\]\(#([^)]+)\)", where):
            assert link in headings, (number, link)
    total = sum(counts.values())
    assert (f"Counts: {total} items: {counts['done']} done, {counts['partial']} partial, "
            f"{counts['not for a tool']} not for a tool.") in " ".join(SOURCES.split())
    assert total >= 110  # the issue's reading found 110 actionable items
