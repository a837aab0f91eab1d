"""WSL2 rigs: the Windows side that a Linux deploy cannot see but an engine dies of.

- Windows resets a GPU whose kernel runs longer than the TDR delay (2 s by default); the engine
  in WSL2 then dies with "CUDA driver error: device not ready" (a 156K-token prompt trips it).
  rigbook sets TdrDelay / TdrDdiDelay (and TdrLevel=0 on request) under
  HKLM\\System\\CurrentControlSet\\Control\\GraphicsDrivers through reg.exe over WSL interop,
  and says that Windows must reboot for them to apply.
- HKLM writes need Windows administrator rights, which root inside WSL does not give. Without
  them rigbook writes a .reg file and a PowerShell script for the user to run, says so, and
  fails the rig (never a success that did not happen); see `tdr_registry`.
- WSL2 needs >= 24 GiB of memory for model loading; %UserProfile%\\.wslconfig is read and a
  lower value reported (never edited: it is the user's Windows file).
- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False avoids a boot crash at weight repack:
  `serving_environment` gives it to the serving role (on WSL2 and on NVLink rigs, the two
  occurrences the hardware notes list), /etc/profile.d/rigbook-wsl.sh to shells.

The platform check runs on every rig: a rig declared wsl2 that is not WSL2, or a WSL2 host
declared otherwise, fails before anything else of this role runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from io import StringIO
from pathlib import PurePosixPath

from pyinfra import host
from pyinfra.api import FactBase, StringCommand, deploy, operation
from pyinfra.api.command import QuoteString
from pyinfra.api.exceptions import FactProcessError

from rigbook import FILES
from rigbook.core.checks import Check, Facts, Finding, Read, drift, error, warn
from rigbook.core.errors import RigbookError
from rigbook.core.managed import put_commands
from rigbook.core.messages import gib, notice, refuse, warn_once
from rigbook.core.render import render_crlf, template
from rigbook.core.runfacts import once
from rigbook.core.spec import Rig
from rigbook.core.types import JsonValue
from rigbook.core.units import SYSTEMD_READ
from rigbook.roles.tuning import SHM_READ, Shm

REG_EXE = "/mnt/c/Windows/System32/reg.exe"
GRAPHICS_DRIVERS = r"HKLM\System\CurrentControlSet\Control\GraphicsDrivers"
USERS = "/mnt/c/Users"
PROFILE_D = "/etc/profile.d/rigbook-wsl.sh"
#: Where the .reg / .ps1 go when no single Windows profile is found under /mnt/c/Users.
FALLBACK_DIR = "/root"
TDR_BASENAME = "rigbook-tdr"
#: Folders under C:\Users that are not a person's profile.
SYSTEM_PROFILES = {"all users", "default", "default user", "public", "defaultapppool"}

_REG = "##RIGBOOK_REG##"
_RC = "##RIGBOOK_RC##"
_NO_REG = "##RIGBOOK_NO_REG##"
_PROFILE = "##RIGBOOK_PROFILE##"
_WSLCONFIG = "##RIGBOOK_WSLCONFIG##"

_NOT_FOUND = "unable to find the specified registry key or value"
_DENIED = "Access is denied"
_VALUE_LINE = re.compile(r"^\s+(\S+)\s+(REG_[A-Z0-9_]+)\s*(.*)$")
_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)B?$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def serving_environment(rig: Rig) -> dict[str, str]:
    """Environment the serving role merges into every engine's unit on this rig.

    expandable_segments:False on WSL2 and on NVLink rigs: an engine died at weight repack with
    "device not ready" with PyTorch's expandable segments on. The hardware notes list it under
    WSL2 but say it "is not strictly WSL2-only", and their NVLink composes "already hardcode
    expandable_segments off" (docs/sources.md, "expandable_segments"): those are the two
    known occurrences, so both get it.
    """
    if rig.platform == "wsl2" or rig.nvlink:
        return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    return {}


# --- detection ------------------------------------------------------------------------------


#: A WSL1 kernel release: "3.4.0-Microsoft", "4.4.0-18362-Microsoft" (capital M).
_WSL1_KERNEL = re.compile(r"-Microsoft\b")


@dataclass(frozen=True)
class WslSignals(JsonValue):
    """What says "this is WSL": the kernel release and the files WSL's init creates."""

    kernel: str
    interop: bool  # /proc/sys/fs/binfmt_misc/WSLInterop (or WSLInterop-late) is registered
    run_wsl: bool  # /run/WSL exists

    @property
    def version(self) -> int | None:
        """1 or 2 on WSL, None elsewhere. WSL1 kernels end in "-Microsoft" (4.4.0-19041-Microsoft;
        it has no GPU); WSL2's say "microsoft-standard" (a custom build may say nothing: then
        WSL's own files tell)."""
        if _WSL1_KERNEL.search(self.kernel):
            return 1
        if "microsoft" in self.kernel.lower() or self.interop or self.run_wsl:
            return 2
        return None

    @property
    def detected(self) -> bool:
        """This is WSL2 (the only WSL with a GPU)."""
        return self.version == 2

    def evidence(self) -> str:
        found = []
        if "microsoft" in self.kernel.lower():
            found.append(f"kernel {self.kernel}")
        if self.interop:
            found.append("WSLInterop in binfmt_misc")
        if self.run_wsl:
            found.append("/run/WSL")
        return ", ".join(found) or f"kernel {self.kernel}, no WSLInterop, no /run/WSL"


class Wsl(FactBase[WslSignals]):
    """
    WSL detection: ``uname -r`` plus the WSL-only files. Output on WSL2::

        5.15.153.1-microsoft-standard-WSL2
        interop
        run-wsl

    Custom kernels defeat the uname check, hence the files too; the sandbox's WSL2 profile only
    has /run/WSL.
    """

    def command(self) -> str:
        return (
            "uname -r; "
            "for f in /proc/sys/fs/binfmt_misc/WSLInterop*; do "
            '[ -e "$f" ] && echo interop && break; done; '
            "[ -e /run/WSL ] && echo run-wsl; true"
        )

    def process(self, output: list[str]) -> WslSignals:
        lines = [line.strip() for line in output if line.strip()]
        if not lines:
            raise FactProcessError("no kernel release from uname -r")
        return WslSignals(lines[0], "interop" in lines[1:], "run-wsl" in lines[1:])


def platform_problem(platform: str, signals: WslSignals) -> str | None:
    """Why the declared platform and what the host is disagree (what it is, what is allowed),
    or None when they agree. WSL1 is refused whatever is declared: it has no GPU."""
    if signals.version == 1:
        return (f"this host is WSL1 (kernel {signals.kernel}), which has no GPU; allowed: a "
                "WSL2 distribution (on Windows: wsl --set-version <distro> 2)")
    if platform == "wsl2" and not signals.detected:
        return (f"declared wsl2 but this host is not WSL2 ({signals.evidence()}); allowed: "
                "ubuntu or debian for this host, or deploy to the WSL2 distribution itself")
    if platform != "wsl2" and signals.detected:
        return (f"declared {platform} but this host is WSL2 ({signals.evidence()}); allowed: "
                "wsl2 (no Linux NVIDIA driver may be installed inside WSL2)")
    return None


def check_platform(host_name: str, platform: str, signals: WslSignals) -> None:
    """RigbookError when the declared platform and what the host is disagree."""
    problem = platform_problem(platform, signals)
    if problem:
        raise RigbookError(f"{host_name}: platform: {problem}. Nothing was changed.")


WSL_READ = Read("wsl", Wsl, "WSL signals")


def platform_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """The declared platform against what the host is: WSL2 or not."""
    if facts.missing("wsl") or facts.wsl is None:
        return facts.missing("wsl")
    problem = platform_problem(rig.platform, facts.wsl)
    return [error("platform", problem, key="platform")] if problem else []


PLATFORM = Check("platform", lambda rig, name: [WSL_READ], platform_findings)


# --- the Windows registry through reg.exe ----------------------------------------------------


def tdr_values(rig: Rig) -> dict[str, int]:
    """The REG_DWORD values rigbook wants under GraphicsDrivers, in the order it writes them."""
    values = {"TdrDelay": rig.wsl_tdr_delay, "TdrDdiDelay": rig.wsl_tdr_ddi_delay}
    if rig.wsl_tdr_disable:
        values["TdrLevel"] = 0
    return values


def parse_reg_value(lines: list[str], name: str) -> int | str:
    """The data of value `name` in `reg.exe query KEY /v NAME` output; REG_DWORD as an int.

    Real output (CRLF line ends, four-space columns)::

        <blank>
        HKEY_LOCAL_MACHINE\\System\\CurrentControlSet\\Control\\GraphicsDrivers
            TdrDelay    REG_DWORD    0x3c
    """
    for line in lines:
        match = _VALUE_LINE.match(line.rstrip("\r\n"))
        if match and match.group(1).lower() == name.lower():
            kind, data = match.group(2), match.group(3).strip()
            if kind in ("REG_DWORD", "REG_QWORD"):
                return int(data, 16)
            return data
    raise ValueError(f"no line for {name} in the reg.exe output: {lines!r}")


@dataclass(frozen=True)
class RegProbe(JsonValue):
    """Values read with reg.exe (None: the value does not exist), or why reg.exe failed."""

    values: dict[str, int | str | None]
    error: str | None = None


class RegistryValues(FactBase[RegProbe]):
    """
    Values under one Windows registry key, read with ``reg.exe query KEY /v NAME`` each.

    A missing value is ``ERROR: The system was unable to find the specified registry key or
    value.`` with exit 1, and reads as None. The shell around reg.exe always exits 0 and marks
    each query's output and status, so a broken interop reaches the operation as a message::

        RegProbe(values={"TdrDelay": 60, "TdrDdiDelay": None})
        RegProbe(values={}, error="no /mnt/c/Windows/System32/reg.exe ...")
    """

    def command(self, key: str, names: tuple[str, ...]) -> StringCommand:
        parts: list = ["if [ -x", REG_EXE, "]; then"]
        for name in names:
            parts += [
                f"echo '{_REG} {name}';", REG_EXE, "query", QuoteString(key), "/v",
                QuoteString(name), f"2>&1; printf '\\n{_RC} %s\\n' \"$?\";",
            ]
        parts += [f"else echo '{_NO_REG}'; fi; true"]
        return StringCommand(*parts)

    def process(self, output: list[str]) -> RegProbe:
        return parse_reg_probe(output)


def parse_reg_probe(output: list[str]) -> RegProbe:
    """RegistryValues' marked output into a RegProbe."""
    if any(line.strip() == _NO_REG for line in output):
        return RegProbe({}, f"no {REG_EXE} (WSL interop off, or C: not mounted at /mnt/c)")
    values: dict[str, int | str | None] = {}
    name, lines = None, []
    for line in output:
        if line.startswith(_REG):
            name, lines = line[len(_REG):].strip(), []
        elif line.startswith(_RC) and name is not None:
            status, text = int(line[len(_RC):]), "\n".join(x.strip() for x in lines if x.strip())
            if status == 0:
                try:
                    values[name] = parse_reg_value(lines, name)
                except ValueError as error:
                    return RegProbe(values, str(error))
            elif _NOT_FOUND in text:
                values[name] = None
            else:
                return RegProbe(values, f"reg.exe query {name} exited {status}: {text}")
            name = None
        else:
            lines.append(line)
    return RegProbe(values)


def reg_add_command(key: str, values: dict[str, int]) -> StringCommand:
    """`reg.exe add KEY /v NAME /t REG_DWORD /d N /f` for each value, as one shell step.

    "Access is denied." (no Windows administrator rights) is swallowed so the operation can
    read the registry again and take the no-admin path; any other reg.exe error fails the step
    with reg.exe's own message (so does a refusal worded in another language of Windows).
    """
    parts: list = []
    for name, value in values.items():
        add = StringCommand(
            REG_EXE, "add", QuoteString(key), "/v", QuoteString(name), "/t", "REG_DWORD",
            "/d", str(value), "/f",
        )
        parts += [
            "out=$(", add, "2>&1) || case \"$out\" in",
            f"*'{_DENIED}'*) ;;", "*) printf '%s\\n' \"$out\" >&2; exit 1;;", "esac;",
        ]
    return StringCommand(*parts, "true")


def differing(wanted: dict[str, int], probe: RegProbe) -> dict[str, int]:
    return {name: value for name, value in wanted.items() if probe.values.get(name) != value}


def show(values: dict[str, int]) -> str:
    return ", ".join(f"{name}={value}" for name, value in values.items())


# --- files for the user to run on Windows ----------------------------------------------------


@dataclass(frozen=True)
class WindowsProfile(JsonValue):
    """A folder under C:\\Users as WSL sees it, and its .wslconfig (None: there is none)."""

    path: str
    wslconfig: str | None


class WindowsProfiles(FactBase[list[WindowsProfile]]):
    """
    The people's profile folders under /mnt/c/Users and the text of their .wslconfig.

    Output (the sandbox's WSL2 rig)::

        ##RIGBOOK_PROFILE## /mnt/c/Users/rig
        ##RIGBOOK_WSLCONFIG##
        [wsl2]
        memory=32GB
    """

    default = list

    def command(self) -> str:
        return (
            f'for d in {USERS}/*/; do [ -d "$d" ] || continue; '
            f'echo "{_PROFILE} ${{d%/}}"; '
            f'[ -f "$d.wslconfig" ] && echo "{_WSLCONFIG}" && cat "$d.wslconfig" && echo; '
            "done; true"
        )

    def process(self, output: list[str]) -> list[WindowsProfile]:
        return parse_profiles(output)


def parse_profiles(output: list[str]) -> list[WindowsProfile]:
    profiles: list[WindowsProfile] = []
    path, text = None, None

    def close():
        if path is not None and PurePosixPath(path).name.lower() not in SYSTEM_PROFILES:
            profiles.append(WindowsProfile(path, text))

    for line in output:
        if line.startswith(_PROFILE):
            close()
            path, text = line[len(_PROFILE):].strip(), None
        elif line.strip() == _WSLCONFIG:
            text = ""
        elif text is not None:
            text += line.rstrip("\r") + "\n"
    close()
    return profiles


def tdr_file_dir(profiles: list[WindowsProfile]) -> str:
    """Where the .reg / .ps1 go: the one Windows profile (the one with a .wslconfig when there
    are several), so the user finds them in C:\\Users\\<name>; else FALLBACK_DIR."""
    for candidates in ([p for p in profiles if p.wslconfig is not None], profiles):
        if len(candidates) == 1:
            return candidates[0].path
    return FALLBACK_DIR


def windows_path(path: str) -> str:
    """/mnt/c/Users/rig/x -> C:\\Users\\rig\\x; other paths stay as they are."""
    match = re.match(r"^/mnt/([a-z])(/.*)?$", path)
    if not match:
        return path
    return f"{match.group(1).upper()}:" + (match.group(2) or "/").replace("/", "\\")


def render_windows_file(name: str, **data) -> str:
    """A files/wsl template rendered with CRLF line ends, as Windows tools expect."""
    return render_crlf(FILES / "wsl" / name, **data)


def tdr_reg_file(host_name: str, values: dict[str, int]) -> str:
    """A .reg file (Windows Registry Editor Version 5.00) that sets `values`."""
    reg_key = GRAPHICS_DRIVERS.replace("HKLM\\", "HKEY_LOCAL_MACHINE\\", 1)
    return render_windows_file(
        "rigbook-tdr.reg.j2", host_name=host_name, reg_key=reg_key, values=values
    )


def tdr_ps1_file(host_name: str, values: dict[str, int], script_path: str) -> str:
    """PowerShell lines (Set-ItemProperty ... -Type DWord) that set `values`."""
    ps_key = GRAPHICS_DRIVERS.replace("HKLM\\", "HKLM:\\", 1)
    return render_windows_file(
        "rigbook-tdr.ps1.j2", host_name=host_name, ps_key=ps_key, values=values,
        script_path=script_path,
    )


def no_admin_message(host_name: str, values: dict[str, int], reg: str, ps1: str) -> str:
    return (
        f"{host_name}: Windows refused the TDR registry change (reg.exe add: Access is "
        f"denied.): WSL is not running with Windows administrator rights, so {show(values)} "
        f"were NOT set and the registry is unchanged. To set them, on Windows either "
        f"double-click {windows_path(reg)} and accept the administrator prompt, or run "
        f'`powershell -ExecutionPolicy Bypass -File "{windows_path(ps1)}"` in an '
        "Administrator PowerShell, or start WSL from an Administrator terminal and deploy "
        "again; then reboot Windows. This rig fails until the values are in the registry."
    )


@operation()
def tdr_registry(values: dict[str, int], key: str = GRAPHICS_DRIVERS) -> Iterator:
    """
    Set REG_DWORD values under a Windows registry key through reg.exe, only those that differ.

    + values: value name -> number (TdrDelay, TdrDdiDelay, TdrLevel)
    + key: the registry key (``HKLM\\System\\CurrentControlSet\\Control\\GraphicsDrivers``)

    Windows administrator rights are found out by the add itself: reg.exe is the only Windows
    tool the rig may rely on (``net session`` needs the Server service and says "no" on some
    admin sessions), and a refused add changes nothing. After the add the registry is read
    again, so success is reported only for values that are really there:

    - all set: a warning says to reboot Windows (TDR values are read at boot);
    - refused: a .reg file and a .ps1 script with every value go to the Windows profile folder
      (or /root), the message says how to run them, and the host fails. A later run with
      nothing new to write fails the same way and changes nothing, until the values are set.
    """
    before = once(RegistryValues, key=key, names=tuple(values))
    if before.error:
        yield refuse(f"{host.name}: cannot read the Windows registry: {before.error}")
        return
    wanted = differing(values, before)
    if not wanted:
        host.noop(f"{show(values)} already set under {key}")
        return

    yield reg_add_command(key, wanted)

    after = host.get_fact(RegistryValues, key=key, names=tuple(values))
    still = differing(values, after) if not after.error else wanted
    done = {name: value for name, value in wanted.items() if name not in still}
    if done:
        yield notice(f"{host.name}: reboot Windows to apply {show(done)} (read at boot)")
    if not still:
        return

    directory = tdr_file_dir(once(WindowsProfiles))
    reg = f"{directory}/{TDR_BASENAME}.reg"
    ps1 = f"{directory}/{TDR_BASENAME}.ps1"
    yield from put_commands(src=StringIO(tdr_reg_file(host.name, values)), dest=reg)
    yield from put_commands(
        src=StringIO(tdr_ps1_file(host.name, values, windows_path(ps1))), dest=ps1
    )
    yield refuse(no_admin_message(host.name, still, reg, ps1))


# --- .wslconfig memory ----------------------------------------------------------------------


def wslconfig_memory(text: str) -> str | None:
    """The raw `memory=` value of the [wsl2] section of a .wslconfig; None when not set."""
    section, memory = None, None
    for raw in text.splitlines():
        line = raw.strip().lstrip("\ufeff").strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip().lower()
        elif section == "wsl2" and "=" in line:
            name, _, value = line.partition("=")
            if name.strip().lower() == "memory":
                memory = value.split("#", 1)[0].strip().strip("\"'")
    return memory or None


def memory_bytes(value: str) -> int:
    """A .wslconfig size (8GB, 8192MB, 16G) in bytes; WSL counts in binary units."""
    match = _MEMORY.match(value.strip())
    if not match:
        raise ValueError(f"{value!r} is not a size like 24GB or 24576MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def memory_findings(
    host_name: str, profiles: list[WindowsProfile], mem_total_bytes: int, min_gib: int
) -> tuple[list[str], list[str]]:
    """(warnings, fine) about WSL2's memory against min_gib, one line per .wslconfig."""
    warnings, fine = [], []
    least = min_gib * 1024**3
    configs = [p for p in profiles if p.wslconfig is not None]
    # Not set: WSL2 gets 50% of Windows memory; what the VM got is MemTotal (whole GiB, as the
    # kernel keeps a little for itself).
    vm_gib = -(-mem_total_bytes // 1024**3)
    default = (
        f"[wsl2] memory is not set, so WSL2 gets 50% of Windows memory: {vm_gib} GiB here"
    )
    if not configs:
        line = f"{host_name}: no .wslconfig under {USERS}; {default}"
        (warnings if vm_gib < min_gib else fine).append(
            line + (f", below wsl_min_memory_gib={min_gib}" if vm_gib < min_gib else "")
        )
    for profile in configs:
        where = windows_path(f"{profile.path}/.wslconfig")
        raw = wslconfig_memory(profile.wslconfig or "")
        if raw is None:
            below = vm_gib < min_gib
            (warnings if below else fine).append(
                f"{host_name}: {where}: {default}"
                + (f", below wsl_min_memory_gib={min_gib}" if below else "")
            )
            continue
        try:
            size = memory_bytes(raw)
        except ValueError as error:
            warnings.append(f"{host_name}: {where}: [wsl2] memory={raw} cannot be read: {error}")
            continue
        if size < least:
            warnings.append(
                f"{host_name}: {where}: [wsl2] memory={raw} ({gib(size)}) is below "
                f"wsl_min_memory_gib={min_gib}: model loading needs at least {min_gib} GiB"
            )
        else:
            fine.append(f"{host_name}: {where}: [wsl2] memory={raw} >= {min_gib} GiB")
    if warnings:
        warnings.append(
            f"{host_name}: set memory={min_gib}GB (or more) under [wsl2] in that .wslconfig on "
            "Windows, then run `wsl --shutdown`; rigbook does not edit Windows files"
        )
    return warnings, fine


@operation()
def wsl_memory(min_gib: int) -> Iterator:
    """
    Report WSL2 memory below ``min_gib`` from %UserProfile%\\.wslconfig (never edited).

    + min_gib: the least memory WSL2 needs for model loading, in GiB

    A report only: warnings, no change.
    """
    yield from ()  # an operation is a generator, even one that never changes anything
    warnings, fine = memory_findings(
        host.name, once(WindowsProfiles), once(Shm).mem_total_bytes, min_gib
    )
    for line in warnings:
        warn_once(line)
    host.noop("; ".join(fine) or "WSL2 memory reported")


# --- systemd in the distribution ---------------------------------------------------------------

#: What a WSL2 distribution needs in /etc/wsl.conf for systemd to be PID 1 (the fact is the
#: units' SystemdBooted, read once in the preflight's batch).
WSL_CONF_SYSTEMD = "[boot]\nsystemd=true"


def no_systemd_text() -> str:
    return ("systemd is not PID 1 in this WSL2 distribution, and rigbook's units (power caps, "
            "guards, serving) need it: add " + WSL_CONF_SYSTEMD.replace("\n", " / ")
            + " (two lines) to /etc/wsl.conf in the distribution, run `wsl --shutdown` on "
            "Windows, start the distribution again and converge (docs/wsl2.md)")


# --- the WSL2 check ---------------------------------------------------------------------------


def wsl2_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """On WSL2: the TDR values against the inventory, and WSL2's memory against
    wsl_min_memory_gib (warnings: rigbook never edits Windows files)."""
    if rig.platform != "wsl2":
        return []
    if facts.missing("registry", "profiles"):
        return facts.missing("registry", "profiles")
    if facts.systemd is False:
        return [error("wsl", no_systemd_text(), key="platform")]
    probe = facts.registry or RegProbe({}, "not read")
    if probe.error:
        found = [drift("wsl", f"cannot read the Windows registry: {probe.error}")]
    else:
        found = [drift("wsl", f"{key} is {probe.values.get(key)}, inventory {value}")
                 for key, value in differing(tdr_values(rig), probe).items()]
    if facts.shm is not None:
        warnings, _ = memory_findings(
            rig_name, facts.profiles or [], facts.shm.mem_total_bytes, rig.wsl_min_memory_gib
        )
        found += [warn("wsl", line.removeprefix(f"{rig_name}: "), key="wsl_min_memory_gib")
                  for line in warnings[:-1]]  # the last one is the advice on how to fix it
    return found


def _wsl2_reads(rig: Rig, rig_name: str) -> list[Read]:
    if rig.platform != "wsl2":
        return []
    return [
        Read("registry", RegistryValues, "Windows registry (TDR)",
             (("key", GRAPHICS_DRIVERS), ("names", tuple(tdr_values(rig))))),
        Read("profiles", WindowsProfiles, "Windows profiles (.wslconfig)"),
        SYSTEMD_READ,
        SHM_READ,
    ]


CHECKS = (PLATFORM, Check("WSL2 host", _wsl2_reads, wsl2_findings))


# --- the role -------------------------------------------------------------------------------


@deploy("WSL2 host")
def wsl_host(rig: Rig) -> None:
    """On WSL2 rigs: TDR, memory and the environment (the platform is the preflight's check)."""
    if rig.platform != "wsl2":
        return
    tdr_registry(name="Set the Windows GPU timeout (TDR) registry values", values=tdr_values(rig))
    wsl_memory(name="Check WSL2 memory in .wslconfig", min_gib=rig.wsl_min_memory_gib)
    template(
        name=f"Write {PROFILE_D}",
        src=str(FILES / "wsl" / "rigbook-wsl.sh.j2"),
        dest=PROFILE_D,
        mode="644",
        cfg=rig,
        env=serving_environment(rig),
    )

