"""Test deploy: the platform check, then one command that holds each rig's connection open
while a test takes a rig's link away or kills its sshd, then one more step.

    RIGBOOK_TEST_HOLD_S=30 pyinfra inventory/sandbox.py tests/deploys/hold_link.py

While the hold runs, HOLDING exists on the rig (tests/test_faults_fleet_e2e.py waits for it).
"""

import os

from pyinfra import host
from pyinfra.operations import server

from rigbook.inventory import rig_of
from rigbook.preflight import preflight
from rigbook.roles.wsl import PLATFORM

HOLDING = "/run/rigbook-test-holding"

rig = rig_of(host)
if preflight(rig, [PLATFORM]):
    seconds = int(os.environ.get("RIGBOOK_TEST_HOLD_S", "1"))
    server.shell(name="Hold the connection",
                 commands=[f"touch {HOLDING} && sleep {seconds}; rm -f {HOLDING}"])
    server.shell(name="After the hold", commands=["true"])
