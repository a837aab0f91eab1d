"""What a Hugging Face cache holds, read on the rig: rigbook's ModelCache fact (roles/models.py).

Sent as `python3 -c <rigbook/rigside/hfcache.py as module hfcache, then this file> CACHE`
(standard library only, nothing of rigbook installed); beside pull.py it imports the copy of
hfcache.py there.
Prints one JSON object (sorted keys): per models--ORG--NAME folder its refs, each snapshot's
file sizes, the blobs' total and .incomplete leftovers, and rigbook's manifests (the
`rigbook/` folder pull.py writes), each with the sha256 of its bytes (what an operator pins as
manifest_sha256 for the rigs that pull it from this rig's mirror); and `untrusted`: why another
user (the engine's) could change the cache, or null. Read-only, no network. pull.py imports
`untrusted` from its copy beside it.
"""

import hashlib
import json
import os
import stat
import sys

from hfcache import BLOBS, MANIFESTS, REFS, REPO_PREFIX, SNAPSHOTS

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _loose(where: str, st: os.stat_result, sticky_ok: bool = False) -> str | None:
    """Why another user could change `where` (this user's, no group or other write), or None.
    A sticky folder (/tmp) may be written by others above the cache when the next folder down
    is this user's: nobody else can rename or remove that one."""
    if st.st_uid != os.geteuid():
        return f"{where} belongs to uid {st.st_uid}"
    if st.st_mode & _OTHERS_WRITE and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return f"{where} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def untrusted(cache: str) -> str | None:
    """Why a user other than this one (root on a rig) could change what pull.py writes or the
    engines load under `cache`, or None: every folder above it (as written and as resolved)
    must be this user's and closed to others' writes; in it, every folder and file too, and a
    link only in a repo's snapshots or blobs (where huggingface_hub's layout has them; Xet's
    blobs are links into the cache's shared store). Nothing is followed."""
    paths = {os.path.abspath(cache), os.path.realpath(cache)}
    for path in paths:
        parts = path.split(os.sep)[1:]
        above = ["/" + "/".join(parts[:i]) for i in range(len(parts) + 1)]
        for i, folder in enumerate(above[:-1]):
            try:
                st = os.stat(folder)
            except FileNotFoundError:
                break
            except OSError as error:
                return f"cannot read {folder}: {error.strerror}"
            below = above[i + 1]
            try:
                next_mine = os.stat(below).st_uid == os.geteuid()
            except OSError:
                next_mine = False  # to be made by this user: a stranger could take the name
            why = _loose(folder, st, sticky_ok=next_mine)
            if why:
                return why
    real = os.path.realpath(cache)
    if not os.path.isdir(real):
        return None
    why = _loose(real, os.lstat(real))
    if why:
        return why
    for root, folders, files in os.walk(real):
        for name in [*folders, *files]:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue  # gone meanwhile
            if stat.S_ISLNK(st.st_mode):
                if os.path.relpath(path, real).split(os.sep)[1:2] not in ([SNAPSHOTS],
                                                                           [BLOBS]):
                    return (f"{path} is a link where the cache has none (only a repo's "
                            "snapshots and, with Xet, its blobs do)")
                continue
            why = _loose(path, st)
            if why:
                return why
    return None


def main(argv: list[str]) -> None:
    cache = argv[1]
    out = {"cache": cache, "exists": os.path.isdir(cache), "repos": [],
           "untrusted": untrusted(cache)}
    names = sorted(os.listdir(cache)) if out["exists"] else []
    for name in names:
        top = os.path.join(cache, name)
        if not name.startswith(REPO_PREFIX) or not os.path.isdir(top):
            continue
        repo = {"folder": name, "refs": {}, "snapshots": {}, "manifests": {}, "incomplete": [],
                "bytes": 0}
        refs = os.path.join(top, REFS)
        for root, _, found in os.walk(refs):
            for ref in found:
                path = os.path.join(root, ref)
                try:
                    with open(path) as handle:
                        repo["refs"][os.path.relpath(path, refs)] = handle.read().strip()
                except OSError:
                    pass
        blobs = os.path.join(top, BLOBS)
        for blob in sorted(os.listdir(blobs)) if os.path.isdir(blobs) else []:
            try:
                size = os.stat(os.path.join(blobs, blob)).st_size
            except OSError:
                continue
            repo["bytes"] += size
            if blob.endswith(".incomplete"):
                repo["incomplete"].append([blob, size])
        snapshots = os.path.join(top, SNAPSHOTS)
        for commit in sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []:
            base = os.path.join(snapshots, commit)
            if not os.path.isdir(base):
                continue
            sizes = {}
            for root, _, found in os.walk(base):
                for item in found:
                    path = os.path.join(root, item)
                    try:
                        sizes[os.path.relpath(path, base)] = os.stat(path).st_size
                    except OSError:
                        sizes[os.path.relpath(path, base)] = None
            repo["snapshots"][commit] = sizes
        manifests = os.path.join(top, MANIFESTS)
        for item in sorted(os.listdir(manifests)) if os.path.isdir(manifests) else []:
            if not item.endswith(".json"):
                continue
            try:
                with open(os.path.join(manifests, item), "rb") as handle:
                    raw = handle.read()
                data = json.loads(raw)
                data = {key: data[key] for key in ("files", "allow_patterns", "ignore_patterns")}
                data["sha256"] = hashlib.sha256(raw).hexdigest()
            except (OSError, ValueError, KeyError, TypeError):
                data = None
            repo["manifests"][item[:-5]] = data
        out["repos"].append(repo)
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv)
