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

from rigbook.rigside.gpus import csv_header, pl_range, smi_failure
from rigbook.rigside.xid import (
    GONE_ACTIONS,
    parse_boot,
    parse_cards,
    parse_mismatches,
    parse_module,
    parse_xid_lines,
    split_prefix,
)
from rigbook.roles.venvs import parse_smi_header
from rigbook.roles.wsl import WslSignals, platform_problem
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


KLOG = readings("klog/")


@pytest.mark.parametrize("name, want", KLOG, ids=[n for n, _ in KLOG])
def test_the_kernels_api_mismatch_in_every_wording_and_format(name, want):
    """The user-space and module versions, the client the newer wording names, and the time."""
    found = parse_mismatches((REAL / name).read_text().splitlines())
    assert [vars(m) for m in found] == want.get("mismatches", [])


@pytest.mark.parametrize("name, want", KLOG, ids=[n for n, _ in KLOG])
def test_the_loaded_modules_flavour_from_its_loading_line(name, want):
    modules = [parse_module(line) for line in (REAL / name).read_text().splitlines()]
    loaded = [{"flavour": m.flavour, "version": m.version} for m in modules if m]
    assert loaded == ([want["loaded"]] if want.get("loaded") else [])


CARDS = [(n, w) for n, w in KLOG if "cards" in w]


@pytest.mark.parametrize("name, want", CARDS, ids=[n for n, _ in CARDS])
def test_the_cards_a_log_names_with_uuid_and_serial(name, want):
    """"GPU at PCI:<pci>: GPU-<uuid>" and the serial line after it; consumer cards print 0."""
    cards = parse_cards((REAL / name).read_text().splitlines())
    assert [vars(card) for card in cards.values()] == want["cards"]


BOOTS = readings("boots/")


@pytest.mark.parametrize("name, want", BOOTS, ids=[n for n, _ in BOOTS])
def test_the_boots_the_journal_keeps_in_both_layouts(name, want):
    """`journalctl --list-boots` before systemd 252 (em dash) and after (header, columns)."""
    boots = [parse_boot(line) for line in (REAL / name).read_text().splitlines()]
    assert [vars(boot) for boot in boots if boot] == want["boots"]
    assert all(boot or line.startswith("IDX ") for boot, line in zip(
        boots, (REAL / name).read_text().splitlines(), strict=True))


MESSAGES = [(n, w) for n, w in KLOG if "messages" in w]


@pytest.mark.parametrize("name, want", MESSAGES, ids=[n for n, _ in MESSAGES])
def test_every_prefix_gives_the_message_that_follows_it(name, want):
    """dmesg's stacked --time-format stamps, --raw levels, localised journal months."""
    lines = (REAL / name).read_text().splitlines()
    assert [split_prefix(line)[1] for line in lines] == want["messages"]


PROC = readings("proc-version/")


@pytest.mark.parametrize("name, want", PROC, ids=[n for n, _ in PROC])
def test_proc_driver_version_gives_the_flavour_that_runs(name, want):
    first = (REAL / name).read_text().splitlines()[0]
    assert vars(parse_module(first)) == want


@pytest.mark.parametrize("name, want", readings("smi-table/"),
                         ids=[n for n, _ in readings("smi-table/")])
def test_plain_tables_old_and_new_layouts_give_driver_and_cuda(name, want):
    """parse_smi_header: the venv role's runtime-vs-driver check reads these two versions."""
    assert parse_smi_header((REAL / name).read_text()) == (want["driver"], want["cuda"])


@pytest.mark.parametrize("name, want", readings("smi-csv/"),
                         ids=[n for n, _ in readings("smi-csv/")])
def test_csv_headers_are_told_from_data_rows(name, want):
    first = (REAL / name).read_text().splitlines()[0]
    assert csv_header(first) == (want["fields"] if want["header"] else None)


@pytest.mark.parametrize("name, want", readings("wsl/"), ids=[n for n, _ in readings("wsl/")])
def test_wsl1_is_told_from_wsl2_by_its_kernel(name, want):
    text = (REAL / name).read_text().split()
    # uname -r: the release; uname -a: its third word; /proc/version: the third as well
    release = text[0] if len(text) == 1 else text[2]
    assert release == want["kernel"]
    signals = WslSignals(release, interop=False, run_wsl=False)
    if release == "3.4.0+":  # 2016's WSL1 said nothing of Microsoft: only WSL's files tell
        assert signals.version is None
        return
    assert signals.version == want["wsl"]
    assert signals.detected == (want["wsl"] == 2)
    problem = platform_problem("wsl2", signals)
    assert (problem is None) == (want["wsl"] == 2)
    if want["wsl"] == 1:
        assert problem.startswith(f"this host is WSL1 (kernel {release}), which has no GPU")


@pytest.mark.parametrize("name, want", readings("smi-errors/") + readings("pl/"),
                         ids=[n for n, _ in readings("smi-errors/") + readings("pl/")])
def test_nvidia_smi_failures_are_named_in_words(name, want):
    """smi_failure: what the power role and status say when nvidia-smi cannot answer."""
    text = (REAL / name).read_text()
    kind = None if want.get("ok") else want["kind"]
    assert smi_failure(text) == kind
    if want.get("min_w") is not None:
        assert pl_range(text) == (want["min_w"], want["max_w"])
