"""Progress of long work on a rig (a model pull, a venv build), shown while the work runs.

pyinfra hands a command's output back only when the command exits (-vvv echoes every line as it
comes, but raw: unthrottled, unredacted, the result protocol included). So the work writes its
progress to a file on the rig, and `run_watched` runs the command while it reads that file's new
lines every few seconds with a second, short command on the same connection; the caller turns
them into lines of pyinfra's output, with the rig's prefix.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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


# --- what a venv build shows while it runs (rigbook.roles.venvs) ----------------------------------

#: Build-log lines shown while a build runs: rigbook's phases, uv's counts and source builds.
PHASE = "rigbook phase: "
_UV_SAID = re.compile(r"(?:(?:Resolved|Prepared|Installed|Uninstalled|Audited) \d+ packages? in "
                      r"|Building |Built )")
#: uv (progress bars off) names each download over 1 MiB when it starts and when it is done.
_UV_DOWNLOADING = re.compile(r"Downloading (\S+) \(([^()]+)\)")
_UV_DOWNLOADED = re.compile(r" Downloaded (\S+)")


@dataclass
class BuildProgress:
    """What a build shows while it runs, from the new lines of its log: each phase and uv's
    counts as they come, and uv's download lines folded into one line per read."""

    name: str
    downloading: dict[str, str] = field(default_factory=dict)  # wheel -> size, not done yet
    downloaded: int = 0

    def shown(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        folded = False  # download lines since the last line shown
        for line in lines:
            if started := _UV_DOWNLOADING.fullmatch(line):
                self.downloading[started[1]] = started[2]
                folded = True
            elif done := _UV_DOWNLOADED.fullmatch(line):
                self.downloading.pop(done[1], None)
                self.downloaded += 1
                folded = True
            elif line.startswith(PHASE) or _UV_SAID.match(line):
                if folded:
                    out.append(self.downloads())
                    folded = False
                out.append(line.removeprefix(PHASE))
        if folded:
            out.append(self.downloads())
        return [f"venv {self.name}: {text}" for text in out]

    def downloads(self) -> str:
        text = (f"downloading: {self.downloaded} of {self.downloaded + len(self.downloading)} "
                "large wheel(s) done")
        now = [f"{wheel} ({size})" for wheel, size in list(self.downloading.items())[:3]]
        return f"{text}, now {', '.join(now)}" if now else text


class WatchedBuild(StringCommand):
    """The build script, run so that its phases show while it runs (a plain StringCommand's
    output comes back only when it ends), then a line with the time it took."""

    def __init__(self, script: str, name: str, log: str, every: float):
        super().__init__(script)
        self.name, self.log, self.every = name, log, every

    def execute(self, state, host, connector_arguments):
        connector_arguments.update(self.connector_arguments)
        progress, started = BuildProgress(self.name), time.monotonic()

        def show(lines: list[str]) -> None:
            for text in progress.shown(lines):
                logger.info(f"{host.print_prefix}{text}")

        ok, output, _ = run_watched(host, self, self.log, show, self.every,
                                    print_output=state.print_output,
                                    print_input=state.print_input, **connector_arguments)
        if ok:
            logger.info(f"{host.print_prefix}venv {self.name}: built, smoke-tested and swapped "
                        f"in after {time.monotonic() - started:.1f} s")
        return ok, output
