"""Rig guards: the /dev/shm reaper's decisions, the Xid watch, GPU topology, the NCCL P2P rule.

The reaper and the watch are the scripts a rig runs (files/guards/), loaded or run from a copy
laid out as on the rig (the watch beside a copy of rigbook/rigside/xid.py, the reaper beside a copy
of rigbook/rigside/shmglob.py). The reaper decides on fake /proc trees here, on this machine's real
/proc for a file this test maps itself, and reaps with real processes holding real files: a /proc
of links to their /proc/PID folders (this machine's PID 1 cannot be read even by root, which
would make every real run refuse).
Topology parsers read the real H200 captures (tests/fixtures/nvidia-h200: one GPU, no NVLink);
the multi-GPU samples below are CONSTRUCTED in nvidia-smi's real format (tab-separated, ANSI
underline around the header), since no multi-GPU capture exists.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import importlib.machinery
import importlib.util
import logging
import mmap
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand

from rigbook.core.checks import Facts
from rigbook.core.errors import RigbookError
from rigbook.core.render import render
from rigbook.core.spec import Rig, parse_rig
from rigbook.rigside.gpus import Gpu, GpuProbe
from rigbook.roles import guards
from rigbook.roles.guards import (
    GpuLostMark,
    NvLinks,
    ReapPlan,
    ShmVerdict,
    Topology,
    TopoMatrix,
    gpu_lost_reason,
    p2p_disable_problem,
    parse_gpu_lost,
    parse_nvlink_status,
    parse_reap_plan,
    parse_topo_matrix,
    parse_topology,
    reap_shm,
    topology_findings,
    topology_report,
    topology_summary,
    topology_warnings,
)
from rigbook.roles.recipes import catalogue
from rigbook.status import build_rig_status
from tests.opkit import run_op, shell

ROOT = Path(__file__).resolve().parent.parent
GUARDS = ROOT / "files" / "guards"
H200 = ROOT / "tests" / "fixtures" / "nvidia-h200"
SIM_KMSG = ROOT / "sandbox" / "simulated" / "kmsg-xid79.log"


def load_script(path: Path, name: str):
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    loader.exec_module(module)
    return module


#: The reaper as installed on a rig: the script with a copy of rigbook/rigside/shmglob.py beside it.
_REAPER_DIR = tempfile.TemporaryDirectory(prefix="rigbook-guards-")
for _source in (GUARDS / "rigbook-shm-reaper", ROOT / "rigbook" / "rigside" / "shmglob.py"):
    shutil.copy(_source, _REAPER_DIR.name)
REAPER = Path(_REAPER_DIR.name) / "rigbook-shm-reaper"
reaper = load_script(REAPER, "rigbook_shm_reaper")


def rig(**data) -> Rig:
    return Rig(**{"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2,
                  "power_profile": "stock", **data})


# --- the reaper on a fake /proc -------------------------------------------------------------


class FakeProc:
    """A /proc tree: one folder per PID with comm, maps and fd/ links, as the kernel lays it."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir()

    def process(self, pid: int, comm: str = "python3", maps: list[str] = (),
                fds: dict[int, str] | None = None) -> Path:
        folder = self.root / str(pid)
        (folder / "fd").mkdir(parents=True)
        (folder / "comm").write_text(comm + "\n")
        (folder / "maps").write_text("".join(line + "\n" for line in maps))
        for fd, target in (fds or {}).items():
            os.symlink(target, folder / "fd" / str(fd))
        return folder


def maps_line(path: Path, shared: bool = True) -> str:
    """A /proc/PID/maps line of a file mapping, with the file's real device and inode."""
    st = path.stat()
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    perms = "rw-s" if shared else "r--p"
    return f"7f0c00000000-7f0c40000000 {perms} 00000000 {dev} {st.st_ino}                   {path}"


LIBC = "7f0c50000000-7f0c50028000 r--p 00000000 fd:01 1311745                    /usr/lib/x86_64-linux-gnu/libc.so.6"  # noqa: E501
ANON = "7ffd1c5e2000-7ffd1c603000 rw-p 00000000 00:00 0                          [stack]"


@pytest.fixture
def shm(tmp_path) -> Path:
    folder = tmp_path / "shm"
    folder.mkdir()
    return folder


def leak(shm: Path, name: str = "vllm_offload_0b7e.mmap", size: int = 3 * 2**30 // 2) -> Path:
    path = shm / name
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


def judge(shm: Path, proc: Path, patterns=reaper.DEFAULT_PATTERNS):
    files = reaper.candidates(str(shm), tuple(patterns))
    return files, reaper.decide(files, reaper.scan(str(proc), files))


def test_only_matching_regular_files_are_candidates(shm):
    path = leak(shm)
    (shm / "pulse-shm-1234").write_bytes(b"x")
    (shm / "vllm_offload_dir.mmap").mkdir()
    os.symlink(path, shm / "vllm_offload_link.mmap")
    files = reaper.candidates(str(shm), reaper.DEFAULT_PATTERNS)
    assert [c.path for c in files] == [str(path)]
    assert files[0].size == 3 * 2**30 // 2


def test_held_through_a_mapping_is_kept(shm, tmp_path):
    path = leak(shm)
    proc = FakeProc(tmp_path / "proc")
    proc.process(1, "systemd", [LIBC, ANON])
    proc.process(812, "python3", [LIBC, maps_line(path), ANON])
    _, (verdict,) = judge(shm, proc.root)
    assert verdict.action == "keep"
    assert verdict.reason == "held by PID 812 (python3, maps)"


def test_a_mapping_is_matched_by_inode_even_under_another_path(shm, tmp_path):
    """A process in another mount namespace sees the file elsewhere; device and inode match."""
    path = leak(shm)
    proc = FakeProc(tmp_path / "proc")
    line = maps_line(path).replace(str(path), "/container/shm/renamed.mmap")
    proc.process(900, "python3", [line])
    _, (verdict,) = judge(shm, proc.root)
    assert verdict.action == "keep" and "PID 900" in verdict.reason


def test_held_through_an_open_file_is_kept(shm, tmp_path):
    path = leak(shm)
    proc = FakeProc(tmp_path / "proc")
    proc.process(77, "vllm", [LIBC], fds={0: "/dev/null", 5: "socket:[12345]", 9: str(path)})
    _, (verdict,) = judge(shm, proc.root)
    assert (verdict.action, verdict.reason) == ("keep", "held by PID 77 (vllm, fd 9)")


def test_no_holder_is_reaped_and_the_line_says_the_size(shm, tmp_path):
    path = leak(shm)
    other = leak(shm, "vllm_offload_held.mmap", 4096)
    proc = FakeProc(tmp_path / "proc")
    proc.process(1, "systemd", [LIBC, ANON], fds={0: "/dev/null"})
    proc.process(2, "python3", [maps_line(other)])
    _, verdicts = judge(shm, proc.root)
    assert [(v.path, v.action) for v in verdicts] == [
        (str(path), "delete"), (str(other), "keep"),
    ]
    done = reaper.run(str(shm), str(proc.root), reaper.DEFAULT_PATTERNS, dry_run=False)
    assert not path.exists() and other.exists()
    line = reaper.line_of(done[0], dry_run=False)
    assert line == (f"reaped {path} (1.5 GiB, 1610612736 bytes; 0.0 GiB in RAM): no process "
                    "maps it or holds it open (2 processes read, and 2 again after it was set "
                    "aside)")
    assert os.listdir(shm / reaper.QUARANTINE) == []


def test_unreadable_mappings_refuse_and_nothing_is_deleted(shm, tmp_path, monkeypatch):
    """A process whose maps cannot be read (EACCES: another user's, reaper unprivileged)."""
    path = leak(shm)
    proc = FakeProc(tmp_path / "proc")
    proc.process(1, "systemd", [LIBC])
    secret = proc.process(4242, "sleep", [maps_line(path)])
    real_open = open

    def guarded_open(file, *args, **kwargs):
        if str(file) == str(secret / "maps"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(reaper, "open", guarded_open, raising=False)
    (verdict,) = reaper.run(str(shm), str(proc.root), reaper.DEFAULT_PATTERNS, dry_run=False)
    assert verdict.action == "refuse"
    uid = os.stat(secret).st_uid
    assert verdict.reason == (
        f"cannot read the mappings of PID 4242 (sleep, uid {uid}): Permission denied: "
        f"{secret / 'maps'}; an unreadable holder is indistinguishable from no holder, so "
        "nothing was deleted"
    )
    assert path.exists()
    assert reaper.line_of(verdict, False).startswith(f"refused {path} (1.5 GiB, 1610612736 bytes")


def test_a_held_file_stays_kept_even_when_others_are_unreadable(shm, tmp_path, monkeypatch):
    path = leak(shm)
    proc = FakeProc(tmp_path / "proc")
    proc.process(5, "python3", [maps_line(path)])
    proc.process(6, "sshd", [])
    real_listdir = os.listdir

    def guarded_listdir(folder):
        if str(folder).endswith("/6/fd"):
            raise PermissionError(errno.EACCES, "Permission denied", str(folder))
        return real_listdir(folder)

    monkeypatch.setattr(reaper.os, "listdir", guarded_listdir)
    _, (verdict,) = judge(shm, proc.root)
    assert verdict.action == "keep"


def test_a_process_that_exits_while_read_is_skipped(shm, tmp_path, monkeypatch):
    path = leak(shm)
    proc = FakeProc(tmp_path / "proc")
    gone = proc.process(31, "python3", [maps_line(path)])
    real_open = open

    def exiting_open(file, *args, **kwargs):
        if str(file) == str(gone / "maps"):
            shutil.rmtree(gone)  # the kernel removes /proc/PID when the process is reaped
            raise ProcessLookupError(errno.ESRCH, "No such process")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(reaper, "open", exiting_open, raising=False)
    _, (verdict,) = judge(shm, proc.root)
    assert verdict.action == "delete"


def test_a_vanish_error_of_a_process_still_there_is_retried(shm, tmp_path, monkeypatch):
    path = leak(shm)
    proc = FakeProc(tmp_path / "proc")
    flaky = proc.process(40, "python3", [maps_line(path)])
    real_open = open
    calls = []

    def flaky_open(file, *args, **kwargs):
        if str(file) == str(flaky / "maps"):
            calls.append(file)
            if len(calls) == 1:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(reaper, "open", flaky_open, raising=False)
    _, (verdict,) = judge(shm, proc.root)
    assert len(calls) == 2 and verdict.action == "keep"


def test_a_process_started_during_the_scan_is_read_too(shm, tmp_path, monkeypatch):
    path = leak(shm)
    proc = FakeProc(tmp_path / "proc")
    proc.process(10, "bash", [])
    real_scan_one = reaper._scan_one

    def forking_scan_one(root, pid, files, result):
        if pid == 10 and not (proc.root / "11").exists():
            proc.process(11, "python3", [maps_line(path)])  # a child forked after the listing
        real_scan_one(root, pid, files, result)

    monkeypatch.setattr(reaper, "_scan_one", forking_scan_one)
    _, (verdict,) = judge(shm, proc.root)
    assert (verdict.action, verdict.reason) == ("keep", "held by PID 11 (python3, maps)")


def test_hidepid_hides_processes_from_an_unprivileged_reaper(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text(f"proc {proc} proc rw,nosuid,nodev,noexec,relatime,hidepid=invisible 0 0\n")
    assert reaper.hidden_processes(str(proc), euid=1000, mounts=str(mounts)) == (
        f"{proc} is mounted with hidepid=invisible: other users' processes are hidden"
    )
    assert reaper.hidden_processes(str(proc), euid=0, mounts=str(mounts)) is None
    mounts.write_text(f"proc {proc} proc rw,relatime 0 0\n")
    assert reaper.hidden_processes(str(proc), euid=1000, mounts=str(mounts)) is None
    scan = reaper.Scan(hidden="hidden!")
    files = [reaper.Candidate("/dev/shm/vllm_offload_1.mmap", 1, 1, (0, 1), 2)]
    (verdict,) = reaper.decide(files, scan)
    assert verdict.action == "refuse" and verdict.reason.startswith("hidden!; an unreadable")


def test_maps_lines_of_this_process_parse():
    """Every line of a real /proc/self/maps parses (or is anonymous)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    parsed = [reaper.parse_maps_line(line) for line in lines]
    files = [p for p in parsed if p is not None]
    assert files and all(p[2].startswith(("/", "[")) for p in files)
    assert reaper.parse_maps_line(ANON)[2] == "[stack]"
    assert reaper.parse_maps_line("7f0c0-7f0c1 rw-p 00000000 00:00 0") is None


def test_real_proc_finds_this_process_as_the_holder():
    """On this machine's own /proc: a /dev/shm file this test maps is held by this process."""
    folder = Path("/dev/shm") / f"rigbook-test-{uuid.uuid4().hex}"
    folder.mkdir()
    try:
        path = folder / "vllm_offload_test.mmap"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 1 << 20)
        mapping = mmap.mmap(fd, 0)
        os.close(fd)  # held through the mapping alone
        files = reaper.candidates(str(folder), reaper.DEFAULT_PATTERNS)
        held = reaper.scan("/proc", files).holders[str(path)]
        assert reaper.Holder(os.getpid(), Path("/proc/self/comm").read_text().strip(),
                             "maps") in held
        mapping.close()
        after = reaper.scan("/proc", files)
        assert not any(h.pid == os.getpid() for h in after.holders[str(path)])
        (verdict,) = reaper.decide(files, after)
        # This machine may have processes even root cannot read (then the reaper refuses).
        assert verdict.action == ("refuse" if after.unreadable else "delete"), verdict
    finally:
        shutil.rmtree(folder)


def test_the_cli_json_is_what_the_fact_reads(shm, tmp_path):
    path = leak(shm)
    proc = FakeProc(tmp_path / "proc")
    proc.process(3, "python3", [])
    done = subprocess.run(
        [sys.executable, str(REAPER), "--dir", str(shm), "--proc",
         str(proc.root), "--dry-run", "--json"],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    plan = parse_reap_plan([*done.stdout.splitlines(), f"{guards._RC} 0"])
    assert plan.installed and plan.error is None
    (verdict,) = plan.verdicts
    assert (verdict.path, verdict.action, verdict.size) == (str(path), "delete", 1610612736)
    assert verdict.line.startswith(f"would reap {path} (1.5 GiB")
    assert path.exists()  # a dry run


def test_the_cli_exits_3_on_a_refusal_with_the_reason_on_stderr(shm, tmp_path):
    leak(shm)
    proc = FakeProc(tmp_path / "proc")
    (proc.process(3, "python3", []) / "maps").unlink()
    (proc.root / "3" / "maps").mkdir()  # unreadable as a file: not a vanished process
    done = subprocess.run(
        [sys.executable, str(REAPER), "--dir", str(shm), "--proc",
         str(proc.root)], capture_output=True, text=True,
    )
    assert done.returncode == reaper.EXIT_REFUSED
    assert done.stdout == ""
    assert "cannot read the mappings of PID 3 (python3, uid" in done.stderr
    assert "Is a directory" in done.stderr and "nothing was deleted" in done.stderr
    missing = subprocess.run(
        [sys.executable, str(REAPER), "--dir", str(tmp_path / "none")],
        capture_output=True, text=True,
    )
    assert missing.returncode == reaper.EXIT_ERROR
    assert "No such file or directory; nothing was deleted" in missing.stderr


# --- the reaper with real processes: the quarantine and the second reading -------------------

HOLD = """\
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
if sys.argv[2] == "maps":
    buffer = mmap.mmap(fd, 0)
    buffer[:4] = b"kv!!"
    os.close(fd)  # held through the mapping alone, as an engine holds its offload buffer
else:
    os.pwrite(fd, b"kv!!", 0)
print("ready", flush=True)
sys.stdin.read()  # holds it until the test closes stdin
"""


class RealProc(FakeProc):
    """A /proc that lists only the given real processes: links to their /proc/PID folders."""

    def add(self, pid: int) -> int:
        os.symlink(f"/proc/{pid}", self.root / str(pid))
        return pid


class Holders:
    """Real processes that map (or open) a file and write b"kv!!" into it, until released."""

    def __init__(self):
        self.children: dict[int, subprocess.Popen] = {}

    def start(self, path: Path, how: str = "maps") -> int:
        child = subprocess.Popen([sys.executable, "-c", HOLD, str(path), how],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.children[child.pid] = child
        assert child.stdout.readline() == "ready\n"
        return child.pid

    def release(self, pid: int) -> None:
        child = self.children.pop(pid)
        child.stdin.close()
        child.wait(10)


@pytest.fixture
def holders():
    started = Holders()
    yield started
    for pid in list(started.children):
        started.release(pid)


def unreadable(proc: FakeProc, pid: int, comm: str) -> None:
    """A process whose maps cannot be read (a folder: not a vanish error, so no retry)."""
    maps = proc.process(pid, comm) / "maps"
    maps.unlink()
    maps.mkdir()


def reap(shm: Path, proc: FakeProc, dry_run: bool = False, patterns=reaper.DEFAULT_PATTERNS):
    return reaper.run(str(shm), str(proc.root), tuple(patterns), dry_run)


def names_and_actions(verdicts) -> list[tuple[str, str]]:
    return sorted((Path(v.path).name, v.action) for v in verdicts)


def test_an_open_file_is_matched_by_device_and_inode_whatever_its_name_now(
        shm, tmp_path, holders):
    """Issue 29, finding 7: fds were matched by basename only. A real process opens a buffer
    as staging.tmp, which then gets its final name by link + unlink (a rename that replaces
    nothing): /proc/PID/fd/N reads `.../staging.tmp (deleted)`, and the buffer, still open,
    counted as unheld and was deleted."""
    staging = leak(shm, "staging.tmp", 4096)
    proc = RealProc(tmp_path / "proc")
    pid = proc.add(holders.start(staging, "fd"))
    final = shm / "vllm_offload_renamed.mmap"
    os.link(staging, final)
    staging.unlink()
    assert os.readlink(f"/proc/{pid}/fd/3").endswith("/staging.tmp (deleted)")
    verdicts = reap(shm, proc)
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    assert [(v.action, v.reason) for v in verdicts] == [
        ("keep", f"held by PID {pid} ({comm}, fd 3)")]
    assert final.read_bytes()[:4] == b"kv!!"


def test_real_holders_keep_their_files_a_leak_is_reaped_and_the_quarantine_is_left_empty(
        shm, tmp_path, holders):
    held, leaked = leak(shm, "vllm_offload_held.mmap", 4096), leak(shm, size=4096)
    proc = RealProc(tmp_path / "proc")
    proc.add(os.getpid())
    pid = proc.add(holders.start(held))
    dry = reap(shm, proc, dry_run=True)
    assert not (shm / reaper.QUARANTINE).exists()  # a dry run changes nothing, creates nothing
    blind = FakeProc(tmp_path / "blind")
    unreadable(blind, 1, "systemd")
    assert names_and_actions(reap(shm, blind)) == [
        ("vllm_offload_0b7e.mmap", "refuse"), ("vllm_offload_held.mmap", "refuse")]
    assert not (shm / reaper.QUARANTINE).exists()  # nor a run that refuses
    verdicts = reap(shm, proc)
    assert [(v.path, v.action) for v in verdicts] == [(v.path, v.action) for v in dry] == [
        (str(leaked), "delete"), (str(held), "keep")]
    assert verdicts[1].reason.startswith(f"held by PID {pid} (")  # never set aside
    assert not leaked.exists() and held.read_bytes()[:4] == b"kv!!"
    assert os.listdir(shm / reaper.QUARANTINE) == []
    assert names_and_actions(reap(shm, proc)) == [("vllm_offload_held.mmap", "keep")]


@pytest.mark.parametrize("how", ["maps", "fd"])
def test_a_file_taken_after_the_first_reading_is_kept_and_put_back(
        shm, tmp_path, monkeypatch, holders, how):
    """The race the second reading closes: a process maps (or opens) a file after every
    process was read and before the file is set aside. The first reading found no holder (it
    would have been deleted); the second finds the new one, and the file goes back under its
    name, the same file with what the holder wrote into it."""
    leaked, taken = leak(shm, size=4096), leak(shm, "vllm_offload_taken.mmap", 4096)
    inode = taken.stat().st_ino
    proc = RealProc(tmp_path / "proc")
    proc.add(os.getpid())
    first: list = []
    real_scan = reaper.scan

    def scan_then_take(root, files):
        result = real_scan(root, files)
        if not first:
            first.extend(reaper.decide(files, result))
            first.append(proc.add(holders.start(taken, how)))  # by name: it is still there
        return result

    monkeypatch.setattr(reaper, "scan", scan_then_take)
    verdicts = reap(shm, proc)
    *decided, pid = first
    assert names_and_actions(decided) == [("vllm_offload_0b7e.mmap", "delete"),
                                          ("vllm_offload_taken.mmap", "delete")]
    assert names_and_actions(verdicts) == [("vllm_offload_0b7e.mmap", "delete"),
                                           ("vllm_offload_taken.mmap", "keep")]
    kept = verdicts[1]
    assert kept.reason.startswith(f"held by PID {pid} (")
    assert (f", {how}" if how == "maps" else ", fd ") in kept.reason
    assert kept.reason.endswith("(read again after it was set aside); put back under its name")
    assert reaper.line_of(verdicts[0], False).endswith(
        "no process maps it or holds it open (1 processes read, and 2 again after it was set "
        "aside)")
    assert not leaked.exists()
    assert taken.stat().st_ino == inode and taken.read_bytes()[:4] == b"kv!!"
    assert os.listdir(shm / reaper.QUARANTINE) == []
    # The holder now sees it under its quarantine path, "(deleted)": the same inode still holds.
    assert names_and_actions(reap(shm, proc)) == [("vllm_offload_taken.mmap", "keep")]


def test_an_incomplete_second_reading_puts_everything_back(shm, tmp_path, monkeypatch):
    leaked = leak(shm, size=4096)
    inode = leaked.stat().st_ino
    proc = RealProc(tmp_path / "proc")
    proc.add(os.getpid())
    real_scan = reaper.scan

    def scan_then_hide(root, files):
        result = real_scan(root, files)
        if not (proc.root / "4242").exists():  # a process that cannot be read appears
            unreadable(proc, 4242, "sleep")
        return result

    monkeypatch.setattr(reaper, "scan", scan_then_hide)
    (verdict,) = reap(shm, proc)
    assert verdict.action == "refuse"
    assert "cannot read the mappings of PID 4242 (sleep, uid" in verdict.reason
    assert verdict.reason.endswith("so nothing was deleted (read again after it was set aside);"
                                   " put back under its name")
    assert leaked.stat().st_ino == inode and os.listdir(shm / reaper.QUARANTINE) == []


def test_a_held_file_whose_name_was_taken_stays_in_the_quarantine_until_the_name_is_free(
        shm, tmp_path, monkeypatch, holders):
    taken = leak(shm, "vllm_offload_taken.mmap", 4096)
    inode = taken.stat().st_ino
    aside = shm / reaper.QUARANTINE / taken.name
    proc = RealProc(tmp_path / "proc")
    pids: list[int] = []
    real_scan = reaper.scan

    def scan_take_and_replace(root, files):
        if pids:  # set aside: another program creates a file of that name
            taken.write_bytes(b"new")
        result = real_scan(root, files)
        if not pids:
            pids.append(proc.add(holders.start(taken)))
        return result

    monkeypatch.setattr(reaper, "scan", scan_take_and_replace)
    (verdict,) = reap(shm, proc)
    monkeypatch.undo()
    (pid,) = pids
    assert verdict.action == "refuse" and verdict.reason.startswith(f"held by PID {pid} (")
    assert verdict.reason.endswith("could not put it back (File exists: vllm_offload_taken.mmap)"
                                   f": it stays in {aside}")
    assert taken.read_bytes() == b"new"  # the other file: never replaced
    assert aside.stat().st_ino == inode and aside.read_bytes()[:4] == b"kv!!"

    # Next runs: left there and said so (the new file is kept: a holder's mapping has its name)
    leftover, new = reap(shm, proc)
    assert (leftover.action, new.action) == ("refuse", "keep")
    assert leftover.reason.endswith(f"is another file now: it stays in {aside}, nothing was "
                                    "deleted (compare the two, then move it by hand)")
    taken.unlink()  # the operator frees the name: the file goes back, and is still held
    assert names_and_actions(reap(shm, proc)) == [("vllm_offload_taken.mmap", "keep"),
                                                  ("vllm_offload_taken.mmap", "restore")]
    assert taken.stat().st_ino == inode and os.listdir(aside.parent) == []
    holders.release(pid)
    assert names_and_actions(reap(shm, proc)) == [("vllm_offload_taken.mmap", "delete")]
    assert not taken.exists()


def test_a_leftover_that_appeared_after_the_first_look_is_never_replaced(
        shm, tmp_path, monkeypatch):
    """Another run made the quarantine after this one looked, and was stopped with a file of
    the same name set aside: setting this one aside would replace it."""
    path = leak(shm, size=4096)
    proc = FakeProc(tmp_path / "proc")
    proc.process(3, "python3", [])
    real_scan = reaper.scan

    def scan_while_another_run_stops(root, files):
        (shm / reaper.QUARANTINE).mkdir(mode=0o700)
        (shm / reaper.QUARANTINE / path.name).write_bytes(b"theirs")
        return real_scan(root, files)

    monkeypatch.setattr(reaper, "scan", scan_while_another_run_stops)
    (verdict,) = reap(shm, proc)
    assert (verdict.action, verdict.reason) == (
        "refuse", f"a file of that name is in {reaper.QUARANTINE}: not set aside, nothing was "
                  "deleted")
    assert path.exists() and (shm / reaper.QUARANTINE / path.name).read_bytes() == b"theirs"


def test_leftovers_of_a_stopped_run_go_back_under_their_names_first(shm, tmp_path, holders):
    """A run killed between setting files aside and deciding: the next run puts each back (it
    never deletes on a guess), then judges it like any other file; a dry run says so."""
    aside = shm / reaper.QUARANTINE
    aside.mkdir(mode=0o700)
    leak(aside, "vllm_offload_free.mmap", 4096)
    held = leak(aside, "vllm_offload_held.mmap", 4096)
    twice = leak(aside, "vllm_offload_twice.mmap", 4096)
    os.link(twice, shm / twice.name)  # killed between a restore's link and its unlink
    leak(aside, "sglang_kv_0.bin", 4096)  # matched the patterns of that run, not this one's
    proc = RealProc(tmp_path / "proc")
    proc.add(os.getpid())
    pid = proc.add(holders.start(held))  # through its quarantine path: held all along
    before = sorted(os.listdir(aside))
    dry = reap(shm, proc, dry_run=True)
    assert sorted(os.listdir(aside)) == before and (shm / twice.name).exists()
    cli = subprocess.run(
        [sys.executable, str(REAPER), "--dir", str(shm), "--proc", str(proc.root), "--dry-run",
         "--json"], capture_output=True, text=True)
    plan = parse_reap_plan([*cli.stdout.splitlines(), f"{guards._RC} {cli.returncode}"])
    assert [(v.path, v.action, v.reason) for v in plan.verdicts] == [
        (v.path, v.action, v.reason) for v in dry]
    assert [v.line.split(" ")[:2] for v in plan.verdicts][:4] == [
        ["would", "restore"]] * 4

    done = reap(shm, proc)
    assert names_and_actions(done) == names_and_actions(dry) == [
        ("sglang_kv_0.bin", "restore"),
        ("vllm_offload_free.mmap", "delete"), ("vllm_offload_free.mmap", "restore"),
        ("vllm_offload_held.mmap", "keep"), ("vllm_offload_held.mmap", "restore"),
        ("vllm_offload_twice.mmap", "delete"), ("vllm_offload_twice.mmap", "restore"),
    ]
    assert done[0].reason == (f"left in {aside} by a run that was stopped midway: back under "
                              "its name, judged like any other file")
    assert done[3].reason == (f"left in {aside} by a run that was stopped midway, and already "
                              "back under its name: the quarantine's name is dropped")
    assert next(v for v in done if v.action == "keep").reason.startswith(f"held by PID {pid} (")
    assert os.listdir(aside) == []
    assert sorted(os.listdir(shm)) == [reaper.QUARANTINE, "sglang_kv_0.bin",
                                       "vllm_offload_held.mmap"]
    assert (shm / held.name).read_bytes()[:4] == b"kv!!"


@pytest.mark.parametrize("kind", ["link", "file", "mode", "owner"])
def test_a_stray_quarantine_is_set_aside_and_the_reaper_goes_on(shm, tmp_path, kind):
    """Issue 29, finding 7: `mkdir /dev/shm/.rigbook-quarantine` by another user (or a link, a
    file, a folder of the wrong mode) used to stop the reaper for good (exit 1, "must be a
    folder of uid 0"). Whoever can write into the quarantine could swap the file that gets
    deleted, so the stray is never used: it is renamed aside, unread, and reported, and the run
    reaps with a folder of its own."""
    path = leak(shm, size=4096)
    proc = FakeProc(tmp_path / "proc")
    proc.process(3, "python3", [])
    aside, elsewhere = shm / reaper.QUARANTINE, tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / path.name).write_bytes(b"planted")  # what a followed link would "recover"
    if kind == "link":
        aside.symlink_to(elsewhere)
    elif kind == "file":
        aside.write_text("")
    else:
        aside.mkdir(mode=0o700)
        (aside / "vllm_offload_planted.mmap").write_bytes(b"planted")
        if kind == "mode":
            aside.chmod(0o755)
        elif os.geteuid() == 0:
            os.chown(aside, 65534, 65534)
        else:
            pytest.skip("giving a folder to another user needs root")
    before = os.lstat(aside).st_ino
    dry = subprocess.run([sys.executable, str(REAPER), "--dir", str(shm), "--proc",
                          str(proc.root), "--dry-run"], capture_output=True, text=True)
    assert dry.returncode == 0, dry
    assert dry.stderr.startswith(f"would set aside {aside} (") and os.lstat(aside).st_ino == before
    assert f"would reap {path} (" in dry.stdout
    done = subprocess.run([sys.executable, str(REAPER), "--dir", str(shm), "--proc",
                           str(proc.root)], capture_output=True, text=True)
    assert done.returncode == 0, done
    assert done.stderr.startswith(f"set aside {aside} (") and "remove it" in done.stderr
    assert f"reaped {path} (" in done.stdout and not path.exists()
    (stray,) = [name for name in os.listdir(shm) if name.startswith(".rigbook-quarantine.")]
    assert os.lstat(shm / stray).st_ino == before  # renamed, not followed or emptied
    assert not (shm / "vllm_offload_planted.mmap").exists()  # nothing of it was put back
    st = os.lstat(aside)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid() and os.listdir(aside) == []
    assert (elsewhere / path.name).read_bytes() == b"planted"


def test_an_unprivileged_run_that_cannot_move_a_stray_refuses_and_deletes_nothing(
        shm, tmp_path, monkeypatch):
    path = leak(shm, size=4096)
    proc = FakeProc(tmp_path / "proc")
    proc.process(3, "python3", [])
    (shm / reaper.QUARANTINE).write_text("")

    def refused(*_, **__):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(reaper.os, "rename", refused)
    with pytest.raises(reaper.Unsafe, match="cannot be set aside .Operation not permitted"):
        reap(shm, proc)
    assert path.exists()


def test_the_quarantine_is_made_0700_whatever_the_umask_and_runs_take_turns(
        shm, tmp_path, monkeypatch):
    leak(shm, size=4096)
    proc = FakeProc(tmp_path / "proc")
    proc.process(3, "python3", [])
    previous = os.umask(0o277)
    try:
        assert names_and_actions(reap(shm, proc)) == [("vllm_offload_0b7e.mmap", "delete")]
    finally:
        os.umask(previous)
    st = os.lstat(shm / reaper.QUARANTINE)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid()
    leak(shm, size=4096)
    other_run = os.open(shm / reaper.QUARANTINE, os.O_RDONLY | os.O_DIRECTORY)
    monkeypatch.setattr(reaper, "LOCK_WAIT_S", 0.3)
    try:
        fcntl.flock(other_run, fcntl.LOCK_EX)
        for dry_run in (False, True):
            with pytest.raises(reaper.Unsafe, match="another reaper run held the quarantine"):
                reap(shm, proc, dry_run)
    finally:
        os.close(other_run)
    assert names_and_actions(reap(shm, proc)) == [("vllm_offload_0b7e.mmap", "delete")]


def test_reaper_unit_passes_the_host_data_patterns():
    text = render(GUARDS / "rigbook-shm-reaper.service.j2",
                  patterns=("vllm_offload_*.mmap", "sglang_kv_?.bin"))
    assert ("ExecStart=/usr/bin/python3 -I -S /opt/rigbook/guards/rigbook-shm-reaper "
            "--pattern vllm_offload_*.mmap --pattern sglang_kv_?.bin") in text.splitlines()
    assert "Type=oneshot" in text.splitlines()


#: Patterns that must never choose files for root to delete: too broad (fewer than 4 literal
#: characters before a glob character), hidden names, options, or a way out of /dev/shm, a unit
#: line or a shell word.
REFUSED_PATTERNS = [
    "s*", "abc*", "*.mmap", "[v]llm*", "*", "?", "vll?_*", "abc[d]*", "",
    "a b", "vllm *", " vllm*", "vllm\u00a0*", "../x", "vllm/../x*", "x/y", "vllm_/*", "vllm..x*",
    ".vllm*", ".rigbook-quarantine", "-vllm*", "--pattern", "vllm_*\n", "vllm\t*", "vllm\x00*",
    "vllm\x1b[31m*", "vllm\x7f*", "vllm'*", 'vllm"*', "vllm`id`*", "vllm$(id)*", "vllm${IFS}*",
    "vllm%i*", "vllm;rm*", "vllm|x*", "vllm\\*", "vllm_[!a]*", "vllm\u00e9*", "vllm\u0661*",
]


@pytest.mark.parametrize("pattern", REFUSED_PATTERNS)
def test_a_broad_or_hostile_pattern_is_refused_by_the_inventory_and_by_the_reaper(pattern):
    with pytest.raises(RigbookError) as refused:
        parse_rig("rig1", {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 1,
                           "guards_shm_patterns": ["vllm_offload_*.mmap", pattern]})
    message = str(refused.value)
    assert message.startswith(f"rig1: guards_shm_patterns: {pattern!r}: a /dev/shm file-name "
                              "glob must start with at least 4 literal characters"), message
    assert "e.g. vllm_offload_*.mmap" in message and "\n" not in message
    with pytest.raises(argparse.ArgumentTypeError) as also:  # the copy on the rig: same rule
        reaper._pattern(pattern)
    assert str(also.value) in message


@pytest.mark.parametrize("value", [
    "vllm_offload_*.mmap", ["vllm_offload_*.mmap", 5], [None], [["vllm_offload_*.mmap"]],
    {"vllm_offload_*.mmap": 1}, [], None, 5, True,
])
def test_patterns_of_the_wrong_type_are_refused(value):
    with pytest.raises(RigbookError, match="^rig1: guards_shm_patterns"):
        parse_rig("rig1", {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 1,
                           "guards_shm_patterns": value})


@pytest.mark.parametrize("pattern", [
    "vllm_offload_*.mmap", "sglang_kv_?.bin", "vllm[0-9]*", "abcd", "0123*", "_.-a*",
    "x-_.[a-z]*?.mmap",
])
def test_a_pattern_with_four_literal_characters_first_is_accepted(pattern):
    assert rig(guards_shm_patterns=[pattern]).guards_shm_patterns == (pattern,)
    assert reaper._pattern(pattern) == pattern


def test_the_reaper_refuses_a_broad_pattern_itself_and_touches_nothing(shm, tmp_path):
    """Defence in depth: a unit edited by hand, or a typo at the command line."""
    other = leak(shm, "sqlite-shared-state", 4096)
    proc = FakeProc(tmp_path / "proc")
    proc.process(3, "python3", [])
    done = subprocess.run(
        [sys.executable, str(REAPER), "--dir", str(shm), "--proc", str(proc.root),
         "--pattern", "vllm_offload_*.mmap", "--pattern", "s*"], capture_output=True, text=True,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert ("error: argument --pattern: 's*': a /dev/shm file-name glob must start with at "
            "least 4 literal characters") in done.stderr
    assert "e.g. vllm_offload_*.mmap" in done.stderr
    assert other.exists() and not (shm / reaper.QUARANTINE).exists()


def test_guards_defaults():
    r = rig()
    assert r.guards_shm_patterns == ("vllm_offload_*.mmap",) == reaper.DEFAULT_PATTERNS
    assert r.guards_xid_watch is True


# --- reap_shm (deploys/reap_shm.py) ---------------------------------------------------------


def verdict(action: str, path: str = "/dev/shm/vllm_offload_1.mmap") -> ShmVerdict:
    words = {"delete": "would reap", "keep": "kept", "refuse": "refused",
             "restore": "would restore", "stray": "would set aside"}
    return ShmVerdict(path, 2**31, 2**31, action, "why",
                      f"{words[action]} {path} (2.0 GiB, 2147483648 bytes): why")


def test_reap_runs_the_reaper_only_when_something_is_to_be_deleted():
    plan = ReapPlan(True, (verdict("delete"), verdict("keep", "/dev/shm/vllm_offload_2.mmap")))
    commands, fake = run_op(reap_shm, {"ShmReapPlan": plan}, patterns=("vllm_offload_*.mmap",))
    assert shell(commands) == [f"python3 {guards.REAPER} --pattern 'vllm_offload_*.mmap'"]
    (note,) = [c for c in commands if isinstance(c, FunctionCommand)]
    assert note.args == ("reaping /dev/shm/vllm_offload_1.mmap (2.0 GiB, 2147483648 bytes): why",)


def test_reap_runs_the_reaper_to_put_back_a_leftover_of_a_stopped_run():
    plan = ReapPlan(True, (verdict("restore"), verdict("keep", "/dev/shm/vllm_offload_2.mmap")))
    commands, fake = run_op(reap_shm, {"ShmReapPlan": plan}, patterns=("vllm_offload_*.mmap",))
    assert shell(commands) == [f"python3 {guards.REAPER} --pattern 'vllm_offload_*.mmap'"]
    (note,) = [c for c in commands if isinstance(c, FunctionCommand)]
    assert note.args == ("restoring /dev/shm/vllm_offload_1.mmap (2.0 GiB, 2147483648 bytes): "
                         "why",)


def test_reap_runs_the_reaper_to_set_a_stray_quarantine_aside():
    stray = verdict("stray", "/dev/shm/.rigbook-quarantine")
    commands, _ = run_op(reap_shm, {"ShmReapPlan": ReapPlan(True, (stray,))},
                         patterns=("vllm_offload_*.mmap",))
    assert shell(commands) == [f"python3 {guards.REAPER} --pattern 'vllm_offload_*.mmap'"]
    (note,) = [c for c in commands if isinstance(c, FunctionCommand)]
    assert note.args[0].startswith("setting aside /dev/shm/.rigbook-quarantine (")


def test_reap_plan_parses_a_missing_reaper_and_an_error():
    assert parse_reap_plan([guards._NO_REAPER]) == ReapPlan(installed=False)
    plan = parse_reap_plan(["rigbook-shm-reaper: cannot read /dev/shm: No such file or "
                            "directory; nothing was deleted", f"{guards._RC} 1"])
    assert plan.error.startswith("rigbook-shm-reaper: cannot read /dev/shm")


# --- the Xid watch --------------------------------------------------------------------------


@pytest.fixture
def watch_dir(tmp_path) -> Path:
    """The watch as installed on a rig: the script with a copy of rigbook/rigside/xid.py beside
    it."""
    folder = tmp_path / "guards"
    folder.mkdir()
    shutil.copy(GUARDS / "rigbook-xid-watch", folder)
    shutil.copy(ROOT / "rigbook" / "rigside" / "xid.py", folder)
    return folder


def run_watch(folder: Path, tmp_path: Path, scan: str, follow: str, *args: str,
              env: dict | None = None):
    env = {**os.environ, "RIGBOOK_XID_SCAN": scan, "RIGBOOK_XID_FOLLOW": follow, **(env or {})}
    return subprocess.run(
        [sys.executable, str(folder / "rigbook-xid-watch"), "--mark",
         str(tmp_path / "run" / "gpu-lost"), "--faults-log",
         str(tmp_path / "log" / "engine-faults.log"), *args],
        capture_output=True, text=True, env=env, timeout=60,
    )


def test_watch_marks_this_boots_fatal_xids_and_logs_engine_faults(watch_dir, tmp_path):
    mark, faults = tmp_path / "run" / "gpu-lost", tmp_path / "log" / "engine-faults.log"
    sim = SIM_KMSG.read_text().splitlines()
    done = run_watch(watch_dir, tmp_path, "true", f"cat {SIM_KMSG}")
    assert done.returncode == 0, done.stderr
    assert mark.read_text().splitlines() == [
        "GPU lost: do not restart serving",
        next(line for line in sim if "): 79," in line),
        next(line for line in sim if "): 154," in line),
    ]
    assert faults.read_text().splitlines() == [next(line for line in sim if "): 31," in line)]
    assert ("GPU lost: do not restart serving: Xid 79 (fallen off the bus) on PCI 0000:01:00 "
            "at 2026-09-12T03:14:15+0000") in done.stderr
    assert "engine fault: Xid 31 (GPU memory page fault) on PCI 0000:01:00" in done.stdout
    # A restart of the watch replays this boot: nothing is written twice.
    before = (mark.read_text(), faults.read_text())
    again = run_watch(watch_dir, tmp_path, f"cat {SIM_KMSG}", f"cat {SIM_KMSG}")
    assert again.returncode == 0 and (mark.read_text(), faults.read_text()) == before
    # The mark as the GpuLostMark fact reads it, and what the serving preflight is told.
    fact = GpuLostMark().process([guards._MARK, *mark.read_text().splitlines()])
    assert [event.code for event in fact.events] == [79, 154]
    assert gpu_lost_reason(fact) == (
        "GPU lost: do not restart serving: Xid 79 (fallen off the bus) on PCI 0000:01:00 at "
        "2026-09-12T03:14:15+0000; Xid 154 (recovery: Node Reboot Required) on PCI "
        "0000:01:00 at 2026-09-12T03:14:16+0000 (/run/rigbook/gpu-lost, written by the Xid "
        "watch this boot; only a reboot brings the card back and clears it: check the card "
        "first, docs/guards.md)"
    )
    # --check, as the serving unit's ExecStartPre runs it.
    check = run_watch(watch_dir, tmp_path, "true", "true", "--check")
    assert check.returncode == 1
    assert check.stderr.splitlines()[0] == f"{mark}: GPU lost: do not restart serving"
    mark.unlink()
    assert run_watch(watch_dir, tmp_path, "true", "true", "--check").returncode == 0


def test_the_engine_faults_log_rotates_itself_and_a_restart_logs_nothing_twice(watch_dir,
                                                                               tmp_path):
    """A real log with five Xid 31/13 lines (587 bytes) and a 300-byte limit: one rotation."""
    source = ROOT / "tests" / "fixtures" / "real" / "klog" / "dmesg-xid31-13-32-dxvk-overwatch.txt"
    faults = tmp_path / "log" / "engine-faults.log"
    env = {"RIGBOOK_XID_FAULTS_MAX_BYTES": "300"}
    done = run_watch(watch_dir, tmp_path, f"cat {source}", "true", env=env)
    assert done.returncode == 0, done.stderr
    current, older = faults.read_text(), faults.with_name("engine-faults.log.1").read_text()
    assert 0 < len(current.encode()) <= 300 and 0 < len(older.encode()) <= 300
    logged = older.splitlines() + current.splitlines()
    assert len(logged) == 5 and len(set(logged)) == 5
    assert all(re.search(r"Xid .*\): (31|13),", line) for line in logged), logged
    again = run_watch(watch_dir, tmp_path, f"cat {source}", "true", env=env)
    assert again.returncode == 0 and faults.read_text() == current  # lines in .1 count too


def test_earlier_boots_set_no_mark(watch_dir, tmp_path):
    """A fatal Xid before the last reboot is reported, but the reboot cleared the card."""
    done = run_watch(watch_dir, tmp_path, f"cat {SIM_KMSG}", "true")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "run" / "gpu-lost").exists()
    assert "kernel log, all boots: 3 Xid line(s)" in done.stdout
    assert "Xid 79 (fallen off the bus) x1, last on PCI 0000:01:00" in done.stdout
    faults = (tmp_path / "log" / "engine-faults.log").read_text()
    assert "): 31," in faults


def test_cleared_recovery_and_unknown_xids_are_not_acted_on(watch_dir, tmp_path):
    log = tmp_path / "kmsg.log"
    log.write_text(
        "[  950.100000] NVRM: Xid (PCI:0000:02:00): 154, GPU recovery action changed from 0x1 "
        "(GPU Reset Required) to 0x0 (None)\n"
        "[315905.140252] NVRM: Xid (PCI:0000:03:00): 43, pid=123, name=python3, Ch 00000008\n"
    )
    done = run_watch(watch_dir, tmp_path, "true", f"cat {log}")
    assert done.returncode == 0
    assert not (tmp_path / "run" / "gpu-lost").exists()
    assert "Xid 154 (recovery action cleared) on PCI 0000:02:00 at 950.100000: not acted on" in (
        done.stdout)
    assert "Xid 43 (GPU stopped processing) on PCI 0000:03:00" in done.stdout  # IGNORE


def test_a_failing_source_is_reported_and_exits_nonzero(watch_dir, tmp_path):
    done = run_watch(watch_dir, tmp_path, "echo nope >&2; exit 4", "exit 1")
    assert done.returncode == 1
    assert "kernel log of all boots: `echo nope >&2; exit 4` failed: nope; skipped" in done.stderr
    assert "`exit 1` ended with exit 1" in done.stderr


def test_the_watch_unit_names_the_watch_sources(watch_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(watch_dir))
    watch = load_script(watch_dir / "rigbook-xid-watch", "rigbook_xid_watch")
    unit = (GUARDS / "rigbook-xid-watch.service").read_text().splitlines()
    assert f'Environment="RIGBOOK_XID_SCAN={watch.SCAN}"' in unit
    assert f'Environment="RIGBOOK_XID_FOLLOW={watch.FOLLOW}"' in unit
    assert "Restart=always" in unit
    assert f"ExecStart=/usr/bin/python3 -I -S {guards.WATCH}" in unit
    dropin = (GUARDS / "rigbook-serve-guards.conf").read_text().splitlines()
    assert (f"ExecStartPre=!/usr/bin/env -i -C / /usr/bin/python3 -I -S {guards.WATCH} --check"
            in dropin)  # tests/test_prestart.py runs it
    assert f"ExecStopPost=-+/usr/bin/systemctl start {guards.REAPER_UNIT}" in dropin


def test_no_mark_means_no_reason():
    assert GpuLostMark().process([guards._MARK, ""]) == parse_gpu_lost([])
    assert gpu_lost_reason(None) is None
    empty = gpu_lost_reason(parse_gpu_lost([]))
    assert empty.startswith("GPU lost: do not restart serving: the mark names no Xid")


def test_status_reports_the_mark_as_gpu_gone():
    mark = parse_gpu_lost(["GPU lost: do not restart serving",
                           next(line for line in SIM_KMSG.read_text().splitlines()
                                if "): 79," in line)])
    status = build_rig_status("rig1", rig(), Facts(gpu_lost=mark))
    assert status.state == "gpu-gone"
    assert [f.reason for f in status.findings if f.level == "gone"] == [gpu_lost_reason(mark)]
    clean = build_rig_status("rig1", rig(), Facts())
    assert not [f for f in clean.findings if f.level == "gone"]


# --- topology -------------------------------------------------------------------------------

# CONSTRUCTED in nvidia-smi's real format (not captured): two RTX 3090s with an NVLink bridge.
TOPO_DUAL_NVLINK = [
    "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m",
    "GPU0\t X \tNV4\t0-23\t0\t\tN/A",
    "GPU1\tNV4\t X \t0-23\t0\t\tN/A",
    "",
    "Legend:",
    "",
    "  X    = Self",
    "  NV#  = Connection traversing a bonded set of # NVLinks",
]
# CONSTRUCTED: the same box without the bridge, both cards behind the CPU's host bridge.
TOPO_DUAL_PHB = [
    "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m",
    "GPU0\t X \tPHB\t0-23\t0\t\tN/A",
    "GPU1\tPHB\t X \t0-23\t0\t\tN/A",
]
# CONSTRUCTED after a public 4x H100 report: GPUs and NICs, NV6 between every GPU pair.
TOPO_QUAD_NIC = [
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m",
    "GPU0\t X \tNV6\tNV6\tNV6\tPIX\tSYS\t6,14,22,30\t3\t\tN/A",
    "GPU1\tNV6\t X \tNV6\tNV6\tSYS\tPIX\t4,12,20,28\t1\t\tN/A",
    "GPU2\tNV6\tNV6\t X \tNV6\tSYS\tSYS\t7,15,23,31\t7\t\tN/A",
    "GPU3\tNV6\tNV6\tNV6\t X \tSYS\tSYS\t5,13,21,29\t5\t\tN/A",
    "NIC0\tPIX\tSYS\tSYS\tSYS\t X \tSYS",
    "NIC1\tSYS\tPIX\tSYS\tSYS\tSYS\t X ",
    "",
    "Legend:",
    "",
    "  X    = Self",
    "",
    "NIC Legend:",
    "",
    "  NIC0: mlx5_0",
]
# CONSTRUCTED in `nvidia-smi nvlink -s`'s real format (a bridged 3090 pair, one link down).
NVLINK_DUAL = [
    "GPU 0: NVIDIA GeForce RTX 3090 (UUID: GPU-3c6f3b5a-0000-0000-0000-000000000000)",
    "\t Link 0: 14.062 GB/s",
    "\t Link 1: 14.062 GB/s",
    "\t Link 2: 14.062 GB/s",
    "\t Link 3: <inactive>",
    "GPU 1: NVIDIA GeForce RTX 3090 (UUID: GPU-3c6f3b5a-0000-0000-0000-000000000001)",
    "\t Link 0: 14.062 GB/s",
    "\t Link 1: 14.062 GB/s",
    "\t Link 2: 14.062 GB/s",
    "\t Link 3: 14.062 GB/s",
]


def test_real_single_gpu_topo_capture():
    matrix = parse_topo_matrix((H200 / "topo-m.txt").read_text().splitlines())
    assert matrix == TopoMatrix(1, {(0, 0): "X"})
    assert matrix.nvlink_pairs() == [] and matrix.pairs_text() == "1 GPU, no peers"


def test_real_nvlink_capture_of_a_gpu_without_nvlink_is_empty():
    assert (H200 / "nvlink-s.txt").read_text() == ""
    assert parse_nvlink_status([]) == {}


def test_constructed_multi_gpu_topologies():
    nv = parse_topo_matrix(TOPO_DUAL_NVLINK)
    assert nv.links == {(0, 0): "X", (0, 1): "NV4", (1, 0): "NV4", (1, 1): "X"}
    assert nv.nvlink_pairs() == [(0, 1, "NV4")]
    assert parse_topo_matrix(TOPO_DUAL_PHB).nvlink_pairs() == []
    quad = parse_topo_matrix(TOPO_QUAD_NIC)
    assert quad.gpus == 4 and len(quad.nvlink_pairs()) == 6
    assert (0, 4) not in quad.links  # NIC columns are not GPU links
    with pytest.raises(ValueError, match="2 GPU columns but 1 GPU rows"):
        parse_topo_matrix(TOPO_DUAL_PHB[:2])


def test_constructed_nvlink_status():
    links = parse_nvlink_status(NVLINK_DUAL)
    assert links[0] == NvLinks(0, "NVIDIA GeForce RTX 3090",
                               {0: "14.062 GB/s", 1: "14.062 GB/s", 2: "14.062 GB/s"}, (3,))
    assert len(links[1].active) == 4 and links[1].inactive == ()
    with pytest.raises(ValueError, match="not an nvlink -s line"):
        parse_nvlink_status(["Something else"])


def smi_block(path: str, lines: list[str], rc: int = 0) -> list[str]:
    """What rigbook.core.facts.smi_script prints for one nvidia-smi run."""
    return [f"##RIGBOOK_SMI## {path}", *lines, "", f"##RIGBOOK_RC## {rc}"]


def test_topology_fact_output():
    topo = parse_topology([guards._TOPO, *smi_block("/usr/bin/nvidia-smi", TOPO_DUAL_NVLINK),
                           guards._NVLINK_S, *smi_block("/usr/bin/nvidia-smi", NVLINK_DUAL)])
    assert topo.known and topo.error is None and topo.smi == "/usr/bin/nvidia-smi"
    assert topo.nvlink_evidence() == ["GPU0-GPU1 NV4", "GPU 0: 3 active NVLink(s)",
                                      "GPU 1: 4 active NVLink(s)"]
    stand_in = parse_topology([
        guards._TOPO, *smi_block("/usr/bin/nvidia-smi", [
            "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."], 2),
        guards._NVLINK_S, *smi_block("/usr/bin/nvidia-smi", ["Invalid combination"], 2),
    ])
    assert not stand_in.known
    assert stand_in.error.startswith("/usr/bin/nvidia-smi topo -m failed: Invalid combination")
    assert parse_topology([guards._TOPO, "##RIGBOOK_NO_SMI##", guards._NVLINK_S,
                           "##RIGBOOK_NO_SMI##"]) == Topology(error="no nvidia-smi")


def gpu(index: int, width: int | None = 16, width_max: int | None = 16, gen: int = 1,
        gen_max: int = 4) -> Gpu:
    return Gpu(index=index, uuid=f"GPU-{index}", name="NVIDIA GeForce RTX 3090",
               bus_id=f"00000000:0{index + 1}:00.0", pcie_gen=gen, pcie_gen_max=gen_max,
               pcie_width=width, pcie_width_max=width_max)


NV_TOPO = Topology(matrix=parse_topo_matrix(TOPO_DUAL_NVLINK), nvlinks={})
PHB_TOPO = Topology(matrix=parse_topo_matrix(TOPO_DUAL_PHB), nvlinks={})
UNKNOWN = Topology(error="/usr/bin/nvidia-smi topo -m failed: Invalid combination")


def test_undeclared_nvlink_is_reported():
    (finding,) = topology_findings(rig(nvlink=False), NV_TOPO, [gpu(0), gpu(1)])
    assert finding == ("host data says nvlink: false, but nvidia-smi shows NVLink (GPU0-GPU1 "
                       "NV4): set nvlink: true (recipes for PCIe-only rigs turn NCCL P2P off)")
    assert topology_findings(rig(nvlink=True), NV_TOPO, [gpu(0), gpu(1)]) == []


def test_declared_nvlink_that_is_absent_is_reported():
    (finding,) = topology_findings(rig(nvlink=True), PHB_TOPO, [gpu(0), gpu(1)])
    assert "host data says nvlink: true, but nvidia-smi shows no NVLink (GPU0-GPU1 PHB)" in finding
    assert topology_findings(rig(nvlink=True), UNKNOWN, [gpu(0), gpu(1)]) == []


def test_partly_inactive_nvlink_is_reported():
    topo = Topology(matrix=parse_topo_matrix(TOPO_DUAL_NVLINK),
                    nvlinks=parse_nvlink_status(NVLINK_DUAL))
    assert topology_findings(rig(nvlink=True), topo, []) == [
        "GPU 0: NVLink 1 of 4 links inactive (3): reseat the bridge"]


def test_a_two_card_recipe_on_a_gen_3_slot_is_reported():
    """Hardware notes: "PCIe Gen 4 slot — Gen 3 works but allreduce on dual-card is slower
    (mild impact on multi-tenant; minimal impact on single-stream)". The max is read: the
    runbook's card "reports pcie.link.gen.current = 1 at idle"."""
    gpus = [gpu(0), gpu(1, gen=1, gen_max=3)]
    (finding,) = topology_findings(rig(), PHB_TOPO, gpus, 2, "dual-3090-tp2")
    assert finding == (
        "recipe dual-3090-tp2 splits the model over 2 cards without NVLink, and GPU 1 PCIe gen "
        "1 (max 3) x16 (max x16) is at most a Gen 3 link: the hardware notes find allreduce "
        "slower there (mild for many users, minimal for one stream); a Gen 4 slot avoids it")
    assert topology_findings(rig(), PHB_TOPO, gpus, 1) == []  # one card: no allreduce
    assert topology_findings(rig(), PHB_TOPO, [gpu(0, gen=1), gpu(1, gen=1)], 2) == []  # idle 4
    assert topology_findings(rig(nvlink=True), NV_TOPO, gpus, 2) == []  # NVLink carries it


def test_a_two_card_recipe_on_a_x4_link_is_reported():
    gpus = [gpu(0), gpu(1, width=4, width_max=4)]
    (finding,) = topology_findings(rig(), PHB_TOPO, gpus, 2, "dual-3090-tp2")
    assert finding == (
        "recipe dual-3090-tp2 splits the model over 2 cards without NVLink, and GPU 1 PCIe gen "
        "1 (max 4) x4 (max x4) is a x4 link: every token crosses it; use an x8/x16 slot or a "
        "one-card recipe"
    )
    assert topology_findings(rig(), PHB_TOPO, gpus, 1) == []  # one card: no traffic between
    assert topology_findings(rig(), PHB_TOPO, [gpu(0), gpu(1, width=8)], 2) == []
    # A third card the recipe does not run on is not its problem.
    assert topology_findings(rig(gpu_count=3), PHB_TOPO, [gpu(0), gpu(1), gpu(2, 4, 4)], 2) == []
    # A link that trained narrower than its max counts by what it runs at.
    assert len(topology_findings(rig(), PHB_TOPO, [gpu(0), gpu(1, 4, 16)], 2)) == 1


def test_topology_summary_shows_idle_and_max_pcie():
    text = topology_summary(PHB_TOPO, [gpu(1, 16, 16, gen=4), gpu(0)])
    assert text == ("GPU0-GPU1 PHB; nvlink -s lists no links; GPU 0 PCIe gen 1 (max 4) x16 "
                    "(max x16); GPU 1 PCIe gen 4 (max 4) x16 (max x16)")
    assert topology_summary(UNKNOWN, []).startswith("topology unknown (/usr/bin/nvidia-smi")


def test_p2p_disable_only_where_there_is_no_nvlink():
    off = {"NCCL_P2P_DISABLE": "1"}
    assert p2p_disable_problem(off, rig(), PHB_TOPO) is None
    assert p2p_disable_problem(off, rig(), NV_TOPO) == (
        "the recipe sets NCCL_P2P_DISABLE=1, but the rig has NVLink (GPU0-GPU1 NV4): it would "
        "turn P2P over the bridge off; choose a recipe for NVLink rigs"
    )
    # The reported topology wins over the host data; without it, the host data decides.
    assert p2p_disable_problem(off, rig(nvlink=True), PHB_TOPO) is None
    assert "host data says nvlink: true" in p2p_disable_problem(off, rig(nvlink=True), UNKNOWN)
    assert p2p_disable_problem(off, rig(), UNKNOWN) is None
    assert p2p_disable_problem(off, rig(), None) is None
    assert p2p_disable_problem({"NCCL_P2P_DISABLE": "0"}, rig(), NV_TOPO) is None
    assert p2p_disable_problem({}, rig(nvlink=True), NV_TOPO) is None


def test_p2p_rule_on_the_shipped_recipes():
    """The catalogue's PCIe-only dual recipe turns P2P off: refused on a bridged pair."""
    recipe = catalogue()["dual-3090-tp2"]
    assert recipe.env.get("NCCL_P2P_DISABLE") == "1"
    assert p2p_disable_problem(recipe.env, rig(), NV_TOPO) is not None
    assert p2p_disable_problem(recipe.env, rig(), PHB_TOPO) is None


def test_topology_report_warns_and_never_changes(caplog):
    probe = GpuProbe(smi="/usr/bin/nvidia-smi", gpus=(gpu(0), gpu(1, 4, 4)))
    venv = {"name": "vllm-0.33", "engine": "vllm", "packages": ["vllm==0.33.0"]}
    with caplog.at_level(logging.WARNING, logger="pyinfra"):
        commands, fake = run_op(topology_report, {"NvidiaGpus": probe, "GpuTopology": NV_TOPO},
                                rig=rig(recipe="dual-3090-tp2", venvs=[venv]))
    assert commands == []
    assert fake.noops == ["GPU topology: GPU0-GPU1 NV4; nvlink -s lists no links; GPU 0 PCIe "
                          "gen 1 (max 4) x16 (max x16); GPU 1 PCIe gen 1 (max 4) x4 (max x4)"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "GPU topology: host data says nvlink: false, but nvidia-smi shows NVLink" in warnings[0]
    assert "recipe dual-3090-tp2: the recipe sets NCCL_P2P_DISABLE=1" in warnings[1]
    commands, fake = run_op(topology_report, {"NvidiaGpus": None}, rig=rig())
    assert commands == [] and fake.noops == ["GPU topology not read: no nvidia-smi"]



@pytest.mark.parametrize("log", [
    "klog/dmesg-open-module-fallen-off-bus-no-xid.txt",  # three lines, no Xid at all
    "klog/dmesg-T-xid62-154-4x3090.txt",  # 62: RESET_GPU in NVIDIA's catalogue
    "klog/journal-nohost-xid120-154-rtxpro6000.txt",  # 120: GSP error, RESET_GPU
])
def test_reset_or_reboot_bound_faults_as_the_field_logs_them_set_the_mark(watch_dir, tmp_path,
                                                                           log):
    real = ROOT / "tests" / "fixtures" / "real" / log
    done = run_watch(watch_dir, tmp_path, "true", f"cat {real}")
    assert done.returncode == 0, done.stderr
    mark = (tmp_path / "run" / "gpu-lost").read_text().splitlines()
    assert mark[0] == "GPU lost: do not restart serving" and len(mark) >= 2
    check = run_watch(watch_dir, tmp_path, "true", "true", "--check")
    assert check.returncode == 1, check.stdout + check.stderr


def test_an_empty_mark_is_a_mark_all_the_same(watch_dir, tmp_path):
    mark = tmp_path / "run" / "gpu-lost"
    mark.parent.mkdir(parents=True)
    mark.write_text("")
    check = run_watch(watch_dir, tmp_path, "true", "true", "--check")
    assert check.returncode == 1 and "(empty)" in check.stderr


def test_the_topology_check_reads_with_the_preflight_and_warns_as_the_report_does():
    from rigbook.core.checks import reads_of

    names = [read.name for read in reads_of(rig(nvlink=False), "rig1", [guards.TOPOLOGY])]
    assert names == ["probe", "topology"] and guards.TOPOLOGY.gpus
    probe = GpuProbe(smi="nvidia-smi", gpus=(gpu(0), gpu(1)))
    facts = Facts(probe=probe, topology=NV_TOPO)
    (finding,) = guards.TOPOLOGY.run(rig(nvlink=False), facts, "rig1")
    assert finding.level == "warn"
    assert finding.reason == topology_warnings(rig(nvlink=False), NV_TOPO, probe.gpus)[0]
    assert guards.TOPOLOGY.run(rig(nvlink=True), facts, "rig1") == []
    assert guards.TOPOLOGY.run(rig(nvlink=False), Facts(probe=probe), "rig1") == []


def test_prepare_makes_the_quarantine_sets_a_stray_aside_and_reaps_nothing(shm, tmp_path):
    """What the install runs instead of `systemd-tmpfiles --create`, which makes another user's
    folder of that name root's 0700 with its contents (seen with systemd 252): the stray is
    renamed aside unread, the quarantine made empty, and nothing is reaped."""
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    path = leak(shm, size=4096)
    aside = shm / reaper.QUARANTINE
    aside.mkdir()
    aside.chmod(0o777)
    (aside / "vllm_offload_planted.mmap").write_bytes(b"planted")
    os.chown(aside, 65534, 65534)
    before = os.lstat(aside).st_ino
    done = subprocess.run([sys.executable, str(REAPER), "--dir", str(shm), "--prepare"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done
    assert done.stderr.startswith(f"set aside {aside} ("), done
    assert "but a folder of uid 65534, mode 0777 (made by someone else" in done.stderr, done
    assert done.stdout == ""
    (stray,) = [name for name in os.listdir(shm) if name.startswith(".rigbook-quarantine.")]
    assert os.lstat(shm / stray).st_ino == before and os.lstat(shm / stray).st_uid == 65534
    st = os.lstat(aside)
    assert (stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
            and st.st_uid == 0 and os.listdir(aside) == [])
    assert path.exists()  # nothing reaped
    again = subprocess.run([sys.executable, str(REAPER), "--dir", str(shm), "--prepare"],
                           capture_output=True, text=True)
    assert (again.returncode, again.stdout, again.stderr) == (0, f"{aside} is ready\n", "")
    assert os.lstat(aside).st_ino == st.st_ino  # kept, not made again
