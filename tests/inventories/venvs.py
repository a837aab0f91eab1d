"""Test inventory: the sandbox rigs, the dual 3090 (rig1) with one light venv.

The venv is what docs/runbooks/rebuild-venvs.md rebuilds on the sandbox: one pinned package
from the wheelhouse (`python -m tests.standins wheels` puts it there), used by the serving unit.
rig1 pins the driver branch only (the newest 580), so that the runbook can move its driver with
deploys/driver.py and converge without editing this file.
"""

from inventory.sandbox import sandbox_rigs

VENVS = [{"name": "demo", "engine": "none", "python": "3.11", "packages": ["six==1.16.0"],
          "services": ["rigbook-serve.service"]}]

RIG1 = {"venvs": VENVS, "driver_version": None}

rigs = [(name, {**data, **RIG1} if name == "rig1" else data) for name, data in sandbox_rigs]
