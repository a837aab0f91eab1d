"""The operation fixtures: tests/operations/<role>.<op>/<case>.json, one test each (pyinfra's
shape), run over the op harness (tests/opkit.py).

A fixture gives the operation's arguments and the facts it reads (by fact class, its value as
JSON: the fields of the fact's dataclass), and what it must do with them: the commands it yields
(as opkit.describe writes them), the no-change text, the facts it asked for, and, for a call
that refuses, the lines it logs when executed. docs/architecture.md (Tests) says how to add one.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand

from tests.opkit import describe, execute, run_op
from tests.test_facts_data import fact_args, fixtures, role_module

OPERATIONS = Path(__file__).parent / "operations"


def typed(kind, data):
    """JSON data as a value of a fact's type: dataclasses by their fields, mappings, tuples."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if data is None:
        return None
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in args if arg is not type(None)]
        return typed(inner[0], data) if len(inner) == 1 else data  # int | str: as JSON has it
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return kind(**{name: typed(hints[name], value) for name, value in data.items()})
    if origin in (dict, Mapping):
        return {key: typed(args[1], value) for key, value in data.items()}
    if origin is tuple:
        items = args[:1] * len(data) if args[-1:] == (Ellipsis,) else args
        return tuple(typed(item, value) for item, value in zip(items, data, strict=True))
    if origin is list:
        return [typed(args[0], value) for value in data]
    if origin in (set, frozenset):
        return origin(typed(args[0], value) for value in data)
    return data


def fact_value(module, name: str, data):
    """A fixture's fact value, typed as the fact class `name` of the role module returns it."""
    (base,) = [b for b in getattr(module, name).__orig_bases__ if typing.get_args(b)]
    return typed(typing.get_args(base)[0], data)


@pytest.mark.parametrize("path", fixtures(OPERATIONS), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_operation(path: Path):
    data = json.loads(path.read_text())
    role, op_name = path.parent.name.split(".")
    module = role_module(role)
    facts = {name: fact_value(module, name, value) for name, value in data["facts"].items()}
    commands, fake = run_op(getattr(module, op_name), facts, *data.get("args", ()),
                            name=data.get("host", "rig1"), **data.get("kwargs", {}))
    assert [describe(command) for command in commands] == data["commands"]
    noop = data.get("noop_description")
    assert fake.noops == ([noop] if noop else [])
    if "asked" in data:
        assert fake.asked == [(name, fact_args({"args": args})) for name, args in data["asked"]]
    if "refused" in data:  # each call refuses: it returns False and logs why
        calls = [command for command in commands if isinstance(command, FunctionCommand)]
        assert calls and all(execute(command, fake) is False for command in calls)
        assert fake.logged == data["refused"]
