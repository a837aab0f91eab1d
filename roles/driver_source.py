"""Where the running driver came from: apt packages rigbook manages, or a driver it does not own.

"No driver package" is not "no driver". A home rig may run a driver from NVIDIA's .run
installer; a rented GPU container runs the host's driver, mounted at /usr/local/nvidia. Both
have a loaded nvidia module and an nvidia-smi that answers, and no package owns their files:
installing a packaged driver there puts a second driver on top of the running one. A driver
installed from another apt source than the inventory's is the same case: rigbook would
replace it from its own source.

`DriverSourceFact` asks dpkg who owns the driver's user space (the nvidia-smi that answers,
libnvidia-ml.so.1) and looks for NVIDIA's uninstaller; `foreign_driver` says whether the
driver is one rigbook does not own and why; `foreign_findings` is the check. Host data
`driver_foreign` decides: `refuse` (the default) fails the rig before any change, naming what
was found and how to hand it over; `adopt` keeps it as it is: rigbook installs, holds, bumps,
pins and blacklists nothing, writes no persistenced drop-in, and checks the running version
against `driver_version` (the venvs and recipes check it against their CUDA needs). docs/driver.md,
"Drivers rigbook does not own".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyinfra.api import FactBase
from pyinfra.api.exceptions import FactProcessError

from rigbook.core.apt import upstream_version
from rigbook.core.checks import Facts, Finding, Read, error
from rigbook.core.spec import Rig
from rigbook.core.types import JsonValue
from rigbook.roles.kernel import is_configured

#: Where a container runtime mounts the host's driver (NVIDIA's container toolkit, cloud images).
HOST_MOUNT = "/usr/local/nvidia"
#: What NVIDIA's .run installer leaves behind to remove itself.
UNINSTALLER = "/usr/bin/nvidia-uninstall"

_LINE = re.compile(
    r"(?P<kind>file|uninstaller)\t(?P<path>/[^\x00-\x1f]*)(\t(?P<owner>[^\x00-\x1f]*))?")
_OWNER = re.compile(r"[a-z0-9][a-z0-9+.-]+(:[a-z0-9]+)?")


@dataclass(frozen=True)
class DriverFile(JsonValue):
    """One file of the driver's user space and the package that owns it (None: no package)."""

    path: str
    owner: str | None


@dataclass(frozen=True)
class DriverSource(JsonValue):
    """The driver's user-space files with their owners, and NVIDIA's uninstaller if present."""

    files: tuple[DriverFile, ...] = ()
    uninstaller: str | None = None

    @property
    def unowned(self) -> list[str]:
        return [file.path for file in self.files if file.owner is None]


class DriverSourceFact(FactBase[DriverSource]):
    """
    Who owns the driver's user space: for the nvidia-smi on PATH, the host-mounted one and
    every libnvidia-ml.so.1 the loader knows, ``dpkg-query -S`` of the file (or of what its
    symlink resolves to); and whether NVIDIA's .run uninstaller exists. One line each, tab
    separated; the owner is empty when no package owns the file. On the H200 host (a driver
    mounted from the host; the loader also knows a /lib copy)::

        file	/usr/local/nvidia/bin/nvidia-smi
        file	/usr/local/nvidia/lib64/libnvidia-ml.so.1
        file	/lib/libnvidia-ml.so.1

    .. code:: python

        DriverSource(files=(DriverFile("/usr/local/nvidia/bin/nvidia-smi", None), ...))
    """

    def command(self) -> str:
        return (
            "seen=' '; "
            "for f in \"$(command -v nvidia-smi)\" "
            f"{HOST_MOUNT}/bin/nvidia-smi {HOST_MOUNT}/lib64/libnvidia-ml.so.1 "
            "$(ldconfig -p 2>/dev/null | sed -n 's/^.*libnvidia-ml\\.so\\.1 .*=> //p'); do "
            '[ -n "$f" ] && [ -e "$f" ] || continue; '
            'case "$seen" in *" $f "*) continue;; esac; seen="$seen$f "; '
            'owner=""; for p in "$f" "$(readlink -f "$f")"; do '
            '[ -n "$owner" ] || owner=$(dpkg-query -S "$p" 2>/dev/null '
            "| sed -n '/^diversion /!{s/[:,] .*//p;q}'); done; "
            "printf 'file\\t%s\\t%s\\n' \"$f\" \"$owner\"; done; "
            f"[ -x {UNINSTALLER} ] && printf 'uninstaller\\t%s\\n' {UNINSTALLER}; true"
        )

    @staticmethod
    def default() -> DriverSource:
        return DriverSource()

    def process(self, output: list[str]) -> DriverSource:
        files: list[DriverFile] = []
        uninstaller = None
        for line in output:
            found = _LINE.fullmatch(line)
            owner = (found["owner"] or "") if found else ""
            if not found or (owner and not _OWNER.fullmatch(owner)):
                raise FactProcessError(f"not a driver file line: {line!r}")
            if found["kind"] == "uninstaller":
                uninstaller = found["path"]
            else:
                files.append(DriverFile(found["path"], owner or None))
        return DriverSource(tuple(files), uninstaller)


SOURCE_READ = Read("driver_source", DriverSourceFact,
                   "owners of the driver's files (dpkg-query -S)")


@dataclass(frozen=True)
class Foreign(JsonValue):
    """A driver rigbook does not own: what it is (`kind`), what was found, how to hand it over."""

    kind: str  # "runfile", "host mount", "unowned files", "another apt source"
    found: str
    handover: str


def running_version(facts: Facts) -> str | None:
    """The running driver: what nvidia-smi reports, else the loaded module's version."""
    probe = facts.probe
    return (probe.driver_version if probe is not None and probe.ok else None) or facts.loaded


def foreign_driver(rig: Rig, facts: Facts, default_repo: str,
                   installed: set[str]) -> Foreign | None:
    """The driver this rig runs or has, when rigbook does not own it; None when it does (or there
    is none yet). `installed`: the driver versions its packages carry (rigbook.roles.driver's
    driver_versions). Needs facts driver_source, loaded, probe and driver_policy."""
    if rig.platform == "wsl2":
        return None
    source: DriverSource = facts.driver_source or DriverSource()
    running = running_version(facts)
    what = f"driver {running}" if running else "a driver"
    unowned = source.unowned
    if source.uninstaller or unowned:
        if source.uninstaller:
            kind, handover = "runfile", (
                f"remove it with NVIDIA's own uninstaller ({source.uninstaller}), reboot, then "
                "converge again: rigbook installs the packaged driver")
        elif any(path.startswith(f"{HOST_MOUNT}/") for path in unowned):
            kind, handover = "host mount", (
                f"it belongs to the host that mounts {HOST_MOUNT}: change it there")
        else:
            kind, handover = "unowned files", (
                "remove the files no package owns (a .run install: nvidia-uninstall, or "
                "`sh NVIDIA-Linux-*.run --uninstall`), reboot, then converge again")
        files = ", ".join(unowned) or "none"
        return Foreign(kind, f"{what} whose files no package owns ({files})", handover)
    if running and not installed:
        return Foreign("unowned files", f"{what} is loaded and no driver package is installed",
                       "remove what installed it (a .run install: nvidia-uninstall), reboot, "
                       "then converge again")
    for policy in facts.driver_policy or ():
        for version in policy.versions:
            if version.installed and version.origins and not any(
                    is_configured(uri, rig, default_repo) for uri in version.origins):
                return Foreign(
                    "another apt source",
                    f"{policy.package} {upstream_version(version.version)} from "
                    f"{', '.join(version.origins)}, not the configured source",
                    f"purge it (apt-get purge {policy.package}) and converge again"
                    + ", or set driver_repo_uri to that source")
    return None


def describe(foreign: Foreign | None, installed: set[str]) -> str:
    """The driver's source in words, for status."""
    if foreign is not None:
        return f"{foreign.kind}: {foreign.found}"
    return "apt packages" if installed else "none"


def foreign_findings(rig: Rig, facts: Facts, foreign: Foreign) -> list[Finding]:
    """A foreign driver refused (`driver_foreign: refuse`) or checked as adopted: it must run
    the version the inventory names, since rigbook cannot move it."""
    if rig.driver_foreign == "refuse":
        return [error("driver", f"{foreign.found}: rigbook would put a packaged driver over it; "
                      f"to hand it over: {foreign.handover}; or keep it as it is with "
                      "driver_foreign: adopt", key="driver_foreign")]
    running = running_version(facts)
    if running is None:
        return [error("driver", f"adopted driver ({foreign.kind}) is not running: nvidia-smi "
                      "does not answer and no nvidia module is loaded", key="driver_foreign")]
    if rig.driver_version and running != rig.driver_version:
        return [error("driver", f"adopted driver runs {running}, inventory pins "
                      f"{rig.driver_version}; rigbook cannot move a driver it does not own: set "
                      f"driver_version: {running}", key="driver_version")]
    if not rig.driver_version and running.split(".", 1)[0] != str(rig.driver_branch):
        return [error("driver", f"adopted driver runs {running}, not of driver_branch "
                      f"{rig.driver_branch}", key="driver_branch")]
    probe = facts.probe
    off = [f"GPU {gpu.index}" for gpu in (probe.gpus if probe is not None else ())
           if gpu.persistence is False]
    if off:
        # the power role refuses a cap without it, after other roles changed the rig: say it now
        return [error("driver", f"persistence mode is off on {', '.join(off)} and rigbook runs "
                      "no nvidia-persistenced for a driver it does not own: turn it on with the "
                      "driver's own tools (nvidia-smi -pm 1, or its nvidia-persistenced)",
                      key="driver_foreign")]
    return []
