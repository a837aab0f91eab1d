"""What pyinfra's apt support lacks: the held-package set, an idempotent apt-mark hold, and the
repair of package work that a dead apt or dpkg left half-done.

pyinfra has no apt-mark operation, and a `server.shell("apt-mark hold ...")` step counts as a
change on every run. `apt_hold` reads the held set first (`AptHolds`) and marks only the
packages whose mark differs. `DpkgInstalled` is dpkg's own view of what is installed, with the
exact versions, which roles compare by upstream version (`upstream_version`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from pyinfra import host
from pyinfra.api import FactBase, QuoteString, StringCommand, operation
from pyinfra.api.exceptions import FactProcessError

from rigbook.core.runfacts import once


class AptHolds(FactBase[set[str]]):
    """
    The packages held by apt/dpkg, from ``apt-mark showhold``: one name per line, a foreign
    architecture's package with its ``:arch`` suffix. Real output (an Ubuntu 24.04 host)::

        libcublas-13-0
        libcublas-dev-13-0
        libcudnn9-cuda-13
        libnccl-dev
        libnccl2

    .. code:: python

        {"libcublas-13-0", "libcublas-dev-13-0", "libcudnn9-cuda-13", "libnccl-dev", "libnccl2"}
    """

    def requires_command(self) -> str:
        return "apt-mark"

    def command(self) -> str:
        return "apt-mark showhold"

    @staticmethod
    def default() -> set[str]:
        return set()

    def process(self, output: list[str]) -> set[str]:
        return {line.strip() for line in output if line.strip()}


_INSTALLED = "i"  # second letter of db:Status-Abbrev: the package is fully installed


class DpkgInstalled(FactBase[dict[str, str]]):
    """
    Fully installed packages and their exact versions, from dpkg itself::

        dpkg --print-architecture
        dpkg-query -W -f='${db:Status-Abbrev}\\t${Package}\\t${Architecture}\\t${Version}\\n'

    Real output (Debian 12)::

        amd64
        ii \tapt\tamd64\t2.6.1
        hi \tlibnccl2\tamd64\t2.28.3-1+cuda13.0
        rc \tnvidia-kernel-open-dkms\tamd64\t580.95.05-1

    .. code:: python

        {"apt": "2.6.1", "libnccl2": "2.28.3-1+cuda13.0"}

    Only status ``i`` counts (``ii``, and ``hi`` = held); removed-but-configured (``rc``) and
    half-installed packages do not. A package of a foreign architecture is keyed
    ``name:arch``, as ``apt-mark showhold`` names it.
    """

    def requires_command(self) -> str:
        return "dpkg-query"

    def command(self) -> str:
        return (
            "dpkg --print-architecture && "
            "dpkg-query -W -f='${db:Status-Abbrev}\\t${Package}\\t${Architecture}\\t${Version}\\n'"
        )

    @staticmethod
    def default() -> dict[str, str]:
        return {}

    def process(self, output: list[str]) -> dict[str, str]:
        native, rows = output[0].strip(), output[1:]
        installed = {}
        for line in rows:
            fields = line.split("\t")
            if len(fields) != 4:
                raise FactProcessError(f"not a dpkg-query status line: {line!r}")
            status, name, arch, version = fields
            if len(status) < 2 or status[1] != _INSTALLED:
                continue
            key = name if arch in (native, "all", "") else f"{name}:{arch}"
            installed[key] = version
        return installed


class AptVersions(FactBase[dict[str, list[str]]]):
    """
    The versions apt can install, per package, from ``apt-cache madison PACKAGE...``
    (configured sources only, newest first; a package apt does not know is absent)::

        nvidia-open | 580.159.04-1 | file:/srv/rigbook-sim-repo  Packages
        nvidia-open | 580.95.05-1 | file:/srv/rigbook-sim-repo  Packages

    .. code:: python

        {"nvidia-open": ["580.159.04-1", "580.95.05-1"]}
    """

    def requires_command(self, packages: list[str]) -> str:
        return "apt-cache"

    def command(self, packages: list[str]) -> StringCommand:
        return StringCommand("apt-cache madison", *(QuoteString(name) for name in packages))

    @staticmethod
    def default() -> dict[str, list[str]]:
        return {}

    def process(self, output: list[str]) -> dict[str, list[str]]:
        versions: dict[str, list[str]] = {}
        for line in output:
            fields = [field.strip() for field in line.split("|")]
            if len(fields) != 3:
                raise FactProcessError(f"not an apt-cache madison line: {line!r}")
            name, version = fields[0], fields[1]
            if version not in versions.setdefault(name, []):
                versions[name].append(version)
        return versions


def upstream_version(version: str) -> str:
    """The upstream part of a Debian version: no epoch, no Debian revision.

    '580.95.05-0ubuntu0.24.04.1' -> '580.95.05', '580.95.05-1' -> '580.95.05', '1:2.3-4' -> '2.3'.
    """
    without_epoch = version.split(":", 1)[1] if ":" in version else version
    return without_epoch.rsplit("-", 1)[0]


@operation()
def apt_hold(packages: list[str] | tuple[str, ...], held: bool = True):
    """
    Hold (or release) apt packages, marking only those whose hold state differs.

    + packages: package names as ``apt-mark`` takes them
    + held: True to hold (``apt-mark hold``), False to release (``apt-mark unhold``)

    A held package is never upgraded by ``apt-get upgrade`` nor by unattended-upgrades; an
    explicit ``apt-get install`` of it fails until it is released.

    **Example:**

    .. code:: python

        apt_hold(name="Hold the driver", packages=["nvidia-open", "nvidia-smi"])
    """
    current = once(AptHolds)
    todo = sorted({name for name in packages if (name in current) != held})
    verb = "hold" if held else "unhold"
    if todo:
        yield StringCommand("apt-mark", verb, *(QuoteString(name) for name in todo))
    elif packages:
        state = "held" if held else "not held"
        host.noop(f"{', '.join(sorted(set(packages)))}: already {state}")
    else:
        host.noop(f"no packages to {verb}")


#: dpkg's own journal of work it started: not empty when a dpkg run died mid-way.
DPKG_UPDATES = "/var/lib/dpkg/updates"
#: The locks dpkg (and apt, as its frontend) hold while they change packages.
DPKG_LOCKS = ("/var/lib/dpkg/lock-frontend", "/var/lib/dpkg/lock")
#: Programs that change packages, by process name (the kernel cuts names to 15 characters:
#: unattended-upgrade is "unattended-upgr"), and the driver bump's script by its path.
_PACKAGE_WORKERS = "^(dpkg|apt|apt-get|aptitude|unattended-upgr|packagekitd)$"
#: The driver bump's apt step (files/driver/bump.sh, roles/driver.py move_driver).
BUMP_SCRIPT = "/opt/rigbook/driver/bump.sh"
_BUMP = BUMP_SCRIPT.replace("bump.sh", "[b]ump.sh")  # [b]: not the shell that runs pgrep
_MARK = "rigbook-dpkg:"
#: A package line of `dpkg --audit`: one space, the name (":arch" on multiarch), its summary.
_AUDIT_PACKAGE = re.compile(r" ([a-z0-9][a-z0-9+.-]+(?::[a-z0-9]+)?)(?: .*)?")


@dataclass(frozen=True)
class DpkgWork:
    """Package work left half-done, and what is changing packages right now."""

    journal: bool = False  # DPKG_UPDATES is not empty
    packages: tuple[str, ...] = ()  # what `dpkg --audit` names that --configure finishes
    broken: tuple[str, ...] = ()  # what it names that --configure cannot (to reinstall)
    busy: tuple[str, ...] = ()  # "PID NAME" of each process at work, "lock PATH" of a held lock

    @property
    def interrupted(self) -> bool:
        """dpkg --configure -a has work to finish."""
        return self.journal or bool(self.packages)

    def to_json(self) -> dict[str, Any]:
        """JSON-able form (`pyinfra @rig fact ...`)."""
        return {**asdict(self), "interrupted": self.interrupted}

    def describe(self) -> str:
        """What was left half-done, in words."""
        parts = [f"{', '.join(self.packages)} not fully installed"] if self.packages else []
        if self.journal:
            parts.append(f"{DPKG_UPDATES}/ not empty")
        return "; ".join(parts)


def parse_dpkg_audit(lines: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The packages `LC_ALL=C dpkg --audit` names, each once: those of a section whose heading
    says `dpkg --configure` (unpacked, half-configured, triggers awaited or pending), which
    `dpkg --configure -a` finishes, and the others (half-installed, to reinstall, no md5sums or
    file list), which it cannot. Package lines start with one space; headings do not."""
    heading: list[str] = []
    configure: list[str] = []
    broken: list[str] = []
    for line in lines:
        if not line.strip():
            heading = []
        elif not line.startswith(" "):
            heading.append(line)
        else:
            matched = _AUDIT_PACKAGE.fullmatch(line.rstrip(" "))
            if matched is None:
                raise FactProcessError(f"not a dpkg --audit package line: {line!r}")
            found = configure if "--configure" in " ".join(heading) else broken
            if matched[1] not in found:
                found.append(matched[1])
    return tuple(configure), tuple(broken)


class DpkgInterrupted(FactBase[DpkgWork]):
    """
    Package work a dead apt or dpkg left half-done (apt then refuses everything with "E: dpkg
    was interrupted, you must manually run 'dpkg --configure -a' to correct the problem"), and
    the processes or locks that say package work is under way now. Reads dpkg's journal
    (/var/lib/dpkg/updates), the processes that change packages, dpkg's locks (/proc/locks)
    and ``dpkg --audit``, whose real output (tests/fixtures/real/apt/) looks like::

        The following packages are missing the md5sums control file in the
        database, they need to be reinstalled:
         default-jre          Standard Java or Java compatible Runtime

    .. code:: python

        DpkgWork(journal=False, packages=(), broken=("default-jre",), busy=())

    (A section whose heading names ``dpkg --configure`` goes to ``packages``.)
    """

    def requires_command(self) -> str:
        return "dpkg"

    def command(self) -> str:
        locks = " ".join(DPKG_LOCKS)
        return (
            f"ls -A {DPKG_UPDATES} 2>/dev/null | grep -q . && echo '{_MARK}journal'; "
            f"pgrep -l '{_PACKAGE_WORKERS}' | sed 's/^/{_MARK}busy /'; "
            f"pgrep -f '{_BUMP}' | sed 's/$/ bump.sh/; s/^/{_MARK}busy /'; "
            f"for lock in {locks}; do [ -e \"$lock\" ] && "
            f"grep -q \":$(stat -c %i \"$lock\") \" /proc/locks 2>/dev/null && "
            f"echo \"{_MARK}busy lock $lock\"; done; "
            "LC_ALL=C dpkg --audit; [ $? -le 1 ]"  # dpkg 1.20 and later exit 1 on a finding
        )

    @staticmethod
    def default() -> DpkgWork:
        return DpkgWork()

    def process(self, output: list[str]) -> DpkgWork:
        marks = [line[len(_MARK):] for line in output if line.startswith(_MARK)]
        packages, broken = parse_dpkg_audit(
            [line for line in output if not line.startswith(_MARK)])
        return DpkgWork(
            journal="journal" in marks,
            packages=packages,
            broken=broken,
            busy=tuple(mark.removeprefix("busy ") for mark in marks if mark.startswith("busy ")),
        )


@operation()
def finish_interrupted():
    """
    Finish the package work a dead apt or dpkg left half-done (``dpkg --configure -a``), so
    that apt runs again; nothing when none was left, and nothing while package work is under way
    (a dpkg or apt process, the driver bump, a held dpkg lock): that work is not interrupted.

    Configuration files the packages ship are kept as they are on the rig (--force-confold).
    """
    work = once(DpkgInterrupted)
    if work.busy:
        host.noop(f"package work under way ({', '.join(work.busy)}): left to finish")
    elif not work.interrupted:
        host.noop("no interrupted package work")
    else:
        yield StringCommand("DEBIAN_FRONTEND=noninteractive dpkg --force-confdef "
                            "--force-confold --configure -a")
