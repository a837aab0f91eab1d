"""How roles speak to the operator from inside an operation: warnings, notices and refusals
(and `gib` and `human`, the ways a size is written in them).

An operation body runs at prepare time (when pyinfra diffs) and again at execution, so what it
says must be said once; and a problem that concerns one rig must fail that rig alone: pyinfra
aborts the whole run when deploy code raises while it prepares. `refuse_now` fails a rig while
the deploy is planned (the preflight's refusals, a path rigbook will not replace), `refuse` and
`refused` when the step executes; `note` keeps each failed rig's reason for the closing table
(rigbook/fleet.py).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, State, operation
from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS
from pyinfra.context import ctx_host, ctx_state

_warned: set[tuple[str, str]] = set()
#: Why each rig of a run failed, by run: its first reason (what came after followed from it).
REASONS: WeakKeyDictionary = WeakKeyDictionary()

GIB = 1024**3


def gib(size_bytes: float) -> str:
    """A size in bytes as GiB with one decimal: 25769803776 -> "24.0 GiB"."""
    return f"{size_bytes / GIB:.1f} GiB"


def human(size_bytes: float) -> str:
    """A size of files as GiB with two decimals or, below 1 GiB, MiB: "262.14 MiB"."""
    if size_bytes >= GIB:
        return f"{size_bytes / GIB:.2f} GiB"
    return f"{size_bytes / 1024**2:.2f} MiB"


def warn_once(message: str) -> None:
    """logger.warning naming the host, once per run.

    With -y an operation body runs only at execution; without it, at prepare and execution.
    Remembering what was said prints the warning exactly once in every mode, --dry included.
    """
    key = (host.name, message)
    if key not in _warned:
        _warned.add(key)
        logger.warning(f"{host.print_prefix}{message}")


def _log_warning(state, host, message: str) -> bool:
    logger.warning(f"{host.print_prefix}{message}")
    return True


def _log_refusal(state, host, message: str) -> bool:
    host.log_styled(message, fg="red", log_func=logger.error)
    return False


def notice(message: str) -> FunctionCommand:
    """A command that prints a warning when it executes (so only when the operation ran)."""
    return FunctionCommand(_log_warning, (message,), {})


def note(run_state: State, name: str, reason: str) -> None:
    """Why this rig failed; a rig's first reason is kept (what came after followed from it)."""
    REASONS.setdefault(run_state, {}).setdefault(name, reason)


def refuse_now(message: str, reason: str) -> None:
    """Fail the current rig while the deploy is planned: no operation planned for it runs, the
    run (and --dry) exits non-zero, and no prompt stops the other rigs, which go on. `reason`:
    its line in the run's closing table (rigbook/fleet.py)."""
    host.log_styled(message, fg="red", log_func=logger.error)
    this = ctx_host.get()  # the Host itself: `host` is pyinfra's context proxy
    run_state = ctx_state.get()
    note(run_state, this.name, reason)
    run_state.failed_hosts.add(this)
    run_state.active_hosts.discard(this)


def refuse(message: str) -> FunctionCommand:
    """A command that fails its host with `message` when it executes.

    A RigbookError that concerns one host is turned into this failing step: that host stops
    here, before the operations after it change anything, and the other hosts go on.
    """
    return FunctionCommand(_log_refusal, (message,), {})


@operation(is_idempotent=False)
def refused(message: str):
    """
    Fail this rig with a message, before anything after it changes; the other rigs go on.

    + message: what is wrong (bad input found while planning) and what to do instead
    """
    yield refuse(message)


def connector_arguments() -> dict:
    """The current operation's connector arguments (_sudo, _env...), for the commands that a
    FunctionCommand body runs itself (host.run_shell_command)."""
    given = host.current_op_global_arguments or {}
    return {key: value for key, value in given.items() if key in CONNECTOR_ARGUMENT_KEYS}
