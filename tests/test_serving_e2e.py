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

llama-cpp-python is an sdist only: `wheelhouse_for_llama` builds it once into the wheelhouse
(a small CPU-only build; about 4.5 minutes on 2 cores) and downloads its server's dependencies
for the rigs' Python 3.11.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from roles.recipes import snapshot_dir
from roles.sandbox import wheelhouse
from roles.serving import CONF_DIR, ENV_PATH, KEY_PATH, UNIT_NAME, UNIT_PATH
from roles.tools import TOOLS_PINS
from roles.venvs import VENVS_DIR
from tests.conftest import ROOT, SANDBOX_INVENTORY, rig_ssh, run_pyinfra
from tests.tinymodel import FILE, REPO, cache_layout, revision_of, write_tiny_gguf

CONVERGE = "tests/recipes/converge.py"
SWITCH = "deploys/serve.py"
LLAMA = "llama-cpp-python==0.3.36"
LLAMA_SERVER = "llama-cpp-python[server]==0.3.36"
#: A small CPU-only build: no native tuning (the wheel runs on any x86_64), no OpenMP runtime
#: to carry, no multimodal library, tools, examples, tests, server binary or TLS.
CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF "
    "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF "
    "-DLLAMA_OPENSSL=OFF"
)
CACHE = "/var/lib/rigbook/hf/hub"
SERVE_OP = "Serving | Serve {} as rigbook-serve.service"
KEY = "rigbook-e2e-key-7f3a"

pytestmark = pytest.mark.sandbox


def pip(*args: str, timeout: int = 600, env: dict | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def wheelhouse_for_llama() -> float:
    """Fill the wheelhouse for the engine venv; returns the seconds spent building the wheel."""
    house = wheelhouse()
    built = 0.0
    if not list(house.glob("llama_cpp_python-0.3.36-*.whl")):
        with tempfile.TemporaryDirectory() as tmp:
            pip("download", "--no-deps", "--no-binary=:all:", LLAMA, "-d", tmp)
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS,
                   "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
            start = time.monotonic()
            pip("wheel", "--no-deps", "-w", str(house), str(sdist), timeout=3600, env=env)
            built = time.monotonic() - start
    platforms = (
        "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64",
    )
    pip(
        "download", "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
        "--abi", "cp311", *(f"--platform={p}" for p in platforms), "--find-links", str(house),
        "-d", str(house), LLAMA_SERVER,
        *(f"{name}=={version}" for name, version in TOOLS_PINS.items()),
    )
    return built


def ssh_with_input(rig: dict, command: str, data: bytes) -> None:
    done = subprocess.run(
        ["ssh", "-i", rig["ssh_key"], "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
         f"root@{rig['address']}", command],
        input=data, capture_output=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()


def place_model(rig: dict, gguf: Path, revision: str) -> None:
    """The tiny model in the rig's HF cache exactly as a completed rigbook pull leaves it."""
    layout = cache_layout(gguf, revision)
    data = gguf.read_bytes()
    manifest = {
        "rigbook_manifest": 1, "repo": REPO, "revision": revision,
        "allow_patterns": [], "ignore_patterns": [],
        "files": {FILE: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}},
    }
    top = f"{CACHE}/{layout['blob'].split('/')[0]}"
    ssh_with_input(rig, f"mkdir -p {top}/blobs && cat > {CACHE}/{layout['blob']}", data)
    snapshot = snapshot_dir(CACHE, REPO, revision)
    ssh_with_input(
        rig,
        f"mkdir -p {snapshot} {top}/refs {top}/rigbook && "
        f"ln -sfn {layout['target']} {CACHE}/{layout['link']} && "
        f"echo {revision} > {CACHE}/{layout['ref']} && cat > {top}/rigbook/{revision}.json",
        json.dumps(manifest).encode(),
    )


def data_args(recipe: str, revision: str, key_file: Path) -> list[str]:
    data = {
        "recipe": recipe,
        "serving_recipe_dirs": json.dumps([str(ROOT / "tests" / "recipes")]),
        "venvs": json.dumps([{"name": "tiny-cpu", "engine": "llama-cpp-python",
                              "python": "3.11", "packages": [LLAMA_SERVER]}]),
        "models": json.dumps([{"repo": REPO, "revision": revision}]),
        "serving_bind": "0.0.0.0",
        "serving_api_key_file": str(key_file),
        "serving_health_timeout_s": "180",
    }
    args = ["--limit", "rig1"]
    for key, value in data.items():
        args += ["--data", f"{key}={value}"]
    return args


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
        assert "HF_HUB_OFFLINE=1" in env and "RIGBOOK_RECIPE=tiny-cpu-a" in env
        assert KEY not in env
        unit = rig_ssh(rig, f"systemctl show -p TimeoutStopUSec,Restart,User {UNIT_NAME}").stdout
        assert "TimeoutStopUSec=2min" in unit and "Restart=on-failure" in unit

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
        assert "RIGBOOK_RECIPE=tiny-cpu-b" in rig_ssh(rig, f"cat {ENV_PATH}").stdout
    finally:  # leave rig1 as the other tests know it: no engine, unit, model or venv of ours
        rig_ssh(rig, f"systemctl disable --now {UNIT_NAME}; rm -rf {UNIT_PATH} {CONF_DIR} "
                     f"{CACHE}/models--local--tiny {VENVS_DIR}/tiny-cpu {VENVS_DIR}/tiny-cpu-* "
                     f"{VENVS_DIR}/tiny-cpu.env; systemctl daemon-reload", check=False)
