"""cu13 serving venvs: built with uv, smoke-tested, swapped in atomically, rebuilt on a driver bump.

Each engine runs from its own venv. A venv is built against the CUDA 13 stack of the driver it
meets, and a driver bump can move the ABI under it; the fix is a rebuild, and a rebuild that
fails must not take the working venv away. So:

- every build goes to its own directory, /opt/rigbook/venvs/<name>-<spec hash>-<UTC stamp>
  (the hash covers the venv's spec and the package source; the stamp tells two builds of one
  spec apart, e.g. before and after a driver bump);
- uv installs into it, then the venv's own Python runs files/venvs/smoke.py: it imports the
  engine (or the first package), checks torch's CUDA runtime against the driver and
  torch.cuda.device_count() against nvidia-smi, and only then writes rigbook-manifest.json;
- only then the stable path /opt/rigbook/venvs/<name>, a symlink, moves to it (`ln -sfn` to a
  temp name, `mv -T` over the link: rename(2) is atomic), services named in venvs[].services
  are restarted if running, and builds beyond venvs_keep are pruned;
- a failure at any step removes the half-built directory and fails the rig with the output
  tail; the symlink, the old build and running services are untouched;
- while it runs, its phases and uv's counts show in pyinfra's output (BuildProgress, read from
  the build log every few seconds by rigbook.core.progress).

A kept build whose spec matches again (a pin reverted in the inventory) and that is current
for the driver is swapped back in without building. The converge (deploys/rig.py) builds missing
or changed venvs but never rebuilds a stale one (built for another driver): it warns "stale:
built for driver X, running Y: run deploys/venvs.py" and changes nothing. deploys/venvs.py does
what the converge does and also rebuilds exactly the stale ones (all with rebuild_all).
docs/venvs.md and docs/runbooks/rebuild-venvs.md say the same for operators.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pyinfra import host
from pyinfra.api import FactBase, QuoteString, StringCommand, deploy, operation
from pyinfra.api.exceptions import FactProcessError

from rigbook import FILES
from rigbook.core.checks import Check, Facts, Finding, Read, drift, error
from rigbook.core.errors import RigbookError
from rigbook.core.facts import GPUS, GPUS_READ, NvidiaGpus, smi_attempts, smi_script
from rigbook.core.managed import expect
from rigbook.core.messages import notice, refuse, warn_once
from rigbook.core.pins import VENVS_DIR, venv_link
from rigbook.core.progress import WatchedBuild, progress_every
from rigbook.core.render import render, template_commands
from rigbook.core.runfacts import once
from rigbook.core.spec import Rig, VenvSpec
from rigbook.core.tools import UV, package_source_args, tools_venv
from rigbook.core.units import start_shell
from rigbook.roles.cuda import (
    DRIVER_FOR_CUDA,
    check_driver,
    driver_problem,
    required_driver,
    version_tuple,
)

MANIFEST = "rigbook-manifest.json"
#: uv's cache on the venvs' filesystem, so that installs hardlink instead of copying.
UV_CACHE = "/opt/rigbook/cache/uv"
#: Where uv puts a Python it downloads (a venv asks for 3.12 on a host that has 3.11).
PYTHON_DIR = "/opt/rigbook/python"
#: PATH after the venv's own bin in the launcher environment (systemd's default PATH).
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Bump when a change to the build procedure must rebuild every venv (it is in the spec hash).
RECIPE = 1
#: Lines of the build log a failed build shows.
TAIL_LINES = 40

TEMPLATES = FILES / "venvs"
ENV_TEMPLATE = TEMPLATES / "venv.env.j2"

#: The module an engine's smoke test imports.
ENGINE_MODULES = {"vllm": "vllm", "sglang": "sglang", "llama-cpp-python": "llama_cpp"}

_STAMP = re.compile(r"^\d{8}T\d{6}Z$")


# --- pins ------------------------------------------------------------------------------------


# --- spec hash, builds, pruning --------------------------------------------------------------


def spec_hash(spec: VenvSpec, rig: Rig) -> str:
    """12 hex digits over what decides a venv's contents: its spec (not the services that run
    from it) and the package source; RECIPE too, so a changed build procedure rebuilds.

    Fields left at their default are not hashed: a new VenvSpec field with a default keeps
    every existing venv's hash.
    """
    payload = {
        "recipe": RECIPE,
        "spec": spec.model_dump(mode="json", exclude={"services"}, exclude_defaults=True),
        "source": {"find_links": rig.python_find_links, "no_index": rig.python_no_index},
    }
    if cuda_build(spec, rig):
        payload["build"] = "cuda"  # a CPU build of the same pins is another venv
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build_name(name: str, digest: str, stamp: str) -> str:
    """The directory of one build: <name>-<spec hash>-<UTC stamp>."""
    return f"{name}-{digest}-{stamp}"


def build_stamp(now: float | None = None) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


def is_build_of(name: str, entry: str) -> bool:
    """Whether a directory name under VENVS_DIR is a build of venv `name` (not of 'name-x')."""
    prefix = f"{name}-"
    if not entry.startswith(prefix):
        return False
    digest, _, stamp = entry[len(prefix):].partition("-")
    return bool(re.match(r"^[0-9a-f]{12}$", digest)) and bool(_STAMP.match(stamp))


def prune_selection(
    builds: Mapping[str, Mapping | None], keep: int, live: str | None = None,
    prefer: str | None = None,
) -> list[str]:
    """Builds to remove so that `live` (the symlink's target) plus `keep` others remain.

    Complete builds (with a manifest) other than `live` are kept newest first, `prefer` (the
    build a new one replaces: the one to roll back to) before all others; incomplete ones (no
    manifest: a build that was cut off) always go.
    """
    incomplete = sorted(b for b, manifest in builds.items() if manifest is None and b != live)
    complete = [b for b, manifest in builds.items() if manifest is not None and b != live]
    complete.sort(key=lambda b: b.rsplit("-", 1)[1], reverse=True)
    complete.sort(key=lambda b: b != prefer)  # stable: prefer first, then newest first
    return incomplete + complete[keep:]


def swap_commands(root: str, name: str, build: str) -> list[str]:
    """Point root/name at root/build atomically: a new link under a temp name renamed over it."""
    link, temp, target = f"{root}/{name}", f"{root}/.{name}.swap", f"{root}/{build}"
    return [
        f"ln -sfn {shlex.quote(target)} {shlex.quote(temp)}",
        f"mv -T {shlex.quote(temp)} {shlex.quote(link)}",
    ]


# --- staleness -------------------------------------------------------------------------------


def staleness(manifest: Mapping | None, live_driver: str | None) -> str | None:
    """Why a built venv no longer matches the running driver, or None when it does.

    Stale when the driver version differs from the one it was built with. None also when the
    rig reports no driver now (nothing to compare: the GPU layer's own checks say why).
    """
    if manifest is None or live_driver is None:
        return None
    built = manifest.get("driver")
    if built is None:
        return f"built without a GPU driver, running {live_driver}"
    if built != live_driver:
        return f"built for driver {built}, running {live_driver}"
    return None


def incompatibility(manifest: Mapping | None, live_driver: str | None) -> str | None:
    """Why the venv's CUDA runtime cannot run on the live driver (CUDA error 804), or None."""
    if manifest is None or live_driver is None or not manifest.get("cuda_runtime"):
        return None
    try:
        needed = required_driver(manifest["cuda_runtime"])
    except ValueError:
        return None
    if version_tuple(live_driver) < version_tuple(needed):
        return (
            f"its CUDA {manifest['cuda_runtime']} runtime needs driver >= {needed}, running "
            f"{live_driver} (CUDA error 804)"
        )
    return None


# --- the launcher environment ----------------------------------------------------------------


@dataclass(frozen=True)
class VenvLayout:
    """What the launcher environment depends on in a venv, as the rig has it."""

    venv: str  # the venv's path (rigbook uses the stable symlink, so swaps keep it)
    site_packages: str
    cu13: tuple[str, ...] | None  # entries of site-packages/nvidia/cu13; None: no such dir
    cu13_nvcc: bool  # site-packages/nvidia/cu13/bin/nvcc exists
    path_nvcc: str | None  # nvcc on the launcher's PATH (venv bin + BASE_PATH), if any
    path_nvcc_release: str | None = None  # its `nvcc --version` release ("13.0"), if it said

    @property
    def path_nvcc_matches(self) -> bool:
        """The nvcc on PATH is of the venv's CUDA major (13): an older one next to a cu13 venv
        is the failure log's dead end (docs/sources.md, "FlashInfer sampler and nvcc")."""
        release = self.path_nvcc_release or ""
        return self.path_nvcc is not None and release.split(".")[0] == VENV_CUDA_MAJOR

    @property
    def cuda_home(self) -> str | None:
        return f"{self.site_packages}/nvidia/cu13" if self.cu13 is not None else None

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, with the environment it gives (`pyinfra @rig fact ...`)."""
        return {**asdict(self), "environment": venv_environment(self)}


def venv_environment(layout: VenvLayout, base_path: str = BASE_PATH) -> dict[str, str]:
    """The environment an engine runs with from this venv.

    CUDA_HOME points into the venv's own nvidia/cu13 (these hosts have no system toolkit, and
    FlashInfer's JIT looks there); PATH starts with the venv's bin (then CUDA_HOME/bin when it
    holds nvcc); VLLM_USE_FLASHINFER_SAMPLER=0 unless an nvcc of the venv's CUDA major (13)
    exists, in CUDA_HOME/bin or on PATH: an older nvcc on PATH (a system 12.x toolkit) made
    FlashInfer's JIT fail on a CUDA-13-only flag (docs/sources.md, "FlashInfer sampler and
    nvcc"), so it counts as no nvcc.
    """
    env: dict[str, str] = {}
    path = [f"{layout.venv}/bin"]
    cuda_home = layout.cuda_home
    if cuda_home is not None:
        env["CUDA_HOME"] = cuda_home
        if layout.cu13_nvcc:
            path.append(f"{cuda_home}/bin")
    env["PATH"] = ":".join([*path, base_path])
    env["VIRTUAL_ENV"] = layout.venv
    if not layout.cu13_nvcc and not layout.path_nvcc_matches:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


def restart_marker(root: str, name: str) -> str:
    """The restart-pending marker of a venv: the units a swap has not restarted yet."""
    return f"{root}/.{name}.restart"


def env_file(name: str) -> str:
    """The launcher environment file of a venv (systemd EnvironmentFile= / `set -a; .`)."""
    return f"{VENVS_DIR}/{name}.env"


# --- facts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VenvState:
    """A venv's stable symlink and its builds on the rig."""

    target: str | None  # the symlink's target, as readlink prints it; None: no symlink
    not_link: bool  # the stable path exists but is not a symlink (someone's own venv)
    builds: dict[str, dict | None]  # build dir name -> its manifest (None: no manifest)
    #: Units a swap left to restart (a build cut off between its swap and its restarts).
    restart_pending: tuple[str, ...] = ()

    @property
    def target_build(self) -> str | None:
        """The build the symlink points at, when it points at one of this venv's builds."""
        if self.target is None:
            return None
        base = self.target.rstrip("/").rsplit("/", 1)[-1]
        return base if base in self.builds else None

    @property
    def manifest(self) -> dict | None:
        build = self.target_build
        return self.builds.get(build) if build else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "target_build": self.target_build}


_VENV, _TARGET, _NOTLINK, _BUILD, _RESTART = (
    "##RIGBOOK_VENV", "##RIGBOOK_TARGET", "##RIGBOOK_NOTLINK", "##RIGBOOK_BUILD",
    "##RIGBOOK_RESTART",
)


class VenvBuilds(FactBase[VenvState]):
    """
    The stable symlink /opt/rigbook/venvs/<name> and every build of that venv with its manifest.

    Output (a build's manifest follows its line; a build without one was cut off; a RESTART
    line is a unit that a swap left to restart, from its restart-pending marker)::

        ##RIGBOOK_VENV demo
        ##RIGBOOK_TARGET /opt/rigbook/venvs/demo-3f2a9c1b7d4e-20261129T202754Z
        ##RIGBOOK_RESTART rigbook-serve.service
        ##RIGBOOK_BUILD demo-3f2a9c1b7d4e-20261129T202754Z
        {"rigbook_manifest": 1, "spec_hash": "3f2a9c1b7d4e", "driver": "580.95.05", ...}
    """

    def command(self, venv_name: str) -> str:
        name = venv_name
        root, link = shlex.quote(VENVS_DIR), shlex.quote(venv_link(name))
        return (
            f"echo '{_VENV}' {shlex.quote(name)}; "
            f"if [ -L {link} ]; then echo \"{_TARGET} $(readlink {link})\"; "
            f"elif [ -e {link} ]; then echo '{_NOTLINK}'; fi; "
            f"[ -f {shlex.quote(restart_marker(VENVS_DIR, name))} ] && "
            f"sed 's/^/{_RESTART} /' {shlex.quote(restart_marker(VENVS_DIR, name))}; "
            f"for b in {root}/{shlex.quote(name)}-*; do "
            '[ -d "$b" ] && [ ! -L "$b" ] || continue; '
            f'echo "{_BUILD} ${{b##*/}}"; '
            f'if [ -f "$b/{MANIFEST}" ]; then cat "$b/{MANIFEST}"; echo; fi; '
            "done; true"
        )

    def process(self, output: list[str]) -> VenvState:
        return parse_venv_builds(output)


def parse_venv_builds(output: list[str]) -> VenvState:
    """VenvBuilds' output -> VenvState (builds of other venvs that share the prefix dropped)."""
    name, target, not_link = None, None, False
    pending: list[str] = []
    chunks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in output:
        if line.startswith(_RESTART):
            pending.append(line[len(_RESTART):].strip())
        elif line.startswith(_VENV):
            name = line[len(_VENV):].strip()
        elif line.startswith(_TARGET):
            target = line[len(_TARGET):].strip() or None
        elif line.strip() == _NOTLINK:
            not_link = True
        elif line.startswith(_BUILD):
            current = chunks.setdefault(line[len(_BUILD):].strip(), [])
        elif current is not None:
            current.append(line)
    if name is None:
        raise FactProcessError(f"no venv name in the VenvBuilds output: {output!r}")
    builds: dict[str, dict | None] = {}
    for build, lines in chunks.items():
        if not is_build_of(name, build):
            continue
        text = "\n".join(lines).strip()
        try:
            manifest = json.loads(text) if text else None
        except json.JSONDecodeError:
            manifest = None  # a torn manifest is no manifest: that build did not finish
        builds[build] = manifest if isinstance(manifest, dict) else None
    return VenvState(target, not_link, builds, tuple(unit for unit in pending if unit))


_SITE, _CU13, _CU13_NVCC, _NVCC = "##SITE", "##CU13", "##CU13_NVCC", "##NVCC"
_NVCC_RELEASE = "##NVCC_RELEASE"
#: The CUDA major the venvs are built for (torch cu130): an nvcc of another major does not count.
VENV_CUDA_MAJOR = "13"


class VenvLayoutFact(FactBase[VenvLayout | None]):
    """
    The venv's site-packages, its nvidia/cu13 dir and where nvcc is; None when no venv is there.

    ``venv`` is a venv's path (rigbook's are /opt/rigbook/venvs/<name>). Output of the torch
    venv on the H200 host (tests/fixtures/nvidia-h200/python-cuda.txt)::

        ##SITE /opt/torch/.venv/lib/python3.12/site-packages
        ##CU13 include lib
        ##NVCC
    """

    def command(self, venv: str) -> str:
        v = shlex.quote(venv)
        path = shlex.quote(f"{venv}/bin:{BASE_PATH}")
        return (
            f"[ -x {v}/bin/python ] || exit 0; "
            f"for sp in {v}/lib/python3*/site-packages; do break; done; "
            f'echo "{_SITE} $sp"; c="$sp/nvidia/cu13"; '
            f'if [ -d "$c" ]; then echo "{_CU13} $(ls -1 "$c" | tr "\\n" " ")"; fi; '
            f'if [ -x "$c/bin/nvcc" ]; then echo "{_CU13_NVCC}"; fi; '
            f'n=$(PATH={path} command -v nvcc); echo "{_NVCC} $n"; '
            f'if [ -n "$n" ]; then echo "{_NVCC_RELEASE} $("$n" --version 2>/dev/null '
            f"| sed -n 's/.*release \\([0-9][0-9.]*\\).*/\\1/p' | head -n 1)\"; fi"
        )

    def process(self, output: list[str]) -> VenvLayout | None:
        site = cu13 = nvcc = release = None
        cu13_nvcc = False
        for line in output:
            if line.startswith(_NVCC_RELEASE):
                release = line[len(_NVCC_RELEASE):].strip() or None
            elif line.startswith(_CU13_NVCC):
                cu13_nvcc = True
            elif line.startswith(_SITE):
                site = line[len(_SITE):].strip()
            elif line.startswith(_CU13):
                cu13 = tuple(line[len(_CU13):].split())
            elif line.startswith(_NVCC):
                nvcc = line[len(_NVCC):].strip() or None
        if not site:
            raise FactProcessError(f"no site-packages in the venv layout output: {output!r}")
        venv = site.split("/lib/python3", 1)[0]
        return VenvLayout(venv, site, cu13, cu13_nvcc, nvcc, release)


#: The plain table's header: "Driver Version: 580.95.05  CUDA Version: 13.0", and from the 610
#: drivers on "KMD Version: 610.57.04  CUDA UMD Version: 13.3"; old drivers print no CUDA, WSL2
#: may print "ERR!" and some "N/A".
_DRIVER = re.compile(r"(?:Driver|KMD) Version:\s*(\d+\.\d+(?:\.\d+)?)")
_CUDA = re.compile(r"CUDA (?:UMD )?Version:\s*(\d+\.\d+)")


def parse_smi_header(text: str) -> tuple[str, str | None] | None:
    """(driver, CUDA or None) from plain `nvidia-smi` output's header; None without a driver."""
    driver, cuda = _DRIVER.search(text), _CUDA.search(text)
    return (driver.group(1), cuda.group(1) if cuda else None) if driver else None


class NvidiaSmiHeader(FactBase[tuple[str, str] | None]):
    """
    (driver version, highest CUDA version the driver supports) from plain ``nvidia-smi``.

    None when there is no nvidia-smi or it fails. The header line (real, H200)::

        | NVIDIA-SMI 580.159.04             Driver Version: 580.159.04     CUDA Version: 13.0     |
    """

    def command(self) -> str:
        return smi_script("")

    def process(self, output: list[str]) -> tuple[str, str] | None:
        attempts = smi_attempts(output)
        if attempts is None:
            return None
        for _, lines, status in attempts:
            if status == 0:
                return parse_smi_header("\n".join(lines))
        return None


@dataclass(frozen=True)
class LiveDriver:
    """The driver a venv meets now."""

    version: str | None  # None: no GPU layer on this rig (no nvidia-smi anywhere)
    cuda: str | None  # highest CUDA the driver supports (nvidia-smi's header)
    gpus: int | None  # GPUs nvidia-smi lists
    broken: str | None = None  # nvidia-smi exists but fails: why
    compute_caps: tuple[str, ...] = ()  # each GPU's compute capability ("9.0"), as listed


def live_driver() -> LiveDriver:
    """Read inside an operation: the rig's driver as it is at that moment of the run."""
    probe = once(NvidiaGpus)
    if probe is None:
        return LiveDriver(None, None, None)
    if not probe.ok or not probe.gpus:
        return LiveDriver(None, None, None, broken=f"{probe.smi}: {probe.error or 'no GPUs'}")
    header = once(NvidiaSmiHeader)
    cuda = header[1] if header else None
    caps = tuple(gpu.compute_cap or "" for gpu in probe.gpus)
    return LiveDriver(probe.driver_version, cuda, len(probe.gpus), compute_caps=caps)


# --- decisions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What venv_build does about one venv, and why (said to the operator)."""

    action: Literal["keep", "build", "swap", "warn", "refuse"]
    reason: str
    build: str | None = None  # swap: the kept build to point the symlink at


def reusable_build(state: VenvState, digest: str, driver: LiveDriver) -> str | None:
    """The newest kept build of this spec that is current for the live driver, if any.

    Reverting a pin in the inventory then swaps back to the kept build instead of building it
    again: that is the rollback venvs_keep keeps builds for.
    """
    fits = [
        build for build, manifest in state.builds.items()
        if manifest is not None and build != state.target_build
        and manifest.get("spec_hash") == digest
        and staleness(manifest, driver.version) is None
        and incompatibility(manifest, driver.version) is None
    ]
    return max(fits, key=lambda b: b.rsplit("-", 1)[1], default=None)


def decide(
    rig_name: str, spec: VenvSpec, digest: str, state: VenvState, driver: LiveDriver,
    rebuild_stale: bool = False, rebuild_all: bool = False,
) -> Decision:
    """Keep, build, swap to a kept build, warn (stale in a converge, or the GPU layer is down)
    or refuse one venv."""
    link = venv_link(spec.name)
    if state.not_link:
        return Decision(
            "refuse",
            f"{rig_name}: {link} exists and is not rigbook's symlink: move it away; nothing "
            "was built",
        )
    if driver.broken is not None:
        return Decision(
            "warn",
            f"venv {spec.name}: GPU layer not usable ({driver.broken}): not checked or built; "
            "run again once nvidia-smi works",
        )
    if rebuild_stale and rebuild_all:
        return Decision("build", "rebuild_all")
    manifest = state.manifest
    if manifest is None:
        why = (
            f"{link} -> {state.target}, which is not a finished build"
            if state.target else "not built yet"
        )
    elif manifest.get("spec_hash") != digest:
        why = f"spec changed ({manifest.get('spec_hash')} -> {digest})"
    else:
        stale = staleness(manifest, driver.version)
        if stale is None:
            return Decision(
                "keep",
                f"venv {spec.name} is already {state.target_build} (built for driver "
                f"{manifest.get('driver')})",
            )
        if not rebuild_stale:
            broken = incompatibility(manifest, driver.version)
            if broken is not None:
                return Decision(
                    "refuse",
                    f"{rig_name}: venv {spec.name} is stale and cannot run: {broken}: run "
                    "deploys/venvs.py (and check the pins against the driver)",
                )
            return Decision("warn", f"venv {spec.name} is stale: {stale}: run deploys/venvs.py")
        why = f"stale: {stale}"
    kept = reusable_build(state, digest, driver)
    if kept is not None:
        return Decision("swap", f"{why}; {kept} is a kept build of this spec", kept)
    return Decision("build", why)


# --- the CUDA build of llama.cpp --------------------------------------------------------------


#: The CUDA toolkit wheels a llama.cpp build gets when the rig has no nvcc of its own: the
#: compiler, the runtime and cuBLAS (headers and libraries), and CCCL (CUB/Thrust headers), all
#: of the CUDA release the driver supports; they install into the venv's nvidia/cu13.
TOOLKIT_WHEELS = ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cuda-cccl")


def cuda_build(spec: VenvSpec, rig: Rig) -> bool:
    """Whether this venv's engine is built for the GPU: a llama.cpp venv is (llama-cpp-python
    from the default index is a source build that runs on the CPU unless told otherwise),
    except the venv of the rig's recipe when that recipe is cpu_only."""
    if spec.engine != "llama-cpp-python":
        return False
    from rigbook.roles.recipes import catalogue  # recipes imports this module

    try:
        recipe = catalogue(rig.serving_recipe_dirs).get(rig.recipe) if rig.recipe else None
    except RigbookError:  # a broken recipe folder is the serving check's finding
        recipe = None
    return not (recipe is not None and recipe.venv == spec.name and recipe.cpu_only)


@dataclass(frozen=True)
class Nvcc:
    """An nvcc on the rig outside any venv (a system CUDA toolkit)."""

    path: str
    release: str | None  # `nvcc --version`'s release, "13.0"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class SystemNvcc(FactBase[Nvcc | None]):
    """
    The system CUDA compiler: nvcc on PATH, else /usr/local/cuda/bin/nvcc; None when neither.

    Output (the H200 host, tests/fixtures/nvidia-h200/serve/first-call.txt)::

        /usr/local/cuda/bin/nvcc
        13.0
    """

    def command(self) -> str:
        return (
            'for n in "$(command -v nvcc)" /usr/local/cuda/bin/nvcc; do '
            '[ -n "$n" ] && [ -x "$n" ] || continue; echo "$n"; '
            "\"$n\" --version 2>/dev/null | sed -n 's/.*release \\([0-9][0-9.]*\\).*/\\1/p' "
            "| head -n 1; break; done; true"
        )

    def process(self, output: list[str]) -> Nvcc | None:
        lines = [line.strip() for line in output if line.strip()]
        if not lines:
            return None
        return Nvcc(lines[0], lines[1] if len(lines) > 1 else None)


def cuda_architectures(caps: Iterable[str]) -> str:
    """CMAKE_CUDA_ARCHITECTURES from nvidia-smi's compute capabilities: ("8.6", "8.6") -> "86";
    one build for the rig's own cards only, much faster than all architectures."""
    archs = set()
    for cap in caps:
        if not re.fullmatch(r"\d+\.\d+", cap or ""):
            raise RigbookError(f"compute capability {cap!r} is not MAJOR.MINOR")
        archs.add(cap.replace(".", ""))
    if not archs:
        raise RigbookError("nvidia-smi listed no compute capability")
    return ";".join(sorted(archs, key=int))


@dataclass(frozen=True)
class CudaBuild:
    """How a llama.cpp venv is compiled for the rig's GPUs."""

    architectures: str  # CMAKE_CUDA_ARCHITECTURES, "90"
    nvcc: str | None  # the system nvcc; None: the toolkit wheels below
    toolkit: tuple[str, ...] = ()  # requirements installed first, nvcc from the venv

    def config_settings(self) -> tuple[str, ...]:
        """`uv pip install -C` settings: CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=..."
        said as scikit-build-core config settings, which uv keys its built-wheel cache on (an
        environment variable is not, so a cached CPU wheel would come back)."""
        return (
            "-C", "cmake.define.GGML_CUDA=on",
            "-C", f"cmake.define.CMAKE_CUDA_ARCHITECTURES={self.architectures}",
        )


def cuda_build_of(driver: LiveDriver, nvcc: Nvcc | None) -> CudaBuild:
    """The system nvcc when its CUDA release is one the driver runs, else the toolkit wheels of
    the driver's CUDA release; RigbookError when neither can be chosen."""
    archs = cuda_architectures(driver.compute_caps)
    supported = version_tuple(driver.cuda) if driver.cuda else None
    if nvcc is not None and nvcc.release and (
            supported is None or version_tuple(nvcc.release) <= supported):
        return CudaBuild(archs, nvcc.path)
    if driver.cuda is None:
        raise RigbookError(
            "no nvcc on the rig and nvidia-smi names no CUDA release to fetch a compiler for"
        )
    return CudaBuild(archs, None, tuple(f"{name}=={driver.cuda}.*" for name in TOOLKIT_WHEELS))


# --- the build script ------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildPlan:
    """Everything one build needs; build_script() turns it into the shell that runs on the rig."""

    name: str
    build: str
    python: str
    install_args: tuple[str, ...]
    uv_env: dict[str, str]
    smoke_input: dict[str, Any]
    prune: tuple[str, ...] = ()
    services: tuple[str, ...] = ()
    uv: str = UV
    root: str = VENVS_DIR
    cache: str = UV_CACHE
    reuse: bool = False  # `build` is a kept, finished build: only swap to it
    cuda: CudaBuild | None = None  # llama.cpp compiled for the rig's GPUs

    @property
    def log(self) -> str:
        return f"{self.root}/.{self.name}.build.log"

    @property
    def lock(self) -> str:
        """flock'ed by the build that runs: one build of a venv at a time."""
        return f"{self.root}/.{self.name}.lock"


def install_args(spec: VenvSpec, rig: Rig, cuda: CudaBuild | None = None) -> tuple[str, ...]:
    """`uv pip install` options and requirements: the rig's package source, torch's backend,
    llama.cpp's CUDA settings."""
    args = package_source_args(rig) + list(cuda.config_settings() if cuda else ())
    if not rig.python_no_index:
        args += ["--torch-backend", spec.torch_backend]
        for url in spec.extra_index_urls:
            args += ["--extra-index-url", url]
    return (*args, *spec.packages)


def uv_environment(rig: Rig, cache: str = UV_CACHE, cuda: CudaBuild | None = None
                   ) -> dict[str, str]:
    env = {"UV_CACHE_DIR": cache, "UV_PYTHON_INSTALL_DIR": PYTHON_DIR, "UV_NO_PROGRESS": "1"}
    if rig.python_no_index:
        env["UV_PYTHON_DOWNLOADS"] = "never"
    if cuda is not None and cuda.nvcc is not None:
        env["CUDACXX"] = cuda.nvcc
    return env


def smoke_input(
    spec: VenvSpec, rig: Rig, digest: str, build: str, driver: LiveDriver, root: str = VENVS_DIR,
    cuda: CudaBuild | None = None,
) -> dict[str, Any]:
    """What files/venvs/smoke.py gets (argv[1], JSON) and copies into the manifest."""
    return {
        "name": spec.name,
        "engine": spec.engine,
        "build": build,
        "manifest": f"{root}/{build}/{MANIFEST}",
        "module": ENGINE_MODULES.get(spec.engine),
        "packages": list(spec.packages),
        "spec_hash": digest,
        "spec": spec.model_dump(mode="json"),
        "source": {"find_links": rig.python_find_links, "no_index": rig.python_no_index},
        "driver": driver.version,
        "cuda": driver.cuda,
        "gpus": driver.gpus,
        "compute_caps": list(driver.compute_caps),
        "gpu_offload": cuda is not None,
        "cuda_architectures": cuda.architectures if cuda else None,
        "driver_for_cuda": DRIVER_FOR_CUDA,
        "services": list(spec.services),
    }


def build_script(plan: BuildPlan) -> str:
    """The shell that builds, smoke-tests and swaps in one venv (files/venvs/build.sh.j2)."""
    return render(
        TEMPLATES / "build.sh.j2",
        name=plan.name, build=plan.build, root=plan.root, log=plan.log, cache=plan.cache,
        lock=plan.lock, marker=restart_marker(plan.root, plan.name),
        restart=lambda unit: start_shell(unit, "try-restart"),
        uv=plan.uv, python=plan.python, install_args=plan.install_args, uv_env=plan.uv_env,
        smoke_input=json.dumps(plan.smoke_input, sort_keys=True),
        smoke_py=(TEMPLATES / "smoke.py").read_text().rstrip("\n"),
        swap=swap_commands(plan.root, plan.name, plan.build),
        prune=[f"{plan.root}/{build}" for build in plan.prune],
        services=plan.services, tail=TAIL_LINES, reuse=plan.reuse,
        packages=len(plan.smoke_input["packages"]), cuda=plan.cuda,
        site=f"lib/python{plan.python}/site-packages",
    )


# --- operations ------------------------------------------------------------------------------


def _prune_command(builds: Iterable[str]) -> StringCommand:
    return StringCommand("rm", "-rf", "--", *(QuoteString(f"{VENVS_DIR}/{b}") for b in builds))


def _pending_restarts(name: str, units: tuple[str, ...]) -> Iterator:
    """What a swap cut off before its restarts left to do: restart (if running) the units its
    marker names, then remove the marker."""
    yield notice(f"venv {name} was swapped by a run that ended before it restarted "
           f"{' '.join(units)}: restarting them now")
    for unit in units:
        yield StringCommand(f"systemctl show -p LoadState --value {shlex.quote(unit)} | "
                            f"grep -qx not-found || {start_shell(unit, 'try-restart')}")
    yield StringCommand("rm", "-f", QuoteString(restart_marker(VENVS_DIR, name)))


@operation()
def venv_build(rig: Rig, spec: VenvSpec, rebuild_stale: bool = False):
    """
    Build one serving venv when it is missing or its spec changed, smoke-test it, swap it in.

    + rig: the rig's validated host data (``rigbook.core.spec.Rig``)
    + spec: the venv (``rigbook.core.spec.VenvSpec``, one of ``rig.venvs``)
    + rebuild_stale: also rebuild a venv built for another driver (deploys/venvs.py); with
      ``rig.rebuild_all`` rebuild it even when it is current

    Reads the symlink, the builds' manifests and the live driver when it executes. Nothing runs
    when the symlink's build has this spec's hash and was built for the running driver (older
    builds beyond ``venvs_keep`` are pruned then). A kept build of this spec that is current
    for the driver (a pin reverted in the inventory) is swapped back in without building. A
    stale venv in a converge is a warning that changes nothing; one whose CUDA runtime cannot
    run on the live driver fails the rig. Before a build, a CUDA runtime that needs a newer
    driver than the rig runs fails the rig with the driver needed. The build itself
    (files/venvs/build.sh.j2) fails the rig with the tail of its log and leaves the working
    venv in place.
    """
    driver = live_driver()
    state = once(VenvBuilds, venv_name=spec.name)
    digest = spec_hash(spec, rig)
    decision = decide(
        host.name, spec, digest, state, driver, rebuild_stale=rebuild_stale,
        rebuild_all=rig.rebuild_all,
    )
    if decision.action == "refuse":
        yield refuse(decision.reason)
        return
    if decision.action in ("keep", "warn"):
        if decision.action == "warn":
            warn_once(decision.reason)
        prune = prune_selection(state.builds, rig.venvs_keep, live=state.target_build)
        if prune:
            yield _prune_command(prune)
        if state.restart_pending:
            yield from _pending_restarts(spec.name, state.restart_pending)
        if not prune and not state.restart_pending:
            host.noop(decision.reason)
        return
    if decision.action == "swap":
        build = decision.build
    else:
        try:
            check_driver(host.name, spec, driver.version)
        except RigbookError as error:
            yield refuse(str(error))
            return
        build = build_name(spec.name, digest, build_stamp())
    cuda = None
    if decision.action == "build" and cuda_build(spec, rig):
        try:
            cuda = cuda_build_of(driver, once(SystemNvcc))
        except RigbookError as error:
            yield refuse(f"{host.name}: venv {spec.name}: the CUDA build of llama.cpp: {error}")
            return
    others = {b: manifest for b, manifest in state.builds.items() if b != build}
    plan = BuildPlan(
        name=spec.name, build=build, python=spec.python,
        install_args=install_args(spec, rig, cuda), uv_env=uv_environment(rig, cuda=cuda),
        smoke_input=smoke_input(spec, rig, digest, build, driver, cuda=cuda), cuda=cuda,
        # the build it replaces may still run an engine: kept this run even with venvs_keep 0
        prune=tuple(prune_selection(others, max(rig.venvs_keep, 1), prefer=state.target_build)),
        services=spec.services, reuse=decision.action == "swap",
    )
    script = build_script(plan)
    yield (StringCommand(script) if plan.reuse
           else WatchedBuild(script, spec.name, plan.log, progress_every()))
    if state.target_build is not None and not spec.services:
        yield notice(
            f"venv {spec.name} now runs from {build} ({decision.reason}); venvs[].services names "
            f"no unit that uses it: restart what runs from {venv_link(spec.name)} yourself"
        )


@operation()
def venv_env_file(rig: Rig, spec: VenvSpec):
    """
    Write the launcher environment of a venv, /opt/rigbook/venvs/<name>.env.

    + rig: the rig's validated host data (``rigbook.core.spec.Rig``)
    + spec: the venv (``rigbook.core.spec.VenvSpec``)

    ``KEY=value`` lines (a systemd ``EnvironmentFile=``, or ``set -a; . FILE; set +a``) from
    ``venv_environment``: CUDA_HOME in the venv's nvidia/cu13, PATH with the venv's bin first,
    VLLM_USE_FLASHINFER_SAMPLER=0 where no CUDA 13 nvcc exists. Read from the venv as it is when the
    operation executes (after the build); nothing when the venv is not built.
    """
    layout = once(VenvLayoutFact, venv=venv_link(spec.name))
    if layout is None:
        host.noop(f"venv {spec.name} is not built: no {env_file(spec.name)}")
        return
    yield from template_commands(
        src=ENV_TEMPLATE, dest=env_file(spec.name), mode="644", name=spec.name,
        env=venv_environment(layout),
    )


def launcher_environment(name: str) -> dict[str, str] | None:
    """Inside an operation: the environment an engine gets from venv `name`; None: not built."""
    layout = host.get_fact(VenvLayoutFact, venv=venv_link(name))
    return venv_environment(layout) if layout is not None else None


# --- the role --------------------------------------------------------------------------------


@deploy("Python venvs")
def venvs(rig: Rig, rebuild_stale: bool = False) -> None:
    """Every venv in rig.venvs: built, smoke-tested, swapped in, with its launcher environment.

    The converge (deploys/rig.py) calls it as is: missing and changed venvs are built, stale
    ones reported. deploys/venvs.py passes rebuild_stale=True. A rig without venvs gets nothing,
    not even the tools venv.
    """
    if not rig.venvs:
        return
    if rig.rebuild_all and not rebuild_stale:
        warn_once("rebuild_all is a run option of deploys/venvs.py: the converge ignores it")
    tools_venv(rig)
    for spec in rig.venvs:
        venv_build(rig, spec, rebuild_stale=rebuild_stale, name=f"Venv {spec.name}")
        expect(env_file(spec.name))
        venv_env_file(rig, spec, name=f"Launcher environment {env_file(spec.name)}")


# --- the venvs check ---------------------------------------------------------------------------


def venv_condition(rig: Rig, spec: VenvSpec, state: VenvState, driver: str | None
                   ) -> tuple[str, str]:
    """(current | not-rigbook | missing | spec-changed | incompatible | stale, why) of one venv,
    decided in the order `decide` decides; why is "" for a current venv."""
    link = venv_link(spec.name)
    digest = spec_hash(spec, rig)
    manifest = state.manifest
    if state.not_link:
        return "not-rigbook", f"{link} exists and is not rigbook's symlink: move it away"
    if manifest is None:
        built = (f"{link} -> {state.target}, which is not a finished build" if state.target
                 else "not built")
        return "missing", f"{built}: deploys/rig.py builds it"
    if manifest.get("spec_hash") != digest:
        return "spec-changed", (f"spec changed ({manifest.get('spec_hash')} -> {digest}): "
                                "deploys/rig.py rebuilds it")
    broken = incompatibility(manifest, driver)
    if broken is not None:
        return "incompatible", (f"cannot run: {broken}: run deploys/venvs.py (and check the "
                                "pins against the driver)")
    stale = staleness(manifest, driver)
    if stale is not None:
        return "stale", f"stale: {stale}: run deploys/venvs.py"
    return "current", ""


def _venv_findings(rig: Rig, facts: Facts, rebuild: bool) -> list[Finding]:
    names = [f"venvs:{spec.name}" for spec in rig.venvs]
    if facts.missing(*names):
        return facts.missing(*names)
    probe = facts.probe
    driver = probe.driver_version if probe is not None and probe.ok and probe.gpus else None
    found = []
    for spec in rig.venvs:
        state = (facts.venvs or {}).get(spec.name)
        if state is None:
            continue
        kind, why = venv_condition(rig, spec, state, driver)
        refused = kind == "not-rigbook" or (kind == "incompatible" and not rebuild)
        if refused:
            found.append(error("venvs", why, key=f"venvs[{spec.name}]"))
        elif kind != "current":
            found.append(drift("venvs", f"venv {spec.name}: {why}"))
        if kind in ("missing", "spec-changed") or (rebuild and kind in ("stale", "incompatible")):
            problem = driver_problem(spec, driver)
            if problem:
                found.append(error("venvs", problem, key=f"venvs[{spec.name}]"))
    return found


def _venv_reads(rig: Rig, rig_name: str) -> list[Read]:
    return [GPUS_READ] + [
        Read(f"venvs:{spec.name}", VenvBuilds, f"venv {spec.name}",
             (("venv_name", spec.name),)) for spec in rig.venvs
    ]


#: In a converge (deploys/rig.py) a venv that cannot run on the driver refuses the rig; the
#: rebuild (deploys/venvs.py) is what fixes it.
CHECKS = (GPUS, Check("venvs", _venv_reads, lambda rig, facts, name: _venv_findings(
    rig, facts, rebuild=False), gpus=True))
REBUILD_CHECKS = (GPUS, Check("venvs (rebuild)", _venv_reads, lambda rig, facts, name:
                              _venv_findings(rig, facts, rebuild=True), gpus=True))
