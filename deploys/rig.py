"""The full converge of a rig: driver, tuning, WSL2 host settings, power, venvs, models, serving.

    pyinfra inventory/rigs.py deploys/rig.py

Every role reads facts and changes only what differs, so a second run reports no changes.
The preflight runs every role's checks first (rigbook/preflight.py): a rig that would be refused
changes nothing. Order matters: the driver (and its reboot, when allowed) comes first so that
the power role finds the GPUs it caps; on a rig without a driver yet, the GPU checks run right
after it. The guards (/dev/shm reaper, Xid watch, the serving unit's drop-in, topology report;
docs/guards.md) come before the power caps: they need no GPU, and must be in place before
anything serves.
"""

from rigbook.jobs import converge

converge()
