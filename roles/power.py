"""GPU power caps: a boot unit that is the truth, and live caps made to match it.

A cap set by hand with `nvidia-smi -pl` is gone after a reboot or a driver unload, and a unit
that disagrees with the live cap is how fleets drift. rigbook writes
/etc/systemd/system/nvidia-power-limit.service (one `nvidia-smi -i <UUID> -pl <W>` per GPU, run
after nvidia-persistenced at every boot), then sets the live cap only where it differs and reads
it back.

The GPUs, their UUIDs and their limits are read from the rig when the operations execute, not
when the deploy is planned: on a new rig they appear only after the driver was installed and
the rig rebooted earlier in the same run. Every GPU is checked (count, the card's own min/max,
persistence mode) before anything is changed; one bad value fails that rig and changes nothing
on it, while the other rigs go on.

On WSL2 the Windows driver owns the cards: rigbook writes no unit, changes no cap and reports
the live caps (docs/power.md, "WSL2").
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pyinfra import host, logger, state
from pyinfra.api import (
    BaseStateCallback,
    FunctionCommand,
    QuoteString,
    StringCommand,
    deploy,
    operation,
)
from pyinfra.api.util import get_template
from pyinfra.operations import files, systemd
from rich.console import Console
from rich.table import Table

from roles.errors import RigbookError
from roles.facts import NvidiaGpus
from roles.gpus import Gpu, GpuProbe
from roles.spec import Rig

UNIT_NAME = "nvidia-power-limit.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT_NAME}"
UNIT_TEMPLATE = str(
    Path(__file__).resolve().parent.parent / "files" / "power" / f"{UNIT_NAME}.j2"
)

#: Live and desired caps closer than this (watts) are equal: nvidia-smi prints two decimals and
#: some cards round the limit they store.
TOLERANCE_W = 0.5


def _jinja_env() -> dict:
    # A fresh dict each time: pyinfra's get_template pops keys out of the one it is given.
    return {"trim_blocks": True, "lstrip_blocks": True}


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
        return self.live_w is not None and abs(self.live_w - self.watts) <= TOLERANCE_W


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


def desired_caps(rig: Rig, rig_name: str, gpus: Iterable[Gpu]) -> tuple[GpuCap, ...]:
    """The cap of every GPU, checked against what the rig reports; RigbookError if any is bad.

    Refused, all at once: a GPU count other than gpu_count, a power_caps UUID the rig does not
    have, a cap outside the card's own min/max (power.min_limit / power.max_limit), a card that
    reports no range, and persistence mode off (a cap does not hold between processes then).
    """
    gpus = sorted(gpus, key=lambda gpu: gpu.index)
    problems: list[str] = []
    if len(gpus) != rig.gpu_count:
        seen = ", ".join(f"{gpu.index} {gpu.uuid}" for gpu in gpus) or "none"
        problems.append(
            f"gpu_count is {rig.gpu_count} but the rig reports {len(gpus)} GPU(s) ({seen}); "
            "fix gpu_count or the hardware"
        )
    uuids = {gpu.uuid for gpu in gpus}
    for key in rig.power_caps:
        if not key.isdigit() and key not in uuids:
            problems.append(
                f"power_caps names {key}, which this rig does not have "
                f"(its GPUs: {', '.join(sorted(uuids)) or 'none'})"
            )

    caps, no_persistence = [], []
    for gpu in gpus:
        label = f"GPU {gpu.index} ({gpu.uuid})"
        try:
            asked, source = asked_cap(rig, gpu)
        except ValueError as e:
            problems.append(f"{label}: {e}")
            continue
        if asked is None:
            asked = gpu.default_limit_w
            if asked is None:
                problems.append(f"{label}: power_profile stock, but the card reports no default")
                continue
        if gpu.min_limit_w is None or gpu.max_limit_w is None:
            problems.append(
                f"{label}: {source} asks {watts(asked)} W, but the card reports no power limit "
                "range, so it cannot be capped"
            )
            continue
        if not gpu.min_limit_w <= asked <= gpu.max_limit_w:
            problems.append(
                f"{label}: {source} asks {watts(asked)} W, outside the card's allowed range "
                f"{watts(gpu.min_limit_w)}-{watts(gpu.max_limit_w)} W"
            )
            continue
        if gpu.persistence is False:
            no_persistence.append(label)
        caps.append(GpuCap(
            index=gpu.index, uuid=gpu.uuid, name=gpu.name, watts=float(asked), source=source,
            live_w=gpu.power_limit_w, min_w=gpu.min_limit_w, max_w=gpu.max_limit_w,
        ))
    if no_persistence:
        problems.append(
            f"persistence mode is Disabled on {', '.join(no_persistence)}: a cap does not hold "
            "between processes without it; enable nvidia-persistenced persistence "
            "(driver_persistence: true, which the driver role applies; deploys/rig.py)"
        )
    if problems:
        lines = "\n".join(f"  - {rig_name}: {problem}" for problem in problems)
        raise RigbookError(f"{rig_name}: power caps refused, nothing was changed:\n{lines}")
    return tuple(caps)


def render_unit(smi: str, caps: Iterable[GpuCap]) -> str:
    """The unit text power_unit writes (same template, same jinja settings)."""
    return get_template(UNIT_TEMPLATE, _jinja_env()).render(smi=smi, caps=tuple(caps))


# --- the rig's GPUs ------------------------------------------------------------------------


def _visible_gpus() -> tuple[GpuProbe | None, str | None]:
    """(probe, None) when nvidia-smi lists GPUs, else (probe, why there are none to cap)."""
    probe = host.get_fact(NvidiaGpus)
    if probe is None:
        return None, "driver not installed: no nvidia-smi"
    if not probe.ok:
        return probe, f"driver not loaded: {probe.smi}: {probe.error}"
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


def _refusal(error: RigbookError, gpus: Iterable[Gpu], warn_now: bool) -> FunctionCommand:
    rows = tuple(
        CapRow(host.name, f"{gpu.index} {gpu.uuid}", gpu.power_limit_w, gpu.power_limit_w,
               "refused, unchanged")
        for gpu in gpus
    )
    if warn_now and not state.is_executing:  # so that --dry shows why the rig will fail
        host.log_styled(str(error), fg="red", log_func=logger.warning)
    return FunctionCommand(_refuse, (str(error), rows), {})


def _read_back(state, host, smi: str, caps: tuple[GpuCap, ...]) -> bool:
    """FunctionCommand body: re-read every GPU; fail the rig if a cap did not take."""
    probe = host.get_fact(NvidiaGpus)
    live = {gpu.uuid: gpu.power_limit_w for gpu in probe.gpus} if probe is not None else {}
    rows, wrong = [], []
    for cap in caps:
        now = live.get(cap.uuid)
        took = now is not None and abs(now - cap.watts) <= TOLERANCE_W
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

    + rig: the rig's validated host data (``roles.spec.Rig``)

    The unit (``/etc/systemd/system/nvidia-power-limit.service``) is a oneshot that runs after
    and requires ``nvidia-persistenced.service``, with one
    ``ExecStart=<nvidia-smi> -i <GPU UUID> -pl <W>`` per GPU (by UUID: indexes can change
    between boots), wanted by ``multi-user.target``. It is enabled, not started: the live caps
    are ``live_power_caps``' job; the unit sets them at every boot.

    The GPUs are read when the operation executes. No GPU visible yet (no driver, or a driver
    installed but not loaded before the reboot) is a no-op that says so. A cap the cards do not
    allow, a GPU count other than ``gpu_count`` or persistence mode off fails the rig with the
    reason, and nothing is written. On WSL2 no unit is written (the Windows driver owns the cap).
    """
    if rig.platform == "wsl2":
        host.noop(
            "WSL2: no power-limit unit: the Windows driver owns the GPUs and their caps; "
            "set the cap on the Windows host (docs/power.md)"
        )
        return
    probe, why = _visible_gpus()
    if why is not None:
        host.noop(_not_yet(why))
        return
    try:
        caps = desired_caps(rig, host.name, probe.gpus)
    except RigbookError as error:
        yield _refusal(error, probe.gpus, warn_now=True)
        return

    unit = list(files.template._inner(
        src=UNIT_TEMPLATE, dest=UNIT_PATH, mode="644", jinja_env_kwargs=_jinja_env(),
        smi=probe.smi, caps=caps,
    ))
    yield from unit
    if unit:
        yield from systemd.daemon_reload._inner()
    enable = list(systemd.service._inner(UNIT_NAME, running=None, enabled=True))
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

    + rig: the rig's validated host data (``roles.spec.Rig``)

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
        yield _refusal(error, probe.gpus, warn_now=False)
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
    for cap in todo:
        yield StringCommand(
            QuoteString(probe.smi), "-i", QuoteString(cap.uuid), "-pl", cap.watts_arg
        )
    yield FunctionCommand(_read_back, (probe.smi, caps), {})


def _wsl2_report(rig: Rig, probe: GpuProbe | None, why: str | None) -> str:
    """What live_power_caps says on WSL2: the live caps, and the cap rigbook would set."""
    if why is not None:
        return f"WSL2: {_not_yet(why)}"
    text = (
        "WSL2: caps are set on the Windows host, not from WSL2 (rigbook policy); live caps: "
        + _live_list(probe.gpus)
    )
    try:
        caps = desired_caps(rig, host.name, probe.gpus)
    except RigbookError:
        return text
    wanted = [cap for cap in caps if not cap.in_place]
    if wanted:
        commands = "; ".join(f"nvidia-smi -i {cap.uuid} -pl {cap.watts_arg}" for cap in wanted)
        text += f"; to apply this rig's caps, run in an Administrator prompt on Windows: {commands}"
    return text


# --- the role ------------------------------------------------------------------------------


@deploy("Power limits")
def power_limit(rig: Rig) -> None:
    """Cap every GPU of the rig: the boot unit (the truth), then the live caps to match it."""
    power_unit(rig, name=f"Power-limit unit ({UNIT_NAME})")
    live_power_caps(rig, name="Live GPU power caps")
