"""rigbook.core.units: every unit rigbook runs, read in one `systemctl show`."""

from __future__ import annotations

from pyinfra.api import Config, Inventory, State
from pyinfra.context import ctx_host, ctx_state

from rigbook.core import units
from rigbook.core.units import UnitState
from tests.conftest import ROOT
from tests.opkit import FakeHost, describe

SHOW = ROOT / "tests" / "fixtures" / "systemd" / "systemctl-show-units.txt"
ASKED = ("nvidia-persistenced.service", "rigbook-xid-watch.service", "nvidia-power-limit.service",
         "no-such-unit.service")


def test_real_systemctl_show_output_is_read_in_the_order_asked():
    states = units.UnitStates().process(SHOW.read_text().splitlines())
    assert states == {
        "0": UnitState(running=True, enabled=True),  # static counts as enabled, as in pyinfra
        "1": UnitState(running=True, enabled=True),
        "2": UnitState(running=False, enabled=True),  # a oneshot that exited
        "3": UnitState(running=False, enabled=False),  # no such unit
    }


def test_the_command_quotes_every_unit():
    command = units.UnitStates().command(("a.service", "b c; reboot")).get_raw_value()
    assert command.endswith("-- a.service 'b c; reboot'")


def run(body, facts: dict, planned=ASKED):
    fake = FakeHost(facts)
    state = State(Inventory((["rig1"], {})), Config())
    state.is_executing = True
    with ctx_state.use(state), ctx_host.use(fake):
        units.runfacts.expect("units", planned)
        commands = list(body())
    return commands, fake


def test_every_planned_unit_is_read_once_and_only_what_differs_is_changed():
    facts = {"UnitStates": lambda units: units_fact(units)}

    def body():
        yield from units.service_commands("nvidia-persistenced.service", running=True)
        yield from units.service_commands("rigbook-xid-watch.service", running=True, enabled=True)
        yield from units.service_commands("nvidia-power-limit.service", running=None,
                                          enabled=True)
        yield from units.service_commands("no-such-unit.service", running=False, enabled=False)
        yield from units.service_commands("rigbook-xid-watch.service", restarted=True)

    commands, fake = run(body, facts)
    assert [name for name, _ in fake.asked] == ["UnitStates"]
    assert fake.asked[0][1]["units"] == ASKED
    assert [describe(c) for c in commands] == ["systemctl restart rigbook-xid-watch.service"]


def units_fact(asked):
    real = units.UnitStates().process(SHOW.read_text().splitlines())
    return {str(i): real[str(ASKED.index(unit))] for i, unit in enumerate(asked)}


def test_a_stopped_disabled_unit_is_started_and_enabled_and_a_daemon_reload_reads_it_again():
    facts = {"UnitStates": lambda units: {"0": UnitState(False, False)}}
    commands, fake = run(lambda: units.service_commands("x.service", running=True, enabled=True,
                                                        daemon_reload=True), facts, ())
    assert [describe(c) for c in commands] == [
        "systemctl daemon-reload", "systemctl start x.service", "systemctl enable x.service"]


def test_no_systemctl_reads_as_nothing_running():
    commands, _ = run(lambda: units.service_commands("x.service", running=True),
                      {"UnitStates": {}}, ())
    assert [describe(c) for c in commands] == ["systemctl start x.service"]
