"""What a Hugging Face cache holds, read on the rig: rigbook's ModelCache fact (roles/models.py).

Sent as `python3 -c <this file> CACHE` (standard library only, nothing of rigbook installed).
Prints one JSON object (sorted keys): per models--ORG--NAME folder its refs, each snapshot's
file sizes, the blobs' total and .incomplete leftovers, and rigbook's manifests (the
`rigbook/` folder pull.py writes), each with the sha256 of its bytes (what an operator pins as
manifest_sha256 for the rigs that pull it from this rig's mirror). Read-only, no network.
"""

import hashlib
import json
import os
import sys


def main(argv: list[str]) -> None:
    cache = argv[1]
    out = {"cache": cache, "exists": os.path.isdir(cache), "repos": []}
    names = sorted(os.listdir(cache)) if out["exists"] else []
    for name in names:
        top = os.path.join(cache, name)
        if not name.startswith("models--") or not os.path.isdir(top):
            continue
        repo = {"folder": name, "refs": {}, "snapshots": {}, "manifests": {}, "incomplete": [],
                "bytes": 0}
        refs = os.path.join(top, "refs")
        for root, _, found in os.walk(refs):
            for ref in found:
                path = os.path.join(root, ref)
                try:
                    with open(path) as handle:
                        repo["refs"][os.path.relpath(path, refs)] = handle.read().strip()
                except OSError:
                    pass
        blobs = os.path.join(top, "blobs")
        for blob in sorted(os.listdir(blobs)) if os.path.isdir(blobs) else []:
            try:
                size = os.stat(os.path.join(blobs, blob)).st_size
            except OSError:
                continue
            repo["bytes"] += size
            if blob.endswith(".incomplete"):
                repo["incomplete"].append([blob, size])
        snapshots = os.path.join(top, "snapshots")
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
        manifests = os.path.join(top, "rigbook")
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
