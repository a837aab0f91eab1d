"""`rigbook status`: what every rig is actually doing, and where it drifted from the inventory.

Operators look before they touch anything, so this reads and never changes. It loads the
inventory the way a deploy does (roles/inventory.py: every host validated into a `Rig`),
connects to every rig in parallel over the same pyinfra connectors (SSH, @local), reads the
facts the roles themselves decide on (roles/facts.py, apt.py, driver.py, power.py, tuning.py,
wsl.py, guards.py, venvs.py, models.py, serving.py, and the few below that no role needs), and
compares them with what each role would converge to, through the roles' own helpers: the cap a
GPU gets is power.py's, the sysctl values tuning.py's, the TDR values wsl.py's, a venv's
staleness venvs.py's, a snapshot's completeness models.py's, the serving plan and probe
serving.py's. Nothing is decided twice. Venvs, the HF cache and the serving unit are read only
on rigs that declare them.

Three layers, so tests feed real captured output to the same code:

- gathering (`gather`): pyinfra's API, one greenlet per rig; a rig that cannot be reached gets
  one clear line and the others go on;
- building (`build_rig_status`): pure, from a `RigFacts` to a pydantic `RigStatus` with its
  findings (warn / drift / gone);
- showing (`status_table`, `--json`): a rich table, or `FleetStatus` as JSON.

Exit status: 0 every rig as declared, 1 drift, 2 a rig unreachable or a GPU gone (nvidia-smi
fails, Xid 79 / 154 since the last boot, or the Xid watch's GPU-lost mark is set).
docs/status.md explains every column.

GPU facts come from nvidia-smi (roles.facts.NvidiaGpus): NVML through rigbook's own Python on
the rig (roles/gpus.py --probe) is not used here, since a rig need not have rigbook installed.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Literal

import gevent
from pydantic import BaseModel, ConfigDict, model_validator
from pyinfra.api import Config, FactBase, Inventory, QuoteString, State, StringCommand
from pyinfra.api.connect import disconnect_all
from pyinfra.api.exceptions import ConnectError, FactProcessError, NoGroupError
from pyinfra.api.facts import get_fact
from pyinfra.context import ctx_state
from pyinfra.facts.files import FileContents, FindInFile
from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

from roles.apt import AptHolds, DpkgInstalled
from roles.driver import (
    LoadedDriverVersion,
    RebootMarker,
    driver_packages,
    driver_versions,
    reboot_reasons,
    version_matches,
    wanted,
)
from roles.errors import RigbookError
from roles.facts import WSL_NVIDIA_SMI, NvidiaGpus
from roles.gpus import Gpu, GpuProbe
from roles.guards import GpuLost, GpuLostMark, gpu_lost_reason
from roles.inventory import load_inventory
from roles.models import (
    CacheState,
    ModelCache,
    human,
    label,
    prune_listing,
    snapshot_status,
    unreferenced,
)
from roles.power import TOLERANCE_W, UNIT_NAME, UNIT_PATH, asked_cap, watts
from roles.serving import ENV_PATH as SERVE_ENV_PATH
from roles.serving import HEALTH_PATH, ServePlan, ServeProbe, ServeState, probe_args, serve_plan
from roles.serving import UNIT_NAME as SERVE_UNIT
from roles.serving import UNIT_PATH as SERVE_UNIT_PATH
from roles.spec import ModelSpec, Rig, VenvSpec
from roles.tuning import (
    FSTAB,
    SHM,
    SYSCTL_CONF,
    LiveSysctl,
    LiveSysctls,
    Shm,
    ShmState,
    fstab_line,
    gib,
    same_sysctl,
    shm_differs,
    size_bytes,
    sysctl_values,
)
from roles.venvs import (
    VenvBuilds,
    VenvState,
    incompatibility,
    spec_hash,
    staleness,
    venv_link,
)
from roles.wsl import (
    GRAPHICS_DRIVERS,
    RegistryValues,
    RegProbe,
    WindowsProfile,
    WindowsProfiles,
    Wsl,
    WslSignals,
    check_platform,
    differing,
    memory_findings,
    tdr_values,
)
from roles.xid import Xid, parse_xid_lines, same_device

#: Where free disk space is reported: the root filesystem and the venvs' home (VenvSpec).
DISK_PATHS = ("/", "/opt/rigbook")
#: Below this share of free space a filesystem is flagged (a warning, not drift).
DISK_LOW = 0.10
#: Seconds one fact command may run on a rig (nvidia-smi has its own 60 s limit inside).
FACT_TIMEOUT_S = 120
#: Kernel-log Xid lines kept per section: a flapping card can log thousands.
XID_LINES = 500

_UNIT = "##RIGBOOK_UNIT##"
_ENABLED = "##RIGBOOK_ENABLED##"
_KLOG = "##RIGBOOK_KLOG##"
_EARLIER = "##RIGBOOK_KLOG_ALL_BOOTS##"
_EXEC_START = re.compile(
    r"^ExecStart=-?(?P<smi>\S+)\s+-i\s+(?P<gpu>\S+)\s+-pl\s+(?P<watts>\d+(?:\.\d+)?)\s*$"
)
_FSTAB_SHM = re.compile(r"^[^#\s]+\s+/dev/shm\s")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: What nvidia-smi calls the cards of each gpu_class ("other" is not checked).
_CLASS_NAMES = {
    "rtx3090": re.compile(r"RTX 3090(?! Ti)"),
    "rtx3090ti": re.compile(r"RTX 3090 Ti"),
    "rtx4090": re.compile(r"RTX 4090"),
    "rtx5090": re.compile(r"RTX 5090"),
    "a6000": re.compile(r"RTX A6000"),
}


# --- facts no role needs -------------------------------------------------------------------


@dataclass(frozen=True)
class PowerUnit:
    """The power-limit unit as installed: its ExecStart lines and `systemctl is-enabled`."""

    exec_starts: tuple[str, ...]
    enabled: str | None  # None: no systemctl on the host


class PowerUnitFile(FactBase[PowerUnit | None]):
    """
    The ExecStart lines of /etc/systemd/system/nvidia-power-limit.service and whether the unit
    is enabled; None when there is no unit file. Output (a converged dual-3090 rig)::

        ##RIGBOOK_UNIT##
        ExecStart=/usr/bin/nvidia-smi -i GPU-3c6f...-0 -pl 290
        ExecStart=/usr/bin/nvidia-smi -i GPU-3c6f...-1 -pl 290
        ##RIGBOOK_ENABLED## enabled
    """

    @staticmethod
    def default() -> None:
        return None

    def command(self) -> str:
        return (
            f"if [ -f {UNIT_PATH} ]; then echo '{_UNIT}'; grep '^ExecStart=' {UNIT_PATH}; "
            "if command -v systemctl >/dev/null 2>&1; then "
            f'echo "{_ENABLED} $(systemctl is-enabled {UNIT_NAME} 2>&1)"; fi; fi; true'
        )

    def process(self, output: list[str]) -> PowerUnit | None:
        if not output or output[0].strip() != _UNIT:
            raise FactProcessError(f"not the power unit probe: {output!r}")
        lines, enabled = [], None
        for line in output[1:]:
            if line.startswith(_ENABLED):
                enabled = line[len(_ENABLED):].strip()
            elif line.strip():
                lines.append(line.strip())
        return PowerUnit(tuple(lines), enabled)


def unit_caps(exec_starts: Iterable[str]) -> tuple[dict[str, float], list[str]]:
    """({GPU UUID: watts}, lines that are not `nvidia-smi -i <UUID> -pl <W>`) of a unit."""
    caps, other = {}, []
    for line in exec_starts:
        match = _EXEC_START.match(line)
        if match:
            caps[match.group("gpu")] = float(match.group("watts"))
        else:
            other.append(line)
    return caps, other


@dataclass(frozen=True)
class KernelLog:
    """Xid lines of the kernel log: this boot's and earlier boots', or why it was unreadable."""

    source: str | None  # "journalctl" or "dmesg"; None when neither could be read
    this_boot: tuple[Xid, ...] = ()
    earlier: tuple[Xid, ...] = ()
    error: str | None = None


class KernelXids(FactBase[KernelLog]):
    """
    NVIDIA Xid lines from the kernel log, this boot's apart from earlier boots'.

    ``journalctl -k -b 0`` (this boot) and ``journalctl -k -b all`` when the journal holds
    kernel messages, else ``dmesg`` (this boot only). Output (journal)::

        ##RIGBOOK_KLOG## journalctl
        Nov 29 10:11:12 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=0, GPU has fallen ...
        ##RIGBOOK_KLOG_ALL_BOOTS##
        Nov 27 08:00:01 rig1 kernel: NVRM: Xid (PCI:0000:02:00): 31, pid=4242, name=python3, ...
        Nov 29 10:11:12 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=0, GPU has fallen ...

    A host whose kernel log cannot be read (a container without CAP_SYSLOG) says why::

        ##RIGBOOK_KLOG## none
        dmesg: read kernel buffer failed: Operation not permitted
    """

    @staticmethod
    def default() -> KernelLog:
        return KernelLog(None, error="no output from the kernel-log probe")

    def command(self) -> str:
        grep = f"grep -F 'NVRM: Xid' | tail -n {XID_LINES}"
        journal = "journalctl -k -o short -q --no-pager"
        return (
            "if command -v journalctl >/dev/null 2>&1 && "
            f'[ -n "$({journal} -b 0 -n 1 2>/dev/null)" ]; then '
            f"echo '{_KLOG} journalctl'; {journal} -b 0 2>/dev/null | {grep}; "
            f"echo '{_EARLIER}'; "
            f"{{ {journal} -b all 2>/dev/null || "
            f"journalctl _TRANSPORT=kernel -o short -q --no-pager 2>/dev/null; }} | {grep}; "
            "elif out=$(dmesg 2>&1); then "
            f"echo '{_KLOG} dmesg'; printf '%s\\n' \"$out\" | {grep}; "
            f"else echo '{_KLOG} none'; printf '%s\\n' \"$out\" | head -n 3; fi; true"
        )

    def process(self, output: list[str]) -> KernelLog:
        return parse_kernel_log(output)


def parse_kernel_log(output: list[str]) -> KernelLog:
    """KernelXids' output into a KernelLog; earlier = all boots' Xids less this boot's."""
    if not output or not output[0].startswith(_KLOG):
        raise FactProcessError(f"not the kernel-log probe: {output!r}")
    source = output[0][len(_KLOG):].strip()
    rest = output[1:]
    if source == "none":
        why = " ".join(line.strip() for line in rest if line.strip()) or "no journal, no dmesg"
        return KernelLog(None, error=why)
    if _EARLIER in rest:
        at = rest.index(_EARLIER)
        this_boot, every = rest[:at], rest[at + 1:]
    else:
        this_boot, every = rest, []
    left = Counter(line.strip() for line in this_boot)
    earlier = []
    for line in every:  # a multiset difference: the same line may repeat
        if left[line.strip()] > 0:
            left[line.strip()] -= 1
        else:
            earlier.append(line)
    return KernelLog(source, tuple(parse_xid_lines(this_boot)), tuple(parse_xid_lines(earlier)))


@dataclass(frozen=True)
class Disk:
    """One filesystem: the path asked about, where it is mounted, its size and free bytes."""

    path: str
    mount: str
    size_bytes: int
    avail_bytes: int


class FreeDisk(FactBase[list[Disk]]):
    """
    Size and free space (``df -P -B1``) of the filesystems holding `paths` that exist::

        / /dev/vda 270465425408 18253340672 68719476736 21% /
    """

    default = list

    def command(self, paths: tuple[str, ...]) -> StringCommand:
        return StringCommand(
            "for p in", *(QuoteString(path) for path in paths), "; do",
            '[ -e "$p" ] && df -P -B1 "$p" 2>/dev/null | tail -n 1 | sed "s#^#$p #";',
            "done; true",
        )

    def process(self, output: list[str]) -> list[Disk]:
        disks = []
        for line in output:
            fields = line.split()
            if len(fields) < 7:
                raise FactProcessError(f"not a df -P line: {line!r}")
            disks.append(Disk(fields[0], " ".join(fields[6:]), int(fields[2]), int(fields[4])))
        return disks


class PresentPaths(FactBase[list[str]]):
    """Which of `paths` exist (a file, a folder or a link), one per line."""

    default = list

    def command(self, paths: tuple[str, ...]) -> StringCommand:
        return StringCommand(
            "for p in", *(QuoteString(path) for path in paths), "; do",
            '{ [ -e "$p" ] || [ -L "$p" ]; } && echo "$p";', "done; true",
        )

    def process(self, output: list[str]) -> list[str]:
        return [line.strip() for line in output if line.strip()]


def parse_sysctl_conf(lines: Iterable[str]) -> dict[str, str]:
    """`key = value` lines of a sysctl.d file (comments and blanks skipped), as sysctl reads."""
    values = {}
    for raw in lines:
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.lstrip("-").partition("=")
        if sep:
            values[key.strip()] = value.strip()
    return values


# --- the facts of one rig ------------------------------------------------------------------


@dataclass
class RigFacts:
    """Everything read from one rig. `unread` names what could not be read, and why."""

    probe: GpuProbe | None = None
    installed: dict[str, str] = field(default_factory=dict)
    holds: set[str] = field(default_factory=set)
    loaded: str | None = None
    reboot_marker: list[str] = field(default_factory=list)
    wsl: WslSignals | None = None
    unit: PowerUnit | None = None
    sysctl_file: list[str] | None = None
    sysctl_live: dict[str, LiveSysctl] = field(default_factory=dict)
    shm: ShmState | None = None
    fstab: list[str] | None = None
    stale_present: list[str] = field(default_factory=list)
    registry: RegProbe | None = None
    profiles: list[WindowsProfile] = field(default_factory=list)
    disks: list[Disk] = field(default_factory=list)
    klog: KernelLog | None = None
    gpu_lost: GpuLost | None = None
    venvs: dict[str, VenvState] = field(default_factory=dict)  # by venv name
    cache: CacheState | None = None
    serving: ServeState | None = None
    serving_recipe: list[str] | None = None  # RIGBOOK_RECIPE= lines of engine.env; None: no file
    unread: dict[str, str] = field(default_factory=dict)


#: RigFacts field -> what it is, in words (progress and "could not read" lines).
FACT_LABELS = {
    "probe": "GPUs (nvidia-smi)",
    "installed": "installed packages",
    "holds": "apt holds",
    "loaded": "loaded driver module",
    "reboot_marker": "reboot marker",
    "wsl": "WSL signals",
    "unit": "power-limit unit",
    "sysctl_file": SYSCTL_CONF,
    "sysctl_live": "live sysctl values",
    "shm": SHM,
    "fstab": FSTAB,
    "disks": "free disk",
    "klog": "kernel log",
    "gpu_lost": "GPU-lost mark",
    "stale_present": "leftover files",
    "registry": "Windows registry (TDR)",
    "profiles": "Windows profiles (.wslconfig)",
    "cache": "HF cache (models_cache)",
    "serving": f"serving state ({SERVE_UNIT})",
    "serving_recipe": SERVE_ENV_PATH,
}
#: Plan names of facts read once per item ("venvs:<name>"): RigFacts dict field -> label.
_PER_ITEM = {"venvs": "venv {}"}
#: The engine.env line that names the recipe the unit runs (roles/serving.py writes it).
_RECIPE_LINE = "RIGBOOK_RECIPE="


def fact_label(name: str) -> str:
    """What a fact_plan name is, in words ("venvs:demo" -> "venv demo")."""
    kind, _, item = name.partition(":")
    return _PER_ITEM[kind].format(item) if item else FACT_LABELS[name]


def store_fact(facts: RigFacts, name: str, value: Any) -> None:
    """Put one fact's value in its RigFacts field ("venvs:demo" -> facts.venvs["demo"])."""
    kind, _, item = name.partition(":")
    if item:
        getattr(facts, kind)[item] = value
    else:
        setattr(facts, name, value)


def plan_serving(rig: Rig, name: str) -> tuple[ServePlan | None, str | None]:
    """(the serving role's plan, None) for a rig with a recipe, or (None, why it has none).

    The plan is the role's own (roles/serving.py serve_plan): recipe from the catalogue, fit
    checks, bind address, port and API key file, all on this machine; (None, None) without a
    recipe.
    """
    if rig.recipe is None:
        return None, None
    try:
        return serve_plan(rig, name), None
    except RigbookError as error:  # one line: a fit error lists its problems on several
        return None, " ".join(str(error).removeprefix(f"{name}: ").split())


def fact_plan(rig: Rig, name: str = "rig") -> list[tuple[str, type[FactBase], dict[str, Any]]]:
    """(RigFacts field, fact, its arguments) for one rig, in the order they are read.

    Venvs, the HF cache and the serving unit are read only when the rig declares venvs,
    models or a recipe (a recipe's models are in the cache too).
    """
    plan: list[tuple[str, type[FactBase], dict[str, Any]]] = [
        ("probe", NvidiaGpus, {}),
        ("installed", DpkgInstalled, {}),
        ("holds", AptHolds, {}),
        ("loaded", LoadedDriverVersion, {}),
        ("reboot_marker", RebootMarker, {}),
        ("wsl", Wsl, {}),
        ("unit", PowerUnitFile, {}),
        ("sysctl_file", FileContents, {"path": SYSCTL_CONF}),
        ("sysctl_live", LiveSysctls, {"keys": tuple(sysctl_values(rig))}),
        ("shm", Shm, {}),
        ("fstab", FileContents, {"path": FSTAB}),
        ("disks", FreeDisk, {"paths": DISK_PATHS}),
        ("klog", KernelXids, {}),
        ("gpu_lost", GpuLostMark, {}),
    ]
    if rig.stale_files:
        plan.append(("stale_present", PresentPaths, {"paths": tuple(rig.stale_files)}))
    if rig.platform == "wsl2":
        plan.append(("registry", RegistryValues,
                     {"key": GRAPHICS_DRIVERS, "names": tuple(tdr_values(rig))}))
        plan.append(("profiles", WindowsProfiles, {}))
    for spec in rig.venvs:
        plan.append((f"venvs:{spec.name}", VenvBuilds, {"venv_name": spec.name}))
    if rig.models or rig.recipe:
        plan.append(("cache", ModelCache, {"cache": rig.models_cache}))
    serve, _ = plan_serving(rig, name)
    if serve is not None:
        plan.append(("serving", ServeProbe, {"args": probe_args(serve)}))
        plan.append(("serving_recipe", FindInFile,
                     {"path": SERVE_ENV_PATH, "pattern": f"^{_RECIPE_LINE}"}))
    return plan


# --- the status model ----------------------------------------------------------------------

Level = Literal["warn", "drift", "gone"]
RigState = Literal["as-declared", "drift", "gpu-gone", "unreachable"]
_RANK = {"warn": 0, "drift": 1, "gone": 2}
VenvCondition = Literal[
    "current", "stale", "incompatible", "spec-changed", "missing", "not-rigbook", "unknown"
]
ModelState = Literal["complete", "partial", "missing", "unknown"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Finding(_Model):
    """One thing that is not as declared (drift), unusable (gone) or worth a look (warn)."""

    level: Level
    area: str
    reason: str
    gpu: str | None = None  # the GPU's UUID when the finding is about one GPU


class XidEvent(_Model):
    """One Xid from the kernel log, with the GPU it names when that GPU is listed."""

    code: int
    label: str
    gone: bool
    pci: str
    gpu_index: int | None
    when: str | None
    message: str
    this_boot: bool


class GpuStatus(_Model):
    index: int
    uuid: str
    name: str
    bus_id: str
    driver_version: str | None
    persistence: bool | None
    cap_desired_w: float | None
    cap_source: str | None
    cap_unit_w: float | None
    cap_live_w: float | None
    default_limit_w: float | None
    min_limit_w: float | None
    max_limit_w: float | None
    power_draw_w: float | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    temperature_c: int | None


class DriverStatus(_Model):
    declared: str
    installed: list[str]
    loaded: str | None
    running: str | None
    smi: str | None
    smi_error: str | None
    packages: list[str]
    unheld: list[str]
    reboot_pending: list[str]


class PowerUnitStatus(_Model):
    present: bool
    enabled: str | None
    caps: dict[str, float]


class SysctlStatus(_Model):
    key: str
    declared: str
    file: str | None
    live: str | None
    read_only: bool


class ShmStatus(_Model):
    declared: str | None
    fstype: str | None
    size_bytes: int | None
    used_bytes: int | None
    mem_total_bytes: int
    fstab: list[str]


class WslStatus(_Model):
    tdr_declared: dict[str, int]
    tdr: dict[str, int | str | None]
    tdr_error: str | None
    memory: list[str]


class DiskStatus(_Model):
    mount: str
    paths: list[str]
    size_bytes: int
    avail_bytes: int


class KernelLogStatus(_Model):
    source: str | None
    error: str | None
    xids: list[XidEvent]


class VenvStatus(_Model):
    """One declared venv as the rig has it (roles/venvs.py: symlink, build, manifest)."""

    name: str
    state: VenvCondition
    build: str | None = None  # the build the symlink points at
    built_driver: str | None = None  # the driver its manifest says it was built for
    running_driver: str | None = None
    spec_hash: str | None = None  # what the inventory's spec hashes to now
    built_spec_hash: str | None = None
    reason: str = ""  # why it is not current ("" when it is)


class ModelStatus(_Model):
    """One pinned snapshot in the HF cache: from the rig's models or its recipe's pins."""

    repo: str
    revision: str
    source: Literal["models", "recipe"]
    state: ModelState
    files: int = 0  # files in rigbook's manifest of that snapshot (0: none)
    bytes: int = 0
    missing_files: int | None = None  # missing or wrong-size files; None: not known
    reason: str = ""


class CachedRepoStatus(_Model):
    repo: str
    bytes: int


class CacheStatus(_Model):
    """The rig's HF cache: where it is, and the repos in it that models does not list."""

    path: str
    exists: bool
    unlisted: list[CachedRepoStatus]
    prune: bool  # models_prune: the converge removes the unlisted repos


class ServingStatus(_Model):
    """The declared recipe and what rigbook-serve.service does (roles/serving.py's probe)."""

    recipe: str
    running_recipe: str | None = None  # RIGBOOK_RECIPE of the unit's engine.env
    url: str | None = None  # where the probe reached the API, on the rig itself
    unit: str | None = None  # systemd ActiveState (active, failed, inactive, activating ...)
    sub: str | None = None
    enabled: str | None = None
    healthy: bool | None = None  # None: not checked (the unit is not active)
    health: str | None = None  # the model it serves, or why it does not answer
    other_engines: list[str] = []


class RigStatus(_Model):
    name: str
    state: RigState
    platform: str
    gpu_class: str
    gpu_count: int
    error: str | None = None
    gpus: list[GpuStatus] = []
    driver: DriverStatus | None = None
    power_unit: PowerUnitStatus | None = None
    sysctl: list[SysctlStatus] = []
    shm: ShmStatus | None = None
    stale_files: list[str] = []
    wsl: WslStatus | None = None
    disks: list[DiskStatus] = []
    kernel_log: KernelLogStatus | None = None
    gpu_lost: str | None = None  # the Xid watch's GPU-lost mark (roles/guards.py), if set
    venvs: list[VenvStatus] = []
    models: list[ModelStatus] = []
    models_cache: CacheStatus | None = None
    serving: ServingStatus | None = None
    findings: list[Finding] = []

    @model_validator(mode="after")
    def _state_matches_findings(self) -> RigStatus:
        if self.state != state_of(self.findings, reachable=self.error is None):
            raise ValueError(f"state {self.state} does not follow from the findings")
        return self

    @property
    def exit_code(self) -> int:
        return {"as-declared": 0, "drift": 1, "gpu-gone": 2, "unreachable": 2}[self.state]


class FleetStatus(_Model):
    inventory: str
    rigs: list[RigStatus]
    exit_code: int

    @model_validator(mode="after")
    def _exit_code(self) -> FleetStatus:
        if self.exit_code != fleet_exit_code(self.rigs):
            raise ValueError(f"exit_code {self.exit_code} does not follow from the rigs")
        return self


def state_of(findings: Iterable[Finding], reachable: bool = True) -> RigState:
    if not reachable:
        return "unreachable"
    levels = {finding.level for finding in findings}
    return "gpu-gone" if "gone" in levels else "drift" if "drift" in levels else "as-declared"


def fleet_exit_code(rigs: Iterable[RigStatus]) -> int:
    """0 all as declared, 1 drift, 2 a rig unreachable or a GPU gone."""
    return max((rig.exit_code for rig in rigs), default=0)


# --- building a rig's status from its facts ------------------------------------------------


class _Findings(list):
    def add(self, level: Level, area: str, reason: str, gpu: str | None = None) -> None:
        finding = Finding(level=level, area=area, reason=reason, gpu=gpu)
        if finding not in self:
            self.append(finding)


def _declared(rig: Rig) -> dict[str, Any]:
    """Venvs, models and recipe as the inventory declares them, with nothing read ("unknown")."""
    return {
        "venvs": [VenvStatus(name=spec.name, state="unknown") for spec in rig.venvs],
        "models": [ModelStatus(repo=spec.repo, revision=spec.revision, source="models",
                               state="unknown") for spec in rig.models],
        "serving": ServingStatus(recipe=rig.recipe) if rig.recipe else None,
    }


def unreachable_status(name: str, rig: Rig, why: str) -> RigStatus:
    """The status of a rig that could not be reached: only what the inventory declares."""
    return RigStatus(
        name=name, state="unreachable", platform=rig.platform, gpu_class=rig.gpu_class,
        gpu_count=rig.gpu_count, error=why, **_declared(rig),
        findings=[Finding(level="gone", area="connection", reason=f"could not be reached: {why}")],
    )


def _unread(facts: RigFacts, found: _Findings, *names: str) -> bool:
    """True (and a drift finding) when any of these facts could not be read."""
    missing = [name for name in names if name in facts.unread]
    for name in missing:
        found.add("drift", "facts", f"could not read {fact_label(name)}: {facts.unread[name]}")
    return bool(missing)


def _check_gpus(rig: Rig, facts: RigFacts, found: _Findings) -> tuple[Gpu, ...]:
    """The GPUs nvidia-smi lists; findings for a broken GPU layer, count and card class."""
    if _unread(facts, found, "probe"):
        return ()
    probe = facts.probe
    if probe is None:
        where = f"{WSL_NVIDIA_SMI} (update the Windows driver)" if (
            rig.platform == "wsl2") else "nvidia-smi (no driver installed?)"
        found.add("drift", "gpu", f"no {where}")
        return ()
    if not probe.ok:
        found.add("gone", "gpu", f"{probe.smi} fails: {probe.error}")
        return ()
    if not probe.gpus:
        found.add("gone", "gpu", f"{probe.smi} lists no GPUs")
        return ()
    if len(probe.gpus) != rig.gpu_count:
        found.add("drift", "gpu",
                  f"gpu_count {rig.gpu_count} declared, nvidia-smi lists {len(probe.gpus)}")
    pattern = _CLASS_NAMES.get(rig.gpu_class)
    for gpu in probe.gpus:
        if pattern is not None and not pattern.search(gpu.name):
            found.add("drift", "gpu", f"gpu_class {rig.gpu_class} declared, card is {gpu.name}",
                      gpu.uuid)
    return probe.gpus


def _check_driver(rig: Rig, facts: RigFacts, found: _Findings) -> DriverStatus | None:
    if _unread(facts, found, "installed", "holds", "loaded", "reboot_marker"):
        return None
    probe = facts.probe
    running = probe.driver_version if probe is not None and probe.ok else None
    installed = driver_versions(facts.installed)
    packages = driver_packages(facts.installed)
    if rig.platform == "wsl2":
        if installed:
            found.add("drift", "driver",
                      f"Linux NVIDIA driver {', '.join(sorted(installed))} installed in WSL2; "
                      "it shadows the Windows driver")
        return DriverStatus(
            declared="Windows driver", installed=sorted(installed), loaded=None, running=running,
            smi=probe.smi if probe else None, smi_error=probe.error if probe else None,
            packages=packages, unheld=[], reboot_pending=[],
        )
    reasons = reboot_reasons(installed, facts.loaded, facts.reboot_marker)
    unheld = [name for name in packages if name not in facts.holds]
    if not installed:
        found.add("drift", "driver", f"no driver installed; inventory: {wanted(rig)}")
    elif not all(version_matches(rig, version) for version in installed):
        found.add("drift", "driver",
                  f"installed {', '.join(sorted(installed))}, inventory: {wanted(rig)}")
    if reasons:
        found.add("drift", "driver", f"reboot pending: {'; '.join(reasons)}")
    elif running is not None and not version_matches(rig, running):
        found.add("drift", "driver", f"running {running}, inventory: {wanted(rig)}")
    if unheld:
        found.add("drift", "driver", f"not held: {', '.join(unheld)}")
    return DriverStatus(
        declared=wanted(rig), installed=sorted(installed), loaded=facts.loaded, running=running,
        smi=probe.smi if probe else None, smi_error=probe.error if probe else None,
        packages=packages, unheld=unheld, reboot_pending=reasons,
    )


def _gpu_status(
    rig: Rig, gpu: Gpu, unit: dict[str, float] | None, found: _Findings
) -> GpuStatus:
    """One GPU's row: persistence and its cap as declared, in the unit, and live."""
    label = f"GPU {gpu.index}"
    if rig.platform != "wsl2" and rig.driver_persistence and gpu.persistence is False:
        found.add("drift", "persistence", f"{label}: persistence mode is off", gpu.uuid)
    try:
        desired, source = asked_cap(rig, gpu)
    except ValueError as e:
        found.add("drift", "power", f"{label}: {e}", gpu.uuid)
        desired, source = None, None
    else:
        if desired is None:
            desired = gpu.default_limit_w
        in_range = (
            desired is None or gpu.min_limit_w is None or gpu.max_limit_w is None
            or gpu.min_limit_w <= desired <= gpu.max_limit_w
        )
        if not in_range:
            found.add("drift", "power",
                      f"{label}: {source} asks {watts(desired)} W, outside the card's range "
                      f"{watts(gpu.min_limit_w)}-{watts(gpu.max_limit_w)} W", gpu.uuid)
    in_unit = None if unit is None else unit.get(gpu.uuid)
    live = gpu.power_limit_w
    if desired is not None:
        if rig.platform == "wsl2":
            if not _same_w(live, desired):
                found.add("warn", "power",
                          f"{label}: live cap {watts(live)} W, inventory {watts(desired)} W; "
                          "set it on Windows (Administrator): "
                          f"nvidia-smi -i {gpu.uuid} -pl {watts(desired)}", gpu.uuid)
        else:
            if unit is not None and not _same_w(in_unit, desired):
                found.add("drift", "power",
                          f"{label}: unit caps {watts(in_unit)} W, inventory {watts(desired)} W",
                          gpu.uuid)
            if not _same_w(live, desired):
                found.add("drift", "power",
                          f"{label}: live cap {watts(live)} W, inventory {watts(desired)} W",
                          gpu.uuid)
    return GpuStatus(
        index=gpu.index, uuid=gpu.uuid, name=gpu.name, bus_id=gpu.bus_id,
        driver_version=gpu.driver_version, persistence=gpu.persistence,
        cap_desired_w=desired, cap_source=source, cap_unit_w=in_unit, cap_live_w=live,
        default_limit_w=gpu.default_limit_w, min_limit_w=gpu.min_limit_w,
        max_limit_w=gpu.max_limit_w, power_draw_w=gpu.power_draw_w,
        memory_used_mib=gpu.memory_used_mib, memory_total_mib=gpu.memory_total_mib,
        temperature_c=gpu.temperature_c,
    )


def _same_w(value: float | None, desired: float) -> bool:
    return value is not None and abs(value - desired) <= TOLERANCE_W


def _check_unit(rig: Rig, facts: RigFacts, gpus: tuple[Gpu, ...], found: _Findings):
    """(status, caps by UUID) of the power-limit unit; (None, None) on WSL2 or when unread."""
    if rig.platform == "wsl2" or _unread(facts, found, "unit"):
        return None, None
    unit = facts.unit
    if unit is None:
        if gpus:
            found.add("drift", "power", f"no {UNIT_NAME}: caps are lost at the next reboot")
        return PowerUnitStatus(present=False, enabled=None, caps={}), None
    caps, other = unit_caps(unit.exec_starts)
    for line in other:
        found.add("drift", "power", f"{UNIT_NAME} has a line rigbook did not write: {line}")
    if unit.enabled is not None and unit.enabled != "enabled":
        found.add("drift", "power", f"{UNIT_NAME} is {unit.enabled}, not enabled")
    listed = {gpu.uuid for gpu in gpus}
    for uuid in caps:
        if gpus and uuid not in listed:
            found.add("drift", "power", f"{UNIT_NAME} caps {uuid}, which nvidia-smi does not list")
    return PowerUnitStatus(present=True, enabled=unit.enabled, caps=caps), caps


def _check_sysctl(rig: Rig, facts: RigFacts, found: _Findings) -> list[SysctlStatus]:
    if _unread(facts, found, "sysctl_file", "sysctl_live"):
        return []
    in_file = parse_sysctl_conf(facts.sysctl_file) if facts.sysctl_file is not None else None
    if in_file is None:
        found.add("drift", "tuning", f"no {SYSCTL_CONF}")
    rows = []
    for key, declared in sysctl_values(rig).items():
        written = in_file.get(key) if in_file is not None else None
        live = facts.sysctl_live.get(key)
        value = live.value if live is not None else None
        read_only = live.read_only if live is not None else False
        if in_file is not None and not same_sysctl(declared, written):
            found.add("drift", "tuning",
                      f"{SYSCTL_CONF}: {key} = {written if written is not None else '(absent)'}, "
                      f"inventory {declared}")
        if value is None:
            found.add("drift", "tuning", f"this kernel has no {key}")
        elif not same_sysctl(declared, value):
            if read_only:
                found.add("warn", "tuning",
                          f"{key} is {value} live: /proc/sys is read-only here, the file's "
                          f"{declared} applies at a boot that allows it")
            else:
                found.add("drift", "tuning", f"{key} is {value} live, inventory {declared}")
        rows.append(SysctlStatus(key=key, declared=declared, file=written, live=value,
                                 read_only=read_only))
    return rows


def _check_shm(rig: Rig, facts: RigFacts, found: _Findings) -> ShmStatus | None:
    if _unread(facts, found, "shm", "fstab"):
        return None
    shm = facts.shm
    fstab = [line.strip() for line in facts.fstab or [] if _FSTAB_SHM.match(line.strip())]
    if shm is None:
        return None
    if rig.shm_size is not None:
        want = fstab_line(rig.shm_size)
        if fstab != [want]:
            found.add("drift", "tuning",
                      f"{FSTAB}: {SHM} line is {fstab or '(absent)'}, inventory: {want}")
        if shm.fstype != "tmpfs":
            found.add("drift", "tuning", f"{SHM} is {shm.fstype or 'not mounted'}, not a tmpfs")
        else:
            wanted_bytes = size_bytes(rig.shm_size, shm.mem_total_bytes)
            if shm_differs(wanted_bytes, shm):
                found.add("drift", "tuning",
                          f"{SHM} is {_size(shm.size_bytes)}, inventory {rig.shm_size} "
                          f"({gib(wanted_bytes)})")
    return ShmStatus(
        declared=rig.shm_size, fstype=shm.fstype, size_bytes=shm.size_bytes,
        used_bytes=shm.used_bytes, mem_total_bytes=shm.mem_total_bytes, fstab=fstab,
    )


def _size(value: int | None) -> str:
    return "?" if value is None else gib(value)


def _check_wsl(rig: Rig, facts: RigFacts, found: _Findings, name: str) -> WslStatus | None:
    if not _unread(facts, found, "wsl") and facts.wsl is not None:
        try:
            check_platform(name, rig.platform, facts.wsl)
        except RigbookError as error:
            found.add("drift", "platform", str(error).removesuffix(" Nothing was changed."))
    if rig.platform != "wsl2" or _unread(facts, found, "registry", "profiles"):
        return None
    want = tdr_values(rig)
    probe = facts.registry or RegProbe({}, "not read")
    if probe.error:
        found.add("drift", "wsl", f"cannot read the Windows registry: {probe.error}")
    else:
        for key, value in differing(want, probe).items():
            found.add("drift", "wsl", f"{key} is {probe.values.get(key)}, inventory {value}")
    memory: list[str] = []
    if facts.shm is not None:
        warnings, fine = memory_findings(
            name, facts.profiles, facts.shm.mem_total_bytes, rig.wsl_min_memory_gib
        )
        for line in warnings[:-1]:  # the last one is the advice on how to fix it
            found.add("warn", "wsl", line.removeprefix(f"{name}: "))
        memory = [line.removeprefix(f"{name}: ") for line in warnings + fine]
    return WslStatus(tdr_declared=want, tdr=dict(probe.values), tdr_error=probe.error,
                     memory=memory)


def _check_disks(facts: RigFacts, found: _Findings) -> list[DiskStatus]:
    if _unread(facts, found, "disks"):
        return []
    by_mount: dict[str, DiskStatus] = {}
    for disk in facts.disks:
        seen = by_mount.get(disk.mount)
        paths = (seen.paths if seen else []) + [disk.path]
        by_mount[disk.mount] = DiskStatus(mount=disk.mount, paths=paths,
                                          size_bytes=disk.size_bytes, avail_bytes=disk.avail_bytes)
    for disk in by_mount.values():
        if disk.size_bytes and disk.avail_bytes < DISK_LOW * disk.size_bytes:
            found.add("warn", "disk",
                      f"{disk.mount}: {gib(disk.avail_bytes)} free of {gib(disk.size_bytes)}")
    return list(by_mount.values())


def _check_xids(facts: RigFacts, gpus: tuple[Gpu, ...], found: _Findings) -> KernelLogStatus | None:
    if _unread(facts, found, "klog") or facts.klog is None:
        return None
    log = facts.klog
    if log.source is None:
        found.add("warn", "faults", f"kernel log not readable ({log.error}): GPU faults unknown")
    events = []
    for this_boot, xids in ((True, log.this_boot), (False, log.earlier)):
        for xid in xids:
            gpu = next((g for g in gpus if same_device(xid.pci, g.bus_id)), None)
            events.append(XidEvent(
                code=xid.code, label=xid.label, gone=xid.gone, pci=xid.pci,
                gpu_index=gpu.index if gpu else None, when=xid.when, message=xid.message,
                this_boot=this_boot,
            ))
    seen: set[tuple[int, str]] = set()
    for event in events:
        if not event.this_boot or (event.code, event.pci) in seen:
            continue
        seen.add((event.code, event.pci))
        gpu = next((g for g in gpus if g.index == event.gpu_index), None)
        count = sum(1 for e in events if e.this_boot and (e.code, e.pci) == (event.code, event.pci))
        where = f"GPU {gpu.index}" if gpu else f"PCI {event.pci}"
        times = f" ({count}x)" if count > 1 else ""
        found.add("gone" if event.gone else "warn", "faults",
                  f"{where}: Xid {event.code} {event.label} since boot{times}, last at "
                  f"{event.when or '?'}", gpu.uuid if gpu else None)
    return KernelLogStatus(source=log.source, error=log.error, xids=events)


def _live_driver(facts: RigFacts) -> str | None:
    """The driver a venv meets, as roles/venvs.py live_driver() sees it: None without GPUs."""
    probe = facts.probe
    return probe.driver_version if probe is not None and probe.ok and probe.gpus else None


def venv_status(
    rig: Rig, spec: VenvSpec, state: VenvState, driver: str | None, found: _Findings
) -> VenvStatus:
    """One venv: current, or why not, in the order the venvs role decides (venvs.decide)."""
    link = venv_link(spec.name)
    digest = spec_hash(spec, rig)
    manifest = state.manifest
    known = {
        "name": spec.name, "build": state.target_build, "running_driver": driver,
        "spec_hash": digest, "built_driver": manifest.get("driver") if manifest else None,
        "built_spec_hash": manifest.get("spec_hash") if manifest else None,
    }
    broken = incompatibility(manifest, driver)
    stale = staleness(manifest, driver)
    if state.not_link:
        kind, why = "not-rigbook", f"{link} exists and is not rigbook's symlink: move it away"
    elif manifest is None:
        built = (f"{link} -> {state.target}, which is not a finished build" if state.target
                 else "not built")
        kind, why = "missing", f"{built}: deploys/rig.py builds it"
    elif manifest.get("spec_hash") != digest:
        kind, why = "spec-changed", (f"spec changed ({manifest.get('spec_hash')} -> {digest}): "
                                     "deploys/rig.py rebuilds it")
    elif broken is not None:
        kind, why = "incompatible", (f"cannot run: {broken}: run deploys/venvs.py (and check "
                                     "the pins against the driver)")
    elif stale is not None:
        kind, why = "stale", f"stale: {stale}: run deploys/venvs.py"
    else:
        return VenvStatus(state="current", **known)
    found.add("drift", "venvs", f"venv {spec.name}: {why}")
    return VenvStatus(state=kind, reason=why, **known)


def _check_venvs(rig: Rig, facts: RigFacts, found: _Findings) -> list[VenvStatus]:
    driver = _live_driver(facts)
    rows = []
    for spec in rig.venvs:
        state = facts.venvs.get(spec.name)
        if _unread(facts, found, f"venvs:{spec.name}") or state is None:
            rows.append(VenvStatus(name=spec.name, state="unknown"))
        else:
            rows.append(venv_status(rig, spec, state, driver, found))
    return rows


def _check_models(
    rig: Rig, facts: RigFacts, serve: ServePlan | None, found: _Findings
) -> tuple[list[ModelStatus], CacheStatus | None]:
    """Each pinned snapshot complete, partial or missing (models.snapshot_status), and the
    cached repos models does not list (models.unreferenced), as the models role sees them."""
    listed = {spec.repo for spec in rig.models}
    wanted: list[tuple[ModelSpec, Literal["models", "recipe"]]] = [
        (spec, "models") for spec in rig.models
    ]
    if serve is not None:  # the recipe's pins the rig's models do not cover
        wanted += [(spec, "recipe") for spec in serve.pins if spec.repo not in listed]
    cache = facts.cache
    if _unread(facts, found, "cache") or cache is None:
        return [ModelStatus(repo=spec.repo, revision=spec.revision, source=source,
                            state="unknown") for spec, source in wanted], None
    rows = []
    for spec, source in wanted:
        status = snapshot_status(cache, spec)
        known = {"repo": spec.repo, "revision": spec.revision, "source": source,
                 "files": status.files, "bytes": status.bytes}
        if status.complete:
            rows.append(ModelStatus(state="complete", **known))
            continue
        repo = cache.repos.get(spec.repo)
        kind = "partial" if repo is not None and repo.snapshots.get(spec.revision) else "missing"
        missing = len(status.missing) + len(status.wrong_size) if status.files else None
        why = status.reason.removeprefix("partial: ")
        fix = ("run deploys/models.py" if source == "models"
               else "add it to the rig's models and run deploys/models.py")
        what = "model" if source == "models" else f"recipe {rig.recipe}: model"
        found.add("drift", "models", f"{what} {label(spec)} {kind}: {why}; {fix}")
        rows.append(ModelStatus(state=kind, missing_files=missing, reason=why, **known))
    extra = unreferenced(cache, listed)
    if extra:
        listing = prune_listing(extra)
        if rig.models_prune:
            found.add("drift", "models", f"cached but not in models: {listing}; models_prune is "
                                         "true: deploys/rig.py or deploys/models.py removes them")
        else:
            found.add("warn", "models", f"cached but not in models: {listing}; models_prune: "
                                        "true removes them")
    return rows, CacheStatus(
        path=cache.cache, exists=cache.exists, prune=rig.models_prune,
        unlisted=[CachedRepoStatus(repo=repo.repo, bytes=repo.bytes) for repo in extra],
    )


def running_recipe(lines: list[str] | None) -> str | None:
    """The recipe named by engine.env's RIGBOOK_RECIPE= line (FindInFile's value), if any."""
    for line in lines or ():
        if line.startswith(_RECIPE_LINE):
            return line[len(_RECIPE_LINE):].strip().strip('"') or None
    return None


def _check_serving(
    rig: Rig, facts: RigFacts, serve: ServePlan | None, error: str | None, found: _Findings
) -> ServingStatus | None:
    """The declared recipe against rigbook-serve.service: installed for it, enabled, active,
    answering /v1/models (roles/serving.py's probe, run on the rig), and alone."""
    if rig.recipe is None:
        return None
    if serve is None:
        found.add("drift", "serving", f"{error}: nothing of it was read from the rig")
        return ServingStatus(recipe=rig.recipe)
    if _unread(facts, found, "serving", "serving_recipe") or facts.serving is None:
        return ServingStatus(recipe=rig.recipe, url=serve.url)
    probe = facts.serving
    running = running_recipe(facts.serving_recipe)
    if probe.files.get(SERVE_UNIT_PATH) is None:
        found.add("drift", "serving",
                  f"no {SERVE_UNIT}: recipe {rig.recipe} is not set up; run deploys/serve.py")
    else:
        if running != rig.recipe:
            found.add("drift", "serving", f"{SERVE_UNIT} is set up for recipe {running or '?'}, "
                                          f"inventory {rig.recipe}: run deploys/serve.py")
        if probe.enabled != "enabled":
            found.add("drift", "serving", f"{SERVE_UNIT} is {probe.enabled or 'not enabled'}, "
                                          "not enabled: it does not start at boot")
        if not probe.running:
            found.add("drift", "serving",
                      f"{SERVE_UNIT} is {probe.active} ({probe.sub}): recipe {rig.recipe} is not "
                      f"served; journalctl -u {SERVE_UNIT}, then deploys/serve.py")
    healthy, health = None, None
    if probe.running:
        answer = probe.answer or {}
        healthy = bool(answer.get("ok"))
        if healthy:
            health = f"serves {answer.get('model')}"
        else:
            health = str(answer.get("message") or f"not checked: no {HEALTH_PATH} on the rig")
            found.add("drift", "serving", f"{serve.url}/v1/models does not answer: {health}")
    others = [f"pid {pid} {cmd}" for pid, cmd in probe.engines]
    for pid, cmd in probe.engines:
        found.add("drift", "serving",
                  f"another engine runs outside {SERVE_UNIT}: pid {pid} `{cmd[:80]}`")
    return ServingStatus(
        recipe=rig.recipe, running_recipe=running, url=serve.url, unit=probe.active,
        sub=probe.sub, enabled=probe.enabled or None, healthy=healthy, health=health,
        other_engines=others,
    )


def build_rig_status(name: str, rig: Rig, facts: RigFacts) -> RigStatus:
    """What one rig is doing and every way it differs from its host data.

    Pure but for the serving plan, which reads the recipe catalogue (and the API key file) on
    this machine, as a deploy does.
    """
    found = _Findings()
    gpus = _check_gpus(rig, facts, found)
    driver = _check_driver(rig, facts, found)
    unit_status, unit = _check_unit(rig, facts, gpus, found)
    gpu_rows = [_gpu_status(rig, gpu, unit, found) for gpu in gpus]
    sysctl = _check_sysctl(rig, facts, found)
    shm = _check_shm(rig, facts, found)
    stale = []
    if rig.stale_files and not _unread(facts, found, "stale_present"):
        stale = list(facts.stale_present)
        for path in stale:
            found.add("drift", "tuning", f"leftover {path} is present")
    wsl = _check_wsl(rig, facts, found, name)
    disks = _check_disks(facts, found)
    kernel_log = _check_xids(facts, gpus, found)
    lost = None if _unread(facts, found, "gpu_lost") else gpu_lost_reason(facts.gpu_lost)
    if lost:  # the Xid watch's mark (roles/guards.py): serving refuses to start on this boot
        found.add("gone", "faults", lost)
    venvs = _check_venvs(rig, facts, found)
    serve, serve_error = plan_serving(rig, name)
    models, cache = _check_models(rig, facts, serve, found)
    serving = _check_serving(rig, facts, serve, serve_error, found)
    return RigStatus(
        name=name, state=state_of(found), platform=rig.platform, gpu_class=rig.gpu_class,
        gpu_count=rig.gpu_count, gpus=gpu_rows, driver=driver, power_unit=unit_status,
        sysctl=sysctl, shm=shm, stale_files=stale, wsl=wsl, disks=disks, kernel_log=kernel_log,
        gpu_lost=lost, venvs=venvs, models=models, models_cache=cache, serving=serving,
        findings=list(found),
    )


# --- the table -----------------------------------------------------------------------------

_STYLE = {"warn": "yellow", "drift": "red", "gone": "bold red"}
_STATE_TEXT = {
    "as-declared": ("as declared", "green"),
    "drift": ("DRIFT", "red"),
    "gpu-gone": ("GPU GONE", "bold red"),
    "unreachable": ("UNREACHABLE", "bold red"),
}
COLUMNS = (
    "rig", "state", "GPU", "driver", "persist.", "cap W\nwant/unit/live", "tuning", "WSL TDR",
    "disk free", "GPU faults", "venvs / models / serving",
)


def _worst(findings: Iterable[Finding]) -> str | None:
    levels = [finding.level for finding in findings]
    return _STYLE[max(levels, key=_RANK.__getitem__)] if levels else None


def _cell(text: str, findings: Iterable[Finding]) -> Text:
    return Text(text, style=_worst(findings) or "")


def _short_name(name: str) -> str:
    return name.removeprefix("NVIDIA ").removeprefix("GeForce ")


def _w(value: float | None) -> str:
    return "-" if value is None else watts(value)


def _driver_text(rig: RigStatus) -> str:
    driver = rig.driver
    if driver is None:
        return "?"
    if rig.platform == "wsl2":
        return f"{driver.running or '-'}\nWindows driver"
    version = driver.running or driver.loaded or ", ".join(driver.installed) or "none"
    held = "n/a" if not driver.packages else "NOT held" if driver.unheld else "held"
    lines = [version, held]
    if driver.reboot_pending:
        lines.append("reboot pending")
    return "\n".join(lines)


def _tuning_text(rig: RigStatus) -> str:
    lines = []
    if rig.sysctl:
        rows = rig.sysctl
        file = "ok" if all(same_sysctl(s.declared, s.file) for s in rows) else (
            "missing" if all(s.file is None for s in rows) else "differs")
        live = "ok" if all(same_sysctl(s.declared, s.live) for s in rows) else (
            "differs (ro)" if all(s.read_only for s in rows) else "differs")
        lines.append(f"sysctl file {file}, live {live}")
    if rig.shm is not None:
        size = _size(rig.shm.size_bytes)
        lines.append(f"shm {size}" + (f" (want {rig.shm.declared})" if rig.shm.declared else ""))
    if rig.stale_files:
        lines.append(f"{len(rig.stale_files)} leftover file(s)")
    return "\n".join(lines) or "-"


def _wsl_text(rig: RigStatus) -> str:
    if rig.wsl is None:
        return "-"
    if rig.wsl.tdr_error:
        return "registry unreadable"
    return "\n".join(f"{key} {rig.wsl.tdr.get(key)}" for key in rig.wsl.tdr_declared)


def _disk_text(rig: RigStatus) -> str:
    return "\n".join(
        f"{disk.mount} {gib(disk.avail_bytes)} ({disk.avail_bytes / disk.size_bytes:.0%})"
        if disk.size_bytes else f"{disk.mount} ?"
        for disk in rig.disks
    ) or "-"


def _faults_text(rig: RigStatus, index: int | None) -> str:
    """The Xids of GPU `index` (None: those naming no listed GPU), or why they are unknown."""
    log = rig.kernel_log
    if log is None:
        return "?"
    if log.source is None:
        return "log unreadable"
    return _xid_summary(log, index) or "none"


def _xid_summary(log: KernelLogStatus, index: int | None) -> str:
    mine = [event for event in log.xids if event.gpu_index == index]
    now = Counter(f"Xid {e.code} {e.label}" for e in mine if e.this_boot)
    before = sum(1 for e in mine if not e.this_boot)
    lines = [f"{text} x{count}" if count > 1 else text for text, count in now.items()]
    if before:
        lines.append(f"{before} in earlier boots")
    return "\n".join(lines)


def _venv_text(venv: VenvStatus) -> str:
    if venv.state == "stale":
        return (f"venv {venv.name}: stale (built for driver {venv.built_driver or 'none'}, "
                f"running {venv.running_driver})")
    if venv.state == "incompatible":
        return f"venv {venv.name}: incompatible (error 804)"
    if venv.state == "current" and venv.running_driver is None:
        return f"venv {venv.name}: built (driver {venv.built_driver or 'none'}; live unknown)"
    return f"venv {venv.name}: {venv.state.replace('-', ' ')}"


def _model_text(model: ModelStatus) -> str:
    state = model.state
    if state == "complete":
        state = f"complete, {human(model.bytes)}"
    elif state == "partial" and model.missing_files:
        state = f"partial ({model.missing_files} file(s) missing)"
    where = " (recipe)" if model.source == "recipe" else ""
    return f"model {model.repo}{where}: {state}"


def _recipe_text(serving: ServingStatus) -> str:
    running = (f" (unit: {serving.running_recipe})"
               if serving.running_recipe not in (None, serving.recipe) else "")
    state = serving.unit or "?"
    if serving.unit == "active":
        state += ", healthy" if serving.healthy else ", NOT answering"
    elif serving.sub and serving.unit is not None:
        state += f" ({serving.sub})"
    return f"recipe {serving.recipe}{running}: {state}"


def _serving_cell(rig: RigStatus) -> Text:
    """A line per venv, model and the recipe, each coloured by its own state."""
    def level_of(*areas: str) -> str | None:
        levels = [f.level for f in rig.findings if f.area in areas]
        return _STYLE[max(levels, key=_RANK.__getitem__)] if levels else None

    lines: list[tuple[str, str | None]] = []
    for venv in rig.venvs:
        bad = venv.state not in ("current", "unknown")
        lines.append((_venv_text(venv), _STYLE["drift"] if bad else None))
    for model in rig.models:
        bad = model.state in ("partial", "missing")
        lines.append((_model_text(model), _STYLE["drift"] if bad else None))
    cache = rig.models_cache
    if cache is not None and cache.unlisted:
        size = human(sum(repo.bytes for repo in cache.unlisted))
        lines.append((f"+{len(cache.unlisted)} cached repo(s) not in models, {size}",
                      _STYLE["drift" if cache.prune else "warn"]))
    if rig.serving is not None:
        lines.append((_recipe_text(rig.serving), level_of("serving")))
    if not lines:
        return Text("none declared")
    if rig.state == "unreachable":
        lines.append(("(not read)", None))
    text = Text()
    for position, (line, style) in enumerate(lines):
        text.append(("\n" if position else "") + line, style=style or "")
    return text


def _mark(level: str) -> str:
    return {"warn": "!", "drift": "x", "gone": "X"}[level]


def findings_text(fleet: FleetStatus) -> Text:
    """Every finding, one line each under its rig: what differs and why (the table's colours)."""
    text = Text()
    for rig in fleet.rigs:
        if not rig.findings:
            continue
        label, style = _STATE_TEXT[rig.state]
        text.append(f"{rig.name}: ", style="bold")
        text.append(f"{label}\n", style=style)
        for finding in rig.findings:
            text.append(f"  {_mark(finding.level)} {finding.reason}\n", style=_STYLE[finding.level])
    return text


def status_table(fleet: FleetStatus) -> Table:
    """One row per rig, and one more per GPU after the first; drift red, warnings yellow."""
    table = Table(title=f"rigbook status: {fleet.inventory}", show_lines=True)
    for header in COLUMNS:
        table.add_column(header, overflow="fold")
    for rig in fleet.rigs:
        text, style = _STATE_TEXT[rig.state]
        head = Text(f"{rig.name}\n{rig.platform} {rig.gpu_class} x{rig.gpu_count}")
        if rig.state == "unreachable":
            table.add_row(head, Text(text, style=style), Text(rig.error or "", style=style),
                          *[""] * (len(COLUMNS) - 4), _serving_cell(rig))
            continue
        for position, gpu in enumerate(rig.gpus or [None]):
            first = position == 0
            uuid = gpu.uuid if gpu else None

            def here(*areas: str, uuid=uuid, first=first, rig=rig) -> list[Finding]:
                """This row's findings: its GPU's, and on the first row the rig-wide ones."""
                return [f for f in rig.findings
                        if f.area in areas and (f.gpu == uuid or (first and f.gpu is None))]

            def anywhere(*areas: str, rig=rig) -> list[Finding]:
                return [f for f in rig.findings if f.area in areas]

            persist = "-" if gpu is None or gpu.persistence is None else (
                "on" if gpu.persistence else "off")
            in_unit = "n/a" if rig.platform == "wsl2" or gpu is None else _w(gpu.cap_unit_w)
            cap = "-" if gpu is None else (
                f"{_w(gpu.cap_desired_w)} / {in_unit} / {_w(gpu.cap_live_w)}"
            )
            faults = _faults_text(rig, gpu.index if gpu else None)
            if gpu is not None and first and rig.kernel_log and rig.kernel_log.source:
                unmapped = _xid_summary(rig.kernel_log, None)  # cards nvidia-smi lost
                faults += f"\nno GPU listed: {unmapped}" if unmapped else ""
            if first and rig.gpu_lost:  # the Xid watch's mark is about the rig
                faults = f"GPU-lost mark set\n{faults}"
            table.add_row(
                head if first else "",
                Text(text, style=style) if first else "",
                _cell(f"{gpu.index} {_short_name(gpu.name)}" if gpu else "none", here("gpu")),
                _cell(_driver_text(rig), anywhere("driver")) if first else "",
                _cell(persist, here("persistence")),
                _cell(cap, here("power")),
                _cell(_tuning_text(rig), anywhere("tuning")) if first else "",
                _cell(_wsl_text(rig), anywhere("wsl", "platform")) if first else "",
                _cell(_disk_text(rig), anywhere("disk")) if first else "",
                _cell(faults, here("faults")),
                _serving_cell(rig) if first else "",
            )
    return table


def render(fleet: FleetStatus) -> Group:
    """The table, then the findings that colour it."""
    return Group(status_table(fleet), findings_text(fleet))


# --- gathering -----------------------------------------------------------------------------


class _HostLog(logging.Handler):
    """Keeps what pyinfra logs about each host while facts are read, instead of printing it.

    pyinfra reports a fact that failed (non-zero exit, unparsable output, a dropped connection)
    only through its logger, as "[host] ..." lines; they become the reason a fact is unread.
    """

    def __init__(self, names: Iterable[str]):
        super().__init__(logging.WARNING)
        self.lines: dict[str, list[str]] = {name: [] for name in names}

    def emit(self, record: logging.LogRecord) -> None:
        text = _ANSI.sub("", record.getMessage())
        match = re.match(r"^\s*\[([^\]]+)\]\s*(.*)$", text, re.DOTALL)
        if match and match.group(1) in self.lines:
            self.lines[match.group(1)].append(match.group(2).strip())


class _QuietLoggers:
    """pyinfra's and paramiko's loggers go to a _HostLog only, for the length of the block."""

    def __init__(self, handler: logging.Handler):
        self.handler = handler
        self.saved: list[tuple[logging.Logger, bool]] = []

    def __enter__(self):
        for name in ("pyinfra", "paramiko"):
            logger = logging.getLogger(name)
            self.saved.append((logger, logger.propagate))
            logger.propagate = False
            logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        for logger, propagate in self.saved:
            logger.removeHandler(self.handler)
            logger.propagate = propagate


def _limit(inventory: Inventory, limit: list[str] | None) -> list:
    """The hosts --limit names: host names, group names or globs, as pyinfra's --limit."""
    hosts = list(inventory)
    if not limit:
        return hosts
    chosen, unknown = [], []
    for pattern in limit:
        try:
            matched = list(inventory.get_group(pattern))
        except NoGroupError:
            matched = [host for host in hosts if fnmatch(host.name, pattern)]
        if not matched:
            unknown.append(pattern)
        chosen += [host for host in matched if host not in chosen]
    if unknown:
        raise RigbookError(
            f"--limit {', '.join(unknown)}: no such rig or group in the inventory; rigs: "
            + ", ".join(host.name for host in hosts)
        )
    return [host for host in hosts if host in chosen]


def _read_facts(
    state: State, host, rig: Rig, log: _HostLog, on_fact: Callable[[str], None]
) -> RigFacts:
    """Every fact of fact_plan(rig), one after the other; a failing one is noted in unread."""
    facts = RigFacts()
    for name, fact, kwargs in fact_plan(rig, host.name):
        on_fact(name)
        before = len(log.lines[host.name])
        try:
            value = get_fact(state, host, fact, kwargs={**kwargs, "_timeout": FACT_TIMEOUT_S},
                             apply_failed_hosts=False)
        except Exception as e:  # a fact that breaks must not stop the other facts or rigs
            facts.unread[name] = f"{type(e).__name__}: {e}"
            continue
        errors = log.lines[host.name][before:]
        if errors:
            facts.unread[name] = "; ".join(errors[-3:])
        else:
            store_fact(facts, name, value)
    return facts


def gather(
    inventory_file: str, limit: list[str] | None, console: Console
) -> FleetStatus:
    """Read every (limited) rig of an inventory in parallel and build the fleet's status."""
    if not Path(inventory_file).is_file():  # pyinfra would read a missing file as host names
        raise RigbookError(f"no inventory file {inventory_file}")
    inventory, rigs = load_inventory(inventory_file)  # all validated before anything is contacted
    hosts = _limit(inventory, limit)
    state = State(inventory, Config(PARALLEL=max(len(hosts), 1)), initial_limit=hosts)
    log = _HostLog(host.name for host in hosts)
    results: dict[str, RigStatus] = {}
    interactive = console.is_terminal
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        console=console, transient=True, disable=not interactive,
    )

    def one(host) -> None:
        rig = rigs[host.name]
        steps = len(fact_plan(rig, host.name)) + 1
        task = progress.add_task(f"{host.name}: connecting", total=steps)
        try:
            host.connect(show_errors=False, raise_exceptions=True)
        except Exception as e:  # ConnectError, or a connector that cannot even start (no key)
            text = str(e.args[0] if e.args else e)
            if not isinstance(e, ConnectError):
                text = f"{type(e).__name__}: {text}"
            why = _ANSI.sub("", text)
            results[host.name] = unreachable_status(host.name, rig, why)
            progress.console.print(
                Text(f"{host.name}: could not be reached: {why}", style="bold red"),
                soft_wrap=True,
            )
            progress.update(task, visible=False)
            return
        state.activate_host(host)
        facts = _read_facts(
            state, host, rig, log,
            lambda name: progress.update(
                task, description=f"{host.name}: {fact_label(name)}", advance=1
            ),
        )
        results[host.name] = build_rig_status(host.name, rig, facts)
        progress.update(task, description=f"{host.name}: done", advance=1)

    if not interactive:
        console.print(f"rigbook status: reading {len(hosts)} rig(s) ...", highlight=False)
    with ctx_state.use(state), _QuietLoggers(log), progress:
        greenlets = [state.pool.spawn(one, host) for host in hosts]
        gevent.joinall(greenlets, raise_error=True)
        disconnect_all(state)
    ordered = [results[host.name] for host in hosts]
    return FleetStatus(inventory=inventory_file, rigs=ordered, exit_code=fleet_exit_code(ordered))


def status(inventory_file: str, limit: list[str] | None, as_json: bool) -> int:
    """`rigbook status INVENTORY [--limit NAME ...] [--json]`; returns the exit status.

    0: every rig as declared; 1: drift; 2: a rig unreachable or a GPU gone. Progress and one
    line per unreachable rig go to stderr; the table (or the JSON) to stdout.
    """
    err = Console(stderr=True)
    fleet = gather(inventory_file, limit, err)
    if as_json:
        sys.stdout.write(fleet.model_dump_json(indent=2) + "\n")
    else:
        # a terminal's width, or COLUMNS; piped without COLUMNS, wide enough for the table
        wide = sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
        out = Console(width=None if wide else 200)
        out.print(render(fleet))
    return fleet.exit_code
