"""The roles, in the order the full converge runs them: one line each.

The preflight of every job, `rigbook status`, the bench's breakdown, the generated role pages
and the layer test read this list; nothing finds a role by its module's name. A role is its
modules in roles/ (the first one holds its `@deploy`), the checks status and the converge's
preflight run for it, its part of the converge (None: it runs in a job of its own, or only
reads), its page under docs/ and the host-data keys it reads (its page's settings table).
docs/architecture.md (Adding a role) says what else a new role touches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from rigbook.core.checks import Check, unique
from rigbook.core.spec import Rig
from rigbook.roles import (
    benchab,
    capadvice,
    charts,
    cuda,
    degeneration,
    disks,
    driver,
    driver_source,
    guards,
    health,
    journal,
    kernel,
    models,
    offboard,
    power,
    recipes,
    serving,
    soak,
    specmetrics,
    stepproblem,
    stress,
    sweep,
    sweepresult,
    thinkcheck,
    tokens,
    toolcheck,
    tuning,
    venvs,
    verify,
    wsl,
)


@dataclass(frozen=True)
class Role:
    """One role: `name` is what the docs and the bench call it; `modules` its modules in roles/,
    the one with its `@deploy` first; `page` its page under docs/; `keys` its host-data keys,
    each a key or a prefix ending in `_` (every key of Rig is one role's or one of SHARED's)."""

    name: str
    modules: tuple[ModuleType, ...]
    checks: tuple[Check, ...]
    converge: Callable[[Rig], None] | None
    page: str
    keys: tuple[str, ...] = ()


ROLES = (
    Role("driver", (driver, driver_source, kernel), driver.CHECKS, driver.driver, "driver.md",
         ("driver_", "allow_reboot")),
    Role("tuning", (tuning,), tuning.CHECKS, tuning.host_tuning, "tuning.md",
         ("sysctl_", "shm_size", "stale_files")),
    Role("wsl", (wsl,), wsl.CHECKS, wsl.wsl_host, "wsl2.md", ("wsl_",)),
    Role("guards", (guards,), guards.CHECKS, guards.guards, "guards.md", ("guards_",)),
    Role("power", (power, capadvice), power.CHECKS + capadvice.CHECKS, power.power_limit,
         "power.md", ("power_", "psu_")),
    Role("venvs", (venvs, cuda), venvs.CHECKS, venvs.venvs, "venvs.md",
         ("venvs", "venvs_", "python_", "rebuild_all")),
    Role("models", (models, tokens), models.CHECKS, models.models, "models.md",
         ("models", "models_")),
    Role("serving", (serving, recipes, journal), serving.CHECKS, serving.serving, "serving.md",
         ("recipe", "serving_")),
    Role("health", (health,), health.CHECKS, None, "status.md"),
    Role("disks", (disks,), disks.CHECKS, None, "status.md"),
    Role("sweep", (sweep, sweepresult, charts), (), None, "sweep.md", ("sweep_",)),
    Role("verify", (verify, toolcheck, thinkcheck, degeneration, specmetrics, stress, soak,
                    benchab, stepproblem), (), None, "verify.md", ("verify_",)),
    Role("offboard", (offboard,), (), None, "footprint.md", ("offboard_",)),
)
#: Host-data keys that no one role owns, by group: the rig's hardware, read by most roles, and
#: the SSH link's bound (rigbook/core/link.py). host-data.md lists them with the rest.
SHARED = {
    "hardware": ("platform", "gpu_class", "gpu_count", "gpu_limits_watts", "cooling", "nvlink"),
    "the SSH link": ("link_",),
}
BY_NAME = {role.name: role for role in ROLES}
#: The full converge's roles, in order (deploys/rig.py).
CONVERGED = tuple(role for role in ROLES if role.converge is not None)


def checks_of(*names: str) -> tuple[Check, ...]:
    """The checks of these roles (every role's when none is named: what status runs), each once."""
    return unique(check for role in (map(BY_NAME.__getitem__, names) if names else ROLES)
                  for check in role.checks)


def role_of_module(module: str) -> str | None:
    """The name of the role a module of roles/ belongs to (None: not a role's module)."""
    for role in ROLES:
        if any(part.__name__ == module for part in role.modules):
            return role.name
    return None


def keys_of(entries: tuple[str, ...]) -> tuple[str, ...]:
    """The keys of Rig that a role's or a SHARED group's entries name, in Rig's order."""
    return tuple(key for key in Rig.model_fields
                 if any(key == entry or (entry.endswith("_") and key.startswith(entry))
                        for entry in entries))
