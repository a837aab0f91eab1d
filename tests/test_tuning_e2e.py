"""Host tuning and WSL2 end to end on the sandbox rigs, driven by the pyinfra CLI.

Each test first puts the rigs in a known "before" state over SSH (another test may have run the
full deploy already), then converges, checks the rigs themselves, and converges again to see
that nothing changes. /proc/sys is read-only inside the rigs, so the live sysctl step must warn
and leave this machine's own fs.inotify values alone. The WSL2 rig's reg.exe is the sandbox's
stand-in: real output format, a registry file, admin rights by /etc/rigbook-sim/windows-admin.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from rigbook.inventory import load_rigs
from rigbook.roles.tuning import READ_ONLY_NOTE, SYSCTL_CONF, size_bytes
from rigbook.roles.wsl import GRAPHICS_DRIVERS, REG_EXE
from tests.conftest import SANDBOX_INVENTORY, rig_ssh, run_pyinfra

DEPLOY = "tests/deploys/tuning_host.py"
WATCHES = Path("/proc/sys/fs/inotify/max_user_watches")
INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")
ADMIN = "/etc/rigbook-sim/windows-admin"
TDR_FILES = "/mnt/c/Users/rig/rigbook-tdr"

pytestmark = pytest.mark.sandbox


def changed(run, text: str) -> list[str]:
    """Hosts on which an operation whose name contains `text` changed something."""
    return sorted({h for name, hosts in run.changed().items() if text in name for h in hosts})


def reg(rig: dict, verb: str, *args: str, check: bool = True):
    quoted = " ".join(f"'{arg}'" for arg in (GRAPHICS_DRIVERS, *args))
    return rig_ssh(rig, f"{REG_EXE} {verb} {quoted}", check=check)


def tdr_delay(rig: dict) -> str:
    return reg(rig, "query", "/v", "TdrDelay").stdout


def remote_bytes(rig: dict, path: str) -> bytes:
    """A file's exact bytes (rig_ssh reads text, which turns CRLF into LF)."""
    return base64.b64decode(rig_ssh(rig, f"base64 -w0 {path}").stdout)


def wsl_rig(sandbox) -> dict:
    return next(r for r in sandbox.values() if r["profile"] == "wsl2-3090")


def test_tuning_converges_then_changes_nothing(sandbox):
    data = load_rigs(SANDBOX_INVENTORY)
    names = sorted(sandbox)
    own = WATCHES.read_text(), INSTANCES.read_text()
    wsl = wsl_rig(sandbox)
    # Before: no rigbook sysctl file, a leftover on each rig that lists it, a small /dev/shm
    # with no fstab line, and Windows' default TdrDelay on the WSL2 rig.
    for name, rig in sandbox.items():
        rig_ssh(rig, f"rm -f {SYSCTL_CONF}")
        for path in data[name].stale_files:
            rig_ssh(rig, f"echo 'vm.swappiness = 10' > {path}")
        if data[name].shm_size:
            rig_ssh(rig, "sed -i '/[[:space:]]\\/dev\\/shm[[:space:]]/d' /etc/fstab; "
                         "mount -o remount,size=64M /dev/shm")
    reg(wsl, "add", "/v", "TdrDelay", "/t", "REG_DWORD", "/d", "2", "/f")
    reg(wsl, "add", "/v", "TdrDdiDelay", "/t", "REG_DWORD", "/d", "60", "/f")

    first = run_pyinfra(SANDBOX_INVENTORY, DEPLOY)
    assert first.returncode == 0, first.explain()
    assert changed(first, f"Write {SYSCTL_CONF}") == names, first.explain()
    stale_hosts = sorted(n for n in names if data[n].stale_files)
    assert changed(first, "Remove leftover") == stale_hosts
    shm_hosts = sorted(n for n in names if data[n].shm_size)
    assert changed(first, "/dev/shm size in /etc/fstab") == shm_hosts
    assert changed(first, "Resize the live /dev/shm") == shm_hosts
    # Read-only /proc/sys: a warning per rig, no change, and this machine's values untouched.
    assert changed(first, "Apply the sysctl values live") == []
    differs = [n for n in names if (own[0].strip(), own[1].strip()) != (
        str(data[n].sysctl_inotify_max_user_watches),
        str(data[n].sysctl_inotify_max_user_instances))]
    for name in differs:
        assert f"{name}: /proc/sys is read-only here" in first.stderr, first.explain()
    assert not differs or READ_ONLY_NOTE in first.stderr
    assert (WATCHES.read_text(), INSTANCES.read_text()) == own
    # WSL2: only TdrDelay differed; it is set and the user is told to reboot Windows.
    assert changed(first, "GPU timeout (TDR)") == [wsl["name"]]
    assert f"{wsl['name']}: reboot Windows to apply TdrDelay=60 (read at boot)" in first.stderr

    for name, rig in sandbox.items():
        cfg = data[name]
        text = rig_ssh(rig, f"cat {SYSCTL_CONF}").stdout
        assert f"fs.inotify.max_user_watches = {cfg.sysctl_inotify_max_user_watches}" in text
        for path in cfg.stale_files:
            assert rig_ssh(rig, f"test -e {path}", check=False).returncode == 1
        if cfg.shm_size:
            fstab = rig_ssh(rig, "grep /dev/shm /etc/fstab").stdout.splitlines()
            assert fstab == [f"tmpfs /dev/shm tmpfs defaults,size={cfg.shm_size} 0 0"]
            size = int(rig_ssh(rig, "df -B1 --output=size /dev/shm").stdout.split()[-1])
            mem = int(rig_ssh(rig, "grep MemTotal /proc/meminfo").stdout.split()[1]) * 1024
            assert size == size_bytes(cfg.shm_size, mem)
    assert "REG_DWORD    0x3c" in tdr_delay(wsl)
    profile = rig_ssh(wsl, ". /etc/profile.d/rigbook-wsl.sh; echo $PYTORCH_CUDA_ALLOC_CONF")
    assert profile.stdout.strip() == "expandable_segments:False"

    second = run_pyinfra(SANDBOX_INVENTORY, DEPLOY)
    assert second.returncode == 0, second.explain()
    assert second.changed() == {}, second.explain()
    assert "reboot Windows" not in second.stderr
    for name in differs:  # still said, and still no change
        assert f"{name}: /proc/sys is read-only here" in second.stderr
    assert (WATCHES.read_text(), INSTANCES.read_text()) == own


def test_wsl_without_admin_writes_reg_and_ps1_and_fails(sandbox):
    wsl = wsl_rig(sandbox)
    limit = ("--limit", wsl["name"], "--data", "wsl_tdr_delay=90")
    registry = "cat /var/lib/rigbook-sim/registry.json"
    rig_ssh(wsl, f"rm -f {ADMIN} {TDR_FILES}.reg {TDR_FILES}.ps1")
    try:
        before = rig_ssh(wsl, registry, check=False).stdout
        run = run_pyinfra(SANDBOX_INVENTORY, DEPLOY, *limit)
        assert run.returncode != 0, run.explain()
        for part in ("Access is denied", "NOT set", "TdrDelay=90", r"C:\Users\rig\rigbook-tdr.reg",
                     "Administrator PowerShell", "reboot Windows"):
            assert part in run.stderr, run.explain()
        assert "reboot Windows to apply" not in run.stderr  # nothing was applied
        assert rig_ssh(wsl, registry, check=False).stdout == before
        reg_file = remote_bytes(wsl, f"{TDR_FILES}.reg")
        assert reg_file.startswith(b"Windows Registry Editor Version 5.00\r\n")
        assert b'"TdrDelay"=dword:0000005a\r\n' in reg_file
        assert b'"TdrDdiDelay"=dword:0000003c\r\n' in reg_file
        ps1 = remote_bytes(wsl, f"{TDR_FILES}.ps1")
        assert b"-Name TdrDelay -Type DWord -Value 90 -Force\r\n" in ps1
        stamp = rig_ssh(wsl, f"stat -c %Y:%s {TDR_FILES}.reg {TDR_FILES}.ps1").stdout

        # Again: the same clear failure, and the files are not written again.
        again = run_pyinfra(SANDBOX_INVENTORY, DEPLOY, *limit)
        assert again.returncode != 0 and "Access is denied" in again.stderr
        assert rig_ssh(wsl, f"stat -c %Y:%s {TDR_FILES}.reg {TDR_FILES}.ps1").stdout == stamp
        assert rig_ssh(wsl, registry, check=False).stdout == before
    finally:
        rig_ssh(wsl, f"echo 'simulated elevated session' > {ADMIN}")


def test_wsl_memory_below_minimum_is_reported_not_edited(sandbox):
    wsl = wsl_rig(sandbox)
    config = "/mnt/c/Users/rig/.wslconfig"
    original = rig_ssh(wsl, f"cat {config}").stdout
    rig_ssh(wsl, f"printf '[wsl2]\\nmemory=16GB\\n' > {config}")
    try:
        run = run_pyinfra(SANDBOX_INVENTORY, DEPLOY, "--limit", wsl["name"])
        assert run.returncode == 0, run.explain()
        assert changed(run, "WSL2 memory") == []
        assert "memory=16GB (16.0 GiB) is below wsl_min_memory_gib=24" in run.stderr
        assert rig_ssh(wsl, f"cat {config}").stdout == "[wsl2]\nmemory=16GB\n"
    finally:
        rig_ssh(wsl, f"cat > {config} <<'EOF'\n{original}EOF")
