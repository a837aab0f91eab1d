"""The preflight end to end: a rig that will be refused changes nothing; the others converge.

deploys/rig.py runs on the three sandbox rigs, each defect on its own rig beside a good rig,
twice per defect: on fresh rigs (just booted, no driver) and on converged rigs. Every run also
asks for changes that would otherwise apply (a new inotify value, a new leftover file), so a
refused rig that changed anything would show it. What "nothing changed" means is measured, not
assumed: pyinfra's --json results, and checksums of every file under /etc (the unit files
included) and /opt/rigbook taken before and after.

A defect that only the GPUs can show (their count, their UUIDs, their power range, the VRAM
they have free) cannot be seen on a rig with no driver yet: there the preflight defers those
checks, the driver role installs the driver, and the checks refuse the rig right after it,
before tuning, guards, power, venvs or serving touch it (asserted below from the results and
from the files those roles would write).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from rigbook.roles.power import UNIT_PATH
from rigbook.roles.tuning import SYSCTL_CONF
from tests.conftest import PYINFRA, ROOT, PyinfraRun, rig_ssh, rigbook

pytestmark = pytest.mark.sandbox

INVENTORY = "tests/inventories/sandbox_overrides.py"
RECIPES = str(ROOT / "tests" / "recipes")
GUARDS = "/opt/rigbook/guards"
GPU_CHECK_OP = "Check the GPUs now that the driver is in"
#: Files whose contents say whether a rig changed (sorted `sha256sum` lines).
CHECKSUMS = ("find /etc /opt/rigbook -xdev -type f -print0 2>/dev/null | sort -z "
             "| xargs -0 sha256sum")
#: What every run asks of every rig on top of its defect: changes a good rig makes.
ASKED = {"sysctl_inotify_max_user_instances": 2048}
NEW_LEFTOVER = "/etc/sysctl.d/98-old-tuning.conf"
TINY_VENV = [{"name": "tiny-cpu", "engine": "llama-cpp-python", "python": "3.11",
              "packages": ["llama-cpp-python[server]==0.3.35"]}]
FAT_RECIPE = {"recipe": "tiny-gpu-fat", "serving_recipe_dirs": [RECIPES], "venvs": TINY_VENV,
              "models": [{"repo": "local/tiny", "revision": "1" * 40}]}
#: Another process holds 8 GiB of each simulated card (the simulator's fixed data).
BUSY_VRAM = ("python3 -c \"import json; p='/etc/rigbook-sim/gpus.json'; d=json.load(open(p)); "
             "[g.update(memory_used_mib=8192) for g in d['gpus']]; "
             "json.dump(d, open(p, 'w'), indent=2)\"")

# (rig, host data that is wrong for it, needs the GPUs to be seen, what the refusal says)
DEFECTS = {
    "gpu_count": ("rig1", {"gpu_count": 3}, True, "gpu_count: declared 3, nvidia-smi lists 2"),
    "power_caps UUID": ("rig2", {"power_caps": {"GPU-00000000-0000-0000-0000-000000000000": 300}},
                        True, "power_caps: names GPU GPU-00000000-0000-0000-0000-000000000000"),
    "cap range": ("rig1", {"power_cap_watts": 450}, True,
                  "asks 450 W (power_cap_watts); allowed: the card's range 100-400 W"),
    "shm above RAM": ("rig2", {"shm_size": "4096G"}, False,
                      "shm_size: asked 4096G (4096.0 GiB) but the host has"),
    "sysctl key": ("rig2", {"sysctl_extra": {"vm.no_such_key": 1}}, False,
                   "sysctl_extra: this kernel has no vm.no_such_key"),
    "VRAM": ("rig1", FAT_RECIPE, True, "recipe: recipe tiny-gpu-fat: VRAM: GPU 0 (NVIDIA GeForce "
             "RTX 3090): the recipe needs 23.0 GiB, 16.0 GiB is free (8.0 GiB held by others, "
             "1.0 GiB kept per card)"),
    "platform": ("rig3", {"platform": "debian"}, False,
                 "platform: declared debian but this host is WSL2"),
}
#: Two defects per run on two rigs; the third rig is the good one.
ROUNDS = (("gpu_count", "power_caps UUID"), ("cap range", "shm above RAM"),
          ("VRAM", "sysctl key"), ("platform",))


def deploy(overrides: dict[str, dict]) -> PyinfraRun:
    """deploys/rig.py with --json on the sandbox rigs, each with its own host data."""
    proc = subprocess.run(
        [PYINFRA, "-y", "--json", INVENTORY, "deploys/rig.py"], cwd=ROOT, capture_output=True,
        text=True, timeout=900,
        env={**os.environ, "PYINFRA_PROGRESS": "off",
             "RIGBOOK_TEST_OVERRIDES": json.dumps(overrides)},
    )
    results = json.loads(proc.stdout).get("results") if proc.stdout.strip() else None
    return PyinfraRun(proc.returncode, proc.stdout, proc.stderr, results)


def touched(run: PyinfraRun, rig: str) -> list[str]:
    """Operations that ran on the rig at all (changed, no change or failed)."""
    return [op["name"] for op in run.results["operations"]
            if rig in op["success"] + op["error"] + op["no_change"]]


def checksums(rig: dict) -> str:
    return rig_ssh(rig, CHECKSUMS).stdout


def fresh(sandbox) -> None:
    """New rigs in place of the old ones (same names and addresses): no driver, nothing."""
    rigbook("sandbox", "up", str(len(sandbox)))


def run_round(sandbox, defects: tuple[str, ...], converged: bool) -> None:
    bad = {DEFECTS[d][0]: d for d in defects}
    good = sorted(set(sandbox) - set(bad))
    asked = {name: {**ASKED, "stale_files": [NEW_LEFTOVER]} for name in sandbox}
    overrides = {name: {**asked[name], **DEFECTS[d][1]} for name, d in bad.items()}
    overrides.update({name: asked[name] for name in good})
    for name in sandbox:
        rig_ssh(sandbox[name], f"echo 'vm.swappiness = 10' > {NEW_LEFTOVER}")
    if "VRAM" in defects:
        rig_ssh(sandbox[DEFECTS["VRAM"][0]], BUSY_VRAM)
    before = {name: checksums(sandbox[name]) for name in bad}

    run = deploy(overrides)

    assert run.returncode == 1, run.explain()
    for name, defect in bad.items():
        _, _, needs_gpus, says = DEFECTS[defect]
        assert says in run.stderr, (defect, run.explain())
        if converged or not needs_gpus:
            assert touched(run, name) == [], (defect, touched(run, name))
            assert checksums(sandbox[name]) == before[name], defect
        else:  # the driver went in, then the GPU checks refused the rig before anything else
            ran = [op["name"] for op in run.results["operations"]
                   if name in op["success"] + op["no_change"]]
            failed = [op["name"] for op in run.results["operations"] if name in op["error"]]
            assert failed[0] == GPU_CHECK_OP, (defect, failed)  # later ones never ran
            assert all(op.startswith("NVIDIA driver | ") for op in ran), (defect, ran)
            files = rig_ssh(sandbox[name], f"ls {SYSCTL_CONF} {GUARDS} {UNIT_PATH}", check=False)
            assert files.stdout == "", (defect, files.stdout)
            assert rig_ssh(sandbox[name], f"test -e {NEW_LEFTOVER}", check=False).returncode == 0
    for name in good:  # the good rig converged, the asked changes included
        changed = [op for op in touched(run, name) if name in next(
            o["success"] for o in run.results["operations"] if o["name"] == op)]
        assert f"Host tuning | Write {SYSCTL_CONF}" in changed, (name, run.explain())
        assert f"Host tuning | Remove leftover {NEW_LEFTOVER}" in changed, name
        assert "max_user_instances = 2048" in rig_ssh(sandbox[name], f"cat {SYSCTL_CONF}").stdout


@pytest.mark.parametrize("defects", ROUNDS, ids=["+".join(r) for r in ROUNDS])
def test_a_refused_rig_changes_nothing_fresh_or_converged(sandbox, defects):
    fresh(sandbox)
    run_round(sandbox, defects, converged=False)
    fresh(sandbox)
    first = deploy({})  # converge every rig as the inventory says
    assert first.returncode == 0, first.explain()
    run_round(sandbox, defects, converged=True)


def test_dry_run_of_a_refused_rig_plans_nothing_and_exits_non_zero(sandbox):
    proc = subprocess.run(
        [PYINFRA, "--dry", "--json", INVENTORY, "deploys/power_cap.py"], cwd=ROOT,
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYINFRA_PROGRESS": "off", "RIGBOOK_TEST_OVERRIDES": json.dumps(
            {"rig1": {"power_cap_watts": 450}, "rig2": {"power_cap_watts": 300}})},
    )
    assert proc.returncode == 1, proc.stderr
    plan = json.loads(proc.stdout)["plan"]
    assert not [op for op in plan if "rig1" in op["hosts_with_change"]], plan
    assert "asks 450 W (power_cap_watts); allowed: the card's range 100-400 W" in proc.stderr
