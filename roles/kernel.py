"""The kernel side of the driver: nouveau, Secure Boot, DKMS, kernel headers, other sources.

What bites first on a fresh Ubuntu box, before the NVIDIA module can load:

- nouveau is loaded (or not blacklisted): the nvidia module cannot take the card until nouveau
  is blacklisted, the initramfs rebuilt and the box rebooted;
- Secure Boot is on and the DKMS signing key is not enrolled: the DKMS-built module is refused
  by the kernel, and nvidia-smi says "couldn't communicate with the NVIDIA driver" after an
  install that reported success;
- the headers of the running kernel are missing, so DKMS builds nothing; or an installed
  kernel has no nvidia module built, so its next boot has no driver;
- another apt source (the graphics-drivers PPA, a second CUDA repository) offers a different
  driver than the configured source.

This module holds the parsers of the real outputs (mokutil, dkms status, lsmod or /proc/modules,
apt-cache policy; tests/fixtures/real/ holds published ones), the facts that read them, the
findings (`onboard_findings`, run by the driver role's check, the preflight and status), and
the operations that fix what a converge may fix. roles/driver.py wires them in; docs/driver.md,
"Onboarding a real box", describes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pyinfra import host
from pyinfra.api import FactBase, QuoteString, StringCommand, operation
from pyinfra.facts.apt import noninteractive_apt

from rigbook import FILES
from rigbook.core.checks import Facts, Finding, Read, drift, error, warn
from rigbook.core.managed import absent_commands, put_commands
from rigbook.core.messages import notice, refuse
from rigbook.core.reboot import RebootMarker, record_reboot
from rigbook.core.render import template_commands
from rigbook.core.runfacts import once
from rigbook.core.spec import Rig
from rigbook.core.types import JsonValue

TEMPLATES = FILES / "driver"

#: The file rigbook writes to keep nouveau off the GPUs (files/driver/blacklist-nouveau.conf).
NOUVEAU_CONF = "/etc/modprobe.d/rigbook-blacklist-nouveau.conf"
#: Where modprobe reads its configuration (modprobe.d(5)).
MODPROBE_DIRS = ("/etc/modprobe.d", "/lib/modprobe.d", "/usr/lib/modprobe.d", "/run/modprobe.d")
#: The DKMS signing keys, public halves in DER: dkms 3's own (`dkms generate_mok`, the default
#: mok_certificate) and Ubuntu's shim-signed one (`update-secureboot-policy --new-key`).
DKMS_KEYS = ("/var/lib/dkms/mok.pub", "/var/lib/shim-signed/mok/MOK.der")
#: The key pair `driver_secure_boot: enroll` makes when there is none, where each platform's DKMS
#: signs with it: (private key, DER certificate). Ubuntu's update-secureboot-policy --new-key and
#: Debian's dkms generate_mok make the same pair there.
SIGNING_KEYS = {
    "ubuntu": ("/var/lib/shim-signed/mok/MOK.priv", "/var/lib/shim-signed/mok/MOK.der"),
    "debian": ("/var/lib/dkms/mok.key", "/var/lib/dkms/mok.pub"),
}
#: The one-time password a person types at the console to confirm the enrolment: root-only,
#: in no command line and no log.
MOK_PASSWORD = "/root/rigbook-mok-password"
CONSOLE_STEP = ("at the next boot, at the console: MOK Manager > Enroll MOK > Continue > Yes > "
                f"the password in {MOK_PASSWORD} > Reboot")
#: Other sources of the driver are pinned out here (apt_preferences(5), priority -1).
OTHER_SOURCES_PREF = "/etc/apt/preferences.d/rigbook-nvidia-other-sources.pref"
#: Simulation hook, as roles/driver.py's SIM_LOADED_VERSION: the sandbox's stand-in "loaded
#: modules" list (lsmod's format), read instead of /proc/modules only when it exists. A
#: container sees its host's /proc/modules; no real rig has this file (/run is emptied at boot).
SIM_MODULES = "/run/rigbook-sim/modules"
#: A kernel release as uname -r prints it; anything else is not put into a package name.
_RELEASE = re.compile(r"[0-9][A-Za-z0-9.+~_-]*")
#: Ubuntu's archive hosts (archive, security, ports and the country mirrors CC.archive).
_UBUNTU_ARCHIVE = re.compile(r"([a-z0-9-]+\.)*(archive|security|ports)\.ubuntu\.com")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


# --- parsers of real outputs ----------------------------------------------------------------


def parse_sb_state(lines: Iterable[str]) -> bool | None:
    """`mokutil --sb-state`: True (SecureBoot enabled), False (disabled, also in setup mode),
    None (unknown: "EFI variables are not supported on this system" - a BIOS boot - or any
    other text)."""
    for line in lines:
        found = re.search(r"\bSecureBoot (enabled|disabled)\b", line)
        if found:
            return found.group(1) == "enabled"
    return None


@dataclass(frozen=True)
class MokKey:
    """One key of a mokutil listing (`--list-enrolled`, `--list-new`, `--kek`, `--pk`)."""

    index: int
    sha1: str | None = None
    subject_cn: str | None = None
    owner: str | None = None


def parse_mok_listing(lines: Iterable[str]) -> list[MokKey]:
    """The keys of a mokutil listing: `[key N]`, then `Owner:` (newer mokutil), `SHA1
    Fingerprint:` and the certificate, whose `Subject:` CN is kept. Text before the first
    `[key N]` (the end of an earlier key) is skipped; "MokListRT is empty" gives no key."""
    keys: list[MokKey] = []
    current: dict | None = None
    for raw in lines:
        line = raw.strip()
        head = re.fullmatch(r"\[key (\d+)\]", line)
        if head:
            if current is not None:
                keys.append(MokKey(**current))
            current = {"index": int(head.group(1))}
            continue
        if current is None:
            continue
        if line.startswith("SHA1 Fingerprint:") and "sha1" not in current:
            current["sha1"] = line.split(":", 1)[1].strip().lower()
        elif line.startswith("Owner:") and "owner" not in current:
            current["owner"] = line.split(":", 1)[1].strip()
        elif line.startswith("Subject:") and "subject_cn" not in current:
            cn = re.search(r"\bCN\s*=\s*([^,/]+)", line)
            current["subject_cn"] = cn.group(1).strip() if cn else None
    if current is not None:
        keys.append(MokKey(**current))
    return keys


@dataclass(frozen=True)
class DkmsModule(JsonValue):
    """One line of `dkms status`: a module version for a kernel (None: added, no kernel yet)."""

    module: str
    version: str
    kernel: str | None
    arch: str | None
    state: str
    note: str = ""


@dataclass(frozen=True)
class DkmsError(JsonValue):
    """One "Error! ..." of dkms, with the module, version and kernel its next line names (None
    where dkms does not say: "File:  does not exist." names no path)."""

    message: str
    module: str | None = None
    version: str | None = None
    kernel: str | None = None

    @property
    def text(self) -> str:
        named = [f"module {self.module} {self.version}" if self.module else None,
                 f"kernel {self.kernel}" if self.kernel else None]
        what = ", ".join(n for n in named if n) or "dkms names no module"
        return f"{self.message} ({what})"


@dataclass(frozen=True)
class DkmsStatus(JsonValue):
    modules: tuple[DkmsModule, ...] = ()
    errors: tuple[DkmsError, ...] = ()


# dkms >= 3: "nvidia/580.95.05, 6.8.0-45-generic, x86_64: installed (note)";
# dkms 2: "nvidia, 396.45, 4.17.11-200.fc28.x86_64, x86_64: installed (note)";
# either without kernel and arch while only added: "nvidia/580.95.05: added".
_DKMS_NEW = re.compile(
    r"(?P<module>[^\s,/:]+)/(?P<version>[^\s,:]+)(, (?P<kernel>[^\s,]+), (?P<arch>[^\s,:]+))?"
    r": (?P<state>[A-Za-z-]+)(?P<note>.*)"
)
_DKMS_OLD = re.compile(
    r"(?P<module>[^\s,/:]+), (?P<version>[^\s,:]+)(, (?P<kernel>[^\s,]+), (?P<arch>[^\s,:]+))?"
    r": (?P<state>[A-Za-z-]+)(?P<note>.*)"
)
#: The module tree a follow-up line names: "File: /var/lib/dkms/M/V/source/dkms.conf does not
#: exist.", "Consult /var/lib/dkms/M/V/build/make.log for more information."
_DKMS_TREE = re.compile(
    r"(?:File:|Consult) /var/lib/dkms/(?P<module>[^/\s]+)/(?P<version>[^/\s]+)/"
)
_DKMS_KERNEL = re.compile(r"on kernel: (?P<kernel>\S+) \((?P<arch>[^)\s]+)\)")


def parse_dkms_status(lines: Iterable[str]) -> DkmsStatus:
    """`dkms status`, old (comma) and new (slash) formats, with its notes ("(WARNING! Diff
    between built and installed module!)", "(original_module exists)") and its errors, each
    with what its next line names ("Error! Could not locate dkms.conf file." + "File:
    /var/lib/dkms/nvidia/390.48/source/dkms.conf does not exist."; "Error! Bad return status
    for module build on kernel: K (x86_64)" + "Consult /var/lib/dkms/nvidia/V/build/make.log")."""
    modules: list[DkmsModule] = []
    errors: list[DkmsError] = []
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        if line.startswith("Error!"):
            message = line.removeprefix("Error!").strip()
            kernel = _DKMS_KERNEL.search(message)
            errors.append(DkmsError(message, kernel=kernel["kernel"] if kernel else None))
            continue
        tree = _DKMS_TREE.match(line)
        if tree and errors and errors[-1].module is None:
            last = errors[-1]
            errors[-1] = DkmsError(last.message, tree["module"], tree["version"], last.kernel)
            continue
        found = _DKMS_NEW.fullmatch(line) or _DKMS_OLD.fullmatch(line)
        if found:
            modules.append(DkmsModule(
                found["module"], found["version"], found["kernel"], found["arch"],
                found["state"], found["note"].strip(),
            ))
    return DkmsStatus(tuple(modules), tuple(errors))


def parse_lsmod(lines: Iterable[str]) -> list[str]:
    """Module names, in order, from `lsmod` (header line skipped) or /proc/modules."""
    names = []
    for line in lines:
        fields = line.split()
        if not fields or fields[:2] == ["Module", "Size"]:
            continue
        if len(fields) >= 2 and fields[1].isdigit():
            names.append(fields[0])
    return names


@dataclass(frozen=True)
class PolicyVersion(JsonValue):
    """One version of an `apt-cache policy` version table and the sources that offer it."""

    version: str
    priority: int
    installed: bool
    origins: tuple[str, ...]


@dataclass(frozen=True)
class AptPolicy(JsonValue):
    package: str
    versions: tuple[PolicyVersion, ...]


_POLICY_VERSION = re.compile(r"( \*\*\*|    ) (?P<version>\S+) (?P<priority>-?\d+)")
_POLICY_ORIGIN = re.compile(r"\s+-?\d+ (?P<uri>\S+)( .*)?")


def parse_apt_policy(lines: Iterable[str]) -> list[AptPolicy]:
    """`apt-cache policy PACKAGE...` in any locale: the headings are translated, the table's
    shape is not. A version line is indented 5 (or ` *** ` when installed) and ends with its
    priority; an origin line is indented deeper and starts with the source's priority; the dpkg
    status file (installed, not offered) is not an origin."""
    policies: list[AptPolicy] = []
    package: str | None = None
    versions: list[PolicyVersion] = []
    current: dict | None = None

    def close() -> None:
        nonlocal current
        if current is not None:
            versions.append(PolicyVersion(current["version"], current["priority"],
                                          current["installed"], tuple(current["origins"])))
            current = None

    for line in lines:
        if line and not line[0].isspace() and line.rstrip().endswith(":"):
            close()
            if package is not None:
                policies.append(AptPolicy(package, tuple(versions)))
            package, versions = line.rstrip()[:-1], []
            continue
        found = _POLICY_VERSION.fullmatch(line.rstrip())
        if found:
            close()
            current = {"version": found["version"], "priority": int(found["priority"]),
                       "installed": line.startswith(" ***"), "origins": []}
            continue
        origin = _POLICY_ORIGIN.fullmatch(line.rstrip())
        if origin and current is not None and line.startswith("       "):
            if origin["uri"] != "/var/lib/dpkg/status":
                current["origins"].append(origin["uri"])
    close()
    if package is not None:
        policies.append(AptPolicy(package, tuple(versions)))
    return policies


# --- facts ------------------------------------------------------------------------------------


def _sections(output: Iterable[str]) -> dict[str, list[str]]:
    """Lines under `##name` markers, by name (a fact's command prints several parts)."""
    parts: dict[str, list[str]] = {}
    name = None
    for line in output:
        if line.startswith("##") and not line.startswith("###"):
            name = line[2:].strip()
            parts.setdefault(name, [])
        elif name is not None:
            parts[name].append(line)
    return parts


@dataclass(frozen=True)
class SecureBoot(JsonValue):
    """The Secure Boot state and the DKMS signing keys, as mokutil sees them.

    `enabled`: True, False, or None (unknown: no mokutil, or no EFI variables - a BIOS boot).
    `keys`: each DKMS key file present on the rig -> its SHA-1 fingerprint (lower case).
    `enrolled` / `queued`: fingerprints of the enrolled MOKs and of those waiting for the
    console step at the next boot (`mokutil --list-new`).
    """

    enabled: bool | None = None
    mokutil: bool = False
    keys: dict[str, str] = field(default_factory=dict)
    enrolled: frozenset[str] = frozenset()
    queued: frozenset[str] = frozenset()
    text: str = ""

    def key_state(self) -> tuple[str | None, str]:
        """(key path, 'enrolled' | 'queued' | 'unreadable' | 'not enrolled' | 'no key')."""
        for path, sha1 in self.keys.items():
            if sha1 in self.enrolled:
                return path, "enrolled"
        for path, sha1 in self.keys.items():
            if sha1 in self.queued:
                return path, "queued"
        for path, sha1 in self.keys.items():
            if not sha1:
                return path, "unreadable"
        if self.keys:
            return next(iter(self.keys)), "not enrolled"
        return None, "no key"


class SecureBootFact(FactBase[SecureBoot]):
    """
    Secure Boot and the DKMS signing key, in one command::

        ##mokutil
        ##sb-state
        SecureBoot enabled
        ##key /var/lib/dkms/mok.pub
        sha1 Fingerprint=27:DD:CA:C4:...
        ##enrolled
        [key 1]
        SHA1 Fingerprint: 27:dd:ca:c4:...
        ##new
        MokNew is empty

    No mokutil: Secure Boot is unknown (nothing is refused on it).
    """

    def command(self) -> str:
        keys = " ".join(DKMS_KEYS)
        return (
            "if command -v mokutil >/dev/null 2>&1; then echo '##mokutil'; fi; "
            "echo '##sb-state'; mokutil --sb-state 2>&1; "
            f"for k in {keys}; do if [ -r \"$k\" ]; then echo \"##key $k\"; "
            'openssl x509 -inform der -in "$k" -noout -fingerprint -sha1 2>&1; fi; done; '
            "echo '##enrolled'; mokutil --list-enrolled 2>&1; "
            "echo '##new'; mokutil --list-new 2>&1; true"
        )

    @staticmethod
    def default() -> SecureBoot:
        return SecureBoot()

    def process(self, output: list[str]) -> SecureBoot:
        parts = _sections(output)
        if "mokutil" not in parts:
            return SecureBoot(text="mokutil is not installed")
        keys = {}
        for name, lines in parts.items():
            if name.startswith("key "):
                found = re.search(r"Fingerprint=([0-9A-Fa-f:]+)", " ".join(lines))
                keys[name[4:]] = found.group(1).lower() if found else ""
        state = parts.get("sb-state", [])
        return SecureBoot(
            enabled=parse_sb_state(state),
            mokutil=True,
            keys=keys,
            enrolled=frozenset(k.sha1 for k in parse_mok_listing(parts.get("enrolled", []))
                               if k.sha1),
            queued=frozenset(k.sha1 for k in parse_mok_listing(parts.get("new", [])) if k.sha1),
            text=" ".join(line.strip() for line in state if line.strip()),
        )


class DkmsStatusFact(FactBase[DkmsStatus]):
    """`dkms status` (parse_dkms_status); no dkms: no modules."""

    def requires_command(self) -> str:
        return "dkms"

    def command(self) -> str:
        return "dkms status 2>&1; true"

    @staticmethod
    def default() -> DkmsStatus:
        return DkmsStatus()

    def process(self, output: list[str]) -> DkmsStatus:
        return parse_dkms_status(output)


@dataclass(frozen=True)
class Kernels(JsonValue):
    """The running kernel, the installed ones (/boot/vmlinuz-*), which have a module tree
    (/lib/modules/K) and which have headers (/lib/modules/K/build)."""

    running: str = ""
    installed: tuple[str, ...] = ()
    modules: frozenset[str] = frozenset()
    headers: frozenset[str] = frozenset()

    @property
    def own(self) -> bool:
        """The running kernel belongs to this system: it has a module tree here. A container
        (a sandbox rig) runs its host's kernel, and there is nothing to build for it."""
        return self.running in self.modules


class KernelsFact(FactBase[Kernels]):
    """
    Kernels and headers::

        running 6.8.0-45-generic
        kernel 6.8.0-45-generic
        modules 6.8.0-45-generic
        headers 6.8.0-45-generic
    """

    def command(self) -> str:
        return (
            'echo "running $(uname -r)"; '
            'for f in /boot/vmlinuz-*; do [ -e "$f" ] && echo "kernel ${f#/boot/vmlinuz-}"; done; '
            'for d in /lib/modules/*; do [ -d "$d" ] || continue; '
            'echo "modules ${d#/lib/modules/}"; '
            '[ -e "$d/build" ] && echo "headers ${d#/lib/modules/}"; done; true'
        )

    @staticmethod
    def default() -> Kernels:
        return Kernels()

    def process(self, output: list[str]) -> Kernels:
        seen: dict[str, list[str]] = {"running": [], "kernel": [], "modules": [], "headers": []}
        for line in output:
            kind, _, release = line.strip().partition(" ")
            if kind in seen and release:
                seen[kind].append(release)
        return Kernels(
            running=(seen["running"] or [""])[0],
            installed=tuple(seen["kernel"]),
            modules=frozenset(seen["modules"]),
            headers=frozenset(seen["headers"]),
        )


@dataclass(frozen=True)
class Nouveau(JsonValue):
    """Whether nouveau is loaded, and which modprobe files blacklist it."""

    loaded: bool = False
    blacklisted_by: tuple[str, ...] = ()
    simulated: bool = False


class NouveauFact(FactBase[Nouveau]):
    """
    The loaded modules (/proc/modules, or the sandbox's SIM_MODULES) and the modprobe files
    that say ``blacklist nouveau``::

        ##modules
        nouveau 3096576 0 - Live 0x0000000000000000
        ##blacklist
        /etc/modprobe.d/rigbook-blacklist-nouveau.conf
    """

    def command(self) -> str:
        dirs = " ".join(f"{d}/*.conf" for d in MODPROBE_DIRS)
        return (
            f"if [ -r {SIM_MODULES} ]; then echo '##modules simulated'; cat {SIM_MODULES}; "
            "else echo '##modules'; cat /proc/modules; fi; "
            "echo '##blacklist'; "
            "grep -lsE '^[[:space:]]*blacklist[[:space:]]+nouveau([[:space:]]|$)' "
            f"{dirs}; true"
        )

    @staticmethod
    def default() -> Nouveau:
        return Nouveau()

    def process(self, output: list[str]) -> Nouveau:
        parts = _sections(output)
        modules = parts.get("modules simulated", parts.get("modules", []))
        return Nouveau(
            loaded="nouveau" in parse_lsmod(modules),
            blacklisted_by=tuple(line.strip() for line in parts.get("blacklist", [])
                                 if line.strip()),
            simulated="modules simulated" in parts,
        )


class AptPolicyFact(FactBase[list[AptPolicy]]):
    """`apt-cache policy PACKAGE...` in the C locale (parse_apt_policy)."""

    def requires_command(self, packages: tuple[str, ...]) -> str:
        return "apt-cache"

    def command(self, packages: tuple[str, ...]) -> StringCommand:
        return StringCommand("LC_ALL=C apt-cache policy",
                             *(QuoteString(name) for name in packages))

    @staticmethod
    def default() -> list[AptPolicy]:
        return []

    def process(self, output: list[str]) -> list[AptPolicy]:
        return parse_apt_policy(output)


#: A kernel release of Ubuntu's scheme, SERIES-ABI-FLAVOUR (6.8.0-51-generic, 6.8.0-1015-aws,
#: 6.8.0-51-generic-64k): Ubuntu builds the prebuilt nvidia modules per flavour and per ABI.
_UBUNTU_KERNEL = re.compile(
    r"(?P<series>\d+\.\d+\.\d+)-(?P<abi>\d+)-(?P<flavour>[a-z0-9][a-z0-9.+-]*)")
#: The same in sed -E, for the fact's command (what it matches goes into a package name).
_FLAVOUR_SED = r"s/^[0-9]+\.[0-9]+\.[0-9]+-[0-9]+-([a-z0-9][a-z0-9.+-]*)$/\1/p"


def kernel_series(release: str) -> str | None:
    """6.8.0 of 6.8.0-51-generic; None for a kernel that is not of Ubuntu's scheme."""
    found = _UBUNTU_KERNEL.fullmatch(release)
    return found["series"] if found else None


def modules_prefix(branch: int, server: bool, open_: bool) -> str:
    """The name of Ubuntu's prebuilt signed modules of a driver branch, up to the flavour (or the
    kernel release): linux-modules-nvidia-580[-server][-open]-."""
    return f"linux-modules-nvidia-{branch}{'-server' if server else ''}{'-open' if open_ else ''}-"


@dataclass(frozen=True)
class SignedModules(JsonValue):
    """What the rig's apt sources offer as Ubuntu's prebuilt signed nvidia modules for the running
    kernel's flavour: the metapackage linux-modules-nvidia-B[-server][-open]-FLAVOUR, which
    carries the kernel's version, stands in for the DKMS package (`provides`: name -> version)
    and brings the module package of one kernel (`kernel`, its release). `package` is empty
    when the sources offer none (or the kernel is not of Ubuntu's scheme)."""

    running: str = ""
    package: str = ""
    version: str = ""
    provides: dict[str, str] = field(default_factory=dict)
    kernel: str = ""


def parse_apt_show(lines: Iterable[str]) -> dict[str, str]:
    """The first record of `apt-cache show`: field -> value, continuation lines joined."""
    record: dict[str, str] = {}
    name = None
    for line in lines:
        if not line.strip():
            if record:
                break
            continue
        if line[0].isspace() and name is not None:
            record[name] += " " + line.strip()
        elif ":" in line:
            name, _, value = line.partition(":")
            record[name] = value.strip()
    return record


def _relations(value: str) -> dict[str, str]:
    """A Depends/Provides field: name -> version (the '=' one, else ''), alternatives flattened."""
    found = {}
    for part in re.split(r"[,|]", value):
        relation = re.fullmatch(r"\s*([a-z0-9][a-z0-9+.-]+)(?::\S+)?\s*(?:\((\S+)\s*(\S+)\))?\s*",
                                part)
        if relation:
            found.setdefault(relation[1], relation[3] if relation[2] == "=" else "")
    return found


class SignedModulesFact(FactBase[SignedModules]):
    """
    The running kernel and `apt-cache show` of the prebuilt signed modules for its flavour::

        ##running 6.8.0-151-generic
        ##show linux-modules-nvidia-580-open-generic
        Package: linux-modules-nvidia-580-open-generic
        Version: 6.8.0-151.151+1
        Provides: nvidia-dkms-580-open (= 580.196.07-0ubuntu0.24.04.1), nvidia-prebuilt-kernel
        Depends: linux-modules-nvidia-580-open-6.8.0-151-generic (= 6.8.0-151.151+1), ...

    The package name is built here from the branch and the flavour sed keeps (letters, digits,
    `.+-`), so nothing else reaches the shell.
    """

    def requires_command(self, branch: int, server: bool, open_: bool) -> str:
        return "apt-cache"

    def command(self, branch: int, server: bool, open_: bool) -> str:
        prefix = modules_prefix(int(branch), bool(server), bool(open_))
        return (
            "r=$(uname -r); echo \"##running $r\"; "
            f"f=$(printf '%s\\n' \"$r\" | sed -nE '{_FLAVOUR_SED}'); "
            f"if [ -n \"$f\" ]; then echo \"##show {prefix}$f\"; "
            f"LC_ALL=C apt-cache show --no-all-versions \"{prefix}$f\" 2>/dev/null; fi; true"
        )

    @staticmethod
    def default() -> SignedModules:
        return SignedModules()

    def process(self, output: list[str]) -> SignedModules:
        return signed_modules(output)


def signed_modules(output: Iterable[str]) -> SignedModules:
    """SignedModulesFact's output read: the record only when it is the package asked about, and
    the kernel from its Depends on linux-modules-nvidia-...-KERNEL."""
    parts = _sections(output)
    running = next((name[len("running "):] for name in parts if name.startswith("running ")), "")
    asked = next((name[len("show "):] for name in parts if name.startswith("show ")), "")
    record = parse_apt_show(parts.get(f"show {asked}", []))
    if not asked or record.get("Package") != asked:
        return SignedModules(running=running)
    running_kernel = _UBUNTU_KERNEL.fullmatch(running)
    flavour = running_kernel["flavour"] if running_kernel else ""
    prefix = asked.removesuffix(flavour) if flavour and asked.endswith("-" + flavour) else ""
    kernel = next((name.removeprefix(prefix) for name in _relations(record.get("Depends", ""))
                   if prefix and name.startswith(prefix)
                   and _UBUNTU_KERNEL.fullmatch(name.removeprefix(prefix))), "")
    return SignedModules(running=running, package=asked, version=record.get("Version", ""),
                         provides=_relations(record.get("Provides", "")), kernel=kernel)


# --- what the facts mean ----------------------------------------------------------------------


def _same_source(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def configured_source(rig: Rig, default_repo: str) -> str | None:
    """The driver's own source: the repository URI (Debian), on Ubuntu the source the rig data
    names or None (Ubuntu's archive)."""
    if rig.platform == "debian":
        return rig.driver_repo_uri or default_repo
    return rig.driver_repo_uri


def is_configured(uri: str, rig: Rig, default_repo: str) -> bool:
    """True when `uri` (an apt-cache policy origin) is the driver's configured source."""
    own = configured_source(rig, default_repo)
    if own is not None:
        return _same_source(uri, own)
    return bool(_UBUNTU_ARCHIVE.fullmatch(urlsplit(uri).hostname or ""))


def offers_driver(policies: list[AptPolicy], rig: Rig, default_repo: str) -> set[str]:
    """The versions the configured source offers (empty: it does not offer the driver, e.g.
    before the driver role wrote the Debian source)."""
    return {version.version for policy in policies for version in policy.versions
            if any(is_configured(uri, rig, default_repo) for uri in version.origins)}


def other_sources(policies: list[AptPolicy], rig: Rig,
                  default_repo: str) -> dict[str, list[tuple[str, int]]]:
    """Sources other than the configured one that offer a driver version the configured source
    does not offer: URI -> [(version, its priority)]. A mirror of the configured source offers
    the same versions and is not one of them. A priority below 0 means apt will not install
    that version (pinned out)."""
    own = offers_driver(policies, rig, default_repo)
    found: dict[str, list[tuple[str, int]]] = {}
    for policy in policies:
        for version in policy.versions:
            if version.version in own:
                continue
            for uri in version.origins:
                if not is_configured(uri, rig, default_repo):
                    seen = found.setdefault(uri, [])
                    if (version.version, version.priority) not in seen:
                        seen.append((version.version, version.priority))
    return found


def pin_targets(policies: list[AptPolicy], rig: Rig, default_repo: str) -> list[str]:
    """The other sources to pin out: only those apt can pin by origin, and only while the
    configured source offers the driver itself (never pin out the only source)."""
    if not offers_driver(policies, rig, default_repo):
        return []
    return sorted(uri for uri in other_sources(policies, rig, default_repo) if pinnable(uri))


def unbuilt_kernels(kernels: Kernels, dkms: DkmsStatus) -> list[str]:
    """Installed kernels without an nvidia module that DKMS installed for them, when DKMS
    manages an nvidia module at all (nvidia, nvidia-current, nvidia-srv ...)."""
    nvidia = [m for m in dkms.modules if m.module.startswith("nvidia")]
    if not nvidia:
        return []
    done = {m.kernel for m in nvidia if m.state == "installed"}
    return [k for k in kernels.installed if k not in done]


def secure_boot_steps(rig: Rig, key: str | None) -> str:
    """What a person does so that a DKMS-built module loads with Secure Boot on."""
    if rig.platform == "ubuntu":
        create = "sudo update-secureboot-policy --new-key"
        enrol = "sudo update-secureboot-policy --enroll-key (it runs mokutil --import and asks " \
                "for a one-time password)"
    else:
        create = "sudo dkms generate_mok"
        enrol = f"sudo mokutil --import {key or DKMS_KEYS[0]} (it asks for a one-time password)"
    first = f"1) {create} (skip when {key} exists)" if key else f"1) {create}"
    return (
        f"{first}; 2) {enrol}; 3) reboot at the console: MOK Manager > Enroll MOK > Continue > "
        "Yes > the password > Reboot; 4) run the converge again. Or turn Secure Boot off in "
        "the firmware"
    )


def onboard_findings(rig: Rig, facts: Facts, rig_name: str, default_repo: str,
                     signed: bool = False) -> list[Finding]:
    """nouveau, Secure Boot and the DKMS key, headers, DKMS per kernel, other driver sources.

    Refused (before any change): Secure Boot on and the DKMS signing key not enrolled nor
    queued, while no nvidia module is loaded (`loaded`, the driver role's LoadedDriverVersion:
    a loaded module was accepted, so then it is a warning). The rest is drift a converge
    fixes (nouveau, headers) or reports (a kernel without a module), or a warning (another
    source offers the driver; DKMS errors). `signed`: the module is Ubuntu's prebuilt signed
    one (planned or installed), so the DKMS key does not matter.
    """
    if rig.platform == "wsl2":
        return []
    names = ("secure_boot", "kernels", "dkms", "nouveau", "driver_policy")
    if facts.missing(*names):
        return facts.missing(*names)
    found: list[Finding] = []
    sb: SecureBoot = facts.secure_boot or SecureBoot()
    if sb.enabled and not signed:
        key, state = sb.key_state()
        if state == "queued":
            found.append(drift("driver", f"Secure Boot is on; the DKMS key {key} is queued for "
                               "enrolment: confirm it at the console on the next boot (MOK "
                               "Manager > Enroll MOK)", key="driver_secure_boot"))
        elif state != "enrolled":
            what = {
                "no key": "no DKMS signing key exists yet",
                "unreadable": f"the DKMS signing key {key} could not be read (openssl x509)",
            }.get(state, f"the DKMS signing key {key} is not enrolled")
            steps = secure_boot_steps(rig, key)
            if rig.driver_secure_boot == "enroll" and state != "unreadable":
                found.append(drift(
                    "driver", f"Secure Boot is on and {what}; driver_secure_boot: enroll: the "
                    "converge makes the key when there is none and queues its enrolment "
                    f"(mokutil --import); one step is left, {CONSOLE_STEP}",
                    key="driver_secure_boot"))
            elif facts.loaded:  # the kernel took the loaded module: signed by a key it trusts
                found.append(warn(
                    "driver",
                    f"Secure Boot is on and {what}; the loaded nvidia module {facts.loaded} was "
                    "accepted, but a module DKMS builds next (a new kernel, a bump) would be "
                    f"refused. Steps: {steps}",
                    key="driver_secure_boot",
                ))
            else:
                found.append(error(
                    "driver",
                    f"Secure Boot is on and {what}: the kernel would refuse the DKMS-built "
                    f"nvidia module; allowed: an enrolled key. Steps: {steps}",
                    key="driver_secure_boot",
                ))
    nouveau: Nouveau | None = facts.nouveau  # None: not asked for (a capture without it)
    if nouveau is None:
        pass
    elif nouveau.loaded:
        after = "; the converge rebuilds the initramfs and reboots (allow_reboot)"
        if nouveau.blacklisted_by:
            found.append(drift("driver", "nouveau is loaded though blacklisted ("
                               f"{', '.join(nouveau.blacklisted_by)}): reboot pending{after}"))
        else:
            found.append(drift("driver", "nouveau is loaded and not blacklisted: the nvidia "
                               f"module cannot take the GPUs{after}"))
    elif not nouveau.blacklisted_by:
        found.append(drift("driver", "nouveau is not blacklisted: at a boot where the nvidia "
                           "module does not load, it would take the GPUs; the converge "
                           f"blacklists it ({NOUVEAU_CONF})"))
    kernels: Kernels = facts.kernels or Kernels()
    if kernels.own and kernels.running not in kernels.headers:
        found.append(drift("driver", f"no headers for the running kernel {kernels.running} "
                           f"(/lib/modules/{kernels.running}/build): DKMS builds nothing; the "
                           f"converge installs linux-headers-{kernels.running}"))
    dkms: DkmsStatus = facts.dkms or DkmsStatus()
    for kernel in unbuilt_kernels(kernels, dkms):
        found.append(drift("driver", f"kernel {kernel} has no nvidia module built by DKMS: "
                           "booting it gives no driver (dkms status)"))
    for failure in dkms.errors:
        found.append(warn("driver", f"dkms status: {failure.text}"))
    policies = facts.driver_policy or []
    targets = pin_targets(policies, rig, default_repo)
    for uri, offered in other_sources(policies, rig, default_repo).items():
        live = [version for version, priority in offered if priority >= 0]
        if not live:
            continue  # pinned out already (priority -1): apt will not take the driver there
        if uri in targets:
            fix = f"the converge pins it out ({OTHER_SOURCES_PREF})"
        elif not pinnable(uri):
            fix = "a local source cannot be pinned out by origin: remove it"
        else:
            fix = "not pinned while the configured source offers no driver: remove it"
        found.append(warn("driver", f"another apt source offers the driver: {uri} "
                          f"({', '.join(live)}); {fix}"))
    return found


def onboard_reads(packages: tuple[str, ...]) -> list[Read]:
    return [
        Read("secure_boot", SecureBootFact, "Secure Boot state (mokutil)"),
        Read("kernels", KernelsFact, "kernels and headers"),
        Read("dkms", DkmsStatusFact, "dkms status"),
        Read("nouveau", NouveauFact, "loaded modules (nouveau)"),
        Read("driver_policy", AptPolicyFact, "apt sources of the driver (apt-cache policy)",
             (("packages", packages),)),
    ]


# --- operations -------------------------------------------------------------------------------


@operation()
def enroll_dkms_key(rig: Rig):
    """
    With Secure Boot on and `driver_secure_boot: enroll`: make DKMS's signing key when there is
    none (SIGNING_KEYS) and queue its enrolment with mokutil --import, so that one step is left,
    at the console at the next boot (CONSOLE_STEP). Nothing when Secure Boot is off or unknown,
    or the key is enrolled or queued already.

    + rig: the rig's validated host data (driver_secure_boot, platform)

    The one-time password is drawn on the rig, written to MOK_PASSWORD (0600) and handed to
    mokutil on its standard input: it is in no command line, no log and no output.
    """
    boot = once(SecureBootFact)
    key, state = boot.key_state()
    if not boot.enabled or rig.driver_secure_boot != "enroll" or state in ("enrolled", "queued"):
        host.noop("no DKMS key to enrol" + (f": {key} is {state}" if key else ""))
        return
    if state == "unreadable":
        yield refuse(f"the DKMS signing key {key} could not be read (openssl x509)")
        return
    if state == "no key":
        private, key = SIGNING_KEYS[rig.platform]
        yield StringCommand(
            f"mkdir -p {Path(key).parent} && (umask 077 && openssl req -new -x509 -newkey "
            "rsa:2048 -nodes -days 36500 -subj '/CN=rigbook DKMS module signing key/' "
            f"-outform DER -keyout {private} -out {key}) && chmod 644 {key}"
        )
    yield StringCommand(
        "umask 077 && pw=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \\n') && "
        f"printf '%s\\n' \"$pw\" > {MOK_PASSWORD} && "
        "printf '%s\\n%s\\n' \"$pw\" \"$pw\" | mokutil --import", QuoteString(key),
    )
    yield notice(f"the DKMS signing key {key} is queued for enrolment; {CONSOLE_STEP}")


@operation()
def blacklist_nouveau():
    """
    Blacklist nouveau (NOUVEAU_CONF), rebuild the initramfs when the file changed, and record a
    pending reboot (rigbook.core.reboot's REBOOT_MARKER) while nouveau is still loaded
    (NouveauFact).

    The initramfs is rebuilt with update-initramfs where the rig has it (Debian, Ubuntu);
    the reboot itself is the driver role's reboot gate (allow_reboot).
    """
    loaded = once(NouveauFact).loaded
    changed = False
    for command in put_commands(src=str(TEMPLATES / "blacklist-nouveau.conf"),
                                dest=NOUVEAU_CONF, mode="644"):
        changed = True
        yield command
    if changed:
        yield StringCommand(
            "if command -v update-initramfs >/dev/null 2>&1; then update-initramfs -u; fi"
        )
    reason = "nouveau is loaded (blacklisted, the initramfs rebuilt)"
    if loaded and reason not in host.get_fact(RebootMarker):
        yield record_reboot(reason)
    elif not changed:
        host.noop("nouveau is blacklisted" + ("" if loaded else " and not loaded"))


@operation()
def kernel_headers():
    """
    Install linux-headers-RELEASE for the running kernel (uname -r) when its headers are
    missing (KernelsFact). A kernel that is not this system's (a container runs its host's
    kernel: no /lib/modules/RELEASE here) needs none.
    """
    kernels = once(KernelsFact)
    running = kernels.running
    if not kernels.own:
        host.noop(f"kernel {running or '?'} is not this system's (no /lib/modules/{running}): "
                  "nothing to build for")
        return
    if running in kernels.headers:
        host.noop(f"headers for {running} are installed")
        return
    if not _RELEASE.fullmatch(running):
        yield refuse(f"not a kernel release: {running!r}")
        return
    yield StringCommand(noninteractive_apt("install"), QuoteString(f"linux-headers-{running}"))


def pinnable(uri: str) -> bool:
    """A source that apt can pin out by origin (its host name): http(s) and the like."""
    return bool(_HOSTNAME.fullmatch(urlsplit(uri).hostname or "")) and not uri.startswith("file:")


@dataclass(frozen=True)
class OtherSourcesConf:
    """What other-sources.pref.j2 renders: origins (host names) pinned out for the globs."""

    origins: tuple[str, ...]
    globs: tuple[str, ...]


@operation()
def pin_out_sources(rig: Rig, packages: tuple[str, ...], default_repo: str,
                    globs: tuple[str, ...]):
    """
    Pin the driver packages of other sources out (priority -1 per origin host name), or remove
    that file when no other source offers the driver.

    + rig: the rig's validated host data (which source is its own)
    + packages: the driver's metapackage, asked about with apt-cache policy (AptPolicyFact)
    + default_repo: the driver's repository when the host data names none (Debian)
    + globs: the driver package globs (roles/driver.py DRIVER_PACKAGE_GLOBS)

    Read when it runs, after the driver's own source is in. Only while that source offers the
    driver itself, and only http(s) sources: a local (file:) one has no origin host to pin, and
    the check says to remove it.
    """
    policies = once(AptPolicyFact, packages=tuple(packages))
    uris = pin_targets(policies, rig, default_repo)
    origins = tuple(sorted({urlsplit(uri).hostname or "" for uri in uris}))
    if not origins:
        yield from absent_commands(path=OTHER_SOURCES_PREF)
        return
    changed = False
    for command in template_commands(src=str(TEMPLATES / "other-sources.pref.j2"),
                                     dest=OTHER_SOURCES_PREF, mode="644",
                                     cfg=OtherSourcesConf(origins, tuple(globs))):
        changed = True
        yield command
    if changed:
        yield notice(f"other apt sources offer the NVIDIA driver: {', '.join(origins)}; "
                     f"their driver packages are pinned out ({OTHER_SOURCES_PREF})")
