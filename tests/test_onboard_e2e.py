"""Onboarding a real box, end to end on the dual-3090 sandbox rig (rig1): one test per check.

Each test puts a documented stand-in on the rig (sandbox/simulated/README.md, "Onboarding a
real box"), converges with deploys/rig.py, and sees the rig refused before any change or fixed;
a second converge then changes nothing:

- Secure Boot on (the stand-in mokutil) and no DKMS key: refused, nothing changed; opted in
  (driver_secure_boot: enroll), the key is made and queued for the console step; with Secure
  Boot off the converge goes on;
- nouveau loaded (the stand-in module list, the published `lsmod | grep nouv` lines): blacklisted
  and rebooted away (the sandbox inventory allows reboots);
- headers missing for the running kernel and a second apt source offering a newer driver (a
  repository served on the rig's loopback): the headers are installed from it, and its driver is
  pinned out.
"""

from __future__ import annotations

import base64

import pytest

from rigbook.core.reboot import REBOOT_MARKER
from rigbook.roles.kernel import (
    CONSOLE_STEP,
    MOK_PASSWORD,
    NOUVEAU_CONF,
    OTHER_SOURCES_PREF,
    SIGNING_KEYS,
    SIM_MODULES,
)
from rigbook.sandbox import SIM_DIR
from tests.conftest import ROOT, SANDBOX_INVENTORY, rig_ssh, run_pyinfra
from tests.test_driver_e2e import forget_driver

pytestmark = pytest.mark.sandbox

CONVERGE = "deploys/rig.py"
ENROLL_OP = "NVIDIA driver | Queue the DKMS signing key for enrolment"
MOKUTIL = "/usr/local/sbin/mokutil"
SIM = "/etc/rigbook-sim"
OTHER_REPO = "/var/lib/rigbook-sim/other-repo"
OTHER_LIST = "/etc/apt/sources.list.d/rigbook-sim-other.list"
OTHER_URI = "http://127.0.0.1:8765/"
SERVER_PID = "/run/rigbook-sim-other-repo.pid"
NOUVEAU_LINES = ROOT / "tests/fixtures/real/secureboot/lsmod-grep-nouv-loaded-gdev.txt"


def put(rig: dict, path: str, data: bytes, mode: str = "644") -> None:
    encoded = base64.b64encode(data).decode()
    rig_ssh(rig, f"mkdir -p \"$(dirname {path})\" && echo {encoded} | base64 -d > {path} && "
                 f"chmod {mode} {path}")


def converge(*data: str) -> object:
    return run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1", *data)


def test_secure_boot_on_without_a_key_is_refused_before_any_change(sandbox):
    rig1 = sandbox["rig1"]
    forget_driver(rig1)  # a new box: no nvidia module loaded that the kernel already took
    put(rig1, MOKUTIL, (SIM_DIR / "mokutil").read_bytes(), "755")
    put(rig1, f"{SIM}/secure-boot", b"enabled\n")
    try:
        refused = converge()
        assert refused.returncode != 0, refused.explain()
        assert refused.changed() == {}, refused.explain()
        said = refused.stderr + refused.stdout
        assert "refused before any change, nothing was changed" in said, refused.explain()
        assert "driver_secure_boot: Secure Boot is on and no DKMS signing key exists yet" in said
        assert "sudo dkms generate_mok" in said and "MOK Manager" in said
        # Opted in (driver_secure_boot: enroll): the key is made and queued, the converge goes
        # on, the one-time password stays in its root-only file; the next converge: nothing.
        private, cert = SIGNING_KEYS["debian"]
        enrolled = converge("--data", "driver_secure_boot=enroll")
        assert enrolled.returncode == 0, enrolled.explain()
        assert "rig1" in enrolled.changed()[ENROLL_OP], enrolled.explain()
        assert CONSOLE_STEP in enrolled.stderr, enrolled.explain()
        password = rig_ssh(rig1, f"cat {MOK_PASSWORD}").stdout.strip()
        assert password and password not in enrolled.stdout + enrolled.stderr
        assert rig_ssh(rig1, f"stat -c '%a %U' {MOK_PASSWORD} {private}").stdout.split() == [
            "600", "root", "600", "root"]
        fingerprint = rig_ssh(rig1, f"openssl x509 -inform der -in {cert} -noout -fingerprint "
                                    "-sha1").stdout.strip().split("=", 1)[1].lower()
        assert f"SHA1 Fingerprint: {fingerprint}" in rig_ssh(rig1, "mokutil --list-new").stdout
        again = converge("--data", "driver_secure_boot=enroll")
        assert again.returncode == 0 and again.changed() == {}, again.explain()
        # Secure Boot off: the same rig converges, and a second converge changes nothing.
        put(rig1, f"{SIM}/secure-boot", b"disabled\n")
        first = converge()
        assert first.returncode == 0, first.explain()
        again = converge()
        assert again.returncode == 0 and again.changed() == {}, again.explain()
    finally:
        rig_ssh(rig1, f"rm -f {MOKUTIL} {SIM}/secure-boot {SIM}/mok-new {MOK_PASSWORD} "
                      f"{' '.join(SIGNING_KEYS['debian'])}", check=False)


def test_a_loaded_nouveau_is_blacklisted_and_rebooted_away(sandbox):
    rig1 = sandbox["rig1"]
    settle = converge()  # the driver in place, so that only nouveau is left to do
    assert settle.returncode == 0, settle.explain()
    rig_ssh(rig1, f"rm -f {NOUVEAU_CONF}")
    put(rig1, SIM_MODULES, NOUVEAU_LINES.read_bytes())
    boot = rig_ssh(rig1, "cat /proc/sys/kernel/random/boot_id").stdout
    first = converge()
    assert first.returncode == 0, first.explain()
    changed = first.changed()
    assert changed.get("NVIDIA driver | Blacklist nouveau") == ["rig1"], first.explain()
    assert changed.get("NVIDIA driver | Reboot into the installed driver") == ["rig1"], \
        first.explain()
    assert "blacklist nouveau" in rig_ssh(rig1, f"cat {NOUVEAU_CONF}").stdout.splitlines()
    assert rig_ssh(rig1, "cat /proc/sys/kernel/random/boot_id").stdout != boot  # rebooted
    assert rig_ssh(rig1, f"test -e {SIM_MODULES} || test -e {REBOOT_MARKER}",
                   check=False).returncode != 0
    again = converge()
    assert again.returncode == 0 and again.changed() == {}, again.explain()


#: Run by python3 on the rig: a flat repository with a newer stand-in driver and the running
#: kernel's stand-in headers (sandbox/simulated/README.md).
BUILD_REPO = r'''
import hashlib, os, pathlib, subprocess
release = os.uname().release
repo = pathlib.Path("@REPO@")
repo.mkdir(parents=True, exist_ok=True)
def build(name, version, files):
    tree = pathlib.Path("/tmp/rigbook-sim-pkg") / name
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    (tree / "DEBIAN").mkdir(parents=True)
    control = (f"Package: {name}\nVersion: {version}\nArchitecture: all\n"
               "Maintainer: rigbook sandbox <root@localhost>\n"
               "Description: rigbook sandbox simulation - not a real package\n")
    (tree / "DEBIAN/control").write_text(control)
    for path, text in files.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(text)
    deb = repo / f"{name}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(deb)], check=True,
                   stdout=subprocess.DEVNULL)
    data = deb.read_bytes()
    sums = f"MD5sum: {hashlib.md5(data).hexdigest()}\n"
    sums += f"SHA256: {hashlib.sha256(data).hexdigest()}\n"
    return control + f"Filename: ./{deb.name}\nSize: {len(data)}\n" + sums
stanzas = [
    build("nvidia-open", "580.200.01-1", {}),
    build(f"linux-headers-{release}", "1.0-1",
          {f"lib/modules/{release}/build/Makefile": "# SIMULATED kernel headers\n"}),
]
(repo / "Packages").write_text("\n".join(stanzas))
print(release)
'''.replace("@REPO@", OTHER_REPO)


def test_missing_headers_installed_and_a_second_source_pinned_out(sandbox):
    rig1 = sandbox["rig1"]
    settle = converge()
    assert settle.returncode == 0, settle.explain()
    put(rig1, "/tmp/rigbook-sim-build-repo.py", BUILD_REPO.encode())
    release = rig_ssh(rig1, "python3 /tmp/rigbook-sim-build-repo.py").stdout.strip()
    headers = f"linux-headers-{release}"
    try:
        # the server in a session of its own, no fd left to the SSH session (or ssh waits)
        rig_ssh(rig1, f"mkdir -p /lib/modules/{release}; ( setsid python3 -m http.server 8765 "
                      f"--bind 127.0.0.1 --directory {OTHER_REPO} >/dev/null 2>&1 </dev/null & "
                      f"echo $! > {SERVER_PID} )")
        rig_ssh(rig1, f"echo 'deb [trusted=yes] {OTHER_URI} ./' > {OTHER_LIST} && sleep 1 && "
                      "apt-get update -qq")
        offered = rig_ssh(rig1, "apt-cache madison nvidia-open").stdout
        assert "580.200.01-1" in offered, offered
        first = converge()
        assert first.returncode == 0, first.explain()
        changed = first.changed()
        assert changed.get("NVIDIA driver | Headers for the running kernel") == ["rig1"], \
            first.explain()
        assert changed.get("NVIDIA driver | Pin out other sources of the driver") == ["rig1"], \
            first.explain()
        said = first.stderr + first.stdout
        assert "other apt sources offer the NVIDIA driver: 127.0.0.1" in said, first.explain()
        assert rig_ssh(rig1, f"test -e /lib/modules/{release}/build/Makefile",
                       check=False).returncode == 0
        pref = rig_ssh(rig1, f"cat {OTHER_SOURCES_PREF}").stdout
        assert 'Pin: origin "127.0.0.1"' in pref and "Pin-Priority: -1" in pref
        policy = rig_ssh(rig1, "apt-cache policy nvidia-open").stdout
        assert "580.200.01-1 -1" in policy, policy
        installed = rig_ssh(rig1, "dpkg-query -W -f='${Version}' nvidia-open").stdout
        assert installed == "580.95.05-1"
        again = converge()
        assert again.returncode == 0 and again.changed() == {}, again.explain()
    finally:
        rig_ssh(rig1, f"kill \"$(cat {SERVER_PID})\"; rm -rf {SERVER_PID} {OTHER_LIST} "
                      f"{OTHER_REPO} {OTHER_SOURCES_PREF} /tmp/rigbook-sim-pkg; "
                      f"DEBIAN_FRONTEND=noninteractive apt-get purge -y {headers} >/dev/null; "
                      f"rm -rf /lib/modules/{release}; apt-get update -qq", check=False)
