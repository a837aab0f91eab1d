"""Test deploy: only the host-tuning and WSL2 roles, as deploys/rig.py runs them.

    pyinfra inventory/sandbox.py tests/deploys/tuning_host.py
"""

from pyinfra import host

from rigbook.inventory import rig_of
from rigbook.preflight import preflight
from rigbook.roles import tuning, wsl

rig = rig_of(host)

if preflight(rig, tuning.CHECKS, wsl.CHECKS):
    wsl.wsl_host(rig)
    tuning.host_tuning(rig)
