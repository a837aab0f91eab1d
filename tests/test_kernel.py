"""rigbook.roles.kernel: nouveau, Secure Boot and the DKMS key, headers, DKMS per kernel, other
sources.

Every parser reads the published outputs of tests/fixtures/real/ (SOURCES.md gives each URL)
against the reading a person wrote in expected.json; the findings and the operations run on
facts the tests give, as tests/test_driver.py does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from rigbook.core import reboot
from rigbook.core.checks import Facts, batch_command, process_output
from rigbook.core.render import render
from rigbook.core.spec import Rig
from rigbook.roles import driver as drv
from rigbook.roles import kernel as kern
from rigbook.roles.wsl import WslSignals
from tests.opkit import describe, file_states, run_op, shell
from tests.test_real_fixtures import REAL, readings


def rig(**data) -> Rig:
    base = {"platform": "ubuntu", "gpu_class": "rtx3090", "gpu_count": 2}
    return Rig(**{**base, **data})


def lines(name: str) -> list[str]:
    return (REAL / name).read_text().splitlines()


# --- the parsers on published outputs -------------------------------------------------------


def _of(kind: str):
    return [(n, w) for n, w in readings("secureboot/") if w["kind"] == kind]


@pytest.mark.parametrize("name, want", _of("sb-state"), ids=[n for n, _ in _of("sb-state")])
def test_sb_state_as_published(name, want):
    assert kern.parse_sb_state(lines(name)) is want["enabled"]


@pytest.mark.parametrize("name, want", _of("list-enrolled"),
                         ids=[n for n, _ in _of("list-enrolled")])
def test_mok_listings_as_published(name, want):
    keys = kern.parse_mok_listing(lines(name))
    assert [{k: asdict(key)[k] for k in wanted} for key, wanted in zip(keys, want["keys"],
                                                                          strict=True)] \
        == want["keys"]


@pytest.mark.parametrize("name, want", _of("dkms-status"), ids=[n for n, _ in _of("dkms-status")])
def test_dkms_status_as_published(name, want):
    status = kern.parse_dkms_status(lines(name))
    assert [{k: asdict(m)[k] for k in ("module", "version", "kernel", "state")}
            for m in status.modules] == want["modules"]
    assert [e.message for e in status.errors][:1] == ([want["error"]] if want.get("error") else [])
    # each error with the module, version and kernel it names (issue 35)
    assert [{k: asdict(e)[k] for k in ("module", "version", "kernel")}
            for e in status.errors] == want.get("errors", [])


@pytest.mark.parametrize("name, want", _of("lsmod"), ids=[n for n, _ in _of("lsmod")])
def test_lsmod_as_published(name, want):
    assert kern.parse_lsmod(lines(name)) == want["loaded"]


POLICIES = [(n, w) for n, w in readings("apt/") if w.get("kind") == "apt-policy"]


@pytest.mark.parametrize("name, want", POLICIES, ids=[n for n, _ in POLICIES])
def test_apt_policy_as_published(name, want):
    (policy,) = kern.parse_apt_policy(lines(name))
    assert policy.package == want["package"]
    assert [{**asdict(v), "origins": list(v.origins)} for v in policy.versions] == want["versions"]


def test_dkms_notes_and_the_added_state():
    (diff,) = kern.parse_dkms_status(lines("secureboot/dkms-status-diff-warning.txt")).modules
    assert diff.note == "(WARNING! Diff between built and installed module!)"
    # dkms' own grammar for a module added but not built (no kernel, no arch yet).
    (added,) = kern.parse_dkms_status(["nvidia/580.95.05: added"]).modules
    assert (added.module, added.version, added.kernel, added.state) == \
        ("nvidia", "580.95.05", None, "added")


def test_other_sources_from_published_policies():
    debian = rig(platform="debian")
    cuda = kern.parse_apt_policy(lines("apt/policy-nvidia-driver-de-cuda-debian12-cut.txt"))
    assert kern.other_sources(cuda, debian, drv.CUDA_REPO) == {}  # the configured repo only
    two = kern.parse_apt_policy(lines("apt/policy-fabricmanager-two-cuda-repos-pinned-out.txt"))
    others = kern.other_sources(two, debian, drv.CUDA_REPO)
    assert sorted(others) == [
        "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2004/x86_64",
        "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64",
    ]
    assert all(priority == -1 for offered in others.values() for _, priority in offered)
    # Ubuntu: Pop!_OS' own archive mirror is not Ubuntu's archive, so it counts as another.
    pop = kern.parse_apt_policy(lines("apt/policy-nvidia-driver-470-popos-pins.txt"))
    assert "http://apt.pop-os.org/ubuntu" in kern.other_sources(pop, rig(), drv.CUDA_REPO)
    assert kern.is_configured("http://de.archive.ubuntu.com/ubuntu", rig(), drv.CUDA_REPO)
    assert not kern.is_configured(
        "https://ppa.launchpadcontent.net/graphics-drivers/ppa/ubuntu", rig(), drv.CUDA_REPO)


# --- the facts' output ------------------------------------------------------------------------


def test_secure_boot_fact_from_published_lines():
    enrolled = lines("secureboot/mokutil-listing-key-boundary-owner.txt")
    out = ["##mokutil", "##sb-state", *lines("secureboot/mokutil-sb-state-enabled.txt"),
           "##key /var/lib/dkms/mok.pub",
           "sha1 Fingerprint=27:DD:CA:C4:01:D4:66:E6:EC:68:00:F9:42:58:49:D9:65:B7:AA:56",
           "##enrolled", *enrolled, "##new", "MokNew is empty"]
    sb = kern.SecureBootFact().process(out)
    assert sb.enabled is True and sb.key_state() == ("/var/lib/dkms/mok.pub", "enrolled")
    other = kern.SecureBootFact().process(
        [*out[:4], "sha1 Fingerprint=AA:BB", "##enrolled", "MokListRT is empty", "##new"])
    assert other.key_state() == ("/var/lib/dkms/mok.pub", "not enrolled")
    queued = kern.SecureBootFact().process([*out[:4], "sha1 Fingerprint=AA:BB", "##enrolled",
                                            "##new", "[key 1]", "SHA1 Fingerprint: aa:bb"])
    assert queued.key_state() == ("/var/lib/dkms/mok.pub", "queued")
    bios = kern.SecureBootFact().process(
        ["##mokutil", "##sb-state", *lines("secureboot/mokutil-efi-not-supported-vm.txt")])
    assert bios.enabled is None and bios.text == "EFI variables are not supported on this system"
    assert kern.SecureBootFact().process(["##sb-state", "sh: mokutil: not found"]).mokutil is False


def test_nouveau_and_kernels_facts():
    loaded = kern.NouveauFact().process(
        ["##modules", *lines("secureboot/lsmod-grep-nouv-loaded-gdev.txt"), "##blacklist"])
    assert loaded.loaded and loaded.blacklisted_by == ()
    clean = kern.NouveauFact().process(
        ["##modules", *lines("secureboot/lsmod-full-no-nvidia-no-nouveau.txt"), "##blacklist",
         kern.NOUVEAU_CONF])
    assert not clean.loaded and clean.blacklisted_by == (kern.NOUVEAU_CONF,)
    # /proc/modules' own format (lsmod without its header)
    proc = ["nouveau 3096576 0 - Live 0x0000000000000000", "ttm 110592 1 nouveau, Live 0x0"]
    assert kern.NouveauFact().process(["##modules", *proc]).loaded
    kernels = kern.KernelsFact().process(
        ["running 6.8.0-45-generic", "kernel 6.8.0-45-generic", "kernel 6.8.0-48-generic",
         "modules 6.8.0-45-generic", "modules 6.8.0-48-generic", "headers 6.8.0-48-generic"])
    assert kernels.own and kernels.installed == ("6.8.0-45-generic", "6.8.0-48-generic")
    assert kernels.headers == {"6.8.0-48-generic"}
    assert not kern.KernelsFact().process(["running 6.1.0-28-amd64"]).own  # a container


def test_one_round_trip_reads_them_all():
    reads = drv._onboard_reads(rig(), "rig1")
    assert [r.name for r in reads] == ["secure_boot", "kernels", "dkms", "nouveau",
                                       "driver_policy", "signed_modules", "probe",
                                       "driver_source", "installed", "loaded"]
    assert reads[-1] in drv._driver_reads(rig(), "rig1")  # the same fact, read once
    command = batch_command(reads).get_raw_value()
    assert "mokutil --sb-state" in command and "LC_ALL=C apt-cache policy nvidia-driver-580-open" \
        in command
    assert 'apt-cache show --no-all-versions "linux-modules-nvidia-580-open-$f"' in command
    assert "signed_modules" not in [r.name for r in drv._onboard_reads(rig(platform="debian"),
                                                                       "rig1")]
    assert drv._onboard_reads(rig(platform="wsl2"), "rig3") == []
    assert drv.ONBOARD in drv.CHECKS


def test_the_signed_modules_command_runs_here():
    """This machine's kernel is not of Ubuntu's scheme: the running kernel, and no package."""
    command = kern.SignedModulesFact().command(580, False, True)
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    found = kern.SignedModulesFact().process(out.stdout.splitlines())
    assert found == kern.SignedModules(running=os.uname().release)
    server = kern.SignedModulesFact().command(595, True, False)
    assert '"linux-modules-nvidia-595-server-$f"' in server


def test_main_package_is_what_plan_driver_installs():
    wsl = WslSignals(kernel="6.8.0-45-generic", interop=False, run_wsl=False)
    ubuntu = {"name": "Ubuntu", "release_meta": {"VERSION_ID": "24.04"}}
    for data in ({}, {"driver_open": False}, {"driver_server": True}, {"driver_branch": 595}):
        r = rig(**data)
        assert drv.plan_driver(r, "rig1", ubuntu, wsl, "x86_64").packages[0] == \
            drv.main_package(r)
    debian = {"name": "Debian", "major": 12, "release_meta": {"VERSION_ID": "12"}}
    for data in ({}, {"driver_open": False}):
        r = rig(platform="debian", **data)
        assert drv.plan_driver(r, "rig1", debian, wsl, "x86_64").packages[0] == \
            drv.main_package(r)


# --- the findings -----------------------------------------------------------------------------

OWN = kern.Kernels("6.8.0-45-generic", ("6.8.0-45-generic",), frozenset({"6.8.0-45-generic"}),
                   frozenset({"6.8.0-45-generic"}))
BUILT = kern.DkmsStatus((kern.DkmsModule("nvidia", "580.95.05", "6.8.0-45-generic", "x86_64",
                                         "installed"),))


def findings(r: Rig | None = None, **facts):
    base = {"secure_boot": kern.SecureBoot(enabled=False, mokutil=True), "kernels": OWN,
            "dkms": BUILT, "nouveau": kern.Nouveau(blacklisted_by=(kern.NOUVEAU_CONF,)),
            "driver_policy": []}
    return kern.onboard_findings(r or rig(), Facts(**{**base, **facts}), "rig1", drv.CUDA_REPO)


def test_a_clean_box_has_nothing_to_say():
    assert findings() == []
    assert findings(rig(platform="wsl2")) == []
    # no mokutil: Secure Boot is unknown, nothing refused on it
    assert findings(secure_boot=kern.SecureBoot()) == []


def test_secure_boot_on_without_an_enrolled_key_is_refused_with_the_steps():
    sb = kern.SecureBoot(enabled=True, mokutil=True, keys={kern.DKMS_KEYS[1]: "aa:bb"})
    (found,) = findings(secure_boot=sb)
    assert found.level == "error" and found.key == "driver_secure_boot"
    assert "not enrolled" in found.reason and "update-secureboot-policy --enroll-key" in \
        found.reason and "MOK Manager" in found.reason
    (fresh,) = findings(rig(platform="debian"),
                        secure_boot=kern.SecureBoot(enabled=True, mokutil=True))
    assert "no DKMS signing key exists yet" in fresh.reason and "dkms generate_mok" in \
        fresh.reason
    (opted,) = findings(rig(driver_secure_boot="enroll"), secure_boot=sb)
    assert opted.level == "drift" and "queues its enrolment" in opted.reason
    assert kern.CONSOLE_STEP in opted.reason
    unreadable = kern.SecureBoot(enabled=True, mokutil=True, keys={kern.DKMS_KEYS[1]: ""})
    (cannot,) = findings(rig(driver_secure_boot="enroll"), secure_boot=unreadable)
    assert cannot.level == "error" and "could not be read" in cannot.reason
    # a loaded module was accepted by the kernel: a warning for the next build, not a refusal
    (running,) = findings(secure_boot=sb, loaded="580.95.05")
    assert running.level == "warn" and "a module DKMS builds next" in running.reason
    enrolled = kern.SecureBoot(enabled=True, mokutil=True, keys={kern.DKMS_KEYS[0]: "aa:bb"},
                               enrolled=frozenset({"aa:bb"}))
    assert findings(secure_boot=enrolled) == []
    queued = kern.SecureBoot(enabled=True, mokutil=True, keys={kern.DKMS_KEYS[0]: "aa:bb"},
                             queued=frozenset({"aa:bb"}))
    assert [f.level for f in findings(secure_boot=queued)] == ["drift"]


def test_nouveau_headers_dkms_and_other_sources():
    (loaded,) = findings(nouveau=kern.Nouveau(loaded=True))
    assert loaded.level == "drift" and "not blacklisted" in loaded.reason
    (waiting,) = findings(nouveau=kern.Nouveau(loaded=True, blacklisted_by=(kern.NOUVEAU_CONF,)))
    assert "reboot pending" in waiting.reason
    (unlisted,) = findings(nouveau=kern.Nouveau())
    assert unlisted.level == "drift" and "not blacklisted" in unlisted.reason
    no_headers = kern.Kernels(OWN.running, OWN.installed, OWN.modules, frozenset())
    (headers,) = findings(kernels=no_headers)
    assert "linux-headers-6.8.0-45-generic" in headers.reason
    container = kern.Kernels("6.1.0-28-amd64")
    assert findings(kernels=container, dkms=kern.DkmsStatus()) == []
    upgraded = kern.Kernels(OWN.running, (*OWN.installed, "6.8.0-48-generic"), OWN.modules,
                            OWN.headers)
    (unbuilt,) = findings(kernels=upgraded)
    assert unbuilt.level == "drift" and "6.8.0-48-generic has no nvidia module" in unbuilt.reason
    published = kern.parse_dkms_status(
        lines("secureboot/dkms-status-error-then-nvidia570-two-kernels.txt"))
    two = kern.Kernels("6.16.3-76061603-generic",
                       ("6.12.10-76061203-generic", "6.16.3-76061603-generic"))
    assert [f.level for f in findings(kernels=two, dkms=published)] == ["warn"]
    ppa = kern.AptPolicy("nvidia-driver-580-open", (
        kern.PolicyVersion("580.105.08-0ubuntu1", 500, False,
                           ("https://ppa.launchpadcontent.net/graphics-drivers/ppa/ubuntu",)),
        kern.PolicyVersion("580.95.05-0ubuntu0.24.04.2", 500, True,
                           ("http://archive.ubuntu.com/ubuntu",)),
    ))
    (other,) = findings(driver_policy=[ppa])
    assert other.level == "warn" and "580.105.08-0ubuntu1" in other.reason and "pins it out" in \
        other.reason
    pinned = kern.AptPolicy(ppa.package, (
        kern.PolicyVersion("580.105.08-0ubuntu1", -1, False, ppa.versions[0].origins),))
    assert findings(driver_policy=[pinned]) == []


def test_unread_facts_refuse():
    facts = process_output(drv._onboard_reads(rig(), "rig1"), ["##RIGBOOK_FACT## kernels"])
    found = kern.onboard_findings(rig(), facts, "rig1", drv.CUDA_REPO)
    assert found and all(f.level == "error" for f in found)


# --- the operations ---------------------------------------------------------------------------

ABSENT = {"FileStates": file_states()}


def enroll_commands(secure_boot: kern.SecureBoot, **data) -> tuple[list, object]:
    return run_op(kern.enroll_dkms_key, {"SecureBootFact": secure_boot},
                  rig=rig(driver_secure_boot="enroll", **data))


def test_enroll_makes_the_key_and_queues_it_with_no_password_in_any_command(tmp_path):
    """The commands run here for real: openssl makes the pair, the sandbox's stand-in mokutil
    (RIGBOOK_SIM_ROOT) queues it, and the SecureBootFact reads the key as queued."""
    commands, fake = enroll_commands(kern.SecureBoot(enabled=True, mokutil=True),
                                     platform="debian")
    private, cert = kern.SIGNING_KEYS["debian"]
    texts = [c.get_raw_value() for c in commands if hasattr(c, "get_raw_value")]
    assert f"-keyout {private} -out {cert}" in texts[0] and "mokutil --import" in texts[1]
    here = {path: str(tmp_path / path.lstrip("/"))
            for path in (private, cert, kern.MOK_PASSWORD, str(Path(cert).parent))}
    pattern = "|".join(map(re.escape, sorted(here, key=len, reverse=True)))  # files first
    script = re.sub(pattern, lambda match: here[match.group(0)], "\n".join(texts))
    assert "/var/lib" not in script.replace(f"{tmp_path}/var/lib", "")  # nothing outside tmp
    (tmp_path / "root").mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mokutil").symlink_to(kern_sim_mokutil())
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "RIGBOOK_SIM_ROOT": str(tmp_path)}
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    password = Path(here[kern.MOK_PASSWORD])
    assert oct(password.stat().st_mode & 0o777) == "0o600"
    assert oct(Path(here[private]).stat().st_mode & 0o777) == "0o600"
    secret = password.read_text().strip()
    assert len(secret) == 16 and all(secret not in text for text in texts)
    assert secret not in done.stdout + done.stderr
    fingerprint = subprocess.run(["openssl", "x509", "-inform", "der", "-in", here[cert],
                                  "-noout", "-fingerprint", "-sha1"], capture_output=True,
                                 text=True, check=True).stdout.strip()
    listing = subprocess.run([str(bin_dir / "mokutil"), "--list-new"], env=env,
                             capture_output=True, text=True).stdout.splitlines()
    fact = kern.SecureBootFact().process(["##mokutil", "##sb-state", "SecureBoot enabled",
                                          f"##key {cert}", fingerprint, "##enrolled",
                                          "MokListRT is empty", "##new", *listing])
    assert fact.key_state() == (cert, "queued")
    # queued (or enrolled) already, Secure Boot off, or not opted in: nothing to do
    assert enroll_commands(fact)[0] == []
    assert enroll_commands(kern.SecureBoot(enabled=False, mokutil=True))[0] == []
    assert run_op(kern.enroll_dkms_key, {"SecureBootFact": kern.SecureBoot(enabled=True)},
                  rig=rig())[0] == []


def test_enroll_uses_an_existing_key_and_refuses_an_unreadable_one():
    key = kern.DKMS_KEYS[1]
    commands, _ = enroll_commands(kern.SecureBoot(enabled=True, mokutil=True, keys={key: "aa"}))
    (only,) = [c.get_raw_value() for c in commands if hasattr(c, "get_raw_value")]
    assert only.endswith(f"mokutil --import {key}") and "openssl req" not in only
    commands, _ = enroll_commands(kern.SecureBoot(enabled=True, mokutil=True, keys={key: ""}))
    assert [describe(c) for c in commands] == ["call _log_refusal"]


def kern_sim_mokutil() -> Path:
    from rigbook.sandbox import SIM_DIR

    return SIM_DIR / "mokutil"


def test_blacklist_nouveau():
    text = (kern.TEMPLATES / "blacklist-nouveau.conf").read_text()
    assert "blacklist nouveau" in text.splitlines()
    loaded = {"NouveauFact": kern.Nouveau(loaded=True), "RebootMarker": []}
    commands, _ = run_op(kern.blacklist_nouveau, {**ABSENT, **loaded})
    steps = [describe(c) for c in commands]
    assert steps[1:] == [
        f"upload {kern.NOUVEAU_CONF}",
        f"chmod 644 {kern.NOUVEAU_CONF}",
        "if command -v update-initramfs >/dev/null 2>&1; then update-initramfs -u; fi",
        "mkdir -p /run/rigbook && echo 'nouveau is loaded (blacklisted, the initramfs rebuilt)'"
        f" >> {reboot.REBOOT_MARKER}",
    ]
    # already written and the reboot recorded: nothing to do
    same = {"FileStates": file_states({kern.NOUVEAU_CONF: text})}
    reason = "nouveau is loaded (blacklisted, the initramfs rebuilt)"
    commands, fake = run_op(kern.blacklist_nouveau, {**same, **loaded, "RebootMarker": [reason]})
    assert commands == []
    commands, fake = run_op(kern.blacklist_nouveau,
                            {**same, "NouveauFact": kern.Nouveau(), "RebootMarker": []})
    assert commands == [] and fake.noops[-1] == "nouveau is blacklisted and not loaded"


def test_kernel_headers():
    def kernels(running, modules=(), headers=()):
        return {"KernelsFact": kern.Kernels(running, (), frozenset(modules), frozenset(headers))}

    k = "6.8.0-45-generic"
    commands, _ = run_op(kern.kernel_headers, kernels(k, [k]))
    (command,) = shell(commands)
    assert command.endswith("apt-get -y -o Dpkg::Options::=\"--force-confdef\" -o "
                            "Dpkg::Options::=\"--force-confold\" install "
                            "linux-headers-6.8.0-45-generic")
    commands, fake = run_op(kern.kernel_headers, kernels(k, [k], [k]))
    assert commands == [] and "installed" in fake.noops[0]
    commands, fake = run_op(kern.kernel_headers, kernels("6.1.0-28-amd64"))
    assert commands == [] and "not this system's" in fake.noops[0]
    commands, _ = run_op(kern.kernel_headers, kernels("6.8.0;reboot", ["6.8.0;reboot"]))
    assert shell(commands) == []  # refused, nothing run


def test_pin_out_sources():
    conf = kern.OtherSourcesConf(("ppa.launchpadcontent.net",), drv.DRIVER_PACKAGE_GLOBS)
    text = render(kern.TEMPLATES / "other-sources.pref.j2", cfg=conf)
    stanza = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert stanza[1:] == [
        f"Package: {' '.join(drv.DRIVER_PACKAGE_GLOBS)}",
        'Pin: origin "ppa.launchpadcontent.net"',
        "Pin-Priority: -1",
    ]
    assert kern.pinnable("https://ppa.launchpadcontent.net/graphics-drivers/ppa/ubuntu")
    assert not kern.pinnable("file:/srv/rigbook-sim-repo")
    debian = rig(platform="debian", driver_repo_uri="file:/srv/rigbook-sim-repo",
                 driver_repo_trusted=True)
    own = kern.PolicyVersion("580.95.05-1", 1001, True, ("file:/srv/rigbook-sim-repo",))
    newer = kern.PolicyVersion("580.200.01-1", 500, False, ("http://127.0.0.1:8765",))
    local = kern.PolicyVersion("580.300.01-1", 500, False, ("file:/srv/other",))
    policy = [kern.AptPolicy("nvidia-open", (newer, local, own))]
    assert kern.pin_targets(policy, debian, drv.CUDA_REPO) == ["http://127.0.0.1:8765"]
    # the configured source does not offer the driver (yet): nothing is pinned out
    assert kern.pin_targets([kern.AptPolicy("nvidia-open", (newer,))], debian,
                            drv.CUDA_REPO) == []
    # a mirror of the configured source offers the same versions: not another source
    mirror = kern.PolicyVersion("580.95.05-1", 1001, True, ("http://mirror.example",))
    assert kern.other_sources([kern.AptPolicy("nvidia-open", (own, mirror))], debian,
                              drv.CUDA_REPO) == {}
    facts = {**ABSENT, "AptPolicyFact": lambda packages: policy}
    commands, _ = run_op(kern.pin_out_sources, facts, rig=debian, packages=("nvidia-open",),
                         default_repo=drv.CUDA_REPO, globs=drv.DRIVER_PACKAGE_GLOBS)
    assert [describe(c) for c in commands][-1] == "call _log_warning"
    facts = {**ABSENT, "AptPolicyFact": lambda packages: [kern.AptPolicy("nvidia-open", (own,))]}
    commands, _ = run_op(kern.pin_out_sources, facts, rig=debian, packages=("nvidia-open",),
                         default_repo=drv.CUDA_REPO, globs=drv.DRIVER_PACKAGE_GLOBS)
    assert commands == []  # nothing to pin, no file to remove


def test_expected_json_lists_the_new_readings():
    data = json.loads((REAL / "expected.json").read_text())["files"]
    assert data["secureboot/lsmod-grep-nouv-loaded-gdev.txt"]["loaded"][0] == "nouveau"


def test_each_dkms_error_names_its_module_version_and_kernel():
    """The warning says which module is broken (issue 35: the "File:" line was dropped)."""
    stale = kern.parse_dkms_status(lines("secureboot/dkms-status-error-no-dkms-conf.txt"))
    (found,) = findings(dkms=kern.DkmsStatus(BUILT.modules, stale.errors))
    assert found.level == "warn"
    assert found.reason == ("dkms status: Could not locate dkms.conf file. (module nvidia "
                            "390.48)")
    build = kern.parse_dkms_status(lines("secureboot/dkms-install-bad-return-580-two-kernels.txt"))
    assert [f.reason for f in findings(dkms=kern.DkmsStatus(BUILT.modules, build.errors))] == [
        "dkms status: Bad return status for module build on kernel: 7.0.9-1-cachyos (x86_64) "
        "(module nvidia 580.119.02, kernel 7.0.9-1-cachyos)",
        "dkms status: Bad return status for module build on kernel: 7.1.0-rc3-2-cachyos-rc "
        "(x86_64) (module nvidia 580.119.02, kernel 7.1.0-rc3-2-cachyos-rc)"]
    evdi = "secureboot/dkms-status-error-empty-file-evdi-added.txt"
    unnamed = kern.parse_dkms_status(lines(evdi))
    assert unnamed.errors[0].text == "Could not locate dkms.conf file. (dkms names no module)"
