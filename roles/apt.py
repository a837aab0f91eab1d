"""What pyinfra's apt support lacks: the held-package set and an idempotent apt-mark hold.

pyinfra has no apt-mark operation, and a `server.shell("apt-mark hold ...")` step counts as a
change on every run. `apt_hold` reads the held set first (`AptHolds`) and marks only the
packages whose mark differs. `DpkgInstalled` is dpkg's own view of what is installed, with the
exact versions, which roles compare by upstream version (`upstream_version`).
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import FactBase, QuoteString, StringCommand, operation
from pyinfra.api.exceptions import FactProcessError

from rigbook.runfacts import once


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
