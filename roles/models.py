"""Models in the Hugging Face cache: pinned, preflighted, complete, offline-ready.

Engines serve from the rig's HF cache with HF_HUB_OFFLINE=1, so a missing or half-downloaded
repo is a failed boot, not a silent download. For every ModelSpec of a rig (a repo pinned to a
40-hex commit, with optional allow/ignore patterns) rigbook makes the cache hold exactly that
snapshot:

- `ModelCache` reads what the cache holds on the rig itself, from the layout alone (no network):
  `models--ORG--NAME/{refs,snapshots/<commit>/...,blobs}`, each snapshot file's size through its
  symlink, `.incomplete` leftovers, and the manifest rigbook wrote when it last completed a pull
  (`models--ORG--NAME/rigbook/<commit>.json`: every expected file with its size and sha256).
- A snapshot is complete when that manifest exists for the same patterns and every file in it
  is present with its size: the check is local and runs on every deploy, so a complete cache
  costs no network call and no change.
- Otherwise files/models/pull.py runs on the rig with the tools venv's huggingface_hub: it reads
  the file list (sizes, LFS sha256) of the pinned commit, refuses with the numbers when the
  missing bytes plus models_disk_margin_gib do not fit on the cache's filesystem, downloads only
  what is missing, checks sizes and hashes, and writes the manifest only when the snapshot is
  complete. A partial snapshot fails the rig with the files that are missing or wrong.
- Tokens reach the rig as root-only 0600 files, never in a command, an argument, a diff or a
  log line (see `hf_token`), and only where they are used: the HF token (the operator's HF_TOKEN
  or models_token_file) where the rig pulls from the hub, the fleet's mirror token
  (models_mirror_token_file) where it pulls from a mirror or runs one. huggingface_hub reads the
  one for the pull's destination through HF_TOKEN_PATH, so each goes only there.
- Cached repos that models does not list are reported with their sizes, and removed with
  models_prune: true.
- Fleet pulls: a rig with models_mirror_port runs rigbook's mirror (files/models/mirror.py) over
  its complete snapshots, on models_mirror_bind (default: the rig's address that SSH reached),
  for requests with the fleet's token; a rig with models_endpoint pulls from it and checks every
  file against the sha256 of the mirror's manifest.

docs/models.md has the cache layout, offline serving, tokens, fleet pulls and pruning.
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import NamedTuple

from pyinfra import host, logger, state
from pyinfra.api import FactBase, FunctionCommand, QuoteString, StringCommand, deploy, operation
from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS
from pyinfra.api.command import FileUploadCommand
from pyinfra.api.exceptions import FactProcessError
from pyinfra.facts.files import File
from pyinfra.operations import files, systemd

from rigbook import FILES
from rigbook.checks import Check, Facts, Finding, Read, drift, error, warn
from rigbook.errors import RigbookError
from rigbook.messages import notice, refuse, warn_once
from rigbook.recipes import recipe_for, recipe_pins
from rigbook.render import template
from rigbook.secrets import Secret, read_secret_file
from rigbook.spec import ModelSpec, Rig
from rigbook.tools import TOOLS_PYTHON, tools_venv
from rigbook.types import ip_address

#: Where pull.py lives on the rig (run by the tools venv's python).
MODELS_DIR = "/opt/rigbook/models"
PULL_SCRIPT = f"{MODELS_DIR}/pull.py"
PULL_SOURCE = FILES / "models" / "pull.py"
#: rigbook's hub mirror (files/models/mirror.py) and its unit, where models_mirror_port is set.
MIRROR_SCRIPT = f"{MODELS_DIR}/mirror.py"
MIRROR_SOURCE = FILES / "models" / "mirror.py"
MIRROR_UNIT = "rigbook-hf-mirror.service"
MIRROR_UNIT_PATH = f"/etc/systemd/system/{MIRROR_UNIT}"
MIRROR_TEMPLATE = FILES / "models" / f"{MIRROR_UNIT}.j2"
#: The HF token on the rig: root-only, read by huggingface_hub through HF_TOKEN_PATH.
SECRETS_DIR = "/etc/rigbook/secrets"
TOKEN_PATH = f"{SECRETS_DIR}/hf-token"
#: The fleet's mirror token on the rig: sent by pulls from models_endpoint (HF_TOKEN_PATH), handed
#: to the mirror's unit as a credential (LoadCredential=).
MIRROR_TOKEN_PATH = f"{SECRETS_DIR}/hf-mirror-token"
#: The copy of it that systemd hands the running mirror (root can read it).
MIRROR_CREDENTIAL_PATH = f"/run/credentials/{MIRROR_UNIT}/mirror-token"
#: Manifests rigbook writes inside each repo folder of the cache: rigbook/<commit>.json.
MANIFEST_DIR = "rigbook"
REPO_PREFIX = "models--"
GIB = 1024**3

def repo_folder(repo: str) -> str:
    """ORG/NAME -> models--ORG--NAME (huggingface_hub's folder name in the cache)."""
    return REPO_PREFIX + repo.replace("/", "--")


def snapshot_path(rig: Rig, spec: ModelSpec) -> str:
    """The snapshot folder an engine can load directly (or pass repo + --revision offline)."""
    return f"{rig.models_cache}/{repo_folder(spec.repo)}/snapshots/{spec.revision}"


def human(size: int) -> str:
    """Bytes as GiB (two decimals) or, below 1 GiB, MiB."""
    if size >= GIB:
        return f"{size / GIB:.2f} GiB"
    return f"{size / 1024**2:.2f} MiB"


def label(spec: ModelSpec) -> str:
    return f"{spec.repo}@{spec.revision[:12]}"


# --- the cache fact ---------------------------------------------------------------------------

#: Runs on the rig with its python3 (argv[1] is the cache); prints one JSON object. Standard
#: library only, read-only, no network.
CACHE_SCRIPT = r"""
import json, os, sys
cache = sys.argv[1]
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
            with open(os.path.join(manifests, item)) as handle:
                data = json.load(handle)
            data = {key: data[key] for key in ("files", "allow_patterns", "ignore_patterns")}
        except (OSError, ValueError, KeyError, TypeError):
            data = None
        repo["manifests"][item[:-5]] = data
    out["repos"].append(repo)
print(json.dumps(out, sort_keys=True))
"""


@dataclass(frozen=True)
class Manifest:
    """What rigbook recorded when it completed a pull: expected files and the patterns."""

    files: Mapping[str, tuple[int, str | None]]  # path -> (size, sha256 of LFS files)
    allow_patterns: tuple[str, ...]
    ignore_patterns: tuple[str, ...]

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self.files.values())


@dataclass(frozen=True)
class CachedRepo:
    """One models--ORG--NAME folder of the cache."""

    folder: str
    bytes: int  # everything in blobs/, .incomplete leftovers included
    refs: Mapping[str, str] = field(default_factory=dict)
    snapshots: Mapping[str, Mapping[str, int | None]] = field(default_factory=dict)
    manifests: Mapping[str, Manifest | None] = field(default_factory=dict)  # None: unreadable
    incomplete: tuple[tuple[str, int], ...] = ()

    @property
    def repo(self) -> str:
        return self.folder.removeprefix(REPO_PREFIX).replace("--", "/")


@dataclass(frozen=True)
class CacheState:
    """The whole cache as ModelCache read it."""

    cache: str
    exists: bool
    repos: Mapping[str, CachedRepo]  # by repo id


class ModelCache(FactBase[CacheState]):
    """
    What a Hugging Face cache holds, read from its layout on the rig (no network).

    Runs a short python3 script (``CACHE_SCRIPT``) that prints one JSON object, e.g. for a cache
    with one complete snapshot::

        {"cache": "/var/lib/rigbook/hf/hub", "exists": true, "repos": [{
          "folder": "models--rigbook-test--tiny", "bytes": 262318, "refs": {},
          "snapshots": {"3f2635f2...": {"config.json": 98, "model.safetensors": 262144}},
          "manifests": {"3f2635f2...": {"files": {"config.json": {"size": 98, "sha256": null},
              "model.safetensors": {"size": 262144, "sha256": "c87f7657..."}},
              "allow_patterns": [], "ignore_patterns": []}},
          "incomplete": []}]}
    """

    def command(self, cache: str) -> StringCommand:
        return StringCommand("python3", "-c", QuoteString(CACHE_SCRIPT), QuoteString(cache))

    def process(self, output: list[str]) -> CacheState:
        return parse_cache("\n".join(output))


def _manifest(data) -> Manifest | None:
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return None
    try:
        entries = {
            str(path): (int(meta["size"]), meta.get("sha256"))
            for path, meta in data["files"].items()
        }
    except (KeyError, TypeError, ValueError):
        return None
    return Manifest(
        entries,
        tuple(data.get("allow_patterns") or ()),
        tuple(data.get("ignore_patterns") or ()),
    )


def parse_cache(text: str) -> CacheState:
    """ModelCache's JSON into a CacheState (see the fact's docstring)."""
    try:
        data = json.loads(text)
    except ValueError as error:
        raise FactProcessError(f"the cache probe printed no JSON: {text[:200]!r}") from error
    repos = {}
    for entry in data.get("repos", ()):
        repo = CachedRepo(
            folder=entry["folder"],
            bytes=int(entry.get("bytes", 0)),
            refs=dict(entry.get("refs", {})),
            snapshots={commit: dict(sizes) for commit, sizes in entry.get("snapshots", {}).items()},
            manifests={commit: _manifest(m) for commit, m in entry.get("manifests", {}).items()},
            incomplete=tuple((name, int(size)) for name, size in entry.get("incomplete", ())),
        )
        repos[repo.repo] = repo
    return CacheState(data["cache"], bool(data["exists"]), repos)


# --- completeness -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotStatus:
    """Whether the cache holds a ModelSpec's snapshot completely, and if not, why."""

    complete: bool
    reason: str  # why not complete ("" when complete)
    files: int = 0
    bytes: int = 0
    missing: tuple[str, ...] = ()
    wrong_size: tuple[tuple[str, int, int], ...] = ()  # (path, have, want)


def snapshot_status(cache: CacheState, spec: ModelSpec) -> SnapshotStatus:
    """Decide from the cache alone (no network) whether `spec`'s snapshot is complete.

    Complete: rigbook's manifest for the commit exists, was written for the same patterns, and
    every file it lists is in snapshots/<commit>/ with its size; no `.incomplete` leftover of an
    interrupted pull is lying in the repo's blobs. Hashes are not re-read here (they were
    checked when the files were pulled).
    """
    repo = cache.repos.get(spec.repo)
    if repo is None:
        return SnapshotStatus(False, f"not in the cache {cache.cache}")
    present = repo.snapshots.get(spec.revision, {})
    if spec.revision not in repo.manifests:
        if not present:
            return SnapshotStatus(False, f"no snapshot of commit {spec.revision[:12]} yet")
        return SnapshotStatus(
            False,
            f"{len(present)} file(s) in snapshots/{spec.revision[:12]} but no rigbook manifest: "
            "never completed by a pull (interrupted, or pulled by other means)",
        )
    manifest = repo.manifests[spec.revision]
    if manifest is None:
        return SnapshotStatus(False, "its rigbook manifest is unreadable")
    if (manifest.allow_patterns, manifest.ignore_patterns) != (
        spec.allow_patterns, spec.ignore_patterns
    ):
        return SnapshotStatus(False, "allow/ignore patterns changed since the last pull")
    missing = tuple(path for path in manifest.files if present.get(path) is None)
    wrong = tuple(
        (path, present[path], size)
        for path, (size, _) in manifest.files.items()
        if present.get(path) is not None and present[path] != size
    )
    counts = {"files": len(manifest.files), "bytes": manifest.bytes}
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if wrong:
            parts.append("wrong size " + ", ".join(f"{p} ({h} of {w} bytes)" for p, h, w in wrong))
        return SnapshotStatus(False, "partial: " + "; ".join(parts), missing=missing,
                              wrong_size=wrong, **counts)
    if repo.incomplete:
        leftover = sum(size for _, size in repo.incomplete)
        return SnapshotStatus(
            False,
            f"{len(repo.incomplete)} .incomplete leftover(s) ({human(leftover)}) of an "
            "interrupted pull in blobs/",
            **counts,
        )
    return SnapshotStatus(True, "", **counts)


def unhashed(cache: CacheState, spec: ModelSpec) -> int:
    """How many files a complete snapshot's manifest lists without a sha256: an older rigbook
    recorded none for non-LFS files, and the mirror serves only snapshots with every hash."""
    manifest = cache.repos[spec.repo].manifests[spec.revision]
    return sum(1 for _, sha in manifest.files.values() if not sha)


# --- the pull ---------------------------------------------------------------------------------


def pull_command(spec: ModelSpec, rig: Rig) -> StringCommand:
    """The command that runs pull.py for one model: no secret in it, only the token's path.

    HF_TOKEN_PATH names the token of the pull's destination, so neither token goes anywhere
    else: the HF token for the hub, the fleet's mirror token for models_endpoint.
    """
    token_path = MIRROR_TOKEN_PATH if rig.models_endpoint else TOKEN_PATH
    env = [
        "HF_HUB_DISABLE_PROGRESS_BARS=1",
        "HF_HUB_DISABLE_TELEMETRY=1",
        f"HF_TOKEN_PATH={token_path}",
    ]
    args = [
        f"--cache={rig.models_cache}",
        f"--repo={spec.repo}",
        f"--revision={spec.revision}",
        f"--margin-bytes={int(rig.models_disk_margin_gib * GIB)}",
    ]
    if rig.models_endpoint:
        # A mirror serves files over plain HTTP; Xet storage lives with the hub itself.
        env.append("HF_HUB_DISABLE_XET=1")
        args.append(f"--endpoint={rig.models_endpoint}")
    args += [f"--allow={pattern}" for pattern in spec.allow_patterns]
    args += [f"--ignore={pattern}" for pattern in spec.ignore_patterns]
    return StringCommand(
        "env", "-u", "HF_TOKEN", "-u", "HUGGING_FACE_HUB_TOKEN",
        *env, TOOLS_PYTHON, PULL_SCRIPT, *(QuoteString(arg) for arg in args),
    )


def parse_pull_output(stdout: str) -> dict | None:
    """The JSON object pull.py printed last, or None when there is none."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                return None
            return result if isinstance(result, dict) and "status" in result else None
    return None


def pull_message(spec: ModelSpec, result: dict | None, stderr: str = "") -> str:
    """One line that says what a pull did, for the operator (pyinfra prefixes the rig)."""
    where = label(spec)
    if result is None:
        tail = " | ".join(stderr.strip().splitlines()[-5:]) or "no output"
        return f"{where}: the pull script failed without a result: {tail}"
    status = result["status"]
    if status == "complete":
        pulled = result.get("downloaded", [])
        what = (
            f"pulled {len(pulled)} file(s), {human(result.get('downloaded_bytes', 0))} "
            f"in {result.get('seconds', 0):.1f} s"
            if pulled else "nothing to download"
        )
        removed = result.get("removed_incomplete", [])
        if removed:
            what += (
                f", removed {len(removed)} .incomplete leftover(s) "
                f"({human(sum(item['size'] for item in removed))})"
            )
        return (
            f"{where}: {what}; complete: {result.get('files', 0)} file(s), "
            f"{human(result.get('total_bytes', 0))}"
        )
    if status == "refused":
        return f"{where}: pull refused: {result.get('message', '?')}"
    if status == "partial":
        parts = []
        if result.get("missing"):
            parts.append("missing " + ", ".join(result["missing"]))
        for item in result.get("wrong_size", []):
            parts.append(f"{item['path']} is {item['size']} of {item['expected']} bytes")
        for item in result.get("bad_hash", []):
            parts.append(f"{item['path']} has {item['hash']} {item['actual'][:12]}…, "
                         f"expected {item['expected'][:12]}…")
        errors = "; ".join(f"{path}: {text}" for path, text in result.get("errors", {}).items())
        return (
            f"{where}: PARTIAL snapshot, not complete: {'; '.join(parts)}"
            + (f" (errors: {errors})" if errors else "")
            + f". Pulled {len(result.get('downloaded', []))} file(s); run again to finish "
            "(files already complete are kept, bad ones were removed)"
        )
    return f"{where}: pull failed: {result.get('message', status)}"


def redact(text: str, secret: Secret | None) -> str:
    return secret.redact(text) if secret is not None else text


def _connector_arguments() -> dict:
    """The operation's connector arguments (_sudo, _env...), for commands run from a function."""
    given = host.current_op_global_arguments or {}
    return {key: value for key, value in given.items() if key in CONNECTOR_ARGUMENT_KEYS}


def _pull(state, host, spec: ModelSpec, why: str, command: StringCommand, arguments: dict,
          secret: Secret | None) -> bool:
    """FunctionCommand body: run pull.py, report one line, fail the rig unless complete."""
    logger.info(f"{host.print_prefix}pulling {label(spec)} ({why}) ...")
    _ok, output = host.run_shell_command(
        command, print_output=state.print_output, print_input=state.print_input, **arguments
    )
    result = parse_pull_output(output.stdout)
    message = redact(pull_message(spec, result, output.stderr), secret)
    if result is not None and result["status"] == "complete":
        logger.info(f"{host.print_prefix}{message}")
        return True
    host.log_styled(message, fg="red", log_func=logger.error)
    return False


@operation()
def model_snapshot(spec: ModelSpec, rig: Rig, token: Secret | None = None) -> Iterator:
    """
    Make the rig's HF cache hold one pinned snapshot completely.

    + spec: the model (repo, 40-hex revision, allow/ignore patterns)
    + rig: the rig's validated host data (cache, endpoint, disk margin)
    + token: the token placed by ``hf_token`` (only to mask it in messages; never sent)

    Complete per ``snapshot_status`` (local, no network): no change, unless the rig runs the
    mirror and the manifest lacks a sha256 (``unhashed``): then the pull hashes those files,
    downloading nothing. Otherwise runs files/models/pull.py with the tools venv's python and
    fails the rig unless the pull ends complete: a refusal says how many GiB are needed and free
    on which filesystem, a partial pull lists the files missing or wrong.
    """
    cache = host.get_fact(ModelCache, cache=rig.models_cache)
    status = snapshot_status(cache, spec)
    reason = status.reason
    if status.complete and rig.models_mirror_port is not None and unhashed(cache, spec):
        reason = (f"{unhashed(cache, spec)} file(s) have no sha256 in its manifest (an older "
                  "rigbook's pull), which the mirror needs")
    elif status.complete:
        host.noop(
            f"{label(spec)} is complete in {rig.models_cache} "
            f"({status.files} file(s), {human(status.bytes)})"
        )
        return
    if not state.is_executing:
        warn_once(f"{label(spec)}: {reason}: will pull")
    yield FunctionCommand(
        _pull, (spec, reason, pull_command(spec, rig), _connector_arguments(), token), {}
    )


# --- the token --------------------------------------------------------------------------------


def operator_token(rig: Rig, environ: Mapping[str, str] = os.environ) -> Secret | None:
    """The HF token on the operator's machine: models_token_file if set, else HF_TOKEN.

    RigbookError when models_token_file cannot be read or does not hold one token.
    """
    if rig.models_token_file:
        text = read_secret_file("models_token_file", rig.models_token_file, "token")
        return Secret(text)
    value = environ.get("HF_TOKEN", "").strip()
    return Secret(value) if value else None


#: A fleet token: long enough not to be guessed, and nothing an HTTP header would mangle.
_MIRROR_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{32,}")


def mirror_token(rig: Rig) -> Secret | None:
    """The fleet's mirror token from models_mirror_token_file (None when unset).

    RigbookError, never showing the file's content, when the file cannot be read, when others
    may read it, or when it does not hold one token of 32 or more header-safe characters.
    """
    if rig.models_mirror_token_file is None:
        return None
    text = read_secret_file("models_mirror_token_file", rig.models_mirror_token_file, "token")
    if not _MIRROR_TOKEN.fullmatch(text):
        raise RigbookError(
            "models_mirror_token_file: its token must be 32 or more letters, digits and "
            "- . _ ~ + / = (e.g. the output of `openssl rand -hex 32`)"
        )
    return Secret(text)


class RigToken(NamedTuple):
    """A token file of the rig: what it holds, where, and the token (None: the file goes)."""

    what: str
    path: str
    token: Secret | None
    why_not: str  # why the rig holds none, when token is None


def rig_tokens(rig: Rig, environ: Mapping[str, str] = os.environ) -> tuple[RigToken, RigToken]:
    """The HF token and the fleet's mirror token, each only where the rig uses it.

    The HF token where the rig pulls from the hub (models and no models_endpoint), the mirror
    token where it pulls from a mirror (models_endpoint) or runs one (models_mirror_port). Both
    files of the operator are read either way, so a bad one is refused before connecting.
    """
    hub, mirror = operator_token(rig, environ), mirror_token(rig)
    from_hub = bool(rig.models) and rig.models_endpoint is None
    for_mirror = rig.models_mirror_port is not None or bool(rig.models and rig.models_endpoint)
    return (
        RigToken("HF token", TOKEN_PATH, hub if from_hub else None,
                 "not used here" if hub and not from_hub else "none supplied this run"),
        RigToken("mirror token", MIRROR_TOKEN_PATH, mirror if for_mirror else None,
                 "not used here" if mirror and not for_mirror else "none supplied this run"),
    )


@dataclass(frozen=True)
class SecretFileState:
    mode: str
    owner: str
    group: str
    sha256: str


class SecretFile(FactBase[SecretFileState | None]):
    """
    Mode, owner, group and sha256 of a file (None when absent); never its contents.

    Output::

        600 root root
        9f2c5d0e...  (sha256, 64 hex)
    """

    def command(self, path: str) -> StringCommand:
        quoted = QuoteString(path)
        return StringCommand(
            "if [ -f", quoted, "]; then stat -c '%a %U %G'", quoted, "&& sha256sum <", quoted,
            "| cut -d' ' -f1; fi",
        )

    def process(self, output: list[str]) -> SecretFileState | None:
        return parse_secret_file(output)


def parse_secret_file(output: list[str]) -> SecretFileState | None:
    lines = [line.strip() for line in output if line.strip()]
    if not lines:
        return None
    if len(lines) != 2 or len(lines[0].split()) != 3 or len(lines[1]) != 64:
        raise FactProcessError(f"unexpected secret-file probe output ({len(lines)} lines)")
    mode, owner, group = lines[0].split()
    return SecretFileState(mode, owner, group, lines[1])


_SUDO_LIKE = ("_sudo", "_doas", "_dzdo", "_su_user")


def secret_upload(secret: Secret, path: str) -> Iterator:
    """Commands that write `secret` to `path` without it ever being readable by anyone else.

    The bytes travel by SFTP (pyinfra's file upload, whose log names only the object) into a
    file created 0600 beforehand (an SFTP write keeps an existing file's mode), then replace
    `path` with one rename. Under sudo pyinfra first uploads as the login user to a temporary
    file: that one is created 0600 by the login user first, for the same reason.
    """
    staging = f"{path}.new"
    yield StringCommand("install", "-m", "600", "-o", "root", "-g", "root", "/dev/null",
                        QuoteString(staging))
    given = host.current_op_global_arguments or {}
    if any(given.get(key) for key in _SUDO_LIKE):
        temp = host.get_temp_filename(f"rigbook-secret-{path}")
        yield StringCommand("install", "-m", "600", "/dev/null", QuoteString(temp),
                            _sudo=False, _doas=False, _dzdo=False, _su_user=None)
        yield FileUploadCommand(io.BytesIO(secret.data), staging, remote_temp_filename=temp)
    else:
        yield FileUploadCommand(io.BytesIO(secret.data), staging)
    yield StringCommand("mv", "-f", QuoteString(staging), QuoteString(path))


@operation()
def hf_token(token: Secret, path: str = TOKEN_PATH) -> Iterator:
    """
    Place a token on the rig as a root-only file (0600 in a 0700 directory).

    + token: the token (a ``Secret``: printed as ``***``)
    + path: where it goes: ``TOKEN_PATH`` (the HF token) or ``MIRROR_TOKEN_PATH`` (the fleet's
      mirror token); pull.py is run with ``HF_TOKEN_PATH`` pointing at one of them

    Compared by sha256 (``SecretFile``), never by content, so ``--diff`` has nothing to show;
    unlike ``files.put``, which prints a file-like source's lines with ``--diff``.
    """
    now = host.get_fact(SecretFile, path=path)
    wanted = SecretFileState("600", "root", "root", token.sha256)
    if now == wanted:
        host.noop(f"{path} holds the token (0600 root)")
        return
    yield StringCommand("install", "-d", "-m", "700", "-o", "root", "-g", "root",
                        QuoteString(str(PurePosixPath(path).parent)))
    if now is None or now.sha256 != wanted.sha256:
        yield from secret_upload(token, path)
    else:
        yield StringCommand("chown", "root:root", QuoteString(path))
        yield StringCommand("chmod", "600", QuoteString(path))


# --- pruning ----------------------------------------------------------------------------------


def unreferenced(cache: CacheState, keep: Iterable[str]) -> list[CachedRepo]:
    """Cached model repos that `keep` (the repos of the rig's models) does not name."""
    wanted = set(keep)
    return [cache.repos[repo] for repo in sorted(cache.repos) if repo not in wanted]


def prune_listing(repos: Iterable[CachedRepo]) -> str:
    repos = list(repos)
    total = sum(repo.bytes for repo in repos)
    listed = ", ".join(f"{repo.repo} ({human(repo.bytes)})" for repo in repos)
    return f"{len(repos)} repo(s), {human(total)}: {listed}"


@operation()
def prune_models(cache: str, keep: tuple[str, ...], prune: bool = False) -> Iterator:
    """
    Report, and with ``prune`` remove, cached model repos that the rig's models do not list.

    + cache: the HF cache (models_cache)
    + keep: the repos to keep (ORG/NAME of every ModelSpec of the rig)
    + prune: remove them (models_prune); otherwise only report them with their sizes

    Only ``models--*`` folders are considered (datasets and spaces are left alone); a repo's
    per-file locks under ``.locks`` go with it.
    """
    extra = unreferenced(host.get_fact(ModelCache, cache=cache), keep)
    if not extra:
        host.noop(f"no cached repo outside models in {cache}")
        return
    listing = prune_listing(extra)
    if not prune:
        warn_once(f"cached but not in models: {listing}; models_prune: true removes them")
        host.noop(f"not pruning (models_prune is false): {listing}")
        return
    for repo in extra:
        yield StringCommand(
            "rm", "-rf", QuoteString(f"{cache}/{repo.folder}"),
            QuoteString(f"{cache}/.locks/{repo.folder}"),
        )
    yield notice(f"pruned from {cache}: {listing}")


# --- the role ---------------------------------------------------------------------------------


def selected(rig: Rig) -> tuple[ModelSpec, ...]:
    """The models this run pulls: all of them, or only models_only."""
    if rig.models_only is None:
        return rig.models
    return tuple(spec for spec in rig.models if spec.repo == rig.models_only)


@operation()
def refused(message: str) -> Iterator:
    """Fail this rig with `message` (bad input found while planning); nothing else runs on it."""
    yield refuse(message)


class SshAddress(FactBase[str | None]):
    """
    The rig's own address of the operator's SSH connection (None without one, e.g. @local).

    The third field of SSH_CONNECTION (client address, client port, server address, server
    port); sudo drops the variable, so it is read from the nearest process up the tree that has
    it. An address with a scope id (link-local IPv6) counts as none; an IPv4-mapped IPv6 address
    is given as IPv4::

        10.0.3.1 51234 10.0.3.7 22
    """

    def command(self) -> str:
        return (
            'pid=$$; while [ "${pid:-0}" -gt 1 ]; do '
            "tr '\\0' '\\n' < /proc/$pid/environ 2>/dev/null | sed -n 's/^SSH_CONNECTION=//p'; "
            "pid=$(sed -n 's/^PPid:[[:space:]]*//p' /proc/$pid/status 2>/dev/null); "
            "done | head -n 1"
        )

    def process(self, output: list[str]) -> str | None:
        return parse_ssh_address(output)


def parse_ssh_address(output: list[str]) -> str | None:
    fields = " ".join(output).split()
    if len(fields) != 4:
        return None
    try:
        address = ip_address(fields[2])
    except ValueError:
        return None
    mapped = getattr(ipaddress.ip_address(address), "ipv4_mapped", None)
    return str(mapped) if mapped else address


#: Why a mirror has no address to listen on (the check and hub_mirror say the same).
NO_MIRROR_ADDRESS = (
    "no address for the mirror: the rig's SSH connection gives none (no SSH_CONNECTION, e.g. "
    "@local, or a link-local address); set models_mirror_bind to one of the rig's addresses"
)


def hub_mirror(rig: Rig, token: Secret | None) -> None:
    """Run rigbook's mirror on models_mirror_port, or make sure it is gone (deploy-level).

    It listens on models_mirror_bind, else on the rig's address that the SSH connection reached
    (``SshAddress``), and takes the fleet's `token` (placed at MIRROR_TOKEN_PATH before; None
    only where models_mirror_port is unset) as a systemd credential: a mirror that runs with
    another one (its credential's sha256 differs) is restarted. Whether the unit file exists is
    read while planning: nothing earlier in a run creates it.
    """
    if rig.models_mirror_port is None:
        if host.get_fact(File, path=MIRROR_UNIT_PATH):
            systemd.service(name=f"Stop {MIRROR_UNIT} (models_mirror_port is unset)",
                            service=MIRROR_UNIT, running=False, enabled=False)
            files.file(name=f"Remove {MIRROR_UNIT_PATH}", path=MIRROR_UNIT_PATH, present=False)
            systemd.daemon_reload(name="Reload systemd")
        return
    bind = rig.models_mirror_bind or host.get_fact(SshAddress)
    if bind is None:
        refused(name=f"Find the address of {MIRROR_UNIT}", message=f"{host.name}: "
                f"models_mirror_bind: {NO_MIRROR_ADDRESS}")
        return
    files.directory(name=f"Create {MODELS_DIR}", path=MODELS_DIR, mode="755")
    script = files.put(name=f"Install {MIRROR_SCRIPT}", src=str(MIRROR_SOURCE),
                       dest=MIRROR_SCRIPT, mode="644")
    unit = template(
        name=f"Write {MIRROR_UNIT_PATH}", src=str(MIRROR_TEMPLATE), dest=MIRROR_UNIT_PATH,
        mode="644", cache=rig.models_cache, bind=bind, port=rig.models_mirror_port,
        script=MIRROR_SCRIPT, token_path=MIRROR_TOKEN_PATH,
    )
    held = host.get_fact(SecretFile, path=MIRROR_CREDENTIAL_PATH)  # None: not running
    systemd.service(
        name=f"Run {MIRROR_UNIT} on {bind} port {rig.models_mirror_port}", service=MIRROR_UNIT,
        running=True, enabled=True, daemon_reload=unit.will_change,
        restarted=unit.will_change or script.will_change or (
            held is not None and held.sha256 != token.sha256),
    )


@deploy("Models in the Hugging Face cache")
def models(rig: Rig) -> None:
    """Pull every model (or models_only) completely, report or prune the rest, run the mirror.

    The tokens go first: each is placed where the rig uses it and removed elsewhere. The mirror
    (models_mirror_port) and the prune step are left out of a models_only run.
    """
    specs = selected(rig)
    try:
        tokens = rig_tokens(rig)
    except RigbookError as error:
        refused(name="Read the tokens on this machine", message=f"{host.name}: {error}")
        return
    hub, fleet = tokens
    for what, path, token, why_not in tokens:
        if token is None:
            files.file(name=f"No {what} on the rig ({path}): {why_not}", path=path, present=False)
        else:
            hf_token(name=f"Place the {what} in {path} (root only)", token=token, path=path)
    if specs:
        tools_venv(rig)
        files.directory(name=f"Create {MODELS_DIR}", path=MODELS_DIR, mode="755")
        files.put(name=f"Install {PULL_SCRIPT}", src=str(PULL_SOURCE), dest=PULL_SCRIPT,
                  mode="644")
        files.directory(name=f"Create the HF cache {rig.models_cache}", path=rig.models_cache,
                        mode="755")
        sent = (fleet if rig.models_endpoint else hub).token
        for spec in specs:
            model_snapshot(name=f"Pull {label(spec)}", spec=spec, rig=rig, token=sent)
    if rig.models_only is None:
        prune_models(
            name="Cached repos not in models",
            cache=rig.models_cache,
            keep=tuple(spec.repo for spec in rig.models),
            prune=rig.models_prune,
        )
        hub_mirror(rig, fleet.token)


# --- the models check --------------------------------------------------------------------------


def wanted_models(rig: Rig, rig_name: str) -> list[tuple[ModelSpec, str]]:
    """(spec, "models" | "recipe") of every snapshot the rig must hold: its models, then the
    recipe's pins its models do not cover (a recipe that does not resolve adds none: the
    serving check says why)."""
    wanted = [(spec, "models") for spec in rig.models]
    if rig.recipe is not None:
        listed = {spec.repo for spec in rig.models}
        try:
            pins = recipe_pins(recipe_for(rig, rig_name), rig)
        except RigbookError:
            pins = ()
        wanted += [(spec, "recipe") for spec in pins if spec.repo not in listed]
    return wanted


def model_state(cache: CacheState, spec: ModelSpec) -> tuple[str, SnapshotStatus]:
    """(complete | partial | missing, the snapshot's status) of one pinned snapshot."""
    status = snapshot_status(cache, spec)
    if status.complete:
        return "complete", status
    repo = cache.repos.get(spec.repo)
    return ("partial" if repo is not None and repo.snapshots.get(spec.revision) else "missing",
            status)


def model_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """Each pinned snapshot complete, or partial / missing with what to run; cached repos that
    models does not list (drift when models_prune removes them, else a warning)."""
    if not (rig.models or rig.recipe):
        return []
    if facts.missing("cache") or facts.cache is None:
        return facts.missing("cache")
    cache, found = facts.cache, []
    for spec, source in wanted_models(rig, rig_name):
        state, status = model_state(cache, spec)
        if state == "complete":
            continue
        fix = ("run deploys/models.py" if source == "models"
               else "add it to the rig's models and run deploys/models.py")
        what = "model" if source == "models" else f"recipe {rig.recipe}: model"
        why = status.reason.removeprefix("partial: ")
        found.append(drift("models", f"{what} {label(spec)} {state}: {why}; {fix}"))
    extra = unreferenced(cache, {spec.repo for spec in rig.models})
    if extra:
        listing = prune_listing(extra)
        if rig.models_prune:
            found.append(drift("models", f"cached but not in models: {listing}; models_prune is "
                                         "true: deploys/rig.py or deploys/models.py removes them"))
        else:
            found.append(warn("models", f"cached but not in models: {listing}; models_prune: "
                                        "true removes them"))
    return found


def _model_reads(rig: Rig, rig_name: str) -> list[Read]:
    if not (rig.models or rig.recipe):
        return []
    return [Read("cache", ModelCache, "HF cache (models_cache)", (("cache", rig.models_cache),))]


def _mirror_reads(rig: Rig, rig_name: str) -> list[Read]:
    if rig.models_mirror_port is None or rig.models_mirror_bind is not None:
        return []
    return [Read("ssh_address", SshAddress, "the rig's address of the SSH connection")]


def mirror_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """A mirror without models_mirror_bind needs the rig's address of the SSH connection."""
    if not _mirror_reads(rig, rig_name):
        return []
    if facts.missing("ssh_address"):
        return facts.missing("ssh_address")
    if facts.ssh_address is None:
        return [error("models", NO_MIRROR_ADDRESS, key="models_mirror_bind")]
    return []


CHECKS = (Check("models", _model_reads, model_findings),
          Check("models mirror", _mirror_reads, mirror_findings))
