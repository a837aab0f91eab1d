"""Free disk on the filesystems rigbook fills: the root and /opt/rigbook (venvs, guards).

A full disk is how a venv build or a model pull dies half way, so status warns before it is.
No deploy changes anything here; the models role checks the space a pull needs on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyinfra.api import FactBase, QuoteString, StringCommand
from pyinfra.api.exceptions import FactProcessError

from rigbook.core.checks import Check, Facts, Finding, Read, warn
from rigbook.core.messages import gib
from rigbook.core.spec import Rig
from rigbook.core.types import JsonValue

DISK_PATHS = ("/", "/opt/rigbook")
#: Warn when a filesystem has less than this share free.
DISK_LOW = 0.10


@dataclass(frozen=True)
class Disk(JsonValue):
    """One filesystem: the path asked about, where it is mounted, its size and free bytes."""

    path: str
    mount: str
    size_bytes: int
    avail_bytes: int


class FreeDisk(FactBase[list[Disk]]):
    """
    Size and free space (``df -P -B1``) of the filesystems holding `paths` that exist::

        / /dev/vda 270465425408 18253340672 68719476736 21% /
    """

    default = list

    def command(self, paths: tuple[str, ...]) -> StringCommand:
        return StringCommand(
            "for p in", *(QuoteString(path) for path in paths), "; do",
            '[ -e "$p" ] && df -P -B1 "$p" 2>/dev/null | tail -n 1 | sed "s#^#$p #";',
            "done; true",
        )

    def process(self, output: list[str]) -> list[Disk]:
        disks = []
        for line in output:
            fields = line.split()
            if len(fields) < 7:
                raise FactProcessError(f"not a df -P line: {line!r}")
            disks.append(Disk(fields[0], " ".join(fields[6:]), int(fields[2]), int(fields[4])))
        return disks


def by_mount(disks: list[Disk]) -> dict[str, tuple[Disk, list[str]]]:
    """Each filesystem once, with the asked paths it holds."""
    mounts: dict[str, tuple[Disk, list[str]]] = {}
    for disk in disks:
        mounts.setdefault(disk.mount, (disk, []))[1].append(disk.path)
    return mounts


def disk_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    if facts.missing("disks"):
        return facts.missing("disks")
    return [
        warn("disk", f"{mount}: {gib(disk.avail_bytes)} free of {gib(disk.size_bytes)}")
        for mount, (disk, _) in by_mount(facts.disks or []).items()
        if disk.size_bytes and disk.avail_bytes < DISK_LOW * disk.size_bytes
    ]


CHECKS = (Check(
    "free disk",
    lambda rig, name: [Read("disks", FreeDisk, "free disk", (("paths", DISK_PATHS),))],
    disk_findings,
),)
