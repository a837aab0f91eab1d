"""The recipe catalogue: every shipped recipe loads, fits its rig class, and renders exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from rigbook.core.errors import RigbookError
from rigbook.core.pins import engine_pins, engine_venv
from rigbook.core.spec import Rig
from rigbook.roles.recipes import (
    FIGURE,
    PLACEHOLDER_REVISION,
    RECIPES_DIR,
    START_WITH,
    VENV_ENGINE,
    Recipe,
    catalogue,
    engine_argv,
    example_rig,
    fit_problems,
    load_recipe,
    recipe_for,
    recipes_markdown,
)
from rigbook.roles.serving import engine_environment
from tests.conftest import ROOT

TEST_RECIPES = str(ROOT / "tests" / "recipes")
MAIN, DRAFT = "a" * 40, "b" * 40
CACHE = "/var/lib/rigbook/hf/hub"
VLLM = "/opt/rigbook/venvs/vllm-0.33/bin/vllm"
QWEN32 = f"{CACHE}/models--Qwen--Qwen3-32B-AWQ/snapshots/{MAIN}"

#: The exact command line of every shipped recipe, on a rig of its class that pins the model
#: at MAIN (and the draft at DRAFT) in its `models` host data.
EXPECTED = {
    "dual-3090-tp2": [
        VLLM, "serve", QWEN32, "--served-model-name", "Qwen/Qwen3-32B-AWQ",
        "--host", "127.0.0.1", "--port", "8000", "--tensor-parallel-size", "2",
        "--max-model-len", "32768", "--gpu-memory-utilization", "0.95", "--max-num-seqs", "8",
        "--shutdown-timeout", "30",
    ],
    "dual-3090-draft": [
        VLLM, "serve", QWEN32, "--served-model-name", "Qwen/Qwen3-32B-AWQ",
        "--host", "127.0.0.1", "--port", "8000", "--tensor-parallel-size", "2",
        "--max-model-len", "32768", "--gpu-memory-utilization", "0.95", "--max-num-seqs", "4",
        "--speculative-config",
        '{"model":"/var/lib/rigbook/hf/hub/models--Qwen--Qwen3-0.6B/snapshots/'
        + DRAFT + '","num_speculative_tokens":5,"method":"draft_model"}',
        "--shutdown-timeout", "30",
    ],
    "single-24g-long": [
        VLLM, "serve", f"{CACHE}/models--Qwen--Qwen3-4B-Instruct-2507/snapshots/{MAIN}",
        "--served-model-name", "Qwen/Qwen3-4B-Instruct-2507",
        "--host", "127.0.0.1", "--port", "8000", "--tensor-parallel-size", "1",
        "--max-model-len", "131072", "--gpu-memory-utilization", "0.92",
        "--kv-cache-dtype", "fp8_e5m2", "--max-num-seqs", "1",
        "--max-num-batched-tokens", "16384", "--shutdown-timeout", "30",
    ],
    "llamacpp-single": [
        "/opt/rigbook/venvs/llamacpp/bin/python", "-m", "llama_cpp.server",
        "--model", f"{CACHE}/models--Qwen--Qwen3-14B-GGUF/snapshots/{MAIN}/Qwen3-14B-Q4_K_M.gguf",
        "--model_alias", "Qwen/Qwen3-14B-GGUF", "--host", "127.0.0.1", "--port", "8000",
        "--n_ctx", "32768", "--n_gpu_layers", "-1",
    ],
    "dual-20g-tp2": [
        VLLM, "serve", QWEN32, "--served-model-name", "Qwen/Qwen3-32B-AWQ",
        "--host", "127.0.0.1", "--port", "8000", "--tensor-parallel-size", "2",
        "--max-model-len", "32768", "--gpu-memory-utilization", "0.82",
        "--kv-cache-dtype", "fp8_e5m2", "--max-num-seqs", "4", "--shutdown-timeout", "30",
    ],
    "wsl2-dual-3090-tp2": [
        VLLM, "serve", QWEN32, "--served-model-name", "Qwen/Qwen3-32B-AWQ",
        "--host", "127.0.0.1", "--port", "8000", "--tensor-parallel-size", "2",
        "--max-model-len", "32768", "--gpu-memory-utilization", "0.95", "--max-num-seqs", "8",
        "--shutdown-timeout", "30",
    ],
    "qwen36-27b-dual-20g": [
        VLLM, "serve", f"{CACHE}/models--Lorbus--Qwen3.6-27B-int4-AutoRound/snapshots/{MAIN}",
        "--served-model-name", "Lorbus/Qwen3.6-27B-int4-AutoRound",
        "--host", "127.0.0.1", "--port", "8000", "--tensor-parallel-size", "2",
        "--max-model-len", "262144", "--gpu-memory-utilization", "0.82",
        "--kv-cache-dtype", "fp8_e5m2", "--shutdown-timeout", "30",
    ],
    "qwen36-27b-dual-3090": [
        VLLM, "serve", f"{CACHE}/models--Lorbus--Qwen3.6-27B-int4-AutoRound/snapshots/{MAIN}",
        "--served-model-name", "Lorbus/Qwen3.6-27B-int4-AutoRound",
        "--host", "127.0.0.1", "--port", "8000", "--tensor-parallel-size", "2",
        "--max-model-len", "65536", "--gpu-memory-utilization", "0.95",
        "--kv-cache-dtype", "fp8_e5m2", "--shutdown-timeout", "30",
    ],
    "qwen36-27b-5090": [
        VLLM, "serve", f"{CACHE}/models--Lorbus--Qwen3.6-27B-int4-AutoRound/snapshots/{MAIN}",
        "--served-model-name", "Lorbus/Qwen3.6-27B-int4-AutoRound",
        "--host", "127.0.0.1", "--port", "8000", "--tensor-parallel-size", "1",
        "--max-model-len", "131072", "--gpu-memory-utilization", "0.92",
        "--shutdown-timeout", "30",
    ],
    "qwen36-27b-llamacpp": [
        "/opt/rigbook/venvs/llamacpp/bin/python", "-m", "llama_cpp.server",
        "--model", f"{CACHE}/models--unsloth--Qwen3.6-27B-GGUF/snapshots/{MAIN}/"
        "Qwen3.6-27B-UD-Q3_K_XL.gguf",
        "--model_alias", "unsloth/Qwen3.6-27B-GGUF", "--host", "127.0.0.1", "--port", "8000",
        "--n_ctx", "65536", "--n_gpu_layers", "-1",
    ],
}


def pinned_rig(recipe: Recipe, **data) -> Rig:
    """example_rig with the recipe's models pinned in host data (and any other keys)."""
    models = [{"repo": recipe.model.repo, "revision": MAIN}]
    if recipe.draft is not None:
        models.append({"repo": recipe.draft.repo, "revision": DRAFT})
    base = example_rig(recipe).model_dump(exclude_defaults=True)
    return Rig.model_validate({**base, "models": models, **data})


def recipe_data(**changes) -> dict:
    """A valid vLLM recipe as TOML would give it, with changes."""
    data = {
        "name": "x", "description": "x", "engine": "vllm", "venv": "v",
        "max_model_len": 4096, "gpu_memory_utilization": 0.9,
        "model": {"repo": "o/m", "revision": MAIN, "weights_gib": 1},
        "fits": {"gpu_class": ["rtx3090"], "gpu_count": 2, "platforms": ["debian"]},
        "estimate": {"kv_gib": 1, "host_ram_gib": 8},
    }
    data.update(changes)
    return data


def test_every_shipped_recipe_names_the_sources_it_follows():
    """docs/recipes.md shows each recipe's source and section; each topic is a section of
    docs/sources.md, which quotes it."""
    from rigbook.roles.recipes import anchor

    sources = (ROOT / "docs" / "sources.md").read_text()
    headings = {anchor(line[3:]) for line in sources.splitlines() if line.startswith("## ")}
    docs = (ROOT / "docs" / "recipes.md").read_text()
    for recipe in catalogue().values():
        assert recipe.sources, recipe.name
        for ref in recipe.sources:
            assert anchor(ref.topic) in headings, (recipe.name, ref.topic)
            assert ref.markdown() in docs
    assert anchor("Shutdown drain and /dev/shm") == "shutdown-drain-and-devshm"
    assert anchor("expandable_segments") == "expandable_segments"


def test_recipes_quote_no_figures_from_configurations_they_do_not_ship():
    """Issue 20 (2): the failure log's acceptance and tok/s belong to its 1.4B draft and GDN
    27B; (3): the long-context vLLM recipe is not for SM86 cards."""
    recipes = catalogue()
    for recipe in recipes.values():
        for figure in ("3.7-4.2", "170-210", "1.07-1.27", "56 tok/s", "56 vs 58"):
            assert figure not in recipe.description, (recipe.name, figure)
    long = recipes["single-24g-long"]
    assert long.max_model_len > 60_000
    assert not set(long.fits.gpu_class) & {"rtx3090", "rtx3090ti", "a6000"}
    assert "recommend past ~60K" not in recipes["llamacpp-single"].description


def test_the_measured_configurations_are_the_notes_own_and_come_first():
    """Issue 20 (1): the notes' own configurations ship, first, with their figures only."""
    recipes = catalogue()
    twenty = recipes["qwen36-27b-dual-20g"]
    assert twenty.measured and twenty.model.gdn and twenty.tensor_parallel_size == 2
    assert (twenty.max_model_len, twenty.gpu_memory_utilization, twenty.kv_cache_dtype) == (
        262144, 0.82, "fp8_e5m2")
    assert twenty.env["NCCL_P2P_DISABLE"] == "1" and twenty.fits.gpu_class == ("other",)
    llama = recipes["qwen36-27b-llamacpp"]
    assert llama.measured and llama.model.gdn and llama.engine == "llama.cpp"
    assert llama.max_model_len > 60_000 and "rtx3090" in llama.fits.gpu_class
    five = recipes["qwen36-27b-5090"]
    assert five.measured and five.model.gdn and five.fits.gpu_class == ("rtx5090",)
    assert "119.98 narr / 159.23 code TPS at 400 W" in " ".join(five.description.split())
    measured = {twenty.name, llama.name, five.name}
    assert {r.name for r in recipes.values() if r.measured} == measured
    sources = (ROOT / "docs" / "sources.md").read_text()
    for recipe in (twenty, llama, five):  # every figure it quotes is quoted by docs/sources.md
        for number in re.findall(r"\d+\.\d+", recipe.description):
            assert number in sources, (recipe.name, number)
    catalogue_rows = recipes_markdown().split("## Catalogue")[1].split("\n## ")[0]
    names = re.findall(r"^\| `([a-z0-9-]+)`", catalogue_rows, re.M)
    assert names[:3] == sorted(measured) and len(names) == len(recipes)


@pytest.mark.parametrize("description", [
    "bench 82.4 TPS on two cards", "reached 170-210 tok/s", "0.111 TPS/W at 290 W",
    "56 tokens/s with speculation",
])
def test_a_generic_recipe_quoting_a_figure_is_refused(description):
    source = {"document": "Hardware notes", "section": "Power", "topic": "Power sweet spots"}
    data = recipe_data(description=description, sources=[source])
    with pytest.raises(Exception, match="quote no borrowed figure"):
        Recipe.model_validate(data)
    data["measured"] = True
    data["measured_on"] = {"gpu_class": ["rtx3090"], "gpu_count": 2, "engine": "vllm",
                           "venv": "v", "build": "vllm==0.33.0"}
    assert Recipe.model_validate(data).measured
    data["sources"] = []
    with pytest.raises(Exception, match="names the source that measured it"):
        Recipe.model_validate(data)


def test_the_catalogue_ships_the_recipes_the_sources_describe():
    recipes = catalogue()
    assert set(recipes) == set(EXPECTED)
    assert all(path.stem in recipes for path in RECIPES_DIR.glob("*.toml"))
    assert not any(r.cpu_only for r in recipes.values()), "test recipes live under tests/"
    tp2 = recipes["dual-3090-tp2"]
    assert tp2.env["NCCL_P2P_DISABLE"] == "1" and tp2.fits.nvlink == "forbidden"
    assert tp2.speculative is None  # no MTP head over PCIe
    draft = recipes["dual-3090-draft"]
    assert draft.speculative.method == "draft_model" and draft.draft.repo == "Qwen/Qwen3-0.6B"
    twenty = recipes["dual-20g-tp2"]
    assert (twenty.gpu_memory_utilization, twenty.kv_cache_dtype) == (0.82, "fp8_e5m2")
    assert recipes["wsl2-dual-3090-tp2"].fits.platforms == ("wsl2",)
    assert recipes["llamacpp-single"].engine == "llama.cpp"
    assert recipes["single-24g-long"].max_model_len >= 131072
    for recipe in recipes.values():  # every shipped pin is a marked placeholder
        assert all(pin.revision == PLACEHOLDER_REVISION for pin in recipe.models)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_shipped_recipe_renders_its_exact_command_line(name):
    recipe = catalogue()[name]
    rig = pinned_rig(recipe)
    assert fit_problems(recipe, rig) == []
    assert engine_argv(recipe, rig) == EXPECTED[name]


def test_speculative_config_is_the_json_vllm_documents():
    recipe = catalogue()["dual-3090-draft"]
    argv = engine_argv(recipe, pinned_rig(recipe))
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {
        "model": f"{CACHE}/models--Qwen--Qwen3-0.6B/snapshots/{DRAFT}",
        "num_speculative_tokens": 5, "method": "draft_model",
    }


def test_bind_port_and_cache_come_from_host_data_when_set():
    recipe = catalogue()["llamacpp-single"]
    rig = pinned_rig(recipe, serving_bind="0.0.0.0", serving_port=9000,
                     serving_api_key_file="/k", models_cache="/srv/hf")
    argv = engine_argv(recipe, rig)
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--model") + 1].startswith("/srv/hf/models--Qwen--Qwen3-14B-GGUF/")
    assert "--api-key" not in argv and "--api_key" not in argv


def test_a_placeholder_pin_needs_the_rigs_models_entry():
    recipe = catalogue()["dual-3090-tp2"]
    with pytest.raises(RigbookError) as error:
        engine_argv(recipe, example_rig(recipe))
    assert "pins no real commit of Qwen/Qwen3-32B-AWQ" in str(error.value)
    assert ('add {"repo": "Qwen/Qwen3-32B-AWQ", "revision": "<40-hex commit>"} to the rig\'s '
            "models (`rigbook models resolve Qwen/Qwen3-32B-AWQ` prints") in str(error.value)


def test_a_gguf_pin_is_asked_for_with_its_file_and_pulls_only_that():
    """Issue 33 (2): a GGUF repo holds every quantisation; the recipe serves one file."""
    from rigbook.roles.recipes import gguf_patterns, recipe_pins, rig_models

    recipe = catalogue()["qwen36-27b-llamacpp"]
    with pytest.raises(RigbookError) as error:
        engine_argv(recipe, example_rig(recipe))
    assert ('add {"repo": "unsloth/Qwen3.6-27B-GGUF", "revision": "<40-hex commit>", '
            '"allow_patterns": ["Qwen3.6-27B-UD-Q3_K_XL.gguf"]}') in str(error.value)
    rig = pinned_rig(recipe)
    (spec,) = rig_models(rig)
    assert spec.allow_patterns == ("Qwen3.6-27B-UD-Q3_K_XL.gguf",)
    assert recipe_pins(recipe, rig) == (spec,)
    other = pinned_rig(recipe, models=[{"repo": recipe.model.repo, "revision": MAIN},
                                       {"repo": "o/m", "revision": DRAFT}])
    assert rig_models(other)[1].allow_patterns == ()  # not the recipe's repo: as written
    mine = pinned_rig(recipe, models=[{"repo": recipe.model.repo, "revision": MAIN,
                                       "allow_patterns": ["*.gguf", "README.md"]}])
    assert rig_models(mine)[0].allow_patterns == ("*.gguf", "README.md")  # the rig's own
    assert fit_problems(recipe, mine) == []
    wrong = pinned_rig(recipe, models=[{"repo": recipe.model.repo, "revision": MAIN,
                                        "allow_patterns": ["*Q4_K_M*"]}])
    assert fit_problems(recipe, wrong) == [
        "models: the patterns of unsloth/Qwen3.6-27B-GGUF leave out Qwen3.6-27B-UD-Q3_K_XL.gguf, "
        "the file the recipe serves; allowed: \"allow_patterns\": "
        "['Qwen3.6-27B-UD-Q3_K_XL.gguf'] (or no patterns: rigbook then pulls that file only)"]
    assert gguf_patterns("Q4/m-Q4_K_M-00001-of-00003.gguf") == ("Q4/m-Q4_K_M-*-of-00003.gguf",)
    assert gguf_patterns("m-00001-of-00003.gguf.part") == ("m-00001-of-00003.gguf.part",)


def test_a_placeholder_in_the_rigs_own_models_is_refused():
    recipe = catalogue()["qwen36-27b-dual-3090"]
    rig = pinned_rig(recipe, models=[{"repo": recipe.model.repo, "revision": PLACEHOLDER_REVISION}])
    with pytest.raises(RigbookError, match="Lorbus/Qwen3.6-27B-int4-AutoRound is pinned to the "
                                           "all-zeros placeholder, which is no commit"):
        engine_argv(recipe, rig)


def test_the_example_fleet_serves_qwen36_27b_on_its_dual_3090_and_fits_the_5090():
    """Issue 33 (1, 4): the example inventory's dual 3090 rig serves the Qwen3.6-27B recipe
    (venv, model pin, recipe in its host data), and a 5090 rig fits the notes' measured one."""
    from rigbook.inventory import load_rigs
    from tests.test_spec import PINNED

    fleet = str(ROOT / "inventory/rigs.py")
    with pytest.raises(RigbookError) as error:  # as shipped: the operator pastes the commit
        load_rigs(fleet)
    assert ("rig-dual3090: recipe qwen36-27b-dual-3090: models: Lorbus/Qwen3.6-27B-int4-AutoRound "
            "is pinned to the all-zeros placeholder, which is no commit; pin the one `rigbook "
            "models resolve Lorbus/Qwen3.6-27B-int4-AutoRound` prints") in str(error.value)
    rigs = load_rigs(fleet, PINNED)
    dual = rigs["rig-dual3090"]
    recipe = recipe_for(dual, "rig-dual3090")
    assert recipe.name == "qwen36-27b-dual-3090" and not recipe.measured
    assert not FIGURE.search(recipe.description)
    assert "dual.yml" in recipe.description and "stock" in recipe.description
    assert [v.name for v in dual.venvs] == [recipe.venv]
    five = rigs["rig-5090"].model_copy(update={
        "venvs": dual.venvs, "recipe": "qwen36-27b-5090"})
    measured = recipe_for(five, "rig-5090")
    assert measured.measured and fit_problems(measured, five) == []
    assert fit_problems(catalogue()["qwen36-27b-dual-3090"], five) != []


@pytest.mark.parametrize(("gpu_class", "count", "platforms", "name"), START_WITH,
                         ids=[f"{c}x{n}-{p[0]}" for c, n, p, _ in START_WITH])
def test_the_recipe_to_start_with_fits_each_card_class(gpu_class, count, platforms, name):
    recipe = catalogue()[name]
    for platform in platforms:
        data = {"platform": platform, "gpu_class": gpu_class, "gpu_count": count,
                "venvs": [engine_venv(VENV_ENGINE[recipe.engine], name=recipe.venv)],
                "recipe": name, "power_profile": "stock"}
        if gpu_class == "other":
            data["gpu_limits_watts"] = (100, 320)
        assert fit_problems(recipe, Rig.model_validate(data)) == [], (name, platform)
    assert f"| {count}x {gpu_class} | {', '.join(platforms)} | [`{name}`](#{name})" in (
        ROOT / "docs" / "recipes.md").read_text()


def test_every_card_class_has_a_recipe_to_start_with():
    from typing import get_args

    from rigbook.core.spec import GpuClass

    assert {row[0] for row in START_WITH} == set(get_args(GpuClass))


@pytest.mark.parametrize(("change", "differs"), [
    ({"fits": {"gpu_class": ["rtx3090"], "gpu_count": 2, "nvlink": "forbidden",
               "platforms": ["ubuntu"]}}, "fits 2x rtx3090, measured on 2x other"),
    ({"fits": {"gpu_class": ["other"], "gpu_count": 1, "platforms": ["ubuntu"]},
      "tensor_parallel_size": 1}, "fits 1x other, measured on 2x other"),
    ({"venv": "vllm-nightly"}, "engine vllm venv vllm-nightly, measured on vllm venv vllm-0.33"),
])
def test_a_copied_measured_recipe_with_other_fits_or_build_is_not_measured(change, differs):
    """Issue 33 (1): copying qwen36-27b-dual-20g with new fits kept measured = true and the
    20 GB 3080s' figures; a measured recipe is what its measured_on says."""
    import tomllib

    data = tomllib.loads((RECIPES_DIR / "qwen36-27b-dual-20g.toml").read_text())
    assert Recipe.model_validate(data).measured
    data.update(change, name="mine")
    with pytest.raises(ValidationError) as error:
        Recipe.model_validate(data)
    assert differs in str(error.value)
    assert "not the configuration its source measured" in str(error.value)
    assert "set measured = false" in str(error.value)
    del data["measured_on"]
    with pytest.raises(ValidationError, match="measured_on: a measured configuration says what"):
        Recipe.model_validate(data)
    data["measured"] = False
    with pytest.raises(ValidationError, match="quote no borrowed figure"):  # its 82.4 TPS
        Recipe.model_validate(data)


def test_wsl2_recipes_get_the_allocator_setting_from_the_wsl_role():
    recipe = catalogue()["wsl2-dual-3090-tp2"]
    env = engine_environment(recipe, pinned_rig(recipe))
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert env["NCCL_P2P_DISABLE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    native = catalogue()["dual-3090-tp2"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in engine_environment(native, pinned_rig(native))


@pytest.mark.parametrize(("data", "expected"), [
    (recipe_data(flavour="x"), "flavour: Extra inputs are not permitted"),
    (recipe_data(speculative={"method": "mtp", "num_speculative_tokens": 3},
                 tensor_parallel_size=2), "speculative.mtp_head: say how the checkpoint stores"),
    (recipe_data(speculative={"method": "mtp", "num_speculative_tokens": 3,
                              "mtp_head": "quantised"}),
     "INT4-quantised MTP head accepted only 1.07-1.27 tokens"),
    (recipe_data(speculative={"method": "draft_model", "num_speculative_tokens": 5,
                              "mtp_head": "unquantised"}, draft={"repo": "o/d", "revision": DRAFT,
                                                                 "weights_gib": 1}),
     "speculative.mtp_head is for method mtp"),
    (recipe_data(model={"repo": "o/m", "revision": MAIN, "weights_gib": 1, "gdn": True},
                 extra_args=["--enable-torch-compile"]),
     "--enable-torch-compile crashes on GDN models"),
    (recipe_data(extra_args=["--mamba-cache-strategy=extra_buffer"]),
     "extra_buffer mamba radix-cache strategy took decode from 62 to 30 tok/s"),
    (recipe_data(speculative={"method": "draft_model", "num_speculative_tokens": 5}),
     "draft_model needs a draft model"),
    (recipe_data(kv_cache_dtype="turboquant_3bit_nc"), "kv_cache_dtype 'turboquant_3bit_nc'"),
    (recipe_data(gpu_memory_utilization=None), "vllm needs gpu_memory_utilization"),
    (recipe_data(extra_args=["--port", "9"]), "extra_args: --port is set by rigbook"),
    (recipe_data(extra_args=["--api-key=x"]), "extra_args: --api-key is set by rigbook"),
    (recipe_data(env={"HF_HUB_OFFLINE": "0"}), "env: HF_HUB_OFFLINE is set by rigbook"),
    (recipe_data(env={"A": "x\ny"}), "env.A: one line of text"),
    (recipe_data(engine="llama.cpp", gpu_memory_utilization=None),
     "llama.cpp needs model.file"),
    (recipe_data(engine="sglang", max_num_seqs=4), "max_num_seqs is a vLLM setting"),
    (recipe_data(chunked_prefill=False), "chunked_prefill false has no verified flag"),
    (recipe_data(tensor_parallel_size=4), "tensor_parallel_size 4 > fits.gpu_count 2"),
    (recipe_data(bind="everywhere"), "bind: an IP address"),
    (recipe_data(cpu_only=True), "cpu_only recipes are llama.cpp recipes"),
    # tool parsers: each engine's own names, nothing else (a name of another engine, a flag)
    (recipe_data(tool_parser="qwen25"), "tool_parser 'qwen25' is not a vllm tool-call parser"),
    (recipe_data(engine="sglang", model={"repo": "o/m", "revision": MAIN, "weights_gib": 1},
                 tool_parser="llama3_json"), "tool_parser 'llama3_json' is not a sglang"),
    (recipe_data(tool_parser="--hermes"), "tool_parser: one word"),
    (recipe_data(tool_parser="hermes --api-key x"), "tool_parser: "),
    (recipe_data(extra_args=["--tool-call-parser", "hermes"]),
     "extra_args: --tool-call-parser is set by rigbook"),
    (recipe_data(extra_args=["--enable_auto_tool_choice"]),
     "reads it as --enable-auto-tool-choice"),
    (recipe_data(extra_args=["--tool-call=hermes"]), "reads it as --tool-call-parser"),
    # reasoning parsers: each engine's own names (SGLang spells DeepSeek-R1's with a dash)
    (recipe_data(reasoning_parser="deepseek-r1"),
     "reasoning_parser 'deepseek-r1' is not a vllm reasoning parser"),
    (recipe_data(engine="llama.cpp", gpu_memory_utilization=None,
                 model={"repo": "o/m", "revision": MAIN, "weights_gib": 1, "file": "m.gguf"},
                 reasoning_parser="qwen3"), "allowed: none (llama.cpp has no parser)"),
    (recipe_data(extra_args=["--reasoning-parser", "qwen3"]),
     "extra_args: --reasoning-parser is set by rigbook"),
    (recipe_data(extra_args=["--reasoning_parser=qwen3"]), "reads it as --reasoning-parser"),
    # the acceptance floor: no more than a verification pass can yield
    (recipe_data(speculative={"method": "mtp", "num_speculative_tokens": 2,
                              "mtp_head": "unquantised", "min_acceptance_length": 3.5}),
     "min_acceptance_length 3.5: a pass yields at most 1 + num_speculative_tokens = 3 tokens"),
    (recipe_data(speculative={"method": "mtp", "num_speculative_tokens": 2,
                              "mtp_head": "unquantised", "min_acceptance_length": 0.5}),
     "min_acceptance_length"),
])
def test_bad_recipes_are_refused_with_the_field(tmp_path: Path, data, expected):
    path = tmp_path / "x.toml"
    path.write_text(_toml(data))
    with pytest.raises(RigbookError) as error:
        load_recipe(path)
    assert expected in str(error.value) and str(path) in str(error.value)


def test_mtp_follows_the_head_not_the_topology():
    """The hardware notes' PCIe-only dual 20 GB pair ran MTP K=3; the failure log's MTP failed
    for its quantised head (docs/sources.md, MTP). No NVLink requirement, a quantised head
    refused."""
    ok = Recipe.model_validate(recipe_data(
        tensor_parallel_size=2, fits={"gpu_class": ["rtx3090"], "gpu_count": 2,
                                      "nvlink": "forbidden", "platforms": ["debian"]},
        speculative={"method": "mtp", "num_speculative_tokens": 3, "mtp_head": "unquantised"},
    ))
    assert ok.speculative.mtp_head == "unquantised"
    argv = engine_argv(ok, Rig(platform="debian", gpu_class="rtx3090", gpu_count=2,
                               venvs=[{"name": "v", "engine": "vllm", "packages": ["vllm==1"]}]))
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {"num_speculative_tokens": 3, "method": "mtp"}  # mtp_head is not a flag


def test_mtp_head_is_read_from_the_checkpoint_index():
    from rigbook.roles.recipes import mtp_head_of_index

    half = {"weight_map": {
        "model.layers.0.mlp.down_proj.weight_packed": "a.safetensors",
        "mtp.layers.0.mlp.down_proj.weight_packed": "b.safetensors",
        "mtp.fc.weight": "b.safetensors",
    }}
    assert mtp_head_of_index(half) == "quantised"
    bf16 = {"weight_map": {"model.layers.0.mlp.down_proj.weight_packed": "a.safetensors",
                           "mtp.layers.0.mlp.down_proj.weight": "b.safetensors"}}
    assert mtp_head_of_index(bf16) == "unquantised"
    assert mtp_head_of_index({"weight_map": {"model.embed_tokens.weight": "a"}}) is None
    assert mtp_head_of_index({}) is None


def gdn_recipe(**changes) -> Recipe:
    data = recipe_data(model={"repo": "o/m", "revision": MAIN, "weights_gib": 1, "gdn": True})
    data.update(changes)
    return Recipe.model_validate(data)


def gdn_rig(gpu_class="rtx3090", packages=("vllm==0.33.0", "torch==2.14.0")) -> Rig:
    return Rig(platform="debian", gpu_class=gpu_class, gpu_count=2,
               venvs=[{"name": "v", "engine": "vllm", "packages": list(packages)}])


def test_gdn_models_need_a_cuda_13_0_venv(monkeypatch):
    from rigbook.roles import recipes

    assert recipes.venv_cuda(("vllm==0.33.0", "torch==2.14.0")) == "13.0"
    assert fit_problems(gdn_recipe(), gdn_rig()) == []
    monkeypatch.setitem(engine_pins(), "future", {
        "venv": "f", "packages": ["vllm==9.9", "torch==9.9"], "cuda": "13.2"})
    problems = fit_problems(gdn_recipe(), gdn_rig(packages=("vllm==9.9", "torch==9.9")))
    assert problems == [
        "venv v resolves to CUDA 13.2; GDN kernels need CUDA 13.0 exactly (12.8 hangs on load, "
        "13.3 fails to build: the failure log; docs/sources.md, GDN models)"
    ]
    # Unknown pins: the serving preflight reads the built venv's CUDA instead.
    assert fit_problems(gdn_recipe(), gdn_rig(packages=("vllm==1.0",))) == []


def test_a_rig_can_lower_context_and_memory_share_for_a_display():
    """Hardware notes: a 4090 driving a display has ~23.5 GB usable and needed
    MAX_MODEL_LEN=90000; the same overrides apply for other GPU consumers (docs/sources.md,
    VRAM margins)."""
    from rigbook.roles.recipes import vram_need_gib

    recipe = catalogue()["single-24g-long"]
    rig = pinned_rig(recipe, serving_max_model_len=90000, serving_gpu_memory_utilization=0.9)
    argv = engine_argv(recipe, rig)
    assert argv[argv.index("--max-model-len") + 1] == "90000"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    assert fit_problems(recipe, rig) == []
    # KV scales with the context: 9 GiB at 131072 -> 9 x 90000 / 131072.
    assert vram_need_gib(recipe, rig) == pytest.approx(7.5 + 9 * 90000 / 131072 + 1.5)
    assert vram_need_gib(recipe) == 18
    higher = pinned_rig(recipe, serving_max_model_len=262144)
    assert fit_problems(recipe, higher) == [
        "serving_max_model_len 262144 is above the recipe's 131072: it can only lower it (the "
        "recipe's memory estimate is for its own context)"
    ]
    llama = catalogue()["llamacpp-single"]
    share = pinned_rig(llama, serving_gpu_memory_utilization=0.8)
    assert fit_problems(llama, share) == [
        "serving_gpu_memory_utilization: llama.cpp has no such setting"
    ]
    short = pinned_rig(llama, serving_max_model_len=8192)
    argv = engine_argv(llama, short)
    assert argv[argv.index("--n_ctx") + 1] == "8192"


def test_a_share_that_eats_the_per_card_margin_is_refused():
    """The runbook keeps 1 GiB per card that is never handed to a model."""
    recipe = catalogue()["single-24g-long"]
    greedy = pinned_rig(recipe, serving_gpu_memory_utilization=0.98)
    assert fit_problems(recipe, greedy) == [
        "gpu_memory_utilization 0.98 of a 24 GiB rtx4090 leaves 0.48 GiB; 1 GiB per card is kept "
        "for the driver and display (docs/sources.md, VRAM margins)"
    ]
    assert fit_problems(recipe, pinned_rig(recipe, serving_gpu_memory_utilization=0.95)) == []


def test_a_recipe_is_named_after_its_file(tmp_path: Path):
    path = tmp_path / "other.toml"
    path.write_text(_toml(recipe_data()))
    with pytest.raises(RigbookError, match="must be the file's stem 'other'"):
        load_recipe(path)


def _toml(data: dict, prefix: str = "") -> str:
    """A tiny TOML writer for the test data (scalars, lists, one level of tables)."""
    lines, tables = [], []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in tables:
        lines.append(f"[{prefix}{key}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in value.items()]
    return "\n".join(lines) + "\n"


def test_fit_names_every_mismatch():
    recipe = catalogue()["dual-3090-tp2"]
    rig = Rig.model_validate({
        "platform": "wsl2", "gpu_class": "a6000", "gpu_count": 3, "nvlink": True,
        "power_profile": "stock",
        "venvs": [{"name": "vllm-0.33", "engine": "sglang", "packages": ["x==1.0"]}],
    })
    problems = fit_problems(recipe, rig)
    assert problems == [
        "platform is wsl2; the recipe fits ubuntu, debian",
        "venv vllm-0.33 is a sglang venv; the recipe is vllm",
        "gpu_class is a6000; the recipe fits rtx3090, rtx3090ti",
        "gpu_count is 3; the recipe needs 2",
        "the recipe is for rigs without NVLink (this rig has nvlink: true)",
    ]
    with pytest.raises(RigbookError) as error:
        recipe_for(rig.model_copy(update={"recipe": "dual-3090-tp2"}), "rig7")
    assert str(error.value).startswith("rig7: recipe dual-3090-tp2 does not fit this rig:\n")


def test_unknown_recipe_lists_the_catalogue():
    rig = example_rig(catalogue()["llamacpp-single"]).model_copy(update={"recipe": "nope"})
    with pytest.raises(RigbookError) as error:
        recipe_for(rig, "rig1")
    assert "rig1: recipe: unknown recipe 'nope'; allowed: " in str(error.value)
    assert "dual-3090-tp2" in str(error.value)


def test_test_recipes_load_from_their_own_folder_without_shadowing(tmp_path: Path):
    recipes = catalogue((TEST_RECIPES,))
    assert {"tiny-cpu-a", "tiny-cpu-b", "tiny-cpu-badflag", "tiny-cpu-huge"} <= set(recipes)
    assert recipes["tiny-cpu-a"].cpu_only
    shadow = tmp_path / "dual-3090-tp2.toml"
    shadow.write_text((RECIPES_DIR / "dual-3090-tp2.toml").read_text())
    with pytest.raises(RigbookError, match="a recipe named 'dual-3090-tp2' already exists"):
        catalogue((str(tmp_path),))


def test_recipes_docs_are_generated_from_the_catalogue():
    docs = (ROOT / "docs" / "recipes.md").read_text()
    assert docs == recipes_markdown(), "run `rigbook docs` to regenerate"


def test_figures_measured_on_another_engine_build_are_shown_as_the_sources():
    """Issue 36: qwen36-27b-dual-20g's 82.4 / 107.9 TPS were measured on vLLM nightly with the
    notes' patches (a patched source clone); rigbook installs the stock vLLM 0.33.0 wheel. The
    docs show them as the source's; a recipe measured on the build it installs shows its own."""
    import tomllib

    from rigbook.roles.recipes import figures_text, measured_on_its_build

    docs = (ROOT / "docs" / "recipes.md").read_text()
    for name in ("qwen36-27b-dual-20g", "qwen36-27b-5090", "qwen36-27b-llamacpp"):
        recipe = catalogue()[name]
        assert not measured_on_its_build(recipe), name
        text = figures_text(recipe)
        assert text.startswith(f"the source's: measured on {recipe.measured_on.build}; this "
                               "recipe installs `"), text
        assert f"| figures | {text} |" in docs
        assert "not this build's" in " ".join(recipe.description.split()), name
    assert "vLLM nightly with the notes' patches" in catalogue()[
        "qwen36-27b-dual-20g"].measured_on.build
    data = tomllib.loads((RECIPES_DIR / "qwen36-27b-dual-20g.toml").read_text())
    data["measured_on"]["build"] = "vllm==0.33.0"  # a source that measured rigbook's own pins
    same = Recipe.model_validate(data)
    assert measured_on_its_build(same)
    assert figures_text(same) == ("measured by its source on `vllm==0.33.0`, the build this "
                                  "recipe installs")
    del data["measured_on"]["build"]
    with pytest.raises(ValidationError, match="measured_on.build"):
        Recipe.model_validate(data)


def test_the_kv_offload_buffer_counts_against_host_ram_and_shm_size():
    """Runbook: /dev/shm "holds vllm_offload_<uuid>.mmap, 42,945,576,960 bytes (40.0 GiB) —
    vLLM's CPU KV-offload region, sized by --kv-offloading-size", on a host whose free -g read
    "182 total" and whose /dev/shm is "a 92 G tmpfs"."""
    from rigbook.roles.recipes import kv_offload_gib, shm_offload_problem

    args = ["--kv-offloading-backend", "native", "--kv-offloading-size", "40"]
    data = recipe_data(extra_args=args, estimate={"kv_gib": 1, "host_ram_gib": 24})
    with pytest.raises(ValidationError, match="estimate.host_ram_gib 24 is below the "
                                              "--kv-offloading-size 40 GiB buffer"):
        Recipe.model_validate(data)
    data["estimate"]["host_ram_gib"] = 64
    recipe = Recipe.model_validate(data)
    assert kv_offload_gib(recipe) == 40.0
    for spelling in (["--kv-offloading-size=40"], ["--kv_offloading_size", "40"]):
        assert kv_offload_gib(Recipe.model_validate({**data, "extra_args": spelling})) == 40.0
    assert 42_945_576_960 / 1024**3 == pytest.approx(40.0, abs=0.01)
    assert shm_offload_problem(recipe, "92G") is None
    problem = shm_offload_problem(recipe, "32G")
    assert problem.startswith("shm_size 32G (32.0 GiB) cannot hold the recipe's "
                              "--kv-offloading-size 40 GiB buffer")
    rig = Rig(platform="debian", gpu_class="rtx3090", gpu_count=2, shm_size="32G",
              venvs=[{"name": "v", "engine": "vllm", "packages": ["vllm==1.0"]}])
    assert problem in fit_problems(recipe, rig)
    # a percentage needs the host's RAM: the serving preflight has MemTotal
    assert shm_offload_problem(recipe, "50%") is None
    assert shm_offload_problem(recipe, "50%", 182 * 1024**3) is None  # 91 GiB
    assert shm_offload_problem(recipe, "20%", 182 * 1024**3).startswith("shm_size 20% (36.4 GiB)")
    assert shm_offload_problem(Recipe.model_validate(recipe_data()), "1G") is None  # no buffer


def test_weight_offload_and_a_small_chunk_for_one_long_sequence_are_said():
    """Runbook: "CPU STREAM read 64.6 GB/s ... against PCIe H2D 56.4" (1.15x): offload "cannot
    pay" below FreeToken's 2.0x. Failure log: a 2048 chunk "quadrupled prefill iterations on
    single-request 50-90K contexts"."""
    from rigbook.inventory import rig_warnings
    from rigbook.roles.recipes import recipe_warnings

    rig = Rig(platform="debian", gpu_class="rtx4090", gpu_count=2)
    (text,) = recipe_warnings(Recipe.model_validate(recipe_data(
        extra_args=["--cpu_offload_gb", "8"])), rig)
    assert text.startswith("extra_args --cpu-offload-gb: weights offloaded to host RAM")
    assert "1.15x PCIe" in text and "below 2x" in text
    assert round(64.6 / 56.4, 2) == 1.15
    one = recipe_data(max_num_seqs=1, max_num_batched_tokens=2048, max_model_len=65536)
    (text,) = recipe_warnings(Recipe.model_validate(one), rig)
    assert text.startswith("max_num_batched_tokens 2048 for one sequence of up to 65536 tokens")
    assert recipe_warnings(Recipe.model_validate({**one, "max_num_batched_tokens": 16384}),
                           rig) == []
    assert recipe_warnings(Recipe.model_validate({**one, "max_num_seqs": 8}), rig) == []
    shipped = catalogue()
    assert all(recipe_warnings(r, example_rig(r)) == [] for r in shipped.values())
    assert rig_warnings(example_rig(shipped["single-24g-long"]), "r") == []


def test_an_sglang_gdn_checkpoint_with_half_quantised_linear_attention_is_refused():
    """Failure log: SGLang hung loading a checkpoint "half-quantized, with the MTP head and some
    linear-attention layers stored as plain `weight` rather than `weight_packed`"."""
    from rigbook.roles.recipes import gdn_index_problem, mixed_linear_attention
    from rigbook.roles.serving import reads_weight_index

    def index(plain_layers: range, layers: int = 4) -> str:
        names = {}
        for i in range(layers):
            kind = "weight" if i in plain_layers else "weight_packed"
            names[f"model.layers.{i}.linear_attn.in_proj_qkvz.{kind}"] = "a"
            names[f"model.layers.{i}.linear_attn.out_proj.weight"] = "a"  # plain everywhere
            names[f"model.layers.{i}.linear_attn.norm.weight"] = "a"
        return json.dumps({"weight_map": names})

    model = {"repo": "o/m", "revision": MAIN, "weights_gib": 1, "gdn": True}
    sglang = Recipe.model_validate(recipe_data(engine="sglang", model=model))
    problem = gdn_index_problem(sglang, index(range(2, 4)))
    assert problem.startswith("model.safetensors.index.json stores linear_attn.in_proj_qkvz as "
                              "weight_packed in some layers and as plain weight in others")
    assert gdn_index_problem(sglang, index(range(0))) is None  # quantised the same everywhere
    assert mixed_linear_attention(json.loads(index(range(4)))) == []  # plain everywhere
    vllm = Recipe.model_validate(recipe_data(model=model))
    assert gdn_index_problem(vllm, index(range(2, 4))) is None  # the hang was SGLang's
    assert gdn_index_problem(sglang, "not json") is None
    assert reads_weight_index(sglang) and not reads_weight_index(vllm)


def test_reasoning_parser_renders_each_engines_flag():
    """vLLM's and SGLang's --reasoning-parser (docs/sources.md, Reasoning parsers); none: no
    flag. The extra_args that follow stay last."""
    vllm = catalogue()["single-24g-long"]
    sglang = Recipe.model_validate(recipe_data(engine="sglang"))
    for recipe, parser in ((vllm, "qwen3"), (sglang, "deepseek-r1")):
        plain = engine_argv(recipe, pinned_rig(recipe))
        assert "--reasoning-parser" not in plain
        argv = engine_argv(recipe.model_copy(update={"reasoning_parser": parser}),
                           pinned_rig(recipe))
        at = len(plain) - len(recipe.extra_args)
        assert argv[at:at + 2] == ["--reasoning-parser", parser]
        assert argv[at + 2:] == list(recipe.extra_args)


def test_tool_parser_renders_each_engines_own_flags():
    """vLLM parses calls only with --enable-auto-tool-choice and a --tool-call-parser; SGLang
    takes --tool-call-parser; llama-cpp-python's --chat_format (docs/sources.md, Tool-call
    parsers). No tool_parser: no flag."""
    vllm = catalogue()["single-24g-long"]
    sglang = Recipe.model_validate(recipe_data(engine="sglang"))
    llama = catalogue()["llamacpp-single"]
    cases = [(vllm, "hermes", ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
             (sglang, "qwen25", ["--tool-call-parser", "qwen25"]),
             (llama, "chatml-function-calling", ["--chat_format", "chatml-function-calling"])]
    for recipe, parser, flags in cases:
        plain = engine_argv(recipe, pinned_rig(recipe))
        assert not {"--tool-call-parser", "--chat_format"} & set(plain), recipe.name
        with_tools = recipe.model_copy(update={"tool_parser": parser})
        argv = engine_argv(with_tools, pinned_rig(recipe))
        assert argv[len(plain) - len(recipe.extra_args):][:len(flags)] == flags, argv
