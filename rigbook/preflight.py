"""The preflight: every check of a deploy's roles, before any operation changes the rig.

Each job starts with it (rigbook/jobs.py; the roles' checks from rigbook/registry.py)::

    rig = rig_of(host)
    if preflight(rig, checks_of("driver", "tuning", "power")):
        driver.driver(rig)
        deferred_checks(rig)
        tuning.host_tuning(rig)
        power.power_limit(rig)

It first takes the rig's run lock (rigbook/core/runlock.py: one operator per rig; a rig another run
holds is refused, the holder named), then reads the facts of every check in one round trip (and
whether systemd runs the rig: on a rig without it, it says so once, and the roles plan no unit
and no systemctl), runs all of them, and on any refusing finding (an `error` or a `gone`) fails
that rig at once with ALL its problems listed, before a single operation is planned for it:
nothing on it changes, `--dry` plans nothing for it and exits non-zero, and the other rigs go on.

A rig whose driver this run installs (or reboots into) has no GPUs to check yet. Its GPU checks
(`Check.gpus`) are deferred, said in one line, and run again by `deferred_checks` right after
the driver role, before power, venvs and serving do anything.
"""

from __future__ import annotations

from collections.abc import Iterable

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, operation
from pyinfra.context import ctx_host, ctx_state

from rigbook import fleet
from rigbook.core import link, runlock
from rigbook.core.checks import REFUSING, Check, Finding, read_facts, reads_of, run_checks, unique
from rigbook.core.facts import usable
from rigbook.core.messages import refuse_now
from rigbook.core.spec import Rig
from rigbook.core.units import NO_SYSTEMD, SYSTEMD
from rigbook.roles.driver import DRIVER, driver_pending

#: Checks deferred per rig in this run, for deferred_checks (one pyinfra run per process).
_DEFERRED: dict[str, tuple[Check, ...]] = {}


def refusal_text(rig_name: str, findings: Iterable[Finding],
                 headline: str = "refused before any change, nothing was changed") -> str:
    lines = "\n".join(f"  - {finding.message(rig_name)}" for finding in findings)
    return f"{headline}:\n{lines}"


def refusal_reason(findings: list[Finding]) -> str:
    """A refusal in the closing table: the keys of its findings, the first one's text."""
    keys = ", ".join(dict.fromkeys(finding.key for finding in findings if finding.key))
    more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
    return f"refused by the preflight ({keys or 'no key'}): {findings[0].text}{more}"


def _other_rigs_go_on(state) -> bool:
    return False


def no_prompt_mid_run(state) -> None:
    """Without -y, pyinfra asks "One of more hosts failed, continue?" when a rig fails while
    the others are between two operations (a new unit, the old live cap) and leaves them there
    until someone answers. rigbook's rule is that the other rigs go on: no prompt. pyinfra's
    --fail-percent, where given with -y, still applies."""
    if state.should_raise_failed_hosts is not None:
        state.should_raise_failed_hosts = _other_rigs_go_on


def preflight(rig: Rig, *groups: Iterable[Check]) -> bool:
    """Check the whole rig for the roles of this deploy (each role's CHECKS); False when the
    rig is refused, and then the deploy must plan nothing for it."""
    no_prompt_mid_run(state)
    fleet.watch(ctx_state.get())
    link.bound(ctx_state.get(), ctx_host.get(), rig)
    held = runlock.take(state, host)
    if held is not None:
        refuse_now(f"refused before any change: {held}", f"refused: {held}")
        return False
    checks = unique(check for group in ((SYSTEMD,), *groups) for check in group)
    facts = read_facts(state, host, reads_of(rig, host.name, checks))
    if link.lost(ctx_host.get()):
        lost = link.lost_text(ctx_host.get())
        refuse_now(f"{lost}, while the preflight read its facts: nothing was changed",
                  f"{lost}, during the preflight")
        return False
    if facts.systemd is False:  # said once, here: the roles plan no unit and no systemctl
        logger.info(f"{host.print_prefix}{NO_SYSTEMD}")
    deferred: tuple[Check, ...] = ()
    if DRIVER in checks and not usable(facts.probe) and driver_pending(rig, facts):
        deferred = tuple(check for check in checks if check.gpus)
        checks = tuple(check for check in checks if not check.gpus)
    refusing = [f for f in run_checks(rig, host.name, checks, facts) if f.level in REFUSING]
    if refusing:
        refuse_now(refusal_text(host.name, refusing), refusal_reason(refusing))
        return False
    for finding in run_checks(rig, host.name, [c for c in checks if c.said], facts):
        logger.warning(f"{host.print_prefix}{finding.text}")
    _DEFERRED.pop(host.name, None)
    if deferred:
        _DEFERRED[host.name] = deferred
        logger.info(f"{host.print_prefix}no driver loaded yet: checked after the driver role: "
                    + ", ".join(check.name for check in deferred))
    return True


def _run_deferred(state, host, rig: Rig, checks: tuple[Check, ...]) -> bool:
    """FunctionCommand body: the deferred checks on the rig as it is now, driver in."""
    facts = read_facts(state, host, reads_of(rig, host.name, checks))
    if not usable(facts.probe):
        logger.warning(f"{host.print_prefix}still no GPUs visible after the driver role (a "
                       "reboot not allowed yet?): the GPU checks run at the next converge")
        return True
    refusing = [f for f in run_checks(rig, host.name, checks, facts) if f.level in REFUSING]
    if refusing:
        headline = "refused once the driver was in: what needs the GPUs was not changed"
        host.log_styled(refusal_text(host.name, refusing, headline), fg="red",
                        log_func=logger.error)
        return False
    return True


@operation(is_idempotent=False)
def gpu_checks(rig: Rig, checks: tuple[Check, ...]):
    """
    Run the GPU checks the preflight deferred, now that the driver is in.

    + rig: the rig's validated host data
    + checks: the deferred checks

    A refusing finding fails the rig here, before the roles after it change anything.
    """
    yield FunctionCommand(_run_deferred, (rig, checks), {})


def deferred_checks(rig: Rig) -> None:
    """Plan gpu_checks for a rig whose GPU checks the preflight deferred; nothing otherwise."""
    checks = _DEFERRED.get(host.name)
    if checks:
        gpu_checks(name="Check the GPUs now that the driver is in", rig=rig, checks=checks)
