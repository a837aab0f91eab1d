"""`rigbook status` end to end on the sandbox rigs, through pyinfra's API over their SSH.

One story, in order: converge every rig (deploys/rig.py), then status says every rig is as
declared (exit 0); a cap changed by hand on one GPU of rig1 is drift on that GPU (exit 1); a rig
whose sshd is stopped is reported unreachable while the others are still read (exit 2). The
JSON is validated against the pydantic model each time. status() is called from a small script
(as `rigbook status` will call it), in its own process, as a user runs it.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from roles.status import FleetStatus
from tests.conftest import ROOT, SANDBOX_INVENTORY, rig_ssh, rigbook, run_pyinfra

pytestmark = pytest.mark.sandbox


def rigbook_status(*limit: str, as_json: bool = True) -> subprocess.CompletedProcess:
    script = (
        "import sys; from roles.status import status; "
        f"sys.exit(status({SANDBOX_INVENTORY!r}, {list(limit) or None!r}, {as_json!r}))"
    )
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def fleet_of(done: subprocess.CompletedProcess) -> FleetStatus:
    assert done.stdout.strip(), done.stderr
    return FleetStatus.model_validate_json(done.stdout)


def states(fleet: FleetStatus) -> dict[str, str]:
    return {rig.name: rig.state for rig in fleet.rigs}


def explain(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n--- stdout ---\n{done.stdout[-6000:]}\n--- stderr ---\n" \
           f"{done.stderr[-3000:]}"


def test_status_as_declared_drift_and_unreachable(sandbox):
    names = sorted(sandbox)
    converge = run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py")
    assert converge.returncode == 0, converge.explain()

    # 1. Every rig as the inventory declares it: exit 0, the table says so.
    done = rigbook_status()
    assert done.returncode == 0, explain(done)
    fleet = fleet_of(done)
    assert states(fleet) == {name: "as-declared" for name in names}, explain(done)
    assert fleet.exit_code == 0
    rig1 = next(rig for rig in fleet.rigs if rig.name == "rig1")
    assert len(rig1.gpus) == 2 and rig1.power_unit.present
    for gpu in rig1.gpus:
        assert gpu.cap_desired_w == gpu.cap_unit_w == gpu.cap_live_w, gpu
    table = rigbook_status(as_json=False)
    assert table.returncode == 0, explain(table)
    assert "DRIFT" not in table.stdout and "UNREACHABLE" not in table.stdout, explain(table)
    for name in names:
        assert re.search(rf"│ {name}\s+│ as declared\s+│", table.stdout), explain(table)

    # 2. A cap changed by hand on rig1's first GPU: drift on exactly that GPU, exit 1.
    gpu = rig1.gpus[0]
    desired = gpu.cap_desired_w
    by_hand = 300 if desired != 300 else 310
    rig_ssh(sandbox["rig1"], f"nvidia-smi -i {gpu.uuid} -pl {by_hand}")
    try:
        done = rigbook_status()
        assert done.returncode == 1, explain(done)
        fleet = fleet_of(done)
        assert states(fleet) == {
            name: "drift" if name == "rig1" else "as-declared" for name in names
        }, explain(done)
        drifted = next(rig for rig in fleet.rigs if rig.name == "rig1")
        assert [(f.area, f.gpu, f.reason) for f in drifted.findings if f.level == "drift"] == [
            ("power", gpu.uuid, f"GPU 0: live cap {by_hand} W, inventory {desired:g} W")
        ], explain(done)
        assert [g.cap_live_w for g in drifted.gpus] == [by_hand, rig1.gpus[1].cap_live_w]
    finally:
        rig_ssh(sandbox["rig1"], f"nvidia-smi -i {gpu.uuid} -pl {desired:g}")

    # 3. rig2's sshd stopped: one clear line for it, the others still read, exit 2.
    victim = "rig2" if "rig2" in sandbox else names[-1]
    rig_ssh(sandbox[victim], "systemctl stop ssh")
    try:
        done = rigbook_status()
        assert done.returncode == 2, explain(done)
        fleet = fleet_of(done)
        assert states(fleet) == {
            name: "unreachable" if name == victim else "as-declared" for name in names
        }, explain(done)
        down = next(rig for rig in fleet.rigs if rig.name == victim)
        assert down.error and "Could not connect" in down.error, down
        assert f"{victim}: could not be reached: " in done.stderr, explain(done)
    finally:
        rigbook("sandbox", "restart", victim)

    # The rig is back (sshd enabled, the unit sets the caps again at boot).
    done = rigbook_status(victim)
    assert done.returncode == 0, explain(done)
    assert states(fleet_of(done)) == {victim: "as-declared"}
