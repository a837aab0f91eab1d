"""pyinfra inventory of the sandbox rigs for the stock pyinfra peer, from the rendered peers.json.

    RIGBOOK_BENCH_PEERS=DIR/peers.json pyinfra bench/peers/inventory.py bench/peers/pyinfra_stock.py

No rigbook import: the peer runs on pyinfra alone (bench/peers/render.py wrote the file).
"""

import json
import os
from pathlib import Path

_PEERS = json.loads(Path(os.environ["RIGBOOK_BENCH_PEERS"]).read_text())

rigs = [
    (entry["name"], {
        "ssh_hostname": entry["address"],
        "ssh_user": entry["user"],
        "ssh_key": entry["key"],
        "ssh_strict_host_key_checking": "off",
        "ssh_known_hosts_file": "/dev/null",
        **entry["vars"],
    })
    for entry in _PEERS["hosts"]
]
