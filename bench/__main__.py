"""Fleet convergence speed and cost on sandbox rigs.

    python -m bench [--sizes 1,2,4,8] [--repeat 3]

For each fleet size N: fresh sandbox rigs, then the first converge of deploys/rig.py, a no-change
converge, a fleet cap change with deploys/power_cap.py and `rigbook status`, each timed with the
real CLI (median of --repeat runs after the first converge). Remote commands, uploads and SSH
connections per host come from pyinfra's own connector (bench/counting_pyinfra.py). Results go
to bench/results/results.json and bench/results/results.md. Times are figures to read, not
thresholds: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
INVENTORY = "inventory/sandbox.py"
LOCK = Path("/run/lock/rigbook-sandbox.lock")


def _timed(argv: list[str], env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    return time.perf_counter() - start, proc


def _pyinfra(deploy: str, *args: str) -> dict:
    """One counted pyinfra run: wall time, changes, errors and per-host remote work."""
    with tempfile.NamedTemporaryFile(suffix=".json") as counts:
        env = {**os.environ, "RIGBOOK_BENCH_COUNTS": counts.name, "PYINFRA_PROGRESS": "off"}
        argv = [sys.executable, "bench/counting_pyinfra.py", "-y", "--json", INVENTORY, deploy]
        seconds, proc = _timed([*argv, *args], env)
        per_host = json.loads(Path(counts.name).read_text() or "{}")
    if proc.returncode != 0:
        raise SystemExit(f"{deploy} failed:\n{proc.stderr[-4000:]}")
    results = json.loads(proc.stdout)["results"]
    changes = sum(len(op["success"]) for op in results["operations"])
    hosts = max(len(per_host), 1)
    total = {kind: sum(c.get(kind, 0) for c in per_host.values()) for kind in
             ("commands", "uploads", "connections")}
    return {
        "seconds": round(seconds, 2),
        "changes": changes,
        "commands_per_host": round(total["commands"] / hosts, 1),
        "uploads_per_host": round(total["uploads"] / hosts, 1),
        "connections_per_host": round(total["connections"] / hosts, 1),
    }


def _median(runs: list[dict]) -> dict:
    middle = sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]
    return {**middle, "seconds": round(statistics.median(r["seconds"] for r in runs), 2),
            "runs": [r["seconds"] for r in runs]}


def _status_seconds() -> float:
    seconds, proc = _timed([sys.executable, "-m", "rigbook.cli", "status", INVENTORY, "--json"])
    if proc.returncode not in (0, 1):
        raise SystemExit(f"rigbook status failed:\n{proc.stderr[-4000:]}")
    return round(seconds, 2)


def measure(size: int, repeat: int) -> dict:
    """Every figure for one fleet size, on freshly booted sandbox rigs."""
    up_seconds, up = _timed([sys.executable, "-m", "rigbook.cli", "sandbox", "up", str(size)])
    if up.returncode != 0:
        raise SystemExit(up.stderr)
    first = _pyinfra("deploys/rig.py")
    no_change = _median([_pyinfra("deploys/rig.py") for _ in range(repeat)])
    caps = [_pyinfra("deploys/power_cap.py", "--data", f"power_cap_watts={280 + 10 * (i % 2)}")
            for i in range(repeat)]
    status = [_status_seconds() for _ in range(repeat)]
    return {
        "rigs": size,
        "sandbox_up_seconds": round(up_seconds, 2),
        "first_converge": first,
        "no_change_converge": no_change,
        "fleet_cap_change": _median(caps),
        "status_seconds": statistics.median(status),
    }


def markdown(report: dict) -> str:
    lines = [
        f"# Benchmark results ({report['date']})",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['cores']} cores, Python {report['python']}, pyinfra {report['pyinfra']};"
        " every rig is a sandbox rig on this same machine, so rigs share its cores.",
        "",
        "| rigs | first converge | no-change converge | changes (2nd) | commands/host "
        "| uploads/host | SSH connects/host | cap change | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["sizes"]:
        nc = row["no_change_converge"]
        lines.append(
            f"| {row['rigs']} | {row['first_converge']['seconds']} s | {nc['seconds']} s "
            f"| {nc['changes']} | {nc['commands_per_host']} | {nc['uploads_per_host']} "
            f"| {nc['connections_per_host']} | {row['fleet_cap_change']['seconds']} s "
            f"| {row['status_seconds']} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8", help="fleet sizes (default 1,2,4,8)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per median (default 3)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m bench " + " ".join(sys.argv[1:]),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "pyinfra": version("pyinfra"),
        "sizes": [],
    }
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the same lock as the tests: one user of the rigs
        try:
            for size in sizes:
                report["sizes"].append(measure(size, args.repeat))
                print(json.dumps(report["sizes"][-1]), flush=True)
        finally:
            subprocess.run([sys.executable, "-m", "rigbook.cli", "sandbox", "down"], cwd=ROOT)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "results.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
