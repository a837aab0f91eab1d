"""Test inventory: the sandbox rigs, the dual 3090 (rig1) serving the CPU llama.cpp recipe.

What docs/runbooks/switch-recipe.md switches on the sandbox: the test-only recipes of
tests/recipes (tiny-cpu-a, tiny-cpu-b, ...), their engine's venv (from the wheelhouse, used by
the serving unit) and the tiny model pinned at the revision `python -m tests.standins serving`
places in the rig's Hugging Face cache.
"""

from pathlib import Path

from inventory.sandbox import sandbox_rigs
from tests.standins import LLAMA_SERVER, tiny_model
from tests.tinymodel import REPO

SERVING = {
    "recipe": "tiny-cpu-a",
    "serving_recipe_dirs": [str(Path(__file__).resolve().parent.parent / "recipes")],
    "venvs": [{"name": "tiny-cpu", "engine": "llama-cpp-python", "python": "3.11",
               "packages": [LLAMA_SERVER], "services": ["rigbook-serve.service"]}],
    "models": [{"repo": REPO, "revision": tiny_model()[1]}],
    "serving_health_timeout_s": 180,
}

rigs = [(name, {**data, **SERVING} if name == "rig1" else data) for name, data in sandbox_rigs]
