"""The proof on a real GPU host: converge, serve and verify the tiny model on the GPU, @local.

Run as root on a bare GPU host with no network (docs/runbooks/gpu-host-proof.md says how the
wheels get there), from a checkout of rigbook:

    python3 -m tests.gpu_host --wheels .whl --out OUT_DIR

Every step's command and output go to OUT_DIR (one file a step, and commands.txt); a failed step
is written down and the kit goes on with what does not depend on it. It never sets a GPU
setting: the inventory asks for the cap that runs (the host owns the caps), the kit stops before
the real converge when the dry plan would run `nvidia-smi -pl`, a driver, a unit or systemctl,
and it reads the live cap before and after.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "tests" / "fixtures" / "nvidia-h200" / "serve"
RECIPE = "tiny-h200"
VENV = "llamacpp-cuda"
CACHE = "/var/lib/rigbook/hf/hub"
CONTROLLER = Path("/tmp/rigbook-controller")
#: What the dry plan must not change on a host whose driver and caps it does not own.
FORBIDDEN = re.compile(r"Install the driver|Pin the driver|Blacklist nouveau|systemctl|"
                       r"daemon-reload|persistenced|-pl \d")
_ROW = re.compile(r"\s{4}(.+?)\s{2,}(\d+ \(\S+\)|-)\s{2,}(\d+ \(\S+\)|-)\s*")


def forbidden_changes(plan: str) -> list[str]:
    """The operations of pyinfra's "Detected changes" table that would change something and
    name what the host owns (a driver, a unit's systemctl, a cap)."""
    rows = [m for line in plan.splitlines() if (m := _ROW.fullmatch(line))]
    return [m[1] for m in rows if (m[2] != "-" or m[3] != "-") and FORBIDDEN.search(m[1])]


#: verify's ladder sized for a random-weights model of context 512 (tests/test_verify_e2e.py).
VERIFY = {
    "verify_prefill_tokens": 300, "verify_needle_exact": False, "verify_bench_warmups": 1,
    "verify_bench_runs": 3, "verify_bench_tokens": 64, "verify_bench_concurrency": 2,
    "verify_timeout_s": 60,
    "verify_soak_seconds": 120,  # --verify-level soak inside one device call with the converge
}


class Kit:
    def __init__(self, out: Path):
        self.out, self.failed = out, []
        out.mkdir(parents=True, exist_ok=True)

    def run(self, step: str, argv: list[str], timeout: int = 600, **kwargs
            ) -> subprocess.CompletedProcess:
        """Run one step, write its command and output to OUT/<step>.txt."""
        started = time.monotonic()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  cwd=kwargs.pop("cwd", ROOT), **kwargs)
        except subprocess.TimeoutExpired as error:
            done = subprocess.CompletedProcess(argv, 124, error.stdout or "", error.stderr or "")
        took = time.monotonic() - started
        command = shlex.join(argv)
        text = (f"$ {command}\n# exit {done.returncode} after {took:.1f} s\n"
                f"{_text(done.stdout)}{_text(done.stderr)}")
        (self.out / f"{step}.txt").write_text(text)
        with (self.out / "commands.txt").open("a") as f:
            f.write(f"{step}: exit {done.returncode} in {took:.1f} s: {command}\n")
        if done.returncode != 0:
            self.failed.append(step)
        print(f"== {step}: exit {done.returncode} in {took:.1f} s", flush=True)
        return done

    def note(self, step: str, text: str) -> None:
        (self.out / f"{step}.txt").write_text(text)
        with (self.out / "commands.txt").open("a") as f:
            f.write(f"{step}: {text.splitlines()[0] if text else ''}\n")
        print(f"== {step}: {text.splitlines()[0] if text else ''}", flush=True)


def _text(value) -> str:
    value = value.decode(errors="replace") if isinstance(value, bytes) else (value or "")
    return value if value.endswith("\n") or not value else value + "\n"


def live_cap(text: str) -> float | None:
    match = re.search(r"Current Power Limit\s*:\s*([\d.]+) W", text)
    return float(match.group(1)) if match else None


def place_model(gguf: Path, revision: str) -> None:
    """The tiny model in this host's HF cache as a completed rigbook pull leaves it (the same
    layout as tests/standins.place_model writes on a sandbox rig)."""
    from tests.tinymodel import FILE, cache_layout, pull_manifest

    layout = cache_layout(gguf, revision)
    data = gguf.read_bytes()
    cache = Path(CACHE)
    top = cache / layout["blob"].split("/")[0]
    (cache / layout["blob"]).parent.mkdir(parents=True, exist_ok=True)
    (cache / layout["blob"]).write_bytes(data)
    link = cache / layout["link"]
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(layout["target"])
    (cache / layout["ref"]).parent.mkdir(parents=True, exist_ok=True)
    (cache / layout["ref"]).write_text(revision + "\n")
    (top / "rigbook").mkdir(parents=True, exist_ok=True)
    # the recipe's GGUF file is its one allow pattern (recipes.gguf_patterns of a single file)
    (top / "rigbook" / f"{revision}.json").write_bytes(pull_manifest(gguf, revision, [FILE]))


def host_data(wheels: Path, revision: str, cap: float, driver: str) -> dict:
    """The inventory of this host: the driver and the cap are the host's (adopted, asked as
    they run), packages only from the carried wheels."""
    from tests.tinymodel import REPO

    return {
        "platform": "ubuntu", "gpu_class": "other", "gpu_count": 1,
        "gpu_limits_watts": [200, 700], "driver_version": driver, "driver_foreign": "adopt",
        "power_cap_watts": int(cap),
        "python_find_links": str(wheels), "python_no_index": True,
        "venvs": [{"name": VENV, "engine": "llama-cpp-python",
                   "packages": ["llama-cpp-python[server]==0.3.36"]}],
        "models": [{"repo": REPO, "revision": revision}],
        "recipe": RECIPE, "serving_recipe_dirs": [str(HERE / "recipes")],
        "serving_health_timeout_s": 300, "verify_url": "http://127.0.0.1:8110", **VERIFY,
    }


def tokens_per_second(port: int) -> str:
    """One completion of 128 tokens, timed here: the engine's decode speed on the GPU."""
    body = json.dumps({"prompt": "The", "max_tokens": 128, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    took = time.monotonic() - started
    tokens = answer.get("usage", {}).get("completion_tokens", 0)
    return f"{tokens} tokens in {took:.3f} s: {tokens / took:.1f} tok/s (one request, 128 max)\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-only", action="store_true", help="stop after the dry plan")
    parser.add_argument("--verify-level", action="append", choices=("stress", "soak"),
                        default=[], help="also run deploys/verify.py at this level after the "
                        "quick one (repeatable; docs/verify.md)")
    args = parser.parse_args(argv)
    wheels, kit = args.wheels.resolve(), Kit(args.out)

    kit.run("image", ["bash", "-c", "python3 --version; command -v nvcc && nvcc --version | "
                      "tail -1; uname -r; ps -p 1 -o comm=; command -v systemctl || "
                      "echo 'no systemctl'; nvidia-smi --query-gpu=name,compute_cap,"
                      "driver_version,memory.total --format=csv; df -h /"])
    before = kit.run("power-before", ["nvidia-smi", "-q", "-d", "POWER"]).stdout
    cap = live_cap(before)
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    if cap is None or not driver:
        kit.note("abort", "no live cap or driver read: nothing done")
        return 1

    py = str(CONTROLLER / "bin" / "python")
    kit.run("controller-venv", ["/usr/bin/python3", "-m", "venv", str(CONTROLLER)])
    # the controller also sees the image's own packages (rich, requests, ...: fewer wheels to
    # carry); the rig's venvs do not, they install from the wheels alone
    image = subprocess.run([sys.executable, "-c", "import sysconfig; "
                            "print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True).stdout.strip()
    (CONTROLLER / "lib" / "python3.12" / "site-packages" / "image.pth").write_text(image + "\n")
    kit.run("controller-install", [py, "-m", "pip", "install", "-q", "--no-index",
                                   "--find-links", str(wheels), "rigbook", "gguf"])
    bin_dir = CONTROLLER / "bin"
    # the image's cmake and ninja (for the llama.cpp build) come after the system's
    env = {"PATH": f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:"
                   "/opt/torch/.venv/bin",
           "HOME": "/root", "PYTHONUNBUFFERED": "1", "RIGBOOK_PROGRESS_EVERY": "15",
           "RIGBOOK_VERIFY_DIR": str(kit.out / "verify-results")}

    gguf = kit.out.parent / "tiny.gguf"
    made = kit.run("tiny-model", [py, "-c", "import sys; from pathlib import Path; "
                                  "from tests.tinymodel import write_tiny_gguf, revision_of; "
                                  f"p = write_tiny_gguf(Path({str(gguf)!r})); "
                                  "print(p.stat().st_size, revision_of(p))"], env=env)
    revision = made.stdout.split()[-1] if made.returncode == 0 else "0" * 40
    place_model(gguf, revision)

    inventory = kit.out.parent / "inventory.py"
    data = host_data(wheels, revision, cap, driver)
    inventory.write_text(f"hosts = [('@local', {data!r})]\n")
    kit.note("inventory", inventory.read_text())
    pyinfra = str(bin_dir / "pyinfra")

    # no -y: pyinfra's change detection lists every operation it would run
    dry = kit.run("rig-dry", [pyinfra, str(inventory), "deploys/rig.py", "--dry"], env=env,
                  stdin=subprocess.DEVNULL)
    plan = dry.stdout + dry.stderr  # pyinfra 3.10 writes its tables to stderr
    bad = forbidden_changes(plan)
    if "--> Detected changes:" not in plan:
        bad = ["no change detection in the dry output"]
    kit.note("rig-dry-check", f"forbidden in the dry plan: {bad or 'nothing'}\n")
    if bad:
        kit.note("abort", f"the dry plan holds {bad}: no real converge on this host")
        kit.run("power-after", ["nvidia-smi", "-q", "-d", "POWER"])
        return 1
    if args.dry_only:
        kit.run("power-after", ["nvidia-smi", "-q", "-d", "POWER"])
        return 0

    kit.run("rig-converge", [pyinfra, "-y", str(inventory), "deploys/rig.py"], env=env,
            timeout=400)
    port = 8110
    kit.run("verify", [pyinfra, "-y", str(inventory), "deploys/verify.py"], env=env,
            timeout=150)
    for level in args.verify_level:  # the soak's own bound is verify_soak_seconds (600)
        kit.run(f"verify-{level}", [pyinfra, "-y", str(inventory), "deploys/verify.py",
                                    "--data", f"verify_level={level}"], env=env, timeout=900)
    kit.run("nvidia-smi-serving", ["bash", "-c", "nvidia-smi; nvidia-smi --query-compute-apps="
                                   "pid,process_name,used_memory --format=csv; ps -o pid,user,"
                                   "args -C python3 -C python || true"])
    try:
        kit.note("tok-s", tokens_per_second(port))
    except Exception as error:  # a failed measurement is written down, not fatal
        kit.note("tok-s", f"no measurement: {error}\n")
    kit.run("status", [str(bin_dir / "rigbook"), "status", str(inventory)], env=env)
    kit.run("rig-converge-2", [pyinfra, "-y", str(inventory), "deploys/rig.py"], env=env,
            timeout=150)
    kit.run("stop", ["bash", "-c", "set -x; python3 -I -S /opt/rigbook/serving/supervise.py stop "
                     "/etc/rigbook/serving/supervise.json; sleep 1; nvidia-smi --query-compute-"
                     "apps=pid,process_name,used_memory --format=csv; tail -n 20 "
                     "/var/log/rigbook/serve.log 2>/dev/null || true"])
    kit.run("venv-manifest", ["bash", "-c", f"cat /opt/rigbook/venvs/{VENV}/rigbook-manifest.json"
                              f"; tail -n 60 /opt/rigbook/venvs/.{VENV}.build.log"])
    after = kit.run("power-after", ["nvidia-smi", "-q", "-d", "POWER"]).stdout
    kit.note("caps", f"live cap before {cap} W, after {live_cap(after)} W\n")
    kit.note("result", f"failed steps: {kit.failed or 'none'}\n")
    return 1 if kit.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
