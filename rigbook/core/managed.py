"""The files rigbook writes on a rig, compared in one read instead of three round trips a file.

pyinfra's `files.put`, `files.file` and `files.directory` each read the file, its folder and its
hash before deciding: three SSH commands a file, about 50 of the 70 of a no-change converge
(docs/performance.md). Here the role functions name the paths they manage while the deploy is
planned (the wrappers below do it for them, `expect` for paths written inside a larger
operation), and the first comparison of a run reads the kind, mode and sha256 of all of them in
one command (`FileStates`). Each comparison after that is free.

What was read stays true while only these operations change the rig: they update it as they
write. Any other operation that changed something (an apt install, a venv build) makes the next
comparison read again, so a file some package put there is never mistaken for absent.
"""

from __future__ import annotations

import hashlib
import io
import posixpath
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pyinfra import host, logger, state
from pyinfra.api import (
    FactBase,
    FileUploadCommand,
    QuoteString,
    StringCommand,
    operation,
)
from pyinfra.api.output import format_text
from pyinfra.api.util import get_file_io
from pyinfra.facts.files import FileContents
from pyinfra.operations.util.files import chmod, generate_color_diff

from rigbook.core import runfacts
from rigbook.core.messages import refuse, refuse_now
from rigbook.core.types import JsonValue


@dataclass(frozen=True)
class FileState(JsonValue):
    """What is at a path: `kind` is file, directory, link or other; `sha256` for files."""

    kind: str
    mode: int
    sha256: str | None = None


#: One line a path: kind, octal mode, sha256 or "-", the path (last: it may hold spaces).
#: printf, not echo: dash's echo would expand a backslash in a path.
_PROBE = (
    'if [ -L "$p" ]; then printf "link 0 - %s\\n" "$p"; '
    'elif [ -d "$p" ]; then printf "directory %s - %s\\n" "$(stat -c %a "$p")" "$p"; '
    'elif [ -f "$p" ]; then printf "file %s %s %s\\n" "$(stat -c %a "$p")" '
    '"$(sha256sum < "$p" | cut -d" " -f1)" "$p"; '
    'elif [ -e "$p" ]; then printf "other 0 - %s\\n" "$p"; '
    'else printf "absent 0 - %s\\n" "$p"; fi'
)


class FileStates(FactBase[dict]):
    """Kind, mode and content hash of each path, in one command (None: nothing there)."""

    def command(self, paths: tuple[str, ...]) -> StringCommand:
        quoted = " ".join(shlex.quote(path) for path in paths)
        return StringCommand(f"for p in {quoted}; do {_PROBE}; done")

    def process(self, output: list[str]) -> dict[str, FileState | None]:
        states: dict[str, FileState | None] = {}
        for line in output:
            kind, mode, digest, path = line.split(" ", 3)
            states[path] = None if kind == "absent" else FileState(
                kind, int(mode, 8), None if digest == "-" else digest)
        return states


def _with_folders(paths) -> list[str]:
    """The paths and their folders: an upload creates a missing folder first."""
    return list(dict.fromkeys(p for path in paths for p in (path, posixpath.dirname(path))))


def expect(*paths: str) -> None:
    """Name paths this rig's run will compare, while it is planned: one read covers them."""
    runfacts.expect("files", _with_folders(paths))


def state_of(path: str) -> FileState | None:
    """What is at `path` now: from this run's one read, read again only when needed."""
    return runfacts.batched(
        "files", path, lambda unread: host.get_fact(FileStates, paths=tuple(_with_folders(unread))))


def _sha256(src: str | Path | IO) -> str:
    if isinstance(src, (str, Path)):
        return hashlib.sha256(Path(src).read_bytes()).hexdigest()
    src.seek(0)
    data = src.read()
    src.seek(0)
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _show_diff(src: str | Path | IO, dest: str, existed: bool) -> None:
    """What --diff shows for a file that changes, as pyinfra's files.put shows it."""
    current = [line + "\n" for line in (host.get_fact(FileContents, path=dest) or [])] \
        if existed else []
    verb = "modify" if existed else "create"
    host.log(f"Will {verb} {format_text(dest, bold=True)}", logger.info)
    with get_file_io(src, "r") as handle:
        wanted = handle.readlines()
    for line in generate_color_diff(current, wanted):
        logger.info("  %s", line)
    logger.info("")


def _refused(message: str) -> Iterator:
    """Refuse this rig for a path rigbook will not touch, and only this rig: while the deploy is
    planned, at once (nothing planned for it runs; raising here would abort the whole run);
    while it executes (-y plans nothing first), by a step that fails it."""
    if state.is_executing:
        yield refuse(message)
    else:
        refuse_now(f"refused, nothing was changed: {message}", f"refused: {message}")


def put_commands(src: str | Path | IO, dest: str, mode: str | None = None) -> Iterator:
    """Upload `src` (a local path or a file-like object) to `dest` when its content differs, or
    its mode when given; nothing, and a no-op line, when it is already there. Without a mode
    the file's mode is left as it is (a Windows drive under WSL2 has no Unix modes)."""
    if isinstance(src, str) and not Path(src).is_file():
        raise OSError(f"No such file: {src}")
    now = state_of(dest)
    if now is not None and now.kind != "file":
        yield from _refused(f"{dest} is a {now.kind}, not a file: rigbook will not replace it")
        return
    wanted = now.mode if mode is None and now is not None else int(mode or "644", 8)
    digest = _sha256(src)
    if now is not None and now.sha256 == digest:
        if now.mode == wanted:
            host.noop(f"file {dest} is already uploaded")
            return
        yield chmod(dest, mode)
    else:
        if state.config.DIFF:
            _show_diff(src, dest, now is not None)
        folder = posixpath.dirname(dest)
        if now is None and state_of(folder) is None:
            yield StringCommand("mkdir", "-p", folder)
            runfacts.remember("files", folder, FileState("directory", 0o755))
        yield FileUploadCommand(src, dest, remote_temp_filename=host.get_temp_filename(dest))
        if mode is not None:
            yield chmod(dest, mode)
    runfacts.remember("files", dest, FileState("file", wanted, digest))


def text_commands(text: str, dest: str, mode: str | None = "644") -> Iterator:
    """`put_commands` for content made here (a rendered template)."""
    yield from put_commands(io.StringIO(text), dest, mode)


def absent_commands(path: str) -> Iterator:
    """Remove the regular file at `path` when there is one. Anything else there (a folder, a
    link, a device node, a FIFO) is refused: from the read, and again by the removing command
    itself, which tests what is there in the same shell command that removes it."""
    now = state_of(path)
    if now is None:
        host.noop(f"file {path} does not exist")
        return
    if now.kind != "file":
        yield from _refused(f"{path} is a {now.kind}, not a regular file: rigbook will not "
                            "remove it")
        return
    quoted = QuoteString(path)
    yield StringCommand(
        "if [ -f", quoted, "] && [ ! -L", quoted, "]; then rm -f --", quoted, "; else echo",
        QuoteString(f"{path} is not a regular file: rigbook will not remove it"), ">&2; false; fi",
    )
    runfacts.remember("files", path, None)


def directory_commands(path: str, mode: str = "755") -> Iterator:
    """Create the folder at `path`, or set its mode, when it differs."""
    wanted = int(mode, 8)
    now = state_of(path)
    if now is not None and now.kind != "directory":
        yield from _refused(f"{path} is a {now.kind}, not a directory: rigbook will not "
                            "replace it")
        return
    if now is not None and now.mode == wanted:
        host.noop(f"directory {path} already exists")
        return
    if now is None:
        yield StringCommand("mkdir", "-p", path)
    yield chmod(path, mode)
    runfacts.remember("files", path, FileState("directory", wanted))


@operation()
def _put(src: str | Path | IO, dest: str, mode: str | None = None):
    """
    Upload a file when its content or mode differs (one read for all of a rig's files).

    + src: local path or file-like object
    + dest: where it goes on the rig
    + mode: its permissions; none = left as they are
    """
    runfacts.mark_ours()
    yield from put_commands(src, dest, mode)


@operation()
def _absent(path: str):
    """
    Remove a file when it is there.

    + path: the file
    """
    runfacts.mark_ours()
    yield from absent_commands(path)


@operation()
def _directory(path: str, mode: str = "755"):
    """
    Create a folder, or set its mode, when it differs.

    + path: the folder
    + mode: its permissions
    """
    runfacts.mark_ours()
    yield from directory_commands(path, mode)


def put(src: str | Path | IO, dest: str, mode: str | None = None, **op_args):
    """files.put's job for a file rigbook owns: planned now, compared in the rig's one read."""
    expect(dest)
    return _put(src=src, dest=dest, mode=mode, **op_args)


def absent(path: str, **op_args):
    """files.file(present=False)'s job, in the rig's one read."""
    expect(path)
    return _absent(path=path, **op_args)


def directory(path: str, mode: str = "755", **op_args):
    """files.directory's job, in the rig's one read."""
    expect(path)
    return _directory(path=path, mode=mode, **op_args)
