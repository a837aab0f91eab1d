"""GPU health as the driver reports it: memory errors, throttling, heat and the PCIe link.

`rigbook status` shows, per GPU, what needs a person before the next model is loaded:
uncorrected ECC errors (volatile and aggregate), retired pages and remapped rows pending or
failed, the clock-event (throttle) reasons active now, the temperature against the card's
T.Limit, and a PCIe link below its maximum while the card is busy. Xids since boot are the
guards' check (roles/guards.py). Each finding says what it means and what to do.

The values come from NVML: rigbook's probe (rigbook/rigside/gpus.py, `--probe`) run by the tools
venv's python, which holds nvidia-ml-py (rigbook/core/tools.py). Where there is no tools venv or
NVML does not load there, from `nvidia-smi --query-gpu` (NVML's own command line) with the same
wrapper as the GPU facts; a driver too old for one of its fields answers with an error, and the
health is then reported as not read. Both give the same readings, named as nvidia-smi names them.
Status only:
no deploy refuses a rig on these (a throttling card still serves; a failing one is the Xid
watch's).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyinfra.api import FactBase
from pyinfra.api.exceptions import FactProcessError

from rigbook.core.checks import Check, Facts, Finding, Read, warn
from rigbook.core.facts import SMI_TIMEOUT_S, smi_answer, smi_attempts, smi_script
from rigbook.core.spec import Rig
from rigbook.core.tools import TOOLS_PYTHON
from rigbook.core.types import JsonValue
from rigbook.rigside import gpus
from rigbook.rigside.gpus import csv_header, na, number, parse_fields

#: The fields read, in order (nvidia-smi --help-query-gpu names them; driver 535 and newer).
HEALTH_FIELDS = (
    "index", "uuid", "temperature.gpu", "temperature.gpu.tlimit",
    "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.pending", "remapped_rows.pending", "remapped_rows.failure",
    "clocks_event_reasons.sw_power_cap", "clocks_event_reasons.hw_slowdown",
    "clocks_event_reasons.hw_thermal_slowdown", "clocks_event_reasons.sw_thermal_slowdown",
    "pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current",
    "pcie.link.width.max", "utilization.gpu", "power.draw", "enforced.power.limit",
)
#: NVML's clock-event reason bits (nvml.h) -> the nvidia-smi field that reports them.
EVENT_BITS = {
    0x04: "clocks_event_reasons.sw_power_cap",
    0x08: "clocks_event_reasons.hw_slowdown",
    0x80: "clocks_event_reasons.hw_slowdown",  # HW power brake: nvidia-smi counts it as HW slowdown
    0x20: "clocks_event_reasons.sw_thermal_slowdown",
    0x40: "clocks_event_reasons.hw_thermal_slowdown",
}
#: First line of the fact's output when the NVML probe answered.
_NVML = "##RIGBOOK_NVML##"
#: The probe's source, run with `python -c` on the rig: nothing of rigbook is installed there.
_PROBE = Path(gpus.__file__)
#: Degrees below its T.Limit (temperature.gpu.tlimit: the throttling limit; the slowdown starts
#: a few degrees earlier) under which a card is about to throttle.
NEAR_SLOWDOWN_C = 5
#: The hardware notes' table ("Interpreting draw plateaued below cap sweeps"): actual draw 5-15%
#: below the cap with the GPU at 78 °C or more is a thermal throttle, "Software cap not the
#: limit; cooling is" (docs/sources.md, Thermal plateau).
PLATEAU_C = 78
PLATEAU_BELOW = (0.05, 0.15)
#: A link below its maximum matters only while the card works.
BUSY_PERCENT = 50


@dataclass(frozen=True)
class GpuHealth(JsonValue):
    """One GPU's health readings; None where the card reports none ([N/A])."""

    index: int
    uuid: str
    values: dict[str, str | None]

    def number(self, field: str) -> int | None:
        value = self.values.get(field)
        try:
            return int(float(number(value))) if value is not None else None
        except ValueError:
            return None

    def watts(self, field: str) -> float | None:
        value = self.values.get(field)
        try:
            return float(number(value)) if value is not None else None
        except ValueError:
            return None

    def active(self, field: str) -> bool:
        return self.values.get(field) in ("Active", "Yes")


class GpuHealthReadings(FactBase[list[GpuHealth] | None]):
    """
    The NVML probe's JSON from the tools venv (rigbook/rigside/gpus.py), else `nvidia-smi
    --query-gpu=<HEALTH_FIELDS> --format=csv,nounits`, per GPU; None without either. The CSV
    (H200, tests/fixtures/nvidia-h200/health.csv)::

        index, uuid, temperature.gpu, temperature.gpu.tlimit, ecc.errors.uncorrected...
        0, GPU-fe498097-b8b0-08f8-71e6-602f1062937d, 44, 43, 0, 0, [N/A], No, No, Not Active, ...
    """

    def command(self) -> str:
        probe = f"{TOOLS_PYTHON} -I -c {shlex.quote(_PROBE.read_text())} --probe 2>/dev/null"
        smi = smi_script(f"--query-gpu={','.join(HEALTH_FIELDS)} --format=csv,nounits")
        # a wedged GPU can hang NVML: past the limit (or without `timeout`) nvidia-smi answers
        return (f'if [ -x {TOOLS_PYTHON} ] && nvml=$(timeout {SMI_TIMEOUT_S} {probe}); then '
                f'echo "{_NVML}"; '
                f'printf "%s\\n" "$nvml"; else {smi}; fi')

    def process(self, output: list[str]) -> list[GpuHealth] | None:
        if output and output[0].strip() == _NVML:
            try:
                return health_from_probe(json.loads("\n".join(output[1:])))
            except (ValueError, KeyError, TypeError) as error:
                raise FactProcessError(f"NVML probe: {error}: {output[1:3]!r}") from error
        attempts = smi_attempts(output)
        if attempts is None:
            return None
        path, lines, status = smi_answer(attempts)
        if status != 0:
            raise FactProcessError(f"{path}: {' '.join(lines)[:300]}")
        try:
            return parse_health(lines)
        except ValueError as error:
            raise FactProcessError(str(error)) from error


def parse_health(lines: list[str]) -> list[GpuHealth]:
    """GpuHealth per row of the health query (its header names the columns)."""
    header = csv_header(lines[0]) if lines else None
    if header is None:
        raise FactProcessError(f"no header in the health query's output: {lines[:2]!r}")
    return [GpuHealth(int(row["index"]), row["uuid"],
                      {field: None if na(cell) else cell for field, cell in row.items()})
            for _, _, row in parse_fields(header, lines[1:], start=2)]


def health_from_probe(probe: dict[str, Any]) -> list[GpuHealth]:
    """GpuHealth per GPU of the NVML probe, each reading as nvidia-smi would print it."""
    def text(value: Any) -> str | None:
        return None if value is None else str(value)

    def watts(milliwatts: Any) -> str | None:  # nvidia-smi prints watts, two decimals
        return None if milliwatts is None else f"{milliwatts / 1000:.2f}"

    def flag(value: Any, on: str = "Yes", off: str = "No") -> str | None:
        return None if value is None else on if value else off

    found = []
    for gpu in probe["gpus"]:
        volatile, aggregate = gpu["ecc_uncorrected"]
        remapped, events = gpu["remapped"], gpu["events"]
        values = {
            "temperature.gpu": text(gpu["temp"]), "temperature.gpu.tlimit": text(gpu["tlimit"]),
            "ecc.errors.uncorrected.volatile.total": text(volatile),
            "ecc.errors.uncorrected.aggregate.total": text(aggregate),
            "retired_pages.pending": flag(gpu["retired_pending"]),
            "remapped_rows.pending": flag(remapped and remapped[2]) if remapped else None,
            "remapped_rows.failure": flag(remapped and remapped[3]) if remapped else None,
            "pcie.link.gen.current": text(gpu["pcie_gen"]),
            "pcie.link.gen.max": text(gpu["pcie_gen_max"]),
            "pcie.link.width.current": text(gpu["pcie_width"]),
            "pcie.link.width.max": text(gpu["pcie_width_max"]),
            "utilization.gpu": text(gpu["util"]),
            "power.draw": watts(gpu.get("power_usage_mw")),
            "enforced.power.limit": watts(gpu.get("enforced_mw")),
        }
        for bit, field in EVENT_BITS.items():
            if events is not None and (events & bit or field not in values):
                values[field] = flag(events & bit, "Active", "Not Active")
        found.append(GpuHealth(gpu["index"], gpu["uuid"], values))
    return found


def health_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    if "health" in facts.unread:
        return [warn("health", f"GPU health not read: {facts.unread['health']}")]
    found: list[Finding] = []
    for gpu in facts.health or ():
        found += _gpu_findings(gpu)
    return found


def _gpu_findings(gpu: GpuHealth) -> list[Finding]:
    label, found = f"GPU {gpu.index}", []

    def add(level, text: str) -> None:
        found.append(Finding(level, "health", f"{label}: {text}", gpu=gpu.uuid))

    volatile = gpu.number("ecc.errors.uncorrected.volatile.total")
    aggregate = gpu.number("ecc.errors.uncorrected.aggregate.total")
    if volatile:
        add("drift", f"{volatile} uncorrected ECC error(s) since the driver loaded: its memory "
                     "failed; stop serving on it, reset the GPU or reboot, and look for Xid 48/63/"
                     "64/94/95 (rigbook status)")
    elif aggregate:
        add("warn", f"{aggregate} uncorrected ECC error(s) over its life: watch it; repeated "
                    "ones mean the card needs service")
    if gpu.active("remapped_rows.failure"):
        add("drift", "a row remapping failed: the card's memory cannot be repaired; it needs "
                     "service (RMA)")
    if gpu.active("remapped_rows.pending") or gpu.active("retired_pages.pending"):
        add("warn", "memory repair pending (remapped rows / retired pages): reset the GPU or "
                    "reboot to apply it")
    for field, what in (("clocks_event_reasons.hw_thermal_slowdown", "HW thermal slowdown"),
                        ("clocks_event_reasons.sw_thermal_slowdown", "SW thermal slowdown"),
                        ("clocks_event_reasons.hw_slowdown", "HW slowdown")):
        if gpu.active(field):
            add("warn", f"{what} active now: the card is too hot or its power brake fired; "
                        "check the cooling and the power supply")
            break
    temperature, margin = gpu.number("temperature.gpu"), gpu.number("temperature.gpu.tlimit")
    if margin is not None and margin <= NEAR_SLOWDOWN_C:
        add("warn", f"{margin} °C below its T.Limit ({temperature} °C now): it is about to "
                    "throttle; check the cooling or lower the cap")
    busy = gpu.number("utilization.gpu")
    plateau = thermal_plateau(gpu)
    if plateau is not None:
        draw, cap, below = plateau
        add("warn", f"draws {draw:g} W, {below:.0%} below its {cap:g} W cap, at {temperature} °C "
                    f"while {busy}% busy: the hardware notes read a draw plateau 5-15% below the "
                    f"cap at {PLATEAU_C} °C or more as a thermal throttle: the cap is not the "
                    "limit, cooling is; improve the cooling (airflow, an undervolt, water), "
                    "which no cap change fixes")
    for kind in ("gen", "width"):
        now, most = gpu.number(f"pcie.link.{kind}.current"), gpu.number(f"pcie.link.{kind}.max")
        if busy is not None and busy >= BUSY_PERCENT and now and most and now < most:
            add("warn", f"PCIe link {kind} {now} of {most} while {busy}% busy: reseat the card "
                        "or check the slot and riser")
    return found


def thermal_plateau(gpu: GpuHealth) -> tuple[float, float, float] | None:
    """(draw W, cap W, share below the cap) when a busy card at PLATEAU_C or more draws 5-15%
    below its enforced cap without being held at it (sw_power_cap not active): the notes'
    thermal row. At the cap (sw_power_cap active) the software cap is the limit, not this."""
    draw, cap = gpu.watts("power.draw"), gpu.watts("enforced.power.limit")
    temperature, busy = gpu.number("temperature.gpu"), gpu.number("utilization.gpu")
    if (draw is None or not cap or temperature is None or temperature < PLATEAU_C
            or busy is None or busy < BUSY_PERCENT
            or gpu.active("clocks_event_reasons.sw_power_cap")):
        return None
    below = 1 - draw / cap
    low, high = PLATEAU_BELOW
    return (draw, cap, below) if low <= round(below, 4) <= high else None


CHECKS = (Check(
    "GPU health", lambda rig, name: [Read("health", GpuHealthReadings, "GPU health")],
    health_findings,
),)
