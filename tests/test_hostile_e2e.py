"""The nastiest values rigbook accepts, rendered into a real unit and env file on a sandbox rig.

The serving unit and its engine.env are rendered exactly as roles/serving.py renders them, for a
recipe whose engine arguments and environment hold quotes, `$()`, backticks, `%` specifiers,
backslashes, spaces and a leading dash (tests/test_hostile.py lists them). On the rig,
`systemd-analyze verify` checks the unit, and systemd itself starts it with a stand-in engine
that writes down the argv and environment it was given: they must be the recipe's values
exactly, with no extra argument, directive or variable. Nothing of it is left on the rig.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from roles.render import systemd_word
from roles.serving import ENV_PATH, SERVE_HOME, SERVE_USER, render_env, render_unit, serve_plan
from roles.spec import Rig
from tests.conftest import ROOT, rig_ssh
from tests.test_hostile import ACCEPTED_ARGS

pytestmark = pytest.mark.sandbox

UNIT = "rigbook-hostile.service"
DUMP = "/usr/local/bin/rigbook-argv-dump"
OUT = "/tmp/rigbook-hostile.json"  # written as the unit's user
ENV_HERE = "/etc/rigbook-hostile/engine.env"
ENV = {"HOSTILE_A": "$HOME", "HOSTILE_B": 'say "hi" `id` \\ %h $(id)', "HOSTILE_C": "-x ;"}
DUMPER = f"""#!/usr/bin/python3
import json, os, sys
json.dump({{"argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items()
                                          if k.startswith("HOSTILE_")}}}}, open("{OUT}", "w"))
"""


def put(rig: dict, path: str, text: str, mode: str = "644") -> None:
    done = subprocess.run(
        ["ssh", "-i", rig["ssh_key"], "-o", "StrictHostKeyChecking=no", "-o",
         "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
         f"root@{rig['address']}", f"mkdir -p $(dirname {path}) && cat > {path} && chmod {mode} "
                                   f"{path}"],
        input=text, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr


def hostile_plan(tmp_path: Path):
    recipe = (ROOT / "tests" / "recipes" / "tiny-cpu-a.toml").read_text()
    recipe = recipe.replace('name = "tiny-cpu-a"', 'name = "hostile-cpu"').replace(
        "[model]", f"extra_args = {json.dumps(ACCEPTED_ARGS)}\n"
                   f"env = {{ {', '.join(f'{k} = {json.dumps(v)}' for k, v in ENV.items())} }}\n"
                   "[model]", 1)
    (tmp_path / "hostile-cpu.toml").write_text(recipe)
    rig = Rig.model_validate({
        "platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2, "recipe": "hostile-cpu",
        "serving_recipe_dirs": [str(tmp_path)],
        "venvs": [{"name": "tiny-cpu", "engine": "llama-cpp-python", "python": "3.11",
                   "packages": ["llama-cpp-python[server]==0.3.36"]}],
        "models": [{"repo": "local/tiny", "revision": "1" * 40}],
    })
    return serve_plan(rig, "rig1")


def test_accepted_hostile_values_are_inert_in_the_real_unit_and_env_file(sandbox, tmp_path):
    rig = sandbox["rig1"]
    plan = hostile_plan(tmp_path)
    assert all(arg in plan.argv for arg in ACCEPTED_ARGS)
    unit = render_unit(plan, None).replace(ENV_PATH, ENV_HERE)
    engine = systemd_word(plan.argv[0])
    assert f"ExecStart={engine} " in unit
    unit = unit.replace(f"ExecStart={engine} ", f"ExecStart={DUMP} ", 1)
    try:
        rig_ssh(rig, f"id -u {SERVE_USER} >/dev/null 2>&1 || useradd --system {SERVE_USER}; "
                     f"mkdir -p {SERVE_HOME}")
        put(rig, DUMP, DUMPER, "755")
        put(rig, ENV_HERE, render_env(plan, None))
        put(rig, f"/etc/systemd/system/{UNIT}", unit)
        verify = rig_ssh(rig, f"systemd-analyze verify /etc/systemd/system/{UNIT}", check=False)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        rig_ssh(rig, f"systemctl daemon-reload && systemctl start {UNIT}")
        rig_ssh(rig, f"timeout 30 sh -c 'until [ -s {OUT} ]; do sleep 0.2; done'")
        seen = json.loads(rig_ssh(rig, f"cat {OUT}").stdout)
        assert seen["argv"] == list(plan.argv[1:])  # every word as the recipe has it, no more
        assert seen["env"] == ENV  # every variable as the recipe has it, no more
        shown = rig_ssh(rig, f"systemctl cat {UNIT}").stdout.splitlines()
        directives = [line.split("=", 1)[0] for line in shown if "=" in line
                      and not line.startswith("#")]
        assert directives.count("ExecStart") == 1 and "ExecStartPre" not in directives
        print(f"{UNIT}: systemd-analyze verify clean; argv of {len(seen['argv'])} words and "
              f"{len(seen['env'])} variables read back unchanged")
    finally:
        rig_ssh(rig, f"systemctl stop {UNIT}; rm -f /etc/systemd/system/{UNIT} {DUMP} {OUT}; "
                     "rm -rf /etc/rigbook-hostile; systemctl daemon-reload", check=False)
