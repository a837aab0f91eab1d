"""Faults of a fleet run on sandbox rigs, with the real pyinfra CLI (issue 30, items 4 and 5):
a rig whose link goes down mid-run, a rig whose sshd dies mid-run, a rig that is unreachable
from the start and one the preflight refuses.

Every test puts its rigs back (link up, sshd answering) in `finally`, then proves them fine: a
rerun without the fault converges and a further run reports no changes
(tests/deploys/tuning_host.py). Bounded: every pyinfra run has a time limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

from rigbook import sandbox as sandboxes
from tests.conftest import PYINFRA, ROOT, SANDBOX_INVENTORY, rig_ssh, run_pyinfra

pytestmark = pytest.mark.sandbox

HOLD = "tests/deploys/hold_link.py"
HOLDING = "/run/rigbook-test-holding"
OVERRIDES = "tests/inventories/sandbox_overrides.py"
TUNING = "tests/deploys/tuning_host.py"
#: Short bounds, so that a lost rig fails within KEEPALIVE + LOST_AFTER seconds.
KEEPALIVE, LOST_AFTER = 2, 5
BOUNDS = ("--data", f"link_keepalive={KEEPALIVE}", "--data", f"link_lost_after={LOST_AFTER}")


class Watched:
    """A pyinfra run in the background whose stderr lines are kept with their arrival time."""

    def __init__(self, inventory: str, *args: str, env: dict | None = None):
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            [PYINFRA, "-y", "--json", inventory, *args], cwd=ROOT, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYINFRA_PROGRESS": "off", **(env or {})},
        )
        self.stdout = ""
        self._out = threading.Thread(target=self._read_out)
        self._err = threading.Thread(target=self._read_err)
        self._out.start()
        self._err.start()

    def _read_out(self):
        self.stdout = self.proc.stdout.read()

    def _read_err(self):
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))

    def wait(self, limit: float) -> int:
        try:
            return self.proc.wait(timeout=limit)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._out.join()
            self._err.join()

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, text: str) -> float | None:
        """When a stderr line with `text` came, or None."""
        return next((at for at, line in self.lines if text in line), None)

    def changed(self) -> dict[str, list[str]]:
        results = json.loads(self.stdout).get("results") or {}
        return {op["name"]: op["success"] for op in results.get("operations", [])
                if op["success"]}


def wait_for(check, what: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"timed out after {limit:g} s waiting for {what}"
        time.sleep(0.3)


def holding(rig: dict) -> bool:
    return rig_ssh(rig, f"test -e {HOLDING}", check=False).returncode == 0


def link(rig: dict, state: str) -> None:
    """The rig's side of its veth (host0, inside its network namespace) up or down."""
    subprocess.run(["ip", "-n", sandboxes.prefix() + rig["name"], "link", "set", "host0",
                    state],
                   check=True, timeout=10)


def answers(rig: dict) -> bool:
    try:
        return rig_ssh(rig, "true", check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def put_back(rig: dict) -> None:
    """Link up and sshd answering; started again from inside the rig when it does not."""
    link(rig, "up")
    deadline = time.monotonic() + 30
    while not answers(rig):
        if time.monotonic() > deadline:
            init = sandboxes._container_init(sandboxes.Rig(int(rig["name"][3:]), rig["profile"]))
            subprocess.run(["nsenter", "-t", str(init), "-a", "systemctl", "start",
                            "ssh.service"], check=False, timeout=30)
            wait_for(lambda: answers(rig), f"sshd on {rig['name']}")
            break
        time.sleep(0.5)
    rig_ssh(rig, f"rm -f {HOLDING}")


def converges(*names: str) -> None:
    """A run without the fault converges these rigs; the next one changes nothing."""
    limits = [part for name in names for part in ("--limit", name)]
    first = run_pyinfra(SANDBOX_INVENTORY, TUNING, *limits, timeout=300)
    assert first.returncode == 0, first.explain()
    again = run_pyinfra(SANDBOX_INVENTORY, TUNING, *limits, timeout=300)
    assert again.returncode == 0 and again.changed() == {}, again.explain()


def test_a_rig_whose_link_goes_down_fails_within_the_bound_and_the_others_go_on(sandbox):
    """Seen before: pyinfra sat silent while a rig's veth was down, and for ever if it stayed
    down. Now the rig fails within link_keepalive + link_lost_after, saying so, while the
    other rig finishes its hold and goes on to the next operation."""
    rig1, rig2 = sandbox["rig1"], sandbox["rig2"]
    try:
        run = Watched(SANDBOX_INVENTORY, HOLD, "--limit", "rig1", "--limit", "rig2", *BOUNDS,
                      env={"RIGBOOK_TEST_HOLD_S": "40"})
        try:
            wait_for(lambda: holding(rig1) and holding(rig2), "both holds to start")
        finally:
            link(rig2, "down")
        down = time.monotonic()
        assert run.wait(limit=120) != 0
        lost = run.first("lost the connection to rig2")
        assert lost is not None, run.stderr
        assert lost - down <= KEEPALIVE + LOST_AFTER + 3, (lost - down, run.stderr)
        print(f"rig2 failed {lost - down:.1f} s after its link went down "
              f"(bound {KEEPALIVE + LOST_AFTER} s)")
        assert (f"lost the connection to rig2: no answer within {KEEPALIVE + LOST_AFTER} s "
                f"(link_keepalive {KEEPALIVE} s + link_lost_after {LOST_AFTER} s), or the rig "
                'closed it, during "Hold the connection"') in run.stderr
        assert run.changed()["After the hold"] == ["rig1"], run.stderr  # rig1 went on
        assert "    rig2  lost the connection to rig2: no answer within" in run.stderr
        assert "    rig1  " not in run.stderr
    finally:
        put_back(rig2)
    converges("rig1", "rig2")


def test_a_fleet_run_ends_with_each_failed_rig_its_reason_and_the_retry_command(sandbox):
    """rig1 loses its sshd mid-run, rig2 is unreachable (link down from the start), rig3 is
    refused by the preflight (declared debian, it is WSL2): the run ends with one table of the
    three and the command that retries just them, which succeeds once the faults are gone."""
    rig1, rig2 = sandbox["rig1"], sandbox["rig2"]
    overrides = {"RIGBOOK_TEST_OVERRIDES": json.dumps({"rig3": {"platform": "debian"}}),
                 "RIGBOOK_TEST_HOLD_S": "40"}
    try:
        link(rig2, "down")
        run = Watched(OVERRIDES, HOLD, *BOUNDS, env=overrides)
        try:
            wait_for(lambda: holding(rig1), "rig1's hold to start", limit=90)
        finally:  # the sessions' sshd processes too: the connection closes at once
            rig_ssh(rig1, "systemctl kill --signal=KILL ssh.service", check=False)
        assert run.wait(limit=120) != 0
        said = run.stderr
        assert "--> rigbook: 3 of 3 rig(s) failed:" in said, said
        table = said[said.index("--> rigbook: 3 of 3 rig(s) failed:"):]
        rows = table.splitlines()
        assert rows[1].startswith('    rig1  lost the connection to rig1'), table
        assert rows[1].endswith(', during "Hold the connection"'), table
        assert rows[2] == ("    rig2  unreachable: pyinfra could not connect (its message is "
                           "above)"), table
        assert rows[3].startswith("    rig3  refused by the preflight (platform): platform: "
                                  "declared debian but this host is WSL2"), table
        retry = (f"pyinfra -y --json {OVERRIDES} {HOLD} --data link_keepalive={KEEPALIVE} "
                 f"--data link_lost_after={LOST_AFTER} --limit rig1 --limit rig2 --limit rig3")
        assert rows[4] == f"    retry just these: {retry}", table
    finally:
        put_back(rig2)
        put_back(rig1)
    # The retry command, with the faults gone (rig3 declared as it is): all three succeed.
    argv = retry.split()[1:]
    again = run_pyinfra(argv[2], *argv[3:], timeout=300)
    assert again.returncode == 0, again.explain()
    assert again.changed()["After the hold"] == ["rig1", "rig2", "rig3"], again.explain()
    assert "rig(s) failed" not in again.stderr
    converges("rig1", "rig2", "rig3")
