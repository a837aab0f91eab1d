"""The real pyinfra CLI, with a count of what it asks of each host over SSH.

    python bench/counting_pyinfra.py INVENTORY DEPLOY [ARGS...]

Wraps pyinfra's SSH connector so that every remote command (facts and operations alike), file
transfer and connection is counted per host; the counts go to the JSON file named by
RIGBOOK_BENCH_COUNTS when the CLI exits, and with RIGBOOK_BENCH_COMMANDS the text of every
remote command to that file. Nothing else about the run changes.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections import Counter, defaultdict
from functools import wraps

from pyinfra.connectors.ssh import SSHConnector
from pyinfra_cli.main import main

COUNTS: dict[str, Counter] = defaultdict(Counter)
#: With RIGBOOK_BENCH_COMMANDS set, every remote command's text too (to see where time goes).
COMMANDS: dict[str, list[str]] = defaultdict(list)


def _counted(method, kind: str):
    @wraps(method)
    def wrapper(self, *args, **kwargs):
        COUNTS[self.host.name][kind] += 1
        if kind == "commands" and os.environ.get("RIGBOOK_BENCH_COMMANDS"):
            command = args[0] if args else kwargs.get("command")
            COMMANDS[self.host.name].append(getattr(command, "get_raw_value", lambda: command)())
        return method(self, *args, **kwargs)

    return wrapper


SSHConnector.run_shell_command = _counted(SSHConnector.run_shell_command, "commands")
SSHConnector.put_file = _counted(SSHConnector.put_file, "uploads")
SSHConnector.get_file = _counted(SSHConnector.get_file, "downloads")
SSHConnector.connect = _counted(SSHConnector.connect, "connections")


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


if __name__ == "__main__":
    sys.argv[0] = "pyinfra"
    sys.exit(main())
