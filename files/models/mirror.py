"""rigbook's tiny hub mirror: serve a rig's Hugging Face cache to other rigs over the hub's API.

    python3 mirror.py --cache /var/lib/rigbook/hf/hub --host 0.0.0.0 --port 8090

A rig that has pulled a model can be the source of the others on the LAN: they set
`models_endpoint: http://<that rig>:8090` and huggingface_hub (HF_ENDPOINT) pulls through the
same routes it uses against the hub, so the pull on the other rigs is the same code, with the
same preflight, completeness check and manifest. Only snapshots that rigbook completed (those
with a manifest, `models--ORG--NAME/rigbook/<commit>.json`) are served, read-only, with the
sizes and sha256 the manifest recorded; nothing else of the rig is reachable. No token is asked:
run it only on a network you trust (docs/models.md, "Fleet pulls").

The routes (exactly what huggingface_hub 2.x calls to pull):

    GET  /api/models/{repo}/revision/{rev}        model_info (siblings, sizes, LFS sha256)
    GET  /api/models/{repo}/tree/{rev}[/{path}]   list_repo_tree
    POST /api/models/{repo}/paths-info/{rev}      get_paths_info
    HEAD /{repo}/resolve/{rev}/{path}             X-Repo-Commit, ETag / X-Linked-Etag, sizes
    GET  /{repo}/resolve/{rev}/{path}             the bytes; Range requests resume

`rev` is a commit or a ref the cache knows (refs/<name>). Errors carry the X-Error-Code headers
huggingface_hub maps to its exceptions. No Xet headers: clients fetch over plain HTTP (rigbook
sets HF_HUB_DISABLE_XET=1 for a mirror). Standard library only: it runs with any python3.
tests/hubstub.py serves generated repos through the same handler.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

CHUNK = 1024 * 1024
REPO_PREFIX = "models--"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


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
    sha256: str | None  # LFS files only
    git_oid: str  # the git blob id (of the LFS pointer, for LFS files)
    chunks: Callable[[int], Iterator[bytes]] | None  # bytes from an offset; None: no bytes

    @property
    def etag(self) -> str:
        return self.sha256 or self.git_oid

    def tree_entry(self) -> dict:
        entry = {"type": "file", "oid": self.git_oid, "size": self.size, "path": self.path}
        if self.sha256:
            entry["lfs"] = {"oid": self.sha256, "size": self.size,
                            "pointerSize": len(lfs_pointer(self.sha256, self.size))}
        return entry


class Store:
    """Where repos come from: `lookup` resolves a revision to (commit, files) or None."""

    def exists(self, repo_id: str) -> bool:
        raise NotImplementedError

    def lookup(self, repo_id: str, revision: str) -> tuple[str, dict[str, Entry]] | None:
        raise NotImplementedError


def _file_chunks(path: str) -> Callable[[int], Iterator[bytes]]:
    def chunks(start: int) -> Iterator[bytes]:
        with open(path, "rb") as handle:
            handle.seek(start)
            while block := handle.read(CHUNK):
                yield block

    return chunks


class CacheStore(Store):
    """The complete snapshots of an HF cache: those rigbook wrote a manifest for."""

    def __init__(self, cache: str):
        self.cache = cache

    def _folder(self, repo_id: str) -> str:
        return os.path.join(self.cache, REPO_PREFIX + repo_id.replace("/", "--"))

    def exists(self, repo_id: str) -> bool:
        return os.path.isdir(os.path.join(self._folder(repo_id), MANIFESTS))

    def lookup(self, repo_id: str, revision: str):
        folder = self._folder(repo_id)
        commit = revision
        if not _COMMIT.match(revision):
            try:
                with open(os.path.join(folder, "refs", revision)) as handle:
                    commit = handle.read().strip()
            except OSError:
                return None
        try:
            with open(os.path.join(folder, MANIFESTS, f"{commit}.json")) as handle:
                manifest = json.load(handle)
        except (OSError, ValueError):
            return None
        snapshot = os.path.join(folder, "snapshots", commit)
        files = {}
        for path, meta in manifest.get("files", {}).items():
            local = os.path.join(snapshot, path)
            if not os.path.isfile(local) or os.path.getsize(local) != meta["size"]:
                return None  # no longer complete: serve nothing rather than a partial snapshot
            sha = meta.get("sha256")
            oid = git_blob_oid(lfs_pointer(sha, meta["size"])) if sha else os.path.basename(
                os.path.realpath(local))
            files[path] = Entry(path, meta["size"], sha, oid, _file_chunks(local))
        return commit, files


#: Folder of rigbook's manifests inside a repo folder of the cache.
MANIFESTS = "rigbook"

_API = re.compile(r"^/api/models/([^/]+/[^/]+)/(revision|tree|paths-info)/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-$")


class HubHandler(BaseHTTPRequestHandler):
    """The hub routes over a Store. Subclasses may set `token` and override the hooks."""

    protocol_version = "HTTP/1.1"
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
        return "ok" if given == f"Bearer {self.token}" else "wrong"

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
        extra = {"Content-Type": "application/json", "X-Error-Message": message, **(headers or {})}
        if code:
            extra["X-Error-Code"] = code
        self.send(status, json.dumps({"error": message}).encode(), extra)

    def resolve_revision(self, repo_id: str, revision: str):
        if self.auth() in ("missing", "wrong") or not self.store.exists(repo_id):
            self.error(401 if self.store.exists(repo_id) else 404, "RepoNotFound",
                       "Repository not found")
            return None
        found = self.store.lookup(repo_id, unquote(revision))
        if found is None:
            self.error(404, "RevisionNotFound", f"Invalid rev id: {unquote(revision)}")
        return found

    # --- routes --------------------------------------------------------------------------------

    def do_GET(self):
        self.dispatch()

    def do_HEAD(self):
        self.dispatch()

    def do_POST(self):
        self.dispatch()

    def dispatch(self) -> None:
        url = urlsplit(self.path)
        api, resolve = _API.match(url.path), _RESOLVE.match(url.path)
        if api:
            self.record(api.group(2))
            found = self.resolve_revision(api.group(1), api.group(3))
            if found:
                route = getattr(self, "route_" + api.group(2).replace("-", "_"))
                route(api.group(1), *found, url, api.group(4))
        elif resolve:
            self.record("resolve")
            found = self.resolve_revision(resolve.group(1), resolve.group(2))
            if found:
                self.route_resolve(*found, unquote(resolve.group(3)))
        else:
            self.record("unknown")
            self.error(404, None, f"no route {url.path}")

    def route_revision(self, repo_id: str, commit: str, files: dict, url, _rest) -> None:
        blobs = parse_qs(url.query).get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for entry in files.values():
            sibling = {"rfilename": entry.path}
            if blobs:
                sibling.update(size=entry.size, blobId=entry.git_oid)
                if entry.sha256:
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
        length = int(self.headers.get("Content-Length") or 0)
        wanted = set(parse_qs(self.rfile.read(length).decode()).get("paths", []))
        self.send_json([e.tree_entry() for e in files.values() if e.path in wanted])

    def route_resolve(self, commit: str, files: dict, path: str) -> None:
        entry = files.get(path)
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if entry is None:
            self.error(404, "EntryNotFound", f"{path} does not exist", headers)
            return
        if entry.chunks is None:
            self.error(500, None, f"{path} has no bytes here", headers)
            return
        headers["ETag"] = f'"{entry.git_oid}"'
        if entry.sha256:
            headers.update({"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)})
        if self.command == "HEAD":
            self.send(200, b"", {**headers, "Content-Length": str(entry.size)})
            return
        start, status = 0, 200
        match = _RANGE.match(self.headers.get("Range") or "")
        if match and int(match.group(1)) < entry.size:
            start, status = int(match.group(1)), 206
            headers["Content-Range"] = f"bytes {start}-{entry.size - 1}/{entry.size}"
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(entry.size - start)}.items():
            self.send_header(key, value)
        self.end_headers()
        self.send_body(entry, start)


def server(handler: type[HubHandler], host: str = "127.0.0.1", port: int = 0):
    """A threading HTTP server for `handler` (call serve_forever, e.g. in a thread)."""
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    return httpd


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve an HF cache's complete snapshots.")
    parser.add_argument("--cache", required=True, help="the HF_HUB_CACHE to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args(argv)
    handler = type("CacheHandler", (HubHandler,), {"store": CacheStore(args.cache)})
    httpd = server(handler, args.host, args.port)
    print(f"serving {args.cache} on http://{args.host}:{httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
