"""Sweep the GPU power cap and bench the running recipe at each step; the caps restored after.

    pyinfra inventory/rigs.py deploys/power_sweep.py --data sweep_watts=250:350:10
    pyinfra inventory/rigs.py deploys/power_sweep.py --data sweep_watts=250,290 --limit dual_3090

Per rig: every asked cap is checked against every card's own range before anything changes (a
refused rig changes nothing); then each cap is set live (never the boot unit), the verify bench
runs (decode at 1 stream, concurrent where the engine allows it, prefill) while the rig's draw
is sampled, and at the end a guard on the rig sets every live cap back to what
nvidia-power-limit.service says, also when a step fails or this process is killed. Results:
JSON and a PNG beside the verify results; `rigbook bench sweep` tables them. docs/sweep.md.
"""

from rigbook.jobs import power_sweep

power_sweep()
