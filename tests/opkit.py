"""Running an operation's body against fake facts, as pyinfra would, to see its commands.

pyinfra's own operation tests feed facts to an operation and compare the commands it yields;
this is the same idea for rigbook's custom operations, without pyinfra's test harness.
"""

from __future__ import annotations

import hashlib
import subprocess

from pyinfra.api import Config, FunctionCommand, Inventory, State, StringCommand
from pyinfra.api.command import FileUploadCommand
from pyinfra.context import ctx_host, ctx_state

from rigbook.core.managed import FileState


class Calls(list):
    """Successive answers of one fact, for operations that read it again after a step.

    A fake fact may also be a function of the fact's arguments (e.g. path=...).
    """


class FakeHost:
    """The few parts of pyinfra's Host an operation body touches."""

    def __init__(self, facts: dict, name: str = "rig1"):
        self.name = name
        self.print_prefix = f"[{name}] "
        self.facts = {"SystemdBooted": True, **facts}  # a rig runs systemd unless told
        self.asked: list[tuple[str, dict]] = []
        self.noops: list[str] = []
        self.logged: list[str] = []
        self.current_op_global_arguments: dict = {}
        self.current_op_hash = None

    def get_fact(self, cls, *args, **kwargs):
        self.asked.append((cls.__name__, kwargs))
        value = self.facts[cls.__name__]
        if isinstance(value, Calls):
            return value.pop(0)
        return value(**kwargs) if callable(value) else value

    def get_temp_filename(self, key: str = "", temp_directory=None) -> str:
        return f"/tmp/pyinfra-{abs(hash(key))}"

    def noop(self, text: str) -> None:
        self.noops.append(text)

    def log_styled(self, message: str, **_) -> None:
        self.logged.append(message)


def file_states(files: dict | None = None, mode: int = 0o644, dirs: dict | None = None):
    """A fake rigbook.core.managed.FileStates: each file's content (str or bytes) and each folder's
    mode by path; any other path is absent."""
    files, dirs = files or {}, dirs or {}

    def fact(paths):
        states = {}
        for path in paths:
            if files.get(path) is not None:
                data = files[path].encode() if isinstance(files[path], str) else files[path]
                states[path] = FileState("file", mode, hashlib.sha256(data).hexdigest())
            else:
                states[path] = FileState("directory", dirs[path]) if path in dirs else None
        return states

    return fact


def run_op(op, facts: dict, *args, name: str = "rig1", executing: bool = False, **kwargs):
    """An operation's commands and the fake host it ran on (prepare time unless executing)."""
    fake = FakeHost(facts, name)
    state = State(Inventory(([name], {})), Config())
    state.is_executing = executing
    with ctx_state.use(state), ctx_host.use(fake):
        commands = list(op._inner(*args, **kwargs))
    return commands, fake


def shell(commands) -> list[str]:
    """The shell commands among what an operation yielded."""
    return [c.get_raw_value() for c in commands if isinstance(c, StringCommand)]


def describe(command) -> str:
    """One line per yielded command: the shell text, an upload's destination, a call's name."""
    if isinstance(command, FileUploadCommand):
        return f"upload {command.dest}"
    if isinstance(command, FunctionCommand):
        return f"call {command.function.__name__}"
    assert isinstance(command, StringCommand), command
    return command.get_raw_value()


def execute(command: FunctionCommand, fake: FakeHost) -> bool:
    """What a FunctionCommand does when pyinfra executes it."""
    return command.function(None, fake, *command.args, **command.kwargs)


def local_fact(fact_cls, **kwargs):
    """Run a fact's command on this machine and process its stdout, as pyinfra would."""
    fact = fact_cls()
    command = fact.command(**kwargs)
    text = command.get_raw_value() if isinstance(command, StringCommand) else command
    proc = subprocess.run(["sh", "-c", text], capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    return fact.process(lines) if lines else fact.default()
