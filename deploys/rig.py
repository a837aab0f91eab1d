"""The full converge of a rig: driver, tuning, WSL2 host settings, power, venvs, models, serving.

    pyinfra inventory/rigs.py deploys/rig.py

Every role reads facts and changes only what differs, so a second run reports no changes.
Order matters: the driver (and its reboot, when allowed) comes first so that the power role
finds the GPUs it caps. The guards (/dev/shm reaper, Xid watch, the serving unit's drop-in,
topology report; docs/guards.md) come before the power caps: they need no GPU, and must be in
place before anything serves.
"""

from pyinfra import host

from roles.driver import driver
from roles.guards import guards
from roles.models import models
from roles.power import power_limit
from roles.serving import serving
from roles.spec import rig_of
from roles.tuning import host_tuning
from roles.venvs import venvs
from roles.wsl import wsl_host

rig = rig_of(host)

driver(rig)
host_tuning(rig)
wsl_host(rig)
guards(rig)
power_limit(rig)
venvs(rig)
models(rig)
serving(rig)
