"""Every `rigbook` and `pyinfra ... deploys/X.py` command the docs show still exists as written:
a renamed sub-command, flag or deploy fails here, not on a reader's machine. The runbooks run
theirs for real on the sandbox (tests/test_runbooks.py); here every other deploy command for
the user's rigs runs with --dry on the sandbox rigs, and every `rigbook models resolve` against
the stub hub. (`rigbook bench` reads a rig's verify results: the runbooks run those forms.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import threading

import pytest

from rigbook import jobs
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


#: The pages' deploy commands that no runbook test runs (the runbooks run theirs for real).
OUTSIDE_RUNBOOKS = [(where, command) for where, command in PYINFRA
                    if not where.startswith("docs/runbooks/")
                    and "inventory/rigs.py" in command]
#: What says that pyinfra or rigbook did not take a command as written: a renamed deploy, flag,
#: host-data key or recipe, a value of the wrong type, a --limit that names nothing. A refusal
#: of the sandbox rig's own data (a recipe that needs a venv it lacks) or of its facts is not one.
NOT_TAKEN = ("unknown key", "unknown recipe", "Input should be", "Usage:", "No such option",
             "No such file", "does not exist", "Traceback", "selects no host")


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
    assert not refused and (done.returncode == 0 or "refused" in said
                            or "invalid host data" in said), (
        f"{where}: `{command}` (exit {done.returncode}):\n{said[-3000:]}")


RESOLVES = [(where, command) for where, command in RIGBOOK
            if command.startswith("rigbook models resolve ")]


@pytest.mark.parametrize(("where", "command"), RESOLVES, ids=[w for w, _ in RESOLVES])
def test_every_resolve_of_the_docs_answers_from_a_hub(where, command, monkeypatch, capsys):
    """`rigbook models resolve` as the docs write it, against tests/hubstub.py holding the
    repo it names (HF_ENDPOINT: the one thing added): it prints the pin to paste."""
    from rigbook.cli import main
    from tests.hubstub import Hub, MemoryStore, serve, tiny_repo

    argv = shlex.split(command)[1:]
    name, _, ref = argv[2].partition("@")
    repo = tiny_repo(name)

    class Tagged(MemoryStore):
        """The repo's one commit, also under the tag the command names."""

        def lookup(self, repo_id: str, revision: str):
            return super().lookup(repo_id, "main" if revision == ref else revision)

    hub = Hub((repo,))
    hub.store = Tagged((repo,))
    server = serve(hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        code = main(argv)
    finally:
        server.shutdown()
        server.server_close()
    out = capsys.readouterr()
    assert code == 0, f"{where}: `{command}` exited {code}:\n{out.out}{out.err}"
    assert f'"repo": "{repo.repo_id}", "revision": "{repo.commit}"' in out.out
