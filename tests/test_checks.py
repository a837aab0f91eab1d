"""rigbook.core.checks and rigbook.preflight: facts read in one round trip, findings, what refuses.

The batched command runs for real here (sh on this machine), with rigbook's and pyinfra's own
facts, so a fact whose command breaks the shell around it, keeps state between command() and
process(), exits non-zero or writes to stderr is seen as it would be on a rig.
"""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
from pyinfra.api import FactBase
from pyinfra.facts.files import FileContents

from rigbook.core.checks import (
    Check,
    Facts,
    Read,
    batch_command,
    error,
    process_output,
    reads_of,
    refusal,
    run_checks,
)
from rigbook.core.errors import RigbookError
from rigbook.core.spec import Rig
from rigbook.preflight import no_prompt_mid_run, refusal_text
from rigbook.registry import checks_of
from rigbook.roles import (
    capadvice,
    disks,
    driver,
    guards,
    health,
    models,
    power,
    serving,
    tuning,
    venvs,
    wsl,
)
from rigbook.roles.tuning import PresentPaths


class Fails(FactBase):
    def command(self) -> str:
        return "echo partial; echo 'it broke' >&2; exit 3"

    def process(self, output):
        return output


class Unparsable(FactBase):
    def command(self) -> str:
        return "echo not-a-number"

    def process(self, output):
        return int(output[0])


def run_batch(reads: list[Read]) -> Facts:
    command = batch_command(reads).get_raw_value()
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    return process_output(reads, out.stdout.splitlines())


def test_one_shell_command_reads_every_fact_as_pyinfra_would(tmp_path):
    present = tmp_path / "here.conf"
    present.write_text("a = 1\n")
    reads = [
        Read("paths", PresentPaths, "leftovers", (("paths", (str(present), "/nope")),)),
        Read("file", FileContents, "a file", (("path", str(present)),)),
        Read("absent", FileContents, "no file", (("path", str(tmp_path / "absent")),)),
        Read("broken", Fails, "a failing fact"),
        Read("garbled", Unparsable, "a bad parse"),
    ]
    facts = run_batch(reads)
    assert facts.paths == {str(present): "file"}
    assert facts.file == ["a = 1"]
    assert facts.absent is None  # FileContents keeps its marker from command() to process()
    assert facts.unread == {"broken": "it broke",
                            "garbled": "ValueError: invalid literal for int() with base 10: "
                                       "'not-a-number'"}
    assert [f.reason for f in facts.missing("broken", "file")] == [
        "could not read a failing fact: it broke"]


def test_two_checks_that_read_one_fact_two_ways_are_a_bug():
    one = Check("a", lambda rig, name: [Read("x", PresentPaths, "x", (("paths", ("/a",)),))],
                lambda rig, facts, name: [])
    two = Check("b", lambda rig, name: [Read("x", PresentPaths, "x", (("paths", ("/b",)),))],
                lambda rig, facts, name: [])
    rig = Rig(platform="debian", gpu_class="rtx3090", gpu_count=1)
    with pytest.raises(ValueError, match="fact x is read two ways"):
        reads_of(rig, "r", [one, two])


def test_every_role_with_checks_is_found_and_each_check_runs_once():
    found = checks_of()
    for module in (driver, guards, models, power, capadvice, serving, tuning, venvs, wsl,
                   health, disks):
        assert set(module.CHECKS) <= set(found), module.__name__
    assert len(found) == len(set(found))
    rig = Rig(platform="debian", gpu_class="rtx3090", gpu_count=2)
    names = [read.name for read in reads_of(rig, "r", found)]
    assert len(names) == len(set(names)) and names.count("probe") == 1


def test_a_refusal_names_host_key_and_what_is_allowed():
    finding = refusal("serving", RigbookError("rig1: serving_bind: 0.0.0.0 is wider than "
                                              "loopback and no API key\n  is set"), "rig1")
    assert (finding.level, finding.key) == ("error", "serving_bind")
    assert finding.message("rig1") == (
        "rig1: serving_bind: 0.0.0.0 is wider than loopback and no API key is set")
    lines = refusal_text("rig1", [finding, error("gpu", "declared 3, lists 2", "gpu_count")])
    assert lines.splitlines() == [
        "refused before any change, nothing was changed:",
        "  - rig1: serving_bind: 0.0.0.0 is wider than loopback and no API key is set",
        "  - rig1: gpu_count: declared 3, lists 2",
    ]


def test_an_unread_fact_is_a_refusal_not_a_silent_pass():
    rig = Rig(platform="debian", gpu_class="rtx3090", gpu_count=1, shm_size="2G")
    facts = Facts(unread={"shm": "Command timed out after 300s"})
    (finding,) = run_checks(rig, "r", tuning.CHECKS, facts)
    assert finding.level == "error"
    assert finding.reason == "could not read /dev/shm: Command timed out after 300s"


def test_no_prompt_between_operations_when_a_rig_fails():
    asked = SimpleNamespace(should_raise_failed_hosts=lambda state: True)  # pyinfra without -y
    no_prompt_mid_run(asked)
    assert asked.should_raise_failed_hosts(asked) is False
    with_y = SimpleNamespace(should_raise_failed_hosts=None)  # -y: --fail-percent applies
    no_prompt_mid_run(with_y)
    assert with_y.should_raise_failed_hosts is None


def test_a_batch_that_brings_nothing_back_is_read_once_more(monkeypatch):
    """A dropped SSH channel on a loaded rig gives no output at all: the read is tried again,
    and what it read is kept for the run's operations (rigbook.core.runfacts)."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.facts.server import Arch

    from rigbook.core import checks, runfacts

    state = State(Inventory((["rig1"], {})), Config())
    (host,) = list(state.inventory)
    reads = (checks.Read("arch", Arch, "architecture"),)
    answers = [[], ["##RIGBOOK_FACT## arch", "x86_64", "##RIGBOOK_FACT_RC## 0"]]
    calls = []
    monkeypatch.setattr(checks, "get_fact", lambda *a, **k: calls.append(1) or answers.pop(0))
    facts = checks.read_facts(state, host, reads)
    assert len(calls) == 2 and facts.arch == "x86_64" and not facts.unread
    assert runfacts.record(state, host).facts[runfacts._key(Arch, {})] == "x86_64"
    answers[:] = [[], []]
    assert checks.read_facts(state, host, reads).unread == {"arch": "no output"}
