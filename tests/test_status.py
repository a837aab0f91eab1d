"""rigbook.status: facts -> RigStatus (drift rules, exit codes), the table and the JSON.

Fact values are made the way pyinfra makes them: each fact's own `process()` on output in its
real format (the H200 captures in tests/fixtures/nvidia-h200, dpkg/apt/df/proc output), and the
unit and sysctl file the roles themselves render (power.render_unit, the tuning template), so
status is checked against what a converge really leaves. Facts whose commands are rigbook's own
are also run for real here (against stand-in journalctl/dmesg where a kernel log is needed).
One test gathers from @local and a closed loopback port through pyinfra's API.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError
from pyinfra.api import Inventory
from pyinfra.facts.files import FindInFile
from rich.console import Console

from rigbook.core import pins
from rigbook.core.apt import AptHolds, DpkgInstalled
from rigbook.core.checks import REFUSING, Facts, reads_of, run_checks
from rigbook.core.errors import RigbookError
from rigbook.core.facts import GPUS, NvidiaGpus, RunningDriverFact, mismatch_finding
from rigbook.core.reboot import LoadedDriverVersion
from rigbook.core.render import render as render_template
from rigbook.core.spec import Rig
from rigbook.inventory import select_hosts as limit_hosts
from rigbook.preflight import refusal_text
from rigbook.registry import checks_of
from rigbook.rigside.gpus import Gpu, GpuProbe
from rigbook.roles import venvs as venvs_role
from rigbook.roles.disks import FreeDisk
from rigbook.roles.driver_source import DriverSourceFact
from rigbook.roles.guards import (
    KernelXids,
    fault_findings,
    gpu_lost_reason,
    history_findings,
    parse_gpu_lost,
    parse_kernel_log,
)
from rigbook.roles.models import ModelCache
from rigbook.roles.power import PowerUnitFile, desired_caps, render_unit, unit_caps
from rigbook.roles.serving import ENV_PATH as SERVE_ENV_PATH
from rigbook.roles.serving import (
    HEALTH_PATH,
    KEY_PATH,
    ServeProbe,
    probe_args,
    render_env,
    serve_plan,
)
from rigbook.roles.serving import UNIT_PATH as SERVE_UNIT_PATH
from rigbook.roles.tuning import (
    SYSCTL_TEMPLATE,
    PresentPaths,
    fstab_line,
    parse_live_sysctls,
    parse_shm,
    parse_sysctl_conf,
)
from rigbook.roles.venvs import MANIFEST, LiveDriver, VenvBuilds, build_name, smoke_input, spec_hash
from rigbook.roles.wsl import RegProbe, WindowsProfile, WslSignals
from rigbook.status import (
    FleetStatus,
    RigStatus,
    build_rig_status,
    fleet_exit_code,
    unreachable_status,
)
from rigbook.status_table import render, status
from tests.test_facts_data import captured
from tests.test_models import FILES_A, make_repo, read_cache
from tests.test_real_fixtures import REAL

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "tests" / "fixtures" / "nvidia-h200"
H200_SMI = "/usr/local/nvidia/bin/nvidia-smi"
SMI = "/usr/bin/nvidia-smi"
UUID0 = "GPU-5f1c0a3e-0000-4000-8000-000000000000"
UUID1 = "GPU-5f1c0a3e-1111-4000-8000-000000000001"
SIM_PACKAGES = ("libnvidia-ml1", "nvidia-kernel-open-dkms", "nvidia-open", "nvidia-persistenced",
                "nvidia-smi")


# --- facts as pyinfra hands them over ------------------------------------------------------


def smi_output(path: str, lines: list[str], rc: int = 0) -> list[str]:
    """What NvidiaGpus' shell wrapper prints around one nvidia-smi run."""
    return [f"##RIGBOOK_SMI## {path}", *lines, f"##RIGBOOK_RC## {rc}"]


def h200_probe() -> GpuProbe:
    csv = (H200 / "query-full-nounits.csv").read_text().splitlines()
    return NvidiaGpus().process(smi_output(H200_SMI, csv))


def rtx3090(index: int, uuid: str, limit: float = 290.0, persistence: bool = True) -> Gpu:
    return Gpu(
        index=index, uuid=uuid, name="NVIDIA GeForce RTX 3090",
        bus_id=f"00000000:0{index + 1}:00.0", driver_version="580.95.05", power_limit_w=limit,
        default_limit_w=350.0, min_limit_w=100.0, max_limit_w=400.0, enforced_limit_w=limit,
        persistence=persistence,
    )


def dual_3090(**data) -> Rig:
    return Rig(platform="debian", gpu_class="rtx3090", gpu_count=2, driver_version="580.95.05",
               shm_size="2G", stale_files=("/etc/sysctl.d/99-vllm-swap.conf",), **data)


def dpkg(packages: dict[str, str], held: set[str]) -> dict[str, str]:
    """DpkgInstalled from dpkg-query lines (held packages show as 'hi')."""
    lines = ["amd64"] + [
        f"{'hi' if name in held else 'ii'} \t{name}\tamd64\t{version}"
        for name, version in packages.items()
    ]
    return DpkgInstalled().process(lines)


def unit_fact(rig: Rig, gpus, smi: str = SMI, enabled: str = "enabled") -> object:
    """PowerUnitFile's value for the unit power.py writes for these GPUs."""
    text = render_unit(smi, desired_caps(rig, "rig1", gpus))
    starts = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    return PowerUnitFile().process(["##RIGBOOK_UNIT##", *starts, f"##RIGBOOK_ENABLED## {enabled}"])


def sysctl_file(rig: Rig) -> list[str]:
    return render_template(SYSCTL_TEMPLATE, cfg=rig).splitlines()


def live_sysctls(rig: Rig, read_only: bool = True, **values: str) -> dict:
    """LiveSysctls' value: /proc/sys read-only (nspawn) unless asked, values by key."""
    lines = [f"mount /proc/sys {'ro' if read_only else 'rw'},nosuid,nodev,noexec,relatime"]
    keys = {"fs.inotify.max_user_watches": str(rig.sysctl_inotify_max_user_watches),
            "fs.inotify.max_user_instances": str(rig.sysctl_inotify_max_user_instances)}
    keys.update({key.replace("__", "."): value for key, value in values.items()})
    lines += [f"key {key} {value}" for key, value in keys.items()]
    return parse_live_sysctls(lines)


def converged_dual(rig: Rig | None = None, gpus=None) -> Facts:
    """A dual-3090 sandbox-like rig as deploys/rig.py leaves it: everything as declared."""
    rig = rig or dual_3090()
    gpus = gpus or (rtx3090(0, UUID0), rtx3090(1, UUID1))
    installed = {name: "580.95.05-1" for name in SIM_PACKAGES}
    return Facts(
        probe=GpuProbe(smi=SMI, gpus=tuple(gpus)),
        installed=dpkg(installed, set(installed)),
        holds=AptHolds().process(list(SIM_PACKAGES)),
        loaded="580.95.05",
        reboot_marker=[],
        wsl=WslSignals("6.1.0-27-amd64", interop=False, run_wsl=False),
        unit=unit_fact(rig, gpus),
        sysctl_file=sysctl_file(rig),
        sysctl_live=live_sysctls(rig, read_only=True, fs__inotify__max_user_watches="124208",
                                 fs__inotify__max_user_instances="128"),
        shm=parse_shm(["mount tmpfs rw,nosuid,nodev,size=2097152k,inode64", "df 2147483648 0",
                       "MemTotal:       24596720 kB"]),
        fstab=["# /etc/fstab: static file system information.", fstab_line("2G")],
        stale_present={},
        disks=FreeDisk().process(["/ overlay 63000000000 20000000000 43000000000 32% /"]),
        klog=parse_kernel_log(["##RIGBOOK_KLOG## journalctl"]),
    )


def real(name: str) -> str:
    """A published output from tests/fixtures/real/ (SOURCES.md gives its URL)."""
    return (REAL / name).read_text()


def drifts(status: RigStatus, level: str = "drift") -> list[tuple[str, str | None, str]]:
    return [(f.area, f.gpu, f.reason) for f in status.findings if f.level == level]


def table_text(*rigs: RigStatus, width: int = 200) -> str:
    fleet = FleetStatus(inventory="inventory/test.py", rigs=list(rigs),
                        exit_code=fleet_exit_code(rigs))
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render(fleet))
    return console.export_text()


# --- all as declared ------------------------------------------------------------------------


def test_converged_dual_3090_is_as_declared():
    status = build_rig_status("rig1", dual_3090(), converged_dual())
    assert status.state == "as-declared", status.findings
    assert status.exit_code == 0
    assert [(g.index, g.cap_desired_w, g.cap_unit_w, g.cap_live_w) for g in status.gpus] == [
        (0, 290.0, 290.0, 290.0), (1, 290.0, 290.0, 290.0)]
    assert status.gpus[0].cap_source == "power_profile sweet-spot (rtx3090, air)"
    assert status.driver.running == "580.95.05" and status.driver.unheld == []
    assert status.power_unit.enabled == "enabled"
    # /proc/sys is read-only (the sandbox): the file is in place, so a warning, not drift
    assert [f.area for f in status.findings] == ["tuning", "tuning"]
    assert all(f.level == "warn" and "read-only" in f.reason for f in status.findings)
    text = table_text(status)
    assert "as declared" in text
    assert "290 / 290 / 290" in text and "RTX 3090" in text and "held" in text


def test_real_h200_capture():
    """The H200 host as captured: driver from /usr/local/nvidia, no packages, no systemd."""
    rig = Rig(platform="ubuntu", gpu_class="other", gpu_count=1, gpu_limits_watts=(200, 700),
              power_profile="stock", driver_version="580.159.04")
    proc = (H200 / "proc-driver-version.txt").read_text().splitlines()
    facts = Facts(
        probe=h200_probe(),
        installed={},
        driver_source=DriverSourceFact().process(
            (H200 / "driver-source-fact.txt").read_text().splitlines()),
        holds=AptHolds().process((H200 / "apt-mark-showhold.txt").read_text().splitlines()),
        loaded=LoadedDriverVersion().process(proc),
        unit=None,
        sysctl_file=None,
        sysctl_live=live_sysctls(rig, read_only=False, fs__inotify__max_user_watches="1030000",
                                 fs__inotify__max_user_instances="128"),
        shm=parse_shm(["mount tmpfs rw,nosuid,nodev,inode64", "df 137438953472 0",
                       "MemTotal:       131795188 kB"]),
        fstab=[],
        # what FreeDisk and KernelXids printed on the H200 host (rigbook status, @local)
        disks=FreeDisk().process(
            ["/ /dev/vda       270553174016 17355767808 68633169920      21% /"]),
        klog=KernelXids().process(["##RIGBOOK_KLOG## dmesg"]),
    )
    status = build_rig_status("h200", rig, facts)
    gpu = status.gpus[0]
    assert (gpu.name, gpu.uuid, gpu.bus_id) == (
        "NVIDIA H200", "GPU-26318cf3-2491-8ba9-5e54-60691789063b", "00000000:00:06.0")
    assert (gpu.cap_desired_w, gpu.cap_unit_w, gpu.cap_live_w) == (700.0, None, 700.0)
    assert gpu.persistence is True and gpu.memory_total_mib == 143771
    assert status.driver.running == "580.159.04" and status.driver.loaded == "580.159.04"
    assert status.driver.smi == H200_SMI
    # what is not as a rigbook rig would be, each said once
    assert drifts(status) == [
        ("driver", None, "driver_foreign: driver 580.159.04 whose files no package owns "
         "(/usr/local/nvidia/bin/nvidia-smi, /usr/local/nvidia/lib64/libnvidia-ml.so.1, "
         "/lib/libnvidia-ml.so.1): rigbook would put a packaged driver over it; to hand it "
         "over: it belongs to the host that mounts /usr/local/nvidia: change it there; or keep "
         "it as it is with driver_foreign: adopt"),
        ("tuning", None, "no /etc/sysctl.d/90-rigbook.conf"),
        ("tuning", None, "fs.inotify.max_user_watches is 1030000 live, inventory 1048576"),
        ("tuning", None, "fs.inotify.max_user_instances is 128 live, inventory 1024"),
        ("power", None, "no nvidia-power-limit.service: caps are lost at the next reboot"),
    ]
    assert status.state == "drift" and status.exit_code == 1
    assert status.kernel_log.source == "dmesg" and status.kernel_log.xids == []
    assert [(d.mount, d.avail_bytes) for d in status.disks] == [("/", 68633169920)]
    text = table_text(status)
    assert "0 H200" in text and "700 / - / 700" in text and "/ 63.9 GiB (25%)" in text
    assert status.driver.source.startswith("host mount: driver 580.159.04 whose files")
    assert "host mount" in text
    # adopted: the driver check has nothing to say; the source says so
    adopted = build_rig_status("h200", rig.model_copy(update={"driver_foreign": "adopt"}), facts)
    assert [f for f in adopted.findings if f.area == "driver"] == []
    assert adopted.driver.source.endswith("(adopted: driver_foreign)")
    other = build_rig_status("h200", rig.model_copy(update={"driver_foreign": "adopt",
                                                           "driver_version": "580.95.05"}), facts)
    assert [f.reason for f in other.findings if f.area == "driver"] == [
        "driver_version: adopted driver runs 580.159.04, inventory pins 580.95.05; rigbook "
        "cannot move a driver it does not own: set driver_version: 580.159.04"]


# --- drift ---------------------------------------------------------------------------------


def test_cap_changed_by_hand_on_one_gpu():
    gpus = (rtx3090(0, UUID0), rtx3090(1, UUID1, limit=300.0))
    facts = converged_dual().replace(probe=GpuProbe(smi=SMI, gpus=gpus))
    status = build_rig_status("rig1", dual_3090(), facts)
    assert status.state == "drift" and status.exit_code == 1
    assert drifts(status) == [("power", UUID1, "GPU 1: live cap 300 W, inventory 290 W")]
    assert [g.cap_live_w for g in status.gpus] == [290.0, 300.0]
    text = table_text(status)
    assert "290 / 290 / 300" in text and "DRIFT" in text
    assert "x GPU 1: live cap 300 W, inventory 290 W" in text


def test_unit_out_of_date_disabled_or_missing():
    rig = dual_3090()
    stale = unit_fact(dual_3090(power_cap_watts=300), (rtx3090(0, UUID0), rtx3090(1, UUID1)),
                      enabled="disabled")
    status = build_rig_status("rig1", rig, converged_dual().replace(unit=stale))
    assert drifts(status) == [
        ("power", None, "nvidia-power-limit.service is disabled, not enabled"),
        ("power", UUID0, "GPU 0: unit caps 300 W, inventory 290 W"),
        ("power", UUID1, "GPU 1: unit caps 300 W, inventory 290 W"),
    ]
    missing = build_rig_status("rig1", rig, converged_dual().replace(unit=None))
    assert drifts(missing) == [
        ("power", None, "no nvidia-power-limit.service: caps are lost at the next reboot")]


def test_cap_outside_the_cards_range_and_per_gpu_caps():
    rig = dual_3090(power_caps={UUID1: 250})
    gpus = (rtx3090(0, UUID0), rtx3090(1, UUID1, limit=250.0))
    status = build_rig_status("rig1", rig, converged_dual(rig, gpus).replace(
        probe=GpuProbe(smi=SMI, gpus=gpus)))
    assert status.state == "as-declared", status.findings
    assert status.gpus[1].cap_source == f"power_caps[{UUID1}]"
    too_high = dual_3090(power_cap_watts=500)
    status = build_rig_status("rig1", too_high, converged_dual())
    assert ("power", UUID0, f"power_cap_watts: GPU 0 ({UUID0}) asks 500 W (power_cap_watts); "
            "allowed: the "
            "card's range 100-400 W") in drifts(status)


def test_persistence_off_and_driver_not_held():
    gpus = (rtx3090(0, UUID0, persistence=False), rtx3090(1, UUID1))
    facts = converged_dual().replace(probe=GpuProbe(smi=SMI, gpus=gpus),
                    holds={"nvidia-open", "nvidia-smi"})
    status = build_rig_status("rig1", dual_3090(), facts)
    assert drifts(status) == [
        ("driver", None,
         "not held: libnvidia-ml1, nvidia-kernel-open-dkms, nvidia-persistenced"),
        ("persistence", UUID0, "GPU 0: persistence mode is off"),
    ]
    assert "NOT held" in table_text(status)
    # persistence is not asked for: off is as declared
    relaxed = build_rig_status("rig1", dual_3090(driver_persistence=False),
                               converged_dual().replace(probe=GpuProbe(smi=SMI, gpus=gpus)))
    assert relaxed.state == "as-declared"


def test_driver_version_and_pending_reboot():
    newer = {name: "580.159.04-1" for name in SIM_PACKAGES}
    facts = converged_dual().replace(installed=dpkg(newer, set(newer)))
    status = build_rig_status("rig1", dual_3090(), facts)
    assert drifts(status) == [
        ("driver", None, "driver_version: installed 580.159.04, inventory pins 580.95.05; "
                         "allowed: the installed driver, or move it on purpose with "
                         "deploys/driver.py"),
        ("driver", None, "reboot pending: driver 580.159.04 is installed but the loaded module "
                         "is 580.95.05"),
    ]
    assert "reboot pending" in table_text(status)


def test_gpu_count_and_class_as_declared():
    rig = Rig(platform="debian", gpu_class="rtx4090", gpu_count=2, driver_version="580.95.05",
              power_profile="stock", shm_size="2G",
              stale_files=("/etc/sysctl.d/99-vllm-swap.conf",))
    gpu = rtx3090(0, UUID0, limit=350.0)
    facts = converged_dual().replace(probe=GpuProbe(smi=SMI, gpus=(gpu,)))
    areas = [(area, gpu, reason) for area, gpu, reason in drifts(build_rig_status("r", rig, facts))
             if area == "gpu"]
    assert areas == [
        ("gpu", None, f"gpu_count: declared 2, nvidia-smi lists 1 (0 {UUID0}); allowed: the "
                      "number the rig has: fix gpu_count or the hardware"),
        ("gpu", UUID0, "gpu_class rtx4090 declared, card is NVIDIA GeForce RTX 3090"),
    ]


def test_host_tuning_drift():
    rig = dual_3090()
    facts = converged_dual().replace(
        sysctl_file=[line.replace("1048576", "524288") for line in sysctl_file(rig)],
        sysctl_live=live_sysctls(rig, read_only=False, fs__inotify__max_user_instances="128"),
        shm=parse_shm(["mount tmpfs rw,nosuid,nodev,size=65536k,inode64", "df 67108864 0",
                       "MemTotal:       24596720 kB"]),
        fstab=["tmpfs /dev/shm tmpfs defaults,size=1G 0 0"],
        stale_present={"/etc/sysctl.d/99-vllm-swap.conf": "file"},
    )
    assert drifts(build_rig_status("rig1", rig, facts)) == [
        ("tuning", None, "/etc/sysctl.d/90-rigbook.conf: fs.inotify.max_user_watches = 524288, "
                         "inventory 1048576"),
        ("tuning", None, "fs.inotify.max_user_instances is 128 live, inventory 1024"),
        ("tuning", None, "/etc/fstab: /dev/shm line is ['tmpfs /dev/shm tmpfs defaults,size=1G "
                         "0 0'], inventory: tmpfs /dev/shm tmpfs defaults,size=2G 0 0"),
        ("tuning", None, "/dev/shm is 0.1 GiB, inventory 2G (2.0 GiB)"),
        ("tuning", None, "leftover /etc/sysctl.d/99-vllm-swap.conf is present"),
    ]


def test_a_fact_that_could_not_be_read_is_not_as_declared():
    facts = converged_dual().replace(unread={"unit": "Command timed out after 120s"})
    status = build_rig_status("rig1", dual_3090(), facts)
    assert drifts(status) == [
        ("facts", None, "could not read power-limit unit: Command timed out after 120s")]
    assert status.power_unit is None and status.gpus[0].cap_unit_w is None


def test_low_disk_is_a_warning():
    facts = converged_dual().replace(disks=FreeDisk().process([
        "/ overlay 63000000000 60000000000 3000000000 96% /",
        "/opt/rigbook overlay 63000000000 60000000000 3000000000 96% /",
    ]))
    status = build_rig_status("rig1", dual_3090(), facts)
    assert status.state == "as-declared"
    assert [d.paths for d in status.disks] == [["/", "/opt/rigbook"]]
    assert ("disk", None, "/: 2.8 GiB free of 58.7 GiB") in drifts(status, "warn")


# --- GPU gone ------------------------------------------------------------------------------


def test_nvidia_smis_mismatch_is_a_driver_mismatch_with_its_own_state():
    """Issue 35: one finding, its own state and exit code, whatever says it (nvidia-smi's NVML
    error, the kernel's API mismatch) - on published outputs."""
    mismatch = NvidiaGpus().process(smi_output(
        SMI, real("smi-errors/version-mismatch-570.txt").splitlines(), rc=18))
    status = build_rig_status("rig1", dual_3090(), converged_dual().replace(probe=mismatch))
    assert status.state == "driver-mismatch" and status.exit_code == 4
    assert drifts(status, "mismatch") == [
        ("driver", None, "driver user-space 570.124, kernel module (not read): reboot to load "
                         "the 570.124 module (or reinstall the user-space packages of the loaded "
                         "module); nothing serves until then")]
    assert drifts(status, "gone") == []  # the one finding says it, not a second one
    assert status.gpus == [] and "DRIVER MISMATCH" in table_text(status)
    # the kernel's own word gives both versions: a captured journal of the same event
    log = real("klog/journal-host-aligned-mismatch-367.txt").splitlines()
    running = RunningDriverFact().process(["##RIGBOOK_KLOG##", *log])
    both = build_rig_status("rig1", dual_3090(), converged_dual().replace(
        probe=mismatch, running=running))
    assert drifts(both, "mismatch") == [
        ("driver", None, "driver user-space 367.44, kernel module 367.35: reboot to load the "
                         "367.44 module (or reinstall the 367.35 user-space packages); nothing "
                         "serves until then")]
    assert fleet_exit_code([status, both]) == 4


def test_every_gpu_deploys_preflight_refuses_a_mismatch_with_the_steps():
    """The GPU check (power, venvs, serving, sweep, verify all run it) refuses on it."""
    log = real("klog/syslog-hash012-mismatch-535-530.txt").splitlines()
    facts = converged_dual().replace(running=RunningDriverFact().process(
        ["##RIGBOOK_KLOG##", *log]), probe=NvidiaGpus().process(smi_output(
            SMI, real("smi-errors/version-mismatch-550.txt").splitlines(), rc=18)))
    refusing = [f for f in run_checks(dual_3090(), "rig1", [GPUS], facts)
                if f.level in REFUSING]
    assert refusal_text("rig1", refusing) == (
        "refused before any change, nothing was changed:\n  - rig1: driver user-space "
        "535.54.03, kernel module 530.30.02: reboot to load the 535.54.03 module (or reinstall "
        "the 530.30.02 user-space packages); nothing serves until then")


def test_a_logged_mismatch_of_another_client_or_a_reloaded_module():
    """nvidia-smi works and a client (nvidia-powerd) logged a mismatch: a warning naming it; the
    module named in the log no longer runs (reloaded since): nothing."""
    log = real("klog/journal-host-aligned-mismatch-nvidia-powerd-575.txt").splitlines()
    proc = real("proc-version/open-565-ubuntu-2404.txt").splitlines()
    running = RunningDriverFact().process(["##RIGBOOK_KLOG##", *log])
    assert running.mismatch.process == "nvidia-powerd" and running.module is None
    status = build_rig_status("rig1", dual_3090(), converged_dual().replace(running=running))
    assert status.state == "as-declared"
    assert [r for a, _, r in drifts(status, "warn") if a == "driver"] == [
        "nvidia-powerd (pid 849) has driver user-space 570.133.07 against kernel module "
        "575.51.02 (kernel log, Apr 19 12:34:42); nvidia-smi works: restart that client"]
    other = RunningDriverFact().process([*proc, "##RIGBOOK_KLOG##", *log])
    assert other.module.version == "565.57.01"
    assert mismatch_finding(None, other) is None


def test_the_module_that_runs_against_driver_open():
    """/proc/driver/nvidia/version as published: the open module where driver_open asks for
    the proprietary one is drift on that key; the flavour it asks for is nothing."""
    proc = real("proc-version/open-565-ubuntu-2404.txt").splitlines()
    running = RunningDriverFact().process([*proc, "##RIGBOOK_KLOG##"])
    status = build_rig_status("rig1", dual_3090(driver_open=False),
                              converged_dual().replace(running=running))
    assert ("driver", None, "the open kernel module 565.57.01 runs; driver_open: false asks for "
            "the proprietary one (/proc/driver/nvidia/version)") in drifts(status)
    same = build_rig_status("rig1", dual_3090(), converged_dual().replace(running=running))
    assert not [r for _, _, r in drifts(same) if "kernel module" in r]


def test_no_nvidia_smi_is_drift():
    status = build_rig_status("rig1", dual_3090(), converged_dual().replace(probe=None))
    assert ("gpu", None, "no nvidia-smi (no driver installed?)") in drifts(status)
    assert status.exit_code == 1


def test_xid_79_since_boot_names_the_gpu():
    klog = parse_kernel_log([
        "##RIGBOOK_KLOG## dmesg",
        "[ 8812.004000] NVRM: Xid (PCI:0000:02:00): 79, pid=4242, name=python3, GPU has fallen "
        "off the bus.",
        "[ 8812.009000] NVRM: Xid (PCI:0000:02:00): 154, GPU recovery action changed from 0x0 "
        "(None) to 0x2 (Node Reboot Required)",
    ])
    status = build_rig_status("rig1", dual_3090(), converged_dual().replace(klog=klog))
    assert status.state == "gpu-gone" and status.exit_code == 2
    assert drifts(status, "gone") == [
        ("faults", UUID1, "GPU 1: Xid 79 fallen off the bus since boot, last at 8812.004000; "
                          "NVIDIA's action: RESTART_BM"),
        ("faults", UUID1, "GPU 1: Xid 154 recovery: Node Reboot Required since boot, last at "
                          "8812.009000; NVIDIA's action: XID_154"),
    ]
    assert [(x.code, x.gpu_index, x.this_boot) for x in status.kernel_log.xids] == [
        (79, 1, True), (154, 1, True)]
    assert "Xid 79 fallen off the bus" in table_text(status)


def test_xid_of_a_card_nvidia_smi_no_longer_lists():
    klog = parse_kernel_log([
        "##RIGBOOK_KLOG## dmesg",
        "[ 77.000001] NVRM: Xid (PCI:0000:03:00): 79, pid=0, GPU has fallen off the bus.",
    ])
    status = build_rig_status("rig1", dual_3090(), converged_dual().replace(klog=klog))
    assert drifts(status, "gone") == [
        ("faults", None, "PCI 0000:03:00: Xid 79 fallen off the bus since boot, last at "
                         "77.000001; NVIDIA's action: RESTART_BM")]
    assert "no GPU listed: Xid 79" in table_text(status)


def test_earlier_boots_and_app_faults_are_not_gone():
    xid_31 = ("NVRM: Xid (PCI:0000:01:00): 31, pid=4242, name=python3, Ch 00000008, intr "
              "00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f1c_00000000. "
              "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ")
    journal = [
        "##RIGBOOK_KLOG## journalctl",
        f"Nov 29 10:11:12 rig1 kernel: {xid_31}",
        "##RIGBOOK_KLOG_BOOT## -1 43f6209bfc284a7d9ef1e1f24d7721c9 Fri 2026-11-27 07:59:00 UTC "
        "Sat 2026-11-28 22:00:00 UTC",
        "2026-11-27T08:00:01+0000 rig1 kernel: NVRM: Xid (PCI:0000:02:00): 79, pid=0, GPU has "
        "fallen off the bus.",
        "##RIGBOOK_KLOG_BOOT## 0 9e2ffa348b354fbc8555aa1f524214e5 Sun 2026-11-29 10:00:00 UTC "
        "Sun 2026-11-29 10:30:00 UTC",
        f"2026-11-29T10:11:12+0000 rig1 kernel: {xid_31}",
    ]
    status = build_rig_status("rig1", dual_3090(),
                              converged_dual().replace(klog=parse_kernel_log(journal)))
    assert status.state == "as-declared" and status.exit_code == 0
    assert [(x.code, x.gpu_index, x.this_boot) for x in status.kernel_log.xids] == [
        (31, 0, True), (79, 1, False)]
    assert ("faults", UUID0, "GPU 0: Xid 31 GPU memory page fault since boot, last at Nov 29 "
            "10:11:12") in (
        drifts(status, "warn"))
    text = table_text(status)
    assert "Xid 31 GPU memory page fault" in text and "1 in earlier boots" in text


def test_unreadable_kernel_log_is_a_warning():
    klog = parse_kernel_log(["##RIGBOOK_KLOG## none",
                             "dmesg: read kernel buffer failed: Operation not permitted"])
    status = build_rig_status("rig1", dual_3090(), converged_dual().replace(klog=klog))
    assert status.state == "as-declared"
    assert ("faults", None, "kernel log not readable (dmesg: read kernel buffer failed: "
            "Operation not permitted): GPU faults unknown") in drifts(status, "warn")


def test_unreachable_rig_and_fleet_exit_code():
    down = unreachable_status("rig2", dual_3090(), "Could not connect (Connection refused)")
    assert down.state == "unreachable" and down.exit_code == 2
    assert drifts(down, "gone") == [
        ("connection", None, "could not be reached: Could not connect (Connection refused)")]
    fine = build_rig_status("rig1", dual_3090(), converged_dual())
    assert fleet_exit_code([fine]) == 0
    assert fleet_exit_code([fine, down]) == 2
    text = table_text(fine, down)
    assert "UNREACHABLE" in text and "as declared" in text


# --- WSL2 ----------------------------------------------------------------------------------


def wsl_rig(**data) -> Rig:
    return Rig(platform="wsl2", gpu_class="rtx3090", gpu_count=1, **data)


def wsl_facts(rig: Rig, limit: float = 350.0, tdr: dict | None = None) -> Facts:
    gpu = replace(rtx3090(0, UUID0, limit=limit), driver_version="581.57")
    return Facts(
        probe=GpuProbe(smi="/usr/lib/wsl/lib/nvidia-smi", gpus=(gpu,)),
        installed=dpkg({"python3": "3.11.2-1+b1"}, set()),
        wsl=WslSignals("5.15.153.1-microsoft-standard-WSL2", interop=True, run_wsl=True),
        sysctl_file=sysctl_file(rig),
        sysctl_live=live_sysctls(rig, read_only=False),
        shm=parse_shm(["mount tmpfs rw,nosuid,nodev", "df 16777216000 0",
                       "MemTotal:       32768000 kB"]),
        fstab=[],
        registry=RegProbe(tdr if tdr is not None else {"TdrDelay": 60, "TdrDdiDelay": 60}),
        profiles=[WindowsProfile("/mnt/c/Users/rig", "[wsl2]\nmemory=32GB\n")],
        klog=parse_kernel_log(["##RIGBOOK_KLOG## dmesg"]),
    )


def test_wsl2_as_declared_caps_are_reported_not_drift():
    rig = wsl_rig()
    status = build_rig_status("rig3", rig, wsl_facts(rig))
    assert status.state == "as-declared", status.findings
    assert status.driver.declared == "Windows driver" and status.driver.running == "581.57"
    assert status.wsl.tdr == {"TdrDelay": 60, "TdrDdiDelay": 60}
    assert [f.reason for f in status.findings] == [
        f"GPU 0: live cap 350 W, inventory 290 W; set it on Windows (Administrator): "
        f"nvidia-smi -i {UUID0} -pl 290"]
    assert status.power_unit is None
    text = table_text(status)
    assert "290 / n/a / 350" in text and "TdrDelay 60" in text


def test_wsl2_tdr_drift_and_linux_driver_inside():
    rig = wsl_rig(power_profile="stock")
    facts = wsl_facts(rig, tdr={"TdrDelay": 2, "TdrDdiDelay": None}).replace(
        installed=dpkg({"nvidia-utils-580": "580.95.05-0ubuntu1"}, set()))
    assert drifts(build_rig_status("rig3", rig, facts)) == [
        ("driver", None, "Linux NVIDIA driver 580.95.05 installed in WSL2; it shadows the "
                         "Windows driver"),
        ("wsl", None, "TdrDelay is 2, inventory 60"),
        ("wsl", None, "TdrDdiDelay is None, inventory 60"),
    ]


def test_wsl2_low_memory_is_a_warning_and_platform_mismatch_is_drift():
    rig = wsl_rig(power_profile="stock")
    facts = wsl_facts(rig).replace(profiles=[WindowsProfile("/mnt/c/Users/rig",
                                                            "[wsl2]\nmemory=16GB\n")])
    status = build_rig_status("rig3", rig, facts)
    assert status.state == "as-declared"
    assert ("wsl", None, "C:\\Users\\rig\\.wslconfig: [wsl2] memory=16GB (16.0 GiB) is below "
            "wsl_min_memory_gib=24: model loading needs at least 24 GiB") in drifts(status, "warn")
    declared_debian = build_rig_status("rig1", dual_3090(), converged_dual().replace(
        wsl=WslSignals("6.1.0", interop=False, run_wsl=True)))
    assert [area for area, _, _ in drifts(declared_debian)] == ["platform"]


# --- venvs, models, serving, JSON ---------------------------------------------------------


VENV = {"engine": "none", "python": "3.11", "packages": ["six==1.16.0"]}
REV_A, REV_B = "a" * 40, "b" * 40
STAMP = "20261129T000000Z"


def write_build(root: Path, rig: Rig, name: str, driver: str | None, *, digest: str | None = None,
                cuda_runtime: str | None = None, finished: bool = True) -> str:
    """A build of venv `name` under root as files/venvs/build.sh.j2 leaves it: its folder, the
    manifest smoke.py writes (json, indent 1) from venvs.smoke_input, and the stable symlink."""
    spec = next(v for v in rig.venvs if v.name == name)
    digest = digest or spec_hash(spec, rig)
    build = build_name(name, digest, STAMP)
    folder = root / build
    folder.mkdir(parents=True)
    if finished:
        given = smoke_input(spec, rig, digest, build, LiveDriver(driver, "13.0", 2),
                            root=str(root))
        manifest = {
            "rigbook_manifest": 1, **{key: given[key] for key in (
                "name", "engine", "build", "spec_hash", "spec", "source", "driver", "cuda",
                "services")},
            "python": "3.11.2", "packages": {"six": "1.16.0"}, "cuda_runtime": cuda_runtime,
            "cuda_devices": None, "smoke_import": "six", "built_at": "2026-11-29T00:00:00Z",
        }
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (root / name).symlink_to(folder)
    return build


#: Where the captured venv builds lie (tests/facts/capture.py, layouts: write_build's builds).
CAPTURED_VENVS = Path("/tmp/rigbook-capture/venvs")


def read_venvs(rig: Rig, facts: Facts) -> Facts:
    """VenvBuilds of every venv of the rig, as a real host read write_build's builds
    (tests/facts/venvs.VenvBuilds; VENVS_DIR patched to where they lay there)."""
    for spec in rig.venvs:
        facts.store(f"venvs:{spec.name}", captured(f"venvs.VenvBuilds/{spec.name}"))
    return facts


def test_venvs_current_stale_incompatible_changed_missing(monkeypatch):
    root = CAPTURED_VENVS
    for module in (venvs_role, pins):
        monkeypatch.setattr(module, "VENVS_DIR", str(root))
    names = ["ok", "old", "cu132", "changed", "cut", "absent", "mine"]
    rig = dual_3090(venvs=[{"name": name, **VENV} for name in names])
    # Captured: ok, old (driver 580.76.05), cu132 (its CUDA 13.2 runtime), changed (another
    # digest), cut (no manifest), no absent, and mine: someone's own folder where the link goes.
    ok, cut = (build_name(name, spec_hash(rig.venvs[i], rig), STAMP)
               for i, name in ((0, "ok"), (4, "cut")))
    status = build_rig_status("rig1", rig, read_venvs(rig, converged_dual(rig)))
    assert [(v.name, v.state) for v in status.venvs] == [
        ("ok", "current"), ("old", "stale"), ("cu132", "incompatible"),
        ("changed", "spec-changed"), ("cut", "missing"), ("absent", "missing"),
        ("mine", "not-rigbook"),
    ]
    first = status.venvs[0]
    assert (first.build, first.built_driver, first.running_driver) == (ok, "580.95.05",
                                                                       "580.95.05")
    assert first.spec_hash == first.built_spec_hash == spec_hash(rig.venvs[0], rig)
    digest = spec_hash(rig.venvs[3], rig)
    assert [reason for area, _, reason in drifts(status) if area == "venvs"] == [
        "venv old: stale: built for driver 580.76.05, running 580.95.05: run deploys/venvs.py",
        "venvs[cu132]: cannot run: its CUDA 13.2 runtime needs driver >= 595.45.04, running "
        "580.95.05 (CUDA error 804): run deploys/venvs.py (and check the pins against the "
        "driver)",
        f"venv changed: spec changed (0123456789ab -> {digest}): deploys/rig.py rebuilds it",
        f"venv cut: {root}/cut -> {root}/{cut}, which is not a finished build: "
        "deploys/rig.py builds it",
        "venv absent: not built: deploys/rig.py builds it",
        f"venvs[mine]: {root}/mine exists and is not rigbook's symlink: move it away",
    ]
    assert status.state == "drift"
    text = table_text(status, width=400)
    for line in ("venv ok: current", "venv old: stale (built for driver 580.76.05, running "
                 "580.95.05)", "venv cu132: incompatible (error 804)",
                 "venv changed: spec changed", "venv absent: missing", "venv mine: not rigbook"):
        assert line in text, line
    # nvidia-smi gone: staleness cannot be judged, the GPU finding says why; the build is shown
    blind = build_rig_status("rig1", rig, read_venvs(rig, converged_dual(rig)).replace(
        probe=None))
    assert [v.state for v in blind.venvs][:2] == ["current", "current"]
    assert "venv old: built (driver 580.76.05; live unknown)" in table_text(blind, width=400)


def test_models_complete_partial_missing_and_unlisted(tmp_path):
    make_repo(tmp_path, "org/complete", REV_A, FILES_A)
    partial = make_repo(tmp_path, "org/partial", REV_B, FILES_A)
    (partial / "snapshots" / REV_B / "model.safetensors").unlink()  # an interrupted pull
    make_repo(tmp_path, "org/unlisted", REV_A, {"config.json": b"{}\n"})
    models = [{"repo": "org/complete", "revision": REV_A},
              {"repo": "org/partial", "revision": REV_B},
              {"repo": "org/missing", "revision": REV_A}]
    rig = dual_3090(models_cache=str(tmp_path), models=models)
    facts = converged_dual(rig)
    # the role's own script, run in-process on the cache the test built
    facts.store("cache", read_cache(tmp_path))
    status = build_rig_status("rig1", rig, facts)
    assert [(m.repo, m.state, m.files, m.missing_files) for m in status.models] == [
        ("org/complete", "complete", 3, None), ("org/partial", "partial", 3, 1),
        ("org/missing", "missing", 0, None),
    ]
    assert [reason for area, _, reason in drifts(status) if area == "models"] == [
        f"model org/partial@{REV_B[:12]} partial: missing model.safetensors; run "
        "deploys/models.py",
        f"model org/missing@{REV_A[:12]} missing: not in the cache {tmp_path}; run "
        "deploys/models.py",
    ]
    unlisted = [reason for area, _, reason in drifts(status, "warn") if area == "models"]
    assert unlisted == ["cached but not in models: 1 repo(s), 0.00 MiB: org/unlisted "
                        "(0.00 MiB); models_prune: true removes them"]
    assert status.models_cache.unlisted[0].repo == "org/unlisted"
    text = table_text(status, width=400)
    assert "model org/complete: complete" in text
    assert "model org/partial: partial (1 file(s) missing)" in text
    assert "model org/missing: missing" in text
    assert "+1 cached repo(s) not in models, 0.00 MiB" in text
    # with models_prune the converge removes them: not as declared until it has
    pruning = build_rig_status("rig1", dual_3090(models_cache=str(tmp_path), models=models[:1],
                                                 models_prune=True), facts)
    assert [(area, reason.split(";")[0]) for area, _, reason in drifts(pruning)] == [
        ("models", "cached but not in models: 2 repo(s), 0.00 MiB: org/partial (0.00 MiB), "
                   "org/unlisted (0.00 MiB)")]


def tiny_rig(tmp_path: Path, recipe: str = "tiny-cpu-a", **data) -> Rig:
    """A rig with the test catalogue's CPU recipe, its venv and its model (tests/recipes)."""
    return dual_3090(
        venvs=[{"name": "tiny-cpu", "engine": "llama-cpp-python", "python": "3.11",
                "packages": ["llama-cpp-python[server]==0.3.36"]}],
        models=[{"repo": "local/tiny", "revision": REV_A}], models_cache=str(tmp_path / "hub"),
        serving_recipe_dirs=[str(ROOT / "tests" / "recipes")], recipe=recipe, **data,
    )


def probe_output(active: str = "active", sub: str = "running", enabled: str = "enabled",
                 answer: dict | None = None, engines: tuple = ()) -> list[str]:
    """ServeProbe's output as files/serving/probe.py prints it (one JSON line, sorted keys)."""
    files = {path: "5" * 64 for path in (SERVE_UNIT_PATH, SERVE_ENV_PATH, HEALTH_PATH)}
    return [json.dumps({
        "MemAvailable": 20000000, "MemTotal": 24596720, "answer": answer, "apps": None,
        "engines": [list(e) for e in engines], "entry": True, "files": {**files, KEY_PATH: None},
        "rss_kib": 51200 if active == "active" else 0, "smi": None,
        "unit": {"ActiveState": active, "LoadState": "loaded", "SubState": sub,
                 "UnitFileState": enabled},
        "unit_pids": [812] if active == "active" else [], "user": True,
    }, sort_keys=True)]


def recipe_lines(rig: Rig) -> list[str]:
    """What FindInFile(^RIGBOOK_RECIPE=) reads of the engine.env serving.render_env writes."""
    env = render_env(serve_plan(rig, "rig1"), None).splitlines()
    return [line for line in env if line.startswith("RIGBOOK_RECIPE=")]


HEALTHY = {"ok": True, "model": "tiny", "seconds": 0.0}
REFUSED = {"ok": False, "stage": "models", "seconds": 0.0,
           "message": "/v1/models: <urlopen error [Errno 111] Connection refused>"}


def test_serving_recipe_unit_state_and_health(tmp_path, monkeypatch):
    # The tiny-cpu build as a real host read it (tests/facts/venvs.VenvBuilds/tiny-cpu).
    for module in (venvs_role, pins):
        monkeypatch.setattr(module, "VENVS_DIR", "/tmp/rigbook-capture/serve/venvs")
    rig = tiny_rig(tmp_path)
    make_repo(tmp_path / "hub", "local/tiny", REV_A, {"tiny.gguf": b"GGUF" * 64},
              patterns=(("tiny.gguf",), ()))  # a GGUF recipe's repo: its file only
    base = read_venvs(rig, converged_dual(rig))
    base.store("cache", read_cache(tmp_path / "hub"))

    def serving(probe: list[str], recipe_of: Rig = rig, **changes) -> RigStatus:
        facts = base.replace(serving=ServeProbe().process(probe),
                        serving_recipe=recipe_lines(recipe_of), **changes)
        return build_rig_status("rig1", rig, facts)

    def reasons(status: RigStatus) -> list[str]:
        return [reason for area, _, reason in drifts(status) if area == "serving"]

    healthy = serving(probe_output(answer=HEALTHY))
    assert healthy.state == "as-declared", healthy.findings
    assert healthy.serving.model_dump() == {
        "recipe": "tiny-cpu-a", "running_recipe": "tiny-cpu-a", "url": "http://127.0.0.1:8100",
        "unit": "active", "sub": "running", "enabled": "enabled", "healthy": True,
        "health": "serves tiny", "other_engines": [],
    }
    assert [(m.repo, m.state) for m in healthy.models] == [("local/tiny", "complete")]
    text = table_text(healthy, width=400)
    assert "venv tiny-cpu: current" in text and "recipe tiny-cpu-a: active, healthy" in text

    failed = serving(probe_output(active="failed", sub="failed"))
    assert reasons(failed) == [
        "rigbook-serve.service is failed (failed): recipe tiny-cpu-a is not served; "
        "journalctl -u rigbook-serve.service, then deploys/serve.py"]
    assert failed.serving.healthy is None
    assert "recipe tiny-cpu-a: failed (failed)" in table_text(failed, width=400)

    deaf = serving(probe_output(answer=REFUSED))
    assert reasons(deaf) == ["http://127.0.0.1:8100/v1/models does not answer: /v1/models: "
                             "<urlopen error [Errno 111] Connection refused>"]
    assert "recipe tiny-cpu-a: active, NOT answering" in table_text(deaf, width=400)

    other = serving(probe_output(answer=HEALTHY, enabled="disabled"),
                    recipe_of=tiny_rig(tmp_path, recipe="tiny-cpu-b"))
    assert reasons(other) == [
        "rigbook-serve.service is set up for recipe tiny-cpu-b, inventory tiny-cpu-a: run "
        "deploys/serve.py",
        "rigbook-serve.service is disabled, not enabled: it does not start at boot"]
    assert "recipe tiny-cpu-a (unit: tiny-cpu-b): active, healthy" in table_text(other,
                                                                                 width=400)

    engine = (4242, "/usr/bin/python3 -m vllm.entrypoints.openai.api_server --model x")
    two = serving(probe_output(answer=HEALTHY, engines=(engine,)))
    assert reasons(two) == ["another engine runs outside rigbook-serve.service: pid 4242 "
                            f"`{engine[1]}`"]
    assert two.serving.other_engines == [f"pid 4242 {engine[1]}"]

    # The serving role's probe on a real host where nothing is set up (no systemd there: the
    # supervisor's file is what is missing), and its engine.env absent.
    bare = base.replace(serving=captured("serving.ServeProbe/a-host-that-serves-nothing"),
                        serving_recipe=captured("serving.FindInFile/no-engine-env"))
    unset = build_rig_status("rig1", rig, bare)
    assert not bare.serving.systemd
    assert reasons(unset) == ["no /etc/rigbook/serving/supervise.json: recipe tiny-cpu-a is not "
                              "set up; run deploys/serve.py"]
    assert unset.serving.running_recipe is None and unset.serving.healthy is None


def test_a_recipe_that_cannot_be_planned_is_drift_and_not_probed(tmp_path):
    rig = tiny_rig(tmp_path, recipe="no-such-recipe")
    assert not {"serving", "serving_recipe"} & set(fact_plan(rig, "rig1"))
    status = build_rig_status("rig1", rig, converged_dual(rig))
    (reason,) = [reason for area, _, reason in drifts(status) if area == "serving"]
    assert reason.startswith("recipe: unknown recipe 'no-such-recipe'; allowed: ")
    test_catalogue = sorted(path.stem for path in (ROOT / "tests" / "recipes").glob("*.toml"))
    assert reason.endswith(", ".join(test_catalogue))  # the shipped ones, then the test catalogue
    assert status.serving.model_dump()["unit"] is None
    unfit = tiny_rig(tmp_path, recipe="dual-3090-tp2")  # a vllm recipe, a llama venv
    (reason,) = [r for area, _, r in drifts(build_rig_status("rig1", unfit, converged_dual(unfit)))
                 if area == "serving"]
    assert reason.startswith("recipe dual-3090-tp2 does not fit this rig: - venv 'vllm-0.33' is "
                             "not in the rig's venvs")


def test_gpu_lost_mark_and_an_unreachable_rigs_declared_items():
    mark = parse_gpu_lost(["GPU lost: do not restart serving",
                           "2026-11-29T10:11:12+0000 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 79, "
                           "pid=0, GPU has fallen off the bus."])
    lost = build_rig_status("rig1", dual_3090(), converged_dual().replace(gpu_lost=mark))
    assert lost.state == "gpu-gone" and lost.gpu_lost == gpu_lost_reason(mark)
    assert "GPU-lost mark set" in table_text(lost, width=400)
    rig = dual_3090(venvs=[{"name": "demo", **VENV}], models=[{"repo": "org/m",
                                                              "revision": REV_A}])
    down = unreachable_status("rig2", rig, "Could not connect")
    assert [(v.name, v.state) for v in down.venvs] == [("demo", "unknown")]
    assert [(m.repo, m.state) for m in down.models] == [("org/m", "unknown")]
    text = table_text(down, width=400)
    assert "venv demo: unknown" in text and "(not read)" in text

def test_json_round_trip_and_the_model_refuses_what_does_not_add_up():
    rigs = [build_rig_status("rig1", dual_3090(), converged_dual()),
            unreachable_status("rig2", dual_3090(), "Could not connect (timed out)")]
    fleet = FleetStatus(inventory="inventory/sandbox.py", rigs=rigs, exit_code=2)
    data = json.loads(fleet.model_dump_json())
    assert FleetStatus.model_validate(data) == fleet
    assert data["rigs"][1]["error"] == "Could not connect (timed out)"
    with pytest.raises(ValidationError, match="exit_code 0 does not follow"):
        FleetStatus.model_validate({**data, "exit_code": 0})
    with pytest.raises(ValidationError, match="state as-declared does not follow"):
        RigStatus.model_validate({**data["rigs"][1], "state": "as-declared"})
    with pytest.raises(ValidationError, match="extra"):
        FleetStatus.model_validate({**data, "surprise": 1})


# --- rigbook's own facts and parsers -------------------------------------------------------


def test_power_unit_fact_reads_what_power_writes():
    gpus = (rtx3090(0, UUID0), rtx3090(1, UUID1))
    unit = unit_fact(dual_3090(), gpus)
    assert unit.enabled == "enabled"
    assert unit_caps(unit.exec_starts) == ({UUID0: 290.0, UUID1: 290.0}, [])
    assert unit_caps(["ExecStart=/bin/true", f"ExecStart=-{SMI} -i {UUID0} -pl 350.5"]) == (
        {UUID0: 350.5}, ["ExecStart=/bin/true"])
    # the command, run here: this machine has no unit, so the fact's default (None) applies
    out = subprocess.run(["sh", "-c", PowerUnitFile().command()], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "" and PowerUnitFile.default() is None


def test_sysctl_conf_parser_reads_the_tuning_template():
    rig = dual_3090(sysctl_extra={"vm.max_map_count": 1048576})
    assert parse_sysctl_conf(sysctl_file(rig)) == {
        "fs.inotify.max_user_watches": "1048576",
        "fs.inotify.max_user_instances": "1024",
        "vm.max_map_count": "1048576",
    }


def run_fact(fact, **kwargs) -> list[str]:
    command = fact.command(**kwargs)
    text = command.get_raw_value() if hasattr(command, "get_raw_value") else command
    out = subprocess.run(["sh", "-c", text], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_free_disk_and_present_paths_run_here(tmp_path):
    disks = FreeDisk().process(run_fact(FreeDisk(), paths=("/", str(tmp_path / "absent"))))
    assert [d.path for d in disks] == ["/"]
    assert disks[0].mount == "/" and 0 < disks[0].avail_bytes <= disks[0].size_bytes
    (tmp_path / "left over.conf").write_text("vm.swappiness = 10\n")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    paths = (str(tmp_path / "left over.conf"), str(tmp_path / "dangling"), str(tmp_path / "no"))
    assert PresentPaths().process(run_fact(PresentPaths(), paths=paths)) == {
        paths[0]: "file", paths[1]: "link"}


def fake_tools(tmp_path: Path, journal_this_boot: list[str] | None,
               journal_earlier: list[str], dmesg: list[str] | None,
               boots: list[str] | None = None) -> dict:
    """Stand-in journalctl and dmesg in a PATH of their own: None = the tool is absent/fails.
    `boots` is what --list-boots prints (real lines, tests/fixtures/real/boots/); its boot 0
    gets this boot's lines, every other boot `journal_earlier`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if journal_this_boot is not None:
        script = bin_dir / "journalctl"
        this_boot = "\n".join(journal_this_boot)
        earlier = "\n".join(journal_earlier)
        first = journal_this_boot[0] if journal_this_boot else ""
        listing = "\n".join(boots or [])
        current = next((line.split()[1] for line in boots or [] if line.split()[0] == "0"), "-")
        script.write_text(
            "#!/bin/sh\n"
            'case " $* " in\n'
            f"  *' -b 0 -n 1 '*) printf '%s\\n' \"{first}\" | grep . ;;\n"
            f"  *' -b 0 '*|*' -b {current} '*) cat <<'EOF'\n{this_boot}\nEOF\n;;\n"
            f"  *' --list-boots '*) cat <<'EOF'\n{listing}\nEOF\n;;\n"
            f"  *' -b '*) cat <<'EOF'\n{earlier}\nEOF\n;;\n"
            "esac\n"
        )
        script.chmod(0o755)
    script = bin_dir / "dmesg"
    if dmesg is None:
        script.write_text("#!/bin/sh\necho 'dmesg: read kernel buffer failed: Operation not "
                          "permitted' >&2\nexit 1\n")
    else:
        script.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(dmesg) + "\nEOF\n")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}


def kernel_log_here(env: dict):
    out = subprocess.run(["sh", "-c", KernelXids().command()], capture_output=True, text=True,
                         env=env, check=True)
    return KernelXids().process(out.stdout.splitlines())


XID_79 = ("Nov 29 10:11:12 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=0, GPU has fallen "
          "off the bus.")
XID_13_OLD = ("Nov 27 08:00:01 rig1 kernel: NVRM: Xid (PCI:0000:01:00): 13, pid=2345, "
              "name=python3, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range "
              "Address")


def test_kernel_log_from_the_journal(tmp_path):
    boot = ["Nov 29 10:00:00 rig1 kernel: Linux version 6.1.0-27-amd64", XID_79, XID_79]
    before = ["Nov 27 07:59:00 rig1 kernel: Linux version 6.1.0-27-amd64", XID_13_OLD]
    boots = real("boots/list-boots-old-v246-unpadded.txt").splitlines()
    log = kernel_log_here(fake_tools(tmp_path, boot, before, dmesg=["[1.0] unused"],
                                     boots=boots))
    assert log.source == "journalctl" and log.error is None
    assert [x.code for x in log.this_boot] == [79, 79]
    # boots -2 and -1 each gave the earlier lines, boot 0 this boot's
    assert [(x.code, x.when) for x in log.earlier] == [(13, "Nov 27 08:00:01")] * 2
    assert [(b.boot.index, [x.code for x in b.xids]) for b in log.boots] == [
        (-2, [13]), (-1, [13]), (0, [79, 79])]


def test_a_boot_list_line_that_is_no_boot_never_reaches_journalctl(tmp_path):
    """Only a 32-hex-digit id is passed to `journalctl -b`: what else --list-boots could print
    (a header, a shell word, an option) is skipped by the probe and by the parser alike."""
    hostile = ["IDX BOOT ID FIRST ENTRY LAST ENTRY",
               f" -2 $(touch${{IFS}}{tmp_path}/pwned) Mon 2026-11-27 07:59:00 UTC",
               f" -3 43f6209bfc284a7d9ef1e1f24d7721c9;touch${{IFS}}{tmp_path}/pwned Mon",
               " -1 --since=yesterday Mon 2026-11-27 07:59:00 UTC",
               "  x 43f6209bfc284a7d9ef1e1f24d7721c9 Fri 2026-11-27 07:59:00 UTC",
               *real("boots/list-boots-old-v246-unpadded.txt").splitlines()[2:]]
    env = fake_tools(tmp_path, [XID_79], [XID_13_OLD], dmesg=None, boots=hostile)
    calls = tmp_path / "calls"
    script = tmp_path / "bin" / "journalctl"
    script.write_text(script.read_text().replace(
        "#!/bin/sh\n", f"#!/bin/sh\necho \"$*\" >> {calls}\n", 1))
    log = kernel_log_here(env)
    assert [(b.boot.index, b.boot.boot_id) for b in log.boots] == [
        (0, "bde6e48dd6084030856f26129514ee03")]
    read = [line for line in calls.read_text().splitlines() if " -b " in f" {line} "]
    assert [line.split(" -b ")[1].split()[0] for line in read] == [
        "0", "0", "bde6e48dd6084030856f26129514ee03"]
    assert not (tmp_path / "pwned").exists()


def test_kernel_log_reads_no_header_as_a_boot(tmp_path):
    boots = real("boots/list-boots-header-v253-five.txt").splitlines()
    log = kernel_log_here(fake_tools(tmp_path, [XID_79], [XID_13_OLD], dmesg=None, boots=boots))
    assert [b.boot.index for b in log.boots] == [-4, -3, -2, -1, 0]


# --- the Xid history across boots ------------------------------------------------------------


def history_log(*boots: tuple[str, list[str]]):
    """A KernelXids output whose boots are real --list-boots lines, each with real kernel lines
    (tests/fixtures/real/): the boots and the lines come from different published reports,
    the assembly is the test's."""
    return parse_kernel_log(["##RIGBOOK_KLOG## journalctl", *boots[-1][1], *(
        line for listed, lines in boots for line in (f"##RIGBOOK_KLOG_BOOT## {listed}", *lines))])


def test_a_card_falling_off_the_bus_on_two_boots_is_a_pattern():
    listed = real("boots/list-boots-old-v246-unpadded.txt").splitlines()
    fell = real("klog/journal-nohost-xid79-rtx5080.txt").splitlines()
    klog = history_log((listed[0], fell), (listed[1], []), (listed[2], fell))
    status = build_rig_status("rig1", dual_3090(), converged_dual().replace(klog=klog))
    history = [f for f in drifts(status, "warn") if "boots" in f[2]]
    assert history == [("faults", None,
        "PCI 0000:2b:00 (not listed now): Xid 79 on 2 boots (2020-10-12, 2020-10-12): a card "
        "that keeps falling off the bus: the field report the runbook cites treats Xid 79 + "
        "154 as an NVIDIA GSP firmware/driver bug with the card an RMA candidate, and names "
        "two mitigations: NVreg_DynamicPowerManagement=0x00 (not set in "
        "driver_modprobe_options) and persistence mode on (driver_persistence: true); a lower "
        "power cap lowers the odds and does not remove them (what it costs in tok/s is "
        "measured, what it buys in fault rate is not) (docs/sources.md#xid-79-and-154)")]
    assert "Xid 79 on 2 boots" in table_text(status)
    # the JSON keeps the card's history: its address, the codes and each boot's day
    assert [card.model_dump() for card in status.kernel_log.history] == [{
        "pci": "0000:2b:00", "gpu_index": None, "serial": None, "codes": [79],
        "dates": ["2020-10-12", "2020-10-12"]}]


def test_the_history_names_the_listed_gpu_and_a_reset_pattern_without_xid_79():
    listed = real("boots/list-boots-header-v253-five.txt").splitlines()
    halted = real("klog/dmesg-T-xid62-154-4x3090.txt").splitlines()  # Xid 62, then 154
    akash = real("klog/dmesg-T-xid43-31-94-535-akash.txt").splitlines()  # no fatal Xid
    gpu = replace(rtx3090(0, UUID0), bus_id="00000000:3E:00.0")
    klog = history_log((listed[1], halted), (listed[3], akash), (listed[5], halted))
    rig = dual_3090()
    facts = converged_dual(rig, gpus=(gpu, rtx3090(1, UUID1))).replace(klog=klog)
    findings = [f for f in fault_findings(rig, facts, "rig1") if "boots" in f.reason]
    assert [(f.level, f.gpu, f.reason) for f in findings] == [("warn", UUID0,
        "GPU 0 (PCI 0000:3e:00): Xid 62, Xid 154 on 2 boots (2023-04-26, 2023-04-26): a card "
        "that keeps needing a reset (NVIDIA's action: RESET_GPU, XID_154); no mitigation is "
        "documented for it (docs/sources.md#xid-79-and-154)")]


def test_one_boot_an_app_fault_or_a_boot_listed_twice_is_no_pattern():
    fell = real("klog/journal-nohost-xid79-rtx5080.txt").splitlines()
    app = real("klog/dmesg-xid31-proton-spaceengine.txt").splitlines()
    thrice = real("boots/list-boots-same-id-thrice-no-rtc-v215.txt").splitlines()
    listed = real("boots/list-boots-old-german-days-v230.txt").splitlines()
    for klog in (history_log((listed[0], fell), (listed[2], [])),       # one boot
                 history_log((listed[0], app), (listed[2], app)),       # Xid 31: the app's
                 history_log((thrice[0], fell), (thrice[1], fell))):    # one boot, listed twice
        assert history_findings(dual_3090(), klog, ()) == []
    mitigated = dual_3090(driver_modprobe_options={"NVreg_DynamicPowerManagement": "0x00"})
    twice = history_log((listed[0], fell), (listed[2], fell))
    assert "0x00 (set in driver_modprobe_options)" in history_findings(
        mitigated, twice, ())[0].reason


def test_kernel_log_falls_back_to_dmesg(tmp_path):
    dmesg = ["[    0.000000] Linux version 6.1.0-27-amd64",
             "[ 8812.004000] NVRM: Xid (PCI:0000:02:00): 79, pid=4242, name=python3, GPU has "
             "fallen off the bus."]
    # a journal with no kernel messages (a container's) counts as none
    log = kernel_log_here(fake_tools(tmp_path, [], [], dmesg=dmesg))
    assert log.source == "dmesg"
    assert [(x.code, x.pci, x.when) for x in log.this_boot] == [(79, "0000:02:00", "8812.004000")]
    assert log.earlier == ()


def test_kernel_log_unreadable(tmp_path):
    log = kernel_log_here(fake_tools(tmp_path, None, [], dmesg=None))
    assert log.source is None
    assert log.error == "dmesg: read kernel buffer failed: Operation not permitted"


# --- gathering -----------------------------------------------------------------------------


def fact_plan(rig: Rig, name: str = "rig") -> dict[str, tuple[type, dict]]:
    """What status reads from a rig: fact name -> (fact, its arguments)."""
    return {read.name: (read.fact, dict(read.kwargs))
            for read in reads_of(rig, name, checks_of())}


def test_fact_plan_follows_the_host_data():
    plain = fact_plan(Rig(platform="debian", gpu_class="rtx3090", gpu_count=1))
    assert "registry" not in plain and "stale_present" not in plain
    wsl = fact_plan(wsl_rig(wsl_tdr_disable=True))
    assert wsl["registry"][1]["names"] == ("TdrDelay", "TdrDdiDelay", "TdrLevel")
    assert "stale_present" in fact_plan(dual_3090())
    # venvs and the serving unit only where the rig declares them; the HF cache always (the
    # models role reports what it holds on every rig)
    assert not [name for name in plain if name.startswith(("venvs:", "serving"))]
    assert plain["cache"] == (ModelCache, {"cache": "/var/lib/rigbook/hf/hub"})
    venvs = fact_plan(dual_3090(venvs=[{"name": "a", **VENV}, {"name": "b", **VENV}]))
    assert venvs["venvs:a"] == (VenvBuilds, {"venv_name": "a"})
    assert venvs["venvs:b"] == (VenvBuilds, {"venv_name": "b"})
    models = fact_plan(dual_3090(models=[{"repo": "org/m", "revision": REV_A}]))
    assert models["cache"] == (ModelCache, {"cache": "/var/lib/rigbook/hf/hub"})
    rig = tiny_rig(Path("/srv"))
    serving = fact_plan(rig, "rig1")
    assert serving["serving"] == (ServeProbe, {"args": probe_args(serve_plan(rig, "rig1"))})
    assert serving["serving_recipe"] == (
        FindInFile, {"path": SERVE_ENV_PATH, "pattern": "^RIGBOOK_RECIPE="})
    assert "cache" in serving and "venvs:tiny-cpu" in serving


def test_limit_names_hosts_groups_and_globs():
    inventory = Inventory(
        ([("rig1", {}), ("rig2", {}), ("box", {})], {}),
        duals=(["rig1"], {}),
    )
    assert [h.name for h in limit_hosts(inventory, None)] == ["rig1", "rig2", "box"]
    assert [h.name for h in limit_hosts(inventory, ["duals", "b*"])] == ["rig1", "box"]
    with pytest.raises(RigbookError, match="--limit rig9: no such rig or group"):
        limit_hosts(inventory, ["rig9"])


LOCAL_INVENTORY = '''
rigs = [
    ("@local", {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 1}),
    ("closed", {"ssh_hostname": "127.0.0.1", "ssh_port": 1, "platform": "debian",
                "gpu_class": "rtx3090", "gpu_count": 1}),
]
'''


def test_gather_reaches_one_rig_and_reports_the_other_unreachable(tmp_path):
    """Through pyinfra's API: @local is read, a closed loopback port is one clear line."""
    inventory = tmp_path / "inv.py"
    inventory.write_text(LOCAL_INVENTORY)
    script = ("import sys; from rigbook.status_table import status; "
              f"sys.exit(status({str(inventory)!r}, None, True))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    fleet = FleetStatus.model_validate_json(done.stdout)
    local, closed = fleet.rigs
    assert local.name == "@local" and local.state != "unreachable"
    assert local.driver is not None and local.kernel_log is not None  # facts were read
    assert not [f for f in local.findings if f.area == "facts"], local.findings
    assert closed.state == "unreachable" and "port 1" in closed.error
    assert "closed: could not be reached: Could not connect" in done.stderr
    limited = subprocess.run(
        [sys.executable, "-c", script.replace("None", "['@local']")], cwd=ROOT,
        capture_output=True, text=True, timeout=120)
    assert [rig.name for rig in FleetStatus.model_validate_json(limited.stdout).rigs] == [
        "@local"]


def test_bad_inventory_is_refused_before_any_connection(tmp_path):
    with pytest.raises(RigbookError, match="no inventory file"):
        status(str(tmp_path / "missing.py"), None, True)
    inventory = tmp_path / "bad.py"
    inventory.write_text(LOCAL_INVENTORY.replace('"gpu_count": 1}),', '"gpu_count": 0}),', 1))
    with pytest.raises(RigbookError, match="@local: gpu_count"):
        status(str(inventory), None, True)
