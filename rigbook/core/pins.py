"""rigbook's shipped engine pins (files/venvs/pins.toml) and the path engines run from: what a
recipe names and the venvs role builds, defined once for both."""

from __future__ import annotations

import functools
import tomllib
from typing import Any

from rigbook import FILES
from rigbook.core.errors import RigbookError
from rigbook.core.spec import VenvSpec

VENVS_DIR = "/opt/rigbook/venvs"


@functools.cache
def engine_pins() -> dict[str, dict[str, Any]]:
    """rigbook's shipped pins (files/venvs/pins.toml), read once, when first needed: engine ->
    {"venv": name, "packages": [...], "cuda": "13.0" (absent: no CUDA runtime of its own)}."""
    with (FILES / "venvs" / "pins.toml").open("rb") as f:
        return tomllib.load(f)


def engine_venv(engine: str, name: str | None = None, **fields: Any) -> dict[str, Any]:
    """A venvs[] entry with rigbook's pins for `engine`, for Python inventories.

    `engine_venv("vllm", services=["vllm.service"])` ->
    {"name": "vllm-0.33", "engine": "vllm", "packages": ["vllm==0.33.0", "torch==2.14.0"], ...}
    (the name the shipped recipes give that engine's venv, unless `name` says another).
    """
    shipped = engine_pins()
    if engine not in shipped:
        raise RigbookError(f"no shipped pins for engine {engine!r}; allowed: {sorted(shipped)}")
    pins = shipped[engine]
    entry = {"name": name or pins["venv"], "engine": engine, "packages": pins["packages"]}
    entry.update(fields)
    return VenvSpec.model_validate(entry).model_dump(mode="json")


def venv_link(name: str) -> str:
    """The stable path engines run from: a symlink to the current build."""
    return f"{VENVS_DIR}/{name}"
