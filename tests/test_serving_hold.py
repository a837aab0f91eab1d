"""The driver bump's hold on serving (issue 35, item 6): the bump stops rigbook-serve.service and
writes the hold that the unit's venv check refuses a start on; deploys/venvs.py removes it,
starts the recipe and waits for its health; a converge leaves a held rig be."""

from __future__ import annotations

from rigbook.core.units import UnitState
from rigbook.roles.serving import (
    HOLD_PATH,
    UNIT_NAME,
    UNIT_PATH,
    VENV_CHECK_PATH,
    hold_serving,
    render_unit,
    resume_serving,
    serve_plan,
    serve_recipe,
)
from tests.opkit import describe, file_states, run_op
from tests.test_serving import SMI, cpu_rig, deployed, dual_rig, op_facts, state

REASON = ("serving is held by the driver bump to 580.159.04: rebuild the venvs (pyinfra "
          "INVENTORY deploys/venvs.py), which starts it again")


def hold_facts(unit: bool = True, running: bool = True, hold: list[str] | None = None) -> dict:
    return {"File": {"size": 1} if unit else None, "FileContents": hold,
            "UnitStates": {"0": UnitState(running, True)},
            "FileStates": file_states(dirs={"/var/lib/rigbook": 0o755})}


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


def test_status_says_a_held_rig_waits_for_the_rebuild():
    from rigbook.core.checks import Facts
    from rigbook.roles.serving import serving_findings

    rig = dual_rig()
    plan = serve_plan(rig, "rig1")
    probe = state(enabled="enabled", files={**deployed(plan), HOLD_PATH: "1" * 64})
    found = serving_findings(rig, Facts(serving=probe, serving_recipe=[
        "RIGBOOK_RECIPE=dual-3090-draft"]), "rig1")
    assert [f.text for f in found] == [f"{UNIT_NAME} is held by a driver bump ({HOLD_PATH}): "
                                       "deploys/venvs.py rebuilds the venvs and starts it"]


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
