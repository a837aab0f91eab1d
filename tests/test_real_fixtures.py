"""The corpus of real outputs (tests/fixtures/real/): every file has its source and a reading.

Each file is output that someone published (a bug report, a forum post), copied verbatim;
SOURCES.md gives its URL, driver and GPU, and expected.json the reading a person wrote from
it. The parsers' own tests read these files against those readings (issue: GPU faults and
command output as the field prints them); this test keeps the corpus honest as it grows.
"""

from __future__ import annotations

import json
import re

import pytest

from roles.xid import GONE_ACTIONS, parse_xid_lines
from tests.conftest import ROOT

REAL = ROOT / "tests" / "fixtures" / "real"


def test_every_real_output_has_a_source_url_and_a_hand_written_reading():
    files = sorted(str(p.relative_to(REAL)) for p in REAL.rglob("*.txt"))
    rows = dict(re.findall(r"^\| `([^`]+)` \| (\S+) \|", (REAL / "SOURCES.md").read_text(), re.M))
    readings = json.loads((REAL / "expected.json").read_text())["files"]
    assert len(files) >= 60
    assert [f for f in files if not rows.get(f, "").startswith("https://")] == []
    assert [f for f in files if f not in readings] == []
    assert sorted(rows) == files and sorted(readings) == files  # nothing listed that is not here
    assert all((REAL / f).read_text().strip() for f in files)


def readings(category: str):
    data = json.loads((REAL / "expected.json").read_text())["files"]
    return [(name, want) for name, want in sorted(data.items()) if name.startswith(category)]


def _pci(address: str | None) -> str | None:
    return address.lower().split(".")[0] if address else None


@pytest.mark.parametrize("name, want", readings("klog/"), ids=[n for n, _ in readings("klog/")])
def test_kernel_logs_as_the_field_prints_them(name, want):
    faults = parse_xid_lines((REAL / name).read_text().splitlines())
    xids = [{"code": x.code, "pci": x.pci, "when": x.when} for x in faults if not x.fallen]
    assert xids == [{**x, "pci": _pci(x["pci"])} for x in want["xids"]]
    # a fallen-off-the-bus report right after an Xid 79 of the same GPU is that event again
    after_79 = {x["pci"] for x in want["xids"] if x["code"] == 79}
    fallen = [_pci(pci) for pci in want["fallen_off_bus"] if _pci(pci) not in after_79]
    assert [x.pci for x in faults if x.fallen] == fallen
    for fault in faults:  # every reset- or reboot-bound code takes the GPU out of service
        assert fault.gone == (fault.fallen or fault.action in GONE_ACTIONS or (
            fault.code == 154 and "to 0x0 " not in fault.message))
