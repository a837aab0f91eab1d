"""Faults an operator's bad day brings, on sandbox rigs, each followed by a rerun that converges
and a run that reports no changes (issue 30; docs/faults.md says what rigbook guarantees).

1. pyinfra SIGKILLed while deploys/venvs.py builds a venv (one package added) that a running
   service uses: the build finishes on the rig without its operator, swaps, and restarts the
   service from the new build; the dead run's lock does not block the rerun; a swap whose
   restarts were cut off (its restart-pending marker left) is finished by the next run.
2. Two runs of one rig 0.4 s apart: one is refused before any change, naming the other.
3. A unit in start-limit failure: rigbook's own start resets it and starts it; a start that fails
   shows the unit's journal tail.
4. A rig whose container died (`rigbook sandbox kill`) boots again with its disk
   (`rigbook sandbox restart`).

Every test puts its rig back as it found it. Packages come from the wheelhouse (tiny wheels made
here); the service that uses the venv is a stand-in unit that records the build it started from.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from rigbook.core.pins import VENVS_DIR
from rigbook.core.runlock import LOCK
from rigbook.core.tools import TOOLS_PINS
from rigbook.core.units import start_shell
from rigbook.roles.venvs import restart_marker
from rigbook.sandbox import wheelhouse
from tests.conftest import PYINFRA, ROOT, SANDBOX_INVENTORY, rig_ssh, rigbook, run_pyinfra
from tests.test_models import ensure_wheels
from tests.test_venvs import make_wheel

REBUILD = "deploys/venvs.py"
NAME = "faulty"
VENV_OP = f"Python venvs | Venv {NAME}"
USER_UNIT = "rigbook-fault-user.service"
#: Where the stand-in service writes the build it started from (the venv link, resolved).
STARTED_FROM = "/run/rigbook-fault-user.build"
USER_UNIT_TEXT = f"""[Unit]
Description=rigbook fault test: a process that runs from venv {NAME}
[Service]
ExecStart={VENVS_DIR}/{NAME}/bin/python -c "import os, sys, time; \
open('{STARTED_FROM}', 'w').write(os.path.realpath(sys.prefix)); time.sleep(86400)"
"""
#: Its module sleeps 4 s on import, so the build's smoke test does: the window to kill pyinfra.
SLOW, EXTRA = "rigfaultslow", "rigfaultextra"

pytestmark = pytest.mark.sandbox


def venvs_data(*packages: str, services: tuple[str, ...] = ()) -> list[str]:
    spec = {"name": NAME, "engine": "none", "python": "3.11", "packages": list(packages),
            "services": list(services)}
    return ["--data", "venvs=" + json.dumps([spec])]


@pytest.fixture
def wheels():
    ensure_wheels([f"{name}=={version}" for name, version in TOOLS_PINS.items()], wheelhouse())
    make_wheel(wheelhouse(), SLOW, "1.0", body="import time\ntime.sleep(4)\n")
    make_wheel(wheelhouse(), EXTRA, "1.0")
    yield
    for name in (SLOW, EXTRA):
        (wheelhouse() / f"{name}-1.0-py3-none-any.whl").unlink(missing_ok=True)


def start_pyinfra(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PYINFRA, "-y", "--json", SANDBOX_INVENTORY, *args], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYINFRA_PROGRESS": "off"},
    )


def wait_for(what: str, done, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.3)


def live_build(rig: dict) -> str:
    return rig_ssh(rig, f"readlink -f {VENVS_DIR}/{NAME}").stdout.strip()


def cleanup_venv(rig: dict) -> None:
    rig_ssh(rig, f"systemctl disable --now {USER_UNIT} 2>/dev/null; "
                 f"rm -f /etc/systemd/system/{USER_UNIT} {STARTED_FROM}; systemctl daemon-reload; "
                 f"rm -rf {VENVS_DIR}/{NAME} {VENVS_DIR}/{NAME}-* {VENVS_DIR}/{NAME}.env "
                 f"{VENVS_DIR}/.{NAME}.*", check=False)


def test_a_venv_build_outlives_its_killed_operator_and_restarts_what_uses_it(sandbox, wheels):
    rig = sandbox["rig1"]
    services = (USER_UNIT,)
    killed = None
    try:
        first = run_pyinfra(SANDBOX_INVENTORY, REBUILD, "--limit", "rig1",
                            *venvs_data(f"{SLOW}==1.0", services=services))
        assert first.returncode == 0, first.explain()
        old = live_build(rig)
        rig_ssh(rig, f"cat > /etc/systemd/system/{USER_UNIT} <<'EOF'\n{USER_UNIT_TEXT}EOF\n"
                     f"systemctl daemon-reload && systemctl start {USER_UNIT}")
        wait_for("the service started", lambda: rig_ssh(
            rig, f"cat {STARTED_FROM}", check=False).stdout == old)

        # one package added; pyinfra SIGKILLed while the new build runs its smoke test
        wanted = venvs_data(f"{SLOW}==1.0", f"{EXTRA}==1.0", services=services)
        rig_ssh(rig, f"rm -f {VENVS_DIR}/.{NAME}.build.log")  # the first build's phases
        killed = start_pyinfra(REBUILD, "--limit", "rig1", *wanted)
        wait_for("the build's smoke test", lambda: "rigbook phase: smoke test" in rig_ssh(
            rig, f"cat {VENVS_DIR}/.{NAME}.build.log", check=False).stdout)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        wait_for("the orphaned build to end", lambda: rig_ssh(
            rig, f"flock -n {VENVS_DIR}/.{NAME}.lock true", check=False).returncode == 0)
        new = live_build(rig)
        assert new != old and rig_ssh(rig, f"test -f {new}/rigbook-manifest.json").returncode == 0
        rig_ssh(rig, f"{VENVS_DIR}/{NAME}/bin/python -c 'import {EXTRA}'")
        assert rig_ssh(rig, f"cat {STARTED_FROM}").stdout == new  # the service moved with it
        assert rig_ssh(rig, f"test -e {restart_marker(VENVS_DIR, NAME)}",
                       check=False).returncode == 1

        # the dead run's lock is still on the rig and blocks nobody
        assert f'"pid": {killed.pid},' in rig_ssh(rig, f"cat {LOCK}").stdout
        rerun = run_pyinfra(SANDBOX_INVENTORY, REBUILD, "--limit", "rig1", *wanted)
        assert rerun.returncode == 0, rerun.explain()
        assert rig_ssh(rig, f"cat {STARTED_FROM}").stdout == new == live_build(rig)
        again = run_pyinfra(SANDBOX_INVENTORY, REBUILD, "--limit", "rig1", *wanted)
        assert again.returncode == 0 and again.changed() == {}, again.explain()

        # a swap cut off before its restarts (the rig went down then) leaves its marker: the
        # next run restarts the service and removes it; the run after changes nothing
        pid = rig_ssh(rig, f"systemctl show -p MainPID --value {USER_UNIT}").stdout.strip()
        rig_ssh(rig, f"echo {USER_UNIT} > {restart_marker(VENVS_DIR, NAME)}")
        finish = run_pyinfra(SANDBOX_INVENTORY, REBUILD, "--limit", "rig1", *wanted)
        assert finish.returncode == 0, finish.explain()
        assert finish.changed().get(VENV_OP) == ["rig1"], finish.explain()
        assert "ended before it restarted" in finish.stderr
        wait_for("the service restarted", lambda: rig_ssh(
            rig, f"systemctl show -p MainPID --value {USER_UNIT}").stdout.strip() not in (pid, "0"))
        assert rig_ssh(rig, f"test -e {restart_marker(VENVS_DIR, NAME)}",
                       check=False).returncode == 1
        last = run_pyinfra(SANDBOX_INVENTORY, REBUILD, "--limit", "rig1", *wanted)
        assert last.returncode == 0 and last.changed() == {}, last.explain()
    finally:
        if killed is not None and killed.poll() is None:
            killed.kill()
        cleanup_venv(rig)


def test_two_runs_of_one_rig_at_once_one_is_refused_naming_the_other(sandbox, wheels):
    rig = sandbox["rig2"]
    data = venvs_data(f"{SLOW}==1.0")
    runs = []
    try:
        runs.append(start_pyinfra(REBUILD, "--limit", "rig2", *data))
        time.sleep(0.4)
        runs.append(start_pyinfra(REBUILD, "--limit", "rig2", *data))
        done = [(run, *run.communicate(timeout=600)) for run in runs]
        refused = [(run, err) for run, _out, err in done if run.returncode != 0]
        assert len(refused) == 1, [err[-3000:] for _run, _out, err in done]
        loser, err = refused[0]
        winner = next(run for run in runs if run is not loser)
        assert "refused before any change: another run holds this rig: " in err, err[-3000:]
        assert f"@{socket.gethostname()} (pid {winner.pid}, from " in err, err[-3000:]
        assert "Venv faulty" not in err  # it planned nothing
        assert winner.returncode == 0
        again = run_pyinfra(SANDBOX_INVENTORY, REBUILD, "--limit", "rig2", *data)
        assert again.returncode == 0 and again.changed() == {}, again.explain()
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
        cleanup_venv(rig)


def test_rigbooks_own_start_clears_a_start_limit_and_shows_the_journal(sandbox):
    rig = sandbox["rig2"]
    unit, boom = "rigbook-fault-limit.service", "rigbook-fault-boom.service"
    units = {
        unit: "[Unit]\nStartLimitIntervalSec=600\nStartLimitBurst=3\n"
              "[Service]\nExecStart=/bin/sleep 86400\n",
        boom: "[Service]\nType=oneshot\nExecStart=/bin/sh -c 'echo rigbook-fault-says-why; "
              "exit 3'\n",
    }
    try:
        for name, text in units.items():
            rig_ssh(rig, f"cat > /etc/systemd/system/{name} <<'EOF'\n{text}EOF")
        rig_ssh(rig, "systemctl daemon-reload")
        for _ in range(3):
            rig_ssh(rig, f"systemctl restart {unit}")
        wedged = rig_ssh(rig, f"systemctl restart {unit}", check=False)
        assert wedged.returncode != 0 and "too often" in wedged.stderr + rig_ssh(
            rig, f"systemctl status --no-pager {unit}", check=False).stdout
        started = rig_ssh(rig, start_shell(unit), check=False)
        assert started.returncode == 0, started.stderr
        assert rig_ssh(rig, f"systemctl is-active {unit}").stdout.strip() == "active"
        failed = rig_ssh(rig, start_shell(boom), check=False)
        assert failed.returncode != 0
        assert "rigbook-fault-says-why" in failed.stderr, failed.stderr
    finally:
        rig_ssh(rig, f"systemctl stop {unit} {boom}; systemctl reset-failed {unit} {boom}; "
                     f"rm -f /etc/systemd/system/{unit} /etc/systemd/system/{boom}; "
                     "systemctl daemon-reload", check=False)


def test_a_rig_whose_container_died_boots_again_keeping_its_disk(sandbox):
    rig = sandbox["rig3"]
    mark = "/root/rigbook-fault-disk-kept"
    try:
        rig_ssh(rig, f"echo kept > {mark} && sync && touch /run/rigbook-fault-volatile")
        killed = rigbook("sandbox", "kill", "rig3", check=False)
        assert killed.returncode == 0, killed.stderr
        assert rig_ssh(rig, "true", check=False).returncode != 0  # gone
        refused = rigbook("sandbox", "kill", "rig3", check=False)
        assert refused.returncode != 0 and "rig3 is not running" in refused.stderr
        back = rigbook("sandbox", "restart", "rig3", check=False)
        assert back.returncode == 0, back.stderr
        assert rig_ssh(rig, f"cat {mark}").stdout == "kept\n"
        assert rig_ssh(rig, "test -e /run/rigbook-fault-volatile", check=False).returncode == 1
        wait_for("systemd up", lambda: rig_ssh(rig, "systemctl is-system-running", check=False
                                                ).stdout.strip() in ("running", "degraded"))
    finally:
        if rig_ssh(rig, "true", check=False).returncode != 0:
            rigbook("sandbox", "restart", "rig3", check=False)
        rig_ssh(rig, f"rm -f {mark}", check=False)
