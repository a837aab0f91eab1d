"""A driver no package owns, end to end on the dual-3090 sandbox rig (rig1): refused, then
adopted, converged twice.

The test lays the stand-in driver's files on rig1 without their packages (`dpkg-deb -x` of the
sandbox repository's libnvidia-ml1 and nvidia-smi, as a .run installer leaves files no package
owns) and "loads" its module (the stand-in's /run/rigbook-sim/loaded-version;
sandbox/simulated/README.md). deploys/rig.py then refuses the rig before any change
(`driver_foreign: refuse`, the default), and with `driver_foreign=adopt` while persistence mode
is off; with persistence on (`nvidia-smi -pm 1`, what the owner of such a driver does) and
`driver_foreign=adopt` it converges with no
driver package, hold, pin, source or persistenced drop-in, and a second run changes nothing;
deploys/driver.py to the version that runs changes nothing, to another one is refused.
The rig gets its files removed and no driver afterwards (the next test installs its own).
"""

from __future__ import annotations

import pytest

from rigbook.core.reboot import SIM_LOADED_VERSION
from rigbook.roles.driver import BLACKLIST, PERSISTENCED_DROPIN, PREFERENCES, SOURCES
from tests.conftest import SANDBOX_INVENTORY, rig_ssh, run_pyinfra
from tests.test_driver_e2e import NEW, OLD, forget_driver

pytestmark = pytest.mark.sandbox

DEBS = [f"/srv/rigbook-sim-repo/{name}_{OLD}-1_all.deb" for name in ("libnvidia-ml1", "nvidia-smi")]
#: What the driver role writes on a driver it owns; none of it may appear on an adopted one.
OWNED = (SOURCES, PREFERENCES, BLACKLIST, PERSISTENCED_DROPIN)
STATE = ("dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\\n'; apt-mark showhold; "
         "ls -la /etc/apt/sources.list.d /etc/apt/preferences.d /etc/apt/apt.conf.d "
         "/etc/systemd/system /etc/modprobe.d /etc/sysctl.d 2>&1")


def converge(*data: str):
    return run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py", "--limit", "rig1", *data)


def bump(*data: str):
    return run_pyinfra(SANDBOX_INVENTORY, "deploys/driver.py", "--limit", "rig1", *data)


def unowned_install(rig: dict) -> list[str]:
    """The stand-in driver's files laid out with no package owning them; their paths."""
    listing = rig_ssh(rig, " ; ".join(f"dpkg-deb -c {deb}" for deb in DEBS)).stdout
    paths = [line.split()[-1].removeprefix(".") for line in listing.splitlines()
             if not line.startswith("d")]
    rig_ssh(rig, " && ".join([*(f"dpkg-deb -x {deb} /" for deb in DEBS),
                              f"mkdir -p /run/rigbook-sim && echo {OLD} > {SIM_LOADED_VERSION}"]))
    return paths


def persistence(rig: dict, on: bool) -> None:
    """What the owner of such a driver does (rigbook runs no persistenced for it)."""
    rig_ssh(rig, f"nvidia-smi -pm {int(on)} >/dev/null")


def test_a_driver_no_package_owns_is_refused_then_adopted(sandbox):
    rig1 = sandbox["rig1"]
    forget_driver(rig1)
    paths = unowned_install(rig1)
    try:
        assert "/usr/bin/nvidia-smi" in paths
        assert rig_ssh(rig1, "dpkg-query -S /usr/bin/nvidia-smi", check=False).returncode != 0
        before = rig_ssh(rig1, STATE).stdout

        refused = converge()
        assert refused.returncode != 0, refused.explain()
        said = refused.stdout + refused.stderr
        assert "driver_foreign: driver 580.95.05 whose files no package owns" in said, said
        assert "(/usr/bin/nvidia-smi)" in said and "driver_foreign: adopt" in said, said
        assert "refused before any change" in said, said
        assert refused.changed() == {}, refused.explain()
        assert rig_ssh(rig1, STATE).stdout == before

        # adopted with persistence mode off: refused before any change (the power role would
        # refuse the caps only after other roles changed the rig)
        persistence(rig1, on=False)
        off = converge("--data", "driver_foreign=adopt")
        assert off.returncode != 0 and off.changed() == {}, off.explain()
        assert "persistence mode is off on GPU 0, GPU 1" in off.stdout + off.stderr
        assert rig_ssh(rig1, STATE).stdout == before

        persistence(rig1, on=True)
        adopted = converge("--data", "driver_foreign=adopt")
        assert adopted.returncode == 0, adopted.explain()
        driver_ops = [name for name in adopted.changed() if name.startswith("NVIDIA driver")]
        assert driver_ops == [], adopted.explain()
        present = rig_ssh(rig1, f"ls {' '.join(OWNED)} 2>/dev/null; apt-mark showhold",
                          check=False).stdout
        assert present.strip() == "", present
        packages = rig_ssh(rig1, "dpkg-query -W -f='${Package}\\n' 'nvidia-*' 'libnvidia-*' "
                           "2>/dev/null", check=False).stdout
        assert packages.strip() == "", packages
        assert "Adopted driver" in adopted.stdout + adopted.stderr

        again = converge("--data", "driver_foreign=adopt")
        assert again.returncode == 0, again.explain()
        assert again.changed() == {}, again.explain()

        # the bump: to the version that runs, nothing (no apt-get update, no restart); to
        # another one, refused with the hand-over steps
        same = bump("--data", "driver_foreign=adopt")
        assert same.returncode == 0 and same.changed() == {}, same.explain()
        assert "Bump done: the target is running" in same.stderr, same.explain()
        other = bump("--data", "driver_foreign=adopt", "--data", f"driver_version={NEW}")
        assert other.returncode != 0 and other.changed() == {}, other.explain()
        assert "rigbook cannot move a driver it does not own" in other.stderr, other.explain()
    finally:
        rig_ssh(rig1, f"rm -f {' '.join(paths)} {SIM_LOADED_VERSION}", check=False)
        forget_driver(rig1)
