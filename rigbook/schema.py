"""JSON Schema of host data and of a recipe, from the models that validate them.

An editor that reads JSON Schema (taplo for a recipe's TOML, the YAML and JSON language servers
for an inventory's data) then shows a key's description, its allowed values and its range as the
user types. The schema is an aid, never the judge: it comes from the same pydantic models as
docs/host-data.md, and what it cannot say (a path's `..` parts, a pinned requirement's grammar,
keys that contradict each other) is left to rigbook's own check, which runs before connecting.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import GenerateJsonSchema

from rigbook.core.spec import PYINFRA_KEY, Rig
from rigbook.core.types import ALLOWS, PATTERNS, VALIDATORS
from rigbook.roles.recipes import Recipe

DIALECT = "https://json-schema.org/draft/2020-12/schema"


class _WithRigbookTypes(GenerateJsonSchema):
    """Gives each of rigbook/core/types.py's string types its allowed characters as a pattern (where
    a JSON Schema pattern can say exactly that much, or less) and its words as a comment."""

    def function_after_schema(self, schema) -> dict[str, Any]:
        json_schema = dict(super().function_after_schema(schema))
        name = VALIDATORS.get(getattr(schema["function"]["function"], "__name__", ""))
        if name:
            json_schema["$comment"] = ALLOWS[name]
            if name in PATTERNS:
                json_schema["pattern"] = PATTERNS[name]
        return json_schema


def host_data_schema(partial: bool = False) -> dict[str, Any]:
    """One rig's host data; pyinfra's own keys (`ssh_*`, `_sudo`, ...) pass, as in the check.
    `partial` drops the required keys, for a group-data file that carries only some of them."""
    schema = _schema(Rig, "rigbook host data")
    schema["patternProperties"] = {PYINFRA_KEY.pattern: {}}
    if partial:
        schema.pop("required", None)
    return schema


def recipe_schema() -> dict[str, Any]:
    """One recipe file (files/recipes/<name>.toml, or one in `serving_recipe_dirs`)."""
    return _schema(Recipe, "rigbook serving recipe")


def _schema(model, title: str) -> dict[str, Any]:
    schema = model.model_json_schema(schema_generator=_WithRigbookTypes, mode="validation")
    return {"$schema": DIALECT, **schema, "title": title}
