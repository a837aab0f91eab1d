"""Every `rigbook` and `pyinfra ... deploys/X.py` command the docs show still exists as written:
a renamed sub-command, flag or deploy fails here, not on a reader's machine. (The runbooks run
theirs for real on the sandbox: tests/test_runbooks.py.)"""

from __future__ import annotations

import re
import shlex

import pytest

from rigbook import jobs
from rigbook.cli import build_parser
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
            for part in re.split(r"\s(?:&&|\|\||;|\||>)\s", text.split(" # ")[0]):
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
    for job in re.findall(r"\brigbook\.jobs\.(\w+)", command):
        assert callable(getattr(jobs, job, None)), f"{where}: rigbook.jobs.{job} does not exist"
