"""`rigbook schema`: the JSON Schema an editor validates recipes and host data with, checked by
a JSON Schema validator (jsonschema), not by rigbook's own code. It must take everything rigbook
takes (the shipped recipes, the example inventory) and refuse what it can see is broken."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tomllib

import pytest
from jsonschema import Draft202012Validator
from pyinfra.api import State
from pyinfra.context import ctx_state
from pyinfra_cli.inventory import make_inventory_from_files

from rigbook.roles.recipes import RECIPES_DIR
from tests.conftest import ROOT


def schema_of(*args: str) -> Draft202012Validator:
    """The schema as a user gets it: printed by the CLI."""
    out = subprocess.run([sys.executable, "-m", "rigbook.cli", "schema", *args], check=True,
                         capture_output=True, text=True).stdout
    schema = json.loads(out)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


@pytest.fixture(scope="module")
def recipe() -> Draft202012Validator:
    return schema_of("recipe")


@pytest.fixture(scope="module")
def host_data() -> Draft202012Validator:
    return schema_of("host-data")


RECIPES = sorted(RECIPES_DIR.glob("*.toml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_validates(recipe, path):
    errors = [e.message for e in recipe.iter_errors(tomllib.loads(path.read_text()))]
    assert errors == []


def _broken(data: dict, change) -> dict:
    data = copy.deepcopy(data)
    change(data)
    return data


BROKEN_RECIPES = {
    "a newline in an env value": lambda r: r.update(env={"NCCL_P2P_DISABLE": "1\nLD_PRELOAD=x"}),
    "an unknown key (a typo)": lambda r: r.update(tensor_paralel=2),
    "a number as text": lambda r: r.update(context_len="65536"),
    "a boolean as a number": lambda r: r.update(gdn=1),
    "an engine rigbook does not have": lambda r: r.update(engine="tgi"),
    "the required engine missing": lambda r: r.pop("engine"),
}


@pytest.mark.parametrize("change", BROKEN_RECIPES.values(), ids=BROKEN_RECIPES)
def test_a_broken_recipe_is_refused(recipe, change):
    good = tomllib.loads((RECIPES_DIR / "qwen36-27b-dual-3090.toml").read_text())
    assert list(recipe.iter_errors(good)) == []
    assert list(recipe.iter_errors(_broken(good, change))) != []


def _example_hosts() -> dict[str, dict]:
    """Each example rig's data (group data merged) as pyinfra loads it, before rigbook's check
    (which refuses the example's placeholder model pin: no schema can know a commit)."""
    with ctx_state.use(State()):
        inventory = make_inventory_from_files(str(ROOT / "inventory" / "rigs.py"),
                                              override_data={}, cwd=str(ROOT))
    return {h.name: json.loads(json.dumps(h.data.dict())) for h in inventory}


def test_every_example_rig_validates_pyinfra_keys_included(host_data):
    hosts = _example_hosts()
    assert len(hosts) >= 3 and any(k.startswith("ssh_") for d in hosts.values() for k in d)
    for name, data in hosts.items():
        assert [e.message for e in host_data.iter_errors(data)] == [], name


BROKEN_HOST_DATA = {
    "an unknown key": lambda d: d.update(power_cap=300),
    "a newline in a path": lambda d: d.update(stale_files=["/etc/sysctl.d/x.conf\nrm -rf /"]),
    "more GPUs than a rig has": lambda d: d.update(gpu_count=64),
    "a card class rigbook does not know": lambda d: d.update(gpu_class="rtx9090"),
    "a path that is not absolute": lambda d: d.update(models_cache="var/lib/hf"),
    "a path with a space": lambda d: d.update(models_cache="/var/lib/my models"),
    "a driver version that is no version": lambda d: d.update(driver_version="580; reboot"),
}


@pytest.mark.parametrize("change", BROKEN_HOST_DATA.values(), ids=BROKEN_HOST_DATA)
def test_broken_host_data_is_refused(host_data, change):
    good = _example_hosts()["rig-dual3090"]
    assert list(host_data.iter_errors(_broken(good, change))) != []


def test_group_data_validates_with_partial_and_needs_the_required_keys_without():
    group = {"driver_branch": 580, "ssh_user": "root"}
    assert list(schema_of("host-data", "--partial").iter_errors(group)) == []
    missing = {e.message for e in schema_of("host-data").iter_errors(group)}
    assert {"'platform' is a required property", "'gpu_class' is a required property"} <= missing
