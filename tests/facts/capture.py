"""Capture fact outputs on a real host for the fact fixtures (tests/facts/README.md).

    .venv/bin/python tests/facts/capture.py plan PLAN.json        # here: each case's command
    python3 tests/facts/capture.py run PLAN.json RAW.json          # on the host: stdlib only
    .venv/bin/python tests/facts/capture.py write RAW.json         # here: the fixture files

`run` sets up what a case needs under /tmp/rigbook-capture (a folder, a venv, a process holding
inotify watches), runs the fact's own command with sh and keeps its stdout, and the independent
reads a case is checked against (`also`: what the fact reads, by another tool). It changes
nothing outside /tmp/rigbook-capture. `write` makes each case's fixture, its value parsed by the
fact; compare it with the case's `also` reads (kept in RAW, tests/facts/captures/) before
committing it.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = "/tmp/rigbook-capture"
WATCHES = "fs.inotify.max_user_watches"
#: A process holding three inotify watches while InotifyWatches runs (its pid in ROOT/holder).
HOLDER = (
    f"mkdir -p {ROOT}/w/0 {ROOT}/w/1 {ROOT}/w/2; python3 -c 'import ctypes,os,time\n"
    "libc=ctypes.CDLL(None)\nfd=libc.inotify_init()\n"
    f"[libc.inotify_add_watch(fd,(\"{ROOT}/w/%d\"%i).encode(),0x100) for i in range(3)]\n"
    "time.sleep(20)' >/dev/null 2>&1 & echo $! > " + ROOT + "/holder; sleep 2"
)
VENV = f"{ROOT}/v"
#: A stand-in nvcc of a given release on PATH (the host has none): what `nvcc --version` prints.
NVCC = ("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        "echo 'Cuda compilation tools, release {0}, V{0}.88'\n")


def cases() -> list[dict]:
    """Each case: its fixture's name, the fact, its arguments, set-up and independent reads."""
    from rigbook.roles import wsl
    from rigbook.roles.serving import probe_args, serve_plan
    from tests.test_serving import cpu_rig

    present = tuple(f"{ROOT}/present/{name}" for name in
                    ("99-vllm-swap.conf", "a folder.conf", "a link.conf", "absent.conf"))
    users = f"{ROOT}/Users"
    return [
        {"name": "tuning.LiveSysctls/watches-rmem-and-a-missing-key",
         "args": {"keys": [WATCHES, "net.ipv4.tcp_rmem", "vm.no_such_key"]},
         "also": {"watches": "cat /proc/sys/fs/inotify/max_user_watches",
                  "rmem": "cat /proc/sys/net/ipv4/tcp_rmem", "mounts": "cat /proc/mounts"}},
        {"name": "tuning.Shm/tmpfs-dev-shm",
         "args": {}, "also": {"meminfo": "grep MemTotal /proc/meminfo",
                              "df": "df -B1 --output=size,used /dev/shm"}},
        {"name": "tuning.InotifyWatches/a-process-holding-three",
         "args": {}, "setup": HOLDER,
         "also": {"pid": f"cat {ROOT}/holder", "uid": "id -u"}},
        {"name": "tuning.PresentPaths/file-folder-link-absent",
         "args": {"paths": list(present)},
         "setup": (f"mkdir -p '{ROOT}/present/a folder.conf' && "
                   f"echo 'vm.swappiness = 10' > {present[0]} && "
                   f"ln -sfn {present[0]} '{present[2]}'"),
         "also": {"ls": f"ls -la {ROOT}/present"}},
        {"name": "wsl.Wsl/linux-not-wsl", "args": {}, "also": {"uname": "uname -r"}},
        {"name": "wsl.RegistryValues/no-reg-exe",
         "args": {"key": wsl.GRAPHICS_DRIVERS, "names": ["TdrDelay", "TdrDdiDelay", "TdrLevel"]},
         "also": {"reg": f"ls -l {wsl.REG_EXE} 2>&1; true"}},
        {"name": "wsl.WindowsProfiles/users-folders", "args": {}, "patch": {"USERS": users},
         "setup": (f"mkdir -p {users}/rig {users}/Public {users}/Default {users}/other && "
                   f": > {users}/desktop.ini && printf '[wsl2]\\r\\nmemory=32GB\\r\\n' > "
                   f"{users}/rig/.wslconfig"),
         "also": {"ls": f"ls -la {users} {users}/rig"}},
        {"name": "guards.GpuTopology/h200-one-gpu", "args": {},
         "also": {"topo": "nvidia-smi topo -m", "nvlink": "nvidia-smi nvlink -s; echo rc=$?"}},
        {"name": "serving.ServeProbe/a-host-that-serves-nothing",
         "args": {"args": probe_args(serve_plan(cpu_rig(), "rig1"))},
         "also": {"meminfo": "grep -E '^Mem(Total|Available):' /proc/meminfo",
                  "unit": "systemctl show rigbook-serve.service 2>&1 | head -5; true"}},
        {"name": "tokens.SecretFile/a-token-file", "args": {"path": f"{ROOT}/token"},
         "setup": f"umask 077; printf 'hf_not_a_real_token\\n' > {ROOT}/token",
         "also": {"stat": f"stat -c '%a %U %G' {ROOT}/token", "sha": f"sha256sum {ROOT}/token"}},
        {"name": "tokens.SecretFile/absent", "args": {"path": f"{ROOT}/no-token"}},
        {"name": "venvs.VenvLayoutFact/a-bare-venv", "args": {"venv": VENV},
         "setup": f"python3 -m venv --without-pip {VENV}",
         "also": {"site": f"ls -d {VENV}/lib/python3*/site-packages"}},
        {"name": "venvs.VenvLayoutFact/a-venv-with-cu13-and-its-nvcc", "args": {"venv": VENV},
         "setup": (f"s=$(ls -d {VENV}/lib/python3*/site-packages); "
                   "mkdir -p $s/nvidia/cu13/bin $s/nvidia/cu13/lib && "
                   "printf '#!/bin/sh\\n' > $s/nvidia/cu13/bin/nvcc && "
                   "chmod 755 $s/nvidia/cu13/bin/nvcc"),
         "also": {"cu13": f"ls {VENV}/lib/python3*/site-packages/nvidia/cu13"}},
        {"name": "venvs.VenvLayoutFact/no-venv", "args": {"venv": f"{ROOT}/none"}},
        *({"name": f"venvs.VenvLayoutFact/nvcc-{release}-on-path", "args": {"venv": f"{ROOT}/n"},
           "setup": (f"python3 -m venv --without-pip {ROOT}/n && printf %s "
                     f"{shell_quote(NVCC.format(release))} > {ROOT}/n/bin/nvcc && "
                     f"chmod 755 {ROOT}/n/bin/nvcc"),
           "also": {"nvcc": f"{ROOT}/n/bin/nvcc --version"}} for release in ("12.8", "13.0")),
    ]


def layouts() -> list[dict]:
    """Cases read over folders the tests build (a cache, venv builds): built here under ROOT with
    the tests' own helpers and sent to the host as a tarball in the set-up."""
    from tests import test_status as status
    from tests.test_models import COMMIT, FILES_A, make_repo

    subprocess.run(["rm", "-rf", ROOT], check=True)
    hub = Path(ROOT, "hub")
    make_repo(hub, "org/model", COMMIT, FILES_A, lfs=("model.safetensors",))
    venvs = Path(ROOT, "venvs")
    names = ["ok", "old", "cu132", "changed", "cut", "absent", "mine"]
    rig = status.dual_3090(venvs=[{"name": name, **status.VENV} for name in names])
    status.write_build(venvs, rig, "ok", "580.95.05")
    status.write_build(venvs, rig, "old", "580.76.05")
    status.write_build(venvs, rig, "cu132", "580.95.05", cuda_runtime="13.2")
    status.write_build(venvs, rig, "changed", "580.95.05", digest="0123456789ab")
    status.write_build(venvs, rig, "cut", "580.95.05", finished=False)
    (venvs / "mine").mkdir()
    serve = Path(ROOT, "serve")
    tiny = status.tiny_rig(serve)
    status.write_build(serve / "venvs", tiny, "tiny-cpu", "580.95.05")
    tar = subprocess.run(["tar", "czf", "-", "-C", ROOT, "."], capture_output=True, check=True)
    subprocess.run(["rm", "-rf", ROOT], check=True)
    unpack = f"printf %s {base64.b64encode(tar.stdout).decode()} | base64 -d | tar xzf - -C {ROOT}"
    venv_cases = [
        {"name": f"venvs.VenvBuilds/{name}", "args": {"venv_name": name},
         "patch": {"VENVS_DIR": str(venvs)}, "also": {"ls": f"ls -la {venvs}"}}
        for name in names]
    venv_cases[0]["setup"] = unpack
    return [
        *venv_cases,
        {"name": "venvs.VenvBuilds/tiny-cpu", "args": {"venv_name": "tiny-cpu"},
         "patch": {"VENVS_DIR": str(serve / "venvs")}, "also": {"ls": f"ls -la {serve}/venvs"}},
        {"name": "models.ModelCache/one-repo-with-an-lfs-file", "args": {"cache": str(hub)},
         "also": {"find": f"find {hub} -printf '%y %s %p -> %l\\n'"}},
        {"name": "serving.FindInFile/no-engine-env",
         "args": {"path": f"{ROOT}/no.env", "pattern": "^RIGBOOK_RECIPE="},
         "also": {"ls": f"ls -l {ROOT}/no.env 2>&1; true"}},
    ]


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def fact_of(name: str):
    from tests.test_facts_data import fact_class

    return fact_class(name.split("/")[0])


def command_of(case: dict) -> str:
    from pyinfra.api import StringCommand

    from tests.test_facts_data import role_module

    module = role_module(case["name"].split(".")[0])
    saved = {key: getattr(module, key) for key in case.get("patch", {})}
    try:
        for key, value in case.get("patch", {}).items():
            setattr(module, key, value)
        args = {k: tuple(v) if isinstance(v, list) else v for k, v in case["args"].items()}
        command = fact_of(case["name"])().command(**args)
    finally:
        for key, value in saved.items():
            setattr(module, key, value)
    return command.get_raw_value() if isinstance(command, StringCommand) else command


def plan(path: str, which: str = "cases") -> None:
    """The plan of `cases` (the first capture) or `layouts` (the second)."""
    out = [{**case, "command": command_of(case)} for case in {"cases": cases,
                                                                "layouts": layouts}[which]()]
    Path(path).write_text(json.dumps(out, indent=1))


def sh(text: str) -> dict:
    proc = subprocess.run(["sh", "-c", text], capture_output=True, text=True)
    return {"stdout": proc.stdout, "stderr": proc.stderr, "rc": proc.returncode}


def run(plan_path: str, raw_path: str) -> None:
    """On the host: set up, run each command, keep what it printed (stdlib only)."""
    subprocess.run(["rm", "-rf", ROOT], check=True)
    Path(ROOT).mkdir()
    host = {key: sh(cmd)["stdout"] for key, cmd in
            {"uname": "uname -a", "os": "cat /etc/os-release", "pid1": "ps -p 1 -o comm="}.items()}
    raw = []
    for case in json.loads(Path(plan_path).read_text()):
        setup = sh(case["setup"]) if case.get("setup") else None
        result = sh(case["command"])
        also = {key: sh(cmd) for key, cmd in case.get("also", {}).items()}
        raw.append({**case, "setup_result": setup, "result": result, "also_result": also})
    Path(raw_path).write_text(json.dumps({"host": host, "cases": raw}, indent=1))
    subprocess.run(["rm", "-rf", ROOT], check=True)


def write(raw_path: str) -> None:
    from tests.test_facts_data import fact_args, plain

    for case in json.loads(Path(raw_path).read_text())["cases"]:
        output = case["result"]["stdout"].splitlines()
        fact = fact_of(case["name"])()
        value = fact.process(output) if output else fact.default()
        fixture = {"args": case["args"], **({"patch": case["patch"]} if "patch" in case else {}),
                   "command": case["command"], "output": output, "value": plain(value)}
        assert fact_args(fixture) is not None
        path = HERE / f"{case['name']}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(fixture, indent=4, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    {"plan": plan, "run": run, "write": write}[sys.argv[1]](*sys.argv[2:])
