"""The full converge of a rig: driver, host tuning, WSL2 host settings, power caps.

    pyinfra inventory/rigs.py deploys/rig.py

Every role reads facts and changes only what differs, so a second run reports no changes.
Order matters: the driver (and its reboot, when allowed) comes first so that the power role
finds the GPUs it caps.
"""

from pyinfra import host

from roles.driver import driver
from roles.power import power_limit
from roles.spec import rig_of
from roles.tuning import host_tuning
from roles.wsl import wsl_host

rig = rig_of(host)

driver(rig)
host_tuning(rig)
wsl_host(rig)
power_limit(rig)
