"""Host tuning: inotify limits, the /dev/shm size, and leftovers that mislead.

Why each setting exists (docs/tuning.md has the long form):

- fs.inotify.max_user_watches / max_user_instances: an engine died at startup with "ENOSPC:
  System limit for number of file watchers reached" while an editor held 59,628 of 65,536
  watches. The values go to /etc/sysctl.d/90-rigbook.conf (the truth across reboots) and are
  applied live as a separate step, only where the live values differ.
- /dev/shm is a tmpfs in host RAM that engines fill with offload buffers (vLLM's KV offload
  region is a file there). Its size is a ceiling, not a reservation; rigbook sets it in
  /etc/fstab and remounts it live, and refuses a size above the host's RAM.
- Leftovers such as /etc/sysctl.d/99-vllm-swap.conf (vm.swappiness on a box with no swap) are
  removed, each one reported.

A host whose /proc/sys is mounted read-only (a container such as the sandbox rigs) cannot take
live values: the file is still written, the live step warns and changes nothing, so a second
run is clean. Bad input (a /dev/shm size above RAM, a sysctl key this kernel lacks) is found by
the role's check (`CHECKS`) in every deploy's preflight, and fails that host before anything on
it changes; the other hosts go on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pyinfra import host
from pyinfra.api import FactBase, StringCommand, deploy, operation
from pyinfra.api.command import QuoteString
from pyinfra.api.exceptions import FactProcessError
from pyinfra.facts.files import FileContents
from pyinfra.operations import files

from rigbook import FILES
from rigbook.core.checks import Check, Facts, Finding, Read, drift, error, warn
from rigbook.core.managed import absent
from rigbook.core.messages import gib, refuse, warn_once
from rigbook.core.render import template
from rigbook.core.runfacts import once
from rigbook.core.spec import Rig
from rigbook.core.types import JsonValue

SYSCTL_TEMPLATE = FILES / "tuning" / "90-rigbook.conf.j2"
SYSCTL_CONF = "/etc/sysctl.d/90-rigbook.conf"
FSTAB = "/etc/fstab"
SHM = "/dev/shm"
PAGE = 4096

#: What a host that refuses live sysctl writes is told (true in a --dry plan too, where the
#: file is not written yet).
READ_ONLY_NOTE = "they apply from the sysctl.d file at the next boot of a host that allows it"

_SIZE = re.compile(r"^([1-9][0-9]*)([KMG%])$")
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}


# --- sysctl ---------------------------------------------------------------------------------


def sysctl_values(rig: Rig) -> dict[str, str]:
    """Every key that files/tuning/90-rigbook.conf.j2 writes, with its value, in file order."""
    values = {
        "fs.inotify.max_user_watches": str(rig.sysctl_inotify_max_user_watches),
        "fs.inotify.max_user_instances": str(rig.sysctl_inotify_max_user_instances),
    }
    values.update((key, str(rig.sysctl_extra[key])) for key in sorted(rig.sysctl_extra))
    return values


def sysctl_path(key: str) -> str:
    """The /proc/sys file of a key: dots are separators, a slash stands for a dot (sysctl(8))."""
    return "/proc/sys/" + key.translate({ord("."): "/", ord("/"): "."})


def same_sysctl(wanted: str, live: str | None) -> bool:
    """Whether a live value equals the wanted one; multi-value keys compare field by field."""
    return live is not None and wanted.split() == live.split()


@dataclass(frozen=True)
class LiveSysctl(JsonValue):
    """One key as the running kernel has it."""

    value: str | None  # None: this kernel has no such key
    read_only: bool  # the /proc/sys file sits on a read-only mount


class LiveSysctls(FactBase[dict[str, LiveSysctl]]):
    """
    Live values of sysctl keys, and whether /proc/sys may be written for each.

    Reads /proc/sys directly and the mounts under /proc from /proc/mounts; a key is read-only
    when the deepest mount holding its file is mounted ``ro`` (systemd-nspawn and Docker mount
    /proc/sys that way, nspawn with /proc/sys/net writable again). Output of a sandbox rig::

        mount /proc rw,nosuid,nodev,noexec,relatime
        mount /proc/sys ro,nosuid,nodev,noexec,relatime
        key fs.inotify.max_user_watches 124208
        nokey vm.no_such_key

    .. code:: python

        {"fs.inotify.max_user_watches": LiveSysctl(value="124208", read_only=True),
         "vm.no_such_key": LiveSysctl(value=None, read_only=True)}
    """

    default = dict

    def command(self, keys: tuple[str, ...]) -> StringCommand:
        parts: list = ["awk '$2 ~ \"^/proc(/|$)\" {print \"mount\", $2, $4}' /proc/mounts;"]
        for key in keys:
            path = QuoteString(sysctl_path(key))
            parts += [
                "if [ -f", path, "]; then printf 'key %s ' ", QuoteString(key), ";",
                "tr '\\t\\n' '  ' <", path, "; echo; else echo nokey", QuoteString(key), "; fi;",
            ]
        return StringCommand(*parts, "true")

    def process(self, output: list[str]) -> dict[str, LiveSysctl]:
        return parse_live_sysctls(output)


def parse_live_sysctls(output: list[str]) -> dict[str, LiveSysctl]:
    """LiveSysctls' output into key -> LiveSysctl (see the fact's docstring)."""
    mounts: dict[str, bool] = {}
    found: dict[str, str | None] = {}
    for line in output:
        kind, _, rest = line.strip().partition(" ")
        if kind == "mount":
            point, _, options = rest.partition(" ")
            mounts[point] = "ro" in options.split(",")
        elif kind == "key":
            key, _, value = rest.partition(" ")
            found[key] = value.strip()
        elif kind == "nokey":
            found[rest.strip()] = None
        elif line.strip():
            raise FactProcessError(f"unexpected line in the sysctl probe: {line!r}")

    def read_only(key: str) -> bool:
        path = sysctl_path(key)
        holders = [p for p in mounts if path == p or path.startswith(p.rstrip("/") + "/")]
        return mounts[max(holders, key=len)] if holders else False

    return {key: LiveSysctl(value, read_only(key)) for key, value in found.items()}


@dataclass(frozen=True)
class SysctlPlan:
    """What the live step does: write these keys, warn about those it cannot write."""

    apply: dict[str, str]
    read_only: dict[str, str]
    missing: tuple[str, ...]


def plan_live_sysctl(wanted: dict[str, str], live: dict[str, LiveSysctl]) -> SysctlPlan:
    """Split the wanted keys into: differ and writable, differ but read-only, unknown."""
    apply, read_only, missing = {}, {}, []
    for key, value in wanted.items():
        now = live.get(key)
        if now is None or now.value is None:
            missing.append(key)
        elif not same_sysctl(value, now.value):
            (read_only if now.read_only else apply)[key] = value
    return SysctlPlan(apply, read_only, tuple(missing))


@operation()
def sysctl_live(values: dict[str, str], conf: str = SYSCTL_CONF) -> Iterator:
    """
    Apply sysctl values to the running kernel where they differ from it.

    + values: key -> value, exactly as in ``conf``
    + conf: the sysctl.d file that holds them (written by an earlier step)

    All differing keys writable: ``sysctl -p conf``. Keys on a read-only /proc/sys (a
    container) are left alone with a warning naming them; that is no change, so a second run is
    clean. Keys this kernel does not have fail the host.
    """
    plan = plan_live_sysctl(values, once(LiveSysctls, keys=tuple(values)))
    if plan.missing:
        yield refuse(
            f"{host.name}: sysctl: this kernel has no {', '.join(plan.missing)} "
            f"(no {', '.join(sysctl_path(k) for k in plan.missing)}); "
            "remove it from sysctl_extra"
        )
        return
    if plan.read_only:
        warn_once(
            f"{host.name}: /proc/sys is read-only here, live sysctl not applied for "
            f"{', '.join(f'{k}={v}' for k, v in plan.read_only.items())}: {READ_ONLY_NOTE}"
        )
    if not plan.apply:
        if not plan.read_only:
            host.noop(f"sysctl values of {conf} are live")
        return
    if not plan.read_only:
        yield StringCommand("sysctl", "-p", QuoteString(conf))
        return
    for key, value in plan.apply.items():
        yield StringCommand("sysctl", "-w", QuoteString(f"{key}={value}"))


# --- /dev/shm -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShmState(JsonValue):
    """/dev/shm as mounted now, and the host's RAM (all in bytes)."""

    fstype: str | None  # None: nothing is mounted on /dev/shm
    options: str
    size_bytes: int | None
    used_bytes: int | None
    mem_total_bytes: int


class Shm(FactBase[ShmState | None]):
    """
    The /dev/shm mount (/proc/mounts), its size and use (``df -B1``) and MemTotal.

    Output (a dual-3090 sandbox rig)::

        mount tmpfs rw,nosuid,nodev,size=65536k,nr_inodes=1048576,inode64
        df 67108864 0
        MemTotal:       24596720 kB
    """

    def command(self) -> str:
        return (
            f"awk '$2==\"{SHM}\" {{print \"mount\", $3, $4}}' /proc/mounts; "
            f"df -B1 --output=size,used {SHM} 2>/dev/null | tail -n +2 | sed 's/^ */df /'; "
            "grep '^MemTotal:' /proc/meminfo"
        )

    def process(self, output: list[str]) -> ShmState:
        return parse_shm(output)


def parse_shm(output: list[str]) -> ShmState:
    """Shm's output into a ShmState; the last mount on /dev/shm is the one that is seen."""
    fstype, options, size, used, mem = None, "", None, None, None
    for line in output:
        fields = line.split()
        if not fields:
            continue
        if fields[0] == "mount" and len(fields) >= 3:
            fstype, options = fields[1], fields[2]
        elif fields[0] == "df" and len(fields) == 3:
            size, used = int(fields[1]), int(fields[2])
        elif fields[0] == "MemTotal:" and len(fields) == 3 and fields[2] == "kB":
            mem = int(fields[1]) * 1024
    if mem is None:
        raise FactProcessError(f"no MemTotal in /proc/meminfo: {output!r}")
    return ShmState(fstype, options, size if fstype else None, used if fstype else None, mem)


def size_bytes(size: str, mem_total_bytes: int) -> int:
    """A tmpfs size= value in bytes as the kernel sets it: K/M/G binary units, N% of RAM.

    Rounded up to whole pages like tmpfs does; a percentage is of MemTotal (the kernel's
    totalram pages, which is what /proc/meminfo's MemTotal counts).
    """
    match = _SIZE.match(size)
    if not match:
        raise ValueError(f"{size!r} is not a tmpfs size; use e.g. 64G, 512M or 50%")
    number, unit = int(match.group(1)), match.group(2)
    if unit == "%":
        pages = -(-(mem_total_bytes // PAGE) * number // 100)
    else:
        pages = -(-number * _UNITS[unit] // PAGE)
    return pages * PAGE


def shm_problem(size: str, shm: ShmState) -> str | None:
    """Why /dev/shm must not be set to `size` on this host (what it has, what is allowed), or
    None when it can be."""
    wanted = size_bytes(size, shm.mem_total_bytes)
    if wanted > shm.mem_total_bytes:
        return (f"asked {size} ({gib(wanted)}) but the host has {gib(shm.mem_total_bytes)} of "
                "RAM (MemTotal); allowed: up to the RAM, e.g. 50% or a size below it")
    if shm.fstype != "tmpfs":
        what = "not mounted" if shm.fstype is None else f"a {shm.fstype} mount"
        return f"asked {size} but {SHM} is {what}, not a tmpfs; allowed: a tmpfs {SHM}"
    if shm.used_bytes is not None and wanted < shm.used_bytes:
        return (f"asked {size} ({gib(wanted)}) but {SHM} holds {gib(shm.used_bytes)} now (engine "
                "offload buffers?); allowed: at least what is in use: stop the engine or pick a "
                "larger size")
    return None


def shm_differs(wanted_bytes: int, shm: ShmState) -> bool:
    """Whether the live /dev/shm size differs from the wanted one (by more than a page)."""
    return shm.size_bytes is None or abs(shm.size_bytes - wanted_bytes) > PAGE


def fstab_line(size: str) -> str:
    return f"tmpfs {SHM} tmpfs defaults,size={size} 0 0"


#: An fstab line that mounts something on /dev/shm (ERE, for files.line); comments excluded.
FSTAB_SHM_LINE = r"^[^#[:space:]]+[[:space:]]+/dev/shm[[:space:]]"


@operation()
def fstab_shm_size(size: str) -> Iterator:
    """
    The /dev/shm line of /etc/fstab with ``size``: pyinfra's files.line, run only when the
    fstab the preflight read (rigbook.core.runfacts) does not have exactly that line already.

    + size: tmpfs size (``2G``, ``512M``, ``50%``)
    """
    wanted = fstab_line(size)
    found = shm_fstab(once(FileContents, path=FSTAB))
    if found and all(line == wanted for line in found):
        host.noop(f"{FSTAB} already mounts {SHM} with size={size}")
        return
    yield from files.line._inner(path=FSTAB, line=FSTAB_SHM_LINE, replace=wanted,
                                 extended_regex=True)


@operation()
def shm_live(size: str) -> Iterator:
    """
    Remount /dev/shm with ``size`` when its live size differs.

    + size: tmpfs size as in fstab (``2G``, ``512M``, ``50%``)

    Sizes compare in bytes (percentages of MemTotal, rounded to pages as tmpfs does).
    """
    shm = once(Shm)
    problem = shm_problem(size, shm)
    if problem:
        yield refuse(f"{host.name}: shm_size: {problem}. Nothing was changed.")
        return
    wanted = size_bytes(size, shm.mem_total_bytes)
    if shm_differs(wanted, shm):
        yield StringCommand("mount", "-o", QuoteString(f"remount,size={size}"), SHM)
    else:
        host.noop(f"{SHM} is already {gib(wanted)} (size={size})")


# --- the tuning check ------------------------------------------------------------------------

#: An fstab line that mounts something on /dev/shm, as FSTAB_SHM_LINE matches it.
_FSTAB_SHM = re.compile(r"^[^#\s]+\s+/dev/shm\s")


class PresentPaths(FactBase[dict]):
    """Which of `paths` exist, and what each is: file (a regular one), link, directory or
    other (a device node, a FIFO, a socket). One line a path: the kind, then the path (last: it
    may hold spaces)."""

    default = dict

    def command(self, paths: tuple[str, ...]) -> StringCommand:
        return StringCommand(
            "for p in", *(QuoteString(path) for path in paths), "; do",
            'if [ -L "$p" ]; then k=link; elif [ -d "$p" ]; then k=directory;',
            'elif [ -f "$p" ]; then k=file; elif [ -e "$p" ]; then k=other; else continue; fi;',
            'printf "%s %s\\n" "$k" "$p";', "done; true",
        )

    def process(self, output: list[str]) -> dict[str, str]:
        pairs = (line.split(" ", 1) for line in output if " " in line)
        return {path: kind for kind, path in pairs}


_SWAPPINESS = "##RIGBOOK_SWAPPINESS##"
#: Where a sysctl file of the admin's lives (systemd's sysctl.d(5): /etc wins over the rest).
SYSCTL_FILES = ("/etc/sysctl.conf", "/etc/sysctl.d/*.conf")


@dataclass(frozen=True)
class SwapLeftover(JsonValue):
    """The active swap areas (/proc/swaps) and the sysctl files that set vm.swappiness."""

    areas: tuple[str, ...]
    swappiness_files: tuple[str, ...]


class SwapLeftovers(FactBase[SwapLeftover]):
    """
    ``/proc/swaps`` (a header, then one line per active area) and the files of
    /etc/sysctl.conf and /etc/sysctl.d that set ``vm.swappiness`` (``grep -H``)::

        Filename                                Type            Size    Used    Priority
        /dev/dm-1                               partition       892924  29004   -1
        ##RIGBOOK_SWAPPINESS##
        /etc/sysctl.d/99-vllm-swap.conf:vm.swappiness = 10
    """

    def command(self) -> str:
        return (f"cat /proc/swaps 2>/dev/null; echo '{_SWAPPINESS}'; grep -Hs -E "
                "'^[[:space:]]*-?vm[./]swappiness[[:space:]]*=' "
                f"{' '.join(SYSCTL_FILES)}; true")

    def process(self, output: list[str]) -> SwapLeftover:
        at = output.index(_SWAPPINESS) if _SWAPPINESS in output else len(output)
        areas = tuple(line.split()[0] for line in output[:at]
                      if line.strip() and not line.startswith("Filename"))
        files = tuple(dict.fromkeys(line.split(":", 1)[0] for line in output[at + 1:]
                                    if ":" in line))
        return SwapLeftover(areas, files)


def swap_leftover_findings(rig: Rig, leftover: SwapLeftover | None) -> list[Finding]:
    """The runbook's leftover: a file setting vm.swappiness on a box with no swap is inert, and
    its rationale "cannot happen without swap" (not one rigbook writes or already removes)."""
    if leftover is None or leftover.areas:
        return []
    return [warn("tuning", f"{path} sets vm.swappiness, but the host has no swap: it is inert "
                           "(the runbook's 99-vllm-swap.conf); list it in stale_files to remove "
                           "it", key="stale_files")
            for path in leftover.swappiness_files
            if path != SYSCTL_CONF and path not in rig.stale_files]


def parse_sysctl_conf(lines: Iterable[str]) -> dict[str, str]:
    """`key = value` lines of a sysctl.d file (comments and blanks skipped), as sysctl reads."""
    values = {}
    for raw in lines:
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.lstrip("-").partition("=")
        if sep:
            values[key.strip()] = value.strip()
    return values


def shm_fstab(lines: Iterable[str] | None) -> list[str]:
    """The fstab lines that mount /dev/shm."""
    return [line.strip() for line in lines or () if _FSTAB_SHM.match(line.strip())]


def _sysctl_findings(rig: Rig, facts: Facts) -> list[Finding]:
    in_file = parse_sysctl_conf(facts.sysctl_file) if facts.sysctl_file is not None else None
    found = [] if in_file is not None else [drift("tuning", f"no {SYSCTL_CONF}")]
    for key, declared in sysctl_values(rig).items():
        written = in_file.get(key) if in_file is not None else None
        live = (facts.sysctl_live or {}).get(key)
        if in_file is not None and not same_sysctl(declared, written):
            found.append(drift("tuning", f"{SYSCTL_CONF}: {key} = "
                               f"{written if written is not None else '(absent)'}, "
                               f"inventory {declared}"))
        if live is None or live.value is None:
            field = "sysctl_extra" if key in rig.sysctl_extra else "sysctl_" + key.split(".")[-1]
            found.append(error("tuning", f"this kernel has no {key} (no {sysctl_path(key)}); "
                               "allowed: keys this kernel has", key=field))
        elif not same_sysctl(declared, live.value):
            if live.read_only:
                found.append(warn("tuning", f"{key} is {live.value} live: /proc/sys is "
                                  f"read-only here, the file's {declared} applies at a boot "
                                  "that allows it"))
            else:
                found.append(drift("tuning", f"{key} is {live.value} live, inventory {declared}"))
    return found


def _shm_findings(rig: Rig, facts: Facts) -> list[Finding]:
    shm = facts.shm
    if rig.shm_size is None or shm is None:
        return []
    problem = shm_problem(rig.shm_size, shm)
    if problem:
        return [error("tuning", problem, key="shm_size")]
    found = []
    fstab, want = shm_fstab(facts.fstab), fstab_line(rig.shm_size)
    if fstab != [want]:
        found.append(drift("tuning", f"{FSTAB}: {SHM} line is {fstab or '(absent)'}, "
                           f"inventory: {want}"))
    wanted_bytes = size_bytes(rig.shm_size, shm.mem_total_bytes)
    if shm_differs(wanted_bytes, shm):
        size = "?" if shm.size_bytes is None else gib(shm.size_bytes)
        found.append(drift("tuning", f"{SHM} is {size}, inventory {rig.shm_size} "
                           f"({gib(wanted_bytes)})"))
    return found


@dataclass(frozen=True)
class InotifyHolder(JsonValue):
    """One process holding inotify watches."""

    pid: int
    uid: int
    comm: str
    watches: int


class InotifyWatches(FactBase[list[InotifyHolder]]):
    """
    inotify watches per process, counted from /proc/*/fdinfo (an ``inotify wd:`` line per
    watch), as the runbook diagnoses ENOSPC (docs/sources.md, "inotify watches"). Processes of
    other users are counted only when the deploy may read them (root). Output: one line per
    holder, ``WATCHES PID UID COMM``::

        59628 4242 1000 code
        12 812 0 systemd
    """

    default = list

    def command(self) -> str:
        return (
            "for d in /proc/[0-9]*; do "
            "n=$(cat \"$d\"/fdinfo/* 2>/dev/null | grep -c '^inotify wd:'); "
            "[ \"${n:-0}\" -gt 0 ] 2>/dev/null && "
            "echo \"$n ${d#/proc/} $(stat -c %u \"$d\" 2>/dev/null) "
            "$(cat \"$d\"/comm 2>/dev/null)\"; "
            "done; true"
        )

    def process(self, output: list[str]) -> list[InotifyHolder]:
        return parse_inotify(output)


def parse_inotify(output: Iterable[str]) -> list[InotifyHolder]:
    """InotifyWatches' lines, most watches first (lines that do not parse are skipped)."""
    holders = []
    for line in output:
        parts = line.split(None, 3)
        if len(parts) >= 3 and all(p.isdigit() for p in parts[:3]):
            comm = parts[3].strip() if len(parts) == 4 else "?"
            holders.append(InotifyHolder(int(parts[1]), int(parts[2]), comm, int(parts[0])))
    return sorted(holders, key=lambda h: (-h.watches, h.pid))


#: Warn when one user holds this share of fs.inotify.max_user_watches.
INOTIFY_NEAR = 0.8


def inotify_findings(holders: list[InotifyHolder] | None, limit: str | None) -> list[Finding]:
    """A warning per user near fs.inotify.max_user_watches (the limit is per user), naming the
    processes that hold the most watches."""
    if not holders or limit is None or not str(limit).strip().isdigit():
        return []
    cap = int(limit)
    by_user: dict[int, list[InotifyHolder]] = {}
    for holder in holders:
        by_user.setdefault(holder.uid, []).append(holder)
    found = []
    for uid, mine in sorted(by_user.items()):
        total = sum(h.watches for h in mine)
        if cap and total >= INOTIFY_NEAR * cap:
            top = ", ".join(f"{h.comm} (pid {h.pid}) {h.watches}" for h in mine[:3])
            found.append(warn(
                "tuning",
                f"uid {uid} holds {total} of fs.inotify.max_user_watches {cap} inotify watches "
                f"({100 * total // cap}%); most: {top}. A start can die with ENOSPC: exclude "
                "the watcher's folders or raise sysctl_inotify_max_user_watches "
                "(docs/sources.md, inotify watches)",
            ))
    return found


def tuning_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """A tuning the host cannot take (errors: a /dev/shm size above MemTotal or below what it
    holds, a /dev/shm that is not tmpfs, a sysctl key this kernel lacks), and every drift."""
    names = ["sysctl_file", "sysctl_live", "shm", "fstab"]
    names += ["stale_present"] if rig.stale_files else []
    if facts.missing(*names):
        return facts.missing(*names)
    found = _sysctl_findings(rig, facts) + _shm_findings(rig, facts)
    found += swap_leftover_findings(rig, facts.swap)
    live = (facts.sysctl_live or {}).get("fs.inotify.max_user_watches")
    found += inotify_findings(facts.inotify, live.value if live is not None else None)
    for path, kind in (facts.stale_present or {}).items():
        found.append(drift("tuning", f"leftover {path} is present") if kind == "file" else error(
            "tuning", f"{path} is a {kind}, not a regular file: rigbook removes regular files "
            "only; allowed: take it out of stale_files", key="stale_files"))
    return found


def _tuning_reads(rig: Rig, rig_name: str) -> list[Read]:
    reads = [
        Read("sysctl_file", FileContents, SYSCTL_CONF, (("path", SYSCTL_CONF),)),
        Read("sysctl_live", LiveSysctls, "live sysctl values",
             (("keys", tuple(sysctl_values(rig))),)),
        SHM_READ,
        Read("fstab", FileContents, FSTAB, (("path", FSTAB),)),
        Read("inotify", InotifyWatches, "inotify watches per process"),
        Read("swap", SwapLeftovers, "swap areas and vm.swappiness files"),
    ]
    if rig.stale_files:
        reads.append(Read("stale_present", PresentPaths, "leftover files",
                          (("paths", tuple(rig.stale_files)),)))
    return reads


SHM_READ = Read("shm", Shm, SHM)
CHECKS = (Check("host tuning", _tuning_reads, tuning_findings),)


# --- the role -------------------------------------------------------------------------------


@deploy("Host tuning")
def host_tuning(rig: Rig) -> None:
    """Converge inotify limits, /dev/shm and leftovers (see the module docstring)."""
    for path in rig.stale_files:
        absent(name=f"Remove leftover {path}", path=path)

    values = sysctl_values(rig)
    template(
        name=f"Write {SYSCTL_CONF}",
        src=str(SYSCTL_TEMPLATE),
        dest=SYSCTL_CONF,
        mode="644",
        cfg=rig,
    )
    sysctl_live(name="Apply the sysctl values live", values=values)

    if rig.shm_size is not None:
        fstab_shm_size(name=f"Set the {SHM} size in {FSTAB}", size=rig.shm_size)
        shm_live(name=f"Resize the live {SHM}", size=rig.shm_size)
