"""`rigbook status`: what every rig is actually doing, and where it drifted from the inventory.

Operators look before they touch anything, so this reads and never changes. It loads the
inventory the way a deploy does (roles/inventory.py: every host validated into a `Rig`),
connects to every rig in parallel over the same pyinfra connectors (SSH, @local), reads the
facts that every role's checks need in one round trip per rig, and runs those checks
(roles/checks.py: each role's `CHECKS`, the same functions a deploy's preflight runs). Nothing
is decided here; a value a deploy would refuse shows as drift.

Three layers, so tests feed real captured output to the same code:

- gathering (`gather`): pyinfra's API, one greenlet per rig; a rig that cannot be reached gets
  one clear line and the others go on;
- building (`build_rig_status`): pure, from the rig's `Facts` to a pydantic `RigStatus`: the
  roles' findings (warn / drift / gone) and rows that show the facts;
- showing (`status_table`, `--json`): a rich table, or `FleetStatus` as JSON.

Exit status: 0 every rig as declared, 1 drift, 2 a rig unreachable or a GPU gone (nvidia-smi
fails, Xid 79 / 154 since the last boot, or the Xid watch's GPU-lost mark is set).
docs/status.md explains every column.

GPU facts come from nvidia-smi (rigbook.facts.NvidiaGpus). GPU health (roles/health.py) comes from
NVML through rigbook's probe where the tools venv can run it, else from nvidia-smi.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import gevent
from pydantic import BaseModel, ConfigDict, model_validator
from pyinfra.api import Config, State
from pyinfra.api.connect import disconnect_all
from pyinfra.api.exceptions import ConnectError
from pyinfra.context import ctx_state
from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

from rigbook.checks import Facts, every_check, read_facts, reads_of, run_checks
from rigbook.checks import Finding as CheckFinding
from rigbook.disks import by_mount
from rigbook.driver import driver_packages, driver_versions, reboot_reasons, wanted
from rigbook.errors import RigbookError
from rigbook.gpus import Gpu
from rigbook.guards import gpu_lost_reason, xid_events
from rigbook.inventory import load_inventory
from rigbook.models import human, model_state, unreferenced, wanted_models
from rigbook.power import asked_cap, unit_caps, watts
from rigbook.serving import health_text, plan_of, running_recipe
from rigbook.spec import Rig
from rigbook.tuning import gib, parse_sysctl_conf, same_sysctl, shm_fstab, sysctl_values
from rigbook.venvs import spec_hash, venv_condition
from rigbook.wsl import RegProbe, memory_findings, tdr_values

#: Seconds the fact command may run on a rig (nvidia-smi has its own 60 s limit inside).
FACT_TIMEOUT_S = 300

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


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


def _finding(finding: CheckFinding) -> Finding:
    """A role's finding as status shows it: a value the deploys refuse is drift here, with the
    host-data key it concerns."""
    if finding.level == "error":
        return Finding(level="drift", area=finding.area, reason=finding.text, gpu=finding.gpu)
    return Finding(level=finding.level, area=finding.area, reason=finding.reason, gpu=finding.gpu)


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


def _read(facts: Facts, *names: str) -> bool:
    """All these facts were read (none is in facts.unread)."""
    return not any(name in facts.unread for name in names)


def _gpus(facts: Facts) -> tuple[Gpu, ...]:
    probe = facts.probe
    return probe.gpus if _read(facts, "probe") and probe is not None and probe.ok else ()


def _gpu_row(rig: Rig, gpu: Gpu, unit: dict[str, float] | None) -> GpuStatus:
    """One GPU's row: persistence and its cap as declared, in the unit, and live."""
    try:
        desired, source = asked_cap(rig, gpu)
    except ValueError:
        desired, source = None, None
    else:
        desired = gpu.default_limit_w if desired is None else desired
    return GpuStatus(
        index=gpu.index, uuid=gpu.uuid, name=gpu.name, bus_id=gpu.bus_id,
        driver_version=gpu.driver_version, persistence=gpu.persistence,
        cap_desired_w=desired, cap_source=source,
        cap_unit_w=None if unit is None else unit.get(gpu.uuid), cap_live_w=gpu.power_limit_w,
        default_limit_w=gpu.default_limit_w, min_limit_w=gpu.min_limit_w,
        max_limit_w=gpu.max_limit_w, power_draw_w=gpu.power_draw_w,
        memory_used_mib=gpu.memory_used_mib, memory_total_mib=gpu.memory_total_mib,
        temperature_c=gpu.temperature_c,
    )


def _driver_row(rig: Rig, facts: Facts) -> DriverStatus | None:
    if not _read(facts, "installed", "holds", "loaded", "reboot_marker"):
        return None
    probe = facts.probe
    running = probe.driver_version if probe is not None and probe.ok else None
    installed = driver_versions(facts.installed or {})
    packages = driver_packages(facts.installed or {})
    smi = {"smi": probe.smi if probe else None, "smi_error": probe.error if probe else None}
    if rig.platform == "wsl2":
        return DriverStatus(declared="Windows driver", installed=sorted(installed), loaded=None,
                            running=running, packages=packages, unheld=[], reboot_pending=[],
                            **smi)
    return DriverStatus(
        declared=wanted(rig), installed=sorted(installed), loaded=facts.loaded, running=running,
        packages=packages, unheld=[name for name in packages if name not in (facts.holds or ())],
        reboot_pending=reboot_reasons(installed, facts.loaded, facts.reboot_marker or []), **smi,
    )


def _unit_row(rig: Rig, facts: Facts) -> PowerUnitStatus | None:
    if rig.platform == "wsl2" or not _read(facts, "unit"):
        return None
    if facts.unit is None:
        return PowerUnitStatus(present=False, enabled=None, caps={})
    return PowerUnitStatus(present=True, enabled=facts.unit.enabled,
                           caps=unit_caps(facts.unit.exec_starts)[0])


def _sysctl_rows(rig: Rig, facts: Facts) -> list[SysctlStatus]:
    if not _read(facts, "sysctl_file", "sysctl_live"):
        return []
    in_file = parse_sysctl_conf(facts.sysctl_file) if facts.sysctl_file is not None else {}
    rows = []
    for key, declared in sysctl_values(rig).items():
        live = (facts.sysctl_live or {}).get(key)
        rows.append(SysctlStatus(
            key=key, declared=declared, file=in_file.get(key),
            live=live.value if live is not None else None,
            read_only=live.read_only if live is not None else False,
        ))
    return rows


def _shm_row(rig: Rig, facts: Facts) -> ShmStatus | None:
    shm = facts.shm
    if not _read(facts, "shm", "fstab") or shm is None:
        return None
    return ShmStatus(
        declared=rig.shm_size, fstype=shm.fstype, size_bytes=shm.size_bytes,
        used_bytes=shm.used_bytes, mem_total_bytes=shm.mem_total_bytes,
        fstab=shm_fstab(facts.fstab),
    )


def _wsl_row(rig: Rig, facts: Facts, name: str) -> WslStatus | None:
    if rig.platform != "wsl2" or not _read(facts, "registry", "profiles"):
        return None
    probe = facts.registry or RegProbe({}, "not read")
    memory: list[str] = []
    if facts.shm is not None:
        warnings, fine = memory_findings(
            name, facts.profiles or [], facts.shm.mem_total_bytes, rig.wsl_min_memory_gib
        )
        memory = [line.removeprefix(f"{name}: ") for line in warnings + fine]
    return WslStatus(tdr_declared=tdr_values(rig), tdr=dict(probe.values), tdr_error=probe.error,
                     memory=memory)


def _disk_rows(facts: Facts) -> list[DiskStatus]:
    if not _read(facts, "disks"):
        return []
    return [DiskStatus(mount=mount, paths=paths, size_bytes=disk.size_bytes,
                       avail_bytes=disk.avail_bytes)
            for mount, (disk, paths) in by_mount(facts.disks or []).items()]


def _kernel_log_row(facts: Facts, gpus: tuple[Gpu, ...]) -> KernelLogStatus | None:
    log = facts.klog
    if not _read(facts, "klog") or log is None:
        return None
    return KernelLogStatus(source=log.source, error=log.error, xids=[
        XidEvent(code=xid.code, label=xid.label, gone=xid.gone, pci=xid.pci,
                 gpu_index=gpu.index if gpu else None, when=xid.when, message=xid.message,
                 this_boot=this_boot)
        for xid, this_boot, gpu in xid_events(log, gpus)
    ])


def _venv_rows(rig: Rig, facts: Facts) -> list[VenvStatus]:
    probe = facts.probe
    driver = probe.driver_version if probe is not None and probe.ok and probe.gpus else None
    rows = []
    for spec in rig.venvs:
        state = (facts.venvs or {}).get(spec.name)
        if not _read(facts, f"venvs:{spec.name}") or state is None:
            rows.append(VenvStatus(name=spec.name, state="unknown"))
            continue
        kind, why = venv_condition(rig, spec, state, driver)
        manifest = state.manifest
        rows.append(VenvStatus(
            name=spec.name, state=kind, reason=why, build=state.target_build,
            running_driver=driver, spec_hash=spec_hash(spec, rig),
            built_driver=manifest.get("driver") if manifest else None,
            built_spec_hash=manifest.get("spec_hash") if manifest else None,
        ))
    return rows


def _model_rows(rig: Rig, facts: Facts, name: str
                ) -> tuple[list[ModelStatus], CacheStatus | None]:
    wanted = wanted_models(rig, name)
    cache = facts.cache
    if not _read(facts, "cache") or cache is None:
        return [ModelStatus(repo=spec.repo, revision=spec.revision, source=source,
                            state="unknown") for spec, source in wanted], None
    rows = []
    for spec, source in wanted:
        state, status = model_state(cache, spec)
        known = {"repo": spec.repo, "revision": spec.revision, "source": source,
                 "files": status.files, "bytes": status.bytes}
        if state == "complete":
            rows.append(ModelStatus(state=state, **known))
        else:
            missing = len(status.missing) + len(status.wrong_size) if status.files else None
            rows.append(ModelStatus(state=state, missing_files=missing,
                                    reason=status.reason.removeprefix("partial: "), **known))
    extra = unreferenced(cache, {spec.repo for spec in rig.models})
    return rows, CacheStatus(
        path=cache.cache, exists=cache.exists, prune=rig.models_prune,
        unlisted=[CachedRepoStatus(repo=repo.repo, bytes=repo.bytes) for repo in extra],
    )


def _serving_row(rig: Rig, facts: Facts, name: str) -> ServingStatus | None:
    if rig.recipe is None:
        return None
    plan, _ = plan_of(rig, name)
    if plan is None:
        return ServingStatus(recipe=rig.recipe)
    probe = facts.serving
    if not _read(facts, "serving", "serving_recipe") or probe is None:
        return ServingStatus(recipe=rig.recipe, url=plan.url)
    return ServingStatus(
        recipe=rig.recipe, running_recipe=running_recipe(facts.serving_recipe), url=plan.url,
        unit=probe.active, sub=probe.sub, enabled=probe.enabled or None,
        healthy=bool((probe.answer or {}).get("ok")) if probe.running else None,
        health=health_text(probe) if probe.running else None,
        other_engines=[f"pid {pid} {cmd}" for pid, cmd in probe.engines],
    )


def build_rig_status(name: str, rig: Rig, facts: Facts) -> RigStatus:
    """What one rig is doing and every way it differs from its host data.

    The findings are the roles' own checks (roles/checks.py `every_check`); the rows show the
    facts they were decided on. Pure but for the serving plan, which reads the recipe catalogue
    (and the API key file) on this machine, as a deploy does.
    """
    findings = [_finding(f) for f in run_checks(rig, name, every_check(), facts)]
    gpus = _gpus(facts)
    unit = _unit_row(rig, facts)
    models, cache = _model_rows(rig, facts, name)
    return RigStatus(
        name=name, state=state_of(findings), platform=rig.platform, gpu_class=rig.gpu_class,
        gpu_count=rig.gpu_count,
        gpus=[_gpu_row(rig, gpu, unit.caps if unit and unit.present else None) for gpu in gpus],
        driver=_driver_row(rig, facts), power_unit=unit, sysctl=_sysctl_rows(rig, facts),
        shm=_shm_row(rig, facts), stale_files=list(facts.stale_present or []),
        wsl=_wsl_row(rig, facts, name), disks=_disk_rows(facts),
        kernel_log=_kernel_log_row(facts, gpus),
        gpu_lost=gpu_lost_reason(facts.gpu_lost) if _read(facts, "gpu_lost") else None,
        venvs=_venv_rows(rig, facts), models=models, models_cache=cache,
        serving=_serving_row(rig, facts, name), findings=findings,
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
        size = "?" if rig.shm.size_bytes is None else gib(rig.shm.size_bytes)
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

    pyinfra reports a fact command that failed (a dropped connection, a timeout) only through
    its logger, as "[host] ..." lines; they become the reason the rig's facts are unread.
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


def gather(
    inventory_file: str, limit: list[str] | None, console: Console
) -> FleetStatus:
    """Read every (limited) rig of an inventory in parallel and build the fleet's status."""
    if not Path(inventory_file).is_file():  # pyinfra would read a missing file as host names
        raise RigbookError(f"no inventory file {inventory_file}")
    # every rig of the limit validated before anything is contacted
    inventory, hosts, rigs = load_inventory(inventory_file, limit=limit)
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
        task = progress.add_task(f"{host.name}: connecting", total=2)
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
        progress.update(task, description=f"{host.name}: reading facts", advance=1)
        reads = reads_of(rig, host.name, every_check())
        facts = read_facts(state, host, reads, timeout=FACT_TIMEOUT_S)
        lost = log.lines[host.name]  # pyinfra logs a connection that dropped while reading
        if lost:
            facts.unread.update({read.name: "; ".join(lost[-3:]) for read in reads})
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
