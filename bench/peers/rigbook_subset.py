"""rigbook's own roles for the subset the peers converge: driver, tuning, guards, power.

    pyinfra inventory/sandbox.py bench/peers/rigbook_subset.py

deploys/rig.py without the WSL2, venvs, models and serving roles, so the bench compares like
with like; the roles still do what they always do beyond the peers' subset (the preflight
checks, onboarding, persistence mode, live caps, topology report).
"""

from pyinfra import host

from rigbook.core.spec import rig_of
from rigbook.preflight import deferred_checks, preflight
from rigbook.roles import driver, guards, power, tuning

rig = rig_of(host)

if preflight(rig, driver.CHECKS, tuning.CHECKS, guards.CHECKS, power.CHECKS):
    driver.driver(rig)
    deferred_checks(rig)
    tuning.host_tuning(rig)
    guards.guards(rig)
    power.power_limit(rig)
