"""rigbook.core.cards and the rules keyed on what the card is (compute capability, VRAM), read from
the class before connecting and from nvidia-smi once facts are read, with the sources' own cards and
numbers (docs/sources.md, Rules keyed on the card)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigbook.core.cards import Card, class_card, facts_card
from rigbook.core.spec import Rig
from rigbook.rigside.gpus import Gpu, GpuProbe, parse_query_csv
from rigbook.roles.recipes import Recipe, card_problems, card_warnings, fit_problems
from rigbook.roles.serving import fit_problems as serving_fit_problems
from rigbook.roles.serving import serve_plan
from tests.conftest import ROOT
from tests.test_recipes import MAIN, recipe_data
from tests.test_serving import state

H200 = parse_query_csv((ROOT / "tests/fixtures/nvidia-h200/query-gpu.csv").read_text(),
                       skip_mismatched=True)


def gdn(**changes) -> Recipe:
    data = recipe_data(model={"repo": "o/m", "revision": MAIN, "weights_gib": 1, "gdn": True})
    data.update(changes)
    return Recipe.model_validate(data)


def rig(gpu_class: str = "rtx3090", count: int = 1, **data) -> Rig:
    extra = {"gpu_limits_watts": (100, 320)} if gpu_class == "other" else {}
    return Rig.model_validate({
        "platform": "debian", "gpu_class": gpu_class, "gpu_count": count,
        "power_profile": "stock", "venvs": [{"name": "v", "engine": "vllm",
                                             "packages": ["vllm==1.0"]}], **extra, **data})


def card(gpu_class: str) -> Card:
    found = class_card(gpu_class)
    assert found is not None
    return found


def modded_3080(index: int = 0) -> Gpu:
    """The notes' "2x RTX 3080 modded 20 GB ... sm_86" pair, as nvidia-smi would list one."""
    return Gpu(index=index, uuid=f"GPU-{index}", name="NVIDIA GeForce RTX 3080",
               bus_id=f"00000000:0{index + 1}:00.0", memory_total_mib=20480, compute_cap="8.6")


ONE = {"gpu_class": ["rtx3090", "rtx4090", "rtx5090", "a5000", "a6000"], "gpu_count": 1,
       "platforms": ["debian"]}


def test_cliff_2_is_keyed_on_24_gb_single_cards_not_on_sm86():
    """Hardware notes: Cliff 2 is "the chunked-prefill code path that 24 GB single-card configs
    are forced to take" (">50K single-prompt"), and the A6000's "double VRAM lets you skip the
    cliff workarounds": a 48 GB A6000 passes, a 24 GB 4090 does not; TP=2 "escapes the cliff";
    the 5090's 32 GB "relaxes the prefill cliffs"."""
    long = gdn(max_model_len=131072, fits=ONE)
    for refused in ("rtx3090", "rtx4090", "a5000"):
        (problem,) = card_problems(long, rig(refused), card(refused))
        assert problem.startswith("max_model_len 131072 on one 24 GiB card (gpu_class ")
        assert "24 GB single-card configs take the chunked-prefill path" in problem
    assert card_problems(long, rig("a6000"), card("a6000")) == []
    assert card_problems(long, rig("rtx5090"), card("rtx5090")) == []
    assert card_problems(long, rig(serving_max_model_len=50000), card("rtx3090")) == []
    two = gdn(max_model_len=131072, tensor_parallel_size=2)
    assert card_problems(two, rig(count=2), card("rtx3090")) == []
    # fit_problems reads the class card before connecting: the A6000 fits, the 4090 does not
    assert fit_problems(long, rig("a6000")) == []
    assert any("Cliff 2" in p for p in fit_problems(long, rig("rtx4090")))


def test_flashinfer_gdn_needs_sm90_read_from_the_facts_for_other_cards(tmp_path: Path):
    """Failure log: "flashinfer's GDN kernels require SM90+". `other` (the notes' modded 20 GB
    3080 pair, sm_86) has no class card: the serving preflight reads nvidia-smi's compute_cap."""
    args = ["--linear-attention-backend=flashinfer"]
    recipe = gdn(extra_args=args, fits=ONE)
    (problem,) = card_problems(recipe, rig(), card("rtx3090"))
    assert "GDN kernels need SM90+; this card is SM86 (gpu_class rtx3090)" in problem
    assert card_problems(recipe, rig("rtx4090"), card("rtx4090"))  # SM89 is below SM90 too
    assert card_problems(recipe, rig("a5000"), card("a5000"))
    assert card_problems(gdn(fits=ONE), rig(), card("rtx3090")) == []  # Triton: the default
    plain = Recipe.model_validate(recipe_data(extra_args=args))
    assert card_problems(plain, rig(count=2), card("rtx3090")) == []  # not a GDN model
    [h200] = H200
    assert facts_card(H200) == Card((9, 0), 140.4, "nvidia-smi: GPU 0 NVIDIA H200, compute_cap "
                                    "9.0, 143771 MiB")
    assert card_problems(recipe, rig(), facts_card(H200)) == []
    # through the serving preflight, on an `other` pair that nvidia-smi shows as sm_86
    (tmp_path / "gdn-pair.toml").write_text(_toml("gdn-pair", args))
    pair = rig("other", 2, serving_recipe_dirs=[str(tmp_path)], recipe="gdn-pair",
               models=[{"repo": "o/m", "revision": MAIN}])
    assert fit_problems(serve_plan(pair, "r").recipe, pair) == []  # no class card: facts decide
    gpus = GpuProbe(smi="/usr/bin/nvidia-smi", gpus=(modded_3080(0), modded_3080(1)))
    problems = serving_fit_problems(serve_plan(pair, "r"), state(), gpus)
    assert [p for p in problems if p.startswith("card: ")] == [
        "card: extra_args or env select FlashInfer, whose GDN kernels need SM90+; this card is "
        "SM86 (nvidia-smi: GPU 0 NVIDIA GeForce RTX 3080, compute_cap 8.6, 20480 MiB), where "
        "only the Triton linear-attention backend runs (the failure log; docs/sources.md, Rules "
        "keyed on the card)"]


def _toml(name: str, args: list[str]) -> str:
    return f'''name = "{name}"
description = "a GDN pair"
engine = "vllm"
venv = "v"
tensor_parallel_size = 2
max_model_len = 4096
gpu_memory_utilization = 0.82
extra_args = {args!r}
[model]
repo = "o/m"
revision = "{MAIN}"
weights_gib = 1
gdn = true
[fits]
gpu_class = ["other"]
gpu_count = 2
platforms = ["debian"]
[estimate]
kv_gib = 1
host_ram_gib = 1
'''.replace("'", '"')


@pytest.mark.parametrize("env, extra_args", [
    ({"VLLM_FLASH_ATTN_VERSION": "3"}, []),
    ({}, ["--attention-backend", "FLASHMLA"]),
])
def test_sm90_only_kernels_are_refused_on_sm120(env, extra_args):
    """The runbook (a GB202, SM120): "kernels the ecosystem ships for SM90 either fail to select
    or select and then assert here"; the notes' H100 row: "flash-attn 3 paths available"."""
    recipe = Recipe.model_validate(recipe_data(env=env, extra_args=extra_args, fits=ONE))
    (problem,) = card_problems(recipe, rig("rtx5090"), card("rtx5090"))
    assert "is built for SM90 (Hopper); this card is SM120 (gpu_class rtx5090)" in problem
    assert card_problems(recipe, rig(), card("rtx3090"))  # nor on SM86
    assert card_problems(recipe, rig(), facts_card(H200)) == []  # the H200 is SM90


def test_long_context_on_sm86_is_said_for_any_vllm_recipe():
    """Hardware notes: the SM86 slowdown at depth (~-71% from 0 to 131K) is "architectural, not
    model-specific"; "switch to llama.cpp at >60K context": a non-GDN vLLM recipe at 131072 on
    a 3090 is said, not refused; on SM89 (a 4090) and under llama.cpp it is not."""
    long = Recipe.model_validate(recipe_data(max_model_len=131072, fits=ONE))
    (text,) = card_warnings(long, rig(), card("rtx3090"))
    assert text.startswith("max_model_len 131072 on SM86 (gpu_class rtx3090): single-stream "
                           "decode on SM86 slows ~71% from 0 to 131K context")
    assert card_problems(long, rig(), card("rtx3090")) == []
    assert card_warnings(long, rig("a6000"), card("a6000"))  # SM86 whatever its VRAM
    assert card_warnings(long, rig("rtx4090"), card("rtx4090")) == []
    assert card_warnings(long, rig(serving_max_model_len=60000), card("rtx3090")) == []
    assert card_warnings(long, rig(), Card((8, 6), 20, "x"))  # a modded 3080 from its facts


def test_a_gpu_without_compute_cap_or_memory_gives_no_card():
    assert facts_card([]) is None
    blank = Gpu(index=0, uuid="GPU-0", name="NVIDIA GeForce RTX 3090", bus_id="0:1:0.0")
    assert facts_card([blank]) is None
    assert facts_card([modded_3080(0), H200[0]]).compute_cap == (8, 6)  # the weakest card
