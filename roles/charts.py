"""Charts of rigbook's measurements, drawn with matplotlib (the `charts` extra).

matplotlib is an extra, not a dependency: rigbook runs on operators' machines and in rigs' tools
venvs where a plotting stack (matplotlib, numpy, pillow, fonttools: ~40 MB of wheels) buys
nothing, and a sweep's JSON and table carry every figure the chart shows. Without it the sweep
and `rigbook bench` work as before and say how to get the charts: pip install 'rigbook[charts]'.

- `sweep_figure`: per workload class, tok/s (narrative and code) and tok/s per W against the cap
  with their 95 % bands, the sweet spot starred, the caps indistinguishable from it shaded, the
  caps the draw does not reach (the workload no longer binds) hatched, and the draw against the
  cap below;
- `probe_figure`: the concurrency probe, aggregate tok/s against the streams with its 95 % band,
  the plateau (the smallest level within noise of the best) marked;
- `compare_png`: `rigbook bench compare`'s bars of single-stream decode tok/s.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rigbook.roles.sweepresult import SweepRun
    from rigbook.roles.verify import VerifyRun

MISSING = ("charts need matplotlib, which rigbook does not install by default: "
           "pip install 'rigbook[charts]' (then `rigbook bench sweep` draws them from the "
           "stored JSON)")
COLOURS = {"narrative": "#3465a4", "code": "#f57900", "frozen-long": "#4e9a06",
           "per_w": "#75507b", "draw": "#555753"}


def _pyplot():
    """matplotlib's pyplot on the file-only backend, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def available() -> bool:
    return _pyplot() is not None


def sweep_figure(run: SweepRun, workload: str, note: str | None = None):
    """One class's chart of a sweep (a matplotlib Figure)."""
    from rigbook.roles.sweepresult import pooled, suggestions

    plt = _pyplot()
    if plt is None:
        raise ImportError(MISSING)
    points = [p for p in run.points if any(win.workload == workload for win in p.windows)]
    caps = [p.cap_w for p in points]
    suggestion = suggestions(run).get(workload)
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(9, 9.5), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 3, 2]})
    s = run.setup
    title = (f"{', '.join(sorted(set(s.gpu_models)))} ({s.cooling}) - {s.engine} {s.model}\n"
             f"power sweep of {run.rig}, {workload}, {run.started:%Y-%m-%d}, "
             f"{run.window_s:g} s windows")
    fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=11)
    step = min((b - a for a, b in zip(caps, caps[1:], strict=False)), default=10.0)

    def shade(ax) -> None:
        for p in points:
            loose = any(not win.evidence.cap_bound for win in p.windows
                        if win.workload == workload)
            if loose:
                ax.axvspan(p.cap_w - step / 2, p.cap_w + step / 2, color="#ef2929", alpha=0.12,
                           lw=0, label="_loose")
            if suggestion and p.cap_w in suggestion.within_w:
                ax.axvspan(p.cap_w - step / 2, p.cap_w + step / 2, color="#fce94f", alpha=0.35,
                           lw=0, label="_within")
        ax.grid(True, alpha=0.3)

    for prompt in dict.fromkeys(win.prompt for p in points for win in p.windows
                                if win.workload == workload):
        wins = [(p.cap_w, next((x for x in p.windows if x.workload == workload
                                and x.prompt == prompt), None)) for p in points]
        wins = [(c, x) for c, x in wins if x is not None]
        xs = [c for c, _ in wins]
        colour = COLOURS.get(prompt, "#2e3436")
        top.plot(xs, [x.tps.mean for _, x in wins], "o-", color=colour, label=f"{prompt} tok/s")
        top.fill_between(xs, [x.tps.low for _, x in wins], [x.tps.high for _, x in wins],
                         color=colour, alpha=0.2, lw=0)
    shade(top)
    top.set_ylabel("tok/s (95 % interval)")

    per_w = [pooled(p, workload) for p in points]
    mid.plot(caps, [e.mean for e in per_w], "o-", color=COLOURS["per_w"], label="tok/s per W")
    mid.fill_between(caps, [e.low for e in per_w], [e.high for e in per_w],
                     color=COLOURS["per_w"], alpha=0.2, lw=0, label="95 % interval")
    shade(mid)
    mid.set_ylabel("tok/s per W")
    if suggestion:
        best = per_w[caps.index(suggestion.best_w)]
        mid.plot([suggestion.best_w], [best.mean], "*", ms=18, color="#c4a000", mec="black",
                 label=f"sweet spot {suggestion.best_w:g} W")
        mid.set_title(suggestion.text(), fontsize=9,
                      bbox={"boxstyle": "round", "fc": "#fce94f", "alpha": 0.9})

    draws = [[win.evidence.mean_w for win in p.windows if win.workload == workload]
             for p in points]
    low.plot(caps, [sum(d) / len(d) for d in draws], "o-", color=COLOURS["draw"],
             label="mean draw, all GPUs")
    gpus = max(len(p.live_caps_w) for p in points) or 1
    low.plot(caps, [c * gpus for c in caps], "--", color="#888a85",
             label="cap" + (f" x {gpus} GPUs" if gpus > 1 else ""))
    shade(low)
    low.set_ylabel("W")
    low.set_xlabel("power cap per GPU (W)")
    from matplotlib.patches import Patch

    handles = [Patch(color="#fce94f", alpha=0.5, label="within noise of the best"),
               Patch(color="#ef2929", alpha=0.25, label="the cap does not bind (draw below)")]
    top.legend(loc="best", fontsize=8)
    top.set_ylim(bottom=0)
    mid.set_ylim(bottom=0)
    mid.legend(handles=mid.get_legend_handles_labels()[0] + handles, loc="best", fontsize=8)
    low.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def probe_figure(run: SweepRun, note: str | None = None):
    """The concurrency probe's chart (a matplotlib Figure): aggregate tok/s per level, its
    band, the plateau starred, the levels within noise of the best shaded."""
    from rigbook.core.stats import indistinguishable
    from rigbook.roles.sweepresult import probe_line

    plt = _pyplot()
    if plt is None:
        raise ImportError(MISSING)
    probe = run.concurrency
    wins = sorted(probe.windows, key=lambda win: win.concurrency)
    xs = [win.concurrency for win in wins]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    s = run.setup
    fig.suptitle(f"{', '.join(sorted(set(s.gpu_models)))} ({s.cooling}) - {s.engine} {s.model}\n"
                 f"concurrency probe of {run.rig}, {run.started:%Y-%m-%d}, "
                 f"{run.window_s:g} s windows" + (f"\n{note}" if note else ""), fontsize=11)
    best = max(wins, key=lambda win: win.tps.mean).tps.estimate()
    for win in wins:
        if indistinguishable(best, win.tps.estimate()):
            ax.axvspan(win.concurrency / 2 ** 0.25, win.concurrency * 2 ** 0.25, color="#fce94f",
                       alpha=0.35, lw=0)
    ax.plot(xs, [win.tps.mean for win in wins], "o-", color=COLOURS["narrative"],
            label="aggregate tok/s (narrative)")
    ax.fill_between(xs, [win.tps.low for win in wins], [win.tps.high for win in wins],
                    color=COLOURS["narrative"], alpha=0.2, lw=0, label="95 % interval")
    at = next(win for win in wins if win.concurrency == probe.plateau)
    ax.plot([probe.plateau], [at.tps.mean], "*", ms=18, color="#c4a000", mec="black",
            label=f"plateau: {probe.plateau} streams")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tok/s (95 % interval)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    from matplotlib.patches import Patch

    handles = ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles + [Patch(color="#fce94f", alpha=0.5,
                                       label="within noise of the best")], fontsize=8,
              loc="lower right")
    ax.set_title(probe_line(probe).split(" (streams:")[0], fontsize=9,
                 bbox={"boxstyle": "round", "fc": "#fce94f", "alpha": 0.9})
    fig.tight_layout()
    return fig


def write_charts(run: SweepRun, folder: Path, stem: str,
                 note: str | None = None) -> list[Path] | str:
    """A PNG per workload class (<stem>-<class>.png) and of the concurrency probe
    (<stem>-concurrency.png), or why none was drawn."""
    from rigbook.roles.sweepresult import workloads_of

    plt = _pyplot()
    if plt is None:
        return MISSING
    written = []
    for workload in workloads_of(run):
        fig = sweep_figure(run, workload, note)
        path = folder / f"{stem}-{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if run.concurrency is not None:
        fig = probe_figure(run, note)
        path = folder / f"{stem}-concurrency.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def compare_png(runs: list[VerifyRun], rig: str | None = None) -> bytes:
    """Bars of single-stream decode tok/s (median, with the runs' range), narrative and code,
    one group per compared row."""
    from rigbook.roles.verify import _bench, compare_rows

    plt = _pyplot()
    if plt is None:
        raise ImportError(MISSING)
    rows = compare_rows(runs, rig)
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(rows) + 2), 4.5))
    width = 0.38
    for j, prompt in enumerate(("narrative", "code")):
        figures = [_bench(r, prompt, 1) for r in rows]
        xs = [i + (j - 0.5) * width for i in range(len(rows))]
        values = [f.decode_tps.median if f else 0.0 for f in figures]
        errors = [[f.decode_tps.median - f.decode_tps.min if f else 0 for f in figures],
                  [f.decode_tps.max - f.decode_tps.median if f else 0 for f in figures]]
        bars = ax.bar(xs, values, width, yerr=errors, capsize=3, color=COLOURS[prompt],
                      label=prompt)
        ax.bar_label(bars, labels=[f"{v:.1f}" if f else "no bench" for v, f in
                                   zip(values, figures, strict=True)], fontsize=8, padding=2)
    ax.set_xticks(range(len(rows)),
                  [f"{r.rig}\n{r.recipe}\n{r.started:%m-%d %H:%M}" for r in rows], fontsize=8)
    ax.set_ylabel("decode tok/s, 1 stream (median, runs' range)")
    ax.set_title("rigbook bench compare")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out.getvalue()
