"""Rebuild the serving venvs that the running driver made stale, and restart what uses them.

    pyinfra inventory/rigs.py deploys/venvs.py
    pyinfra inventory/rigs.py deploys/venvs.py --limit rig-dual3090 --data rebuild_all=true

After a driver bump every venv built for the old driver is stale (its manifest names the driver
it was built with). On each rig (all at once) this builds a fresh copy of exactly those venvs
next to the working one, smoke-tests it against the new driver, swaps the stable symlink to it
and restarts (if running) the systemd units listed in that venv's `services`; it also builds
venvs that are missing or whose spec changed, as the converge does. Then, where a driver bump
held serving (deploys/driver.py stops it and keeps it from starting), it starts the rig's recipe
again and waits until it answers. `--data rebuild_all=true`
rebuilds every venv, stale or not. A build that fails fails that rig with the reason and leaves
its working venv in place; the other rigs go on. docs/runbooks/rebuild-venvs.md walks through it.
"""

from pyinfra import host

from rigbook.preflight import preflight
from rigbook.serving import resume_after_bump, settle_held
from rigbook.spec import rig_of
from rigbook.venvs import REBUILD_CHECKS, venvs
from rigbook.wsl import PLATFORM

rig = rig_of(host)
if preflight(rig, [PLATFORM], REBUILD_CHECKS):
    settle_held(rig)  # a unit held by a driver bump: its restart loop ended, not restarted
    venvs(rig, rebuild_stale=True)
    resume_after_bump(rig)
