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
  complete. A partial snapshot fails the rig with the files that are missing or wrong. While it
  runs, its bytes and rates show in pyinfra's output every few seconds (rigbook.core.progress).
- Tokens reach the rig as root-only 0600 files, never in a command, an argument, a diff or a
  log line (roles/tokens.py), and only where they are used: the HF token (the operator's
  HF_TOKEN or models_token_file) where the rig pulls from the hub, the fleet's mirror token
  (models_mirror_token_file) where it pulls from a mirror or runs one. pull.py reads the
  one for the pull's destination through HF_TOKEN_PATH, so each goes only there.
- Cached repos that models does not list are reported with their sizes, and removed with
  models_prune: true.
- Fleet pulls: a rig with models_mirror_port runs rigbook's mirror (files/models/mirror.py) over
  its complete snapshots, on models_mirror_bind (default: the rig's address that SSH reached),
  for requests with the fleet's token; a rig with models_endpoint pulls from it, accepts the
  mirror's manifest only when it hashes to the model's manifest_sha256 (pinned by the operator
  from the source rig: a complete snapshot's message shows it), and checks every file against
  the hashes in that manifest. The mirror vouches for nothing.

docs/models.md has the cache layout, offline serving, tokens, fleet pulls and pruning.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pyinfra import host, logger, state
from pyinfra.api import FactBase, FunctionCommand, QuoteString, StringCommand, deploy, operation
from pyinfra.api.exceptions import FactProcessError
from pyinfra.facts.files import File
from pyinfra.operations import systemd

from rigbook import FILES
from rigbook.core.checks import Check, Facts, Finding, Read, drift, error, warn
from rigbook.core.errors import RigbookError
from rigbook.core.managed import absent, directory, put
from rigbook.core.messages import GIB, human, notice, refused, warn_once
from rigbook.core.messages import connector_arguments as _connector_arguments  # model_snapshot's
from rigbook.core.progress import EVERY_DEFAULT, progress_every, run_watched
from rigbook.core.render import template
from rigbook.core.runfacts import once
from rigbook.core.secrets import Secret
from rigbook.core.spec import ModelSpec, Rig
from rigbook.core.tools import TOOLS_PYTHON, tools_venv
from rigbook.core.types import JsonValue, ip_address
from rigbook.core.units import SYSTEMD_READ, booted, service
from rigbook.rigside import hfcache
from rigbook.rigside.hfcache import repo_folder, repo_of, snapshot_dir
from rigbook.roles.recipes import (
    PLACEHOLDER_REVISION,
    placeholder_text,
    recipe_for,
    recipe_pins,
    rig_models,
)
from rigbook.roles.tokens import MIRROR_TOKEN_PATH, TOKEN_PATH, SecretFile, hf_token, rig_tokens

#: Where pull.py lives on the rig (run by the tools venv's python).
MODELS_DIR = "/opt/rigbook/models"
PULL_SCRIPT = f"{MODELS_DIR}/pull.py"
PULL_SOURCE = FILES / "models" / "pull.py"
#: ModelCache's program, sent with `python3 -c` (standard library only, read-only); pull.py
#: imports its `untrusted` from the copy beside it.
CACHE_SOURCE = FILES / "models" / "cache.py"
CACHE_COPY = f"{MODELS_DIR}/cache.py"
#: rigbook's hub mirror (files/models/mirror.py) and its unit, where models_mirror_port is set.
MIRROR_SCRIPT = f"{MODELS_DIR}/mirror.py"
MIRROR_SOURCE = FILES / "models" / "mirror.py"
MIRROR_UNIT = "rigbook-hf-mirror.service"
MIRROR_UNIT_PATH = f"/etc/systemd/system/{MIRROR_UNIT}"
MIRROR_TEMPLATE = FILES / "models" / f"{MIRROR_UNIT}.j2"
#: The copy of it that systemd hands the running mirror (root can read it).
MIRROR_CREDENTIAL_PATH = f"/run/credentials/{MIRROR_UNIT}/mirror-token"
#: The cache's layout (rigbook/rigside/hfcache.py), copied beside pull.py and mirror.py.
HFCACHE_SOURCE = Path(hfcache.__file__)
HFCACHE_COPY = f"{MODELS_DIR}/hfcache.py"


def snapshot_path(rig: Rig, spec: ModelSpec) -> str:
    """The snapshot folder an engine can load directly (or pass repo + --revision offline)."""
    return snapshot_dir(rig.models_cache, spec.repo, spec.revision)


def label(spec: ModelSpec) -> str:
    return f"{spec.repo}@{spec.revision[:12]}"


# --- the cache fact ---------------------------------------------------------------------------



@dataclass(frozen=True)
class Manifest(JsonValue):
    """What rigbook recorded when it completed a pull: expected files and the patterns."""

    files: Mapping[str, tuple[int, str | None]]  # path -> (size, sha256 of LFS files)
    allow_patterns: tuple[str, ...]
    ignore_patterns: tuple[str, ...]
    sha256: str | None = None  # of the manifest file's bytes: what manifest_sha256 pins

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self.files.values())


@dataclass(frozen=True)
class CachedRepo(JsonValue):
    """One models--ORG--NAME folder of the cache."""

    folder: str
    bytes: int  # everything in blobs/, .incomplete leftovers included
    refs: Mapping[str, str] = field(default_factory=dict)
    snapshots: Mapping[str, Mapping[str, int | None]] = field(default_factory=dict)
    manifests: Mapping[str, Manifest | None] = field(default_factory=dict)  # None: unreadable
    incomplete: tuple[tuple[str, int], ...] = ()

    @property
    def repo(self) -> str:
        return repo_of(self.folder)


@dataclass(frozen=True)
class CacheState(JsonValue):
    """The whole cache as ModelCache read it."""

    cache: str
    exists: bool
    repos: Mapping[str, CachedRepo]  # by repo id
    untrusted: str | None = None  # why another user (the engine's) could change it


class ModelCache(FactBase[CacheState]):
    """
    What a Hugging Face cache holds, read from its layout on the rig (no network).

    Runs files/models/cache.py with the rig's python3 (sent as ``python3 -c``, one round trip);
    it prints one JSON object, e.g. for a cache with one complete snapshot::

        {"cache": "/var/lib/rigbook/hf/hub", "exists": true, "repos": [{
          "folder": "models--rigbook-test--tiny", "bytes": 262318, "refs": {},
          "snapshots": {"3f2635f2...": {"config.json": 98, "model.safetensors": 262144}},
          "manifests": {"3f2635f2...": {"files": {"config.json": {"size": 98, "sha256": null},
              "model.safetensors": {"size": 262144, "sha256": "c87f7657..."}},
              "allow_patterns": [], "ignore_patterns": [], "sha256": "5b0e41d7..."}},
          "incomplete": []}]}
    """

    def command(self, cache: str) -> StringCommand:
        source = (  # hfcache.py as the module cache.py imports, then cache.py
            "import sys, types\nhfcache = types.ModuleType('hfcache')\n"
            f"exec({HFCACHE_SOURCE.read_text()!r}, hfcache.__dict__)\n"
            "sys.modules['hfcache'] = hfcache\n" + CACHE_SOURCE.read_text())
        return StringCommand("python3", "-c", QuoteString(source), QuoteString(cache))

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
    sha256 = data.get("sha256")
    return Manifest(
        entries,
        tuple(data.get("allow_patterns") or ()),
        tuple(data.get("ignore_patterns") or ()),
        sha256 if isinstance(sha256, str) else None,
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
    untrusted = data.get("untrusted", "the cache probe did not say who can write the cache")
    return CacheState(data["cache"], bool(data["exists"]), repos,
                      None if untrusted is None else str(untrusted))


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
    manifest_sha256: str | None = None  # of a complete snapshot's manifest (what rigs pin)


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
    return SnapshotStatus(True, "", manifest_sha256=manifest.sha256, **counts)


def unhashed(cache: CacheState, spec: ModelSpec) -> int:
    """How many files a complete snapshot's manifest lists without a sha256: an older rigbook
    recorded none for non-LFS files, and the mirror serves only snapshots with every hash."""
    manifest = cache.repos[spec.repo].manifests[spec.revision]
    return sum(1 for _, sha in manifest.files.values() if not sha)


# --- the pull ---------------------------------------------------------------------------------


def pull_log(spec: ModelSpec) -> str:
    """pull.py's stderr on the rig (progress lines, warnings), kept from the repo's last pull."""
    return f"{MODELS_DIR}/.{repo_folder(spec.repo)}.pull.log"


def pull_command(spec: ModelSpec, rig: Rig, every: float = EVERY_DEFAULT) -> StringCommand:
    """The command that runs pull.py for one model: no secret in it, only the token's path.

    HF_TOKEN_PATH names the token of the pull's destination, so neither token goes anywhere
    else: the HF token for the hub, the fleet's mirror token for models_endpoint. Its stderr,
    a progress line every `every` seconds among it, goes to ``pull_log``, read while it runs.
    From a mirror the model's manifest_sha256 goes along: the one manifest the pull accepts.
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
        f"--progress-every={every:g}",
    ]
    if rig.models_endpoint:
        # A mirror serves files over plain HTTP; Xet storage lives with the hub itself.
        env.append("HF_HUB_DISABLE_XET=1")
        args += [f"--endpoint={rig.models_endpoint}",
                 f"--manifest-sha256={spec.manifest_sha256}"]  # the spec check requires it
    args += [f"--allow={pattern}" for pattern in spec.allow_patterns]
    args += [f"--ignore={pattern}" for pattern in spec.ignore_patterns]
    return StringCommand(
        "env", "-u", "HF_TOKEN", "-u", "HUGGING_FACE_HUB_TOKEN",
        *env, TOOLS_PYTHON, PULL_SCRIPT, *(QuoteString(arg) for arg in args),
        "2>", QuoteString(pull_log(spec)),
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


def progress_record(line: str) -> dict | None:
    """A progress line of pull.py (a JSON object with "progress"), else None."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "progress" in record else None


def per_second(rate: float) -> str:
    return f"{human(rate)}/s"


def progress_text(record: dict) -> str:
    """One progress record of pull.py in words (see its docstring for the records)."""
    kind = record["progress"]
    if kind == "download":
        return f"downloading {record['files']} file(s), {human(record['bytes'])}"
    if kind == "verify":
        return f"checking sizes and hashes of {record['files']} file(s)"
    done, total = record["bytes"], record["total"]
    text = (f"{human(done)} of {human(total)} ({100 * done / total if total else 100:.0f}%) at "
            f"{per_second(record['rate'])}, {record['files_done']} of {record['files']} "
            "file(s) done")
    active = [f"{item['path']} {human(item['bytes'])} of {human(item['size'])} at "
              f"{per_second(item['rate'])}" for item in record["active"]]
    return "; ".join([text, *active])


def progress_shown(lines: list[str]) -> list[str]:
    """What one read of the pull log shows: its download and check lines, and of the byte
    counts only the newest (one comes every interval; a late read must not replay a backlog)."""
    records = [record for record in map(progress_record, lines) if record is not None]
    counts = [record for record in records if record["progress"] == "bytes"]
    return [progress_text(record) for record in records
            if record["progress"] != "bytes" or record is counts[-1]]


def pull_message(spec: ModelSpec, result: dict | None, stderr: str = "") -> str:
    """One line that says what a pull did, for the operator (pyinfra prefixes the rig)."""
    where = label(spec)
    if result is None:
        tail = " | ".join(stderr.strip().splitlines()[-5:]) or "no output"
        return f"{where}: the pull script failed without a result: {tail}"
    status = result["status"]
    if status == "complete":
        pulled, size = result.get("downloaded", []), result.get("downloaded_bytes", 0)
        seconds = result.get("download_seconds", result.get("seconds", 0))
        what = (
            f"pulled {len(pulled)} file(s), {human(size)} in {seconds:.1f} s"
            + (f" ({per_second(size / seconds)})" if seconds else "")
            if pulled else "nothing to download"
        )
        removed = result.get("removed_incomplete", [])
        if removed:
            what += (
                f", removed {len(removed)} .incomplete leftover(s) "
                f"({human(sum(item['size'] for item in removed))})"
            )
        pin = result.get("manifest_sha256")
        return (
            f"{where}: {what}; complete: {result.get('files', 0)} file(s), "
            f"{human(result.get('total_bytes', 0))}" + (f"; manifest sha256 {pin}" if pin else "")
        )
    if status == "refused":
        return f"{where}: pull refused: {result.get('message', '?')}"
    if status == "partial" and result.get("disk_full"):
        return f"{where}: PARTIAL snapshot, not complete: {result['disk_full']['message']}"
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


def _pull(state, host, spec: ModelSpec, why: str, command: StringCommand, every: float,
          arguments: dict, secret: Secret | None) -> bool:
    """FunctionCommand body: run pull.py, show its progress while it runs (redacted, with the
    rig's prefix), end with one line that sums it up, fail the rig unless complete."""
    logger.info(f"{host.print_prefix}pulling {label(spec)} ({why}) ...")

    def show(lines: list[str]) -> None:
        for text in progress_shown(lines):
            logger.info(f"{host.print_prefix}{redact(f'{label(spec)}: {text}', secret)}")

    _ok, output, log = run_watched(
        host, command, pull_log(spec), show, every, print_output=state.print_output,
        print_input=state.print_input, **arguments,
    )
    result = parse_pull_output(output.stdout)
    stderr = "\n".join([*output.stderr_lines,
                        *(line for line in log if progress_record(line) is None)])
    message = redact(pull_message(spec, result, stderr), secret)
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
    cache = once(ModelCache, cache=rig.models_cache)
    status = snapshot_status(cache, spec)
    reason = status.reason
    if status.complete and rig.models_mirror_port is not None and unhashed(cache, spec):
        reason = (f"{unhashed(cache, spec)} file(s) have no sha256 in its manifest (an older "
                  "rigbook's pull), which the mirror needs")
    elif status.complete:
        host.noop(
            f"{label(spec)} is complete in {rig.models_cache} "
            f"({status.files} file(s), {human(status.bytes)}); manifest sha256 "
            f"{status.manifest_sha256}"
        )
        return
    if not state.is_executing:
        warn_once(f"{label(spec)}: {reason}: will pull")
    every = progress_every()
    yield FunctionCommand(
        _pull, (spec, reason, pull_command(spec, rig, every), every, _connector_arguments(),
                token), {}
    )


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
    extra = unreferenced(once(ModelCache, cache=cache), keep)
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
    """The models this run pulls: all of them, or only models_only (a GGUF recipe's repo
    narrowed to its file: rigbook.roles.recipes.rig_models)."""
    if rig.models_only is None:
        return rig_models(rig)
    return tuple(spec for spec in rig_models(rig) if spec.repo == rig.models_only)


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


def install_layout():
    """The cache's layout beside pull.py and mirror.py, which import it (in MODELS_DIR)."""
    return put(name=f"Install {HFCACHE_COPY} (the cache's layout)", src=str(HFCACHE_SOURCE),
               dest=HFCACHE_COPY, mode="644")


def hub_mirror(rig: Rig, token: Secret | None) -> None:
    """Run rigbook's mirror on models_mirror_port, or make sure it is gone (deploy-level).

    It listens on models_mirror_bind, else on the rig's address that the SSH connection reached
    (``SshAddress``), and takes the fleet's `token` (placed at MIRROR_TOKEN_PATH before; None
    only where models_mirror_port is unset) as a systemd credential: a mirror that runs with
    another one (its credential's sha256 differs) is restarted. Whether the unit file exists is
    read while planning: nothing earlier in a run creates it.
    """
    if not booted():  # its preflight refused a mirror port: nothing to run, or to remove
        return
    if rig.models_mirror_port is None:
        if once(File, path=MIRROR_UNIT_PATH):
            service(name=f"Stop {MIRROR_UNIT} (models_mirror_port is unset)",
                    service=MIRROR_UNIT, running=False, enabled=False)
            absent(name=f"Remove {MIRROR_UNIT_PATH}", path=MIRROR_UNIT_PATH)
            systemd.daemon_reload(name="Reload systemd")
        return
    bind = rig.models_mirror_bind or once(SshAddress)
    if bind is None:
        refused(name=f"Find the address of {MIRROR_UNIT}", message=f"{host.name}: "
                f"models_mirror_bind: {NO_MIRROR_ADDRESS}")
        return
    directory(name=f"Create {MODELS_DIR}", path=MODELS_DIR, mode="755")
    script = put(name=f"Install {MIRROR_SCRIPT}", src=str(MIRROR_SOURCE),
                 dest=MIRROR_SCRIPT, mode="644")
    layout = install_layout()
    unit = template(
        name=f"Write {MIRROR_UNIT_PATH}", src=str(MIRROR_TEMPLATE), dest=MIRROR_UNIT_PATH,
        mode="644", cache=rig.models_cache, bind=bind, port=rig.models_mirror_port,
        script=MIRROR_SCRIPT, token_path=MIRROR_TOKEN_PATH,
    )
    held = once(SecretFile, path=MIRROR_CREDENTIAL_PATH)  # None: not running
    service(
        name=f"Run {MIRROR_UNIT} on {bind} port {rig.models_mirror_port}", service=MIRROR_UNIT,
        running=True, enabled=True, daemon_reload=unit.will_change,
        restarted=unit.will_change or script.will_change or layout.will_change or (
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
            absent(name=f"No {what} on the rig ({path}): {why_not}", path=path)
        else:
            hf_token(name=f"Place the {what} in {path} (root only)", token=token, path=path)
    if specs:
        tools_venv(rig)
        directory(name=f"Create {MODELS_DIR}", path=MODELS_DIR, mode="755")
        put(name=f"Install {PULL_SCRIPT}", src=str(PULL_SOURCE), dest=PULL_SCRIPT,
            mode="644")
        put(name=f"Install {CACHE_COPY} (pull.py's cache check)", src=str(CACHE_SOURCE),
            dest=CACHE_COPY, mode="644")
        install_layout()
        directory(name=f"Create the HF cache {rig.models_cache}", path=rig.models_cache,
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
    wanted = [(spec, "models") for spec in rig_models(rig)]
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
    placeholders = [error("models", placeholder_text(spec.repo).removeprefix("models: "),
                          key="models") for spec in rig.models
                    if spec.revision == PLACEHOLDER_REVISION]
    if placeholders:
        return placeholders
    cache, found = facts.cache, []
    if cache.untrusted:  # pull.py would refuse it too; an engine must not load from it
        found.append(error("models", f"models_cache {rig.models_cache}: {cache.untrusted}, so "
                           "another user (the engine's) could change what root writes there or "
                           "what the engines load; allowed: a folder only root can write, e.g. "
                           "the default /var/lib/rigbook/hf/hub", key="models_cache"))
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
    """The cache, also on a rig with no models: the role reports (or prunes) what it holds."""
    return [Read("cache", ModelCache, "HF cache (models_cache)", (("cache", rig.models_cache),))]


def _mirror_reads(rig: Rig, rig_name: str) -> list[Read]:
    """The SSH address a mirror binds to by default; without a mirror, whether a unit of an
    earlier one is left to remove (the role plans on it: read with the preflight's batch)."""
    if rig.models_mirror_port is None:
        return [Read("mirror_unit", File, MIRROR_UNIT_PATH, (("path", MIRROR_UNIT_PATH),))]
    if rig.models_mirror_bind is not None:
        return [SYSTEMD_READ]
    return [SYSTEMD_READ,
            Read("ssh_address", SshAddress, "the rig's address of the SSH connection")]


def mirror_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """A mirror runs as a systemd unit; without models_mirror_bind it needs the rig's address
    of the SSH connection."""
    if rig.models_mirror_port is None:
        return []
    if facts.systemd is False:
        return [error("models", f"{MIRROR_UNIT} needs systemd, which this rig does not run; "
                                "allowed: leave it unset here (docs/no-systemd.md)",
                      key="models_mirror_port")]
    if rig.models_mirror_bind is not None:
        return []
    if facts.missing("ssh_address"):
        return facts.missing("ssh_address")
    if facts.ssh_address is None:
        return [error("models", NO_MIRROR_ADDRESS, key="models_mirror_bind")]
    return []


CHECKS = (Check("models", _model_reads, model_findings),
          Check("models mirror", _mirror_reads, mirror_findings))
