"""A power sweep's results: each window's evidence, its intervals, the suggestion and diagnosis.

A window is one workload class and prompt at one cap, bounded by time (decode: timed from the
first token; prefill: the cold prefills' own spans). What the meter sampled inside it becomes its
evidence (docs/sweep.md lists every field); the token rate binned on the same 0.5 s grid as the
draw gives tok/s and tok/s per W with intervals that count the series' autocorrelation
(rigbook.core.stats). The suggestion per class names the cap with the best tok/s per W and the
caps indistinguishable from it; caps whose draw stays below them get a diagnosis line, after the
hardware notes' "draw plateaued below cap" table.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from rigbook.core.errors import RigbookError
from rigbook.core.stats import Estimate, estimate, indistinguishable, ratio, resolvable
from rigbook.core.types import StrictModel
from rigbook.roles.power import watts as w
from rigbook.roles.verify import _part, results_dir, truncate

Workload = Literal["decode-single", "decode-concurrent", "prefill-heavy"]
#: The grid (s) the token rate and the draw are binned on: the sources' sampling interval.
BIN_S = 0.5
#: A cap binds when the draw reaches this share of it (or the card says sw_power_cap).
BINDS_AT = 0.95
#: The hardware notes' line between a cooled card and a thermally throttled one (C).
THERMAL_C = 78
#: Below this mean utilisation (%) a plateau is the workload's, not the card's.
BUSY_PCT = 50


class Interval(StrictModel):
    """A mean and its 95 % interval; n_eff and tau_s say how many independent samples it had."""

    mean: float
    low: float
    high: float
    n_eff: float
    tau_s: float

    @classmethod
    def of(cls, e: Estimate) -> Interval:
        """From an estimate; rates are never negative, so the interval stops at 0."""
        half = e.half_width if math.isfinite(e.half_width) else abs(e.mean)
        return cls(mean=round(e.mean, 6), low=round(max(e.mean - half, 0.0), 6),
                   high=round(e.mean + half, 6), n_eff=round(e.n_eff, 2), tau_s=round(e.tau_s, 3))

    def estimate(self) -> Estimate:
        half = self.high - self.mean  # the upper side: the lower one may stop at 0
        se = half / 1.96
        return Estimate(self.mean, se * math.sqrt(self.n_eff), 0, self.tau_s, self.n_eff, half)


class Evidence(StrictModel):
    """What the meter saw in one window, all GPUs of the rig together (temperatures: the
    hottest card)."""

    seconds: float
    samples: int  # inside the window; 0: the nearest one stood in (the meter fell behind)
    interval_s: float | None  # the median spacing of the samples
    mean_w: float
    median_w: float
    p95_w: float
    energy_j: float
    energy_source: Literal["counter", "mean-draw"]
    temp_c_max: float | None
    util_pct_mean: float | None
    sm_mhz_mean: float | None
    clock_reasons: tuple[str, ...]  # clock-event reasons active in any sample
    cap_bound: bool
    resolvable_w: float | None  # the smallest draw difference this window resolves (95 %)
    other_processes: tuple[str, ...]  # "pid command" of GPU processes outside the engine
    # The whole system where a PSU reports it (corsairpsu): its DC output, AC is 8-12 % higher.
    psu_mean_w: float | None = None
    psu_median_w: float | None = None
    psu_samples: int = 0


class Window(StrictModel):
    workload: Workload
    prompt: str  # narrative, code, or the frozen long prompt of the prefill
    concurrency: int
    requests: int
    tokens: float  # generated (decode) or prompt (prefill) tokens inside the window
    tps: Interval
    tps_per_w: Interval
    evidence: Evidence
    salts: tuple[str, ...] = ()  # prefill: the salt at the start of each cold prompt


class SweepPoint(StrictModel):
    cap_w: float
    live_caps_w: dict[str, float | None]
    meter: str  # "nvml" or "nvidia-smi"
    windows: tuple[Window, ...]
    psu: str | None = None  # the corsairpsu hwmon folder the meter read; None: none found

    @property
    def other_load(self) -> bool:
        return any(win.evidence.other_processes for win in self.windows)


class ConcurrencyProbe(StrictModel):
    """Where decode concurrency plateaus at the rig's current cap: a narrative decode window per
    level (1, 2, 4, ...), and the smallest level whose aggregate tok/s is within noise of the
    best (`plateau`), which the sweep's decode-concurrent windows then run at."""

    caps_w: dict[str, float | None]  # the live caps it ran at (the unit's)
    windows: tuple[Window, ...]
    plateau: int


class Rigs(StrictModel):
    """What sets a sweep beside another rig's: the notes' row columns and the build."""

    gpu_models: tuple[str, ...]
    cooling: str
    engine: str
    engine_build: str  # the serving venv (files/venvs/pins.toml pins it)
    model: str
    driver: str | None


class SweepRun(StrictModel):
    """One sweep of one rig, stored as JSON on the operator's machine."""

    schema_version: Literal[2] = 2
    rig: str
    recipe: str
    url: str
    setup: Rigs
    caps_asked_w: tuple[float, ...]
    window_s: float
    prefill_tokens: int
    started: datetime
    seconds: float
    points: tuple[SweepPoint, ...]
    error: str | None = None
    unit_caps_w: dict[str, float]
    restored: bool
    restore_detail: str
    concurrency: ConcurrencyProbe | None = None  # sweep_concurrency_probe

    @property
    def ok(self) -> bool:
        return self.error is None and self.restored and len(self.points) == len(self.caps_asked_w)


# --- storage -------------------------------------------------------------------------------------


def sweep_path(run: SweepRun, root: Path | None = None) -> Path:
    """<root>/<rig>/<recipe>/sweeps/<started>.json, beside the verify runs (history kept)."""
    stamp = run.started.strftime("%Y%m%dT%H%M%S.%fZ")
    return (root or results_dir()) / _part(run.rig) / _part(run.recipe) / "sweeps" / f"{stamp}.json"


def load_sweeps(root: Path | None = None) -> list[tuple[Path, SweepRun]]:
    """Every stored sweep, oldest first; a file that does not validate is an error naming it."""
    found = []
    for path in sorted((root or results_dir()).glob("*/*/sweeps/*.json")):
        try:
            found.append((path, SweepRun.model_validate_json(path.read_text())))
        except (OSError, ValidationError) as failure:
            raise RigbookError(f"{path}: not a sweep result: {truncate(str(failure))}") from None
    return sorted(found, key=lambda item: item[1].started)


# --- a window from the meter's samples -----------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One meter reading: the rig's clock, per GPU {"w","mj","t","u","sm","why"}, the GPU
    processes outside the engine where it looked for them (None: not this time), and the PSU's
    DC output (W) where one reports it."""

    t: float
    gpus: dict
    others: list | None = None
    psu_w: float | None = None

    @property
    def total_w(self) -> float:
        return sum(g["w"] for g in self.gpus.values())


def samples_of(lines: Sequence) -> list[Sample]:
    """The meter's JSON lines (header dropped), only readings of every GPU without error; a
    line's fourth item is the PSU's draw (lines of a meter before it have three)."""
    found = []
    for line in lines:
        if not isinstance(line, list) or len(line) not in (3, 4) or not isinstance(line[1], dict):
            continue
        t, gpus, others, *psu = line
        psu_w = psu[0] if psu and isinstance(psu[0], int | float) else None
        if gpus and "error" not in gpus and all(
                isinstance(g, dict) and isinstance(g.get("w"), int | float) for g in gpus.values()):
            found.append(Sample(float(t), gpus, others, psu_w))
    return found


def _inside(samples: list[Sample], begin: float, end: float) -> tuple[list[Sample], int]:
    inside = [s for s in samples if begin <= s.t <= end]
    if inside:
        return inside, len(inside)
    if not samples:
        raise ValueError("the meter took no sample")
    return [min(samples, key=lambda s: abs(s.t - (begin + end) / 2))], 0


def _mean(values: list) -> float | None:
    values = [v for v in values if isinstance(v, int | float)]
    return round(statistics.fmean(values), 2) if values else None


def evidence(samples: list[Sample], begin: float, end: float, cap_w: float) -> Evidence:
    """The draw and the card's state between `begin` and `end` (the rig's clock). Energy from
    the cards' counters when every sample has one, else mean watts x seconds."""
    inside, count = _inside(samples, begin, end)
    totals = [s.total_w for s in inside]
    ordered = sorted(totals)
    seconds = max(end - begin, 0.0)
    mean = statistics.fmean(totals)
    spacing = [b.t - a.t for a, b in zip(inside, inside[1:], strict=False)]
    interval = statistics.median(spacing) if spacing else None
    counters = all(g.get("mj") is not None for s in inside for g in s.gpus.values())
    if counters and len(inside) > 1 and inside[-1].t > inside[0].t:
        first, last = inside[0].gpus, inside[-1].gpus
        joules = sum(last[u]["mj"] - first[u]["mj"] for u in first if u in last) / 1000.0
        energy, source = joules * seconds / (inside[-1].t - inside[0].t), "counter"
    else:
        energy, source = mean * seconds, "mean-draw"
    gpus = [g for s in inside for g in s.gpus.values()]
    reasons = sorted({why for g in gpus for why in g.get("why") or ()})
    cards = max(len(s.gpus) for s in inside)
    sd = statistics.stdev(totals) if len(totals) > 1 else 0.0
    tau = estimate(totals, interval or BIN_S).tau_s
    others = sorted({f"{pid} {name}" for s in samples if begin - 2 <= s.t <= end + 2
                     for pid, name in s.others or ()})
    psu = [s.psu_w for s in inside if s.psu_w is not None]
    return Evidence(
        seconds=round(seconds, 3), samples=count,
        interval_s=round(interval, 3) if interval else None, mean_w=round(mean, 2),
        median_w=round(statistics.median(totals), 2),
        p95_w=round(ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)], 2),
        energy_j=round(energy, 3), energy_source=source,
        temp_c_max=max((g["t"] for g in gpus if isinstance(g.get("t"), int | float)),
                       default=None),
        util_pct_mean=_mean([g.get("u") for g in gpus]),
        sm_mhz_mean=_mean([g.get("sm") for g in gpus]),
        clock_reasons=tuple(reasons),
        cap_bound=mean >= BINDS_AT * cap_w * cards or "sw_power_cap" in reasons,
        resolvable_w=round(resolvable(sd, tau, seconds), 2) if sd > 0 and seconds > 0 else None,
        other_processes=tuple(others),
        psu_mean_w=round(statistics.fmean(psu), 2) if psu else None,
        psu_median_w=round(statistics.median(psu), 2) if psu else None,
        psu_samples=len(psu) if count else 0,
    )


def binned_draw(samples: list[Sample], begin: float, bins: int) -> list[float]:
    """The draw on the BIN_S grid from `begin`: a bin's mean, or the last value before it."""
    if not samples:
        raise ValueError("the meter took no sample")
    out, held = [], min(samples, key=lambda s: abs(s.t - begin)).total_w
    for i in range(bins):
        lo, hi = begin + i * BIN_S, begin + (i + 1) * BIN_S
        inside = [s.total_w for s in samples if lo <= s.t < hi]
        held = statistics.fmean(inside) if inside else held
        out.append(held)
    return out


def decode_window(workload: Workload, prompt: str, level: int, requests: int,
                  tokens: list[tuple[float, float]], begin: float, window_s: float,
                  samples: list[Sample], cap_w: float) -> Window:
    """One decode window: `tokens` are (rig-clock time, token count) of every streamed chunk;
    the window runs `window_s` from `begin` (the first token)."""
    bins = max(int(window_s / BIN_S), 1)
    rate = [0.0] * bins
    for t, count in tokens:
        i = int((t - begin) / BIN_S)
        if 0 <= i < bins:
            rate[i] += count / BIN_S
    draw = binned_draw(samples, begin, bins)
    end = begin + bins * BIN_S
    return Window(workload=workload, prompt=prompt, concurrency=level, requests=requests,
                  tokens=round(sum(rate) * BIN_S, 2), tps=Interval.of(estimate(rate, BIN_S)),
                  tps_per_w=Interval.of(ratio(rate, draw, BIN_S)),
                  evidence=evidence(samples, begin, end, cap_w))


def prefill_window(runs: list[tuple[str, int, float, float]], samples: list[Sample],
                   cap_w: float, prompt: str) -> Window:
    """Cold prefills, each (salt, prompt tokens, begin, end) on the rig's clock: tok/s per run,
    the draw over each run's span (cold runs are independent samples)."""
    rates = [tokens / max(end - begin, 1e-9) for _, tokens, begin, end in runs]
    draws = [statistics.fmean(s.total_w for s in _inside(samples, begin, end)[0])
             for _, _, begin, end in runs]
    return Window(workload="prefill-heavy", prompt=prompt, concurrency=1, requests=len(runs),
                  tokens=sum(tokens for _, tokens, _, _ in runs),
                  tps=Interval.of(estimate(rates, 1.0)),
                  tps_per_w=Interval.of(ratio(rates, draws, 1.0)),
                  evidence=evidence(samples, runs[0][2], runs[-1][3], cap_w),
                  salts=tuple(salt for salt, *_ in runs))


#: The probe's highest level where the recipe names no max_num_seqs.
PROBE_MAX = 64


def probe_levels(max_seqs: int | None) -> list[int]:
    """1, 2, 4, ... up to max_seqs (or PROBE_MAX), max_seqs itself last where it is no power
    of 2."""
    top = max(1, min(max_seqs or PROBE_MAX, PROBE_MAX))
    levels = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return levels + ([top] if levels[-1] != top else [])


def plateau_level(windows: Sequence[Window]) -> int:
    """The smallest concurrency whose aggregate tok/s cannot be told from the best's (their
    intervals, autocorrelation counted): more streams than that buy nothing this run can see."""
    best = max(windows, key=lambda win: win.tps.mean)
    top = best.tps.estimate()
    return min(win.concurrency for win in windows
               if win is best or indistinguishable(top, win.tps.estimate()))


def probe_line(probe: ConcurrencyProbe) -> str:
    """The probe's finding, in words."""
    best = max(probe.windows, key=lambda win: win.tps.mean)
    at = next(win for win in probe.windows if win.concurrency == probe.plateau)
    caps = ", ".join(sorted({w(c) for c in probe.caps_w.values() if c is not None}))
    levels = ", ".join(f"{win.concurrency}: {win.tps.mean:.1f}" for win in probe.windows)
    return (f"concurrency plateaus at {probe.plateau} streams ({at.tps.mean:.1f} tok/s, "
            f"{at.tps.low:.1f}-{at.tps.high:.1f}; the best, {best.concurrency} streams, "
            f"{best.tps.mean:.1f}) at the current cap {caps} W (streams: tok/s {levels}); the "
            f"sweep's decode-concurrent ran at {probe.plateau}")


# --- reading a sweep -----------------------------------------------------------------------------


def workloads_of(run: SweepRun) -> list[Workload]:
    return list(dict.fromkeys(win.workload for point in run.points for win in point.windows))


def pooled(point: SweepPoint, workload: Workload, value: str = "tps_per_w") -> Estimate | None:
    """A point's figure of a class over its prompts (narrative and code): their mean, with the
    standard errors combined; None where the point did not run that class."""
    found = [getattr(win, value).estimate() for win in point.windows if win.workload == workload]
    if not found:
        return None
    mean = statistics.fmean(e.mean for e in found)
    se = math.sqrt(sum(e.se ** 2 for e in found)) / len(found)
    n_eff = sum(e.n_eff for e in found)
    return Estimate(mean, se * math.sqrt(n_eff), 0, found[0].tau_s, n_eff, 1.96 * se)


def mean_draw(point: SweepPoint, workload: Workload) -> float:
    draws = [win.evidence.mean_w for win in point.windows if win.workload == workload]
    return statistics.fmean(draws) if draws else math.nan


@dataclass(frozen=True)
class Suggestion:
    workload: Workload
    best_w: float  # the best tok/s per W
    within_w: tuple[float, ...]  # caps indistinguishable from it (itself included)
    least_w: float  # of those, the one that draws least
    left_out_w: tuple[float, ...]  # caps with other GPU load seen

    def text(self) -> str:
        span = _span(self.within_w)
        if len(self.within_w) == 1:
            said = f"{w(self.best_w)} W has the best tok/s per W, told apart from every other cap"
        else:
            said = (f"{span} W are within noise of the best ({w(self.best_w)} W); "
                    f"{w(self.least_w)} W draws least")
        if self.left_out_w:
            said += f" (left out, other GPU load: {', '.join(w(c) for c in self.left_out_w)} W)"
        return said


def _span(caps: Sequence[float]) -> str:
    caps = sorted(caps)
    return w(caps[0]) if len(caps) == 1 else ", ".join(w(c) for c in caps) if len(caps) < 3 \
        else f"{w(caps[0])}-{w(caps[-1])}"


def suggestions(run: SweepRun) -> dict[Workload, Suggestion]:
    """Per class: the cap with the best tok/s per W among points without other GPU load, and the
    caps whose interval cannot be told from it."""
    found = {}
    for workload in workloads_of(run):
        clean = [(p, e) for p in run.points if not p.other_load
                 and (e := pooled(p, workload)) is not None]
        if not clean:
            continue
        best, top = max(clean, key=lambda item: (item[1].mean, -item[0].cap_w))
        within = [p for p, e in clean if p is best or indistinguishable(top, e)]
        least = min(within, key=lambda p: (mean_draw(p, workload), p.cap_w))
        found[workload] = Suggestion(
            workload, best.cap_w, tuple(p.cap_w for p in within), least.cap_w,
            tuple(p.cap_w for p in run.points if p.other_load))
    return found


def diagnosis(run: SweepRun, workload: Workload) -> list[str]:
    """Lines for caps the draw does not reach: a run of them drawing alike is a plateau, named
    with its likely cause (the hardware notes' table); a lone one a cap that does not bind."""
    lines: list[str] = []
    loose = [p for p in run.points
             if any(not win.evidence.cap_bound for win in p.windows if win.workload == workload)]
    wins = [win for p in loose for win in p.windows if win.workload == workload]
    if not loose:
        return lines
    draws = [mean_draw(p, workload) for p in loose]
    noise = max((win.evidence.resolvable_w or 0.0 for win in wins), default=0.0)
    temp = max((win.evidence.temp_c_max or 0.0 for win in wins), default=0.0)
    utils = [win.evidence.util_pct_mean for win in wins if win.evidence.util_pct_mean is not None]
    if len(loose) >= 2 and max(draws) - min(draws) <= max(noise, 0.05 * max(draws)):
        if temp >= THERMAL_C:
            why = f"thermal: the cards reached {temp:g} C; cooling is the limit, not the cap"
        elif utils and statistics.fmean(utils) < BUSY_PCT:
            why = (f"workload too small: utilisation {statistics.fmean(utils):.0f} %; a bigger "
                   "model or more concurrent streams loads the card")
        elif workload == "prefill-heavy":
            why = "firmware or voltage limit: a compute-bound prefill does not draw more"
        else:
            why = ("memory-bandwidth-bound decode: try prefill-heavy or more streams to see "
                   "whether compute can use the headroom")
        lines.append(f"{workload}: caps {_span([p.cap_w for p in loose])} W all draw "
                     f"~{statistics.fmean(draws):.0f} W: a plateau, {why}")
    else:
        for p, draw in zip(loose, draws, strict=True):
            lines.append(f"{workload}: the {w(p.cap_w)} W cap does not bind (drew "
                         f"{draw:.1f} W)")
    return lines


def resolvable_w(run: SweepRun) -> float | None:
    """The smallest draw difference the sweep's windows resolve (their median)."""
    found = [win.evidence.resolvable_w for p in run.points for win in p.windows
             if win.evidence.resolvable_w]
    return round(statistics.median(found), 1) if found else None


#: What a corsairpsu's power1 is: the supply's DC output, not what it draws from the wall.
AC_NOTE = "DC output of the PSU: its AC draw at the wall is 8-12 % higher"


def psu_line(run: SweepRun) -> str:
    """Whole-system power: which PSU the meter read and its range of window means, or that the
    rig has none the meter could read."""
    folders = sorted({p.psu for p in run.points if p.psu})
    means = [win.evidence.psu_mean_w for p in run.points for win in p.windows
             if win.evidence.psu_mean_w is not None]
    if not folders or not means:
        return ("whole-system power: none found (no corsairpsu hwmon on the rig, the only PSU "
                "telemetry the meter reads)")
    return (f"whole-system power: corsairpsu ({', '.join(folders)}), windows' means "
            f"{min(means):.1f}-{max(means):.1f} W, {AC_NOTE}")


def summary_rows(run: SweepRun) -> list[str]:
    """The hardware notes' cross-rig rows (GPU, Cooling, Engine, Model, Cap, Narr TPS, Code TPS,
    TPS/W, Source) as markdown: per class the suggested cap (starred) and the highest cap."""
    rows = ["| GPU | Cooling | Engine | Model | Cap | Narr TPS | Code TPS | TPS/W | Source |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    s = run.setup
    gpu = ", ".join(sorted(set(s.gpu_models))) or "?"
    for workload, suggestion in suggestions(run).items():
        top = max(run.points, key=lambda p: p.cap_w)
        best = next(p for p in run.points if p.cap_w == suggestion.best_w)
        for point in [best] + ([top] if top is not best else []):
            def tps(prompt: str, point: SweepPoint = point, workload: Workload = workload) -> str:
                found = [win.tps.mean for win in point.windows
                         if win.workload == workload and win.prompt == prompt]
                return f"{found[0]:.2f}" if found else "(n/a)"
            narr = tps("narrative") if workload != "prefill-heavy" else tps("frozen-long")
            star = " ⭐" if point.cap_w == suggestion.best_w else ""
            per_w = pooled(point, workload)
            rows.append(
                f"| {gpu} | {s.cooling} | {s.engine} {workload} ({s.engine_build}) | {s.model} | "
                f"{w(point.cap_w)}W{star} | {narr} | {tps('code')} | "
                f"{per_w.mean:.3f} | sweep of {run.rig} by rigbook, {run.started:%Y-%m-%d}, "
                f"{len(run.points)} caps |")
    return rows


def sweep_table(run: SweepRun):
    """A rich Table of one sweep: a row per cap and window, the suggestion marked."""
    from rich.table import Table

    best = suggestions(run)
    table = Table(title=f"power sweep of {run.rig} ({run.recipe}, "
                        f"{run.started:%Y-%m-%d %H:%M:%S} UTC)")
    for column in ("cap W", "workload", "prompt", "tok/s (95% CI)", "tok/s/W (95% CI)", "mean W",
                   "p95 W", "n", "PSU DC W", "C", "util", "bound", "note"):
        table.add_column(column, justify="left" if column in ("workload", "prompt", "note")
                         else "right")
    for point in run.points:
        for win in point.windows:
            e, s = win.evidence, best.get(win.workload)
            note = ("other GPU load: " + ", ".join(e.other_processes) if e.other_processes
                    else "<- best" if s and s.best_w == point.cap_w
                    else "within noise" if s and point.cap_w in s.within_w else "")
            table.add_row(
                w(point.cap_w), win.workload, win.prompt,
                f"{win.tps.mean:.1f} ({win.tps.low:.1f}-{win.tps.high:.1f})",
                f"{win.tps_per_w.mean:.4f} ({win.tps_per_w.low:.4f}-{win.tps_per_w.high:.4f})",
                f"{e.mean_w:.1f}", f"{e.p95_w:.1f}", str(e.samples),
                "-" if e.psu_mean_w is None else f"{e.psu_mean_w:.1f}",
                "-" if e.temp_c_max is None else f"{e.temp_c_max:g}",
                "-" if e.util_pct_mean is None else f"{e.util_pct_mean:.0f}%",
                "yes" if e.cap_bound else "no", note)
    return table
