"""A tiny stand-in for the Hugging Face hub, serving small model repos it generates.

No hub is reachable from the tests. This serves, over loopback, the routes huggingface_hub 2.x
calls for model_info / get_paths_info / list_repo_tree / hf_hub_download / snapshot_download
(the handler of files/models/mirror.py, rigbook's mirror: the same code answers both), for
repos made of deterministic bytes, so a test computes their commit and sha256 itself, and
rigbook's manifest of each as files/models/pull.py writes it for a pull without patterns
(`Repo.manifest`; its sha256 is what a test pins as manifest_sha256):

- rigbook-test/tiny: README.md, config.json, tokenizer.json and a 256 KiB model.safetensors
  that the hub stores in LFS (its tree entry carries the sha256);
- rigbook-test/huge: its metadata says model.safetensors is 10 TB (disk preflight tests);
- rigbook-test/big: tiny with a 32 MiB model.safetensors, for pulls that take a while
  (with --rate).

Test knobs: `Hub(gated={repo: "manual"})` (its model_info says gated, as the hub's does),
--token-file (every route wants `Authorization: Bearer <that token>`; read from a
file so that it is not in this process's argv either), --interrupt PATH (the first GET of PATH
sends half its bytes and drops the connection, later GETs of it answer 503: a pull fails half
way), --rate BYTES (file bodies go out at that many bytes a second: a pull that takes seconds),
--log FILE (one JSON line per request: method, path, Range, route, auth). It sends no Xet
headers; clients set HF_HUB_DISABLE_XET=1. Standard library only: it is copied to a sandbox rig
(with mirror.py and pull.py beside it) and run there with the system python3.

    python3 hubstub.py --port 18080 --log /run/rigbook-hubstub/requests.jsonl
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from urllib.parse import unquote


def _programs() -> Path:
    """The folder of the models programs, laid out as rigbook puts them on a rig (pull.py and
    mirror.py beside cache.py and hfcache.py, which they import): this file's own folder on a
    rig; in the repo, a copy of files/models' programs and rigbook/rigside/hfcache.py."""
    here = Path(__file__).resolve().parent
    if (here / "mirror.py").exists():
        return here
    folder = Path(tempfile.mkdtemp(prefix="rigbook-models-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    for source in (*(here.parent / "files" / "models").glob("*.py"),
                   here.parent / "rigbook" / "rigside" / "hfcache.py"):
        shutil.copy(source, folder)
    return folder


#: Where pull.py and mirror.py are, with what they import beside them.
PROGRAMS = _programs()


def _load(name: str):
    """PROGRAMS/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"rigbook_{name}", PROGRAMS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(f"rigbook_{name}", module)
    spec.loader.exec_module(module)
    return module


mirror, pull = _load("mirror"), _load("pull")

#: Files the hub serves through LFS.
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")
TB = 10**12


@dataclass(frozen=True)
class RepoFile:
    path: str
    data: bytes
    claimed_size: int | None = None  # the metadata says this size (a stand-in for a huge file)

    @property
    def size(self) -> int:
        return self.claimed_size if self.claimed_size is not None else len(self.data)

    @property
    def lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @cached_property
    def sha256(self) -> str:
        """Hashed once: every request looks its repo up, which would hash the weights again."""
        return hashlib.sha256(self.data).hexdigest()

    def entry(self):
        sha = self.sha256
        oid = mirror.git_blob_oid(mirror.lfs_pointer(sha, self.size) if self.lfs else self.data)
        chunks = None if self.claimed_size is not None else lambda start: iter([self.data[start:]])
        return mirror.Entry(self.path, self.size, sha, self.lfs, oid, chunks)


@dataclass(frozen=True)
class Repo:
    repo_id: str
    files: tuple[RepoFile, ...]

    @property
    def commit(self) -> str:
        digest = hashlib.sha1(self.repo_id.encode())
        for item in self.files:
            digest.update(f"{item.path}\0{item.size}\0{item.entry().etag}\0".encode())
        return digest.hexdigest()

    def file(self, path: str) -> RepoFile | None:
        return next((item for item in self.files if item.path == path), None)

    def manifest(self) -> bytes:
        """rigbook's manifest of the commit, as a pull of it without patterns writes it."""
        return pull.manifest_bytes(self.repo_id, self.commit, [], [], {
            item.path: item.entry().manifest_entry() for item in self.files})


def _weights(size: int, seed: str) -> bytes:
    """Deterministic bytes that do not compress (so a half-sent file is really half)."""
    out, counter = bytearray(), 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


def tiny_repo(repo_id: str = "rigbook-test/tiny", weights_bytes: int = 256 * 1024) -> Repo:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "model_type": "llama"}
    return Repo(repo_id, (
        RepoFile("README.md", b"# tiny\nA generated test model.\n"),
        RepoFile("config.json", (json.dumps(config, indent=2) + "\n").encode()),
        RepoFile("model.safetensors", _weights(weights_bytes, repo_id)),
        RepoFile("tokenizer.json", b'{"version": "1.0", "model": {"type": "BPE"}}\n'),
    ))


def big_repo(repo_id: str = "rigbook-test/big", weights_bytes: int = 32 * 1024**2) -> Repo:
    """tiny's files with big weights (shake_256 makes them fast: _weights takes ~1 s here)."""
    weights = RepoFile("model.safetensors", hashlib.shake_256(repo_id.encode()).digest(
        weights_bytes))
    return Repo(repo_id, tuple(weights if item.path == weights.path else item
                               for item in tiny_repo(repo_id, 0).files))


def huge_repo(repo_id: str = "rigbook-test/huge") -> Repo:
    return Repo(repo_id, (
        RepoFile("config.json", b'{"model_type": "llama"}\n'),
        RepoFile("model.safetensors", b"", claimed_size=10 * TB),
    ))


class MemoryStore(mirror.Store):
    """Generated repos, each with one commit (also reachable as `main`)."""

    def __init__(self, repos):
        self.repos = {repo.repo_id: repo for repo in repos}

    def exists(self, repo_id: str) -> bool:
        return repo_id in self.repos

    def lookup(self, repo_id: str, revision: str):
        repo = self.repos[repo_id]
        if revision not in (repo.commit, "main"):
            return None
        return repo.commit, {item.path: item.entry() for item in repo.files}

    def manifest(self, repo_id: str, commit: str) -> bytes:
        return self.repos[repo_id].manifest()


class Hub:
    """What a stub server holds: repos, the token it wants, a fault, and the request log."""

    def __init__(self, repos, token=None, interrupt=None, log_path=None, rate=None, gated=None):
        self.store = MemoryStore(repos)
        self.gated = dict(gated or {})  # repo id -> the hub's approval mode ("auto", "manual")
        self.token = token
        self.interrupt = interrupt
        self.rate = rate  # bytes a second of file bodies; None: as fast as the socket goes
        self.interrupted = False
        self.log_path = log_path
        self.lock = threading.Lock()
        self.endpoint = None

    def log(self, record: dict) -> None:
        if self.log_path:
            with self.lock, open(self.log_path, "a") as handle:
                handle.write(json.dumps(record, sort_keys=True) + "\n")


class StubHandler(mirror.HubHandler):
    hub: Hub

    @property
    def store(self):
        return self.hub.store

    @property
    def token(self):
        return self.hub.token

    def record(self, route: str) -> None:
        self.hub.log({"method": self.command, "path": self.path.split("?")[0],
                      "range": self.headers.get("Range"), "auth": self.auth(), "route": route})

    def route_revision(self, repo_id, commit, files, url, rest):
        """model_info, with the hub's `gated` field for a gated repo."""
        if repo_id not in self.hub.gated:
            super().route_revision(repo_id, commit, files, url, rest)
            return
        sent = self.send_json
        self.send_json = lambda info: sent({**info, "gated": self.hub.gated[repo_id]})
        try:
            super().route_revision(repo_id, commit, files, url, rest)
        finally:
            del self.send_json

    def route_resolve(self, repo_id, commit, files, url, rest):
        if self.command == "GET" and unquote(rest) == self.hub.interrupt:
            with self.hub.lock:
                first, self.hub.interrupted = not self.hub.interrupted, True
            if not first:
                self.error(503, None, "unavailable (interrupted on purpose)",
                           {"X-Repo-Commit": commit})
                return
        super().route_resolve(repo_id, commit, files, url, rest)

    def send_body(self, entry, start):
        if self.hub.interrupt == entry.path and self.command == "GET":
            data = b"".join(entry.chunks(start))
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if self.hub.rate is None:
            super().send_body(entry, start)
            return
        step = 64 * 1024
        for block in entry.chunks(start):
            for at in range(0, len(block), step):
                piece = block[at:at + step]
                self.wfile.write(piece)
                time.sleep(len(piece) / self.hub.rate)


def serve(hub: Hub, host: str = "127.0.0.1", port: int = 0):
    """A server for `hub` (not started: call serve_forever, e.g. in a thread)."""
    return mirror.server(type("BoundStubHandler", (StubHandler,), {"hub": hub}), host, port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A tiny stand-in for the Hugging Face hub.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--token-file", help="require this token (Authorization: Bearer)")
    parser.add_argument("--interrupt", help="repo path whose first GET drops half way")
    parser.add_argument("--log", help="append one JSON line per request here")
    parser.add_argument("--rate", type=int, help="send file bodies at this many bytes a second")
    args = parser.parse_args(argv)
    token = None
    if args.token_file:
        with open(args.token_file) as handle:
            token = handle.read().strip()
    hub = Hub((tiny_repo(), huge_repo(), big_repo()), token=token, interrupt=args.interrupt,
              log_path=args.log, rate=args.rate)
    serve(hub, args.host, args.port).serve_forever()


if __name__ == "__main__":
    main()
