"""roles.health: the health query read from a real H200 (tests/fixtures/nvidia-h200/health.csv),
and the findings each fault gives, on that same row with one value changed at a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyinfra.api.exceptions import FactProcessError

from roles.checks import Facts
from roles.facts import _NO_SMI, _RC, _SMI
from roles.health import HEALTH_FIELDS, GpuHealthReadings, health_findings, parse_health
from roles.spec import Rig

CAPTURE = (Path(__file__).parent / "fixtures" / "nvidia-h200" / "health.csv").read_text()
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


def findings(row: str) -> list[tuple[str, str]]:
    facts = Facts(health=parse_health([HEADER, row]))
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
     [("warn", "GPU 0: 4 °C below its slowdown limit (83 °C)")]),
    ({"temperature__gpu": "80", "clocks_event_reasons__sw_power_cap": "Active"},
     [("warn", "GPU 0: held at its power cap at 80 °C")]),
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
