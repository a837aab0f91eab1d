"""One tool's recorded converges of one sandbox rig, and the swap that makes it another rig.

A recording (JSON, FORMAT) holds the recorded rig's identity (name, address, GPU UUIDs and
serials), its host data, and per run (`first`, `no_change`, `cap_change`, `status`) every remote
command in order with its answer, and every file put or get. Replayed rig I gets its own
identity (`identity(I)`); `Swap` replaces the recorded identity by it in answers and back in
commands, and does the same to the sha1, sha256 and md5 of every uploaded file whose text holds
an identifier (a power unit names its GPUs), so a hash read back matches the file rendered for
that rig.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

FORMAT = 1
RUNS = ("first", "no_change", "cap_change", "status")
#: Joins a command's text and its stdin in the key it is recorded under.
STDIN = "\0stdin\0"


@dataclass(frozen=True)
class Identity:
    """What tells one rig from another in commands and answers."""

    name: str
    address: str
    uuids: tuple[str, ...]
    serials: tuple[str, ...] = ()

    def values(self) -> tuple[str, ...]:
        return (self.name, self.address, *self.uuids, *self.serials)


def identity(index: int, like: Identity) -> Identity:
    """Replayed rig `index` (0-based): a rig with as many GPUs (and serials) as `like`."""
    def uuid(slot: int) -> str:
        digest = hashlib.sha256(f"replay-{index}/{slot}".encode()).hexdigest()
        return "GPU-" + "-".join(digest[a:b] for a, b in
                                 ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
    return Identity(
        name=f"replay-{index + 1:04d}",
        address=f"10.{200 + index // 65536}.{index // 256 % 256}.{index % 256}",
        uuids=tuple(uuid(slot) for slot in range(len(like.uuids))),
        serials=tuple(f"RPL{index:06d}{slot}" for slot in range(len(like.serials))),
    )


def _hashes(text: str) -> tuple[str, ...]:
    data = text.encode()
    return tuple(getattr(hashlib, algo)(data).hexdigest() for algo in ("sha1", "sha256", "md5"))


class Swap:
    """Recorded identity <-> one replayed rig's, in both directions, hashes included."""

    def __init__(self, recorded: Identity, rig: Identity, contents: list[str]):
        pairs = dict(zip(recorded.values(), rig.values(), strict=True))
        if len(set(pairs)) != len(pairs) or len(set(pairs.values())) != len(pairs):
            raise ValueError(f"identity values repeat: {recorded} / {rig}")
        self._forward = _Replacer(pairs)
        for text in contents:
            pairs.update(zip(_hashes(text), _hashes(self._forward(text)), strict=True))
        self.forward = _Replacer(pairs)
        self.reverse = _Replacer({new: old for old, new in pairs.items()})


class _Replacer:
    """Every key of `pairs` in a text replaced by its value, in one pass (longest first)."""

    def __init__(self, pairs: dict[str, str]):
        self._pairs = {old: new for old, new in pairs.items() if old != new}
        keys = sorted(self._pairs, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, keys))) if keys else None

    def __call__(self, text: str) -> str:
        if self._pattern is None or not text:
            return text
        return self._pattern.sub(lambda m: self._pairs[m.group(0)], text)


#: The one part of a command that differs between runs of the same converge: the run lock's
#: taker (rigbook/core/runlock.py), which names the operator, a pid and the time the run began.
#: Its answer does not depend on them; a recording and the key put fixed values in their place.
_VOLATILE = re.compile(r'"operator": "[^"]*", "pid": [0-9]+, "started": "[0-9T:Z-]+"')
_FIXED = '"operator": "OPERATOR", "pid": 0, "started": "STARTED"'


def scrub(text: str) -> str:
    """`text` with the run lock's taker fixed (the operator's login and host, pid, time)."""
    return _VOLATILE.sub(_FIXED, text)


def command_key(command: str, stdin) -> str:
    """What identifies a command: its text as the rig's shell gets it (scrubbed), and its
    stdin."""
    command = scrub(command)
    if stdin is None:
        return command
    if isinstance(stdin, (list, tuple)):
        stdin = "\n".join(stdin)
    if isinstance(stdin, bytes):
        stdin = stdin.decode()
    return f"{command}{STDIN}{stdin}"


class Unrecorded(OSError):
    """A rig asked for something the recording does not have. An OSError, so that pyinfra
    fails the rig's fact or operation with it (pyinfra catches OSError from a connector)."""


@dataclass
class Run:
    """One recorded run's answers: per command (or file path), the answers in recorded order."""

    commands: dict[str, list[dict]]
    puts: dict[str, list[dict]]
    gets: dict[str, list[dict]]
    changes: list[str]
    exit: int


class Recording:
    """A recording file, loaded once per process (`load`)."""

    def __init__(self, data: dict):
        if data.get("format") != FORMAT:
            raise ValueError(f"recording format {data.get('format')}, this bench reads {FORMAT}")
        self.data = data
        rig = data["rig"]
        self.identity = Identity(rig["name"], rig["address"], tuple(rig["uuids"]),
                                 tuple(rig["serials"]))
        self.host_data: dict = rig["data"]
        self.contents: list[str] = data["contents"]
        self.runs = {name: _run(run) for name, run in data["runs"].items()}

    def swap(self, index: int) -> Swap:
        return Swap(self.identity, identity(index, self.identity), self.contents)


def _run(run: dict) -> Run:
    tables: dict[str, dict[str, list[dict]]] = {kind: defaultdict(list)
                                                for kind in ("command", "put", "get")}
    for event in run["events"]:
        key = command_key(event["command"], event.get("stdin")) if event["kind"] == "command" \
            else event["path"]
        tables[event["kind"]][key].append(event)
    return Run(dict(tables["command"]), dict(tables["put"]), dict(tables["get"]),
               run["changes"], run["exit"])


@cache
def load(path: str) -> Recording:
    return Recording(json.loads(Path(path).read_text()))
