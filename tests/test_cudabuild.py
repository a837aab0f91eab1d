"""llama.cpp on the GPU: the CUDA build of a GPU recipe's llama.cpp venv and the smoke test's
GPU checks (offload for llama.cpp, torch's GPUs for vLLM/SGLang)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rigbook.core.errors import RigbookError
from rigbook.roles.venvs import (
    TOOLKIT_WHEELS,
    BuildPlan,
    LiveDriver,
    Nvcc,
    SystemNvcc,
    build_script,
    cuda_architectures,
    cuda_build,
    cuda_build_of,
    install_args,
    smoke_input,
    spec_hash,
    uv_environment,
)
from tests.conftest import ROOT
from tests.test_venvs import rig, smoke_module, spec

H200 = ROOT / "tests" / "fixtures" / "nvidia-h200" / "serve"
RECIPES = str(ROOT / "tests" / "recipes")
LLAMA = {"name": "tiny-cpu", "engine": "llama-cpp-python", "python": "3.11",
         "packages": ["llama-cpp-python[server]==0.3.36"]}
H200_DRIVER = LiveDriver("580.159.04", "13.0", 1, compute_caps=("9.0",))


def llama_rig(recipe: str | None):
    return rig(venvs=[LLAMA], serving_recipe_dirs=[RECIPES],
               **({"recipe": recipe} if recipe else {}))


# --- which venvs are built with CUDA ---------------------------------------------------------


def test_a_gpu_recipes_llamacpp_venv_is_a_cuda_build_and_a_cpu_only_ones_is_not():
    gpu, cpu, none = llama_rig("tiny-gpu-fat"), llama_rig("tiny-cpu-a"), llama_rig(None)
    assert cuda_build(spec(**LLAMA), gpu) and cuda_build(spec(**LLAMA), none)
    assert not cuda_build(spec(**LLAMA), cpu)
    assert not cuda_build(spec(name="vllm", engine="vllm", packages=["vllm==0.33.0"]), gpu)
    # the CPU build and the CUDA build of the same pins are two venvs
    assert spec_hash(spec(**LLAMA), gpu) != spec_hash(spec(**LLAMA), cpu)
    # a cpu_only recipe keeps the hash the CPU build always had
    assert spec_hash(spec(**LLAMA), cpu) == spec_hash(spec(**LLAMA), rig(venvs=[LLAMA]).model_copy(
        update={"recipe": "tiny-cpu-a", "serving_recipe_dirs": (RECIPES,)}))


# --- architectures and the compiler ----------------------------------------------------------


@pytest.mark.parametrize(("caps", "archs"), [
    (("9.0",), "90"), (("8.6", "8.6"), "86"), (("8.9", "8.6"), "86;89"), (("12.0",), "120"),
])
def test_cuda_architectures_are_the_rigs_own(caps, archs):
    assert cuda_architectures(caps) == archs


@pytest.mark.parametrize("cap", ["9.0\n", "9", "9.0;all", "$(id)", "", None, "9.0 "])
def test_a_compute_capability_that_is_no_version_is_refused(cap):
    with pytest.raises(RigbookError):
        cuda_architectures([cap])


def test_no_compute_capability_at_all_is_refused():
    with pytest.raises(RigbookError, match="no compute capability"):
        cuda_architectures([])


def test_system_nvcc_fact_reads_this_machines_toolkit():
    """The fact's own shell against the nvcc here (CUDA 13.0 as on the H200 host,
    tests/fixtures/nvidia-h200/serve/first-call.txt); with no nvcc anywhere it is None."""
    fact = SystemNvcc()
    done = subprocess.run(["bash", "-c", fact.command()], capture_output=True, text=True)
    found = fact.process(done.stdout.splitlines())
    assert found is not None and found.path.endswith("/nvcc")
    assert found.release is not None and found.release.split(".")[0] == "13"
    bare = subprocess.run(["env", "-i", "PATH=/nonexistent", "/bin/bash", "-c",
                           fact.command().replace("/usr/local/cuda/bin/nvcc", "/nonexistent")],
                          capture_output=True, text=True)
    assert fact.process(bare.stdout.splitlines()) is None
    assert "release 13.0" in (H200 / "first-call.txt").read_text()


def test_the_system_nvcc_is_used_when_the_driver_runs_its_cuda_else_the_toolkit_wheels():
    system = cuda_build_of(H200_DRIVER, Nvcc("/usr/local/cuda/bin/nvcc", "13.0"))
    assert (system.nvcc, system.toolkit, system.architectures) == (
        "/usr/local/cuda/bin/nvcc", (), "90")
    newer = cuda_build_of(H200_DRIVER, Nvcc("/usr/local/cuda/bin/nvcc", "13.2"))
    assert newer.nvcc is None
    assert newer.toolkit == tuple(f"{name}==13.0.*" for name in TOOLKIT_WHEELS)
    assert cuda_build_of(H200_DRIVER, None).toolkit == newer.toolkit
    with pytest.raises(RigbookError, match="no nvcc"):
        cuda_build_of(LiveDriver("580.159.04", None, 1, compute_caps=("9.0",)), None)


def plan(cuda, nvcc_path="/usr/local/cuda/bin/nvcc"):
    r = llama_rig("tiny-gpu-fat")
    s = spec(**LLAMA)
    build = "tiny-cpu-0123456789ab-20261202T000000Z"
    return BuildPlan(name=s.name, build=build, python=s.python,
                     install_args=install_args(s, r, cuda), uv_env=uv_environment(r, cuda=cuda),
                     smoke_input=smoke_input(s, r, "0123456789ab", build, H200_DRIVER, cuda=cuda),
                     cuda=cuda)


def test_the_build_script_compiles_for_the_rigs_architecture_and_shows_progress():
    cuda = cuda_build_of(H200_DRIVER, Nvcc("/opt/cuda dir/bin/nvcc", "13.0"))
    script = build_script(plan(cuda))
    assert "-C cmake.define.GGML_CUDA=on -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90" in script
    assert "CUDACXX='/opt/cuda dir/bin/nvcc'" in script  # quoted for the shell
    assert "compiling llama.cpp with CUDA for 90: $(find" in script
    assert "nvidia-cuda-nvcc" not in script
    smoke = json.loads(next(line for line in script.splitlines()
                            if line.startswith('"$d/bin/python" -I -')).split(" ", 3)[3]
                       .split(" >>")[0].strip("'"))
    assert (smoke["gpu_offload"], smoke["cuda_architectures"], smoke["compute_caps"]) == (
        True, "90", ["9.0"])
    wheels = build_script(plan(cuda_build_of(H200_DRIVER, None)))
    assert "'nvidia-cuda-nvcc==13.0.*'" in wheels
    assert 'export CUDACXX="$d/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc"' in wheels
    for text in (script, wheels):
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_a_cpu_build_has_no_cuda_settings():
    script = build_script(plan(None))
    assert "GGML_CUDA" not in script and "CUDACXX" not in script and "compiling" not in script


# --- the smoke test's GPU checks ----------------------------------------------------------------


def test_the_smoke_test_refuses_a_real_cpu_build_for_a_gpu_recipe(tmp_path):
    """llama-cpp-python as the sandbox wheelhouse builds it (CPU only, tests/standins.py), in a
    venv of its own: llama_supports_gpu_offload() is False there, and the smoke test says so."""
    from tests.standins import wheelhouse, wheelhouse_for_llama

    wheelhouse_for_llama()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--find-links",
                    str(wheelhouse()), "llama-cpp-python==0.3.36"], check=True, timeout=600)
    source = (ROOT / "files" / "venvs" / "smoke.py").read_text()
    base = {"name": "tiny-cpu", "engine": "llama-cpp-python", "build": "b",
            "manifest": str(tmp_path / "manifest.json"), "module": "llama_cpp",
            "packages": ["llama-cpp-python==0.3.36"], "spec_hash": "0" * 12, "spec": {},
            "source": {}, "driver": None, "cuda": None, "gpus": None, "compute_caps": [],
            "driver_for_cuda": {}, "services": [], "cuda_architectures": "90"}

    def smoke(gpu_offload: bool):
        spec_json = json.dumps({**base, "gpu_offload": gpu_offload})
        return subprocess.run([str(venv / "bin" / "python"), "-I", "-", spec_json], input=source,
                              capture_output=True, text=True, timeout=120)

    refused = smoke(True)
    assert refused.returncode == 1
    assert "llama_cpp cannot offload to the GPU (llama_supports_gpu_offload() is False" in (
        refused.stderr)
    assert not (tmp_path / "manifest.json").exists()
    cpu = smoke(False)  # a cpu_only recipe's venv: the same build passes
    assert cpu.returncode == 0, cpu.stderr
    assert json.loads((tmp_path / "manifest.json").read_text())["gpu_offload"] is False


class Torch:
    """torch.cuda as a driver shows it: a count, each device's capability, or an init error."""

    __version__ = "2.14.0+cu130"

    def __init__(self, caps, error=None):
        self.caps, self.error, self.cuda = caps, error, self

    def device_count(self):
        return len(self.caps)

    def get_device_capability(self, index):
        if self.error:
            raise RuntimeError(self.error)
        return self.caps[index]


def test_the_smoke_test_proves_torch_sees_the_rigs_gpus():
    smoke = smoke_module()
    spec_ = {"gpus": 2, "compute_caps": ["8.6", "8.6"]}
    assert smoke.torch_devices(Torch([(8, 6), (8, 6)]), "13.0", spec_) == 2
    with pytest.raises(SystemExit, match="device_count\\(\\) is 1 but nvidia-smi lists 2"):
        smoke.torch_devices(Torch([(8, 6)]), "13.0", spec_)
    with pytest.raises(SystemExit, match="GPU 1 as compute capability 8.9, nvidia-smi as 8.6"):
        smoke.torch_devices(Torch([(8, 6), (8, 9)]), "13.0", spec_)
    error_804 = ("CUDA error: forward compatibility was attempted on non supported HW "
                 "(error 804)")
    with pytest.raises(SystemExit, match="cannot initialise GPU 0: .*error 804"):
        smoke.torch_devices(Torch([(8, 6), (8, 6)], error=error_804), "13.2", spec_)


def test_the_h200_proof_recipe_is_a_gpu_recipe_of_one_card():
    from rigbook.roles.recipes import load_recipe

    recipe = load_recipe(H200 / "recipes" / "tiny-h200.toml")
    assert not recipe.cpu_only and recipe.fits.gpu_count == 1 and recipe.venv == "llamacpp-cuda"


def test_the_h200_dry_plan_changes_no_driver_unit_or_cap():
    """The dry plan captured on the H200 host (no systemd, an adopted host-mounted driver, the
    host's cap): the rows that would change name no driver, systemctl, persistenced or -pl."""
    from tests.gpu_host import forbidden_changes

    plan = (H200 / "rig-dry.txt").read_text()
    assert "Venv llamacpp-cuda" in plan and "Power limits | Live GPU power caps" in plan
    assert forbidden_changes(plan) == []
    changed = [line for line in plan.splitlines() if "1 (@local)" in line]
    assert len(changed) == 11 and not any("driver" in line.lower() for line in changed)
