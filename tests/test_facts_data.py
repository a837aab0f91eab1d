"""The fact fixtures: tests/facts/<role>.<Fact>/<case>.json, one test each (pyinfra's shape).

Each fixture holds the fact's arguments, the command the fact sends for them, the output a real
host printed for that command (tests/facts/SOURCES.md says which host) and the value the fact
reads from it. Nothing runs here: the output is the capture, never this machine's.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from pyinfra.api import StringCommand

from rigbook.core import pins

FACTS = Path(__file__).parent / "facts"


def role_module(role: str):
    """The role module a fixture folder names (`tuning` in tuning.Shm/)."""
    return importlib.import_module(f"rigbook.roles.{role}")


def fact_class(folder: str):
    role, name = folder.split(".")
    return getattr(role_module(role), name)


def fixtures(root: Path) -> list[Path]:
    return sorted(root.glob("*.*/*.json"))


def plain(value):
    """A fact's value as its fixture writes it: JSON, as pyinfra's fact CLI prints it (a key
    JSON cannot hold, e.g. the (i, j) of a topology matrix, is written "i,j")."""
    if hasattr(value, "to_json"):
        value = value.to_json()
    if isinstance(value, dict):
        return {",".join(map(str, k)) if isinstance(k, tuple) else k: plain(v)
                for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float)) else str(value)


def fact_args(data: dict) -> dict:
    """A fixture's arguments as the fact takes them (a JSON list is a tuple: facts hash them)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.get("args", {}).items()}


@pytest.mark.parametrize("path", fixtures(FACTS), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_fact(path: Path, monkeypatch):
    data = json.loads(path.read_text())
    module = role_module(path.parent.name.split(".")[0])
    for name, value in data.get("patch", {}).items():  # a module constant the capture moved
        for holder in (module, pins):  # the role's copy, and the core's one it came from
            if hasattr(holder, name):
                monkeypatch.setattr(holder, name, value)
    fact = fact_class(path.parent.name)()
    if "command" in data:
        command = fact.command(**fact_args(data))
        text = command.get_raw_value() if isinstance(command, StringCommand) else command
        assert text == data["command"]
    output = data["output"]
    value = fact.process(output) if output else fact.default()
    assert plain(value) == data["value"]


def captured(case: str):
    """The value a fact reads from a fixture's captured output ("tuning.Shm/tmpfs-dev-shm"),
    for a test that checks more than the value: what a check or an operation does with it."""
    folder, _ = case.split("/")
    data = json.loads((FACTS / f"{case}.json").read_text())
    fact = fact_class(folder)()
    return fact.process(data["output"]) if data["output"] else fact.default()
