"""One operator per rig: the run lock, taken by the preflight before anything changes.

Two converges of one rig at once both build the same spec, restart the same unit and fail each
other (issue 30). So the preflight of every deploy first takes /run/lock/rigbook/run.lock on the
rig (files/runlock/take.py): it records the operator (user@host, pid, start time) and the run's
sshd session on the rig. A second run meets a live holder and is refused, named, before it
reads or changes anything else. There is no release step: the lock lives as long as the
holder's SSH session, so a run that ends, fails or is killed (its connection closes) leaves a
stale lock that the next run takes over. /run is emptied at boot.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time

from pyinfra import logger
from pyinfra.api import FactBase, QuoteString, StringCommand
from pyinfra.api.facts import get_fact

from rigbook import FILES

LOCK = "/run/lock/rigbook/run.lock"
PROGRAM = FILES / "runlock" / "take.py"


class RunLock(FactBase[dict | None]):
    """
    Takes the run lock for this run, or names who holds it (a fact, because it must run while
    the deploy is planned, before any operation). Output: one JSON line::

        {"taken": false, "holder": {"operator": "ana@desk", "pid": 4242, "started":
         "2026-12-02T20:20:01Z", "session": 731, "session_start": "88123", "client": "10.0.0.5"}}
    """

    def command(self, taker: str) -> StringCommand:
        return StringCommand("python3", "-I", "-S", "-c", QuoteString(PROGRAM.read_text()),
                             QuoteString(LOCK), QuoteString(taker))

    def process(self, output: list[str]) -> dict | None:
        try:
            answer = json.loads(output[-1]) if output else None
        except ValueError:
            return None
        return answer if isinstance(answer, dict) else None


def this_run() -> str:
    """Who takes the lock: this operator process, as JSON."""
    return json.dumps({
        "operator": f"{getpass.getuser()}@{socket.gethostname()}", "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })


def holder_text(holder: dict) -> str:
    client = f", from {holder['client']}" if holder.get("client") else ""
    return (f"{holder.get('operator', '?')} (pid {holder.get('pid', '?')}{client}) since "
            f"{holder.get('started', '?')}")


def take(state, host) -> str | None:
    """None when this run holds the rig's lock now (free, stale or already ours); else why
    not, naming the live holder."""
    answer = get_fact(state, host, RunLock, kwargs={"taker": this_run(), "_timeout": 30},
                      apply_failed_hosts=False)
    if answer is None:
        return (f"could not take the run lock {LOCK} (python3 -I -S {PROGRAM.name} gave no "
                "answer): nothing was changed")
    if not answer.get("taken"):
        return (f"another run holds this rig: {holder_text(answer.get('holder') or {})}. One "
                f"operator per rig: nothing was changed; run again once it ended (its lock, "
                f"{LOCK}, goes stale when its SSH connection closes)")
    if answer.get("stale"):
        logger.debug(f"{host.print_prefix}took over the run lock of the ended run "
                     f"{holder_text(answer['stale'])}")
    return None
