"""rigbook.core.progress: a command's progress file read while the command runs, against a fake rig
that writes the file in gevent time (the reads and the command share one connection there)."""

from __future__ import annotations

import gevent
from pyinfra.api import StringCommand
from pyinfra.connectors.util import CommandOutput, OutputLine

from rigbook.core.progress import FileTail, progress_every, run_watched


def stdout(*lines: str) -> CommandOutput:
    return CommandOutput([OutputLine("stdout", line) for line in lines])


class FakeRig:
    """Runs `rm -f`, `tail -c +N FILE ...` and one work command that writes `chunks` to the
    file, one every `step` seconds (a chunk may end in the middle of a line), then prints
    `result`."""

    def __init__(self, chunks: list[str], step: float, result: str = '{"status": "complete"}',
                 fail_reads: int = 0):
        self.chunks, self.step, self.result, self.fail_reads = chunks, step, result, fail_reads
        self.file = b"old line of an earlier run\n"
        self.print_prefix = "[rig1] "
        self.commands: list[str] = []

    def run_shell_command(self, command, print_output=False, print_input=False, **arguments):
        text = command.get_raw_value()
        self.commands.append(text.split()[0])
        if text.startswith("rm -f "):
            self.file = b""
            return True, stdout()
        if text.startswith("tail -c +"):
            if self.fail_reads:
                self.fail_reads -= 1
                raise OSError("channel closed")
            assert arguments["_timeout"] == 30
            offset = int(text.split()[2][1:]) - 1
            lines = self.file[offset:].decode().split("\n")  # what echo + the mark print
            return True, stdout(*lines, "rigbook-progress-end")
        assert "_timeout" not in arguments
        self.work = {"print_output": print_output, **arguments}
        for chunk in self.chunks:
            gevent.sleep(self.step)
            self.file += chunk.encode()
        return True, stdout(self.result)


def test_progress_every_from_the_environment():
    assert progress_every({}) == 5.0
    assert progress_every({"RIGBOOK_PROGRESS_EVERY": "1"}) == 1.0
    assert progress_every({"RIGBOOK_PROGRESS_EVERY": "0"}) == 0.2  # never a busy loop
    assert progress_every({"RIGBOOK_PROGRESS_EVERY": "soon"}) == 5.0


def test_file_tail_takes_complete_lines_and_leaves_the_rest():
    tail = FileTail("/opt/x.log")
    assert tail.command().get_raw_value() == (
        "tail -c +1 /opt/x.log 2>/dev/null; echo; echo rigbook-progress-end")
    assert tail.take(["a", "bé", "", "rigbook-progress-end"]) == ["a", "bé"]
    assert tail.offset == len("a\nbé\n".encode())
    assert tail.take(["c", "hal", "rigbook-progress-end"]) == ["c"]  # "hal" is still written
    assert tail.offset == len("a\nbé\nc\n".encode())
    assert tail.take(["", "rigbook-progress-end"]) == []  # nothing new, or no file yet
    assert tail.take(["cut short"]) == [] and tail.offset == 8  # no end mark: taken next time
    assert "tail -c +9 " in tail.command().get_raw_value()


def test_lines_show_while_the_command_runs_and_once_more_at_its_end():
    rig = FakeRig(["one\ntw", "o\n", "three\n", "four\nfive\n"], step=0.05, fail_reads=1)
    shown: list[list[str]] = []
    ok, output, lines = run_watched(
        rig, StringCommand("work"), "/opt/x.log", shown.append, 0.03, print_output=True,
        _sudo=True)
    assert ok and output.stdout == '{"status": "complete"}'
    assert rig.work == {"print_output": True, "_sudo": True}
    assert lines == ["one", "two", "three", "four", "five"]  # the earlier run's line was removed
    assert sum(shown, []) == lines and len(shown) >= 3  # several reads, each line once, whole
    assert rig.commands[:2] == ["rm", "work"] and rig.commands[-1] == "tail"
    assert rig.commands.count("tail") >= 5  # a failed read cost nothing but its lines
