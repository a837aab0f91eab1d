"""Power caps end to end on the dual-3090 sandbox rig (rig1), driven by the pyinfra CLI.

One story, in order, because each step starts from the state the last one left: converge (the
driver, its reboot, then the unit and the caps), converge again (nothing), a fleet cap change
(exactly the unit and the live caps), a reboot (the unit sets the cap again), a cap the cards do
not allow (refused by the preflight, nothing changes) run together with the 4090 rig (which
allows it and goes on), and the WSL2 rig (nothing to change there: the cap is reported with the
command to run on Windows).
The rig's cards are simulated RTX 3090s: min 100 W, max 400 W, default 350 W.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time

import pytest

from rigbook.rigside.gpus import Gpu, parse_query_csv, query_args
from rigbook.roles.guards import (
    GPU_LOST_HEADLINE,
    GPU_LOST_MARK,
    GUARDS_DIR,
    SERVE_DROPIN,
    WATCH,
    XID_COPY,
)
from rigbook.roles.power import UNIT_NAME, UNIT_PATH
from rigbook.roles.serving import (
    CAP_CHECK_PATH,
    CAP_CHECK_SOURCE,
    SERVE_HOME,
    SERVE_USER,
    VENV_CHECK_PATH,
    render_unit,
    serve_plan,
)
from rigbook.status import FleetStatus
from tests.conftest import SANDBOX_INVENTORY, rig_ssh, rigbook, run_pyinfra
from tests.test_serving import SMI, dual_rig

pytestmark = pytest.mark.sandbox

UNIT_OP = f"Power limits | Power-limit unit ({UNIT_NAME})"
LIVE_OP = "Power limits | Live GPU power caps"


def gpus(rig: dict, smi: str = "nvidia-smi") -> list[Gpu]:
    """The rig's GPUs as its nvidia-smi reports them, read with rigbook's own parser."""
    return parse_query_csv(rig_ssh(rig, f"{smi} {query_args(header=True)}").stdout)


def live_caps(rig: dict) -> list[float]:
    return [gpu.power_limit_w for gpu in gpus(rig)]


def unit_text(rig: dict) -> str | None:
    done = rig_ssh(rig, f"cat {UNIT_PATH}", check=False)
    return done.stdout if done.returncode == 0 else None


def exec_starts(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("ExecStart=")]


def forget_power_caps(rig: dict) -> None:
    """Undo what an earlier test may have left: no unit, and the cards at their default cap."""
    rig_ssh(rig, f"systemctl disable {UNIT_NAME}; rm -f {UNIT_PATH}; systemctl daemon-reload",
            check=False)
    if rig_ssh(rig, "nvidia-smi -L", check=False).returncode == 0:
        for gpu in gpus(rig):
            rig_ssh(rig, f"nvidia-smi -i {gpu.uuid} -pl {gpu.default_limit_w:g}")


def reboot(rig: dict) -> None:
    """Restart the rig and wait until the power unit ran at boot (it must end active)."""
    rigbook("sandbox", "restart", rig["name"])
    deadline = time.monotonic() + 90
    while True:
        state = rig_ssh(rig, f"systemctl is-active {UNIT_NAME}", check=False).stdout.strip()
        if state in ("active", "failed") or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert state == "active", rig_ssh(rig, f"systemctl status {UNIT_NAME}", check=False)


def power_changes(run) -> dict[str, list[str]]:
    return {name: hosts for name, hosts in run.changed().items() if name.startswith("Power")}


def test_power_caps_converge_change_survive_reboot_and_refuse(sandbox):
    rig1 = sandbox["rig1"]
    forget_power_caps(rig1)
    try:
        # 1. First converge: the driver (and its reboot) first, then the unit and the caps.
        first = run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py", "--limit", "rig1")
        assert first.returncode == 0, first.explain()
        assert power_changes(first) == {UNIT_OP: ["rig1"], LIVE_OP: ["rig1"]}, first.explain()
        cards = gpus(rig1)
        assert len(cards) == 2
        assert [gpu.power_limit_w for gpu in cards] == [290.0, 290.0]  # 3090 air sweet spot
        text = unit_text(rig1)
        assert text is not None
        smi = rig_ssh(rig1, "command -v nvidia-smi").stdout.strip()
        assert exec_starts(text) == [f"ExecStart=-{smi} -i {gpu.uuid} -pl 290" for gpu in cards]
        for line in ("Type=oneshot", "RemainAfterExit=yes", "After=nvidia-persistenced.service",
                     "Requires=nvidia-persistenced.service", "WantedBy=multi-user.target"):
            assert line in text.splitlines()
        assert rig_ssh(rig1, f"systemctl is-enabled {UNIT_NAME}").stdout.strip() == "enabled"

        # 2. Second run: the power role has nothing to do, in the converge and on its own.
        second = run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py", "--limit", "rig1")
        assert second.returncode == 0, second.explain()
        assert power_changes(second) == {}, second.explain()
        alone = run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", "--limit", "rig1")
        assert alone.returncode == 0, alone.explain()
        assert alone.changed() == {}, alone.explain()

        # 3. The fleet cap change: exactly the unit and the live caps, with a table of them.
        change = run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", "--limit", "rig1",
                             "--data", "power_cap_watts=300")
        assert change.returncode == 0, change.explain()
        assert change.changed() == {UNIT_OP: ["rig1"], LIVE_OP: ["rig1"]}, change.explain()
        assert live_caps(rig1) == [300.0, 300.0]
        text = unit_text(rig1)
        assert exec_starts(text) == [f"ExecStart=-{smi} -i {gpu.uuid} -pl 300" for gpu in cards]
        assert "GPU power caps" in change.stderr
        for gpu in cards:
            row = rf"rig1\W+{gpu.index} {re.escape(gpu.uuid)}\W+290 W\W+300 W\W+set\b"
            assert re.search(row, change.stderr), change.explain()
        again = run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", "--limit", "rig1",
                            "--data", "power_cap_watts=300")
        assert again.returncode == 0 and again.changed() == {}, again.explain()

        # 4. A reboot forgets the live cap; the unit sets it again at boot.
        reboot(rig1)
        assert live_caps(rig1) == [300.0, 300.0]

        # 5. One pass over two rigs at once: rig1 refuses a cap outside its cards' range in the
        # preflight and changes nothing; the 4090 rig, whose range allows it, goes on.
        rig2 = sandbox["rig2"]
        converged = run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py", "--limit", "rig2")
        assert converged.returncode == 0, converged.explain()
        mixed = run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", "--limit", "rig1",
                            "--limit", "rig2", "--data", "power_cap_watts=500")
        assert mixed.returncode != 0, mixed.explain()
        assert mixed.changed() == {UNIT_OP: ["rig2"], LIVE_OP: ["rig2"]}, mixed.explain()
        assert json.loads(mixed.stdout)["results"]["failed_hosts"] == ["rig1"]
        for gpu in cards:
            assert (
                f"rig1: power_cap_watts: GPU {gpu.index} ({gpu.uuid}) asks 500 W "
                "(power_cap_watts); allowed: the card's range 100-400 W"
            ) in mixed.stderr, mixed.explain()
        assert unit_text(rig1) == text
        assert live_caps(rig1) == [300.0, 300.0]
        assert live_caps(rig2) == [500.0]

        # 6. The WSL2 rig: no unit, no cap change; the live cap is reported with the command
        # to run on Windows.
        rig3 = sandbox["rig3"]
        wsl = run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", "--limit", "rig3",
                          "--data", "power_cap_watts=300", "-v")
        assert wsl.returncode == 0 and wsl.changed() == {}, wsl.explain()
        assert unit_text(rig3) is None
        row = r"rig3\W+0 GPU-\S+\W+350 W\W+350 W\W+WSL2: set on the Windows host"
        assert re.search(row, wsl.stderr), wsl.explain()
        (wsl_gpu,) = gpus(rig3, "/usr/lib/wsl/lib/nvidia-smi")
        assert wsl_gpu.power_limit_w == 350.0
        assert f"nvidia-smi -i {wsl_gpu.uuid} -pl 300" in wsl.stderr, wsl.explain()
    finally:
        # Leave rig1 and rig2 as their inventory says (sweet spot), for whatever runs next.
        run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", "--limit", "rig1", "--limit",
                    "rig2")


# A stand-in for rigbook-serve.service (in /run: gone at reboot) carrying the real unit of a GPU
# recipe (its user, sandbox and pre-start checks, and the guards' drop-in), with an "engine" that
# only sleeps, an environment file that sets PYTHONPATH to a folder of the engine's user, and no
# Restart= (a refused start stays refused).
STAND_IN = "rigbook-test-capped.service"
STAND_IN_PATH = f"/run/systemd/system/{STAND_IN}"
TEST_ENV = "/run/rigbook-test/engine.env"
GPUS_FILE = "/etc/rigbook-sim/gpus.json"
PLANTED = f"{SERVE_HOME}/planted"
#: What the engine's user plants to switch the checks off (issue 29, 2).
PLANT = (f"site=$(HOME={SERVE_HOME} python3 -c 'import site; print(site.getusersitepackages())')"
         f" && mkdir -p \"$site\" {PLANTED} && echo 'import os; os._exit(0)' > \"$site/off.pth\""
         f" && echo 'import os; os._exit(0)' > {PLANTED}/sitecustomize.py")


def capped_stand_in() -> str:
    real = render_unit(serve_plan(dual_rig(), "rig1"), SMI).splitlines()
    unit = [line for line in real if line.startswith(("Requires=", "After="))]
    service = real[real.index("[Service]") + 1:real.index("[Install]")]
    # the venv check (a driver bump's hold, the venv's driver) has its own tests
    # (tests/test_venv_check.py, the driver-bump runbook): this stand-in has no venv to check
    service = [line for line in service if not line.startswith(
        ("ExecStart=", "EnvironmentFile=", "Restart", "#")) and VENV_CHECK_PATH not in line]
    assert len(unit) == 2 and [line for line in service if CAP_CHECK_PATH in line], real
    return "\n".join(["[Unit]", *unit, "[Service]", *service, f"EnvironmentFile={TEST_ENV}",
                      "ExecStart=/bin/sleep infinity", ""])


def install_stand_in(rig: dict) -> None:
    rig_ssh(rig, f"mkdir -p {TEST_ENV.rsplit('/', 1)[0]} {STAND_IN_PATH}.d && echo "
                 f"PYTHONPATH={PLANTED} > {TEST_ENV} && cp {SERVE_DROPIN} {STAND_IN_PATH}.d/ && "
                 f"cat > {STAND_IN_PATH} <<'RIGBOOK_EOF'\n{capped_stand_in()}"
                 "RIGBOOK_EOF\nsystemctl daemon-reload")


def as_engine_user(rig: dict, command: str) -> subprocess.CompletedProcess:
    return rig_ssh(rig, f"runuser -u {SERVE_USER} -- sh -c {shlex.quote(command)}", check=False)


def start(rig: dict) -> tuple[bool, str]:
    """Start the stand-in: (whether it runs, the cap check's line from its journal)."""
    rig_ssh(rig, f"systemctl reset-failed {STAND_IN}", check=False)
    since = rig_ssh(rig, "date +%s.%N").stdout.strip()
    started = rig_ssh(rig, f"systemctl restart {STAND_IN}", check=False).returncode == 0
    said = rig_ssh(rig, f"journalctl -u {STAND_IN} -o cat --no-pager --since @{since}").stdout
    return started, said


def test_an_engine_never_starts_uncapped_and_a_replaced_card_fails_only_its_own_line(sandbox):
    rig1 = sandbox["rig1"]
    converged = run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py", "--limit", "rig1")
    assert converged.returncode == 0, converged.explain()
    cards = gpus(rig1)
    assert [gpu.power_limit_w for gpu in cards] == [290.0, 290.0]
    created = rig_ssh(rig1, f"id -u {SERVE_USER}", check=False).returncode != 0
    if created:  # as the serving role makes it
        rig_ssh(rig1, f"useradd --system --user-group --create-home --home-dir {SERVE_HOME} "
                      f"--shell /usr/sbin/nologin {SERVE_USER}")
    rig_ssh(rig1, f"mkdir -p {CAP_CHECK_PATH.rsplit('/', 1)[0]} && cat > {CAP_CHECK_PATH} "
                  f"<<'RIGBOOK_EOF'\n{CAP_CHECK_SOURCE.read_text()}RIGBOOK_EOF")
    install_stand_in(rig1)
    rig_ssh(rig1, f"cp {GPUS_FILE} {GPUS_FILE}.orig")
    try:
        # 0. The engine's user plants a .pth in its site folder and a sitecustomize.py on the
        # unit's PYTHONPATH; it can write nothing the checks run or read.
        planted = as_engine_user(rig1, PLANT)
        assert planted.returncode == 0, planted.stderr
        for path in (CAP_CHECK_PATH, CAP_CHECK_PATH.rsplit("/", 1)[0], "/opt/rigbook", GUARDS_DIR,
                     WATCH, XID_COPY, SERVE_DROPIN, UNIT_PATH):
            assert as_engine_user(rig1, f"test -w {path}").returncode == 1, path
            assert rig_ssh(rig1, f"stat -c %U {path}").stdout.strip() == "root", path

        # 1. Caps as the unit says: the engine starts (as the unprivileged user), after the
        # checks ran (they print their line: the plants did not stop them).
        started, said = start(rig1)
        assert started, said
        assert f"caps as the unit says: {cards[0].uuid} 290 W, {cards[1].uuid} 290 W" in said
        pid = rig_ssh(rig1, f"systemctl show -p MainPID --value {STAND_IN}").stdout.strip()
        assert rig_ssh(rig1, f"ps -o user= -p {pid}").stdout.strip() == SERVE_USER
        # A GPU-lost mark refuses the start (the guards' drop-in), plants or not.
        rig_ssh(rig1, f"systemctl stop {STAND_IN}; mkdir -p {GPU_LOST_MARK.rsplit('/', 1)[0]} "
                      f"&& echo '{GPU_LOST_HEADLINE}' > {GPU_LOST_MARK}")
        try:
            started, said = start(rig1)
        finally:
            rig_ssh(rig1, f"rm -f {GPU_LOST_MARK}")
        assert not started and f"{GPU_LOST_MARK}: {GPU_LOST_HEADLINE}" in said, said

        # 2. A live cap changed behind the unit's back: the start is refused, with both values.
        rig_ssh(rig1, f"systemctl stop {STAND_IN}; nvidia-smi -i {cards[1].uuid} -pl 350")
        started, said = start(rig1)
        assert not started
        assert f"{cards[1].uuid} runs at a 350 W cap, the unit says 290 W" in said, said
        # The check as it ran before (as the engine's user, in the unit's environment) passes.
        old = as_engine_user(rig1, f"HOME={SERVE_HOME} PYTHONPATH={PLANTED} /usr/bin/python3 "
                                   f"{CAP_CHECK_PATH} --unit {UNIT_PATH} --tolerance 0.5")
        assert (old.returncode, old.stdout, old.stderr) == (0, "", ""), old

        # 3. Card 1 is replaced (a new UUID) and the rig boots: the power unit still caps card 0
        # and ends active, as card 1's line fails alone; the new card runs at its default.
        replaced = cards[1].uuid[:-4] + "beef"
        rig_ssh(rig1, f"python3 -c \"import json; p='{GPUS_FILE}'; d=json.load(open(p)); "
                      f"d['gpus'][1]['uuid']='{replaced}'; json.dump(d, open(p, 'w'))\"")
        reboot(rig1)
        assert live_caps(rig1) == [290.0, 350.0]
        failed = rig_ssh(rig1, f"journalctl -b -u {UNIT_NAME} -o cat --no-pager").stdout
        assert "No devices were found" in failed and "Finished nvidia-power-limit" in failed, failed
        install_stand_in(rig1)  # it lived in /run
        started, said = start(rig1)
        assert not started
        assert f"{cards[1].uuid} (capped at 290 W by the unit) is not listed" in said, said
        assert f"{replaced} is not capped by the unit" in said, said
        status = FleetStatus.model_validate_json(
            rigbook("status", SANDBOX_INVENTORY, "--json", "--limit", "rig1", check=False).stdout)
        (row,) = status.rigs
        assert ("drift", "power", f"nvidia-power-limit.service caps {cards[1].uuid}, which "
                "nvidia-smi does not list") in [(f.level, f.area, f.reason) for f in row.findings]

        # 4. The fleet cap converge writes the new card's line and caps it; the engine starts.
        fixed = run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", "--limit", "rig1")
        assert fixed.returncode == 0, fixed.explain()
        assert live_caps(rig1) == [290.0, 290.0]
        started, said = start(rig1)
        assert started, said
    finally:
        rig_ssh(rig1, f"systemctl stop {STAND_IN}; rm -rf {STAND_IN_PATH} {STAND_IN_PATH}.d "
                      f"{TEST_ENV} {PLANTED} {SERVE_HOME}/.local {CAP_CHECK_PATH}; "
                      f"mv {GPUS_FILE}.orig {GPUS_FILE}; systemctl daemon-reload"
                      + (f"; userdel -r {SERVE_USER}" if created else ""), check=False)
        run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", "--limit", "rig1")
