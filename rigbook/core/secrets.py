"""Secrets from the operator's machine (an HF token, an API key): read once, never printed.

They reach a rig only as root-only files written by operations whose commands never contain
them; anything that may print holds a `Secret`, whose repr and str are masked.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from rigbook.core.errors import RigbookError

#: What a secret looks like in text: an HF token, an API key, credentials in a URL.
_SECRET = re.compile(r"hf_[A-Za-z0-9]{8,}|sk-[A-Za-z0-9]{8,}|://[^/\s]*@")


def looks_secret(text: str) -> bool:
    """Whether a value could be a secret: then no message shows it."""
    return bool(_SECRET.search(text))


class Secret:
    """A token that must not be printed: its repr and str are masked, its bytes go to a file."""

    def __init__(self, value: str):
        self._value = value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self.sha256)

    @property
    def data(self) -> bytes:
        return self._value.encode() + b"\n"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def reveal(self) -> str:
        return self._value

    def redact(self, text: str) -> str:
        """`text` with the token replaced by ***."""
        return text.replace(self._value, "***") if self._value else text


def read_secret_file(field: str, path: str, noun: str, forbidden: str = "") -> str:
    """The one secret in an operator-side file named by host-data `field`.

    RigbookError, naming the field and the file, when it cannot be read, when other users of
    this machine may read or write it, or when it holds anything but one word (or holds one of
    the `forbidden` characters).
    """
    file = Path(path).expanduser()
    shown = "the file named" if looks_secret(path) else str(file)
    try:
        mode = file.stat().st_mode & 0o777
        text = file.read_text().strip()
    except OSError as error:
        raise RigbookError(
            f"{field}: cannot read {shown} on this machine ({error.strerror}); "
            f"allowed: the path of a readable file holding one {noun} (not the {noun} itself)"
        ) from None
    if mode & 0o077:
        raise RigbookError(
            f"{field}: other users of this machine may read {shown} (mode {mode:04o}); "
            f"allowed: a file only its owner can read (chmod 600)"
        )
    if not text or len(text.split()) != 1 or any(c in text for c in forbidden):
        no = f", none of {' '.join(forbidden)}" if forbidden else ""
        raise RigbookError(
            f"{field}: {shown} must hold one {noun} (one word on one line{no}); "
            f"it holds {len(text.split())} words"
        )
    return text
