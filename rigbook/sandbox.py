"""Sandbox rigs: local systemd-nspawn containers that stand in for GPU rigs.

Each rig boots real systemd as PID 1 from an overlay of one cached Debian bookworm rootfs, in its
own network namespace and its own cgroup, and carries the simulated GPU layer of
sandbox/simulated/. A profile with `"systemd": false` (nosystemd-4090, started by `add` for the
tests that need it) runs sshd directly instead, with no systemctl: a GPU container's shape.
Everything made on this machine is named `rigbook-rigI` (network namespace, host-side veth,
cgroup folders) or lives under the state dir, so any run can find and remove what
an interrupted one left. RIGBOOK_SANDBOX_SET=N (1-9) keeps another set of rigs beside that one,
for e2e tests run on parallel workers: named `rigbookN-rigI`, on 10.(231+N).I.0/24, with its own
state dir; each set's commands see and remove only their own set's rigs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from rigbook.core.errors import RigbookError

log = logging.getLogger(__name__)

SUITE = "bookworm"
INCLUDE = (
    "openssh-server",
    "python3",
    "python3-venv",
    "sudo",
    "systemd",
    "systemd-sysv",
    "dbus",
    "apt-utils",
    "iproute2",
    "procps",
    "ca-certificates",
    "kmod",
)
# Ubuntu's minbase lacks python3-venv in main; unattended-upgrades brings Ubuntu's own config.
UBUNTU_INCLUDE = (*(p for p in INCLUDE if p != "python3-venv"), "unattended-upgrades")
# Bump when _prepare_rootfs changes what goes into the cached tarball (UBUNTU_RECIPE: only
# into Ubuntu's).
ROOTFS_RECIPE = 1
UBUNTU_RECIPE = 3


@dataclass(frozen=True)
class Release:
    """A distribution release a rig can run: what debootstrap builds its rootfs from."""

    suite: str
    distro: str  # "debian" or "ubuntu"
    version: str  # VERSION_ID, as the docs and the tests name it
    include: tuple[str, ...] = INCLUDE
    #: Its systemd needs the unified cgroup hierarchy: 256 and later refuse to run as PID 1 on
    #: the legacy one, which nspawn gives a container on a hybrid host unless told otherwise.
    unified_cgroups: bool = False


#: The releases of sandbox rigs (a profile's "release"; bookworm when it names none).
RELEASES = {
    "bookworm": Release("bookworm", "debian", "12"),
    "trixie": Release("trixie", "debian", "13"),
    "noble": Release("noble", "ubuntu", "24.04", UBUNTU_INCLUDE),
    "resolute": Release("resolute", "ubuntu", "26.04", UBUNTU_INCLUDE, unified_cgroups=True),
}
#: debootstrap's script for every Ubuntu release since 7.10 (newer suites may lack a link).
UBUNTU_SCRIPT = "gutsy"
#: Ubuntu's pockets and components whose real indexes an Ubuntu rig keeps (UBUNTU_LISTS).
UBUNTU_POCKETS = ("", "-updates", "-security")
#: universe too, as an Ubuntu install's own sources have it: on 2026-12-04 26.04's -updates/main
#: libllvm22 (which the driver's mesa dependencies pull in) depended on universe's libz3-4, and
#: nvidia-driver-580-open did not resolve from main and restricted alone.
UBUNTU_COMPONENTS = ("main", "restricted", "universe")
#: On an Ubuntu rig: Ubuntu's real package indexes of its release, read when the rootfs was
#: built, and the source list they belong to; apt reads them only when told to (the rig has
#: no route out, so its own sources hold only the local repository).
UBUNTU_LISTS = "/var/lib/rigbook-sim/ubuntu-lists"
UBUNTU_SOURCES = "/etc/rigbook-sim/ubuntu-archive.sources"
#: The local repository as an Ubuntu rig's own apt source (its driver comes from its sources).
SIM_SOURCES = "etc/apt/sources.list.d/rigbook-sim.sources"
#: Primary key fingerprints that may sign an Ubuntu release's InRelease: the "Ubuntu Archive
#: Automatic Signing Key (2018)", as the rootfs's own ubuntu-keyring carries it. The rootfs is
#: kept only when its InRelease verifies against one of these.
UBUNTU_SIGNERS = frozenset({"F6ECB3762474EDA9D21B7022871920D1991BC93C"})
PREFIX = "rigbook-"
RIG_NAME = re.compile(r"rig(\d+)")
SUBNET = "10.231"
MAX_RIGS = 200
SET_ENV = "RIGBOOK_SANDBOX_SET"
#: Sets beside the default one (0): one digit keeps `rigbookN-rig200` within an interface
#: name's 15 characters.
MAX_SET = 9
SSH_WAIT_S = 60
STOP_WAIT_S = 20
REBOOT_EXIT = 133
REPO_MOUNT = "/srv/rigbook-sim-repo"
# Rigs have no route out: Python packages reach them from this machine's wheelhouse, read-only.
WHEELS_MOUNT = "/srv/rigbook-wheels"
SIM_DIR = Path(str(files("rigbook.simulated")))
TOOLS = (
    "debootstrap",
    "systemd-nspawn",
    "systemctl",
    "ip",
    "tar",
    "zstd",
    "ssh-keygen",
    "dpkg-deb",
    "dpkg-scanpackages",
)
# Runs each rig's nspawn from the rig's own cgroup (several --keep-unit containers started from
# one cgroup share a system.slice and fail with 219/CGROUP) and boots it again when the rig asks
# for a reboot: nspawn exits with 133 then.
SUPERVISOR = f"""
while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 1; shift; done
shift
while :; do
    "$@"
    rc=$?
    echo "rigbook supervisor: systemd-nspawn exited with status $rc"
    [ "$rc" -eq {REBOOT_EXIT} ] || exit "$rc"
done
"""


#: The host's side of a rig without systemd (sandbox/simulated/host-persistence), in the rig.
HOST_PERSISTENCE = "usr/lib/rigbook-sim/host-persistence"
# What a rig without systemd runs instead of booting: the stand-in driver "loaded" and
# persistence on, as the host of a GPU container keeps them, then sshd in the foreground.
NO_SYSTEMD_ENTRYPOINT = f"""
mkdir -p /run/sshd
[ -x /usr/lib/rigbook-sim/load-driver ] && /usr/lib/rigbook-sim/load-driver
/{HOST_PERSISTENCE}
exec /usr/sbin/sshd -D -e
"""


def sandbox_set() -> int:
    """Which set of rigs this process works on (RIGBOOK_SANDBOX_SET; 0, the default set)."""
    value = os.environ.get(SET_ENV, "0")
    if not value.isdigit() or int(value) > MAX_SET:
        raise RigbookError(f"{SET_ENV} must be a number from 0 to {MAX_SET}, not {value!r}")
    return int(value)


def prefix() -> str:
    """What the names of this set's things start with: `rigbook-`, or `rigbookN-` for set N."""
    number = sandbox_set()
    return f"rigbook{number}-" if number else PREFIX


def _thing_name() -> re.Pattern:
    return re.compile(re.escape(prefix()) + r"rig\d+")


@dataclass(frozen=True)
class Rig:
    """One sandbox rig; its names and addresses all derive from its index."""

    index: int
    profile: str

    @property
    def name(self) -> str:
        return f"rig{self.index}"

    @property
    def thing(self) -> str:
        """Name of its network namespace, host-side veth and cgroup folders."""
        return prefix() + self.name

    @property
    def address(self) -> str:
        return f"{_subnet()}.{self.index}.2"

    @property
    def host_address(self) -> str:
        return f"{_subnet()}.{self.index}.1"

    @property
    def dir(self) -> Path:
        return state_dir() / self.name

    @property
    def release(self) -> Release:
        return release_of(self.profile)

    @property
    def console(self) -> Path:
        return self.dir / "console.log"


def _subnet() -> str:
    """10.231 for the default set, 10.(231+N) for set N."""
    first, second = SUBNET.split(".")
    return f"{first}.{int(second) + sandbox_set()}"


def cache_dir() -> Path:
    """Where the rootfs tarball is kept across runs (RIGBOOK_CACHE_DIR)."""
    return Path(os.environ.get("RIGBOOK_CACHE_DIR", "/var/cache/rigbook"))


def wheelhouse() -> Path:
    """Wheels (and sdists) the rigs may install from, mounted at WHEELS_MOUNT (pip --find-links)."""
    path = cache_dir() / "wheels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def state_dir() -> Path:
    """Where the rigs' disks, logs, key and hosts.json live (RIGBOOK_SANDBOX_DIR; set N's
    default is /var/lib/rigbook/sandbox-N)."""
    number = sandbox_set()
    default = f"/var/lib/rigbook/sandbox-{number}" if number else "/var/lib/rigbook/sandbox"
    return Path(os.environ.get("RIGBOOK_SANDBOX_DIR", default))


def hosts_file() -> Path:
    return state_dir() / "hosts.json"


def release_of(profile: str) -> Release:
    """The release a profile's rigs run (profiles.json "release"; bookworm by default)."""
    return RELEASES[_load_json("profiles.json")["profiles"][profile].get("release", SUITE)]


def _repo_dir(release: Release) -> Path:
    return state_dir() / ("repo" if release.distro == "debian" else f"repo-{release.suite}")


def _sim_repo(release: Release, fresh: bool = False) -> Path:
    """The local repository of stand-in driver packages for a release's rigs: Debian's names
    (one for every Debian release), or Ubuntu's with that release's version suffix."""
    repo = _repo_dir(release)
    if fresh or not (repo / "Packages").exists():
        build_sim_repo(repo, release)
    return repo


def up(count: int = 2, profile: str | None = None) -> list[dict]:
    """Starts `count` fresh rigs after removing any earlier ones; returns the hosts.json entries.
    Their profiles come round-robin from the rotation, or all are `profile`."""
    if not 1 <= count <= MAX_RIGS:
        raise RigbookError(f"the number of rigs must be between 1 and {MAX_RIGS}, not {count}")
    _check_machine()
    profiles = _load_json("profiles.json")
    if profile is not None:
        _check_profile(profile, profiles)
    with _locked():
        _teardown()
        key = _ensure_key()
        rotation = [profile] if profile else profiles["rotation"]
        rigs = [Rig(i, rotation[(i - 1) % len(rotation)]) for i in range(1, count + 1)]
        log.info("starting %s", ", ".join(f"{r.name} ({r.profile})" for r in rigs))
        built: set[Path] = set()  # each repository afresh, once
        for rig in rigs:
            base = _base(rig.release)
            repo = _sim_repo(rig.release, fresh=_repo_dir(rig.release) not in built)
            built.add(repo)
            _create_network(rig)
            root = _mount_root(rig, base)
            _write_rig_files(rig, root, key, profiles, repo)
            _start(rig, root, repo)
        _wait_for_ssh(rigs)
        entries = [
            {"name": r.name, "address": r.address, "profile": r.profile, "ssh_key": str(key)}
            for r in rigs
        ]
        hosts_file().write_text(json.dumps(entries, indent=2) + "\n")
        return entries


def add(profile: str) -> dict:
    """Starts one more rig of `profile` beside the running ones (the next free index); returns
    its hosts.json entry. For profiles outside the rotation, so the default fleet is unchanged."""
    _check_machine()
    profiles = _load_json("profiles.json")
    _check_profile(profile, profiles)
    with _locked():
        entries = _entries()
        index = max((int(RIG_NAME.fullmatch(e["name"]).group(1)) for e in entries), default=0)
        rig = Rig(index + 1, profile)
        base = _base(rig.release)
        repo = _sim_repo(rig.release)
        key = _ensure_key()
        log.info("starting %s (%s)", rig.name, profile)
        _create_network(rig)
        root = _mount_root(rig, base)
        _write_rig_files(rig, root, key, profiles, repo)
        _start(rig, root, repo)
        _wait_for_ssh([rig])
        entry = {"name": rig.name, "address": rig.address, "profile": profile,
                 "ssh_key": str(key)}
        hosts_file().write_text(json.dumps([*entries, entry], indent=2) + "\n")
        return entry


def _check_profile(profile: str, profiles: dict) -> None:
    if profile not in profiles["profiles"]:
        raise RigbookError(f"no sandbox profile {profile!r}; allowed: "
                           + ", ".join(sorted(profiles["profiles"])))


def remove(name: str) -> None:
    """Stops one rig and removes what it left here (safe when it is already gone)."""
    _check_machine()
    if RIG_NAME.fullmatch(name) is None:
        raise RigbookError(f"not a sandbox rig name: {name!r} (rig1, rig2, ...)")
    with _locked():
        thing = prefix() + name
        _stop_processes([c for c in _rig_cgroups() if c.name == thing])
        _unmount_under(state_dir() / name)
        _remove_cgroups(thing)
        _remove_network(thing)
        _remove_tree(state_dir() / name)
        entries = [e for e in _entries() if e["name"] != name]
        hosts_file().write_text(json.dumps(entries, indent=2) + "\n")


def _entries() -> list[dict]:
    try:
        return json.loads(hosts_file().read_text())
    except FileNotFoundError:
        return []


def down() -> None:
    """Stops every rig and removes all it left here, the rigs' SSH key included (`up` makes a
    new one); only the rootfs cache stays.

    Safe to run twice, or after a run that was killed half way.
    """
    _check_machine()
    with _locked():
        _teardown()
        for key in (state_dir() / "id_ed25519", state_dir() / "id_ed25519.pub"):
            key.unlink(missing_ok=True)


def restart(name: str) -> None:
    """Reboots one rig as `reboot` inside it would: systemd stops, the rig boots again. A rig
    whose container died (`sandbox kill`, a crash) is booted afresh from the same disk.

    Its disk is kept; /run, and with it the simulated cards' live state, starts empty.
    """
    _check_machine()
    rig = _rig_named(name)
    with _locked():
        init = _container_init(rig)
        if init is None:
            log.info("%s is not running: booting it again from its disk", name)
            _kill_all(_cgroups_of(rig))  # what the dead container left, its supervisor too
            for cgroup in _cgroups_of(rig):  # and the cgroups its systemd made, for a clean boot
                for folder, _, _ in os.walk(cgroup, topdown=False):
                    if Path(folder) != cgroup:
                        os.rmdir(folder)
            root = rig.dir / "root"
            if root not in _mount_points():
                _mount_root(rig, _base(rig.release))
            _start(rig, root, _sim_repo(rig.release))
        else:
            log.info("rebooting %s", name)
            os.kill(init, signal.SIGRTMIN + 5)
            _wait_for_new_boot(rig, init)
        _wait_for_ssh([rig])


def kill(name: str) -> None:
    """Kills one rig's container at once, as a power cut would: no shutdown, its disk kept
    as it was at that moment (`sandbox restart` boots it again)."""
    _check_machine()
    rig = _rig_named(name)
    with _locked():
        if _container_init(rig) is None:
            raise RigbookError(f"{name} is not running")
        log.info("killing %s", name)
        _kill_all(_cgroups_of(rig))


def _rig_named(name: str) -> Rig:
    entry = next((e for e in rigs() if e["name"] == name), None)
    if entry is None:
        raise RigbookError(f"no sandbox rig named {name!r}; `rigbook sandbox list` shows them")
    return Rig(int(RIG_NAME.fullmatch(name).group(1)), entry["profile"])


def _cgroups_of(rig: Rig) -> list[Path]:
    return [path / rig.thing for path in _cgroup_roots() if (path / rig.thing).is_dir()]


def rigs() -> list[dict]:
    """The hosts.json entries of the rigs `sandbox up` started last."""
    try:
        return json.loads(hosts_file().read_text())
    except FileNotFoundError:
        raise RigbookError(
            f"no sandbox rigs ({hosts_file()} is missing): run `rigbook sandbox up` first"
        ) from None


def _base(release: Release) -> Path:
    """The release's rootfs, built and unpacked into the cache if missing, which every set of
    rigs shares: one process at a time builds or unpacks there (each set holds only its own
    state dir's lock)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _extract_base(ensure_rootfs(release))


def ensure_rootfs(release: Release = RELEASES[SUITE]) -> Path:
    """The cached rootfs tarball of a release; built once per include list (debootstrap takes
    1-4 min and needs the network; later runs need none)."""
    suite = release.suite
    recipe = (suite, release.include, ROOTFS_RECIPE)
    if release.distro == "ubuntu":
        recipe += (UBUNTU_RECIPE,)
    key = hashlib.sha256(repr(recipe).encode()).hexdigest()[:12]
    tarball = cache_dir() / f"{suite}-{key}.tar.zst"
    if tarball.exists():
        return tarball
    cache_dir().mkdir(parents=True, exist_ok=True)
    _remove_stale_cache(suite)
    build = cache_dir() / f"build-{suite}"
    _unmount_under(build)
    _remove_tree(build)
    log.info("building the %s rootfs with debootstrap (a few minutes, once)", suite)
    source = [ubuntu_mirror(), UBUNTU_SCRIPT] if release.distro == "ubuntu" else []
    logfile = cache_dir() / f"debootstrap-{suite}.log"
    with open(logfile, "w") as out:
        result = subprocess.run(
            ["debootstrap", "--variant=minbase", "--include=" + ",".join(release.include),
             suite, build, *source],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        if result.returncode != 0:
            raise RigbookError(f"debootstrap failed; see {logfile}")
        if release.distro == "ubuntu":
            _check_ubuntu_signer(build, suite)
            _read_ubuntu_indexes(build, suite)
        _prepare_rootfs(build, release)
    except BaseException:
        _unmount_under(build)
        _remove_tree(build)
        raise
    partial = tarball.with_name(tarball.name + ".partial")
    _run([*_tar(), "-cf", partial, "-C", build, "."])
    partial.rename(tarball)
    _remove_tree(build)
    return tarball


def _check_machine() -> None:
    """Rigs need root and a few tools; say which are missing instead of failing half way."""
    if os.geteuid() != 0:
        raise RigbookError("sandbox rigs need root (network namespaces, mounts, cgroups)")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise RigbookError("sandbox rigs need these tools: " + ", ".join(missing))


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One sandbox command at a time: two would fight over the same names."""
    state_dir().mkdir(parents=True, exist_ok=True)
    with open(state_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    """Runs a command; a failure becomes a RigbookError that names it and quotes its stderr."""
    args = [str(part) for part in cmd]
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()[-800:]
        raise RigbookError(f"`{' '.join(args)}` failed (exit {result.returncode}): {detail}")
    return result


def _tar() -> list[str]:
    return ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-I", "zstd -T0"]


def _load_json(name: str) -> dict:
    return json.loads((SIM_DIR / name).read_text())


def ubuntu_mirror() -> str:
    """Where Ubuntu rootfs come from: RIGBOOK_UBUNTU_MIRROR (a mirror you control), else the
    archive debootstrap's own Ubuntu script names, over https (TLS guards the download when this
    machine has no Ubuntu keyring; the signer check below guards the result)."""
    mirror = os.environ.get("RIGBOOK_UBUNTU_MIRROR")
    if mirror:
        return mirror
    script = Path("/usr/share/debootstrap/scripts") / UBUNTU_SCRIPT
    mirrors = re.findall(r"default_mirror\s+(\S+)", script.read_text())
    main = [m for m in mirrors if "old-releases" not in m and "ports" not in m]
    if not main:
        raise RigbookError(f"no Ubuntu mirror in {script}; set RIGBOOK_UBUNTU_MIRROR")
    return main[0].replace("http://", "https://", 1)


def _check_ubuntu_signer(root: Path, suite: str) -> None:
    """The release file debootstrap used is signed by a key of UBUNTU_SIGNERS, checked with
    the keyring the new rootfs carries (this machine need not have one)."""
    inrelease = next((root / "var/lib/apt/lists").glob(f"*_dists_{suite}_InRelease"), None)
    keyring = root / "usr/share/keyrings/ubuntu-archive-keyring.gpg"
    if inrelease is None or not keyring.exists():
        raise RigbookError(f"the {suite} rootfs has no InRelease or no ubuntu-archive-keyring")
    status = subprocess.run(["gpgv", "--status-fd", "1", "--keyring", keyring, inrelease],
                            capture_output=True, text=True).stdout
    signers = {line.split()[-1] for line in status.splitlines()
               if line.startswith("[GNUPG:] VALIDSIG")}
    if not signers & UBUNTU_SIGNERS:
        raise RigbookError(f"{inrelease.name} is not signed by Ubuntu's archive key "
                           f"({', '.join(sorted(UBUNTU_SIGNERS))}); gpgv said:\n{status}")


def _ubuntu_sources(suite: str, keyring: str) -> str:
    """The deb822 source of a release's real archive: release, -updates, -security pockets."""
    return (f"Types: deb\nURIs: {ubuntu_mirror()}\n"
            f"Suites: {' '.join(suite + pocket for pocket in UBUNTU_POCKETS)}\n"
            f"Components: {' '.join(UBUNTU_COMPONENTS)}\nArchitectures: amd64\n"
            f"Signed-By: {keyring}\n")


def _read_ubuntu_indexes(root: Path, suite: str) -> None:
    """Ubuntu's real package indexes for the release, read with this machine's apt into the
    rootfs (UBUNTU_LISTS) with the rootfs's own keyring: the rig answers `apt-get -s` against
    them offline. A private apt root: nothing on this machine changes."""
    lists = root / UBUNTU_LISTS.lstrip("/")
    (lists / "partial").mkdir(parents=True)
    sources = root / UBUNTU_SOURCES.lstrip("/")
    sources.parent.mkdir(parents=True, exist_ok=True)
    sources.write_text(_ubuntu_sources(suite, "/usr/share/keyrings/ubuntu-archive-keyring.gpg"))
    with tempfile.TemporaryDirectory() as work:
        here = Path(work) / "here.sources"
        here.write_text(_ubuntu_sources(
            suite, str(root / "usr/share/keyrings/ubuntu-archive-keyring.gpg")))
        _run(["apt-get", *ubuntu_apt_options(lists, here, root / "var/lib/dpkg/status"),
              "-o", f"Dir::Cache={work}", "-o", "Dir::Etc::Trusted=/dev/null",
              "-o", "Dir::Etc::TrustedParts=/nonexistent", "update"])


def ubuntu_apt_options(lists: Path | str, sources: Path | str, status: Path | str) -> list[str]:
    """apt options that read (only) Ubuntu's real indexes kept in `lists`."""
    return ["-o", f"Dir::Etc::SourceList={sources}", "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", f"Dir::State::Lists={lists}", "-o", f"Dir::State::status={status}",
            "-o", "APT::Architecture=amd64", "-o", "Acquire::Languages=none",
            "-o", "Debug::NoLocking=1", "-q"]


def _remove_stale_cache(suite: str) -> None:
    """Drops tarballs and extracted bases of an older include list: they are never used again."""
    for old in cache_dir().glob(f"{suite}-*"):
        if old.is_dir():
            _remove_tree(old)
        else:
            old.unlink()


def _prepare_rootfs(root: Path, release: Release) -> None:
    """Makes a fresh debootstrap fit to be a rig: offline apt, root login by key, sshd on.
    Ubuntu: the local repository is one of its own sources (an Ubuntu rig's driver comes from
    its sources), and sshd stays socket-activated as Ubuntu ships it."""
    (root / "etc/apt/sources.list").write_text(
        "# Sandbox rigs have no route out: the mirror entries were removed.\n"
    )
    for path in (root / "etc/apt/sources.list.d").iterdir():
        path.unlink()
    for path in (root / "var/lib/apt/lists").iterdir():
        if path.is_file() and path.name != "lock":
            path.unlink()
    for path in (root / "var/cache/apt/archives").glob("*.deb"):
        path.unlink()
    (root / "etc/ssh/sshd_config.d/rigbook-sandbox.conf").write_text(
        "PermitRootLogin prohibit-password\n"
    )
    if release.distro == "debian":
        _run(["systemctl", f"--root={root}", "enable", "ssh.service"])
        return
    (root / SIM_SOURCES).write_text(
        f"Types: deb\nURIs: file:{REPO_MOUNT}\nSuites: ./\nTrusted: yes\n")
    _run(["systemctl", f"--root={root}", "mask", "motd-news.timer"])


def _extract_base(tarball: Path) -> Path:
    """The tarball unpacked once next to it: the shared read-only lower layer of every rig."""
    base = tarball.with_name(tarball.name.removesuffix(".tar.zst"))
    if base.is_dir():
        return base
    partial = base.with_name(base.name + ".partial")
    _remove_tree(partial)
    partial.mkdir()
    log.info("unpacking %s", tarball.name)
    _run([*_tar(), "-xpf", tarball, "-C", partial])
    partial.rename(base)
    return base


def _ensure_key() -> Path:
    """The rigs' root login key, made by the first `sandbox up` after a `sandbox down`."""
    key = state_dir() / "id_ed25519"
    if not key.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rigbook-sandbox", "-f", key])
    return key


def build_sim_repo(repo: Path, release: Release, versions: list[str] | None = None) -> Path:
    """Builds every stand-in driver package in every version (the manifest's, or `versions`:
    a newer one for an upgrade test) into a flat apt repository: Debian's names
    (packages.json), or Ubuntu's per-branch names (packages-ubuntu.json) with the release's
    version suffix ({version_id})."""
    manifest = _load_json("packages.json" if release.distro == "debian"
                          else "packages-ubuntu.json")
    versions = [v.format(version_id=release.version) for v in versions or manifest["versions"]]
    _remove_tree(repo)
    repo.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as work:
        for version in versions:
            branch = version.split(".", 1)[0]
            for template, spec in manifest["packages"].items():
                name = template.format(branch=branch)
                spec = {**spec, "depends": [d.format(branch=branch) for d in spec["depends"]]}
                tree = Path(work) / f"{name}_{version}"
                _package_tree(tree, name, version, spec, manifest)
                _run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", tree, repo])
    packages = _run(["dpkg-scanpackages", "--multiversion", "."], cwd=repo).stdout
    (repo / "Packages").write_text(packages)
    return repo


def _package_tree(tree: Path, name: str, version: str, spec: dict, manifest: dict) -> None:
    """Lays out one stand-in package (control file, maintainer scripts, files) for dpkg-deb."""
    upstream = version.rsplit("-", 1)[0]
    depends = [f"{dep} (= {version})" for dep in spec["depends"]] + spec["requires"]
    control = [
        f"Package: {name}",
        f"Version: {version}",
        "Architecture: all",
        f"Maintainer: {manifest['maintainer']}",
        "Section: misc",
        "Priority: optional",
    ]
    if depends:
        control.append("Depends: " + ", ".join(depends))
    control += [f"Description: {manifest['description']}", f" {spec['summary']}"]
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text("\n".join(control) + "\n")
    for script, source in spec["scripts"].items():
        shutil.copyfile(SIM_DIR / source, tree / "DEBIAN" / script)
        (tree / "DEBIAN" / script).chmod(0o755)
    for target, source in spec["files"].items():
        path = tree / target
        path.parent.mkdir(parents=True, exist_ok=True)
        if source == "@version":
            path.write_text(upstream + "\n")
            path.chmod(0o644)
        else:
            shutil.copyfile(SIM_DIR / source, path)
            path.chmod(0o755 if os.access(SIM_DIR / source, os.X_OK) else 0o644)


def _create_network(rig: Rig) -> None:
    """Its own network namespace with a veth pair: host side .1, rig side .2, no route out."""
    ns = ["ip", "-n", rig.thing]
    peer = ["peer", "name", "host0", "netns", rig.thing]
    for cmd in (
        ["ip", "netns", "add", rig.thing],
        ["ip", "link", "add", rig.thing, "type", "veth", *peer],
        ["ip", "addr", "add", f"{rig.host_address}/24", "dev", rig.thing],
        ["ip", "link", "set", rig.thing, "up"],
        [*ns, "addr", "add", f"{rig.address}/24", "dev", "host0"],
        [*ns, "link", "set", "host0", "up"],
        [*ns, "link", "set", "lo", "up"],
    ):
        _run(cmd)


def _mount_root(rig: Rig, base: Path) -> Path:
    """An overlay of the shared base with a per-rig upper dir on disk: survives reboots."""
    dirs = {part: rig.dir / part for part in ("upper", "work", "root")}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={base},upperdir={dirs['upper']},workdir={dirs['work']}"
    _run(["mount", "-t", "overlay", "overlay", "-o", options, dirs["root"]])
    return dirs["root"]


def _write_rig_files(rig: Rig, root: Path, key: Path, profiles: dict, repo: Path) -> None:
    """Identity, login key and the simulated hardware of one rig, written before it boots."""
    (root / "etc/hostname").write_text(rig.name + "\n")
    (root / "etc/hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{rig.name}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    (root / "etc/machine-id").write_text(hashlib.md5(rig.name.encode()).hexdigest() + "\n")
    ssh = root / "root/.ssh"
    ssh.mkdir(mode=0o700, exist_ok=True)
    (ssh / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
    (ssh / "authorized_keys").chmod(0o600)
    profile = profiles["profiles"][rig.profile]
    sim = root / "etc/rigbook-sim"
    sim.mkdir(parents=True, exist_ok=True)
    (sim / "gpus.json").write_text(json.dumps(_sim_gpus(rig, profiles), indent=2) + "\n")
    if profile["wsl2"]:
        _write_wsl2_files(root, profile["wsl2"])
    if profile.get("psu"):
        _write_psu_files(root, profile["psu"])
    if rig.release.distro == "ubuntu":  # its own source read already, as on a real rig
        lists = root / "var/lib/apt/lists" / (REPO_MOUNT.replace("/", "_") + "_._Packages")
        shutil.copyfile(repo / "Packages", lists)
    if profile.get("systemd", True) is False:  # no systemctl at all (a whiteout in its upper)
        (root / "usr/bin/systemctl").unlink(missing_ok=True)
        target = root / HOST_PERSISTENCE
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SIM_DIR / "host-persistence", target)
        target.chmod(0o755)


#: The stand-in corsairpsu hwmon folder of a rig whose profile has a PSU (sandbox/simulated/
#: README.md); no /sys/class/hwmon can be made in a container, so the sweep is pointed here.
SIM_HWMON = "/var/lib/rigbook-sim/hwmon"


def _write_psu_files(root: Path, psu: dict) -> None:
    """A PSU with USB-HID telemetry, as the corsair-psu driver shows one: a hwmon folder named
    corsairpsu whose power1_input (uW) the stand-in nvidia-smi keeps at the host's draw plus
    the cards'."""
    (root / "etc/rigbook-sim/psu.json").write_text(json.dumps(psu) + "\n")
    folder = root / SIM_HWMON.lstrip("/") / "hwmon0"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "name").write_text("corsairpsu\n")
    (folder / "power1_label").write_text("power total\n")
    (folder / "power1_input").write_text(f"{round(psu['host_w'] * 1e6)}\n")


def _sim_gpus(rig: Rig, profiles: dict) -> dict:
    """The rig's simulated cards; UUIDs derive from the rig name so they stay the same."""
    profile = profiles["profiles"][rig.profile]
    gpus = []
    for index, slot in enumerate(profile["gpus"]):
        digest = hashlib.sha256(f"{rig.name}/{slot['pci_bus_id']}".encode()).hexdigest()
        uuid = "-".join(digest[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
        gpus.append(
            {
                "index": index,
                "uuid": "GPU-" + uuid,
                "pci_bus_id": slot["pci_bus_id"],
                **profiles["cards"][slot["card"]],
            }
        )
    return {
        "about": "SIMULATED GPUs of a rigbook sandbox rig; read by the stand-in nvidia-smi.",
        "rig": rig.name,
        "profile": rig.profile,
        "driver_version": (profile["wsl2"] or {}).get("driver_version"),
        "cuda_version": profiles["cuda_version"],
        "gpus": gpus,
    }


def _write_wsl2_files(root: Path, wsl2: dict) -> None:
    """What a WSL2 rig shows instead of driver packages: the Windows side's tools and files."""
    smi = root / "usr/lib/wsl/lib/nvidia-smi"
    reg = root / "mnt/c/Windows/System32/reg.exe"
    for target, source in ((smi, "nvidia-smi"), (reg, "reg.exe")):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SIM_DIR / source, target)
        target.chmod(0o755)
    (root / "etc/tmpfiles.d/rigbook-sim-wsl.conf").write_text("d /run/WSL 0755 root root -\n")
    if wsl2["windows_admin"]:
        (root / "etc/rigbook-sim/windows-admin").write_text("simulated elevated session\n")
    wslconfig = root / "mnt/c/Users/rig/.wslconfig"
    wslconfig.parent.mkdir(parents=True, exist_ok=True)
    wslconfig.write_text(wsl2["wslconfig"])


def _start(rig: Rig, root: Path, repo: Path) -> None:
    """Boots the rig in the background under its supervisor, logging to console.log."""
    cgroups = [path / rig.thing for path in _cgroup_roots()]
    for path in cgroups:
        path.mkdir(exist_ok=True)
    booted = _load_json("profiles.json")["profiles"][rig.profile].get("systemd", True)
    nspawn = [
        "systemd-nspawn",
        *(["-b"] if booted else []),
        "-D",
        str(root),
        "--register=no",
        "--keep-unit",
        f"--network-namespace-path=/run/netns/{rig.thing}",
        "-M",
        rig.name,
        "--console=read-only",
        f"--bind-ro={repo}:{REPO_MOUNT}",
        f"--bind-ro={wheelhouse()}:{WHEELS_MOUNT}",
    ]
    if not booted:
        nspawn += ["--as-pid2", "/bin/sh", "-c", NO_SYSTEMD_ENTRYPOINT]
    # nspawn's read-only /proc/sys stays: a writable one leaks fs.inotify.* to this machine.
    env = {k: v for k, v in os.environ.items() if k != "SYSTEMD_NSPAWN_API_VFS_WRITABLE"}
    if rig.release.unified_cgroups:
        env["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"] = "1"
    with open(rig.console, "ab") as console:
        supervisor = subprocess.Popen(
            ["sh", "-c", SUPERVISOR, "rigbook-supervisor", *map(str, cgroups), "--", *nspawn],
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    # Later checks read liveness from the cgroup: wait until the supervisor has moved there.
    deadline = time.monotonic() + 5
    while not all(supervisor.pid in _pids(path, recursive=False) for path in cgroups):
        if supervisor.poll() is not None or time.monotonic() > deadline:
            raise RigbookError(f"{rig.name} did not start; see {rig.console}")
        time.sleep(0.02)


def _cgroup_roots() -> list[Path]:
    """The hierarchies a rig gets its own folder in: hybrid (v1 name=systemd + v2) or pure v2."""
    hybrid = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified")]
    if all((path / "cgroup.procs").exists() for path in hybrid):
        return hybrid
    return [Path("/sys/fs/cgroup")]


def _rig_cgroups() -> list[Path]:
    return [
        path
        for root in _cgroup_roots()
        if root.is_dir()
        for path in root.iterdir()
        if _thing_name().fullmatch(path.name) and path.is_dir()
    ]


def _pids(cgroup: Path, recursive: bool = True) -> set[int]:
    """Processes in a cgroup folder (and below); folders vanish while systemd cleans up."""
    folders = [Path(d) for d, _, _ in os.walk(cgroup)] if recursive else [cgroup]
    pids = set()
    for folder in folders:
        with contextlib.suppress(OSError):
            pids.update(int(line) for line in (folder / "cgroup.procs").read_text().split())
    return pids


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _container_init(rig: Rig) -> int | None:
    """Host PID of the rig's systemd: the process in its cgroup that is PID 1 in its namespace."""
    found = []
    for cgroup in (path / rig.thing for path in _cgroup_roots()):
        for pid in _pids(cgroup) if cgroup.is_dir() else ():
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                nspids = re.search(r"^NSpid:\s*(.*)$", status, re.M).group(1).split()
                if len(nspids) > 1 and nspids[-1] == "1":
                    found.append((len(nspids), pid))
    return min(found)[1] if found else None


def _supervisor_running(rig: Rig) -> bool:
    return any(
        _pids(path / rig.thing, recursive=False)
        for path in _cgroup_roots()
        if (path / rig.thing).is_dir()
    )


def _console_tail(rig: Rig) -> str:
    with contextlib.suppress(FileNotFoundError):
        lines = rig.console.read_text(errors="replace").strip().splitlines()
        return "\n".join(lines[-5:])
    return ""


def _wait_for_new_boot(rig: Rig, old_init: int) -> None:
    deadline = time.monotonic() + SSH_WAIT_S
    while time.monotonic() < deadline:
        init = _container_init(rig)
        if init not in (None, old_init):
            return
        if not _supervisor_running(rig):
            break
        time.sleep(0.2)
    raise RigbookError(
        f"{rig.name} did not boot again after the reboot; see {rig.console}\n{_console_tail(rig)}"
    )


def _ssh_answers(address: str) -> bool:
    try:
        with socket.create_connection((address, 22), timeout=1) as conn:
            conn.settimeout(2)
            return conn.recv(4) == b"SSH-"
    except OSError:
        return False


def _wait_for_ssh(rigs: list[Rig]) -> None:
    """Waits, bounded, until sshd greets on every rig; a rig whose nspawn ended fails at once."""
    deadline = time.monotonic() + SSH_WAIT_S
    pending = list(rigs)
    while pending:
        for rig in list(pending):
            if _ssh_answers(rig.address):
                pending.remove(rig)
            elif not _supervisor_running(rig):
                raise RigbookError(
                    f"{rig.name} stopped while booting; see {rig.console}\n{_console_tail(rig)}"
                )
        if pending and time.monotonic() > deadline:
            rig = pending[0]
            raise RigbookError(
                f"{rig.name} did not answer SSH on {rig.address}:22 within {SSH_WAIT_S} s; "
                f"see {rig.console}\n{_console_tail(rig)}"
            )
        if pending:
            time.sleep(0.3)


def _teardown() -> None:
    """Removes, by name, everything rigs make here: processes, mounts, cgroups, links, state."""
    _stop_processes()
    _unmount_under(state_dir())
    _remove_cgroups()
    _remove_network()
    for path in state_dir().iterdir() if state_dir().is_dir() else ():
        if RIG_NAME.fullmatch(path.name) or re.fullmatch(r"repo(-\w+)?", path.name):
            _remove_tree(path)
    hosts_file().unlink(missing_ok=True)


def _stop_processes(cgroups: list[Path] | None = None) -> None:
    """Asks each rig's nspawn to shut its rig down, then kills whatever is left.

    A halted rig makes nspawn exit 0, so its supervisor ends by itself and reaps it (this
    machine's PID 1 is slow to reap orphans). An nspawn that a rig's reboot started meanwhile
    gets its SIGTERM on the next round.
    """
    cgroups = _rig_cgroups() if cgroups is None else cgroups
    asked: set[int] = set()
    deadline = time.monotonic() + STOP_WAIT_S
    while pids := _pids_of(cgroups):
        if time.monotonic() > deadline:
            log.warning("rigs did not shut down within %s s; killing them", STOP_WAIT_S)
            _kill_all(cgroups)
            return
        nspawns = {pid for pid in pids if _comm(pid) == "systemd-nspawn"}
        _signal(nspawns - asked, signal.SIGTERM)
        asked |= nspawns
        time.sleep(0.1)


def _pids_of(cgroups: list[Path]) -> set[int]:
    return set().union(*(_pids(cgroup) for cgroup in cgroups))


def _kill_all(cgroups: list[Path]) -> None:
    deadline = time.monotonic() + 5
    while pids := _pids_of(cgroups):
        if time.monotonic() > deadline:
            raise RigbookError(
                "could not stop the sandbox rigs' processes: "
                + ", ".join(str(cgroup) for cgroup in cgroups if _pids(cgroup))
            )
        _signal(pids, signal.SIGKILL)
        time.sleep(0.1)


def _mount_points() -> list[Path]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        field = line.split()[4]
        points.append(Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)))
    return points


def _unmount_under(top: Path) -> None:
    """Unmounts everything at or below `top`, deepest first."""
    inside = [p for p in _mount_points() if p == top or top in p.parents]
    for point in sorted(inside, key=lambda p: len(p.parts), reverse=True):
        _run(["umount", point])


def _remove_tree(path: Path) -> None:
    """rm -rf that refuses to reach through a mount into a filesystem it does not own."""
    if not path.exists():
        return
    if any(p == path or path in p.parents for p in _mount_points()):
        raise RigbookError(f"{path} still has mounts below it; not removing it")
    shutil.rmtree(path)


def _remove_cgroups(thing: str | None = None) -> None:
    """Removes the rigs' cgroup folders (or one rig's), children first (cgroup folders only go
    empty)."""
    for cgroup in _rig_cgroups():
        if thing is not None and cgroup.name != thing:
            continue
        for folder, _, _ in os.walk(cgroup, topdown=False):
            try:
                os.rmdir(folder)
            except OSError as error:
                raise RigbookError(f"cannot remove cgroup {folder}: {error}") from None


def _remove_network(thing: str | None = None) -> None:
    """Deletes the rigs' host-side veths (taking the peers along), then their namespaces.

    In that order: a namespace's deletion frees its veth pair only some time later.
    """
    things = _thing_name()
    for line in _run(["ip", "-o", "link", "show"]).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if things.fullmatch(name) and thing in (None, name):
            _run(["ip", "link", "delete", name])
    for line in _run(["ip", "netns", "list"]).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if things.fullmatch(name) and thing in (None, name):
            _run(["ip", "netns", "delete", name])
