"""Progress of long work on a rig (a model pull, a venv build), shown while the work runs.

pyinfra hands a command's output back only when the command exits (-vvv echoes every line as it
comes, but raw: unthrottled, unredacted, the result protocol included). So the work writes its
progress to a file on the rig, and `run_watched` runs the command while it reads that file's new
lines every few seconds with a second, short command on the same connection; the caller turns
them into lines of pyinfra's output, with the rig's prefix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import gevent
from pyinfra import logger
from pyinfra.api import QuoteString, StringCommand
from pyinfra.connectors.util import CommandOutput

#: Seconds between progress lines (the e2e tests set 1).
EVERY_ENV = "RIGBOOK_PROGRESS_EVERY"
EVERY_DEFAULT = 5.0
#: Seconds one read of the progress file may take.
READ_TIMEOUT = 30
_END = "rigbook-progress-end"


def progress_every(environ: Mapping[str, str] = os.environ) -> float:
    """RIGBOOK_PROGRESS_EVERY in seconds (at least 0.2), else 5; a value that is no number is
    ignored: it only paces what the operator sees."""
    try:
        return max(0.2, float(environ.get(EVERY_ENV) or EVERY_DEFAULT))
    except ValueError:
        return EVERY_DEFAULT


@dataclass
class FileTail:
    """The complete lines a file on the rig gained since the last read."""

    path: str
    offset: int = 0  # bytes already taken

    def command(self) -> StringCommand:
        """The bytes from `offset`, then a newline and an end mark (nothing when no file)."""
        return StringCommand("tail", "-c", f"+{self.offset + 1}", QuoteString(self.path),
                             "2>/dev/null;", "echo;", "echo", _END)

    def take(self, lines: list[str]) -> list[str]:
        """The complete lines of one read's output; a last line still being written (no newline
        yet) is left for the next read."""
        if not lines or lines[-1] != _END:
            return []
        complete = lines[:-2]  # the last line before the mark is the unfinished rest, or ""
        self.offset += sum(len(line.encode()) + 1 for line in complete)
        return complete


def run_watched(
    host, command: StringCommand, path: str, show: Callable[[list[str]], None], every: float,
    print_output: bool = False, print_input: bool = False, **arguments,
) -> tuple[bool, CommandOutput, list[str]]:
    """Run `command` on the rig; while it runs, hand the new lines of the file at `path` to
    `show` every `every` seconds (a list per read), and once more when it ends.

    (ok, output, every line of the file): the command's own result as pyinfra gives it. The file
    is removed first, so no line of an earlier run shows; a read (or a `show`) that fails costs
    only progress lines. `arguments` are the operation's connector arguments (sudo...), for both
    commands.
    """
    reads = {**arguments, "_timeout": READ_TIMEOUT}
    host.run_shell_command(StringCommand("rm", "-f", QuoteString(path)), **reads)
    job = gevent.spawn(host.run_shell_command, command, print_output=print_output,
                       print_input=print_input, **arguments)
    tail, seen = FileTail(path), []
    while True:
        job.join(timeout=every)
        finished = job.ready()
        try:
            _ok, output = host.run_shell_command(tail.command(), **reads)
            lines = tail.take(output.stdout_lines)
            seen += lines
            if lines:
                show(lines)
        except Exception as error:  # never leave the command behind: its own result says
            logger.debug(f"{host.print_prefix}reading {path} failed: {error}")
        if finished:
            break
    ok, output = job.get()
    return ok, output, seen
