"""Power sweep: the cap that gives the most tokens per watt, measured on the rig's own serving.

deploys/power_sweep.py, per rig (docs/sweep.md):

1. the preflight (`SWEEP_CHECKS`) refuses the rig before anything changes when any asked cap
   (`sweep_watts`) lies outside any card's own min/max, when no boot unit caps every GPU (the
   caps could not be restored; without systemd none can), or when persistence mode is off;
2. a guard is started on the rig as a unit of its own (files/power/sweep_rig.py under
   `systemd-run`, outside the SSH login, which logind may kill when it ends): it holds
   a lease that the sweep renews before every request, and once the sweep releases it, or the
   lease lapses because the operator's pyinfra died, it sets every live cap back to what
   nvidia-power-limit.service says, naming in its record each GPU it could not set back
   (a hung or missing nvidia-smi); where that record is missing or leaves a GPU out, the sweep
   sets those caps itself and fails the rig;
3. per cap: the live cap of every GPU (`nvidia-smi -i UUID -pl W`, never the unit), then the
   verify bench of roles/verify.py (decode at 1 stream, at verify_bench_concurrency where the
   engine allows it, prefill) while a meter on the rig samples the draw through NVML (nvidia-smi
   where the tools venv's pynvml is missing): mean and p95 watts, energy from the card's
   total-energy counter where it has one (else mean watts x seconds);
4. the restore is read back and the run stored as JSON beside the verify results, with a PNG
   chart; `rigbook bench sweep` tables them and suggests a cap per workload.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import requests
from pydantic import ValidationError
from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, QuoteString, StringCommand, deploy, operation
from pyinfra.operations import files

from rigbook import FILES, cap_check
from rigbook.chart import PALETTE, Panel, Series, line_chart
from rigbook.checks import Check, Facts, Finding, Read, error
from rigbook.errors import RigbookError
from rigbook.facts import GPUS, GPUS_READ, NvidiaGpus, count_finding, usable
from rigbook.messages import refused, warn_once
from rigbook.power import (
    UNIT_NAME,
    UNIT_PATH,
    UNIT_READ,
    GpuCap,
    PowerUnitFile,
    _set_cap,
    same_w,
    unit_caps,
)
from rigbook.power import watts as w
from rigbook.spec import Rig
from rigbook.tools import TOOLS_PYTHON
from rigbook.types import StrictModel
from rigbook.units import SYSTEMD_READ, outside_login
from rigbook.verify import (
    BENCH_PROMPTS,
    Client,
    Ladder,
    Settings,
    StepFailed,
    Target,
    _part,
    results_dir,
    truncate,
)

#: At most this many caps per sweep: each one is a full bench.
MAX_CAPS = 64
#: No card takes more than this (W): a larger number is a typo, refused before any range check.
MAX_WATTS = 2000
_NUMBER = re.compile(r"\d{1,4}(?:\.\d{1,2})?")

SWEEP_DIR = "/run/rigbook-sweep"  # tmpfs: gone at boot, as the live caps are
RIG_PROGRAM = FILES / "power" / "sweep_rig.py"
#: The lease outlives the longest request by this much (s); then the guard restores the caps.
LEASE_MARGIN_S = 5
#: The lease is renewed at most this often (s).
RENEW_EVERY_S = 3
#: The guard's transient unit (systemd-run): outside the SSH login, gone once it exited.
GUARD_UNIT = "rigbook-sweep-guard.service"
#: A `-pl` call on the rig is given up after this long (s); the guard's own default too.
SMI_TIMEOUT_S = 20
#: How often the meter samples the draw (s).
METER_INTERVAL_S = 0.2

Workload = Literal["decode x1", "decode xN", "prefill"]


# --- what to sweep -----------------------------------------------------------------------------


def _cap(value: Any) -> float:
    """One cap in watts from a number or a numeric word; ValueError says what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a cap in watts")
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        number = float(value.strip())
    else:
        raise ValueError(f"{value!r} is not a cap in watts (digits, up to 2 decimals)")
    if not math.isfinite(number) or not 1 <= number <= MAX_WATTS:
        raise ValueError(f"{value!r} W is outside 1..{MAX_WATTS} W")
    return round(number, 2)


def parse_watts(value: Any) -> tuple[float, ...]:
    """The caps of sweep_watts, ascending and each once: START:STOP:STEP (both ends included),
    a comma list, a JSON list, or one cap. ValueError names what is wrong and what is allowed."""
    if value is None or value == "" or value == () or value == []:
        return ()
    if isinstance(value, list | tuple):
        caps = [_cap(item) for item in value]
    elif isinstance(value, str) and ":" in value:
        parts = value.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"{value!r}: a range is START:STOP:STEP, e.g. 250:350:10")
        start, stop = _cap(parts[0]), _cap(parts[1])
        try:
            step = _cap(parts[2])
        except ValueError:
            raise ValueError(f"{value!r}: STEP {parts[2]!r} is not a step of 1 W or more") from None
        if stop < start:
            raise ValueError(f"{value!r}: STOP {stop:g} is below START {start:g}")
        count = math.floor((stop - start) / step + 1e-9) + 1
        if count > MAX_CAPS:
            raise ValueError(f"{value!r} asks {count} caps; allowed: at most {MAX_CAPS}")
        caps = [round(start + i * step, 2) for i in range(count)]
    elif isinstance(value, str):
        caps = [_cap(part) for part in value.split(",")]
    else:
        caps = [_cap(value)]
    caps = sorted(set(caps))
    if len(caps) > MAX_CAPS:
        raise ValueError(f"{len(caps)} caps asked; allowed: at most {MAX_CAPS}")
    return tuple(caps)


# --- the checks ----------------------------------------------------------------------------------


#: Without systemd no boot unit can exist: the caps are the host's or only live, and the guard
#: that restores them is a transient unit itself.
NO_UNIT_HERE = (
    f"no systemd as PID 1: no {UNIT_NAME} can hold the caps here (the host or the live state "
    "owns them), so the sweep has nothing to set them back to afterwards, and its guard runs "
    "under systemd-run; allowed: a rig with systemd whose caps rigbook manages "
    "(docs/no-systemd.md)"
)


def sweep_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """Why the sweep may not touch this rig: no caps asked, WSL2, no systemd (no unit can
    exist), a cap outside a card's range, no unit that caps every GPU (nothing to restore to),
    persistence mode off."""
    if not rig.sweep_watts:
        return [error("sweep", "no caps to sweep; allowed: --data sweep_watts=START:STOP:STEP "
                      "(e.g. 250:350:10), a comma list or one cap", key="sweep_watts")]
    if rig.platform == "wsl2":
        return [error("sweep", "WSL2: the Windows driver owns the caps (docs/power.md); "
                      "allowed: a Linux rig", key="platform")]
    if facts.systemd is False:
        return [error("sweep", NO_UNIT_HERE)]
    if facts.missing("probe", "unit") or not usable(facts.probe):
        return facts.missing("probe", "unit")  # the GPU check says why there are no GPUs
    gpus = facts.probe.gpus
    found = [count] if (count := count_finding(rig, gpus)) else []
    restore_to = unit_caps(facts.unit.exec_starts)[0] if facts.unit else {}
    if facts.unit is None:
        found.append(error("sweep", f"no {UNIT_NAME}: nothing to restore the caps to after the "
                           "sweep; allowed: a rig whose caps rigbook manages (deploys/power_cap.py"
                           " or deploys/rig.py first)"))
    for gpu in gpus:
        label = f"GPU {gpu.index} ({gpu.uuid})"
        if facts.unit is not None and gpu.uuid not in restore_to:
            found.append(error("sweep", f"{label}: {UNIT_NAME} does not cap it, so its cap could"
                               " not be restored; allowed: GPUs the unit caps (deploys/power_cap"
                               ".py)", gpu=gpu.uuid))
        if gpu.min_limit_w is None or gpu.max_limit_w is None:
            found.append(error("sweep", f"{label}: the card reports no power limit range, so it "
                               "cannot be capped", key="sweep_watts", gpu=gpu.uuid))
            continue
        outside = [cap for cap in rig.sweep_watts
                   if not gpu.min_limit_w <= cap <= gpu.max_limit_w]
        if outside:
            found.append(error(
                "sweep", f"{label} asks {', '.join(w(cap) for cap in outside)} W; allowed: the "
                f"card's range {w(gpu.min_limit_w)}-{w(gpu.max_limit_w)} W", key="sweep_watts",
                gpu=gpu.uuid))
        if gpu.persistence is False:
            found.append(error("sweep", f"{label}: persistence mode is Disabled: a cap does not "
                               "hold between processes; allowed: driver_persistence: true "
                               "(deploys/rig.py)", key="driver_persistence", gpu=gpu.uuid))
    return found


def _reads(rig: Rig, rig_name: str) -> list[Read]:
    return [GPUS_READ, UNIT_READ, SYSTEMD_READ]


#: The sweep's preflight. Not named CHECKS: `rigbook status` runs every role's CHECKS, and the
#: caps of a sweep are a run's option, not a state of the rig to report.
SWEEP_CHECKS = (GPUS, Check("power sweep", _reads, sweep_findings, gpus=True))


# --- results -------------------------------------------------------------------------------------


class Power(StrictModel):
    """The rig's draw (all its GPUs together) over one workload."""

    samples: int
    seconds: float
    mean_w: float
    p95_w: float
    energy_j: float
    energy_source: Literal["counter", "mean-draw"]


class WorkloadResult(StrictModel):
    workload: Workload
    concurrency: int
    tokens: int  # generated (decode) or prompt (prefill) tokens over the measured runs
    tps: float  # decode: median tok/s (x1) or all streams' (xN); prefill: prompt tok/s
    power: Power

    @property
    def tps_per_w(self) -> float:
        return self.tps / self.power.mean_w if self.power.mean_w > 0 else 0.0

    @property
    def j_per_token(self) -> float:
        return self.power.energy_j / self.tokens if self.tokens else 0.0


class SweepPoint(StrictModel):
    cap_w: float
    live_caps_w: dict[str, float | None]
    meter: str  # "nvml" or "nvidia-smi": what sampled the draw
    workloads: tuple[WorkloadResult, ...]


class SweepRun(StrictModel):
    """One sweep of one rig, stored as JSON on the operator's machine."""

    schema_version: Literal[1] = 1
    rig: str
    recipe: str
    engine: str
    url: str
    driver: str | None
    caps_asked_w: tuple[float, ...]
    started: datetime
    seconds: float
    points: tuple[SweepPoint, ...]
    error: str | None = None
    unit_caps_w: dict[str, float]
    restored: bool
    restore_detail: str

    @property
    def ok(self) -> bool:
        return self.error is None and self.restored and len(self.points) == len(self.caps_asked_w)


def sweep_path(run: SweepRun, root: Path | None = None) -> Path:
    """<root>/<rig>/<recipe>/sweeps/<started>.json, beside the verify runs (history kept)."""
    stamp = run.started.strftime("%Y%m%dT%H%M%S.%fZ")
    return (root or results_dir()) / _part(run.rig) / _part(run.recipe) / "sweeps" / f"{stamp}.json"


def save_sweep(run: SweepRun, root: Path | None = None) -> Path:
    """The JSON and, beside it, the chart (same name, .png)."""
    path = sweep_path(run, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run.model_dump_json(indent=2) + "\n")
    if run.points:
        path.with_suffix(".png").write_bytes(chart_png(run))
    return path


def load_sweeps(root: Path | None = None) -> list[tuple[Path, SweepRun]]:
    """Every stored sweep, oldest first; a file that does not validate is an error naming it."""
    found = []
    for path in sorted((root or results_dir()).glob("*/*/sweeps/*.json")):
        try:
            found.append((path, SweepRun.model_validate_json(path.read_text())))
        except (OSError, ValidationError) as failure:
            raise RigbookError(f"{path}: not a sweep result: {truncate(str(failure))}") from None
    return sorted(found, key=lambda item: item[1].started)


def workloads_of(run: SweepRun) -> list[Workload]:
    seen: list[Workload] = []
    for point in run.points:
        seen += [r.workload for r in point.workloads if r.workload not in seen]
    return seen


def series(run: SweepRun, workload: Workload,
           value: Callable[[WorkloadResult], float]) -> tuple[float | None, ...]:
    return tuple(next((value(r) for r in p.workloads if r.workload == workload), None)
                 for p in run.points)


def suggestions(run: SweepRun) -> dict[str, float]:
    """Per workload, the cap with the most tokens per watt (ties: the lower cap)."""
    best: dict[str, float] = {}
    for workload in workloads_of(run):
        scored = [(r.tps_per_w, -p.cap_w) for p in run.points for r in p.workloads
                  if r.workload == workload]
        best[workload] = -max(scored)[1]
    return best


def apply_command(rig: str, cap_w: float) -> str:
    """The follow-up that applies a suggestion (the sweep never applies one itself)."""
    return f"pyinfra INVENTORY deploys/power_cap.py --limit {rig} --data power_cap_watts={w(cap_w)}"


def chart_png(run: SweepRun) -> bytes:
    """tok/s and tok/s per W against the cap, one line per workload."""
    xs = [p.cap_w for p in run.points]
    kinds = workloads_of(run)

    def panel(title: str, value: Callable[[WorkloadResult], float]) -> Panel:
        return Panel(title, tuple(Series(k, PALETTE[i % len(PALETTE)], series(run, k, value))
                                  for i, k in enumerate(kinds)))
    return line_chart(f"{run.rig} {run.recipe}", xs, [
        panel("tok/s", lambda r: r.tps), panel("tok/s per w", lambda r: r.tps_per_w)])


def sweep_table(run: SweepRun):
    """A rich Table of one sweep: a row per cap and workload, the suggestion marked."""
    from rich.table import Table

    best = suggestions(run)
    table = Table(title=f"power sweep of {run.rig} ({run.recipe}, "
                        f"{run.started:%Y-%m-%d %H:%M:%S} UTC)")
    for column in ("cap W", "workload", "tok/s", "mean W", "p95 W", "tok/s/W", "J/tok", "energy",
                   "best"):
        table.add_column(column, justify="left" if column in ("workload", "energy") else "right")
    for point in run.points:
        for r in point.workloads:
            mark = "<- suggested" if best.get(r.workload) == point.cap_w else ""
            table.add_row(w(point.cap_w), r.workload, f"{r.tps:.1f}", f"{r.power.mean_w:.1f}",
                          f"{r.power.p95_w:.1f}", f"{r.tps_per_w:.4f}", f"{r.j_per_token:.3f}",
                          r.power.energy_source, mark)
    return table


# --- power of a workload from the meter's samples ----------------------------------------------


def power_of(samples: list, begin: float, end: float) -> Power:
    """The rig's draw between `begin` and `end` (the rig's clock): the samples inside, or the one
    nearest when the workload was shorter than one sampling interval. Energy from the cards'
    counters when every sample has one, else mean watts x seconds."""
    usable_ = [(t, gpus) for t, gpus in samples
               if isinstance(gpus, dict) and gpus and "error" not in gpus]
    if not usable_:
        raise ValueError("the meter took no sample")
    inside = [s for s in usable_ if begin <= s[0] <= end]
    if not inside:
        inside = [min(usable_, key=lambda s: abs(s[0] - (begin + end) / 2))]
    totals = sorted(sum(v[0] for v in gpus.values()) for _, gpus in inside)
    mean = statistics.fmean(totals)
    p95 = totals[min(len(totals) - 1, math.ceil(0.95 * len(totals)) - 1)]
    seconds = max(end - begin, 0.0)
    first, last = inside[0][1], inside[-1][1]
    counters = all(v[1] is not None for _, gpus in inside for v in gpus.values())
    if counters and len(inside) > 1:
        span = inside[-1][0] - inside[0][0]
        joules = sum(last[u][1] - first[u][1] for u in first if u in last) / 1000.0
        energy, source = (joules * seconds / span if span > 0 else joules), "counter"
    else:
        energy, source = mean * seconds, "mean-draw"
    return Power(samples=len(inside), seconds=round(seconds, 3), mean_w=round(mean, 2),
                 p95_w=round(p95, 2), energy_j=round(energy, 3), energy_source=source)


# --- on the rig ----------------------------------------------------------------------------------


def _sh(host_, *parts: Any) -> tuple[bool, str]:
    """Run one command on the rig; (ok, stdout and stderr)."""
    ok, output = host_.run_shell_command(StringCommand(*parts))
    return ok, "\n".join(output.stdout_lines + output.stderr_lines)


def lease_command(seconds: int | None, folder: str = SWEEP_DIR) -> str:
    """Shell that holds the guard's lease `seconds` from now (the rig's clock), or releases it
    (None): JSON written whole, then renamed, as the guard reads it. A lease is not renewed once
    the guard has closed (it is restoring, or has)."""
    if seconds is None:
        body = """printf '{"release": true}'"""
    else:
        deadline = f'"$(( $(date +%s) + {int(seconds)} ))"'
        body = (f"[ ! -e {folder}/closed ] && "
                f"""printf '{{"deadline": %s, "release": false}}' {deadline}""")
    return f"{body} > {folder}/lease.tmp && mv {folder}/lease.tmp {folder}/lease"


def guard_command(unit: str = UNIT_PATH, folder: str = SWEEP_DIR) -> StringCommand:
    """Shell that starts the guard as a unit of its own (outside the SSH login: logind with
    KillUserProcesses=yes kills a login's processes when it ends) and waits until it runs."""
    guard = outside_login(GUARD_UNIT, "/usr/bin/python3", "-I", f"{folder}/sweep_rig.py", "guard",
                          "--unit", QuoteString(unit), "--dir", QuoteString(folder),
                          "--smi-timeout", str(SMI_TIMEOUT_S))
    return StringCommand("cd", QuoteString(folder), "&&", guard, "2>&1 && for i in $(seq 100); "
                         "do [ -s guard.pid ] && exit 0; sleep 0.1; done; echo the guard did not "
                         "start; exit 1")


def _lease(host_, seconds: int | None) -> bool:
    return _sh(host_, lease_command(seconds))[0]


class LeasedClient(Client):
    """The verify client, renewing the guard's lease before its requests (at most every few
    seconds): while requests go out the caps stay; when they stop, the guard restores them."""

    def __init__(self, target: Target, timeout_s: float, renew: Callable[[], None]) -> None:
        super().__init__(target, timeout_s)
        self.renew, self.renewed, self.lock = renew, 0.0, threading.Lock()

    def post(self, path: str, body: dict, *, stream: bool = False) -> requests.Response:
        with self.lock:
            if time.monotonic() - self.renewed > RENEW_EVERY_S:
                self.renew()
                self.renewed = time.monotonic()
        return super().post(path, body, stream=stream)


class _Sweep:
    """One rig's sweep while the deploy executes."""

    def __init__(self, host_, rig: Rig, target: Target, settings: Settings,
                 smi: str, gpus: tuple, unit: dict[str, float]) -> None:
        self.host, self.rig, self.target, self.settings = host_, rig, target, settings
        self.smi, self.gpus, self.unit = smi, gpus, unit
        self.lease_s = int(settings.timeout_s) + LEASE_MARGIN_S
        self.ladder = Ladder(target, settings)
        self.ladder.client = LeasedClient(target, settings.timeout_s, self.renew)
        self.points: list[SweepPoint] = []
        self.armed = False
        self.undone: str | None = None  # what the guard's restore left undone (guard_undone)

    def log(self, line: str) -> None:
        logger.info(f"{self.host.print_prefix}sweep {line}")

    def renew(self) -> None:
        if not _lease(self.host, self.lease_s):
            raise RigbookError("the sweep's lease could not be renewed: the guard restored the "
                               "caps (a step outlived the lease, verify_timeout_s + 5 s)")

    def arm(self) -> None:
        """The lease, then the guard: a unit of its own, so it outlives this SSH login even
        where logind kills a login's processes with it (KillUserProcesses=yes)."""
        _sh(self.host, f"cd {SWEEP_DIR} && rm -f restored.json closed guard.pid")
        self.renew()
        ok, said = _sh(self.host, guard_command())
        if not ok:
            raise RigbookError(f"could not start the cap guard on the rig: {truncate(said)}")
        self.armed = True

    def set_caps(self, cap_w: float) -> dict[str, float | None]:
        """Each card at `cap_w`, under a lease: a cap set while the guard closed is set back."""
        self.renew()
        self._set_all(cap_w)
        if _sh(self.host, f"[ -e {SWEEP_DIR}/closed ]")[0]:
            for gpu in self.gpus:
                self._set_all(self.unit[gpu.uuid], (gpu,))
            raise RigbookError("the guard restored the caps while a step began: the sweep stops")
        live = self.live()
        wrong = [u for u, v in live.items() if not same_w(v, cap_w)]
        if wrong:
            raise RigbookError(f"asked {w(cap_w)} W, read back {live}")
        return live

    def _set_all(self, cap_w: float, gpus: tuple | None = None) -> None:
        for gpu in gpus or self.gpus:
            cap = GpuCap(index=gpu.index, uuid=gpu.uuid, name=gpu.name, watts=cap_w,
                         source="sweep_watts", live_w=gpu.power_limit_w, min_w=gpu.min_limit_w,
                         max_w=gpu.max_limit_w)
            if not _set_cap(state, self.host, self.smi, cap):
                raise RigbookError(f"{cap.label}: the cap {w(cap_w)} W did not take")

    def live(self) -> dict[str, float | None]:
        probe = self.host.get_fact(NvidiaGpus)
        return {g.uuid: g.power_limit_w for g in (probe.gpus if probe is not None else ())}

    def meter_start(self, name: str) -> float:
        """Start the meter; the rig's clock minus this machine's (s)."""
        before = time.time()
        ok, said = _sh(self.host, f"cd {SWEEP_DIR} && rm -f {name}.stop {name}.json && py=python3"
                                  f" && if [ -x {TOOLS_PYTHON} ]; then py={TOOLS_PYTHON}; fi && "
                                  f'setsid -f "$py" sweep_rig.py meter --dir {SWEEP_DIR} --name '
                                  f"{name} --interval {METER_INTERVAL_S} --smi",
                       QuoteString(self.smi), "</dev/null >/dev/null 2>&1 && date +%s.%N")
        after = time.time()
        try:
            return float(said.strip().splitlines()[-1]) - (before + after) / 2
        except (ValueError, IndexError):
            raise RigbookError(f"could not start the draw meter: {truncate(said)}") from None

    def meter_stop(self, name: str) -> dict:
        ok, said = _sh(self.host, f"cd {SWEEP_DIR} && touch {name}.stop && for i in $(seq 100); "
                                  f"do [ -f {name}.json ] && break; sleep 0.1; done; "
                                  f"cat {name}.json && rm -f {name}.json {name}.stop")
        try:
            return json.loads(said)
        except ValueError:
            raise RigbookError(f"the draw meter wrote no samples: {truncate(said)}") from None

    def point(self, cap_w: float) -> SweepPoint:
        self.renew()
        live = self.set_caps(cap_w)
        name = f"cap-{w(cap_w).replace('.', '_')}"
        offset = self.meter_start(name)
        windows: list[tuple[Workload, int, float, float, int, float]] = []

        def timed(workload: Workload, level: int, run: Callable[[], tuple[int, float]]) -> None:
            begin = time.time() + offset
            tokens, tps = run()
            windows.append((workload, level, begin, time.time() + offset, tokens, tps))

        levels, _ = self.ladder.levels()
        name_ = next(iter(BENCH_PROMPTS))  # the narrative prompt
        try:
            self.ladder.warm_up(name_)
            for level in levels:
                def decode(level: int = level) -> tuple[int, float]:
                    f = self.ladder.measure(name_, level)
                    tps = f.decode_tps.median if level == 1 else f.aggregate_tps.median
                    return f.tokens * f.runs * level, tps
                timed("decode x1" if level == 1 else "decode xN", level, decode)

            def prefill() -> tuple[int, float]:
                runs = [self.ladder.prefill_once() for _ in range(self.settings.bench_runs)]
                tokens = sum(t for t, _ in runs)
                return tokens, tokens / max(sum(s for _, s in runs), 1e-9)
            timed("prefill", 1, prefill)
        finally:
            metered = self.meter_stop(name)
        samples = metered.get("samples") or []
        results = tuple(
            WorkloadResult(workload=kind, concurrency=level, tokens=tokens, tps=round(tps, 3),
                           power=power_of(samples, begin, end))
            for kind, level, begin, end, tokens, tps in windows
        )
        for r in results:
            self.log(f"{w(cap_w)} W {r.workload}: {r.tps:.1f} tok/s, {r.power.mean_w:.1f} W mean "
                     f"(p95 {r.power.p95_w:.1f}), {r.tps_per_w:.4f} tok/s/W, "
                     f"{r.j_per_token:.3f} J/tok")
        return SweepPoint(cap_w=cap_w, live_caps_w=live, meter=str(metered.get("source")),
                          workloads=results)

    def release(self) -> tuple[bool, str]:
        """Release the lease, wait for the guard's restore, read the caps back against the unit.
        Where the guard's record is missing or leaves a GPU out, this side sets those GPUs to
        the unit's caps itself and `self.undone` says what the guard did not do."""
        said = "no guard: no cap was set"
        if self.armed:
            _lease(self.host, None)
            tries = 10 * (SMI_TIMEOUT_S * len(self.unit) + 30)  # the guard's worst case
            said = _sh(self.host, f"cd {SWEEP_DIR} && for i in $(seq {tries}); do [ -f "
                                  "restored.json ] && break; kill -0 \"$(cat guard.pid)\" || "
                                  "break; sleep 0.1; done 2>/dev/null; cat restored.json")[1]
            left = guard_left(said, self.unit)
            if left:
                self.undone = "the cap guard did not restore " + "; ".join(
                    f"{uuid} ({truncate(why)})" for uuid, why in left)
                self.host.log_styled(f"{self.host.name}: {self.undone}; setting {UNIT_NAME}'s "
                                     "caps from here", fg="red", log_func=logger.error)
            for uuid, _ in left:
                _sh(self.host, f"timeout -k 5 {SMI_TIMEOUT_S}", QuoteString(self.smi), "-i",
                    QuoteString(uuid), "-pl", f"{self.unit[uuid]:g}")
        live = self.live()
        wrong = {u: v for u, want in self.unit.items() if not same_w(v := live.get(u), want)}
        if wrong:
            return False, (f"live caps {wrong} differ from {UNIT_NAME} {self.unit} after the "
                           f"restore ({truncate(said)}); deploys/power_cap.py sets them again")
        return True, "live caps as " + UNIT_NAME + " says: " + ", ".join(
            f"{u} {w(v)} W" for u, v in self.unit.items())


def guard_left(said: str, unit: dict[str, float]) -> list[tuple[str, str]]:
    """The unit's GPUs the guard's restore record (restored.json, as `said`) does not name as
    restored, each with why: a missing record, one that does not parse, or one that is not
    complete leaves every GPU it does not name restored."""
    try:
        record = json.loads(said)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("restored"), list):
        return [(uuid, "no restore record: the guard died or hung") for uuid in unit]
    named = record.get("not_restored")
    named = named if isinstance(named, dict) else {}
    complete = record.get("complete") is True
    return [(uuid, str(named.get(uuid, "not in its record" if complete else
                                 "its record is incomplete")))
            for uuid in unit if uuid not in record["restored"] or not complete]


def _run(state, host, rig: Rig, target: Target, settings: Settings, root: Path | None) -> bool:
    """FunctionCommand body: the whole sweep of one rig, the restore always last (pyinfra
    passes `state` and `host` to a body whose parameters are so named)."""
    probe = host.get_fact(NvidiaGpus)
    unit = host.get_fact(PowerUnitFile)
    if probe is None or not probe.gpus or unit is None:  # the preflight saw them: gone since
        host.log_styled(f"{host.name}: sweep refused: the GPUs or {UNIT_NAME} are gone since "
                        "the preflight; nothing was changed", fg="red", log_func=logger.error)
        return False
    restore_to = unit_caps(unit.exec_starts)[0]
    sweep = _Sweep(host, rig, target, settings, probe.smi, probe.gpus, restore_to)
    started, clock, failure = datetime.now(UTC), time.monotonic(), None
    try:
        sweep.arm()
        sweep.ladder.health()
        for cap_w in rig.sweep_watts:
            sweep.points.append(sweep.point(cap_w))
    except (StepFailed, RigbookError, requests.RequestException, ValueError) as failed:
        failure = truncate(str(failed))
        host.log_styled(f"{host.name}: sweep stopped: {failure}", fg="red",
                        log_func=logger.error)
    finally:
        restored, detail = sweep.release()
        run = SweepRun(
            rig=host.name, recipe=target.recipe, engine=target.engine, url=target.url,
            driver=probe.driver_version, caps_asked_w=rig.sweep_watts, started=started,
            seconds=round(time.monotonic() - clock, 3), points=tuple(sweep.points),
            error=failure or sweep.undone, unit_caps_w=restore_to, restored=restored,
            restore_detail=detail,
        )
        path = save_sweep(run, root)
    if sweep.undone:  # loud even when this side then set the caps: the guard failed its job
        host.log_styled(f"{host.name}: sweep FAILED: {sweep.undone}; after setting them from "
                        f"here: {detail}", fg="red", log_func=logger.error)
        return False
    if not restored:
        host.log_styled(f"{host.name}: caps NOT restored: {detail}", fg="red",
                        log_func=logger.error)
        return False
    sweep.log(f"restored: {detail}; stored {path}")
    for workload, cap_w in suggestions(run).items():
        sweep.log(f"suggested for {workload}: {w(cap_w)} W; to apply: "
                  f"{apply_command(host.name, cap_w)}")
    return failure is None


@operation(is_idempotent=False)
def sweep_caps(rig: Rig, target: Target, settings: Settings, root: str | None = None):
    """
    Sweep the live power cap over ``rig.sweep_watts`` and bench each step; restore the caps.

    + rig: the rig's validated host data (``sweep_watts``, the verify_* bench settings)
    + target: the running recipe as this machine reaches it (``rigbook.verify.verify_plan``)
    + settings: the bench settings
    + root: results folder; none = ``rigbook.verify.results_dir()``

    Copies the guard and meter (files/power/sweep_rig.py, with roles/cap_check.py) to
    /run/rigbook-sweep, then, when the deploy executes: starts the guard detached, sets each
    cap live (never the unit), benches it while the meter samples the draw, and releases the
    guard, which sets every live cap back to nvidia-power-limit.service's and is read back.
    """
    probe = host.get_fact(NvidiaGpus)
    if not state.is_executing and probe is not None:  # --dry: the caps it would set, per GPU
        for gpu in probe.gpus:
            warn_once(f"sweep GPU {gpu.index} ({gpu.uuid}): cap {w(gpu.power_limit_w)} W -> "
                      f"{', '.join(w(c) for c in rig.sweep_watts)} W live, then back to "
                      f"{UNIT_NAME}'s cap")
    yield from files.directory._inner(path=SWEEP_DIR, mode="700")
    yield from files.put._inner(src=str(RIG_PROGRAM), dest=f"{SWEEP_DIR}/sweep_rig.py")
    yield from files.put._inner(src=cap_check.__file__, dest=f"{SWEEP_DIR}/cap_check.py")
    yield FunctionCommand(_run, (rig, target, settings, Path(root) if root else None), {})


@deploy("Power sweep")
def power_sweep(rig: Rig) -> None:
    """Sweep the rig's live cap over sweep_watts with the verify bench; the caps restored."""
    from rigbook.verify import verify_plan

    if rig.recipe is None:
        refused(name="Check the serving recipe",
                message=f"{host.name}: recipe: no recipe to bench; pass --data recipe=NAME")
        return
    try:
        target, settings = verify_plan(rig, host.name, host.data.get("ssh_hostname") or host.name)
    except RigbookError as failed:
        refused(name="Check the verify settings", message=str(failed))
        return
    sweep_caps(name=f"Sweep {', '.join(w(c) for c in rig.sweep_watts)} W on {target.url}",
               rig=rig, target=target, settings=settings)


def rows(runs: Iterable[SweepRun], rig: str | None = None) -> list[SweepRun]:
    """The latest sweep per rig and recipe, or every sweep of one rig."""
    runs = list(runs)
    if rig is not None:
        return [r for r in runs if r.rig == rig]
    latest = {(r.rig, r.recipe): r for r in runs}
    return sorted(latest.values(), key=lambda r: (r.rig, r.recipe))
