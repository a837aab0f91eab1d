"""Validate the hosts a run selects before pyinfra connects to any of them.

pyinfra runs deploy code only after it has connected to every host; host data checked there
would already have opened SSH connections. Two hooks run before pyinfra connects, and either
calls `check_command_line(sys.argv)`: the repository's config.py, which pyinfra loads from its
working folder only (the repository root, or `--chdir` to it), and rigbook's inventory files
(inventory/rigs.py, inventory/sandbox.py), which call `check_before_connecting()` as their last
line: pyinfra loads an inventory before it connects, from whatever folder it runs in. The check
builds the inventory exactly as the pyinfra CLI will (an inventory file with its group data,
`@local`, an inline host; `--data` merged; `--limit` and `--exclude` applied), validates every
selected host into a `Rig`, checks what needs no rig (`rig_problems`: the recipe and its fit,
the bind rule; `inventory_problems`: no hosts, one address under two names) and stops with one
message naming each bad host and key. Nothing is contacted.

Where neither hook ran (an inventory of one's own run from another folder, an inline host, a
deploy file of one's own that includes rigbook's), the check could not happen before
connecting: `require_checked`, which `rig_of` calls on the first line of every deploy, then
refuses the run before anything is read or planned, and says how to run it (fail closed).
`rigbook status` loads inventories through `load_inventory`, with the same checks.
"""

from __future__ import annotations

import os
import sys
from fnmatch import fnmatch
from pathlib import Path

from pyinfra.api import Host, Inventory, State
from pyinfra.api.exceptions import NoGroupError, PyinfraError
from pyinfra.context import ctx_state
from pyinfra_cli.inventory import make_inventory, make_inventory_from_files
from pyinfra_cli.util import parse_cli_arg

from rigbook.core.errors import RigbookError
from rigbook.core.spec import Rig, parse_rig

#: Hosts whose data the check before connecting passed in this process; `require_checked`
#: refuses every other. `_checked_argv`: the command line it ran for (it runs once).
_checked: set[str] = set()
_checked_argv: list[str] | None = None
#: True while rigbook itself builds an inventory: an inventory file's own call waits for it.
_loading = False


class NotChecked(PyinfraError):
    """A deploy reached a host whose data was not checked before connecting. A pyinfra error,
    so that the CLI prints the message alone and stops the run before any operation."""


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


def _address(host: Host) -> str:
    """Where pyinfra connects to for a host: its SSH address and port, or its name."""
    data = host.data.dict()
    name = data.get("ssh_hostname") or host.name
    return f"{name}:{data.get('ssh_port') or 22}" if not name.startswith("@") else name


def inventory_problems(hosts: list[Host]) -> list[str]:
    """What is wrong with the selection as a whole: no hosts, one address under two names."""
    if not hosts:
        return ["the inventory (and --limit) selects no host: nothing to do"]
    names: dict[str, list[str]] = {}
    for host in hosts:
        names.setdefault(_address(host), []).append(host.name)
    return [f"{', '.join(same)}: one address ({address}) under {len(same)} names; allowed: one "
            "name per rig" for address, same in names.items() if len(same) > 1]


def rig_problems(rig: Rig, name: str) -> list[str]:
    """What needs no rig to be refused: the recipe (from the catalogue and serving_recipe_dirs)
    and its fit to the host data (cards, class VRAM, NVLink, platform, venv), the bind rule, the
    verify sizes set against the recipe's context, the API key file and the token files (HF,
    mirror)."""
    # imported here: the roles import this module's neighbours
    from rigbook.roles.recipes import catalogue
    from rigbook.roles.serving import plan_of
    from rigbook.roles.tokens import rig_tokens
    from rigbook.roles.verify import SIZE_KEYS, size_problems

    plan, problem = plan_of(rig, name)
    problems = [problem.message(name)] if problem else []
    if plan is not None:  # verify's sizes the operator set, against the context served
        given = [key for key in SIZE_KEYS if key in rig.model_fields_set]
        problems += [f"{name}: {line}" for line in size_problems(rig, plan.recipe, given)]
    from rigbook.roles.capadvice import psu_inventory_problem

    psu = psu_inventory_problem(rig)
    if psu is not None:
        problems.append(f"{name}: psu_watts: {psu}")
    checks = [lambda: rig_tokens(rig)]
    if rig.recipe is None:  # with a recipe, plan_of loaded the folders
        checks.append(lambda: catalogue(rig.serving_recipe_dirs))
    for check in checks:
        try:
            check()
        except RigbookError as exc:
            problems.append(f"{name}: {exc}")
    return problems


def rig_warnings(rig: Rig, name: str) -> list[str]:
    """What the host data asks for that costs the rig, short of refusing it: the card's advice
    for the recipe (from the class; rigbook.core.cards), the recipe's own flags'
    (rigbook.roles.recipes.recipe_warnings) and the caps' (rigbook.roles.capadvice)."""
    from rigbook.core.cards import class_card
    from rigbook.roles.capadvice import cap_warnings
    from rigbook.roles.recipes import card_warnings, recipe_warnings
    from rigbook.roles.serving import plan_of

    plan, _ = plan_of(rig, name)
    card = class_card(rig.gpu_class)
    found = card_warnings(plan.recipe, rig, card) if plan is not None and card else []
    found += recipe_warnings(plan.recipe, rig) if plan is not None else []
    return [f"{name}: {text}" for text in found + cap_warnings(rig)]


def validate(hosts: list[Host]) -> dict[str, Rig]:
    """A validated Rig per host; RigbookError lists every problem of every host at once."""
    rigs, errors = {}, inventory_problems(hosts)
    for host in hosts:
        try:
            rigs[host.name] = parse_rig(host.name, host.data.dict())
        except RigbookError as exc:
            errors.append(str(exc))
        else:
            errors += rig_problems(rigs[host.name], host.name)
    if errors:
        raise RigbookError("invalid host data, nothing was changed:\n" + "\n".join(errors))
    return rigs


def _loaded(loader, *args, **kwargs) -> Inventory:
    """An inventory built by rigbook: in a pyinfra state (its loader execs files in one), with
    the inventory file's own `check_before_connecting` waiting (this is that check)."""
    global _loading
    _loading = True
    try:
        with ctx_state.use(ctx_state.get() or State()):
            return loader(*args, **kwargs)
    finally:
        _loading = False


def load_inventory(inventory_file: str, override_data: dict | None = None,
                   limit: list[str] | None = None, exclude: list[str] | None = None):
    """(pyinfra Inventory, the hosts the limit selects, a validated Rig per selected host) of an
    inventory file, loaded as the CLI does. Hosts a run leaves out are not validated: the
    `--data` of a run for one group need not fit another.

    RigbookError lists every bad host at once.
    """
    inventory = _loaded(make_inventory_from_files, str(Path(inventory_file).resolve()),
                        override_data=override_data or {}, cwd=os.getcwd())
    hosts = select_hosts(inventory, limit, exclude)
    return inventory, hosts, validate(hosts)


def load_rigs(inventory_file: str, override_data: dict | None = None) -> dict[str, Rig]:
    """Every host of an inventory file, validated."""
    return load_inventory(inventory_file, override_data)[2]


def check_command_line(argv: list[str]) -> None:
    """Check the hosts a pyinfra command line selects (from config.py or an inventory file,
    before pyinfra connects); on a problem, print it plainly and exit 1: nothing is contacted.
    Runs once per command line: the second hook finds it done."""
    global _checked_argv
    from pyinfra_cli.cli import cli  # pyinfra's own parser: the same inventory, data and limit

    if _loading or _checked_argv == argv:
        return
    params = cli.make_context("pyinfra", list(argv[1:]), resilient_parsing=True).params
    source = params.get("inventory")
    if not source:
        return  # --help, --version and the like
    data = cli_override_data([arg for pair in params.get("data") or () for arg in ("--data", pair)])
    try:
        inventory = _loaded(make_inventory, source, override_data=data, cwd=os.getcwd(),
                            group_data_directories=params.get("group_data") or None)
        rigs = validate(select_hosts(inventory, list(params.get("limit") or ()),
                                     list(params.get("exclude") or ())))
    except RigbookError as exc:
        print(f"--> rigbook: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    for rig_name, rig in rigs.items():
        for line in rig_warnings(rig, rig_name):
            print(f"--> rigbook: warning: {line}", file=sys.stderr)
    _checked.update(rigs)
    _checked_argv = list(argv)


def check_before_connecting() -> None:
    """The last line of an inventory file: check this pyinfra run's hosts before it connects,
    from whatever folder pyinfra runs in. Nothing outside the pyinfra CLI (`rigbook status`,
    a test that imports the file) is affected: they validate on their own."""
    import pyinfra

    if pyinfra.is_cli:
        check_command_line(sys.argv)


def require_checked(name: str) -> None:
    """Refuse a host whose data no check before connecting passed in this process (the first
    line of every deploy, through rig_of): fail closed, never go on with unchecked data."""
    if name not in _checked:
        raise NotChecked(
            f"{name}: host data not checked before connecting, refused: nothing was read or "
            "changed. pyinfra loads rigbook's check from config.py in the folder it runs in, or "
            "from an inventory file that calls it: run pyinfra from the rigbook repository (or "
            "with --chdir to it), with inventory/rigs.py, or end your own inventory file with "
            "`from rigbook.inventory import check_before_connecting` and "
            "`check_before_connecting()` (docs/preflight.md, Before connecting)"
        )


def rig_of(host) -> Rig:
    """The validated Rig of a pyinfra host (deploys call this once, on their first line, then
    pass the Rig on); a host whose data was not checked before connecting is refused here."""
    require_checked(host.name)
    return parse_rig(host.name, host.data.dict())
