"""The rig-side programs the facts send with `python3 -c`: files/serving/probe.py (ServeProbe)
and files/models/cache.py (ModelCache).

They run on a rig where nothing of rigbook is installed, so they may import the standard library
only; importing one runs nothing; its `main` prints what the fact's parser reads; and the fact
reads the file when it builds its command, not when rigbook is imported.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest

from rigbook import FILES
from rigbook.roles import models, serving
from rigbook.roles.models import ModelCache, parse_cache
from rigbook.roles.serving import ServeProbe, parse_probe, probe_args, serve_plan
from tests.test_facts_data import captured
from tests.test_serving import cpu_rig

PROGRAMS = {"probe": FILES / "serving" / "probe.py", "cache": FILES / "models" / "cache.py"}
#: rigbook's rig-side modules a program may import: sent with it, stdlib only themselves
#: (tests/test_layers.py).
RIGSIDE = {"hfcache"}


def load(name: str):
    for module in RIGSIDE:  # as the fact's command defines them before the program
        sys.modules.setdefault(module, importlib.import_module(f"rigbook.rigside.{module}"))
    spec = importlib.util.spec_from_file_location(f"rigbook_{name}", PROGRAMS[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_rig_program_imports_the_standard_library_only(name):
    imported = set()
    for node in ast.walk(ast.parse(PROGRAMS[name].read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported and imported <= sys.stdlib_module_names | RIGSIDE


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_importing_a_rig_program_runs_nothing(name, capsys):
    assert callable(load(name).main)
    assert capsys.readouterr().out == ""


def test_cache_main_prints_what_the_fact_reads(tmp_path, capsys):
    """main run here on a cache prints what the fact's command printed on a real host for the
    same layout (tests/facts/models.ModelCache: make_repo's cache, sent there)."""
    from tests.test_models import COMMIT, FILES_A, make_repo

    make_repo(tmp_path, "org/model", COMMIT, FILES_A, lfs=("model.safetensors",))
    load("cache").main(["cache.py", str(tmp_path)])
    state = parse_cache(capsys.readouterr().out)
    real = captured("models.ModelCache/one-repo-with-an-lfs-file")
    assert state == dataclasses.replace(real, cache=str(tmp_path))
    assert state.repos["org/model"].snapshots[COMMIT]["model.safetensors"] == 4096


def test_probe_main_prints_what_the_fact_reads(capsys):
    args = probe_args(serve_plan(cpu_rig(), "rig1"))
    load("probe").main(["probe.py", args])
    printed = capsys.readouterr().out
    assert len(printed.splitlines()) == 1
    state = parse_probe(printed)  # (a sandbox rig's engine on this machine may show in it)
    assert state.mem_total_kib >= state.mem_available_kib > 0
    assert set(state.files) == set(json.loads(args)["files"])


@pytest.mark.parametrize(("fact", "module", "name", "argument"), [
    (ServeProbe, serving, "PROBE_SOURCE", {"args": "{}"}),
    (ModelCache, models, "CACHE_SOURCE", {"cache": "/c"}),
])
def test_the_fact_reads_its_program_when_it_builds_the_command(monkeypatch, tmp_path, fact,
                                                                module, name, argument):
    def sent() -> list[str]:
        return shlex.split(fact().command(**argument).get_raw_value())

    # the program's text ends the -c script (the cache's sends rigside's hfcache ahead of it)
    python, flag, script, *rest = sent()
    assert [python, flag, *rest] == ["python3", "-c", *argument.values()]
    assert script.endswith(getattr(module, name).read_text())
    other = tmp_path / "program.py"
    other.write_text("print('{}')  # only this copy\n")
    monkeypatch.setattr(module, name, Path(other))
    assert sent()[2].endswith(other.read_text())
