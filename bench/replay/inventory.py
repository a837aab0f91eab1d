"""pyinfra inventory of N replayed rigs, for rigbook's deploys and `rigbook status`.

    RIGBOOK_REPLAY=bench/replay/recordings/rigbook-full.json RIGBOOK_REPLAY_RUN=no_change \
    RIGBOOK_REPLAY_RIGS=100 PYTHONPATH=bench/replay/dist:. \
    pyinfra bench/replay/inventory.py deploys/rig.py

Each rig is `@replay/replay-NNNN` with the recorded rig's host data and its own address; the
connector (bench/replay/connector.py) reads the recording and the run from the environment.
rigbook checks every rig before pyinfra connects, as inventory/sandbox.py does.
"""

import os

from bench.replay.recording import identity, load
from rigbook.inventory import check_before_connecting

_RECORDING = load(os.environ["RIGBOOK_REPLAY"])


def _rig(index: int) -> tuple[str, dict]:
    rig = identity(index, _RECORDING.identity)
    return f"@replay/{rig.name}", {**_RECORDING.host_data, "ssh_hostname": rig.address}


replay_rigs = [_rig(index) for index in range(int(os.environ["RIGBOOK_REPLAY_RIGS"]))]

check_before_connecting()
