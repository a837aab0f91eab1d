"""Test deploy: only the host-tuning and WSL2 roles, as deploys/rig.py runs them.

    pyinfra inventory/sandbox.py tests/deploys/tuning_host.py
"""

from pyinfra import host

from roles import tuning, wsl
from roles.preflight import preflight
from roles.spec import rig_of

rig = rig_of(host)

if preflight(rig, tuning.CHECKS, wsl.CHECKS):
    wsl.wsl_host(rig)
    tuning.host_tuning(rig)
