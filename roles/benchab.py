"""A/B of two stored verify runs (`rigbook bench compare --ab A B`): every bench figure's mean
and 95 % interval in both, the change, and whether it is inside the noise; what differs between
the two configurations (their fingerprints and settings); the stress ceilings and the soaks'
figures side by side.

The noise is rigbook.core.stats' (the power sweep's own): the runs' values in order, their
autocorrelation counted, and a difference inside 1.96 standard errors of the difference is
"inside the noise". A change of 3 % over 5 runs with a 4 % coefficient of variation is not a
finding; the table says so instead of ranking the two.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from rigbook.core import stats
from rigbook.core.errors import RigbookError
from rigbook.roles.verify import Stat, VerifyRun


def stamp(run: VerifyRun) -> str:
    """A run's name as its stored file has it (rigbook.roles.verify.run_path)."""
    return run.started.strftime("%Y%m%dT%H%M%S.%fZ")


def pick(runs: list[VerifyRun], ref: str) -> VerifyRun:
    """The run a reference names: a stored run's file, or a prefix of one stamp alone."""
    path = Path(ref)
    if path.suffix == ".json" and path.is_file():
        try:
            return VerifyRun.model_validate_json(path.read_text())
        except ValueError as error:
            raise RigbookError(f"{ref}: not a verify result ({error})") from None
    found = [run for run in runs if stamp(run).startswith(ref)]
    if len(found) != 1:
        which = "no stored run" if not found else f"{len(found)} stored runs"
        raise RigbookError(f"--ab {ref}: {which} with that stamp; give a run's JSON file or a "
                           "longer prefix of its name (rigbook bench compare --rig RIG --json)")
    return found[0]


@dataclass(frozen=True)
class Row:
    what: str
    a: str
    b: str
    change: str
    verdict: str


def _cell(estimate: stats.Estimate, digits: int) -> str:
    half = "" if estimate.half_width == float("inf") else f" ± {estimate.half_width:.{digits}f}"
    return f"{estimate.mean:.{digits}f}{half}"


def measure(what: str, a: Stat | None, b: Stat | None, *, higher_is_better: bool = True,
            digits: int = 1) -> Row | None:
    """One figure of both runs: means with 95 % intervals, the change, and the verdict."""
    if a is None or b is None:
        return None
    ea, eb = a.estimate(), b.estimate()
    if ea is None or eb is None:
        return Row(what, a.text(digits), b.text(digits), "-",
                   "cannot tell: a run stored without its values")
    change = (eb.mean - ea.mean) / ea.mean if ea.mean else 0.0
    if stats.indistinguishable(ea, eb):
        verdict = "inside the noise"
    else:
        verdict = "B better" if (change > 0) == higher_is_better else "B worse"
    return Row(what, _cell(ea, digits), _cell(eb, digits), f"{change:+.1%}", verdict)


def rows(a: VerifyRun, b: VerifyRun) -> list[Row]:
    """The bench figures both runs measured (same prompt, same concurrency), then the levels'."""
    found = []
    for fa in a.bench:
        fb = next((f for f in b.bench if (f.prompt, f.concurrency) == (fa.prompt,
                                                                       fa.concurrency)), None)
        if fb is None:
            continue
        name = f"{fa.prompt} x{fa.concurrency}"
        found += [measure(f"{name} decode tok/s", fa.decode_tps, fb.decode_tps),
                  measure(f"{name} wall tok/s", fa.wall_tps, fb.wall_tps),
                  measure(f"{name} TTFT s", fa.ttft_s, fb.ttft_s, higher_is_better=False,
                          digits=3)]
        if fa.concurrency > 1:
            found.append(measure(f"{name} all streams tok/s", fa.aggregate_tps,
                                 fb.aggregate_tps))
    if a.ceiling is not None and b.ceiling is not None:
        ca, cb = a.ceiling.ceiling or 0, b.ceiling.ceiling or 0
        found.append(Row("stress ceiling tok", str(ca), str(cb), f"{cb - ca:+d}",
                         "one ladder each: no noise figure"))
    if a.soak is not None and b.soak is not None:
        ka, kb = a.soak.retention(), b.soak.retention()
        found.append(Row("soak retention", f"{ka[0]:.2f}" if ka else "-",
                         f"{kb[0]:.2f}" if kb else "-", "-", "one soak each"))
        found.append(Row("soak empty / errors", f"{len(a.soak.empty)} / {len(a.soak.errors)}",
                         f"{len(b.soak.empty)} / {len(b.soak.errors)}", "-", "counts"))
    return [row for row in found if row is not None]


def differences(a: VerifyRun, b: VerifyRun) -> list[str]:
    """What differs between the two configurations and the two runs' settings."""
    notes = []
    fa = a.fingerprint.model_dump() if a.fingerprint else {}
    fb = b.fingerprint.model_dump() if b.fingerprint else {}
    for key in sorted(set(fa) | set(fb)):
        if fa.get(key) != fb.get(key):
            notes.append(f"{key}: {fa.get(key)} -> {fb.get(key)}")
    if not fa or not fb:
        notes.append("a run stored before fingerprints: its configuration is not all known")
    for key in sorted(set(a.settings) | set(b.settings)):
        if a.settings.get(key) != b.settings.get(key):
            notes.append(f"setting {key}: {a.settings.get(key)} -> {b.settings.get(key)}")
    return notes


def ab_json(a: VerifyRun, b: VerifyRun) -> dict:
    return {"a": stamp(a), "b": stamp(b), "rows": [asdict(row) for row in rows(a, b)],
            "differences": differences(a, b)}


def ab_table(a: VerifyRun, b: VerifyRun):
    """A rich Table of `rows`, titled with both runs."""
    from rich.table import Table

    table = Table(title=f"A {a.rig} {a.recipe} {a.level} {stamp(a)}  vs  B {b.rig} {b.recipe} "
                        f"{b.level} {stamp(b)} (mean ± 95 % interval)")
    for column in ("figure", "A", "B", "change", "verdict"):
        table.add_column(column, justify="left" if column in ("figure", "verdict") else "right")
    for row in rows(a, b):
        table.add_row(row.what, row.a, row.b, row.change, row.verdict)
    return table
