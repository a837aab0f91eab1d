"""rigbook.roles.health: the health query read from a real H200
(tests/fixtures/nvidia-h200/health.csv), and the findings each fault gives, on that same row with
one value changed at a time; the NVML probe's answer and nvidia-smi's, captured one after the other
on another H200, read the same; the fact's shell takes NVML when the tools venv answers and
nvidia-smi otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api.exceptions import FactProcessError

from rigbook.core.checks import Facts
from rigbook.core.facts import _NO_SMI, _RC, _SMI
from rigbook.core.spec import Rig
from rigbook.core.tools import TOOLS_PYTHON
from rigbook.roles.health import (
    HEALTH_FIELDS,
    GpuHealthReadings,
    health_findings,
    health_from_probe,
    parse_health,
)
from tests.conftest import ROOT

H200 = ROOT / "tests" / "fixtures" / "nvidia-h200"
CAPTURE = (H200 / "health.csv").read_text()
PROBE = json.loads((H200 / "nvml-health.json").read_text())
SAME_MOMENT = (H200 / "health-same-moment.csv").read_text()
HEADER, ROW = CAPTURE.splitlines()
UUID = "GPU-fe498097-b8b0-08f8-71e6-602f1062937d"
RIG = Rig(platform="ubuntu", gpu_class="other", gpu_count=1, gpu_limits_watts=(200, 700),
          power_profile="stock")


def smi_output(*lines: str, status: int = 0) -> list[str]:
    """What the fact's command prints: one nvidia-smi attempt, then its exit status."""
    return [f"{_SMI} /usr/bin/nvidia-smi", *lines, "", f"{_RC} {status}"]


def changed(**values: str) -> str:
    """The H200 row with some fields changed (names with '_' for '.')."""
    cells = ROW.split(", ")
    for name, value in values.items():
        cells[HEALTH_FIELDS.index(name.replace("__", "."))] = value
    return ", ".join(cells)


def findings(row: str, header: str = HEADER) -> list[tuple[str, str]]:
    facts = Facts(health=parse_health([header, row]))
    return [(f.level, f.reason) for f in health_findings(RIG, facts, "rig")]


def test_the_h200_capture_reads_as_one_healthy_gpu():
    [gpu] = GpuHealthReadings().process(smi_output(HEADER, ROW))
    assert (gpu.index, gpu.uuid) == (0, UUID)
    assert gpu.number("temperature.gpu") == 44 and gpu.number("temperature.gpu.tlimit") == 43
    assert gpu.values["retired_pages.pending"] is None  # [N/A]: the H200 remaps rows instead
    assert gpu.number("utilization.gpu") == 0  # its header says `utilization.gpu [%]`
    assert findings(ROW) == []


@pytest.mark.parametrize("values, expected", [
    ({"ecc__errors__uncorrected__volatile__total": "2"},
     [("drift", "GPU 0: 2 uncorrected ECC error(s) since the driver loaded")]),
    ({"ecc__errors__uncorrected__aggregate__total": "1"},
     [("warn", "GPU 0: 1 uncorrected ECC error(s) over its life")]),
    ({"remapped_rows__failure": "Yes"}, [("drift", "GPU 0: a row remapping failed")]),
    ({"remapped_rows__pending": "Yes"}, [("warn", "GPU 0: memory repair pending")]),
    ({"clocks_event_reasons__hw_thermal_slowdown": "Active",
      "clocks_event_reasons__hw_slowdown": "Active"},
     [("warn", "GPU 0: HW thermal slowdown active now")]),
    ({"temperature__gpu": "83", "temperature__gpu__tlimit": "4"},
     [("warn", "GPU 0: 4 °C below its T.Limit (83 °C now)")]),
    ({"pcie__link__gen__current": "3", "utilization__gpu": "97"},
     [("warn", "GPU 0: PCIe link gen 3 of 5 while 97% busy")]),
    # An idle card drops its link to save power: no finding (nvidia-smi -q shows the same).
    ({"pcie__link__gen__current": "1", "pcie__link__width__current": "8"}, []),
    ({"temperature__gpu": "[N/A]", "temperature__gpu__tlimit": "[N/A]"}, []),
])
def test_each_fault_is_one_finding_saying_what_to_do(values, expected):
    found = findings(changed(**values))
    assert len(found) == len(expected), found
    assert [(level, reason[:len(want)]) for (level, reason), (_, want) in
            zip(found, expected, strict=True)] == expected, found


def powered(draw: str, cap: str, temperature: str, busy: str = "97", sw_cap: str = "Not Active"):
    """The H200 row with power.draw and enforced.power.limit added, and the throttle inputs."""
    row = changed(temperature__gpu=temperature, utilization__gpu=busy,
                  clocks_event_reasons__sw_power_cap=sw_cap)
    return findings(f"{row}, {draw}, {cap}", header=f"{HEADER}, power.draw [W], "
                                                    "enforced.power.limit [W]")


def test_a_draw_plateau_below_the_cap_at_78_c_is_the_notes_thermal_throttle():
    """The hardware notes' table: draw 5-15% below the cap ("547W actual at 600W cap on a 5090")
    with the GPU at >= 78 °C is "Thermal throttle kicking in. Software cap not the limit;
    cooling is"; the same plateau at the notes' 66 °C is the memory-bandwidth row, no finding."""
    [(level, reason)] = powered("547.00", "600.00", "80")
    assert level == "warn" and reason.startswith("GPU 0: draws 547 W, 9% below its 600 W cap, at "
                                                 "80 °C while 97% busy")
    assert "cooling is" in reason and "no cap change fixes" in reason
    assert powered("547.00", "600.00", "66") == []  # the notes' 5090 peak: not thermal
    assert powered("334.00", "370.00", "76") == []  # the notes' 3090 plateau peaked at 76 °C
    assert powered("547.00", "600.00", "80", busy="10") == []  # idle: no plateau to read


def test_a_card_held_at_its_cap_is_not_the_thermal_row():
    """The runbook's GB202 "simultaneously power- and thermally-capped (598.76 W, 91 C,
    clocks_event_reasons.sw_power_cap = Active)": the software cap is the limit there, so the
    notes' "cap not the limit" row does not fire; neither does a draw outside 5-15% below."""
    assert powered("598.76", "600.00", "91", sw_cap="Active") == []
    assert powered("598.76", "600.00", "91") == []  # 0.2% below: at the cap
    assert powered("450.00", "600.00", "91") == []  # 25% below: not a plateau under the cap
    [(_, reason)] = powered("510.00", "600.00", "78")  # exactly 15% below, exactly 78 °C
    assert "15% below its 600 W cap" in reason


def test_a_failed_query_is_a_fact_error_and_status_says_health_was_not_read():
    refused = smi_output('Field "temperature.gpu.tlimit" is not a valid field to query.',
                         status=2)
    with pytest.raises(FactProcessError, match="not a valid field"):
        GpuHealthReadings().process(refused)
    assert GpuHealthReadings().process([_NO_SMI]) is None
    facts = Facts(unread={"health": "not a valid field"})
    assert [(f.level, f.reason) for f in health_findings(RIG, facts, "rig")] == [
        ("warn", "GPU health not read: not a valid field")]


def test_rows_that_do_not_match_the_header_are_a_fact_error():
    with pytest.raises(FactProcessError):
        GpuHealthReadings().process(smi_output(HEADER, ROW.rsplit(", ", 1)[0]))
    with pytest.raises(FactProcessError, match="no header"):
        GpuHealthReadings().process(smi_output(ROW))


def readings(health, fields=HEALTH_FIELDS[2:18]) -> list[tuple[int, str, dict]]:
    """The fields the same-moment capture has (it predates power.draw in the query)."""
    return [(gpu.index, gpu.uuid, {field: gpu.values.get(field) for field in fields})
            for gpu in health]


def test_nvml_and_nvidia_smi_read_the_same_h200_the_same():
    from_nvml = readings(health_from_probe(PROBE))
    assert from_nvml == readings(parse_health(SAME_MOMENT.splitlines()))
    [gpu] = health_from_probe(PROBE)  # the capture's power_usage_mw / enforced_mw, in watts
    assert (gpu.watts("power.draw"), gpu.watts("enforced.power.limit")) == (79.0, 700.0)
    [(_, _, values)] = from_nvml
    assert values["temperature.gpu.tlimit"] == "51"  # NVML's margin is nvidia-smi's T.Limit
    assert values["remapped_rows.failure"] == "No" and values["retired_pages.pending"] is None


@pytest.mark.parametrize("events, active", [
    (0x01, []),  # GPU idle only, as the H200 reported
    (0x04, ["clocks_event_reasons.sw_power_cap"]),
    (0x80, ["clocks_event_reasons.hw_slowdown"]),  # HW power brake
    (0x48, ["clocks_event_reasons.hw_slowdown", "clocks_event_reasons.hw_thermal_slowdown"]),
    (0x20, ["clocks_event_reasons.sw_thermal_slowdown"]),
])
def test_nvml_clock_event_bits_are_the_reasons_nvidia_smi_names(events, active):
    probe = json.loads(json.dumps(PROBE))
    probe["gpus"][0]["events"] = events
    [gpu] = health_from_probe(probe)
    assert sorted(field for field in HEALTH_FIELDS if gpu.active(field)) == active


def fact_output(tmp_path: Path, python: str) -> list[str]:
    """The fact's own shell, with the tools venv's python swapped for `python` and a stand-in
    nvidia-smi on PATH that prints the H200's health query."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {H200 / 'health-same-moment.csv'}\n")
    smi.chmod(0o755)
    command = GpuHealthReadings().command().replace(TOOLS_PYTHON, python)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env,
                          check=True)
    return done.stdout.splitlines()


def test_the_fact_takes_nvml_from_the_tools_venv_and_nvidia_smi_without_it(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat {H200 / 'nvml-health.json'}\n")
    fake.chmod(0o755)
    with_nvml = fact_output(tmp_path, str(fake))
    assert with_nvml[0] == "##RIGBOOK_NVML##"
    without = fact_output(tmp_path, str(tmp_path / "no-such-python"))
    assert without[0].startswith("##RIGBOOK_SMI##")
    assert readings(GpuHealthReadings().process(with_nvml)) == readings(
        GpuHealthReadings().process(without))


def test_the_real_probe_answers_or_nvidia_smi_does(tmp_path):
    """The real probe run by this python (nvidia-ml-py installed): without a driver here it
    exits 3 and the stand-in nvidia-smi answers; with one, NVML answers."""
    probe_py = ROOT / "rigbook" / "rigside" / "gpus.py"
    probe = subprocess.run([sys.executable, str(probe_py), "--probe"],
                           capture_output=True, text=True)
    out = fact_output(tmp_path, sys.executable)
    if probe.returncode == 0:
        assert out[0] == "##RIGBOOK_NVML##", out[:3]
    else:
        assert probe.returncode == 3 and '"error"' in probe.stdout
        assert out[0].startswith("##RIGBOOK_SMI##"), out[:3]
        [gpu] = GpuHealthReadings().process(out)
        assert gpu.uuid == PROBE["gpus"][0]["uuid"]
