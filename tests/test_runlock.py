"""The run lock's rig-side program (files/runlock/take.py), run here as the rig runs it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from rigbook.core.runlock import RunLock, holder_text, this_run


def take(lock: Path, taker: str | None = None) -> dict:
    command = RunLock().command(taker or this_run()).get_raw_value()
    done = subprocess.run(["sh", "-c", command.replace("/run/lock/rigbook/run.lock", str(lock))],
                          capture_output=True, text=True, check=True, timeout=30)
    return RunLock().process(done.stdout.splitlines())


def start_of(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()[19]


def test_a_live_holder_refuses_a_dead_one_is_taken_over(tmp_path):
    lock = tmp_path / "rigbook" / "run.lock"
    first = take(lock)
    assert first == {"taken": True, "stale": None}
    mine = json.loads(lock.read_text())
    assert mine["pid"] and mine["operator"].count("@") == 1 and mine["session"] > 1
    assert take(lock) == {"taken": True, "stale": None}  # the same session takes it again

    holder = subprocess.Popen(["sleep", "60"])
    try:
        other = {"operator": "ana@desk", "pid": 4242, "started": "2026-12-02T20:20:01Z",
                 "session": holder.pid, "session_start": start_of(holder.pid), "client": None}
        lock.write_text(json.dumps(other))
        refused = take(lock)
        assert refused == {"taken": False, "holder": other}
        assert holder_text(other) == "ana@desk (pid 4242) since 2026-12-02T20:20:01Z"
        assert json.loads(lock.read_text()) == other  # a refused run changes nothing
    finally:
        holder.kill()
        holder.wait()
    stale = take(lock)  # its session is gone: the lock is stale
    assert stale == {"taken": True, "stale": other}
    assert json.loads(lock.read_text())["session"] == mine["session"]
    # a pid reused by another process is no holder: its start time differs
    lock.write_text(json.dumps({**other, "session": mine["session"], "session_start": "1"}))
    assert take(lock)["taken"]


def test_a_torn_lock_file_holds_nothing(tmp_path):
    lock = tmp_path / "run.lock"
    lock.write_text('{"operator": "ana@de')
    assert take(lock) == {"taken": True, "stale": None}
    assert json.loads(lock.read_text())["session"] > 1
