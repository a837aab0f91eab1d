"""Sandbox rigs of other releases, without booting one: which rootfs a profile gets, where an
Ubuntu rootfs comes from, and the stand-in packages with Ubuntu's names."""

from __future__ import annotations

import shutil

import pytest

from rigbook import sandbox


def test_profiles_name_their_release_and_the_rotation_stays_debian_12():
    profiles = sandbox._load_json("profiles.json")
    assert {p: sandbox.release_of(p).suite for p in profiles["rotation"]} == {
        "dual-3090": "bookworm", "single-4090": "bookworm", "wsl2-3090": "bookworm"}
    assert sandbox.release_of("noble-3090").version == "24.04"
    assert sandbox.release_of("resolute-4090").version == "26.04"
    assert sandbox.release_of("trixie-4090").distro == "debian"
    ubuntu = sandbox.RELEASES["noble"].include
    assert "unattended-upgrades" in ubuntu and "python3-venv" not in ubuntu


def test_the_ubuntu_mirror_is_debootstraps_own_over_https_unless_one_is_named(monkeypatch):
    if not (shutil.which("debootstrap")):
        pytest.skip("needs debootstrap's scripts")
    monkeypatch.delenv("RIGBOOK_UBUNTU_MIRROR", raising=False)
    mirror = sandbox.ubuntu_mirror()
    assert mirror.startswith("https://") and mirror.endswith("/ubuntu")
    assert "old-releases" not in mirror and "ports" not in mirror
    monkeypatch.setenv("RIGBOOK_UBUNTU_MIRROR", "http://10.0.0.5/ubuntu")
    assert sandbox.ubuntu_mirror() == "http://10.0.0.5/ubuntu"
    sources = sandbox._ubuntu_sources("noble", "/k.gpg")
    assert "Suites: noble noble-updates noble-security\n" in sources
    assert "Components: main restricted universe\n" in sources


def stanzas(packages: str) -> dict[tuple[str, str], dict]:
    found = {}
    for stanza in packages.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line)
        found[fields["Package"], fields["Version"]] = fields
    return found


@pytest.mark.skipif(shutil.which("dpkg-scanpackages") is None, reason="needs dpkg-dev")
def test_the_ubuntu_stand_ins_carry_ubuntus_names_and_version_scheme(tmp_path):
    repo = sandbox.build_sim_repo(tmp_path / "repo", sandbox.RELEASES["resolute"])
    built = stanzas((repo / "Packages").read_text())
    version = "580.178.04-0ubuntu0.26.04.1"
    assert set(built) == {(name, version) for name in (
        "nvidia-driver-580-open", "nvidia-dkms-580-open", "libnvidia-compute-580",
        "nvidia-utils-580", "nvidia-compute-utils-580")}
    meta = built["nvidia-driver-580-open", version]
    assert meta["Depends"].split(", ") == [f"{name} (= {version})" for name in (
        "nvidia-dkms-580-open", "libnvidia-compute-580", "nvidia-utils-580",
        "nvidia-compute-utils-580")]
    newer = sandbox.build_sim_repo(tmp_path / "newer", sandbox.RELEASES["noble"],
                                   ["580.190.01-0ubuntu0.{version_id}.1"])
    assert {v for _, v in stanzas((newer / "Packages").read_text())} == {
        "580.190.01-0ubuntu0.24.04.1"}
    debian = stanzas((sandbox.build_sim_repo(tmp_path / "deb", sandbox.RELEASES["trixie"])
                      / "Packages").read_text())
    assert ("nvidia-open", "580.95.05-1") in debian
