"""A rig without systemd as PID 1, end to end: deploys/rig.py twice, serving by the supervisor.

The rig is a sandbox rig of profile nosystemd-4090, added for this file only (`rigbook sandbox
add`, removed at the end, so the default fleet is unchanged): systemd-nspawn without -b, sshd
as the container's command, no systemctl at all (the shape of a rented GPU container, and of
WSL2 without systemd). One story, each step starting from what the last left:

1. `deploys/rig.py` converges it: the stand-in driver, tuning, the live cap, the engine's venv
   and recipe tiny-cpu-a served by files/serving/supervise.py (pidfile, log, rigbook-serve);
   the preflight says once that there is no systemd, and no unit or systemctl is planned;
2. a second converge changes nothing, and the engine is the same process;
3. `rigbook status` shows it served by the supervisor, healthy, and advises no unit;
4. what cannot be done there is refused with its reason before any change: a power sweep (no
   unit to set the caps back to), the models mirror (a unit);
5. a switch to tiny-cpu-b stops a gracefully (SIGTERM: uvicorn's own shutdown in the log) and
   starts b; one engine runs;
6. the driver bump (`deploys/driver.py`, without leave to reboot: no reboot there) writes the
   hold and stops the supervisor's engine before the driver moves;
7. after a restart of the container the start its entrypoint would run is refused with the
   hold's line, `supervise.py status` and `rigbook status` say so, and a converge leaves it held;
8. `deploys/venvs.py` rebuilds the venv for the new driver, removes the hold and serves b again;
   a converge then changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyinfra_cli.util import parse_cli_arg

from rigbook.core.units import NO_SYSTEMD
from rigbook.roles.serving import (
    HOLD_PATH,
    PIDFILE,
    SERVE_LOG,
    SUPERVISE_CONF,
    SUPERVISE_PATH,
    SUPERVISOR,
)
from rigbook.roles.sweep import NO_UNIT_HERE
from tests.conftest import ROOT, SANDBOX_INVENTORY, added_rig, rig_ssh, rigbook, run_pyinfra
from tests.standins import place_model, wheelhouse_for_llama
from tests.test_serving_e2e import engines, tiny_cpu_args
from tests.tinymodel import FILE, revision_of, write_tiny_gguf

pytestmark = pytest.mark.sandbox

SERVE_OP = "Serving | Serve {} under rigbook's supervisor"
#: What an operation planned there must not name: a unit, systemctl, a daemon-reload.
UNIT_WORDS = ("systemctl", "daemon-reload", ".service", "drop-in")


@pytest.fixture(scope="module")
def bare_rig(sandbox):
    """One nosystemd-4090 rig beside the session's rigs, removed (with all it left) at the end."""
    with added_rig("nosystemd-4090") as rig:
        yield rig


def unit_steps(run) -> list[str]:
    """The run's operations that name a unit or systemctl."""
    if run.results is not None:
        names = [op["name"] for op in run.results.get("operations", [])]
    else:  # --dry prints the plan instead of results
        names = [op["name"] for op in json.loads(run.stdout).get("plan", [])]
    assert names, run.explain()
    return [name for name in names if any(word in name for word in UNIT_WORDS)]


#: inventory/sandbox.py with a converge's --data on the one rig: what `rigbook status` reads.
STATUS_INVENTORY = """
import inventory.sandbox as _sandbox

sandbox_rigs = [(name, {{**data, **{extra!r}}}) for name, data in _sandbox.sandbox_rigs
                if name == {name!r}]
"""


def status_inventory(folder: Path, args: list[str]) -> str:
    """An inventory file holding the `--data` pairs of pyinfra's `args` for their rig."""
    name = args[args.index("--limit") + 1]
    pairs = [value.split("=", 1) for flag, value in zip(args, args[1:], strict=False)
             if flag == "--data"]
    extra = {key: parse_cli_arg(value) for key, value in pairs}  # as pyinfra's --data reads it
    path = folder / "status_inventory.py"
    path.write_text(STATUS_INVENTORY.format(extra=extra, name=name))
    return str(path)


def supervisor_pid(rig: dict) -> int:
    return int(rig_ssh(rig, f"cat {PIDFILE}").stdout.strip())


def engine_pid(rig: dict) -> int:
    """The engine: the supervisor's child."""
    return int(rig_ssh(rig, f"pgrep -P {supervisor_pid(rig)}").stdout.split()[0])


def test_a_rig_without_systemd_converges_and_serves_under_the_supervisor(bare_rig, tmp_path):
    wheelhouse_for_llama()
    rig, name = bare_rig, bare_rig["name"]
    assert rig_ssh(rig, "command -v systemctl", check=False).returncode != 0
    assert rig_ssh(rig, "test -d /run/systemd/system", check=False).returncode != 0
    gguf = write_tiny_gguf(tmp_path / FILE)
    revision = revision_of(gguf)
    place_model(rig, gguf, revision)

    def converge(deploy: str, recipe: str, *more: str):
        args = tiny_cpu_args(name, recipe, revision, power_cap_watts="260")
        return run_pyinfra(SANDBOX_INVENTORY, deploy, *args, *more)

    # 0. --dry plans no unit and no systemctl
    dry = converge("deploys/rig.py", "tiny-cpu-a", "--dry")
    assert dry.returncode == 0, dry.explain()
    assert unit_steps(dry) == []

    # 1. the converge: no unit, no systemctl (the rig has none: one would fail the run with
    # 127); the supervisor serves tiny-cpu-a
    first = converge("deploys/rig.py", "tiny-cpu-a")
    assert first.returncode == 0, first.explain()
    said = first.stdout + first.stderr
    assert said.count("no systemd as PID 1 (or no systemctl)") == 1
    assert unit_steps(first) == []
    assert name in first.changed()[SERVE_OP.format("tiny-cpu-a")]
    assert "answers on http://127.0.0.1:8100" in said
    written = rig_ssh(rig, "find /etc/systemd/system -newer /etc/hostname -type f",
                      check=False).stdout
    assert written == "", written
    supervisor, engine = supervisor_pid(rig), engine_pid(rig)
    cmdline = rig_ssh(rig, f"tr '\\0' ' ' < /proc/{supervisor}/cmdline").stdout
    assert cmdline.split()[1:5] == ["-I", "-S", SUPERVISE_PATH, "start"]
    assert rig_ssh(rig, f"ps -o user= -p {engine}").stdout.strip() == "rigbook-serve"
    assert rig_ssh(rig, f"ps -o user= -p {supervisor}").stdout.strip() == "root"
    conf = json.loads(rig_ssh(rig, f"cat {SUPERVISE_CONF}").stdout)
    assert conf["stop_timeout"] == 120 and conf["user"] == "rigbook-serve"
    assert answers(rig, 8100)
    live = rig_ssh(rig, "nvidia-smi --query-gpu=power.limit --format=csv,noheader,nounits")
    assert float(live.stdout) == 260.0  # the live cap, set where the host allows it
    # persistence on as the host keeps it (sandbox/simulated/host-persistence): one daemon, started
    # by the stand-in packages' postinsts, however often they ran
    mode = rig_ssh(rig, "nvidia-smi --query-gpu=persistence_mode --format=csv,noheader")
    assert mode.stdout.strip() == "Enabled"
    daemons = rig_ssh(rig, "pgrep -fc '^/usr/bin/python3 /usr/bin/nvidia-persistenced '")
    assert daemons.stdout.strip() == "1"

    # 2. a second converge changes nothing
    second = converge("deploys/rig.py", "tiny-cpu-a")
    assert second.returncode == 0, second.explain()
    assert second.changed() == {}, second.changed()
    assert (supervisor_pid(rig), engine_pid(rig)) == (supervisor, engine)

    # 3. status: served by the supervisor, healthy; no advice about units
    shown = rigbook("status", status_inventory(tmp_path, tiny_cpu_args(
        name, "tiny-cpu-a", revision, power_cap_watts="260")), "--limit", name, "--json",
        check=False)
    (status,) = json.loads(shown.stdout)["rigs"]
    reasons = [finding["reason"] for finding in status["findings"]]
    assert reasons.count(NO_SYSTEMD) == 1, reasons  # the notice, which names systemctl itself
    others = [r for r in reasons if r != NO_SYSTEMD]
    assert not [r for r in others if any(word in r for word in UNIT_WORDS)], reasons
    assert status["power_unit"] is None
    serving = status["serving"]
    assert serving["unit"] == "active" and serving["sub"].startswith("supervised, pid ")
    assert serving["healthy"] is True, serving

    # 4. refused there with its reason, before any change: the power sweep (no unit to set the
    # caps back to) and the models mirror (a unit); the engine and the live cap stay
    sweep = converge("deploys/power_sweep.py", "tiny-cpu-a", "--data", "sweep_watts=250:270:10")
    assert sweep.returncode != 0, sweep.explain()
    assert f"{name}: {NO_UNIT_HERE}" in sweep.stderr, sweep.explain()
    token = tmp_path / "fleet-token"
    token.write_text("rigbook-test-fleet-token-" + "0" * 32 + "\n")
    token.chmod(0o600)
    mirror = converge("deploys/rig.py", "tiny-cpu-a", "--data", "models_mirror_port=8400",
                      "--data", f"models_mirror_token_file={token}")
    assert mirror.returncode != 0, mirror.explain()
    assert "needs systemd, which this rig does not run" in mirror.stderr, mirror.explain()
    assert float(rig_ssh(rig, "nvidia-smi --query-gpu=power.limit --format=csv,noheader,"
                              "nounits").stdout) == 260.0
    assert (supervisor_pid(rig), engine_pid(rig)) == (supervisor, engine)

    # 5. switch to tiny-cpu-b: a stops gracefully, b answers, one engine
    switch = converge("deploys/serve.py", "tiny-cpu-b")
    assert switch.returncode == 0, switch.explain()
    assert engines(rig) == 1 and supervisor_pid(rig) != supervisor
    assert answers(rig, 8101) and not answers(rig, 8100)  # the engines bind the rig's loopback
    log = rig_ssh(rig, f"cat {SERVE_LOG}").stdout
    assert "Finished server process" in log  # uvicorn's graceful shutdown of a, on SIGTERM
    assert "the engine exited with" in log and "did not stop in" not in log  # no SIGKILL

    bump_holds_serving_until_the_venvs_are_rebuilt(rig, tmp_path, revision)


OLD, NEW = "580.95.05", "580.159.04"
HOLD_OP = "NVIDIA driver bump | Stop serving and hold it until the venvs match the new driver"
MOVE_OP = f"NVIDIA driver bump | Move the driver to {NEW}"
HELD = (f"{HOLD_PATH}: serving is held by the driver bump to {NEW}: rebuild the venvs (pyinfra "
        "INVENTORY deploys/venvs.py), which starts it again")
SUPERVISE = f"python3 -I -S {SUPERVISE_PATH} {{}} {SUPERVISE_CONF}"


def rig_epoch(rig: dict, stamp: str) -> float:
    """A time the rig wrote (dpkg.log's, the supervisor log's), as the rig's epoch seconds."""
    return float(rig_ssh(rig, f"date -d '{stamp}' +%s").stdout)


def bump_holds_serving_until_the_venvs_are_rebuilt(rig: dict, tmp_path: Path, revision: str):
    """Steps 6-8 (the docstring), from step 5's state: tiny-cpu-b served on driver OLD."""
    name = rig["name"]
    args = tiny_cpu_args(name, "tiny-cpu-b", revision, power_cap_watts="260")
    assert answers(rig, 8101) and rig_ssh(rig, f"test -e {HOLD_PATH}", check=False).returncode
    built = json.loads(rig_ssh(rig, "cat /opt/rigbook/venvs/tiny-cpu/rigbook-manifest.json").stdout)
    assert built["driver"] == OLD

    # 6. the bump: hold written and the engine stopped, then the driver moved; it stops at the
    # check (no leave to reboot: the old module still runs)
    bump = run_pyinfra(SANDBOX_INVENTORY, "deploys/driver.py", *args,
                       "--data", f"driver_version={NEW}", "--data", "allow_reboot=false")
    assert bump.returncode != 0, bump.explain()
    assert f"driver {NEW} is not running" in bump.stderr, bump.explain()
    said = bump.stdout + bump.stderr  # a failed run prints no results: its log says the order
    assert -1 < said.find(HOLD_OP.split(" | ")[1]) < said.find(MOVE_OP.split(" | ")[1]), (
        bump.explain())
    assert rig_ssh(rig, f"cat {HOLD_PATH}").stdout == HELD.split(": ", 1)[1] + "\n"
    assert engines(rig) == 0 and not answers(rig, 8101)
    stopped = rig_ssh(rig, f"grep 'supervisor exits' {SERVE_LOG} | tail -1").stdout.split()[0]
    moved = rig_ssh(rig, f"grep -m1 ' upgrade nvidia-open:[a-z0-9]* {OLD}-1 {NEW}-1' "
                         "/var/log/dpkg.log").stdout
    assert moved, "dpkg.log has no upgrade of nvidia-open"
    hold_written = float(rig_ssh(rig, f"stat -c %Y {HOLD_PATH}").stdout)
    dpkg_moved = rig_epoch(rig, " ".join(moved.split()[:2]))
    assert hold_written <= dpkg_moved and rig_epoch(rig, stopped) <= dpkg_moved
    said = rig_ssh(rig, SUPERVISE.format("status"), check=False)
    assert said.returncode == 3 and said.stdout == "not running\n"

    # 7. a restart of the container (a power cycle): the new driver loads; the start its
    # entrypoint would run is refused with the hold's line, and said by status
    for action in ("kill", "restart"):
        done = rigbook("sandbox", action, name, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    smi = rig_ssh(rig, "nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    assert smi.stdout.strip() == NEW
    start = rig_ssh(rig, SUPERVISE.format("start"), check=False)
    assert start.returncode == 1 and start.stdout == f"not starting the engine: {HELD}\n"
    said = rig_ssh(rig, SUPERVISE.format("status"), check=False)
    assert said.returncode == 3 and said.stdout.startswith("not running: the start at ")
    assert said.stdout.endswith(f" was refused: {HELD}\n"), said.stdout
    assert engines(rig) == 0
    new_args = [*args, "--data", f"driver_version={NEW}"]
    shown = rigbook("status", status_inventory(tmp_path, new_args), "--limit", name, "--json",
                    check=False)
    (status,) = json.loads(shown.stdout)["rigs"]
    reasons = [finding["reason"] for finding in status["findings"]]
    assert ("serving held by the driver bump until venvs are rebuilt: run deploys/venvs.py "
            f"({HOLD_PATH}; {SUPERVISOR} is stopped)") in reasons, reasons
    held = run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py", *new_args)
    assert held.returncode == 0, held.explain()
    assert f"serving is held by a driver bump ({HOLD_PATH})" in held.stdout + held.stderr, (
        held.explain())
    assert SERVE_OP.format("tiny-cpu-b") not in held.changed() and engines(rig) == 0

    # 8. the rebuild: the venv for NEW, the hold gone, b served again; then nothing to change
    rebuild = run_pyinfra(SANDBOX_INVENTORY, "deploys/venvs.py", *new_args)
    assert rebuild.returncode == 0, rebuild.explain()
    assert rebuild.changed().get("Serving | Start tiny-cpu-b again (the driver bump's hold)") == [
        name], rebuild.explain()
    assert "answers on http://127.0.0.1:8101" in rebuild.stdout + rebuild.stderr
    built = json.loads(rig_ssh(rig, "cat /opt/rigbook/venvs/tiny-cpu/rigbook-manifest.json").stdout)
    assert built["driver"] == NEW
    assert rig_ssh(rig, f"test -e {HOLD_PATH}", check=False).returncode != 0
    assert answers(rig, 8101) and engines(rig) == 1
    said = rig_ssh(rig, SUPERVISE.format("status")).stdout
    assert said == f"running (pid {supervisor_pid(rig)})\n"
    again = run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py", *new_args)
    assert again.returncode == 0, again.explain()
    assert again.changed() == {}, again.changed()


def answers(rig: dict, port: int) -> bool:
    """The rig's own health check of one engine, asked on the rig (its loopback)."""
    asked = rig_ssh(rig, "python3 /opt/rigbook/serving/health.py --once "
                         f"--url http://127.0.0.1:{port}", check=False)
    return asked.returncode == 0 and json.loads(asked.stdout)["ok"] is True


def test_the_nosystemd_rig_is_not_in_the_default_fleet(sandbox):
    assert all(rig["profile"] != "nosystemd-4090" for rig in sandbox.values())
    profiles = json.loads((Path(ROOT) / "sandbox/simulated/profiles.json").read_text())
    assert "nosystemd-4090" not in profiles["rotation"]
