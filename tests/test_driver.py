"""rigbook.roles.driver and rigbook.core.apt: package selection, holds, blacklist, pin, persistence,
reboot.

Parsers are fed real captured output (the H200 host's apt-mark showhold, dpkg-query and
/proc/driver/nvidia/version, this Debian machine's os-release, apt's own madison output).
Operations run with facts the test gives and the commands they yield are checked; the apt pin,
the deb822 source and the version globs are checked against a real apt on a throwaway root.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from pyinfra.api import Config, FunctionCommand, Inventory, State
from pyinfra.api.exceptions import FactProcessError
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.server import LinuxDistribution

from rigbook.core import reboot
from rigbook.core.apt import (
    AptHolds,
    AptVersions,
    DpkgInstalled,
    DpkgInterrupted,
    DpkgWork,
    apt_hold,
    finish_interrupted,
    parse_dpkg_audit,
    upstream_version,
)
from rigbook.core.checks import Facts
from rigbook.core.errors import RigbookError
from rigbook.core.render import render as render_template
from rigbook.core.spec import DRIVER_BRANCHES, Rig
from rigbook.rigside.gpus import GpuProbe, parse_query_csv
from rigbook.roles import driver as drv
from rigbook.roles import kernel as kern
from rigbook.roles.kernel import parse_apt_policy
from rigbook.roles.wsl import WslSignals
from tests.opkit import Calls, FakeHost, describe, file_states, shell
from tests.test_real_fixtures import REAL, readings

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-h200"
TEMPLATES = drv.TEMPLATES

#: `dpkg --print-architecture; dpkg-query -W -f='${db:Status-Abbrev}\t${Package}\t...'` on the
#: H200 host (Ubuntu 24.04), an excerpt of its 439 package lines: held (hi) CUDA libraries, an
#: arch-all package, an epoch, and cuda-compat, whose version looks like a driver's.
H200_DPKG = """amd64
ii \tadduser\tall\t3.137ubuntu1
ii \tapt\tamd64\t2.8.3
ii \tautomake\tall\t1:1.16.5-1.3ubuntu1
ii \tcuda-compat-13-0\tamd64\t580.95.05-0ubuntu1
ii \tlibc6\tamd64\t2.39-0ubuntu8.9
hi \tlibcublas-13-0\tamd64\t13.1.0.3-1
hi \tlibcudnn9-cuda-13\tamd64\t9.14.0.64-1
hi \tlibnccl-dev\tamd64\t2.28.3-1+cuda13.0
hi \tlibnccl2\tamd64\t2.28.3-1+cuda13.0""".splitlines()

#: The sandbox's dual-3090 rig after the first converge (package names of NVIDIA's Debian repo).
SIM_INSTALLED = {
    "libnvidia-ml1": "580.95.05-1",
    "nvidia-kernel-open-dkms": "580.95.05-1",
    "nvidia-open": "580.95.05-1",
    "nvidia-persistenced": "580.95.05-1",
    "nvidia-smi": "580.95.05-1",
    "python3": "3.11.2-1+b1",
}

#: An Ubuntu 24.04 rig with the open 580 driver (names from docs/sources.md, "Driver branches and
#: repositories").
UBUNTU_INSTALLED = {
    "libnvidia-compute-580": "580.95.05-0ubuntu0.24.04.1",
    "nvidia-driver-580-open": "580.95.05-0ubuntu0.24.04.1",
    "nvidia-dkms-580-open": "580.95.05-0ubuntu0.24.04.1",
    "nvidia-firmware-580-580.95.05": "580.95.05-0ubuntu0.24.04.1",
    "nvidia-utils-580": "580.95.05-0ubuntu0.24.04.1",
    "nvidia-settings": "510.47.03-0ubuntu4",
    "libnccl2": "2.28.3-1+cuda13.0",
}

#: `apt-cache madison nvidia-open nvidia-smi` against the sandbox's repository layout.
MADISON = [
    "nvidia-open | 580.159.04-1 | file:/srv/rigbook-sim-repo  Packages",
    "nvidia-open | 580.95.05-1 | file:/srv/rigbook-sim-repo  Packages",
    "nvidia-smi | 580.159.04-1 | file:/srv/rigbook-sim-repo  Packages",
    "nvidia-smi | 580.95.05-1 | file:/srv/rigbook-sim-repo  Packages",
]

MISMATCH = (
    "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.159"
)


# --- operations run with given facts (the fake host of tests/test_tuning.py) ----------------


def run_op(op, facts: dict, executing: bool = False, **kwargs):
    """An operation's commands and the fake host it ran on (executing: as pyinfra runs it)."""
    fake = FakeHost(facts)
    state = State(Inventory((["rig1"], {})), Config())
    state.is_executing = executing
    with ctx_state.use(state), ctx_host.use(fake):
        commands = list(op._inner(**kwargs))
    return commands, fake


def refusals(commands, fake: FakeHost) -> list[str]:
    """Run the FunctionCommands as pyinfra would; the messages of those that failed the host."""
    for command in commands:
        if isinstance(command, FunctionCommand):
            assert command.function(None, fake, *command.args, **command.kwargs) is False
    return fake.logged


def rig(**data) -> Rig:
    base = {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2}
    return Rig(**{**base, **data})


def os_release(text: str) -> dict:
    """pyinfra's LinuxDistribution fact on an os-release file's text."""
    return LinuxDistribution().process(["/etc/os-release", *text.splitlines(), "---"])


def h200_os_release() -> str:
    lines = (FIXTURES / "host.txt").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("PRETTY_NAME="))
    end = next(i for i, line in enumerate(lines[start:], start) if line.startswith("LOGO="))
    return "\n".join(lines[start : end + 1])


#: Real /etc/os-release of a Debian 12 machine (the one these tests were written on).
DEBIAN_12 = """PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"
NAME="Debian GNU/Linux"
VERSION_ID="12"
VERSION="12 (bookworm)"
VERSION_CODENAME=bookworm
ID=debian
HOME_URL="https://www.debian.org/"
SUPPORT_URL="https://www.debian.org/support"
BUG_REPORT_URL="https://bugs.debian.org/"
"""

NOT_WSL = WslSignals("6.1.0-28-amd64", interop=False, run_wsl=False)
IN_WSL = WslSignals("5.15.153.1-microsoft-standard-WSL2", interop=True, run_wsl=True)


def ubuntu(version_id: str = "24.04") -> dict:
    return os_release(h200_os_release().replace('VERSION_ID="24.04"', f'VERSION_ID="{version_id}"'))


# --- parsers on real output -----------------------------------------------------------------


def test_apt_holds_parses_the_real_showhold():
    lines = (FIXTURES / "apt-mark-showhold.txt").read_text().splitlines()
    assert AptHolds().process(lines) == {
        "libcublas-13-0", "libcublas-dev-13-0", "libcudnn9-cuda-13", "libnccl-dev", "libnccl2",
    }
    assert AptHolds().process([]) == set() == AptHolds.default()


def test_dpkg_installed_parses_the_real_output():
    installed = DpkgInstalled().process(H200_DPKG)
    assert installed["libnccl2"] == "2.28.3-1+cuda13.0"  # held (hi) is installed
    assert installed["adduser"] == "3.137ubuntu1"  # Architecture: all keeps the plain name
    assert installed["automake"] == "1:1.16.5-1.3ubuntu1"
    assert len(installed) == 9


def test_dpkg_installed_counts_only_installed_and_names_foreign_arches():
    # Constructed rows for the states the capture lacks: removed with config left (rc),
    # unpacked but not configured (iU), and a foreign-architecture copy.
    lines = [
        "amd64",
        "rc \tnvidia-kernel-open-dkms\tamd64\t580.95.05-1",
        "iU \tnvidia-smi\tamd64\t580.159.04-1",
        "ii \tlibnvidia-compute-580\ti386\t580.95.05-0ubuntu0.24.04.1",
        "ii \tlibnvidia-compute-580\tamd64\t580.95.05-0ubuntu0.24.04.1",
    ]
    assert DpkgInstalled().process(lines) == {
        "libnvidia-compute-580": "580.95.05-0ubuntu0.24.04.1",
        "libnvidia-compute-580:i386": "580.95.05-0ubuntu0.24.04.1",
    }
    with pytest.raises(Exception, match="not a dpkg-query status line"):
        DpkgInstalled().process(["amd64", "ii  apt 2.6.1"])


def test_dpkg_installed_command_runs_here():
    if shutil.which("dpkg-query") is None:
        pytest.skip("no dpkg here")
    out = subprocess.run(["sh", "-c", DpkgInstalled().command()], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    installed = DpkgInstalled().process(out)
    assert re.match(r"^\d", installed["dpkg"])


@pytest.mark.parametrize(("version", "upstream"), [
    ("580.95.05-0ubuntu0.24.04.1", "580.95.05"),
    ("580.95.05-1", "580.95.05"),
    ("580.159.04-1", "580.159.04"),
    ("1:1.16.5-1.3ubuntu1", "1.16.5"),
    ("595.84", "595.84"),
])
def test_upstream_version(version, upstream):
    assert upstream_version(version) == upstream


def test_apt_versions_parses_madison():
    assert AptVersions().process(MADISON) == {
        "nvidia-open": ["580.159.04-1", "580.95.05-1"],
        "nvidia-smi": ["580.159.04-1", "580.95.05-1"],
    }
    assert AptVersions().command(["nvidia-open"]).get_raw_value() == "apt-cache madison nvidia-open"
    with pytest.raises(Exception, match="madison"):
        AptVersions().process(["N: Unable to locate package x"])


def test_loaded_driver_version_real_module_and_simulation_hook():
    proc = (FIXTURES / "proc-driver-version.txt").read_text().splitlines()
    assert reboot.LoadedDriverVersion().process(proc) == "580.159.04"
    tag = reboot._SIM_TAG
    assert reboot.LoadedDriverVersion().process([f"{tag} 580.95.05"]) == "580.95.05"
    assert reboot.LoadedDriverVersion().process([f"{tag} "]) is None
    with pytest.raises(Exception, match="not a version"):
        reboot.LoadedDriverVersion().process([f"{tag} garbage"])
    # The real file always wins: the simulation file is read only when it is absent.
    command = reboot.LoadedDriverVersion().command()
    assert command.index(reboot.PROC_VERSION) < command.index(reboot.SIM_LOADED_VERSION)


def test_loaded_driver_version_command_on_a_machine_without_a_module():
    if os.path.exists(reboot.PROC_VERSION) or os.path.exists(reboot.SIM_LOADED_VERSION):
        pytest.skip("this machine has a (simulated) nvidia module")
    out = subprocess.run(["sh", "-c", reboot.LoadedDriverVersion().command()],
                         capture_output=True, text=True, check=True)
    assert out.stdout == ""  # pyinfra returns the default, None: no module loaded


# --- package selection per platform ---------------------------------------------------------


def test_ubuntu_packages_per_branch_flavour_and_server():
    distro = ubuntu()
    plan = drv.plan_driver(rig(platform="ubuntu", driver_version="580.95.05"), "rig1", distro,
                           NOT_WSL, "x86_64")
    assert plan.packages == ("nvidia-driver-580-open", "nvidia-utils-580", "nvidia-dkms-580-open")
    assert plan.version == "580.95.05-*"  # matches 580.95.05-0ubuntu0.24.04.1
    assert plan.source is None  # the distribution's own archive
    server = drv.plan_driver(rig(platform="ubuntu", driver_server=True), "rig1", distro,
                             NOT_WSL, "x86_64")
    assert server.packages == ("nvidia-driver-580-server-open", "nvidia-utils-580-server",
                               "nvidia-dkms-580-server-open")
    assert server.version == "580.*"
    closed = drv.plan_driver(rig(platform="ubuntu", driver_open=False, driver_branch=595),
                             "rig1", distro, NOT_WSL, "x86_64")
    assert closed.packages == ("nvidia-driver-595", "nvidia-utils-595", "nvidia-dkms-595")


def test_debian_packages_and_sources():
    distro = os_release(DEBIAN_12)
    sim = rig(driver_version="580.95.05", driver_repo_uri="file:/srv/rigbook-sim-repo",
              driver_repo_trusted=True)
    plan = drv.plan_driver(sim, "rig1", distro, NOT_WSL, "x86_64")
    assert plan.packages == ("nvidia-open", "nvidia-persistenced")
    assert plan.version == "580.95.05-*"
    assert plan.source == drv.AptSource("file:/srv/rigbook-sim-repo", trusted=True)
    nvidia = drv.plan_driver(rig(driver_open=False), "rig1", distro, NOT_WSL, "x86_64")
    assert nvidia.packages[0] == "cuda-drivers"
    assert nvidia.source == drv.AptSource(drv.CUDA_REPO, trusted=False)


def test_wsl2_gets_no_packages():
    plan = drv.plan_driver(rig(platform="wsl2"), "rig3", os_release(DEBIAN_12), IN_WSL, "x86_64")
    assert plan == drv.DriverPlan(platform="wsl2")


@pytest.mark.parametrize(("data", "distro", "wsl", "arch", "message"), [
    ({"platform": "ubuntu"}, "debian", NOT_WSL, "x86_64",
     "declared ubuntu, but the host reports Debian 12"),
    ({}, "ubuntu", NOT_WSL, "x86_64", "declared debian, but the host reports Ubuntu 24.04"),
    ({}, "debian", IN_WSL, "x86_64", "declared debian but this host is WSL2"),
    ({"platform": "wsl2"}, "debian", NOT_WSL, "x86_64", "declared wsl2 but this host is not WSL2"),
    ({}, "debian", NOT_WSL, "aarch64", "Debian 12 x86_64 only"),
])
def test_platform_mismatches_are_errors_naming_both(data, distro, wsl, arch, message):
    distros = {"debian": os_release(DEBIAN_12), "ubuntu": ubuntu()}
    with pytest.raises(RigbookError) as error:
        drv.plan_driver(rig(**data), "rig7", distros[distro], wsl, arch)
    assert str(error.value).startswith("rig7: ")
    assert message in str(error.value)


def test_spec_refuses_unknown_branches_and_bad_module_options():
    with pytest.raises(ValidationError, match="unknown driver branch 590"):
        rig(driver_branch=590)
    with pytest.raises(ValidationError, match="no spaces"):
        rig(driver_modprobe_options={"NVreg_X": "1 2"})
    with pytest.raises(ValidationError, match="module parameter names are letters, digits and _"):
        rig(driver_modprobe_options={"NVreg-X": "1"})


# --- which packages are the driver, which version is installed ------------------------------


def test_driver_packages_follow_unattended_upgrades_re_match():
    assert drv.driver_packages(UBUNTU_INSTALLED) == [
        "libnvidia-compute-580", "nvidia-dkms-580-open", "nvidia-driver-580-open",
        "nvidia-firmware-580-580.95.05", "nvidia-settings", "nvidia-utils-580",
    ]
    assert drv.driver_packages(SIM_INSTALLED) == sorted(set(SIM_INSTALLED) - {"python3"})
    # The H200 host's CUDA libraries (and cuda-compat, whose version looks like a driver's)
    # are not the driver.
    assert drv.driver_packages(DpkgInstalled().process(H200_DPKG)) == []
    assert not drv.is_driver_package("xnvidia-foo")  # anchored at the start


def test_driver_versions_and_refusal():
    assert drv.driver_versions(UBUNTU_INSTALLED) == {"580.95.05"}  # not nvidia-settings' 510
    assert drv.driver_versions(SIM_INSTALLED) == {"580.95.05"}
    assert drv.driver_versions(DpkgInstalled().process(H200_DPKG)) == set()
    pinned = rig(driver_version="580.95.05")
    assert drv.refusal(pinned, {"580.95.05"}) is None
    assert drv.refusal(pinned, set()) is None  # nothing installed yet: install it
    assert drv.refusal(rig(), {"580.159.04"}) is None  # branch only: any 580 is fine
    assert drv.refusal(pinned, {"580.159.04"}) == (
        "installed 580.159.04, inventory pins 580.95.05; allowed: the installed driver, or move "
        "it on purpose with deploys/driver.py"
    )
    assert drv.refusal(rig(driver_branch=595), {"580.95.05"}) == (
        "installed 580.95.05, inventory pins branch 595; allowed: the installed driver, or move "
        "it on purpose with deploys/driver.py"
    )


def test_bump_refuses_only_a_target_that_is_installed_and_running():
    assert drv.bump_refusal("580.159.04", "580.159.04", {"580.159.04"}) == (
        "driver 580.159.04 is already running: nothing to bump"
    )
    assert drv.bump_refusal("580.159.04", "580.95.05", {"580.159.04"}) is None  # reboot it
    assert drv.bump_refusal("580.95.05", "580.95.05", {"580.159.04"}) is None  # move back
    assert drv.bump_refusal("580.159.04", None, set()) is None  # nothing installed yet


# --- holds ----------------------------------------------------------------------------------


def test_apt_hold_marks_only_what_is_not_held():
    holds = AptHolds().process((FIXTURES / "apt-mark-showhold.txt").read_text().splitlines())
    commands, _ = run_op(apt_hold, {"AptHolds": holds},
                         packages=["libnccl2", "nvidia-smi", "nvidia-open"])
    assert shell(commands) == ["apt-mark hold nvidia-open nvidia-smi"]
    commands, fake = run_op(apt_hold, {"AptHolds": holds}, packages=["libnccl2", "libnccl-dev"])
    assert commands == []
    assert fake.noops == ["libnccl-dev, libnccl2: already held"]
    commands, _ = run_op(apt_hold, {"AptHolds": holds}, packages=["libnccl2", "nvidia-smi"],
                         held=False)
    assert shell(commands) == ["apt-mark unhold libnccl2"]


def test_hold_driver_holds_every_installed_driver_package_once():
    facts = {"DpkgInstalled": SIM_INSTALLED, "AptHolds": {"nvidia-open", "libnccl2"}}
    commands, _ = run_op(drv.hold_driver, facts)
    assert shell(commands) == [
        "apt-mark hold libnvidia-ml1 nvidia-kernel-open-dkms nvidia-persistenced nvidia-smi"
    ]
    facts["AptHolds"] = set(SIM_INSTALLED) - {"python3"}
    commands, fake = run_op(drv.hold_driver, facts)
    assert commands == [] and "already held" in fake.noops[0]
    commands, fake = run_op(drv.hold_driver, {"DpkgInstalled": DpkgInstalled().process(H200_DPKG)})
    assert commands == [] and fake.noops == ["no driver packages are installed"]


def render(name: str, cfg) -> str:
    """A template as the driver role renders it (rigbook.core.render)."""
    return render_template(TEMPLATES / name, cfg=cfg)


def test_blacklist_content():
    text = render("blacklist.j2", drv.BlacklistConf(drv.DRIVER_PACKAGE_PATTERNS))
    entries = re.findall(r'^    "([^"]*)";$', text, re.M)
    assert tuple(entries) == drv.DRIVER_PACKAGE_PATTERNS
    assert entries[:3] == ["nvidia-", "libnvidia-", "cuda-drivers"]
    assert "Unattended-Upgrade::Package-Blacklist {\n" in text and text.endswith("};\n")
    # unattended-upgrades' own rule: re.match, anchored at the start.
    blocked = [name for name in ("nvidia-open", "libnvidia-ml1", "cuda-drivers-580", "libnccl2",
                                 "cuda-compat-13-0", "libcudart13")
               if any(re.match(entry, name) for entry in entries)]
    assert blocked == ["nvidia-open", "libnvidia-ml1", "cuda-drivers-580"]


def test_blacklist_parses_with_apt_config(tmp_path):
    if shutil.which("apt-config") is None:
        pytest.skip("no apt-config here")
    conf = tmp_path / "51rigbook-nvidia-blacklist"
    conf.write_text(render("blacklist.j2", drv.BlacklistConf(drv.DRIVER_PACKAGE_PATTERNS)))
    main = tmp_path / "apt.conf"
    main.write_text(f'#include "{conf}";\n')
    out = subprocess.run(["apt-config", "dump"], env={**os.environ, "APT_CONFIG": str(main)},
                         capture_output=True, text=True, check=True).stdout
    listed = re.findall(r'^Unattended-Upgrade::Package-Blacklist:: "(.*)";$', out, re.M)
    assert tuple(listed) == drv.DRIVER_PACKAGE_PATTERNS


# --- persistence, module options ------------------------------------------------------------


def test_persistenced_dropin_keeps_the_command_without_no_persistence_mode():
    lines = [line for line in (TEMPLATES / "persistenced-override.conf").read_text().splitlines()
             if line and not line.startswith("#")]
    assert lines == [
        "[Service]",
        "ExecStart=",
        "ExecStart=/usr/bin/nvidia-persistenced --user nvidia-persistenced --verbose",
    ]
    # Against the unit the sandbox (and Ubuntu) ships: the same command minus the flag.
    unit = Path(__file__).parent.parent / "sandbox/simulated/units/nvidia-persistenced.service"
    if unit.exists():
        shipped = re.search(r"^ExecStart=(.*)$", unit.read_text(), re.M).group(1)
        assert shipped.replace(" --no-persistence-mode", "") == lines[2].removeprefix("ExecStart=")


def test_modprobe_options_content_and_reboot_marker():
    text = render("modprobe.conf.j2", drv.ModprobeConf({"NVreg_b": "1", "NVreg_A": "0x00"}))
    assert text.splitlines()[-1] == "options nvidia NVreg_A=0x00 NVreg_b=1"
    commands, _ = run_op(drv.modprobe_options, {"FileStates": file_states()},
                         options={"NVreg_DynamicPowerManagement": "0x00"})
    assert any("echo 'nvidia module options changed" in c and reboot.REBOOT_MARKER in c
               for c in shell(commands))
    # No options and no file: nothing to do, no reboot.
    commands, _ = run_op(drv.modprobe_options, {"FileStates": file_states()},
                         options={})
    assert commands == []
    # No options but the file is there: removed, and the module must load again.
    there = file_states({drv.MODPROBE_CONF: "options nvidia NVreg_A=0x00\n"})
    commands, _ = run_op(drv.modprobe_options, {"FileStates": there}, options={})
    assert shell(commands)[0].startswith(f"if [ -f {drv.MODPROBE_CONF} ] && [ ! -L ")
    assert f"then rm -f -- {drv.MODPROBE_CONF} ;" in shell(commands)[0]
    assert reboot.REBOOT_MARKER in shell(commands)[1]


# --- apt sources and the version pin --------------------------------------------------------


def test_sources_content():
    trusted = render("nvidia.sources.j2", drv.AptSource("file:/srv/rigbook-sim-repo", True))
    fields = dict(line.split(": ", 1) for line in trusted.splitlines() if not line.startswith("#"))
    assert fields == {"Types": "deb", "URIs": "file:/srv/rigbook-sim-repo", "Suites": "/",
                      "Trusted": "yes"}
    signed = render("nvidia.sources.j2", drv.AptSource(drv.CUDA_REPO, False))
    fields = dict(line.split(": ", 1) for line in signed.splitlines() if not line.startswith("#"))
    assert fields == {"Types": "deb", "URIs": drv.CUDA_REPO, "Suites": "/",
                      "Signed-By": drv.CUDA_KEYRING}


def _deb(root: Path, name: str, version: str, depends: str = "") -> None:
    build = root / "build" / f"{name}_{version}"
    (build / "DEBIAN").mkdir(parents=True)
    control = (f"Package: {name}\nVersion: {version}\nArchitecture: all\n"
               "Maintainer: rigbook tests <root@localhost>\nDescription: test package\n")
    depends_line = f"Depends: {depends}\n" if depends else ""
    (build / "DEBIAN" / "control").write_text(control + depends_line)
    subprocess.run(["dpkg-deb", "-b", str(build), str(root / "repo" / f"{name}_{version}_all.deb")],
                   check=True, capture_output=True)


@pytest.fixture
def apt_root(tmp_path):
    """A throwaway apt (own lists, status and sources) over a flat repository of two versions."""
    for tool in ("dpkg-deb", "dpkg-scanpackages", "apt-get"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} here")
    (tmp_path / "repo").mkdir()
    for version in ("580.95.05-1", "580.159.04-1"):
        # Like NVIDIA's metapackage: an exact dependency and an unversioned one.
        _deb(tmp_path, "nvidia-open", version,
             f"nvidia-smi (= {version}), nvidia-kernel-open-dkms")
        _deb(tmp_path, "nvidia-smi", version)
        _deb(tmp_path, "nvidia-kernel-open-dkms", version)
    packages = subprocess.run(["dpkg-scanpackages", "-m", "."], cwd=tmp_path / "repo",
                              capture_output=True, text=True, check=True).stdout
    (tmp_path / "repo" / "Packages").write_text(packages)
    etc = tmp_path / "etc"
    for sub in ("sources.list.d", "preferences.d", "apt.conf.d"):
        (etc / sub).mkdir(parents=True)
    for sub in ("state/lists/partial", "cache/archives/partial"):
        (tmp_path / sub).mkdir(parents=True)
    (tmp_path / "status").write_text("")
    (etc / "sources.list.d" / "rigbook-nvidia.sources").write_text(
        render("nvidia.sources.j2", drv.AptSource(f"file:{tmp_path}/repo", True))
    )
    conf = tmp_path / "apt.conf"
    conf.write_text(
        f'Dir::State "{tmp_path}/state"; Dir::State::status "{tmp_path}/status";\n'
        f'Dir::Cache "{tmp_path}/cache"; Dir::Etc "{etc}"; Dir::Etc::sourcelist "/dev/null";\n'
        'Dir::Etc::sourceparts "sources.list.d"; Debug::NoLocking "true";\n'
    )
    env = {**os.environ, "APT_CONFIG": str(conf), "LC_ALL": "C"}

    def apt(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=env, capture_output=True, text=True)

    assert apt("apt-get", "update").returncode == 0
    return etc, apt


def _inst(output: str) -> dict[str, str]:
    return dict(re.findall(r"^Inst (\S+) \((\S+)", output, re.M))


def test_version_glob_and_pin_resolve_dependencies_to_the_pinned_version(apt_root):
    etc, apt = apt_root
    pinned = rig(driver_version="580.95.05")
    plan_version = drv.version_glob(pinned)
    # The source template is a valid flat source: apt sees both versions.
    assert "580.95.05-1" in apt("apt-cache", "madison", "nvidia-open").stdout
    # Without the pin apt takes the newest version for every dependency: an older driver does
    # not even resolve.
    unpinned = apt("apt-get", "install", "-s", f"nvidia-open={plan_version}")
    assert unpinned.returncode != 0
    assert "Depends: nvidia-smi (= 580.95.05-1) but 580.159.04-1 is to be installed" in (
        unpinned.stdout
    )
    # With the pin every driver package resolves to the inventory's version.
    (etc / "preferences.d" / "rigbook-nvidia.pref").write_text(render(
        "preferences.j2", drv.PinConf(plan_version, "driver_version", drv.DRIVER_PACKAGE_GLOBS)
    ))
    pinned_run = apt("apt-get", "install", "-s", f"nvidia-open={plan_version}",
                     f"nvidia-persistenced={plan_version}")
    assert pinned_run.returncode != 0  # a package the source lacks fails loudly, no guess
    pinned_run = apt("apt-get", "install", "-s", f"nvidia-open={plan_version}")
    assert pinned_run.returncode == 0, pinned_run.stdout + pinned_run.stderr
    assert _inst(pinned_run.stdout) == {
        "nvidia-kernel-open-dkms": "580.95.05-1", "nvidia-smi": "580.95.05-1",
        "nvidia-open": "580.95.05-1",
    }
    # A version the source does not have is an error, not the newest version.
    missing = apt("apt-get", "install", "-s", "nvidia-open=580.99.01-*")
    assert missing.returncode != 0 and "580.99.01-*" in missing.stdout + missing.stderr


# --- install, move ----------------------------------------------------------------------------


def test_install_driver_installs_only_the_missing_packages_pinned():
    commands, _ = run_op(drv.install_driver, {"DpkgInstalled": {"python3": "3.11.2-1+b1"}},
                         packages=("nvidia-open", "nvidia-persistenced"), version="580.95.05-*")
    assert shell(commands) == [
        "DEBIAN_FRONTEND=noninteractive apt-get -y -o Dpkg::Options::=\"--force-confdef\" "
        "-o Dpkg::Options::=\"--force-confold\" install "
        "'nvidia-open=580.95.05-*' 'nvidia-persistenced=580.95.05-*'"
    ]
    commands, fake = run_op(drv.install_driver, {"DpkgInstalled": SIM_INSTALLED},
                            packages=("nvidia-open", "nvidia-persistenced"), version="580.95.05-*")
    assert commands == []
    assert fake.noops == ["installed: nvidia-open 580.95.05-1, nvidia-persistenced 580.95.05-1"]


def move(installed: dict, madison: list[str] = MADISON, target: str = "580.159.04"):
    def versions(packages):
        offered = AptVersions().process(madison)
        return {name: offered[name] for name in packages if name in offered}

    facts = {"DpkgInstalled": installed, "AptVersions": versions,
             "FileStates": file_states()}
    return run_op(drv.move_driver, facts, packages=("nvidia-open", "nvidia-persistenced"),
                  target=target)


def test_move_driver_installs_the_bump_script_and_runs_it_detached():
    madison = MADISON + [
        f"{name} | {version} | file:/srv/rigbook-sim-repo  Packages"
        for name in ("libnvidia-ml1", "nvidia-kernel-open-dkms", "nvidia-persistenced")
        for version in ("580.159.04-1", "580.95.05-1")
    ]
    commands, _ = move(SIM_INSTALLED, madison)
    assert [describe(command) for command in commands] == [
        "mkdir -p /opt/rigbook/driver",
        "upload /opt/rigbook/driver/bump.sh",
        "chmod 755 /opt/rigbook/driver/bump.sh",
        "/opt/rigbook/driver/bump.sh --detach 'libnvidia-ml1=580.159.04-*' "
        "'nvidia-kernel-open-dkms=580.159.04-*' 'nvidia-open=580.159.04-*' "
        "'nvidia-persistenced=580.159.04-*' 'nvidia-smi=580.159.04-*'",
    ]
    assert commands[1].src == str(TEMPLATES / "bump.sh")


def test_move_driver_keeps_packages_named_after_the_old_version():
    installed = dict(UBUNTU_INSTALLED)
    madison = [f"{name} | {version} | x Packages"
               for name in ("nvidia-driver-580-open", "nvidia-utils-580", "libnvidia-compute-580",
                            "nvidia-dkms-580-open")
               for version in ("580.159.04-0ubuntu0.24.04.1", "580.95.05-0ubuntu0.24.04.1")]
    facts = {"DpkgInstalled": installed,
             "AptVersions": lambda packages: AptVersions().process(madison),
             "FileStates": file_states()}
    commands, _ = run_op(drv.move_driver, facts,
                         packages=("nvidia-driver-580-open", "nvidia-utils-580"),
                         target="580.159.04")
    command = shell(commands)[-1]
    assert "nvidia-firmware-580-580.95.05" not in command  # not offered at the target: stays
    assert "nvidia-settings" not in command  # not the driver's version
    assert "'nvidia-dkms-580-open=580.159.04-*'" in command


def test_move_driver_refuses_a_target_the_source_lacks_and_noops_when_there():
    commands, fake = move(SIM_INSTALLED, target="580.200.01")
    assert refusals(commands, fake) == [
        "nvidia-open 580.200.01 is not offered by the configured apt sources "
        "(offered: 580.159.04-1, 580.95.05-1)"
    ]
    there = {name: "580.159.04-1" for name in SIM_INSTALLED}
    commands, fake = move(there)
    assert commands == [] and fake.noops == ["driver 580.159.04 is installed"]


def test_move_driver_refuses_what_is_not_a_package_name_or_a_version():
    hostile = {"nvidia-smi": "580.95.05-1", "nvidia-x;reboot": "580.95.05-1"}
    madison = MADISON + ["nvidia-x;reboot | 580.159.04-1 | x Packages"]
    commands, fake = move(hostile, madison)
    assert refusals(commands, fake) == ["not Debian package names: 'nvidia-x;reboot'"]
    commands, fake = move(SIM_INSTALLED, target="580.159.04\n")
    assert refusals(commands, fake) == ["not a driver version: '580.159.04\\n'"]


# --- the bump script itself, with stand-ins for apt and dpkg ---------------------------------

BUMP = TEMPLATES / "bump.sh"
TARGETS = ["nvidia-open=580.159.04-*", "nvidia-smi=580.159.04-*", "libnvidia-ml1=580.159.04-*"]


class StandIns:
    """A bin folder of stand-in apt-mark, apt-get and dpkg-query that log their calls.

    dpkg-query answers from `status` (name -> db:Status-Abbrev); apt-get exits `apt_status`
    and, while the file `hold_apt` exists, waits for it to go (a slow install); it writes its
    parent's pid to `apt_pid` when it starts and touches `apt_done` when it ran to its end.
    """

    def __init__(self, root: Path):
        self.root = root
        self.calls = root / "calls"
        self.hold_apt = root / "hold-apt"
        self.apt_pid = root / "apt-parent"
        self.apt_done = root / "apt-done"
        self.logs = root / "logs"
        bin_dir = root / "bin"
        bin_dir.mkdir()
        scripts = {
            "apt-mark": f'echo "apt-mark $*" >> {self.calls}\n',
            "apt-get": (
                f'echo "apt-get $*" >> {self.calls}\necho $PPID > {self.apt_pid}\n'
                f"while [ -e {self.hold_apt} ]; do sleep 0.05; done\ntouch {self.apt_done}\n"
                'echo "E: apt-get (stand-in) exits $APT_STATUS" >&2\nexit $APT_STATUS\n'
            ),
            "dpkg-query": f'grep "^${{3}} " {root}/status | cut -d" " -f2 | tr -d "\\n"'
                          ' | grep .\n',
        }
        for name, body in scripts.items():
            (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
            (bin_dir / name).chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin",
                    "RIGBOOK_LOG_DIR": str(self.logs), "APT_STATUS": "0"}

    def status(self, **packages: str) -> None:
        (self.root / "status").write_text(
            "".join(f"{name.replace('_', '-')} {abbrev}\n" for name, abbrev in packages.items())
        )

    def run(self, *specs: str, apt_status: int = 0, **popen) -> subprocess.Popen:
        return subprocess.Popen(
            ["setsid", "-w", str(BUMP), *specs], env={**self.env, "APT_STATUS": str(apt_status)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
        )

    def called(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


@pytest.fixture
def standins(tmp_path):
    if shutil.which("setsid") is None:
        pytest.skip("no setsid here")
    tools = StandIns(tmp_path)
    tools.status(nvidia_open="hi", nvidia_smi="hi", libnvidia_ml1="hi")
    return tools


def wait_for(predicate, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_bump_script_holds_again_when_apt_fails(standins):
    standins.status(nvidia_open="hi", nvidia_smi="hi", libnvidia_ml1="un")
    run = standins.run(*TARGETS, apt_status=100)
    out, err = run.communicate(timeout=30)
    assert run.returncode == 100
    assert standins.called() == [
        "apt-mark unhold nvidia-open nvidia-smi",  # libnvidia-ml1 is not installed
        "apt-get -y -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "
        "install --allow-downgrades " + " ".join(TARGETS),
        "apt-mark hold nvidia-open nvidia-smi",
    ]
    # What apt said comes back to the caller (and stays in the log on the rig).
    assert "E: apt-get (stand-in) exits 100" in out
    (log,) = standins.logs.glob("driver-bump-*.log")
    assert log.read_text() == out


def test_bump_script_keeps_the_ten_newest_logs_of_earlier_bumps(standins):
    standins.logs.mkdir()
    old = [standins.logs / f"driver-bump-202601{day:02d}T000000Z-1.log" for day in range(1, 13)]
    for path in old:
        path.write_text("an earlier bump\n")
    standins.run(*TARGETS).communicate(timeout=30)
    kept = sorted(path.name for path in standins.logs.glob("driver-bump-*.log"))
    assert kept[:10] == [path.name for path in old[2:]] and len(kept) == 11  # + this run's


def test_bump_script_holds_what_a_failed_dpkg_left_half_way(standins):
    # iF: half-configured (a postinst failed), iU: unpacked; both are on the system.
    standins.status(nvidia_open="iU", nvidia_smi="iF", libnvidia_ml1="ii")
    run = standins.run(*TARGETS, apt_status=100)
    run.communicate(timeout=30)
    assert standins.called()[-1] == "apt-mark hold nvidia-open nvidia-smi libnvidia-ml1"


def test_bump_script_outlives_the_hang_up_of_its_session(standins):
    """A dropped SSH connection hangs up the session pyinfra's command runs in (the process
    group of `setsid -w`): the script and apt are in a session of their own and go on."""
    standins.hold_apt.touch()
    run = standins.run(*TARGETS, start_new_session=True)
    wait_for(standins.apt_pid.exists)
    os.killpg(run.pid, signal.SIGHUP)
    assert run.wait(timeout=10) == -signal.SIGHUP  # the caller's side is gone
    assert standins.called()[-1].startswith("apt-get")  # apt still runs
    standins.hold_apt.unlink()
    wait_for(lambda: standins.called()[-1].startswith("apt-mark hold"))
    assert standins.apt_done.exists()  # apt ran to its end
    assert standins.called()[-1] == "apt-mark hold nvidia-open nvidia-smi libnvidia-ml1"


def test_bump_script_lets_apt_finish_on_a_signal_then_holds(standins):
    standins.hold_apt.touch()
    run = standins.run(*TARGETS)
    wait_for(standins.apt_pid.exists)
    os.kill(int(standins.apt_pid.read_text()), signal.SIGTERM)  # the script, not apt
    time.sleep(0.3)
    assert standins.called()[-1].startswith("apt-get")  # apt is not cut short
    standins.hold_apt.unlink()
    run.communicate(timeout=10)
    assert run.returncode == 143 and standins.apt_done.exists()
    assert standins.called()[-1] == "apt-mark hold nvidia-open nvidia-smi libnvidia-ml1"


@pytest.mark.skipif(Path("/run/systemd/system").is_dir(), reason="this machine runs systemd")
def test_without_systemd_detach_runs_the_apt_step_in_a_session_of_its_own(standins):
    """No unit to run in (no systemd as PID 1): `--detach` is `setsid -w` of the apt step, so
    the caller gets its status and log, and the hold comes back, as before."""
    standins.status(nvidia_open="hi", nvidia_smi="hi", libnvidia_ml1="un")
    run = subprocess.run([str(BUMP), "--detach", *TARGETS], env={**standins.env,
                         "APT_STATUS": "100"}, capture_output=True, text=True, timeout=30)
    assert run.returncode == 100, run
    assert "E: apt-get (stand-in) exits 100" in run.stdout
    assert standins.called()[-1] == "apt-mark hold nvidia-open nvidia-smi"


@pytest.mark.parametrize("spec", [
    "nvidia-open", "nvidia-open=580.159.04-*;reboot", "nvidia-open=580.159.04-*\n",
    "-o=1", "nvidia-open=$(id)",
])
def test_bump_script_refuses_what_is_not_package_equals_version(standins, spec):
    run = standins.run("nvidia-smi=580.159.04-*", spec)
    _, err = run.communicate(timeout=10)
    assert run.returncode == 2 and "not PACKAGE=VERSION" in err
    assert standins.called() == []


# --- the cuda-keyring download, checked against its pinned sha256 ---------------------------


def test_cuda_keyring_checks_the_hash_before_dpkg():
    commands, fake = run_op(drv.cuda_keyring, {"DpkgInstalled": {}})
    (command,) = shell(commands)
    assert drv.CUDA_KEYRING_DEB in command
    assert command.index(f'echo "{drv.CUDA_KEYRING_SHA256}  $deb" | sha256sum -c') < (
        command.index('dpkg --force-confdef --force-confold -i "$deb"')
    )
    commands, fake = run_op(drv.cuda_keyring, {"DpkgInstalled": {"cuda-keyring": "1.1-1"}})
    assert commands == [] and fake.noops == ["cuda-keyring is installed"]
    commands, fake = run_op(drv.cuda_keyring, {"DpkgInstalled": {}}, sha256="abc; reboot")
    assert refusals(commands, fake) == ["not a sha256: 'abc; reboot'"]


@pytest.mark.parametrize("pinned", ["right", "wrong"])
def test_cuda_keyring_installs_only_a_download_that_matches(tmp_path, pinned):
    """The generated shell, run here: a stand-in curl 'downloads' a local file, a stand-in dpkg
    logs its calls. dpkg runs only on a match; the temp file is gone either way."""
    deb = tmp_path / "cuda-keyring_1.1-1_all.deb"
    deb.write_bytes(b"not really a keyring\n")
    actual = hashlib.sha256(deb.read_bytes()).hexdigest()
    expected = actual if pinned == "right" else "0" * 64
    bin_dir, temp, log = tmp_path / "bin", tmp_path / "tmp", tmp_path / "dpkg.log"
    bin_dir.mkdir()
    temp.mkdir()
    (bin_dir / "curl").write_text(f'#!/bin/sh\ncp {deb} "$3"\n')  # curl -fsSL -o FILE URL
    (bin_dir / "dpkg").write_text(f'#!/bin/sh\necho "dpkg $*" >> {log}\n')
    for tool in ("curl", "dpkg"):
        (bin_dir / tool).chmod(0o755)
    url = "https://example.invalid/cuda-keyring_1.1-1_all.deb"
    command = drv.keyring_command(url, expected).get_raw_value()
    run = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                         env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin",
                              "TMPDIR": str(temp)})
    assert list(temp.iterdir()) == []
    if pinned == "right":
        assert run.returncode == 0, run.stderr
        assert log.read_text().startswith(f"dpkg --force-confdef --force-confold -i {temp}/")
    else:
        assert run.returncode == 1
        assert run.stderr == (
            f"{url}: sha256 mismatch: expected {expected}, actual {actual}; not installed\n"
        )
        assert not log.exists()


# --- reboot, verify, WSL2 -------------------------------------------------------------------


def test_reboot_reasons():
    assert reboot.reboot_reasons(set(), None, []) == []
    assert reboot.reboot_reasons({"580.95.05"}, "580.95.05", []) == []
    assert reboot.reboot_reasons({"580.159.04"}, "580.95.05", []) == [
        "driver 580.159.04 is installed but the loaded module is 580.95.05"
    ]
    assert reboot.reboot_reasons({"580.95.05"}, None, ["nvidia module options changed (x)"]) == [
        "nvidia module options changed (x)",
        "driver 580.95.05 is installed but no nvidia module is loaded",
    ]


BOOT = "8d2c3e5e-54ac-4a43-a0c6-0c3f1d0c2c11"


def reboot_facts(loaded, marker=()) -> dict:
    return {"DpkgInstalled": SIM_INSTALLED, "LoadedDriverVersion": loaded,
            "RebootMarker": list(marker), "BootId": BOOT}


def test_reboot_only_when_pending_and_allowed(caplog):
    commands, fake = run_op(drv.reboot_for_driver, reboot_facts("580.95.05"), allow_reboot=True)
    assert commands == []
    assert fake.noops == ["no reboot pending: the running driver is the installed one"]

    with caplog.at_level(logging.WARNING):
        commands, _ = run_op(drv.reboot_for_driver, reboot_facts("580.159.04"))
    assert commands == []
    assert ("[rig1] reboot needed (driver 580.95.05 is installed but the loaded module is "
            "580.159.04); allow_reboot is false: reboot the rig") in caplog.text

    commands, _ = run_op(drv.reboot_for_driver, reboot_facts(None, ["x changed"]),
                         allow_reboot=True)
    assert shell(commands) == ["( sleep 1 && reboot ) </dev/null >/dev/null 2>&1 &"]
    wait = commands[-1]
    assert wait.function is reboot.wait_for_boot and wait.args == (BOOT, *reboot.REBOOT_WAIT_S)


class Rebooting:
    """A rig seen over SSH while it reboots: down, then up with the old id, then a new one."""

    def __init__(self, answers: list):
        self.answers = answers
        self.connected = False
        self.logged: list[str] = []
        self.connector_data: dict = {}  # no sudo password: nothing to forget

    def connect(self, show_errors=True):
        self.connected = self.answers[0] is not None
        if not self.connected:
            self.answers.pop(0)

    def disconnect(self):
        self.connected = False

    def run_shell_command(self, command):
        assert command.get_raw_value() == f"cat {reboot.BOOT_ID}"
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return True, type("Output", (), {"stdout_lines": [answer]})()

    def log_styled(self, message, **_):
        self.logged.append(message)


def test_wait_for_boot_waits_for_a_new_boot_id():
    rig1 = Rebooting([BOOT, OSError("connection reset"), None, None, "a-new-boot-id"])
    assert reboot.wait_for_boot(None, rig1, BOOT, 0, 0, 5) is True
    assert rig1.answers == [] and rig1.connected
    stuck = Rebooting([BOOT] * 1000)
    assert reboot.wait_for_boot(None, stuck, BOOT, 0, 0.01, 0.05) is False
    assert stuck.logged == ["did not come back from the reboot within 0.05 s"]


def test_reboot_that_did_not_help_fails_the_rig():
    facts = reboot_facts(Calls(["580.159.04", "580.159.04"]))
    commands, fake = run_op(drv.reboot_for_driver, facts, executing=True, allow_reboot=True)
    assert refusals(commands[-1:], fake) == [
        "still after the reboot: driver 580.95.05 is installed but the loaded module is 580.159.04"
    ]
    facts = reboot_facts(Calls(["580.159.04", "580.95.05"]))
    commands, _ = run_op(drv.reboot_for_driver, facts, executing=True, allow_reboot=True)
    assert not isinstance(commands[-1], FunctionCommand) or "still" not in str(commands[-1].args)


def h200_probe() -> GpuProbe:
    text = (FIXTURES / "query-full-nounits.csv").read_text()
    return GpuProbe(smi="/usr/local/nvidia/bin/nvidia-smi", gpus=tuple(parse_query_csv(text)))


def test_verify_driver_passes_only_on_the_target():
    commands, fake = run_op(drv.verify_driver, {"NvidiaGpus": h200_probe()}, version="580.159.04")
    assert commands == []
    assert fake.noops == [
        "nvidia-smi (/usr/local/nvidia/bin/nvidia-smi) reports driver 580.159.04 on 1 GPU(s)"
    ]
    facts = {"NvidiaGpus": h200_probe(), "DpkgInstalled": {}, "LoadedDriverVersion": "580.159.04",
             "RebootMarker": []}
    commands, fake = run_op(drv.verify_driver, facts, version="580.95.05")
    assert refusals(commands, fake) == [
        "driver 580.95.05 is not running: nvidia-smi reports 580.159.04"
    ]
    broken = GpuProbe(smi="/usr/bin/nvidia-smi", error=MISMATCH, exit_code=18)
    facts = {"NvidiaGpus": broken, **reboot_facts("580.95.05")}
    facts["DpkgInstalled"] = {name: "580.159.04-1" for name in SIM_INSTALLED}
    commands, fake = run_op(drv.verify_driver, facts, version="580.159.04")
    assert refusals(commands, fake) == [
        f"driver 580.159.04 is not running: nvidia-smi fails: {MISMATCH}; reboot needed: "
        "driver 580.159.04 is installed but the loaded module is 580.95.05"
    ]


def test_wsl2_checks_the_windows_driver_and_refuses_a_linux_one():
    wsl_probe = GpuProbe(smi=drv.WSL_NVIDIA_SMI, gpus=h200_probe().gpus)
    commands, fake = run_op(drv.check_wsl, {"DpkgInstalled": {"python3": "3.11"},
                                            "NvidiaGpus": wsl_probe})
    assert commands == []
    assert fake.noops == [
        f"WSL2: the Windows driver 580.159.04 serves 1 GPU(s) ({drv.WSL_NVIDIA_SMI}); "
        "no Linux driver is installed, by design"
    ]
    shadowed = {"nvidia-utils-580": "580.95.05-0ubuntu0.24.04.1",
                "libnvidia-compute-580": "580.95.05-0ubuntu0.24.04.1",
                "nvidia-container-toolkit": "1.17.8-1", "cuda-toolkit-13-0": "13.0.2-1"}
    commands, fake = run_op(drv.check_wsl, {"DpkgInstalled": shadowed, "NvidiaGpus": wsl_probe})
    (message,) = refusals(commands, fake)
    assert message.startswith("Linux NVIDIA driver packages are installed in WSL2 "
                              "(libnvidia-compute-580, nvidia-utils-580)")
    assert message.endswith("apt-get purge libnvidia-compute-580 nvidia-utils-580")
    commands, fake = run_op(drv.check_wsl, {"DpkgInstalled": {}, "NvidiaGpus": None})
    assert "does not answer (no nvidia-smi)" in refusals(commands, fake)[0]
    broken = GpuProbe(smi=drv.WSL_NVIDIA_SMI, error="No devices were found", exit_code=6)
    commands, fake = run_op(drv.check_wsl, {"DpkgInstalled": {}, "NvidiaGpus": broken})
    assert refusals(commands, fake) == [f"WSL2: {drv.WSL_NVIDIA_SMI} fails: No devices were found"]


# --- the Ubuntu plan against Ubuntu's real archive (tests/fixtures/ubuntu-archive) --------

ARCHIVE = Path(__file__).parent / "fixtures" / "ubuntu-archive"


def archive_policy(release: str) -> list:
    return parse_apt_policy((ARCHIVE / f"policy-{release}.txt").read_text().splitlines())


def installs(name: str) -> dict[str, str]:
    """`apt-get -s install`'s Inst lines: package -> the version apt would install."""
    found = {}
    for line in (ARCHIVE / name).read_text().splitlines():
        if line.startswith("Inst "):
            package, version = line.split()[1], line.split("(", 1)[1].split()[0]
            found[package] = version
    return found


#: What each release's archive carried on 2026-12-04 (the captures; docs/driver.md's table):
#: every nvidia-driver-B-open name -> the upstream version its candidate and nvidia-utils-B's
#: carry. Another branch's version is a transitional name (530 on 24.04 installs 535).
CARRIED = {
    "noble": {530: "535.309.01", 535: "535.309.01", 570: "570.211.01", 580: "580.196.07",
              590: "590.48.01", 595: "595.112.07"},
    "resolute": {535: "580.196.07", 570: "580.196.07", 580: "580.196.07", 590: "595.112.07",
                 595: "595.112.07"},
}
VERSION_ID = {"noble": "24.04", "resolute": "26.04"}


def candidates(release: str) -> dict[str, str]:
    return {policy.package: policy.versions[0].version for policy in archive_policy(release)
            if policy.versions}


@pytest.mark.parametrize("release", ["noble", "resolute"])
def test_every_branch_the_release_carries_is_planned_or_refused(release):
    names = (ARCHIVE / f"pkgnames-{release}.txt").read_text().split()
    branches = sorted(int(m[1]) for name in names
                      if (m := re.fullmatch(r"nvidia-driver-(\d+)-open", name)))
    offered = candidates(release)
    carried = {}
    for branch in branches:
        driver, utils = offered[f"nvidia-driver-{branch}-open"], offered[f"nvidia-utils-{branch}"]
        assert upstream_version(driver) == upstream_version(utils)
        carried[branch] = upstream_version(driver)
    assert carried == CARRIED[release]
    for branch, upstream in carried.items():
        if branch in DRIVER_BRANCHES:  # planned: resolves (the test below), the branch's own
            assert upstream.startswith(f"{branch}.")
            r = rig(platform="ubuntu", driver_branch=branch)
            assert drv.archive_finding(r, Facts(driver_policy=archive_policy(release),
                                                installed={})) is None
        else:  # the branch's own, or a transitional name: refused by the host data's check
            with pytest.raises(ValidationError, match=f"unknown driver branch {branch}"):
                rig(platform="ubuntu", driver_branch=branch)


def driver_parts(closure: dict[str, str], upstream: str) -> set[str]:
    """The packages of a closure that carry the driver's version or are NVIDIA's."""
    return {name for name, version in closure.items() if upstream in version or "nvidia" in name}


@pytest.mark.parametrize(("release", "branch"), [
    ("noble", 580), ("noble", 595), ("resolute", 580), ("resolute", 595)])
def test_the_ubuntu_plan_resolves_against_the_real_archive(release, branch):
    r = rig(platform="ubuntu", driver_branch=branch)
    plan = drv.plan_driver(r, "rig1", ubuntu(VERSION_ID[release]), NOT_WSL, "x86_64")
    newest = candidates(release)[f"nvidia-driver-{branch}-open"]
    facts = Facts(driver_policy=archive_policy(release), installed={})
    assert drv.offered(r, facts.driver_policy)[0] == newest
    assert drv.archive_finding(r, facts) is None
    # what apt resolved for exactly these packages and this glob, on that release's archive
    assert plan.packages[-1] == f"nvidia-dkms-{branch}-open" and plan.version == f"{branch}.*"
    closure = installs(f"install-s-{release}-{branch}-open.txt")
    for package in plan.packages:
        assert closure[package] == newest
    # every package of the closure that carries the driver's version, or is NVIDIA's, is held
    # and blacklisted: an upgrade cannot move one part of the driver without the others
    upstream = upstream_version(newest)
    parts = driver_parts(closure, upstream)
    assert {f"nvidia-dkms-{branch}-open", f"nvidia-kernel-common-{branch}",
            f"nvidia-firmware-{branch}-{upstream}", f"libnvidia-compute-{branch}",
            "libnvidia-egl-wayland1"} <= parts
    assert [name for name in parts if not drv.is_driver_package(name)] == []


SECURE_BOOT = kern.SecureBoot(enabled=True, mokutil=True)


def signed_fact(release: str, branch: int, running: str) -> kern.SignedModules:
    """SignedModulesFact on a rig running `running`, its apt-cache show the real capture."""
    shown = (ARCHIVE / f"show-{release}-{branch}-open-generic.txt").read_text().splitlines()
    return kern.SignedModulesFact().process(
        [f"##running {running}", f"##show linux-modules-nvidia-{branch}-open-generic", *shown])


@pytest.mark.parametrize(("release", "branch", "kernel"), [
    ("noble", 580, "6.8.0-151-generic"), ("noble", 595, "6.8.0-151-generic"),
    ("resolute", 580, "7.0.0-44-generic"), ("resolute", 595, "7.0.0-44-generic")])
def test_on_secure_boot_the_ubuntu_plan_takes_the_prebuilt_signed_modules(release, branch,
                                                                           kernel):
    r = rig(platform="ubuntu", driver_branch=branch)
    meta = f"linux-modules-nvidia-{branch}-open-generic"
    newest = candidates(release)[f"nvidia-driver-{branch}-open"]
    modules = signed_fact(release, branch, kernel)
    assert modules.kernel == kernel and modules.provides[f"nvidia-dkms-{branch}-open"] == newest
    policies = archive_policy(release)
    module = drv.kernel_module(r, SECURE_BOOT, modules, policies, {})
    assert module.signed == meta
    assert module.says == (f"Ubuntu's prebuilt signed modules ({meta} for kernel {kernel}; Secure "
                           f"Boot: no MOK enrolment needed) instead of nvidia-dkms-{branch}-open")
    plan = drv.plan_driver(r, "rig1", ubuntu(VERSION_ID[release]), NOT_WSL, "x86_64", module)
    assert plan.packages == (f"nvidia-driver-{branch}-open", f"nvidia-utils-{branch}")
    assert plan.unpinned == (meta,) and plan.module == module.says
    # the module package carries the kernel's version: installed without the driver's glob
    commands, _ = run_op(drv.install_driver, {"DpkgInstalled": {}}, packages=plan.packages,
                         version=plan.version, unpinned=plan.unpinned)
    assert shell(commands)[0].endswith(f"install 'nvidia-driver-{branch}-open={branch}.*' "
                                       f"'nvidia-utils-{branch}={branch}.*' {meta}")
    # what apt resolved for exactly those: the signed modules stand in for DKMS
    closure = installs(f"install-s-{release}-{branch}-open-signed.txt")
    assert closure[meta] == modules.version and not upstream_version(modules.version).startswith(
        f"{branch}.")
    assert closure[f"linux-modules-nvidia-{branch}-open-{kernel}"] == modules.version
    assert all(closure[package] == newest for package in plan.packages)
    assert f"nvidia-dkms-{branch}-open" not in closure and "dkms" not in closure
    parts = driver_parts(closure, upstream_version(newest))
    assert {meta, f"linux-modules-nvidia-{branch}-open-{kernel}",
            f"nvidia-kernel-common-{branch}"} <= parts
    assert [name for name in parts if not drv.is_driver_package(name)] == []  # held, listed
    # a rig still on an older kernel of the series: the modules bring the newer one
    older = drv.kernel_module(r, SECURE_BOOT, signed_fact(release, branch, "6.8.0-51-generic"
                                                          if release == "noble" else
                                                          "7.0.0-10-generic"), policies, {})
    assert older.signed == meta and "which it installs: the module loads once the rig boots it" \
        in older.says


def test_secure_boot_keeps_dkms_where_no_signed_module_fits():
    r = rig(platform="ubuntu")
    policies = archive_policy("noble")
    fits = signed_fact("noble", 580, "6.8.0-151-generic")

    def says(r=r, sb=SECURE_BOOT, modules=fits, policies=policies, installed=None):
        module = drv.kernel_module(r, sb, modules, policies, installed or {})
        assert module.signed is None
        return module.says

    assert says(sb=kern.SecureBoot(enabled=False, mokutil=True)) == "DKMS (nvidia-dkms-580-open)"
    assert says(sb=kern.SecureBoot()) == "DKMS (nvidia-dkms-580-open)"  # unknown: no mokutil
    lead = ("DKMS (nvidia-dkms-580-open): Secure Boot is on, no prebuilt signed module (")
    tail = "); the DKMS key must be enrolled"
    # the sandbox's kernel is not of Ubuntu's scheme, and a flavour the sources do not offer
    assert says(modules=kern.SignedModulesFact().process(["##running 6.18.44-fc-v1252"])) == (
        lead + "the rig's sources offer no linux-modules-nvidia-580-open-FLAVOUR for the running "
        "kernel 6.18.44-fc-v1252" + tail)
    absent = kern.SignedModulesFact().process(
        ["##running 6.8.0-1015-foo", "##show linux-modules-nvidia-580-open-foo"])
    assert "offer no linux-modules-nvidia-580-open-FLAVOUR for the running kernel " \
        "6.8.0-1015-foo" in says(modules=absent)
    # a driver the modules were not built for: 26.04's release-pocket 580.142
    old = rig(platform="ubuntu", driver_version="580.142")
    assert says(old, modules=signed_fact("resolute", 580, "7.0.0-44-generic"),
                policies=archive_policy("resolute")) == (
        lead + "linux-modules-nvidia-580-open-generic 7.0.0-44.44+1 stands in for "
        "nvidia-dkms-580-open 580.196.07-0ubuntu0.26.04.1, not for the "
        "580.142-0ubuntu3 the plan installs" + tail)
    # an HWE kernel: the flavour's modules are the GA series' (6.8), not the running 7.0's
    assert says(modules=signed_fact("noble", 580, "7.0.0-44-generic")) == (
        lead + "linux-modules-nvidia-580-open-generic is for kernel 6.8.0-151-generic, not of "
        "the running kernel's series (7.0.0-44-generic)" + tail)
    # a DKMS driver installed stays DKMS, installed signed modules stay: the converge never
    # moves a driver (Secure Boot turned off since, too)
    assert "nvidia-dkms-580-open is installed" in says(
        installed={"nvidia-dkms-580-open": "580.196.07-0ubuntu0.24.04.1"})
    signed = {"linux-modules-nvidia-580-open-6.8.0-151-generic": "6.8.0-151.151+1",
              "linux-modules-nvidia-580-open-generic": "6.8.0-151.151+1"}
    for sb in (SECURE_BOOT, kern.SecureBoot(enabled=False, mokutil=True)):
        kept = drv.kernel_module(r, sb, kern.SignedModules(), policies, signed)
        assert kept == drv.KernelModule("linux-modules-nvidia-580-open-generic", (
            "Ubuntu's prebuilt signed modules (linux-modules-nvidia-580-open-generic, installed)"))


def test_secure_boot_on_ubuntu_needs_no_mok_with_the_signed_modules():
    r = rig(platform="ubuntu")
    base = {"secure_boot": SECURE_BOOT, "kernels": kern.Kernels("6.8.0-151-generic"),
            "dkms": kern.DkmsStatus(), "nouveau": kern.Nouveau(blacklisted_by=(kern.NOUVEAU_CONF,)),
            "driver_policy": archive_policy("noble"), "installed": {}, "loaded": None,
            "probe": None, "driver_source": None,
            "signed_modules": signed_fact("noble", 580, "6.8.0-151-generic")}
    (chosen,) = drv.ONBOARD.run(r, Facts(**base), "rig1")
    assert chosen.level == "drift" and chosen.reason.startswith(
        "Secure Boot is on: the converge installs Ubuntu's prebuilt signed modules "
        "(linux-modules-nvidia-580-open-generic for kernel 6.8.0-151-generic")
    installed = {"linux-modules-nvidia-580-open-generic": "6.8.0-151.151+1",
                 "nvidia-driver-580-open": "580.196.07-0ubuntu0.24.04.1"}
    assert drv.ONBOARD.run(r, Facts(**{**base, "installed": installed}), "rig1") == []
    # no signed module for the running kernel: the DKMS key's refusal, with its steps
    other = kern.SignedModulesFact().process(["##running 6.18.44-fc-v1252"])
    (refused,) = drv.ONBOARD.run(r, Facts(**{**base, "signed_modules": other}), "rig1")
    assert refused.level == "error" and "update-secureboot-policy --new-key" in refused.reason


def test_a_version_the_archive_no_longer_carries_is_refused_before_any_change():
    # apt's own word on the glob rigbook would plan for it ...
    gone = (ARCHIVE / "install-s-noble-580.95.05-gone.txt").read_text()
    assert "E: Version '580.95.05-*' for 'nvidia-driver-580-open' was not found" in gone
    # ... is the preflight's, before anything changes, with what the sources do offer
    r = rig(platform="ubuntu", driver_version="580.95.05")
    finding = drv.archive_finding(r, Facts(driver_policy=archive_policy("noble"), installed={}))
    assert finding.level == "error" and finding.key == "driver_version"
    assert ("nvidia-driver-580-open 580.95.05 is not offered by this rig's apt sources; they "
            "offer 580.196.07-0ubuntu0.24.04.1.") in finding.reason
    # 26.04 still carries its release pocket's 580.142 beside -updates
    old = rig(platform="ubuntu", driver_version="580.142")
    assert drv.archive_finding(old, Facts(driver_policy=archive_policy("resolute"),
                                          installed={})) is None
    # an installed driver is the driver check's to judge; a source offering nothing is named
    installed = Facts(driver_policy=archive_policy("noble"), installed={"nvidia-utils-580": "1"})
    assert drv.archive_finding(r, installed) is None
    nothing = drv.archive_finding(rig(platform="ubuntu"), Facts(driver_policy=[], installed={}))
    assert "no apt source of this rig offers nvidia-driver-580-open" in nothing.reason


# --- package work a dead apt or dpkg left half-done (issue 30) ------------------------------

HALF = DpkgWork(packages=("nvidia-kernel-open-dkms", "nvidia-open"))


def test_interrupted_package_work_is_finished_once_and_never_under_running_apt():
    commands, _ = run_op(finish_interrupted, {"DpkgInterrupted": HALF})
    assert shell(commands) == [
        "DEBIAN_FRONTEND=noninteractive dpkg --force-confdef --force-confold --configure -a"]
    journal_only = DpkgWork(journal=True)
    assert journal_only.interrupted
    assert journal_only.describe() == "/var/lib/dpkg/updates/ not empty"
    assert shell(run_op(finish_interrupted, {"DpkgInterrupted": journal_only})[0])
    commands, fake = run_op(finish_interrupted, {"DpkgInterrupted": DpkgWork()})
    assert commands == [] and fake.noops == ["no interrupted package work"]
    busy = DpkgWork(packages=HALF.packages, busy=("4242 bump.sh", "lock /var/lib/dpkg/lock"))
    commands, fake = run_op(finish_interrupted, {"DpkgInterrupted": busy})
    assert commands == [] and fake.noops == [
        "package work under way (4242 bump.sh, lock /var/lib/dpkg/lock): left to finish"]


def test_the_dpkg_fact_reads_the_journal_the_workers_the_locks_and_the_audit():
    command = DpkgInterrupted().command()
    assert "ls -A /var/lib/dpkg/updates" in command and "dpkg --audit; [ $? -le 1 ]" in command
    assert "pgrep -f '/opt/rigbook/driver/[b]ump.sh'" in command  # not its own shell
    assert "/proc/locks" in command and "/var/lib/dpkg/lock-frontend" in command
    work = DpkgInterrupted().process([
        "rigbook-dpkg:journal", "rigbook-dpkg:busy 77 apt-get",
        "rigbook-dpkg:busy lock /var/lib/dpkg/lock-frontend",
    ])
    assert work == DpkgWork(journal=True, busy=("77 apt-get", "lock /var/lib/dpkg/lock-frontend"))
    assert DpkgInterrupted().process([]) == DpkgWork() and not DpkgWork().interrupted


@pytest.mark.parametrize(
    "line", [" Bad-Name summary", " nvidia-open\n", " $(reboot)", "  nvidia-open", " A"])
def test_a_dpkg_audit_line_that_names_no_package_is_a_parse_error(line):
    with pytest.raises(FactProcessError):
        parse_dpkg_audit([line])


AUDITS = [(n, w) for n, w in readings("apt/") if w.get("kind") == "dpkg-audit"]


@pytest.mark.parametrize("name, want", AUDITS, ids=[n for n, _ in AUDITS])
def test_dpkg_audit_as_published(name, want):
    """What --configure -a finishes and what it cannot, from the section headings."""
    text = (REAL / name).read_text().splitlines()
    packages, broken = parse_dpkg_audit(text)
    assert {"configure": list(packages), "reinstall": list(broken)} == want["packages"]
    work = DpkgInterrupted().process(text)
    assert work.interrupted == bool(packages)


def test_the_preflight_says_interrupted_work_and_the_converge_finishes_it_first():
    facts = Facts(dpkg=HALF)
    (finding,) = drv.dpkg_findings(rig(), facts, "rig1")
    assert finding.level == "drift" and drv.DPKG.said
    assert finding.text == (
        "dpkg was interrupted (nvidia-kernel-open-dkms, nvidia-open not fully installed): the "
        "converge runs dpkg --configure -a, then holds the driver")
    busy = Facts(dpkg=DpkgWork(packages=HALF.packages, busy=("9 dpkg",)))
    assert [f.level for f in drv.dpkg_findings(rig(), busy, "rig1")] == ["warn"]
    assert drv.dpkg_findings(rig(), Facts(dpkg=DpkgWork()), "rig1") == []
    assert drv.dpkg_findings(rig(platform="wsl2"), facts, "rig1") == []
    assert drv.DPKG in drv.CHECKS and drv.DPKG not in drv.ONBOARD.reads(rig(), "rig1")
    broken = Facts(dpkg=DpkgWork(broken=("default-jre",)))
    (finding,) = drv.dpkg_findings(rig(), broken, "rig1")  # not interrupted: nothing to finish
    assert finding.level == "warn" and "default-jre need reinstalling" in finding.text
    unread = Facts(unread={"dpkg": "exit 2"})
    assert [f.level for f in drv.dpkg_findings(rig(), unread, "rig1")] == ["error"]
