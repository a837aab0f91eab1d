"""Drivers rigbook does not own (roles/driver_source.py), on real captures: the H200 host's
host-mounted driver (tests/fixtures/nvidia-h200/driver-source-fact.txt, its nvidia-smi and
/proc/driver/nvidia/version) and a published `apt policy` of a driver from Pop!_OS's own
archive (tests/fixtures/real/apt, SOURCES.md)."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
from pyinfra.api.exceptions import FactProcessError

from rigbook.core.checks import Facts
from rigbook.core.reboot import LoadedDriverVersion
from rigbook.core.spec import Rig
from rigbook.roles.driver import driver_findings, driver_pending, foreign_of
from rigbook.roles.driver_source import (
    DriverFile,
    DriverSource,
    DriverSourceFact,
    foreign_driver,
)
from rigbook.roles.kernel import parse_apt_policy
from tests.test_status import H200, ROOT, h200_probe

H200_FACT = (H200 / "driver-source-fact.txt").read_text().splitlines()
POPOS = ROOT / "tests/fixtures/real/apt/policy-nvidia-driver-470-popos-pins.txt"


def h200_rig(**data) -> Rig:
    return Rig(**{"platform": "ubuntu", "gpu_class": "other", "gpu_count": 1,
                  "gpu_limits_watts": (200, 700), "power_profile": "stock",
                  "driver_version": "580.159.04", **data})


def h200_facts(**changes) -> Facts:
    proc = (H200 / "proc-driver-version.txt").read_text().splitlines()
    values = dict(probe=h200_probe(), installed={}, holds=set(), reboot_marker=[],
                  loaded=LoadedDriverVersion().process(proc),
                  driver_source=DriverSourceFact().process(H200_FACT),
                  distro={"name": "Ubuntu", "major": 24, "release_meta": {"VERSION_ID": "24.04"}},
                  arch="x86_64", wsl=None)
    values.update(changes)
    return Facts(**values)


def test_the_h200_fact_reads_three_files_no_package_owns():
    source = DriverSourceFact().process(H200_FACT)
    assert source == DriverSource(files=(
        DriverFile("/usr/local/nvidia/bin/nvidia-smi", None),
        DriverFile("/usr/local/nvidia/lib64/libnvidia-ml.so.1", None),
        DriverFile("/lib/libnvidia-ml.so.1", None),
    ))
    assert source.to_json()["files"][0] == {"path": "/usr/local/nvidia/bin/nvidia-smi",
                                            "owner": None}


@pytest.mark.parametrize("line", [
    "file\trelative/path\t",
    "file\t/usr/bin/nvidia-smi\tpkg; rm -rf /",
    "file\t/usr/bin/nvidia-smi\t-pkg",
    "file\t/usr/bin/nvidia-smi\tpkg\textra",
    "uninstaller\t/usr/bin/nvidia-uninstall\n\n",
    "diversion by foo from: /usr/bin/nvidia-smi",
])
def test_the_fact_refuses_lines_it_does_not_know(line):
    with pytest.raises(FactProcessError):
        DriverSourceFact().process([line])


def test_the_fact_command_runs_here_and_parses():
    out = subprocess.run(["sh", "-c", DriverSourceFact().command()], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert isinstance(DriverSourceFact().process(out), DriverSource)


def test_h200_is_a_host_mount_refused_by_default_with_the_hand_over():
    rig, facts = h200_rig(), h200_facts()
    foreign = foreign_of(rig, facts)
    assert foreign.kind == "host mount"
    assert foreign.found.startswith("driver 580.159.04 whose files no package owns")
    findings = driver_findings(rig, facts, "h200")
    assert [(f.level, f.key) for f in findings] == [("error", "driver_foreign")]
    assert "change it there" in findings[0].reason and "driver_foreign: adopt" in findings[0].reason
    # not "no driver installed": the converge must not plan to install one
    assert not driver_pending(rig, facts)


def test_h200_adopted_is_checked_against_driver_version_and_branch():
    facts = h200_facts()
    assert driver_findings(h200_rig(driver_foreign="adopt"), facts, "h200") == []
    other = driver_findings(h200_rig(driver_foreign="adopt", driver_version="580.95.05"),
                            facts, "h200")
    assert [(f.key, f.reason.split(";")[0]) for f in other] == [
        ("driver_version", "adopted driver runs 580.159.04, inventory pins 580.95.05")]
    branch = driver_findings(
        Rig(platform="ubuntu", gpu_class="other", gpu_count=1, gpu_limits_watts=(200, 700),
            power_profile="stock", driver_branch=595, driver_foreign="adopt"), facts, "h200")
    assert [f.key for f in branch] == ["driver_branch"]
    off = h200_probe()
    off = dataclasses.replace(off, gpus=(dataclasses.replace(off.gpus[0], persistence=False),))
    assert [f.reason.split(" and ")[0] for f in driver_findings(
        h200_rig(driver_foreign="adopt"), h200_facts(probe=off), "h200")] == [
        "persistence mode is off on GPU 0"]
    gone = driver_findings(h200_rig(driver_foreign="adopt"),
                           h200_facts(probe=None, loaded=None), "h200")
    assert [f.key for f in gone] == ["driver_foreign"] and "not running" in gone[0].reason


def test_runfile_uninstaller_and_a_loaded_module_without_packages():
    rig = h200_rig()
    runfile = DriverSource((DriverFile("/usr/bin/nvidia-smi", None),), "/usr/bin/nvidia-uninstall")
    found = foreign_of(rig, h200_facts(driver_source=runfile))
    assert found.kind == "runfile" and "/usr/bin/nvidia-uninstall" in found.handover
    bare = foreign_of(rig, h200_facts(driver_source=DriverSource()))
    assert (bare.kind, bare.found) == (
        "unowned files", "driver 580.159.04 is loaded and no driver package is installed")


def test_packaged_driver_from_the_configured_source_is_rigbooks():
    rig = h200_rig()
    owned = DriverSource((DriverFile("/usr/bin/nvidia-smi", "nvidia-utils-580"),))
    assert foreign_of(rig, h200_facts(driver_source=owned, installed={
        "nvidia-utils-580": "580.159.04-0ubuntu0.24.04.1"})) is None
    # no driver at all: rigbook installs one
    assert foreign_of(rig, h200_facts(driver_source=DriverSource(), probe=None,
                                      loaded=None)) is None


def test_a_driver_from_another_apt_source_is_not_rigbooks():
    policies = parse_apt_policy(POPOS.read_text().splitlines())
    owned = DriverSource((DriverFile("/usr/bin/nvidia-smi", "nvidia-utils-470"),))
    rig = Rig(platform="ubuntu", gpu_class="rtx3090", gpu_count=1)
    facts = h200_facts(driver_source=owned, driver_policy=policies,
                       installed={"nvidia-utils-470": "470.199.02-1pop0"})
    found = foreign_driver(rig, facts, "https://example.invalid/", {"470.199.02"})
    assert found.kind == "another apt source"
    assert found.found == ("nvidia-driver-470 470.199.02 from "
                           "http://apt.pop-os.org/staging/linux-6.5.4, not the configured source")
    assert "apt-get purge nvidia-driver-470" in found.handover
