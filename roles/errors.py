"""The one error type rigbook raises for bad input and refused actions."""


class RigbookError(Exception):
    """A problem the operator must fix; the CLI prints it plainly and exits 1."""
