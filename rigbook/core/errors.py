"""The one error type rigbook raises for bad input and refused actions, and the exit codes."""

#: Exit codes of the `rigbook` command: 0 as declared, 1 drift, 2 a rig unreachable or a GPU
#: gone, 4 a driver mismatch (rigbook/status.py decides those four), 3 a usage or configuration
#: error. docs/status.md (Exit status) is their one table.
EXIT_USAGE = 3


class RigbookError(Exception):
    """A problem the operator must fix; the CLI prints it plainly and exits EXIT_USAGE."""
