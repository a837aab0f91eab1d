"""The driver bump's hold on serving (issue 35, item 6): the bump stops rigbook-serve.service (or,
without systemd, rigbook's supervisor) and writes the hold that the venv check before every
start refuses on; deploys/venvs.py removes it, starts the recipe and waits for its health; a
converge leaves a held rig be. The supervisor's own refusal runs for real in test_nosystemd.py."""

from __future__ import annotations

import json

import pytest

from rigbook.core.checks import Facts
from rigbook.core.render import systemd_word
from rigbook.core.units import UnitState
from rigbook.roles.serving import (
    HOLD_PATH,
    SUPERVISE_CONF,
    SUPERVISE_PATH,
    SUPERVISOR,
    UNIT_NAME,
    UNIT_PATH,
    VENV_CHECK_PATH,
    hold_serving,
    render_supervise,
    render_unit,
    resume_serving,
    serve_plan,
    serve_recipe,
    serving_findings,
    stop_held,
    venv_check_args,
)
from tests.opkit import describe, file_states, run_op
from tests.test_serving import SMI, cpu_rig, deployed, dual_rig, op_facts, state

REASON = ("serving is held by the driver bump to 580.159.04: rebuild the venvs (pyinfra "
          "INVENTORY deploys/venvs.py), which starts it again")


def hold_facts(unit: bool = True, running: bool = True, hold: list[str] | None = None) -> dict:
    return {"File": {"size": 1} if unit else None, "FileContents": hold,
            "UnitStates": {"0": UnitState(running, True)},
            "FileStates": file_states(dirs={"/var/lib/rigbook": 0o755})}


def bare_hold_facts(said: str | None, hold: list[str] | None = None) -> dict:
    """A rig without systemd: `said` is SupervisorStatus (None: no supervise.json)."""
    return {"SystemdBooted": False, "SupervisorStatus": said, "FileContents": hold,
            "FileStates": file_states(dirs={"/var/lib/rigbook": 0o755})}


SUPERVISE_STOP = f"/usr/bin/python3 -I -S {SUPERVISE_PATH} stop {SUPERVISE_CONF}"
SUPERVISE_START = f"/usr/bin/python3 -I -S {SUPERVISE_PATH} start {SUPERVISE_CONF}"


def test_the_bump_writes_the_hold_then_stops_serving():
    commands, _ = run_op(hold_serving, hold_facts(), reason=REASON)
    assert [describe(c) for c in commands] == [
        "mkdir -p /var/lib/rigbook", f"upload {HOLD_PATH}", f"chmod 644 {HOLD_PATH}",
        f"systemctl stop {UNIT_NAME}",
    ]
    assert commands[1].src.getvalue() == REASON + "\n"


def test_a_held_rig_or_one_without_serving_is_left_as_it_is():
    commands, fake = run_op(hold_serving, hold_facts(running=False, hold=[REASON]), reason=REASON)
    assert commands == [] and fake.noops == [f"{UNIT_NAME} is held already"]
    commands, fake = run_op(hold_serving, hold_facts(unit=False), reason=REASON)
    assert commands == [] and fake.noops == [f"no {UNIT_NAME}: nothing to hold"]
    # held, but started by hand since: stopped again
    commands, _ = run_op(hold_serving, hold_facts(hold=[REASON]), reason=REASON)
    assert [describe(c) for c in commands][-1] == f"systemctl stop {UNIT_NAME}"


@pytest.mark.parametrize("rig, smi_args", [(dual_rig, ["--smi", SMI]), (cpu_rig, [])])
def test_the_unit_and_the_supervisor_run_one_venv_check_argv(rig, smi_args):
    """venv_check_args is the one definition: the unit's ExecStartPre line is its words, the
    supervisor's config carries the same list."""
    plan = serve_plan(rig(), "rig1")
    argv = venv_check_args(plan, SMI)
    assert argv == ["/usr/bin/env", "-i", "-C", "/", "/usr/bin/python3", "-I", "-S",
                    VENV_CHECK_PATH, "--hold", HOLD_PATH, "--venv",
                    f"/opt/rigbook/venvs/{plan.recipe.venv}", *smi_args]
    unit = render_unit(plan, SMI).splitlines()
    assert f"ExecStartPre=!{' '.join(systemd_word(word) for word in argv)}" in unit
    assert json.loads(render_supervise(plan, SMI, {}))["venv_check"] == argv


def test_every_unit_refuses_while_held_and_a_gpu_one_also_on_a_stale_venv():
    gpu = render_unit(serve_plan(dual_rig(), "rig1"), SMI)
    cpu = render_unit(serve_plan(cpu_rig(), "rig1"), SMI)
    line = ("ExecStartPre=!/usr/bin/env -i -C / /usr/bin/python3 -I -S "
            f"{VENV_CHECK_PATH} --hold {HOLD_PATH} --venv /opt/rigbook/venvs/")
    (gpu_check,) = [row for row in gpu.splitlines() if row.startswith(line)]
    assert gpu_check.endswith(f"vllm-0.33 --smi {SMI}")
    (cpu_check,) = [row for row in cpu.splitlines() if row.startswith(line)]
    assert "--smi" not in cpu_check  # it reaches no GPU device: only the hold


def test_the_converge_leaves_a_held_rig_unserved_and_says_so():
    plan = serve_plan(dual_rig(), "rig1")
    probe = state(enabled="enabled", files={**deployed(plan), HOLD_PATH: "1" * 64})
    commands, fake = run_op(serve_recipe, op_facts(probe), plan=plan)
    assert commands == [] and fake.noops == [f"{UNIT_NAME} is held by a driver bump"]


def test_the_rebuild_removes_the_hold_starts_serving_and_waits_for_it():
    plan = serve_plan(dual_rig(), "rig1")
    held = state(enabled="enabled", files={**deployed(plan), HOLD_PATH: "1" * 64})
    commands, _ = run_op(resume_serving, op_facts(held), plan=plan)
    steps = [describe(c) for c in commands]
    assert steps[0] == f"rm -f {HOLD_PATH}"
    assert f"systemctl start {UNIT_NAME}" in steps[1] and steps[2] == "call _await_health"
    free = state(enabled="enabled", files=deployed(plan))
    commands, fake = run_op(resume_serving, op_facts(free), plan=plan)
    assert commands == [] and fake.noops == ["serving is not held by a driver bump"]
    assert UNIT_PATH in deployed(plan)


HELD = ("serving held by the driver bump until venvs are rebuilt: run deploys/venvs.py "
        f"({HOLD_PATH}; ")


def test_status_says_a_held_rig_waits_for_the_rebuild_with_systemd_or_without():
    from tests.test_nosystemd import supervised

    rig = dual_rig()
    plan = serve_plan(rig, "rig1")
    recipe = ["RIGBOOK_RECIPE=dual-3090-draft"]
    probe = state(enabled="enabled", files={**deployed(plan), HOLD_PATH: "1" * 64})
    found = serving_findings(rig, Facts(serving=probe, serving_recipe=recipe), "rig1")
    assert [f.text for f in found] == [f"{HELD}{UNIT_NAME} is stopped)"]
    bare = state(systemd=False, sub="not running", files={**supervised(plan), HOLD_PATH: "1" * 64})
    found = serving_findings(rig, Facts(serving=bare, serving_recipe=recipe), "rig1")
    assert [f.text for f in found] == [f"{HELD}{SUPERVISOR} is stopped)"]
    # started by hand past its check: still held, and it says that it runs
    up = state(systemd=False, active="active", sub="supervised, pid 7", answer={"ok": True},
               files={**supervised(plan), HOLD_PATH: "1" * 64})
    found = serving_findings(rig, Facts(serving=up, serving_recipe=recipe), "rig1")
    assert [f.text for f in found] == [f"{HELD}{SUPERVISOR} runs all the same (started by "
                                       "hand?))"]


def test_without_systemd_the_bump_writes_the_hold_then_stops_the_supervisor():
    commands, _ = run_op(hold_serving, bare_hold_facts("running (pid 812)"), reason=REASON)
    assert [describe(c) for c in commands] == [
        "mkdir -p /var/lib/rigbook", f"upload {HOLD_PATH}", f"chmod 644 {HOLD_PATH}",
        SUPERVISE_STOP,
    ]
    assert commands[1].src.getvalue() == REASON + "\n"
    refused = "not running: the start at 2026-12-04T19:02:11+0000 was refused: held"
    commands, fake = run_op(hold_serving, bare_hold_facts(refused, [REASON]), reason=REASON)
    assert commands == [] and fake.noops == [f"{SUPERVISOR} is held already"]
    commands, fake = run_op(hold_serving, bare_hold_facts(None), reason=REASON)
    assert commands == [] and fake.noops == [f"no {SUPERVISE_CONF}: nothing to hold"]
    # not running and not held yet: the hold only
    commands, _ = run_op(hold_serving, bare_hold_facts("not running"), reason=REASON)
    assert [describe(c) for c in commands][-1] == f"chmod 644 {HOLD_PATH}"


def test_without_systemd_the_rebuild_starts_the_supervisor_and_a_converge_leaves_it_held():
    from tests.test_nosystemd import supervised

    plan = serve_plan(cpu_rig(), "rig1")
    held = state(systemd=False, sub="not running", files={**supervised(plan), HOLD_PATH: "1" * 64})
    commands, fake = run_op(serve_recipe, op_facts(held), plan=plan)
    assert commands == [] and fake.noops == [f"{SUPERVISOR} is held by a driver bump"]
    commands, fake = run_op(stop_held, op_facts(held), plan=plan)
    assert commands == [] and fake.noops == [f"{SUPERVISOR} is held and inactive"]
    by_hand = state(systemd=False, active="active", sub="supervised, pid 7",
                    files={**supervised(plan), HOLD_PATH: "1" * 64})
    commands, _ = run_op(stop_held, op_facts(by_hand), plan=plan)
    assert [describe(c) for c in commands] == [SUPERVISE_STOP]
    commands, _ = run_op(resume_serving, op_facts(held), plan=plan)
    assert [describe(c) for c in commands] == [f"rm -f {HOLD_PATH}", SUPERVISE_START,
                                               "call _await_health"]
    assert commands[2].args[2] is False  # the health check reads the supervisor's log


def test_before_the_rebuild_a_held_unit_that_systemd_retries_is_stopped():
    """After the bump's reboot systemd retries the start the check refused (auto-restart): the
    venv swap's try-restart would start it again, fail, and fail the rebuild."""
    from rigbook.roles.serving import stop_held

    plan = serve_plan(cpu_rig(), "rig1")
    held = {**deployed(plan), HOLD_PATH: "1" * 64}
    retrying = state(active="activating", sub="auto-restart", enabled="enabled", files=held)
    commands, _ = run_op(stop_held, op_facts(retrying), plan=plan)
    assert [describe(c) for c in commands] == [f"systemctl stop {UNIT_NAME}"]
    given_up = state(active="failed", sub="failed", enabled="enabled", files=held)
    commands, fake = run_op(stop_held, op_facts(given_up), plan=plan)
    assert commands == [] and fake.noops == [f"{UNIT_NAME} is held and failed"]
    free = state(active="active", sub="running", enabled="enabled", files=deployed(plan))
    commands, fake = run_op(stop_held, op_facts(free), plan=plan)
    assert commands == [] and fake.noops == ["serving is not held by a driver bump"]
