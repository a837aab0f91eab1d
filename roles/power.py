"""GPU power caps: a boot unit that is the truth, and live caps made to match it.

A cap set by hand with `nvidia-smi -pl` is gone after a reboot or a driver unload, and a unit
that disagrees with the live cap is how fleets drift. rigbook writes
/etc/systemd/system/nvidia-power-limit.service (one `nvidia-smi -i <UUID> -pl <W>` per GPU, run
after nvidia-persistenced at every boot), then sets the live cap only where it differs and reads
it back.

The GPUs, their UUIDs and their limits are read from the rig when the operations execute, not
when the deploy is planned: on a new rig they appear only after the driver was installed and
the rig rebooted earlier in the same run. The checks (`CHECKS`: count, power_caps keys, the
card's own min/max) run in every deploy's preflight, before anything on the rig changes, and
again in the operations themselves (persistence mode too); one bad value fails that rig and
changes nothing on it, while the other rigs go on.

On WSL2 the Windows driver owns the cards: rigbook writes no unit, changes no cap and reports
the live caps (docs/power.md, "WSL2").
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from pyinfra import host, logger, state
from pyinfra.api import (
    BaseStateCallback,
    FactBase,
    FunctionCommand,
    QuoteString,
    StringCommand,
    deploy,
    operation,
)
from pyinfra.api.exceptions import FactProcessError
from pyinfra.operations import systemd
from rich.console import Console
from rich.table import Table

from rigbook import FILES
from rigbook.core import runfacts
from rigbook.core.checks import Check, Facts, Finding, Read, drift, error, warn
from rigbook.core.errors import RigbookError
from rigbook.core.facts import GPUS, GPUS_READ, NvidiaGpus, count_finding, usable
from rigbook.core.managed import expect
from rigbook.core.messages import warn_once
from rigbook.core.render import render, template_commands
from rigbook.core.runfacts import once
from rigbook.core.spec import Rig
from rigbook.core.types import JsonValue
from rigbook.core.units import SYSTEMD_READ, booted, service_commands
from rigbook.rigside.cap_check import LINE as CAP_LINE
from rigbook.rigside.gpus import SMI_ADVICE, Gpu, GpuProbe, smi_failure

UNIT_NAME = "nvidia-power-limit.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT_NAME}"
UNIT_TEMPLATE = str(FILES / "power" / f"{UNIT_NAME}.j2")

#: Live and desired caps closer than this (watts) are equal: nvidia-smi prints two decimals and
#: some cards round the limit they store.
TOLERANCE_W = 0.5


def watts(value: float | None) -> str:
    """290.0 -> '290', 350.5 -> '350.5', None -> '?': how caps are written and shown."""
    return "?" if value is None else f"{value:g}"


@dataclass(frozen=True)
class GpuCap:
    """The cap one GPU gets, where it came from, and the card as it was read."""

    index: int
    uuid: str
    name: str
    watts: float
    source: str
    live_w: float | None
    min_w: float
    max_w: float
    persistence: bool | None = None

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid})"

    @property
    def watts_arg(self) -> str:
        return watts(self.watts)

    @property
    def range(self) -> str:
        return f"{watts(self.min_w)}-{watts(self.max_w)} W"

    @property
    def in_place(self) -> bool:
        """The live cap already is the desired one."""
        return same_w(self.live_w, self.watts)


# --- cap policy ----------------------------------------------------------------------------


def asked_cap(rig: Rig, gpu: Gpu) -> tuple[float | None, str]:
    """(watts, which key asked) for one GPU; None watts means the card's default (stock).

    power_caps (by index or UUID) > power_cap_watts > power_profile (Rig.default_cap()).
    """
    by_index, by_uuid = rig.power_caps.get(str(gpu.index)), rig.power_caps.get(gpu.uuid)
    if by_index is not None and by_uuid is not None and by_index != by_uuid:
        raise ValueError(
            f"power_caps names this GPU twice, by index ({by_index} W) and by UUID "
            f"({by_uuid} W); name it once"
        )
    if by_uuid is not None:
        return by_uuid, f"power_caps[{gpu.uuid}]"
    if by_index is not None:
        return by_index, f"power_caps[{gpu.index}]"
    if rig.power_cap_watts is not None:
        return rig.power_cap_watts, "power_cap_watts"
    default = rig.default_cap()
    if default is None:
        return None, "power_profile stock (the card's default limit)"
    return default, f"power_profile {rig.power_profile} ({rig.gpu_class}, {rig.cooling})"


def _key(source: str) -> str:
    """The host-data key a cap source names: "power_caps[0]" -> "power_caps"."""
    return source.split("[")[0].split(" ")[0]


def cap_plan(rig: Rig, gpus: Iterable[Gpu]) -> tuple[tuple[GpuCap, ...], list[Finding]]:
    """The cap of every GPU the rig can take, and an error finding for each one it cannot:
    a power_caps key this rig does not have, a GPU named twice, a cap outside the card's own
    min/max (power.min_limit / power.max_limit), a card that reports no range or no default."""
    gpus = sorted(gpus, key=lambda gpu: gpu.index)
    problems: list[Finding] = []
    uuids = {gpu.uuid for gpu in gpus}
    indexes = {str(gpu.index) for gpu in gpus}
    for key in rig.power_caps:
        if key not in uuids and key not in indexes:
            problems.append(error(
                "power", f"names GPU {key}, which this rig does not have; allowed: its GPUs "
                f"({', '.join(f'{gpu.index} {gpu.uuid}' for gpu in gpus) or 'none'})",
                key="power_caps",
            ))
    caps = []
    for gpu in gpus:
        label = f"GPU {gpu.index} ({gpu.uuid})"
        try:
            asked, source = asked_cap(rig, gpu)
        except ValueError as e:
            problems.append(error("power", f"{label}: {e}", key="power_caps", gpu=gpu.uuid))
            continue
        if asked is None:
            asked = gpu.default_limit_w
            if asked is None:
                problems.append(error("power", f"{label}: the card reports no default limit; "
                                      "allowed: a cap in watts", key="power_profile", gpu=gpu.uuid))
                continue
        if gpu.min_limit_w is None or gpu.max_limit_w is None:
            problems.append(error(
                "power", f"{label} asks {watts(asked)} W, but the card reports no power limit "
                "range, so it cannot be capped; allowed: no cap (power_profile stock)",
                key=_key(source), gpu=gpu.uuid,
            ))
            continue
        if not gpu.min_limit_w <= asked <= gpu.max_limit_w:
            problems.append(error(
                "power", f"{label} asks {watts(asked)} W ({source}); allowed: the card's range "
                f"{watts(gpu.min_limit_w)}-{watts(gpu.max_limit_w)} W", key=_key(source),
                gpu=gpu.uuid,
            ))
            continue
        caps.append(GpuCap(
            index=gpu.index, uuid=gpu.uuid, name=gpu.name, watts=float(asked), source=source,
            live_w=gpu.power_limit_w, min_w=gpu.min_limit_w, max_w=gpu.max_limit_w,
            persistence=gpu.persistence,
        ))
    return tuple(caps), problems


def desired_caps(rig: Rig, rig_name: str, gpus: Iterable[Gpu]) -> tuple[GpuCap, ...]:
    """The cap of every GPU, checked against what the rig reports; RigbookError if any is bad.

    Refused, all at once: a GPU count other than gpu_count, every problem of `cap_plan`, and
    persistence mode off (a cap does not hold between processes then).
    """
    gpus = tuple(gpus)
    caps, problems = cap_plan(rig, gpus)
    count = count_finding(rig, gpus)
    problems = ([count] if count else []) + problems
    off = [cap.label for cap in caps if cap.persistence is False]
    if off:
        problems.append(error(
            "power", f"persistence mode is Disabled on {', '.join(off)}: a cap does not hold "
            "between processes without it; allowed: persistence on (driver_persistence: true, "
            "which the driver role applies; deploys/rig.py)", key="driver_persistence",
        ))
    if problems:
        lines = "\n".join(f"  - {problem.message(rig_name)}" for problem in problems)
        raise RigbookError(f"{rig_name}: power caps refused, nothing was changed:\n{lines}")
    return caps


def render_unit(smi: str, caps: Iterable[GpuCap]) -> str:
    """The unit text power_unit writes (same template, same jinja settings)."""
    return render(UNIT_TEMPLATE, smi=smi, caps=tuple(caps))


# --- the unit as installed, and the power check ----------------------------------------------

_UNIT = "##RIGBOOK_UNIT##"
_ENABLED = "##RIGBOOK_ENABLED##"


@dataclass(frozen=True)
class PowerUnit(JsonValue):
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
        match = CAP_LINE.match(line)
        if match:
            caps[match.group("gpu")] = float(match.group("watts"))
        else:
            other.append(line)
    return caps, other


def same_w(value: float | None, desired: float) -> bool:
    return value is not None and abs(value - desired) <= TOLERANCE_W


def _unit_findings(unit: PowerUnit | None, gpus: tuple[Gpu, ...]) -> list[Finding]:
    if unit is None:
        return [drift("power", f"no {UNIT_NAME}: caps are lost at the next reboot")]
    caps, other = unit_caps(unit.exec_starts)
    found = [drift("power", f"{UNIT_NAME} has a line rigbook did not write: {line}")
             for line in other]
    if unit.enabled is not None and unit.enabled != "enabled":
        found.append(drift("power", f"{UNIT_NAME} is {unit.enabled}, not enabled"))
    listed = {gpu.uuid for gpu in gpus}
    found += [drift("power", f"{UNIT_NAME} caps {uuid}, which nvidia-smi does not list")
              for uuid in caps if uuid not in listed]
    return found


def power_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """Caps the cards cannot take (errors), and the unit and live caps against the inventory.
    Without systemd no unit can hold the caps: only the live caps are checked (the preflight
    says once that nothing survives a reboot there)."""
    unit_kept = rig.platform != "wsl2" and facts.systemd is not False
    names = ("probe", "unit") if unit_kept else ("probe",)
    if facts.missing(*names) or not usable(facts.probe):
        return facts.missing(*names)  # the GPU check says why there are no GPUs
    gpus = facts.probe.gpus
    caps, found = cap_plan(rig, gpus)
    unit = None
    if unit_kept:
        found += _unit_findings(facts.unit, gpus)
        unit = unit_caps(facts.unit.exec_starts)[0] if facts.unit else None
    for gpu in gpus:
        if rig.platform != "wsl2" and rig.driver_persistence and gpu.persistence is False:
            found.append(drift("persistence", f"GPU {gpu.index}: persistence mode is off",
                               gpu=gpu.uuid))
    for cap in caps:
        live, label = cap.live_w, f"GPU {cap.index}"
        if rig.platform == "wsl2":
            if not same_w(live, cap.watts):
                found.append(warn("power", f"{label}: live cap {watts(live)} W, inventory "
                                  f"{cap.watts_arg} W; set it on Windows (Administrator): "
                                  f"{windows_command(cap)}", gpu=cap.uuid))
            continue
        if unit is not None and not same_w(unit.get(cap.uuid), cap.watts):
            found.append(drift("power", f"{label}: unit caps {watts(unit.get(cap.uuid))} W, "
                               f"inventory {cap.watts_arg} W", gpu=cap.uuid))
        if not same_w(live, cap.watts):
            found.append(drift("power", f"{label}: live cap {watts(live)} W, inventory "
                               f"{cap.watts_arg} W", gpu=cap.uuid))
    return found


def windows_command(cap: GpuCap) -> str:
    """What the operator runs in an Administrator prompt on a WSL2 rig's Windows host."""
    return f"nvidia-smi -i {cap.uuid} -pl {cap.watts_arg}"


#: The unit as installed, for the checks of the roles that read it (power, the sweep).
UNIT_READ = Read("unit", PowerUnitFile, "power-limit unit")


def _power_reads(rig: Rig, rig_name: str) -> list[Read]:
    if rig.platform == "wsl2":
        return [GPUS_READ]
    return [GPUS_READ, UNIT_READ, SYSTEMD_READ]


CHECKS = (GPUS, Check("power caps", _power_reads, power_findings, gpus=True))


# --- the rig's GPUs ------------------------------------------------------------------------


def _visible_gpus() -> tuple[GpuProbe | None, str | None]:
    """(probe, None) when nvidia-smi lists GPUs, else (probe, why there are none to cap)."""
    probe = once(NvidiaGpus)
    if probe is None:
        return None, "driver not installed: no nvidia-smi"
    if not probe.ok:
        kind = smi_failure(probe.error or "")
        said = (probe.error or "").strip().splitlines()[0] if probe.error else "no output"
        return probe, f"{SMI_ADVICE.get(kind, 'nvidia-smi fails')}: {probe.smi}: {said}"
    if not probe.gpus:
        return probe, f"{probe.smi} lists no GPUs"
    return probe, None


def _not_yet(why: str) -> str:
    return f"no GPUs visible yet ({why}): power cap not applied; run again after the reboot"


def _live_list(gpus: Iterable[Gpu]) -> str:
    return ", ".join(
        f"GPU {gpu.index} ({gpu.uuid}) {watts(gpu.power_limit_w)} W "
        f"(range {watts(gpu.min_limit_w)}-{watts(gpu.max_limit_w)} W)"
        for gpu in gpus
    )


# --- the cap table -------------------------------------------------------------------------


@dataclass(frozen=True)
class CapRow:
    """One line of the table deploys/power_cap.py prints: a rig's GPU, its cap before and after."""

    rig: str
    gpu: str
    old_w: float | None
    new_w: float | None
    note: str


#: Rows by rig name, written while the operations execute (one pyinfra run per process).
_ROWS: dict[str, tuple[CapRow, ...]] = {}


def _record(rig: str, rows: Iterable[CapRow]) -> None:
    _ROWS[rig] = tuple(rows)


def recorded_rows() -> list[CapRow]:
    return [row for rig in sorted(_ROWS) for row in _ROWS[rig]]


def cap_table(rows: Iterable[CapRow]) -> Table:
    table = Table(title="GPU power caps")
    for column in ("rig", "GPU", "old", "new", "note"):
        table.add_column(column, no_wrap=column != "note")
    for row in rows:
        table.add_row(row.rig, row.gpu, _cell(row.old_w), _cell(row.new_w), row.note)
    return table


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{watts(value)} W"


class CapTableAtEnd(BaseStateCallback):
    """Prints the cap table when the run's last operation has ended on every rig.

    To stderr, where pyinfra prints its own progress and results (stdout may carry --json).
    """

    def operation_end(self, state, op_hash) -> None:
        order = state.get_op_order()
        if order and op_hash == order[-1] and _ROWS:
            console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
            console.print(cap_table(recorded_rows()))


def print_cap_table_at_end(state) -> None:
    """Register CapTableAtEnd once for this run (a deploy file runs once per host)."""
    if not any(isinstance(handler, CapTableAtEnd) for handler in state.callback_handlers):
        _ROWS.clear()
        state.add_callback_handler(CapTableAtEnd())


# --- commands ------------------------------------------------------------------------------


def _refuse(state, host, message: str, rows: tuple[CapRow, ...]) -> bool:
    """FunctionCommand body: say why the rig is refused and fail it (nothing ran before)."""
    _record(host.name, rows)
    host.log_styled(message, fg="red", log_func=logger.error)
    return False


def _refusal(error: RigbookError, gpus: Iterable[Gpu]) -> FunctionCommand:
    rows = tuple(
        CapRow(host.name, f"{gpu.index} {gpu.uuid}", gpu.power_limit_w, gpu.power_limit_w,
               "refused, unchanged")
        for gpu in gpus
    )
    return FunctionCommand(_refuse, (str(error), rows), {})


def _set_cap(state, host, smi: str, cap: GpuCap) -> bool:
    """FunctionCommand body: `nvidia-smi -i <UUID> -pl <W>`; a refusal fails the rig with what
    nvidia-smi said and what to do (it may exit 0 on a card that does not support it)."""
    command = StringCommand(QuoteString(smi), "-i", QuoteString(cap.uuid), "-pl", cap.watts_arg)
    ok, output = host.run_shell_command(command)
    text = "\n".join(output.stdout_lines + output.stderr_lines)
    kind = smi_failure(text)
    if ok and kind is None:
        return True
    said = next((line.strip() for line in text.splitlines() if line.strip()), "no output")
    advice = f": {SMI_ADVICE[kind]}" if kind else ""
    host.log_styled(f"{cap.label}: {smi} -pl {cap.watts_arg} failed ({said}){advice}",
                    fg="red", log_func=logger.error)
    return False


def _read_back(state, host, smi: str, caps: tuple[GpuCap, ...]) -> bool:
    """FunctionCommand body: re-read every GPU; fail the rig if a cap did not take."""
    probe = host.get_fact(NvidiaGpus)
    live = {gpu.uuid: gpu.power_limit_w for gpu in probe.gpus} if probe is not None else {}
    rows, wrong = [], []
    for cap in caps:
        now = live.get(cap.uuid)
        took = same_w(now, cap.watts)
        note = ("unchanged" if cap.in_place else "set") if took else "DID NOT TAKE"
        rows.append(CapRow(host.name, f"{cap.index} {cap.uuid}", cap.live_w, now, note))
        if not took:
            why = f"reads {watts(now)} W" if now is not None else (
                f"cannot be read ({probe.error if probe is not None else 'no nvidia-smi'})"
            )
            wrong.append(f"{cap.label}: asked {cap.watts_arg} W, the card's power.limit {why}")
    _record(host.name, rows)
    if wrong:
        host.log_styled(
            f"power cap did not take after {smi} -pl: " + "; ".join(wrong),
            fg="red", log_func=logger.error,
        )
        return False
    return True


# --- operations ----------------------------------------------------------------------------


@operation()
def power_unit(rig: Rig):
    """
    Write the boot unit that caps every GPU, reload systemd when it changed, enable it.

    + rig: the rig's validated host data (``rigbook.core.spec.Rig``)

    The unit (``/etc/systemd/system/nvidia-power-limit.service``) is a oneshot that runs after
    and requires ``nvidia-persistenced.service``, with one
    ``ExecStart=<nvidia-smi> -i <GPU UUID> -pl <W>`` per GPU (by UUID: indexes can change
    between boots), wanted by ``multi-user.target``. It is enabled, not started: the live caps
    are ``live_power_caps``' job; the unit sets them at every boot.

    The GPUs are read when the operation executes. No GPU visible yet (no driver, or a driver
    installed but not loaded before the reboot) is a no-op that says so. A cap the cards do not
    allow, a GPU count other than ``gpu_count`` or persistence mode off fails the rig with the
    reason, and nothing is written. On WSL2 no unit is written (the Windows driver owns the cap),
    nor on a rig without systemd (nothing could run it: docs/no-systemd.md).
    """
    if rig.platform == "wsl2":
        host.noop(
            "WSL2: no power-limit unit: the Windows driver owns the GPUs and their caps; "
            "set the cap on the Windows host (docs/power.md)"
        )
        return
    if not booted():
        host.noop(f"no systemd: no {UNIT_NAME}; the live caps are set, and not restored at "
                  "boot (docs/no-systemd.md)")
        return
    probe, why = _visible_gpus()
    if why is not None:
        host.noop(_not_yet(why))
        return
    try:
        caps = desired_caps(rig, host.name, probe.gpus)
    except RigbookError as error:
        yield _refusal(error, probe.gpus)
        return

    unit = list(template_commands(src=UNIT_TEMPLATE, dest=UNIT_PATH, mode="644", smi=probe.smi,
                                  caps=caps))
    yield from unit
    if unit:
        yield from systemd.daemon_reload._inner()
    enable = list(service_commands(UNIT_NAME, running=None, enabled=True))
    yield from enable
    if not unit and not enable:
        host.noop(
            f"{UNIT_NAME} is already enabled and caps "
            + ", ".join(f"GPU {cap.index} at {cap.watts_arg} W" for cap in caps)
        )


@operation()
def live_power_caps(rig: Rig):
    """
    Set each GPU's live power cap where it differs from the rig's cap, then read it back.

    + rig: the rig's validated host data (``rigbook.core.spec.Rig``)

    Runs ``nvidia-smi -i <UUID> -pl <W>`` only for GPUs whose live ``power.limit`` differs from
    the cap by more than 0.5 W, then re-reads every GPU and fails the rig if a card did not take
    its cap. The same checks as ``power_unit`` refuse the rig before anything runs. On WSL2 it
    changes nothing and reports the live caps: they are set on the Windows host.
    """
    probe, why = _visible_gpus()
    if rig.platform == "wsl2":
        host.noop(_wsl2_report(rig, probe, why))
        if state.is_executing:
            _record(host.name, [
                CapRow(host.name, f"{gpu.index} {gpu.uuid}", gpu.power_limit_w,
                       gpu.power_limit_w, "WSL2: set on the Windows host")
                for gpu in (probe.gpus if why is None else ())
            ] or [CapRow(host.name, "-", None, None, f"WSL2: {_not_yet(why)}")])
        return
    if why is not None:
        host.noop(_not_yet(why))
        if state.is_executing:
            _record(host.name, [CapRow(host.name, "-", None, None, _not_yet(why))])
        return
    try:
        caps = desired_caps(rig, host.name, probe.gpus)
    except RigbookError as error:
        yield _refusal(error, probe.gpus)
        return

    todo = [cap for cap in caps if not cap.in_place]
    if not todo:
        host.noop(
            "power caps are already "
            + ", ".join(f"GPU {cap.index} {cap.watts_arg} W" for cap in caps)
        )
        if state.is_executing:
            _record(host.name, [
                CapRow(host.name, f"{cap.index} {cap.uuid}", cap.live_w, cap.live_w, "unchanged")
                for cap in caps
            ])
        return
    if not state.is_executing:  # the plan, per GPU: --dry shows what the run will set
        for cap in todo:
            warn_once(f"{cap.label}: cap {watts(cap.live_w)} W -> {cap.watts_arg} W ({cap.source})")
    for cap in todo:
        yield FunctionCommand(_set_cap, (probe.smi, cap), {})
    yield FunctionCommand(_read_back, (probe.smi, caps), {})


def _wsl2_report(rig: Rig, probe: GpuProbe | None, why: str | None) -> str:
    """What live_power_caps says on WSL2: the live caps, and the cap rigbook would set."""
    if why is not None:
        return f"WSL2: {_not_yet(why)}"
    text = (
        "WSL2: caps are set on the Windows host, not from WSL2 (rigbook policy); live caps: "
        + _live_list(probe.gpus)
    )
    caps, _ = cap_plan(rig, probe.gpus)  # persistence is the Windows driver's: not asked here
    wanted = [cap for cap in caps if not cap.in_place]
    if wanted:
        commands = "; ".join(windows_command(cap) for cap in wanted)
        text += f"; to apply this rig's caps, run in an Administrator prompt on Windows: {commands}"
    return text


# --- the role ------------------------------------------------------------------------------


@deploy("Power limits")
def power_limit(rig: Rig) -> None:
    """Cap every GPU of the rig: the boot unit (the truth), then the live caps to match it."""
    if booted():
        expect(UNIT_PATH)
        runfacts.expect("units", [UNIT_NAME])
        power_unit(rig, name=f"Power-limit unit ({UNIT_NAME})")
    else:
        power_unit(rig, name="Boot caps (none without systemd)")
    live_power_caps(rig, name="Live GPU power caps")
