"""Change the GPU power cap across the fleet, and nothing else.

    pyinfra inventory/rigs.py deploys/power_cap.py --data power_cap_watts=290
    pyinfra inventory/rigs.py deploys/power_cap.py --data power_profile=prefill --limit dual_3090

On every rig (all at once) it rewrites /etc/systemd/system/nvidia-power-limit.service and sets
the live caps to match, reading them back. A cap outside a card's range, a GPU count other than
gpu_count or persistence mode off fails that rig with the reason and changes nothing on it; the
other rigs go on. At the end it prints a table of rig / GPU / old / new cap (to stderr, with
pyinfra's own output). docs/runbooks/fleet-cap-change.md walks through it.
"""

from rigbook.jobs import power_cap

power_cap()
