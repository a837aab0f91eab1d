"""NVIDIA Xid lines from the kernel log: which GPU faulted, with what, and what that means.

The driver reports every GPU fault to the kernel log as one Xid line::

    NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=python3, GPU has fallen off the bus.

`journalctl -k` (short format) puts the time, the host and ``kernel:`` before it, `dmesg` the
seconds since boot in brackets (``dmesg -T`` a date); `parse_xid_line` reads all of them, and
any other line is not an Xid (None), so a whole log can be fed to it.

The Xids a rig operator acts on (NVIDIA's Xid catalogue):

- 79: the GPU has fallen off the bus: it is gone until the host reboots;
- 154: the driver's GPU recovery action changed, e.g. to "Node Reboot Required": the GPU takes
  no new work until that action is taken (a change back to 0x0 (None) clears it);
- 31: an MMU fault (a page fault of one process: usually the application, sometimes the driver);
- 13: a graphics engine exception (a kernel of one process faulted).

Plain Python with no pyinfra, like roles/gpus.py, so the parser is tested on real lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Xid code -> (what it is, whether the GPU is unusable until the host reboots or resets it).
XID_KINDS: dict[int, tuple[str, bool]] = {
    79: ("fallen off the bus", True),
    154: ("node reboot required", True),
    31: ("MMU fault", False),
    13: ("graphics engine exception", False),
}

_XID = re.compile(
    r"NVRM: Xid \(PCI:(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?\): "
    r"(?P<code>\d+)(?:,\s*(?P<message>.*))?$"
)
_PID = re.compile(r"\bpid='?(\d+)'?")
_NAME = re.compile(r"\bname=([^,]+)")
#: Xid 154's message: "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)".
_RECOVERY = re.compile(r"\bto 0x([0-9A-Fa-f]+)(?: \(([^)]*)\))?")
#: What journalctl's short formats put before the message: "<time> <host> kernel: ".
_JOURNAL_PREFIX = re.compile(r"^(?P<when>.*\S)\s+\S+\s+kernel:\s*(?:\[[^\]]*\]\s*)?$")


@dataclass(frozen=True)
class Xid:
    """One Xid line. `pci` is the kernel's domain:bus:device ("0000:01:00")."""

    code: int
    pci: str
    message: str
    when: str | None = None
    pid: int | None = None
    process: str | None = None
    line: str = ""

    @property
    def label(self) -> str:
        """What the Xid means in a few words ("fallen off the bus", "Xid 48")."""
        if self.code == 154:
            action = _recovery_action(self.message)
            if action is not None:
                value, name = action
                return "recovery action cleared" if value == 0 else f"recovery: {name}"
        return XID_KINDS.get(self.code, (f"Xid {self.code}", False))[0]

    @property
    def gone(self) -> bool:
        """True when the GPU takes no work until the host is rebooted (79, 154 not cleared)."""
        if self.code == 154:
            action = _recovery_action(self.message)
            return action is None or action[0] != 0
        return XID_KINDS.get(self.code, ("", False))[1]


def _recovery_action(message: str) -> tuple[int, str] | None:
    """(value, name) of the action an Xid 154 changed to; None when the line does not say."""
    match = _RECOVERY.search(message)
    if not match:
        return None
    return int(match.group(1), 16), match.group(2) or f"0x{match.group(1)}"


def _when(prefix: str) -> str | None:
    """The time a log line carries before 'NVRM:', as written; None when it has none."""
    prefix = prefix.strip()
    if not prefix:
        return None
    journal = _JOURNAL_PREFIX.match(prefix)
    if journal:
        return journal.group("when")
    if prefix.startswith("[") and prefix.endswith("]"):  # dmesg: [  300.123456] or -T's date
        return " ".join(prefix[1:-1].split())
    return prefix


def parse_xid_line(line: str) -> Xid | None:
    """The Xid in one kernel-log line, or None when the line is not an Xid line.

    ``[ 12.5] NVRM: Xid (PCI:0000:01:00): 79, pid=7, GPU has fallen off the bus.`` gives
    ``Xid(code=79, pci="0000:01:00", when="12.5", pid=7, message="pid=7, GPU has ...")``.
    """
    text = line.rstrip("\r\n")
    match = _XID.search(text)
    if not match:
        return None
    message = (match.group("message") or "").strip()
    pid = _PID.search(message)
    name = _NAME.search(message)
    return Xid(
        code=int(match.group("code")),
        pci=match.group("pci").lower(),
        message=message,
        when=_when(text[: match.start()]),
        pid=int(pid.group(1)) if pid else None,
        process=name.group(1).strip() if name else None,
        line=text.strip(),
    )


def parse_xid_lines(lines: list[str]) -> list[Xid]:
    """Every Xid in a kernel log, in order; other lines are skipped."""
    return [xid for xid in map(parse_xid_line, lines) if xid is not None]


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
