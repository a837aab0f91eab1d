"""Facts read once a run: an operation that reads a fact the preflight (or an earlier operation)
already read, with the same arguments, gets that value instead of another round trip.

A value stays true while nothing changed the rig: once any operation that changed it has
completed, the next read goes to the rig again. The one exemption: the batched kinds
(rigbook.core.managed's files, rigbook.core.units' units) survive the writes of operations that keep
them up to date themselves (`mark_ours`); facts do not (a written apt pin changes what apt
reports). Use it for a read made before the operation's own first command: a read after that
must see the operation's own changes (`host.get_fact`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

from pyinfra import host
from pyinfra.api import FactBase, Host, State
from pyinfra.context import ContextObject, ctx_host, ctx_state


@dataclass
class RigRecord:
    """What this run knows of one rig: facts by (fact, arguments), and batched items by kind
    (rigbook.core.managed's files, rigbook.core.units' units): those planned, and those known."""

    facts: dict[tuple, Any] = field(default_factory=dict)
    expected: dict[str, list[str]] = field(default_factory=dict)
    known: dict[str, dict[str, Any]] = field(default_factory=dict)
    changes_seen: tuple[int, int] = (0, 0)  # (by any operation, by operations not `ours`)


@dataclass
class _Run:
    rigs: dict[str, RigRecord] = field(default_factory=dict)
    ours: set[str] = field(default_factory=set)  # operations whose writes keep the record true


_RUNS: WeakKeyDictionary = WeakKeyDictionary()


def _itself(obj):
    """The object behind pyinfra's `state`/`host` context proxies (a key must be the object)."""
    return obj._get_module() if isinstance(obj, ContextObject) else obj


def _run(run_state: State) -> _Run:
    return _RUNS.setdefault(run_state, _Run())


def _changes(run_state: State, rig: Host) -> tuple[int, int]:
    """Completed operations on this rig that changed it: all of them, and those not `ours`.
    Only this rig's operations: the fleet's order (`get_op_order`) would cost every rig's
    operations on every read, a run's cost growing with the square of its rigs."""
    ours = _run(run_state).ours
    every = others = 0
    for op_hash, data in run_state.ops.get(rig, {}).items():
        if data.operation_meta.is_complete() and data.operation_meta.did_change():
            every += 1
            others += op_hash not in ours
    return every, others


def record(run_state: State | None = None, rig_host: Host | None = None) -> RigRecord:
    """A rig's record (the current one by default): its facts forgotten when an operation has
    changed the rig since, its batched kinds when one that is not `ours` has."""
    run_state = _itself(run_state) or ctx_state.get()
    rig_host = _itself(rig_host) or ctx_host.get()
    rig = _run(run_state).rigs.setdefault(rig_host.name, RigRecord())
    changes = _changes(run_state, rig_host)
    if changes[0] != rig.changes_seen[0]:
        rig.facts.clear()
    if changes[1] != rig.changes_seen[1]:
        rig.known.clear()
    rig.changes_seen = changes
    return rig


def mark_ours() -> None:
    """The running operation keeps the batched kinds true itself: its writes do not empty
    them."""
    if host.current_op_hash:
        _run(ctx_state.get()).ours.add(host.current_op_hash)


def _key(fact: type[FactBase], kwargs: dict) -> tuple:
    return (fact.__module__, fact.__name__, repr(sorted(kwargs.items())))


def seed(run_state: State, rig_host: Host, fact: type[FactBase], kwargs: dict,
         value: Any) -> None:
    """Keep a value read in a batch (the preflight's one round trip)."""
    record(run_state, rig_host).facts[_key(fact, kwargs)] = value


def once(fact: type[FactBase], **kwargs) -> Any:
    """`host.get_fact`, read at most once a run while nothing changed the rig."""
    facts = record().facts
    key = _key(fact, kwargs)
    if key not in facts:
        facts[key] = host.get_fact(fact, **kwargs)
    return facts[key]


def expect(kind: str, items) -> None:
    """Name items of a kind that this rig's run will read, while it is planned: the first read
    of that kind covers them all."""
    planned = record().expected.setdefault(kind, [])
    planned += [item for item in items if item not in planned]


def batched(kind: str, item: str, read: Callable[[tuple[str, ...]], dict]) -> Any:
    """What `item` is now: from this run's one read of every planned item of its kind (`read`
    takes the unread items and returns them by name), read again only after a change."""
    rig = record()
    known = rig.known.setdefault(kind, {})
    if item not in known:
        wanted = dict.fromkeys([*rig.expected.get(kind, []), item])
        known.update(read(tuple(name for name in wanted if name not in known)))
    return known[item]


def remember(kind: str, item: str, value: Any) -> None:
    """What an operation of this run made `item`: later reads need not ask the rig. Only while
    executing: pyinfra also runs an operation's body while it plans (without -y, and for
    --dry), and nothing was written then."""
    if ctx_state.get().is_executing:
        record().known.setdefault(kind, {})[item] = value
