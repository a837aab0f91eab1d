"""Serving end to end on the dual-3090 sandbox rig (rig1): a REAL engine on CPU, via the CLI.

Sandbox rigs have no GPU, so the engine is llama-cpp-python's OpenAI-compatible server serving a
tiny random-weights llama model (tests/tinymodel.py) from test-only cpu_only recipes
(tests/recipes/). One story, in order, each step starting from what the last one left:

1. the converge (venvs + serving) builds the engine's venv from the wheelhouse, starts recipe
   tiny-cpu-a bound to 0.0.0.0 with an API key, and the health check proves /v1/models and a
   completion; the key is in no command line, the engine runs as rigbook-serve;
2. a second converge changes nothing;
3. deploys/serve.py switches to tiny-cpu-b (another port and context): the old engine is
   stopped gracefully, the new one answers, one engine runs;
4. a recipe with a bad flag fails its health check, the unit's journal lines are shown and the
   unit is stopped (the rig serves nothing, clearly);
5. back on tiny-cpu-b, a recipe whose host RAM estimate exceeds MemAvailable is refused by the
   preflight: nothing changes and tiny-cpu-b keeps serving.

llama-cpp-python is an sdist only: tests/standins.py builds it once into the wheelhouse.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rigbook.core.pins import VENVS_DIR
from rigbook.roles.serving import CONF_DIR, ENV_PATH, KEY_PATH, UNIT_NAME, UNIT_PATH
from tests.conftest import ROOT, SANDBOX_INVENTORY, rig_ssh, run_pyinfra, security_exposure
from tests.standins import CACHE, LLAMA_SERVER, place_model, wheelhouse_for_llama
from tests.tinymodel import FILE, REPO, revision_of, write_tiny_gguf

CONVERGE = "tests/recipes/converge.py"
SWITCH = "deploys/serve.py"
SERVE_OP = "Serving | Serve {} as rigbook-serve.service"
KEY = "rigbook-e2e-key-7f3a"

pytestmark = pytest.mark.sandbox


def tiny_cpu_args(rig: str, recipe: str, revision: str, **more: str) -> list[str]:
    """pyinfra's arguments for serving one of tests/recipes' tiny CPU recipes on one rig."""
    data = {
        "recipe": recipe,
        "serving_recipe_dirs": json.dumps([str(ROOT / "tests" / "recipes")]),
        "venvs": json.dumps([{"name": "tiny-cpu", "engine": "llama-cpp-python",
                              "python": "3.11", "packages": [LLAMA_SERVER]}]),
        "models": json.dumps([{"repo": REPO, "revision": revision}]),
        "serving_health_timeout_s": "180",
        **more,
    }
    args = ["--limit", rig]
    for key, value in data.items():
        args += ["--data", f"{key}={value}"]
    return args


def data_args(recipe: str, revision: str, key_file: Path) -> list[str]:
    return tiny_cpu_args("rig1", recipe, revision, serving_bind="0.0.0.0",
                         serving_api_key_file=str(key_file))


def api(rig: dict, port: int, path: str = "/v1/models", key: str | None = KEY) -> tuple[int, dict]:
    """Ask the rig's API from this machine (it is bound to 0.0.0.0)."""
    request = urllib.request.Request(f"http://{rig['address']}:{port}{path}")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {}


def refused(rig: dict, port: int) -> bool:
    try:
        api(rig, port)
    except (ConnectionError, urllib.error.URLError, OSError):
        return True
    return False


def main_pid(rig: dict) -> int:
    return int(rig_ssh(rig, f"systemctl show -p MainPID --value {UNIT_NAME}").stdout.strip())


def engines(rig: dict) -> int:
    out = rig_ssh(rig, "pgrep -c -f 'llama_cpp[.]server' || true").stdout.strip()
    return int(out or 0)


def test_serving_story(sandbox, tmp_path: Path):
    built = wheelhouse_for_llama()
    if built:
        print(f"llama-cpp-python wheel built in {built:.0f} s")
    rig = sandbox["rig1"]
    gguf = write_tiny_gguf(tmp_path / FILE)
    revision = revision_of(gguf)
    place_model(rig, gguf, revision)
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)

    def run(deploy: str, recipe: str):
        return run_pyinfra(SANDBOX_INVENTORY, deploy, *data_args(recipe, revision, key_file))

    try:
        # 1. converge: venv built, tiny-cpu-a started and healthy
        first = run(CONVERGE, "tiny-cpu-a")
        assert first.returncode == 0, first.explain()
        assert "rig1" in first.changed()[SERVE_OP.format("tiny-cpu-a")]
        assert "answers on http://127.0.0.1:8100" in first.stderr
        status, models = api(rig, 8100)
        assert status == 200 and models["data"][0]["id"] == REPO
        assert api(rig, 8100, key=None)[0] == 401
        pid = main_pid(rig)
        assert rig_ssh(rig, f"ps -o user= -p {pid}").stdout.strip() == "rigbook-serve"
        cmdline = rig_ssh(rig, f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout
        assert "--n_ctx 512" in cmdline and KEY not in cmdline
        assert rig_ssh(rig, f"stat -c '%a %U' {KEY_PATH}").stdout.split() == ["600", "root"]
        env = rig_ssh(rig, f"cat {ENV_PATH}").stdout
        assert 'HF_HUB_OFFLINE="1"' in env and 'RIGBOOK_RECIPE="tiny-cpu-a"' in env
        assert KEY not in env
        unit = rig_ssh(rig, f"systemctl show -p TimeoutStopUSec,Restart,User {UNIT_NAME}").stdout
        assert "TimeoutStopUSec=2min" in unit and "Restart=on-failure" in unit
        assert security_exposure(rig, UNIT_NAME) <= 4.0  # and the engine serves under it

        # 2. a second converge changes nothing
        second = run(CONVERGE, "tiny-cpu-a")
        assert second.returncode == 0, second.explain()
        assert second.changed() == {}, second.changed()
        assert main_pid(rig) == pid

        # 3. switch to tiny-cpu-b: graceful stop of a, b answers, one engine
        switch = run(SWITCH, "tiny-cpu-b")
        assert switch.returncode == 0, switch.explain()
        assert "rig1" in switch.changed()[SERVE_OP.format("tiny-cpu-b")]
        assert api(rig, 8101)[0] == 200 and refused(rig, 8100)
        assert main_pid(rig) != pid and engines(rig) == 1
        stopped = rig_ssh(rig, f"journalctl --no-pager _PID={pid}").stdout
        assert "Finished server process" in stopped  # uvicorn's own graceful shutdown of a
        unit_log = rig_ssh(rig, f"journalctl --no-pager -u {UNIT_NAME}").stdout
        assert "Killing" not in unit_log  # never the SIGKILL after TimeoutStopSec

        # 4. a bad flag: health fails, journal shown, the unit stopped
        bad = run(SWITCH, "tiny-cpu-badflag")
        assert bad.returncode != 0, bad.explain()  # the only rig failed: no results JSON
        assert "did not come up healthy" in bad.stderr
        assert "unrecognized arguments: --no_such_flag 1" in bad.stderr
        assert "this rig serves nothing now" in bad.stderr
        assert rig_ssh(rig, f"systemctl is-active {UNIT_NAME}", check=False).stdout.strip() in (
            "inactive", "failed")
        assert engines(rig) == 0

        # 5. back to b, then a preflight that does not fit refuses and changes nothing
        back = run(SWITCH, "tiny-cpu-b")
        assert back.returncode == 0, back.explain()
        pid = main_pid(rig)
        huge = run(SWITCH, "tiny-cpu-huge")
        assert huge.returncode != 0
        assert "refused before any change, nothing was changed" in huge.stderr
        assert "host RAM: the recipe needs 4096.0 GiB" in huge.stderr and "short by" in huge.stderr
        assert main_pid(rig) == pid and api(rig, 8101)[0] == 200
        assert 'RIGBOOK_RECIPE="tiny-cpu-b"' in rig_ssh(rig, f"cat {ENV_PATH}").stdout
    finally:  # leave rig1 as the other tests know it: no engine, unit, model or venv of ours
        rig_ssh(rig, f"systemctl disable --now {UNIT_NAME}; rm -rf {UNIT_PATH} {CONF_DIR} "
                     f"{CACHE}/models--local--tiny {VENVS_DIR}/tiny-cpu {VENVS_DIR}/tiny-cpu-* "
                     f"{VENVS_DIR}/tiny-cpu.env; systemctl daemon-reload", check=False)
