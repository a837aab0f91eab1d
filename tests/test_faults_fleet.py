"""Faults of a fleet run, without rigs: a full disk in a pull, bounded connections, the table
of failed rigs (issue 30, items 4-6). tests/test_faults_fleet_e2e.py has them on sandbox rigs."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import pytest

from rigbook.core.spec import ModelSpec
from rigbook.roles.models import pull_message
from tests.hubstub import mirror, tiny_repo
from tests.test_models import COMMIT, Recording, load_pull, requests, resolve_url

# --- a full disk is a full disk (ENOSPC), not a dropped connection ------------------------------


@pytest.fixture
def hub_url(tmp_path):
    """tiny's repo on a loopback stub hub that logs its requests: (hub, endpoint)."""
    from tests.hubstub import Hub

    hub = Hub((tiny_repo(),), log_path=str(tmp_path / "requests.jsonl"))
    hub.auths, hub.dropped = [], False
    server = mirror.server(type("Bound", (Recording,), {"hub": hub}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield hub, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def onto_dev_full(pull, monkeypatch):
    """/dev/full exists, so pull's own O_EXCL (a download never opens a file that is there)
    would refuse it: the stand-in for a full filesystem opens it without O_EXCL."""
    monkeypatch.setattr(pull, "new_file", lambda path, flags: os.open(path, flags & ~os.O_EXCL))


def test_a_write_to_a_full_disk_is_named_and_not_retried(hub_url, monkeypatch):
    """/dev/full answers every write with ENOSPC, as a full filesystem does."""
    hub, endpoint = hub_url
    pull = load_pull()
    onto_dev_full(pull, monkeypatch)
    meta = tiny_repo().file("model.safetensors").entry().manifest_entry()
    with pytest.raises(pull.DiskFull) as raised:
        pull.stream(resolve_url(endpoint), None, Path("/dev/full"), meta)
    assert str(raised.value) == (
        f"no space left on /dev ([Errno 28] No space left on device) writing byte 0 of "
        f"{meta['size']}")
    assert not isinstance(raised.value, OSError)  # nothing takes it for a dropped connection
    assert len([r for r in requests(hub) if r["route"] == "resolve"]) == 1  # one GET: no retry


def test_a_pull_that_fills_the_disk_stops_and_says_what_to_free(hub_url, tmp_path, monkeypatch):
    """download() with every write going to /dev/full: the first file fails as a full disk,
    the others are not started, and pull's message names the filesystem and the bytes."""
    hub, endpoint = hub_url
    pull, repo = load_pull(), tiny_repo()
    onto_dev_full(pull, monkeypatch)
    stream = pull.stream
    monkeypatch.setattr(pull, "stream", lambda url, token, target, meta: stream(
        url, token, Path("/dev/full"), meta))
    files = {f.path: f.entry().manifest_entry() for f in repo.files}
    args = argparse.Namespace(cache=str(tmp_path / "hub"), repo=repo.repo_id,
                              revision=repo.commit, endpoint=endpoint, workers=1)
    errors, hashed, bad, full = pull.download(args, files)
    first = sorted(files)[0]
    assert full == [first] and hashed == {} and bad == {}
    assert errors[first].startswith("DiskFull: no space left on /dev ([Errno 28]")
    assert {errors[path] for path in sorted(files)[1:]} == {"not started: the disk is full"}

    monkeypatch.setattr(pull, "free_bytes", lambda path: 3 * 1024**3)
    monkeypatch.setattr(pull, "mount_point", lambda path: "/var")
    said = pull.disk_full("/var/hub", {"a": {"size": 5 * 1024**3}}, ["a"])
    assert said == {
        "filesystem": "/var", "need_bytes": 5 * 1024**3, "free_bytes": 3 * 1024**3,
        "files": ["a"], "message": (
            "the disk is full: no space left on /var (ENOSPC, [Errno 28]) while writing a; not "
            "retried. The snapshot still needs 5.00 GiB, 3.00 GiB is free on /var (cache "
            "/var/hub): free at least 2.00 GiB there, or move models_cache to a larger disk, "
            "then run again")}
    result = {"status": "partial", "missing": ["a"], "errors": {"a": errors[first]},
              "disk_full": said}
    line = pull_message(ModelSpec(repo="org/model", revision=COMMIT), result)
    assert line.endswith(f"PARTIAL snapshot, not complete: {said['message']}")
    assert "dropped" not in line and "run again to finish" not in line


# --- connections that cannot hang (rigbook/core/link.py) ------------------------------------------


RIG = {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 1}


class _Client:
    def __init__(self, transport):
        self.transport = transport

    def get_transport(self):
        return self.transport


class _Host:
    """What link reads of a pyinfra host: its name and its connector's paramiko client."""

    def __init__(self, name, transport):
        self.name = name
        self.connector = argparse.Namespace(client=_Client(transport))


def test_a_rigs_connection_gets_keepalives_and_a_bound_on_silence(tmp_path):
    """On a real TCP connection (loopback): the SSH keepalive interval and TCP_USER_TIMEOUT
    that the kernel will drop the connection after, read back from the socket."""
    import socket

    import paramiko
    from pyinfra.api import Config, Inventory, State

    from rigbook.core import link
    from rigbook.core.spec import parse_rig

    server = socket.create_server(("127.0.0.1", 0))
    sock = socket.create_connection(server.getsockname())
    transport = paramiko.Transport(sock)
    try:
        state = State(Inventory((["rig1"], {})), Config())
        host = _Host("rig1", transport)
        rig = parse_rig("rig1", {**RIG, "link_keepalive": 3, "link_lost_after": 20})
        link.bound(state, host, rig)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 20_000
        assert transport.packetizer._Packetizer__keepalive_interval == 3
        link.bound(state, host, rig)  # a second deploy of the run: one callback, not two
        assert [type(h) for h in state.callback_handlers] == [link.Reconnects]
        assert link.lost(host)  # never started: not an active connection
        assert link.lost_text(host) == (
            "lost the connection to rig1: no answer within 23 s (link_keepalive 3 s + "
            "link_lost_after 20 s), or the rig closed it")
        assert not link.lost(argparse.Namespace(name="local", connector=object()))  # @local
    finally:
        transport.close()
        sock.close()
        server.close()


@pytest.mark.parametrize("data, problem", [
    ({"link_keepalive": 0}, "link_keepalive"), ({"link_keepalive": 301}, "link_keepalive"),
    ({"link_lost_after": 4}, "link_lost_after"), ({"link_lost_after": "45"}, "link_lost_after"),
    ({"link_lost_after": 3601}, "link_lost_after"), ({"link_keepalive": True}, "link_keepalive"),
])
def test_link_bounds_outside_their_ranges_are_refused(data, problem):
    from rigbook.core.errors import RigbookError
    from rigbook.core.spec import parse_rig

    with pytest.raises(RigbookError, match=problem):
        parse_rig("rig1", {**RIG, **data})
    assert parse_rig("rig1", RIG).link_keepalive + parse_rig("rig1", RIG).link_lost_after == 60


def test_a_rigs_own_connect_timeout_bounds_a_rig_that_never_answers(tmp_path):
    """pyinfra has no connect-timeout key of its own per host: its CONNECT_TIMEOUT (10 s) is one
    for the run. Its ssh_paramiko_connect_kwargs is per host, and its `timeout` bounds the TCP
    connect and the SSH handshake: a loopback listener that accepts and never says a word fails
    the rig after 2 s, through the real CLI and rigbook's check before connecting. The 2 s are
    timed on the listener, from the connection to its close: the CLI's start (several seconds on
    a loaded machine) is not in them."""
    import socket
    import subprocess
    import sys
    import threading
    import time

    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never speaks
    held: list[float] = []  # seconds from the connection to the rig's giving up

    def hold() -> None:
        conn, _ = silent.accept()
        opened = time.monotonic()
        with conn:
            while conn.recv(1024):
                pass
        held.append(time.monotonic() - opened)

    listener = threading.Thread(target=hold, daemon=True)
    listener.start()
    inventory = tmp_path / "silent.py"
    inventory.write_text(f"rigs = [('rig-silent', {{'ssh_hostname': '127.0.0.1', 'ssh_port': "
                         f"{silent.getsockname()[1]}, 'ssh_user': 'root', **{RIG!r}, "
                         "'ssh_paramiko_connect_kwargs': {'timeout': 2}})]\n")
    root = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run(
            [str(Path(sys.executable).with_name("pyinfra")), "-y", str(inventory),
             "tests/deploys/tuning_host.py"],
            cwd=root, capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYINFRA_PROGRESS": "off"},
        )
        listener.join(timeout=10)
    finally:
        silent.close()
    assert done.returncode != 0
    assert "[rig-silent] SSH error (" in done.stderr, done.stderr
    assert "Error reading SSH protocol banner" in done.stderr, done.stderr
    assert len(held) == 1 and 1 < held[0] < 6, held  # 2 s; not CONNECT_TIMEOUT's 10 s


# --- the table that ends a fleet run (rigbook/fleet.py) -------------------------------------------


def test_the_retry_command_is_the_run_for_the_failed_rigs_only():
    from rigbook.fleet import retry_command

    argv = ["/venv/bin/pyinfra", "-y", "inventory/rigs.py", "deploys/rig.py", "--limit", "gpu",
            "--exclude=rig9", "--data", "allow_reboot=true", "--limit=rig7", "--exclude", "x"]
    assert retry_command(argv, ["rig2", "rig4"]) == (
        "pyinfra -y inventory/rigs.py deploys/rig.py --data allow_reboot=true "
        "--limit rig2 --limit rig4")
    assert retry_command(["pyinfra", "inv.py", "my deploy.py"], ["rig1"]) == (
        "pyinfra inv.py 'my deploy.py' --limit rig1")


def test_the_closing_table_names_each_failed_rig_with_its_reason():
    from pyinfra.api import Config, Inventory, State

    from rigbook import fleet
    from rigbook.core.checks import error
    from rigbook.preflight import refusal_reason

    state = State(Inventory((["rig1", "rig2", "rig3", "rig4"], {})), Config())
    assert fleet.table(state, ["pyinfra", "inv.py", "d.py"]) is None  # nothing failed
    rig1, rig2, rig3, rig4 = state.inventory
    state.activated_hosts.update(state.inventory)
    state.failed_hosts.update({rig2, rig3, rig4})
    fleet.watch(state)  # rig2..4 never connected: unreachable
    fleet.note(state, "rig3", "operation \"Install the driver\" failed")
    fleet.note(state, "rig3", "a later reason is not kept")
    state2 = State(Inventory((["rig9"], {})), Config())
    fleet.note(state2, "rig9", "another run's rig")
    reason = refusal_reason([error("power", "400 W is above the card's 350 W", "power_limit_w"),
                             error("driver", "installed 590", "driver_version")])
    assert reason == ("refused by the preflight (power_limit_w, driver_version): "
                      "power_limit_w: 400 W is above the card's 350 W (and 1 more)")
    assert fleet.table(state, ["pyinfra", "inv.py", "d.py", "--limit", "all"]) == "\n".join([
        "--> rigbook: 3 of 4 rig(s) failed:",
        f"    rig2  {fleet.UNREACHABLE}",
        f"    rig3  {fleet.UNREACHABLE}",
        f"    rig4  {fleet.UNREACHABLE}",
        "    retry just these: pyinfra inv.py d.py --limit rig2 --limit rig3 --limit rig4",
    ])
    state3 = State(Inventory((["rig1", "rig2"], {})), Config())
    state3.activated_hosts.update(state3.inventory)
    fleet.watch(state3)
    state3.failed_hosts.update(state3.inventory)
    fleet.note(state3, "rig1", 'operation "Install the driver" failed')
    fleet.note(state3, "rig1", "a later reason is not kept")
    assert fleet.table(state3, ["pyinfra", "inv.py", "d.py"]).splitlines()[1:3] == [
        '    rig1  operation "Install the driver" failed', f"    rig2  {fleet.UNKNOWN}"]
