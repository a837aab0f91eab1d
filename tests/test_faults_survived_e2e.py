"""The faults rigbook survived before issue 30 was fixed, kept proven on sandbox rigs: each
fault, then a rerun without it that converges, then a run that reports no changes, checking
that nothing is left half-done (docs/faults.md has the table of every fault and its test).

1. Pulls (deploys/models.py, rig1, against the hub stub inside the rig; the pulls write to a
   40 MiB tmpfs of their own, so the disk can be filled):
   - pyinfra SIGKILLed in the middle of a 32 MiB pull: the pull finishes on the rig; while it
     runs the snapshot has no manifest (never complete while partial);
   - a disk too full for the snapshot: refused before any download, with the numbers;
   - the disk filled in the middle of the download: named as a full disk, not retried, the
     partial file removed (its space freed), no manifest;
   - a torn manifest, then a truncated weights file: each detected, and repaired by a pull.
2. The converge (deploys/rig.py, rig1, a venv whose smoke test waits for a mark on disk):
   - the rig rebooted while the converge builds the venv: the run names the rig it lost; the
     rerun builds the venv again, leaving no half-built folder;
   - the power unit emptied and the live venv's manifest torn: the rerun writes the unit back
     and builds the venv again, exactly those.

Other faults have their tests beside the code they prove: docs/faults.md lists them all.
Bounded: every pyinfra run has a time limit. Every test puts its rig back as it found it (the
converge leaves rig1 converged, as tests/test_driver_e2e.py leaves it).
"""

from __future__ import annotations

import json
import signal

import pytest

from rigbook.core.pins import VENVS_DIR
from rigbook.roles.models import repo_folder
from rigbook.roles.power import UNIT_PATH
from rigbook.roles.venvs import MANIFEST
from rigbook.sandbox import wheelhouse
from tests.conftest import SANDBOX_INVENTORY, rig_ssh, rigbook, run_pyinfra
from tests.hubstub import big_repo
from tests.test_faults_e2e import (
    NAME,
    VENV_OP,
    cleanup_venv,
    live_build,
    venvs_data,
    wait_for,
    wheels,  # noqa: F401 (a fixture)
)
from tests.test_faults_fleet_e2e import Watched
from tests.test_models_e2e import (
    DEPLOY,
    TOKEN,
    deploy_args,
    pin,
    rig_with_stub,  # noqa: F401 (a fixture)
)
from tests.test_power_e2e import UNIT_OP, unit_text
from tests.test_venvs import make_wheel

pytestmark = pytest.mark.sandbox

BIG = big_repo()
#: A filesystem of its own for the faulted pulls, small enough to fill.
DISK, DISK_MIB = "/var/lib/rigbook/hf-faults", 40
CACHE = f"{DISK}/hub"
FILLER = f"{DISK}/filler"
REPO_DIR = f"{CACHE}/{repo_folder(BIG.repo_id)}"
MANIFEST_OF_BIG = f"{REPO_DIR}/rigbook/{BIG.commit}.json"
WEIGHTS = f"{REPO_DIR}/snapshots/{BIG.commit}/model.safetensors"
LABEL = f"{BIG.repo_id}@{BIG.commit[:12]}"
#: The pull of BIG on the rig, as `pgrep -f` sees it ([p]: not the shell that runs pgrep).
PULLING = f"pgrep -f '[p]ull.py --cache={CACHE} '"
#: The stub's pace for pulls that a fault must catch half way: 32 MiB in 8 s.
SLOW_HUB = ("--rate", str(4 * 2**20))


def ended(run: Watched) -> None:
    """The run stopped (killed if it still runs) and its output read."""
    if run.proc.poll() is None:
        run.proc.kill()
    run.wait(30)


class SmallDisk:
    """rig1, the hub stub in it, and the DISK_MIB filesystem its pulls of BIG go to."""

    def __init__(self, rig: dict, stub):
        self.rig, self.stub = rig, stub

    def ssh(self, command: str, check: bool = True):
        return rig_ssh(self.rig, command, check=check)

    def args(self) -> list[str]:
        """deploys/models.py's arguments: BIG into the small disk's cache, no disk margin."""
        return deploy_args(self.rig, models=(BIG,), models_cache=CACHE,
                           models_disk_margin_gib=0.0)

    def pull(self):
        return run_pyinfra(SANDBOX_INVENTORY, DEPLOY, *self.args(), timeout=300)

    def start_pull(self) -> Watched:
        return Watched(SANDBOX_INVENTORY, DEPLOY, *self.args())

    def downloading(self, at_least_mib: int) -> bool:
        """A download of BIG's weights has written more than this much."""
        return bool(self.ssh(f"find {REPO_DIR}/blobs -name '*.incomplete' "
                             f"-size +{at_least_mib}M 2>/dev/null", check=False).stdout.strip())

    def pulling(self) -> bool:
        return self.ssh(PULLING, check=False).returncode == 0

    def has_manifest(self) -> bool:
        return self.ssh(f"test -e {MANIFEST_OF_BIG}", check=False).returncode == 0

    def leftovers(self) -> list[str]:
        return self.ssh(f"find {REPO_DIR}/blobs -name '*.incomplete' 2>/dev/null",
                        check=False).stdout.split()

    def complete(self, what: str) -> None:
        """BIG is whole in the cache: the pinned manifest, weights that hash right, no partial
        download left."""
        sha = self.ssh(f"sha256sum {MANIFEST_OF_BIG} {WEIGHTS}").stdout.split()[::2]
        assert sha == [pin(BIG), BIG.file("model.safetensors").sha256], what
        assert self.leftovers() == [], what

    def converges_then_nothing(self, what: str):
        """The rerun without the fault ends with BIG complete; the next run changes nothing.
        Returns the rerun."""
        rerun = self.pull()
        assert rerun.returncode == 0, f"{what}: {rerun.explain()}"
        assert f"complete: 4 file(s), 32.00 MiB; manifest sha256 {pin(BIG)}" in rerun.stderr, \
            f"{what}: {rerun.explain()}"
        self.complete(what)
        again = self.pull()
        assert again.returncode == 0 and again.changed() == {}, f"{what}: {again.explain()}"
        return rerun

    def forget_big(self) -> None:
        self.ssh(f"rm -rf {REPO_DIR} {FILLER}")


@pytest.fixture
def small_disk(rig_with_stub, monkeypatch):  # noqa: F811 (the fixture imported above)
    """rig1 with the hub stub and a DISK_MIB tmpfs at DISK (root's, 0755), unmounted after."""
    rig, stub = rig_with_stub
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the stub's repos are gated
    disk = SmallDisk(rig, stub)
    disk.ssh(f"mkdir -p {DISK} && mount -t tmpfs -o size={DISK_MIB}m,mode=0755 "
             f"rigbook-faults {DISK}")
    try:
        yield disk
    finally:
        pids = disk.ssh(PULLING, check=False).stdout.split()  # a pull a failed test left
        if pids:
            disk.ssh(f"kill -KILL {' '.join(pids)}", check=False)
        disk.ssh(f"umount {DISK}; rmdir {DISK}", check=False)


def test_a_pull_killed_or_on_a_full_disk_or_torn_is_never_complete_until_it_is(small_disk):
    disk = small_disk

    # 1. The operator's pyinfra SIGKILLed a few MiB into the pull: the pull goes on on the rig
    #    and ends complete; until then its snapshot has no manifest.
    disk.stub.start(*SLOW_HUB)
    killed = disk.start_pull()
    try:
        wait_for("the weights' download", lambda: disk.downloading(2), timeout=180)
    finally:
        killed.proc.send_signal(signal.SIGKILL)
        ended(killed)
    assert disk.pulling(), "the pull died with its operator"
    assert not disk.has_manifest()
    wait_for("the orphaned pull to end", lambda: not disk.pulling(), timeout=60)
    disk.complete("the pull that outlived its operator")
    # the rig finished the work: the rerun converges with nothing left to do
    after = disk.pull()
    assert after.returncode == 0 and after.changed() == {}, after.explain()

    # 2. Not room enough: refused before any download, with the numbers; room again: converges.
    disk.forget_big()
    disk.stub.start()
    disk.ssh(f"head -c {(DISK_MIB - 16) << 20} /dev/zero > {FILLER}")
    refused = disk.pull()
    assert refused.returncode != 0, refused.explain()
    assert f"{LABEL}: pull refused: need 0.03 GiB + 0.00 GiB margin, have 0.02 GiB free on " \
           f"{DISK} (cache {CACHE}); nothing was downloaded" in refused.stderr, refused.explain()
    assert [r["route"] for r in disk.stub.requests()] == ["manifest"]
    disk.ssh(f"rm {FILLER}")
    disk.converges_then_nothing("after the refusal")

    # 3. The disk fills while the weights download: a full disk, said so, not retried; the
    #    partial file removed and no manifest written; with the space back, converges.
    disk.forget_big()
    disk.stub.start(*SLOW_HUB)
    filled = disk.start_pull()
    try:
        wait_for("the weights' download", lambda: disk.downloading(2), timeout=180)
        disk.ssh(f"head -c {DISK_MIB << 20} /dev/zero > {FILLER}", check=False)  # to ENOSPC
        assert filled.wait(120) != 0, filled.stderr[-4000:]
    finally:
        ended(filled)
    said = filled.stderr
    assert (f"{LABEL}: PARTIAL snapshot, not complete: the disk is full: no space left on "
            f"{DISK} (ENOSPC, [Errno 28]) while writing model.safetensors; not retried. The "
            "snapshot still needs 0.03 GiB") in said, said[-4000:]
    assert f"(cache {CACHE}): free at least " in said, said[-4000:]
    gets = [r for r in disk.stub.requests() if r["method"] == "GET"
            and r["path"].endswith("model.safetensors")]
    assert len(gets) == 1, gets  # not retried as a dropped connection
    assert not disk.has_manifest() and disk.leftovers() == []  # the partial file's space freed
    disk.ssh(f"rm {FILLER}")
    disk.converges_then_nothing("after the disk filled")

    # 4. A torn manifest: not complete; the pull hashes what is there and writes it again,
    #    downloading nothing.
    disk.ssh(f"truncate -s 100 {MANIFEST_OF_BIG}")
    disk.stub.start()
    rewritten = disk.converges_then_nothing("after the torn manifest")
    assert f"{LABEL}: nothing to download; complete: 4 file(s)" in rewritten.stderr
    assert [r["route"] for r in disk.stub.requests()] == ["manifest"]

    # 5. The weights cut short (their blob truncated): detected by its size, fetched again.
    disk.ssh(f"truncate -s 1M $(readlink -f {WEIGHTS})")
    fetched = disk.converges_then_nothing("after the truncated weights")
    assert f"{LABEL}: pulled 1 file(s), 32.00 MiB in " in fetched.stderr, fetched.explain()


#: While this file exists, the venv's smoke test waits. On disk: the converge's own reboot into
#: the driver keeps it; the test removes it once it rebooted the rig itself.
HOLD_MARK = "/var/tmp/rigbook-fault-hold"
HOLD = "rigfaulthold"
CONVERGE = "deploys/rig.py"
DATA = venvs_data(f"{HOLD}==1.0")


@pytest.fixture
def held_build(sandbox, wheels):  # noqa: F811 (the fixture imported above)
    """rig1, and a wheel whose import (the smoke test's) waits while HOLD_MARK exists (120 s at
    most); the venv removed after."""
    make_wheel(wheelhouse(), HOLD, "1.0", body=(
        "import os, time\nuntil = time.monotonic() + 120\n"
        f"while os.path.exists({HOLD_MARK!r}) and time.monotonic() < until:\n"
        "    time.sleep(0.2)\n"))
    rig = sandbox["rig1"]
    try:
        yield rig
    finally:
        (wheelhouse() / f"{HOLD}-1.0-py3-none-any.whl").unlink(missing_ok=True)
        rig_ssh(rig, f"rm -f {HOLD_MARK}", check=False)
        cleanup_venv(rig)


def builds(rig: dict) -> dict[str, bool]:
    """Every build folder of the venv -> whether it has its manifest (a finished build)."""
    out = rig_ssh(rig, f"for b in {VENVS_DIR}/{NAME}-*; do [ -d \"$b\" ] || continue; "
                       f"test -f \"$b/{MANIFEST}\" && echo \"$b 1\" || echo \"$b 0\"; done")
    return {line.split()[0]: line.split()[1] == "1" for line in out.stdout.splitlines()}


def converge():
    return run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1", *DATA, timeout=600)


def test_a_reboot_mid_converge_an_emptied_unit_and_a_torn_manifest_are_repaired(held_build):
    rig = held_build

    # 1. The rig reboots while the converge builds the venv (its smoke test held): the run
    #    fails that rig, naming it lost; the rerun builds the venv again; then nothing.
    rig_ssh(rig, f"touch {HOLD_MARK}")
    run = Watched(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1", *DATA)
    try:
        wait_for("the venv's smoke test", lambda: "rigbook phase: smoke test" in rig_ssh(
            rig, f"cat {VENVS_DIR}/.{NAME}.build.log", check=False).stdout, timeout=480)
        rebooted = rigbook("sandbox", "restart", "rig1", check=False)
        assert rebooted.returncode == 0, rebooted.stderr
        assert run.wait(120) != 0
    finally:
        ended(run)
    assert "    rig1  lost the connection to rig1" in run.stderr, run.stderr[-4000:]
    assert not any(builds(rig).values()), builds(rig)  # no build of it finished
    rig_ssh(rig, f"rm -f {HOLD_MARK}")
    rerun = converge()
    assert rerun.returncode == 0, rerun.explain()
    assert rerun.changed().get(VENV_OP) == ["rig1"], rerun.explain()
    live = live_build(rig)
    assert builds(rig) == {live: True}, builds(rig)  # the cut-off build was removed
    again = converge()
    assert again.returncode == 0 and again.changed() == {}, again.explain()

    # 2. The power unit emptied and the venv's manifest torn: the rerun writes the unit back
    #    and builds the venv again, nothing else; then nothing.
    unit = unit_text(rig)
    assert unit and "ExecStart=" in unit
    rig_ssh(rig, f": > {UNIT_PATH} && truncate -s 20 {live}/{MANIFEST}")
    repaired = converge()
    assert repaired.returncode == 0, repaired.explain()
    assert set(repaired.changed()) == {UNIT_OP, VENV_OP}, repaired.explain()
    assert unit_text(rig) == unit
    rebuilt = live_build(rig)
    assert rebuilt != live and builds(rig) == {rebuilt: True}, builds(rig)
    json.loads(rig_ssh(rig, f"cat {rebuilt}/{MANIFEST}").stdout)  # whole again
    again = converge()
    assert again.returncode == 0 and again.changed() == {}, again.explain()
