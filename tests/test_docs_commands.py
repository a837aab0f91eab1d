"""Every `rigbook` and `pyinfra ... deploys/X.py` command the docs show still exists as written:
a renamed sub-command, flag or deploy fails here, not on a reader's machine. (The runbooks run
theirs for real on the sandbox: tests/test_runbooks.py.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from rigbook.cli import build_parser
from tests.conftest import PYINFRA as PYINFRA_BIN
from tests.conftest import ROOT

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_BLOCK = re.compile(r"^( {4,}|\t)(.*)$")


def commands(tool: str) -> list[tuple[str, str]]:
    """(page:line, command) of each `tool ...` command in a code block or an indented one."""
    found, inside = [], False
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside = not inside
                continue
            text = line.strip() if inside else (m.group(2).strip() if (m := _BLOCK.match(line))
                                                else "")
            for part in re.split(r"\s(?:&&|\|\||;|\|)\s", text.split(" # ")[0]):
                # a prompt and environment assignments go; a tool's own output ("rigbook
                # status: reading ...") and placeholders (<commit>, ...) are not commands
                part = re.sub(r"^(\$ )?([A-Z_]+=\S* )*", "", part.strip())
                if (part.startswith(f"{tool} ") and not part.split()[1].endswith(":")
                        and "<" not in part and "..." not in part):
                    found.append((f"{page.relative_to(ROOT)}:{number}", part))
    return found


RIGBOOK = commands("rigbook")
PYINFRA = commands("pyinfra")


def test_the_docs_show_commands_at_all():
    assert len(RIGBOOK) > 10 and len(PYINFRA) > 10


@pytest.mark.parametrize(("where", "command"), RIGBOOK, ids=[w for w, _ in RIGBOOK])
def test_every_rigbook_command_in_the_docs_parses(where, command):
    try:
        build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit as exit:
        pytest.fail(f"{where}: `{command}` does not parse (exit {exit.code})")


@pytest.mark.parametrize(("where", "command"), PYINFRA, ids=[w for w, _ in PYINFRA])
def test_every_deploy_the_docs_run_exists(where, command):
    deploys = [w for w in shlex.split(command) if re.fullmatch(r"deploys/\w+\.py", w)]
    for deploy in deploys:
        assert (ROOT / deploy).is_file(), f"{where}: {deploy} does not exist"


#: The pages' deploy commands that no runbook test runs (the runbooks run theirs for real).
OUTSIDE_RUNBOOKS = [(where, command) for where, command in PYINFRA
                    if not where.startswith("docs/runbooks/")
                    and "inventory/rigs.py" in command]
#: What says that pyinfra or rigbook did not take a command as written: a renamed deploy, flag
#: or host-data key, a --limit that names nothing; a refusal made on the rig is not one of them.
NOT_TAKEN = ("invalid host data", "Usage:", "No such", "Traceback", "selects no host",
             "No such option", "Error: Invalid")


@pytest.mark.sandbox
@pytest.mark.parametrize(("where", "command"), OUTSIDE_RUNBOOKS,
                         ids=[w for w, _ in OUTSIDE_RUNBOOKS])
def test_every_deploy_command_of_the_docs_plans_on_the_sandbox(sandbox, where, command):
    """Each one, with --dry on the sandbox rigs (the runbooks' replacements: rig-dual3090 and
    dual_3090 are rig1), is taken as written: it plans, or a rig-side check refuses it."""
    from tests.test_runbooks import sandbox_words

    for word, stand_in in sandbox_words(sandbox, "inventory/sandbox.py").items():
        command = command.replace(word, stand_in)
    argv = shlex.split(command)[1:]
    argv = ["-y", *([] if "--dry" in argv else ["--dry"]), *(a for a in argv if a != "-y")]
    done = subprocess.run([PYINFRA_BIN, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYINFRA_PROGRESS": "off"})
    said = done.stdout + done.stderr
    refused = [word for word in NOT_TAKEN if word in said]
    assert not refused and (done.returncode == 0 or "refused" in said), (
        f"{where}: `{command}` (exit {done.returncode}):\n{said[-3000:]}")
