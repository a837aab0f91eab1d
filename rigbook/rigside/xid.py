"""NVIDIA Xid lines from the kernel log: which GPU faulted, with what, and what that means.

The driver reports every GPU fault to the kernel log as one Xid line::

    NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=python3, GPU has fallen off the bus.

`journalctl -k` puts the time, the host (or not) and ``kernel:`` before it, `dmesg` its
stamps (every --time-format, --decode's facility, --raw's level), syslog both, and rsyslog
escapes a multi-line message's newlines as ``#012``; old drivers write ``Xid (0000:01:00)``
without ``PCI:``. `split_prefix` is the one grammar of those prefixes, for the Xids, the
kernel's API mismatch (`parse_mismatches`) and the loaded module (`parse_module`) alike: a line
where ``NVRM: Xid`` stands inside another message (a USB product string, say) is not an Xid.
A GPU that fell off the bus is also reported without an Xid (``NVRM: GPU
at 0000:01:00.0 has fallen off the bus.``, and the open module's three-line ``The NVIDIA GPU
... has fallen off the bus``): `parse_xid_lines` reads those as Xid 79 (`fallen`).

What each code means and what to do right away is NVIDIA's Xid catalogue ("Analyzing Xid
Errors with the Xid Catalog", docs.nvidia.com/deploy/xid-errors; transcribed in
tests/fixtures/real/xid-catalogue.md). A code whose immediate action is a GPU reset or a
reboot (RESET_GPU, RESTART_BM, RESTART_VM) means the GPU must not serve until then (`gone`);
Xid 154 says so itself (its recovery action, until it changes back to 0x0).

Plain Python with no pyinfra, like rigbook/rigside/gpus.py (the Xid watch runs a copy of this file
on the rig), so the parser is tested on real lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: What the Xid watch (files/guards/rigbook-xid-watch) writes on the rig, and rigbook reads: the
#: GPU-lost mark (its first line the headline, then the Xid lines), and the engine-faults log.
GPU_LOST_MARK = "/run/rigbook/gpu-lost"
GPU_LOST_HEADLINE = "GPU lost: do not restart serving"
ENGINE_FAULTS_LOG = "/var/log/rigbook/engine-faults.log"

#: Xid code -> (description, immediate action), from NVIDIA's Xid catalogue (codes it marks
#: unused are left out).
XID_CATALOGUE: dict[int, tuple[str, str]] = {
    8: ('GPU stopped processing', 'RESTART_APP'),
    11: ('Invalid or corrupted push buffer stream', 'RESTART_APP'),
    13: ('Graphics Engine Exception', 'RESTART_APP'),
    25: ('Invalid or illegal push buffer stream', 'RESTART_APP'),
    31: ('GPU memory page fault', 'RESTART_APP'),
    32: ('Invalid or corrupted push buffer stream', 'RESTART_APP'),
    37: ('Driver firmware error', 'IGNORE'),
    38: ('Driver firmware error', 'IGNORE'),
    39: ('Copy Engine Exception', 'RESTART_APP'),
    40: ('Copy Engine Exception', 'RESTART_APP'),
    41: ('Copy Engine Exception', 'RESTART_APP'),
    43: ('GPU stopped processing', 'IGNORE'),
    44: ('Graphics Engine fault during context switch', 'IGNORE'),
    45: (
        'Preemptive cleanup, due to previous errors (most likely running multiple CUDA '
        'applications and hitting a DBE)',
        'WORKFLOW_XID_45',
    ),
    46: ('GPU stopped processing', 'RESET_GPU'),
    48: ('Double Bit ECC Error', 'WORKFLOW_XID_48'),
    54: ('Auxiliary power is not connected to the GPU board', 'CHECK_MECHANICALS'),
    60: ('Video processor exception', 'RESTART_APP'),
    62: ('Internal micro-controller halt (newer drivers)', 'RESET_GPU'),
    63: ('GPU memory remapping event', 'IGNORE'),
    64: ('GPU memory remapping failure', 'RESET_GPU'),
    66: ('Illegal access by driver', 'IGNORE'),
    67: ('Illegal access by driver', 'IGNORE'),
    68: ('NVDEC0 Exception', 'RESTART_APP'),
    69: ('Graphics Engine class error', 'RESTART_APP'),
    70: ('CE3: Unknown Error', 'RESTART_APP'),
    71: ('CE4: Unknown Error', 'RESTART_APP'),
    72: ('CE5: Unknown Error', 'RESTART_APP'),
    74: ('NVLINK Error', 'WORKFLOW_NVLINK_ERR'),
    75: ('CE6: Unknown Error', 'RESTART_APP'),
    76: ('CE7: Unknown Error', 'RESTART_APP'),
    77: ('CE8: Unknown Error', 'RESTART_APP'),
    78: ('vGPU Start Error', 'UPDATE_SWFW'),
    79: ('GPU has fallen off the bus', 'RESTART_BM'),
    80: ('Corrupted data sent to GPU', 'RESTART_APP'),
    82: ('NVJPG0 Error', 'RESTART_APP'),
    83: ('NVDEC1 Error', 'RESTART_APP'),
    84: ('NVDEC2 Error', 'RESTART_APP'),
    85: ('CE9: Unknown Error', 'RESTART_APP'),
    86: ('OFA Exception', 'RESTART_APP'),
    88: ('NVDEC3 Error', 'RESTART_APP'),
    89: ('NVDEC4 Error', 'RESTART_APP'),
    92: ('High single-bit ECC error rate', 'IGNORE'),
    93: ('Non-fatal violation of provisioned InfoROM wear limit', 'IGNORE'),
    94: ('Contained memory error', 'RESTART_APP'),
    95: ('Uncontained memory error', 'RESET_GPU'),
    96: ('NVDEC5 Error', 'RESTART_APP'),
    97: ('NVDEC6 Error', 'RESTART_APP'),
    98: ('NVDEC7 Error', 'RESTART_APP'),
    99: ('NVJPG1 Error', 'RESTART_APP'),
    100: ('NVJPG2 Error', 'RESTART_APP'),
    101: ('NVJPG3 Error', 'RESTART_APP'),
    102: ('NVJPG4 Error', 'RESTART_APP'),
    103: ('NVJPG5 Error', 'RESTART_APP'),
    104: ('NVJPG6 Error', 'RESTART_APP'),
    105: ('NVJPG7 Error', 'RESTART_APP'),
    106: ('SMBPBI Test Message', 'IGNORE'),
    107: ('SMBPBI Test Message Silent', 'IGNORE'),
    109: ('Context Switch Timeout Error', 'RESET_GPU'),
    110: ('Security Fault Error', 'RESET_GPU'),
    119: ('GSP RPC Timeout', 'RESET_GPU'),
    120: ('GSP Error', 'RESET_GPU'),
    121: ('C2C Error', 'IGNORE'),
    126: ('CE10: Unknown Error', 'RESTART_APP'),
    127: ('CE11: Unknown Error', 'RESTART_APP'),
    128: ('CE12: Unknown Error', 'RESTART_APP'),
    129: ('CE13: Unknown Error', 'RESTART_APP'),
    130: ('CE14: Unknown Error', 'RESTART_APP'),
    131: ('CE15: Unknown Error', 'RESTART_APP'),
    132: ('CE16: Unknown Error', 'RESTART_APP'),
    133: ('CE17: Unknown Error', 'RESTART_APP'),
    134: ('CE18: Unknown Error', 'RESTART_APP'),
    135: ('CE19: Unknown Error', 'RESTART_APP'),
    136: ('Link Training Failed', 'RESET_GPU'),
    137: ('NVLink Privilege Error', 'IGNORE'),
    139: ('OFA1 Error', 'RESTART_APP'),
    140: ('ECC Unrecovered Error', 'RESET_GPU'),
    141: ('CUDA Fast Path Error', 'IGNORE'),
    142: ('NVENC3 Error', 'CONTACT_SUPPORT'),
    143: ('GPU Initialization Error', 'RESET_GPU'),
    144: ('NVLINK: SAW Error', 'WORKFLOW_NVLINK5_ERR'),
    145: ('NVLINK: RLW Error', 'WORKFLOW_NVLINK5_ERR'),
    146: ('NVLINK: TLW Error', 'WORKFLOW_NVLINK5_ERR'),
    147: ('NVLINK: TREX Error', 'WORKFLOW_NVLINK5_ERR'),
    148: ('NVLINK: NVLPW_CTRL Error', 'WORKFLOW_NVLINK5_ERR'),
    149: ('NVLINK: NETIR Error', 'WORKFLOW_NVLINK5_ERR'),
    150: ('NVLINK: MSE Error', 'WORKFLOW_NVLINK5_ERR'),
    151: ('Key rotation Error', 'RESTART_VM'),
    152: ('DLA SMMU Error', 'IGNORE'),
    153: ('DLA timeout Error', 'IGNORE'),
    154: ('GPU Recovery Action Changed', 'XID_154'),
    155: ('NVLINK: SW Defined Error', 'RESET_GPU'),
    156: ('Resource Retirement Event', 'RESET_GPU'),
    157: ('Resource Retirement Failure', 'IGNORE'),
    158: ('GPU Fatal Timeout', 'RESET_GPU'),
    159: ('CHI Non-Data Error', 'CHECK_UVM'),
    160: ('Channel Retirement Event', 'IGNORE'),
    161: ('Channel Retirement Failure', 'IGNORE'),
    162: ('Power Smoothing HW Circuitry capability reengaged', 'UNCONFIRMED'),
    163: ('Power Smoothing HW Circuitry capability disengaged', 'UNCONFIRMED'),
    164: ('Power Smoothing HW Circuitry low lifetime reached', 'UNCONFIRMED'),
    165: ('Power Smoothing HW Circuitry lifetime exhausted', 'UNCONFIRMED'),
    166: (
        'CC traffic seen prior to link properly being configured for encrypted traffic',
        'UNCONFIRMED',
    ),
    167: ('PCIE_FATAL_TIMEOUT', 'UNCONFIRMED'),
    168: ('Errors found in WPR (write protected region)', 'UNCONFIRMED'),
    169: ('Internal micro-controller halt', 'UNCONFIRMED'),
    170: ('Interrupt seen in CC mode', 'UNCONFIRMED'),
    171: (
        'Additional to Xid 48: details of the fault, telling DRAM from SRAM',
        'UNCONFIRMED',
    ),
    172: (
        'Additional to Xid 48: details of the fault, telling DRAM from SRAM',
        'UNCONFIRMED',
    ),
}
#: Immediate actions that take the GPU out of service until it is reset or the host reboots.
GONE_ACTIONS = ("RESET_GPU", "RESTART_BM", "RESTART_VM")

_ADDRESS = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}"
_XID = re.compile(
    rf"NVRM: Xid \((?:PCI:)?(?P<pci>{_ADDRESS}(?:\.[0-7])?|\.\.\.)\): "
    r"(?P<code>\d+)(?:,\s*(?P<message>.*))?$"
)
#: A fallen-off-the-bus report without an Xid: "NVRM: GPU at 0000:01:00.0 has fallen off the
#: bus.", "NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus.", "NVRM: The NVIDIA GPU <pci>".
_FALLEN = re.compile(rf"NVRM: (?:GPU (?:at )?|The NVIDIA GPU )(?P<pci>{_ADDRESS}(?:\.[0-7])?)")
_PID = re.compile(r"\bpid='?(\d+)'?")
_NAME = re.compile(r"\bname=([^,]+)")
#: Xid 154's message: "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)".
_RECOVERY = re.compile(r"\bto 0x([0-9A-Fa-f]+)(?: \(([^)]*)\))?")

# --- the one prefix grammar of kernel-log lines ---------------------------------------------
_CLOCK = r"\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?"
_ZONE = r"(?:Z|[+-]\d{2}:?\d{2})"
#: dmesg --time-format iso, journalctl -o short-iso(-precise), rsyslog's RFC 3339 stamps.
_ISO = rf"\d{{4}}-\d{{2}}-\d{{2}}[T ]{_CLOCK}{_ZONE}?"
_WORD = r"[^\W\d_]{2,}\.?"  # a month or day name in any locale: "Nov", "sep", "июл", "févr."
#: journalctl short / short-precise / syslog ("Nov 15 12:02:03[.470068]"), short-iso, and
#: short-full ("Fri 2024-11-15 12:02:03 UTC").
_JOURNAL_TIME = (rf"{_WORD}\s+\d{{1,2}}\s+{_CLOCK}|{_ISO}"
                 rf"|{_WORD}\s+\d{{4}}-\d{{2}}-\d{{2}}\s+{_CLOCK}(?:\s+[A-Z]{{2,5}})?")
#: dmesg's stamps: [seconds] (raw), [seconds <delta>] (delta), [+seconds] (reltime after the
#: first line), [Dec22 12:26] (reltime's first), [Fri Dec 22 12:26:24 2023] (ctime, -T), iso.
_SECONDS = r"\[\s*\+?\d+\.\d+(?:\s*<\s*\d+\.\d+>)?\s*\]"
_STAMP = (rf"{_SECONDS}|\[{_WORD}\s*\d{{1,2}}\s+\d{{2}}:\d{{2}}\]"
          rf"|\[{_WORD}\s+{_WORD}\s+\d{{1,2}}\s+{_CLOCK}\s+\d{{4}}\]|{_ISO}")
#: dmesg --decode / -x: "kern  :warn  : ", "syslog:err   : ".
_FACILITY = r"[a-z0-9]+\s*:\s*[a-z]+\s*:\s"
_PREFIX = re.compile(
    rf"\s*(?:(?P<journal>{_JOURNAL_TIME})(?:\s+\S+)?\s+kernel:\s*(?:{_SECONDS}\s*)?"
    rf"|kernel:\s*(?:{_SECONDS}\s*)?"
    rf"|(?:{_FACILITY})?(?:<\d+>)?(?P<stamps>(?:(?:{_STAMP})\s*)*))"
)
_FIRST_STAMP = re.compile(rf"\[\s*(?P<inner>[^\]]*?)\s*\]|(?P<iso>{_ISO})")
#: rsyslog writes a multi-line kernel message as one line, each newline escaped as "#012".
_ESCAPED_NEWLINE = re.compile(r"#012(?=\s*NVRM:)")


def split_prefix(line: str) -> tuple[str | None, str]:
    """(time as printed, message) of one kernel-log line, whatever printed it: dmesg (every
    --time-format, --decode / -x, --raw levels), journalctl (short, short-precise, short-iso,
    short-full, with or without the host, any locale's month names), syslog, or nothing at
    all. The message is what follows the prefix; a line with no real prefix before its text
    (NVRM quoted inside another message) keeps that text in the message, so that a reader that
    wants "NVRM:" first does not take it."""
    text = line.rstrip("\r\n")
    match = _PREFIX.match(text)
    assert match is not None  # every alternative can match the empty string's prefix
    if match.group("journal"):
        when: str | None = match.group("journal")
    else:
        first = _FIRST_STAMP.match(match.group("stamps") or "")
        when = (first.group("inner") or first.group("iso")) if first else None
    return when or None, text[match.end():]


def log_messages(lines: list[str]) -> list[tuple[str | None, str, str]]:
    """(time, message, the line as printed) for every message of a kernel log; a syslog line
    with rsyslog's "#012" escapes gives one message per escaped line, all with its time."""
    found = []
    for raw in lines:
        text = raw.rstrip("\r\n")
        first, *more = _ESCAPED_NEWLINE.split(text)
        when, message = split_prefix(first)
        found.append((when, message, text))
        found.extend((when, piece.strip(), text) for piece in more)
    return found


@dataclass(frozen=True)
class Xid:
    """One Xid line. `pci` is the kernel's domain:bus:device ("0000:01:00"), None when the
    line does not give it; `fallen` marks a fallen-off-the-bus report that had no Xid line."""

    code: int
    pci: str | None
    message: str
    when: str | None = None
    pid: int | None = None
    process: str | None = None
    line: str = ""
    fallen: bool = False

    @property
    def label(self) -> str:
        """What the Xid means in a few words ("fallen off the bus", "GSP Error")."""
        if self.fallen:
            return "fallen off the bus (no Xid line)"
        if self.code == 154:
            action = _recovery_action(self.message)
            if action is not None:
                value, name = action
                return "recovery action cleared" if value == 0 else f"recovery: {name}"
        if self.code == 79:
            return "fallen off the bus"
        return XID_CATALOGUE.get(self.code, ("uncatalogued",))[0]

    @property
    def action(self) -> str | None:
        """The catalogue's immediate action for the code (RESET_GPU, RESTART_APP, ...)."""
        return "RESTART_BM" if self.fallen else XID_CATALOGUE.get(self.code, (None, None))[1]

    @property
    def gone(self) -> bool:
        """True when the GPU must not serve until it is reset or the host rebooted."""
        if self.code == 154 and not self.fallen:
            action = _recovery_action(self.message)
            return action is None or action[0] != 0
        return self.action in GONE_ACTIONS


def _recovery_action(message: str) -> tuple[int, str] | None:
    """(value, name) of the action an Xid 154 changed to; None when the line does not say."""
    match = _RECOVERY.search(message)
    if not match:
        return None
    return int(match.group(1), 16), match.group(2) or f"0x{match.group(1)}"


def _normal(address: str) -> str | None:
    """The kernel's domain:bus:device of an address as printed ("0000:01:00.0" -> "0000:01:00");
    None for a redacted one."""
    return None if address == "..." else address.lower().split(".", 1)[0]


def parse_xid_line(line: str) -> Xid | None:
    """The Xid in one kernel-log line, or None when the line is not an Xid line.

    ``[ 12.5] NVRM: Xid (PCI:0000:01:00): 79, pid=7, GPU has fallen off the bus.`` gives
    ``Xid(code=79, pci="0000:01:00", when="12.5", pid=7, message="pid=7, GPU has ...")``.
    """
    when, message = split_prefix(line)
    return _xid(when, message, line.rstrip("\r\n").strip())


def _xid(when: str | None, text: str, line: str) -> Xid | None:
    match = _XID.match(text)
    if not match:
        return None
    message = (match.group("message") or "").strip()
    pid = _PID.search(message)
    name = _NAME.search(message)
    return Xid(
        code=int(match.group("code")),
        pci=_normal(match.group("pci")),
        message=message,
        when=when,
        pid=int(pid.group(1)) if pid else None,
        process=name.group(1).strip() if name else None,
        line=line,
    )


def parse_xid_lines(lines: list[str]) -> list[Xid]:
    """Every Xid in a kernel log, in order, fallen-off-the-bus reports without an Xid as Xid 79
    (the open module's spans three lines: the GPU's address on the first); other lines skipped."""
    faults: list[Xid] = []
    named: tuple[re.Match, str, str | None, int] | None = None  # the last "NVRM: GPU <pci>"
    for number, (when, message, text) in enumerate(log_messages(lines)):
        xid = _xid(when, message, text.strip())
        if xid is not None:
            faults.append(xid)
            continue
        match = _FALLEN.match(message)
        if match:
            named = (match, text, when, number)
        if named and "fallen off the bus" in message and number - named[3] <= 2:
            address, first = named[0], named[1]
            pci = _normal(address.group("pci"))
            fallen_when = named[2]
            named = None
            if faults and (faults[-1].code, faults[-1].pci, faults[-1].fallen) == (79, pci, False):
                continue  # the same event as the Xid 79 line just before it
            # one line that reads back alone (the GPU-lost mark keeps one line per event)
            line = first.strip() if "fallen off the bus" in first else (
                f"{first.strip()} (has fallen off the bus)")
            faults.append(Xid(
                code=79, pci=pci, fallen=True, line=line,
                message=f"GPU {address.group('pci')} has fallen off the bus",
                when=fallen_when,
            ))
    return faults


# --- the kernel's driver/library API mismatch, and the module it loaded ----------------------

_VERSION = r"\d+(?:\.\d+){1,3}"
#: Old wording ("the client has the version X, but this kernel module has the version Y.") and
#: the newer one naming the client ("the client 'kwin_wayland' (pid 1005) has the version X,
#: but this kernel module has the version Y."), over one to five NVRM lines.
_MISMATCH = re.compile(
    r"NVRM: API mismatch: the client (?:'(?P<process>[^']*)' \(pid (?P<pid>\d+)\) )?"
    rf"has the version (?P<client>{_VERSION}), but this kernel module has the version "
    rf"(?P<module>{_VERSION})\."
)
#: /proc/driver/nvidia/version's first line and the kernel's "NVRM: loading" line.
_MODULE = re.compile(
    r"NVRM(?: version:|: loading) NVIDIA UNIX (?:(?P<open>Open )Kernel Module for (?P<arch>\S+)"
    rf"|(?P<arch_p>\S+) Kernel Module)\s+(?P<version>{_VERSION})(?:\s|$)"
)
#: The lines of both, for a grep on the rig (continuations of the mismatch included).
MISMATCH_PATTERN = ("NVRM: (API mismatch|has the version|this kernel module|the version|"
                    "make sure|kernel module and|components have|have the same|loading NVIDIA)")


@dataclass(frozen=True)
class Mismatch:
    """The kernel's word that a client's user-space driver is not the loaded module's version."""

    client: str  # the user-space driver's version
    module: str  # the loaded kernel module's version
    process: str | None = None  # the newer wording names the client process and its pid
    pid: int | None = None
    when: str | None = None


@dataclass(frozen=True)
class Module:
    """The kernel module that runs: "open" (NVIDIA's open module) or "proprietary"."""

    flavour: str
    version: str
    arch: str


def parse_module(line: str) -> Module | None:
    """The module of /proc/driver/nvidia/version's first line or of an "NVRM: loading" line."""
    match = _MODULE.match(split_prefix(line)[1])
    if not match:
        return None
    return Module("open" if match.group("open") else "proprietary", match.group("version"),
                  match.group("arch") or match.group("arch_p"))


def _driver_events(lines: list[str]) -> list[Mismatch | Module]:
    """The API mismatches and module loads of a kernel log, in order."""
    found: list[Mismatch | Module] = []
    parts: list[str] = []
    when: str | None = None
    for at, message, _ in log_messages(lines):
        module = parse_module(message)
        if module is not None:
            found.append(module)
        if message.startswith("NVRM: API mismatch:"):
            parts, when = [message], at
        elif parts and message.startswith("NVRM:") and len(parts) < 5:
            parts.append(message.removeprefix("NVRM:"))
        else:
            parts = []
            continue
        match = _MISMATCH.match(" ".join(" ".join(parts).split()))
        if match:
            pid = match.group("pid")
            found.append(Mismatch(match.group("client"), match.group("module"),
                                  match.group("process"), int(pid) if pid else None, when))
            parts = []
    return found


def parse_mismatches(lines: list[str]) -> list[Mismatch]:
    """Every API mismatch of a kernel log, in order, in each wording and log format."""
    return [event for event in _driver_events(lines) if isinstance(event, Mismatch)]


def current_mismatch(lines: list[str]) -> Mismatch | None:
    """A boot's last API mismatch, unless a module was loaded after it (reloaded by hand)."""
    events = _driver_events(lines)
    return events[-1] if events and isinstance(events[-1], Mismatch) else None


def _pci_parts(address: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of '0000:01:00' or nvidia-smi's '00000000:01:00.0'."""
    parts = address.split(".", 1)[0].split(":")
    if len(parts) != 3:
        return None
    try:
        return int(parts[0], 16), int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None


def same_device(pci: str, bus_id: str) -> bool:
    """Whether an Xid's PCI address names the GPU whose nvidia-smi pci.bus_id is `bus_id`."""
    mine, theirs = _pci_parts(pci), _pci_parts(bus_id)
    return mine is not None and mine == theirs


# --- the cards a kernel log names, and the boots the journal keeps -----------------------------

#: "NVRM: GPU at PCI:0000:06:00: GPU-0b6b7808-..." (the driver's first words about a card).
_CARD_UUID = re.compile(rf"NVRM: GPU at PCI:(?P<pci>{_ADDRESS}): (?P<uuid>GPU-[0-9A-Fa-f-]+)\s*$")
#: "NVRM: GPU Board Serial Number: 1650423013443", the line after it; the open module also
#: writes "NVRM: GPU 0000:06:00.0: GPU serial number is 0." Consumer cards print 0: no serial.
_BOARD_SERIAL = re.compile(r"NVRM: GPU Board Serial Number: (?P<serial>\S+)\s*$")
_SERIAL_IS = re.compile(rf"NVRM: GPU (?P<pci>{_ADDRESS})(?:\.[0-7])?: GPU serial number is "
                        r"(?P<serial>[^\s.]+)\.?\s*$")


@dataclass(frozen=True)
class Card:
    """What a kernel log says about one card: its UUID and board serial, where printed."""

    pci: str
    uuid: str | None = None
    serial: str | None = None


def parse_cards(lines: list[str]) -> dict[str, Card]:
    """The cards a kernel log names, by PCI domain:bus:device; a serial of 0 is no serial."""
    cards: dict[str, Card] = {}
    last: str | None = None  # the card of the last "GPU at PCI:" line: the serial line's card
    for _, message, _ in log_messages(lines):
        uuid, board, serial_is = (pattern.match(message)
                                  for pattern in (_CARD_UUID, _BOARD_SERIAL, _SERIAL_IS))
        if uuid:
            last = uuid.group("pci").lower()
            cards[last] = Card(last, uuid.group("uuid"), cards.get(last, Card(last)).serial)
            continue
        match, pci = (board, last) if board else (serial_is, None)
        if match is None:
            last = None
            continue
        pci = pci or match.group("pci").lower()
        serial = match.group("serial")
        if serial.strip("0"):
            cards[pci] = Card(pci, cards.get(pci, Card(pci)).uuid, serial)
    return cards


#: `journalctl --list-boots`, either layout: before systemd 252 ``-2 <id> Di 2016-06-21
#: 22:01:04 CEST—Di 2016-06-21 22:21:40 CEST``, since then a header and the two stamps in
#: columns. Day names and zones are the locale's; the ISO date and time are not.
_BOOT = re.compile(r"\s*(?P<index>-?\d+)\s+(?P<id>[0-9a-f]{32})\s+(?P<rest>.*)")
_STAMP_ISO = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")


@dataclass(frozen=True)
class Boot:
    """One boot of `journalctl --list-boots`: 0 is the current one, -1 the one before."""

    index: int
    boot_id: str
    first: str | None  # the first entry's date and time as printed ("2016-06-21 22:01:04")
    last: str | None


def parse_boot(line: str) -> Boot | None:
    """One line of `journalctl --list-boots`; None for its header and anything else."""
    match = _BOOT.fullmatch(line.rstrip("\r\n"))
    if not match:
        return None
    stamps = _STAMP_ISO.findall(match.group("rest"))
    return Boot(int(match.group("index")), match.group("id"),
                stamps[0] if stamps else None, stamps[-1] if len(stamps) > 1 else None)
