"""The bench's replay connector (bench/replay/), from the committed recordings of one sandbox
rig: replayed rigs through the real pyinfra and rigbook CLIs, no SSH, no container.

A change to the commands rigbook (or the stock peer) sends makes the replayed converges fail,
naming the command the recording lacks: record again on a sandbox rig, `.venv/bin/python -m
bench --replay --record --sizes 16` (about 30 s), and commit bench/replay/recordings/."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench.replay import scale
from bench.replay.recording import Identity, Swap, command_key, identity, load, scrub


def _recording(tool: str):
    return load(str(scale.RECORDINGS / f"{tool}.json"))


def test_each_replayed_rig_has_its_own_name_address_and_gpus():
    recorded = _recording("rigbook-full").identity
    rigs = [identity(index, recorded) for index in range(300)]
    for field in ("name", "address", "uuids"):
        values = [getattr(rig, field) for rig in rigs]
        assert len(set(values)) == len(rigs)
        assert getattr(recorded, field) not in values
    assert all(len(rig.uuids) == len(recorded.uuids) == 2 for rig in rigs)
    assert rigs[0].name == "replay-0001" and rigs[299].address == "10.200.1.43"


def test_the_swap_goes_both_ways_and_carries_the_hashes_of_files_naming_the_rig():
    import hashlib

    recorded = Identity("rig1", "10.231.1.2", ("GPU-aaaa", "GPU-bbbb"))
    unit = "ExecStart=/usr/bin/nvidia-smi -i GPU-aaaa -pl 290\n"
    rig = identity(6, recorded)
    swap = Swap(recorded, rig, [unit])
    answer = f"rig1 at 10.231.1.2: GPU-bbbb {hashlib.sha256(unit.encode()).hexdigest()}"
    mine = unit.replace("GPU-aaaa", rig.uuids[0])
    assert swap.forward(answer) == (f"replay-0007 at {rig.address}: {rig.uuids[1]} "
                                    f"{hashlib.sha256(mine.encode()).hexdigest()}")
    assert swap.reverse(swap.forward(answer)) == answer


def test_the_run_locks_taker_is_the_one_part_of_a_command_that_may_differ():
    taker = '{"operator": "ops@desk", "pid": 4242, "started": "2026-12-04T19:09:13Z"}'
    assert scrub(taker) == '{"operator": "OPERATOR", "pid": 0, "started": "STARTED"}'
    assert command_key(f"lock {taker}", None) == command_key(f"lock {scrub(taker)}", None)
    assert command_key("cat", "a") != command_key("cat", "b")


@pytest.mark.parametrize("tool", list(scale.TOOLS))
def test_a_replayed_no_change_converge_reports_no_changes(tool):
    done = scale.run_replay(tool, "no_change", 3)
    assert done.exit == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)["results"]
    assert results["failed_hosts"] == []
    assert sorted(scale.changes_by_host(done.stdout)) == []  # no rig changed anything
    assert {op["hosts"] for op in results["operations"]} == {3}  # every rig ran every op


@pytest.mark.parametrize("tool", list(scale.TOOLS))
def test_a_replayed_first_converge_makes_the_recorded_changes_on_every_rig(tool):
    recording = _recording(tool)
    recorded = recording.runs["first"].changes
    assert len(recorded) >= 20  # the recorded first converge did change the rig
    done = scale.run_replay(tool, "first", 3)
    assert done.exit == 0, done.stderr[-3000:]
    changed = scale.changes_by_host(done.stdout)
    assert sorted(changed) == ["replay-0001", "replay-0002", "replay-0003"]
    for index, name in enumerate(sorted(changed)):
        assert changed[name] == [recording.swap(index).forward(op) for op in recorded]


def test_a_replayed_cap_change_sets_each_rigs_own_gpus():
    done = scale.run_replay("rigbook-full", "cap_change", 2)
    assert done.exit == 0, done.stderr[-3000:]
    assert len(scale.changes_by_host(done.stdout)) == 2
    recorded = _recording("rigbook-full").identity
    for index in range(2):
        for uuid in identity(index, recorded).uuids:
            assert uuid in done.stdout + done.stderr  # the cap table names each rig's GPUs
    assert recorded.uuids[0] not in done.stdout + done.stderr


def test_rigbook_status_reads_replayed_rigs():
    done = scale.run_replay("rigbook-full", "status", 3)
    assert done.exit == _recording("rigbook-full").runs["status"].exit, done.stderr[-3000:]
    rows = json.loads(done.stdout)["rigs"]
    assert [row["name"] for row in rows] == ["replay-0001", "replay-0002", "replay-0003"]


def test_a_command_not_recorded_fails_the_rig_naming_the_command(tmp_path):
    data = json.loads((scale.RECORDINGS / "rigbook-full.json").read_text())
    events = data["runs"]["no_change"]["events"]
    dropped = next(e for e in events if "systemctl show" in e["command"])
    events.remove(dropped)
    path = tmp_path / "rigbook-full.json"
    path.write_text(json.dumps(data))
    done = scale.run_replay("rigbook-full", "no_change", 2, recording=path)
    assert done.exit != 0
    for name in ("replay-0001", "replay-0002"):
        assert f"replay: {name}: not recorded: command " in done.stderr
    assert "systemctl show --property SubState" in done.stderr


def test_a_command_asked_more_often_than_recorded_fails_the_rig(tmp_path):
    data = json.loads((scale.RECORDINGS / "rigbook-full.json").read_text())
    run = data["runs"]["first"]
    by_key = Counter(command_key(e["command"], e.get("stdin")) for e in run["events"]
                     if e["kind"] == "command")
    key, count = by_key.most_common(1)[0]
    assert count >= 2
    last = [e for e in run["events"] if e["kind"] == "command"
            and command_key(e["command"], e.get("stdin")) == key][-1]
    run["events"].remove(last)  # one answer fewer than the rig asks for
    path = tmp_path / "rigbook-full.json"
    path.write_text(json.dumps(data))
    done = scale.run_replay("rigbook-full", "first", 1, recording=path)
    assert done.exit != 0
    assert f"replay: replay-0001: recorded {count - 1} time(s), asked once more: " \
           "command" in done.stderr
