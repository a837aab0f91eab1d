"""`rigbook models resolve REPO[@REF]`: what to pin, read from the hub's API (operator side).

A rig's `models` entry pins a 40-hex commit; finding it by hand on the hub's History page is
guesswork. This asks the hub's model-info route (`GET /api/models/{repo}/revision/{ref}?blobs=true`,
the route of huggingface_hub's model_info) for the commit REF points at now, every file with
its size, and whether the repo is gated, and prints the entry to paste. The token (HF_TOKEN or
--token-file) is sent only when the hub refuses the request without one (a private or gated
repo's metadata), so a public repo is never asked with it.

The endpoint is --endpoint, else HF_ENDPOINT, else huggingface_hub's own default where that
package is installed on this machine.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import requests

from rigbook.core.errors import RigbookError
from rigbook.core.messages import human

_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
#: A branch, a tag or a commit: no "..", no leading "/" or "-".
_REF = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
TIMEOUT_S = 30


@dataclass(frozen=True)
class Resolved:
    """What a pin of REPO at REF would be: its commit, its files and sizes, gated or not."""

    repo: str
    ref: str
    commit: str
    files: tuple[tuple[str, int | None], ...]  # (path, size in bytes; None: the hub gave none)
    gated: str | None  # None: not gated; "auto" or "manual": the hub's approval mode
    token_used: bool

    def pulled(self, allow: tuple[str, ...]) -> tuple[tuple[str, int | None], ...]:
        """The files a pin with these allow_patterns pulls (none: all of them)."""
        if not allow:
            return self.files
        return tuple(f for f in self.files if any(fnmatch.fnmatch(f[0], p) for p in allow))


def parse_target(target: str) -> tuple[str, str]:
    """REPO[@REF] -> (repo, ref); ref defaults to main."""
    repo, _, ref = target.partition("@")
    ref = ref or "main"
    if not _REPO.fullmatch(repo):
        raise RigbookError(f"models resolve: {repo!r} is not a repo id; allowed: ORG/NAME")
    if not _REF.fullmatch(ref) or ".." in ref:
        raise RigbookError(f"models resolve: {ref!r} is not a branch, tag or commit")
    return repo, ref


def endpoint_of(given: str | None, environ=os.environ) -> str:
    endpoint = given or environ.get("HF_ENDPOINT")
    if not endpoint:
        try:
            from huggingface_hub import constants
        except ImportError:
            raise RigbookError("models resolve: no hub address: pass --endpoint URL or set "
                               "HF_ENDPOINT") from None
        endpoint = constants.ENDPOINT
    if not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", endpoint):
        raise RigbookError(f"models resolve: endpoint {endpoint!r} is not an http(s) URL")
    return endpoint.rstrip("/")


def operator_token(token_file: Path | None, environ=os.environ) -> str | None:
    if token_file is not None:
        try:
            return token_file.read_text().strip() or None
        except OSError as error:
            raise RigbookError(f"models resolve: --token-file: {error.strerror}") from None
    return environ.get("HF_TOKEN", "").strip() or None


def resolve(repo: str, ref: str, endpoint: str, token: str | None) -> Resolved:
    """Ask the hub; the token only after a refusal without it."""
    url = f"{endpoint}/api/models/{repo}/revision/{quote(ref, safe='')}"

    def ask(headers: dict) -> requests.Response:
        try:
            return requests.get(url, params={"blobs": "true"}, headers=headers,
                                timeout=TIMEOUT_S)
        except requests.RequestException as error:
            raise RigbookError(f"models resolve: {endpoint} did not answer: {error}") from None

    answer, used = ask({}), False
    if answer.status_code in (401, 403) and token:
        answer, used = ask({"Authorization": f"Bearer {token}"}), True
    if answer.status_code in (401, 403):
        why = ("the hub refused the token" if used else
               "the hub wants a token (a private or gated repo): set HF_TOKEN or --token-file")
        raise RigbookError(f"models resolve: {repo}: {why}")
    if answer.status_code == 404:
        raise RigbookError(f"models resolve: {repo}@{ref}: no such repo or revision "
                           f"({answer.headers.get('X-Error-Message', 'not found')})")
    if answer.status_code != 200:
        raise RigbookError(f"models resolve: {repo}@{ref}: the hub answered {answer.status_code}")
    try:
        info = answer.json()
        commit = info["sha"]
        files = tuple((s["rfilename"], s.get("size")) for s in info.get("siblings") or ())
    except (ValueError, KeyError, TypeError):
        raise RigbookError(f"models resolve: {repo}@{ref}: the hub's answer is not model "
                           "info") from None
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        raise RigbookError(f"models resolve: {repo}@{ref}: the hub gave no 40-hex commit")
    gated = info.get("gated") or None
    return Resolved(repo, ref, commit, files, gated if isinstance(gated, str) else None, used)


def _size(size: int | None) -> str:
    if size is None:
        return "?"
    return human(size)


def report(found: Resolved, allow: tuple[str, ...]) -> str:
    """What `rigbook models resolve` prints."""
    pulled = found.pulled(allow)
    total = sum(size or 0 for _, size in pulled)
    gated = ("no" if found.gated is None else
             f"yes ({found.gated}): accept its terms on the hub with your account, and give the "
             "rigs your token (HF_TOKEN on this machine, or models_token_file)")
    lines = [
        f"{found.repo}@{found.ref} is commit {found.commit}",
        f"gated: {gated}",
        f"files the pin pulls: {len(pulled)} of {len(found.files)}, {_size(total)}"
        + (f" (allow_patterns {list(allow)})" if allow else ""),
        *(f"  {_size(size):>12}  {path}" for path, size in pulled),
    ]
    entry = f'{{"repo": "{found.repo}", "revision": "{found.commit}"'
    if allow:
        entry += ', "allow_patterns": [' + ", ".join(f'"{p}"' for p in allow) + "]"
    lines += ["pin it in the rig's models (inventory):", f"  {entry}}}"]
    return "\n".join(lines)
