"""rigbook's jobs as functions of the package: one per deploy, each for the host pyinfra runs it on.

    pyinfra inventory.py rigbook.jobs.converge      # pyinfra's function form (rigbook init)
    pyinfra inventory/rigs.py deploys/rig.py        # a clone's deploy file

Both forms run the same code: each file under deploys/ is its docstring and one call of the job
here, and a deploy file of your own can import and call them (`from rigbook.jobs import
converge`). They take no arguments: every setting is host data, given in the inventory or with
`--data` (docs/host-data.md). They are plain functions that call the roles' `@deploy` functions,
not `@deploy` functions themselves, so an operation keeps the role's name in pyinfra's output
(`NVIDIA driver | ...`), whichever form ran it. What each job does: docs/deploys.md.
"""

from __future__ import annotations

from pyinfra import host, state

from rigbook.core.messages import refused
from rigbook.inventory import rig_of
from rigbook.preflight import deferred_checks, preflight
from rigbook.registry import CONVERGED, checks_of
from rigbook.roles import (
    driver,
    guards,
    models,
    offboard,
    power,
    serving,
    sweep,
    venvs,
    verify,
    wsl,
)


def converge() -> None:
    """The full converge (deploys/rig.py): driver first, so the power role finds its GPUs; the
    guards before the caps and anything that serves."""
    rig = rig_of(host)
    if preflight(rig, *(role.checks for role in CONVERGED)):
        first, *rest = CONVERGED  # the driver: the GPU checks it deferred run right after it
        first.converge(rig)
        deferred_checks(rig)
        for role in rest:
            role.converge(rig)


def driver_bump() -> None:
    """The controlled driver bump (deploys/driver.py)."""
    rig = rig_of(host)
    if preflight(rig, [wsl.PLATFORM, driver.ONBOARD]):  # a new DKMS module needs Secure Boot's key
        driver.driver_bump(rig)


def power_cap() -> None:
    """The fleet's power caps, and nothing else (deploys/power_cap.py)."""
    rig = rig_of(host)
    power.print_cap_table_at_end(state)
    if preflight(rig, [wsl.PLATFORM], checks_of("power")):
        power.power_limit(rig)


def power_sweep() -> None:
    """The power sweep, the caps restored after (deploys/power_sweep.py)."""
    rig = rig_of(host)
    if preflight(rig, [wsl.PLATFORM, guards.FAULTS], sweep.SWEEP_CHECKS):
        sweep.power_sweep(rig)


def venvs_rebuild() -> None:
    """The venvs the running driver made stale, rebuilt, and serving a driver bump held started
    again (deploys/venvs.py)."""
    rig = rig_of(host)
    if preflight(rig, [wsl.PLATFORM], venvs.REBUILD_CHECKS):
        serving.settle_held(rig)  # a unit held by a driver bump: its restart loop ended
        venvs.venvs(rig, rebuild_stale=True)
        serving.resume_after_bump(rig)


def pull_models() -> None:
    """The pinned models pulled into the HF cache, and nothing else (deploys/models.py)."""
    rig = rig_of(host)
    if preflight(rig, [wsl.PLATFORM], checks_of("models")):
        models.models(rig)


def serve() -> None:
    """The serving recipe switched or converged (deploys/serve.py)."""
    rig = rig_of(host)
    if rig.recipe is None:
        refused(
            name="Check the serving recipe",
            message=f"{host.name}: recipe: no recipe to serve; pass --data recipe=NAME "
            "(docs/recipes.md lists them)",
        )
    elif preflight(rig, [wsl.PLATFORM], checks_of("guards", "serving")):
        serving.serving(rig)


def reap_shm() -> None:
    """Leaked engine buffers in /dev/shm deleted now (deploys/reap_shm.py)."""
    rig = rig_of(host)
    if preflight(rig, [wsl.PLATFORM]):
        guards.reap_shm_now(rig)


def verify_serving() -> None:
    """The verify ladder and bench of the running recipe (deploys/verify.py)."""
    rig = rig_of(host)
    if preflight(rig, [wsl.PLATFORM, guards.FAULTS]):
        verify.verify(rig)


def offboard_rig() -> None:
    """What rigbook put on the rig, stopped and removed (deploys/offboard.py)."""
    rig = rig_of(host)
    if preflight(rig):
        offboard.offboard(rig)


#: Each job with the deploy file that runs it: `rigbook --help` and docs/deploys.md list them.
JOBS = {
    converge: "deploys/rig.py",
    driver_bump: "deploys/driver.py",
    power_cap: "deploys/power_cap.py",
    power_sweep: "deploys/power_sweep.py",
    venvs_rebuild: "deploys/venvs.py",
    pull_models: "deploys/models.py",
    serve: "deploys/serve.py",
    reap_shm: "deploys/reap_shm.py",
    verify_serving: "deploys/verify.py",
    offboard_rig: "deploys/offboard.py",
}
