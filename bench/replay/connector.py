"""`@replay/NAME`: a pyinfra connector that answers a rig's commands from a recording.

The environment names the recording (RIGBOOK_REPLAY, a file) and which of its runs to answer
from (RIGBOOK_REPLAY_RUN: first, no_change...); the host's name, `replay-NNNN`, says which
replayed rig it is (its identity, bench/replay/recording.py). Nothing goes into host data, so a
replayed rig's data is exactly the recorded rig's, which rigbook validates. Each command is
turned into the text pyinfra's SSH connector would send (`make_unix_command_for_host`), the
rig's identity swapped back to the recorded one, and answered with the next unused answer
recorded for that text (stdout, stderr, exit code), the identity swapped forward. A command not
recorded, or asked more often than recorded, or a file put whose content differs from the
recorded one, raises `Unrecorded` naming it, and every later command of that rig too: the rig
fails loudly, nothing is guessed. Never registered by rigbook: pyinfra finds it through the
entry point in bench/replay/dist/ when that folder is on sys.path.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections import Counter
from typing import TYPE_CHECKING

from pyinfra import logger
from pyinfra.api.exceptions import ConnectError, InventoryError
from pyinfra.api.util import get_file_io
from pyinfra.connectors.base import BaseConnector
from pyinfra.connectors.util import CommandOutput, OutputLine, make_unix_command_for_host

from bench.replay.recording import Unrecorded, command_key, load

if TYPE_CHECKING:
    from bench.replay.recording import Run, Swap

#: A replayed rig's name (bench/replay/recording.py, identity): its index, 1-based.
NAME = re.compile(r"replay-([0-9]{4,})")


class ReplayConnector(BaseConnector):
    """One replayed rig: answers from a recording, no SSH, no container."""

    handles_execution = True

    run: Run
    swap: Swap

    @staticmethod
    def make_names_data(name=None):
        if not name or not NAME.fullmatch(name):
            raise InventoryError(f"@replay/{name}: a replayed rig is named replay-NNNN (1-based)")
        yield name, {}, ["@replay"]

    def connect(self) -> None:
        for variable in ("RIGBOOK_REPLAY", "RIGBOOK_REPLAY_RUN"):
            if not os.environ.get(variable):
                raise ConnectError(f"replay: {variable} is not set (bench/replay/connector.py)")
        recording, run = load(os.environ["RIGBOOK_REPLAY"]), os.environ["RIGBOOK_REPLAY_RUN"]
        if run not in recording.runs:
            raise ConnectError(f"replay: no run {run!r} in {os.environ['RIGBOOK_REPLAY']} "
                               f"(it has {', '.join(recording.runs)})")
        self.run = recording.runs[run]
        self.swap = recording.swap(int(NAME.fullmatch(self.host.name).group(1)) - 1)
        self.used: Counter = Counter()
        self.broken: str | None = None

    def _fail(self, what: str) -> None:
        self.broken = self.broken or what
        message = f"replay: {self.host.name}: {what}"
        logger.error(message)
        raise Unrecorded(message)

    def _next(self, table: dict[str, list[dict]], key: str, what: str) -> dict:
        if self.broken:
            self._fail(f"stopped after {self.broken}")
        answers = table.get(key)
        if not answers:
            self._fail(f"not recorded: {what}")
        used = self.used[key]
        if used >= len(answers):
            self._fail(f"recorded {len(answers)} time(s), asked once more: {what}")
        self.used[key] = used + 1
        return answers[used]

    def run_shell_command(self, command, print_output=False, print_input=False, **arguments):
        arguments.pop("_get_pty", None)
        arguments.pop("_timeout", None)
        stdin = arguments.pop("_stdin", None)
        success_codes = arguments.pop("_success_exit_codes", None)
        text = make_unix_command_for_host(self.state, self.host, command, **arguments)
        text = text.get_raw_value()
        answer = self._next(self.run.commands, command_key(self.swap.reverse(text), stdin),
                            f"command {text!r}")
        forward = self.swap.forward
        lines = [OutputLine("stdout", forward(line)) for line in answer["stdout"]]
        lines += [OutputLine("stderr", forward(line)) for line in answer["stderr"]]
        code = answer["exit"]
        return (code in success_codes if success_codes else code == 0), CommandOutput(lines)

    def put_file(self, filename_or_io, remote_filename, remote_temp_filename=None,
                 print_output=False, print_input=False, **arguments) -> bool:
        path = self.swap.reverse(remote_filename)
        answer = self._next(self.run.puts, path, f"put of {remote_filename}")
        with get_file_io(filename_or_io) as file_io:
            data = file_io.read()
        data = data.encode() if isinstance(data, str) else data
        recorded = hashlib.sha256(self.swap.reverse(data.decode(errors="surrogateescape"))
                                  .encode(errors="surrogateescape")).hexdigest()
        if recorded != answer["sha256"]:
            self._fail(f"put of {remote_filename}: content differs from the recorded upload")
        return answer["ok"]

    def get_file(self, remote_filename, filename_or_io, remote_temp_filename=None,
                 print_output=False, print_input=False, **arguments) -> bool:
        path = self.swap.reverse(remote_filename)
        answer = self._next(self.run.gets, path, f"get of {remote_filename}")
        data = base64.b64decode(answer["content"])
        text = self.swap.forward(data.decode(errors="surrogateescape"))
        with get_file_io(filename_or_io, "wb") as file_io:
            file_io.write(text.encode(errors="surrogateescape"))
        return answer["ok"]
