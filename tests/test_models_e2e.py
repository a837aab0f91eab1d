"""Models end to end on a sandbox rig: deploys/models.py against a hub stub inside the rig.

The rigs have no route out and cannot reach this machine's loopback, so tests/hubstub.py is
copied to the rig and started there on 127.0.0.1 with systemd-run (it outlives the SSH session;
the fixture stops it). The rig's host data comes from the sandbox inventory plus --data: the
models, models_endpoint pointing at the stub, the fleet's mirror token file (the stub is a
mirror here: it serves the same routes as rigbook's, manifest included, and wants that token),
and the wheelhouse as the package source of the tools venv. The stub logs every request, so
"no network call" is counted, not assumed.

One rig, in order: an interrupted pull is reported partial and fails the rig; the next run
fetches only the missing file; the one after changes nothing and makes no request; a 10 TB repo
is refused with the numbers and nothing downloaded; an .incomplete leftover is cleaned; repos
outside models are reported, then pruned; the rig runs rigbook's mirror (on its SSH address,
with the token, hardened: its systemd-analyze security exposure is printed and held to 3.0) and
another cache pulls through it; a 32 MiB pull from a stub that sends 4 MiB/s shows its progress
in pyinfra's output while it runs. Throughout, the fake tokens never show in pyinfra's output
(-vvv --debug --diff), the rig's journal or any file but their 0600 ones.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rigbook.core.tools import TOOLS_PINS
from rigbook.roles.models import repo_folder
from rigbook.roles.tokens import MIRROR_TOKEN_PATH, TOKEN_PATH
from rigbook.sandbox import WHEELS_MOUNT, wheelhouse
from tests.conftest import (
    PYINFRA,
    ROOT,
    SANDBOX_INVENTORY,
    PyinfraRun,
    rig_ssh,
    run_pyinfra,
    security_exposure,
)
from tests.hubstub import PROGRAMS, big_repo, huge_repo, tiny_repo
from tests.test_models import ensure_wheels

DEPLOY = "deploys/models.py"
STUB_DIR = "/run/rigbook-hubstub"
STUB_UNIT = "rigbook-hubstub"
PORT = 18080
CACHE = "/var/lib/rigbook/hf/hub"
TOKEN = "hf_rigbookE2EfakeTOKEN7c1d2e3f4a5b6c7d"
MIRROR_TOKEN = "rigbookE2Efleet0c1d2e3f4a5b6c7d8e9f0a1b2c3d"
#: The operator's copy of the fleet's token (0600), for models_mirror_token_file.
FLEET_TOKEN_FILE = Path(tempfile.gettempdir()) / "rigbook-e2e-fleet-token"
TINY, HUGE, BIG = tiny_repo(), huge_repo(), big_repo()

pytestmark = pytest.mark.sandbox


def pin(repo) -> str:
    """The manifest_sha256 an operator pins: the sha256 of the manifest a pull writes."""
    return hashlib.sha256(repo.manifest()).hexdigest()


def model(repo) -> dict:
    return {"repo": repo.repo_id, "revision": repo.commit, "manifest_sha256": pin(repo)}


def data_args(*pairs: tuple[str, object]) -> list[str]:
    args = []
    for key, value in pairs:
        text = value if isinstance(value, str) else json.dumps(value)
        args += ["--data", f"{key}={text}"]
    return args


def deploy_args(rig: dict, *extra, models=(TINY,), **data) -> list[str]:
    """pyinfra's arguments after the deploy for one rig; a key given as None is left out of its
    data."""
    base = {
        "models": [model(repo) for repo in models],
        "models_endpoint": f"http://127.0.0.1:{PORT}",
        "models_mirror_token_file": str(FLEET_TOKEN_FILE),
        "models_disk_margin_gib": 0.1,
        "python_find_links": WHEELS_MOUNT,
        "python_no_index": True,
        **data,
    }
    pairs = [(key, value) for key, value in base.items() if value is not None]
    return ["--limit", rig["name"], *data_args(*pairs), *extra]


def deploy(rig: dict, *extra, **data) -> PyinfraRun:
    """deploys/models.py on one rig."""
    return run_pyinfra(SANDBOX_INVENTORY, DEPLOY, *deploy_args(rig, *extra, **data))


def pyinfra_timed(inventory: str, deploy: str, *args: str) -> tuple[PyinfraRun, list]:
    """run_pyinfra(), with each line of pyinfra's stderr (stripped: pyinfra indents) and the
    second it arrived at: what shows while a run goes on."""
    proc = subprocess.Popen(
        [PYINFRA, "-y", "--json", inventory, deploy, *args], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYINFRA_PROGRESS": "off"},
    )
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()))
    reader.start()
    started, lines = time.monotonic(), []
    for line in proc.stderr:
        lines.append((time.monotonic() - started, line.strip()))
    reader.join()
    returncode = proc.wait(timeout=60)
    try:
        results = json.loads(stdout[0]).get("results")
    except json.JSONDecodeError:
        results = None
    return PyinfraRun(returncode, stdout[0], "\n".join(line for _, line in lines), results), lines


class Stub:
    """The hub stub running inside a rig."""

    def __init__(self, rig: dict):
        self.rig = rig

    def start(self, *args: str) -> None:
        """(Re)start it with a fresh request log."""
        self.stop()
        rig_ssh(self.rig, f"rm -f {STUB_DIR}/requests.jsonl")
        command = (
            f"systemd-run --unit={STUB_UNIT} --collect --quiet python3 {STUB_DIR}/hubstub.py "
            f"--port {PORT} --log {STUB_DIR}/requests.jsonl --token-file {STUB_DIR}/token "
            + " ".join(args)
        )
        rig_ssh(self.rig, command)
        probe = f"import socket; socket.create_connection(('127.0.0.1', {PORT}), 1)"
        for _ in range(50):
            if rig_ssh(self.rig, f'python3 -c "{probe}"', check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise AssertionError("the hub stub did not start on the rig")

    def stop(self) -> None:
        rig_ssh(self.rig, f"systemctl stop {STUB_UNIT} 2>/dev/null; "
                          f"systemctl reset-failed {STUB_UNIT} 2>/dev/null; true")

    def requests(self) -> list[dict]:
        text = rig_ssh(self.rig, f"cat {STUB_DIR}/requests.jsonl 2>/dev/null || true").stdout
        return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def rig_with_stub(sandbox):
    ensure_wheels([f"{name}=={version}" for name, version in TOOLS_PINS.items()], wheelhouse())
    rig = sandbox[sorted(sandbox)[0]]
    FLEET_TOKEN_FILE.write_text(MIRROR_TOKEN + "\n")
    FLEET_TOKEN_FILE.chmod(0o600)
    rig_ssh(rig, f"rm -rf {CACHE} /etc/rigbook/secrets /opt/rigbook/models {STUB_DIR}; "
                 f"mkdir -p {STUB_DIR} && (umask 077; echo {MIRROR_TOKEN} > {STUB_DIR}/token)")
    # laid out as on a rig: pull.py and mirror.py import cache.py and hfcache.py from beside them
    for source in (ROOT / "tests" / "hubstub.py", *(PROGRAMS / name for name in (
            "mirror.py", "pull.py", "cache.py", "hfcache.py"))):
        text = base64.b64encode(source.read_bytes()).decode()
        rig_ssh(rig, f"echo {text} | base64 -d > {STUB_DIR}/{source.name}")
    stub = Stub(rig)
    try:
        yield rig, stub
    finally:
        stub.stop()
        rig_ssh(rig, f"rm -rf {STUB_DIR}", check=False)
        FLEET_TOKEN_FILE.unlink(missing_ok=True)


def changed(run, text: str) -> bool:
    return any(text in name for name in run.changed())


def no_token(*texts: str) -> None:
    for text in texts:
        assert TOKEN not in text and MIRROR_TOKEN not in text


def test_interrupted_pull_is_partial_then_completed_then_nothing(rig_with_stub, monkeypatch):
    rig, stub = rig_with_stub
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    label = f"{TINY.repo_id}@{TINY.commit[:12]}"
    snapshot = f"{CACHE}/{repo_folder(TINY.repo_id)}/snapshots/{TINY.commit}"

    # 1. The big file drops half way (and answers 503 after): partial, the rig fails.
    stub.start("--interrupt", "model.safetensors")
    first = deploy(rig, "-vvv", "--debug", "--diff")
    no_token(first.stdout, first.stderr)
    assert first.returncode != 0, first.explain()
    assert f"{label}: PARTIAL snapshot, not complete: missing model.safetensors" in first.stderr
    assert "run again to finish" in first.stderr
    gets = [r for r in stub.requests() if r["method"] == "GET"
            and r["path"].endswith("model.safetensors")]
    assert len(gets) == 2, gets  # dropped half way, then the pull's resume (Range) got 503
    assert {r["auth"] for r in stub.requests()} == {"ok"}  # the fleet's token, from its file
    assert [r["route"] for r in stub.requests()][0] == "manifest"
    files = rig_ssh(rig, f"ls {snapshot}").stdout.split()
    assert "config.json" in files and "model.safetensors" not in files
    assert rig_ssh(rig, f"test -e {CACHE}/{repo_folder(TINY.repo_id)}/rigbook/{TINY.commit}.json",
                   check=False).returncode == 1
    assert rig_ssh(rig, f"stat -c '%a %U %G' {MIRROR_TOKEN_PATH} /etc/rigbook/secrets").stdout\
        .split("\n")[:2] == ["600 root root", "700 root root"]
    # The HF token goes only to the hub: a rig that pulls from a mirror does not hold it.
    assert rig_ssh(rig, f"test -e {TOKEN_PATH}", check=False).returncode == 1

    # 2. The hub answers again: only the missing file is fetched; the snapshot is complete.
    stub.start()
    second = deploy(rig)
    no_token(second.stdout, second.stderr)
    assert second.returncode == 0, second.explain()
    assert changed(second, f"Pull {label}")
    assert f"{label}: pulled 1 file(s), 0.25 MiB in " in second.stderr
    assert f"complete: 4 file(s), 0.25 MiB; manifest sha256 {pin(TINY)}" in second.stderr
    resolved = {r["path"].rsplit("/", 1)[-1] for r in stub.requests() if r["route"] == "resolve"}
    assert resolved == {"model.safetensors"}
    sha = rig_ssh(rig, f"sha256sum {snapshot}/model.safetensors").stdout.split()[0]
    assert sha == TINY.file("model.safetensors").sha256
    # Readable by the engines' user and the mirror's, whatever root's umask.
    modes = rig_ssh(rig, f"stat -L -c '%a' {snapshot}/config.json {snapshot} "
                         f"{CACHE}/{repo_folder(TINY.repo_id)}/rigbook/{TINY.commit}.json")
    assert modes.stdout.split() == ["644", "755", "644"]
    # The manifest the rig wrote is the one pinned (the same bytes from every such pull).
    written = rig_ssh(rig, f"sha256sum {CACHE}/{repo_folder(TINY.repo_id)}/rigbook/"
                           f"{TINY.commit}.json").stdout.split()[0]
    assert written == pin(TINY)

    # 3. Complete: no change and not one request to the hub.
    before = len(stub.requests())
    third = deploy(rig, "-v")
    assert third.returncode == 0, third.explain()
    assert third.changed() == {}, third.explain()
    assert (f"{label} is complete in {CACHE} (4 file(s), 0.25 MiB); manifest sha256 "
            f"{pin(TINY)}") in third.stdout + third.stderr
    assert len(stub.requests()) == before

    # Offline, as an engine boots: the pinned snapshot loads with HF_HUB_OFFLINE=1.
    offline = rig_ssh(rig, (
        f"HF_HUB_OFFLINE=1 HF_HUB_CACHE={CACHE} /opt/rigbook/tools/bin/python -c "
        f"\"from huggingface_hub import hf_hub_download as d; "
        f"print(d('{TINY.repo_id}', 'model.safetensors', revision='{TINY.commit}'))\""
    ))
    assert offline.stdout.strip() == f"{snapshot}/model.safetensors"
    assert len(stub.requests()) == before

    # The tokens are nowhere but in their 0600 files.
    for token in (TOKEN, MIRROR_TOKEN):
        leaks = rig_ssh(rig, f"grep -rl {token} /var/lib/rigbook /opt/rigbook/models /tmp /root "
                             f"/etc --exclude-dir=secrets 2>/dev/null; journalctl --no-pager "
                             f"| grep -c {token}", check=False).stdout.split()
        assert leaks == ["0"], leaks

    # 4. No mirror any more (and no HF token supplied): the complete snapshot asks nothing of
    # anyone, and the fleet's token does not stay on the rig.
    monkeypatch.delenv("HF_TOKEN")
    fourth = deploy(rig, models_endpoint=None, models_mirror_token_file=None)
    assert fourth.returncode == 0, fourth.explain()
    assert len(fourth.changed()) == 1, fourth.explain()
    assert changed(fourth, f"No mirror token on the rig ({MIRROR_TOKEN_PATH})"), fourth.explain()
    assert rig_ssh(rig, f"test -e {MIRROR_TOKEN_PATH}", check=False).returncode == 1
    assert len(stub.requests()) == before


def test_disk_full_preflight_refuses_with_numbers(rig_with_stub, monkeypatch):
    rig, stub = rig_with_stub
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the stub's repo is gated
    stub.start()
    run = deploy(rig, models=(TINY, HUGE), models_only=HUGE.repo_id)
    assert run.returncode != 0, run.explain()
    assert f"{HUGE.repo_id}@{HUGE.commit[:12]}: pull refused: need 9313.23 GiB + 0.10 GiB " \
           "margin, have " in run.stderr, run.explain()
    assert f"GiB free on / (cache {CACHE}); nothing was downloaded" in run.stderr
    assert [r["route"] for r in stub.requests()] == ["manifest"]
    assert rig_ssh(rig, f"test -e {CACHE}/{repo_folder(HUGE.repo_id)}/snapshots",
                   check=False).returncode == 1


def test_leftovers_cleaned_and_unlisted_repos_reported_then_pruned(rig_with_stub, monkeypatch):
    rig, stub = rig_with_stub
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the stub's repo is gated
    stub.start()
    blobs = f"{CACHE}/{repo_folder(TINY.repo_id)}/blobs"
    old = f"{CACHE}/models--old--model"
    rig_ssh(rig, f"head -c 4096 /dev/zero > {blobs}/{'e' * 64}.0badc0de.incomplete; "
                 f"mkdir -p {old}/blobs {old}/snapshots/{'f' * 40} && "
                 f"head -c 2097152 /dev/zero > {old}/blobs/{'f' * 40} && "
                 f"ln -s ../../blobs/{'f' * 40} {old}/snapshots/{'f' * 40}/config.json")

    run = deploy(rig)
    assert run.returncode == 0, run.explain()
    assert "removed 1 .incomplete leftover(s) (0.00 MiB)" in run.stderr
    assert "nothing to download" in run.stderr
    assert "cached but not in models: 1 repo(s), 2.00 MiB: old/model (2.00 MiB)" in run.stderr
    assert not changed(run, "Cached repos not in models")
    assert rig_ssh(rig, f"ls {blobs} | grep -c incomplete", check=False).stdout.strip() == "0"

    pruned = deploy(rig, models_prune=True)
    assert pruned.returncode == 0, pruned.explain()
    assert changed(pruned, "Cached repos not in models")
    assert "pruned from /var/lib/rigbook/hf/hub: 1 repo(s), 2.00 MiB" in pruned.stderr
    assert rig_ssh(rig, f"test -e {old}", check=False).returncode == 1

    again = deploy(rig, models_prune=True)
    assert again.returncode == 0 and again.changed() == {}, again.explain()


def test_fleet_pull_through_rigbook_mirror(rig_with_stub, monkeypatch):
    """models_mirror_port serves the rig's complete snapshots, on the rig's SSH address, to
    requests with the fleet's token; another cache pulls from it."""
    rig, stub = rig_with_stub
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the stub's repo is gated
    stub.start()
    mirror_port, other = PORT + 1, "/var/lib/rigbook/hf/hub2"
    address = rig["address"]
    try:
        up = deploy(rig, models_mirror_port=mirror_port)
        assert up.returncode == 0, up.explain()
        assert changed(up, f"Run rigbook-hf-mirror.service on {address} port {mirror_port}")
        assert rig_ssh(rig, "systemctl is-active rigbook-hf-mirror").stdout.strip() == "active"
        listening = rig_ssh(rig, f"ss -Hltn 'sport = :{mirror_port}'").stdout.split()
        assert f"{address}:{mirror_port}" in listening, listening  # not 0.0.0.0
        exposure = security_exposure(rig, "rigbook-hf-mirror.service")
        print(f"\nsystemd-analyze security rigbook-hf-mirror.service (systemd on the sandbox "
              f"rig): overall exposure level {exposure}")
        assert exposure <= 3.0
        probe = (f"import urllib.request as u, urllib.error as e\n"
                 f"try: u.urlopen('http://{address}:{mirror_port}/api/rigbook/manifest/"
                 f"{TINY.repo_id}/{TINY.commit}', timeout=5)\n"
                 f"except e.HTTPError as x: print(x.code)")
        assert rig_ssh(rig, f"python3 -c \"{probe}\"").stdout.strip() == "401"
        again = deploy(rig, models_mirror_port=mirror_port)
        assert again.returncode == 0 and again.changed() == {}, again.explain()

        # A new fleet token restarts the mirror with it.
        FLEET_TOKEN_FILE.write_text(MIRROR_TOKEN[::-1] + "\n")
        renewed = deploy(rig, models_mirror_port=mirror_port)
        FLEET_TOKEN_FILE.write_text(MIRROR_TOKEN + "\n")
        assert renewed.returncode == 0, renewed.explain()
        assert changed(renewed, f"Place the mirror token in {MIRROR_TOKEN_PATH}")
        assert changed(renewed, f"Run rigbook-hf-mirror.service on {address}")
        restored = deploy(rig, models_mirror_port=mirror_port)
        assert changed(restored, f"Run rigbook-hf-mirror.service on {address}")

        # Another cache (as another rig would) pulls through the mirror, not the hub, with the
        # token; the mirror is then turned off because this run does not set models_mirror_port.
        pulled = deploy(rig, models_cache=other,
                        models_endpoint=f"http://{address}:{mirror_port}")
        no_token(pulled.stdout, pulled.stderr)
        assert pulled.returncode == 0, pulled.explain()
        assert f"{TINY.repo_id}@{TINY.commit[:12]}: pulled 4 file(s), 0.25 MiB" in pulled.stderr
        assert stub.requests() == []
        snapshot = f"{other}/{repo_folder(TINY.repo_id)}/snapshots/{TINY.commit}"
        sha = rig_ssh(rig, f"sha256sum {snapshot}/model.safetensors").stdout.split()[0]
        assert sha == TINY.file("model.safetensors").sha256
        assert changed(pulled, "Stop rigbook-hf-mirror.service")
        assert rig_ssh(rig, "test -e /etc/systemd/system/rigbook-hf-mirror.service",
                       check=False).returncode == 1
        journal = rig_ssh(rig, f"journalctl --no-pager | grep -c {MIRROR_TOKEN}", check=False)
        assert journal.stdout.split() == ["0"]
    finally:
        rig_ssh(rig, f"systemctl disable --now rigbook-hf-mirror 2>/dev/null; rm -rf {other} "
                     "/etc/systemd/system/rigbook-hf-mirror.service; systemctl daemon-reload",
                check=False)


def test_a_long_pull_shows_its_progress_while_it_runs(rig_with_stub, monkeypatch):
    """32 MiB at 4 MiB/s: byte counts and rates come into pyinfra's output, with the rig's prefix,
    seconds before the pull ends with its summary (files, bytes, seconds, average rate)."""
    rig, stub = rig_with_stub
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("RIGBOOK_PROGRESS_EVERY", "1")
    stub.start("--rate", str(4 * 2**20))
    cache = "/var/lib/rigbook/hf/hub-progress"
    try:
        run, lines = pyinfra_timed(SANDBOX_INVENTORY, DEPLOY, *deploy_args(
            rig, models=(BIG,), models_cache=cache, models_only=BIG.repo_id))
        no_token(run.stdout, run.stderr)
        assert run.returncode == 0, run.explain()
        where = f"[{rig['name']}] {BIG.repo_id}@{BIG.commit[:12]}: "
        counting = re.compile(re.escape(where) + r"(\d+\.\d\d) MiB of 32\.00 MiB \(\d+%\) at "
                              r"(\d+\.\d\d) MiB/s, \d of 4 file\(s\) done")
        counts = [(at, match) for at, line in lines if (match := counting.match(line))]
        done = [at for at, line in lines if line.startswith(
            f"{where}pulled 4 file(s), 32.00 MiB in ") and " MiB/s); complete: 4 file(s), "
            "32.00 MiB" in line]
        shown = "\n".join(f"{at:6.1f} s  {line}" for at, line in lines if line.startswith(where))
        print(f"\nprogress of the pull as pyinfra printed it:\n{shown}")
        assert len(done) == 1, shown
        assert f"{where}downloading 4 file(s), 32.00 MiB" in run.stderr
        assert f"{where}checking sizes and hashes of 4 file(s)" in run.stderr
        written = [float(match[1]) for _, match in counts]
        assert len(set(written)) >= 2 and written == sorted(written), shown  # more and more
        assert any(float(match[2]) > 0 for _, match in counts), shown  # at a rate
        assert any(match[1] != "32.00" and done[0] - at >= 2 for at, match in counts), shown
    finally:
        rig_ssh(rig, f"rm -rf {cache}", check=False)
