"""Shared test fixtures: sandbox rigs for end-to-end tests and a runner for the real pyinfra CLI.

End-to-end tests boot sandbox rigs (systemd-nspawn hosts with real systemd, sshd and apt) and
drive them with the `pyinfra` command exactly as a user does. One set of rigs serves the whole
session; a file lock keeps two test runs on one machine from fighting over them. On pytest-xdist
workers (`-n 2 --dist loadfile -m sandbox`), worker gwK boots set RIGBOOK_SANDBOX_SET+K of its
own (rigbook.sandbox: other names, subnet and state dir, and its own lock here).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rigbook.core import messages
from rigbook.sandbox import MAX_SET, SET_ENV

ROOT = Path(__file__).resolve().parent.parent
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
SANDBOX_INVENTORY = "inventory/sandbox.py"
#: The default set's lock; set N's is rigbook-sandbox-N.lock beside it.
LOCK = Path("/run/lock/rigbook-sandbox.lock")
#: rig1 dual-3090, rig2 single-4090, rig3 wsl2-3090 (profiles are assigned round-robin).
RIGS = int(os.environ.get("RIGBOOK_TEST_RIGS", "3"))


def _keep_the_hub_awake():
    """In a pytest-xdist worker: a timer on the main thread's gevent hub, for the whole session.

    Importing pyinfra_cli monkey-patches threading while the worker's channel thread already
    runs; the worker's main thread then waits for its next test on a gevent lock that the
    channel thread releases, and a hub with nothing of its own to watch ends that wait at once
    with LoopExit. A timer gives the hub something to watch (it fires once a second and does
    nothing).
    """
    import gevent
    import pyinfra_cli  # noqa: F401 (the patching, before the hub is made)

    timer = gevent.get_hub().loop.timer(1.0, 1.0)
    timer.start(lambda: None)
    return timer


#: The xdist worker's timer (kept referenced for the session).
_HUB_TIMER = _keep_the_hub_awake() if os.environ.get("PYTEST_XDIST_WORKER") else None


def sandbox_unavailable() -> str | None:
    """Why sandbox rigs cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "sandbox rigs need root"
    for tool in ("systemd-nspawn", "debootstrap", "ip", "zstd", "dpkg-scanpackages"):
        if shutil.which(tool) is None:
            return f"sandbox rigs need {tool}"
    return None


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str,
              make: Callable[[Path], None]) -> Path:
    """A folder of this run's temporary files that `make(folder)` fills once for the whole run:
    the xdist workers of one run share it (a worker's own base is one level below the run's),
    and the first that asks makes it, under a lock, while the others wait."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder, made = base / name, base / f"{name}.made"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed make left
            folder.mkdir()
            make(folder)
            made.touch()
    return folder


def rigbook(*args: str, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run the rigbook CLI from this checkout."""
    return subprocess.run(
        [sys.executable, "-m", "rigbook.cli", *args],
        cwd=ROOT, capture_output=True, text=True, check=check, timeout=timeout,
    )


@dataclass
class PyinfraRun:
    """One run of the pyinfra CLI with --json: exit code, results and what it printed."""

    returncode: int
    stdout: str
    stderr: str
    results: dict | None = field(default=None)

    def changed(self) -> dict[str, list[str]]:
        """Operation name -> hosts on which it changed something."""
        if not self.results:
            return {}
        return {op["name"]: op["success"] for op in self.results["operations"] if op["success"]}

    def errors(self) -> dict[str, list[str]]:
        """Operation name -> hosts on which it failed."""
        if not self.results:
            return {}
        return {op["name"]: op["error"] for op in self.results["operations"] if op["error"]}

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stderr ---\n{self.stderr[-6000:]}"


def run_pyinfra(inventory: str, deploy: str, *args: str, timeout: int = 900,
                cwd: Path = ROOT, pyinfra: tuple[str, ...] = (PYINFRA,)) -> PyinfraRun:
    """`pyinfra -y --json INVENTORY DEPLOY ARGS`, from the repo root as a user runs it (or from
    `cwd` with another install's `pyinfra`)."""
    proc = subprocess.run(
        [*pyinfra, "-y", "--json", inventory, deploy, *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYINFRA_PROGRESS": "off"},
    )
    try:
        results = json.loads(proc.stdout).get("results")
    except json.JSONDecodeError:
        results = None
    return PyinfraRun(proc.returncode, proc.stdout, proc.stderr, results)


@contextmanager
def added_rig(profile: str) -> Iterator[dict]:
    """One more sandbox rig of `profile` beside the session's (`rigbook sandbox add`), removed
    with all it left when the block ends: for a test that needs a rig nothing else touched."""
    added = rigbook("sandbox", "add", profile, check=False)
    assert added.returncode == 0, added.stdout + added.stderr
    name = added.stdout.split()[0]
    listing = {rig["name"]: rig for rig in json.loads(rigbook("sandbox", "list", "--json").stdout)}
    try:
        yield listing[name]
    finally:
        rigbook("sandbox", "remove", name, check=False)


def rig_ssh(rig: dict, command: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a shell command on a sandbox rig as root, over SSH like pyinfra does."""
    return subprocess.run(
        ["ssh", "-i", rig["ssh_key"], "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
         f"root@{rig['address']}", command],
        capture_output=True, text=True, check=check, timeout=300,
    )


#: (rig, unit, exposure) that end-to-end tests measured, printed at the end of the run.
EXPOSURES: list[tuple[str, str, float]] = []


def security_exposure(rig: dict, unit: str) -> float:
    """`systemd-analyze security` exposure of a unit on a rig (0 safest, 10 unsafe), recorded
    for the run's summary."""
    out = rig_ssh(rig, f"systemd-analyze security --no-pager {unit}").stdout
    match = re.search(rf"Overall exposure level for {re.escape(unit)}: (\d+\.\d+)", out)
    assert match, out
    EXPOSURES.append((rig["name"], unit, float(match.group(1))))
    return float(match.group(1))


def pytest_terminal_summary(terminalreporter):
    if EXPOSURES:
        terminalreporter.section("systemd-analyze security, measured on sandbox rigs")
        for rig, unit, exposure in EXPOSURES:
            terminalreporter.write_line(f"{rig}: {unit}: exposure {exposure}")


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees warnings said afresh (roles warn once per host and run)."""
    messages._warned.clear()
    yield
    messages._warned.clear()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(xdist, on the controller) Tells each worker how tests are handed out: a worker's own
    --dist reads "no"."""
    node.workerinput["rigbook_dist"] = node.config.getoption("dist")


def _session_set(config: pytest.Config) -> int:
    """The set of rigs this session boots (exported for every rigbook and pyinfra it starts):
    RIGBOOK_SANDBOX_SET (0 when unset), plus K on xdist worker gwK. Workers must take whole
    files (--dist loadfile): an e2e file's tests run in order on one set of rigs."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    dist = getattr(config, "workerinput", {}).get("rigbook_dist")
    if worker and dist not in ("loadfile", "loadscope"):
        pytest.fail("e2e tests on xdist workers need --dist loadfile (a file's tests run in "
                    "order, on one set of rigs)", pytrace=False)
    number = int(os.environ.get(SET_ENV, "0")) + int((worker or "gw0").removeprefix("gw"))
    if number > MAX_SET:
        pytest.fail(f"sandbox set {number} is past the last one ({MAX_SET})", pytrace=False)
    if number:  # the default set's runs see the environment they always saw
        os.environ[SET_ENV] = str(number)
    return number


@pytest.fixture(scope="session")
def sandbox(request):
    """RIGS sandbox rigs, up for the whole session, down (and cleaned) at its end."""
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    number = _session_set(request.config)
    path = LOCK.with_name(f"rigbook-sandbox-{number}.lock") if number else LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            up = rigbook("sandbox", "up", str(RIGS), check=False)
            assert up.returncode == 0, up.stdout + up.stderr
            listing = rigbook("sandbox", "list", "--json")
            yield {rig["name"]: rig for rig in json.loads(listing.stdout)}
        finally:
            rigbook("sandbox", "down", check=False)
