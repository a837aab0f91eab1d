"""rigbook.roles.journal: a failed start's journal read for the signatures the sources name, on
published logs (tests/fixtures/real/SOURCES.md: journal/, their readings in expected.json)."""

from __future__ import annotations

import json

import pytest

from rigbook.core.spec import Rig
from rigbook.roles.journal import journal_hints
from tests.conftest import ROOT

REAL = ROOT / "tests" / "fixtures" / "real"
FILES = {name: want for name, want in json.loads(
    (REAL / "expected.json").read_text())["files"].items() if name.startswith("journal/")}
READINGS = {name: want["signature"] for name, want in FILES.items()
            if want["signature"] in ("tdr", "repack")}
ACCEPTANCE = {name: want["mean_acceptance_length"] for name, want in FILES.items()
              if want["signature"] == "acceptance"}
WSL2 = Rig(platform="wsl2", gpu_class="rtx3090", gpu_count=2)
TDR, REPACK = ("journal/tdr-signature-club3090-50.txt",
               "journal/repack-device-not-ready-club3090-hardware-md.txt")
LINUX = Rig(platform="ubuntu", gpu_class="rtx3090", gpu_count=2)


def journal(name: str) -> str:
    """The published lines as journalctl prints a unit's output (a prefix on every line)."""
    return "".join(f"Dec 03 06:00:00 rig python[812]: {line}\n"
                   for line in (REAL / name).read_text().splitlines())


@pytest.mark.parametrize("name", sorted(READINGS))
def test_each_published_log_reads_as_its_signature(name):
    (hint,) = journal_hints(journal(name), WSL2)
    said = {"tdr": "Windows reset the GPU mid-kernel (TDR",
            "repack": "the engine died at weight repack"}[READINGS[name]]
    assert hint.startswith(said)


def test_the_tdr_signature_is_recognised_on_wsl2():
    for name in sorted(n for n, kind in READINGS.items() if kind == "tdr"):
        (hint,) = journal_hints(journal(name), WSL2)
        assert hint.startswith("Windows reset the GPU mid-kernel (TDR"), name
        assert "this is not OOM" in hint and "TdrDelay 60 s" in hint
        assert "raise wsl_tdr_delay" in hint and "reboot Windows" in hint
    raised = WSL2.model_copy(update={"wsl_tdr_delay": 120})
    assert "TdrDelay 120 s" in journal_hints(journal(TDR), raised)[0]


def test_the_repack_crash_is_told_apart_from_tdr():
    """The notes: "A separate boot-time failure mode, distinct from TDR, surfaces with the same
    device not ready text" at gptq_marlin_repack; the fix is expandable_segments off."""
    for rig in (WSL2, LINUX):
        (hint,) = journal_hints(journal(REPACK), rig)
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False; set it in serving_env" in hint


def test_no_signature_no_hint():
    assert journal_hints(journal(TDR), LINUX) == []  # no TDR there
    assert journal_hints("python[9]: error: unrecognized arguments: --no_such_flag 1\n",
                         WSL2) == []
    assert journal_hints("", WSL2) == []


@pytest.mark.parametrize("name", sorted(ACCEPTANCE))
def test_the_engines_acceptance_length_is_read_from_its_log(name):
    """vLLM's "SpecDecoding metrics: ... Mean acceptance length: N" as published."""
    from rigbook.roles.journal import SpecAcceptance

    assert SpecAcceptance().process(journal(name).splitlines()) == ACCEPTANCE[name]
    assert journal_hints(journal(name), WSL2) == []


def test_a_low_acceptance_is_the_failure_logs_quantised_head():
    """Failure log: the quantised head's "acceptance sat at 1.07-1.27" and bought nothing;
    the draft model reached 3.7-4.2."""
    from rigbook.roles.journal import acceptance_warning, last_acceptance

    log = ("SpecDecoding metrics: Mean acceptance length: 1.07,\n"
           "SpecDecoding metrics: Mean acceptance length: 1.27,\n")
    assert last_acceptance(log) == 1.27  # the last one the engine logged
    text = acceptance_warning(last_acceptance(log))
    assert text.startswith("the engine's mean acceptance length is 1.27 tokens per pass")
    assert "56 vs 58 tok/s" in text
    assert acceptance_warning(3.7) is None and acceptance_warning(None) is None
