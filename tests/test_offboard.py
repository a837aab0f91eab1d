"""The offboard's list of what rigbook writes (roles/offboard.py), held against the roles."""

from __future__ import annotations

import importlib
import subprocess

import pytest

from rigbook.core.errors import RigbookError
from rigbook.inventory import parse_rig
from rigbook.roles.offboard import (
    FOOTPRINT,
    MODELS_CACHE,
    RIGBOOK_SHM_ERE,
    RIGBOOK_SHM_LINE,
    ROOTS,
    footprint,
    kept,
)
from rigbook.roles.tuning import fstab_line
from tests.test_layers import modules

#: Where rigbook writes; a path constant of a role under one of these is rigbook's.
WRITES_UNDER = ("/etc/", "/opt/rigbook", "/var/lib/rigbook", "/var/log/rigbook", "/run/rigbook",
                "/root/", "/usr/share/keyrings", "/run/lock/rigbook", "/dev/shm/")
#: Path constants that are not rigbook's own file, each with why.
NOT_IN_FOOTPRINT = {
    "/usr/share/keyrings/cuda-archive-keyring.gpg": "the cuda-keyring package's (kept with it)",
    "/etc/apt/sources.list.d/cuda-debian12-x86_64.list": "cuda-keyring's, removed by the driver",
    "/etc/systemd/system": "systemd's folder",
    "/etc/fstab": "one line of it: shm_default",
    "/run/lock/rigbook/run.lock": "the run lock every deploy takes (tmpfs)",
    "/run/rigbook-sim/modules": "the sandbox's simulation",
    "/run/rigbook-sim/loaded-version": "the sandbox's simulation",
    "/etc/rigbook-sim/ubuntu-archive.sources": "an Ubuntu sandbox rig's image (its real indexes)",
    "/var/lib/rigbook-sim/ubuntu-lists": "an Ubuntu sandbox rig's image (its real indexes)",
    "/var/lib/rigbook-sim/hwmon": "the sandbox's stand-in PSU telemetry (simulation)",
}


def _path_constants() -> dict[str, str]:
    found = {}
    for module in modules():
        loaded = importlib.import_module(module)
        for name, value in vars(loaded).items():
            if name.isupper() and isinstance(value, str) and value.startswith(WRITES_UNDER):
                found[value] = f"{module}.{name}"
    return found


def test_every_path_a_role_writes_is_in_the_footprint():
    covered = [item.path for item in FOOTPRINT] + list(ROOTS)
    missing = {path: where for path, where in _path_constants().items()
               if path not in NOT_IN_FOOTPRINT
               and not any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered)}
    assert missing == {}


def test_kept_by_default_and_removed_when_asked():
    rig = parse_rig("r", {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 1,
                          "models_cache": "/srv/hf"})
    assert "/srv/hf" in kept(rig) and "/opt/rigbook/venvs" in kept(rig)
    assert "/etc/apt/sources.list.d/rigbook-nvidia.sources" in kept(rig)
    assert MODELS_CACHE not in [item.path for item in footprint(rig)]
    everything = rig.model_copy(update={"offboard_remove": ("driver", "venvs", "models")})
    assert kept(everything) == ()


@pytest.mark.parametrize("value", [["all"], ["venvs", "/"], "venvs"])
def test_offboard_remove_takes_only_what_it_names(value):
    with pytest.raises(RigbookError, match="offboard_remove"):
        parse_rig("r", {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 1,
                        "offboard_remove": value})


OTHERS = [
    "# tmpfs /dev/shm tmpfs defaults,size=2G 0 0",  # a comment
    "tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=2G 0 0",  # the operator's own options
    "none /dev/shm tmpfs defaults,size=2G 0 0",
    "tmpfs /dev/shm tmpfs defaults,size=2G 0 0 extra",
    "UUID=0a1b / ext4 errors=remount-ro 0 1",
]


@pytest.mark.parametrize("size", ["2G", "48G", "512M", "50%"])
def test_sed_takes_out_the_shm_line_rigbook_writes_and_nothing_else(size):
    """The sed program shm_default runs, on an fstab with rigbook's line among others."""
    line = fstab_line(size)
    assert RIGBOOK_SHM_LINE.fullmatch(line)
    fstab = "\n".join([OTHERS[-1], line, *OTHERS[:-1]]) + "\n"
    out = subprocess.run(["sed", "-E", f"\\|{RIGBOOK_SHM_ERE}|d"], input=fstab,
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [OTHERS[-1], *OTHERS[:-1]]


@pytest.mark.parametrize("line", OTHERS)
def test_an_shm_line_rigbook_did_not_write_stays(line):
    assert not RIGBOOK_SHM_LINE.fullmatch(line.strip())
