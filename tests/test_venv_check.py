"""The serving unit's venv check (rigbook/rigside/venv_check.py): the driver bump's hold, then the
live venv's manifest against the driver nvidia-smi reports; one line, and a refusal whenever either
cannot be read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rigbook.rigside import venv_check
from rigbook.roles import venvs

CHECK = Path(venv_check.__file__)


def test_it_reads_the_manifest_rigbook_writes():
    assert venv_check.MANIFEST == venvs.MANIFEST


@pytest.fixture
def rig(tmp_path: Path):
    """A venv folder (its manifest written per test), a stand-in nvidia-smi, no hold."""
    venv, hold = tmp_path / "vllm-0.33", tmp_path / "serving-held"
    venv.mkdir()
    smi = tmp_path / "nvidia-smi"

    def answer(body: str) -> None:
        smi.write_text(f"#!/bin/sh\n{body}\n")
        smi.chmod(0o755)

    def check(gpu: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-I", "-S", str(CHECK), "--venv", str(venv),
                               "--hold", str(hold), *(["--smi", str(smi)] if gpu else [])],
                              capture_output=True, text=True, timeout=30)

    answer("printf '580.159.04\\n580.159.04\\n'")  # one line per GPU
    return venv, answer, check


def test_a_venv_built_for_the_running_driver_starts(rig):
    venv, _, check = rig
    (venv / venvs.MANIFEST).write_text('{"driver": "580.159.04", "spec_hash": "x"}')
    done = check()
    assert (done.returncode, done.stdout, done.stderr) == (
        0, "venv vllm-0.33 was built for driver 580.159.04, which runs\n", "")


@pytest.mark.parametrize("manifest, says", [
    ('{"driver": "580.95.05"}', "venv vllm-0.33 was built for driver 580.95.05, driver "
                                "580.159.04 runs: not starting the engine on it; rebuild it: "
                                "pyinfra INVENTORY deploys/venvs.py"),
    ('{"driver": null}', "venv vllm-0.33 was built for driver none, driver 580.159.04 runs"),
    (None, "venv vllm-0.33 has no build to run ("),
    ('{"driver": "580.1', "venv vllm-0.33 has no build to run ("),  # torn: the build was cut
    ("[]", "venv vllm-0.33 has no build to run ("),
])
def test_another_driver_or_no_manifest_refuses_in_one_line(rig, manifest, says):
    venv, _, check = rig
    if manifest is not None:
        (venv / venvs.MANIFEST).write_text(manifest)
    done = check()
    assert done.returncode == 1 and done.stdout == ""
    assert says in done.stderr and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize("smi", [
    # What the real nvidia-smi says while the user-space driver and the module disagree.
    "echo 'Failed to initialize NVML: Driver/library version mismatch'; exit 18",
    "exit 0",  # no GPU listed
    "printf '580.159.04\\n580.95.05\\n'",  # two drivers at once: not a version to trust
])
def test_no_driver_to_read_refuses(rig, smi):
    venv, answer, check = rig
    (venv / venvs.MANIFEST).write_text('{"driver": "580.159.04"}')
    answer(smi)
    done = check()
    assert done.returncode == 1
    assert done.stderr.startswith("venv vllm-0.33: cannot read the running driver: "), done.stderr


HOLD_LINE = ("serving is held by the driver bump to 580.159.04: rebuild the venvs (pyinfra "
             "INVENTORY deploys/venvs.py), which starts it again")


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu-recipe", "cpu-only-recipe"])
def test_a_held_rig_refuses_with_the_holds_line_until_it_is_gone(rig, tmp_path, gpu):
    venv, _, check = rig
    (venv / venvs.MANIFEST).write_text('{"driver": "580.159.04"}')  # current: held all the same
    hold = tmp_path / "serving-held"
    hold.write_text(HOLD_LINE + "\n")
    done = check(gpu)
    assert (done.returncode, done.stdout, done.stderr) == (1, "", f"{hold}: {HOLD_LINE}\n")
    hold.unlink()
    done = check(gpu)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ("venv vllm-0.33 was built for driver 580.159.04, which runs\n" if gpu
                           else f"serving is not held ({hold} is absent)\n")


def test_a_cpu_only_recipe_is_not_held_back_by_its_venvs_driver(rig):
    """Its unit reaches no GPU device (DevicePolicy=closed), so nvidia-smi is not asked: only
    the hold keeps it from starting after a bump."""
    venv, answer, check = rig
    (venv / venvs.MANIFEST).write_text('{"driver": "580.95.05"}')
    answer("exit 1")
    assert check(gpu=False).returncode == 0
