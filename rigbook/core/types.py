"""Constrained types for every free-text value of host data and recipes.

rigbook runs as root on other people's rigs, and a host-data value ends up in a root shell, a
systemd unit, an env file, an apt source or a modprobe file. So no field takes "a string": each
takes one of these types, which refuse what could break out of any of those formats, and say in
words what they allow. Every check is a full match (`re.fullmatch`): a trailing newline is as
refused as one in the middle. The renderers escape for their format on top of this
(rigbook/core/render.py): validation is the first line, not the only one.

- `Line`: one line of text, no control characters (a tab, a newline, ESC, DEL...).
- `Word`: one word of safe characters, never starting with "-" (it could be read as an option);
  `Glob` the same with the glob characters * ? [ ].
- `RigPath`: an absolute path on the rig, from a safe character set, without "." or ".." parts.
- `LocalPath`: a path on the operator's machine (relative allowed), from the same set.
- `HttpUrl` / `SourceUrl`: a parsed URL with an allowed scheme, a host (file: a path), no
  whitespace and no credentials (user:password@ would end up in logs and files).
- `IpAddress`: an IPv4 or IPv6 address without a scope id (`fe80::1%eth0`), stored normalised.
- `Requirement`: a Python requirement with a name and one `==` version (`vllm==0.33.0`, or a
  release series `cuda-toolkit==13.0.*`; markers allowed), parsed with `packaging`; never an
  option such as `--index-url`, a URL or a range.
- `StrictBool` / `StrictInt` / `StrictFloat`: `True` is not 1, `"yes"` is not true, `"0.9"`
  is not a number (an integer is a float).
- `StrictModel`: the base of every model of host data, recipes and status: an unknown key is
  an error (a typo is never ignored) and a validated object is frozen.
- `JsonValue`: gives a fact's value (a dataclass) the `to_json()` that
  pyinfra's fact CLI calls when it prints it (`pyinfra INVENTORY fact rigbook.M.F`).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import asdict
from typing import Annotated, Any
from urllib.parse import urlsplit

from packaging.requirements import InvalidRequirement
from packaging.requirements import Requirement as Parsed
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
)

__all__ = [
    "Glob", "HttpUrl", "IpAddress", "JsonValue", "Line", "LocalPath", "RepoId", "Requirement",
    "RigPath", "SourceUrl", "StrictBool", "StrictFloat", "StrictInt", "StrictModel", "Word",
]

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./][A-Za-z0-9_@%+=:,./-]*")
_PATH = re.compile(r"[A-Za-z0-9_@+=:,./-]+")
_GLOB = re.compile(r"[A-Za-z0-9_@+=:,.*?/\[\]][A-Za-z0-9_@+=:,.*?/\[\]-]*")


def line(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("one line of text: no newline, tab or other control character")
    return value


def word(value: str) -> str:
    if not _WORD.fullmatch(value):
        raise ValueError("one word of letters, digits and _ @ % + = : , . / - (not starting "
                         "with -), no spaces or quotes")
    return value


def glob(value: str) -> str:
    if not _GLOB.fullmatch(value):
        raise ValueError("a file glob of letters, digits and _ @ + = : , . / * ? [ ] - (not "
                         "starting with -), e.g. *.safetensors")
    return value


def _path(value: str, absolute: bool) -> str:
    parts = value.split("/")
    if not _PATH.fullmatch(value) or value.startswith("-") or any(p in (".", "..") for p in parts):
        raise ValueError("a path of letters, digits and _ @ + = : , . / - (not starting with -), "
                         "without . or .. parts, spaces or quotes")
    if absolute and (not value.startswith("/") or value.rstrip("/") == ""):
        raise ValueError("an absolute path on the rig, e.g. /var/lib/rigbook/hf/hub")
    return value.rstrip("/") if len(value) > 1 else value


def rig_path(value: str) -> str:
    return _path(value, absolute=True)


def local_path(value: str) -> str:
    return _path(value, absolute=False)


def _url(value: str, schemes: tuple[str, ...]) -> str:
    allowed = " or ".join(f"{scheme}:" for scheme in schemes)
    if _CONTROL.search(value) or re.search(r"\s|[\"'`\\<>{}|^]", value):
        raise ValueError(f"a URL ({allowed}) without spaces, quotes or control characters")
    parts = urlsplit(value)
    if parts.scheme not in schemes:
        raise ValueError(f"a URL whose scheme is {allowed}")
    if parts.scheme == "file":
        _path(parts.path, absolute=True)
    elif not parts.hostname:
        raise ValueError(f"a URL with a host name, e.g. {schemes[0]}://mirror.lan:8080")
    if parts.username or parts.password or "@" in parts.netloc:
        raise ValueError("a URL without user or password in it: credentials do not belong in "
                         "host data (they end up in logs and files on the rig)")
    return value


def http_url(value: str) -> str:
    return _url(value, ("https", "http"))


def source_url(value: str) -> str:
    return _url(value, ("https", "http", "file"))


def ip_address(value: str) -> str:
    if "%" in value:
        raise ValueError("an IP address without a scope id (no %...)")
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError("an IP address, e.g. 127.0.0.1, 0.0.0.0 or the rig's LAN address"
                         ) from None


def requirement(value: str) -> str:
    if value.lstrip().startswith("-") or _CONTROL.search(value):
        raise ValueError("a requirement such as vllm==0.33.0, never an option")
    try:
        parsed = Parsed(value)
    except InvalidRequirement:
        raise ValueError("a requirement such as vllm==0.33.0 (name==version)") from None
    specifiers = list(parsed.specifier)
    if parsed.url or len(specifiers) != 1 or specifiers[0].operator != "==":
        raise ValueError("a requirement pinned with ==: name==version, e.g. vllm==0.33.0 or "
                         "cuda-toolkit==13.0.* (markers after ; allowed)")
    return value


Line = Annotated[str, AfterValidator(line)]
Word = Annotated[str, AfterValidator(word)]
Glob = Annotated[str, AfterValidator(glob)]
RigPath = Annotated[str, AfterValidator(rig_path)]
LocalPath = Annotated[str, AfterValidator(local_path)]
HttpUrl = Annotated[str, AfterValidator(http_url)]
SourceUrl = Annotated[str, AfterValidator(source_url)]
IpAddress = Annotated[str, AfterValidator(ip_address)]
Requirement = Annotated[str, AfterValidator(requirement)]
#: A Hugging Face repo id, owner/name.
RepoId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")]


class StrictModel(BaseModel):
    """Unknown keys refused, frozen once validated: the base of rigbook's pydantic models."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class JsonValue:
    """A dataclass fact value pyinfra's fact CLI can print: its JSON encoder (pyinfra_cli/util.py,
    json_encode) knows sets, paths and dates, and otherwise calls the object's `to_json()`;
    a frozenset, which it does not know, becomes a sorted list."""

    def to_json(self) -> Any:
        return _plain(asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, frozenset):
        return sorted(value)
    return value


#: What each type allows, in words: docs/host-data.md shows these (rigbook/docs.py).
ALLOWS = {
    "Line": "one line of text: no newline, tab or other control character",
    "Word": "one word of letters, digits and _ @ % + = : , . / -, not starting with -",
    "Glob": "a file glob: letters, digits and _ @ + = : , . / * ? [ ] -, not starting with -",
    "RigPath": "an absolute path on the rig: letters, digits and _ @ + = : , . / -, no . or .. "
               "parts, no spaces or quotes",
    "LocalPath": "a path on this machine (relative to the repository root allowed), from the "
                 "same characters",
    "HttpUrl": "an http: or https: URL with a host, without spaces, quotes or credentials",
    "SourceUrl": "an http:, https: or file: URL, without spaces, quotes or credentials",
    "IpAddress": "an IPv4 or IPv6 address without a scope id, stored normalised",
    "Requirement": "a Python requirement pinned with ==: name==version (or ==13.0.*), markers "
                   "allowed; never an option, URL or range",
    "RepoId": "a Hugging Face repo id, owner/name",
    "int": "an integer: true/false are not numbers",
    "float": "a number (an integer or a decimal): true/false and text are not numbers",
    "bool": "true or false: 1, 0, \"yes\" are not booleans",
}
#: The validator behind each type, for rigbook/docs.py to name it.
VALIDATORS = {"line": "Line", "word": "Word", "glob": "Glob", "rig_path": "RigPath",
              "local_path": "LocalPath", "http_url": "HttpUrl", "source_url": "SourceUrl",
              "ip_address": "IpAddress", "requirement": "Requirement"}
#: The same character sets as JSON Schema patterns, for `rigbook schema` (rigbook/schema.py): each
#: accepts what the validator accepts, or more (a path's . and .. parts are the validator's alone).
PATTERNS = {
    "Line": "^[^\\x00-\\x1f\\x7f-\\x9f]*$",
    "Word": f"^(?:{_WORD.pattern})$",
    "Glob": f"^(?:{_GLOB.pattern})$",
    "RigPath": f"^/{_PATH.pattern}$",
    "LocalPath": f"^(?!-){_PATH.pattern}$",
}
