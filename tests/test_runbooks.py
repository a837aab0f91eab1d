"""Every runbook in docs/runbooks/, run step by step on the sandbox rigs, as it is written.

The steps come from the runbook's own command blocks (tests/runbook.py reads them), so a
runbook cannot drift from the code: a documented command that fails, or an output the runbook
promises that does not appear, fails its test. Commands name the example fleet; here they run
against the sandbox rigs instead, with exactly these words replaced, in the commands and in
the output they promise (docs/runbooks/README.md says so too): inventory/rigs.py ->
inventory/sandbox.py, rig-dual3090 and the dual_3090 group -> rig1 (the sandbox's dual 3090),
rig-wsl3090 -> rig3 (its WSL2 rig), BOX-ADDRESS -> rig1's address; a runbook may name another
sandbox inventory for inventory/rigs.py (tests/inventories/). Each runbook starts on newly
created rigs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, rig_ssh, rigbook
from tests.runbook import Step, missing, parse, sandbox_inventory

pytestmark = pytest.mark.sandbox

RUNBOOKS = sorted((ROOT / "docs" / "runbooks").glob("*.md"))
RUNBOOKS = [path for path in RUNBOOKS if path.name != "README.md"]


def sandbox_words(sandbox: dict, inventory: str) -> dict[str, str]:
    return {"inventory/rigs.py": inventory, "rig-dual3090": "rig1",
            "dual_3090": "rig1", "rig-wsl3090": "rig3",
            "BOX-ADDRESS": sandbox["rig1"]["address"]}


def run_step(step: Step, command: str, sandbox: dict) -> subprocess.CompletedProcess:
    if step.where == "rig":
        return rig_ssh(sandbox["rig1"], command, check=False)
    env = {**os.environ, "PYINFRA_PROGRESS": "off", "COLUMNS": "200",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900, input="\n" if step.enter else "")


@pytest.mark.parametrize("runbook", RUNBOOKS, ids=[path.stem for path in RUNBOOKS])
def test_runbook_runs_as_written(sandbox, runbook):
    steps = parse(runbook)
    assert steps, f"{runbook} has no command blocks"
    rigbook("sandbox", "up", str(len(sandbox)))  # new rigs: nothing of the last test left
    words = sandbox_words(sandbox, sandbox_inventory(runbook))

    def on_sandbox(text: str) -> str:
        for word, stand_in in words.items():
            text = text.replace(word, stand_in)
        return text

    for step in steps:
        output = ""
        for line in step.commands:
            command = on_sandbox(line)
            done = run_step(step, command, sandbox)
            output += done.stdout + done.stderr
            where = f"{runbook.name}:{step.line}: `{command}`"
            assert done.returncode == step.exit, (
                f"{where} exited {done.returncode}, the runbook says {step.exit}\n"
                f"{output[-6000:]}")
        absent = missing([on_sandbox(line) for line in step.expect], output)
        assert not absent, f"{runbook.name}:{step.line}: not in the output: {absent}\n" + (
            output[-6000:])
