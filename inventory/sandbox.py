"""pyinfra inventory of the local sandbox rigs that `rigbook sandbox up` started.

    pyinfra inventory/sandbox.py deploys/rig.py

Reads hosts.json from the sandbox state dir (RIGBOOK_SANDBOX_DIR, default
/var/lib/rigbook/sandbox); without it, says to run `rigbook sandbox up` first. A rig's host data
is its SSH login plus PROFILE_DATA for its simulated hardware profile: exactly what a user would
write for a real rig of that kind, except that the driver comes from the local repository of
stand-in packages that the sandbox mounts at /srv/rigbook-sim-repo.
"""

from rigbook.inventory import check_before_connecting
from rigbook.sandbox import REPO_MOUNT, WHEELS_MOUNT, rigs

_SIM_DRIVER = {
    "driver_branch": 580,
    "driver_version": "580.95.05",
    "driver_repo_uri": f"file:{REPO_MOUNT}",
    "driver_repo_trusted": True,
    "allow_reboot": True,
}

# Rigs have no route out: Python packages come only from the wheelhouse mounted read-only.
_SIM_PYTHON = {"python_find_links": WHEELS_MOUNT, "python_no_index": True}

# Host data per simulated hardware profile (sandbox/simulated/profiles.json).
PROFILE_DATA = {
    "dual-3090": {
        "platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2, "cooling": "air",
        "shm_size": "2G", "stale_files": ["/etc/sysctl.d/99-vllm-swap.conf"], **_SIM_DRIVER,
        **_SIM_PYTHON,
    },
    "single-4090": {
        "platform": "debian", "gpu_class": "rtx4090", "gpu_count": 1, "shm_size": "1G",
        **_SIM_DRIVER, **_SIM_PYTHON,
    },
    "wsl2-3090": {"platform": "wsl2", "gpu_class": "rtx3090", "gpu_count": 1, **_SIM_PYTHON},
    # Not in the rotation (`rigbook sandbox add PROFILE`): Ubuntu rigs built from Ubuntu's
    # archive, whose own sources offer the driver: the local repository (Ubuntu's names),
    # named as the source a mirror you control would be. The branch, as Ubuntu's archive keeps
    # only a branch's newest version. And Debian 13.
    "noble-3090": {
        "platform": "ubuntu", "gpu_class": "rtx3090", "gpu_count": 1, "driver_branch": 580,
        "driver_repo_uri": f"file:{REPO_MOUNT}", "allow_reboot": True,
    },
    "resolute-4090": {
        "platform": "ubuntu", "gpu_class": "rtx4090", "gpu_count": 1, "driver_branch": 580,
        "driver_repo_uri": f"file:{REPO_MOUNT}", "allow_reboot": True,
    },
    "trixie-4090": {
        "platform": "debian", "gpu_class": "rtx4090", "gpu_count": 1, **_SIM_DRIVER,
    },
    # Not in the rotation (`rigbook sandbox add nosystemd-4090`): no systemd as PID 1.
    "nosystemd-4090": {
        "platform": "debian", "gpu_class": "rtx4090", "gpu_count": 1, **_SIM_DRIVER,
        "allow_reboot": False, **_SIM_PYTHON,
    },
}


def _rig(entry: dict) -> tuple[str, dict]:
    return entry["name"], {
        "ssh_hostname": entry["address"],
        "ssh_user": "root",
        "ssh_key": entry["ssh_key"],
        "ssh_strict_host_key_checking": "off",
        "ssh_known_hosts_file": "/dev/null",
        **PROFILE_DATA[entry["profile"]],
    }


sandbox_rigs = [_rig(entry) for entry in rigs()]

# Check every host this run selects before pyinfra connects, from whatever folder it runs in
# (config.py is loaded only from the working folder): last, once the hosts above exist.
check_before_connecting()
