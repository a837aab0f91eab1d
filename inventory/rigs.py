"""An example fleet: edit the hosts and their data.

Each top-level list is a pyinfra group; a host is (name, data). Data every rig of this file
shares lives in inventory/group_data/rigs.py (the group named after this file). Every key is
documented in docs/host-data.md. The addresses are documentation addresses (RFC 5737): replace
them with your rigs' before you run a deploy.
"""

from rigbook.core.pins import engine_venv
from rigbook.inventory import check_before_connecting

#: The commit of Lorbus/Qwen3.6-27B-int4-AutoRound this fleet serves. The all-zeros value is
#: no commit: every deploy refuses it before connecting, naming the command to run, until you
#: paste the one that `rigbook models resolve Lorbus/Qwen3.6-27B-int4-AutoRound` prints
#: (docs/models.md). No published commit of that repo could be confirmed from here, so none is
#: shipped: a guessed one would pull something nobody checked.
QWEN36_27B_INT4 = "0000000000000000000000000000000000000000"

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
            # Serving (docs/serving.md): the venv the recipe runs from, built with rigbook's
            # engine pins (vllm-0.33, CUDA 13.0: docs/venvs.md); the model it serves, pinned
            # to one commit and pulled into the HF cache (docs/models.md); and the recipe, the
            # one docs/recipes.md says to start with on two 24 GB cards without NVLink.
            "venvs": [engine_venv("vllm", services=["rigbook-serve.service"])],
            "models": [
                {"repo": "Lorbus/Qwen3.6-27B-int4-AutoRound", "revision": QWEN36_27B_INT4},
            ],
            "recipe": "qwen36-27b-dual-3090",
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
