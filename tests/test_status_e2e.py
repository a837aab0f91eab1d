"""`rigbook status` end to end on the sandbox rigs, through pyinfra's API over their SSH.

One story, in order: converge every rig (deploys/rig.py), then status says every rig is as
declared (exit 0); a cap changed by hand on one GPU of rig1 is drift on that GPU (exit 1); a rig
whose sshd is stopped is reported unreachable while the others are still read (exit 2). The
JSON is validated against the pydantic model each time. status() is called from a small script
(as `rigbook status` calls it), in its own process, as a user runs it.

A second story gives rig1 a small venv (from the wheelhouse, as tests/test_venvs_e2e.py does)
and a model through an inventory file that adds host data to inventory/sandbox.py: the venv
is current, then stale once its manifest names another driver; the model, absent from the HF
cache, is drift, and a cached repo that models does not list is a warning.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from rigbook.core.pins import VENVS_DIR
from rigbook.core.spec import Rig
from rigbook.roles.venvs import MANIFEST
from rigbook.status import FleetStatus
from tests.conftest import ROOT, SANDBOX_INVENTORY, rig_ssh, rigbook, run_pyinfra
from tests.standins import fill_wheelhouse

pytestmark = pytest.mark.sandbox


def rigbook_status(*limit: str, as_json: bool = True) -> subprocess.CompletedProcess:
    return rigbook_status_of(SANDBOX_INVENTORY, *limit, as_json=as_json)


def rigbook_status_of(inventory: str, *limit: str, as_json: bool = True
                      ) -> subprocess.CompletedProcess:
    script = (
        "import sys; from rigbook.status_table import status; "
        f"sys.exit(status({inventory!r}, {list(limit) or None!r}, {as_json!r}))"
    )
    # piped, the table takes COLUMNS when set (pytest sets it for its own terminal)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})


def fleet_of(done: subprocess.CompletedProcess) -> FleetStatus:
    assert done.stdout.strip(), done.stderr
    return FleetStatus.model_validate_json(done.stdout)


def states(fleet: FleetStatus) -> dict[str, str]:
    return {rig.name: rig.state for rig in fleet.rigs}


def explain(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n--- stdout ---\n{done.stdout[-6000:]}\n--- stderr ---\n" \
           f"{done.stderr[-3000:]}"


#: Sets one card's health readings in the simulator's live state (sandbox/simulated/README.md).
SET_HEALTH = (
    "python3 -c 'import json; p = \"/run/rigbook-sim/state.json\"; s = json.load(open(p)); "
    "s[\"{uuid}\"][\"health\"] = {health}; json.dump(s, open(p, \"w\"))'"
)


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

    # 2b. rig1's second GPU reports uncorrected ECC errors and a failed row remapping (the
    # simulator's live state, as the driver would count them): drift on that GPU, exit 1.
    sick = rig1.gpus[1]
    rig_ssh(sandbox["rig1"], SET_HEALTH.format(uuid=sick.uuid, health=json.dumps({
        "ecc.errors.uncorrected.volatile.total": "3", "remapped_rows.failure": "Yes"})))
    try:
        done = rigbook_status("rig1")
        assert done.returncode == 1, explain(done)
        [rig] = fleet_of(done).rigs
        assert [(f.level, f.gpu, f.reason.split(":")[1].strip()) for f in rig.findings
                if f.area == "health"] == [
            ("drift", sick.uuid, "3 uncorrected ECC error(s) since the driver loaded"),
            ("drift", sick.uuid, "a row remapping failed"),
        ], explain(done)
    finally:
        rig_ssh(sandbox["rig1"], SET_HEALTH.format(uuid=sick.uuid, health="{}"))

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


# --- venvs and the HF cache, read from a rig that declares them --------------------------------

VENV = "statusdemo"
PIN = "six==1.16.0"
ABSENT = ("rigbook-test/absent", "e" * 40)
UNLISTED = "models--rigbook-test--unlisted"
CACHE = Rig.model_fields["models_cache"].default
#: The sandbox inventory with extra host data for rig1 (the other rigs as they are).
EXTRA_INVENTORY = '''
import inventory.sandbox as _sandbox

sandbox_rigs = [(name, {{**data, **{extra!r}}}) if name == "rig1" else (name, data)
                for name, data in _sandbox.sandbox_rigs]
'''


def inventory_with(folder, name: str, **extra) -> str:
    """An inventory file: inventory/sandbox.py with `extra` host data on rig1."""
    path = folder / f"{name}.py"
    path.write_text(EXTRA_INVENTORY.format(extra=extra))
    return str(path)


def test_status_reads_venvs_and_the_models_cache(sandbox, tmp_path):
    """A venv built by the converge is current; made stale (its manifest names another driver)
    it is drift with the rebuild to run; a declared model not in the cache is drift and a cached
    repo that models does not list is a warning, both read by the models role's own probe."""
    rig1 = sandbox["rig1"]
    fill_wheelhouse()
    venvs = [{"name": VENV, "engine": "none", "python": "3.11", "packages": [PIN]}]
    with_venv = inventory_with(tmp_path, "venv", venvs=venvs)
    try:
        built = run_pyinfra(with_venv, "deploys/rig.py", "--limit", "rig1")
        assert built.returncode == 0, built.explain()

        done = rigbook_status_of(with_venv, "rig1")
        assert done.returncode == 0, explain(done)
        (rig,) = fleet_of(done).rigs
        (venv,) = rig.venvs
        assert venv.state == "current", rig.findings
        assert venv.built_driver == venv.running_driver == "580.95.05"
        assert venv.build.startswith(f"{VENV}-{venv.spec_hash}-")

        manifest = f"{VENVS_DIR}/{VENV}/{MANIFEST}"
        rig_ssh(rig1, "python3 -c \"import json, sys; m = json.load(open(sys.argv[1])); "
                      "m['driver'] = '580.76.05'; json.dump(m, open(sys.argv[1], 'w'))\" "
                      f"{manifest}")
        rig_ssh(rig1, f"mkdir -p {CACHE}/{UNLISTED}/blobs && "
                      f"head -c 4096 /dev/zero > {CACHE}/{UNLISTED}/blobs/0")
        declared = inventory_with(tmp_path, "declared", venvs=venvs, models=[
            {"repo": ABSENT[0], "revision": ABSENT[1]}])
        done = rigbook_status_of(declared, "rig1")
        assert done.returncode == 1, explain(done)
        (rig,) = fleet_of(done).rigs
        assert [(v.name, v.state, v.built_driver) for v in rig.venvs] == [
            (VENV, "stale", "580.76.05")]
        assert [(m.repo, m.state) for m in rig.models] == [(ABSENT[0], "missing")]
        assert [(f.level, f.area, f.reason) for f in rig.findings
                if f.area in ("venvs", "models")] == [  # in the registry's order of roles
            ("drift", "venvs", f"venv {VENV}: stale: built for driver 580.76.05, running "
                               "580.95.05: run deploys/venvs.py"),
            ("drift", "models", f"model {ABSENT[0]}@{ABSENT[1][:12]} missing: not in the cache "
                                f"{CACHE}; run deploys/models.py"),
            ("warn", "models", "cached but not in models: 1 repo(s), 0.00 MiB: "
                               "rigbook-test/unlisted (0.00 MiB); models_prune: true removes "
                               "them"),
        ]
        table = rigbook_status_of(declared, "rig1", as_json=False)
        assert table.returncode == 1, explain(table)
        assert f"x venv {VENV}: stale: built for driver 580.76.05" in table.stdout, explain(table)
    finally:
        rig_ssh(rig1, f"rm -rf {VENVS_DIR}/{VENV} {VENVS_DIR}/{VENV}-* {VENVS_DIR}/.{VENV}* "
                      f"{VENVS_DIR}/{VENV}.env {CACHE}/{UNLISTED}", check=False)
