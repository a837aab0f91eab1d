"""The controlled driver bump: move every rig to its driver_version, on purpose.

    pyinfra inventory/rigs.py deploys/driver.py                                   # inventory's
    pyinfra inventory/rigs.py deploys/driver.py --data driver_version=580.159.04 \\
        --data allow_reboot=true                                                  # one-off

Per rig: refuse when the target already runs; otherwise unhold, install the target, hold again,
reboot when allow_reboot, check that nvidia-smi reports the target, then say what to run next
(rebuild the venvs, restart serving). A rig that fails a step stops there and keeps its hold;
the other rigs go on. docs/runbooks/driver-bump.md has the whole procedure.
"""

from rigbook.jobs import driver_bump

driver_bump()
