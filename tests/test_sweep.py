"""The power sweep without a rig: the caps it accepts, what it refuses, the draw arithmetic, the
chart, the rig-side guard's restore and meter (run here against a stand-in nvidia-smi), the
sandbox's draw model, and `rigbook bench sweep` on stored results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from rigbook import cli
from rigbook.core.checks import Facts
from rigbook.core.errors import RigbookError
from rigbook.core.spec import MAX_CAPS, parse_rig, parse_watts
from rigbook.core.stats import Estimate
from rigbook.rigside.gpus import GpuProbe
from rigbook.roles.power import PowerUnit
from rigbook.roles.sweep import (
    NO_UNIT_HERE,
    RIG_PROGRAM,
    apply_command,
    default_caps,
    lease_command,
    report_lines,
    save_sweep,
    sweep_findings,
)
from rigbook.roles.sweepresult import (
    Evidence,
    Interval,
    Rigs,
    Sample,
    SweepPoint,
    SweepRun,
    Window,
    decode_window,
    diagnosis,
    evidence,
    load_sweeps,
    prefill_window,
    samples_of,
    suggestions,
    summary_rows,
)
from tests.test_power import DUAL, SMI, UUID0, UUID1, rtx3090

ROOT = Path(__file__).resolve().parent.parent
STANDIN_SMI = ROOT / "sandbox" / "simulated" / "nvidia-smi"
BASE = {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2}


# --- the caps asked ------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "caps"), [
    ("250:350:10", tuple(float(w) for w in range(250, 351, 10))),
    ("250:280:20", (250.0, 270.0)),  # STOP is included only when a step lands on it
    ("290,250,290", (250.0, 290.0)),  # sorted, each once
    (300, (300.0,)),  # pyinfra types `--data sweep_watts=300` as an int
    ([250, 300.5], (250.0, 300.5)),  # and a JSON list as a list
    ("250.5", (250.5,)),
    (" 300 ", (300.0,)),
    (None, ()),
])
def test_caps_parse(value, caps):
    assert parse_watts(value) == caps


@pytest.mark.parametrize(("value", "says"), [
    ("-1", "is not a cap in watts"),
    (-1, "outside 1..2000 W"),
    ("250:350:0", "STEP '0' is not a step of 1 W or more"),
    ("250:350:-10", "STEP '-10'"),
    ("350:250:10", "STOP 250 is below START 350"),
    ("250:350", "a range is START:STOP:STEP"),
    ("250:300:10:5", "a range is START:STOP:STEP"),
    ("$(reboot)", "is not a cap in watts"),
    ("250;reboot", "is not a cap in watts"),
    ("300\nExecStart=/bin/sh", "is not a cap in watts"),
    ("1e3", "is not a cap in watts"),
    ("nan", "is not a cap in watts"),
    (float("nan"), "outside 1..2000 W"),
    (float("inf"), "outside 1..2000 W"),
    ("250.125", "is not a cap in watts"),
    (True, "is not a cap in watts"),
    ({"a": 1}, "is not a cap in watts"),
    ("1:2000:1", f"asks 2000 caps; allowed: at most {MAX_CAPS}"),
    ("1:1999999:1", "is not a cap in watts"),
    (list(range(100, 300)), f"200 caps asked; allowed: at most {MAX_CAPS}"),
    (5000, "outside 1..2000 W"),
])
def test_bad_caps_are_refused_saying_what_is_allowed(value, says):
    with pytest.raises(ValueError, match=None) as caught:
        parse_watts(value)
    assert says in str(caught.value)


def test_a_huge_range_is_refused_without_building_it():
    started = time.monotonic()
    with pytest.raises(ValueError, match="at most 64"):
        parse_watts("1:2000:1")
    assert time.monotonic() - started < 0.1


def test_host_data_refuses_a_bad_sweep_before_any_connection():
    assert parse_rig("rig1", {**BASE, "sweep_watts": "250:350:50"}).sweep_watts == (
        250.0, 300.0, 350.0)
    with pytest.raises(RigbookError, match=r"rig1: sweep_watts: .*'\$\(reboot\)' is not a cap"):
        parse_rig("rig1", {**BASE, "sweep_watts": "$(reboot)"})


# --- the checks ----------------------------------------------------------------------------------

UNIT = PowerUnit((f"ExecStart=-{SMI} -i {UUID0} -pl 290", f"ExecStart=-{SMI} -i {UUID1} -pl 290"),
                 "enabled")


def findings(sweep_watts, gpus=DUAL, unit=UNIT, systemd=True, **data) -> list[str]:
    rig = parse_rig("rig1", {**BASE, "sweep_watts": sweep_watts, **data})
    facts = Facts(probe=GpuProbe(smi=SMI, gpus=tuple(gpus)), unit=unit, systemd=systemd)
    return [f.message("rig1") for f in sweep_findings(rig, facts, "rig1")]


def test_caps_inside_every_range_pass_and_a_step_over_20_w_is_warned_about():
    assert findings("250:350:10") == []
    assert findings("250:350:50") == [
        "rig1: sweep_watts: steps over 20 W (250-300, 300-350 W): too coarse to pin down the "
        "efficiency knee (the hardware notes sweep at 10 W); leave sweep_watts out to sweep the "
        "cards' whole range at 10 W"]


def test_no_caps_asked_sweeps_every_cards_whole_range_at_10_w():
    assert default_caps(DUAL) == tuple(float(c) for c in range(100, 401, 10))  # 3090: 100-400 W
    assert findings(None) == []
    # two cards: only what both allow; a range over 64 caps at 10 W takes a wider step
    wide = (replace(rtx3090(0, UUID0), min_limit_w=150.0),
            replace(rtx3090(1, UUID1), max_limit_w=390.0))
    assert default_caps(wide) == tuple(float(c) for c in range(150, 391, 10))
    huge = (replace(rtx3090(0, UUID0), max_limit_w=1000.0),)
    caps = default_caps(huge)
    assert len(caps) <= MAX_CAPS and caps[0] == 100 and caps[-1] == 1000 and caps[1] - caps[0] == 20
    assert default_caps((replace(rtx3090(0, UUID0), min_limit_w=None),)) == ()


def test_caps_outside_a_card_range_are_refused_all_at_once():
    found = findings("50,250,450")
    assert found[1:] == [
        f"rig1: sweep_watts: GPU 0 ({UUID0}) asks 50, 450 W; allowed: the card's range 100-400 W",
        f"rig1: sweep_watts: GPU 1 ({UUID1}) asks 50, 450 W; allowed: the card's range 100-400 W",
    ]


def test_no_unit_no_restore_no_sweep():
    assert any("no nvidia-power-limit.service: nothing to restore" in f
               for f in findings("300", unit=None))
    half = PowerUnit((f"ExecStart=-{SMI} -i {UUID0} -pl 290",), "enabled")
    assert findings("300", unit=half) == [
        f"rig1: GPU 1 ({UUID1}): nvidia-power-limit.service does not cap it, so its cap could "
        "not be restored; allowed: GPUs the unit caps (deploys/power_cap.py)"]


def test_without_systemd_no_unit_can_exist_so_the_sweep_is_refused_saying_so():
    """No systemd: no unit to restore the caps to (the host or the live state owns them) and no
    systemd-run for the guard. One finding, whatever else the rig has: an inert unit file left
    on it, caps the cards could take, no unit at all."""
    refusal = [f"rig1: {NO_UNIT_HERE}"]
    assert findings("300", unit=None, systemd=False) == refusal
    assert findings("300", unit=UNIT, systemd=False) == refusal  # a file no systemd reads
    assert findings("50,450", unit=None, systemd=False, power_profile="stock") == refusal
    assert "no systemd as PID 1" in refusal[0] and "deploys/power_cap.py" not in refusal[0]
    assert "nothing to set them back to" in refusal[0] and "docs/no-systemd.md" in refusal[0]
    # with systemd and no unit the advice is to write one first
    (with_systemd,) = findings("300", unit=None, systemd=True)
    assert "deploys/power_cap.py or deploys/rig.py first" in with_systemd


def test_persistence_off_count_wsl2_and_nothing_asked_are_refused():
    off = (rtx3090(0, UUID0, persistence=False), rtx3090(1, UUID1))
    assert "persistence mode is Disabled" in findings("300", gpus=off)[0]
    assert "declared 2, nvidia-smi lists 1" in findings("300", gpus=DUAL[:1])[0]
    wsl = findings("300", platform="wsl2", gpu_count=1)
    assert wsl and "WSL2: the Windows driver owns the caps" in wsl[0]


# --- a window's evidence and intervals ----------------------------------------------------------


def reading(w: float, mj=None, t=60, u=90, sm=1695, why=()) -> dict:
    return {"w": w, "mj": mj, "t": t, "u": u, "sm": sm, "why": list(why)}


def test_evidence_of_a_window_mean_median_p95_energy_and_the_cards_state():
    samples = [Sample(t * 0.5, {UUID0: reading(100.0 + t, t=60 + t), UUID1: reading(100.0)})
               for t in range(0, 41)]
    e = evidence(samples, 5.0, 15.0, cap_w=110)  # samples 10..30: totals 210..230
    assert (e.samples, e.mean_w, e.median_w, e.p95_w) == (21, 220.0, 220.0, 229.0)
    assert (e.energy_j, e.energy_source, e.seconds, e.interval_s) == (2200.0, "mean-draw", 10, 0.5)
    assert (e.temp_c_max, e.util_pct_mean, e.sm_mhz_mean) == (90, 90, 1695)
    assert e.cap_bound is True  # 220 W of 2 x 110 W
    assert e.resolvable_w is not None and e.other_processes == ()
    counted = [Sample(t, {UUID0: reading(300.0, mj=1000.0 * 300 * t, why=["sw_power_cap"])},
                      [[4242, "python3"]] if t == 4 else None) for t in range(0, 11)]
    by_counter = evidence(counted, 2.0, 8.0, cap_w=400)
    assert by_counter.energy_source == "counter" and by_counter.energy_j == pytest.approx(1800)
    assert by_counter.cap_bound is True and by_counter.clock_reasons == ("sw_power_cap",)
    assert by_counter.other_processes == ("4242 python3",)
    loose = evidence([Sample(0, {UUID0: reading(200.0)}), Sample(1, {UUID0: reading(201.0)})],
                     0, 1, cap_w=300)
    assert loose.cap_bound is False


def test_a_window_without_a_sample_takes_the_nearest_and_says_so():
    samples = [Sample(0.0, {UUID0: reading(50.0)}), Sample(1.0, {UUID0: reading(250.0)})]
    e = evidence(samples, 0.9, 0.95, cap_w=300)
    assert (e.mean_w, e.samples) == (250.0, 0)
    with pytest.raises(ValueError, match="no sample"):
        evidence([], 0, 1, 300)
    # the meter's lines: header and failed reads dropped
    assert samples_of([{"source": "nvidia-smi"}, [0.0, {"error": "failed"}, None],
                       [0.5, {UUID0: reading(1.0)}, None]]) == [Sample(0.5, {UUID0: reading(1.0)})]


def test_decode_window_bins_tokens_from_the_first_token_with_intervals():
    """20 tok/s for 10 s at a steady 250 W: tok/s 20, tok/s per W 0.08, tokens before the first
    token or after the window left out."""
    begin = 100.0
    tokens = [(begin + i / 20, 1.0) for i in range(0, 260)]  # runs 3 s past the window
    samples = [Sample(begin + i * 0.25, {UUID0: reading(250.0 + (i % 2))}) for i in range(-4, 48)]
    win = decode_window("decode-single", "narrative", 1, 3, tokens, begin, 10.0, samples, 300)
    assert win.tokens == 200 and win.tps.mean == pytest.approx(20)
    assert win.tps_per_w.mean == pytest.approx(20 / 250.5, rel=1e-3)
    assert win.tps_per_w.low <= win.tps_per_w.mean <= win.tps_per_w.high
    assert win.evidence.seconds == 10 and win.evidence.samples == 41


def test_prefill_window_keeps_each_cold_runs_salt():
    samples = [Sample(t / 4, {UUID0: reading(300.0)}) for t in range(0, 40)]
    runs = [("a1", 4000, 0.0, 2.0), ("b2", 4000, 3.0, 5.0), ("c3", 4000, 6.0, 8.1)]
    win = prefill_window(runs, samples, 350, "frozen-long")
    assert win.salts == ("a1", "b2", "c3") and win.tokens == 12000
    assert win.tps.low < win.tps.mean == pytest.approx((2000 + 2000 + 4000 / 2.1) / 3)
    assert win.evidence.seconds == pytest.approx(8.1)


# --- results, suggestions, diagnosis -------------------------------------------------------------


def window(workload, prompt, tps, per_w, half, mean_w, bound=True, others=()) -> Window:
    e = Evidence(seconds=10, samples=40, interval_s=0.25, mean_w=mean_w, median_w=mean_w,
                 p95_w=mean_w + 5, energy_j=mean_w * 10, energy_source="mean-draw", temp_c_max=60,
                 util_pct_mean=95, sm_mhz_mean=1695, clock_reasons=(), cap_bound=bound,
                 resolvable_w=8.0, other_processes=others)
    return Window(workload=workload, prompt=prompt, concurrency=1, requests=3, tokens=tps * 10,
                  tps=Interval(mean=tps, low=tps - 1, high=tps + 1, n_eff=20, tau_s=0.5),
                  tps_per_w=Interval(mean=per_w, low=per_w - half, high=per_w + half, n_eff=20,
                                     tau_s=0.5), evidence=e)


#: cap: (tok/s, tok/s per W, half width, draw, binds): 290 and 300 W within noise of each other
FIGURES = {250: (27.0, 0.108, 0.001, 250, True), 290: (32.2, 0.111, 0.001, 290, True),
           300: (33.0, 0.1105, 0.001, 298.6, True), 340: (34.0, 0.100, 0.001, 334, False),
           350: (34.1, 0.0975, 0.001, 334.5, False), 360: (34.2, 0.095, 0.001, 334, False)}


def sample_run(others_at=None, **more) -> SweepRun:
    points = tuple(
        SweepPoint(cap_w=cap, live_caps_w={UUID0: cap}, meter="nvidia-smi", windows=(
            window("decode-single", "narrative", tps, per_w, half, draw, bound,
                   ("77 python3",) if cap == others_at else ()),
            window("decode-single", "code", tps - 0.1, per_w, half, draw, bound),
            window("prefill-heavy", "frozen-long", 900 + cap, 3.6 - cap / 1000, 0.01, cap)))
        for cap, (tps, per_w, half, draw, bound) in FIGURES.items())
    return SweepRun(**{
        "rig": "rig1", "recipe": "tiny-cpu-a", "url": "http://x:8100",
        "setup": Rigs(gpu_models=("NVIDIA GeForce RTX 3090",), cooling="air", engine="llama.cpp",
                      engine_build="llama-cpp", model="org/tiny", driver="580.95.05"),
        "caps_asked_w": tuple(FIGURES), "window_s": 10, "prefill_tokens": 40000,
        "started": datetime(2026, 12, 1, 12, 0, tzinfo=UTC), "seconds": 9.0, "points": points,
        "unit_caps_w": {UUID0: 290.0}, "restored": True, "restore_detail": "as the unit says",
        **more})


def test_the_suggestion_names_the_best_cap_and_those_within_noise():
    found = suggestions(sample_run())
    decode = found["decode-single"]
    assert (decode.best_w, decode.within_w, decode.least_w) == (290, (290, 300), 290)
    assert decode.text() == "290, 300 W are within noise of the best (290 W); 290 W draws least"
    assert found["prefill-heavy"].best_w == 250
    assert apply_command("rig1", 290.0) == (
        "pyinfra INVENTORY deploys/power_cap.py --limit rig1 --data power_cap_watts=290")
    # a point with other GPU load is left out of the suggestion, and the text says so
    loaded = suggestions(sample_run(others_at=290))["decode-single"]
    assert loaded.best_w == 300 and "left out, other GPU load: 290 W" in loaded.text()


def test_a_plateau_of_caps_that_do_not_bind_is_diagnosed():
    lines = diagnosis(sample_run(), "decode-single")
    assert lines == ["decode-single: caps 340-360 W all draw ~334 W: a plateau, memory-bandwidth-"
                     "bound decode: try prefill-heavy or more streams to see whether compute can "
                     "use the headroom"]
    assert diagnosis(sample_run(), "prefill-heavy") == []


def test_a_lone_cap_that_does_not_bind_and_the_plateaus_causes():
    run = sample_run()
    lone = run.model_copy(update={"points": run.points[:4]})  # only 340 W stays below its cap
    assert diagnosis(lone, "decode-single") == [
        "decode-single: the 340 W cap does not bind (drew 334.0 W)"]

    def plateau(**evidence) -> list[str]:
        points = tuple(p.model_copy(update={"windows": tuple(
            w.model_copy(update={"evidence": w.evidence.model_copy(update=evidence)})
            if not w.evidence.cap_bound else w for w in p.windows)}) for p in run.points)
        return diagnosis(run.model_copy(update={"points": points}), "decode-single")
    assert "a plateau, thermal: the cards reached 83 C" in plateau(temp_c_max=83)[0]
    assert "a plateau, workload too small: utilisation 20 %" in plateau(util_pct_mean=20)[0]
    lines = report_lines(run)
    assert any(line.startswith("this sweep resolves draw differences of ~8 W") for line in lines)


def test_the_summary_rows_are_the_notes_format():
    rows = summary_rows(sample_run())
    assert rows[0] == ("| GPU | Cooling | Engine | Model | Cap | Narr TPS | Code TPS | TPS/W | "
                       "Source |")
    assert rows[2] == ("| NVIDIA GeForce RTX 3090 | air | llama.cpp decode-single (llama-cpp) | "
                       "org/tiny | 290W ⭐ | 32.20 | 32.10 | 0.111 | sweep of rig1 by rigbook, "
                       "2026-12-01, 6 caps |")
    assert rows[3].split(" | ")[4:8] == ["360W", "34.20", "34.10", "0.095"]
    assert any("(n/a)" in row and "prefill-heavy" in row for row in rows)


def test_stored_sweeps_and_the_bench_sweep_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RIGBOOK_VERIFY_DIR", str(tmp_path))
    path, charts = save_sweep(sample_run())
    assert path == tmp_path / "rig1" / "tiny-cpu-a" / "sweeps" / "20261201T120000.000000Z.json"
    assert [c.name for c in charts] == ["20261201T120000.000000Z-decode-single.png",
                                        "20261201T120000.000000Z-prefill-heavy.png"]
    assert all(c.read_bytes().startswith(b"\x89PNG") for c in charts)
    assert [run.rig for _, run in load_sweeps()] == ["rig1"]
    assert cli.main(["bench", "sweep", "--png-dir", str(tmp_path / "charts")]) == 0
    out = capsys.readouterr().out
    assert "<- best" in out and "within noise" in out
    assert ("suggested for decode-single: 290 W (290, 300 W are within noise of the best (290 W);"
            " 290 W draws least); to apply: pyinfra INVENTORY deploys/power_cap.py --limit rig1 "
            "--data power_cap_watts=290") in out
    assert "| NVIDIA GeForce RTX 3090 | air |" in out
    assert (tmp_path / "charts" / "20261201T120000.000000Z-decode-single.png").exists()
    assert cli.main(["bench", "sweep", "--rig", "nope"]) == 3
    path.write_text("{}")
    assert cli.main(["bench", "sweep"]) == 3
    assert "not a sweep result" in capsys.readouterr().err


def test_without_matplotlib_the_sweep_stores_json_and_says_how_to_get_charts(
        tmp_path, monkeypatch):
    from rigbook.roles import charts

    monkeypatch.setattr(charts, "_pyplot", lambda: None)
    path, said = save_sweep(sample_run(), tmp_path)
    assert path.exists() and said == charts.MISSING and "rigbook[charts]" in said
    assert not list(path.parent.glob("*.png"))
    assert report_lines(sample_run())[0].startswith("suggested for decode-single: 290 W")


def test_an_estimate_round_trips_through_the_stored_interval():
    e = Interval(mean=1.0, low=0.8, high=1.2, n_eff=16, tau_s=1).estimate()
    assert isinstance(e, Estimate) and e.half_width == pytest.approx(0.2)
    assert e.se == pytest.approx(0.2 / 1.96)


# --- the rig side: guard and meter, against a stand-in nvidia-smi --------------------------------


@pytest.fixture
def rigside(tmp_path):
    """A sweep folder with the program and cap_check.py, a unit, and an nvidia-smi that logs
    its arguments and reports two cards' draw."""
    from rigbook.rigside import cap_check

    folder = tmp_path / "sweep"
    folder.mkdir()
    for source in (RIG_PROGRAM, Path(cap_check.__file__)):
        (folder / Path(source).name).write_text(Path(source).read_text())
    log = tmp_path / "smi.log"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\n"
                   'case "$*" in *compute-apps*) echo 4242; exit 0;; esac\n'
                   f"echo '{UUID0}, 123.45, 61, 97, 1695, 0x0000000000000004'\n"
                   f"echo '{UUID1}, 99.00, 58, [N/A], 1500, 0x0000000000000000'\n")
    smi.chmod(0o755)
    unit = tmp_path / "unit.service"
    unit.write_text(f"[Service]\nExecStart=-{smi} -i {UUID0} -pl 290\n"
                    f"ExecStart=-{smi} -i {UUID1} -pl 300.5\n")
    return folder, smi, log, unit


def start(folder: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(folder / "sweep_rig.py"), *args],
                            env={**os.environ, "PYTHONPATH": ""})


def lease(folder: Path, **body) -> None:
    (folder / "lease").write_text(json.dumps(body))


def shell(command: str) -> None:
    subprocess.run(["sh", "-c", command], check=True)


def test_the_guard_restores_the_units_caps_when_the_lease_lapses(rigside):
    folder, _, log, unit = rigside
    shell(lease_command(2, str(folder)))  # the sweep's own lease: 2 s from now, whole seconds
    guard = start(folder, "guard", "--unit", str(unit), "--dir", str(folder), "--poll", "0.1")
    time.sleep(0.5)
    assert guard.poll() is None and not log.exists()  # the lease holds: nothing restored yet
    assert guard.wait(timeout=10) == 0  # the operator "died": the deadline passed
    assert log.read_text().splitlines() == [f"-i {UUID0} -pl 290", f"-i {UUID1} -pl 300.5"]
    restored = json.loads((folder / "restored.json").read_text())
    assert restored["ok"] and restored["caps"] == {UUID0: 290.0, UUID1: 300.5}


def test_the_guard_restores_at_once_on_release_and_reports_a_failed_line(rigside, tmp_path):
    folder, smi, log, unit = rigside
    shell(lease_command(600, str(folder)))
    guard = start(folder, "guard", "--unit", str(unit), "--dir", str(folder), "--poll", "0.1")
    time.sleep(0.3)
    assert guard.poll() is None
    shell(lease_command(None, str(folder)))  # the sweep's release
    assert guard.wait(timeout=10) == 0 and len(log.read_text().splitlines()) == 2
    smi.write_text("#!/bin/sh\necho 'Insufficient Permissions for GPU 00000000:01:00.0:'\n"
                   "exit 4\n")
    (folder / "lease").unlink()  # no lease at all reads as released
    guard = start(folder, "guard", "--unit", str(unit), "--dir", str(folder))
    assert guard.wait(timeout=10) == 1
    restored = json.loads((folder / "restored.json").read_text())
    assert not restored["ok"] and "exited 4: Insufficient Permissions" in restored["errors"][0]


def test_the_meter_samples_each_card_until_stopped(rigside, tmp_path):
    folder, smi, _, _ = rigside
    lease(folder, deadline=time.time() + 600, release=False)
    meter = start(folder, "meter", "--dir", str(folder), "--name", "cap-290", "--interval",
                  "0.05", "--smi", str(smi), "--hwmon", str(tmp_path / "no-hwmon"))
    time.sleep(0.6)
    (folder / "cap-290.stop").touch()
    assert meter.wait(timeout=10) == 0 and (folder / "cap-290.done").exists()
    lines = [json.loads(line) for line in (folder / "cap-290.jsonl").read_text().splitlines()]
    assert lines[0] == {"source": "nvidia-smi", "interval": 0.05, "psu": None}
    assert len(lines) >= 4 and all(line[3] is None for line in lines[1:])  # no PSU: none read
    assert lines[1][1] == {
        UUID0: {"w": 123.45, "mj": None, "t": 61, "u": 97, "sm": 1695, "why": ["sw_power_cap"]},
        UUID1: {"w": 99.0, "mj": None, "t": 58, "u": None, "sm": 1500, "why": []}}
    assert lines[1][2] == [[4242, "(not visible here)"]]  # seen by the card, not in /proc
    assert all(line[2] is None for line in lines[2:4])  # processes: every 2 s, not every sample


# --- the sandbox's simulated draw ----------------------------------------------------------------


def test_the_simulated_draw_follows_the_documented_model(tmp_path):
    """Idle: the card's idle draw; busy (this process spinning on the CPU): up to min(cap, 1.05 x
    default). The stand-in sees the CPU use of every process but itself."""
    (tmp_path / "etc" / "rigbook-sim").mkdir(parents=True)
    (tmp_path / "run" / "rigbook-sim").mkdir(parents=True)
    card = {"index": 0, "uuid": UUID0, "name": "NVIDIA GeForce RTX 3090",
            "pci_bus_id": "00000000:01:00.0", "power_default_w": 350, "power_min_w": 100,
            "power_max_w": 400, "power_draw_w": 21.37}
    (tmp_path / "etc" / "rigbook-sim" / "gpus.json").write_text(json.dumps(
        {"driver_version": "580.95.05", "cuda_version": "13.0", "gpus": [card]}))
    (tmp_path / "run" / "rigbook-sim" / "state.json").write_text(json.dumps(
        {UUID0: {"power_limit_w": 250.0, "persistence_mode": True}}))
    env = {**os.environ, "RIGBOOK_SIM_ROOT": str(tmp_path)}

    def draw() -> float:
        out = subprocess.run([sys.executable, str(STANDIN_SMI), "--query-gpu=power.draw",
                              "--format=csv,noheader,nounits"], env=env, capture_output=True,
                             text=True, check=True).stdout
        return float(out)

    idle = draw()
    assert 21.37 <= idle <= 250.0
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        busy = max(draw() for _ in range(3))
    finally:
        spin.kill()
    assert busy > 150.0 and busy <= 250.0  # the cap binds: 250 W < 1.05 x 350 W


# --- a real H200 (tests/fixtures/nvidia-h200/power-sweep-dry.txt) ------------------------------


def test_the_h200_dry_run_refused_and_planned_as_the_code_says():
    """The card as that host's nvidia-smi listed it, through rigbook's parser and the sweep's
    checks: the refusal the capture shows is the one the code words, and 500-700 W passes."""
    from rigbook.rigside.gpus import Gpu, csv_header, number, parse_fields

    capture = (ROOT / "tests" / "fixtures" / "nvidia-h200" / "power-sweep-dry.txt").read_text()
    head, row = capture.splitlines()[:2]
    ((_, _, cells),) = parse_fields(csv_header(head), [row])
    watts = {key: float(number(cells[f"power.{key}"])) for key in ("limit", "min_limit",
                                                                    "max_limit")}
    gpu = Gpu(index=0, uuid=cells["uuid"], name=cells["name"], bus_id="(not asked)",
              power_limit_w=watts["limit"], min_limit_w=watts["min_limit"],
              max_limit_w=watts["max_limit"], persistence=True)
    assert (gpu.min_limit_w, gpu.max_limit_w, gpu.power_limit_w) == (200.0, 700.0, 700.0)
    unit = PowerUnit((f"ExecStart=-/usr/local/nvidia/bin/nvidia-smi -i {gpu.uuid} -pl 700",), None)
    h200 = {"platform": "ubuntu", "gpu_class": "other", "gpu_count": 1,
            "gpu_limits_watts": (100, 1000), "power_profile": "stock"}

    def said(sweep_watts) -> list[str]:
        rig = parse_rig("@local", {**h200, "sweep_watts": sweep_watts})
        facts = Facts(probe=GpuProbe(smi="nvidia-smi", gpus=(gpu,)), unit=unit)
        return [f.message("@local") for f in sweep_findings(rig, facts, "@local")]

    assert said("500:700:10") == []
    (refusal,) = [f for f in said("150,500,800") if "steps over" not in f]
    assert f"  - {refusal}\n" in capture
    assert "cap 700 W -> 500, 600, 700 W live, then back to nvidia-power-limit.service's cap" in (
        capture)
    assert capture.rstrip().endswith(f"{gpu.uuid}, 700.00 W")  # the live cap, untouched


def test_a_lease_is_not_renewed_once_the_guard_has_closed(tmp_path):
    """The guard writes `closed` before it restores: no lease (and so no cap) after that."""
    import json
    import subprocess

    from rigbook.roles.sweep import lease_command

    def run(seconds):
        return subprocess.run(["sh", "-c", lease_command(seconds, str(tmp_path))]).returncode

    assert run(30) == 0 and json.loads((tmp_path / "lease").read_text())["release"] is False
    (tmp_path / "closed").touch()
    assert run(30) != 0
    assert run(None) == 0 and json.loads((tmp_path / "lease").read_text()) == {"release": True}


def test_a_hung_or_missing_nvidia_smi_restores_the_rest_and_names_what_it_did_not(rigside):
    """Issue 29, finding 4: one GPU's -pl hangs. The guard gives it up after its timeout, sets
    the other GPU back, and always writes a record naming each GPU; a missing nvidia-smi too."""
    folder, smi, log, unit = rigside
    smi.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\n"
                   f"case \"$*\" in *{UUID0}*) exec sleep 600;; esac\n")
    began = time.monotonic()  # no lease at all reads as released
    guard = start(folder, "guard", "--unit", str(unit), "--dir", str(folder), "--smi-timeout", "1")
    assert guard.wait(timeout=20) == 1 and time.monotonic() - began < 10
    assert log.read_text().splitlines() == [f"-i {UUID0} -pl 290", f"-i {UUID1} -pl 300.5"]
    record = json.loads((folder / "restored.json").read_text())
    assert record["ok"] is False and record["complete"] is True
    assert record["restored"] == [UUID1] and list(record["not_restored"]) == [UUID0]
    assert "timed out after 1 s" in record["not_restored"][UUID0]

    unit.write_text(f"[Service]\nExecStart=-{folder}/no-such-smi -i {UUID0} -pl 290\n")
    guard = start(folder, "guard", "--unit", str(unit), "--dir", str(folder))
    assert guard.wait(timeout=20) == 1
    record = json.loads((folder / "restored.json").read_text())
    assert record["restored"] == [] and "no-such-smi" in record["not_restored"][UUID0]

    unit.unlink()  # no unit to read: nothing is named restored, the record says why
    guard = start(folder, "guard", "--unit", str(unit), "--dir", str(folder))
    assert guard.wait(timeout=20) == 1
    record = json.loads((folder / "restored.json").read_text())
    assert not record["ok"] and record["restored"] == [] and "cannot read" in record["errors"][0]


class Rig:
    """The rig as _Sweep.release sees it: the guard's record as `cat` shows it, a live cap per
    GPU that `-pl` sets, and the red lines logged."""

    name = print_prefix = "rig1"

    def __init__(self, record: str, live: dict[str, float]) -> None:
        self.record, self.caps, self.commands, self.logged = record, live, [], []

    def run_shell_command(self, command):
        from types import SimpleNamespace

        text = command.get_raw_value()
        self.commands.append(text)
        words = text.split()
        if "-pl" in words:
            self.caps[words[words.index("-i") + 1].strip("'")] = float(words[-1])
        said = self.record if "restored.json" in text and "seq" in text else ""
        return True, SimpleNamespace(stdout_lines=said.splitlines(), stderr_lines=[])

    def get_fact(self, _):
        return GpuProbe(smi=SMI, gpus=tuple(rtx3090(i, uuid, limit) for i, (uuid, limit)
                                            in enumerate(self.caps.items())))

    def log_styled(self, text, **_):
        self.logged.append(text)


def release(record: str) -> tuple[Rig, tuple[bool, str], str | None]:
    from rigbook.roles.sweep import _Sweep

    unit = {UUID0: 290.0, UUID1: 300.0}
    try:  # what the guard says it restored is at the unit's cap, the rest at the swept 250 W
        done = json.loads(record).get("restored", [])
    except ValueError:
        done = []
    rig = Rig(record, {uuid: watts if uuid in done else 250.0 for uuid, watts in unit.items()})
    sweep = object.__new__(_Sweep)
    sweep.host, sweep.smi, sweep.gpus, sweep.armed, sweep.undone = rig, SMI, DUAL, True, None
    sweep.unit = unit
    return rig, sweep.release(), sweep.undone


@pytest.mark.parametrize(("record", "left", "why"), [
    ("", [UUID0, UUID1], "no restore record"),  # the guard died: no record at all
    ("{not json", [UUID0, UUID1], "no restore record"),
    (json.dumps({"restored": [UUID1], "not_restored": {UUID0: "timed out after 20 s"},
                 "complete": True, "ok": False}), [UUID0], "timed out after 20 s"),
    (json.dumps({"restored": [UUID1], "not_restored": {}, "complete": True}), [UUID0],
     "not in its record"),
    (json.dumps({"restored": [UUID0, UUID1], "complete": False}), [UUID0, UUID1], "incomplete"),
])
def test_a_missing_or_incomplete_restore_is_done_from_the_operator_and_fails(record, left, why):
    """Issue 29, finding 4: the operator's side sets the caps the guard left, and says so."""
    rig, (restored, detail), undone = release(record)
    set_here = [c for c in rig.commands if "-pl" in c.split()]
    assert [c.split()[c.split().index("-i") + 1] for c in set_here] == left
    assert all(c.startswith("timeout -k 5 20 ") for c in set_here)  # a hung call is given up
    assert undone is not None and why in undone and all(u in undone for u in left)
    assert f"rig1: {undone}; setting nvidia-power-limit.service's caps from here" in rig.logged
    assert restored, detail  # read back from the rig: the unit's caps, set from here
    assert rig.caps == {UUID0: 290.0, UUID1: 300.0}


def test_a_complete_restore_sets_nothing_from_the_operator():
    record = json.dumps({"restored": [UUID0, UUID1], "not_restored": {}, "complete": True,
                         "ok": True})
    rig, (restored, _), undone = release(record)
    assert undone is None and not rig.logged
    assert not [c for c in rig.commands if "-pl" in c.split()]
    assert restored and rig.caps == {UUID0: 290.0, UUID1: 300.0}


def test_the_guard_is_started_as_a_unit_of_its_own_not_in_the_ssh_login():
    """Issue 29, finding 7: `setsid -f` left the guard in the login's session scope, which
    logind stops (killing the guard) when the login ends where KillUserProcesses=yes."""
    from rigbook.roles.sweep import GUARD_UNIT, guard_command

    command = guard_command().get_raw_value()
    assert "setsid" not in command
    assert command.startswith(f"cd /run/rigbook-sweep && systemd-run --unit={GUARD_UNIT} "
                              "--collect --quiet /usr/bin/python3 -I /run/rigbook-sweep/"
                              "sweep_rig.py guard --unit /etc/systemd/system/nvidia-power-limit"
                              ".service --dir /run/rigbook-sweep --smi-timeout 20 ")
    assert "[ -s guard.pid ] && exit 0" in command  # the sweep goes on only once it runs


def test_the_sweep_copies_its_programs_through_managed_in_the_rigs_one_read():
    """The guard and meter reach /run/rigbook-sweep by rigbook.core.managed's writes: one read of
    every file state (FileStates), only what differs written, and the run started after them."""
    from rigbook.roles import sweep
    from tests.opkit import describe, file_states, run_op

    folder = sweep.SWEEP_DIR
    facts = {"NvidiaGpus": None, "FileStates": file_states(
        {f"{folder}/cap_check.py": Path(sweep.cap_check.__file__).read_text()}, dirs={})}
    commands, fake = run_op(sweep.sweep_caps, facts, rig=None, target=None, settings=None,
                            executing=True)
    assert [describe(c) for c in commands] == [
        f"mkdir -p {folder}", f"chmod 700 {folder}", f"upload {folder}/sweep_rig.py",
        f"chmod 644 {folder}/sweep_rig.py", "call _run"]
    assert [name for name, _ in fake.asked] == ["NvidiaGpus", "FileStates"]
