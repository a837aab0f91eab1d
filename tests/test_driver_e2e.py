"""The NVIDIA driver end to end on the dual-3090 sandbox rig (rig1), driven by the pyinfra CLI.

One story, in order, because each step starts from the state the last one left: the converge
installs 580.95.05 from the sandbox's repository and holds it; a plain `apt-get upgrade -y`
(what unattended-upgrades would do) leaves it although 580.159.04 is offered; the second
converge changes nothing; deploys/driver.py without leave to reboot installs 580.159.04 and
stops at the check, saying a reboot is needed; with leave it reboots into it and verifies, and
the driver stays held; the same bump again is refused; a converge whose inventory still pins
the old version refuses to move the driver back; the bump back to 580.95.05 leaves the rig as
its inventory says. The WSL2 rig (rig3) gets no Linux driver, only a check of the Windows one.
The stand-in driver is simulated (sandbox/simulated): after an upgrade its nvidia-smi fails
with a version mismatch until the rig reboots, as a real driver does.
"""

from __future__ import annotations

import pytest

from roles.driver import BLACKLIST, PERSISTENCED_DROPIN, PREFERENCES
from tests.conftest import SANDBOX_INVENTORY, rig_ssh, run_pyinfra

pytestmark = pytest.mark.sandbox

#: The stand-in packages of the sandbox repository (NVIDIA's Debian-repository names).
PACKAGES = ("libnvidia-ml1", "nvidia-kernel-open-dkms", "nvidia-open", "nvidia-persistenced",
            "nvidia-smi")
OLD, NEW = "580.95.05", "580.159.04"
CONVERGE = "deploys/rig.py"
BUMP = "deploys/driver.py"


def versions(rig: dict) -> dict[str, str]:
    """Installed version per stand-in package (absent: not installed)."""
    out = rig_ssh(rig, "dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\\n'").stdout
    return {
        name: version
        for status, name, version in (line.split() for line in out.splitlines())
        if status[1] == "i" and name in PACKAGES
    }


def holds(rig: dict) -> set[str]:
    return set(rig_ssh(rig, "apt-mark showhold").stdout.split())


def smi_driver(rig: dict) -> str:
    done = rig_ssh(rig, "nvidia-smi --query-gpu=driver_version --format=csv,noheader", check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split()[0]


def driver_changes(run) -> dict[str, list[str]]:
    return {name: hosts for name, hosts in run.changed().items() if "NVIDIA driver" in name}


def forget_driver(rig: dict) -> None:
    """Undo what an earlier test may have left: no driver, no driver files, no loaded module."""
    rig_ssh(rig, " ; ".join((
        f"apt-mark unhold {' '.join(PACKAGES)} >/dev/null 2>&1",
        f"DEBIAN_FRONTEND=noninteractive apt-get purge -y {' '.join(PACKAGES)} >/dev/null 2>&1",
        f"rm -f /etc/apt/sources.list.d/rigbook-nvidia.sources {PREFERENCES} {BLACKLIST} "
        f"{PERSISTENCED_DROPIN} /run/rigbook-sim/loaded-version",
        "systemctl daemon-reload",
    )), check=False)


def test_driver_install_hold_bump_refuse(sandbox):
    rig1, rig3 = sandbox["rig1"], sandbox["rig3"]
    forget_driver(rig1)

    # 1. First converge: the pinned driver from the sandbox repository, held, blacklisted,
    #    persistence mode on. WSL2 gets no package, only the check of the Windows driver.
    first = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1", "--limit", "rig3")
    assert first.returncode == 0, first.explain()
    assert versions(rig1) == {name: f"{OLD}-1" for name in PACKAGES}
    assert holds(rig1) >= set(PACKAGES)
    assert smi_driver(rig1) == OLD
    assert '"nvidia-";' in rig_ssh(rig1, f"cat {BLACKLIST}").stdout
    listed = rig_ssh(rig1, "apt-config dump Unattended-Upgrade::Package-Blacklist").stdout
    assert 'Unattended-Upgrade::Package-Blacklist:: "libnvidia-";' in listed
    unit = rig_ssh(rig1, "systemctl show -p ExecStart nvidia-persistenced").stdout
    assert "--user nvidia-persistenced --verbose" in unit and "--no-persistence-mode" not in unit
    assert rig_ssh(rig1, "systemctl is-active nvidia-persistenced").stdout.strip() == "active"
    assert versions(rig3) == {}
    assert not any("rig3" in hosts for hosts in driver_changes(first).values()), first.explain()

    # 2. What unattended-upgrades would do: upgrade everything. 580.159.04 is offered, the
    #    hold keeps 580.95.05 (the apt pin is moved aside so the hold alone is tested).
    offered = rig_ssh(rig1, "apt-get update -qq && apt-cache madison nvidia-open").stdout
    assert f"{NEW}-1" in offered
    upgrade = rig_ssh(rig1, f"mv {PREFERENCES} /root/pin && DEBIAN_FRONTEND=noninteractive "
                      f"apt-get upgrade -y; rc=$?; mv /root/pin {PREFERENCES}; exit $rc")
    assert "kept back" in upgrade.stdout or "held" in upgrade.stdout, upgrade.stdout
    assert versions(rig1) == {name: f"{OLD}-1" for name in PACKAGES}
    assert smi_driver(rig1) == OLD

    # 3. Second converge: nothing to do.
    second = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1", "--limit", "rig3")
    assert second.returncode == 0, second.explain()
    assert second.changed() == {}, second.explain()

    # 4. The bump without leave to reboot: installed and held, but it stops at the check,
    #    which says why (the old module still runs, so nvidia-smi fails).
    halted = run_pyinfra(SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                         "--data", f"driver_version={NEW}", "--data", "allow_reboot=false")
    assert halted.returncode != 0
    assert (f"reboot needed (driver {NEW} is installed but the loaded module is {OLD}); "
            "allow_reboot is false: reboot the rig") in halted.stderr, halted.explain()
    assert f"driver {NEW} is not running: nvidia-smi fails: " in halted.stderr
    assert versions(rig1) == {name: f"{NEW}-1" for name in PACKAGES}
    assert holds(rig1) >= set(PACKAGES)
    assert rig_ssh(rig1, "nvidia-smi -L", check=False).returncode != 0

    # 5. The bump with leave to reboot: the rig reboots into the new driver, still held.
    bump = run_pyinfra(SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                       "--data", f"driver_version={NEW}", "--data", "allow_reboot=true")
    assert bump.returncode == 0, bump.explain()
    changed = driver_changes(bump)
    assert f"NVIDIA driver bump | Move the driver to {NEW}" not in changed  # done in step 4
    assert changed.get("NVIDIA driver bump | Reboot into the new driver") == ["rig1"], (
        bump.explain()
    )
    assert versions(rig1) == {name: f"{NEW}-1" for name in PACKAGES}
    assert holds(rig1) >= set(PACKAGES)
    assert smi_driver(rig1) == NEW
    # no venvs on this rig: nothing built for the old driver, so no "Next: rebuild" step
    assert "Next: rebuild the venvs" not in bump.stderr, bump.explain()

    # 6. The same bump again: done, it says so and changes nothing (a success: exit 0).
    again = run_pyinfra(SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                        "--data", f"driver_version={NEW}")
    assert again.returncode == 0 and again.changed() == {}, again.explain()
    assert f"driver {NEW} is already running: nothing to bump" in again.stderr, again.explain()
    assert versions(rig1) == {name: f"{NEW}-1" for name in PACKAGES}

    # 7. A converge whose inventory still pins the old version never moves the driver back;
    #    with the inventory at the new version it has nothing to do.
    stale = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1")
    assert stale.returncode != 0
    assert f"installed {NEW}, inventory pins {OLD}; allowed: the installed driver" in stale.stderr
    assert versions(rig1) == {name: f"{NEW}-1" for name in PACKAGES}
    current = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1",
                          "--data", f"driver_version={NEW}")
    assert current.returncode == 0 and current.changed() == {}, current.explain()

    # 8. Back to the inventory's version (a downgrade is a bump too), for whatever runs next.
    back = run_pyinfra(SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                       "--data", f"driver_version={OLD}", "--data", "allow_reboot=true")
    assert back.returncode == 0, back.explain()
    assert driver_changes(back).get(f"NVIDIA driver bump | Move the driver to {OLD}") == ["rig1"]
    assert versions(rig1) == {name: f"{OLD}-1" for name in PACKAGES}
    assert holds(rig1) >= set(PACKAGES)
    assert smi_driver(rig1) == OLD
