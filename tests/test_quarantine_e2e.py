"""The reaper's quarantine on a sandbox rig (rig2) across its install and a reboot (issue 29,
finding 7): `mkdir /dev/shm/.rigbook-quarantine` by another user used to stop the reaper.

The install makes the quarantine with the reaper's `--prepare`, not `systemd-tmpfiles
--create`: on a live rig tmpfiles hands a stray folder of that name to root as it is, its
maker's files inside (seen here first). Every boot makes it with tmpfiles.d, on the fresh
/dev/shm, before any user runs: root's, 0700, empty, with whatever stood there before the boot
gone; another user can neither take its name nor look in, and the reaper uses it as it is.
"""

from __future__ import annotations

import pytest

from rigbook.roles.guards import QUARANTINE_TMPFILES, REAPER_UNIT
from tests.conftest import SANDBOX_INVENTORY, rigbook, run_pyinfra
from tests.test_guards_e2e import QUARANTINE, RIG, exists, guarded, journal, ssh

pytestmark = pytest.mark.sandbox

__all__ = ["guarded"]  # the guards deployed on rig2 (a fixture of tests/test_guards_e2e.py)

PLANTED = f"{QUARANTINE}/vllm_offload_planted.mmap"


@pytest.fixture(scope="module", autouse=True)
def new_rigs(sandbox):
    """New rigs before `guarded` deploys the guards: its first run must find rig2 without them,
    and an earlier module's converge may have left them there."""
    rigbook("sandbox", "up", str(len(sandbox)))


def stat_of(path: str) -> str:
    return ssh(f"stat -c '%u %a %F' {path}").stdout.strip()


def plant_stray() -> None:
    """What a local user can do while root's quarantine is missing: take its name."""
    ssh(f"rm -rf {QUARANTINE} && runuser -u nobody -- mkdir -m 777 {QUARANTINE} && "
        f"runuser -u nobody -- truncate -s 1M {PLANTED}")


def test_the_install_sets_a_stray_aside_where_tmpfiles_would_hand_it_to_root(guarded):
    # The finding: systemd-tmpfiles --create makes nobody's folder root's 0700, planted file in.
    plant_stray()
    ssh(f"systemd-tmpfiles --create {QUARANTINE_TMPFILES}")
    assert stat_of(QUARANTINE) == "0 700 directory"
    assert stat_of(PLANTED) == "65534 644 regular file"

    # The install (its tmpfiles.d entry new): the stray is renamed aside, unread, and the
    # quarantine made empty; the second run changes nothing.
    plant_stray()
    ssh(f"rm -f {QUARANTINE_TMPFILES}")
    try:
        first = run_pyinfra(SANDBOX_INVENTORY, guarded, "--limit", RIG)
        assert first.returncode == 0, first.explain()
        assert first.changed() == {
            "Rig guards | Make the reaper's quarantine at every boot (tmpfiles.d, root 0700)":
                [RIG],
            "Rig guards | Make the reaper's quarantine now (tmpfiles.d changed)": [RIG],
        }, first.explain()
        assert stat_of(QUARANTINE) == "0 700 directory"
        assert ssh(f"ls -A {QUARANTINE}").stdout == ""
        assert ssh(f"stat -c '%u' {QUARANTINE}.stray-*").stdout.split() == ["65534"]
        assert ssh(f"ls -A {QUARANTINE}.stray-*").stdout.split() == ["vllm_offload_planted.mmap"]
        second = run_pyinfra(SANDBOX_INVENTORY, guarded, "--limit", RIG)
        assert second.returncode == 0 and second.changed() == {}, second.explain()
    finally:
        ssh(f"rm -rf {QUARANTINE}.stray-*")


def test_every_boot_makes_the_quarantine_root_0700_and_what_stood_there_is_gone(guarded):
    plant_stray()
    ssh(f"mkdir {QUARANTINE}.stray-1-0 && touch {QUARANTINE}.stray-1-0/left")  # an earlier one
    rigbook("sandbox", "restart", RIG)

    assert stat_of(QUARANTINE) == "0 700 directory"
    assert ssh(f"ls -A {QUARANTINE}").stdout == ""
    assert not exists(f"{QUARANTINE}.stray-1-0")  # /dev/shm is a fresh tmpfs every boot
    # Made by the boot's tmpfiles.d, not by a reaper run (none ran this boot).
    assert ssh(f"systemctl show -P ExecMainStartTimestampMonotonic {REAPER_UNIT}"
               ).stdout.strip() == "0"
    # Another user can neither take its name nor look in.
    taken = ssh(f"runuser -u nobody -- mkdir {QUARANTINE}", check=False)
    assert taken.returncode != 0 and "File exists" in taken.stderr, taken
    looked = ssh(f"runuser -u nobody -- ls {QUARANTINE}", check=False)
    assert looked.returncode != 0 and "Permission denied" in looked.stderr, looked

    # The reaper uses the boot's folder as it is: no stray, the same inode afterwards.
    inode = ssh(f"stat -c %i {QUARANTINE}").stdout.strip()
    ssh("truncate -s 1M /dev/shm/vllm_offload_after_boot.mmap")
    done = ssh(f"systemctl start {REAPER_UNIT}", check=False)
    log = journal(REAPER_UNIT)
    assert done.returncode == 0, log
    assert "reaped /dev/shm/vllm_offload_after_boot.mmap (" in log, log
    assert not [line for line in log.splitlines() if line.startswith("set aside")], log
    assert ssh(f"stat -c %i {QUARANTINE}").stdout.strip() == inode
    assert stat_of(QUARANTINE) == "0 700 directory"
