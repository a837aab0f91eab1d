"""The systemd units rigbook runs, read in one command per rig instead of two a unit.

pyinfra's `systemd.service` reads a unit's state and its enablement with one `systemctl show`
each. Here the role functions name their units while the deploy is planned (`service` does it),
and the first unit an operation looks at reads all of them at once (`UnitStates`), through
rigbook.core.runfacts: read again only after an operation changed the rig.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass

from pyinfra import host
from pyinfra.api import FactBase, QuoteString, StringCommand, operation
from pyinfra.operations.util.service import handle_service_control

from rigbook.core import runfacts
from rigbook.core.checks import Check, Facts, Finding, Read, warn
from rigbook.core.types import JsonValue

#: Journal lines a failed start of rigbook's own shows.
JOURNAL_TAIL = 20
#: SubStates pyinfra's SystemdStatus counts as running, and UnitFileStates as enabled.
RUNNING = ("running", "waiting", "exited", "listening", "mounted")
ENABLED = ("enabled", "static")


_SYSTEMD = "##RIGBOOK_SYSTEMD##"

#: What a rig without systemd gets, said once by the preflight and by `rigbook status`.
NO_SYSTEMD = (
    "no systemd as PID 1 (or no systemctl): rigbook writes no unit and runs no systemctl here; "
    "files, sysctl where writable, venvs, models and live caps are converged, the recipe is "
    "served by rigbook's supervisor, and nothing survives a reboot by itself "
    "(docs/no-systemd.md)"
)


class SystemdBooted(FactBase[bool]):
    """Whether systemd runs this host: it is PID 1 (sd_booted: /run/systemd/system exists) and
    `systemctl` is there. Containers and WSL2 without `[boot] systemd=true` have neither::

        ##RIGBOOK_SYSTEMD## no
    """

    def command(self) -> str:
        return (f"[ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1 "
                f"&& echo '{_SYSTEMD} yes' || echo '{_SYSTEMD} no'")

    def process(self, output: list[str]) -> bool:
        return output[-1].strip() == f"{_SYSTEMD} yes"


def _systemd_findings(rig, facts: Facts, rig_name: str) -> list[Finding]:
    return [warn("systemd", NO_SYSTEMD)] if facts.systemd is False else []


#: Read with every preflight's batch: the roles plan on it (no round trip of their own).
SYSTEMD_READ = Read("systemd", SystemdBooted, "systemd as PID 1")
SYSTEMD = Check("systemd", lambda rig, rig_name: [SYSTEMD_READ], _systemd_findings)


def booted() -> bool:
    """Whether this rig runs systemd (the preflight read it: no round trip)."""
    return bool(runfacts.once(SystemdBooted))


@dataclass(frozen=True)
class UnitState(JsonValue):
    running: bool
    enabled: bool


class UnitStates(FactBase[dict]):
    """Running and enabled, for each unit (one `systemctl show` for all of them)."""

    default = dict

    def requires_command(self, units: tuple[str, ...]) -> str:
        return "systemctl"

    def command(self, units: tuple[str, ...]) -> StringCommand:
        return StringCommand("systemctl show --property SubState --property UnitFileState --",
                             *map(QuoteString, units))

    def process(self, output: list[str]) -> dict[str, UnitState]:
        """systemctl prints one block per unit, in the order asked, blank lines between."""
        blocks: list[dict[str, str]] = [{}]
        for line in output:
            if not line.strip():
                blocks.append({})
                continue
            key, _, value = line.partition("=")
            blocks[-1][key] = value
        blocks = [block for block in blocks if block]
        return {str(i): UnitState(b.get("SubState") in RUNNING, b.get("UnitFileState") in ENABLED)
                for i, b in enumerate(blocks)}


def outside_login(unit: str, *argv) -> StringCommand:
    """`argv` started as a transient service of its own (systemd-run), not in the SSH login.

    What `setsid` starts stays in the login's cgroup (its session scope): on a rig whose logind
    has KillUserProcesses=yes, logind stops that scope when the login ends, and so kills it. A
    unit of its own outlives the login; --collect drops the unit once it exited, failed or not.
    systemd-run refuses a unit of that name that is still there (another run's).
    """
    return StringCommand("systemd-run", f"--unit={unit}", "--collect", "--quiet", *argv)


def _read(units: tuple[str, ...]) -> dict[str, UnitState]:
    states = host.get_fact(UnitStates, units=units)
    if not states:  # no systemctl: nothing runs, as pyinfra's systemd facts say
        return {unit: UnitState(False, False) for unit in units}
    if len(states) != len(units):
        raise ValueError(f"systemctl show answered {len(states)} units of {len(units)}")
    return {unit: states[str(i)] for i, unit in enumerate(units)}


def state_of(unit: str) -> UnitState:
    return runfacts.batched("units", unit, _read)


def service_commands(unit: str, running: bool | None = True, enabled: bool | None = None,
                     restarted: bool = False, daemon_reload: bool = False) -> Iterator:
    """What pyinfra's systemd.service yields for these arguments, from the rig's one read
    (after its own daemon-reload, a fresh one)."""
    if daemon_reload:
        yield StringCommand("systemctl", "daemon-reload")
        now = _read((unit,))[unit]
    else:
        now = state_of(unit)
    yield from handle_service_control(host, unit, {unit: now.running}, "systemctl {1} {0}",
                                      running, restarted)
    if enabled is True and not now.enabled:
        yield StringCommand("systemctl", "enable", QuoteString(unit))
    elif enabled is False and now.enabled:
        yield StringCommand("systemctl", "disable", QuoteString(unit))


@operation()
def _service(service: str, running: bool | None = True, enabled: bool | None = None,
             restarted: bool = False, daemon_reload: bool = False):
    """
    Start, stop, restart, enable or disable a systemd unit where its state differs.

    + service: the unit's full name (name.service)
    + running: whether it should run; none = either
    + enabled: whether it should start at boot; none = either
    + restarted: restart it when it runs
    + daemon_reload: systemctl daemon-reload first
    """
    yield from service_commands(service, running, enabled, restarted, daemon_reload)


def service(service: str, running: bool | None = True, enabled: bool | None = None,
            restarted: bool = False, daemon_reload: bool = False, **op_args):
    """systemd.service's job for a unit rigbook runs, planned now, read in the rig's one read."""
    runfacts.expect("units", [service])
    return _service(service=service, running=running, enabled=enabled, restarted=restarted,
                    daemon_reload=daemon_reload, **op_args)


def start_shell(unit: str, verb: str = "start") -> str:
    """`systemctl VERB UNIT` for rigbook's own (re)start, as one shell command.

    `reset-failed` first: StartLimitBurst is there to stop a crash loop, and rigbook's own
    restarts (a converge, a venv swap, a second operator) must not count against it; a unit
    left in start-limit failure refuses every later start until someone resets it. A start
    that fails prints the unit's last JOURNAL_TAIL journal lines on stderr and keeps its exit
    status.
    """
    u = shlex.quote(unit)
    return (f"( systemctl reset-failed {u} 2>/dev/null; systemctl {verb} {u} || {{ rc=$?; "
            f"journalctl -u {u} -n {JOURNAL_TAIL} --no-pager >&2; exit $rc; }} )")


def start_command(unit: str, verb: str = "start") -> StringCommand:
    """start_shell as an operation's command."""
    return StringCommand(start_shell(unit, verb))
