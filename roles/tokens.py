"""Tokens and other secrets on a rig: where each comes from, where it goes, how it is placed.

The HF token (the operator's HF_TOKEN or models_token_file) and the fleet's mirror token
(models_mirror_token_file) are read on the operator's machine (rigbook/core/secrets.py reads the
files), and each reaches a rig only where the rig uses it (`rig_tokens`). `hf_token` places one
as a root-only 0600 file, compared by sha256 (`SecretFile`), never by content; `secret_upload`
writes any secret (a token, the serving API key) without it ever being readable by anyone else
or appearing in a command, an argument, a diff or a log line. docs/models.md, "Tokens".
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import NamedTuple

from pyinfra import host
from pyinfra.api import FactBase, QuoteString, StringCommand, operation
from pyinfra.api.command import FileUploadCommand
from pyinfra.api.exceptions import FactProcessError

from rigbook.core.errors import RigbookError
from rigbook.core.secrets import Secret, read_secret_file
from rigbook.core.spec import Rig
from rigbook.core.types import JsonValue

#: The HF token on the rig: root-only, read by huggingface_hub through HF_TOKEN_PATH.
SECRETS_DIR = "/etc/rigbook/secrets"
TOKEN_PATH = f"{SECRETS_DIR}/hf-token"
#: The fleet's mirror token on the rig: sent by pulls from models_endpoint (HF_TOKEN_PATH), handed
#: to the mirror's unit as a credential (LoadCredential=).
MIRROR_TOKEN_PATH = f"{SECRETS_DIR}/hf-mirror-token"


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
class SecretFileState(JsonValue):
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
    unlike ``files.put``, which prints a file-like source's lines with ``--diff``. Apart from
    rigbook.core.managed's writes for that reason, and because a token's file is checked by its
    owner too, which managed's one read of file states does not see: its writes leave the run's
    remembered file states to be read again.
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
