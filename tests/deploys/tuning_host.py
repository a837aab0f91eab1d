"""Test deploy: only the host-tuning and WSL2 roles, as deploys/rig.py runs them.

    pyinfra inventory/sandbox.py tests/deploys/tuning_host.py
"""

from pyinfra import host

from roles.spec import rig_of
from roles.tuning import host_tuning
from roles.wsl import wsl_host

rig = rig_of(host)

wsl_host(rig)
host_tuning(rig)
