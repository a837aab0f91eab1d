"""An example fleet: edit the hosts and their data.

Each top-level list is a pyinfra group; a host is (name, data). Data every rig of this file
shares lives in inventory/group_data/rigs.py (the group named after this file). Every key is
documented in docs/host-data.md. The addresses are documentation addresses (RFC 5737): replace
them with your rigs' before you run a deploy.
"""

from rigbook.inventory import check_before_connecting

dual_3090 = [
    (
        "rig-dual3090",
        {
            "ssh_hostname": "192.0.2.21",
            "platform": "ubuntu",
            "gpu_class": "rtx3090",
            "gpu_count": 2,
            "cooling": "air",
            "nvlink": False,
            "shm_size": "48G",
            "stale_files": ["/etc/sysctl.d/99-vllm-swap.conf"],
        },
    ),
]

single_5090 = [
    (
        "rig-5090",
        {
            "ssh_hostname": "192.0.2.22",
            "platform": "ubuntu",
            "gpu_class": "rtx5090",
            "gpu_count": 1,
            "driver_branch": 595,
        },
    ),
]

wsl2 = [
    (
        "rig-wsl3090",
        {
            "ssh_hostname": "192.0.2.23",
            "platform": "wsl2",
            "gpu_class": "rtx3090",
            "gpu_count": 1,
            "power_profile": "prefill",
        },
    ),
]

# Check every host this run selects before pyinfra connects, from whatever folder it runs in
# (config.py is loaded only from the working folder): last, once the hosts above exist.
check_before_connecting()
