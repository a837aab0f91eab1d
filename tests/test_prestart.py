"""The serving unit's pre-start checks cannot be switched off by the engine's user (issue 29, 2).

The cap check (rigbook/rigside/cap_check.py), the venv check (rigbook/rigside/venv_check.py) and the
GPU-lost check (rigbook-xid-watch --check) run before
every start of rigbook-serve.service. The engine's user writes its home (the unit's HOME and
WorkingDirectory) and a recipe sets the unit's environment: a `.pth` file in that user's site
folder, or a PYTHONPATH with a sitecustomize.py, runs before either check and can make it exit 0.
Each rendered ExecStartPre that runs python is run here as systemd runs it, with the
environment and working directory systemd gives it (the User='s HOME, USER and SHELL, the env
file's variables, the home as cwd): the real programs, with the rig's real /usr/bin/python3 (a
venv's python has no user site folder, so it would prove nothing).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from rigbook import FILES
from rigbook.core.envvars import LOADER_ENV
from rigbook.core.errors import RigbookError
from rigbook.core.pins import venv_link
from rigbook.roles import power
from rigbook.roles.guards import GPU_LOST_HEADLINE, WATCH, XID_SOURCE
from rigbook.roles.recipes import Recipe, load_recipe
from rigbook.roles.serving import (
    CAP_CHECK_PATH,
    CAP_CHECK_SOURCE,
    SERVE_USER,
    VENV_CHECK_PATH,
    VENV_CHECK_SOURCE,
    render_unit,
    serve_plan,
)
from rigbook.roles.venvs import BASE_PATH, MANIFEST
from tests.test_recipes import _toml, recipe_data
from tests.test_serving import SMI, dual_rig

PYTHON = "/usr/bin/python3"
EXIT_0 = "import os; os._exit(0)\n"
#: systemd's prefixes of an Exec line (systemd.service(5), "Special executable prefixes").
PREFIXES = "-@:+!|"



def python_checks(unit: str) -> list[tuple[str, list[str]]]:
    """(prefix, argv) of each ExecStartPre= of a unit that runs python, split as systemd does
    (the lines are rendered with systemd_word: shell quoting reads them the same)."""
    checks = []
    for line in unit.splitlines():
        if line.startswith("ExecStartPre="):
            command = line.removeprefix("ExecStartPre=")
            argv = shlex.split(command.lstrip(PREFIXES))
            if PYTHON in argv:
                checks.append((command[:len(command) - len(command.lstrip(PREFIXES))], argv))
    return checks


@pytest.fixture
def rig(tmp_path: Path) -> dict[str, str]:
    """The rig's paths the checks read, as test copies: the programs as installed (the watch
    with its xid.py beside it), no power unit, a GPU-lost mark, and a venv built for another
    driver than the one a stand-in nvidia-smi reports."""
    serving, guards, run = tmp_path / "serving", tmp_path / "guards", tmp_path / "run"
    venv = tmp_path / "venv"
    for folder in (serving, guards, run, venv):
        folder.mkdir()
    shutil.copy(CAP_CHECK_SOURCE, serving / "cap_check.py")
    shutil.copy(VENV_CHECK_SOURCE, serving / "venv_check.py")
    (venv / MANIFEST).write_text('{"driver": "580.95.05"}\n')
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 580.159.04\n")
    smi.chmod(0o755)
    shutil.copy(FILES / "guards" / "rigbook-xid-watch", guards)
    shutil.copy(XID_SOURCE, guards / "xid.py")
    (run / "gpu-lost").write_text(f"{GPU_LOST_HEADLINE}\n")
    return {CAP_CHECK_PATH: str(serving / "cap_check.py"),
            VENV_CHECK_PATH: str(serving / "venv_check.py"),
            venv_link("vllm-0.33"): str(venv), SMI: str(smi),
            power.UNIT_PATH: str(tmp_path / "nvidia-power-limit.service"),
            WATCH: str(guards / "rigbook-xid-watch"), "mark": str(run / "gpu-lost")}


def planted(tmp_path: Path, plant: str) -> tuple[dict[str, str], Path]:
    """The environment and cwd systemd gives a command of the serving unit, with what the
    engine's user (its home) or a recipe (the env file) planted: `pth` or `pythonpath`."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": BASE_PATH, "HOME": str(home), "USER": SERVE_USER, "LOGNAME": SERVE_USER,
           "SHELL": "/usr/sbin/nologin"}
    if plant == "pth":
        site = Path(subprocess.run([PYTHON, "-c", "import site; print(site.getusersitepackages())"],
                                   env={"HOME": str(home)}, capture_output=True, text=True,
                                   check=True).stdout.strip())
        assert site.is_relative_to(home), site
        site.mkdir(parents=True)
        (site / "rigbook-off.pth").write_text(EXIT_0)
    else:
        folder = tmp_path / "pythonpath"
        folder.mkdir()
        (folder / "sitecustomize.py").write_text(EXIT_0)
        env["PYTHONPATH"] = str(folder)
    return env, home


def program(argv: list[str]) -> int:
    """Where the program is in a python command line (after the interpreter's own options)."""
    return next(i for i in range(argv.index(PYTHON) + 1, len(argv))
                if not argv[i].startswith("-"))


def checks() -> list[tuple[str, list[str]]]:
    """The serving unit's python checks, then the guards drop-in's."""
    unit = render_unit(serve_plan(dual_rig(), "rig1"), SMI)
    dropin = (FILES / "guards" / "rigbook-serve-guards.conf").read_text()
    found = python_checks(unit) + python_checks(dropin)
    assert [argv[program(argv)] for _, argv in found] == [CAP_CHECK_PATH, VENV_CHECK_PATH, WATCH]
    return found


@pytest.mark.skipif(not Path(PYTHON).is_file(), reason=f"no {PYTHON}")
@pytest.mark.parametrize("plant", ["pth", "pythonpath"])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["cap-check", "venv-check", "gpu-lost-check"])
def test_a_planted_pth_or_pythonpath_does_not_switch_off_a_pre_start_check(
        tmp_path, rig, plant, which):
    prefix, argv = checks()[which]
    # Not as the engine's user: "!" keeps the unit's sandbox but not its User= (root, no
    # capability: CapabilityBoundingSet= is empty).
    assert prefix == "!", prefix
    argv = [rig.get(word, word) for word in argv]
    if which == 2:
        argv += ["--mark", rig["mark"]]  # the watch's own default is /run/rigbook/gpu-lost
    env, home = planted(tmp_path, plant)
    script = program(argv)
    # The plant works: the program run as it used to be (`/usr/bin/python3 PROGRAM ...`) exits
    # 0, silently, with no power unit / with the mark present.
    before = subprocess.run([PYTHON, *argv[script:]], env=env, cwd=home, capture_output=True,
                            text=True, timeout=60)
    assert (before.returncode, before.stdout, before.stderr) == (0, "", "")
    # The line as rendered still refuses the start.
    now = subprocess.run(argv, env=env, cwd=home, capture_output=True, text=True, timeout=60)
    assert now.returncode == 1, (now.stdout, now.stderr)
    if which == 0:
        assert now.stdout.startswith("rigbook: not starting the engine uncapped: cannot read")
    elif which == 1:
        assert now.stderr.endswith("was built for driver 580.95.05, driver 580.159.04 runs: not "
                                   "starting the engine on it; rebuild it: pyinfra INVENTORY "
                                   "deploys/venvs.py\n"), now.stderr
    else:
        assert f"{rig['mark']}: {GPU_LOST_HEADLINE}" in now.stderr


@pytest.mark.parametrize("name", [*LOADER_ENV, "LD_BIND_NOT", "LD_ANYTHING"])
def test_a_recipe_may_not_set_what_the_dynamic_loader_or_libc_reads(tmp_path, name):
    """The unit's environment reaches every program systemd starts for it, also /usr/bin/env of
    the checks that run as root (it clears the environment only for what it starts):
    LD_PRELOAD=/dev/shm/x.so would load a library the engine wrote into a root process."""
    path = tmp_path / "x.toml"
    path.write_text(_toml(recipe_data(env={name: "/dev/shm/x.so"})))
    with pytest.raises(RigbookError) as error:
        load_recipe(path)
    assert f"env: {name} is read by the dynamic loader or libc" in str(error.value)
    assert str(path) in str(error.value)


def test_a_recipe_may_still_set_its_engines_own_variables():
    env = {"PYTHONPATH": "/opt/x", "NCCL_DEBUG": "WARN", "OLD_LD_PRELOAD": "x"}
    assert dict(Recipe.model_validate(recipe_data(env=env)).env) == env
