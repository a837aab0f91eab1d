"""Serving venvs end to end on the dual-3090 sandbox rig (rig1), driven by the pyinfra CLI.

One story, in order, because each step starts from the state the last one left: the converge
builds a small real venv (tools venv, uv from the wheelhouse, smoke test, manifest, symlink,
launcher environment), its phases and uv's counts in pyinfra's output; a second converge
changes nothing; a changed pin builds a new venv and swaps (the old one kept); reverting the
pin swaps back to the kept build; a pin that cannot install fails the rig with uv's reason and
leaves the working venv and its symlink; a driver bump (stand-in packages installed over SSH,
rig rebooted) makes the converge report the venv stale without touching it, and
deploys/venvs.py rebuilds it, keeping the build it replaced and pruning the other; run again,
it changes nothing. Then a venv whose smoke test takes 6 s shows its phases in pyinfra's output
while it builds.
Sandbox rigs have no route out: the packages come from the wheelhouse this test fills with
`pip download` (Python 3.11, manylinux x86_64; no torch), which every rig sees read-only.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from rigbook.core.pins import VENVS_DIR
from rigbook.core.tools import TOOLS_PINS, TOOLS_VENV
from rigbook.inventory import load_rigs
from rigbook.roles.venvs import env_file, parse_smi_header, spec_hash
from rigbook.sandbox import wheelhouse
from tests.conftest import SANDBOX_INVENTORY, rig_ssh, rigbook, run_pyinfra
from tests.standins import fill_wheelhouse
from tests.test_models import ensure_wheels
from tests.test_models_e2e import pyinfra_timed
from tests.test_venvs import make_wheel

CONVERGE = "deploys/rig.py"
REBUILD = "deploys/venvs.py"
NAME = "demo"
OLD, NEW = "580.95.05", "580.159.04"
DRIVER_PACKAGES = ("libnvidia-ml1", "nvidia-kernel-open-dkms", "nvidia-open", "nvidia-persistenced",
                   "nvidia-smi")
VENV_OP = f"Python venvs | Venv {NAME}"
ENV_OP = f"Python venvs | Launcher environment {env_file(NAME)}"

pytestmark = pytest.mark.sandbox


def venv_specs(pin: str) -> list[dict]:
    return [{"name": NAME, "engine": "none", "python": "3.11", "packages": [pin]}]


def venvs_data(pin: str) -> list[str]:
    """--data for one test venv (pyinfra reads the value as JSON)."""
    return ["--data", "venvs=" + json.dumps(venv_specs(pin))]


def target(rig: dict) -> str | None:
    done = rig_ssh(rig, f"readlink {VENVS_DIR}/{NAME}", check=False)
    return done.stdout.strip().rsplit("/", 1)[-1] if done.returncode == 0 else None


def builds(rig: dict) -> set[str]:
    listing = rig_ssh(rig, f"ls -1 {VENVS_DIR} 2>/dev/null || true").stdout.split()
    return {entry for entry in listing if re.fullmatch(rf"{NAME}-[0-9a-f]{{12}}-\d{{8}}T\d{{6}}Z",
                                                       entry)}


def manifest(rig: dict, build: str) -> dict:
    return json.loads(rig_ssh(rig, f"cat {VENVS_DIR}/{build}/rigbook-manifest.json").stdout)


def six_version(rig: dict) -> str:
    return rig_ssh(rig, f"{VENVS_DIR}/{NAME}/bin/python -c 'import six; print(six.__version__)'"
                   ).stdout.strip()


def smi_driver(rig: dict) -> str | None:
    done = rig_ssh(rig, "nvidia-smi --query-gpu=driver_version --format=csv,noheader",
                   check=False)
    return done.stdout.split()[0] if done.returncode == 0 and done.stdout.split() else None


def switch_driver(rig: dict, version: str) -> None:
    """Install the stand-in driver packages of `version` over SSH and reboot into them."""
    held = " ".join(DRIVER_PACKAGES)
    pins = " ".join(f"{name}={version}-1" for name in DRIVER_PACKAGES)
    rig_ssh(rig, f"apt-mark unhold {held} >/dev/null && apt-get update -qq && "
                 "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --allow-downgrades "
                 f"--allow-change-held-packages {pins} >/dev/null && apt-mark hold {held}")
    rigbook("sandbox", "restart", rig["name"])
    deadline = time.monotonic() + 60
    while smi_driver(rig) != version and time.monotonic() < deadline:
        time.sleep(1)
    assert smi_driver(rig) == version


def venv_changes(run) -> dict[str, list[str]]:
    return {name: hosts for name, hosts in run.changed().items() if name.startswith("Python venvs")}


def test_venv_build_swap_fail_stale_rebuild(sandbox, monkeypatch):
    rig1 = sandbox["rig1"]
    monkeypatch.setenv("RIGBOOK_PROGRESS_EVERY", "1")
    fill_wheelhouse()
    installed = smi_driver(rig1)
    if installed not in (None, OLD):  # an earlier test left another driver running
        switch_driver(rig1, OLD)
    rig_ssh(rig1, "rm -rf /opt/rigbook/venvs /opt/rigbook/tools")  # guards stay: serving needs them
    bumped = False
    try:
        # 1. First converge: tools venv, then the venv built, smoke-tested, swapped in.
        first = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1",
                            *venvs_data("six==1.16.0"))
        assert first.returncode == 0, first.explain()
        assert first.changed().get(VENV_OP) == ["rig1"], first.explain()
        assert first.changed().get(ENV_OP) == ["rig1"], first.explain()
        shown = [line.strip().removeprefix(f"[rig1] venv {NAME}: ")
                 for line in first.stderr.splitlines()
                 if line.strip().startswith(f"[rig1] venv {NAME}: ")]
        print("\nthe build as pyinfra printed it:\n" + "\n".join(shown))
        assert shown[:2] == ["creating the venv with Python 3.11",
                             "installing 1 requirement(s): resolving, downloading, installing"]
        uv_said = [" ".join(line.split()[:3]) for line in shown[2:-2]]  # Prepared: not if cached
        assert uv_said[0] == "Resolved 1 package" and uv_said[-1] == "Installed 1 package", shown
        assert shown[-2] == "smoke test: imports, CUDA libraries, the manifest"
        assert re.fullmatch(r"built, smoke-tested and swapped in after \d+\.\d s", shown[-1])
        pip_list = rig_ssh(rig1, f"{TOOLS_VENV}/bin/python -m pip list --format=json").stdout
        tools = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(pip_list)}
        assert tools["uv"] == TOOLS_PINS["uv"]
        assert tools["huggingface-hub"] == TOOLS_PINS["huggingface_hub"]
        assert "hf-xet" in tools
        (b1,) = builds(rig1)
        assert target(rig1) == b1
        rig = load_rigs(SANDBOX_INVENTORY, {"venvs": venv_specs("six==1.16.0")})["rig1"]
        digest = spec_hash(rig.venvs[0], rig)
        assert b1.startswith(f"{NAME}-{digest}-")
        built = manifest(rig1, b1)
        header = parse_smi_header(rig_ssh(rig1, "nvidia-smi").stdout)
        assert header is not None and header[0] == OLD
        assert built["spec_hash"] == digest
        assert built["driver"] == OLD and built["cuda"] == header[1]
        assert built["packages"]["six"] == "1.16.0"
        assert built["smoke_import"] == "six" and built["cuda_runtime"] is None
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", built["built_at"])
        assert six_version(rig1) == "1.16.0"
        env = rig_ssh(rig1, f"cat {env_file(NAME)}").stdout.splitlines()
        assert f'PATH="{VENVS_DIR}/{NAME}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:' \
               '/sbin:/bin"' in env
        assert 'VLLM_USE_FLASHINFER_SAMPLER="0"' in env  # no nvcc anywhere on a sandbox rig
        assert not any(line.startswith("CUDA_HOME=") for line in env)  # no torch, no nvidia/cu13

        # 2. Second converge: nothing changes.
        second = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1",
                             *venvs_data("six==1.16.0"))
        assert second.returncode == 0, second.explain()
        assert second.changed() == {}, second.explain()

        # 3. A changed pin: a new build, swapped in; the old one is kept for rollback.
        change = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1",
                             *venvs_data("six==1.17.0"))
        assert change.returncode == 0, change.explain()
        assert change.changed() == {VENV_OP: ["rig1"]}, change.explain()
        b2 = target(rig1)
        assert b2 != b1 and builds(rig1) == {b1, b2}
        assert six_version(rig1) == "1.17.0"

        # 4. The pin reverted: the symlink goes back to the kept build, nothing is built.
        revert = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1",
                             *venvs_data("six==1.16.0"))
        assert revert.returncode == 0, revert.explain()
        assert revert.changed() == {VENV_OP: ["rig1"]}, revert.explain()
        assert target(rig1) == b1 and builds(rig1) == {b1, b2}
        assert six_version(rig1) == "1.16.0"

        # 5. A pin that cannot install: the rig fails with uv's reason; nothing else moves.
        bad = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1",
                          *venvs_data("six==99.0.0"))
        assert bad.returncode != 0
        failing = bad.stderr.split(f"Starting operation: {VENV_OP}", 1)
        assert len(failing) == 2, bad.explain()  # the venv step is where the rig stopped
        assert f"rigbook: venv {NAME}: uv pip install failed; nothing swapped" in failing[1], (
            bad.explain()
        )
        assert "there is no version of six==99.0.0" in failing[1], bad.explain()  # uv's reason
        assert target(rig1) == b1 and builds(rig1) == {b1, b2}
        assert six_version(rig1) == "1.16.0"

        # 6. A driver bump under the venv: the converge reports it stale and changes nothing.
        switch_driver(rig1, NEW)
        bumped = True
        stale = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, "--limit", "rig1",
                            "--data", f"driver_version={NEW}", *venvs_data("six==1.16.0"))
        assert stale.returncode == 0, stale.explain()
        assert venv_changes(stale) == {}, stale.explain()
        assert (f"venv {NAME} is stale: built for driver {OLD}, running {NEW}: run "
                "deploys/venvs.py") in stale.stderr, stale.explain()
        assert target(rig1) == b1

        # 7. deploys/venvs.py rebuilds exactly that venv for the new driver; venvs_keep 1
        #    keeps the build it replaced and prunes the other one.
        rebuild = run_pyinfra(SANDBOX_INVENTORY, REBUILD, "--limit", "rig1",
                              "--data", f"driver_version={NEW}", *venvs_data("six==1.16.0"))
        assert rebuild.returncode == 0, rebuild.explain()
        assert venv_changes(rebuild) == {VENV_OP: ["rig1"]}, rebuild.explain()
        b3 = target(rig1)
        assert b3 not in (b1, b2) and b3.startswith(f"{NAME}-{digest}-")  # same spec, new build
        assert builds(rig1) == {b1, b3}
        rebuilt = manifest(rig1, b3)
        assert rebuilt["driver"] == NEW and rebuilt["packages"]["six"] == "1.16.0"
        assert "restart what runs from /opt/rigbook/venvs/demo yourself" in rebuild.stderr

        # 8. Again: nothing is stale, nothing changes.
        again = run_pyinfra(SANDBOX_INVENTORY, REBUILD, "--limit", "rig1",
                            "--data", f"driver_version={NEW}", *venvs_data("six==1.16.0"))
        assert again.returncode == 0, again.explain()
        assert again.changed() == {}, again.explain()
    finally:
        if bumped:  # leave the rig at the inventory's driver, for whatever runs next
            switch_driver(rig1, OLD)
        rig_ssh(rig1, "rm -rf /opt/rigbook/venvs /opt/rigbook/tools", check=False)


def test_a_slow_build_shows_its_phases_while_it_runs(sandbox, monkeypatch):
    """A venv whose module sleeps 6 s on import, so its smoke test does: the phases of its build
    come into pyinfra's output while it runs, seconds before the line that ends it."""
    rig1 = sandbox["rig1"]
    monkeypatch.setenv("RIGBOOK_PROGRESS_EVERY", "1")
    ensure_wheels([f"{name}=={version}" for name, version in TOOLS_PINS.items()], wheelhouse())
    make_wheel(wheelhouse(), "rigslow", "1.0", body="import time\ntime.sleep(6)\n")
    slow = [{"name": "slow", "engine": "none", "python": "3.11", "packages": ["rigslow==1.0"]}]
    try:
        run, lines = pyinfra_timed(SANDBOX_INVENTORY, REBUILD, "--limit", "rig1",
                                   "--data", "venvs=" + json.dumps(slow))
        assert run.returncode == 0, run.explain()
        where = "[rig1] venv slow: "
        seen = [(at, line.removeprefix(where)) for at, line in lines if line.startswith(where)]
        print("\nthe slow build as pyinfra printed it:\n"
              + "\n".join(f"{at:6.1f} s  {where}{text}" for at, text in seen))
        at = {text: when for when, text in seen}
        assert [text for _, text in seen if not text.startswith(("Resolved", "Prepared",
                                                                 "Installed"))][:3] == [
            "creating the venv with Python 3.11",
            "installing 1 requirement(s): resolving, downloading, installing",
            "smoke test: imports, CUDA libraries, the manifest"]
        assert re.fullmatch(r"built, smoke-tested and swapped in after \d+\.\d s", seen[-1][1])
        assert seen[-1][0] - at["smoke test: imports, CUDA libraries, the manifest"] >= 3
    finally:
        rig_ssh(rig1, f"rm -rf {VENVS_DIR}/slow {VENVS_DIR}/slow-* {VENVS_DIR}/slow.env "
                      f"{VENVS_DIR}/.slow.build.log", check=False)
        (wheelhouse() / "rigslow-1.0-py3-none-any.whl").unlink(missing_ok=True)
