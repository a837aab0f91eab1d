"""Serving: unit and env rendering, the plan's checks, preflights, and the operation's decisions."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from pyinfra.api import FunctionCommand

from rigbook.core.errors import RigbookError
from rigbook.core.spec import Rig
from rigbook.core.units import start_shell
from rigbook.rigside.gpus import Gpu, GpuProbe
from rigbook.roles.guards import GpuLost, Topology, parse_topo_matrix
from rigbook.roles.models import parse_cache
from rigbook.roles.power import UNIT_PATH as POWER_UNIT
from rigbook.roles.recipes import vram_need_gib
from rigbook.roles.serving import (
    CAP_CHECK_PATH,
    CAP_CHECK_SOURCE,
    ENV_PATH,
    HEALTH_PATH,
    HEALTH_SOURCE,
    HOLD_PATH,
    KEY_PATH,
    PROBE_SOURCE,
    SUPERVISE_CONF,
    SUPERVISE_PATH,
    UNIT_NAME,
    UNIT_PATH,
    VENV_CHECK_PATH,
    VENV_CHECK_SOURCE,
    ServeProbe,
    ServeState,
    _await_health,
    parse_probe,
    preflight,
    probe_args,
    render_env,
    render_unit,
    serve_plan,
    serve_recipe,
    systemd_word,
)
from rigbook.roles.venvs import VenvLayout, VenvState
from tests.conftest import ROOT
from tests.opkit import FakeHost, describe, execute, file_states, local_fact, run_op
from tests.tinymodel import N_LAYER, cache_layout, revision_of, vocabulary, write_tiny_gguf

TEST_RECIPES = str(ROOT / "tests" / "recipes")
REV, DRAFT = "c" * 40, "d" * 40
SMI = "/usr/bin/nvidia-smi"
GIB_MIB = 1024
LAUNCHER = {"CUDA_HOME": "/opt/rigbook/venvs/vllm-0.33/lib/python3.12/site-packages/nvidia/cu13",
            "PATH": "/opt/rigbook/venvs/vllm-0.33/bin:/usr/bin:/bin",
            "VIRTUAL_ENV": "/opt/rigbook/venvs/vllm-0.33"}


def dual_rig(**data) -> Rig:
    """A dual-3090 rig with the dual-3090-draft recipe, its venv and its models pinned."""
    return Rig.model_validate({
        "platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2,
        "venvs": [{"name": "vllm-0.33", "engine": "vllm", "packages": ["vllm==0.33.0"]}],
        "models": [{"repo": "Qwen/Qwen3-32B-AWQ", "revision": REV},
                   {"repo": "Qwen/Qwen3-0.6B", "revision": DRAFT}],
        "recipe": "dual-3090-draft", **data,
    })


def cpu_rig(recipe: str = "tiny-cpu-a", **data) -> Rig:
    return Rig.model_validate({
        "platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2,
        "venvs": [{"name": "tiny-cpu", "engine": "llama-cpp-python", "python": "3.11",
                   "packages": ["llama-cpp-python[server]==0.3.36"]}],
        "models": [{"repo": "local/tiny", "revision": REV}],
        "serving_recipe_dirs": [TEST_RECIPES], "recipe": recipe, **data,
    })


def gpu(index: int, used_mib: int = 300, total_mib: int = 24576) -> Gpu:
    return Gpu(index=index, uuid=f"GPU-{index}", name="NVIDIA GeForce RTX 3090",
               bus_id=f"00000000:0{index + 1}:00.0", driver_version="580.95.05",
               memory_total_mib=total_mib, memory_used_mib=used_mib)


def state(**changes) -> ServeState:
    base = {
        "mem_total_kib": 64 * 1024**2, "mem_available_kib": 60 * 1024**2, "active": "inactive",
        "sub": "dead", "enabled": "", "files": {POWER_UNIT: "0" * 64}, "user": True, "entry": True,
        "smi": {"path": SMI, "rc": 0, "out": "GPU 0: ...\nGPU 1: ..."}, "apps": (),
    }
    base.update(changes)
    return ServeState(**base)


#: What a pull of the tiny GGUF recipe's repo asks for: its file (recipes.rig_models).
TINY = ("tiny.gguf",)


def cache_with(*specs: tuple[str, str, dict[str, int]], allow: tuple[str, ...] = ()) -> object:
    """A ModelCache state holding complete snapshots (with rigbook manifests), pulled with
    `allow` (a GGUF recipe's repo is pulled with its file's pattern: recipes.rig_models)."""
    repos = []
    for repo, revision, files in specs:
        manifest = {"files": {p: {"size": s, "sha256": None} for p, s in files.items()},
                    "allow_patterns": list(allow), "ignore_patterns": []}
        repos.append({"folder": "models--" + repo.replace("/", "--"), "bytes": sum(files.values()),
                      "refs": {}, "snapshots": {revision: files},
                      "manifests": {revision: manifest}, "incomplete": []})
    return parse_cache(json.dumps({"cache": "/var/lib/rigbook/hf/hub", "exists": True,
                                   "repos": repos}))


FULL_CACHE = cache_with(("Qwen/Qwen3-32B-AWQ", REV, {"model.safetensors": 10}),
                        ("Qwen/Qwen3-0.6B", DRAFT, {"model.safetensors": 5}))
VENV_OK = VenvState("/opt/rigbook/venvs/vllm-0.33-abc-20261129T000000Z", False,
                    {"vllm-0.33-abc-20261129T000000Z": {"driver": "580.95.05",
                                                         "cuda_runtime": "13.0"}})
GPUS = GpuProbe(smi=SMI, gpus=(gpu(0), gpu(1)))


# --- rendering --------------------------------------------------------------------------------


def systemd_split(line: str) -> list[str]:
    """How systemd reads an ExecStart= line back into argv (quotes, \\-escapes, %%, $$)."""
    words, word, quoted, i = [], None, False, 0
    while i < len(line):
        c = line[i]
        if quoted:
            if c == "\\":
                word += line[i + 1]
                i += 1
            elif c == '"':
                quoted = False
            else:
                word += c
        elif c == '"':
            quoted, word = True, word or ""
        elif c == " ":
            if word is not None:
                words.append(word)
            word = None
        else:
            word = (word or "") + c
        i += 1
    if word is not None:
        words.append(word)
    return [w.replace("%%", "%").replace("$$", "$") for w in words]


def test_exec_start_reads_back_as_the_exact_argv():
    plan = serve_plan(dual_rig(), "rig1")
    unit = render_unit(plan, SMI)
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    assert systemd_split(line.removeprefix("ExecStart=")) == list(plan.argv)
    assert systemd_word("100%") == "100%%" and systemd_word("$HOME") == '"$$HOME"'


def test_unit_runs_unprivileged_with_graceful_stop_and_the_gpu_check():
    plan = serve_plan(dual_rig(), "rig1")
    unit = render_unit(plan, SMI).splitlines()
    for line in ("Type=exec", "User=rigbook-serve", "Group=rigbook-serve",
                 f"EnvironmentFile={ENV_PATH}", f"ExecStartPre={SMI} -L", "Restart=on-failure",
                 "KillSignal=SIGTERM", "TimeoutStopSec=120", "WantedBy=multi-user.target"):
        assert line in unit
    assert f"EnvironmentFile={KEY_PATH}" not in unit  # loopback without a key
    assert "--shutdown-timeout 30" in next(x for x in unit if x.startswith("ExecStart="))


def test_cpu_recipes_have_no_gpu_check_and_a_key_file_when_bound_wider(tmp_path: Path):
    key = tmp_path / "key"
    _write(key, "s3cret-key\n")
    plan = serve_plan(cpu_rig(serving_bind="0.0.0.0", serving_api_key_file=str(key)), "rig1")
    unit = render_unit(plan, SMI)
    pre = [line for line in unit.splitlines() if line.startswith("ExecStartPre=")]
    assert [line.split()[7] for line in pre] == [VENV_CHECK_PATH]  # the hold only: no GPU check
    assert SMI not in "".join(pre) and f"EnvironmentFile={KEY_PATH}" in unit
    assert "s3cret" not in unit and "s3cret" not in render_env(plan, None)
    assert "s3cret" not in " ".join(plan.argv) and repr(plan.key) == "Secret('***')"
    assert plan.key.data == b"API_KEY=s3cret-key\n"
    assert plan.url == "http://127.0.0.1:8100"


def test_env_file_layers_venv_recipe_platform_and_rigbook():
    plan = serve_plan(dual_rig(), "rig1")
    lines = render_env(plan, LAUNCHER).splitlines()
    body = [x for x in lines if not x.startswith("#")]
    assert body == [
        f'CUDA_HOME="{LAUNCHER["CUDA_HOME"]}"', f'PATH="{LAUNCHER["PATH"]}"',
        f'VIRTUAL_ENV="{LAUNCHER["VIRTUAL_ENV"]}"', 'NCCL_P2P_DISABLE="1"', 'HF_HUB_OFFLINE="1"',
        'HF_HUB_CACHE="/var/lib/rigbook/hf/hub"', 'RIGBOOK_RECIPE="dual-3090-draft"',
    ]
    wsl = Rig.model_validate({**dual_rig().model_dump(exclude_defaults=True),
                              "platform": "wsl2", "recipe": "wsl2-dual-3090-tp2"})
    assert 'PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False"' in render_env(
        serve_plan(wsl, "rig3"), LAUNCHER)


def test_a_rig_sets_an_engine_variable_without_a_copied_recipe():
    """Hardware notes: PYTORCH_CUDA_ALLOC_CONF "as a ${...} override knob ... No edits to
    tracked files needed": serving_env overrides the recipe's and the platform's on one rig,
    escaped like every env-file value."""
    rig = dual_rig(serving_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
                                "NCCL_P2P_DISABLE": "0", "ODD": 'a"$b\\c'})
    body = [x for x in render_env(serve_plan(rig, "rig1"), LAUNCHER).splitlines()
            if not x.startswith("#")]
    assert 'PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False"' in body
    assert 'NCCL_P2P_DISABLE="0"' in body and 'NCCL_P2P_DISABLE="1"' not in body
    assert 'ODD="a\\"\\$b\\\\c"' in body
    assert body[-3:] == ['HF_HUB_OFFLINE="1"', 'HF_HUB_CACHE="/var/lib/rigbook/hf/hub"',
                         'RIGBOOK_RECIPE="dual-3090-draft"']  # rigbook's own still win


@pytest.mark.parametrize("env, refused", [
    ({"LD_PRELOAD": "/var/lib/rigbook-serve/x.so"}, "LD_PRELOAD is read by the dynamic loader"),
    ({"GLIBC_TUNABLES": "glibc.malloc.check=3"}, "GLIBC_TUNABLES is read by the dynamic loader"),
    ({"HF_HUB_OFFLINE": "0"}, "HF_HUB_OFFLINE is set by rigbook"),
    ({"CUDA_VISIBLE_DEVICES": "1"}, "CUDA_VISIBLE_DEVICES is set by rigbook"),
    ({"lower": "1"}, "'lower' is not an environment variable name"),
    ({"A B": "1"}, "'A B' is not an environment variable name"),
    ({"A\nB": "1"}, "is not an environment variable name"),
    ({"OK": "x\nExecStartPre=/bin/sh"}, "serving_env.OK: one line of text"),
    ({"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz012345"}, "HF_TOKEN reads as a secret"),
])
def test_serving_env_refuses_what_a_recipe_env_may_not_set(env, refused):
    from rigbook.core.spec import parse_rig

    data = {**dual_rig().model_dump(exclude_defaults=True), "serving_env": env}
    with pytest.raises(RigbookError, match=re.escape(refused)) as error:
        parse_rig("rig1", data)
    assert "hf_abcdef" not in str(error.value)  # a secret is never shown back


# --- the plan's checks --------------------------------------------------------------------------


def test_a_wide_bind_needs_a_key_at_load_time():
    with pytest.raises(ValueError, match="serving_bind 0.0.0.0 is wider than loopback"):
        cpu_rig(serving_bind="0.0.0.0")
    with pytest.raises(ValueError, match="an IP address, e.g. 127.0.0.1"):
        cpu_rig(serving_bind="lan")


@pytest.mark.parametrize(("rig", "expected"), [
    (lambda tmp: cpu_rig(serving_api_key_file=str(tmp / "missing")),
     "rig1: serving_api_key_file: cannot read"),
    (lambda tmp: cpu_rig(serving_api_key_file=str(_write(tmp / "two", "a b"))),
     "must hold one key"),
    (lambda tmp: dual_rig(models=[]),
     "rig1: recipe dual-3090-draft: models: the recipe pins no real commit"),
    (lambda tmp: cpu_rig(recipe="nope"), "rig1: recipe: unknown recipe 'nope'"),
    (lambda tmp: dual_rig(venvs=[]), "venv 'vllm-0.33' is not in the rig's venvs"),
])
def test_bad_serving_input_names_rig_and_field(tmp_path: Path, rig, expected):
    with pytest.raises(RigbookError) as error:
        serve_plan(rig(tmp_path), "rig1")
    assert expected in str(error.value)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


# --- preflight ----------------------------------------------------------------------------------


def test_preflight_passes_when_everything_fits():
    plan = serve_plan(dual_rig(), "rig1")
    assert preflight(plan, state(), GPUS, FULL_CACHE, VENV_OK) == []


def test_a_gpu_engine_is_refused_without_the_power_unit():
    """Without the boot caps the engine would start uncapped: refused before any change."""
    plan = serve_plan(dual_rig(), "rig1")
    problems = preflight(plan, state(files={}), GPUS, FULL_CACHE, VENV_OK)
    assert problems == [f"power caps: no {POWER_UNIT}: the engine would start uncapped; "
                        "run deploys/power_cap.py (or deploys/rig.py) first"]


def test_a_gone_card_is_never_restarted():
    plan = serve_plan(dual_rig(), "rig1")
    gone = state(smi={"path": SMI, "rc": 6, "out": "No devices were found"})
    problems = preflight(plan, gone, GPUS, FULL_CACHE, VENV_OK)
    assert problems == [
        f"gpus: {SMI} -L failed (exit 6: No devices were found): the card is gone or the driver "
        "is broken; a model is never (re)started then: reboot the rig and check the Xids"
    ]


def test_vram_held_by_others_is_refused_with_the_shortfall():
    plan = serve_plan(dual_rig(), "rig1")
    busy = GpuProbe(smi=SMI, gpus=(gpu(0, used_mib=4 * GIB_MIB), gpu(1)))
    problems = preflight(plan, state(), busy, FULL_CACHE, VENV_OK)
    # 0.95 x 24 GiB = 22.8 GiB claimed leaves 1.2 GiB; others hold 4.0 GiB: short by 2.8 GiB
    assert problems == [
        "VRAM: GPU 0 (NVIDIA GeForce RTX 3090): other processes hold 4.0 GiB; the engine claims "
        "22.8 GiB of 24.0 GiB, leaving 1.2 GiB: short by 2.8 GiB"
    ]


def test_memory_our_own_engine_holds_is_freed_by_the_switch():
    plan = serve_plan(dual_rig(), "rig1")
    busy = GpuProbe(smi=SMI, gpus=(gpu(0, used_mib=22 * GIB_MIB), gpu(1, used_mib=22 * GIB_MIB)))
    ours = state(active="active", unit_pids=(4242,),
                 apps=(("GPU-0", 4242, 22 * GIB_MIB - 300), ("GPU-1", 4242, 22 * GIB_MIB - 300)))
    assert preflight(plan, ours, busy, FULL_CACHE, VENV_OK) == []
    foreign = state(active="active", unit_pids=(4242,),
                    apps=(("GPU-0", 999, 22 * GIB_MIB - 300),))
    assert preflight(plan, foreign, busy, FULL_CACHE, VENV_OK)[0].startswith("VRAM: GPU 0")


def test_a_recipe_bigger_than_its_own_budget_is_refused():
    plan = serve_plan(dual_rig(), "rig1")
    small = GpuProbe(smi=SMI, gpus=(gpu(0, total_mib=16 * GIB_MIB), gpu(1, total_mib=16 * GIB_MIB)))
    need = vram_need_gib(plan.recipe)  # (19 + 1.5 + 11.5) / 2 + 1.5 = 17.5 GiB per card
    assert need == 17.5
    problems = preflight(plan, state(), small, FULL_CACHE, VENV_OK)
    assert problems[0] == (
        "VRAM: GPU 0 (NVIDIA GeForce RTX 3090): the recipe needs 17.5 GiB per card but claims "
        "only 0.95 x 16.0 GiB = 15.2 GiB: short by 2.3 GiB"
    )


def test_host_ram_counts_memavailable_and_what_our_engine_frees():
    plan = serve_plan(dual_rig(), "rig1")  # host_ram_gib 26
    low = state(mem_available_kib=20 * 1024**2)
    assert preflight(plan, low, GPUS, FULL_CACHE, VENV_OK) == [
        "host RAM: the recipe needs 26.0 GiB, 20.0 GiB is available (MemAvailable 20.0 GiB): "
        "short by 6.0 GiB"
    ]
    switching = state(mem_available_kib=20 * 1024**2, active="active", rss_kib=8 * 1024**2)
    assert preflight(plan, switching, GPUS, FULL_CACHE, VENV_OK) == []


def test_models_venv_and_other_engines_are_checked():
    plan = serve_plan(dual_rig(), "rig1")
    half = cache_with(("Qwen/Qwen3-32B-AWQ", REV, {"model.safetensors": 10}))
    stale = VenvState(VENV_OK.target, False, {"vllm-0.33-abc-20261129T000000Z": {
        "driver": "580.65.06", "cuda_runtime": "13.0"}})
    other = state(engines=((777, "python -m sglang.launch_server --model-path x"),))
    problems = preflight(plan, other, GPUS, half, stale)
    assert problems == [
        "model: Qwen/Qwen3-0.6B@dddddddddddd is not complete in /var/lib/rigbook/hf/hub: not in "
        "the cache /var/lib/rigbook/hf/hub; add it to the rig's models and run deploys/models.py",
        "venv: vllm-0.33 is not current for the driver: built for driver 580.65.06, running "
        "580.95.05: run deploys/venvs.py",
        "one engine: another engine runs outside rigbook-serve.service: pid 777 `python -m "
        "sglang.launch_server --model-path x`; stop it first (never two big models at once)",
    ]


def test_the_per_card_margin_is_never_claimed_and_overrides_reach_the_preflight():
    """Runbook: margin_mib = 1024 "is never handed to a model" (docs/sources.md, VRAM margins)."""
    from dataclasses import replace

    plan = serve_plan(dual_rig(), "rig1")
    with pytest.raises(RigbookError, match="1 GiB per card is kept for the driver and display"):
        serve_plan(dual_rig(serving_gpu_memory_utilization=0.97), "rig1")  # caught at fit time
    # A card the fit check cannot size (the rig as the preflight sees it) is caught there.
    plan = replace(plan, rig=plan.rig.model_copy(update={"serving_gpu_memory_utilization": 0.97}))
    problems = preflight(plan, state(), GPUS, FULL_CACHE, VENV_OK)
    assert problems == [
        f"VRAM: GPU {i} (NVIDIA GeForce RTX 3090): the engine would claim 0.97 x 24.0 GiB = "
        "23.3 GiB, leaving 0.7 GiB; 1.0 GiB per card is kept for the driver and display "
        "(docs/sources.md, VRAM margins): lower serving_gpu_memory_utilization"
        for i in (0, 1)
    ]
    lower = serve_plan(dual_rig(serving_gpu_memory_utilization=0.9), "rig1")
    assert "0.9" in lower.argv
    assert preflight(lower, state(), GPUS, FULL_CACHE, VENV_OK) == []


def test_the_served_checkpoints_index_overrules_an_unquantised_mtp_declaration():
    """The failure log read the MTP head's storage from model.safetensors.index.json
    (docs/sources.md, MTP): the preflight reads it from the snapshot and refuses weight_packed."""
    from dataclasses import replace

    from rigbook.roles.recipes import Speculative

    plan = serve_plan(dual_rig(), "rig1")
    spec = Speculative(method="mtp", num_speculative_tokens=3, mtp_head="unquantised")
    mtp = replace(plan, recipe=plan.recipe.model_copy(update={"speculative": spec, "draft": None}),
                  pins=plan.pins[:1])
    packed = json.dumps({"weight_map": {"mtp.layers.0.mlp.up_proj.weight_packed": "b"}})
    plain = json.dumps({"weight_map": {"mtp.layers.0.mlp.up_proj.weight": "b"}})
    none = json.dumps({"weight_map": {"model.layers.0.mlp.up_proj.weight": "a"}})
    problems = preflight(mtp, state(), GPUS, FULL_CACHE, VENV_OK, None, packed)
    assert problems == [
        "model: model.safetensors.index.json stores the MTP head as weight_packed (quantised), "
        "though the recipe declares it unquantised: a quantised head accepted only 1.07-1.27 "
        "tokens in the failure log (docs/sources.md, MTP); use a checkpoint with a BF16 head or "
        "a draft model"
    ]
    assert preflight(mtp, state(), GPUS, FULL_CACHE, VENV_OK, None, plain) == []
    assert preflight(mtp, state(), GPUS, FULL_CACHE, VENV_OK, None, None) == []  # no index
    assert "lists no MTP tensors" in preflight(mtp, state(), GPUS, FULL_CACHE, VENV_OK, None,
                                               none)[0]
    assert preflight(plan, state(), GPUS, FULL_CACHE, VENV_OK, None, packed) == []  # no MTP


def test_a_gdn_model_needs_a_venv_built_on_cuda_13_0_exactly():
    """The failure log: GDN kernels build only on CUDA 13.0 (docs/sources.md, GDN models)."""
    from dataclasses import replace

    plan = serve_plan(dual_rig(), "rig1")
    model = plan.recipe.model.model_copy(update={"gdn": True})
    gdn = replace(plan, recipe=plan.recipe.model_copy(update={"model": model}))
    assert preflight(gdn, state(), GPUS, FULL_CACHE, VENV_OK) == []
    for runtime in ("13.2", "12.8"):
        newer = VenvState(VENV_OK.target, False, {"vllm-0.33-abc-20261129T000000Z": {
            "driver": "580.95.05", "cuda_runtime": runtime}})
        refusal = (
            f"venv: vllm-0.33 carries the CUDA {runtime} runtime; the recipe's GDN model needs "
            "CUDA 13.0 exactly (12.8 hangs on load, 13.3 fails to build: the failure log; "
            "docs/sources.md, GDN models)"
        )
        assert refusal in preflight(gdn, state(), GPUS, FULL_CACHE, newer)
        assert refusal not in preflight(plan, state(), GPUS, FULL_CACHE, newer)  # not GDN


def test_cpu_recipes_skip_the_gpu_checks_and_need_the_gguf_file():
    plan = serve_plan(cpu_rig(), "rig1")
    no_gguf = cache_with(("local/tiny", REV, {"other.gguf": 10}), allow=TINY)
    tiny_venv = VenvState("/opt/rigbook/venvs/tiny-cpu-x-20261129T000000Z", False,
                          {"tiny-cpu-x-20261129T000000Z": {"driver": None}})
    problems = preflight(plan, state(smi=None), None, no_gguf, tiny_venv)
    assert problems == [f"model: local/tiny@{REV[:12]} has no tiny.gguf"]
    huge = serve_plan(cpu_rig(recipe="tiny-cpu-huge"), "rig1")
    ok = cache_with(("local/tiny", REV, {"tiny.gguf": 10}), allow=TINY)
    assert preflight(huge, state(smi=None), None, ok, tiny_venv) == [
        "host RAM: the recipe needs 4096.0 GiB, 60.0 GiB is available (MemAvailable 60.0 GiB): "
        "short by 4036.0 GiB"
    ]


# --- the probe ----------------------------------------------------------------------------------


def test_the_probe_runs_on_a_real_host_and_parses():
    plan = serve_plan(cpu_rig(), "rig1")
    probe = local_fact(ServeProbe, args=probe_args(plan))
    assert probe.mem_total_kib > probe.mem_available_kib > 0
    assert set(probe.files) == {UNIT_PATH, ENV_PATH, KEY_PATH, HEALTH_PATH, CAP_CHECK_PATH,
                                VENV_CHECK_PATH, POWER_UNIT, SUPERVISE_PATH, SUPERVISE_CONF,
                                HOLD_PATH}
    assert not probe.running and probe.unit_pids == ()
    assert not any("PROBE" in cmd or "hashlib" in cmd for _, cmd in probe.engines)
    assert "llama_cpp.server" not in PROBE_SOURCE.read_text()  # it never matches itself


def test_parse_probe_reads_compute_apps():
    text = json.dumps({
        "MemTotal": 100, "MemAvailable": 50, "unit": {"ActiveState": "active"}, "files": {},
        "user": True, "entry": True, "unit_pids": [5], "rss_kib": 7, "engines": [],
        "apps": [["GPU-0", "5", "20000"], ["GPU-1", "6", "[N/A]"]], "smi": None,
    })
    probe = parse_probe(text)
    assert probe.apps == (("GPU-0", 5, 20000), ("GPU-1", 6, None)) and probe.running


# --- the operation --------------------------------------------------------------------------------


def sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def deployed(plan, launcher=LAUNCHER) -> dict:
    """The files a rig has after `plan` was deployed (path -> sha256)."""
    return {
        UNIT_PATH: sha256(render_unit(plan, SMI)), ENV_PATH: sha256(render_env(plan, launcher)),
        KEY_PATH: plan.key.sha256 if plan.key else None,
        HEALTH_PATH: sha256(HEALTH_SOURCE.read_bytes()),
        CAP_CHECK_PATH: sha256(CAP_CHECK_SOURCE.read_bytes()),
        VENV_CHECK_PATH: sha256(VENV_CHECK_SOURCE.read_bytes()), POWER_UNIT: "0" * 64,
    }


DIRS = ("/etc/rigbook/serving", "/opt/rigbook/serving", "/etc/systemd/system")


def op_facts(probe: ServeState, gpus=GPUS, cache=FULL_CACHE, venv=VENV_OK, dirs=DIRS,
             lost=None) -> dict:
    return {
        "ServeProbe": probe, "NvidiaGpus": gpus, "ModelCache": cache, "VenvBuilds": venv,
        "GpuLostMark": lost, "GpuTopology": Topology(error="not read"),
        "VenvLayoutFact": VenvLayout(LAUNCHER["VIRTUAL_ENV"], "x", None, False, None),
        "FileStates": file_states({path: "old" for path, there in probe.files.items() if there},
                                  dirs={folder: 0o755 for folder in dirs}),
    }


def launcher_of(layout: VenvLayout) -> dict:
    from rigbook.roles.venvs import venv_environment

    return venv_environment(layout)


def test_nothing_differs_and_it_answers_so_nothing_changes():
    plan = serve_plan(dual_rig(), "rig1")
    launcher = launcher_of(VenvLayout(LAUNCHER["VIRTUAL_ENV"], "x", None, False, None))
    probe = state(active="active", enabled="enabled", files=deployed(plan, launcher),
                  answer={"ok": True, "model": "Qwen/Qwen3-32B-AWQ"})
    commands, host = run_op(serve_recipe, op_facts(probe), plan=plan)
    assert commands == []
    assert host.noops == [
        f"{UNIT_NAME} already runs dual-3090-draft (vllm, Qwen/Qwen3-32B-AWQ) and answers "
        "(model Qwen/Qwen3-32B-AWQ)"
    ]


def test_a_switch_stops_the_old_engine_first_and_checks_health_last():
    old = serve_plan(dual_rig(recipe="dual-3090-tp2"), "rig1")
    new = serve_plan(dual_rig(), "rig1")
    launcher = launcher_of(VenvLayout(LAUNCHER["VIRTUAL_ENV"], "x", None, False, None))
    probe = state(active="active", enabled="enabled", files=deployed(old, launcher))
    commands, _ = run_op(serve_recipe, op_facts(probe), plan=new)
    steps = [describe(c) for c in commands]
    assert steps[0] == f"systemctl stop {UNIT_NAME}"
    assert f"upload {ENV_PATH}" in steps and f"upload {UNIT_PATH}" in steps
    assert steps[-3:] == ["systemctl daemon-reload", start_shell(UNIT_NAME), "call _await_health"]
    assert start_shell(UNIT_NAME).startswith(f"( systemctl reset-failed {UNIT_NAME} 2>/dev/null; "
                                             f"systemctl start {UNIT_NAME} || ")
    assert HEALTH_PATH not in " ".join(steps)  # unchanged files are not rewritten


def test_a_failed_preflight_changes_nothing_and_the_old_engine_keeps_running():
    old = serve_plan(dual_rig(recipe="dual-3090-tp2"), "rig1")
    new = serve_plan(dual_rig(), "rig1")
    probe = state(active="active", enabled="enabled", files=deployed(old),
                  mem_available_kib=1024**2)
    commands, _ = run_op(serve_recipe, op_facts(probe), plan=new)
    assert [describe(c) for c in commands] == ["call _log_refusal"]
    message = commands[0].args[0]
    assert message.startswith(
        f"rig1: {UNIT_NAME} (dual-3090-draft (vllm, Qwen/Qwen3-32B-AWQ)): preflight failed, "
        f"nothing was changed ({UNIT_NAME} keeps running):\n  - host RAM: the recipe needs 26.0 "
        "GiB, 1.0 GiB is available"
    )
    host = FakeHost({})
    assert execute(commands[0], host) is False and host.logged == [message]


def test_a_gone_card_fails_the_rig_even_when_nothing_changes():
    plan = serve_plan(dual_rig(), "rig1")
    probe = state(active="active", enabled="enabled", files=deployed(plan),
                  smi={"path": SMI, "rc": 15, "out": "Unable to determine the device handle"})
    commands, _ = run_op(serve_recipe, op_facts(probe), plan=plan)
    assert [describe(c) for c in commands] == ["call _log_refusal"]
    assert "GPU check failed, nothing was changed" in commands[0].args[0]


def test_a_new_health_script_alone_does_not_restart_the_engine():
    plan = serve_plan(dual_rig(), "rig1")
    launcher = launcher_of(VenvLayout(LAUNCHER["VIRTUAL_ENV"], "x", None, False, None))
    files = {**deployed(plan, launcher), HEALTH_PATH: "0" * 64}
    probe = state(active="active", enabled="enabled", files=files, answer={"ok": True,
                                                                             "model": "m"})
    commands, _ = run_op(serve_recipe, op_facts(probe), plan=plan)
    assert [describe(c) for c in commands] == [f"upload {HEALTH_PATH}", f"chmod 644 {HEALTH_PATH}"]


def test_the_key_goes_root_only_and_a_removed_key_is_deleted(tmp_path: Path):
    key = _write(tmp_path / "key", "k3y")
    plan = serve_plan(cpu_rig(serving_bind="0.0.0.0", serving_api_key_file=str(key)), "rig1")
    probe = state(smi=None, files={})
    cache = cache_with(("local/tiny", REV, {"tiny.gguf": 1}), allow=TINY)
    facts = op_facts(probe, gpus=None, cache=cache,
                     venv=VenvState("/x/tiny-cpu-b", False, {"tiny-cpu-b": {"driver": None}}),
                     dirs=())
    steps = [describe(c) for c in run_op(serve_recipe, facts, plan=plan)[0]]
    at = steps.index(f"upload {KEY_PATH}.new")
    assert steps[at - 1] == f"install -m 600 -o root -g root /dev/null {KEY_PATH}.new"
    assert steps[at + 1] == f"mv -f {KEY_PATH}.new {KEY_PATH}"
    assert steps.index(f"upload {ENV_PATH}") < at  # the env file makes the directory first
    loopback = serve_plan(cpu_rig(), "rig1")
    facts["ServeProbe"] = state(smi=None, files={KEY_PATH: "f" * 64})
    steps = [describe(c) for c in run_op(serve_recipe, facts, plan=loopback)[0]]
    assert f"rm -f {KEY_PATH}" in steps


def test_the_xid_watchs_gpu_lost_mark_blocks_any_restart():
    plan = serve_plan(dual_rig(), "rig1")
    mark = GpuLost("GPU lost: do not restart serving", (
        "2026-09-12T03:14:15+0000 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=0, "
        "name=, GPU has fallen off the bus.",))
    commands, _ = run_op(serve_recipe, op_facts(state(), lost=mark), plan=plan)
    assert [describe(c) for c in commands] == ["call _log_refusal"]
    assert "GPU check failed, nothing was changed: GPU lost: do not restart serving" in (
        commands[0].args[0])


def test_p2p_off_on_a_rig_that_shows_nvlink_is_refused():
    plan = serve_plan(dual_rig(), "rig1")  # NCCL_P2P_DISABLE=1, rig declares no NVLink
    matrix = parse_topo_matrix([
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID",
        "GPU0\t X \tNV4\t0-15\t0\t\tN/A",
        "GPU1\tNV4\t X \t0-15\t0\t\tN/A",
    ])
    problems = preflight(plan, state(), GPUS, FULL_CACHE, VENV_OK, Topology(SMI, matrix, {}))
    assert problems == [
        "topology: the recipe sets NCCL_P2P_DISABLE=1, but the rig has NVLink (GPU0-GPU1 NV4): "
        "it would turn P2P over the bridge off; choose a recipe for NVLink rigs"
    ]


def test_the_tiny_model_is_a_deterministic_llama_gguf(tmp_path: Path):
    one = write_tiny_gguf(tmp_path / "one.gguf")
    two = write_tiny_gguf(tmp_path / "two.gguf")
    assert one.read_bytes() == two.read_bytes() and len(revision_of(one)) == 40
    reader = gguf.GGUFReader(str(one))
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"
    tokens, _, _ = vocabulary()
    assert {"<0x0A>", "<s>", "</s>", "<unk>"} <= set(tokens)  # SPM byte fallback and newline
    names = {tensor.name for tensor in reader.tensors}
    assert {"token_embd.weight", "output.weight", f"blk.{N_LAYER - 1}.ffn_down.weight"} <= names
    layout = cache_layout(one, revision_of(one))
    assert layout["link"] == f"models--local--tiny/snapshots/{revision_of(one)}/tiny.gguf"


class ShellHost(FakeHost):
    """A FakeHost that answers shell commands from a table (command prefix -> stdout)."""

    def __init__(self, answers: dict[str, str]):
        super().__init__({})
        self.answers, self.ran = answers, []

    def run_shell_command(self, command, **_):
        text = command.get_raw_value()
        self.ran.append(text)
        out = next((v for k, v in self.answers.items() if text.startswith(k)), "")

        class Output:
            stdout, stderr = out, ""

        return True, Output()


def test_a_failed_health_check_shows_the_journal_and_stops_the_unit(tmp_path: Path):
    key = _write(tmp_path / "key", "k3y-secret")
    plan = serve_plan(cpu_rig(recipe="tiny-cpu-badflag", serving_bind="0.0.0.0",
                              serving_api_key_file=str(key)), "rig1")
    failed = {"ok": False, "stage": "engine", "message": "rigbook-serve.service is "
              "activating/auto-restart: the engine exited (status 2)"}
    host = ShellHost({
        "python3 /opt/rigbook/serving/health.py": json.dumps(failed),
        "journalctl": "python[9]: error: unrecognized arguments: --no_such_flag 1\n"
                      "python[9]: API_KEY=k3y-secret\n",
    })
    (health,) = [c for c in run_op(serve_recipe, op_facts(
        state(smi=None), gpus=None,
        cache=cache_with(("local/tiny", REV, {"tiny.gguf": 1}), allow=TINY),
        venv=VenvState("/x/tiny-cpu-b", False, {"tiny-cpu-b": {"driver": None}})),
        plan=plan)[0] if isinstance(c, FunctionCommand) and c.function.__name__ == "_await_health"]
    assert execute(health, host) is False
    assert host.ran == [
        "python3 /opt/rigbook/serving/health.py --url http://127.0.0.1:8102 --timeout 900 "
        f"--unit {UNIT_NAME} --key-file {KEY_PATH}",
        f"journalctl -u {UNIT_NAME} -n 40 --no-pager",
        f"systemctl stop {UNIT_NAME}",
    ]
    (message,) = host.logged
    assert message.startswith(
        "tiny-cpu-badflag (llama.cpp, local/tiny) did not come up healthy on "
        "http://127.0.0.1:8102 (engine: rigbook-serve.service is activating/auto-restart: the "
        "engine exited (status 2)). Last 40 journal lines of rigbook-serve.service:\n"
    )
    assert "unrecognized arguments: --no_such_flag 1" in message and "k3y-secret" not in message
    assert message.endswith("rigbook-serve.service is stopped: this rig serves nothing now.")
    assert "What it shows:" not in message  # no known signature in these lines


def test_a_failed_start_on_wsl2_says_a_tdr_reset_is_not_oom():
    """The hardware notes' TDR signature in the journal of a failed start on a WSL2 rig."""
    wsl = Rig.model_validate({**dual_rig().model_dump(exclude_defaults=True),
                              "platform": "wsl2", "recipe": "wsl2-dual-3090-tp2"})
    plan = serve_plan(wsl, "rig3")
    tdr = (ROOT / "tests/fixtures/real/journal/tdr-signature-club3090-50.txt").read_text()
    host = ShellHost({"python3 /opt/rigbook/serving/health.py": json.dumps(
        {"ok": False, "stage": "engine", "message": "the engine exited"}), "journalctl": tdr})
    assert _await_health(None, host, plan, {}) is False
    (message,) = host.logged
    assert "\nWhat it shows: Windows reset the GPU mid-kernel (TDR" in message


# --- caps that fail closed (rigbook/rigside/cap_check.py) -----------------------------------------

H200_CAPS = ROOT / "tests" / "fixtures" / "nvidia-h200" / "uuid-power-limit.csv"
H200_UUID = H200_CAPS.read_text().split(",")[0]


def cap_check(tmp_path: Path, unit_lines: list[str] | None, smi_rc: int = 0):
    """Run cap_check.py against a power unit of `unit_lines` and an nvidia-smi that prints the
    H200's real `--query-gpu=uuid,power.limit` answer (None: no unit file)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {H200_CAPS}\nexit {smi_rc}\n")
    smi.chmod(0o755)
    unit = tmp_path / "nvidia-power-limit.service"
    if unit_lines is not None:
        unit.write_text("[Service]\n" + "".join(
            f"ExecStart=-{smi} -i {uuid} -pl {watts}\n" for uuid, watts in unit_lines))
    return subprocess.run([sys.executable, str(CAP_CHECK_SOURCE), "--unit", str(unit)],
                          capture_output=True, text=True)


def test_the_cap_check_passes_when_every_live_cap_is_the_units(tmp_path):
    run = cap_check(tmp_path, [(H200_UUID, 700)])
    assert run.returncode == 0, run.stdout
    assert run.stdout == f"caps as the unit says: {H200_UUID} 700 W\n"


@pytest.mark.parametrize("lines, says", [
    ([(H200_UUID, 500)], f"{H200_UUID} runs at a 700 W cap, the unit says 500 W"),
    ([(H200_UUID, 700), ("GPU-00000000-1111-2222-3333-444444444444", 300)],
     "GPU-00000000-1111-2222-3333-444444444444 (capped at 300 W by the unit) is not listed: "
     "replaced or off the bus"),
    ([("GPU-00000000-1111-2222-3333-444444444444", 700)], f"{H200_UUID} is not capped by the unit"),
    ([], "caps no GPU"),
    (None, "cannot read"),
])
def test_the_cap_check_refuses_a_start_that_would_run_uncapped(tmp_path, lines, says):
    run = cap_check(tmp_path, lines)
    assert run.returncode == 1
    assert run.stdout.startswith("rigbook: not starting the engine uncapped: ")
    assert says in run.stdout


def test_the_cap_check_refuses_when_nvidia_smi_fails(tmp_path):
    run = cap_check(tmp_path, [(H200_UUID, 700)], smi_rc=15)
    assert run.returncode == 1 and "cannot list the caps" in run.stdout


def test_the_h200_capture_of_the_cap_check_is_what_the_program_prints():
    """The run on a real H200 (tests/fixtures/nvidia-h200/cap-check.txt), read only."""
    text = (ROOT / "tests" / "fixtures" / "nvidia-h200" / "cap-check.txt").read_text()
    uuid = re.search(r"caps as the unit says: (GPU-[0-9a-f-]+) 700 W\nexit 0", text)[1]
    assert f"{uuid} runs at a 700 W cap, the unit says 500 W" in text and "exit 1" in text


def test_a_gpu_unit_requires_the_caps_and_checks_them_a_cpu_one_does_not():
    gpu = render_unit(serve_plan(dual_rig(), "rig1"), SMI)
    assert "Requires=nvidia-power-limit.service\n" in gpu
    assert (f"ExecStartPre=!/usr/bin/env -i -C / /usr/bin/python3 -I -S {CAP_CHECK_PATH} "
            f"--unit {POWER_UNIT} --tolerance 0.5\n") in gpu
    assert "DeviceAllow=char-nvidia* rw\n" in gpu and "DevicePolicy=closed\n" in gpu
    wsl = Rig.model_validate({**dual_rig().model_dump(exclude_defaults=True),
                              "platform": "wsl2", "recipe": "wsl2-dual-3090-tp2"})
    windows_caps = render_unit(serve_plan(wsl, "rig3"), SMI)  # the Windows driver owns them
    assert "Requires=nvidia-power-limit" not in windows_caps and CAP_CHECK_PATH not in windows_caps


def test_a_cpu_only_unit_gets_no_gpu_device_and_its_engine_sees_no_gpu():
    """A cpu_only recipe has no cap check, no nvidia-smi -L and no Requires= of the power unit:
    it gets no GPU either (issue 29), whatever its engine is told."""
    plan = serve_plan(cpu_rig(), "rig1")
    unit = render_unit(plan, SMI)
    assert "DevicePolicy=closed\n" in unit
    service = [line for line in unit.split("[Service]")[1].splitlines()
               if not line.startswith("#")]
    assert not any("DeviceAllow" in line or "nvidia" in line for line in service), service
    assert dict(plan.env)["CUDA_VISIBLE_DEVICES"] == ""
    assert 'CUDA_VISIBLE_DEVICES=""\n' in render_env(plan, {"CUDA_VISIBLE_DEVICES": "0,1"})
    gpu = serve_plan(dual_rig(), "rig1")
    assert "CUDA_VISIBLE_DEVICES" not in dict(gpu.env)


def test_status_warns_when_a_speculating_recipe_accepts_too_little():
    from rigbook.core.checks import Facts
    from rigbook.roles.serving import speculation_findings

    rig = dual_rig()  # dual-3090-draft speculates with a draft model
    [finding] = speculation_findings(rig, Facts(acceptance=1.2), "rig1")
    assert (finding.level, finding.key) == ("warn", "recipe")
    assert finding.reason.startswith("recipe dual-3090-draft: the engine's mean acceptance "
                                     "length is 1.2 tokens per pass")
    assert speculation_findings(rig, Facts(acceptance=3.9), "rig1") == []
    assert speculation_findings(rig, Facts(acceptance=None), "rig1") == []  # none logged yet
