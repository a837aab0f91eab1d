"""The NVIDIA driver: the version the inventory names, installed, held, moved only on purpose.

An unattended driver upgrade under running engines breaks every cu13 venv, and recovering
means a rebuild, not a restart. So rigbook owns the driver:

- `driver(rig)` (deploys/rig.py) installs the pinned driver from the platform's source, holds
  every driver package, blacklists them in unattended-upgrades, keeps persistence mode on,
  writes module options and reboots only when allowed. It never moves an installed driver: a
  different installed version fails that rig and names the deploy that moves it.
- `driver_bump(rig)` (deploys/driver.py) is that deploy: unhold, install the target, hold
  again, reboot when allowed, and check that nvidia-smi reports the target.
- WSL2 gets no Linux driver at all; the role checks the Windows driver's nvidia-smi instead.
- On an Ubuntu rig with Secure Boot on, the kernel module is Ubuntu's prebuilt signed one where
  the rig's sources offer it for the running kernel and the driver planned (`kernel_module`);
  else DKMS, whose module needs the enrolled MOK.

The platform branch is chosen once (`plan_driver`), from the host data cross-checked with the
distribution the rig reports. Versions are pinned by their upstream part with an apt version
glob (`nvidia-open=580.95.05-*`: apt resolves it against its own candidate list and fails when
nothing matches, so Ubuntu's 580.196.07-0ubuntu0.24.04.1 and the NVIDIA repository's
580.95.05-1 need no lookup table) plus an apt preferences pin with the same glob, so that the
dependencies apt pulls in resolve to the same version instead of the newest one.
docs/driver.md describes the whole role; docs/runbooks/driver-bump.md the bump.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyinfra import host, state
from pyinfra.api import QuoteString, StringCommand, deploy, operation
from pyinfra.facts.apt import noninteractive_apt
from pyinfra.facts.server import Arch, LinuxDistribution
from pyinfra.operations import apt, systemd
from pyinfra.operations.util import any_changed

from rigbook import FILES
from rigbook.core.apt import (
    BUMP_SCRIPT,
    AptHolds,
    AptVersions,
    DpkgInstalled,
    DpkgInterrupted,
    DpkgWork,
    apt_hold,
    finish_interrupted,
    upstream_version,
)
from rigbook.core.checks import Check, Facts, Finding, Read, drift, error, warn
from rigbook.core.checks import refusal as refusal_finding
from rigbook.core.errors import RigbookError
from rigbook.core.facts import GPUS_READ, WSL_NVIDIA_SMI, NvidiaGpus
from rigbook.core.managed import absent, absent_commands, expect, put, put_commands
from rigbook.core.messages import notice, refuse, refused, warn_once
from rigbook.core.reboot import (
    DRIVER_VERSION,
    LoadedDriverVersion,
    RebootMarker,
    reboot_and_wait,
    reboot_reasons,
    record_reboot,
)
from rigbook.core.render import template, template_commands
from rigbook.core.runfacts import once
from rigbook.core.spec import Rig
from rigbook.core.units import booted, service
from rigbook.roles.driver_source import (
    SOURCE_READ,
    DriverSourceFact,
    Foreign,
    foreign_driver,
    foreign_findings,
    running_version,
)
from rigbook.roles.kernel import (
    NOUVEAU_CONF,
    OTHER_SOURCES_PREF,
    AptPolicy,
    AptPolicyFact,
    SecureBoot,
    SecureBootFact,
    SignedModules,
    SignedModulesFact,
    blacklist_nouveau,
    enroll_dkms_key,
    kernel_headers,
    kernel_series,
    modules_prefix,
    offers_driver,
    onboard_findings,
    onboard_reads,
    pin_out_sources,
)
from rigbook.roles.serving import hold_serving
from rigbook.roles.venvs import VenvBuilds
from rigbook.roles.wsl import WSL_READ, Wsl, WslSignals, check_platform, platform_problem

TEMPLATES = FILES / "driver"

#: What rigbook treats as the driver: holds, the unattended-upgrades blacklist and the apt pin
#: all use these. Python regular expressions applied with re.match (anchored at the start), as
#: unattended-upgrades applies its Package-Blacklist; plain prefixes, so `prefix*` is the same
#: set as an apt glob. Broad on purpose: libnvidia-container and the like move with the driver.
DRIVER_PACKAGE_PATTERNS = (
    "nvidia-",
    "libnvidia-",
    "cuda-drivers",
    "libcuda1",
    "libnvcuvid",
    "libnvoptix",
    "libegl-nvidia",
    "libgles-nvidia",
    "libglx-nvidia",
    "libgl1-nvidia",
    "firmware-nvidia-",
    "xserver-xorg-video-nvidia",
    "linux-modules-nvidia-",
    "linux-objects-nvidia-",
    "linux-signatures-nvidia-",
)

#: The same set as apt package globs, for the preferences pin.
DRIVER_PACKAGE_GLOBS = tuple(f"{pattern}*" for pattern in DRIVER_PACKAGE_PATTERNS)

#: Packages whose version is the driver's version (Ubuntu's per-branch names, the NVIDIA
#: repository's Debian-style split names): what "the installed driver" means.
_VERSION_CARRIERS = re.compile(
    r"^(libnvidia-compute-\d+(-server)?|nvidia-utils-\d+(-server)?|nvidia-smi|libnvidia-ml1"
    r"|libcuda1|nvidia-kernel(-open)?-dkms|nvidia-open|cuda-drivers(-\d+)?)$"
)

#: Packages that are a Linux driver (kernel module, libcuda, nvidia-smi): none belongs in WSL2,
#: where they shadow the Windows driver's /usr/lib/wsl/lib. CUDA toolkits and the container
#: toolkit are not among them.
_LINUX_DRIVER = re.compile(
    r"^(nvidia-(driver|utils|dkms|kernel|headless|compute-utils|open$|smi$)"
    r"|libnvidia-(compute|ml)|libcuda1|cuda-drivers|linux-(modules|objects|signatures)-nvidia-)"
)

#: NVIDIA's CUDA repository for Debian 12 (the only release whose path is confirmed:
#: docs/sources.md, "Driver branches and repositories").
CUDA_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/"
CUDA_KEYRING_DEB = CUDA_REPO + "cuda-keyring_1.1-1_all.deb"
#: sha256 of CUDA_KEYRING_DEB: the trust anchor of the driver source is installed only when it
#: matches. NVIDIA's Packages index was not at hand; the value is the one Google pins for
#: debian 12 (https://github.com/GoogleCloudPlatform/compute-gpu-installation/blob/main/linux/
#: cuda_installer/config.py, NVIDIA_KEYRING_SHA256_SUMS), and other public scripts check the
#: same value against this very URL with `sha256sum -c`.
CUDA_KEYRING_SHA256 = "e7f219eab6fe4819cdb5c15b98233dc3420302d9c00883219cd3d896857cf48d"
CUDA_KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"
#: The one-line source cuda-keyring may drop beside ours; removed so apt sees the repo once.
CUDA_KEYRING_LIST = "/etc/apt/sources.list.d/cuda-debian12-x86_64.list"

SOURCES = "/etc/apt/sources.list.d/rigbook-nvidia.sources"
PREFERENCES = "/etc/apt/preferences.d/rigbook-nvidia.pref"
BLACKLIST = "/etc/apt/apt.conf.d/51rigbook-nvidia-blacklist"
PERSISTENCED = "nvidia-persistenced.service"
PERSISTENCED_DROPIN = "/etc/systemd/system/nvidia-persistenced.service.d/override.conf"
MODPROBE_CONF = "/etc/modprobe.d/rigbook-nvidia.conf"
#: Where the bump's apt step (BUMP_SCRIPT, installed by the bump itself) logs.
BUMP_LOGS = "/var/log/rigbook/driver-bump-*.log"
#: The transient unit the apt step runs in, outside the SSH login (files/driver/bump.sh).
BUMP_UNIT = "rigbook-driver-bump.service"

#: A Debian package name as dpkg reports it (Debian policy 5.6.1), with an optional :arch.
_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]+(:[a-z0-9]+)?")
_SHA256 = re.compile(r"[0-9a-f]{64}")


# --- facts ---------------------------------------------------------------------------------


# --- what the packages say -----------------------------------------------------------------


def is_driver_package(name: str) -> bool:
    """True for a package rigbook holds and blacklists (unattended-upgrades' re.match rule)."""
    return any(re.match(pattern, name) for pattern in DRIVER_PACKAGE_PATTERNS)


def driver_packages(installed: dict[str, str]) -> list[str]:
    """The installed packages that belong to the driver, sorted."""
    return sorted(name for name in installed if is_driver_package(name))


def driver_versions(installed: dict[str, str]) -> set[str]:
    """Upstream versions of the installed driver (more than one: a half-moved driver)."""
    return {
        upstream_version(version)
        for name, version in installed.items()
        if _VERSION_CARRIERS.match(name)
    }


def wanted(rig: Rig) -> str:
    """What the inventory asks for, in words: '580.95.05' or 'branch 580'."""
    return rig.driver_version or f"branch {rig.driver_branch}"


def version_matches(rig: Rig, upstream: str) -> bool:
    """True when an installed upstream version is what the inventory asks for."""
    if rig.driver_version:
        return upstream == rig.driver_version
    return upstream.split(".", 1)[0] == str(rig.driver_branch)


def pending_reboot(read=once) -> list[str]:
    """reboot_reasons() for the current host, from its facts at this moment of the run (`read`:
    `host.get_fact` after the operation's own reboot, which `once` would not see)."""
    return reboot_reasons(
        driver_versions(read(DpkgInstalled)), read(LoadedDriverVersion), read(RebootMarker),
    )


# --- the platform branch, chosen once ------------------------------------------------------


@dataclass(frozen=True)
class AptSource:
    """The deb822 source of the driver (Debian): a flat repository, signed or trusted."""

    uri: str
    trusted: bool
    keyring: str = CUDA_KEYRING


@dataclass(frozen=True)
class DriverPlan:
    """What one rig's platform branch chose: packages, their version glob, their source.
    `unpinned`: packages installed without the glob (Ubuntu's prebuilt signed modules carry the
    kernel's version, not the driver's); `module`: where the kernel module comes from, in words."""

    platform: str
    packages: tuple[str, ...] = ()
    version: str = ""
    source: AptSource | None = None
    unpinned: tuple[str, ...] = ()
    module: str = ""


@dataclass(frozen=True)
class KernelModule:
    """Where an Ubuntu rig's nvidia module comes from: `signed`, Ubuntu's prebuilt signed
    modules (a package name), or None, DKMS; `says` is the choice in words, for the plan."""

    signed: str | None
    says: str


def version_glob(rig: Rig) -> str:
    """The apt version glob of the driver: '580.95.05-*' (exact upstream) or '580.*' (branch)."""
    return f"{rig.driver_version}-*" if rig.driver_version else f"{rig.driver_branch}.*"


def plan_driver(rig: Rig, name: str, distro: dict, wsl: WslSignals, arch: str,
                module: KernelModule | None = None) -> DriverPlan:
    """Choose the platform branch once; RigbookError when the rig and the host disagree.

    `distro` is pyinfra's LinuxDistribution fact, `wsl` rigbook.roles.wsl.Wsl, `arch` Arch (uname
    -m),
    `module` on Ubuntu kernel_module()'s choice (None: DKMS).
    """
    check_platform(name, rig.platform, wsl)
    if rig.platform == "wsl2":
        return DriverPlan(platform="wsl2")
    reported = distro.get("name") or "an unknown distribution"
    release = (distro.get("release_meta") or {}).get("VERSION_ID", "")
    expected = {"ubuntu": "Ubuntu", "debian": "Debian"}[rig.platform]
    if reported != expected:
        raise RigbookError(
            f"{name}: platform: declared {rig.platform}, but the host reports {reported} {release}"
        )
    if rig.platform == "ubuntu":  # which branches and versions: the rig's archive (offered)
        infix = "-server" if rig.driver_server else ""
        flavour = "-open" if rig.driver_open else ""
        # The kernel module named, not left to apt: on 26.04 the prebuilt linux-modules-nvidia-B-
        # open-FLAVOUR packages Provide nvidia-dkms-B-open, and apt 3 picked the aws one (with
        # its kernel) for nvidia-driver-595-open on a rig with no kernel package installed.
        packages = (
            f"nvidia-driver-{rig.driver_branch}{infix}{flavour}",
            f"nvidia-utils-{rig.driver_branch}{infix}",
        )
        module = module or KernelModule(None, f"DKMS ({dkms_package(rig)})")
        if module.signed:
            return DriverPlan("ubuntu", packages, version_glob(rig), unpinned=(module.signed,),
                              module=module.says)
        return DriverPlan("ubuntu", (*packages, dkms_package(rig)), version_glob(rig),
                          module=module.says)
    # debian
    if rig.driver_repo_uri is None:
        if distro.get("major") != 12 or arch != "x86_64":
            raise RigbookError(
                f"{name}: platform: NVIDIA's CUDA repository is set up for Debian 12 x86_64 "
                f"only, the host reports {reported} {release} {arch}; set driver_repo_uri "
                "to a repository for it"
            )
        source = AptSource(CUDA_REPO, trusted=False)
    else:
        source = AptSource(rig.driver_repo_uri, trusted=rig.driver_repo_trusted)
    meta = "nvidia-open" if rig.driver_open else "cuda-drivers"
    return DriverPlan("debian", (meta, "nvidia-persistenced"), version_glob(rig), source)


def dkms_package(rig: Rig) -> str:
    """Ubuntu's DKMS package of the driver: nvidia-dkms-580[-server][-open]."""
    return (f"nvidia-dkms-{rig.driver_branch}{'-server' if rig.driver_server else ''}"
            f"{'-open' if rig.driver_open else ''}")


def signed_modules_args(rig: Rig) -> dict:
    """SignedModulesFact's arguments for the rig's driver."""
    return {"branch": rig.driver_branch, "server": rig.driver_server, "open_": rig.driver_open}


def kernel_module(rig: Rig, secure_boot: SecureBoot | None, modules: SignedModules | None,
                  policies: list[AptPolicy], installed: dict[str, str]) -> KernelModule:
    """Ubuntu, Secure Boot on: Ubuntu's prebuilt signed modules for the running kernel's flavour
    when the rig's sources offer them for the very driver version the plan installs and for a
    kernel of the running one's series (signed by Ubuntu: no MOK enrolment); else DKMS, whose
    module needs the enrolled key. An installed DKMS package stays: the converge never moves a
    driver, nor do installed signed modules (with Secure Boot off since, too). The metapackage
    carries the kernel's version, so it gets no version glob."""
    dkms = dkms_package(rig)
    prefix = modules_prefix(**signed_modules_args(rig))
    kept = sorted((kernel_series(name.removeprefix(prefix)) is not None, name)
                  for name in installed if name.startswith(prefix))
    if kept:  # the flavour's metapackage before a kernel's own package
        return KernelModule(kept[0][1], f"Ubuntu's prebuilt signed modules ({kept[0][1]}, "
                                        "installed)")
    if not (secure_boot and secure_boot.enabled):
        return KernelModule(None, f"DKMS ({dkms})")
    modules = modules or SignedModules()
    why = None
    driver = next((v for v in offered(rig, policies) if version_matches(rig, upstream_version(v))),
                  None)
    stands_in = modules.provides.get(dkms)
    series = kernel_series(modules.running)
    if dkms in installed:
        why = f"{dkms} is installed"
    elif not modules.package:
        why = (f"the rig's sources offer no {prefix}FLAVOUR for the running kernel "
               f"{modules.running or '?'}")
    elif not stands_in or upstream_version(stands_in) != upstream_version(driver or ""):
        why = (f"{modules.package} {modules.version} stands in for {dkms} {stands_in or '(none)'}"
               f", not for the {driver or wanted(rig)} the plan installs")
    elif series is None or kernel_series(modules.kernel) != series:
        why = (f"{modules.package} is for kernel {modules.kernel or '?'}, not of the running "
               f"kernel's series ({modules.running})")
    if why:
        return KernelModule(None, f"DKMS ({dkms}): Secure Boot is on, no prebuilt signed module "
                                  f"({why}); the DKMS key must be enrolled")
    after = "" if modules.kernel == modules.running else (
        f", which it installs: the module loads once the rig boots it (it runs {modules.running})")
    return KernelModule(modules.package, f"Ubuntu's prebuilt signed modules ({modules.package} "
                                         f"for kernel {modules.kernel}{after}; Secure Boot: no "
                                         f"MOK enrolment needed) instead of {dkms}")


def refusal(rig: Rig, installed: set[str]) -> str | None:
    """Why the converge must leave this rig's driver alone, or None: it never moves a driver."""
    if all(version_matches(rig, version) for version in installed):
        return None
    return (
        f"installed {', '.join(sorted(installed))}, inventory pins {wanted(rig)}; allowed: the "
        "installed driver, or move it on purpose with deploys/driver.py"
    )


def bump_refusal(target: str, running: str | None, installed: set[str]) -> str | None:
    """Why the bump has nothing to do, or None. A target that is installed but not running
    (a bump without reboot) or running but not installed (packages moved since) is not done."""
    if running == target and installed == {target}:
        return f"driver {target} is already running: nothing to bump"
    return None


def _plan(rig: Rig) -> DriverPlan:
    module = kernel_module(
        rig, once(SecureBootFact), once(SignedModulesFact, **signed_modules_args(rig)),
        once(AptPolicyFact, packages=(main_package(rig),)), once(DpkgInstalled),
    ) if rig.platform == "ubuntu" else None
    return plan_driver(rig, host.name, once(LinuxDistribution), once(Wsl), once(Arch), module)


# --- operations ----------------------------------------------------------------------------


@operation()
def report(message: str):
    """
    Say what the operator must do next (a warning, once); changes nothing.

    + message: the text
    """
    warn_once(message)
    yield from ()


@operation(is_idempotent=False)
def next_steps(message: str):
    """
    Say what the operator must run next, once the rig got here (a warning when it runs).

    + message: the text
    """
    yield notice(message)


@operation()
def install_driver(packages: list[str] | tuple[str, ...], version: str,
                   unpinned: list[str] | tuple[str, ...] = ()):
    """
    Install the driver packages that are missing, each pinned to an apt version glob.

    + packages: the branch's packages (e.g. nvidia-open, nvidia-persistenced)
    + version: apt version glob, '580.95.05-*' or '580.*'
    + unpinned: packages installed without the glob (Ubuntu's prebuilt signed modules, whose
      version is the kernel's; what they depend on pins them to the driver's)

    Installed packages are left as they are: the converge never moves a driver.
    """
    installed = once(DpkgInstalled)
    missing = [name for name in (*packages, *unpinned) if name not in installed]
    if not missing:
        have = ", ".join(f"{name} {installed[name]}" for name in (*packages, *unpinned))
        host.noop(f"installed: {have}")
        return
    yield StringCommand(noninteractive_apt("install"), *(
        QuoteString(name if name in unpinned else f"{name}={version}") for name in missing))


@operation()
def hold_driver(held: bool = True):
    """
    Hold (or release) every installed driver package, as they are at this moment of the run.

    + held: True to hold, False to release
    """
    names = driver_packages(once(DpkgInstalled))
    if not names:
        host.noop("no driver packages are installed")
        return
    yield from apt_hold._inner(packages=names, held=held)


@operation()
def move_driver(packages: list[str] | tuple[str, ...], target: str):
    """
    Move the installed driver to `target` (the bump): release, install, hold again.

    + packages: the branch's packages, installed when missing
    + target: upstream driver version, e.g. 580.159.04

    Moves every installed driver package that carries the old driver's version and that apt
    offers at the target (apt-cache madison), so nothing is left half-moved; a package named
    after the old version (Ubuntu's nvidia-firmware-580-580.95.05) stays, held.

    The apt step runs on the rig as files/driver/bump.sh (installed at BUMP_SCRIPT) in a
    transient unit of its own (BUMP_UNIT), which the script starts and waits for: it holds the
    packages again on any exit, apt failing or a signal included, and neither a dropped SSH
    connection nor the end of the login (logind's KillUserProcesses=yes) reaches it or apt.
    It logs to BUMP_LOGS.
    """
    if not DRIVER_VERSION.fullmatch(target):
        yield refuse(f"not a driver version: {target!r}")
        return
    installed = once(DpkgInstalled)
    old = driver_versions(installed) - {target}
    candidates = [
        name
        for name, version in installed.items()
        if is_driver_package(name) and upstream_version(version) in old
    ]
    available = host.get_fact(AptVersions, packages=sorted(set(candidates) | set(packages)))

    def offered(name: str) -> bool:
        return any(upstream_version(version) == target for version in available.get(name, ()))

    if not offered(packages[0]):
        have = ", ".join(available.get(packages[0], ())) or "none"
        yield refuse(
            f"{packages[0]} {target} is not offered by the configured apt sources "
            f"(offered: {have})"
        )
        return
    moving = sorted(name for name in candidates if offered(name))
    missing = [name for name in packages if name not in installed]
    if not moving and not missing:
        host.noop(f"driver {target} is installed")
        return
    wanted_names = moving + missing
    odd = [name for name in wanted_names if not _PACKAGE.fullmatch(name)]
    if odd:
        yield refuse(f"not Debian package names: {', '.join(map(repr, odd))}")
        return
    yield from put_commands(src=str(TEMPLATES / "bump.sh"), dest=BUMP_SCRIPT, mode="755")
    yield StringCommand(
        BUMP_SCRIPT, "--detach", *(QuoteString(f"{name}={target}-*") for name in wanted_names)
    )


#: The download where a rig has neither curl nor wget (a minimal Debian): its python3.
_FETCH = "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])"


def keyring_command(url: str, sha256: str) -> StringCommand:
    """Download `url` to a temp file and install it with dpkg only when its sha256 is `sha256`
    (64 hex digits, checked by the caller). The temp file goes on every exit; a mismatch fails
    naming the URL and both hashes."""
    src = QuoteString(url)
    return StringCommand(
        "deb=$(mktemp) && trap 'rm -f \"$deb\"' EXIT &&",
        '{ if command -v curl >/dev/null; then curl -fsSL -o "$deb"', src,
        '; elif command -v wget >/dev/null; then wget -q -O "$deb"', src,
        "; else python3 -c", QuoteString(_FETCH), src, '"$deb"; fi; } &&',
        f'if echo "{sha256}  $deb" | sha256sum -c --status; then',
        'dpkg --force-confdef --force-confold -i "$deb"; else',
        "printf '%s: sha256 mismatch: expected %s, actual %s; not installed\\n'", src, sha256,
        '"$(sha256sum < "$deb" | cut -d" " -f1)" >&2; exit 1; fi',
    )


@operation()
def cuda_keyring(url: str = CUDA_KEYRING_DEB, sha256: str = CUDA_KEYRING_SHA256):
    """
    Install NVIDIA's cuda-keyring package (the repository's signing key) unless it is installed.

    + url: where the .deb is
    + sha256: its pinned sha256; the package is installed only when the download matches
    """
    if "cuda-keyring" in once(DpkgInstalled):
        host.noop("cuda-keyring is installed")
        return
    if not _SHA256.fullmatch(sha256):
        yield refuse(f"not a sha256: {sha256!r}")
        return
    yield keyring_command(url, sha256)


@operation()
def modprobe_options(options: dict[str, str]):
    """
    Write the nvidia module options (MODPROBE_CONF); remove the file when there are none.

    + options: module parameters, e.g. {"NVreg_DynamicPowerManagement": "0x00"}

    A change takes effect when the module loads again, so it also records a pending reboot.
    """
    if options:
        commands = template_commands(
            src=str(TEMPLATES / "modprobe.conf.j2"), dest=MODPROBE_CONF, mode="644",
            cfg=ModprobeConf(dict(options)),
        )
    else:
        commands = absent_commands(path=MODPROBE_CONF)
    changed = False
    for command in commands:
        changed = True
        yield command
    if changed:
        yield record_reboot(f"nvidia module options changed ({MODPROBE_CONF})")


@dataclass(frozen=True)
class ModprobeConf:
    """What modprobe.conf.j2 renders."""

    options: dict[str, str]


@operation()
def reboot_for_driver(allow_reboot: bool = False):
    """
    Reboot when the installed driver is not the one running, only if allowed.

    + allow_reboot: host data allow_reboot; when False a pending reboot is reported instead

    Pending means: the packages' driver version differs from the loaded module's, or a change
    recorded in REBOOT_MARKER (module options) waits for the module to load again. After the
    reboot the same check must pass, or the rig fails: a module that does not load is not
    fixed by rebooting again.
    """
    reasons = pending_reboot()
    if not reasons:
        host.noop("no reboot pending: the running driver is the installed one")
        return
    if not allow_reboot:
        warn_once(f"reboot needed ({'; '.join(reasons)}); allow_reboot is false: reboot the rig")
        return
    yield from reboot_and_wait()
    # The generator resumes only once the reboot commands ran (and pyinfra reconnected).
    if state.is_executing:
        still = pending_reboot(host.get_fact)
        if still:
            yield refuse(f"still after the reboot: {'; '.join(still)}")


@operation()
def verify_driver(version: str):
    """
    Fail loudly unless nvidia-smi reports `version`.

    + version: upstream driver version, e.g. 580.159.04
    """
    probe = once(NvidiaGpus)
    if probe is not None and probe.ok and probe.driver_version == version:
        host.noop(f"nvidia-smi ({probe.smi}) reports driver {version} on {len(probe.gpus)} GPU(s)")
        return
    if probe is None:
        seen = "there is no nvidia-smi"
    elif probe.ok:
        seen = f"nvidia-smi reports {probe.driver_version}"
    else:
        seen = f"nvidia-smi fails: {probe.error}"
    reasons = pending_reboot()
    after = f"; reboot needed: {'; '.join(reasons)}" if reasons else ""
    yield refuse(f"driver {version} is not running: {seen}{after}")


@operation()
def check_wsl():
    """
    WSL2: the Windows driver serves the GPUs; check its nvidia-smi and that no Linux driver
    shadows it. Installs nothing (NVIDIA: never install a Linux driver inside WSL2).
    """
    linux = sorted(name for name in once(DpkgInstalled) if _LINUX_DRIVER.match(name))
    if linux:
        yield refuse(
            f"Linux NVIDIA driver packages are installed in WSL2 ({', '.join(linux)}); they "
            f"shadow the Windows driver's {WSL_NVIDIA_SMI} and libcuda. Remove them: "
            f"apt-get purge {' '.join(linux)}"
        )
        return
    probe = once(NvidiaGpus)
    if probe is None or probe.smi != WSL_NVIDIA_SMI:
        found = "no nvidia-smi" if probe is None else f"only {probe.smi}"
        yield refuse(
            f"WSL2: {WSL_NVIDIA_SMI} does not answer ({found}): install or update the NVIDIA "
            "driver on Windows"
        )
    elif not probe.ok:
        yield refuse(f"WSL2: {WSL_NVIDIA_SMI} fails: {probe.error}")
    else:
        host.noop(
            f"WSL2: the Windows driver {probe.driver_version} serves {len(probe.gpus)} GPU(s) "
            f"({WSL_NVIDIA_SMI}); no Linux driver is installed, by design"
        )


# --- deploys -------------------------------------------------------------------------------


def _apt_source(plan: DriverPlan):
    """Debian: the driver's repository (and its key); apt-get update only when it changed."""
    if plan.source is None:
        return
    changes = []
    if not plan.source.trusted:
        changes.append(cuda_keyring(name="NVIDIA repository key (cuda-keyring)"))
        changes.append(absent(
            name="No second copy of the NVIDIA source", path=CUDA_KEYRING_LIST,
        ))
    changes.append(template(
        name="NVIDIA driver apt source", src=str(TEMPLATES / "nvidia.sources.j2"), dest=SOURCES,
        mode="644", cfg=plan.source,
    ))
    apt.update(name="apt-get update (driver source changed)", _if=any_changed(*changes))


@dataclass(frozen=True)
class PinConf:
    """What preferences.j2 renders."""

    version: str
    pinned_by: str
    globs: tuple[str, ...]


def _pin(rig: Rig, plan: DriverPlan):
    template(
        name=f"Pin the driver packages to {plan.version}", src=str(TEMPLATES / "preferences.j2"),
        dest=PREFERENCES, mode="644",
        cfg=PinConf(plan.version, "driver_version" if rig.driver_version else "driver_branch",
                 DRIVER_PACKAGE_GLOBS),
    )


@dataclass(frozen=True)
class BlacklistConf:
    """What blacklist.j2 renders."""

    patterns: tuple[str, ...]


def _hold():
    hold_driver(name="Hold the driver packages (apt-mark hold)")
    template(
        name="Blacklist the driver in unattended-upgrades", src=str(TEMPLATES / "blacklist.j2"),
        dest=BLACKLIST, mode="644", cfg=BlacklistConf(DRIVER_PACKAGE_PATTERNS),
    )


def _persistence(rig: Rig):
    """Persistence mode through the daemon (Ubuntu ships it off); started unless a reboot waits.
    Without systemd there is no daemon to run: the power role reports persistence as it is."""
    if not booted():
        return
    if rig.driver_persistence:
        dropin = put(
            name="Persistence mode on (nvidia-persistenced drop-in)",
            src=str(TEMPLATES / "persistenced-override.conf"), dest=PERSISTENCED_DROPIN, mode="644",
        )
    else:
        dropin = absent(
            name="Persistence mode as the package ships it (no drop-in)",
            path=PERSISTENCED_DROPIN,
        )
    systemd.daemon_reload(name="systemctl daemon-reload (drop-in changed)", _if=dropin.did_change)
    # Restart decided at execution (_if), not with dropin.will_change: that would read the
    # drop-in's facts once more at plan time on every run.
    service(
        name="nvidia-persistenced started",
        service=PERSISTENCED,
        running=True,
        _if=lambda: not pending_reboot(),
    )
    service(
        name="nvidia-persistenced restarted (drop-in changed)",
        service=PERSISTENCED,
        running=True,
        restarted=True,
        _if=[dropin.did_change, lambda: not pending_reboot()],
    )


def _foreign_now(rig: Rig) -> Foreign | None:
    """foreign_driver for the current host, from its facts at this moment of the run."""
    return foreign_of(rig, Facts(
        driver_source=once(DriverSourceFact), loaded=once(LoadedDriverVersion),
        probe=once(NvidiaGpus), installed=once(DpkgInstalled),
        driver_policy=once(AptPolicyFact, packages=(main_package(rig),)),
    ))


def _keep_foreign(rig: Rig, foreign: Foreign, bump: bool = False):
    """A driver rigbook does not own: refused, or adopted and reported; nothing else planned.
    A bump to another version than the one it runs is refused by the same check."""
    facts = Facts(loaded=once(LoadedDriverVersion), probe=once(NvidiaGpus))
    findings = foreign_findings(rig, facts, foreign)
    if findings:
        refused(name="Keep the driver rigbook does not own", message=findings[0].text)
        return
    running = running_version(facts)  # the target itself in a bump: the check above says so
    adopted(
        name="Bump done: the target is running" if bump else "Adopted driver",
        message=(f"{foreign.found}: adopted (driver_foreign: adopt), running {running}; rigbook "
                 "installs, holds, bumps and blacklists nothing" + (
                     "; nothing to bump" if bump else "")),
    )


@operation()
def adopted(message: str):
    """
    Report a driver rigbook does not own and keeps as it is; changes nothing.

    + message: what runs and where it came from
    """
    host.noop(message)
    yield from ()


@deploy("NVIDIA driver")
def driver(rig: Rig):
    """Converge the driver: install what is missing, hold, blacklist, persistence, reboot."""
    try:
        plan = _plan(rig)
    except RigbookError as error:
        refused(name="Driver platform check", message=str(error))
        return
    if plan.platform == "wsl2":
        check_wsl(name="WSL2: the Windows driver serves the GPUs")
        return
    # First: apt refuses everything after a dead dpkg; what follows reads the packages again.
    finish_interrupted(name="Finish interrupted package work (dpkg --configure -a)")
    foreign = _foreign_now(rig)
    if foreign is not None:
        _keep_foreign(rig, foreign)
        return
    why = refusal(rig, driver_versions(once(DpkgInstalled)))
    if why:
        refused(name="Keep the installed driver", message=why)
        return
    _apt_source(plan)
    _onboard(rig)
    _pin(rig, plan)
    install_driver(
        name=f"Install the driver ({', '.join(plan.packages)} {plan.version}"
             f"{''.join(f', {name}' for name in plan.unpinned)}"
             f"{f'; kernel module: {plan.module}' if plan.module else ''})",
        packages=plan.packages, version=plan.version, unpinned=plan.unpinned,
    )
    _hold()
    expect(MODPROBE_CONF)
    modprobe_options(
        name="nvidia module options", options=dict(rig.driver_modprobe_options),
    )
    reboot_for_driver(name="Reboot into the installed driver", allow_reboot=rig.allow_reboot)
    _persistence(rig)


@deploy("NVIDIA driver bump")
def driver_bump(rig: Rig):
    """Move the driver to rig.driver_version: the deliberate counterpart of driver()."""
    target = rig.driver_version
    try:
        if target is None:
            raise RigbookError(
                f"{host.name}: driver_version: the bump needs a target; set it in the inventory "
                "or pass --data driver_version=580.159.04"
            )
        plan = _plan(rig)
    except RigbookError as error:
        refused(name="Driver bump input check", message=str(error))
        return
    if plan.platform == "wsl2":
        report(
            name="WSL2: nothing to bump",
            message="WSL2 runs the Windows driver: update it on Windows, then rebuild the venvs",
        )
        return
    busy = once(DpkgInterrupted).busy
    if busy:  # an earlier bump whose connection dropped, or apt: the packages are moving
        refused(name="Driver bump: no package work under way", message=(
            f"package work under way ({', '.join(busy)}): the bump plans on packages that are "
            f"moving; wait until it ends (systemctl status {BUMP_UNIT}, the logs "
            f"{BUMP_LOGS}), then run the bump again"))
        return
    foreign = _foreign_now(rig)
    if foreign is not None:
        _keep_foreign(rig, foreign, bump=True)
        return
    probe = once(NvidiaGpus)
    running = (probe.driver_version if probe is not None and probe.ok else None) or host.get_fact(
        LoadedDriverVersion
    )
    why = bump_refusal(target, running, driver_versions(once(DpkgInstalled)))
    if why:
        report(name="Bump done: the target is running", message=why)
        return
    hold_serving(name="Stop serving and hold it until the venvs match the new driver",
                 reason=f"serving is held by the driver bump to {target}: rebuild the venvs "
                        "(pyinfra INVENTORY deploys/venvs.py), which starts it again")
    _apt_source(plan)
    _pin(rig, plan)
    apt.update(name="apt-get update (to see the target)")
    move_driver(name=f"Move the driver to {target}", packages=plan.packages, target=target)
    _hold()
    reboot_for_driver(name="Reboot into the new driver", allow_reboot=rig.allow_reboot)
    verify_driver(name=f"nvidia-smi reports {target}", version=target)
    _persistence(rig)
    stale = [spec.name for spec in rig.venvs if built_for(spec.name) != target]
    if stale:
        next_steps(
            name="Next: rebuild the venvs",
            message=(
                f"driver {target} runs; venv(s) {', '.join(stale)} were built for another "
                "driver: rebuild them (pyinfra INVENTORY deploys/venvs.py), which starts "
                "serving again"
            ),
        )


def built_for(venv_name: str) -> str | None:
    """The driver the venv's current build was made for (its manifest), None when unbuilt."""
    manifest = host.get_fact(VenvBuilds, venv_name=venv_name).manifest
    return manifest.get("driver") if manifest else None


# --- the driver check ----------------------------------------------------------------------


def _plan_finding(rig: Rig, rig_name: str, facts: Facts) -> Finding | None:
    """plan_driver's refusal (a distribution, release or branch the rig cannot take), as a
    finding; None when the plan is fine or the platform check already says what is wrong."""
    if facts.wsl is None or facts.distro is None or platform_problem(rig.platform, facts.wsl):
        return None
    try:
        plan_driver(rig, rig_name, facts.distro, facts.wsl, facts.arch or "")
    except RigbookError as e:
        return refusal_finding("driver", e, rig_name)
    return None


def driver_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """The driver packages, holds, loaded module and running version against the inventory.

    Errors: a platform the driver cannot be planned for, and an installed driver other than the
    inventory's (the converge never moves a driver: deploys/driver.py does).
    """
    names = ("installed", "holds", "loaded", "reboot_marker", "distro", "arch", "driver_source")
    if facts.missing(*names):
        return facts.missing(*names)
    probe = facts.probe
    running = probe.driver_version if probe is not None and probe.ok else None
    installed = driver_versions(facts.installed or {})
    if rig.platform == "wsl2":
        return [drift("driver", f"Linux NVIDIA driver {', '.join(sorted(installed))} installed "
                      "in WSL2; it shadows the Windows driver")] if installed else []
    plan = _plan_finding(rig, rig_name, facts)
    found = [plan] if plan else []
    foreign = foreign_of(rig, facts)
    if foreign is not None:
        return found + foreign_findings(rig, facts, foreign)
    if not installed:
        found.append(drift("driver", f"no driver installed; inventory: {wanted(rig)}"))
    elif not all(version_matches(rig, version) for version in installed):
        found.append(error("driver", refusal(rig, installed), key="driver_version"))
    reasons = reboot_reasons(installed, facts.loaded, facts.reboot_marker or [])
    if reasons:
        found.append(drift("driver", f"reboot pending: {'; '.join(reasons)}"))
    elif running is not None and not version_matches(rig, running):
        found.append(drift("driver", f"running {running}, inventory: {wanted(rig)}"))
    unheld = [name for name in driver_packages(facts.installed or {})
              if name not in (facts.holds or set())]
    if unheld:
        found.append(drift("driver", f"not held: {', '.join(unheld)}"))
    return found


def dpkg_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """Package work a dead apt or dpkg left half-done, which the converge finishes before the
    driver (apt refuses everything until then); none while such work is under way. WSL2 gets
    no driver role, so nothing is finished there."""
    if rig.platform == "wsl2":
        return []
    if facts.missing("dpkg"):
        return facts.missing("dpkg")
    work: DpkgWork = facts.dpkg or DpkgWork()
    found = [warn("driver", f"dpkg --audit: {', '.join(work.broken)} need reinstalling "
                  "(apt-get install --reinstall), which dpkg --configure -a cannot do")
             ] if work.broken else []
    if not work.interrupted:
        return found
    if work.busy:
        return [*found, warn("driver", f"package work under way ({', '.join(work.busy)}): "
                             f"{work.describe()}; the converge leaves it to finish")]
    return [*found, drift("driver", f"dpkg was interrupted ({work.describe()}): the converge "
                          "runs dpkg --configure -a, then holds the driver")]


def foreign_of(rig: Rig, facts: Facts) -> Foreign | None:
    """foreign_driver from a check's facts (those of source_reads)."""
    return foreign_driver(rig, facts, CUDA_REPO, driver_versions(facts.installed or {}))


def driver_pending(rig: Rig, facts: Facts) -> bool:
    """The converge installs a driver or reboots into one in this run: the GPUs may appear."""
    installed = driver_versions(facts.installed or {})
    return rig.platform != "wsl2" and foreign_of(rig, facts) is None and (
        not installed or bool(reboot_reasons(installed, facts.loaded, facts.reboot_marker or []))
    )


INSTALLED_READ = Read("installed", DpkgInstalled, "installed packages")


def source_reads(rig: Rig) -> list[Read]:
    """What foreign_of needs: the driver's files and owners, its packages and their source,
    the loaded module and nvidia-smi."""
    return [
        *(read for read in onboard_reads((main_package(rig),)) if read.name == "driver_policy"),
        GPUS_READ,
        SOURCE_READ,
        INSTALLED_READ,
        Read("loaded", LoadedDriverVersion, "loaded driver module"),
    ]


def _driver_reads(rig: Rig, rig_name: str) -> list[Read]:
    return [
        *source_reads(rig),
        Read("holds", AptHolds, "apt holds"),
        Read("reboot_marker", RebootMarker, "reboot marker"),
        WSL_READ,
        Read("distro", LinuxDistribution, "Linux distribution"),
        Read("arch", Arch, "architecture"),
    ]


DRIVER = Check("driver", _driver_reads, driver_findings)


def _dpkg_reads(rig: Rig, rig_name: str) -> list[Read]:
    return [] if rig.platform == "wsl2" else [
        Read("dpkg", DpkgInterrupted, "interrupted package work")]


#: Said by the preflight (`said`): what the converge finishes before the driver.
DPKG = Check("interrupted package work", _dpkg_reads, dpkg_findings, said=True)


# --- onboarding a real box: nouveau, Secure Boot, DKMS, headers, other sources (roles/kernel.py)


def main_package(rig: Rig) -> str:
    """The driver's first package as plan_driver names it (its metapackage), from the host data
    alone: what the check asks apt-cache policy about."""
    if rig.platform == "debian":
        return "nvidia-open" if rig.driver_open else "cuda-drivers"
    infix = "-server" if rig.driver_server else ""
    return f"nvidia-driver-{rig.driver_branch}{infix}{'-open' if rig.driver_open else ''}"


def _onboard_reads(rig: Rig, rig_name: str) -> list[Read]:
    if rig.platform == "wsl2":
        return []
    onboard = onboard_reads((main_package(rig),))
    signed = [Read("signed_modules", SignedModulesFact, "prebuilt signed nvidia modules "
                   "(apt-cache show)", tuple(signed_modules_args(rig).items()))
              ] if rig.platform == "ubuntu" else []
    return [*onboard, *signed, *(read for read in source_reads(rig) if read not in onboard)]


def offered(rig: Rig, policies: list[AptPolicy]) -> list[str]:
    """The versions of the driver's metapackage apt would install from, newest first: the
    configured source's once other sources are pinned out, else every source apt may use."""
    own = offers_driver(policies, rig, CUDA_REPO)
    versions = [version for policy in policies if policy.package == main_package(rig)
                for version in policy.versions if version.origins and version.priority >= 0]
    return [v.version for v in versions if not own or v.version in own]


def archive_finding(rig: Rig, facts: Facts) -> Finding | None:
    """Ubuntu: a branch or version the rig's own sources do not offer is refused before any
    change, with what they offer. Its archive keeps only a branch's newest version in -updates
    (and the release pocket's), so an older exact version is rarely installable. Nothing to say
    when a driver is installed already (the driver check judges it)."""
    if rig.platform != "ubuntu" or facts.missing("driver_policy", "installed"):
        return None
    if driver_versions(facts.installed or {}):
        return None
    versions = offered(rig, facts.driver_policy or [])
    if any(version_matches(rig, upstream_version(v)) for v in versions):
        return None
    package = main_package(rig)
    if not versions:
        return error("driver", f"no apt source of this rig offers {package}: run apt-get "
                     "update, enable the restricted component, or pick a driver_branch its "
                     "archive carries (apt-cache policy 'nvidia-driver-*-open')",
                     key="driver_branch")
    key = "driver_version" if rig.driver_version else "driver_branch"
    return error("driver", f"{package} {wanted(rig)} is not offered by this rig's apt sources; "
                 f"they offer {', '.join(versions)}. Allowed: one of those (Ubuntu's archive "
                 "keeps only a branch's newest version: leave driver_version unset to take it), "
                 "or an older version from a mirror or snapshot you control", key=key)


def _onboard_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """Onboarding is for a driver rigbook installs: none for one it does not own (the driver
    check refuses or adopts that one). First what the rig's archive offers (Ubuntu)."""
    if foreign_of(rig, facts) is not None:
        return []
    archive = archive_finding(rig, facts)
    found = [archive] if archive else []
    signed = False
    if rig.platform == "ubuntu" and not facts.missing("signed_modules", "secure_boot"):
        installed = facts.installed or {}
        module = kernel_module(rig, facts.secure_boot, facts.signed_modules,
                               facts.driver_policy or [], installed)
        signed = bool(module.signed)
        if module.signed and module.signed not in installed:
            found.append(drift("driver", f"Secure Boot is on: the converge installs {module.says}",
                               key="driver_secure_boot"))
    return [*found, *onboard_findings(rig, facts, rig_name, CUDA_REPO, signed=signed)]


def _onboard(rig: Rig):
    """Before the driver goes in: other sources pinned out, nouveau blacklisted (a reboot
    recorded while it is loaded), the running kernel's headers installed. Each reads its facts
    when it runs. The Secure Boot refusal came earlier, in the preflight (ONBOARD)."""
    enroll_dkms_key(name="Queue the DKMS signing key for enrolment", rig=rig)
    pin_out_sources(name="Pin out other sources of the driver", rig=rig,
                    packages=(main_package(rig),), default_repo=CUDA_REPO,
                    globs=DRIVER_PACKAGE_GLOBS)
    expect(OTHER_SOURCES_PREF, NOUVEAU_CONF)
    blacklist_nouveau(name="Blacklist nouveau")
    kernel_headers(name="Headers for the running kernel")


ONBOARD = Check("driver onboarding", _onboard_reads, _onboard_findings)
CHECKS = (DRIVER, DPKG, ONBOARD)
