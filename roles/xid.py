"""NVIDIA Xid lines from the kernel log: which GPU faulted, with what, and what that means.

The driver reports every GPU fault to the kernel log as one Xid line::

    NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=python3, GPU has fallen off the bus.

`journalctl -k` (short format) puts the time, the host (or not) and ``kernel:`` before it,
`dmesg` the seconds since boot in brackets (``dmesg -T`` and ``--ctime`` a date), syslog both;
old drivers write ``Xid (0000:01:00)`` without ``PCI:``. `parse_xid_line` reads all of these,
and only these: a line where ``NVRM: Xid`` stands inside another message (a USB product string,
say) is not an Xid. A GPU that fell off the bus is also reported without an Xid (``NVRM: GPU
at 0000:01:00.0 has fallen off the bus.``, and the open module's three-line ``The NVIDIA GPU
... has fallen off the bus``): `parse_xid_lines` reads those as Xid 79 (`fallen`).

What each code means and what to do right away is NVIDIA's Xid catalogue ("Analyzing Xid
Errors with the Xid Catalog", docs.nvidia.com/deploy/xid-errors; transcribed in
tests/fixtures/real/xid-catalogue.md). A code whose immediate action is a GPU reset or a
reboot (RESET_GPU, RESTART_BM, RESTART_VM) means the GPU must not serve until then (`gone`);
Xid 154 says so itself (its recovery action, until it changes back to 0x0).

Plain Python with no pyinfra, like roles/gpus.py (the Xid watch runs a copy of this file on the
rig), so the parser is tested on real lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
#: What may stand before "NVRM:" on a kernel-log line: nothing, dmesg's [time], or a journal or
#: syslog prefix "<time> [<host>] kernel:" (then perhaps dmesg's [time] again).
_PREFIX = re.compile(
    r"^\s*(?:\[(?P<dmesg>[^\]]*)\]\s*"
    r"|(?:(?P<when>.*?\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?(?:[+-]\d{2}:?\d{2}|Z)?)(?:\s+\S+)?\s+)?"
    r"kernel:\s*(?:\[[^\]]*\]\s*)?)?$"
)


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


def _when(prefix: str) -> str | None | bool:
    """The time a log line carries before 'NVRM:', as printed; None when it has none; False
    when the text before 'NVRM:' is no log prefix (NVRM quoted inside another message)."""
    match = _PREFIX.match(prefix)
    if not match:
        return False
    when = match.group("dmesg") if match.group("dmesg") is not None else match.group("when")
    return when.strip() or None if when is not None else None


def parse_xid_line(line: str) -> Xid | None:
    """The Xid in one kernel-log line, or None when the line is not an Xid line.

    ``[ 12.5] NVRM: Xid (PCI:0000:01:00): 79, pid=7, GPU has fallen off the bus.`` gives
    ``Xid(code=79, pci="0000:01:00", when="12.5", pid=7, message="pid=7, GPU has ...")``.
    """
    text = line.rstrip("\r\n")
    match = _XID.search(text)
    if not match:
        return None
    when = _when(text[: match.start()])
    if when is False:
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
        line=text.strip(),
    )


def parse_xid_lines(lines: list[str]) -> list[Xid]:
    """Every Xid in a kernel log, in order, fallen-off-the-bus reports without an Xid as Xid 79
    (the open module's spans three lines: the GPU's address on the first); other lines skipped."""
    faults: list[Xid] = []
    named: tuple[re.Match, str, int] | None = None  # the last "NVRM: ... GPU <pci>" line
    for number, raw in enumerate(lines):
        text = raw.rstrip("\r\n")
        xid = parse_xid_line(text)
        if xid is not None:
            faults.append(xid)
            continue
        match = _FALLEN.search(text)
        if match and _when(text[: match.start()]) is not False:
            named = (match, text, number)
        if named and "fallen off the bus" in text and number - named[2] <= 2:
            address, first = named[0], named[1]
            pci = _normal(address.group("pci"))
            named = None
            if faults and (faults[-1].code, faults[-1].pci, faults[-1].fallen) == (79, pci, False):
                continue  # the same event as the Xid 79 line just before it
            # one line that reads back alone (the GPU-lost mark keeps one line per event)
            line = first.strip() if "fallen off the bus" in first else (
                f"{first.strip()} (has fallen off the bus)")
            faults.append(Xid(
                code=79, pci=pci, fallen=True, line=line,
                message=f"GPU {address.group('pci')} has fallen off the bus",
                when=_when(first[: address.start()]) or None,
            ))
    return faults


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
