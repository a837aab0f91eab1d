"""The power sweep without a rig: the caps it accepts, what it refuses, the draw arithmetic, the
chart, the rig-side guard's restore and meter (run here against a stand-in nvidia-smi), the
sandbox's draw model, and `rigbook bench sweep` on stored results."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import zlib
from datetime import UTC, datetime
from pathlib import Path

import pytest

from rigbook import cli
from rigbook.chart import PALETTE, Panel, Series, line_chart
from rigbook.checks import Facts
from rigbook.errors import RigbookError
from rigbook.gpus import GpuProbe
from rigbook.power import PowerUnit
from rigbook.spec import parse_rig
from rigbook.sweep import (
    MAX_CAPS,
    NO_UNIT_HERE,
    RIG_PROGRAM,
    Power,
    SweepPoint,
    SweepRun,
    WorkloadResult,
    apply_command,
    lease_command,
    load_sweeps,
    parse_watts,
    power_of,
    save_sweep,
    suggestions,
    sweep_findings,
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


def test_caps_inside_every_range_pass():
    assert findings("250:350:50") == []


def test_caps_outside_a_card_range_are_refused_all_at_once():
    found = findings("50,250,450")
    assert found == [
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
    assert "no caps to sweep" in findings(None)[0]
    wsl = findings("300", platform="wsl2", gpu_count=1)
    assert wsl and "WSL2: the Windows driver owns the caps" in wsl[0]


# --- the draw ------------------------------------------------------------------------------------


def test_power_of_a_window_mean_p95_and_energy():
    samples = [[t, {UUID0: [100.0 + t, None], UUID1: [100.0, None]}] for t in range(0, 21)]
    power = power_of(samples, 5.0, 15.0)  # samples 5..15: totals 205..215
    assert (power.samples, power.mean_w, power.p95_w) == (11, 210.0, 215.0)
    assert (power.energy_j, power.energy_source) == (2100.0, "mean-draw")
    counted = [[t, {UUID0: [300.0, 1000.0 * 300 * t]}] for t in range(0, 11)]
    by_counter = power_of(counted, 2.0, 8.0)
    assert by_counter.energy_source == "counter" and by_counter.energy_j == pytest.approx(1800)


def test_a_workload_shorter_than_a_sample_takes_the_nearest_one():
    samples = [[0.0, {UUID0: [50.0, None]}], [1.0, {UUID0: [250.0, None]}]]
    assert power_of(samples, 0.9, 0.95).mean_w == 250.0
    with pytest.raises(ValueError, match="no sample"):
        power_of([[0.0, {"error": "nvidia-smi failed"}]], 0, 1)


# --- results, suggestions, the chart -------------------------------------------------------------


def result(workload, tps, mean_w, tokens=100) -> WorkloadResult:
    return WorkloadResult(workload=workload, concurrency=1, tokens=tokens, tps=tps,
                          power=Power(samples=5, seconds=1, mean_w=mean_w, p95_w=mean_w + 5,
                                      energy_j=mean_w, energy_source="mean-draw"))


def sample_run(**more) -> SweepRun:
    points = tuple(
        SweepPoint(cap_w=cap, live_caps_w={UUID0: cap}, meter="nvidia-smi", workloads=(
            result("decode x1", tps, cap), result("prefill", 1000 + cap, cap)))
        for cap, tps in ((250, 30.0), (290, 36.0), (330, 38.0))
    )
    return SweepRun(**{
        "rig": "rig1", "recipe": "tiny-cpu-a", "engine": "llama.cpp", "url": "http://x:8100",
        "driver": "580.95.05", "caps_asked_w": (250, 290, 330),
        "started": datetime(2026, 12, 1, 12, 0, tzinfo=UTC), "seconds": 9.0, "points": points,
        "unit_caps_w": {UUID0: 290.0}, "restored": True, "restore_detail": "as the unit says",
        **more})


def test_suggestions_are_the_most_tokens_per_watt_and_the_command_applies_one():
    run = sample_run()
    assert suggestions(run) == {"decode x1": 290.0, "prefill": 250.0}
    assert run.points[0].workloads[0].j_per_token == 2.5
    assert apply_command("rig1", 290.0) == (
        "pyinfra INVENTORY deploys/power_cap.py --limit rig1 --data power_cap_watts=290")


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, body) of each chunk, every CRC checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks.append((kind, body))
        at += 12 + length
    return chunks


def test_the_line_chart_is_a_valid_png():
    data = line_chart("rig1", [250, 290, 330], [
        Panel("tok/s", (Series("decode x1", PALETTE[0], (30, None, 38)),)),
        Panel("tok/s per w", (Series("decode x1", PALETTE[0], (0.12, 0.1, 0.11)),))])
    chunks = png_chunks(data)
    assert [kind for kind, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, colour = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (depth, colour) == (8, 2)
    raw = zlib.decompress(chunks[1][1])
    assert len(raw) == height * (1 + 3 * width)
    assert set(raw[:: 1 + 3 * width]) == {0}  # every row: filter 0
    assert any(raw[i:i + 3] == bytes(PALETTE[0]) for i in range(0, len(raw) - 3))
    with pytest.raises(ValueError):
        line_chart("empty", [], [])


def test_stored_sweeps_and_the_bench_sweep_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RIGBOOK_VERIFY_DIR", str(tmp_path))
    path = save_sweep(sample_run())
    assert path == tmp_path / "rig1" / "tiny-cpu-a" / "sweeps" / "20261201T120000.000000Z.json"
    assert path.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert [run.rig for _, run in load_sweeps()] == ["rig1"]
    assert cli.main(["bench", "sweep", "--png-dir", str(tmp_path / "charts")]) == 0
    out = capsys.readouterr().out
    assert "<- suggested" in out and "decode x1" in out
    assert ("suggested cap for decode x1: 290 W; to apply it: pyinfra INVENTORY "
            "deploys/power_cap.py --limit rig1 --data power_cap_watts=290") in out
    png_chunks((tmp_path / "charts" / "20261201T120000.000000Z.png").read_bytes())
    assert cli.main(["bench", "sweep", "--rig", "nope"]) == 3
    path.write_text("{}")
    assert cli.main(["bench", "sweep"]) == 3
    assert "not a sweep result" in capsys.readouterr().err


# --- the rig side: guard and meter, against a stand-in nvidia-smi --------------------------------


@pytest.fixture
def rigside(tmp_path):
    """A sweep folder with the program and cap_check.py, a unit, and an nvidia-smi that logs
    its arguments and reports two cards' draw."""
    from rigbook import cap_check

    folder = tmp_path / "sweep"
    folder.mkdir()
    for source in (RIG_PROGRAM, Path(cap_check.__file__)):
        (folder / Path(source).name).write_text(Path(source).read_text())
    log = tmp_path / "smi.log"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\n"
                   f"echo '{UUID0}, 123.45'\necho '{UUID1}, 99.00'\n")
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


def test_the_meter_samples_each_card_until_stopped(rigside):
    folder, smi, _, _ = rigside
    lease(folder, deadline=time.time() + 600, release=False)
    meter = start(folder, "meter", "--dir", str(folder), "--name", "cap-290", "--interval",
                  "0.05", "--smi", str(smi))
    time.sleep(0.6)
    (folder / "cap-290.stop").touch()
    assert meter.wait(timeout=10) == 0
    metered = json.loads((folder / "cap-290.json").read_text())
    assert metered["source"] == "nvidia-smi" and len(metered["samples"]) >= 3
    assert metered["samples"][0][1] == {UUID0: [123.45, None], UUID1: [99.0, None]}


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
    from rigbook.gpus import Gpu, csv_header, number, parse_fields

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

    assert said("500:700:100") == []
    (refusal,) = said("150,500,800")
    assert f"  - {refusal}\n" in capture
    assert "cap 700 W -> 500, 600, 700 W live, then back to nvidia-power-limit.service's cap" in (
        capture)
    assert capture.rstrip().endswith(f"{gpu.uuid}, 700.00 W")  # the live cap, untouched


def test_a_lease_is_not_renewed_once_the_guard_has_closed(tmp_path):
    """The guard writes `closed` before it restores: no lease (and so no cap) after that."""
    import json
    import subprocess

    from rigbook.sweep import lease_command

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
    from rigbook.sweep import _Sweep

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
    from rigbook.sweep import GUARD_UNIT, guard_command

    command = guard_command().get_raw_value()
    assert "setsid" not in command
    assert command.startswith(f"cd /run/rigbook-sweep && systemd-run --unit={GUARD_UNIT} "
                              "--collect --quiet /usr/bin/python3 -I /run/rigbook-sweep/"
                              "sweep_rig.py guard --unit /etc/systemd/system/nvidia-power-limit"
                              ".service --dir /run/rigbook-sweep --smi-timeout 20 ")
    assert "[ -s guard.pid ] && exit 0" in command  # the sweep goes on only once it runs
