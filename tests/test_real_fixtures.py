"""The corpus of real outputs (tests/fixtures/real/): every file has its source and a reading.

Each file is output that someone published (a bug report, a forum post), copied verbatim;
SOURCES.md gives its URL, driver and GPU, and expected.json the reading a person wrote from
it. The parsers' own tests read these files against those readings (issue: GPU faults and
command output as the field prints them); this test keeps the corpus honest as it grows.
"""

from __future__ import annotations

import json
import re

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
