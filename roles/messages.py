"""How roles speak to the operator from inside an operation: warnings, notices and refusals.

An operation body runs at prepare time (when pyinfra diffs) and again at execution, so what it
says must be said once; and a problem that concerns one rig must fail that rig alone: pyinfra
aborts the whole run when deploy code raises while it prepares.
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import FunctionCommand

_warned: set[tuple[str, str]] = set()


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


def refuse(message: str) -> FunctionCommand:
    """A command that fails its host with `message` when it executes.

    A RigbookError that concerns one host is turned into this failing step: that host stops
    here, before the operations after it change anything, and the other hosts go on.
    """
    return FunctionCommand(_log_refusal, (message,), {})
