"""The end of a fleet run: the rigs that failed, each with its reason in words, and the command
that retries just those.

pyinfra says of a lost rig only `[rig2] Error: executed 0 commands`, somewhere in the middle
of the output. rigbook notes why each rig failed as it happens (`note`: the first reason of a
rig is the one kept) and, as the run's process ends, prints one table on stderr (so a --json
run's stdout stays JSON):

    --> rigbook: 3 of 4 rigs failed:
        rig2  lost the connection to rig2: no answer within 60 s (...), during "Install ..."
        rig3  unreachable: pyinfra could not connect (its message is above)
        rig4  refused by the preflight (power_limit_w): power_limit_w: 400 W is above ...
        retry just these: pyinfra -y inventory/rigs.py deploys/rig.py --limit rig2 --limit ...

The reasons: unreachable (failed to connect), lost the connection (rigbook/core/link.py bounds how
long that takes), refused by the preflight with the host-data keys of its findings
(rigbook/preflight.py), an operation failed with its name. The retry command is the run's own
command line with its --limit and --exclude replaced by one --limit per failed rig (pyinfra's
--limit takes one name or group each time). `watch` starts this once per run, from the first
preflight.
"""

from __future__ import annotations

import atexit
import shlex
import sys

import pyinfra
from pyinfra import logger
from pyinfra.api import Host, State
from pyinfra.api.state import BaseStateCallback

from rigbook.core.link import lost, lost_text
from rigbook.core.messages import REASONS, note  # per run: each failed rig's first reason

UNREACHABLE = "unreachable: pyinfra could not connect (its message is above)"
UNKNOWN = "failed (the messages above say where)"


class FleetReport(BaseStateCallback):
    """Notes each failed operation: a lost connection (said at once) or the operation's name."""

    @staticmethod
    def operation_host_error(state: State, host: Host, op_hash, retry_num=0, max_retries=0):
        if state.get_op_data_for_host(host, op_hash).global_arguments.get("_ignore_errors"):
            return
        names = ", ".join(state.get_op_meta(op_hash).names) or "an operation"
        if lost(host):
            reason = f"{lost_text(host)}, during \"{names}\""
            host.log_styled(reason, fg="red", log_func=logger.error)
        else:
            reason = f"operation \"{names}\" failed"
        note(state, host.name, reason)


def retry_command(argv: list[str], names: list[str]) -> str:
    """The run's command line for these rigs only: its own --limit / --exclude dropped, one
    --limit per rig added."""
    kept, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg in ("--limit", "--exclude"):
            skip = True
        elif not arg.startswith(("--limit=", "--exclude=")):
            kept.append(arg)
    limits = [part for name in names for part in ("--limit", name)]
    return shlex.join(["pyinfra", *kept, *limits])


def table(state: State, argv: list[str]) -> str | None:
    """The closing table of a run (None when no rig failed)."""
    failed = [host for host in state.inventory if host in state.failed_hosts]
    if not failed:
        return None
    reasons = REASONS.get(state, {})
    width = max(len(host.name) for host in failed)
    rows = [f"    {host.name:<{width}}  {reasons.get(host.name, UNKNOWN)}" for host in failed]
    total = len([host for host in state.inventory if state.is_host_in_limit(host)])
    return "\n".join([
        f"--> rigbook: {len(failed)} of {total} rig(s) failed:", *rows,
        f"    retry just these: {retry_command(argv, [host.name for host in failed])}",
    ])


def _print_table(state: State) -> None:
    text = table(state, sys.argv)
    if text:
        print(text, file=sys.stderr, flush=True)


def watch(state: State) -> None:
    """Start the report for this run (once): the rigs that failed to connect are noted as
    unreachable, later failures as they come, and the table prints when the process ends."""
    if state in REASONS:
        return
    REASONS[state] = {}
    for host in state.inventory:
        if host in state.failed_hosts and not host.connected:
            note(state, host.name, UNREACHABLE)
    state.add_callback_handler(FleetReport())
    if pyinfra.is_cli:  # not in a test that plans a deploy in its own process
        atexit.register(_print_table, state)
