"""The real pyinfra or rigbook CLI over pyinfra's own SSH connector, every exchange recorded.

    RIGBOOK_REPLAY_EVENTS=FILE python -m bench.replay.record pyinfra -y INVENTORY DEPLOY ...
    RIGBOOK_REPLAY_EVENTS=FILE python -m bench.replay.record rigbook status INVENTORY ...

Wraps SSHConnector so that every remote command (as its text reaches the rig's shell, with
its stdin), its stdout, stderr and exit code, and every file put (path, sha256, content) or get
(path, content) is written per host, in order, to FILE when the CLI exits. The commands that
a put or get runs itself (a sudo copy) are part of it, not recorded apart. Nothing else about
the run changes; bench/replay/scale.py turns the files into a recording.
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import json
import os
import sys
from collections import defaultdict
from functools import wraps

import pyinfra.connectors.ssh as ssh
from pyinfra.api.util import get_file_io
from pyinfra.connectors.ssh import SSHConnector
from pyinfra.connectors.util import make_unix_command_for_host

from bench.replay.recording import STDIN, command_key

EVENTS: dict[str, list[dict]] = defaultdict(list)
#: Hosts inside a put or get: their commands belong to it.
_IN_TRANSFER: set[str] = set()
#: The exit code of each host's last command (SSHConnector returns only success).
_EXIT: dict[str, int] = {}


def _exit_code(execute):
    @wraps(execute)
    def wrapper(host, arguments, execute_command):
        code, output = execute(host, arguments, execute_command)
        _EXIT[host.name] = code
        return code, output
    return wrapper


def _command(method):
    @wraps(method)
    def wrapper(self, command, print_output=False, print_input=False, **arguments):
        if self.host.name in _IN_TRANSFER:
            return method(self, command, print_output, print_input, **arguments)
        shell = {k: v for k, v in arguments.items()
                 if k not in ("_get_pty", "_timeout", "_stdin", "_success_exit_codes")}
        text = make_unix_command_for_host(self.state, self.host, command, **shell)
        text = text.get_raw_value()
        key = command_key(text, arguments.get("_stdin"))
        status, output = method(self, command, print_output, print_input, **arguments)
        event = {"kind": "command", "command": text, "exit": _EXIT.pop(self.host.name),
                 "stdout": output.stdout_lines, "stderr": output.stderr_lines}
        if arguments.get("_stdin") is not None:  # (the key is scrubbed: compare no text)
            event["stdin"] = key.split(STDIN, 1)[1]
        EVENTS[self.host.name].append(event)
        return status, output
    return wrapper


def _content(filename_or_io) -> bytes:
    if isinstance(filename_or_io, str):
        with get_file_io(filename_or_io) as file_io:
            return file_io.read()
    position = filename_or_io.tell()
    data = filename_or_io.read()
    filename_or_io.seek(position)
    return data.encode() if isinstance(data, str) else data


def _put(method):
    @wraps(method)
    def wrapper(self, filename_or_io, remote_filename, *args, **kwargs):
        data = _content(filename_or_io)
        _IN_TRANSFER.add(self.host.name)
        try:
            ok = method(self, filename_or_io, remote_filename, *args, **kwargs)
        finally:
            _IN_TRANSFER.discard(self.host.name)
        EVENTS[self.host.name].append({
            "kind": "put", "path": remote_filename, "ok": ok,
            "sha256": hashlib.sha256(data).hexdigest(),
            "content": base64.b64encode(data).decode()})
        return ok
    return wrapper


def _get(method):
    @wraps(method)
    def wrapper(self, remote_filename, filename_or_io, *args, **kwargs):
        _IN_TRANSFER.add(self.host.name)
        try:
            ok = method(self, remote_filename, filename_or_io, *args, **kwargs)
        finally:
            _IN_TRANSFER.discard(self.host.name)
        if isinstance(filename_or_io, str):
            with open(filename_or_io, "rb") as local:
                data = local.read()
        else:
            position = filename_or_io.tell()
            filename_or_io.seek(0)
            data = filename_or_io.read()
            filename_or_io.seek(position)
        EVENTS[self.host.name].append({"kind": "get", "path": remote_filename, "ok": ok,
                                       "content": base64.b64encode(data).decode()})
        return ok
    return wrapper


ssh.execute_command_with_sudo_retry = _exit_code(ssh.execute_command_with_sudo_retry)
SSHConnector.run_shell_command = _command(SSHConnector.run_shell_command)
SSHConnector.put_file = _put(SSHConnector.put_file)
SSHConnector.get_file = _get(SSHConnector.get_file)


@atexit.register
def _write() -> None:
    with open(os.environ["RIGBOOK_REPLAY_EVENTS"], "w") as out:
        json.dump(EVENTS, out)


def main() -> int:
    tool, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    if tool == "pyinfra":
        from pyinfra_cli.main import main as cli
    elif tool == "rigbook":
        from rigbook.cli import main as cli
    else:
        raise SystemExit(f"record: pyinfra or rigbook, not {tool!r}")
    return cli()


if __name__ == "__main__":
    sys.exit(main())
