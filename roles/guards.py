"""Rig guards: a fail-closed /dev/shm reaper, an Xid watch that blocks restarts, GPU topology.

Three failure classes from a real host's runbook, guarded against rather than documented:

- vLLM unlinks its CPU KV-offload buffer (/dev/shm/vllm_offload_*.mmap, tens of GB of host RAM)
  only on a graceful shutdown; a force-kill leaks it until reboot. rigbook installs a reaper
  (files/guards/rigbook-shm-reaper, run by rigbook-shm-reaper.service) that the serving unit
  starts once its engine has stopped, and that deploys/reap_shm.py runs on demand. It deletes a
  file only when it could read the mappings and open files of EVERY process and none holds it:
  an unreadable holder is indistinguishable from no holder, so it fails closed. It reads them
  twice, the second time with the file set aside in a quarantine folder, so a process that
  took the file in between keeps it. Its patterns follow rigbook/rigside/shmglob.py, installed
  beside it.
- Xid 79 (fallen off the bus) and 154 (node reboot required) mean the card is gone until a
  reboot; restarting an engine then only adds a confusing second failure. The Xid watch
  (files/guards/rigbook-xid-watch, a copy of rigbook/rigside/xid.py beside it for the
  classification) follows the kernel log and writes /run/rigbook/gpu-lost for this boot's fatal
  Xids; the serving unit refuses to start while it exists, the serving role's preflight and
  `rigbook status` read it (`GpuLostMark`, `gpu_lost_reason`). Xid 31 / 13 (one process's
  fault) go to /var/log/rigbook/engine-faults.log.
- GPU topology as the rig reports it (`nvidia-smi topo -m`, `nvidia-smi nvlink -s`, PCIe
  generation and width per GPU) compared with the host data: NVLink present but not declared
  (or declared but absent), a multi-GPU recipe on a x4 link, a recipe that turns NCCL P2P off
  on a rig with NVLink (`p2p_disable_problem`, for the serving role). Reported, never changed.

The serving unit gets its guards from a drop-in (rigbook-serve.service.d/50-rigbook-guards.conf)
so that roles/serving.py's unit stays its own. docs/guards.md has the operator's side.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from pyinfra import host, state
from pyinfra.api import FactBase, QuoteString, StringCommand, deploy, operation
from pyinfra.api.exceptions import FactProcessError
from pyinfra.operations import server, systemd
from pyinfra.operations.util import any_changed

import rigbook.rigside.shmglob
import rigbook.rigside.xid
from rigbook import FILES
from rigbook.core.checks import Check, Facts, Finding, Read, warn
from rigbook.core.errors import RigbookError
from rigbook.core.facts import GPUS_READ, NvidiaGpus, smi_answer, smi_attempts, smi_script
from rigbook.core.managed import absent, directory, put
from rigbook.core.messages import notice, refuse, warn_once
from rigbook.core.render import template
from rigbook.core.runfacts import once
from rigbook.core.spec import Rig
from rigbook.core.types import JsonValue
from rigbook.core.units import SYSTEMD, booted, service
from rigbook.rigside.gpus import Gpu
from rigbook.rigside.xid import (
    GPU_LOST_HEADLINE,
    GPU_LOST_MARK,
    Boot,
    Card,
    Xid,
    parse_boot,
    parse_cards,
    parse_xid_lines,
    same_device,
)

SOURCES = FILES / "guards"
XID_SOURCE = Path(rigbook.rigside.xid.__file__)
SHMGLOB_SOURCE = Path(rigbook.rigside.shmglob.__file__)

GUARDS_DIR = "/opt/rigbook/guards"
REAPER = f"{GUARDS_DIR}/rigbook-shm-reaper"
WATCH = f"{GUARDS_DIR}/rigbook-xid-watch"
XID_COPY = f"{GUARDS_DIR}/xid.py"
SHMGLOB_COPY = f"{GUARDS_DIR}/shmglob.py"
#: Makes the reaper's quarantine (/dev/shm/.rigbook-quarantine, root 0700) at boot.
QUARANTINE_TMPFILES = "/etc/tmpfiles.d/rigbook-shm-reaper.conf"
UNITS_DIR = "/etc/systemd/system"
REAPER_UNIT = "rigbook-shm-reaper.service"
WATCH_UNIT = "rigbook-xid-watch.service"
SERVE_UNIT = "rigbook-serve.service"
SERVE_DROPIN = f"{UNITS_DIR}/{SERVE_UNIT}.d/50-rigbook-guards.conf"

#: A link this narrow (lanes) or narrower makes tensor parallelism over PCIe crawl.
NARROW_LINK = 4
#: The hardware notes: "PCIe Gen 4 slot — Gen 3 works but allreduce on dual-card is slower"; the
#: generation is read at its max (pcie.link.gen.max): an idle card drops the current one.
SLOW_GEN = 3

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE = re.compile(r"^(GPU|NIC)\d+$")
_NVLINK = re.compile(r"^NV\d+$")
_NVLINK_GPU = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: ([^)]*)\))?$")
_NVLINK_LINK = re.compile(r"^Link (\d+): (.*)$")

_TOPO = "##RIGBOOK_TOPO##"
_NVLINK_S = "##RIGBOOK_NVLINK##"
_MARK = "##RIGBOOK_GPU_LOST##"
_RC = "##RIGBOOK_REAPER_RC##"
_NO_REAPER = "##RIGBOOK_NO_REAPER##"


# --- the GPU-lost mark ------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuLost(JsonValue):
    """The Xid watch's mark: its first line and the kernel lines of the fatal Xids."""

    headline: str
    lines: tuple[str, ...] = ()

    @property
    def events(self) -> tuple[Xid, ...]:
        return tuple(parse_xid_lines(self.lines))


def parse_gpu_lost(lines: Iterable[str]) -> GpuLost:
    """The mark's text: "GPU lost: do not restart serving", then one kernel line per Xid."""
    text = [line.rstrip("\r") for line in lines if line.strip()]
    return GpuLost(text[0].strip() if text else "", tuple(text[1:]))


class GpuLostMark(FactBase[GpuLost | None]):
    """
    The GPU-lost mark of this boot (/run/rigbook/gpu-lost), None when there is none::

        ##RIGBOOK_GPU_LOST##
        GPU lost: do not restart serving
        2026-09-12T03:14:15+0000 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=0, ...

    An existing but unreadable mark still counts as a mark (fail closed).
    """

    def command(self) -> str:
        return f"if [ -e {GPU_LOST_MARK} ]; then echo '{_MARK}'; cat {GPU_LOST_MARK}; fi; true"

    def process(self, output: list[str]) -> GpuLost | None:
        if output[0].strip() != _MARK:
            raise FactProcessError(f"not the GPU-lost mark probe: {output!r}")
        return parse_gpu_lost(output[1:])


def _describe(event: Xid) -> str:
    return f"Xid {event.code} ({event.label}) on PCI {event.pci} at {event.when or '?'}"


def gpu_lost_reason(mark: GpuLost | None) -> str | None:
    """Why serving must not (re)start on this rig now, from the GpuLostMark fact; None: go on.

    Pure, so the serving preflight and `rigbook status` decide alike.
    """
    if mark is None:
        return None
    what = "; ".join(_describe(event) for event in mark.events) or "the mark names no Xid"
    return (
        f"{mark.headline or GPU_LOST_HEADLINE}: {what} ({GPU_LOST_MARK}, written by the Xid "
        "watch this boot; only a reboot brings the card back and clears it: check the card "
        "first, docs/guards.md)"
    )


# --- the kernel log, and the faults check ----------------------------------------------------

#: The most Xid lines read per boot: a flapping card can log thousands.
XID_LINES = 500
#: The most boots read (the newest): one `journalctl -k -b <id>` each.
BOOTS_READ = 100
#: The kernel-log lines rigbook.rigside.xid reads: Xids, fallen-off-the-bus reports without one, and
#: the "GPU at PCI:" / serial lines that name a card.
KLOG_PATTERN = "NVRM: (Xid|GPU |The NVIDIA GPU )|fallen off the bus"
_KLOG = "##RIGBOOK_KLOG##"
_BOOT = "##RIGBOOK_KLOG_BOOT##"


@dataclass(frozen=True)
class BootXids(JsonValue):
    """One boot the journal keeps: its Xids and the cards its log names (UUID, serial)."""

    boot: Boot
    xids: tuple[Xid, ...] = ()
    cards: tuple[Card, ...] = ()


@dataclass(frozen=True)
class KernelLog(JsonValue):
    """Xid lines of the kernel log: this boot's, earlier boots', and each boot's apart (the
    journal's); or why the log was unreadable."""

    source: str | None  # "journalctl" or "dmesg"; None when neither could be read
    this_boot: tuple[Xid, ...] = ()
    earlier: tuple[Xid, ...] = ()
    error: str | None = None
    boots: tuple[BootXids, ...] = ()


class KernelXids(FactBase[KernelLog]):
    """
    NVIDIA Xid lines from the kernel log, this boot's apart from earlier boots'.

    ``journalctl -k -b 0`` (this boot), then each boot of ``journalctl --list-boots`` (the
    newest BOOTS_READ) with ``journalctl -k -b <id> -o short-iso``, when the journal holds kernel
    messages; else ``dmesg`` (this boot only). Output (journal)::

        ##RIGBOOK_KLOG## journalctl
        Nov 29 10:11:12 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=0, GPU has fallen ...
        ##RIGBOOK_KLOG_BOOT## -1 43f6209bfc284a7d9ef1e1f24d7721c9 Fri 2026-11-27 07:59:00 UTC ...
        2026-11-27T08:00:01+0000 rig1 kernel: NVRM: GPU at PCI:0000:01:00: GPU-0b6b7808-...
        2026-11-27T08:00:01+0000 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=0, GPU has ...
        ##RIGBOOK_KLOG_BOOT## 0 9e2ffa348b354fbc8555aa1f524214e5 Sun 2026-11-29 10:00:00 UTC ...
        2026-11-29T10:11:12+0000 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=0, GPU has ...

    A host whose kernel log cannot be read (a container without CAP_SYSLOG) says why::

        ##RIGBOOK_KLOG## none
        dmesg: read kernel buffer failed: Operation not permitted
    """

    @staticmethod
    def default() -> KernelLog:
        return KernelLog(None, error="no output from the kernel-log probe")

    def command(self) -> str:
        grep = f"grep -E '{KLOG_PATTERN}' | tail -n {XID_LINES}"
        journal = "journalctl -k -o short -q --no-pager"
        # a boot id is 32 hex digits: the list's header and anything else are skipped
        boots = (
            f"journalctl --list-boots --no-pager 2>/dev/null | tail -n {BOOTS_READ} | "
            "while read -r idx id rest; do "
            'case "$idx" in *[!0-9-]*|"") continue;; esac; '
            'case "$id" in *[!0-9a-f]*|"") continue;; esac; '
            f'echo "{_BOOT} $idx $id $rest"; '
            'journalctl -k -b "$id" -o short-iso -q --no-pager 2>/dev/null | '
            f"{grep}; done"
        )
        return (
            "if command -v journalctl >/dev/null 2>&1 && "
            f'[ -n "$({journal} -b 0 -n 1 2>/dev/null)" ]; then '
            f"echo '{_KLOG} journalctl'; {journal} -b 0 2>/dev/null | {grep}; {boots}; "
            "elif out=$(dmesg 2>&1); then "
            f"echo '{_KLOG} dmesg'; printf '%s\\n' \"$out\" | {grep}; "
            f"else echo '{_KLOG} none'; printf '%s\\n' \"$out\" | head -n 3; fi; true"
        )

    def process(self, output: list[str]) -> KernelLog:
        return parse_kernel_log(output)


def parse_kernel_log(output: list[str]) -> KernelLog:
    """KernelXids' output into a KernelLog; earlier = the Xids of every boot but this one."""
    if not output or not output[0].startswith(_KLOG):
        raise FactProcessError(f"not the kernel-log probe: {output!r}")
    source = output[0][len(_KLOG):].strip()
    rest = output[1:]
    if source == "none":
        why = " ".join(line.strip() for line in rest if line.strip()) or "no journal, no dmesg"
        return KernelLog(None, error=why)
    sections: list[tuple[Boot | None, list[str]]] = [(None, [])]
    for line in rest:
        if line.startswith(_BOOT):
            sections.append((parse_boot(line[len(_BOOT):]), []))
        else:
            sections[-1][1].append(line)
    boots = tuple(BootXids(boot, tuple(parse_xid_lines(lines)),
                           tuple(parse_cards(lines).values()))
                  for boot, lines in sections[1:] if boot is not None)
    earlier = tuple(xid for boot in boots if boot.boot.index != 0 for xid in boot.xids)
    return KernelLog(source, tuple(parse_xid_lines(sections[0][1])), earlier, boots=boots)


def xid_events(log: KernelLog, gpus: Iterable[Gpu]) -> list[tuple[Xid, bool, Gpu | None]]:
    """(Xid, this boot?, the listed GPU it names) for every Xid of the log."""
    gpus = tuple(gpus)
    return [
        (xid, this_boot, next((g for g in gpus if same_device(xid.pci, g.bus_id)), None))
        for this_boot, xids in ((True, log.this_boot), (False, log.earlier)) for xid in xids
    ]


def fault_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """This boot's Xids (gone when the card is lost until a reboot, else warn), an unreadable
    kernel log, and the Xid watch's GPU-lost mark (gone: serving refuses to start)."""
    if facts.missing("klog", "gpu_lost"):
        return facts.missing("klog", "gpu_lost")
    found = []
    log = facts.klog
    if log is not None and log.source is None:
        found.append(warn("faults", f"kernel log not readable ({log.error}): GPU faults unknown"))
    probe = facts.probe
    events = xid_events(log, probe.gpus if probe is not None and probe.ok else ()) if log else []
    latest: dict[tuple[int, str | None], tuple[Xid, Gpu | None, int]] = {}
    for xid, this_boot, gpu in events:  # this boot's, by code and GPU: the last one, counted
        if this_boot:
            count = latest.get((xid.code, xid.pci), (None, None, 0))[2] + 1
            latest[(xid.code, xid.pci)] = (xid, gpu, count)
    for xid, gpu, count in latest.values():
        where = f"GPU {gpu.index}" if gpu else f"PCI {xid.pci or '?'}"
        times = f" ({count}x)" if count > 1 else ""
        action = f"; NVIDIA's action: {xid.action}" if xid.gone and xid.action else ""
        found.append(Finding(
            "gone" if xid.gone else "warn", "faults",
            f"{where}: Xid {xid.code} {xid.label} since boot{times}, last at "
            f"{xid.when or '?'}{action}", gpu=gpu.uuid if gpu else None,
        ))
    found.extend(history_findings(rig, log, probe.gpus if probe is not None and probe.ok
                                  else ()) if log else [])
    lost = gpu_lost_reason(facts.gpu_lost)
    if lost:  # the Xid watch's mark: serving refuses to start on this boot
        found.append(Finding("gone", "faults", lost))
    return found


#: The Xid 79 + 154 pattern's field report, mitigations and what a cap buys (docs/sources.md).
HISTORY_SOURCE = "docs/sources.md#xid-79-and-154"


@dataclass(frozen=True)
class CardHistory:
    """One card's reset- or reboot-bound Xids over the boots the journal keeps."""

    pci: str
    gpu: Gpu | None  # the listed GPU at that address, None when nvidia-smi no longer lists it
    serial: str | None  # the board serial the log printed, where not 0
    codes: tuple[int, ...]
    dates: tuple[str, ...]  # one per boot, oldest first
    actions: tuple[str, ...]


def card_histories(log: KernelLog, gpus: Iterable[Gpu]) -> list[CardHistory]:
    """Per card (PCI domain:bus:device), the boots on which it had reset- or reboot-bound Xids,
    oldest first; a boot the journal lists twice counts once."""
    gpus = tuple(gpus)
    boots: dict[str, list[tuple[BootXids, list[Xid]]]] = {}
    seen: set[str] = set()
    for boot in sorted(log.boots, key=lambda b: b.boot.index):
        if boot.boot.boot_id in seen:
            continue
        seen.add(boot.boot.boot_id)
        gone: dict[str, list[Xid]] = {}
        for xid in boot.xids:
            if xid.gone and xid.pci is not None:
                gone.setdefault(xid.pci, []).append(xid)
        for pci, xids in gone.items():
            boots.setdefault(pci, []).append((boot, xids))
    histories = []
    for pci, fatal in boots.items():
        cards = [card for boot, _ in fatal for card in boot.cards if card.pci == pci]
        xids = [xid for _, found in fatal for xid in found]
        histories.append(CardHistory(
            pci, next((g for g in gpus if same_device(pci, g.bus_id)), None),
            next((card.serial for card in reversed(cards) if card.serial), None),
            tuple(sorted({xid.code for xid in xids})),
            tuple(_boot_date(boot, found) for boot, found in fatal),
            tuple(sorted({xid.action or "?" for xid in xids}))))
    return histories


def _boot_date(boot: BootXids, xids: list[Xid]) -> str:
    """The day of a boot's first fatal Xid (short-iso stamps carry it), else the boot's."""
    when = xids[0].when or ""
    if re.match(r"\d{4}-\d{2}-\d{2}", when):
        return when[:10]
    return (boot.boot.first or "")[:10] or f"boot {boot.boot.index}"


def history_findings(rig: Rig, log: KernelLog, gpus: Iterable[Gpu]) -> list[Finding]:
    """A card with reset- or reboot-bound Xids on two or more boots: the pattern, its dates and,
    for a card falling off the bus (Xid 79, with or without 154), the mitigations the field
    report names and what a lower cap buys."""
    found = []
    for card in card_histories(log, gpus):
        if len(card.dates) < 2:
            continue
        gpu = card.gpu
        where = f"GPU {gpu.index} (PCI {card.pci}" if gpu else f"PCI {card.pci} (not listed now"
        where += f", serial {card.serial})" if card.serial else ")"
        what = ", ".join(f"Xid {code}" for code in card.codes)
        if 79 in card.codes:
            modprobe = rig.driver_modprobe_options.get("NVreg_DynamicPowerManagement")
            applied = (
                f"NVreg_DynamicPowerManagement=0x00 "
                f"({'set' if modprobe == '0x00' else 'not set'} in driver_modprobe_options) "
                f"and persistence mode on (driver_persistence: "
                f"{str(rig.driver_persistence).lower()})")
            advice = (
                "a card that keeps falling off the bus: the field report the runbook cites "
                "treats Xid 79 + 154 as an NVIDIA GSP firmware/driver bug with the card an RMA "
                f"candidate, and names two mitigations: {applied}; a lower power cap lowers the "
                "odds and does not remove them (what it costs in tok/s is measured, what it "
                "buys in fault rate is not)")
        else:
            advice = (f"a card that keeps needing a reset (NVIDIA's action: "
                      f"{', '.join(card.actions)}); no mitigation is documented for it")
        found.append(warn(
            "faults", f"{where}: {what} on {len(card.dates)} boots ({', '.join(card.dates)}): "
            f"{advice} ({HISTORY_SOURCE})", gpu=gpu.uuid if gpu else None))
    return found


def _fault_reads(rig: Rig, rig_name: str) -> list[Read]:
    return [GPUS_READ, Read("klog", KernelXids, "kernel log"),
            Read("gpu_lost", GpuLostMark, "GPU-lost mark")]


FAULTS = Check("GPU faults", _fault_reads, fault_findings)


# --- topology -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopoMatrix(JsonValue):
    """`nvidia-smi topo -m` between GPUs: links[(i, j)] is "X", "NV4", "PHB", "SYS", ..."""

    gpus: int
    links: Mapping[tuple[int, int], str]

    def nvlink_pairs(self) -> list[tuple[int, int, str]]:
        return [(i, j, v) for (i, j), v in sorted(self.links.items())
                if i < j and _NVLINK.match(v)]

    def pairs_text(self) -> str:
        """'GPU0-GPU1 NV4, ...' for every pair; '1 GPU, no peers' for one card."""
        pairs = [f"GPU{i}-GPU{j} {self.links[(i, j)]}"
                 for i in range(self.gpus) for j in range(i + 1, self.gpus)]
        return ", ".join(pairs) or f"{self.gpus} GPU, no peers"


def parse_topo_matrix(lines: Iterable[str]) -> TopoMatrix:
    """The GPU-to-GPU block of `nvidia-smi topo -m` (its header may carry ANSI underlines).

    Real (one H200)::

        \\t\\x1b[4mGPU0\\tCPU Affinity\\tNUMA Affinity\\tGPU NUMA ID\\x1b[0m
        GPU0\\t X \\t0-15\\t0\\t\\tN/A

    Rows and columns of NICs are skipped; the legend after the first blank line is not read.
    """
    text = [_ANSI.sub("", line).rstrip("\r") for line in lines]
    body = [line for line in text if line.strip()]
    if not body:
        raise ValueError("empty topo -m output")
    header = [cell.strip() for cell in body[0].split("\t") if cell.strip()]
    devices = []
    for cell in header:
        if not _DEVICE.match(cell):
            break
        devices.append(cell)
    gpu_columns = [i for i, name in enumerate(devices) if name.startswith("GPU")]
    if not gpu_columns:
        raise ValueError(f"no GPU columns in the topo -m header: {body[0]!r}")
    links: dict[tuple[int, int], str] = {}
    rows = 0
    for line in body[1:]:
        if line.startswith("Legend"):
            break
        cells = line.split("\t")
        name = cells[0].strip()
        if not name.startswith("GPU") or not _DEVICE.match(name):
            continue
        values = [cell.strip() for cell in cells[1:1 + len(devices)]]
        if len(values) < len(devices):
            raise ValueError(f"short topo -m row: {line!r}")
        i = int(name[3:])
        for column in gpu_columns:
            links[(i, int(devices[column][3:]))] = values[column]
        rows += 1
    if rows != len(gpu_columns):
        raise ValueError(f"topo -m lists {len(gpu_columns)} GPU columns but {rows} GPU rows")
    for i in range(rows):
        if links.get((i, i)) != "X":
            raise ValueError(f"topo -m: GPU{i} is not X to itself: {links.get((i, i))!r}")
    return TopoMatrix(rows, links)


@dataclass(frozen=True)
class NvLinks(JsonValue):
    """One GPU's NVLinks in `nvidia-smi nvlink -s`: which are up (with their speed), which not."""

    index: int
    name: str
    active: Mapping[int, str]
    inactive: tuple[int, ...]


def parse_nvlink_status(lines: Iterable[str]) -> dict[int, NvLinks]:
    """`nvidia-smi nvlink -s` by GPU index; {} for a GPU without NVLink (empty output, real).

    A GPU with links prints (NVIDIA's format)::

        GPU 0: NVIDIA GeForce RTX 3090 (UUID: GPU-...)
        \\t Link 0: 14.062 GB/s
        \\t Link 1: <inactive>
    """
    found: dict[int, NvLinks] = {}
    current: tuple[int, str] | None = None
    active: dict[int, str] = {}
    inactive: list[int] = []

    def close() -> None:
        if current is not None:
            found[current[0]] = NvLinks(current[0], current[1], dict(active), tuple(inactive))

    for raw in lines:
        line = raw.strip()
        gpu = _NVLINK_GPU.match(line)
        link = _NVLINK_LINK.match(line)
        if gpu:
            close()
            current, active, inactive = (int(gpu.group(1)), gpu.group(2)), {}, []
        elif link and current is not None:
            value = link.group(2).strip()
            if value.strip("<>").lower() == "inactive":
                inactive.append(int(link.group(1)))
            else:
                active[int(link.group(1))] = value
        elif line:
            raise ValueError(f"not an nvlink -s line: {raw!r}")
    close()
    return found


@dataclass(frozen=True)
class Topology(JsonValue):
    """What nvidia-smi says about the interconnect; `error` when it could not say (then the
    declared host data is all there is to go by)."""

    smi: str | None = None
    matrix: TopoMatrix | None = None
    nvlinks: Mapping[int, NvLinks] | None = None
    error: str | None = None

    @property
    def known(self) -> bool:
        return self.matrix is not None

    def nvlink_evidence(self) -> list[str]:
        """Every sign of NVLink: NV# pairs in topo -m, GPUs with active links in nvlink -s."""
        evidence = [f"GPU{i}-GPU{j} {v}" for i, j, v in
                    (self.matrix.nvlink_pairs() if self.matrix else [])]
        for gpu in (self.nvlinks or {}).values():
            if gpu.active:
                evidence.append(f"GPU {gpu.index}: {len(gpu.active)} active NVLink(s)")
        return evidence


def _section(output: list[str], start: str, end: str | None) -> list[str]:
    at = output.index(start) + 1
    stop = output.index(end) if end is not None else len(output)
    return output[at:stop]


def parse_topology(output: list[str]) -> Topology:
    """GpuTopology's output: two nvidia-smi attempts blocks (topo -m, then nvlink -s)."""
    if _TOPO not in output or _NVLINK_S not in output:
        raise FactProcessError(f"not the topology probe: {output!r}")
    topo = smi_attempts(_section(output, _TOPO, _NVLINK_S))
    links = smi_attempts(_section(output, _NVLINK_S, None))
    if topo is None:
        return Topology(error="no nvidia-smi")
    smi, lines, status = smi_answer(topo)
    if status != 0:
        why = " ".join(" ".join(lines).split())[:200] or f"exit {status}"
        return Topology(smi=smi, error=f"{smi} topo -m failed: {why}")
    try:
        matrix = parse_topo_matrix(lines)
    except ValueError as e:
        return Topology(smi=smi, error=f"{smi} topo -m: {e}")
    nvlinks, error = None, None
    if links is not None:
        path, link_lines, link_status = smi_answer(links)
        if link_status == 0:
            try:
                nvlinks = parse_nvlink_status(link_lines)
            except ValueError as e:
                error = f"{path} nvlink -s: {e}"
        else:
            why = " ".join(" ".join(link_lines).split())[:200] or f"exit {link_status}"
            error = f"{path} nvlink -s failed: {why}"
    return Topology(smi=smi, matrix=matrix, nvlinks=nvlinks, error=error)


class GpuTopology(FactBase[Topology]):
    """
    The GPU interconnect: ``nvidia-smi topo -m`` and ``nvidia-smi nvlink -s``, run with the
    same nvidia-smi search as NvidiaGpus (rigbook/core/facts.py). Never fails the host: a broken or
    absent nvidia-smi (or the sandbox's stand-in, which has no topo) gives ``error``.

    .. code:: python

        Topology(smi="/usr/bin/nvidia-smi", matrix=TopoMatrix(2, {(0, 1): "NV4", ...}),
                 nvlinks={0: NvLinks(0, "NVIDIA GeForce RTX 3090", {0: "14.062 GB/s"}, ())})
    """

    @staticmethod
    def default() -> Topology:
        return Topology(error="no output from the topology probe")

    def command(self) -> str:
        return (f"echo '{_TOPO}'; {smi_script('topo -m')}; "
                f"echo '{_NVLINK_S}'; {smi_script('nvlink -s')}")

    def process(self, output: list[str]) -> Topology:
        return parse_topology(output)


def _width(gpu: Gpu) -> int | None:
    """The lanes in use (the current width; the reported max when that is not known)."""
    return gpu.pcie_width if gpu.pcie_width is not None else gpu.pcie_width_max


def _pcie_text(gpu: Gpu) -> str:
    def v(x: int | None) -> str:
        return "?" if x is None else str(x)

    return (f"GPU {gpu.index} PCIe gen {v(gpu.pcie_gen)} (max {v(gpu.pcie_gen_max)}) "
            f"x{v(gpu.pcie_width)} (max x{v(gpu.pcie_width_max)})")


def topology_summary(topology: Topology, gpus: Iterable[Gpu]) -> str:
    """One line: GPU-to-GPU links, NVLinks, PCIe link of each GPU (now at idle, and max)."""
    parts = []
    if topology.matrix is not None:
        parts.append(topology.matrix.pairs_text())
    else:
        parts.append(f"topology unknown ({topology.error})")
    if topology.matrix is not None and topology.error:
        parts.append(topology.error)
    if topology.nvlinks is not None:
        parts.append(", ".join(
            f"GPU {g.index} NVLink {len(g.active)}/{len(g.active) + len(g.inactive)} active"
            for g in topology.nvlinks.values()
        ) or "nvlink -s lists no links")
    parts += [_pcie_text(gpu) for gpu in sorted(gpus, key=lambda g: g.index)]
    return "; ".join(parts)


def topology_findings(
    rig: Rig, topology: Topology, gpus: Iterable[Gpu], recipe_gpus: int | None = None,
    recipe_name: str | None = None,
) -> list[str]:
    """What in the reported topology contradicts the host data or the recipe (warnings).

    `recipe_gpus`: how many cards the rig's recipe splits the model over (tensor parallel).
    """
    found = []
    evidence = topology.nvlink_evidence()
    if topology.known:
        if evidence and not rig.nvlink:
            found.append(
                f"host data says nvlink: false, but nvidia-smi shows NVLink ({', '.join(evidence)})"
                ": set nvlink: true (recipes for PCIe-only rigs turn NCCL P2P off)"
            )
        if rig.nvlink and not evidence:
            found.append(
                f"host data says nvlink: true, but nvidia-smi shows no NVLink "
                f"({topology.matrix.pairs_text()}): check the bridge, or set nvlink: false"
            )
    for gpu in (topology.nvlinks or {}).values():
        if gpu.active and gpu.inactive:
            found.append(
                f"GPU {gpu.index}: NVLink {len(gpu.inactive)} of "
                f"{len(gpu.active) + len(gpu.inactive)} links inactive "
                f"({', '.join(map(str, gpu.inactive))}): reseat the bridge"
            )
    if recipe_gpus is not None and recipe_gpus >= 2 and not evidence:
        for gpu in sorted(gpus, key=lambda g: g.index)[:recipe_gpus]:  # the cards it runs on
            width = _width(gpu)
            if width is not None and width <= NARROW_LINK:
                found.append(
                    f"recipe {recipe_name or '?'} splits the model over {recipe_gpus} cards "
                    f"without NVLink, and {_pcie_text(gpu)} is a x{width} link: every token "
                    "crosses it; use an x8/x16 slot or a one-card recipe"
                )
            elif gpu.pcie_gen_max is not None and gpu.pcie_gen_max <= SLOW_GEN:
                found.append(
                    f"recipe {recipe_name or '?'} splits the model over {recipe_gpus} cards "
                    f"without NVLink, and {_pcie_text(gpu)} is at most a Gen {gpu.pcie_gen_max} "
                    "link: the hardware notes find allreduce slower there (mild for many "
                    "users, minimal for one stream); a Gen 4 slot avoids it"
                )
    return found


def p2p_disable_problem(
    env: Mapping[str, str], rig: Rig, topology: Topology | None = None
) -> str | None:
    """Why a recipe environment with NCCL_P2P_DISABLE=1 does not fit this rig; None if it does.

    Turning NCCL's P2P off is right for cards that talk over PCIe only (dual 3090 without a
    bridge) and wrong where NVLink is there: it would push all traffic off the bridge. The
    reported topology decides; when it could not be read, the declared `nvlink` does.
    """
    if str(env.get("NCCL_P2P_DISABLE", "")).strip() != "1":
        return None
    if topology is not None and topology.known:
        evidence = topology.nvlink_evidence()
        if evidence:
            return (f"the recipe sets NCCL_P2P_DISABLE=1, but the rig has NVLink "
                    f"({', '.join(evidence)}): it would turn P2P over the bridge off; choose a "
                    "recipe for NVLink rigs")
        return None
    if rig.nvlink:
        return ("the recipe sets NCCL_P2P_DISABLE=1, but the host data says nvlink: true: it "
                "would turn P2P over the bridge off; choose a recipe for NVLink rigs")
    return None


def _recipe(rig: Rig):
    """The rig's recipe from the catalogue, or None (the serving role reports a bad one)."""
    if rig.recipe is None:
        return None
    from rigbook.roles.recipes import catalogue  # the catalogue reads TOML files: only when needed

    try:
        return catalogue(rig.serving_recipe_dirs).get(rig.recipe)
    except RigbookError:
        return None


def topology_warnings(rig: Rig, topology: Topology, gpus: tuple[Gpu, ...]) -> list[str]:
    """What the interconnect contradicts: the host data, and the rig's recipe."""
    recipe = _recipe(rig)
    findings = topology_findings(
        rig, topology, gpus,
        recipe.tensor_parallel_size if recipe is not None else None,
        recipe.name if recipe is not None else None,
    )
    if recipe is not None:
        problem = p2p_disable_problem(recipe.env, rig, topology)
        if problem:
            findings.append(f"recipe {recipe.name}: {problem}")
    return findings


def _topology_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    probe = facts.probe
    if facts.topology is None or probe is None or not probe.ok or not probe.gpus:
        return []
    return [warn("topology", text) for text in topology_warnings(rig, facts.topology, probe.gpus)]


#: Read with the preflight's batch (the guards' report plans on it); status shows its warnings.
TOPOLOGY = Check(
    "GPU topology",
    lambda rig, rig_name: [GPUS_READ, Read("topology", GpuTopology, "GPU topology")],
    _topology_findings, gpus=True,
)
CHECKS = (FAULTS, SYSTEMD, TOPOLOGY)


@operation()
def topology_report(rig: Rig) -> Iterator:
    """
    Report the GPU interconnect and warn where it contradicts the host data; change nothing.

    + rig: the rig's validated host data (``rigbook.core.spec.Rig``)

    Reads ``nvidia-smi topo -m`` / ``nvlink -s`` and each GPU's PCIe generation and width (now,
    at idle, and the reported max) when the operation executes, so GPUs that appear after an
    earlier step's reboot are seen. Warned: NVLink found but ``nvlink: false`` (or the
    reverse), partly inactive NVLinks, a recipe over two or more cards without NVLink on a x4
    (or narrower) or Gen 3 (or older) link, and a recipe that sets NCCL_P2P_DISABLE=1 on a rig
    with NVLink.
    """
    probe = once(NvidiaGpus)
    if probe is None or not probe.ok or not probe.gpus:
        why = "no nvidia-smi" if probe is None else probe.error or "no GPUs listed"
        host.noop(f"GPU topology not read: {why}")
        return
    topology = once(GpuTopology)
    for finding in topology_warnings(rig, topology, probe.gpus):
        warn_once(f"GPU topology: {finding}")
    host.noop(f"GPU topology: {topology_summary(topology, probe.gpus)}")
    yield from ()


# --- the reaper on demand ---------------------------------------------------------------------


@dataclass(frozen=True)
class ShmVerdict(JsonValue):
    """One file as the reaper judged it (its --json output)."""

    path: str
    size: int
    resident: int
    action: str  # delete, restore (a leftover of a stopped run put back), keep, refuse, or
    # stray (something else held the quarantine's name: renamed aside)
    reason: str
    line: str  # the reaper's own log line for it


@dataclass(frozen=True)
class ReapPlan(JsonValue):
    installed: bool
    verdicts: tuple[ShmVerdict, ...] = ()
    error: str | None = None


#: The dry run's words for what a real run changes, and what the deploy says while it runs.
_DOING = {"delete": ("would reap", "reaping"), "restore": ("would restore", "restoring"),
          "stray": ("would set aside", "setting aside")}


def reaper_args(patterns: Iterable[str]) -> list:
    args: list = []
    for pattern in patterns:
        args += ["--pattern", QuoteString(pattern)]
    return args


class ShmReapPlan(FactBase[ReapPlan]):
    """
    What the installed reaper would do now (``rigbook-shm-reaper --dry-run --json``)::

        [{"path": "/dev/shm/vllm_offload_1.mmap", "size": 2147483648, "resident": 2147483648,
          "action": "delete", "reason": "no process maps it ...", "line": "would reap ..."}]
        ##RIGBOOK_REAPER_RC## 0
    """

    def command(self, patterns: tuple[str, ...]) -> StringCommand:
        return StringCommand(
            "if [ -f", REAPER, "]; then python3", REAPER, "--dry-run --json",
            *reaper_args(patterns), f"2>&1; echo \"{_RC} $?\"; else echo '{_NO_REAPER}'; fi",
        )

    def process(self, output: list[str]) -> ReapPlan:
        return parse_reap_plan(output)


def parse_reap_plan(output: list[str]) -> ReapPlan:
    if output and output[0].strip() == _NO_REAPER:
        return ReapPlan(installed=False)
    rc = next((line for line in output if line.startswith(_RC)), None)
    if rc is None:
        raise FactProcessError(f"not the reaper probe: {output!r}")
    verdicts = next((line for line in reversed(output) if line.startswith("[")), None)
    if verdicts is None:
        text = " ".join(line.strip() for line in output if not line.startswith(_RC))
        return ReapPlan(installed=True, error=text or rc)
    return ReapPlan(True, tuple(ShmVerdict(**item) for item in json.loads(verdicts)))


@operation()
def reap_shm(patterns: tuple[str, ...]) -> Iterator:
    """
    Delete leaked /dev/shm buffers now, where no process holds them; fail the rig on a refusal.

    + patterns: file-name globs in /dev/shm (``Rig.guards_shm_patterns``)

    Runs the installed reaper as a dry run first: nothing to delete or put back (no match, or
    every match held) is a no-op that says so; a refusal (a process whose mappings could not be
    read) fails the rig with the reaper's reason and deletes nothing; otherwise the reaper runs
    for real and decides again (a holder that appeared meanwhile keeps its file).
    """
    plan = once(ShmReapPlan, patterns=tuple(patterns))
    run = StringCommand("python3", REAPER, *reaper_args(patterns))
    if not plan.installed:
        if state.is_executing:
            yield refuse(f"{host.name}: {REAPER} is not installed: run deploys/rig.py first")
        else:
            yield run  # installed by an earlier step of this run; decided when it executes
        return
    if plan.error:
        yield refuse(f"{host.name}: /dev/shm reaper: {plan.error}")
        return
    refused = [v.line for v in plan.verdicts if v.action == "refuse"]
    if refused:
        yield refuse(f"{host.name}: /dev/shm reaper refused, nothing was deleted:\n"
                     + "\n".join(f"  - {line}" for line in refused))
        return
    changes = [v for v in plan.verdicts if v.action in _DOING]
    if not changes:
        kept = [v.line for v in plan.verdicts]
        host.noop("nothing to reap in /dev/shm: "
                  + ("; ".join(kept) if kept else f"no file matches {' '.join(patterns)}"))
        return
    for verdict in changes:
        yield notice(verdict.line.replace(*_DOING[verdict.action], 1))
    yield run


# --- installation ---------------------------------------------------------------------------


@operation()
def no_systemd() -> Iterator:
    """Say that the guards need systemd (hosts without it: WSL2 without systemd, containers)."""
    host.noop("no systemd as PID 1: the Xid watch is not installed (its unit needs it); the "
              "/dev/shm reaper runs from rigbook's supervisor after each engine stop, and GPU "
              "topology is still reported")
    yield from ()


def _install_reaper(rig: Rig):
    """The reaper script, its pattern rule beside it, and its oneshot unit (no [Install]:
    started by serving's drop-in). Without systemd, no unit: rigbook's supervisor runs the
    script after the engine stops (roles/serving.py)."""
    directory(name=f"Guards folder {GUARDS_DIR}", path=GUARDS_DIR, mode="755")
    put(name="Install the reaper's pattern rule (rigbook/rigside/shmglob.py)",
        src=str(SHMGLOB_SOURCE), dest=SHMGLOB_COPY, mode="644")
    script = put(name="Install the /dev/shm reaper", src=str(SOURCES / "rigbook-shm-reaper"),
                 dest=REAPER, mode="755")
    if not booted():
        return script, None
    boot = put(name="Make the reaper's quarantine at every boot (tmpfiles.d, root 0700)",
               src=str(SOURCES / "rigbook-shm-reaper.tmpfiles.conf"), dest=QUARANTINE_TMPFILES,
               mode="644")
    # Not `systemd-tmpfiles --create`: on a live rig it hands a stray folder of that name
    # (another user's, made while none was there) to root with its contents; this sets it aside.
    server.shell(name="Make the reaper's quarantine now (tmpfiles.d changed)",
                 commands=[StringCommand("/usr/bin/python3", "-I", "-S", REAPER, "--prepare")],
                 _if=boot.did_change)
    unit = template(
        name=f"Write {REAPER_UNIT}", src=str(SOURCES / f"{REAPER_UNIT}.j2"),
        dest=f"{UNITS_DIR}/{REAPER_UNIT}", mode="644", patterns=rig.guards_shm_patterns,
    )
    return script, unit


@deploy("Rig guards")
def guards(rig: Rig) -> None:
    """Install the /dev/shm reaper and the Xid watch, guard the serving unit, report topology."""
    if not booted():
        no_systemd(name="Guards need systemd")
        _install_reaper(rig)
        topology_report(name="GPU topology", rig=rig)
        return
    _script, reaper_unit = _install_reaper(rig)
    xid_copy = put(name="Install the Xid classifier (rigbook/rigside/xid.py)", src=str(XID_SOURCE),
                   dest=XID_COPY, mode="644")
    watch = put(name="Install the Xid watch", src=str(SOURCES / "rigbook-xid-watch"),
                dest=WATCH, mode="755")
    dropin = put(
        name=f"Guard {SERVE_UNIT} (GPU-lost check, reaper after stop)",
        src=str(SOURCES / "rigbook-serve-guards.conf"), dest=SERVE_DROPIN, mode="644",
    )
    if rig.guards_xid_watch:
        watch_unit = put(name=f"Write {WATCH_UNIT}", src=str(SOURCES / WATCH_UNIT),
                         dest=f"{UNITS_DIR}/{WATCH_UNIT}", mode="644")
    else:
        service(name=f"{WATCH_UNIT} stopped and disabled (guards_xid_watch: false)",
                service=WATCH_UNIT, running=False, enabled=False)
        watch_unit = absent(name=f"Remove {WATCH_UNIT}", path=f"{UNITS_DIR}/{WATCH_UNIT}")
    systemd.daemon_reload(name="systemctl daemon-reload (guard units changed)",
                          _if=any_changed(reaper_unit, dropin, watch_unit))
    if rig.guards_xid_watch:
        service(
            name=f"{WATCH_UNIT} enabled and running", service=WATCH_UNIT, running=True,
            enabled=True,
        )
        service(  # decided at execution: will_change would re-read the files' facts
            name=f"{WATCH_UNIT} restarted (its files changed)", service=WATCH_UNIT,
            running=True, restarted=True, _if=any_changed(xid_copy, watch, watch_unit),
        )
    topology_report(name="GPU topology", rig=rig)


@deploy("Reap /dev/shm")
def reap_shm_now(rig: Rig) -> None:
    """deploys/reap_shm.py: make sure the reaper is installed, then reap (see reap_shm)."""
    _install_reaper(rig)
    reap_shm(name="Reap leaked /dev/shm buffers", patterns=rig.guards_shm_patterns)
