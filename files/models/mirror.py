"""rigbook's tiny hub mirror: serve a rig's complete snapshots to the other rigs of the fleet.

    python3 mirror.py --cache /var/lib/rigbook/hf/hub --host 10.0.0.5 --port 8090

A rig that has pulled a model can be the source of the others on the LAN: they set
`models_endpoint: http://<that rig>:8090` and huggingface_hub (HF_ENDPOINT) pulls through the
same routes it uses against the hub. Only snapshots that rigbook completed are served (those
with a manifest, `models--ORG--NAME/rigbook/<commit>.json`, that records the sha256 and git oid
of every file, and whose files still have their sizes), read-only, and only to requests that
carry the fleet's token (`Authorization: Bearer <token>`, compared in constant time). The
token comes from the systemd credential `mirror-token` (LoadCredential=, so it is in no argv
and no environment); without one the mirror refuses to start. docs/models.md, "Fleet pulls".

The mirror vouches for nothing: it serves the manifest's bytes as the pull wrote them, and the
pulling rig accepts them only when they hash to the `manifest_sha256` its operator pinned
(files/models/pull.py), then every file only against the hashes in them. It is bounded, so that
anyone on the LAN can only make it refuse, not exhaust it: at most MAX_CONNECTIONS connections
at once (the next one is answered 503 and closed before a byte of it is read), TIMEOUT seconds
for each read or write on a connection, and a request body of 0 to MAX_BODY bytes.

The routes (what huggingface_hub 2.x calls to pull, and rigbook's manifest):

    GET  /api/rigbook/manifest/{repo}/{rev}       the manifest file as the pull wrote it: every
                                                  file's size, sha256, git oid, LFS flag
    GET  /api/models/{repo}/revision/{rev}        model_info (siblings, sizes, LFS sha256)
    GET  /api/models/{repo}/tree/{rev}[/{path}]   list_repo_tree
    POST /api/models/{repo}/paths-info/{rev}      get_paths_info
    HEAD /{repo}/resolve/{rev}/{path}             X-Repo-Commit, ETag / X-Linked-Etag, sizes
    GET  /{repo}/resolve/{rev}/{path}             the bytes; Range requests resume

`rev` is a commit or a plain ref name the cache knows (refs/<name>: letters, digits, . _ -, no
"/" or ".."); anything else is "not found" before the disk is touched, and a file is only ever
opened by a path that the manifest lists. Errors carry the X-Error-Code headers huggingface_hub
maps to its exceptions. No Xet headers: clients fetch over plain HTTP (rigbook sets
HF_HUB_DISABLE_XET=1 for a mirror). Standard library only: it runs with any python3.
tests/hubstub.py serves generated repos through the same handler.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hfcache import (  # noqa: E402  (rigbook/rigside/hfcache.py, copied beside this file)
    MANIFEST_ROUTE,
    MANIFESTS,
    REFS,
    SNAPSHOTS,
    manifest_name,
    repo_folder,
)

CHUNK = 1024 * 1024
#: The systemd credential that holds the fleet's token (LoadCredential=mirror-token:<file>).
CREDENTIAL = "mirror-token"
#: Connections served at once; one more is answered 503 and closed. A pull opens one for the
#: manifest, then one per file being fetched (8 workers): 14 rigs pulling at once fit.
MAX_CONNECTIONS = 128
#: Seconds a read or a write on a connection may wait (an idle connection is closed after it).
TIMEOUT = 20
#: The largest request body read (paths-info's form); a Content-Length outside 0..MAX_BODY is
#: answered 400 or 413 without reading it.
MAX_BODY = 64 * 1024

_COMMIT = re.compile(r"[0-9a-f]{40}")
_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_MANIFEST = re.compile(re.escape(MANIFEST_ROUTE) + r"/([^/]+/[^/]+)/([^/]+)")
_API = re.compile(r"/api/models/([^/]+/[^/]+)/(revision|tree|paths-info)/([^/]+)(?:/(.*))?")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
_RANGE = re.compile(r"bytes=(\d+)-")


def safe_repo(repo_id: str) -> bool:
    return bool(_REPO.fullmatch(repo_id)) and ".." not in repo_id


def safe_revision(revision: str) -> bool:
    """A commit, or a ref name that cannot leave refs/ (no "/", no "..")."""
    return bool(_COMMIT.fullmatch(revision) or _REF.fullmatch(revision) and ".." not in revision)


def parse_route(path: str) -> tuple[str, str, str, str | None]:
    """(route, repo, revision, rest) of a request path; route "unknown" when none matches."""
    if match := _MANIFEST.fullmatch(path):
        return "manifest", match.group(1), match.group(2), None
    if match := _API.fullmatch(path):
        return match.group(2), match.group(1), match.group(3), match.group(4)
    if match := _RESOLVE.fullmatch(path):
        return "resolve", match.group(1), match.group(2), match.group(3)
    return "unknown", "", "", None


def lfs_pointer(sha256: str, size: int) -> bytes:
    text = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
    return text.encode()


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One file of a commit as the hub describes it, and where its bytes come from."""

    path: str
    size: int
    sha256: str
    lfs: bool  # stored in LFS on the hub: its tree entry carries the sha256
    git_oid: str  # the git blob id (of the LFS pointer, for LFS files)
    chunks: Callable[[int], Iterator[bytes]] | None  # bytes from an offset; None: no bytes

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid

    def tree_entry(self) -> dict:
        entry = {"type": "file", "oid": self.git_oid, "size": self.size, "path": self.path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size,
                            "pointerSize": len(lfs_pointer(self.sha256, self.size))}
        return entry

    def manifest_entry(self) -> dict:
        return {"size": self.size, "sha256": self.sha256, "lfs": self.lfs, "oid": self.git_oid}


class Store:
    """Where repos come from: `lookup` resolves a safe revision to (commit, files) or None;
    `manifest` gives the bytes of rigbook's manifest of a commit that lookup found."""

    def exists(self, repo_id: str) -> bool:
        raise NotImplementedError

    def lookup(self, repo_id: str, revision: str) -> tuple[str, dict[str, Entry]] | None:
        raise NotImplementedError

    def manifest(self, repo_id: str, commit: str) -> bytes | None:
        raise NotImplementedError


def _file_chunks(path: str) -> Callable[[int], Iterator[bytes]]:
    def chunks(start: int) -> Iterator[bytes]:
        with open(path, "rb") as handle:
            handle.seek(start)
            while block := handle.read(CHUNK):
                yield block

    return chunks


def _served(path: str, meta) -> bool:
    """Whether a manifest entry can be served: a relative path inside the snapshot and every
    hash recorded (a manifest of an older rigbook has no sha256 for non-LFS files)."""
    return (not path.startswith("/") and ".." not in path.split("/") and isinstance(meta, dict)
            and isinstance(meta.get("size"), int) and isinstance(meta.get("sha256"), str)
            and isinstance(meta.get("oid"), str))


class CacheStore(Store):
    """The complete snapshots of an HF cache: those rigbook wrote a manifest for."""

    def __init__(self, cache: str):
        self.cache = cache

    def _folder(self, repo_id: str) -> str:
        return os.path.join(self.cache, repo_folder(repo_id))

    def exists(self, repo_id: str) -> bool:
        return os.path.isdir(os.path.join(self._folder(repo_id), MANIFESTS))

    def manifest(self, repo_id: str, commit: str) -> bytes | None:
        try:
            with open(os.path.join(self._folder(repo_id), manifest_name(commit)), "rb") as handle:
                return handle.read()
        except OSError:
            return None

    def lookup(self, repo_id: str, revision: str):
        folder = self._folder(repo_id)
        commit = revision
        if not _COMMIT.fullmatch(revision):
            try:
                with open(os.path.join(folder, REFS, revision)) as handle:
                    commit = handle.read().strip()
            except OSError:
                return None
            if not _COMMIT.fullmatch(commit):
                return None
        try:
            manifest = json.loads(self.manifest(repo_id, commit) or b"")
        except ValueError:
            return None
        snapshot = os.path.join(folder, SNAPSHOTS, commit)
        files = {}
        for path, meta in dict(manifest.get("files", {})).items():
            local = os.path.join(snapshot, path)
            if (not _served(path, meta) or not os.path.isfile(local)
                    or os.path.getsize(local) != meta["size"]):
                return None  # no longer complete: serve nothing rather than a partial snapshot
            files[path] = Entry(path, meta["size"], meta["sha256"], bool(meta.get("lfs")),
                                meta["oid"], _file_chunks(local))
        return commit, files


class HubHandler(BaseHTTPRequestHandler):
    """The hub routes over a Store. Subclasses may set `token` and override the hooks."""

    protocol_version = "HTTP/1.1"
    timeout = TIMEOUT  # socketserver sets it on the connection: every read and write
    store: Store
    token: str | None = None

    def log_message(self, format, *args):  # noqa: A002 - requests are not logged by default
        pass

    def record(self, route: str) -> None:
        """Hook: called once per request with its route name."""

    def send_body(self, entry: Entry, start: int) -> None:
        """Hook: write the bytes of `entry` from `start` (headers are sent)."""
        for block in entry.chunks(start):
            self.wfile.write(block)

    # --- plumbing ------------------------------------------------------------------------------

    def auth(self) -> str:
        if self.token is None:
            return "none-needed"
        given = self.headers.get("Authorization")
        if given is None:
            return "missing"
        wanted = f"Bearer {self.token}".encode()
        return "ok" if hmac.compare_digest(given.encode(errors="replace"), wanted) else "wrong"

    def send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        headers = dict(headers or {})
        headers.setdefault("Content-Length", str(len(body)))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def send_json(self, payload) -> None:
        self.send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def error(self, status: int, code: str | None, message: str, headers=None) -> None:
        message = json.dumps(message)[1:-1]  # no control character reaches a header
        extra = {"Content-Type": "application/json", "X-Error-Message": message,
                 # an unread request body must not be read as a request: close, and say so
                 "Connection": "close", **(headers or {})}
        if code:
            extra["X-Error-Code"] = code
        self.send(status, json.dumps({"error": message}).encode(), extra)

    def resolve_revision(self, repo_id: str, revision: str):
        if not safe_repo(repo_id) or not self.store.exists(repo_id):
            self.error(404, "RepoNotFound", "Repository not found")
            return None
        revision = unquote(revision)
        found = self.store.lookup(repo_id, revision) if safe_revision(revision) else None
        if found is None:
            self.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return found

    # --- routes --------------------------------------------------------------------------------

    def do_GET(self):
        self.dispatch()

    def do_HEAD(self):
        self.dispatch()

    def do_POST(self):
        self.dispatch()

    def body_length(self) -> int | None:
        """The request's Content-Length when it is 0..MAX_BODY (absent: 0); else None, the
        error answered (a negative length would read to the end, a huge one fill memory)."""
        given = self.headers.get("Content-Length", "0").strip()
        if not given.isdigit() or not given.isascii():
            self.error(400, None, f"Content-Length {given!r} is not a number of bytes")
        elif int(given) > MAX_BODY:
            self.error(413, None, f"Content-Length {given} is over {MAX_BODY} bytes")
        else:
            return int(given)
        return None

    def dispatch(self) -> None:
        url = urlsplit(self.path)
        route, repo_id, revision, rest = parse_route(url.path)
        self.record(route)
        auth = self.auth()
        if self.body_length() is None:
            pass  # answered
        elif auth == "missing":  # as the hub answers for a gated or private repo
            self.error(401, "RepoNotFound", "Repository not found")
        elif auth == "wrong":
            self.error(401, None, "Invalid credentials in Authorization header")
        elif route == "unknown":
            self.error(404, None, f"no route {url.path}")
        else:
            found = self.resolve_revision(repo_id, revision)
            if found:
                getattr(self, "route_" + route.replace("-", "_"))(repo_id, *found, url, rest)

    def route_manifest(self, repo_id: str, commit: str, _files, _url, _rest) -> None:
        body = self.store.manifest(repo_id, commit)
        if body is None:
            self.error(404, "RevisionNotFound", f"no manifest of {commit}")
            return
        self.send(200, body, {"Content-Type": "application/json"})

    def route_revision(self, repo_id: str, commit: str, files: dict, url, _rest) -> None:
        blobs = parse_qs(url.query).get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for entry in files.values():
            sibling = {"rfilename": entry.path}
            if blobs:
                sibling.update(size=entry.size, blobId=entry.git_oid)
                if entry.lfs:
                    tree = entry.tree_entry()["lfs"]
                    sibling["lfs"] = {"sha256": entry.sha256, "size": entry.size,
                                      "pointerSize": tree["pointerSize"]}
            siblings.append(sibling)
        self.send_json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                        "siblings": siblings})

    def route_tree(self, repo_id: str, commit: str, files: dict, url, rest) -> None:
        prefix = unquote(rest).strip("/") + "/" if rest else ""
        self.send_json([e.tree_entry() for e in files.values() if e.path.startswith(prefix)])

    def route_paths_info(self, repo_id: str, commit: str, files: dict, url, _rest) -> None:
        body = self.rfile.read(self.body_length() or 0)  # dispatch checked it
        wanted = set(parse_qs(body.decode(errors="replace")).get("paths", []))
        self.send_json([e.tree_entry() for e in files.values() if e.path in wanted])

    def route_resolve(self, repo_id: str, commit: str, files: dict, _url, rest) -> None:
        path = unquote(rest)
        entry = files.get(path)
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if entry is None:
            self.error(404, "EntryNotFound", f"{path} does not exist", headers)
            return
        if entry.chunks is None:
            self.error(500, None, f"{path} has no bytes here", headers)
            return
        headers["ETag"] = f'"{entry.git_oid}"'
        if entry.lfs:
            headers.update({"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)})
        if self.command == "HEAD":
            self.send(200, b"", {**headers, "Content-Length": str(entry.size)})
            return
        start, status = 0, 200
        match = _RANGE.fullmatch(self.headers.get("Range") or "")
        if match and int(match.group(1)) < entry.size:
            start, status = int(match.group(1)), 206
            headers["Content-Range"] = f"bytes {start}-{entry.size - 1}/{entry.size}"
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(entry.size - start)}.items():
            self.send_header(key, value)
        self.end_headers()
        self.send_body(entry, start)


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most `connections` connections at once: one more
    is answered 503 and closed at once, never given a thread (before any token is checked)."""

    daemon_threads = True
    BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 5\r\n"
            b"Connection: close\r\n\r\n")

    def __init__(self, address, handler, connections: int = MAX_CONNECTIONS):
        self.slots = threading.BoundedSemaphore(connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1)
                request.sendall(self.BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # no thread started: nobody else gives the slot back
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def server(handler: type[HubHandler], host: str = "127.0.0.1", port: int = 0,
           connections: int = MAX_CONNECTIONS):
    """A BoundedServer for `handler` on an IPv4 or IPv6 address (not started: call
    serve_forever, e.g. in a thread)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    kind = type("Server", (BoundedServer,), {"address_family": family})
    return kind((host, port), handler, connections)


def credential_token() -> str:
    """The fleet's token from $CREDENTIALS_DIRECTORY/mirror-token; SystemExit without one."""
    folder = os.environ.get("CREDENTIALS_DIRECTORY", "")
    try:
        token = Path(folder, CREDENTIAL).read_text().strip() if folder else ""
    except OSError:
        token = ""
    if not token:
        raise SystemExit(f"mirror.py: no token in $CREDENTIALS_DIRECTORY/{CREDENTIAL} "
                         f"(LoadCredential={CREDENTIAL}:<file>); refusing to serve without one")
    return token


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve an HF cache's complete snapshots.")
    parser.add_argument("--cache", required=True, help="the HF_HUB_CACHE to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args(argv)
    handler = type("CacheHandler", (HubHandler,),
                   {"store": CacheStore(args.cache), "token": credential_token()})
    httpd = server(handler, args.host, args.port)
    print(f"serving {args.cache} on {args.host} port {httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
