"""Validate a whole inventory while pyinfra loads it, before it connects to any host.

pyinfra runs deploy code only after it has connected to every host; host data checked there
would already have opened SSH connections. An inventory file therefore ends with
`check_inventory(__file__)`: it builds the inventory exactly as the pyinfra CLI does (group data
and `--data` overrides merged), validates every host into a `Rig`, and raises one error naming
each bad host and field. pyinfra prints it and exits non-zero; nothing is contacted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pyinfra.api import State
from pyinfra.api.exceptions import InventoryError
from pyinfra.context import ctx_state
from pyinfra_cli.inventory import make_inventory_from_files
from pyinfra_cli.util import parse_cli_arg

from roles.errors import RigbookError
from roles.spec import Rig, parse_rig

_checking: set[str] = set()


def cli_override_data(argv: list[str]) -> dict:
    """The `--data key=value` pairs of a pyinfra command line, typed as pyinfra types them."""
    pairs = []
    for i, arg in enumerate(argv):
        if arg == "--data" and i + 1 < len(argv):
            pairs.append(argv[i + 1])
        elif arg.startswith("--data="):
            pairs.append(arg.removeprefix("--data="))
    data = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if sep:
            data[key] = parse_cli_arg(value)
    return data


def load_inventory(inventory_file: str, override_data: dict | None = None):
    """(pyinfra Inventory, validated Rig per host) of an inventory file, loaded as the CLI does.

    RigbookError lists every bad host at once.
    """
    with ctx_state.use(ctx_state.get() or State()):  # pyinfra's loader needs a state to exec in
        inventory = make_inventory_from_files(
            str(Path(inventory_file).resolve()), override_data=override_data or {}, cwd=os.getcwd()
        )
    rigs, errors = {}, []
    for host in inventory:
        try:
            rigs[host.name] = parse_rig(host.name, host.data.dict())
        except RigbookError as exc:
            errors.append(str(exc))
    if errors:
        raise RigbookError("invalid host data, nothing was changed:\n" + "\n".join(errors))
    return inventory, rigs


def load_rigs(inventory_file: str, override_data: dict | None = None) -> dict[str, Rig]:
    """Every host of an inventory file, validated."""
    return load_inventory(inventory_file, override_data)[1]


def check_inventory(inventory_file: str) -> None:
    """Called at the end of an inventory file; raises InventoryError so pyinfra exits cleanly."""
    key = str(Path(inventory_file).resolve())
    if key in _checking:  # we are the nested load that check_inventory itself started
        return
    _checking.add(key)
    try:
        load_rigs(inventory_file, cli_override_data(sys.argv))
    except RigbookError as exc:
        raise InventoryError(str(exc)) from None
    finally:
        _checking.discard(key)
