"""Whole-system power in the power sweep: the meter reads a Corsair PSU's telemetry (the kernel's
corsair-psu driver, a hwmon folder named corsairpsu) beside the cards, each window records its
DC draw, and the report says what was read, with the AC note, or that none was found.

The driver's outputs are real published ones (tests/fixtures/hwmon/SOURCES.md): each is laid
out as the driver's sysfs folder (power1_input in uW) and read by the meter's own code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rigbook.roles.sweep import report_lines
from rigbook.roles.sweepresult import AC_NOTE, Sample, evidence, psu_line, samples_of
from tests.test_power import UUID0
from tests.test_sweep import STANDIN_SMI, reading, rigside, sample_run, start  # noqa: F401

FIXTURES = Path(__file__).parent / "fixtures" / "hwmon"


def published(fixture: str) -> tuple[str, str, float]:
    """(driver name, label, W) of the PSU's total power in a published output: libsensors' JSON
    (the stored text stops after the `curr +5v` entry: its braces closed here) or `sensors`."""
    text = (FIXTURES / fixture).read_text()
    if fixture.endswith("-sensors-j.txt"):
        ((chip, entries),) = json.loads("{" + text.rstrip().rstrip(",") + "}}").items()
        label = next(label for label, entry in entries.items()
                     if isinstance(entry, dict) and "power1_input" in entry)
        return chip.split("-")[0], label, entries[label]["power1_input"]
    lines = text.splitlines()
    label, _, value = next(line for line in lines if line.startswith("power total")).partition(":")
    return lines[0].split("-")[0], label, float(value.split()[0])


def lay_out(root: Path, fixture: str) -> tuple[Path, float]:
    """The driver's folder for a published output, beside hwmon folders of other drivers (one
    with a power1_input of its own: a GPU's, not the PSU's)."""
    name, label, watts = published(fixture)
    for entry, other, power in (("hwmon0", "coretemp", None), ("hwmon1", "amdgpu", 22000000)):
        (root / entry).mkdir(parents=True)
        (root / entry / "name").write_text(other + "\n")
        if power:
            (root / entry / "power1_input").write_text(f"{power}\n")
    folder = root / "hwmon3"
    folder.mkdir()
    (folder / "name").write_text(name + "\n")
    (folder / "power1_label").write_text(label + "\n")
    (folder / "power1_input").write_text(f"{round(watts * 1e6)}\n")
    return folder, watts


@pytest.fixture
def rig_program(rigside):  # noqa: F811  (the fixture of tests/test_sweep.py)
    """files/power/sweep_rig.py as the rig runs it, from the sweep folder beside cap_check.py."""
    folder = rigside[0]
    spec = importlib.util.spec_from_file_location("sweep_rig_copy", folder / "sweep_rig.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(folder))


@pytest.mark.parametrize(("fixture", "watts"), [
    ("freon-283-sensors-j.txt", 174.0),
    ("corsair-psu-12-hx1500i-sensors.txt", 214.0),
    ("corsair-psu-pr2-sensors.txt", 216.0),
])
def test_the_published_corsair_psu_outputs_read_as_the_psus_dc_watts(rig_program, tmp_path,
                                                                     fixture, watts):
    assert published(fixture)[:2] == ("corsairpsu", "power total")  # power1 is the total
    folder, said = lay_out(tmp_path / "hwmon", fixture)
    assert said == watts
    assert rig_program.find_psu(str(tmp_path / "hwmon")) == str(folder)
    assert rig_program.psu_watts(str(folder)) == watts


def test_no_psu_and_a_failed_read_are_none(rig_program, tmp_path):
    assert rig_program.find_psu(str(tmp_path / "missing")) is None
    (tmp_path / "hwmon" / "hwmon0").mkdir(parents=True)
    (tmp_path / "hwmon" / "hwmon0" / "name").write_text("nvme\n")
    assert rig_program.find_psu(str(tmp_path / "hwmon")) is None
    folder, _ = lay_out(tmp_path / "psu", "corsair-psu-pr2-sensors.txt")
    (folder / "power1_input").write_text("")  # what a read the PSU did not answer leaves
    assert rig_program.psu_watts(str(folder)) is None


def test_the_meter_records_the_psu_beside_every_sample(rigside, tmp_path):  # noqa: F811
    folder, smi, _, _ = rigside
    psu, _ = lay_out(tmp_path / "hwmon", "corsair-psu-12-hx1500i-sensors.txt")
    (folder / "lease").write_text(json.dumps({"deadline": time.time() + 600, "release": False}))
    for name, hwmon, want in (("with", tmp_path / "hwmon", 214.0),
                              ("without", tmp_path / "none", None)):
        meter = start(folder, "meter", "--dir", str(folder), "--name", name, "--interval", "0.05",
                      "--smi", str(smi), "--hwmon", str(hwmon))
        time.sleep(0.4)
        (folder / f"{name}.stop").touch()
        assert meter.wait(timeout=10) == 0
        lines = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
        assert lines[0]["psu"] == (str(psu) if want else None) and len(lines) >= 3
        assert {line[3] for line in lines[1:]} == {want}
        assert all(s.psu_w == want for s in samples_of(lines))


def test_a_window_records_the_psus_mean_median_and_samples():
    samples = [Sample(t * 0.5, {UUID0: reading(200.0)}, None, 300.0 + t) for t in range(0, 21)]
    e = evidence(samples, 1.0, 3.0, cap_w=250)  # samples 2..6: 302..306 W
    assert (e.psu_mean_w, e.psu_median_w, e.psu_samples) == (304.0, 304.0, 5)
    none = evidence([Sample(0.0, {UUID0: reading(200.0)})], 0.0, 1.0, cap_w=250)
    assert (none.psu_mean_w, none.psu_median_w, none.psu_samples) == (None, None, 0)
    # a meter before the PSU read wrote three items a line
    assert samples_of([[0.5, {UUID0: reading(1.0)}, None]])[0].psu_w is None


def test_the_report_names_the_psu_with_the_ac_note_or_none_found():
    bare = sample_run()
    assert psu_line(bare) == ("whole-system power: none found (no corsairpsu hwmon on the rig, "
                              "the only PSU telemetry the meter reads)")
    assert psu_line(bare) in report_lines(bare)
    folder = "/sys/class/hwmon/hwmon3"
    points = tuple(p.model_copy(update={"psu": folder, "windows": tuple(
        win.model_copy(update={"evidence": win.evidence.model_copy(
            update={"psu_mean_w": 400.0 + p.cap_w, "psu_samples": 40})})
        for win in p.windows)}) for p in bare.points)
    said = psu_line(bare.model_copy(update={"points": points}))
    assert said == (f"whole-system power: corsairpsu ({folder}), windows' means 650.0-760.0 W, "
                    f"{AC_NOTE}")
    assert "AC draw at the wall is 8-12 % higher" in said


def test_the_sandbox_psu_stands_in_for_the_host_plus_the_cards(tmp_path):
    """sandbox/simulated: a rig whose profile has a PSU gets a corsairpsu folder, whose
    power1_input the stand-in nvidia-smi keeps at the host's draw plus the cards' (SIMULATED)."""
    from rigbook.sandbox import SIM_HWMON, _write_psu_files

    (tmp_path / "etc" / "rigbook-sim").mkdir(parents=True)
    (tmp_path / "run" / "rigbook-sim").mkdir(parents=True)
    _write_psu_files(tmp_path, {"host_w": 110})
    hwmon = tmp_path / SIM_HWMON.lstrip("/")
    card = {"index": 0, "uuid": UUID0, "name": "NVIDIA GeForce RTX 3090",
            "pci_bus_id": "00000000:01:00.0", "power_default_w": 350, "power_min_w": 100,
            "power_max_w": 400, "power_draw_w": 21.37}
    (tmp_path / "etc" / "rigbook-sim" / "gpus.json").write_text(json.dumps(
        {"driver_version": "580.95.05", "cuda_version": "13.0", "gpus": [card]}))
    env = {**os.environ, "RIGBOOK_SIM_ROOT": str(tmp_path)}
    assert (hwmon / "hwmon0" / "name").read_text() == "corsairpsu\n"
    assert (hwmon / "hwmon0" / "power1_input").read_text() == "110000000\n"  # before any query
    out = subprocess.run([sys.executable, str(STANDIN_SMI), "--query-gpu=uuid,power.draw",
                          "--format=csv,noheader,nounits"], env=env, capture_output=True,
                         text=True, check=True).stdout
    draw = float(out.split(",")[1])
    assert int((hwmon / "hwmon0" / "power1_input").read_text()) / 1e6 == pytest.approx(
        110 + draw, abs=0.01)
    # a query without the draw leaves it as it was
    (hwmon / "hwmon0" / "power1_input").write_text("1\n")
    subprocess.run([sys.executable, str(STANDIN_SMI), "--query-gpu=uuid",
                    "--format=csv,noheader"], env=env, capture_output=True, check=True)
    assert (hwmon / "hwmon0" / "power1_input").read_text() == "1\n"
