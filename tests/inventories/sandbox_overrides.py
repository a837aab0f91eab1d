"""Test inventory: the sandbox rigs, each with extra host data from RIGBOOK_TEST_OVERRIDES.

    RIGBOOK_TEST_OVERRIDES='{"rig1": {"gpu_count": 3}}' \\
        pyinfra tests/inventories/sandbox_overrides.py deploys/rig.py

A JSON object of rig name -> host-data keys: how an end-to-end test gives each rig of one run
its own defect, as a user's inventory would.
"""

import json
import os

from inventory.sandbox import sandbox_rigs

_OVERRIDES = json.loads(os.environ.get("RIGBOOK_TEST_OVERRIDES") or "{}")

rigs = [(name, {**data, **_OVERRIDES.get(name, {})}) for name, data in sandbox_rigs]
