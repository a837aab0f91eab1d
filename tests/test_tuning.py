"""rigbook.roles.tuning: the sysctl file and its live step, /dev/shm, leftovers.

Facts are run for real on this machine (their commands read /proc and /dev/shm here), so the
parsers are tested on real output; operations are run with facts given by the test and the
commands they yield are checked, and where they are shell, run against temporary files.
"""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand
from pyinfra.facts.files import FindInFile
from pyinfra.operations import files

from rigbook.core.checks import Facts
from rigbook.core.errors import RigbookError
from rigbook.core.spec import Rig
from rigbook.roles.tuning import (
    FSTAB_SHM_LINE,
    READ_ONLY_NOTE,
    SYSCTL_CONF,
    SYSCTL_TEMPLATE,
    LiveSysctl,
    LiveSysctls,
    Shm,
    ShmState,
    fstab_line,
    parse_live_sysctls,
    parse_shm,
    plan_live_sysctl,
    shm_differs,
    shm_live,
    shm_problem,
    size_bytes,
    sysctl_live,
    sysctl_path,
    sysctl_values,
    tuning_findings,
)
from tests.conftest import ROOT
from tests.opkit import execute, local_fact, run_op, shell

GIB = 1024**3
WATCHES = "fs.inotify.max_user_watches"
INSTANCES = "fs.inotify.max_user_instances"


# --- a small harness: real facts here, fake facts for operations ------------------------------


def rig(**data) -> Rig:
    return Rig(platform="debian", gpu_class="rtx3090", gpu_count=2, **data)


# --- the sysctl file ------------------------------------------------------------------------


def render(cfg: Rig) -> str:
    from rigbook.core.render import render as render_template

    return render_template(SYSCTL_TEMPLATE, cfg=cfg)


def file_values(text: str) -> dict[str, str]:
    """A sysctl.d file as sysctl -p reads it: key = value lines, comments skipped."""
    values = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith(("#", ";")):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def test_template_defaults_are_documented_values():
    text = render(rig())
    assert file_values(text) == {WATCHES: "1048576", INSTANCES: "1024"}
    assert "ENOSPC" in text  # the file says why
    assert text.endswith("\n") and "\n\n\n" not in text


def test_template_matches_what_the_live_step_compares():
    cfg = rig(
        sysctl_inotify_max_user_watches=524288,
        sysctl_extra={"vm.max_map_count": 262144, "net.ipv4.tcp_rmem": "4096 87380 6291456"},
    )
    assert file_values(render(cfg)) == sysctl_values(cfg)
    assert list(sysctl_values(cfg)) == [WATCHES, INSTANCES, "net.ipv4.tcp_rmem", "vm.max_map_count"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({WATCHES: 5}, "set sysctl_inotify_max_user_watches instead"),
        ({"not a key": 1}, "sysctl keys are dotted names"),
        ({"vm.swappiness": "10\nvm.x = 1"}, "a sysctl value is a number or words"),
    ],
)
def test_bad_sysctl_extra_is_refused_at_load(extra, message):
    from rigbook.core.spec import parse_rig

    with pytest.raises(RigbookError, match=re.escape(message)) as error:
        parse_rig("rig1", {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 1,
                           "sysctl_extra": extra})
    assert "rig1: sysctl_extra" in str(error.value)


def test_sysctl_path_swaps_dots_and_slashes_like_sysctl():
    assert sysctl_path(WATCHES) == "/proc/sys/fs/inotify/max_user_watches"
    dotted = "net.ipv4.conf.eth0/1.rp_filter"
    assert sysctl_path(dotted) == "/proc/sys/net/ipv4/conf/eth0.1/rp_filter"


# --- live values --------------------------------------------------------------------------------


def test_live_sysctls_fact_reads_this_machine():
    live = local_fact(LiveSysctls, keys=(WATCHES, "net.ipv4.tcp_rmem", "vm.no_such_key"))
    assert live[WATCHES].value == Path(sysctl_path(WATCHES)).read_text().strip()
    assert live["net.ipv4.tcp_rmem"].value.split() == (
        Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()
    )
    assert live["vm.no_such_key"].value is None
    proc_sys_ro = any(
        line.split()[1] == "/proc/sys" and "ro" in line.split()[3].split(",")
        for line in Path("/proc/mounts").read_text().splitlines()
    )
    assert live[WATCHES].read_only is proc_sys_ro


def test_read_only_comes_from_the_deepest_mount():
    # systemd-nspawn with a private network: /proc/sys read-only, /proc/sys/net writable again.
    live = parse_live_sysctls([
        "mount /proc rw,nosuid,nodev,noexec,relatime",
        "mount /proc/sys ro,nosuid,nodev,noexec,relatime",
        "mount /proc/sys/net rw,nosuid,nodev,noexec,relatime",
        "mount /proc/sysrq-trigger ro,nosuid,nodev,noexec,relatime",
        f"key {WATCHES} 124208 ",
        "key net.core.somaxconn 4096",
        "nokey vm.no_such_key",
    ])
    assert live[WATCHES] == LiveSysctl("124208", True)
    assert live["net.core.somaxconn"] == LiveSysctl("4096", False)
    assert live["vm.no_such_key"] == LiveSysctl(None, True)


def test_plan_splits_differ_same_read_only_missing():
    wanted = {WATCHES: "1048576", INSTANCES: "1024", "net.ipv4.tcp_rmem": "4096 87380 6291456",
              "vm.nothing": "1"}
    live = {
        WATCHES: LiveSysctl("65536", False),
        INSTANCES: LiveSysctl("1024", False),
        "net.ipv4.tcp_rmem": LiveSysctl("4096\t87380\t6291456", False),
    }
    plan = plan_live_sysctl(wanted, live)
    assert plan.apply == {WATCHES: "1048576"}
    assert plan.read_only == {}
    assert plan.missing == ("vm.nothing",)
    live[WATCHES] = LiveSysctl("65536", True)
    assert plan_live_sysctl(wanted, live).read_only == {WATCHES: "1048576"}


VALUES = {WATCHES: "1048576", INSTANCES: "1024"}


def test_live_step_applies_the_file_when_values_differ():
    live = {WATCHES: LiveSysctl("65536", False), INSTANCES: LiveSysctl("128", False)}
    commands, fake = run_op(sysctl_live, {"LiveSysctls": live}, values=VALUES)
    assert shell(commands) == [f"sysctl -p {SYSCTL_CONF}"]
    assert fake.asked == [("LiveSysctls", {"keys": (WATCHES, INSTANCES)})]


def test_live_step_is_no_change_when_values_match():
    live = {WATCHES: LiveSysctl("1048576", False), INSTANCES: LiveSysctl("1024", False)}
    commands, fake = run_op(sysctl_live, {"LiveSysctls": live}, values=VALUES)
    assert commands == []
    assert fake.noops == [f"sysctl values of {SYSCTL_CONF} are live"]


def test_read_only_host_warns_once_and_changes_nothing(caplog):
    live = {WATCHES: LiveSysctl("65536", True), INSTANCES: LiveSysctl("128", True)}
    with caplog.at_level(logging.WARNING, logger="pyinfra"):
        for _ in range(2):  # prepare and execution both run the body
            commands, _fake = run_op(sysctl_live, {"LiveSysctls": live}, values=VALUES,
                                     name="rig2")
            assert commands == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "rig2" in warnings[0] and READ_ONLY_NOTE in warnings[0]
    assert f"{WATCHES}=1048576" in warnings[0] and f"{INSTANCES}=1024" in warnings[0]


def test_mixed_host_writes_the_writable_keys_one_by_one(caplog):
    live = {WATCHES: LiveSysctl("65536", True), INSTANCES: LiveSysctl("128", False)}
    commands, _ = run_op(sysctl_live, {"LiveSysctls": live}, values=VALUES)
    assert shell(commands) == [f"sysctl -w {INSTANCES}=1024"]
    assert WATCHES in caplog.text


def test_live_step_refuses_a_key_the_kernel_lacks():
    live = {WATCHES: LiveSysctl("1048576", False), INSTANCES: LiveSysctl(None, False)}
    commands, fake = run_op(sysctl_live, {"LiveSysctls": live}, values=VALUES)
    assert len(commands) == 1 and isinstance(commands[0], FunctionCommand)
    assert execute(commands[0], fake) is False
    assert INSTANCES in fake.logged[0] and "rig1" in fake.logged[0]


# --- /dev/shm -----------------------------------------------------------------------------------


def test_shm_fact_reads_this_machine():
    shm = local_fact(Shm)
    meminfo = Path("/proc/meminfo").read_text()
    mem_kib = int(re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M).group(1))
    assert shm.mem_total_bytes == mem_kib * 1024
    df = subprocess.run(["df", "-B1", "--output=size", "/dev/shm"], capture_output=True,
                        text=True, check=True).stdout.split()
    assert shm.fstype == "tmpfs" and shm.size_bytes == int(df[-1])
    assert shm.used_bytes is not None and shm.used_bytes <= shm.size_bytes


def test_shm_fact_without_a_mount():
    shm = parse_shm(["df 1000000 0", "MemTotal:       24596720 kB"])
    assert shm == ShmState(None, "", None, None, 24596720 * 1024)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("2G", 2 * GIB),
        ("512M", 512 * 1024**2),
        ("64K", 64 * 1024),
        ("1K", 4096),  # tmpfs rounds up to whole pages
        ("50%", 12298360 * 1024),  # half of 24596720 kB, in pages
        ("10%", 2459672 * 1024),
    ],
)
def test_size_bytes(size, expected):
    assert size_bytes(size, 24596720 * 1024) == expected


def test_size_bytes_matches_the_kernel_for_percentages():
    # This machine's own /dev/shm (typically size=50%) read back by df is what size_bytes says
    # when its size= option is a percentage of MemTotal.
    shm = local_fact(Shm)
    match = re.search(r"size=(\d+)k", shm.options)
    if match:  # the kernel shows the size in k: the same number of bytes as df
        assert size_bytes(f"{int(match.group(1))}K", shm.mem_total_bytes) == shm.size_bytes


def state(size=64 * 1024**2, used=0, mem=24 * GIB, fstype="tmpfs") -> ShmState:
    return ShmState(fstype, "rw,nosuid,nodev", size, used, mem)


def test_shm_larger_than_ram_is_refused_with_asked_and_ram():
    text = shm_problem("64G", state(mem=24 * GIB))
    for part in ("64G", "64.0 GiB", "24.0 GiB", "RAM", "allowed: up to the RAM"):
        assert part in text


def test_shm_below_what_is_in_use_is_refused():
    assert "holds 3.0 GiB" in shm_problem("2G", state(used=3 * GIB))


def test_shm_that_is_not_tmpfs_is_refused():
    assert "not mounted" in shm_problem("2G", state(fstype=None, size=None))
    assert shm_problem("2G", state()) is None


def test_shm_differs_tolerates_one_page():
    assert not shm_differs(2 * GIB, state(size=2 * GIB))
    assert not shm_differs(2 * GIB, state(size=2 * GIB + 4096))
    assert shm_differs(2 * GIB, state(size=64 * 1024**2))


def test_shm_live_remounts_when_size_differs():
    commands, _ = run_op(shm_live, {"Shm": state(size=64 * 1024**2)}, size="2G")
    assert shell(commands) == ["mount -o remount,size=2G /dev/shm"]


def test_shm_live_is_no_change_at_the_size():
    commands, fake = run_op(shm_live, {"Shm": state(size=2 * GIB)}, size="2G")
    assert commands == [] and "already 2.0 GiB" in fake.noops[0]


def test_shm_live_percentages_compare_in_bytes():
    mem = 24596720 * 1024
    commands, _ = run_op(shm_live, {"Shm": state(size=size_bytes("50%", mem), mem=mem)},
                         size="50%")
    assert commands == []


def test_shm_live_refuses_too_large():
    commands, fake = run_op(shm_live, {"Shm": state(mem=16 * GIB)}, size="32G")
    assert len(commands) == 1 and execute(commands[0], fake) is False
    assert "32G" in fake.logged[0]


# --- /etc/fstab -------------------------------------------------------------------------------

FSTAB = """\
# /etc/fstab: static file system information.
UUID=0a1b / ext4 errors=remount-ro 0 1
# tmpfs /dev/shm tmpfs defaults,size=1G 0 0
none /dev/shm tmpfs defaults 0 0
/dev/shmem /srv ext4 defaults 0 2
"""


def fstab_commands(path: Path, size: str) -> list[str]:
    found = local_fact(FindInFile, path=str(path), pattern=f"{FSTAB_SHM_LINE}.*$",
                       extended_regex=True)
    commands, _ = run_op(
        files.line, {"FindInFile": found}, path=str(path), line=FSTAB_SHM_LINE,
        replace=fstab_line(size), extended_regex=True,
    )
    return shell(commands)


def test_fstab_edit_changes_only_the_shm_line(tmp_path):
    fstab = tmp_path / "fstab"
    fstab.write_text(FSTAB)
    for command in fstab_commands(fstab, "2G"):
        subprocess.run(["sh", "-c", command], check=True)
    lines = fstab.read_text().splitlines()
    assert lines == [
        "# /etc/fstab: static file system information.",
        "UUID=0a1b / ext4 errors=remount-ro 0 1",
        "# tmpfs /dev/shm tmpfs defaults,size=1G 0 0",
        "tmpfs /dev/shm tmpfs defaults,size=2G 0 0",
        "/dev/shmem /srv ext4 defaults 0 2",
    ]
    assert fstab_commands(fstab, "2G") == []  # converged: a second run changes nothing
    assert list(tmp_path.iterdir()) == [fstab]  # no sed backup left behind


def test_fstab_without_a_shm_line_gets_one_appended(tmp_path):
    fstab = tmp_path / "fstab"
    fstab.write_text("# UNCONFIGURED FSTAB FOR BASE SYSTEM\n")
    for command in fstab_commands(fstab, "50%"):
        subprocess.run(["sh", "-c", command], check=True)
    assert fstab.read_text().splitlines()[-1] == "tmpfs /dev/shm tmpfs defaults,size=50% 0 0"
    assert fstab_commands(fstab, "50%") == []


# --- preflight --------------------------------------------------------------------------------


def live_ok(cfg: Rig) -> dict[str, LiveSysctl]:
    return {key: LiveSysctl("1", False) for key in sysctl_values(cfg)}


def tuning_facts(cfg: Rig, shm, live) -> Facts:
    """The tuning check's facts: the file as rigbook writes it, fstab with the wanted line."""
    fstab = [fstab_line(cfg.shm_size)] if cfg.shm_size else []
    return Facts(sysctl_file=[f"{k} = {v}" for k, v in sysctl_values(cfg).items()],
                 sysctl_live=live, shm=shm, fstab=fstab)


def refusals(cfg: Rig, facts: Facts) -> list[str]:
    return [f.message("rig1") for f in tuning_findings(cfg, facts, "rig1") if f.level == "error"]


def test_the_check_passes_a_good_host():
    cfg = rig(shm_size="2G")
    live = {key: LiveSysctl(value, False) for key, value in sysctl_values(cfg).items()}
    assert tuning_findings(cfg, tuning_facts(cfg, state(size=2 * GIB), live), "rig1") == []


def test_the_check_refuses_with_every_reason():
    cfg = rig(shm_size="64G", sysctl_extra={"vm.no_such_key": 1})
    live = live_ok(cfg)
    live["vm.no_such_key"] = LiveSysctl(None, False)
    errors = refusals(cfg, tuning_facts(cfg, state(mem=24 * GIB), live))
    assert errors == [
        "rig1: sysctl_extra: this kernel has no vm.no_such_key (no /proc/sys/vm/no_such_key); "
        "allowed: keys this kernel has",
        "rig1: shm_size: asked 64G (64.0 GiB) but the host has 24.0 GiB of RAM (MemTotal); "
        "allowed: up to the RAM, e.g. 50% or a size below it",
    ]


def test_a_leftover_that_is_not_a_regular_file_refuses_the_rig_before_any_change(tmp_path):
    """Check first: the preflight reads what each leftover is; a folder, a link, a FIFO there
    refuses the rig before the driver (or anything) changes, instead of failing mid-run."""
    from rigbook.roles.tuning import PresentPaths

    (tmp_path / "99-vllm-swap.conf").write_text("vm.swappiness = 10\n")
    (tmp_path / "a folder.conf").mkdir()
    (tmp_path / "a link.conf").symlink_to(tmp_path / "99-vllm-swap.conf")
    paths = tuple(str(tmp_path / name) for name in
                  ("99-vllm-swap.conf", "a folder.conf", "a link.conf", "absent.conf"))
    present = local_fact(PresentPaths, paths=paths)
    assert present == {paths[0]: "file", paths[1]: "directory", paths[2]: "link"}
    cfg = rig(stale_files=["/etc/sysctl.d/99-vllm-swap.conf", "/etc/sysctl.d/x.conf",
                           "/etc/sysctl.d/y.conf"])
    facts = tuning_facts(cfg, state(size=2 * GIB), live_ok(cfg))
    facts.store("stale_present", {"/etc/sysctl.d/99-vllm-swap.conf": "file",
                                  "/etc/sysctl.d/x.conf": "directory",
                                  "/etc/sysctl.d/y.conf": "link"})
    assert refusals(cfg, facts) == [
        f"rig1: stale_files: /etc/sysctl.d/{name}.conf is a {kind}, not a regular file: rigbook "
        "removes regular files only; allowed: take it out of stale_files" for name, kind in
        (("x", "directory"), ("y", "link"))]
    drifts = [f.reason for f in tuning_findings(cfg, facts, "rig1") if f.level == "drift"]
    assert "leftover /etc/sysctl.d/99-vllm-swap.conf is present" in drifts


def test_the_check_leaves_shm_alone_when_not_asked():
    cfg = rig()  # shm_size None: even a tiny, non-tmpfs /dev/shm is fine
    assert refusals(cfg, tuning_facts(cfg, state(fstype=None, size=None), live_ok(cfg))) == []


# --- inotify watches per process (docs/sources.md, inotify watches) ----------------------------


def test_inotify_watches_are_counted_per_process_on_this_machine(tmp_path):
    import ctypes
    import os

    from rigbook.roles.tuning import InotifyWatches

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init()
    if fd < 0:
        pytest.skip("no inotify here")
    try:
        for i in range(3):
            folder = tmp_path / str(i)
            folder.mkdir()
            assert libc.inotify_add_watch(fd, str(folder).encode(), 0x100) >= 0  # IN_CREATE
        holders = local_fact(InotifyWatches)
        mine = [h for h in holders if h.pid == os.getpid()]
        assert len(mine) == 1 and mine[0].watches >= 3 and mine[0].uid == os.getuid()
    finally:
        os.close(fd)


def test_inotify_near_the_limit_names_the_holders():
    from rigbook.roles.tuning import inotify_findings, parse_inotify

    holders = parse_inotify(["12 812 0 systemd", "59628 4242 1000 code", "junk", "5 99 1000 x y"])
    assert [(h.comm, h.watches) for h in holders] == [("code", 59628), ("systemd", 12), ("x y", 5)]
    (finding,) = inotify_findings(holders, "65536")
    assert (finding.level, finding.area) == ("warn", "tuning")
    assert finding.reason == (
        "uid 1000 holds 59633 of fs.inotify.max_user_watches 65536 inotify watches (90%); most: "
        "code (pid 4242) 59628, x y (pid 99) 5. A start can die with ENOSPC: exclude the "
        "watcher's folders or raise sysctl_inotify_max_user_watches (docs/sources.md, inotify "
        "watches)"
    )
    assert inotify_findings(holders, "1048576") == []
    assert inotify_findings(holders, None) == [] and inotify_findings([], "10") == []


def test_the_fstab_line_is_left_alone_when_the_preflight_read_it_as_wanted():
    from rigbook.roles.tuning import fstab_line, fstab_shm_size

    there = ["# /etc/fstab", "UUID=1 / ext4 defaults 0 1", fstab_line("16G")]
    commands, fake = run_op(fstab_shm_size, {"FileContents": there}, size="16G")
    assert commands == [] and fake.noops == ["/etc/fstab already mounts /dev/shm with size=16G"]
    other = [*there[:2], fstab_line("8G")]
    commands, _ = run_op(fstab_shm_size, {"FileContents": other, "FindInFile": [fstab_line("8G")]},
                         size="16G")
    assert commands and "size=16G" in commands[0].get_raw_value()


def test_a_swappiness_leftover_on_a_box_without_swap_is_said():
    """Runbook: "/etc/sysctl.d/99-vllm-swap.conf is a leftover setting vm.swappiness = 10 on a
    box with no swap, so it is inert" ("swapon --show prints nothing"). /proc/swaps as published
    (tests/fixtures/real/swap/); its header alone is a box without swap."""
    from rigbook.roles.tuning import _SWAPPINESS, SwapLeftovers, swap_leftover_findings

    real = (ROOT / "tests/fixtures/real/swap/proc-swaps-one-partition.txt").read_text()
    header = real.splitlines()[:1]
    grep = ["/etc/sysctl.d/99-vllm-swap.conf:vm.swappiness = 10",
            "/etc/sysctl.d/99-vllm-swap.conf:vm.swappiness=10"]
    swapless = SwapLeftovers().process([*header, _SWAPPINESS, *grep])
    assert swapless.areas == () and swapless.swappiness_files == (
        "/etc/sysctl.d/99-vllm-swap.conf",)
    rig = Rig(platform="ubuntu", gpu_class="rtx3090", gpu_count=2)
    [finding] = swap_leftover_findings(rig, swapless)
    assert (finding.level, finding.key) == ("warn", "stale_files")
    assert finding.reason.startswith("/etc/sysctl.d/99-vllm-swap.conf sets vm.swappiness, but "
                                     "the host has no swap: it is inert")
    listed = rig.model_copy(update={"stale_files": ("/etc/sysctl.d/99-vllm-swap.conf",)})
    assert swap_leftover_findings(listed, swapless) == []  # removed as a leftover already
    swapping = SwapLeftovers().process([*real.splitlines(), _SWAPPINESS, *grep])
    assert swapping.areas == ("/dev/dm-1",)
    assert swap_leftover_findings(rig, swapping) == []  # with swap it does something
    assert SwapLeftovers().process([*header, _SWAPPINESS]).swappiness_files == ()
