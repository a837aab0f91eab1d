# rigbook venv smoke test: run by the NEW venv's own Python (-I: isolated, so nothing from the
# working directory or PYTHON* variables leaks in) before the stable symlink moves to it.
# Imports the engine (or the first package), refuses placeholder CUDA library wheels and loads
# libnvrtc/libcudart/libcublas from the venv, checks torch against the driver and the GPUs (count,
# compute capability), refuses a GPU llama.cpp build that cannot offload, and only then writes
# rigbook-manifest.json into the venv: a build with a manifest is a build that passed.
# argv[1]: JSON from roles/venvs.py (smoke_input); stdout goes to the build log.
import importlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import re
import sys
import time


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def cuda_pair(version):
    """'13.0.96' / '13.0' -> (13, 0); None when it is not a version."""
    match = re.match(r"^(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def import_name(requirement):
    """The module the first package provides: the one named like it, else its first one."""
    dist = canonical(re.match(r"^[A-Za-z0-9._-]+", requirement).group(0))
    provided = sorted(
        module
        for module, dists in metadata.packages_distributions().items()
        if dist in (canonical(d) for d in dists) and not module.startswith("_")
    )
    if not provided:
        raise SystemExit(f"smoke: {requirement}: the installed distribution provides no module")
    for module in provided:
        if canonical(module) == dist:
            return module
    return provided[0]


def installed():
    return {d.metadata["Name"]: d.version for d in metadata.distributions()}


def runtime_cuda(packages):
    """The CUDA runtime the venv carries: torch's build, else the CUDA runtime wheel's."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        return torch.version.cuda, torch
    by_name = {canonical(name): version for name, version in packages.items()}
    for name in ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "cuda-toolkit"):
        if name in by_name:
            pair = cuda_pair(by_name[name])
            return (f"{pair[0]}.{pair[1]}" if pair else None), None
    return None, None


#: CUDA library wheels and the library each must put in the venv (nvidia/<dir>/lib). A wheel that
#: installed as a 0.0.0 placeholder carries no library: the failure log's vLLM 0.27.1 never
#: initialised because nvidia-cuda-nvrtc was 0.0.0a0 and libnvrtc.so.13 was missing
#: (docs/sources.md, "nvrtc placeholder wheel").
CUDA_LIBRARIES = {
    "nvidia-cuda-nvrtc": "libnvrtc.so.13",
    "nvidia-cuda-runtime": "libcudart.so.13",
    "nvidia-cublas": "libcublas.so.13",
}
_PLACEHOLDER = re.compile(r"^0+(\.0+)*([._-]?(a|alpha|dev|rc|b)\d*)?$")


def site_dirs():
    return [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]


def find_library(lib, sites):
    """The venv's own copy of a CUDA library (site-packages/nvidia/*/lib/<lib>), or None."""
    for site in sites:
        base = os.path.join(site, "nvidia")
        if not os.path.isdir(base):
            continue
        for sub in sorted(os.listdir(base)):
            path = os.path.join(base, sub, "lib", lib)
            if os.path.exists(path):
                return path
    return None


def cuda_library_problems(packages, sites):
    """Why the venv's CUDA library wheels cannot work: placeholders, libraries missing or not
    loadable from the venv. Only CUDA 13 wheels (name or -cu13) are checked."""
    import ctypes

    problems = []
    by_name = {canonical(name): version for name, version in packages.items()}
    for dist, lib in CUDA_LIBRARIES.items():
        name = next((n for n in (dist, dist + "-cu13") if n in by_name), None)
        if name is None:
            continue
        version = by_name[name]
        if _PLACEHOLDER.match(version):
            problems.append(
                f"{name} {version} is a placeholder wheel, so {lib} is missing (the failure log's "
                f"vLLM died of exactly this; docs/sources.md, nvrtc placeholder wheel): "
                f"force-reinstall {name}"
            )
            continue
        if name == dist and not version.startswith("13"):
            continue  # a CUDA 12 build of the plain name: not a cu13 library
        path = find_library(lib, sites)
        if path is None:
            problems.append(f"{name} {version} is installed but {lib} is not in the venv")
            continue
        try:
            ctypes.CDLL(path)
        except OSError as error:
            problems.append(f"{lib} from the venv does not load: {error}")
    return problems


def torch_devices(torch, cuda_runtime, spec):
    """The GPUs torch sees under this driver: as many as nvidia-smi lists, each of the compute
    capability nvidia-smi gives it. Initialising CUDA here is what raises error 804 (a runtime
    newer than the driver) before the venv goes live, not at the engine's first start."""
    devices = torch.cuda.device_count()
    print(f"smoke: torch {torch.__version__} (CUDA {cuda_runtime}) sees {devices} GPU(s)")
    if devices != spec["gpus"]:
        raise SystemExit(
            f"smoke: torch.cuda.device_count() is {devices} but nvidia-smi lists "
            f"{spec['gpus']} GPU(s)"
        )
    for index, want in enumerate(spec.get("compute_caps") or []):
        try:
            major, minor = torch.cuda.get_device_capability(index)
        except Exception as error:  # torch raises RuntimeError, CUDA errors vary
            raise SystemExit(f"smoke: torch cannot initialise GPU {index}: {error}") from None
        if want and f"{major}.{minor}" != want:
            raise SystemExit(
                f"smoke: torch sees GPU {index} as compute capability {major}.{minor}, "
                f"nvidia-smi as {want}"
            )
        print(f"smoke: GPU {index}: compute capability {major}.{minor}")
    return devices


def offload_check(engine, spec):
    """A GPU recipe's llama.cpp must offload: a CPU build passes every other check, starts,
    answers health and decodes on the CPU (--n_gpu_layers -1 is then silently ignored)."""
    supports = getattr(engine, "llama_supports_gpu_offload", None)
    if supports is None or not supports():
        raise SystemExit(
            f"smoke: {spec['module']} cannot offload to the GPU "
            "(llama_supports_gpu_offload() is False: a CPU build, e.g. a CPU wheel in the "
            "package source won over the CUDA source build); the venv is for a GPU recipe"
        )
    print(f"smoke: {spec['module']} offloads to the GPU "
          f"(built for CUDA architectures {spec.get('cuda_architectures')})")


def main():
    spec = json.loads(sys.argv[1])
    packages = installed()
    problems = cuda_library_problems(packages, site_dirs())
    if problems:
        raise SystemExit("smoke: " + "; ".join(problems))
    module = spec["module"] or import_name(spec["packages"][0])
    imported = importlib.import_module(module)
    print(f"smoke: import {module} ok ({getattr(imported, '__file__', '?')})")
    cuda_runtime, torch = runtime_cuda(packages)
    devices = None
    runtime, supported = cuda_pair(cuda_runtime), cuda_pair(spec["cuda"])
    if runtime and supported:
        if runtime > supported:
            needed = spec["driver_for_cuda"].get(f"{runtime[0]}.{runtime[1]}", "a newer one")
            raise SystemExit(
                f"smoke: this venv carries the CUDA {cuda_runtime} runtime but driver "
                f"{spec['driver']} supports CUDA {spec['cuda']} at most: it would fail with CUDA "
                f"error 804; it needs driver >= {needed}"
            )
    if torch is not None and spec["gpus"] is not None:
        devices = torch_devices(torch, cuda_runtime, spec)
    if spec.get("gpu_offload"):
        offload_check(imported, spec)
    manifest = {
        "rigbook_manifest": 1,
        "name": spec["name"],
        "engine": spec["engine"],
        "build": spec["build"],
        "spec_hash": spec["spec_hash"],
        "spec": spec["spec"],
        "source": spec["source"],
        "python": sys.version.split()[0],
        "packages": dict(sorted(packages.items(), key=lambda item: canonical(item[0]))),
        "driver": spec["driver"],
        "cuda": spec["cuda"],
        "cuda_runtime": cuda_runtime,
        "cuda_devices": devices,
        "gpu_offload": bool(spec.get("gpu_offload")),
        "cuda_architectures": spec.get("cuda_architectures"),
        "smoke_import": module,
        "services": spec["services"],
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = spec["manifest"]
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print(f"smoke: manifest written to {path}")


if __name__ == "__main__":
    main()
