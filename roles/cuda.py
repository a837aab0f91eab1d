"""CUDA runtimes and drivers: which driver a venv's CUDA runtime needs, known before it is built.

A cu13 build on too old a driver crash-loops with CUDA error 804 (forward compatibility is not
supported), so the venvs role checks a venv's pins against the rig's driver first.
"""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name

from rigbook.core.errors import RigbookError
from rigbook.core.spec import VenvSpec

#: Least driver per CUDA runtime (CUDA toolkit release notes, table 3; docs/sources.md, "CUDA
#: runtime and driver"). A cu13 build
#: on an older driver fails with CUDA error 804 (forward compatibility is not supported).
DRIVER_FOR_CUDA = {"13.0": "580.65.06", "13.1": "590.44.01", "13.2": "595.45.04"}
#: CUDA runtime of torch from each torch_backend.
BACKEND_CUDA = {"cu130": "13.0"}


def version_tuple(version: str) -> tuple[int, ...]:
    """'580.95.05' -> (580, 95, 5): driver versions compare part by part."""
    if not re.match(r"^\d+(\.\d+)*$", version):
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in version.split("."))


def cuda_minor(version: str) -> str:
    """'13.0.96' / '13.0' / '13' -> '13.0' (what the driver table is keyed by)."""
    match = re.match(r"^(\d+)(?:\.(\d+))?", version)
    if not match:
        raise ValueError(f"not a CUDA version: {version!r}")
    return f"{match.group(1)}.{match.group(2) or 0}"


def required_driver(cuda_version: str) -> str:
    """The least driver that runs a CUDA `cuda_version` runtime: '13.2' -> '595.45.04'."""
    key = cuda_minor(cuda_version)
    if key not in DRIVER_FOR_CUDA:
        raise ValueError(
            f"rigbook does not know the least driver for CUDA {key}; it knows "
            f"{', '.join(DRIVER_FOR_CUDA)}"
        )
    return DRIVER_FOR_CUDA[key]


_CUDA_PIN = re.compile(
    r"^(?P<name>cuda-toolkit|nvidia-cuda-runtime(?:-cu\d+)?)(?:\[[^\]]*\])?\s*"
    r"(?:===|==|~=|>=)\s*(?P<version>\d+(?:\.\d+)?)"
)
_LOCAL_CU = re.compile(r"\+cu(?P<major>\d\d)(?P<minor>\d+)\b")


def requirement_name(requirement: str) -> str:
    """'llama-cpp-python[server]==0.3.36' -> 'llama-cpp-python'."""
    match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return match.group(1)


def spec_cuda(spec: VenvSpec) -> tuple[str, str] | None:
    """(CUDA runtime, what says so) a venv will carry, known before it is built; None: none.

    An explicit pin wins (`cuda-toolkit==13.2.*`, `nvidia-cuda-runtime==13.1.80`, a
    `torch==2.14.0+cu132` local version); else an engine venv (or any venv with torch) gets
    torch's CUDA from torch_backend.
    """
    found: list[tuple[tuple[int, ...], str, str]] = []
    for requirement in spec.packages:
        text = canonicalize_name(requirement_name(requirement)) + requirement.strip()[
            len(requirement_name(requirement)):
        ]
        pin = _CUDA_PIN.match(text)
        if pin:
            cuda = cuda_minor(pin.group("version"))
            found.append((version_tuple(cuda), cuda, requirement))
        local = _LOCAL_CU.search(requirement)
        if local:
            cuda = f"{int(local.group('major'))}.{int(local.group('minor'))}"
            found.append((version_tuple(cuda), cuda, requirement))
    if found:
        _, cuda, why = max(found)
        return cuda, why
    has_torch = any(canonicalize_name(requirement_name(r)) == "torch" for r in spec.packages)
    if spec.engine != "none" or has_torch:
        return BACKEND_CUDA[spec.torch_backend], f"torch_backend {spec.torch_backend}"
    return None


def driver_problem(spec: VenvSpec, driver: str | None) -> str | None:
    """Why the venv's CUDA runtime cannot run on `driver` (what it needs, what the rig runs),
    or None. No driver (a rig without a GPU layer) is not checked.

    Checked before anything is built: a cu13 build on too old a driver crash-loops with CUDA
    error 804.
    """
    cuda = spec_cuda(spec)
    if cuda is None or driver is None:
        return None
    version, why = cuda
    try:
        needed = required_driver(version)
    except ValueError as e:
        return f"{why}: {e}"
    if version_tuple(driver) < version_tuple(needed):
        return (f"{why} means CUDA {version}, which needs driver >= {needed}; this rig runs "
                f"{driver}: the venv would fail with CUDA error 804. Bump the driver "
                "(deploys/driver.py) or pin an older CUDA")
    return None


def check_driver(rig_name: str, spec: VenvSpec, driver: str | None) -> None:
    """RigbookError when `driver_problem` finds one."""
    problem = driver_problem(spec, driver)
    if problem:
        raise RigbookError(f"{rig_name}: venvs[{spec.name}]: {problem}; nothing was built")
