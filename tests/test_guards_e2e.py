"""Rig guards end to end on a sandbox rig (rig2), driven by the pyinfra CLI.

The guards deploy installs the reaper and the Xid watch (a second run changes nothing). The
reaper, in order: as an unprivileged user next to a root-owned holder it refuses and deletes
nothing (it cannot read root's mappings: real permission errors, not a simulation), and sets
nothing aside; run by its unit as root it reaps a leaked buffer and keeps one a live process
maps, leaving its quarantine empty (a second run changes nothing, an unprivileged one now stops
at root's quarantine); deploys/reap_shm.py reaps on demand and then has nothing to do, and puts
back what a stopped run left in the quarantine (the held buffer, still held; a stray one, then
reaped); a serving unit that is force-killed has its buffer reaped by the guards' drop-in.
The Xid watch: nspawn rigs cannot read the kernel log, so this test (never a production
default) points the watch's sources at a simulated log by a drop-in:
sandbox/simulated/kmsg-xid79.log as this boot's log (in /run: gone at reboot, like the kernel
ring buffer) and as the journal of all boots (on disk). Xid 79 sets the GPU-lost mark, serving
refuses to start with the mark's message, `rigbook status` says GPU gone; `sandbox restart`
clears the mark while the earlier boot's Xid is still reported.

The serving unit's guards are checked on a stand-in unit (rigbook-test-serve.service, in /run)
carrying a copy of the drop-in the deploy installed for rigbook-serve.service, so the test does
not depend on (or disturb) a real serving unit on the rig.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from rigbook.rigside.xid import ENGINE_FAULTS_LOG
from rigbook.roles.guards import (
    GPU_LOST_MARK,
    REAPER,
    REAPER_UNIT,
    SERVE_DROPIN,
    WATCH,
    WATCH_UNIT,
)
from rigbook.status import FleetStatus
from tests.conftest import (
    ROOT,
    SANDBOX_INVENTORY,
    rig_ssh,
    rigbook,
    run_pyinfra,
    security_exposure,
)

pytestmark = pytest.mark.sandbox

RIG = "rig2"
SIM_KMSG = ROOT / "sandbox" / "simulated" / "kmsg-xid79.log"
TEST_DIR = "/run/rigbook-test"
FEED_DROPIN = f"/etc/systemd/system/{WATCH_UNIT}.d/sandbox-feed.conf"
THIS_BOOT = "/run/rigbook-sim/kmsg"  # cleared by a reboot, like the kernel's ring buffer
ALL_BOOTS = "/var/lib/rigbook-sim/kmsg-all-boots.log"  # on disk, like the journal
STAND_IN = "rigbook-test-serve.service"
STAND_IN_PATH = f"/run/systemd/system/{STAND_IN}"
QUARANTINE = "/dev/shm/.rigbook-quarantine"

HOLDER = """\
import mmap, os, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 8 << 20)
buffer = mmap.mmap(fd, 0)
buffer[:4] = b"kv!!"
os.close(fd)  # held through the mapping alone, as an engine holds its offload buffer
open(sys.argv[2], "w").close()
time.sleep(3600)
"""

FEED = f"""\
[Service]
Environment="RIGBOOK_XID_SCAN=cat {ALL_BOOTS}"
Environment="RIGBOOK_XID_FOLLOW=tail -n +1 -F {THIS_BOOT} 2>/dev/null"
"""

# A stand-in for rigbook-serve.service (in /run: gone at reboot) whose "engine" maps a buffer
# and is force-killed on stop, as vLLM is after TimeoutStopSec: the buffer leaks.
SERVE = f"""\
[Unit]
Description=rigbook test stand-in for the serving unit
[Service]
ExecStart=/usr/bin/python3 {TEST_DIR}/holder.py /dev/shm/vllm_offload_serve.mmap \\
    {TEST_DIR}/serve.ready
KillSignal=SIGKILL
"""

RIGS: dict[str, dict] = {}


def ssh(command: str, check: bool = True) -> subprocess.CompletedProcess:
    return rig_ssh(RIGS[RIG], command, check=check)


def wait_for(command: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while ssh(command, check=False).returncode != 0:
        assert time.monotonic() < deadline, f"timed out waiting for: {command}"
        time.sleep(0.5)


def journal(unit: str) -> str:
    return ssh(f"journalctl -u {unit} -o cat --no-pager -b 0").stdout


def write(path: str, text: str) -> None:
    ssh(f"mkdir -p $(dirname {path}) && cat > {path} <<'RIGBOOK_EOF'\n{text}RIGBOOK_EOF")


def exists(path: str) -> bool:
    return ssh(f"test -e {path}", check=False).returncode == 0


def clean() -> None:
    """Leave the rig as the guards deploy made it: default sources, no test files or units."""
    ssh(f"systemctl stop rigbook-test-holder {STAND_IN} 2>/dev/null; "
        f"rm -rf {FEED_DROPIN} {STAND_IN_PATH} {STAND_IN_PATH}.d {ALL_BOOTS} {THIS_BOOT} "
        f"{GPU_LOST_MARK} /dev/shm/vllm_offload_* {QUARANTINE}.stray-* {TEST_DIR}; "
        "systemd-tmpfiles --create /etc/tmpfiles.d/rigbook-shm-reaper.conf; "
        "systemctl daemon-reload; "
        f"systemctl reset-failed {REAPER_UNIT} {STAND_IN} 2>/dev/null; "
        f"systemctl restart {WATCH_UNIT}", check=False)


def stand_in_serving_unit() -> None:
    """The stand-in serving unit, guarded by a copy of the drop-in the deploy installed."""
    write(STAND_IN_PATH, SERVE)
    ssh(f"mkdir -p {STAND_IN_PATH}.d && cp {SERVE_DROPIN} {STAND_IN_PATH}.d/ && "
        "systemctl daemon-reload")


@pytest.fixture(scope="module")
def guarded(sandbox, tmp_path_factory):
    """rig2 with the guards deployed (twice: the second run changes nothing); the deploy file."""
    RIGS.update(sandbox)
    deploy = tmp_path_factory.mktemp("deploy") / "guards_only.py"
    deploy.write_text("from pyinfra import host\nfrom rigbook.roles.guards import guards\n"
                      "from rigbook.inventory import rig_of\nguards(rig_of(host))\n")
    first = run_pyinfra(SANDBOX_INVENTORY, str(deploy), "--limit", RIG)
    assert first.returncode == 0, first.explain()
    assert first.changed(), first.explain()
    second = run_pyinfra(SANDBOX_INVENTORY, str(deploy), "--limit", RIG)
    assert second.returncode == 0 and second.changed() == {}, second.explain()
    assert ssh(f"systemctl is-active {WATCH_UNIT}").stdout.strip() == "active"
    assert ssh(f"systemctl is-enabled {WATCH_UNIT}").stdout.strip() == "enabled"
    assert exists(SERVE_DROPIN)
    # The quarantine is root's from the install on (tmpfiles.d, as every boot makes it).
    assert ssh(f"stat -c '%u %a %F' {QUARANTINE}").stdout.strip() == "0 700 directory"
    write(f"{TEST_DIR}/holder.py", HOLDER)
    try:
        yield str(deploy)
    finally:
        clean()


def test_the_guards_run_hardened(guarded):
    """systemd-analyze security on the rig: 3.0 or less (the tests below prove they still work:
    the watch reads the log and writes its mark, the reaper reads every process and deletes)."""
    for unit in (WATCH_UNIT, REAPER_UNIT):
        assert security_exposure(RIGS[RIG], unit) <= 3.0


def test_reaper_fails_closed_reaps_leaks_and_keeps_held_buffers(guarded):
    ssh(f"rm -rf {QUARANTINE}")  # as a boot leaves /dev/shm (earlier tests may have reaped here)
    ssh(f"systemd-run --unit rigbook-test-holder --collect /usr/bin/python3 {TEST_DIR}/holder.py"
        f" /dev/shm/vllm_offload_held.mmap {TEST_DIR}/held.ready")
    wait_for(f"test -e {TEST_DIR}/held.ready")
    holder = ssh("systemctl show -p MainPID --value rigbook-test-holder").stdout.strip()
    ssh("truncate -s 64M /dev/shm/vllm_offload_leaked.mmap")

    # 1. Unprivileged, beside root's processes: refused, nothing deleted, and it says why.
    weak = ssh(f"runuser -u nobody -- /usr/bin/python3 {REAPER}", check=False)
    assert weak.returncode == 3, weak
    leaked_line = next(line for line in weak.stderr.splitlines() if "_leaked.mmap" in line)
    assert leaked_line.startswith("refused /dev/shm/vllm_offload_leaked.mmap (0.1 GiB, "
                                  "67108864 bytes; 0.0 GiB in RAM): cannot read the mappings of "
                                  "PID 1 (systemd, uid 0): Permission denied: /proc/1/"), weak
    assert leaked_line.endswith("an unreadable holder is indistinguishable from no holder, so "
                                "nothing was deleted")
    assert exists("/dev/shm/vllm_offload_leaked.mmap")
    assert exists("/dev/shm/vllm_offload_held.mmap")
    assert not exists(QUARANTINE)  # nothing was set aside

    # 2. As root, by its unit: the leak is reaped, the buffer a live process maps is kept.
    done = ssh(f"systemctl start {REAPER_UNIT}", check=False)
    log = journal(REAPER_UNIT)
    assert done.returncode == 0, log
    assert ("reaped /dev/shm/vllm_offload_leaked.mmap (0.1 GiB, 67108864 bytes; 0.0 GiB in RAM):"
            " no process maps it or holds it open") in log
    assert (f"kept /dev/shm/vllm_offload_held.mmap (0.0 GiB, 8388608 bytes; 0.0 GiB in RAM): "
            f"held by PID {holder} (python3, maps)") in log
    assert not exists("/dev/shm/vllm_offload_leaked.mmap")
    assert exists("/dev/shm/vllm_offload_held.mmap")
    assert ssh(f"stat -c '%u %a %F' {QUARANTINE}").stdout.strip() == "0 700 directory"
    assert ssh(f"ls -A {QUARANTINE}").stdout == ""
    seen = len(log.splitlines())
    second = ssh(f"systemctl start {REAPER_UNIT}", check=False)
    new = journal(REAPER_UNIT).splitlines()[seen:]
    assert second.returncode == 0, new
    assert [line.split(" (")[0] for line in new if " /dev/shm/" in line] == [
        "kept /dev/shm/vllm_offload_held.mmap"], new  # a second run changes nothing
    weak = ssh(f"runuser -u nobody -- /usr/bin/python3 {REAPER}", check=False)
    assert weak.returncode == 1 and weak.stderr.startswith(
        f"rigbook-shm-reaper: cannot use {QUARANTINE}: Permission denied"), weak
    assert weak.stderr.rstrip().endswith("nothing was deleted")

    # 3. On demand (deploys/reap_shm.py): reaps what leaked, then has nothing to do.
    ssh("truncate -s 1M /dev/shm/vllm_offload_again.mmap")
    reap = run_pyinfra(SANDBOX_INVENTORY, "deploys/reap_shm.py", "--limit", RIG)
    assert reap.returncode == 0, reap.explain()
    assert reap.changed() == {"Reap /dev/shm | Reap leaked /dev/shm buffers": [RIG]}, (
        reap.explain())
    assert "reaping /dev/shm/vllm_offload_again.mmap (0.0 GiB, 1048576 bytes" in reap.stderr
    assert not exists("/dev/shm/vllm_offload_again.mmap")
    again = run_pyinfra(SANDBOX_INVENTORY, "deploys/reap_shm.py", "--limit", RIG)
    assert again.returncode == 0 and again.changed() == {}, again.explain()
    assert exists("/dev/shm/vllm_offload_held.mmap")

    # Leftovers of a run stopped midway: put back first (the held buffer stays held, with its
    # inode), then judged (the stray one is reaped); the quarantine is left empty.
    inode = ssh("stat -c %i /dev/shm/vllm_offload_held.mmap").stdout.strip()
    ssh(f"mv /dev/shm/vllm_offload_held.mmap {QUARANTINE}/ && "
        f"truncate -s 2M {QUARANTINE}/vllm_offload_stray.mmap")
    back = run_pyinfra(SANDBOX_INVENTORY, "deploys/reap_shm.py", "--limit", RIG)
    assert back.returncode == 0, back.explain()
    assert back.changed() == {"Reap /dev/shm | Reap leaked /dev/shm buffers": [RIG]}, (
        back.explain())
    for line in ("restoring /dev/shm/vllm_offload_held.mmap (0.0 GiB, 8388608 bytes",
                 "restoring /dev/shm/vllm_offload_stray.mmap (0.0 GiB, 2097152 bytes",
                 "reaping /dev/shm/vllm_offload_stray.mmap (0.0 GiB, 2097152 bytes"):
        assert line in back.stderr, back.explain()
    assert ssh("stat -c %i /dev/shm/vllm_offload_held.mmap").stdout.strip() == inode
    assert not exists("/dev/shm/vllm_offload_stray.mmap")
    assert ssh(f"ls -A {QUARANTINE}").stdout == ""
    assert ssh(f"grep -c ' {inode} ' /proc/{holder}/maps").stdout.strip() == "1"  # still held
    last = run_pyinfra(SANDBOX_INVENTORY, "deploys/reap_shm.py", "--limit", RIG)
    assert last.returncode == 0 and last.changed() == {}, last.explain()

    # 4. A serving unit whose engine is force-killed: its drop-in reaps the leaked buffer.
    stand_in_serving_unit()
    ssh(f"systemctl start {STAND_IN}")
    wait_for(f"test -e {TEST_DIR}/serve.ready")
    assert exists("/dev/shm/vllm_offload_serve.mmap")
    ssh(f"systemctl stop {STAND_IN}")
    assert not exists("/dev/shm/vllm_offload_serve.mmap"), journal(REAPER_UNIT)
    assert "reaped /dev/shm/vllm_offload_serve.mmap (0.0 GiB, 8388608 bytes" in journal(
        REAPER_UNIT)

    ssh("systemctl stop rigbook-test-holder")


def test_a_stray_quarantine_made_by_another_user_is_set_aside_and_the_reaper_goes_on(guarded):
    """Issue 29, finding 7: `mkdir /dev/shm/.rigbook-quarantine` as nobody (while root's was
    missing) stopped every later run ("must be a folder of uid 0"). Now the unit renames it
    aside, unread, says so, and reaps; the quarantine is root's 0700 again."""
    ssh(f"rm -rf {QUARANTINE} && runuser -u nobody -- mkdir -m 777 {QUARANTINE} && "
        f"runuser -u nobody -- truncate -s 1M {QUARANTINE}/vllm_offload_planted.mmap && "
        "truncate -s 1M /dev/shm/vllm_offload_stray_case.mmap")
    done = ssh(f"systemctl start {REAPER_UNIT}", check=False)
    log = journal(REAPER_UNIT)
    assert done.returncode == 0, log
    assert f"set aside {QUARANTINE} (" in log and "uid 65534" in log, log
    assert "reaped /dev/shm/vllm_offload_stray_case.mmap (" in log, log
    assert not exists("/dev/shm/vllm_offload_stray_case.mmap")
    assert not exists("/dev/shm/vllm_offload_planted.mmap")  # nothing of the stray put back
    assert ssh(f"stat -c '%u %a %F' {QUARANTINE}").stdout.strip() == "0 700 directory"
    strays = ssh(f"stat -c '%u %n' {QUARANTINE}.stray-*").stdout.split()
    assert strays[0] == "65534", strays
    ssh(f"rm -rf {QUARANTINE}.stray-*")


def rigbook_status() -> FleetStatus:
    script = ("import sys; from rigbook.status_table import status; "
              f"sys.exit(status({SANDBOX_INVENTORY!r}, [{RIG!r}], True))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.stdout.strip(), done.stderr
    return FleetStatus.model_validate(json.loads(done.stdout))


def test_xid_79_marks_the_gpu_lost_blocks_serving_and_a_reboot_clears_it(guarded):
    sim = SIM_KMSG.read_text()
    write(THIS_BOOT, sim)
    write(ALL_BOOTS, sim)
    write(FEED_DROPIN, FEED)
    ssh(f"systemctl daemon-reload && systemctl restart {WATCH_UNIT}")
    wait_for(f"test -s {GPU_LOST_MARK} && grep -q '): 154,' {GPU_LOST_MARK}", 30)
    lines = [line for line in sim.splitlines() if not line.startswith("#")]
    assert ssh(f"cat {GPU_LOST_MARK}").stdout.splitlines() == [
        "GPU lost: do not restart serving",
        next(line for line in lines if "): 79," in line),
        next(line for line in lines if "): 154," in line),
    ]
    assert ssh(f"cat {ENGINE_FAULTS_LOG}").stdout.splitlines() == [
        next(line for line in lines if "): 31," in line)]

    # Serving does not start on a lost GPU, and says why.
    stand_in_serving_unit()
    start = ssh(f"systemctl start {STAND_IN}", check=False)
    assert start.returncode != 0
    log = journal(STAND_IN)
    assert f"{GPU_LOST_MARK}: GPU lost: do not restart serving" in log, log
    assert "Xid 79 (fallen off the bus) on PCI 0000:01:00 at 2026-09-12T03:14:15+0000" in log
    assert ssh(f"systemctl is-active {STAND_IN}", check=False).stdout.strip() != "active"

    # rigbook status reads the mark: GPU gone.
    fleet = rigbook_status()
    (status,) = fleet.rigs
    assert status.state == "gpu-gone" and fleet.exit_code == 2
    assert any(f.level == "gone" and f.reason.startswith(
        "GPU lost: do not restart serving: Xid 79 (fallen off the bus) on PCI 0000:01:00")
        for f in status.findings), status.findings

    # A reboot clears the mark; the earlier boot's Xid is still reported, and sets none.
    rigbook("sandbox", "restart", RIG)
    wait_for(f"journalctl -u {WATCH_UNIT} -b 0 -o cat | grep -q 'following the kernel log'", 60)
    assert not exists(GPU_LOST_MARK)
    watch_log = journal(WATCH_UNIT)
    assert "kernel log, all boots: 3 Xid line(s)" in watch_log
    assert "Xid 79 (fallen off the bus) x1, last on PCI 0000:01:00" in watch_log
    assert "GPU lost: do not restart serving:" not in watch_log
    assert ssh(f"/usr/bin/python3 {WATCH} --check", check=False).returncode == 0


@pytest.mark.parametrize("log, says", [
    ("kmsg-reset-required.log", "Xid 62 (Internal micro-controller halt (newer drivers)) on PCI "
                                "0000:01:00 at 2026-09-12T03:20:07+0000"),
    ("kmsg-fallen-no-xid.log", "Xid 79 (fallen off the bus (no Xid line)) on PCI 0000:01:00 at "
                               "2026-09-12T03:31:44+0000"),
])
def test_a_reset_required_xid_or_a_fall_without_xid_marks_the_gpu_lost(guarded, log, says):
    sim = (ROOT / "sandbox" / "simulated" / log).read_text()
    write(THIS_BOOT, sim)
    write(ALL_BOOTS, sim)
    write(FEED_DROPIN, FEED)
    try:
        ssh(f"rm -f {GPU_LOST_MARK}; systemctl daemon-reload && systemctl restart {WATCH_UNIT}")
        wait_for(f"test -s {GPU_LOST_MARK}", 30)
        headline = ssh(f"head -n 1 {GPU_LOST_MARK}").stdout.strip()
        assert headline == "GPU lost: do not restart serving"
        stand_in_serving_unit()
        assert ssh(f"systemctl start {STAND_IN}", check=False).returncode != 0
        assert says in journal(STAND_IN)
        fleet = rigbook_status()
        assert fleet.rigs[0].state == "gpu-gone" and fleet.exit_code == 2
    finally:
        ssh(f"rm -f {GPU_LOST_MARK} {FEED_DROPIN} {THIS_BOOT} {ALL_BOOTS}; systemctl "
            f"daemon-reload; systemctl restart {WATCH_UNIT}", check=False)


def test_the_xid_watch_can_be_turned_off_and_on(guarded):
    off = run_pyinfra(SANDBOX_INVENTORY, guarded, "--limit", RIG,
                      "--data", "guards_xid_watch=false")
    assert off.returncode == 0, off.explain()
    assert not exists(f"/etc/systemd/system/{WATCH_UNIT}")
    assert ssh(f"systemctl is-active {WATCH_UNIT}", check=False).stdout.strip() != "active"
    assert exists(SERVE_DROPIN) and exists(WATCH)  # the serving unit's check still works
    again = run_pyinfra(SANDBOX_INVENTORY, guarded, "--limit", RIG,
                        "--data", "guards_xid_watch=false")
    assert again.returncode == 0 and again.changed() == {}, again.explain()
    on = run_pyinfra(SANDBOX_INVENTORY, guarded, "--limit", RIG)
    assert on.returncode == 0, on.explain()
    assert ssh(f"systemctl is-active {WATCH_UNIT}").stdout.strip() == "active"
