"""The Hugging Face cache's layout, and where rigbook keeps its manifests in it: one definition
for the roles (rigbook.roles.models, rigbook.roles.recipes) and the programs that run on the rig
(files/models/pull.py and mirror.py import the copy rigbook puts beside them).

huggingface_hub's cache holds a repo ORG/NAME in `models--ORG--NAME/`: `refs/<name>` (a commit),
`snapshots/<commit>/<path>` (links into `blobs/`) and `blobs/<etag>`. rigbook adds
`rigbook/<commit>.json`, the manifest of a snapshot it completed, which its mirror serves at
`MANIFEST_ROUTE/ORG/NAME/<commit>`. Standard library only: copied to rigs as it is.
files/models/cache.py (sent with `python3 -c`, nothing beside it) still spells the layout out:
its fact fixture holds its text, so it moves here with its next capture on a real host.
"""

from __future__ import annotations

REPO_PREFIX = "models--"
REFS = "refs"
SNAPSHOTS = "snapshots"
BLOBS = "blobs"
#: The folder of rigbook's manifests inside a repo's folder.
MANIFESTS = "rigbook"
#: The mirror's route for a manifest (GET MANIFEST_ROUTE/ORG/NAME/<commit>).
MANIFEST_ROUTE = "/api/rigbook/manifest"


def repo_folder(repo: str) -> str:
    """ORG/NAME -> models--ORG--NAME (huggingface_hub's folder name in the cache)."""
    return REPO_PREFIX + repo.replace("/", "--")


def repo_of(folder: str) -> str:
    """models--ORG--NAME -> ORG/NAME."""
    return folder.removeprefix(REPO_PREFIX).replace("--", "/")


def snapshot_dir(cache: str, repo: str, revision: str) -> str:
    """The snapshot folder of a repo at a commit (what an engine loads offline)."""
    return f"{cache}/{repo_folder(repo)}/{SNAPSHOTS}/{revision}"


def manifest_name(revision: str) -> str:
    """The manifest's path inside a repo's folder."""
    return f"{MANIFESTS}/{revision}.json"
