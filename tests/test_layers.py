"""The package's layers, held (docs/architecture.md): rig-side code, the core, the roles, the
application. Every import of every module counts, those inside functions and under
TYPE_CHECKING too: a lower layer never imports a higher one, no two modules import each other
even by a detour, and what is copied to rigs needs nothing but the standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import rigbook
import rigbook.roles

#: The layers, lowest first, by the folder a module lives in.
LAYERS = ("rigside", "core", "roles", "app")
#: Outside the standard library, what rig-side code may import: the GPU probe reads NVML where
#: the rig's tools venv holds nvidia-ml-py, and says so when it does not (rigbook.rigside.gpus).
RIGSIDE_EXTRAS = {"pynvml"}


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name, the roles' folder included."""
    found = {}
    for root, package in ((Path(rigbook.__file__).parent, "rigbook"),
                          (Path(rigbook.roles.__file__).parent, "rigbook.roles")):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS[:3] else "app"


def imports(name: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported name) for every import in the module: rigbook's as the module they name
    (a `from rigbook.core import spec` names rigbook.core.spec), others by their top level."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [f"{node.module}.{alias.name}" for alias in node.names]
            named = [sub for sub in subs if sub in known]
            found += [(node.lineno, sub) for sub in named] or [(node.lineno, node.module)]
    return [(line, target) for line, target in found if target != name]


def graph() -> dict[str, list[tuple[int, str]]]:
    every = modules()
    return {name: imports(name, path, set(every)) for name, path in every.items()}


def rigbook_edges(edges: list[tuple[int, str]], known) -> list[tuple[int, str]]:
    """Imports of rigbook's own modules; `import rigbook.rigside.xid` names that module."""
    return [(line, target) for line, target in edges if target in known
            and target not in ("rigbook", "rigbook.roles", "rigbook.core", "rigbook.rigside")]


def upward_imports(deps) -> list[str]:
    known = set(deps)
    bad = []
    for name, edges in deps.items():
        for line, target in rigbook_edges(edges, known):
            if LAYERS.index(layer(target)) > LAYERS.index(layer(name)):
                bad.append(f"{name}:{line} ({layer(name)}) imports {target} ({layer(target)})")
    return bad


def cycles(deps) -> list[list[str]]:
    """Each strongly connected group of two or more modules (Tarjan), as sorted names."""
    known = set(deps)
    edges = {name: sorted({t for _, t in rigbook_edges(e, known)}) for name, e in deps.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def outside_stdlib(deps) -> list[str]:
    bad = []
    for name, edges in deps.items():
        if layer(name) != "rigside":
            continue
        for line, target in edges:
            top = target.split(".")[0]
            if top not in sys.stdlib_module_names and top not in RIGSIDE_EXTRAS:
                bad.append(f"{name}:{line} imports {target}")
    return bad


@pytest.fixture(scope="module")
def deps():
    return graph()


def test_every_module_is_in_a_layer_and_the_roles_folder_holds_only_roles(deps):
    from rigbook.registry import ROLES

    claimed = {module.__name__ for role in ROLES for module in role.modules}
    in_roles = {name for name in deps if layer(name) == "roles" and name != "rigbook.roles"}
    assert in_roles == claimed, (in_roles - claimed, claimed - in_roles)


def test_no_module_imports_from_a_higher_layer(deps):
    assert upward_imports(deps) == []


def test_no_import_cycle_lazy_imports_included(deps):
    assert cycles(deps) == []


def test_rig_side_modules_need_only_the_standard_library(deps):
    assert outside_stdlib(deps) == []


def test_the_rules_catch_what_they_are_for(tmp_path):
    """The checks themselves, on a made-up graph: each rule fails where it should."""
    deps = {
        "rigbook.rigside.probe": [(3, "pyinfra"), (4, "json")],
        "rigbook.core.spec": [(5, "rigbook.roles.sweep")],
        "rigbook.roles.sweep": [(6, "rigbook.core.spec")],
        "rigbook.status": [(7, "rigbook.core.spec")],
    }
    assert outside_stdlib(deps) == ["rigbook.rigside.probe:3 imports pyinfra"]
    assert upward_imports(deps) == [
        "rigbook.core.spec:5 (core) imports rigbook.roles.sweep (roles)"]
    assert cycles(deps) == [["rigbook.core.spec", "rigbook.roles.sweep"]]
