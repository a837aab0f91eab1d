"""`rigbook status`: what every rig is actually doing, and where it drifted from the inventory.

Operators look before they touch anything, so this reads and never changes. It loads the
inventory the way a deploy does (rigbook/inventory.py: every host validated into a `Rig`),
connects to every rig in parallel over the same pyinfra connectors (SSH, @local), reads the
facts that every role's checks need in one round trip per rig, and runs those checks
(every role's checks as rigbook/registry.py lists them, the same a deploy's preflight runs).
Nothing is decided here; a value a deploy would refuse shows as drift.

Three layers, so tests feed real captured output to the same code:

- gathering (`gather`): pyinfra's API, one greenlet per rig; a rig that cannot be reached gets
  one clear line and the others go on;
- building (`build_rig_status`): pure, from the rig's `Facts` to a pydantic `RigStatus`: the
  roles' findings (warn / drift / gone) and rows that show the facts;
- showing (rigbook/status_table.py, `--json`): a rich table, or `FleetStatus` as JSON.

Exit status: 0 every rig as declared, 1 drift, 2 a rig unreachable or a GPU gone (nvidia-smi
fails, Xid 79 / 154 since the last boot, or the Xid watch's GPU-lost mark is set), 4 a driver
whose user space and loaded kernel module disagree (the kernel's API mismatch).
docs/status.md explains every column.

GPU facts come from nvidia-smi (rigbook.core.facts.NvidiaGpus). GPU health (roles/health.py) comes
from NVML through rigbook's probe where the tools venv can run it, else from nvidia-smi.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import gevent
from pydantic import model_validator
from pyinfra.api import Config, State
from pyinfra.api.connect import disconnect_all
from pyinfra.api.exceptions import ConnectError
from pyinfra.context import ctx_state
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.text import Text

from rigbook.core.checks import Facts, Read, read_facts, reads_of, run_checks
from rigbook.core.checks import Finding as CheckFinding
from rigbook.core.errors import RigbookError
from rigbook.core.reboot import reboot_reasons
from rigbook.core.spec import Rig
from rigbook.core.types import StrictModel
from rigbook.inventory import load_inventory
from rigbook.registry import checks_of
from rigbook.rigside.gpus import Gpu
from rigbook.roles.disks import by_mount
from rigbook.roles.driver import driver_packages, driver_versions, foreign_of, wanted
from rigbook.roles.driver_source import describe
from rigbook.roles.guards import card_histories, gpu_lost_reason, xid_events
from rigbook.roles.models import model_state, unreferenced, wanted_models
from rigbook.roles.power import asked_cap, unit_caps
from rigbook.roles.serving import health_text, plan_of, running_recipe
from rigbook.roles.tuning import parse_sysctl_conf, shm_fstab, sysctl_values
from rigbook.roles.venvs import spec_hash, venv_condition
from rigbook.roles.wsl import RegProbe, memory_findings, tdr_values

#: Seconds the fact command may run on a rig (nvidia-smi has its own 60 s limit inside).
FACT_TIMEOUT_S = 300

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# --- the status model ----------------------------------------------------------------------

Level = Literal["warn", "drift", "gone", "mismatch"]
RigState = Literal["as-declared", "drift", "gpu-gone", "unreachable", "driver-mismatch"]
VenvCondition = Literal[
    "current", "stale", "incompatible", "spec-changed", "missing", "not-rigbook", "unknown"
]
ModelState = Literal["complete", "partial", "missing", "unknown"]


class Finding(StrictModel):
    """One thing that is not as declared (drift), unusable (gone) or worth a look (warn)."""

    level: Level
    area: str
    reason: str
    gpu: str | None = None  # the GPU's UUID when the finding is about one GPU


class XidEvent(StrictModel):
    """One Xid from the kernel log, with the GPU it names when that GPU is listed."""

    code: int
    label: str
    gone: bool
    pci: str
    gpu_index: int | None
    when: str | None
    message: str
    this_boot: bool


class GpuStatus(StrictModel):
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


class DriverStatus(StrictModel):
    declared: str
    installed: list[str]
    loaded: str | None
    running: str | None
    smi: str | None
    smi_error: str | None
    packages: list[str]
    unheld: list[str]
    reboot_pending: list[str]
    source: str  # where the driver came from (rigbook.roles.driver_source): apt packages, a runfile


class PowerUnitStatus(StrictModel):
    present: bool
    enabled: str | None
    caps: dict[str, float]


class SysctlStatus(StrictModel):
    key: str
    declared: str
    file: str | None
    live: str | None
    read_only: bool


class ShmStatus(StrictModel):
    declared: str | None
    fstype: str | None
    size_bytes: int | None
    used_bytes: int | None
    mem_total_bytes: int
    fstab: list[str]


class WslStatus(StrictModel):
    tdr_declared: dict[str, int]
    tdr: dict[str, int | str | None]
    tdr_error: str | None
    memory: list[str]


class DiskStatus(StrictModel):
    mount: str
    paths: list[str]
    size_bytes: int
    avail_bytes: int


class CardHistoryStatus(StrictModel):
    """A card's reset- or reboot-bound Xids over the boots the journal keeps (roles/guards.py)."""

    pci: str
    gpu_index: int | None
    serial: str | None
    codes: list[int]
    dates: list[str]


class KernelLogStatus(StrictModel):
    source: str | None
    error: str | None
    xids: list[XidEvent]
    history: list[CardHistoryStatus] = []


class VenvStatus(StrictModel):
    """One declared venv as the rig has it (roles/venvs.py: symlink, build, manifest)."""

    name: str
    state: VenvCondition
    build: str | None = None  # the build the symlink points at
    built_driver: str | None = None  # the driver its manifest says it was built for
    running_driver: str | None = None
    spec_hash: str | None = None  # what the inventory's spec hashes to now
    built_spec_hash: str | None = None
    reason: str = ""  # why it is not current ("" when it is)


class ModelStatus(StrictModel):
    """One pinned snapshot in the HF cache: from the rig's models or its recipe's pins."""

    repo: str
    revision: str
    source: Literal["models", "recipe"]
    state: ModelState
    files: int = 0  # files in rigbook's manifest of that snapshot (0: none)
    bytes: int = 0
    missing_files: int | None = None  # missing or wrong-size files; None: not known
    reason: str = ""


class CachedRepoStatus(StrictModel):
    repo: str
    bytes: int


class CacheStatus(StrictModel):
    """The rig's HF cache: where it is, and the repos in it that models does not list."""

    path: str
    exists: bool
    unlisted: list[CachedRepoStatus]
    prune: bool  # models_prune: the converge removes the unlisted repos


class ServingStatus(StrictModel):
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


class RigStatus(StrictModel):
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
        return {"as-declared": 0, "drift": 1, "gpu-gone": 2, "unreachable": 2,
                "driver-mismatch": 4}[self.state]


class FleetStatus(StrictModel):
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
    if "mismatch" in levels:  # it names why the GPUs are gone, and the one way back
        return "driver-mismatch"
    return "gpu-gone" if "gone" in levels else "drift" if "drift" in levels else "as-declared"


def fleet_exit_code(rigs: Iterable[RigStatus]) -> int:
    """0 all as declared, 1 drift, 2 a rig unreachable or a GPU gone, 4 a driver mismatch."""
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


def gpus_of(facts: Facts) -> tuple[Gpu, ...]:
    """The GPUs nvidia-smi listed, when it was read and answered (else none)."""
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
    if not _read(facts, "installed", "holds", "loaded", "reboot_marker", "driver_source"):
        return None
    probe = facts.probe
    running = probe.driver_version if probe is not None and probe.ok else None
    installed = driver_versions(facts.installed or {})
    packages = driver_packages(facts.installed or {})
    smi = {"smi": probe.smi if probe else None, "smi_error": probe.error if probe else None}
    if rig.platform == "wsl2":
        return DriverStatus(declared="Windows driver", installed=sorted(installed), loaded=None,
                            running=running, packages=packages, unheld=[], reboot_pending=[],
                            source="the Windows driver", **smi)
    foreign = foreign_of(rig, facts)
    source = describe(foreign, installed)
    if foreign is not None and rig.driver_foreign == "adopt":
        source += " (adopted: driver_foreign)"
    return DriverStatus(
        declared=wanted(rig), installed=sorted(installed), loaded=facts.loaded, running=running,
        packages=packages, unheld=[name for name in packages if name not in (facts.holds or ())],
        reboot_pending=reboot_reasons(installed, facts.loaded, facts.reboot_marker or []),
        source=source, **smi,
    )


def _unit_row(rig: Rig, facts: Facts) -> PowerUnitStatus | None:
    if rig.platform == "wsl2" or facts.systemd is False or not _read(facts, "unit"):
        return None  # no unit can hold the caps there: nothing to show or advise
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
    ], history=[
        CardHistoryStatus(pci=card.pci, gpu_index=card.gpu.index if card.gpu else None,
                          serial=card.serial, codes=list(card.codes), dates=list(card.dates))
        for card in card_histories(log, gpus)
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

    The findings are the roles' own checks (rigbook/registry.py `checks_of`); the rows show the
    facts they were decided on. Pure but for the serving plan, which reads the recipe catalogue
    (and the API key file) on this machine, as a deploy does.
    """
    findings = [_finding(f) for f in run_checks(rig, name, checks_of(), facts)]
    gpus = gpus_of(facts)
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
    inventory_file: str, limit: list[str] | None, console: Console,
    extra: tuple[Read, ...] = (), facts_of: dict[str, Facts] | None = None,
) -> FleetStatus:
    """Read every (limited) rig of an inventory in parallel and build the fleet's status.
    `extra` reads more facts in the same round trip, into `facts_of` (`rigbook report`)."""
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
        reads = [*reads_of(rig, host.name, checks_of()), *extra]
        facts = read_facts(state, host, reads, timeout=FACT_TIMEOUT_S)
        if facts_of is not None:
            facts_of[host.name] = facts
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
