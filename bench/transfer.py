"""A model pull against curl, and a venv rebuild against a bare uv install, on one sandbox rig.

    python -m bench.transfer [--repeat 3] [--pull-mib 320]

Pull: tests/hubstub.py runs inside the rig on loopback (as in tests/test_models_e2e.py: the
rigs have no route out) serving a generated repo whose weights are --pull-mib MiB of
incompressible bytes made in memory when it starts (nothing committed). rigbook pulls it with
deploys/models.py (models_endpoint: the stub, which speaks rigbook's mirror routes) into a fresh
cache each time; plain curl (this machine's, copied with the libraries it needs beyond glibc:
the rigs run the same Debian release, without curl) copies the weights from the same stub to a
file on the same filesystem. Rates are MiB/s of the same bytes; rigbook's time is its whole pull
step on the rig (list, preflight, download, sha256 of every file, manifest), from the line that
starts it to the line that ends it in pyinfra's output, and also only its download phase.

Venv: the lock is llama-cpp-python[server] (rigbook's shipped pin for that engine) resolved by
uv from this machine's wheelhouse with no index, the wheels test_venvs_e2e and
test_serving_e2e put there; nothing is downloaded. rigbook rebuilds it with deploys/venvs.py
(`rebuild_all=true`: uv venv, uv pip install, smoke test, manifest, swap); the bare install is
`uv venv` + `uv pip install --no-index --find-links` of the same pins with the same uv, uv cache,
Python and wheelhouse on the same rig, over one SSH command. Both run with the uv cache warm (a
rebuild: the cache survives builds) and emptied first (cold).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from io import BytesIO
from pathlib import Path

from bench.breakdown import INVENTORY, ROOT, sandbox_rigs
from rigbook.core.pins import VENVS_DIR
from rigbook.core.tools import UV
from rigbook.roles.venvs import UV_CACHE
from rigbook.sandbox import WHEELS_MOUNT, wheelhouse
from tests.hubstub import big_repo

MIB = 1024**2
STUB_DIR = "/run/rigbook-bench-hub"
STUB_UNIT = "rigbook-bench-hub"
PORT = 18090
REPO = "rigbook-bench/pull"
CACHE = "/var/lib/rigbook/hf/bench-pull"
CURL_DIR = "/opt/rigbook-bench-curl"
CURL_TARGET = "/var/lib/rigbook/hf/bench-curl"
VENV = "benchlock"
BARE = "/opt/rigbook-bench-bare"
LOCK_OF = "llama-cpp-python[server]==0.3.36"
#: glibc's own libraries: every rig has them, from the same release as this machine.
GLIBC = ("ld-linux", "libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so", "libresolv.so")


def rate(size: int, seconds: float) -> float:
    """MiB/s of `size` bytes in `seconds`."""
    return round(size / MIB / seconds, 1) if seconds > 0 else 0.0


def ratio(part: float, whole: float) -> float:
    return round(part / whole, 2) if whole else 0.0


def ssh(rig: dict, command: str, data: bytes | None = None) -> str:
    """A shell command on a sandbox rig as root, as pyinfra reaches it."""
    done = subprocess.run(
        ["ssh", "-i", rig["ssh_key"], "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
         f"root@{rig['address']}", command],
        input=data, capture_output=True, timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"on {rig['name']}: {command[:200]}\n{done.stderr.decode()[-4000:]}")
    return done.stdout.decode()


def pyinfra_lines(deploy: str, *args: str) -> tuple[float, list[tuple[float, str]]]:
    """The pyinfra CLI's wall time, and each line it printed on stderr with the second it came."""
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("pyinfra")), "-y", INVENTORY, deploy, *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYINFRA_PROGRESS": "off"},
    )
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()))
    reader.start()
    start, lines = time.perf_counter(), []
    for line in proc.stderr:
        lines.append((time.perf_counter() - start, line.strip()))
    reader.join()
    wall = time.perf_counter() - start
    if proc.wait(timeout=60) != 0:
        raise SystemExit(f"{deploy} failed:\n" + "\n".join(text for _, text in lines[-40:]))
    return wall, lines


def data_args(**data) -> list[str]:
    args = []
    for key, value in data.items():
        args += ["--data", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return args


def pull_timing(lines: list[tuple[float, str]], label: str) -> tuple[float, float]:
    """(seconds of the whole pull step, seconds of its download phase) from pyinfra's output:
    from the line that starts the pull of `label` to the line that ends it."""
    started = next(at for at, text in lines if f"pulling {label} " in text)
    ended, text = next((at, text) for at, text in lines if f"{label}: pulled " in text)
    return ended - started, float(re.search(r" in (\d+(?:\.\d+)?) s", text).group(1))


def curl_bundle() -> bytes:
    """A tar of this machine's curl and the shared libraries it loads beyond glibc."""
    curl = shutil.which("curl")
    if curl is None:
        raise SystemExit("no curl on this machine to compare the pull with")
    ldd = subprocess.run(["ldd", curl], capture_output=True, text=True, check=True).stdout
    libraries = [line.split("=>")[1].split("(")[0].strip() for line in ldd.splitlines()
                 if "=>" in line and not line.strip().startswith(GLIBC)]
    out = BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.add(os.path.realpath(curl), arcname="curl")
        for library in libraries:
            tar.add(os.path.realpath(library), arcname=f"lib/{Path(library).name}")
    return out.getvalue()


class Hub:
    """tests/hubstub.py inside the rig, serving one generated repo with the fleet token."""

    def __init__(self, rig: dict, size: int, token: str):
        self.rig, self.size, self.token = rig, size, token

    def start(self) -> None:
        ssh(self.rig, f"rm -rf {STUB_DIR} && mkdir -p {STUB_DIR} && "
                      f"(umask 077; cat > {STUB_DIR}/token)", self.token.encode())
        models = ROOT / "files" / "models"  # pull.py imports cache.py from beside it
        for source in (ROOT / "tests" / "hubstub.py", models / "mirror.py", models / "pull.py",
                       models / "cache.py"):
            ssh(self.rig, f"cat > {STUB_DIR}/{source.name}", source.read_bytes())
        launcher = (
            f"import sys; sys.path.insert(0, {STUB_DIR!r}); import hubstub; "
            f"token = open({STUB_DIR!r} + '/token').read().strip(); "
            f"hub = hubstub.Hub((hubstub.big_repo({REPO!r}, {self.size}),), token=token); "
            f"hubstub.serve(hub, '127.0.0.1', {PORT}).serve_forever()"
        )
        ssh(self.rig, f"systemd-run --unit={STUB_UNIT} --collect --quiet python3 -c "
                      f"{shlex.quote(launcher)}")
        probe = f"import socket; socket.create_connection(('127.0.0.1', {PORT}), 1)"
        ssh(self.rig, f"for i in $(seq 150); do python3 -c {shlex.quote(probe)} 2>/dev/null && "
                      "exit 0; sleep 0.2; done; echo 'the hub stub did not start' >&2; exit 1")
        ssh(self.rig, f"(umask 077; cat > {STUB_DIR}/header)",  # curl's: -H @file, not argv
            f"Authorization: Bearer {self.token}\n".encode())

    def stop(self) -> None:
        ssh(self.rig, f"systemctl stop {STUB_UNIT} 2>/dev/null; "
                      f"systemctl reset-failed {STUB_UNIT} 2>/dev/null; rm -rf {STUB_DIR}; true")


def measure_pull(rig: dict, repeat: int, mib: int) -> dict:
    """rigbook's pull and curl's copy of the same bytes from the same stub, `repeat` times each,
    alternating; medians."""
    repo = big_repo(REPO, mib * MIB)
    weights = repo.file("model.safetensors")
    total = sum(item.size for item in repo.files)
    label = f"{REPO}@{repo.commit[:12]}"
    token = os.urandom(24).hex()
    hub = Hub(rig, weights.size, token)
    ssh(rig, f"rm -rf {CURL_DIR} && mkdir -p {CURL_DIR} && tar x -C {CURL_DIR}", curl_bundle())
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "fleet-token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        args = data_args(
            models=[{"repo": REPO, "revision": repo.commit,  # the stub is the mirror: pinned
                     "manifest_sha256": hashlib.sha256(repo.manifest()).hexdigest()}],
            models_endpoint=f"http://127.0.0.1:{PORT}", models_mirror_token_file=str(token_file),
            models_cache=CACHE, models_disk_margin_gib=0.1, models_only=REPO,
            python_find_links=WHEELS_MOUNT, python_no_index=True,
        )
        url = f"http://127.0.0.1:{PORT}/{REPO}/resolve/{repo.commit}/{weights.path}"
        curl = (
            f"mkdir -p {CURL_TARGET} && LD_LIBRARY_PATH={CURL_DIR}/lib {CURL_DIR}/curl -sS "
            f"-H @{STUB_DIR}/header -o {CURL_TARGET}/{weights.path} "
            f"-w '%{{size_download}} %{{time_total}}' {url}; rm -rf {CURL_TARGET}"
        )
        hub.start()
        try:
            first, _ = pyinfra_lines("deploys/models.py", "--limit", rig["name"], *args)
            ssh(rig, f"rm -rf {CACHE}")
            rigbook, curls = [], []
            for _ in range(repeat):
                wall, lines = pyinfra_lines("deploys/models.py", "--limit", rig["name"], *args)
                step, download = pull_timing(lines, label)
                ssh(rig, f"rm -rf {CACHE}")
                rigbook.append({"wall": wall, "step": step, "download": download})
                size, seconds = ssh(rig, curl).split()
                if int(size) != weights.size:
                    raise SystemExit(f"curl copied {size} bytes, not {weights.size}")
                curls.append(float(seconds))
        finally:
            hub.stop()
            ssh(rig, f"rm -rf {CURL_DIR} {CURL_TARGET} {CACHE}")
    step = statistics.median(run["step"] for run in rigbook)
    download = statistics.median(run["download"] for run in rigbook)
    curl_seconds = statistics.median(curls)
    return {
        "bytes": total,
        "weights_bytes": weights.size,
        "files": len(repo.files),
        "first_pull_cli_seconds": round(first, 2),
        "rigbook_cli_seconds": round(statistics.median(run["wall"] for run in rigbook), 2),
        "rigbook_pull_seconds": round(step, 2),
        "rigbook_download_seconds": download,
        "curl_seconds": round(curl_seconds, 3),
        "runs": {"rigbook_pull": [round(run["step"], 2) for run in rigbook],
                 "curl": curls},
        "rigbook_pull_mib_s": rate(total, step),
        "rigbook_download_mib_s": rate(total, download),
        "curl_mib_s": rate(weights.size, curl_seconds),
        "pull_vs_curl": ratio(rate(total, step), rate(weights.size, curl_seconds)),
        "download_vs_curl": ratio(rate(total, download), rate(weights.size, curl_seconds)),
    }


def lock() -> list[str]:
    """The pins of LOCK_OF as uv resolves them from this machine's wheelhouse, no index."""
    done = subprocess.run(
        [str(Path(sys.executable).with_name("uv")), "pip", "compile", "--no-index",
         "--find-links", str(wheelhouse()), "--python-version", "3.11", "--python-platform",
         "x86_64-unknown-linux-gnu", "--no-header", "--no-annotate", "--quiet", "-"],
        input=LOCK_OF + "\n", capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"the wheelhouse {wheelhouse()} cannot satisfy {LOCK_OF} without an "
                         "index (tests/test_serving_e2e.py fills it):\n" + done.stderr[-2000:])
    pins = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    engine = next(pin for pin in pins if pin.startswith("llama-cpp-python=="))
    return [engine, *(pin for pin in pins if pin != engine)]  # the smoke test imports the first


def bare_install(rig: dict, pins: list[str], cold: bool) -> tuple[float, float]:
    """(seconds on the rig, seconds over SSH) of uv venv + uv pip install of `pins`; emptying
    the cache before and removing the venv after are not timed."""
    ssh(rig, f"rm -rf {BARE}{f' {UV_CACHE}' if cold else ''}")
    env = (f"UV_CACHE_DIR={UV_CACHE} UV_PYTHON_INSTALL_DIR=/opt/rigbook/python "
           "UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1")
    script = (
        f"export {env}; s=$(date +%s.%N); {UV} venv -q --python 3.11 {BARE} && "
        f"{UV} pip install -q --python {BARE}/bin/python --no-index --find-links {WHEELS_MOUNT} "
        f"{' '.join(map(shlex.quote, pins))} && echo $s $(date +%s.%N)"
    )
    start = time.perf_counter()
    began, ended = map(float, ssh(rig, script).split())
    over_ssh = time.perf_counter() - start
    ssh(rig, f"rm -rf {BARE}")
    return ended - began, over_ssh


def measure_venv(rig: dict, repeat: int) -> dict:
    """rigbook's rebuild of the lock against a bare uv install of it, warm and cold uv cache."""
    pins = lock()
    spec = [{"name": VENV, "engine": "llama-cpp-python", "python": "3.11", "packages": pins}]
    args = ["--limit", rig["name"], *data_args(venvs=spec, rebuild_all=True)]
    built = re.compile(rf"venv {VENV}: built, smoke-tested and swapped in after ([\d.]+) s")
    pyinfra_lines("deploys/venvs.py", *args)  # the tools venv, and a warm uv cache
    result = {"packages": len(pins), "lock_of": LOCK_OF}
    try:
        for cache in ("warm", "cold"):
            rigbook, bare = [], []
            for _ in range(repeat):
                if cache == "cold":
                    ssh(rig, f"rm -rf {UV_CACHE}")
                wall, lines = pyinfra_lines("deploys/venvs.py", *args)
                build = next(float(m[1]) for _, text in lines if (m := built.search(text)))
                rigbook.append((wall, build))
                bare.append(bare_install(rig, pins, cache == "cold"))
            cli, build = (statistics.median(run[i] for run in rigbook) for i in (0, 1))
            on_rig, over_ssh = (statistics.median(run[i] for run in bare) for i in (0, 1))
            result[cache] = {
                "rigbook_cli_seconds": round(cli, 2),
                "rigbook_build_seconds": build,
                "bare_uv_seconds": round(on_rig, 2),
                "bare_uv_ssh_seconds": round(over_ssh, 2),
                "cli_vs_bare": ratio(cli, over_ssh),
                "build_vs_bare": ratio(build, on_rig),
                "runs": {"rigbook_cli": [round(run[0], 2) for run in rigbook],
                         "bare_uv_ssh": [round(run[1], 2) for run in bare]},
            }
    finally:
        ssh(rig, f"rm -rf {VENVS_DIR}/{VENV} {VENVS_DIR}/{VENV}-* {VENVS_DIR}/{VENV}.env "
                 f"{VENVS_DIR}/.{VENV}.build.log {BARE}")
    return result


def measure(rig: dict, repeat: int = 3, pull_mib: int = 320) -> dict:
    """Both comparisons on `rig` (a sandbox rig that is up)."""
    return {"pull": measure_pull(rig, repeat, pull_mib), "venv": measure_venv(rig, repeat)}


def markdown(result: dict) -> str:
    """Both comparisons as markdown sections."""
    pull, venv = result["pull"], result["venv"]
    lines = [
        "## Model pull against curl (one rig, loopback hub stub)",
        "",
        f"{pull['files']} files, {pull['bytes'] / MIB:.1f} MiB (curl copies the "
        f"{pull['weights_bytes'] / MIB:.1f} MiB weights file); medians of "
        f"{len(pull['runs']['curl'])} runs.",
        "",
        "| what | seconds | MiB/s | vs curl |",
        "| --- | --- | --- | --- |",
        f"| curl -o file | {pull['curl_seconds']} | {pull['curl_mib_s']} | 1.0 |",
        f"| rigbook pull step (list, download, sha256, manifest) | {pull['rigbook_pull_seconds']}"
        f" | {pull['rigbook_pull_mib_s']} | {pull['pull_vs_curl']} |",
        f"| rigbook download phase | {pull['rigbook_download_seconds']} "
        f"| {pull['rigbook_download_mib_s']} | {pull['download_vs_curl']} |",
        f"| rigbook CLI, whole deploys/models.py | {pull['rigbook_cli_seconds']} | "
        f"{round(pull['bytes'] / MIB / pull['rigbook_cli_seconds'], 1)} | |",
        "",
        f"## Venv rebuild against a bare uv install (one rig, {venv['packages']} pinned "
        f"packages of {venv['lock_of']}, local wheelhouse)",
        "",
        "| uv cache | rigbook CLI (deploys/venvs.py) | rigbook build on the rig | bare uv over SSH "
        "| bare uv on the rig | CLI / bare | build / bare |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cache in ("warm", "cold"):
        row = venv[cache]
        lines.append(
            f"| {cache} | {row['rigbook_cli_seconds']} s | {row['rigbook_build_seconds']} s "
            f"| {row['bare_uv_ssh_seconds']} s | {row['bare_uv_seconds']} s "
            f"| {row['cli_vs_bare']} | {row['build_vs_bare']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.transfer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per median (default 3)")
    parser.add_argument("--pull-mib", type=int, default=320, help="weights MiB (default 320)")
    args = parser.parse_args()
    with sandbox_rigs(1) as rigs:
        result = measure(rigs[0], args.repeat, args.pull_mib)
    print(json.dumps(result, indent=2))
    print(markdown(result))


if __name__ == "__main__":
    main()
