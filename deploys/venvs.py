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

from rigbook.jobs import venvs_rebuild

venvs_rebuild()
