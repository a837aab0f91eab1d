"""The one error type rigbook raises for bad input and refused actions, and the exit codes."""

#: Exit codes of the `rigbook` command: 0 as declared, 1 drift, 2 a rig unreachable or a GPU
#: gone (roles/status.py decides those three), 3 a usage or configuration error.
EXIT_USAGE = 3


class RigbookError(Exception):
    """A problem the operator must fix; the CLI prints it plainly and exits EXIT_USAGE."""
