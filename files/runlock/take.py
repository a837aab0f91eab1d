"""rigbook's run lock, taken on the rig by the preflight (rigbook/core/runlock.py): one operator a
rig.

argv[1] is the lock file, argv[2] the taker as JSON (operator, pid, started). The lock names the
run's sshd session on the rig (its pid and start time): when that run's connection is gone,
killed operator included, the lock is stale and the next run takes it over. A live holder is
asked again for GRACE_S (a run that just ended may still be closing its connection). Prints one
JSON line: {"taken": true, "stale": old holder or null} or {"taken": false, "holder": holder}.
"""

import fcntl
import json
import os
import sys
import time

GRACE_S = 2.0
#: What may sit between the run's session (sshd, or the operator's own process with the local
#: connector) and this program.
WRAPPERS = ("sh", "dash", "bash", "sudo", "su", "env", "timeout")


def stat(pid):
    """(name, parent pid, start time in clock ticks) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return text[text.index("(") + 1:text.rindex(")")], int(fields[1]), fields[19]


def session():
    """(pid, start time) of the nearest sshd ancestor, else of the first one that is no
    wrapper (the local connector's operator process)."""
    pid, first = os.getppid(), None
    while pid > 1:
        found = stat(pid)
        if found is None:
            break
        name, parent, start = found
        if name.startswith("sshd"):
            return pid, start
        if first is None and name not in WRAPPERS:
            first = (pid, start)
        pid = parent
    return first or (os.getppid(), (stat(os.getppid()) or ("", 0, ""))[2])


def alive(holder):
    found = stat(holder.get("session", 0))
    return found is not None and found[2] == holder.get("session_start")


def main():
    path, taker = sys.argv[1], json.loads(sys.argv[2])
    pid, start = session()
    ssh = os.environ.get("SSH_CONNECTION", "").split()
    taker.update(session=pid, session_start=start, client=ssh[0] if ssh else None)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    deadline = time.monotonic() + GRACE_S
    while True:
        with open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                holder = json.loads(f.read() or "null")
            except ValueError:
                holder = None  # a torn lock file holds nothing
            ours = isinstance(holder, dict) and holder.get("session") == pid \
                and holder.get("session_start") == start
            if isinstance(holder, dict) and not ours and alive(holder):
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                print(json.dumps({"taken": False, "holder": holder}))
                return
            f.seek(0)
            f.truncate()
            f.write(json.dumps(taker) + "\n")
            stale = holder if isinstance(holder, dict) and not ours else None
            print(json.dumps({"taken": True, "stale": stale}))
            return


main()
