"""The NVIDIA driver end to end on the dual-3090 sandbox rig (rig1), driven by the pyinfra CLI.

One story, in order, because each step starts from the state the last one left: the converge
installs 580.95.05 from the sandbox's repository and holds it; a plain `apt-get upgrade -y`
(what unattended-upgrades would do) leaves it although 580.159.04 is offered; the second
converge changes nothing; deploys/driver.py without leave to reboot installs 580.159.04 and
stops at the check, saying a reboot is needed; with leave it reboots into it and verifies, and
the driver stays held; the same bump again is refused; a converge whose inventory still pins
the old version refuses to move the driver back; the bump back to 580.95.05 leaves the rig as
its inventory says. The WSL2 rig (rig3) gets no Linux driver, only a check of the Windows one.
The stand-in driver is simulated (sandbox/simulated): after an upgrade its nvidia-smi fails
with a version mismatch until the rig reboots, as a real driver does.

A second story puts the bump's apt step (bump.sh on the rig) through what goes wrong: a DKMS
build that fails, and connections that drop while a slow one runs (the stand-in's hooks).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from rigbook.roles.driver import (
    BLACKLIST,
    BUMP_LOGS,
    BUMP_SCRIPT,
    BUMP_UNIT,
    PERSISTENCED_DROPIN,
    PREFERENCES,
)
from tests.conftest import PYINFRA, ROOT, SANDBOX_INVENTORY, rig_ssh, rigbook, run_pyinfra

pytestmark = pytest.mark.sandbox

#: The stand-in packages of the sandbox repository (NVIDIA's Debian-repository names).
PACKAGES = ("libnvidia-ml1", "nvidia-kernel-open-dkms", "nvidia-open", "nvidia-persistenced",
            "nvidia-smi")
OLD, NEW = "580.95.05", "580.159.04"
CONVERGE = "deploys/rig.py"
BUMP = "deploys/driver.py"


#: Status's one line for the simulated mismatch (the sandbox has no /proc/driver/nvidia/version).
MISMATCH = "driver user-space 580.159, kernel module (not read): reboot to load the 580.159 module"


def status_says_mismatch(rig_name: str = "rig1") -> str:
    """`rigbook status` of a rig in the simulated mismatch: its own state, exit 4, one finding
    with MISMATCH (returned, for what else must say it)."""
    seen = rigbook("status", SANDBOX_INVENTORY, "--json", "--limit", rig_name, check=False)
    assert seen.returncode == 4, seen.stdout + seen.stderr
    (status,) = json.loads(seen.stdout)["rigs"]
    assert status["state"] == "driver-mismatch"
    assert [f["level"] for f in status["findings"] if MISMATCH in f["reason"]] == ["mismatch"]
    return MISMATCH


def versions(rig: dict) -> dict[str, str]:
    """Installed version per stand-in package (absent: not installed)."""
    out = rig_ssh(rig, "dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\\n'").stdout
    return {
        name: version
        for status, name, version in (line.split() for line in out.splitlines())
        if status[1] == "i" and name in PACKAGES
    }


def holds(rig: dict) -> set[str]:
    return set(rig_ssh(rig, "apt-mark showhold").stdout.split())


def smi_driver(rig: dict) -> str:
    done = rig_ssh(rig, "nvidia-smi --query-gpu=driver_version --format=csv,noheader", check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split()[0]


def driver_changes(run) -> dict[str, list[str]]:
    return {name: hosts for name, hosts in run.changed().items() if "NVIDIA driver" in name}


def forget_driver(rig: dict) -> None:
    """Undo what an earlier test may have left: no driver, no driver files, no loaded module."""
    rig_ssh(rig, " ; ".join((
        f"apt-mark unhold {' '.join(PACKAGES)} >/dev/null 2>&1",
        f"DEBIAN_FRONTEND=noninteractive apt-get purge -y {' '.join(PACKAGES)} >/dev/null 2>&1",
        f"rm -f /etc/apt/sources.list.d/rigbook-nvidia.sources {PREFERENCES} {BLACKLIST} "
        f"{PERSISTENCED_DROPIN} /run/rigbook-sim/loaded-version",
        "systemctl daemon-reload",
    )), check=False)


def test_driver_install_hold_bump_refuse(sandbox):
    rig1, rig3 = sandbox["rig1"], sandbox["rig3"]
    forget_driver(rig1)

    # 1. First converge: the pinned driver from the sandbox repository, held, blacklisted,
    #    persistence mode on. WSL2 gets no package, only the check of the Windows driver.
    first = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1", "--limit", "rig3")
    assert first.returncode == 0, first.explain()
    assert versions(rig1) == {name: f"{OLD}-1" for name in PACKAGES}
    assert holds(rig1) >= set(PACKAGES)
    assert smi_driver(rig1) == OLD
    assert '"nvidia-";' in rig_ssh(rig1, f"cat {BLACKLIST}").stdout
    listed = rig_ssh(rig1, "apt-config dump Unattended-Upgrade::Package-Blacklist").stdout
    assert 'Unattended-Upgrade::Package-Blacklist:: "libnvidia-";' in listed
    unit = rig_ssh(rig1, "systemctl show -p ExecStart nvidia-persistenced").stdout
    assert "--user nvidia-persistenced --verbose" in unit and "--no-persistence-mode" not in unit
    assert rig_ssh(rig1, "systemctl is-active nvidia-persistenced").stdout.strip() == "active"
    assert versions(rig3) == {}
    assert not any("rig3" in hosts for hosts in driver_changes(first).values()), first.explain()

    # 2. What unattended-upgrades would do: upgrade everything. 580.159.04 is offered, the
    #    hold keeps 580.95.05 (the apt pin is moved aside so the hold alone is tested).
    offered = rig_ssh(rig1, "apt-get update -qq && apt-cache madison nvidia-open").stdout
    assert f"{NEW}-1" in offered
    upgrade = rig_ssh(rig1, f"mv {PREFERENCES} /root/pin && DEBIAN_FRONTEND=noninteractive "
                      f"apt-get upgrade -y; rc=$?; mv /root/pin {PREFERENCES}; exit $rc")
    assert "kept back" in upgrade.stdout or "held" in upgrade.stdout, upgrade.stdout
    assert versions(rig1) == {name: f"{OLD}-1" for name in PACKAGES}
    assert smi_driver(rig1) == OLD

    # 3. Second converge: nothing to do.
    second = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1", "--limit", "rig3")
    assert second.returncode == 0, second.explain()
    assert second.changed() == {}, second.explain()

    # 4. The bump without leave to reboot: installed and held, but it stops at the check,
    #    which says why (the old module still runs, so nvidia-smi fails).
    halted = run_pyinfra(SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                         "--data", f"driver_version={NEW}", "--data", "allow_reboot=false")
    assert halted.returncode != 0
    assert (f"reboot needed (driver {NEW} is installed but the loaded module is {OLD}); "
            "allow_reboot is false: reboot the rig") in halted.stderr, halted.explain()
    assert f"driver {NEW} is not running: nvidia-smi fails: " in halted.stderr
    assert versions(rig1) == {name: f"{NEW}-1" for name in PACKAGES}
    assert holds(rig1) >= set(PACKAGES)
    assert rig_ssh(rig1, "nvidia-smi -L", check=False).returncode != 0
    # status and every GPU deploy's preflight say it as one finding, in its own state (issue
    # 35); the sandbox has no /proc/driver/nvidia/version, so the module is "not read"; step 5
    # reboots the rig out of this state.
    line = status_says_mismatch()
    refused = run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", "--limit", "rig1")
    assert refused.returncode != 0 and line in refused.stderr, refused.explain()
    assert refused.changed() == {}, refused.explain()

    # 5. The bump with leave to reboot: the rig reboots into the new driver, still held.
    bump = run_pyinfra(SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                       "--data", f"driver_version={NEW}", "--data", "allow_reboot=true")
    assert bump.returncode == 0, bump.explain()
    changed = driver_changes(bump)
    assert f"NVIDIA driver bump | Move the driver to {NEW}" not in changed  # done in step 4
    assert changed.get("NVIDIA driver bump | Reboot into the new driver") == ["rig1"], (
        bump.explain()
    )
    assert versions(rig1) == {name: f"{NEW}-1" for name in PACKAGES}
    assert holds(rig1) >= set(PACKAGES)
    assert smi_driver(rig1) == NEW
    # no venvs on this rig: nothing built for the old driver, so no "Next: rebuild" step
    assert "Next: rebuild the venvs" not in bump.stderr, bump.explain()

    # 6. The same bump again: done, it says so and changes nothing (a success: exit 0).
    again = run_pyinfra(SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                        "--data", f"driver_version={NEW}")
    assert again.returncode == 0 and again.changed() == {}, again.explain()
    assert f"driver {NEW} is already running: nothing to bump" in again.stderr, again.explain()
    assert versions(rig1) == {name: f"{NEW}-1" for name in PACKAGES}

    # 7. A converge whose inventory still pins the old version never moves the driver back;
    #    with the inventory at the new version it has nothing to do.
    stale = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1")
    assert stale.returncode != 0
    assert f"installed {NEW}, inventory pins {OLD}; allowed: the installed driver" in stale.stderr
    assert versions(rig1) == {name: f"{NEW}-1" for name in PACKAGES}
    current = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1",
                          "--data", f"driver_version={NEW}")
    assert current.returncode == 0 and current.changed() == {}, current.explain()

    # 8. Back to the inventory's version (a downgrade is a bump too), for whatever runs next.
    back = run_pyinfra(SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                       "--data", f"driver_version={OLD}", "--data", "allow_reboot=true")
    assert back.returncode == 0, back.explain()
    assert driver_changes(back).get(f"NVIDIA driver bump | Move the driver to {OLD}") == ["rig1"]
    assert versions(rig1) == {name: f"{OLD}-1" for name in PACKAGES}
    assert holds(rig1) >= set(PACKAGES)
    assert smi_driver(rig1) == OLD


#: Simulation hooks of the stand-in DKMS build (sandbox/simulated/README.md).
DKMS_FAILS = "/etc/rigbook-sim/dkms-build-fails"
DKMS_SECONDS = "/etc/rigbook-sim/dkms-build-seconds"
DKMS_BUILDING = "/run/rigbook-sim/dkms-building"


def dpkg_states(rig: dict) -> dict[str, str]:
    """db:Status-Abbrev per stand-in package on the system ('hF ': held, half-configured)."""
    out = rig_ssh(rig, "dpkg-query -W -f='${Package}=${db:Status-Abbrev}\\n'").stdout
    states = dict(line.split("=", 1) for line in out.splitlines())
    return {name: state for name, state in states.items() if name in PACKAGES}


def wait_until(check, what: str, limit: float = 300):
    deadline = time.monotonic() + limit
    while not (answer := check()):
        assert time.monotonic() < deadline, f"timed out after {limit:g} s waiting for {what}"
        time.sleep(0.5)
    return answer


def bump_running(rig: dict) -> bool:
    """The bump's apt step runs: its unit is there and not yet ended (the unit keeps its
    result after the step, `exited` or `failed`, until a wait reads it)."""
    state = rig_ssh(rig, f"systemctl show -P SubState {BUMP_UNIT}").stdout.strip()
    return state not in ("dead", "exited", "failed")


def drop_during_dkms_build(rig: dict, client: subprocess.Popen, version: str,
                           login: str | None = None, meanwhile=lambda: None) -> None:
    """Kill `client` (what holds the SSH connection; first stop `login`, the scope it runs in,
    as logind does with KillUserProcesses=yes) while the stand-in DKMS build sleeps, and call
    `meanwhile` while the bump still runs; then the detached bump must end on its own with every
    package at `version` and held."""
    try:
        wait_until(lambda: rig_ssh(rig, f"test -e {DKMS_BUILDING}", check=False)
                   .returncode == 0, "the DKMS build to start")
        assert bump_running(rig)
        if login:
            rig_ssh(rig, f"systemctl stop {login}")  # the logout: every process in it is killed
            assert rig_ssh(rig, f"systemctl is-active {login}", check=False).stdout.strip() != (
                "active")
    finally:
        client.kill()
        client.wait()
    assert bump_running(rig)  # the bump outlives its connection and its login
    meanwhile()
    wait_until(lambda: not bump_running(rig), "the detached bump to end", limit=120)
    assert holds(rig) >= set(PACKAGES)
    assert versions(rig) == {name: f"{version}-1" for name in PACKAGES}  # apt ran to its end
    assert rig_ssh(rig, "dpkg --audit").stdout == ""
    log = rig_ssh(rig, f"cat $(ls -t {BUMP_LOGS} | head -1)").stdout
    assert f"Setting up nvidia-kernel-open-dkms ({version}-1)" in log, log


#: The transient scope that stands in for an SSH login's session scope.
LOGIN = "rigbook-test-login.scope"


def test_bump_keeps_the_hold_when_apt_fails_or_the_connection_drops(sandbox):
    """The bump's apt step runs on the rig as bump.sh in a unit of its own: a failed DKMS build,
    a dropped SSH connection, with or without a terminal, and the end of the login (its scope
    stopped) all end with every driver package held; a bump while one runs is refused.

    Seen here with the bump as one SSH command (before bump.sh): pyinfra's connection (no
    terminal) dropping midway left apt running and the hold came back; a session with a
    terminal dropping midway (sshd hangs up the terminal: SIGHUP) left the driver unheld."""
    rig1 = sandbox["rig1"]
    forget_driver(rig1)
    try:
        first = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1")
        assert first.returncode == 0, first.explain()
        assert versions(rig1) == {name: f"{OLD}-1" for name in PACKAGES}

        # 1. The new module does not build (apt fails in a postinst): the rig fails at the move,
        #    apt's error is shown, and every package is held again, the half-configured included.
        rig_ssh(rig1, f"touch {DKMS_FAILS}")
        failed = run_pyinfra(SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                             "--data", f"driver_version={NEW}", "--data", "allow_reboot=false")
        assert failed.returncode != 0
        said = failed.stderr
        assert "Bad return status for module build (simulated" in said, failed.explain()
        assert said.index("E: Sub-process /usr/bin/dpkg returned an error code (1)") < said.index(
            "nvidia-kernel-open-dkms set on hold."), failed.explain()
        assert holds(rig1) >= set(PACKAGES)
        states = dpkg_states(rig1)
        assert states["nvidia-kernel-open-dkms"].startswith("hF"), states  # held, half-way
        assert all(state.startswith("h") for state in states.values()), states

        # 2. With the cause gone, the same bump again finishes the move; its connection drops
        #    (pyinfra killed) while the now slow DKMS build runs: the bump ends on the rig. The
        #    bump run again meanwhile is refused before it plans on the moving packages.
        rig_ssh(rig1, f"rm {DKMS_FAILS} && echo 30 > {DKMS_SECONDS}")
        bump_new = (SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                    "--data", f"driver_version={NEW}", "--data", "allow_reboot=false")
        pyinfra = subprocess.Popen([PYINFRA, "-y", *bump_new], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def refused_while_it_runs():
            busy = run_pyinfra(*bump_new)
            assert busy.returncode != 0, busy.explain()
            assert "package work under way" in busy.stderr, busy.explain()
            assert ('operation "NVIDIA driver bump | Driver bump: no package work under way" '
                    "failed") in busy.stderr, busy.explain()
            assert bump_running(rig1)  # still running: the refusal came while it did

        drop_during_dkms_build(rig1, pyinfra, NEW, meanwhile=refused_while_it_runs)

        # 3. The command the bump runs (tests/test_driver.py checks its text), in a session with
        #    a terminal, inside a scope that stands in for the SSH login's session scope (the
        #    rigs' logins are no logind sessions: no pam_systemd). Midway the scope is stopped,
        #    as logind stops it when the login ends where KillUserProcesses=yes, and the
        #    terminal hangs up: the apt step runs in its own unit and goes on.
        specs = " ".join(f"'{name}={OLD}-*'" for name in PACKAGES)
        terminal = subprocess.Popen(
            ["ssh", "-tt", "-i", rig1["ssh_key"], "-o", "StrictHostKeyChecking=no",
             "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
             f"root@{rig1['address']}",
             f"systemd-run --scope --quiet --unit={LOGIN} -- {BUMP_SCRIPT} --detach {specs}"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        drop_during_dkms_build(rig1, terminal, OLD, login=LOGIN)
        rig_ssh(rig1, f"rm {DKMS_SECONDS}")

        # The rig never rebooted since the converge: the old module still runs, and the old
        # driver is installed and held again. The bump to it is done; a converge changes nothing.
        redo = run_pyinfra(SANDBOX_INVENTORY, BUMP, "--limit", "rig1",
                           "--data", f"driver_version={OLD}")
        assert redo.returncode == 0 and redo.changed() == {}, redo.explain()
        assert f"driver {OLD} is already running: nothing to bump" in redo.stderr, redo.explain()
        assert smi_driver(rig1) == OLD
        # The converge moves the apt pin back to the old version (step 3 ran the script alone,
        # without the deploy that pins first) and nothing else; a second converge changes nothing.
        pin = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1")
        assert pin.returncode == 0, pin.explain()
        assert pin.changed() == {f"NVIDIA driver | Pin the driver packages to {OLD}-*": ["rig1"]}
        again = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1")
        assert again.returncode == 0 and again.changed() == {}, again.explain()
    finally:
        rig_ssh(rig1, f"rm -f {DKMS_FAILS} {DKMS_SECONDS}; systemctl stop {LOGIN} {BUMP_UNIT}; "
                      f"systemctl reset-failed {BUMP_UNIT}", check=False)


KEYRING_DIR = "/run/rigbook-test-keyring"
KEYRING_PORT = 18181


def test_the_keyring_is_installed_only_when_its_sha256_matches(sandbox, tmp_path):
    """cuda_keyring against a stand-in .deb served on the rig's loopback (the rigs have no
    route out, and neither curl nor wget: the python3 download): a wrong pin installs nothing
    and says both hashes, the right one installs it, the next run changes nothing."""
    rig = sandbox["rig2"]
    rig_ssh(rig, f"mkdir -p {KEYRING_DIR}/pkg/DEBIAN {KEYRING_DIR}/pkg/usr/share/rigbook-test && "
                 f"printf 'Package: cuda-keyring\\nVersion: 1.1-1\\nArchitecture: all\\n"
                 "Maintainer: rigbook tests <tests@localhost>\\nDescription: stand-in\\n' "
                 f"> {KEYRING_DIR}/pkg/DEBIAN/control && echo key > "
                 f"{KEYRING_DIR}/pkg/usr/share/rigbook-test/keyring && dpkg-deb -b "
                 f"{KEYRING_DIR}/pkg {KEYRING_DIR}/cuda-keyring_1.1-1_all.deb >/dev/null && "
                 f"systemd-run --unit rigbook-test-keyring --collect python3 -m http.server "
                 f"{KEYRING_PORT} --bind 127.0.0.1 --directory {KEYRING_DIR}")
    right = rig_ssh(rig, f"sha256sum {KEYRING_DIR}/cuda-keyring_1.1-1_all.deb").stdout.split()[0]
    url = f"http://127.0.0.1:{KEYRING_PORT}/cuda-keyring_1.1-1_all.deb"

    def deploy(sha256: str):
        path = tmp_path / f"keyring-{sha256[:8]}.py"
        path.write_text("from rigbook.roles.driver import cuda_keyring\n"
                        f"cuda_keyring(name='NVIDIA repository key', url={url!r}, "
                        f"sha256={sha256!r})\n")
        return run_pyinfra(SANDBOX_INVENTORY, str(path), "--limit", "rig2")

    try:
        rig_ssh(rig, "python3 - <<'RIGBOOK_EOF'\nimport time, urllib.request\n"
                     "for _ in range(150):\n    try:\n"
                     f"        urllib.request.urlopen({url!r}); break\n"
                     "    except OSError:\n        time.sleep(0.2)\nRIGBOOK_EOF")
        wrong = deploy("0" * 64)
        assert wrong.returncode != 0, wrong.explain()
        assert (f"{url}: sha256 mismatch: expected {'0' * 64}, actual {right}; not installed"
                in wrong.stderr), wrong.explain()
        assert rig_ssh(rig, "dpkg-query -W cuda-keyring", check=False).returncode != 0
        installed = deploy(right)
        assert installed.returncode == 0, installed.explain()
        assert installed.changed() == {"NVIDIA repository key": ["rig2"]}, installed.explain()
        assert rig_ssh(rig, "dpkg-query -W -f '${Version}' cuda-keyring").stdout == "1.1-1"
        again = deploy(right)
        assert again.returncode == 0 and again.changed() == {}, again.explain()
    finally:
        rig_ssh(rig, f"systemctl stop rigbook-test-keyring; dpkg -r cuda-keyring >/dev/null; "
                     f"rm -rf {KEYRING_DIR}", check=False)


def kill_apt_mid_postinst(rig: dict) -> None:
    """SIGKILL apt-get, dpkg and the stand-in DKMS postinst while it "builds": what a rig that
    dies in the middle of apt leaves (the processes are the ones this test started)."""
    wait_until(lambda: rig_ssh(rig, f"test -e {DKMS_BUILDING}", check=False).returncode == 0,
               "the DKMS build to start")
    rig_ssh(rig, "post=$(pgrep -f '[n]vidia-kernel-open-dkms.postinst'); "
            "kill -KILL $(pgrep -x apt-get) $(pgrep -x dpkg) $post $(for p in $post; do "
            f"pgrep -P $p; done); rm -f {DKMS_BUILDING}", check=False)


def test_a_driver_install_killed_mid_apt_is_finished_and_held_by_the_next_converge(sandbox):
    """Issue 30: a rig that died in the middle of apt ("E: dpkg was interrupted, you must
    manually run 'dpkg --configure -a'"): the preflight says so, the next converge runs
    dpkg --configure -a before the driver and holds it, and a second converge changes nothing."""
    rig1 = sandbox["rig1"]
    forget_driver(rig1)
    try:
        rig_ssh(rig1, f"mkdir -p /etc/rigbook-sim && echo 60 > {DKMS_SECONDS}")
        converge = subprocess.Popen(
            [PYINFRA, "-y", SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            kill_apt_mid_postinst(rig1)
        finally:
            converge.kill()
            converge.wait()
        rig_ssh(rig1, f"rm -f {DKMS_SECONDS}")
        states = dpkg_states(rig1)
        assert states["nvidia-kernel-open-dkms"][1] in "UF", states  # not configured
        assert not holds(rig1) & set(PACKAGES)
        audit = rig_ssh(rig1, "dpkg --audit", check=False).stdout
        assert "nvidia-kernel-open-dkms" in audit, audit
        apt = rig_ssh(rig1, "apt-get install -s nvidia-open", check=False)
        assert "not fully installed" in apt.stdout + apt.stderr, apt.stdout + apt.stderr

        # status says it, and so does the converge's preflight; the converge finishes the work
        # before the driver, then installs nothing more and holds every package.
        seen = rigbook("status", SANDBOX_INVENTORY, "--json", "--limit", "rig1", check=False)
        (status,) = json.loads(seen.stdout)["rigs"]
        said = [f["reason"] for f in status["findings"] if "dpkg was interrupted" in f["reason"]]
        assert said and "nvidia-kernel-open-dkms" in said[0], status["findings"]
        repair = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1")
        assert repair.returncode == 0, repair.explain()
        assert "dpkg was interrupted (" in repair.stderr + repair.stdout, repair.explain()
        changed = driver_changes(repair)
        assert changed.get("NVIDIA driver | Finish interrupted package work "
                           "(dpkg --configure -a)") == ["rig1"], repair.explain()
        assert changed.get("NVIDIA driver | Hold the driver packages (apt-mark hold)") == ["rig1"]
        assert versions(rig1) == {name: f"{OLD}-1" for name in PACKAGES}
        assert holds(rig1) >= set(PACKAGES)
        assert rig_ssh(rig1, "dpkg --audit").stdout == ""
        assert smi_driver(rig1) == OLD

        again = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1")
        assert again.returncode == 0 and again.changed() == {}, again.explain()
    finally:
        # Back to a rig whose packages are all configured and held, whatever failed above.
        rig_ssh(rig1, f"rm -f {DKMS_SECONDS} {DKMS_FAILS} {DKMS_BUILDING}; "
                "if [ -n \"$(dpkg --audit)\" ]; then DEBIAN_FRONTEND=noninteractive "
                "dpkg --configure -a; fi; "
                f"apt-mark hold $(dpkg-query -W -f='${{Package}}\\n' {' '.join(PACKAGES)} "
                "2>/dev/null) >/dev/null 2>&1", check=False)
