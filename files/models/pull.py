"""Pull one pinned model snapshot into a Hugging Face cache, and say whether it is complete.

rigbook copies this script to the rig and runs it with its tools venv's python (which holds
huggingface_hub); roles/models.py parses the one JSON object it prints on stdout:

    {"status": "complete" | "partial" | "refused" | "error", "repo": ..., "revision": ..., ...}

Exit status: 0 complete, 2 refused (nothing was downloaded), 3 partial, 4 error.

What it does, in order, holding a per-repo lock so that two pulls of one repo never race:

1. reads the file list of the pinned commit from the hub (or the mirror HF_ENDPOINT names):
   path, size and, for LFS files, sha256, filtered by the allow/ignore patterns;
2. removes `blobs/*.incomplete` leftovers of killed pulls (huggingface_hub 2.x writes each
   download to a process-unique temporary file that no later process reuses; a leftover whose
   per-file lock nobody holds is dead) and snapshot files whose size is wrong;
3. preflight: the bytes still missing plus the margin must fit in the free space of the cache's
   filesystem, else it refuses with the numbers and downloads nothing;
4. downloads only the missing files (hf_hub_download; within one run huggingface_hub resumes a
   dropped connection with HTTP Range requests);
5. checks every expected file: present, exact size, and sha256 for LFS files downloaded now or
   not yet vouched for by a manifest; a bad file is removed so that the next run fetches it again;
6. complete: writes the manifest `<repo dir>/rigbook/<commit>.json` (files, sizes, sha256,
   patterns) that later runs check locally, without the network. Partial: removes it.

The token, if one is needed, is read by huggingface_hub from the file HF_TOKEN_PATH names: it is
never an argument of this script and never printed.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

EXIT = {"complete": 0, "refused": 2, "partial": 3, "error": 4}
MANIFEST_VERSION = 1
HASH_CHUNK = 8 * 1024 * 1024
GIB = 1024**3


def repo_folder(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


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


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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
    if blob is not None and blob != path and blob.parent.name == "blobs":
        blob.unlink(missing_ok=True)


def read_manifest(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def expected_files(api, repo: str, revision: str, allow, ignore) -> dict[str, dict]:
    """path -> {size, sha256 (LFS files only, else None)} of the pinned commit, filtered."""
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    entries = {
        entry.path: entry
        for entry in api.list_repo_tree(repo, revision=revision, recursive=True)
        if isinstance(entry, RepoFile)
    }
    chosen = filter_repo_objects(
        list(entries), allow_patterns=allow or None, ignore_patterns=ignore or None
    )
    return {
        path: {
            "size": entries[path].size,
            "sha256": entries[path].lfs.sha256 if entries[path].lfs is not None else None,
        }
        for path in sorted(chosen)
    }


def remove_dead_leftovers(cache: Path, folder: str) -> list[dict]:
    """Remove `blobs/<etag>[.<8hex>].incomplete` files whose per-file lock nobody holds.

    huggingface_hub holds an flock on `.locks/<repo dir>/<etag>.lock` while it writes a blob
    (filelock's FileLock is fcntl.flock on Linux); taking the same lock proves nobody does now.
    """
    removed = []
    for leftover in sorted((cache / folder / "blobs").glob("*.incomplete")):
        etag = leftover.name.split(".", 1)[0]
        lock_path = cache / ".locks" / folder / f"{etag}.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a") as lock:
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


def download(repo, revision, cache, endpoint, paths, workers) -> dict[str, str]:
    """Fetch each path; path -> error text for those that failed."""
    from huggingface_hub import hf_hub_download

    errors: dict[str, str] = {}

    def fetch(path: str) -> None:
        try:
            hf_hub_download(
                repo, path, revision=revision, cache_dir=cache, endpoint=endpoint
            )
        except Exception as error:  # every failure is reported per file, the others go on
            errors[path] = f"{type(error).__name__}: {error}".splitlines()[0][:500]

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(paths)))) as pool:
        list(pool.map(fetch, paths))
    return errors


def verify(snapshot: Path, files: dict[str, dict], vouched: dict, hash_paths: set[str]):
    """(missing, wrong_size, bad_hash) after a pull; bad files are removed."""
    missing, wrong, bad = [], [], []
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
        sha = meta["sha256"]
        known = vouched.get(path, {})
        if sha and (path in hash_paths or known.get("sha256") != sha):
            actual = sha256_of(local)
            if actual != sha:
                bad.append({"path": path, "sha256": actual, "expected": sha})
                remove_file(local)
    return missing, wrong, bad


def pull(args: argparse.Namespace) -> dict:
    from huggingface_hub import HfApi, constants

    started = time.monotonic()
    cache = Path(args.cache)
    folder = repo_folder(args.repo)
    repo_dir = cache / folder
    snapshot = repo_dir / "snapshots" / args.revision
    manifest_path = repo_dir / "rigbook" / f"{args.revision}.json"
    result = {"repo": args.repo, "revision": args.revision, "cache": str(cache)}

    (cache / ".locks").mkdir(parents=True, exist_ok=True)
    with open(cache / ".locks" / f"rigbook-{folder}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another pull of this repo: wait for it
        try:
            api = HfApi(endpoint=args.endpoint)
            files = expected_files(api, args.repo, args.revision, args.allow, args.ignore)
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
        refusal = preflight(
            missing, str(cache), args.margin_bytes, constants.MAX_HTTP_DOWNLOAD_SIZE, xet_usable()
        )
        if refusal is not None:
            return {**result, **refusal, "status": "refused"}

        errors = download(
            args.repo, args.revision, str(cache), args.endpoint, sorted(missing), args.workers
        )
        downloaded = sorted(p for p in missing if p not in errors)
        vouched = (read_manifest(manifest_path) or {}).get("files", {})
        absent, wrong, bad = verify(snapshot, files, vouched, set(missing))
        result.update(
            downloaded=downloaded,
            downloaded_bytes=sum(missing[p]["size"] for p in downloaded),
            seconds=round(time.monotonic() - started, 1),
        )
        if absent or wrong or bad:
            manifest_path.unlink(missing_ok=True)
            return {**result, "status": "partial", "missing": absent, "wrong_size": wrong,
                    "bad_sha256": bad, "errors": errors}

        manifest = {
            "rigbook_manifest": MANIFEST_VERSION,
            "repo": args.repo,
            "revision": args.revision,
            "allow_patterns": list(args.allow),
            "ignore_patterns": list(args.ignore),
            "files": files,
            "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        temporary = manifest_path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, manifest_path)
        return {**result, "status": "complete"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True, help="HF_HUB_CACHE directory")
    parser.add_argument("--repo", required=True, help="ORG/NAME")
    parser.add_argument("--revision", required=True, help="40-hex commit")
    parser.add_argument("--allow", action="append", default=[], help="allow pattern (repeat)")
    parser.add_argument("--ignore", action="append", default=[], help="ignore pattern (repeat)")
    parser.add_argument("--endpoint", default=None, help="hub or mirror URL (else HF_ENDPOINT)")
    parser.add_argument("--margin-bytes", type=int, default=10 * GIB)
    parser.add_argument("--workers", type=int, default=8)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    result = pull(parse_args(argv))
    print(json.dumps(result, sort_keys=True), flush=True)
    return EXIT[result["status"]]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
