"""Sandbox rigs of other releases, end to end: Ubuntu 24.04 and 26.04 built from Ubuntu's own
archive, and Debian 13.

Each rig is added beside the session's rigs for its test only (`rigbook sandbox add PROFILE`,
removed at the end, so the default fleet is unchanged). One story per Ubuntu release:

1. on the fresh rig, with Ubuntu's real package indexes of its release (read when the rootfs
   was built), the packages and version glob rigbook plans for every branch the release carries
   resolve (`apt-get -s install`), the DKMS plan and the Secure Boot plan with Ubuntu's
   prebuilt signed modules instead of nvidia-dkms; every package of their closure that belongs
   to the driver is one the holds and the unattended-upgrades blacklist cover; every other
   nvidia-driver-B-open name (another branch, or a transitional one) is refused;
2. `deploys/rig.py` converges it: the driver from the rig's own sources (the local repository,
   Ubuntu's package names), held and blacklisted, the rig rebooted into it;
3. a newer driver in a second local repository: `apt-get upgrade` moves nothing; with the holds
   lifted it would move every driver package, and unattended-upgrades' dry run still moves none
   while the blacklist is in place, all of them once it is moved aside;
4. a second converge changes nothing.

Debian 13: the driver from a repository the rig data names (the local one) converges twice;
without one, the plan is refused before any change.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest
from pydantic import ValidationError

from rigbook import sandbox
from rigbook.core.spec import DRIVER_BRANCHES, Rig
from rigbook.roles.driver import (
    BLACKLIST,
    is_driver_package,
    kernel_module,
    main_package,
    plan_driver,
    upstream_version,
)
from rigbook.roles.kernel import SecureBoot, SignedModulesFact, modules_prefix, parse_apt_policy
from rigbook.roles.wsl import WslSignals
from tests.conftest import SANDBOX_INVENTORY, rig_ssh, rigbook, run_pyinfra

pytestmark = pytest.mark.sandbox

CONVERGE = "deploys/rig.py"
#: What the release carries, as read from Ubuntu's archive on 2026-12-03 (docs/driver.md):
#: the branches whose nvidia-driver-B-open and nvidia-utils-B both carry a B.x version.
#: rigbook plans those of DRIVER_BRANCHES; the others are refused by the host data's check.
CARRIED = {"noble": {535, 570, 580, 590, 595}, "resolute": {580, 595}}
NEWER = "580.190.01-0ubuntu0.{version_id}.1"
NEWER_REPO = "/srv/rigbook-newer"
NEWER_CONF = "/etc/apt/apt.conf.d/52rigbook-test-newer"
NOT_WSL = WslSignals("6.1.0-28-amd64", interop=False, run_wsl=False)


def added(profile: str):
    """Adds one rig of `profile`; yields its hosts.json entry; removes it (and all it left)."""
    before = {r["name"] for r in json.loads(rigbook("sandbox", "list", "--json").stdout)}
    name = f"rig{max((int(n[3:]) for n in before), default=0) + 1}"  # what `add` takes
    try:
        result = rigbook("sandbox", "add", profile, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        listing = {r["name"]: r for r in json.loads(rigbook("sandbox", "list", "--json").stdout)}
        yield listing[name]
    finally:
        rigbook("sandbox", "remove", name, check=False)  # also what a failed boot left


@pytest.fixture
def ubuntu_rig(sandbox, request):
    yield from added(request.param)


@pytest.fixture
def trixie_rig(sandbox):
    yield from added("trixie-4090")


def real_apt(tool: str, *args: str) -> str:
    """A command line reading only Ubuntu's real indexes on the rig, with its own dpkg status."""
    options = sandbox.ubuntu_apt_options(sandbox.UBUNTU_LISTS, sandbox.UBUNTU_SOURCES,
                                         "/var/lib/dpkg/status")
    return shlex.join(["env", "LC_ALL=C", tool, *options, *args])


def open_branches(rig: dict) -> list[int]:
    """Every B of an nvidia-driver-B-open name in the real indexes."""
    names = rig_ssh(rig, real_apt("apt-cache", "pkgnames", "nvidia-driver-")).stdout.split()
    return sorted(int(m.group(1)) for n in names
                  if (m := re.fullmatch(r"nvidia-driver-(\d+)-open", n)))


def carried(rig: dict) -> dict[int, str]:
    """Branch -> candidate of nvidia-driver-B-open, for the branches whose metapackage and
    nvidia-utils-B both carry a B.x version (530 on 24.04 is a transitional name to 535)."""
    found = {}
    for branch in open_branches(rig):
        policy = rig_ssh(rig, real_apt("apt-cache", "policy", f"nvidia-driver-{branch}-open",
                                       f"nvidia-utils-{branch}")).stdout
        candidates = re.findall(r"Candidate: (\S+)", policy)
        if len(candidates) == 2 and all(c.startswith(f"{branch}.") for c in candidates):
            found[branch] = candidates[0]
    return found


def resolves(rig: dict, plan) -> dict[str, str]:
    """`apt-get -s install` of a plan against the rig's real indexes: its closure."""
    wanted = [*(f"{package}={plan.version}" for package in plan.packages), *plan.unpinned]
    out = rig_ssh(rig, real_apt("apt-get", "-s", "install", *wanted), check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return installs(out.stdout)


def driver_parts(closure: dict[str, str], candidate: str) -> set[str]:
    """The packages of a closure that carry the driver's version or are NVIDIA's."""
    upstream = upstream_version(candidate)
    return {p for p, v in closure.items() if upstream in v or "nvidia" in p}


def installs(output: str) -> dict[str, str]:
    """`apt-get -s`'s Inst lines: package -> the version it would install."""
    return {line.split()[1]: line.split("(", 1)[1].split()[0]
            for line in output.splitlines() if line.startswith("Inst ")}


def os_release(rig: dict) -> dict:
    text = rig_ssh(rig, "cat /etc/os-release").stdout
    release = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', text, re.M))
    return {"name": release["NAME"], "major": int(release["VERSION_ID"].split(".")[0]),
            "release_meta": release}


def versions(rig: dict) -> dict[str, str]:
    out = rig_ssh(rig, "dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${Version}\\n' "
                       "'*nvidia*'", check=False).stdout
    return {line.split()[1]: line.split()[2] for line in out.splitlines()
            if line[1:3] == "i "}  # installed, held ("hi") or not


def holds(rig: dict) -> set[str]:
    return set(rig_ssh(rig, "apt-mark showhold").stdout.split())


def push_newer_repo(rig: dict, release: sandbox.Release, tmp_path) -> None:
    """A second local repository with a newer driver, with a Release file whose origin
    unattended-upgrades is told to allow (NEWER_CONF)."""
    repo = sandbox.build_sim_repo(tmp_path / "newer", release, [NEWER])
    tar = subprocess.run(["tar", "-C", repo, "-c", "."], capture_output=True, check=True).stdout
    subprocess.run(
        ["ssh", "-i", rig["ssh_key"], "-o", "StrictHostKeyChecking=no", "-o",
         "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", f"root@{rig['address']}",
         f"mkdir -p {NEWER_REPO} && tar -C {NEWER_REPO} -x"], input=tar, check=True)
    rig_ssh(rig, " && ".join((
        f"cd {NEWER_REPO}",
        "apt-ftparchive -o APT::FTPArchive::Release::Origin=rigbook-newer release . > Release",
        f"echo 'deb [trusted=yes] file:{NEWER_REPO} ./' > /etc/apt/sources.list.d/newer.list",
        f"echo 'Unattended-Upgrade::Origins-Pattern:: \"origin=rigbook-newer\";' > {NEWER_CONF}",
        "apt-get -qq update",
    )))


def drop_newer_repo(rig: dict) -> None:
    rig_ssh(rig, f"rm -rf {NEWER_REPO} /etc/apt/sources.list.d/newer.list {NEWER_CONF}; "
                 "apt-get -qq update", check=False)


def unattended_dry_run(rig: dict) -> str:
    run = rig_ssh(rig, "unattended-upgrade --dry-run --debug 2>&1", check=False)
    return run.stdout


def would_upgrade(log: str) -> set[str]:
    """Packages unattended-upgrades' dry run says it would upgrade."""
    found = re.findall(r"^Packages that will be upgraded: (.*)$", log, re.M)
    return set(" ".join(found).split())


@pytest.mark.parametrize("ubuntu_rig", ["noble-3090", "resolute-4090"], indirect=True)
def test_an_ubuntu_rig_resolves_the_real_archive_converges_and_holds(ubuntu_rig, tmp_path):
    rig, name = ubuntu_rig, ubuntu_rig["name"]
    release = sandbox.release_of(rig["profile"])
    distro = os_release(rig)
    assert (distro["name"], distro["release_meta"]["VERSION_ID"]) == ("Ubuntu", release.version)
    # Ubuntu's own unattended-upgrades configuration, as the package ships it
    shipped = rig_ssh(rig, "cat /etc/apt/apt.conf.d/50unattended-upgrades").stdout
    assert '"${distro_id}:${distro_codename}-security";' in shipped

    # 1. Ubuntu's real indexes: every branch the release carries resolves as planned
    branches = carried(rig)
    assert set(branches) == CARRIED[release.suite], branches
    for branch in set(open_branches(rig)) - set(DRIVER_BRANCHES):  # transitional names too
        with pytest.raises(ValidationError, match=f"unknown driver branch {branch}"):
            Rig(platform="ubuntu", gpu_class="rtx3090", gpu_count=1, driver_branch=branch)
    for branch in DRIVER_BRANCHES:
        candidate = branches[branch]
        data = Rig(platform="ubuntu", gpu_class="rtx3090", gpu_count=1, driver_branch=branch)
        dkms = f"nvidia-dkms-{branch}-open"
        plan = plan_driver(data, name, distro, NOT_WSL, "x86_64")
        closure = resolves(rig, plan)
        assert all(closure[package] == candidate for package in plan.packages), closure
        parts = driver_parts(closure, candidate)
        assert {dkms, f"libnvidia-compute-{branch}"} <= parts, closure
        # Secure Boot on, a generic kernel: the prebuilt signed modules instead of DKMS
        prefix = modules_prefix(branch, False, True)
        meta = f"{prefix}generic"
        shown = rig_ssh(rig, real_apt("apt-cache", "show", "--no-all-versions", meta)).stdout
        kernel = re.search(rf"{prefix}(\d+\.\d+\.\d+-\d+-generic)", shown)[1]
        modules = SignedModulesFact().process([f"##running {kernel}", f"##show {meta}",
                                               *shown.splitlines()])
        policy = rig_ssh(rig, real_apt("apt-cache", "policy", main_package(data))).stdout
        module = kernel_module(data, SecureBoot(enabled=True, mokutil=True), modules,
                               parse_apt_policy(policy.splitlines()), {})
        assert module.signed == meta, module.says
        signed = plan_driver(data, name, distro, NOT_WSL, "x86_64", module)
        closure = resolves(rig, signed)
        assert closure[meta] == modules.version and closure[f"{prefix}{kernel}"]
        assert all(closure[package] == candidate for package in signed.packages), closure
        assert dkms not in closure and "dkms" not in closure, closure
        assert [p for p in driver_parts(closure, candidate) if not is_driver_package(p)] == []

    # 2. the converge: the driver from the rig's own sources, held, running
    first = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", name)
    assert first.returncode == 0, first.explain()
    # the plan says where the module comes from: no Secure Boot here, so DKMS
    said = [op["name"] for op in first.results["operations"]]
    assert any("kernel module: DKMS (nvidia-dkms-580-open)" in op for op in said), said
    version = f"580.178.04-0ubuntu0.{release.version}.1"
    installed = versions(rig)
    assert installed == {p: version for p in (
        "nvidia-driver-580-open", "nvidia-utils-580", "libnvidia-compute-580",
        "nvidia-dkms-580-open", "nvidia-compute-utils-580")}, installed
    assert holds(rig) >= set(installed)
    smi = rig_ssh(rig, "nvidia-smi --query-gpu=driver_version --format=csv,noheader").stdout
    assert smi.strip() == "580.178.04"
    shipped_unit = rig_ssh(rig, "cat /lib/systemd/system/nvidia-persistenced.service").stdout
    assert "--no-persistence-mode" in shipped_unit  # Ubuntu's default, overridden by the role

    # 3. a newer driver offered: the holds and the blacklist keep it out
    push_newer_repo(rig, release, tmp_path)
    try:
        newer = NEWER.format(version_id=release.version)
        held = rig_ssh(rig, "apt-get -s upgrade").stdout
        assert not [p for p in installs(held) if is_driver_package(p)], held
        held_now = holds(rig)
        rig_ssh(rig, "apt-mark unhold " + " ".join(installed))  # apt 3 ignores Ignore-Hold
        unheld = installs(rig_ssh(rig, "apt-get -s upgrade").stdout)
        assert {p for p, v in unheld.items() if v == newer} == set(installed), unheld
        assert set(unheld) <= held_now
        blacklisted = unattended_dry_run(rig)
        assert not would_upgrade(blacklisted) & set(installed), blacklisted
        rig_ssh(rig, f"mv {BLACKLIST} /root/blacklist")
        unlisted = unattended_dry_run(rig)
        rig_ssh(rig, f"mv /root/blacklist {BLACKLIST}")
        assert would_upgrade(unlisted) >= set(installed), unlisted
    finally:
        rig_ssh(rig, "apt-mark hold " + " ".join(installed), check=False)
        drop_newer_repo(rig)

    # 4. nothing left to do
    second = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", name)
    assert second.returncode == 0, second.explain()
    assert second.changed() == {}, second.explain()


def test_a_debian_13_rig_converges_from_the_repository_it_names(trixie_rig):
    rig, name = trixie_rig, trixie_rig["name"]
    assert os_release(rig)["release_meta"]["VERSION_ID"] == "13"
    # NVIDIA's repository in rigbook is Debian 12's: without a source of its own, refused
    # before any change, with the step to take
    bare = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", name,
                       "--data", "driver_repo_uri=null", "--data", "driver_repo_trusted=false")
    said = bare.stdout + bare.stderr
    assert bare.returncode != 0 and "set driver_repo_uri" in said, bare.explain()
    assert bare.changed() == {} and versions(rig) == {}
    first = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", name)
    assert first.returncode == 0, first.explain()
    assert versions(rig)["nvidia-open"] == "580.95.05-1"
    second = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", name)
    assert second.returncode == 0, second.explain()
    assert second.changed() == {}, second.explain()
