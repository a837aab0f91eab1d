"""Faults of a fleet run, without rigs: a full disk in a pull, bounded connections, the table
of failed rigs (issue 30, items 4-6). tests/test_faults_fleet_e2e.py has them on sandbox rigs."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import pytest

from rigbook.models import pull_message
from rigbook.spec import ModelSpec
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


def test_a_write_to_a_full_disk_is_named_and_not_retried(hub_url):
    """/dev/full answers every write with ENOSPC, as a full filesystem does."""
    hub, endpoint = hub_url
    pull = load_pull()
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

