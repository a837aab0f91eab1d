"""Pull one pinned model snapshot into a Hugging Face cache, and say whether it is complete.

rigbook copies this script to the rig and runs it with its tools venv's python (which holds
huggingface_hub, imported only to list the hub's files and for files that need Xet);
roles/models.py parses the one JSON object it prints on stdout:

    {"status": "complete" | "partial" | "refused" | "error", "repo": ..., "revision": ..., ...}

Exit status: 0 complete, 2 refused (nothing was downloaded), 3 partial, 4 error. A complete
result carries `manifest_sha256`, the sha256 of the manifest it wrote: the value an operator
pins for the rigs that pull this snapshot from this rig's mirror.

Progress goes to stderr, one JSON object a line, so that rigbook shows it while the pull runs:
`{"progress": "download", "files": N, "bytes": B}` before the download, then every
--progress-every seconds `{"progress": "bytes", "bytes": ..., "total": ..., "rate": ...,
"files_done": ..., "files": ..., "active": [{"path", "bytes", "size", "rate"}, ...]}` (bytes
written so far, rates in bytes/s over the last 30 s), and `{"progress": "verify", "files": N}`
before the check.

What it does, in order, holding a per-repo lock so that two pulls of one repo never race:

1. reads the file list of the pinned commit, filtered by the allow/ignore patterns: from the
   hub (HF_ENDPOINT), path, size, git blob id and, for LFS files, sha256; from rigbook's mirror
   (--endpoint), its manifest (GET /api/rigbook/manifest/...), whose bytes must hash to the
   sha256 the operator pinned (--manifest-sha256: the mirror, or anything between it and this
   rig, vouches for nothing), else it refuses: size, sha256 and git blob id of every file;
2. removes `blobs/*.incomplete` leftovers of killed pulls (this script and huggingface_hub 2.x
   write each download to a process-unique temporary file that no later process reuses; a
   leftover whose per-file lock nobody holds is dead) and snapshot files whose size is wrong;
3. preflight: the bytes still missing plus the margin must fit in the free space of the cache's
   filesystem, else it refuses with the numbers and downloads nothing;
4. downloads only the missing files, several at a time, each with one streaming GET of the
   /resolve/ route into `blobs/<etag>.<8 hex>.incomplete` (huggingface_hub's layout), hashed
   while it is written (a dropped connection is resumed with a Range request); a file whose
   hashes do not match is never moved into place. Files over huggingface_hub's plain-HTTP limit
   go through hf_hub_download (Xet), as before;
5. checks every expected file: present, exact size, and every hash it has (sha256; the git blob
   id of non-LFS files), for files not hashed while downloaded now nor vouched for by a
   manifest; a bad file is removed so that the next run fetches it again;
6. complete: writes the manifest `<repo dir>/rigbook/<commit>.json` (files with size, sha256 of
   every file, git blob id, LFS flag; patterns) that later runs check locally, without the
   network, and that rigbook's mirror serves as it is. Its bytes depend on the snapshot and the
   patterns alone (`manifest_bytes`: no time, sorted keys), so every rig that completes the
   same snapshot with the same patterns writes the same manifest, and a pin stays valid over
   pulls. Partial: removes it; the snapshots and manifests of other commits are never touched.

The token, if one is needed, is read from the file HF_TOKEN_PATH names (the HF token for the
hub, the fleet's mirror token for --endpoint): it is never an argument of this script, never
printed, and sent only to the hub or mirror itself, never to where it redirects elsewhere (the
hub's storage). The cache is written 0644 / 0755 whatever the caller's umask: the
engines' user and the mirror's read it. A cache another user could change (cache.py's
`untrusted`: a folder above or in it that is not root's or is open to others' writes, a link
outside a repo's snapshots and blobs) is refused before anything is written, and every file
pull.py opens to write (locks, downloads, the manifest) is opened without following a link.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import http.client
import json
import os
import queue
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from fnmatch import fnmatchcase
from pathlib import Path
from urllib.parse import quote, urljoin, urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cache import untrusted  # noqa: E402  (files/models/cache.py, copied beside this file)
from hfcache import (  # noqa: E402  (rigbook/rigside/hfcache.py, copied beside this file)
    BLOBS,
    MANIFEST_ROUTE,
    manifest_name,
    repo_folder,
    snapshot_dir,
)

EXIT = {"complete": 0, "refused": 2, "partial": 3, "error": 4}
MANIFEST_VERSION = 2
#: The most bytes read from rigbook's mirror for a manifest (at hfcache.MANIFEST_ROUTE).
MANIFEST_LIMIT = 64 * 1024**2
_HEX = {"sha256": re.compile(r"[0-9a-f]{64}"), "oid": re.compile(r"[0-9a-f]{40}")}
HASH_CHUNK = 8 * 1024 * 1024
#: Bytes a download reads (hashes, writes) at a time, and chunks read but not hashed yet at
#: most: large reads keep Python's share small (measured on a sandbox rig: 16 MiB with the
#: hashing on its own thread comes near curl; 1-4 MiB, or hashing inline, do not). A download
#: holds (HASH_QUEUE + 2) * READ_CHUNK of buffers.
READ_CHUNK = 16 * 1024 * 1024
HASH_QUEUE = 2
#: The largest file huggingface_hub fetches over plain HTTP (its MAX_HTTP_DOWNLOAD_SIZE): larger
#: ones need Xet, so they go through hf_hub_download.
HTTP_LIMIT = 50 * 10**9
#: GETs of one file: the first and the Range requests that resume it after a dropped connection.
ATTEMPTS = 3
MAX_REDIRECTS = 10
REDIRECTS = (301, 302, 303, 307, 308)
TIMEOUT = 60
#: Seconds of progress samples a rate is taken over.
RATE_WINDOW = 30.0
GIB = 1024**3


def no_follow(path: str, flags: int) -> int:
    """open()'s opener for everything pull.py writes in the cache: a link there (planted, to
    make root write elsewhere) is an error, never followed."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def new_file(path: str, flags: int) -> int:
    """no_follow for a file of this run's own (a download, a manifest): it must not exist."""
    return no_follow(path, flags | os.O_EXCL)


def gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def mount_point(path: str) -> str:
    """The mount point of the filesystem that holds `path` (or would hold it)."""
    path = os.path.realpath(existing_parent(path))
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def existing_parent(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int:
    stat = os.statvfs(existing_parent(path))
    return stat.f_bavail * stat.f_frsize


class DiskFull(Exception):
    """The cache's filesystem is full (ENOSPC, or EDQUOT: a quota): no retry helps, only space.
    Not an OSError, so that nothing takes it for a dropped connection."""


def write_or_full(out, chunk, name: str, written: int, size: int) -> None:
    """All of `chunk` to `out`, an unbuffered file (a buffered one meets a full disk again when
    it is closed, and that error would replace this one); a full disk raises DiskFull naming
    the byte and the filesystem."""
    try:
        while chunk:
            chunk = chunk[out.write(chunk):]
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DiskFull(f"no space left on {mount_point(name)} ([Errno {error.errno}] "
                       f"{os.strerror(error.errno)}) writing byte {written} of {size}") from None


class Hashes:
    """Every hash of one file that `meta` can be checked against, fed with its bytes in order.

    Non-LFS files are also checked against their git blob id (sha1 of "blob <size>\\0" and the
    bytes: the oid the hub's tree lists); for LFS files that id is the pointer's.
    """

    def __init__(self, meta: dict):
        self.meta = meta
        self.sha = hashlib.sha256()
        self.blob = None if meta["lfs"] else hashlib.sha1(b"blob %d\0" % meta["size"])

    def update(self, chunk) -> None:
        self.sha.update(chunk)
        if self.blob is not None:
            self.blob.update(chunk)

    def check(self) -> tuple[str, dict | None]:
        """(sha256 of the bytes, the first hash of `meta` they do not match or None)."""
        actual, meta = self.sha.hexdigest(), self.meta
        if meta["sha256"] and actual != meta["sha256"]:
            return actual, {"hash": "sha256", "actual": actual, "expected": meta["sha256"]}
        if self.blob is not None and self.blob.hexdigest() != meta["oid"]:
            return actual, {"hash": "git blob id", "actual": self.blob.hexdigest(),
                            "expected": meta["oid"] or "none"}
        return actual, None


def check_hashes(path: Path, meta: dict) -> tuple[str, dict | None]:
    """Hashes.check of the file at `path`, one read."""
    hashes = Hashes(meta)
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            hashes.update(chunk)
    return hashes.check()


def size_of(path: Path) -> int | None:
    """Size of a snapshot file through its symlink; None when it or its blob is missing."""
    try:
        return path.stat().st_size
    except OSError:
        return None


def remove_file(path: Path) -> None:
    """Remove a snapshot file and the blob it points to (so a download fetches it again)."""
    try:
        blob = path.resolve(strict=True)
    except OSError:
        blob = None
    path.unlink(missing_ok=True)
    if blob is not None and blob != path and blob.parent.name == BLOBS:
        blob.unlink(missing_ok=True)


def read_manifest(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def hub_files(repo: str, revision: str) -> dict[str, dict]:
    """path -> {size, sha256 (LFS files only, else None), oid, lfs} of the commit on the hub."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    return {
        entry.path: {"size": entry.size, "sha256": entry.lfs.sha256 if entry.lfs else None,
                     "oid": entry.blob_id, "lfs": entry.lfs is not None}
        for entry in HfApi().list_repo_tree(repo, revision=revision, recursive=True)
        if isinstance(entry, RepoFile)
    }


def read_token() -> str | None:
    """The token in the file HF_TOKEN_PATH names (the one of this pull's destination)."""
    try:
        return Path(os.environ["HF_TOKEN_PATH"]).read_text().strip() or None
    except (KeyError, OSError):
        return None


class HTTPError(Exception):
    """An error answer, named as huggingface_hub names the hub's error codes."""

    NAMES = {"RepoNotFound": "RepositoryNotFoundError", "RevisionNotFound":
             "RevisionNotFoundError", "EntryNotFound": "EntryNotFoundError"}

    def __init__(self, url: str, response: http.client.HTTPResponse):
        name = self.NAMES.get(response.getheader("X-Error-Code"), "HTTP error")
        message = response.getheader("X-Error-Message") or response.reason
        where = urlsplit(url)  # no query: a storage URL's signature stays out of the message
        super().__init__(f"{name} {response.status}: {message} "
                         f"({where.scheme}://{where.netloc}{where.path})")


@contextmanager
def get(url: str, token: str | None, headers: dict | None = None):
    """The response to a GET of `url`, redirects followed; HTTPError for an error status.

    The token goes only to the origin (scheme, host, port) of `url` itself, the hub or the
    mirror, never to another one a redirect names (the hub sends LFS files to its storage).
    """
    origin = urlsplit(url)[:2]
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else \
            http.client.HTTPConnection
        connection = kind(parts.netloc, timeout=TIMEOUT)
        try:
            sent = dict(headers or {})
            if token and parts[:2] == origin:
                sent["Authorization"] = f"Bearer {token}"
            connection.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""),
                               headers=sent)
            response = connection.getresponse()
            if response.status in REDIRECTS and response.getheader("Location"):
                url = urljoin(url, response.getheader("Location"))
                continue
            if response.status >= 400:
                raise HTTPError(url, response)
            yield response
            return
        finally:
            connection.close()
    raise HTTPError(url, response)


class Unpinned(Exception):
    """A mirror's manifest that the operator did not pin: the pull is refused."""


def mirror_files(endpoint: str, repo: str, revision: str, pin: str | None) -> dict[str, dict]:
    """path -> {size, sha256, oid, lfs} of the commit, from rigbook's mirror's manifest.

    Unpinned without a pin, or when the manifest's bytes do not hash to it (the message shows
    only a prefix of theirs: the pin comes from the source rig, never from this message).
    ValueError when it is over MANIFEST_LIMIT, for another snapshot, or lacks a hash of a file.
    """
    if pin is None:
        raise Unpinned(f"a pull from the mirror {endpoint} needs the manifest's sha256 "
                       "(--manifest-sha256; manifest_sha256 of the model in host data)")
    url = f"{endpoint.rstrip('/')}{MANIFEST_ROUTE}/{repo}/{revision}"
    with get(url, read_token()) as response:
        body = response.read(MANIFEST_LIMIT + 1)
    if len(body) > MANIFEST_LIMIT:
        raise ValueError(f"the mirror's manifest is over {MANIFEST_LIMIT} bytes")
    if hashlib.sha256(body).hexdigest() != pin:
        raise Unpinned(
            f"the manifest that {endpoint} served for {repo}@{revision} hashes to "
            f"{hashlib.sha256(body).hexdigest()[:12]}…, not to the manifest_sha256 "
            f"{pin[:12]}… that its host data pins: not the snapshot the operator trusted "
            "(changed at the mirror or on the way); nothing was downloaded")
    data = json.loads(body)
    if (data.get("repo"), data.get("revision")) != (repo, revision):
        raise ValueError("the mirror's manifest is for another snapshot")
    files = {}
    for path, meta in data["files"].items():
        entry = {key: meta.get(key) for key in ("size", "sha256", "oid", "lfs")}
        if not (type(entry["size"]) is int and entry["size"] >= 0
                and isinstance(entry["lfs"], bool) and all(
                    isinstance(entry[key], str) and pattern.fullmatch(entry[key])
                    for key, pattern in _HEX.items())):
            raise ValueError(f"the mirror's manifest has no valid size and hashes for {path}")
        files[path] = entry
    return files


def matches(path: str, patterns: list[str]) -> bool:
    """huggingface_hub's pattern rule (filter_repo_objects): fnmatch, case-sensitive, and a
    pattern that ends with "/" stands for everything under that folder."""
    return any(fnmatchcase(path, pattern + "*" if pattern.endswith("/") else pattern)
               for pattern in patterns)


def safe_path(path: str) -> bool:
    """A relative path that stays in the snapshot folder."""
    parts = path.split("/")
    return not path.startswith("/") and "\\" not in path and "\0" not in path and all(
        part not in ("", ".", "..") for part in parts)


def expected_files(args: argparse.Namespace) -> dict[str, dict]:
    """The files of the pinned commit that the patterns select, from the hub or the mirror.

    ValueError for a path that would leave the snapshot or a hash that cannot name a blob: both
    become file names in the cache.
    """
    if args.endpoint:
        files = mirror_files(args.endpoint, args.repo, args.revision, args.manifest_sha256)
    else:
        files = hub_files(args.repo, args.revision)
    chosen = {}
    for path in sorted(files):
        if (args.allow and not matches(path, args.allow)) or matches(path, args.ignore):
            continue
        meta = files[path]
        if not (safe_path(path) and _HEX["oid"].fullmatch(meta["oid"] or "") and (
                not meta["lfs"] or _HEX["sha256"].fullmatch(meta["sha256"] or ""))):
            raise ValueError(f"unsafe path or hash in the file list: {path!r}")
        chosen[path] = meta
    return chosen


def manifest_bytes(repo: str, revision: str, allow: list[str], ignore: list[str],
                   files: dict[str, dict]) -> bytes:
    """The manifest of a complete snapshot as it is written: from these alone (no time), keys
    sorted, so the same snapshot and patterns give the same bytes, and the same sha256."""
    manifest = {"rigbook_manifest": MANIFEST_VERSION, "repo": repo, "revision": revision,
                "allow_patterns": list(allow), "ignore_patterns": list(ignore), "files": files}
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def remove_dead_leftovers(cache: Path, folder: str) -> list[dict]:
    """Remove `blobs/<etag>[.<8hex>].incomplete` files whose per-file lock nobody holds.

    huggingface_hub holds an flock on `.locks/<repo dir>/<etag>.lock` while it writes a blob
    (filelock's FileLock is fcntl.flock on Linux); taking the same lock proves nobody does now.
    """
    removed = []
    for leftover in sorted((cache / folder / BLOBS).glob("*.incomplete")):
        etag = leftover.name.split(".", 1)[0]
        lock_path = cache / ".locks" / folder / f"{etag}.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a", opener=no_follow) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a download is writing it now
            try:
                size = leftover.stat().st_size
                leftover.unlink()
                removed.append({"name": leftover.name, "size": size})
            except OSError:
                pass
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return removed


def xet_usable() -> bool:
    """Whether hf_hub_download may use Xet (it is installed and not turned off)."""
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:
        return False
    return is_xet_available()


def preflight(
    missing: dict[str, dict], cache: str, margin: int, http_limit: int, xet: bool
) -> dict | None:
    """None when the missing files fit; else the refusal (numbers and reason).

    http_limit: the largest file huggingface_hub fetches over plain HTTP (50 GB in 2.x); xet:
    whether it may use Xet, which has no such limit.
    """
    need = sum(meta["size"] for meta in missing.values())
    free = free_bytes(cache)
    fs = mount_point(cache)
    numbers = {"need_bytes": need, "free_bytes": free, "margin_bytes": margin, "filesystem": fs}
    if need + margin > free:
        return {
            **numbers,
            "message": (
                f"need {gib(need)} + {gib(margin)} margin, have {gib(free)} free on {fs} "
                f"(cache {cache}); nothing was downloaded"
            ),
        }
    huge = sorted(p for p, m in missing.items() if m["size"] > http_limit)
    if huge and not xet:
        return {
            **numbers,
            "message": (
                f"{', '.join(huge)} exceed {http_limit / 10**9:g} GB, which "
                "huggingface_hub will not fetch over plain HTTP, and Xet is off or hf_xet is "
                "missing (a mirror endpoint turns Xet off); nothing was downloaded"
            ),
        }
    return None


def etag_of(meta: dict) -> str:
    """The blob name huggingface_hub gives a file: sha256 of an LFS file, else its git blob id."""
    return meta["sha256"] if meta["lfs"] else meta["oid"]


@contextmanager
def hashing(hashes: Hashes):
    """A function that hands chunks to `hashes` on a thread of its own: hashlib releases the
    GIL, so hashing overlaps the next reads and writes instead of stalling them."""
    chunks: queue.Queue = queue.Queue(maxsize=HASH_QUEUE)

    def run() -> None:
        while (chunk := chunks.get()) is not None:
            hashes.update(chunk)

    thread = threading.Thread(target=run, name="hash")
    thread.start()
    try:
        yield chunks.put
    finally:
        chunks.put(None)
        thread.join()


def stream(url: str, token: str | None, target: Path, meta: dict) -> tuple[str, dict | None]:
    """Write the body of `url` to `target`, hashed as it is written: Hashes.check.

    A connection that drops is resumed with a Range request (ATTEMPTS GETs in all); an error
    answer is not retried, nor a full disk (DiskFull).
    """
    hashes, size, written = Hashes(meta), meta["size"], 0
    dropped: Exception | None = None
    # Buffers reused in turn: one being read, HASH_QUEUE queued, one being hashed, so a buffer
    # comes round again only once hashed (fresh ones cost page faults, which halve the rate).
    ring = [memoryview(bytearray(min(READ_CHUNK, size))) for _ in range(HASH_QUEUE + 2)]
    reads = 0
    with open(target, "wb", buffering=0, opener=new_file) as out, hashing(hashes) as feed:
        for _ in range(ATTEMPTS):
            try:
                with get(url, token, {"Range": f"bytes={written}-"} if written else None) as rsp:
                    if written and not (rsp.getheader("Content-Range") or "").startswith(
                            f"bytes {written}-"):
                        raise ValueError(f"the server did not resume at byte {written}")
                    while written < size:
                        chunk = ring[reads % len(ring)][:min(READ_CHUNK, size - written)]
                        reads += 1
                        count = rsp.readinto(chunk)
                        if not count:
                            break  # the connection closed early: resumed below
                        feed(chunk[:count])
                        write_or_full(out, chunk[:count], str(target), written, size)
                        written += count
            except (OSError, http.client.HTTPException) as error:
                dropped = error
            if written == size:
                break
    if written == size:
        return hashes.check()
    raise ConnectionError(f"the connection dropped at byte {written} of {size} "
                          f"{ATTEMPTS} times" + (f" ({dropped})" if dropped else ""))


def fetch(url: str, token: str | None, repo_dir: Path, lock_dir: Path, link: Path,
          meta: dict) -> tuple[str, dict | None]:
    """Download one file into the cache as huggingface_hub lays it out: (its sha256, the hash
    it does not match or None). Only a file that matches is moved to its blob and linked into
    the snapshot. The per-file lock is the one huggingface_hub holds while it writes a blob (so
    remove_dead_leftovers leaves this download alone)."""
    etag = etag_of(meta)
    blob = repo_dir / BLOBS / etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock_dir.mkdir(parents=True, exist_ok=True)
    temporary = blob.with_name(f"{etag}.{os.urandom(4).hex()}.incomplete")
    with open(lock_dir / f"{etag}.lock", "a", opener=no_follow) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            sha256, mismatch = stream(url, token, temporary, meta)
            if mismatch is None:
                os.replace(temporary, blob)
        finally:
            temporary.unlink(missing_ok=True)
            fcntl.flock(lock, fcntl.LOCK_UN)
    if mismatch is None:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return sha256, mismatch


def download(args: argparse.Namespace, missing: dict[str, dict]):
    """Fetch the missing files, args.workers at a time: (path -> error text of those that
    failed, path -> sha256 of those hashed while written, path -> mismatch of those that were
    not what the file list says). Files over HTTP_LIMIT go through hf_hub_download (Xet) and
    are hashed by verify."""
    cache = Path(args.cache)
    repo_dir = cache / repo_folder(args.repo)
    snapshot = Path(snapshot_dir(args.cache, args.repo, args.revision))
    if args.endpoint:
        base = args.endpoint
    else:
        from huggingface_hub import constants

        base = constants.ENDPOINT
    base = f"{base.rstrip('/')}/{args.repo}/resolve/{quote(args.revision, safe='')}"
    token = read_token()
    errors: dict[str, str] = {}
    hashed: dict[str, str] = {}
    bad: dict[str, dict] = {}
    full: list[str] = []

    def one(path: str) -> None:
        if full:  # the disk is full: the other files would only fill it again
            errors[path] = "not started: the disk is full"
            return
        meta = missing[path]
        try:
            if meta["size"] > HTTP_LIMIT:
                from huggingface_hub import hf_hub_download

                hf_hub_download(args.repo, path, revision=args.revision, cache_dir=str(cache),
                                endpoint=args.endpoint)
                return
            sha256, mismatch = fetch(f"{base}/{quote(path)}", token, repo_dir,
                                     cache / ".locks" / repo_dir.name, snapshot / path, meta)
        except Exception as error:  # every failure is reported per file, the others go on
            errors[path] = f"{type(error).__name__}: {error}".splitlines()[0][:500]
            if isinstance(error, DiskFull) or getattr(error, "errno", None) in (
                    errno.ENOSPC, errno.EDQUOT):  # hf_hub_download's own OSError
                full.append(path)
            return
        if mismatch is None:
            hashed[path] = sha256
        else:
            bad[path] = mismatch

    with ThreadPoolExecutor(max_workers=max(1, min(args.workers, len(missing)))) as pool:
        list(pool.map(one, sorted(missing)))
    return errors, hashed, bad, full


def disk_full(cache: str, missing: dict[str, dict], full: list[str]) -> dict:
    """What a pull that filled the disk says: where, the bytes the snapshot still needs and
    the bytes free there now (the partial files were removed)."""
    need = sum(meta["size"] for meta in missing.values())
    free, fs = free_bytes(cache), mount_point(cache)
    return {"filesystem": fs, "need_bytes": need, "free_bytes": free, "files": sorted(full),
            "message": (f"the disk is full: no space left on {fs} (ENOSPC, [Errno 28]) while "
                        f"writing {', '.join(sorted(full))}; not retried. The snapshot still "
                        f"needs {gib(need)}, {gib(free)} is free on {fs} (cache {cache}): free "
                        f"at least {gib(max(need - free, 0))} there, or move models_cache to a "
                        "larger disk, then run again")}


def report(kind: str, **fields) -> None:
    """One progress line on stderr (stdout holds only the result)."""
    print(json.dumps({"progress": kind, **fields}, sort_keys=True), file=sys.stderr, flush=True)


class Progress:
    """How far the download of the missing files is, read from the cache alone.

    Each download (`fetch`, or huggingface_hub's for Xet) writes to
    `blobs/<etag>.<8 hex>.incomplete` (etag: the sha256 of an LFS file, else its git blob id),
    then moves it to its blob and links it into the snapshot: the sizes on disk are the bytes
    written, and nothing hooks into the download, so nothing here can break it. Writes come in
    steps of up to 16 MiB, so rates are taken over the last RATE_WINDOW seconds, not step to
    step.
    """

    def __init__(self, snapshot: Path, blobs: Path, missing: dict[str, dict], now: float):
        self.snapshot, self.blobs, self.missing = snapshot, blobs, missing
        self.total = sum(meta["size"] for meta in missing.values())
        self.samples = [(now, dict.fromkeys(missing, 0))]  # (when, bytes by path), oldest first

    def partial_sizes(self) -> dict[str, int]:
        """etag -> bytes of its download in progress."""
        sizes: dict[str, int] = {}
        try:
            with os.scandir(self.blobs) as entries:
                for entry in entries:
                    if entry.name.endswith(".incomplete"):
                        etag = entry.name.split(".", 1)[0]
                        try:
                            sizes[etag] = max(sizes.get(etag, 0), entry.stat().st_size)
                        except OSError:
                            continue  # moved into place meanwhile
        except FileNotFoundError:
            pass  # no download has started yet
        return sizes

    def sample(self, now: float) -> dict:
        """Bytes written so far (each file's count never goes back), files done, and rates in
        bytes/s over the last RATE_WINDOW seconds: overall and of each file being written."""
        partial, last = self.partial_sizes(), self.samples[-1][1]
        while len(self.samples) > 1 and self.samples[1][0] <= now - RATE_WINDOW:
            self.samples.pop(0)
        since, base = self.samples[0]
        elapsed = max(now - since, 1e-9)
        written, active, done = {}, [], 0
        for path, meta in self.missing.items():
            complete = size_of(self.snapshot / path) == meta["size"]
            etag = etag_of(meta)
            written[path] = max(meta["size"] if complete else partial.get(etag, 0), last[path])
            if complete:
                done += 1
            elif etag in partial:
                active.append({"path": path, "bytes": written[path], "size": meta["size"],
                               "rate": round((written[path] - base[path]) / elapsed)})
        self.samples.append((now, written))
        return {"bytes": sum(written.values()), "total": self.total, "files_done": done,
                "files": len(self.missing), "active": active,
                "rate": round((sum(written.values()) - sum(base.values())) / elapsed)}


@contextmanager
def reporting(progress: Progress, every: float):
    """Report progress.sample() every `every` seconds while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            report("bytes", **progress.sample(time.monotonic()))

    thread = threading.Thread(target=loop, name="progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def vouched_sha256(meta: dict, known: dict) -> str | None:
    """The sha256 a manifest recorded for a file, when it vouches for the file now expected:
    the same sha256, or (a non-LFS file from the hub, whose sha256 is not listed) the same git
    blob id."""
    key = "sha256" if meta["sha256"] else "oid"
    return known.get("sha256") if known.get(key) == meta[key] else None


def verify(snapshot: Path, files: dict[str, dict], vouched: dict, hash_paths: set[str]):
    """(missing, wrong_size, bad_hash, sha256 by path) after a pull; bad files are removed.

    Files in `hash_paths` (downloaded now) and files the old manifest (`vouched`) does not vouch
    for with the same hashes are read and hashed; the others keep their recorded sha256.
    """
    missing, wrong, bad, hashes = [], [], [], {}
    for path, meta in files.items():
        local = snapshot / path
        size = size_of(local)
        if size is None:
            missing.append(path)
            continue
        if size != meta["size"]:
            wrong.append({"path": path, "size": size, "expected": meta["size"]})
            remove_file(local)
            continue
        known = None if path in hash_paths else vouched_sha256(meta, vouched.get(path, {}))
        if known:
            hashes[path] = known
            continue
        hashes[path], mismatch = check_hashes(local, meta)
        if mismatch:
            bad.append({"path": path, **mismatch})
            remove_file(local)
    return missing, wrong, bad, hashes


def pull(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    cache = Path(args.cache)
    folder = repo_folder(args.repo)
    repo_dir = cache / folder
    snapshot = Path(snapshot_dir(args.cache, args.repo, args.revision))
    manifest_path = repo_dir / manifest_name(args.revision)
    result = {"repo": args.repo, "revision": args.revision, "cache": str(cache)}

    why = untrusted(str(cache))
    if why:  # before the first write: a folder another user writes could redirect root's
        return {**result, "status": "refused", "message": (
            f"{cache}: {why}, so another user (the engine's) could make root write elsewhere "
            "or change what the engines load; allowed: a cache only root can write")}
    (cache / ".locks").mkdir(parents=True, exist_ok=True)
    with open(cache / ".locks" / f"rigbook-{folder}.lock", "a", opener=no_follow) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another pull of this repo: wait for it
        try:
            files = expected_files(args)
        except Unpinned as error:
            return {**result, "status": "refused", "message": str(error)}
        except Exception as error:
            return {**result, "status": "error", "message": (
                f"cannot read the file list of {args.repo}@{args.revision}: "
                f"{type(error).__name__}: {error}"
            )}
        if not files:
            return {**result, "status": "error", "message": (
                f"no file of {args.repo}@{args.revision} matches allow_patterns={args.allow} "
                f"ignore_patterns={args.ignore}"
            )}
        result["files"] = len(files)
        result["total_bytes"] = sum(meta["size"] for meta in files.values())
        result["removed_incomplete"] = remove_dead_leftovers(cache, folder)

        missing = {}
        for path, meta in files.items():
            size = size_of(snapshot / path)
            if size != meta["size"]:
                if size is not None:
                    remove_file(snapshot / path)
                missing[path] = meta
        huge = any(meta["size"] > HTTP_LIMIT for meta in missing.values())
        refusal = preflight(missing, str(cache), args.margin_bytes, HTTP_LIMIT,
                            huge and not args.endpoint and xet_usable())
        if refusal is not None:
            return {**result, **refusal, "status": "refused"}

        downloading = time.monotonic()
        progress = Progress(snapshot, repo_dir / BLOBS, missing, downloading)
        if missing:
            report("download", files=len(missing), bytes=progress.total)
        with reporting(progress, args.progress_every):
            errors, hashed, bad_downloads, full = download(args, missing)
        download_seconds = time.monotonic() - downloading
        downloaded = sorted(p for p in missing if p not in errors and p not in bad_downloads)
        vouched = {**(read_manifest(manifest_path) or {}).get("files", {}),
                   **{path: {**files[path], "sha256": sha} for path, sha in hashed.items()}}
        report("verify", files=len(files))
        absent, wrong, bad, hashes = verify(snapshot, files, vouched, set(missing) - set(hashed))
        absent = [path for path in absent if path not in bad_downloads]
        bad = [{"path": path, **mismatch} for path, mismatch in bad_downloads.items()] + bad
        result.update(
            downloaded=downloaded,
            downloaded_bytes=sum(missing[p]["size"] for p in downloaded),
            download_seconds=round(download_seconds, 1),
            seconds=round(time.monotonic() - started, 1),
        )
        if absent or wrong or bad:
            manifest_path.unlink(missing_ok=True)
            if full:
                still = {path: files[path] for path in absent + [item["path"] for item in wrong]}
                result["disk_full"] = disk_full(str(cache), still, full)
            return {**result, "status": "partial", "missing": absent, "wrong_size": wrong,
                    "bad_hash": bad, "errors": errors}

        manifest = manifest_bytes(
            args.repo, args.revision, args.allow, args.ignore,
            {path: {**meta, "sha256": hashes[path]} for path, meta in files.items()})
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        temporary = manifest_path.with_suffix(f".{os.urandom(4).hex()}.tmp")
        with open(temporary, "wb", opener=new_file) as out:
            out.write(manifest)
        os.replace(temporary, manifest_path)
        return {**result, "status": "complete",
                "manifest_sha256": hashlib.sha256(manifest).hexdigest()}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True, help="HF_HUB_CACHE directory")
    parser.add_argument("--repo", required=True, help="ORG/NAME")
    parser.add_argument("--revision", required=True, help="40-hex commit")
    parser.add_argument("--allow", action="append", default=[], help="allow pattern (repeat)")
    parser.add_argument("--ignore", action="append", default=[], help="ignore pattern (repeat)")
    parser.add_argument("--endpoint", default=None,
                        help="rigbook's mirror to pull from (else the hub, HF_ENDPOINT)")
    parser.add_argument("--manifest-sha256", default=None,
                        help="the sha256 the mirror's manifest must have (needed with "
                             "--endpoint)")
    parser.add_argument("--margin-bytes", type=int, default=10 * GIB)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--progress-every", type=float, default=5.0,
                        help="seconds between progress lines on stderr")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    os.umask(0o022)  # the engines' user and the mirror's read the cache
    result = pull(parse_args(argv))
    print(json.dumps(result, sort_keys=True), flush=True)
    return EXIT[result["status"]]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
