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
from fnmatch import fnmatch
from pathlib import Path

from pyinfra.api import Host, Inventory, State
from pyinfra.api.exceptions import InventoryError, NoGroupError
from pyinfra.context import ctx_state
from pyinfra_cli.inventory import make_inventory_from_files
from pyinfra_cli.util import parse_cli_arg

from roles.errors import RigbookError
from roles.spec import Rig, parse_rig

_checking: set[str] = set()


def cli_values(argv: list[str], option: str) -> list[str]:
    """Every value of a pyinfra option on a command line (`--limit a --limit=b` -> [a, b])."""
    values = []
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith(f"{option}="):
            values.append(arg.removeprefix(f"{option}="))
    return values


def cli_override_data(argv: list[str]) -> dict:
    """The `--data key=value` pairs of a pyinfra command line, typed as pyinfra types them."""
    data = {}
    for pair in cli_values(argv, "--data"):
        key, sep, value = pair.partition("=")
        if sep:
            data[key] = parse_cli_arg(value)
    return data


def _matching(inventory: Inventory, patterns: list[str], option: str) -> list[Host]:
    """The hosts of host names, group names or globs, as pyinfra matches them; RigbookError
    for a pattern that matches nothing (pyinfra would only warn, and plan nothing)."""
    hosts = list(inventory)
    chosen, unknown = [], []
    for pattern in patterns:
        try:
            matched = list(inventory.get_group(pattern))
        except NoGroupError:
            matched = [host for host in hosts if fnmatch(host.name, pattern)]
        if not matched:
            unknown.append(pattern)
        chosen += [host for host in matched if host not in chosen]
    if unknown:
        raise RigbookError(
            f"{option} {', '.join(unknown)}: no such rig or group in the inventory; rigs: "
            + ", ".join(host.name for host in hosts)
        )
    return [host for host in hosts if host in chosen]


def select_hosts(inventory: Inventory, limit: list[str] | None = None,
                 exclude: list[str] | None = None) -> list[Host]:
    """The hosts a run with these --limit and --exclude patterns reaches, in inventory order."""
    hosts = _matching(inventory, limit, "--limit") if limit else list(inventory)
    excluded = _matching(inventory, exclude, "--exclude") if exclude else []
    return [host for host in hosts if host not in excluded]


def load_inventory(inventory_file: str, override_data: dict | None = None,
                   limit: list[str] | None = None, exclude: list[str] | None = None):
    """(pyinfra Inventory, the hosts the limit selects, a validated Rig per selected host) of an
    inventory file, loaded as the CLI does. Hosts a run leaves out are not validated: the
    `--data` of a run for one group need not fit another.

    RigbookError lists every bad host at once.
    """
    with ctx_state.use(ctx_state.get() or State()):  # pyinfra's loader needs a state to exec in
        inventory = make_inventory_from_files(
            str(Path(inventory_file).resolve()), override_data=override_data or {}, cwd=os.getcwd()
        )
    hosts = select_hosts(inventory, limit, exclude)
    rigs, errors = {}, []
    for host in hosts:
        try:
            rigs[host.name] = parse_rig(host.name, host.data.dict())
        except RigbookError as exc:
            errors.append(str(exc))
    if errors:
        raise RigbookError("invalid host data, nothing was changed:\n" + "\n".join(errors))
    return inventory, hosts, rigs


def load_rigs(inventory_file: str, override_data: dict | None = None) -> dict[str, Rig]:
    """Every host of an inventory file, validated."""
    return load_inventory(inventory_file, override_data)[2]


def check_inventory(inventory_file: str) -> None:
    """Called at the end of an inventory file; raises InventoryError so pyinfra exits cleanly.

    The hosts are those of this command line's --limit and --exclude, with its --data.
    """
    key = str(Path(inventory_file).resolve())
    if key in _checking:  # we are the nested load that check_inventory itself started
        return
    _checking.add(key)
    try:
        load_inventory(inventory_file, cli_override_data(sys.argv),
                       cli_values(sys.argv, "--limit"), cli_values(sys.argv, "--exclude"))
    except RigbookError as exc:
        raise InventoryError(str(exc)) from None
    finally:
        _checking.discard(key)
