"""The real pyinfra CLI, with a count of what it asks of each host over SSH.

    python bench/counting_pyinfra.py INVENTORY DEPLOY [ARGS...]

Wraps pyinfra's SSH connector so that every remote command (facts and operations alike), file
transfer and connection is counted per host; the counts go to the JSON file named by
RIGBOOK_BENCH_COUNTS when the CLI exits, and with RIGBOOK_BENCH_COMMANDS the text of every
remote command to that file. With RIGBOOK_BENCH_EVENTS, a timeline per host goes to that file for
bench/breakdown.py: every remote command with the operation and the rigbook module it served (the
outermost `rigbook.*` frame of the call stack when the operation was planned or the fact read),
each operation's execution, each role's planning (outermost @deploy calls) and the deploy file's
whole planning. Nothing else about the run changes.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections import Counter, defaultdict
from functools import wraps

import pyinfra.api.operations
import pyinfra_cli.util
from pyinfra import context
from pyinfra.api.state import State
from pyinfra.connectors.ssh import SSHConnector
from pyinfra_cli.main import main

COUNTS: dict[str, Counter] = defaultdict(Counter)
#: With RIGBOOK_BENCH_COMMANDS set, every remote command's text too (to see where time goes).
COMMANDS: dict[str, list[str]] = defaultdict(list)
#: With RIGBOOK_BENCH_EVENTS set, each host's timeline (to see which role the time goes to).
EVENTS: dict[str, list[dict]] = defaultdict(list)
TIMELINE = bool(os.environ.get("RIGBOOK_BENCH_EVENTS"))
#: op hash -> the rigbook module that planned it: its commands at execution are that module's.
OP_MODULES: dict[str, str | None] = {}


def _rigbook_module() -> str | None:
    """The outermost role module on the call stack (rigbook.roles.*): the role a job called,
    whatever helper module the work happens in; else the outermost `rigbook.*` module (the
    job, its preflight)."""
    frame, outermost, role = sys._getframe(1), None, None
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("rigbook."):
            outermost = name
        if name.startswith("rigbook.roles."):
            role = name
        frame = frame.f_back
    return role or outermost


def _op_of(host) -> str | None:
    return host.current_op_hash or host.executing_op_hash


def _counted(method, kind: str):
    @wraps(method)
    def wrapper(self, *args, **kwargs):
        COUNTS[self.host.name][kind] += 1
        if kind == "commands" and os.environ.get("RIGBOOK_BENCH_COMMANDS"):
            command = args[0] if args else kwargs.get("command")
            COMMANDS[self.host.name].append(getattr(command, "get_raw_value", lambda: command)())
        if kind != "commands" or not TIMELINE:
            return method(self, *args, **kwargs)
        op = _op_of(self.host)
        module = OP_MODULES[op] if op in OP_MODULES else _rigbook_module()
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            EVENTS[self.host.name].append({
                "kind": "command", "module": module, "op": op, "start": start,
                "seconds": time.perf_counter() - start,
                "phase": "exec" if self.state.is_executing else "plan"})

    return wrapper


def _event(host, kind: str, start: float, **fields) -> None:
    EVENTS[host.name].append({"kind": kind, "start": start,
                              "seconds": time.perf_counter() - start, **fields})


def _planned_op(set_op_data_for_host):
    """An operation added for a host: remember the module that planned it (a nested operation,
    added while another executes, belongs to that one)."""
    @wraps(set_op_data_for_host)
    def wrapper(self, host, op_hash, op_data):
        if op_hash not in OP_MODULES:
            parent = host.executing_op_hash
            OP_MODULES[op_hash] = OP_MODULES.get(parent) if parent else _rigbook_module()
        EVENTS[host.name].append({"kind": "op_added", "op": op_hash,
                                  "module": OP_MODULES[op_hash]})
        return set_op_data_for_host(self, host, op_hash, op_data)

    return wrapper


def _executed_op(run_host_op):
    """One operation executed on one host (outermost only: a nested one is part of it)."""
    @wraps(run_host_op)
    def wrapper(state, host, op_hash):
        if host.executing_op_hash is not None:
            return run_host_op(state, host, op_hash)
        start = time.perf_counter()
        try:
            return run_host_op(state, host, op_hash)
        finally:
            _event(host, "op", start, op=op_hash, module=OP_MODULES.get(op_hash),
                   names=sorted(state.get_op_meta(op_hash).names))

    return wrapper


def _planned_deploy(wrap_deploy):
    """pyinfra's @deploy wrapper, timing each outermost deploy (a role's planning) per host."""
    def timed_wrap(func):
        deployed = wrap_deploy(func)

        @wraps(deployed)
        def wrapper(*args, **kwargs):
            host = context.host
            if host.current_deploy_name is not None:
                return deployed(*args, **kwargs)
            start = time.perf_counter()
            try:
                return deployed(*args, **kwargs)
            finally:
                _event(host, "deploy", start, module=func.__module__)

        return wrapper

    return timed_wrap


def _planned_file(exec_file):
    """The deploy file, run once per host: the whole planning of that host."""
    @wraps(exec_file)
    def wrapper(*args, **kwargs):
        if not context.ctx_host.isset():
            return exec_file(*args, **kwargs)
        host, start = context.host, time.perf_counter()
        try:
            return exec_file(*args, **kwargs)
        finally:
            _event(host, "plan", start)

    return wrapper


SSHConnector.run_shell_command = _counted(SSHConnector.run_shell_command, "commands")
SSHConnector.put_file = _counted(SSHConnector.put_file, "uploads")
SSHConnector.get_file = _counted(SSHConnector.get_file, "downloads")
SSHConnector.connect = _counted(SSHConnector.connect, "connections")
if TIMELINE:
    State.set_op_data_for_host = _planned_op(State.set_op_data_for_host)
    pyinfra.api.operations.run_host_op = _executed_op(pyinfra.api.operations.run_host_op)
    _deploy_module = sys.modules["pyinfra.api.deploy"]  # pyinfra.api.deploy is also a function
    _deploy_module._wrap_deploy = _planned_deploy(_deploy_module._wrap_deploy)
    pyinfra_cli.util.exec_file = _planned_file(pyinfra_cli.util.exec_file)


@atexit.register
def _write_counts() -> None:
    path = os.environ.get("RIGBOOK_BENCH_COUNTS")
    if path:
        with open(path, "w") as out:
            json.dump({host: dict(counts) for host, counts in COUNTS.items()}, out, indent=2)
    path = os.environ.get("RIGBOOK_BENCH_COMMANDS")
    if path:
        with open(path, "w") as out:
            json.dump(COMMANDS, out, indent=2)
    path = os.environ.get("RIGBOOK_BENCH_EVENTS")
    if path:
        with open(path, "w") as out:
            json.dump(EVENTS, out)


if __name__ == "__main__":
    sys.argv[0] = "pyinfra"
    sys.exit(main())
