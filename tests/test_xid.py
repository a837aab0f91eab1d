"""The Xid parser on kernel-log lines as journalctl -k, dmesg and dmesg -T write them.

The lines are in the NVIDIA driver's own format, as operators have posted them from real hosts
(public bug reports and runbooks): the code, the PCI address without the function, then
`pid=`, `name=` and the message, or the message alone.
"""

from __future__ import annotations

import pytest

from rigbook.rigside.xid import Xid, parse_xid_line, parse_xid_lines, same_device

DMESG_79 = (
    "[12345.678901] NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=python3, "
    "GPU has fallen off the bus."
)
JOURNAL_79 = (
    "Nov 29 10:11:12 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid='<unknown>', "
    "name=<unknown>, GPU has fallen off the bus."
)
DMESG_T_79 = (
    "[Mon Sep 14 04:48:45 2026] NVRM: Xid (PCI:0000:02:00): 79, pid=9962, name=python, "
    "GPU has fallen off the bus."
)
JOURNAL_154 = (
    "Jul 11 05:51:26 gpu-node-01 kernel: NVRM: Xid (PCI:0000:2a:00): 154, "
    "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
)
DMESG_154_REBOOT = (
    "[  912.004211] NVRM: Xid (PCI:0000:02:00): 154, GPU recovery action changed from 0x0 "
    "(None) to 0x2 (Node Reboot Required)"
)
CLEARED_154 = (
    "[  950.100000] NVRM: Xid (PCI:0000:02:00): 154, GPU recovery action changed from 0x1 "
    "(GPU Reset Required) to 0x0 (None)"
)
DMESG_31 = (
    "[315911.559820] NVRM: Xid (PCI:0000:03:00): 31, pid=12083, name=chrome, Ch 00000010, "
    "intr 10000000. MMU Fault: ENGINE CE0 HUBCLIENT_CE0 faulted @ 0x0_04a00000. Fault is of "
    "type FAULT_INFO_TYPE_UNSUPPORTED_KIND ACCESS_TYPE_WRITE"
)
JOURNAL_13 = (
    "Nov 27 08:00:01 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 13, pid=2345, name=python3, "
    "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address"
)
DMESG_62 = (
    "[315905.140252] NVRM: Xid (PCI:0000:03:00): 62, 00000a9f 00000a85 00000a72 00003786 "
    "00001d3e 000027d6 01013289 00000000"
)


def test_dmesg_line():
    xid = parse_xid_line(DMESG_79)
    assert xid == Xid(
        code=79, pci="0000:01:00", message="pid=1234, name=python3, GPU has fallen off the bus.",
        when="12345.678901", pid=1234, process="python3", line=DMESG_79,
    )
    assert xid.label == "fallen off the bus"
    assert xid.gone


def test_journalctl_short_line():
    xid = parse_xid_line(JOURNAL_79)
    assert (xid.code, xid.pci, xid.when) == (79, "0000:01:00", "Nov 29 10:11:12")
    assert xid.pid is None  # pid='<unknown>': the driver did not know it
    assert xid.process == "<unknown>"
    assert xid.gone


def test_dmesg_with_dates():
    xid = parse_xid_line(DMESG_T_79)
    assert xid.when == "Mon Sep 14 04:48:45 2026"
    assert (xid.pci, xid.pid, xid.process) == ("0000:02:00", 9962, "python")


def test_journalctl_short_iso_and_crlf():
    line = (
        "2026-11-29T10:11:12+0000 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 13, pid=7, "
        "name=vllm, Graphics Exception: ESR 0x504648=0x80000000\r\n"
    )
    xid = parse_xid_line(line)
    assert xid.when == "2026-11-29T10:11:12+0000"
    assert xid.message.endswith("ESR 0x504648=0x80000000")
    assert xid.line.endswith("0x80000000")


@pytest.mark.parametrize(
    ("line", "label", "gone"),
    [
        (JOURNAL_154, "recovery: GPU Reset Required", True),
        (DMESG_154_REBOOT, "recovery: Node Reboot Required", True),
        (CLEARED_154, "recovery action cleared", False),
        ("NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed",
         "GPU Recovery Action Changed", True),
        (DMESG_31, "GPU memory page fault", False),
        (JOURNAL_13, "Graphics Engine Exception", False),
        (DMESG_62, "Internal micro-controller halt (newer drivers)", True),  # RESET_GPU
    ],
)
def test_classification(line, label, gone):
    xid = parse_xid_line(line)
    assert (xid.label, xid.gone) == (label, gone)


def test_mmu_fault_keeps_pid_and_process():
    xid = parse_xid_line(DMESG_31)
    assert (xid.code, xid.pid, xid.process, xid.pci) == (31, 12083, "chrome", "0000:03:00")
    assert "MMU Fault: ENGINE CE0" in xid.message


def test_minimal_line_and_function_in_the_address():
    xid = parse_xid_line("NVRM: Xid (PCI:0000:00:1E.0): 13")
    assert (xid.code, xid.pci, xid.message, xid.when, xid.pid) == (13, "0000:00:1e", "", None,
                                                                   None)


@pytest.mark.parametrize(
    "line",
    [
        "[12345.700000] NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
        "[315905.140245] NVRM: GPU at PCI:0000:03:00: GPU-409297e7-8fea-6fdd-c14e-73154d286f4a",
        "NVRM: Xid (PCI:0000:66:00): abc, pid=2280636",
        "Nov 29 10:11:12 rig1 kernel: usb 1-1: new high-speed USB device number 2",
        "",
        # NVRM quoted after something that is no kernel-log prefix (issue 35: only after a
        # real prefix): another program's message, a user's echo, a stamp that is not dmesg's
        "Nov 29 10:11:12 rig1 sudo[77]: NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off",
        "Nov 29 10:11:12 rig1 kernel: usb 1-1: Product: NVRM: Xid (PCI:0000:01:00): 79, x",
        "[drm] NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
        "kern  :warn  : echo NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
        "2024-11-15 NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
    ],
)
def test_other_lines_are_not_xids(line):
    assert parse_xid_line(line) is None


def test_the_h200_hosts_own_driver_lines_are_not_xids():
    """dmesg lines of a real H200 host (driver 580.159.04), captured by rigbook status."""
    boot = [
        "[    0.437256] nvidia: loading out-of-tree module taints kernel.",
        "[    0.531264] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  "
        "Release Build  (nixbld@)  ",
        "[    1.151762] NVRM: gpuClearFbhubPoisonIntrForBug2924523_GA100: FBHUB Interrupt "
        "detected. Clearing it.",
        "[    3.769170] NVRM: Persistence mode is deprecated and will be removed in a future "
        "release. Please use nvidia-persistenced instead.",
    ]
    assert parse_xid_lines(boot) == []


def test_a_whole_log_in_order():
    log = [
        "[    0.000000] Linux version 6.1.0-27-amd64",
        DMESG_79,
        "[12345.700000] NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
        DMESG_154_REBOOT,
    ]
    assert [xid.code for xid in parse_xid_lines(log)] == [79, 154]


@pytest.mark.parametrize(
    ("pci", "bus_id", "same"),
    [
        ("0000:01:00", "00000000:01:00.0", True),
        ("0000:3b:00", "00000000:3B:00.0", True),
        ("0000:00:06", "00000000:00:06.0", True),  # the H200's bus id (tests/fixtures)
        ("0000:01:00", "00000000:02:00.0", False),
        ("0001:01:00", "00000000:01:00.0", False),
        ("0000:01:00", "", False),
    ],
)
def test_xid_address_against_nvidia_smi_bus_id(pci, bus_id, same):
    assert same_device(pci, bus_id) is same
