"""Tests of the sandbox rigs (`rigbook sandbox ...`) and of their simulated GPU layer.

The end-to-end tests (marked `sandbox`) use the session's rigs from tests/conftest.py, booted
afresh for this file, drive them over SSH, restart them and take them down twice; the first run
on a machine builds the rootfs cache (about a minute). The stand-in tools' own tests run them
outside any rig, against a temporary root (RIGBOOK_SIM_ROOT).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rigbook import sandbox
from rigbook.core.errors import RigbookError
from rigbook.sandbox import REPO_MOUNT, Rig, _sim_gpus, cache_dir, prefix, state_dir
from tests.conftest import ROOT, rig_ssh, rigbook

SIM = ROOT / "sandbox" / "simulated"
OLD, NEW = "580.95.05-1", "580.159.04-1"
DRIVER_PACKAGES = (
    "nvidia-open",
    "nvidia-smi",
    "nvidia-persistenced",
    "libnvidia-ml1",
    "nvidia-kernel-open-dkms",
)
FIELDS = (
    "index,name,pci.bus_id,driver_version,power.limit,power.default_limit,power.min_limit,"
    "power.max_limit,enforced.power.limit,memory.total,persistence_mode,pcie.link.gen.max,"
    "pcie.link.width.max,clocks_event_reasons.sw_power_cap,compute_cap"
)


def ok(rig: dict, command: str) -> str:
    result = rig_ssh(rig, command, check=False)
    assert result.returncode == 0, f"{rig['name']}: {command}: {result.stdout}{result.stderr}"
    return result.stdout


def install_driver(rig: dict, version: str) -> None:
    """As the driver role must on Debian: every package pinned, or apt takes the newest deps."""
    pins = " ".join(f"{name}={version}" for name in DRIVER_PACKAGES)
    ok(
        rig,
        f"echo 'deb [trusted=yes] file:{REPO_MOUNT} ./' "
        "> /etc/apt/sources.list.d/rigbook-sim.list && apt-get update -qq && "
        f"DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {pins}",
    )


@pytest.fixture(scope="module")
def rigs(sandbox):
    """The session's rigs, booted again: earlier test files leave their state on them.

    `sandbox up` gives the same names, addresses and key, so the session's entries stay valid.
    """
    rigbook("sandbox", "up", str(len(sandbox)))
    return sandbox


@pytest.fixture(scope="module")
def driver(rigs):
    for name in ("rig1", "rig2"):
        install_driver(rigs[name], OLD)
    return rigs


@pytest.mark.sandbox
def test_up_lists_the_rigs_and_they_answer_over_ssh(rigs):
    one, two = Rig(1, "dual-3090").address, Rig(2, "single-4090").address  # 10.231.I.2 in set 0
    assert [(r["name"], r["address"], r["profile"]) for r in rigs.values()][:2] == [
        ("rig1", one, "dual-3090"),
        ("rig2", two, "single-4090"),
    ]
    assert rigbook("sandbox", "list").stdout.split()[:6] == [
        "rig1", one, "dual-3090", "rig2", two, "single-4090",
    ]  # fmt: skip
    for name, rig in rigs.items():
        assert ok(rig, "hostname").strip() == name
        assert json.loads(ok(rig, "cat /etc/rigbook-sim/gpus.json"))["profile"] == rig["profile"]


@pytest.mark.sandbox
def test_systemd_is_pid1(rigs):
    for rig in rigs.values():
        state = rig_ssh(rig, "systemctl is-system-running --wait", check=False).stdout.strip()
        assert state in ("running", "degraded")
        assert ok(rig, "cat /proc/1/comm").strip() == "systemd"


@pytest.mark.sandbox
def test_nvidia_smi_reports_the_profile_in_the_real_csv_format(driver):
    header = (
        "index, name, pci.bus_id, driver_version, power.limit [W], power.default_limit [W], "
        "power.min_limit [W], power.max_limit [W], enforced.power.limit [W], "
        "memory.total [MiB], persistence_mode, pcie.link.gen.max, pcie.link.width.max, "
        "clocks_event_reasons.sw_power_cap, compute_cap"
    )
    assert ok(driver["rig1"], f"nvidia-smi --query-gpu={FIELDS} --format=csv") == (
        f"{header}\n"
        "0, NVIDIA GeForce RTX 3090, 00000000:01:00.0, 580.95.05, 350.00 W, 350.00 W, "
        "100.00 W, 400.00 W, 350.00 W, 24576 MiB, Disabled, 4, 16, Not Active, 8.6\n"
        "1, NVIDIA GeForce RTX 3090, 00000000:02:00.0, 580.95.05, 350.00 W, 350.00 W, "
        "100.00 W, 400.00 W, 350.00 W, 24576 MiB, Disabled, 4, 16, Not Active, 8.6\n"
    )
    query = f"nvidia-smi --query-gpu={FIELDS} --format=csv,noheader,nounits"
    assert ok(driver["rig2"], query) == (
        "0, NVIDIA GeForce RTX 4090, 00000000:01:00.0, 580.95.05, 450.00, 450.00, 150.00, "
        "600.00, 450.00, 24564, Disabled, 4, 16, Not Active, 8.9\n"
    )
    listing = ok(driver["rig1"], "nvidia-smi -L").splitlines()
    uuid = r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    assert len(listing) == 2
    for index, line in enumerate(listing):
        assert re.fullmatch(rf"GPU {index}: NVIDIA GeForce RTX 3090 \(UUID: {uuid}\)", line)
    bad = rig_ssh(driver["rig1"], "nvidia-smi --query-gpu=index,power.bogus --format=csv", False)
    assert (bad.returncode, bad.stdout.splitlines()[0]) == (
        2,
        'Field "power.bogus" is not a valid field to query.',
    )


@pytest.mark.sandbox
def test_power_limit_out_of_range_fails_with_the_real_message(driver):
    result = rig_ssh(driver["rig1"], "nvidia-smi -pl 450", check=False)
    assert result.returncode == 2
    assert result.stdout.splitlines() == [
        "Provided power limit 450.00 W is not a valid power limit which should be between "
        "100.00 W and 400.00 W for GPU 00000000:01:00.0",
        "Terminating early due to previous errors.",
    ]


@pytest.mark.sandbox
def test_power_limit_in_range_is_remembered(driver):
    out = ok(driver["rig1"], "nvidia-smi -i 00000000:02:00.0 -pl 290").splitlines()
    assert "Power limit for GPU 00000000:02:00.0 was set to 290.00 W from 350.00 W." in out
    assert out[-1] == "All done."
    query = "nvidia-smi --query-gpu=power.limit --format=csv,noheader,nounits"
    assert ok(driver["rig1"], query).split() == ["350.00", "290.00"]


@pytest.mark.sandbox
def test_restart_resets_the_cap_and_keeps_the_installed_driver(driver):
    rig = driver["rig1"]
    ok(rig, "touch /run/before-restart /root/before-restart")
    rigbook("sandbox", "restart", "rig1")
    assert rig_ssh(rig, "test -e /run/before-restart", check=False).returncode == 1
    ok(rig, "test -e /root/before-restart")
    query = "nvidia-smi --query-gpu=power.limit,persistence_mode --format=csv,noheader"
    assert ok(rig, query).splitlines() == ["350.00 W, Disabled"] * 2
    status = "dpkg-query -W -f='${Status} ${Version}' nvidia-open"
    assert ok(rig, status) == f"install ok installed {OLD}"
    assert ok(rig, "systemctl is-active nvidia-persistenced").strip() == "active"


@pytest.mark.sandbox
def test_upgrade_without_reboot_is_a_version_mismatch_until_restart(driver):
    rig = driver["rig2"]
    install_driver(rig, NEW)
    result = rig_ssh(rig, "nvidia-smi -L", check=False)
    assert (result.returncode, result.stdout.splitlines()) == (
        18,
        [
            "Failed to initialize NVML: Driver/library version mismatch",
            "NVML library version: 580.159",
        ],
    )
    rigbook("sandbox", "restart", "rig2")
    query = "nvidia-smi --query-gpu=driver_version --format=csv,noheader"
    assert ok(rig, query).strip() == "580.159.04"


@pytest.mark.sandbox
def test_wsl2_rig_has_the_windows_side_and_no_driver_packages(rigs):
    wsl = next((r for r in rigs.values() if r["profile"] == "wsl2-3090"), None)
    if wsl is None:
        pytest.skip("the session runs fewer than 3 rigs")
    query = "/usr/lib/wsl/lib/nvidia-smi --query-gpu=name,driver_version --format=csv,noheader"
    assert ok(wsl, query) == "NVIDIA GeForce RTX 3090, 581.57\n"
    ok(wsl, "test -d /run/WSL && test -x /mnt/c/Windows/System32/reg.exe")
    assert "memory=32GB" in ok(wsl, "cat /mnt/c/Users/rig/.wslconfig")
    assert "nvidia" not in ok(wsl, "dpkg-query -W -f='${Package}\\n'")


@pytest.mark.sandbox
def test_down_twice_leaves_nothing_behind(rigs):
    try:
        for _ in range(2):
            rigbook("sandbox", "down")
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
        assert prefix() not in netns.stdout + links.stdout  # this set's; others keep theirs
        for hierarchy in ("systemd", "unified", ""):
            assert not list(Path("/sys/fs/cgroup", hierarchy).glob(prefix() + "*"))
        assert str(state_dir()) not in Path("/proc/self/mountinfo").read_text()
        left = sorted(p.name for p in state_dir().iterdir() if p.name != ".lock")
        assert left == []  # the rigs' SSH key too: `up` makes a new one
        assert list(cache_dir().glob("*.tar.zst"))
    finally:
        # Later test files share the session's rigs: hand them a fresh set back.
        rigbook("sandbox", "up", str(len(rigs)))


def test_each_set_of_rigs_has_its_own_names_subnet_and_state_dir(monkeypatch):
    """Set 0 is the sandbox as it always was; set N (parallel e2e workers) names, addresses and
    keeps nothing that set 0's teardown would take for its own, nor the other way round."""
    monkeypatch.delenv("RIGBOOK_SANDBOX_DIR", raising=False)
    monkeypatch.delenv(sandbox.SET_ENV, raising=False)
    rig = Rig(12, "dual-3090")
    assert (rig.thing, rig.address, rig.host_address, state_dir()) == (
        "rigbook-rig12", "10.231.12.2", "10.231.12.1", Path("/var/lib/rigbook/sandbox"))
    default = sandbox._thing_name()
    monkeypatch.setenv(sandbox.SET_ENV, "2")
    assert (rig.thing, rig.address, rig.host_address, state_dir()) == (
        "rigbook2-rig12", "10.233.12.2", "10.233.12.1", Path("/var/lib/rigbook/sandbox-2"))
    assert default.fullmatch("rigbook2-rig12") is None
    assert sandbox._thing_name().fullmatch("rigbook-rig12") is None
    assert len(Rig(sandbox.MAX_RIGS, "dual-3090").thing) <= 15  # an interface name's most
    for wrong in ("10", "-1", "two", ""):
        monkeypatch.setenv(sandbox.SET_ENV, wrong)
        with pytest.raises(RigbookError, match="RIGBOOK_SANDBOX_SET must be a number"):
            sandbox.sandbox_set()


def run_sim(tool: str, root: Path, *args: str) -> subprocess.CompletedProcess:
    """Runs a stand-in tool outside any rig, against a temporary root; keeps CRLF as printed."""
    env = {**os.environ, "RIGBOOK_SIM_ROOT": str(root)}
    result = subprocess.run([sys.executable, SIM / tool, *args], env=env, capture_output=True)
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


def test_reg_exe_answers_in_the_real_format_and_needs_admin_for_hklm(tmp_path):
    key = "HKLM\\System\\CurrentControlSet\\Control\\GraphicsDrivers"
    missing = run_sim("reg.exe", tmp_path, "query", key, "/v", "TdrDelay")
    assert (missing.returncode, missing.stderr) == (
        1,
        "ERROR: The system was unable to find the specified registry key or value.\r\n",
    )
    add = ("add", key, "/v", "TdrDelay", "/t", "REG_DWORD", "/d", "60", "/f")
    denied = run_sim("reg.exe", tmp_path, *add)
    assert (denied.returncode, denied.stderr) == (1, "ERROR: Access is denied.\r\n")
    (tmp_path / "etc/rigbook-sim").mkdir(parents=True)
    (tmp_path / "etc/rigbook-sim/windows-admin").touch()
    added = run_sim("reg.exe", tmp_path, *add)
    assert (added.returncode, added.stdout) == (0, "The operation completed successfully.\r\n")
    long_key = key.replace("HKLM", "HKEY_LOCAL_MACHINE")
    found = run_sim("reg.exe", tmp_path, "query", long_key, "/v", "tdrdelay")
    assert found.stdout == f"\r\n{long_key}\r\n    TdrDelay    REG_DWORD    0x3c\r\n\r\n"


def test_nvidia_smi_without_a_loaded_driver_or_with_an_old_one_fails_like_the_real_one(tmp_path):
    profiles = json.loads((SIM / "profiles.json").read_text())
    (tmp_path / "etc/rigbook-sim").mkdir(parents=True)
    gpus = _sim_gpus(Rig(2, "single-4090"), profiles)
    (tmp_path / "etc/rigbook-sim/gpus.json").write_text(json.dumps(gpus))
    (tmp_path / "usr/lib/rigbook-sim").mkdir(parents=True)
    (tmp_path / "usr/lib/rigbook-sim/nvml-version").write_text("580.159.04\n")
    assert run_sim("nvidia-smi", tmp_path, "-L").returncode == 9
    (tmp_path / "run/rigbook-sim").mkdir(parents=True)
    (tmp_path / "run/rigbook-sim/loaded-version").write_text("580.95.05\n")
    mismatch = run_sim("nvidia-smi", tmp_path, "-L")
    assert (mismatch.returncode, mismatch.stdout) == (
        18,
        "Failed to initialize NVML: Driver/library version mismatch\n"
        "NVML library version: 580.159\n",
    )
    (tmp_path / "run/rigbook-sim/loaded-version").write_text("580.159.04\n")
    table = run_sim("nvidia-smi", tmp_path).stdout.splitlines()
    assert table[2] == (
        "| NVIDIA-SMI 580.159.04             Driver Version: 580.159.04 "
        "    CUDA Version: 13.0     |"
    )
    assert table[8].startswith(
        "|   0  NVIDIA GeForce RTX 4090        Off |   00000000:01:00.0 Off |"
    )
