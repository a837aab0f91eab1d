"""rigbook's own roles for the subset the peers converge: driver, tuning, guards, power.

    pyinfra inventory/sandbox.py bench/peers/rigbook_subset.py

deploys/rig.py without the WSL2, venvs, models and serving roles, so the bench compares like
with like; the roles still do what they always do beyond the peers' subset (the preflight
checks, onboarding, persistence mode, live caps, topology report).
"""

from pyinfra import host

from rigbook.inventory import rig_of
from rigbook.preflight import deferred_checks, preflight
from rigbook.registry import BY_NAME, checks_of

SUBSET = ("driver", "tuning", "guards", "power")
rig = rig_of(host)

if preflight(rig, checks_of(*SUBSET)):
    first, *rest = (BY_NAME[name] for name in SUBSET)
    first.converge(rig)
    deferred_checks(rig)
    for role in rest:
        role.converge(rig)
