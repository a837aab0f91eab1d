"""The way back out, end to end on a fresh sandbox rig (single-4090, added for this file only
and removed at the end, so the default fleet is unchanged), through the pyinfra CLI.

The rig's file list is taken before anything ran; deploys/rig.py converges it (driver, holds,
tuning, guards, power unit, caps), then it serves tests/recipes' tiny CPU recipe (its venv, its
model in the HF cache, rigbook-serve.service and its user, as tests/test_serving_e2e.py
serves); `deploys/offboard.py --dry` changes nothing; the offboard
then leaves none of rigbook's files (docs/footprint.md), units, user or holds: the file list
is the one from before, but for what the offboard keeps (the driver's packages and apt source,
the HF cache) and what the system itself changes (apt's and dpkg's state, the journal); the
caps are the cards' defaults again. A second offboard changes nothing; one with
`offboard_remove: [venvs, models]` leaves only the driver's files.
"""

from __future__ import annotations

import pytest

from rigbook.core.pins import VENVS_DIR
from rigbook.inventory import parse_rig
from rigbook.roles.offboard import FOOTPRINT, UNITS, kept
from rigbook.roles.serving import SERVE_USER, UNIT_NAME
from tests.conftest import SANDBOX_INVENTORY, added_rig, rig_ssh, run_pyinfra
from tests.standins import place_model, wheelhouse_for_llama
from tests.test_serving_e2e import CONVERGE, tiny_cpu_args
from tests.tinymodel import FILE, revision_of, write_tiny_gguf

pytestmark = pytest.mark.sandbox


def profile_data() -> dict:
    """The single-4090 profile's host data. Imported here, not at the top: the sandbox
    inventory reads the running rigs when imported, and none run while tests are collected."""
    from inventory.sandbox import PROFILE_DATA

    return PROFILE_DATA["single-4090"]

#: Folders whose content the system changes by itself, or that this file's runs use.
CHURN = ("/proc", "/sys", "/dev/pts", "/tmp", "/var/tmp", "/var/log/journal", "/var/cache",
         "/var/lib/apt", "/var/lib/dpkg", "/var/log/apt", "/var/lib/systemd", "/run/systemd",
         "/run/user", "/run/lock/rigbook", "/run/rigbook-sim", "/var/lib/rigbook-sim",
         "/root/.cache", "/srv")
#: The file list: every path, with its kind, but for CHURN.
LISTING = ("find / " + " ".join(f"-path {p} -prune -o" for p in CHURN)
           + " -printf '%y %p\\n' | grep -v -e ' /var/log/dpkg.log$' -e ' /var/log/alternatives"
           ".log$' | sort")


@pytest.fixture(scope="module")
def fresh_rig(sandbox):
    """One single-4090 rig nothing has touched, removed (with all it left) at the end."""
    with added_rig("single-4090") as rig:
        yield rig


#: What the kept driver's stand-in packages write from their maintainer scripts (dpkg does not
#: list them: sandbox/simulated/debian/*.postinst) or their daemon at run time, and adduser's
#: lock (tmpfs): none of it rigbook's.
NOT_RIGBOOKS = ("/run/nvidia-persistenced", "/usr/lib/systemd/system/nvidia-persistenced.service",
                "/usr/lib/systemd/system/rigbook-sim-driver.service",
                "/etc/systemd/system/multi-user.target.wants/rigbook-sim-driver.service",
                "/run/adduser")


def files(rig: dict) -> set[str]:
    return set(rig_ssh(rig, LISTING).stdout.splitlines())


def under(path: str, tops) -> bool:
    """Whether `path` is one of `tops`, in one, or a folder that holds one."""
    return any(path == top or path.startswith(top.rstrip("/") + "/")
               or top.startswith(path.rstrip("/") + "/") for top in tops)


def package_files(rig: dict) -> set[str]:
    """What dpkg says the installed packages own (kept: the driver stays)."""
    out = rig_ssh(rig, "dpkg-query -W -f '${Package}\\n' | xargs dpkg -L 2>/dev/null").stdout
    return set(out.splitlines())


def test_offboard_leaves_nothing_of_rigbook(fresh_rig, tmp_path):
    name = fresh_rig["name"]
    before = files(fresh_rig)
    assert not any(line.split(" ", 1)[1].startswith(item.path) for line in before
                   for item in FOOTPRINT), "the fresh rig already has rigbook's files"

    converge = run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py", "--limit", name)
    assert converge.returncode == 0, converge.explain()
    wheelhouse_for_llama()  # then serving, as tests/test_serving_e2e.py serves: venv, model
    gguf = write_tiny_gguf(tmp_path / FILE)
    revision = revision_of(gguf)
    place_model(fresh_rig, gguf, revision)
    serve = run_pyinfra(SANDBOX_INVENTORY, CONVERGE,
                        *tiny_cpu_args(name, "tiny-cpu-a", revision))
    assert serve.returncode == 0, serve.explain()
    assert rig_ssh(fresh_rig, f"systemctl is-active {UNIT_NAME}").stdout.strip() == "active"
    held = rig_ssh(fresh_rig, "apt-mark showhold").stdout.split()
    assert held, "the converge held the driver"
    caps = rig_ssh(fresh_rig, "nvidia-smi --query-gpu=power.limit,power.default_limit "
                   "--format=csv,noheader,nounits").stdout
    assert any(a.strip() != b.strip() for a, b in (line.split(",") for line in caps.splitlines()))

    dry = run_pyinfra(SANDBOX_INVENTORY, "deploys/offboard.py", "--limit", name, "--dry")
    assert dry.returncode == 0, dry.explain()
    assert rig_ssh(fresh_rig, "apt-mark showhold").stdout.split() == held, "--dry changed it"

    off = run_pyinfra(SANDBOX_INVENTORY, "deploys/offboard.py", "--limit", name)
    assert off.returncode == 0, off.explain()
    assert rig_ssh(fresh_rig, "apt-mark showhold").stdout.split() == []
    units = rig_ssh(fresh_rig, "systemctl list-unit-files --no-legend " + " ".join(UNITS),
                    check=False).stdout
    assert units.strip() == "", units
    assert rig_ssh(fresh_rig, f"id {SERVE_USER}", check=False).returncode != 0
    caps = rig_ssh(fresh_rig, "nvidia-smi --query-gpu=power.limit,power.default_limit "
                   "--format=csv,noheader,nounits").stdout
    assert all(float(a) == float(b) for a, b in (line.split(",") for line in caps.splitlines()))

    after = files(fresh_rig)
    owned = package_files(fresh_rig)
    keep = kept(parse_rig(name, profile_data()))
    assert "/etc/apt/sources.list.d/rigbook-nvidia.sources" in keep  # kept with the driver
    new = sorted(line for line in after - before
                 if not under(path := line.split(" ", 1)[1], (*keep, *NOT_RIGBOOKS))
                 and path not in owned)
    assert new == [], "left on the rig:\n" + "\n".join(new)
    gone = sorted(before - after)
    assert gone == [], "removed what was there before:\n" + "\n".join(gone)

    again = run_pyinfra(SANDBOX_INVENTORY, "deploys/offboard.py", "--limit", name)
    assert again.returncode == 0, again.explain()
    assert again.changed() == {}, again.changed()
    assert rig_ssh(fresh_rig, f"ls {VENVS_DIR}").stdout.split() != []  # kept

    # asked for: the venvs and the models go too, and only the driver's files stay
    asked = run_pyinfra(SANDBOX_INVENTORY, "deploys/offboard.py", "--limit", name,
                        "--data", 'offboard_remove=["venvs", "models"]')
    assert asked.returncode == 0, asked.explain()
    keep = kept(parse_rig(name, {**profile_data(),
                                 "offboard_remove": ["venvs", "models"]}))
    assert keep == ("/etc/apt/sources.list.d/rigbook-nvidia.sources",
                    "/etc/modprobe.d/rigbook-blacklist-nouveau.conf")
    new = sorted(line for line in files(fresh_rig) - before
                 if not under(path := line.split(" ", 1)[1], (*keep, *NOT_RIGBOOKS))
                 and path not in owned)
    assert new == [], "left on the rig:\n" + "\n".join(new)
