"""The venvs role without a rig: spec hash, driver table, staleness, launcher environment, the
build script run for real on this machine (uv from the dev extra, wheels made here), the
operations' decisions on fake facts, the tools venv, and the shipped engine pins resolved
against the default package index."""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand, StringCommand

from rigbook.core.errors import RigbookError
from rigbook.core.facts import _RC, _SMI
from rigbook.core.pins import engine_pins, engine_venv
from rigbook.core.progress import BuildProgress, WatchedBuild
from rigbook.core.render import render
from rigbook.core.spec import Rig, VenvSpec, parse_rig
from rigbook.core.tools import TOOLS_PINS, TOOLS_VENV, ToolsVersions, differing_pins, tools_packages
from rigbook.rigside.gpus import Gpu, GpuProbe
from rigbook.roles.cuda import DRIVER_FOR_CUDA, check_driver, required_driver, spec_cuda
from rigbook.roles.recipes import VENV_ENGINE
from rigbook.roles.venvs import (
    ENV_TEMPLATE,
    BuildPlan,
    LiveDriver,
    NvidiaSmiHeader,
    VenvBuilds,
    VenvLayout,
    VenvLayoutFact,
    VenvState,
    build_name,
    build_script,
    decide,
    incompatibility,
    install_args,
    is_build_of,
    parse_smi_header,
    parse_venv_builds,
    prune_selection,
    smoke_input,
    spec_hash,
    staleness,
    swap_commands,
    uv_environment,
    venv_build,
    venv_environment,
)
from tests.conftest import ROOT
from tests.opkit import execute, local_fact, run_op, shell
from tests.test_progress import FakeRig

H200 = ROOT / "tests" / "fixtures" / "nvidia-h200"
BASE = {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2}
DEMO = {"name": "demo", "engine": "none", "python": "3.11", "packages": ["six==1.16.0"]}
VLLM = {"name": "vllm", "engine": "vllm", "packages": ["vllm==0.33.0", "torch==2.14.0"]}


def rig(**data) -> Rig:
    return parse_rig("rig1", {**BASE, **data})


def spec(**data) -> VenvSpec:
    return VenvSpec.model_validate({**DEMO, **data})


# --- spec hash -------------------------------------------------------------------------------


def test_spec_hash_is_stable_and_covers_spec_and_source_only():
    r = rig(venvs=[DEMO])
    digest = spec_hash(spec(), r)
    # A literal: changing how the hash is made rebuilds every venv on every rig; do it on
    # purpose (bump RECIPE) and update this value.
    assert digest == "ed6da2262f1d"
    assert re.fullmatch(r"[0-9a-f]{12}", digest)
    assert spec_hash(spec(), rig(venvs=[DEMO], power_cap_watts=300, venvs_keep=3)) == digest
    assert spec_hash(spec(services=["demo.service"]), r) == digest
    assert spec_hash(spec(packages=["six==1.17.0"]), r) != digest
    assert spec_hash(spec(python="3.12"), r) != digest
    assert spec_hash(spec(), rig(python_find_links="/srv/wheels")) != digest
    no_index = rig(python_find_links="/srv/wheels", python_no_index=True)
    assert spec_hash(spec(), no_index) != spec_hash(spec(), rig(python_find_links="/srv/wheels"))


def test_build_names_belong_to_one_venv_only():
    build = build_name("vllm", "0123456789ab", "20261129T202754Z")
    assert build == "vllm-0123456789ab-20261129T202754Z"
    assert is_build_of("vllm", build)
    assert not is_build_of("vllm", "vllm-old-0123456789ab-20261129T202754Z")
    assert not is_build_of("vllm-old", build)
    assert not is_build_of("vllm", "vllm")
    assert not is_build_of("vllm", "vllm-0123456789ab-20261129T202754Z.partial")


def test_host_data_of_the_python_packages_section():
    with pytest.raises(RigbookError, match="python_no_index needs python_find_links"):
        rig(python_no_index=True)
    with pytest.raises(RigbookError, match="venvs names demo more than once"):
        rig(venvs=[DEMO, DEMO])
    with pytest.raises(RigbookError, match="not a systemd service name"):
        rig(venvs=[{**DEMO, "services": ["vllm; rm -rf /"]}])
    with pytest.raises(RigbookError, match="venvs_keep"):
        rig(venvs_keep=-1)
    assert rig().venvs_keep == 1 and rig().rebuild_all is False


def test_sandbox_rigs_install_from_the_wheelhouse_and_have_no_venvs_by_default(
    tmp_path, monkeypatch
):
    from rigbook.inventory import load_rigs
    from rigbook.sandbox import WHEELS_MOUNT

    monkeypatch.setenv("RIGBOOK_SANDBOX_DIR", str(tmp_path))  # three rigs, none of them up
    (tmp_path / "hosts.json").write_text(json.dumps([
        {"name": f"rig{i}", "address": f"10.231.{i}.2", "profile": profile, "ssh_key": "/k"}
        for i, profile in enumerate(("dual-3090", "single-4090", "wsl2-3090"), 1)
    ]))
    rigs = load_rigs(str(ROOT / "inventory" / "sandbox.py"))
    assert len(rigs) == 3
    for r in rigs.values():
        assert (r.python_find_links, r.python_no_index, r.venvs) == (WHEELS_MOUNT, True, ())


# --- driver and CUDA -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cuda", "driver"),
    [("13.0", "580.65.06"), ("13.1", "590.44.01"), ("13.2", "595.45.04"), ("13", "580.65.06"),
     ("13.0.96", "580.65.06"), ("13.2.1", "595.45.04")],
)
def test_required_driver_table(cuda, driver):
    assert required_driver(cuda) == driver


def test_required_driver_refuses_what_it_does_not_know():
    for cuda in ("12.8", "13.3", "cu130"):
        with pytest.raises(ValueError):
            required_driver(cuda)


@pytest.mark.parametrize(
    ("packages", "engine", "expected"),
    [
        (["vllm==0.33.0", "cuda-toolkit==13.2.*"], "vllm", ("13.2", "cuda-toolkit==13.2.*")),
        (["sglang==0.5.23", "nvidia-cuda-runtime==13.1.80"], "sglang",
         ("13.1", "nvidia-cuda-runtime==13.1.80")),
        (["torch==2.14.0+cu132"], "none", ("13.2", "torch==2.14.0+cu132")),
        (["Cuda_Toolkit[cublas]==13.0.*"], "none", ("13.0", "Cuda_Toolkit[cublas]==13.0.*")),
        (["Cuda__Toolkit==13.2.*"], "none", ("13.2", "Cuda__Toolkit==13.2.*")),
        (["NVIDIA.Cuda-Runtime_cu13==13.1.80"], "none",
         ("13.1", "NVIDIA.Cuda-Runtime_cu13==13.1.80")),
        (["vllm==0.33.0", "torch==2.14.0"], "vllm", ("13.0", "torch_backend cu130")),
        (["torch==2.14.0"], "none", ("13.0", "torch_backend cu130")),
        (["six==1.16.0"], "none", None),
    ],
)
def test_spec_cuda_from_pins_or_backend(packages, engine, expected):
    assert spec_cuda(spec(packages=packages, engine=engine)) == expected


def test_check_driver_refuses_a_cuda_the_driver_cannot_run():
    needs_132 = spec(packages=["vllm==0.33.0", "cuda-toolkit==13.2.*"], engine="vllm")
    with pytest.raises(RigbookError) as error:
        check_driver("rig1", needs_132, "580.95.05")
    assert str(error.value) == (
        "rig1: venvs[demo]: cuda-toolkit==13.2.* means CUDA 13.2, which needs driver >= "
        "595.45.04; this rig runs 580.95.05: the venv would fail with CUDA error 804. Bump the "
        "driver (deploys/driver.py) or pin an older CUDA; nothing was built"
    )
    check_driver("rig1", needs_132, "595.84")  # 595.84 > 595.45.04
    check_driver("rig1", needs_132, None)  # no GPU layer: nothing to check
    check_driver("rig1", spec(engine="vllm", packages=["vllm==0.33.0"]), "580.65.06")
    with pytest.raises(RigbookError, match="needs driver >= 580.65.06; this rig runs 575.64.03"):
        check_driver("rig1", spec(engine="vllm", packages=["vllm==0.33.0"]), "575.64.03")
    with pytest.raises(RigbookError, match="does not know the least driver for CUDA 13.9"):
        check_driver("rig1", spec(packages=["cuda-toolkit==13.9.*"]), "595.84")


# --- staleness on the H200 capture ------------------------------------------------------------


def h200_driver() -> tuple[str, str]:
    header = parse_smi_header((H200 / "nvidia-smi.txt").read_text())
    assert header == ("580.159.04", "13.0")
    return header


def h200_torch_cuda() -> str:
    """torch's CUDA runtime in the H200's torch venv: line 2 is `version cuda available name`."""
    return (H200 / "python-cuda.txt").read_text().splitlines()[1].split()[1]


def test_staleness_against_the_h200_driver():
    driver, _ = h200_driver()
    built_here = {"driver": "580.159.04", "cuda_runtime": h200_torch_cuda()}
    assert staleness(built_here, driver) is None
    assert incompatibility(built_here, driver) is None
    built_before = {"driver": "580.95.05", "cuda_runtime": "13.0"}
    assert staleness(built_before, driver) == "built for driver 580.95.05, running 580.159.04"
    assert staleness({"driver": None}, driver) == "built without a GPU driver, running 580.159.04"
    assert staleness(built_before, None) is None  # no driver now: nothing to compare
    assert staleness(None, driver) is None
    assert incompatibility({"driver": driver, "cuda_runtime": "13.2"}, driver) == (
        "its CUDA 13.2 runtime needs driver >= 595.45.04, running 580.159.04 (CUDA error 804)"
    )
    assert incompatibility({"driver": driver, "cuda_runtime": None}, driver) is None


def test_smi_header_fact_reads_the_driver_and_its_cuda():
    text = (H200 / "nvidia-smi.txt").read_text().splitlines()
    output = [f"{_SMI} /usr/local/nvidia/bin/nvidia-smi", *text, f"{_RC} 0"]
    assert NvidiaSmiHeader().process(output) == ("580.159.04", "13.0")
    failing = [f"{_SMI} /usr/bin/nvidia-smi",
               "Failed to initialize NVML: Driver/library version mismatch", f"{_RC} 18"]
    assert NvidiaSmiHeader().process(failing) is None
    assert NvidiaSmiHeader().process(["##RIGBOOK_NO_SMI##"]) is None


# --- launcher environment ---------------------------------------------------------------------


def h200_layout(path_nvcc: str | None = None, release: str | None = None) -> VenvLayout:
    """The H200's torch venv as VenvLayoutFact would see it, from python-cuda.txt."""
    lines = (H200 / "python-cuda.txt").read_text().splitlines()
    (nvidia,) = ast.literal_eval(lines[2])
    cu13 = next(ast.literal_eval(line.split(None, 1)[1]) for line in lines
                if line.strip().startswith("cu13 "))
    site = nvidia.removesuffix("/nvidia")
    return VenvLayout(
        site.split("/lib/python3")[0], site, tuple(cu13), "bin" in cu13, path_nvcc, release
    )


def test_venv_environment_on_the_h200_torch_venv_without_nvcc():
    layout = h200_layout()
    assert layout.venv == "/opt/torch/.venv"
    assert venv_environment(layout) == {
        "CUDA_HOME": "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13",
        "PATH": "/opt/torch/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "VIRTUAL_ENV": "/opt/torch/.venv",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }


def test_venv_environment_with_nvcc_on_path_or_in_cuda_home():
    on_path = venv_environment(h200_layout(path_nvcc="/usr/local/cuda/bin/nvcc", release="13.0"))
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in on_path
    assert on_path["CUDA_HOME"].endswith("/site-packages/nvidia/cu13")
    cu13 = "/opt/rigbook/venvs/vllm/lib/python3.12/site-packages/nvidia/cu13"
    in_cuda_home = VenvLayout(
        "/opt/rigbook/venvs/vllm", "/opt/rigbook/venvs/vllm/lib/python3.12/site-packages",
        ("bin", "include", "lib"), True, None,
    )
    env = venv_environment(in_cuda_home)
    assert env["CUDA_HOME"] == cu13
    assert env["PATH"].split(":")[:3] == [
        "/opt/rigbook/venvs/vllm/bin", f"{cu13}/bin", "/usr/local/sbin"
    ]
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in env
    no_torch = VenvLayout("/v", "/v/lib/python3.11/site-packages", None, False, None)
    assert venv_environment(no_torch) == {
        "PATH": "/v/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "VIRTUAL_ENV": "/v",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }


def test_an_older_nvcc_on_path_leaves_the_flashinfer_sampler_off():
    """The failure log's case (docs/sources.md, "FlashInfer sampler and nvcc"): a system CUDA
    12.x nvcc next to a cu13 venv is no nvcc for FlashInfer's JIT."""
    for release in ("12.8", None, "130"):
        env = venv_environment(h200_layout(path_nvcc="/usr/bin/nvcc", release=release))
        assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0", release
    ok = venv_environment(h200_layout(path_nvcc="/usr/bin/nvcc", release="13.2"))
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in ok


def test_layout_fact_reads_the_release_of_the_nvcc_on_path(tmp_path):
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    for release in ("12.8", "13.0"):
        nvcc = venv / "bin" / "nvcc"
        nvcc.write_text(
            "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
            f"echo 'Cuda compilation tools, release {release}, V{release}.88'\n"
        )
        nvcc.chmod(0o755)
        layout = local_fact(VenvLayoutFact, venv=str(venv))
        assert layout.path_nvcc == str(nvcc) and layout.path_nvcc_release == release
        assert layout.path_nvcc_matches == (release == "13.0")


def render_env(name: str, env: dict[str, str]) -> list[str]:
    """The env file as venv_env_file writes it (rigbook.core.render, the same template)."""
    return render(ENV_TEMPLATE, name=name, env=env).splitlines()


def test_env_file_content_with_and_without_nvcc():
    without = render_env("vllm", venv_environment(h200_layout()))
    settings = [line for line in without if not line.startswith("#")]
    assert settings == [
        'CUDA_HOME="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13"',
        'PATH="/opt/torch/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"',
        'VIRTUAL_ENV="/opt/torch/.venv"',
        'VLLM_USE_FLASHINFER_SAMPLER="0"',
    ]
    assert any("EnvironmentFile=/opt/rigbook/venvs/vllm.env" in line for line in without)
    with_nvcc = render_env(
        "vllm", venv_environment(h200_layout(path_nvcc="/usr/local/cuda/bin/nvcc", release="13.0"))
    )
    assert 'VLLM_USE_FLASHINFER_SAMPLER="0"' not in with_nvcc
    # What systemd and `set -a; .` read back: exactly the dict.
    env_file = "\n".join(without)
    proc = subprocess.run(["sh", "-c", f"set -a; {env_file}\nenv"], capture_output=True,
                          text=True, check=True, env={})
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in proc.stdout.splitlines()


def test_layout_fact_reads_a_real_venv(tmp_path):
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    layout = local_fact(VenvLayoutFact, venv=str(venv))
    assert layout.venv == str(venv) and layout.cu13 is None and not layout.cu13_nvcc
    site = Path(layout.site_packages)
    assert site.is_dir() and site.name == "site-packages"
    (site / "nvidia" / "cu13" / "bin").mkdir(parents=True)
    (site / "nvidia" / "cu13" / "lib").mkdir()
    nvcc = site / "nvidia" / "cu13" / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    layout = local_fact(VenvLayoutFact, venv=str(venv))
    assert layout.cu13 == ("bin", "lib") and layout.cu13_nvcc
    assert local_fact(VenvLayoutFact, venv=str(tmp_path / "none")) is None


# --- builds, swap, prune ------------------------------------------------------------------------


def manifest(build: str, driver: str = "580.95.05", digest: str | None = None) -> dict:
    return {"build": build, "spec_hash": digest or build.split("-")[1], "driver": driver}


B1 = "demo-aaaaaaaaaaaa-20261101T000000Z"
B2 = "demo-bbbbbbbbbbbb-20261102T000000Z"
B3 = "demo-bbbbbbbbbbbb-20261103T000000Z"
CUT = "demo-cccccccccccc-20261104T000000Z"


def test_prune_selection_keeps_the_live_build_and_the_newest_others():
    builds = {B1: manifest(B1), B2: manifest(B2), B3: manifest(B3), CUT: None}
    assert prune_selection(builds, keep=1, live=B3) == [CUT, B1]
    assert prune_selection(builds, keep=2, live=B3) == [CUT]
    assert prune_selection(builds, keep=0, live=B3) == [CUT, B2, B1]
    # Building a new one that replaces B2 (rolled back to by hand): B2 is kept before newer B3.
    assert prune_selection(builds, keep=1, prefer=B2) == [CUT, B3, B1]
    assert prune_selection({}, keep=1) == []


def test_swap_is_a_temp_link_renamed_over_the_stable_path():
    assert swap_commands("/opt/rigbook/venvs", "vllm", B1.replace("demo", "vllm")) == [
        "ln -sfn /opt/rigbook/venvs/vllm-aaaaaaaaaaaa-20261101T000000Z "
        "/opt/rigbook/venvs/.vllm.swap",
        "mv -T /opt/rigbook/venvs/.vllm.swap /opt/rigbook/venvs/vllm",
    ]


def plan_for(r: Rig, s: VenvSpec, root: Path, **changes) -> BuildPlan:
    import uv

    digest = spec_hash(s, r)
    build = build_name(s.name, digest, changes.pop("stamp", "20261129T000000Z"))
    driver = changes.pop("driver", LiveDriver(None, None, None))
    return BuildPlan(
        name=s.name, build=build, python=s.python, install_args=install_args(s, r),
        uv_env=uv_environment(r, str(root / "cache")),
        smoke_input=smoke_input(s, r, digest, build, driver, root=str(root / "venvs")),
        uv=uv.find_uv_bin(), root=str(root / "venvs"), cache=str(root / "cache"), **changes,
    )


def test_build_script_order_smoke_then_swap_then_prune_then_restart(tmp_path):
    r = rig(python_find_links="/srv/w", python_no_index=True)
    plan = plan_for(r, spec(services=["demo.service"]), tmp_path, prune=(B1,),
                    services=("demo.service",))
    script = build_script(plan)
    steps = [" venv --python 3.11 ", " pip install --python ", "RIGBOOK_SMOKE_PY", "ln -sfn ",
             "mv -T ", "rm -rf -- ", "systemctl try-restart demo.service"]
    positions = [script.index(step) for step in steps]
    assert positions == sorted(positions), script
    assert "--no-index --find-links /srv/w six==1.16.0" in script
    assert "--torch-backend" not in script
    assert "UV_PYTHON_DOWNLOADS=never" in script
    online = build_script(plan_for(rig(), spec(engine="vllm", packages=["vllm==0.33.0"],
                                               extra_index_urls=["https://wheels.example/cu130"]),
                                   tmp_path))
    assert ("--torch-backend cu130 --extra-index-url https://wheels.example/cu130 vllm==0.33.0"
            in online)
    assert "UV_PYTHON_DOWNLOADS" not in online and "systemctl" not in online


#: uv 0.13's output with progress bars off, as the build log gets it (a wheel index over HTTP).
UV_LOG = '''== 2026-11-29T20:27:54Z build /opt/rigbook/venvs/demo-0123456789ab-20261129T202754Z
rigbook phase: creating the venv with Python 3.11
Using CPython 3.11.2 interpreter at: /usr/bin/python3.11
Creating virtual environment at: /opt/rigbook/venvs/demo-0123456789ab-20261129T202754Z
rigbook phase: installing 1 requirement(s): resolving, downloading, installing
Using Python 3.11.2 environment at: /opt/rigbook/venvs/demo-0123456789ab-20261129T202754Z
Resolved 3 packages in 214ms
Downloading hf-xet (4.1MiB)
Downloading numpy (16.1MiB)
 Downloaded hf-xet
 Downloaded numpy
Prepared 3 packages in 333ms
Installed 3 packages in 30ms
 + hf-xet==1.8.0
 + numpy==2.4.6
 + six==1.16.0
rigbook phase: smoke test: imports, CUDA libraries, the manifest'''.splitlines()


def test_build_progress_shows_phases_and_counts_and_folds_downloads():
    progress = BuildProgress("demo")
    assert progress.shown(UV_LOG[:8]) == [
        "venv demo: creating the venv with Python 3.11",
        "venv demo: installing 1 requirement(s): resolving, downloading, installing",
        "venv demo: Resolved 3 packages in 214ms",
        "venv demo: downloading: 0 of 1 large wheel(s) done, now hf-xet (4.1MiB)",
    ]
    assert progress.shown(UV_LOG[8:10]) == [
        "venv demo: downloading: 1 of 2 large wheel(s) done, now numpy (16.1MiB)"]
    assert progress.shown(UV_LOG[10:]) == [
        "venv demo: downloading: 2 of 2 large wheel(s) done",  # before what came after it
        "venv demo: Prepared 3 packages in 333ms",
        "venv demo: Installed 3 packages in 30ms",
        "venv demo: smoke test: imports, CUDA libraries, the manifest",
    ]
    assert progress.shown([" + six==1.16.0", "Using Python 3.11.2 environment at: /x"]) == []


def test_a_build_shows_its_phases_while_it_runs_then_its_time(caplog, monkeypatch):
    monkeypatch.setenv("RIGBOOK_PROGRESS_EVERY", "0.2")
    r = rig(venvs=[DEMO], python_find_links="/srv/w", python_no_index=True)
    commands, fake = run_op(venv_build, facts(VenvState(None, False, {})), r, spec())
    (build,) = [c for c in commands if isinstance(c, WatchedBuild)]
    assert build.log == "/opt/rigbook/venvs/.demo.build.log" and build.every == 0.2
    rig_side = FakeRig(["\n".join(UV_LOG[:8]) + "\n", "\n".join(UV_LOG[8:]) + "\n"], 0.3,
                       "rigbook: venv demo -> /opt/rigbook/venvs/demo-0123456789ab-...")
    fake.run_shell_command = rig_side.run_shell_command

    class FakeState:
        print_output = print_input = False

    with caplog.at_level("INFO", logger="pyinfra"):
        ok, output = build.execute(FakeState(), fake, {"_sudo": True})
    assert ok and output.stdout.startswith("rigbook: venv demo -> ")
    shown = [record.getMessage() for record in caplog.records]
    assert shown[:4] == [
        "[rig1] venv demo: creating the venv with Python 3.11",
        "[rig1] venv demo: installing 1 requirement(s): resolving, downloading, installing",
        "[rig1] venv demo: Resolved 3 packages in 214ms",
        "[rig1] venv demo: downloading: 0 of 1 large wheel(s) done, now hf-xet (4.1MiB)",
    ]
    assert shown[-2] == "[rig1] venv demo: smoke test: imports, CUDA libraries, the manifest"
    assert re.fullmatch(r"\[rig1\] venv demo: built, smoke-tested and swapped in after "
                        r"0\.\d s", shown[-1])
    assert rig_side.work == {"print_output": False, "_sudo": True}
    # A kept build swapped back in runs as a plain command: nothing to watch.
    state = current(r, spec(packages=["six==1.17.0"]))
    old = build_name("demo", spec_hash(spec(), r), "20261001T000000Z")
    state.builds[old] = manifest(old, digest=spec_hash(spec(), r))
    commands, _ = run_op(venv_build, facts(state), r, spec())
    assert type(commands[0]) is StringCommand


# --- the build script, run for real on this machine ------------------------------------------


def make_wheel(folder: Path, name: str, version: str, body: str | None = None) -> None:
    """A minimal pure-Python wheel: one module `name` that sets VERSION (or runs `body`)."""
    files = {
        f"{name}.py": body if body is not None else f"VERSION = {version!r}\n",
        f"{name}-{version}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{name}-{version}.dist-info/WHEEL":
            "Wheel-Version: 1.0\nGenerator: rigbook-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest())
            record.append(f"{path},sha256={digest.rstrip(b'=').decode()},{len(text)}")
        record.append(f"{name}-{version}.dist-info/RECORD,,")
        wheel.writestr(f"{name}-{version}.dist-info/RECORD", "\n".join(record) + "\n")


def run_build(plan: BuildPlan) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", build_script(plan)], capture_output=True, text=True,
                          timeout=300)


def test_build_script_builds_swaps_keeps_and_refuses_for_real(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "rigdemo", "1.0")
    make_wheel(wheels, "rigdemo", "2.0")
    make_wheel(wheels, "rigbroken", "1.0", body="raise ImportError('broken on purpose')\n")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    r = rig(python_find_links=str(wheels), python_no_index=True)
    venvs = tmp_path / "venvs"
    link = venvs / "demo"

    def demo(package: str, stamp: str, **changes) -> BuildPlan:
        return plan_for(r, spec(python=python, packages=[package]), tmp_path, stamp=stamp,
                        **changes)

    first = demo("rigdemo==1.0", "20261101T000000Z")
    done = run_build(first)
    assert done.returncode == 0, done.stderr
    assert os.readlink(link) == str(venvs / first.build)
    # What the operator sees of it, from its log as rigbook reads it while it runs
    assert BuildProgress("demo").shown(Path(first.log).read_text().splitlines()) == [
        f"venv demo: creating the venv with Python {python}",
        "venv demo: installing 1 requirement(s): resolving, downloading, installing",
        *(f"venv demo: {line}" for line in Path(first.log).read_text().splitlines()
          if line.startswith(("Resolved 1 package in ", "Prepared 1 package in ",
                              "Installed 1 package in "))),
        "venv demo: smoke test: imports, CUDA libraries, the manifest",
    ]
    built = json.loads((venvs / first.build / "rigbook-manifest.json").read_text())
    assert built["spec_hash"] == spec_hash(spec(python=python, packages=["rigdemo==1.0"]), r)
    assert built["packages"] == {"rigdemo": "1.0"} and built["smoke_import"] == "rigdemo"
    assert built["driver"] is None and built["cuda_runtime"] is None

    second = demo("rigdemo==2.0", "20261102T000000Z", prune=())
    assert run_build(second).returncode == 0
    assert os.readlink(link) == str(venvs / second.build)
    assert (venvs / first.build).is_dir()  # kept for rollback
    version = subprocess.run([str(link / "bin" / "python"), "-c",
                              "import rigdemo; print(rigdemo.VERSION)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == "2.0"

    for package, why in (("rigdemo==9.9", "uv pip install failed"),
                         ("rigbroken==1.0", "smoke test failed")):
        failed = demo(package, "20261103T000000Z", prune=(first.build,))
        done = run_build(failed)
        assert done.returncode == 1
        assert f"rigbook: venv demo: {why}; nothing swapped: {link} still -> " \
               f"{venvs / second.build}" in done.stderr
        assert ("rigdemo==9.9" in done.stderr) if package.startswith("rigdemo") else (
            "broken on purpose" in done.stderr)
        assert not (venvs / failed.build).exists()  # the half-built dir is gone
        assert os.readlink(link) == str(venvs / second.build)
        assert (venvs / first.build).is_dir()  # nothing pruned after a failure

    # Reverting the pin swaps back to the kept build: nothing installed, nothing removed.
    back = demo("rigdemo==1.0", "20261101T000000Z", reuse=True)
    assert back.build == first.build
    done = run_build(back)
    assert done.returncode == 0, done.stderr
    assert "(kept build)" in done.stdout
    assert os.readlink(link) == str(venvs / first.build) and (venvs / second.build).is_dir()
    gone = demo("rigdemo==1.0", "20261031T000000Z", reuse=True)
    done = run_build(gone)
    assert done.returncode == 1 and "is not a finished build" in done.stderr
    assert os.readlink(link) == str(venvs / first.build)
    assert run_build(demo("rigdemo==2.0", "20261102T000000Z", reuse=True)).returncode == 0

    third = demo("rigdemo==1.0", "20261104T000000Z", prune=(first.build,))
    assert run_build(third).returncode == 0
    assert os.readlink(link) == str(venvs / third.build)
    assert sorted(p.name for p in venvs.iterdir() if not p.name.startswith(".")) == sorted(
        ["demo", second.build, third.build]
    )
    state = parse_venv_builds(venv_builds_output(venvs, "demo"))
    assert state.target_build == third.build and set(state.builds) == {second.build, third.build}

    # Its operator gone (its output a pipe nobody reads any more): it still swaps and prunes.
    orphan = demo("rigdemo==2.0", "20261105T000000Z", prune=(second.build,))
    read, write = os.pipe()
    os.close(read)
    subprocess.run(["sh", "-c", build_script(orphan)], stdout=write, stderr=write, timeout=300)
    os.close(write)
    assert os.readlink(link) == str(venvs / orphan.build) and not (venvs / second.build).exists()


def venv_builds_output(root: Path, name: str) -> list[str]:
    """VenvBuilds' command, pointed at a test root instead of /opt/rigbook/venvs."""
    command = VenvBuilds().command(name).replace("/opt/rigbook/venvs", shlex.quote(str(root)))
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def test_venv_builds_output_parsing():
    output = [
        "##RIGBOOK_VENV demo",
        f"##RIGBOOK_TARGET /opt/rigbook/venvs/{B2}",
        f"##RIGBOOK_BUILD {B1}",
        json.dumps(manifest(B1)),
        f"##RIGBOOK_BUILD {B2}",
        "{", '"spec_hash": "bbbbbbbbbbbb",', '"driver": "580.95.05"', "}",
        f"##RIGBOOK_BUILD {CUT}",
        "{\"spec_hash\": ",  # torn: that build did not finish
        "##RIGBOOK_BUILD demo-old-aaaaaaaaaaaa-20261101T000000Z",
    ]
    state = parse_venv_builds(output)
    assert state.target_build == B2 and state.manifest["spec_hash"] == "bbbbbbbbbbbb"
    assert state.builds == {B1: manifest(B1), B2: {"spec_hash": "bbbbbbbbbbbb",
                                                   "driver": "580.95.05"}, CUT: None}
    empty = parse_venv_builds(["##RIGBOOK_VENV demo"])
    assert empty == VenvState(None, False, {}) and empty.manifest is None
    assert parse_venv_builds(["##RIGBOOK_VENV demo", "##RIGBOOK_NOTLINK"]).not_link


# --- decisions and the operation on fake facts -------------------------------------------------


def gpus(driver: str, count: int = 2) -> GpuProbe:
    return GpuProbe(smi="/usr/bin/nvidia-smi", gpus=tuple(
        Gpu(index=i, uuid=f"GPU-{i}", name="NVIDIA GeForce RTX 3090", bus_id=f"0000:0{i}:00.0",
            driver_version=driver) for i in range(count)
    ))


def facts(state: VenvState, driver: str = "580.95.05") -> dict:
    return {"NvidiaGpus": gpus(driver), "NvidiaSmiHeader": (driver, "13.0"),
            "VenvBuilds": state}


def current(r: Rig, s: VenvSpec, driver: str = "580.95.05", cuda_runtime=None) -> VenvState:
    build = build_name(s.name, spec_hash(s, r), "20261101T000000Z")
    built = {**manifest(build, driver, spec_hash(s, r)), "cuda_runtime": cuda_runtime}
    return VenvState(f"/opt/rigbook/venvs/{build}", False, {build: built})


def test_current_venv_is_a_noop_and_prunes_nothing():
    r = rig(venvs=[DEMO])
    commands, host = run_op(venv_build, facts(current(r, spec())), r, spec())
    assert commands == []
    assert host.noops == ["venv demo is already demo-ed6da2262f1d-20261101T000000Z (built for "
                          "driver 580.95.05)"]


def test_a_swap_whose_restarts_were_cut_off_is_finished_by_the_next_run():
    """The restart-pending marker a build leaves before its swap (removed once its services
    restarted): read by VenvBuilds; with it, a current venv restarts them and removes it."""
    r = rig(venvs=[DEMO])
    build = build_name("demo", spec_hash(spec(), r), "20261101T000000Z")
    state = parse_venv_builds([
        "##RIGBOOK_VENV demo", f"##RIGBOOK_TARGET /opt/rigbook/venvs/{build}",
        "##RIGBOOK_RESTART demo.service", f"##RIGBOOK_BUILD {build}",
        json.dumps(manifest(build, digest=spec_hash(spec(), r)))])
    assert state.restart_pending == ("demo.service",)
    commands, host = run_op(venv_build, facts(state), r, spec(services=["demo.service"]))
    steps = shell(commands)
    assert steps[0].startswith("systemctl show -p LoadState --value demo.service | grep -qx "
                               "not-found || ( systemctl reset-failed demo.service 2>/dev/null; "
                               "systemctl try-restart demo.service || ")
    assert steps[1] == "rm -f /opt/rigbook/venvs/.demo.restart"
    assert host.noops == []


def test_the_build_script_outlives_a_closed_channel_and_leaves_its_marker_until_restarts(
        tmp_path):
    plan = plan_for(rig(python_find_links="/srv/w", python_no_index=True),
                    spec(services=["demo.service"]), tmp_path, services=("demo.service",))
    script = build_script(plan)
    steps = ["trap '' HUP PIPE", "flock -n 9", " pip install ", "RIGBOOK_SMOKE_PY",
             "demo.service >\"$marker\"", "mv -T ", "systemctl reset-failed demo.service",
             "systemctl try-restart demo.service", 'rm -f "$marker"']
    positions = [script.index(step) for step in steps]
    assert positions == sorted(positions), script
    assert f"lock={tmp_path}/venvs/.demo.lock" in script
    assert f"marker={tmp_path}/venvs/.demo.restart" in script


def test_old_builds_beyond_venvs_keep_are_pruned_without_a_build():
    r = rig(venvs=[DEMO])
    state = current(r, spec())
    state.builds.update({B1: manifest(B1), B2: manifest(B2), CUT: None})
    commands, _ = run_op(venv_build, facts(state), r, spec())
    assert shell(commands) == [f"rm -rf -- /opt/rigbook/venvs/{CUT} /opt/rigbook/venvs/{B1}"]


def test_missing_or_changed_venv_is_built_with_the_driver_in_its_manifest():
    r = rig(venvs=[DEMO], python_find_links="/srv/w", python_no_index=True)
    for state in (VenvState(None, False, {}), current(r, spec(packages=["six==1.17.0"]))):
        commands, host = run_op(venv_build, facts(state), r, spec())
        (script,) = shell(commands)
        assert "six==1.16.0" in script and "RIGBOOK_SMOKE_PY" in script
        argument = script.split('"$d/bin/python" -I - ', 1)[1].split(' >>"$log"', 1)[0]
        smoke = json.loads(shlex.split(argument)[0])
        assert (smoke["driver"], smoke["cuda"], smoke["gpus"]) == ("580.95.05", "13.0", 2)
    # Replacing a build with no services named: say what to restart.
    notes = [execute(c, host) for c in commands if isinstance(c, FunctionCommand)]
    assert notes == [True]


def test_a_reverted_pin_swaps_back_to_the_kept_build():
    r = rig(venvs=[DEMO])
    new_pin = spec(packages=["six==1.17.0"])
    state = current(r, new_pin)  # the symlink's build: six 1.17.0
    old_build = build_name("demo", spec_hash(spec(), r), "20261001T000000Z")
    state.builds[old_build] = manifest(old_build, digest=spec_hash(spec(), r))
    commands, _ = run_op(venv_build, facts(state), r, spec())
    (script,) = shell(commands)
    assert f"ln -sfn /opt/rigbook/venvs/{old_build} " in script
    assert " venv --python" not in script and "pip install" not in script
    # Built for another driver: not reused, built again.
    commands, _ = run_op(venv_build, facts(state, driver="580.159.04"), r, spec())
    assert " pip install " in shell(commands)[0]
    decision = decide("rig1", spec(), spec_hash(spec(), r), state,
                      LiveDriver("580.95.05", "13.0", 2), rebuild_stale=True, rebuild_all=True)
    assert decision.action == "build"  # rebuild_all builds, it never reuses


def test_back_on_the_old_driver_deploys_venvs_swaps_to_the_build_made_for_it():
    r = rig(venvs=[DEMO])
    digest = spec_hash(spec(), r)
    for_new = build_name("demo", digest, "20261102T000000Z")
    for_old = build_name("demo", digest, "20261101T000000Z")
    state = VenvState(f"/opt/rigbook/venvs/{for_new}", False, {
        for_new: manifest(for_new, "580.159.04", digest),
        for_old: manifest(for_old, "580.95.05", digest),
    })
    commands, host = run_op(venv_build, facts(state, driver="580.95.05"), r, spec())
    assert commands == [] and "is stale" in host.noops[0]  # the converge only warns
    commands, _ = run_op(venv_build, facts(state, driver="580.95.05"), r, spec(),
                         rebuild_stale=True)
    (script,) = shell(commands)
    assert f"ln -sfn /opt/rigbook/venvs/{for_old} " in script and "pip install" not in script
    assert "rm -rf" not in script  # the build it replaces is the one venvs_keep keeps


def test_venvs_keep_0_never_removes_the_build_an_engine_may_still_run_from():
    r = rig(venvs=[DEMO], venvs_keep=0)
    digest = spec_hash(spec(), r)
    live = build_name("demo", digest, "20261101T000000Z")
    older = build_name("demo", digest, "20261001T000000Z")
    state = VenvState(f"/opt/rigbook/venvs/{live}", False, {
        live: manifest(live, "580.95.05", digest), older: manifest(older, "580.95.05", digest)})
    commands, _ = run_op(venv_build, facts(state, driver="580.159.04"), r, spec(),
                         rebuild_stale=True)
    (script,) = shell(commands)
    assert " pip install " in script and f"/opt/rigbook/venvs/{older}" in script
    prune = script[script.index("rm -rf --"):].splitlines()[0]
    assert older in prune and live not in prune
    # The next run, on the new build, removes it.
    new = next(b for b in re.findall(r"demo-[0-9a-f]{12}-\d{8}T\d{6}Z", script) if b != live
               and b != older)
    assert prune_selection({new: {}, live: {}}, 0, live=new) == [live]


def test_stale_venv_warns_in_a_converge_and_is_rebuilt_by_deploys_venvs():
    r = rig(venvs=[DEMO])
    stale = current(r, spec(), driver="580.95.05")
    commands, host = run_op(venv_build, facts(stale, driver="580.159.04"), r, spec())
    assert commands == []
    assert host.noops == ["venv demo is stale: built for driver 580.95.05, running 580.159.04: "
                          "run deploys/venvs.py"]
    commands, _ = run_op(venv_build, facts(stale, driver="580.159.04"), r, spec(),
                         rebuild_stale=True)
    assert len(shell(commands)) == 1
    fresh = current(r, spec(), driver="580.159.04")
    commands, _ = run_op(venv_build, facts(fresh, driver="580.159.04"), r, spec(),
                         rebuild_stale=True)
    assert commands == []
    everything = rig(venvs=[DEMO], rebuild_all=True)
    commands, _ = run_op(venv_build, facts(current(everything, spec()), "580.159.04"), everything,
                         spec(), rebuild_stale=True)
    assert len(shell(commands)) == 1


def test_refusals_fail_the_rig_and_run_nothing():
    r = rig(venvs=[VLLM])
    needs_132 = VenvSpec.model_validate({**VLLM, "packages": [*VLLM["packages"],
                                                              "cuda-toolkit==13.2.*"]})
    commands, host = run_op(venv_build, facts(VenvState(None, False, {})), r, needs_132)
    (refusal,) = commands
    assert isinstance(refusal, FunctionCommand) and execute(refusal, host) is False
    assert "needs driver >= 595.45.04; this rig runs 580.95.05" in host.logged[0]
    assert "CUDA error 804" in host.logged[0]

    not_link = VenvState(None, True, {})
    commands, host = run_op(venv_build, facts(not_link), r, r.venvs[0])
    assert execute(commands[0], host) is False
    assert "/opt/rigbook/venvs/vllm exists and is not rigbook's symlink" in host.logged[0]

    # A stale venv whose CUDA runtime the live driver cannot run: the converge fails the rig.
    stale = current(r, r.venvs[0], driver="595.84", cuda_runtime="13.2")
    commands, host = run_op(venv_build, facts(stale, driver="580.95.05"), r, r.venvs[0])
    assert execute(commands[0], host) is False
    assert "needs driver >= 595.45.04, running 580.95.05 (CUDA error 804)" in host.logged[0]


def test_broken_gpu_layer_builds_nothing():
    r = rig(venvs=[DEMO])
    broken = GpuProbe(smi="/usr/bin/nvidia-smi", exit_code=18,
                      error="Failed to initialize NVML: Driver/library version mismatch")
    state = {"NvidiaGpus": broken, "NvidiaSmiHeader": None,
             "VenvBuilds": VenvState(None, False, {})}
    commands, host = run_op(venv_build, state, r, spec())
    assert commands == []
    assert "GPU layer not usable" in host.noops[0] and "version mismatch" in host.noops[0]
    decision = decide("rig1", spec(), "x", VenvState(None, False, {}), LiveDriver(None, None, None))
    assert decision.action == "build"  # a rig with no GPU layer at all builds (driver: None)


# --- tools venv -------------------------------------------------------------------------------


def test_tools_venv_installs_only_what_differs():
    r = rig(python_find_links="/srv/w", python_no_index=True)
    commands, _ = run_op(tools_packages, {"ToolsVersions": None}, r)
    assert shell(commands) == [
        f"python3 -m venv {TOOLS_VENV}",
        f"{TOOLS_VENV}/bin/python -m pip install --quiet --disable-pip-version-check --no-input "
        "--no-index --find-links /srv/w uv==0.13.9 huggingface_hub==2.4.0 nvidia-ml-py==13.610.43",
    ]
    installed = {"uv": "0.13.9", "huggingface-hub": "2.3.0", "nvidia_ml_py": "13.610.43",
                 "pip": "23.0.1"}
    commands, _ = run_op(tools_packages, {"ToolsVersions": installed}, rig())
    assert shell(commands) == [
        f"{TOOLS_VENV}/bin/python -m pip install --quiet --disable-pip-version-check --no-input "
        "huggingface_hub==2.4.0"
    ]
    installed["Huggingface_Hub"] = installed.pop("huggingface-hub")
    installed["Huggingface_Hub"] = "2.4.0"
    commands, host = run_op(tools_packages, {"ToolsVersions": installed}, rig())
    assert commands == [] and host.noops == [
        "/opt/rigbook/tools already holds uv 0.13.9, huggingface_hub 2.4.0, nvidia-ml-py 13.610.43"
    ]
    assert differing_pins(None) == TOOLS_PINS


@pytest.mark.parametrize("spelled", ["huggingface__hub", "HuggingFace.Hub", "huggingface_-.hub"])
def test_installed_names_compare_as_pep_503_says(spelled):
    """Runs of - _ . are one -, and case does not count: a__b is a-b, A.B-c_d is a-b-c-d."""
    installed = {"UV": "0.13.9", spelled: "2.4.0", "Nvidia.ML_py": "13.610.43"}
    assert differing_pins(installed) == {}
    assert differing_pins({**installed, spelled: "2.3.0"}) == {"huggingface_hub": "2.4.0"}


def test_tools_versions_fact_reads_this_python():
    command = ToolsVersions().command().replace("/opt/rigbook/tools/bin/python", sys.executable)
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    versions = ToolsVersions().process(out.stdout.splitlines())
    assert versions["pytest"] == __import__("pytest").__version__


# --- the engine pins rigbook ships ------------------------------------------------------------

#: The oldest glibc among the rigs' systems (Ubuntu 22.04: 2.35; Debian 12: 2.36). sglang 0.5.23
#: ships manylinux_2_34 wheels only, so manylinux_2_28 would not resolve it.
PLATFORM = "x86_64-manylinux_2_35"


def compile_pins(engine: str, tmp_path: Path) -> dict[str, str]:
    """`uv pip compile` of one engine's pins against the default index: name -> version."""
    import uv

    requirements = tmp_path / f"{engine}.in"
    requirements.write_text("\n".join(engine_pins()[engine]["packages"]) + "\n")
    done = subprocess.run(
        [uv.find_uv_bin(), "pip", "compile", str(requirements), "--python-version", "3.12",
         "--python-platform", PLATFORM, "--no-header", "--no-annotate", "--quiet"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "UV_NO_CONFIG": "1"},
    )
    assert done.returncode == 0, f"{engine}: {done.stderr}"
    return dict(line.split("==", 1) for line in done.stdout.splitlines() if "==" in line)


def test_shipped_engine_pins_resolve_with_the_cuda_they_claim(tmp_path):
    import uv  # the dev extra's pin (pip install -e .[dev]); CI installs it

    version = subprocess.run([uv.find_uv_bin(), "--version"], capture_output=True, text=True)
    assert version.stdout.split()[:2] == ["uv", TOOLS_PINS["uv"]]  # the dev extra's pin
    pins = tomllib.loads((ROOT / "files" / "venvs" / "pins.toml").read_text())
    assert set(pins) == {"vllm", "sglang", "llama-cpp-python"}
    with ThreadPoolExecutor(max_workers=3) as pool:
        resolved = dict(zip(pins, pool.map(lambda e: compile_pins(e, tmp_path), pins),
                            strict=True))
    for engine, pin in pins.items():
        for requirement in pin["packages"]:
            name, version = re.sub(r"\[[^\]]*\]", "", requirement).split("==")
            assert resolved[engine].get(name) == version, (engine, requirement)
        cuda = resolved[engine].get("cuda-toolkit")
        if "cuda" in pin:
            assert cuda is not None and cuda.startswith(pin["cuda"] + "."), (engine, cuda)
            assert required_driver(pin["cuda"]) == DRIVER_FOR_CUDA["13.0"]  # the 580 branch
        else:
            assert cuda is None, (engine, cuda)
    assert resolved["vllm"]["torch"] == "2.14.0" and resolved["sglang"]["torch"] == "2.14.1"


def test_engine_venv_uses_the_shipped_pins():
    entry = engine_venv("vllm", services=["vllm.service"])
    assert entry["packages"] == ["vllm==0.33.0", "torch==2.14.0"]
    assert entry["name"] == "vllm-0.33" and entry["services"] == ["vllm.service"]
    assert rig(venvs=[entry]).venvs[0].engine == "vllm"
    with pytest.raises(RigbookError, match="no shipped pins for engine 'tgi'"):
        engine_venv("tgi")


def test_engine_venv_names_the_venv_as_every_shipped_recipe_does():
    for path in sorted((ROOT / "files" / "recipes").glob("*.toml")):
        recipe = tomllib.loads(path.read_text())
        assert engine_venv(VENV_ENGINE[recipe["engine"]])["name"] == recipe["venv"], path.name


# --- the smoke test's CUDA library guard (docs/sources.md, nvrtc placeholder wheel) -------------


def smoke_module():
    import importlib.util

    path = ROOT / "files" / "venvs" / "smoke.py"
    module_spec = importlib.util.spec_from_file_location("rigbook_smoke_under_test", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_smoke_refuses_a_placeholder_nvrtc_and_loads_the_libraries_from_the_venv(tmp_path):
    smoke = smoke_module()
    site = tmp_path / "site-packages"
    lib = site / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    placeholder = smoke.cuda_library_problems({"nvidia-cuda-nvrtc": "0.0.0a0"}, [str(site)])
    assert len(placeholder) == 1
    assert "nvidia-cuda-nvrtc 0.0.0a0 is a placeholder wheel, so libnvrtc.so.13 is missing" in (
        placeholder[0])
    assert "docs/sources.md, nvrtc placeholder wheel" in placeholder[0]
    packages = {"nvidia-cuda-nvrtc": "13.0.88", "nvidia_cuda_runtime": "13.0.96"}
    missing = smoke.cuda_library_problems(packages, [str(site)])
    assert missing == [
        "nvidia-cuda-nvrtc 13.0.88 is installed but libnvrtc.so.13 is not in the venv",
        "nvidia-cuda-runtime 13.0.96 is installed but libcudart.so.13 is not in the venv",
    ]
    (lib / "libnvrtc.so.13").write_bytes(b"not an ELF file")
    (lib / "libcudart.so.13").write_bytes(Path(ctypes_util_libm()).read_bytes())
    broken = smoke.cuda_library_problems(packages, [str(site)])
    assert len(broken) == 1 and broken[0].startswith("libnvrtc.so.13 from the venv does not load")
    (lib / "libnvrtc.so.13").write_bytes(Path(ctypes_util_libm()).read_bytes())
    assert smoke.cuda_library_problems(packages, [str(site)]) == []
    # CUDA 12 builds of the plain names and unrelated packages are not checked.
    assert smoke.cuda_library_problems({"nvidia-cublas": "12.8.4.1", "vllm": "0.0.0"}, []) == []


def ctypes_util_libm() -> str:
    """A real shared library on this machine to stand in for a loadable CUDA library."""
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib"):
        path = Path(folder) / "libm.so.6"
        if path.exists():
            return str(path)
    pytest.skip("no libm.so.6 here")


def test_build_refuses_a_placeholder_cuda_wheel_for_real(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "rigdemo", "1.0")
    make_wheel(wheels, "nvidia_cuda_nvrtc", "0.0.0a0")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    r = rig(python_find_links=str(wheels), python_no_index=True)
    plan = plan_for(r, spec(python=python, packages=["rigdemo==1.0", "nvidia-cuda-nvrtc==0.0.0a0"]),
                    tmp_path, stamp="20261101T000000Z")
    done = run_build(plan)
    assert done.returncode == 1
    assert "smoke test failed" in done.stderr
    assert "is a placeholder wheel, so libnvrtc.so.13 is missing" in done.stderr
    assert not (tmp_path / "venvs" / "demo").exists()
