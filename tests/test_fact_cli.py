"""Every rigbook fact through pyinfra's own fact CLI (`pyinfra INVENTORY fact rigbook.M.F
key=value`), which prints each value as JSON with pyinfra_cli's encoder: sets, paths and dates,
and otherwise the value's `to_json()` (rigbook.core.types.JsonValue). Run once on @local (this
machine: most GPU facts are empty here) and once on the dual-3090 sandbox rig, whose simulated
GPU layer gives the GPU facts values."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import subprocess
import typing

import pytest
from pydantic import BaseModel
from pyinfra.api import FactBase

from rigbook.core.reboot import SIM_LOADED_VERSION
from rigbook.roles.serving import probe_args, serve_plan
from tests.conftest import PYINFRA, ROOT, SANDBOX_INVENTORY, rig_ssh
from tests.test_driver_e2e import forget_driver
from tests.test_driver_source_e2e import unowned_install
from tests.test_layers import modules
from tests.test_serving import cpu_rig

#: Arguments for the facts that take some (JSON, as the CLI parses a value).
ARGS = {
    "AptVersions": ['packages=["nvidia-open"]'],
    "AptPolicyFact": ['packages=["nvidia-open"]'],
    "FreeDisk": ['paths=["/"]'],
    "ShmReapPlan": ['patterns=["vllm-*"]'],
    "FileStates": ['paths=["/etc/hostname"]'],
    "ModelCache": ["cache=/var/lib/rigbook/hf/hub"],
    # one JSON string (as probe_args makes it), given as a JSON string literal
    "ServeProbe": ["args=" + json.dumps(probe_args(serve_plan(cpu_rig(), "rig1")))],
    "SecretFile": ["path=/etc/hostname"],
    # takes the run lock for the CLI's own session (stale once it ends, as after any run)
    "RunLock": ["taker=" + json.dumps(json.dumps({"operator": "fact@cli", "pid": 1,
                                                  "started": "2026-12-02T00:00:00Z"}))],
    "LiveSysctls": ['keys=["fs.inotify.max_user_watches"]'],
    "PresentPaths": ['paths=["/etc"]'],
    "Entries": ["path=/etc"],
    "UnitStates": ['units=["ssh.service"]'],
    "VenvBuilds": ["venv_name=demo"],
    "VenvLayoutFact": ["venv=/opt/rigbook/venvs/demo"],
    "RegistryValues": ["key=HKLM\\System", 'names=["TdrDelay"]'],
    "SpecAcceptance": ["unit=rigbook-serve.service", "log=/var/log/rigbook/serve.log"],
    "SignedModulesFact": ["branch=580", "server=false", "open_=true"],
}
#: Not for the CLI: the one-round-trip batch of other facts' commands (rigbook.core.checks).
INTERNAL = {"FactBatch"}


def rigbook_facts() -> list[type[FactBase]]:
    found = []
    for module in modules():
        mod = importlib.import_module(module)
        found += [cls for cls in vars(mod).values() if inspect.isclass(cls)
                  and issubclass(cls, FactBase) and cls.__module__ == mod.__name__
                  and cls.__name__ not in INTERNAL]
    return found


def _unencodable(hint, seen: set) -> list[str]:
    """Dataclasses and models in a value's type that pyinfra's encoder would refuse (a value
    with to_json() is encoded whole: asdict() takes care of what it holds)."""
    bad = []
    for arg in typing.get_args(hint):
        bad += _unencodable(arg, seen)
    if inspect.isclass(hint) and hint not in seen and (
            dataclasses.is_dataclass(hint) or issubclass(hint, BaseModel)):
        seen.add(hint)
        if not hasattr(hint, "to_json"):
            bad.append(hint.__qualname__)
            for field_hint in typing.get_type_hints(hint).values():
                bad += _unencodable(field_hint, seen)
    return bad


def test_every_fact_value_type_has_a_json_form():
    facts = rigbook_facts()
    assert len(facts) > 30
    bad = {cls.__name__: _unencodable(typing.get_type_hints(cls.process).get("return"), set())
           for cls in facts}
    assert {name: types for name, types in bad.items() if types} == {}


def fact_cli(inventory: str, *options: str) -> dict[str, object]:
    """Run the CLI on every rigbook fact at once; fact name -> its JSON value for the host."""
    argv = [PYINFRA, "-y", inventory, *options, "fact"]
    for cls in rigbook_facts():
        argv += [f"{cls.__module__}.{cls.__name__}", *ARGS.get(cls.__name__, ())]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYINFRA_PROGRESS": "off"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    values: dict[str, object] = {}
    text = run.stdout + run.stderr
    for block in text.split("--> Fact data for: ")[1:]:
        header, _, rest = block.partition("\n")
        body = rest.split("\n--> ", 1)[0]
        (value,) = json.loads(body).values()
        values[header.split(" ", 1)[0].removeprefix("rigbook.")] = value
    return values


def _expected() -> set[str]:
    return {f"{cls.__module__.removeprefix('rigbook.')}.{cls.__name__}"
            for cls in rigbook_facts()}


def test_every_fact_prints_as_json_on_local():
    # config.py validates every host's data first: @local gets the least a rig declares
    values = fact_cli("@local", "--data", "platform=debian", "--data", "gpu_class=rtx3090",
                      "--data", "gpu_count=1")
    assert set(values) == _expected()
    assert isinstance(values["roles.driver_source.DriverSourceFact"]["files"], list)
    disks = values["roles.disks.FreeDisk"]
    assert isinstance(disks, list) and disks[0]["mount"]
    assert values["roles.serving.ServeProbe"]["mem_total_kib"] > 0


@pytest.mark.sandbox
def test_every_fact_prints_as_json_on_a_sandbox_rig(sandbox):
    rig1 = sandbox["rig1"]
    forget_driver(rig1)
    paths = unowned_install(rig1)  # the stand-in GPU layer, whatever an earlier test left
    try:
        values = fact_cli(SANDBOX_INVENTORY, "--limit", "rig1")
    finally:
        rig_ssh(rig1, f"rm -f {' '.join(paths)} {SIM_LOADED_VERSION}", check=False)
        forget_driver(rig1)
    assert set(values) == _expected()
    health = values["roles.health.GpuHealthReadings"]
    assert [gpu["index"] for gpu in health] == [0, 1]
    assert len(values["core.facts.NvidiaGpus"]["gpus"]) == 2
    assert values["roles.wsl.Wsl"]["run_wsl"] is False
