"""Fleet convergence speed and cost on sandbox rigs.

    python -m bench [--sizes 1,2,4,8] [--repeat 3]

For each fleet size N: fresh sandbox rigs, then the first converge of deploys/rig.py, a no-change
converge, a fleet cap change with deploys/power_cap.py and `rigbook status`, each timed with the
real CLI (median of --repeat runs after the first converge). Remote commands, uploads and SSH
connections per host come from pyinfra's own connector (bench/counting_pyinfra.py). Results go
to bench/results/results.json and bench/results/results.md. Times are figures to read, not
thresholds: nothing here asserts a time.

At size 1, on the rig just measured, the run also breaks the no-change converge down by role
(bench/breakdown.py) and times a model pull against curl and a venv rebuild against a bare uv
install (bench/transfer.py).

With --replay, fleets of replayed rigs instead (bench/replay/, default sizes 16,100,300,1000):
bench/results/replay.json and replay.md, and the plot docs/img/replay-scale.png.

With --peers (the default), each size also measures what users would otherwise run
(bench/peers/): rigbook's roles for the subset the peers manage, an Ansible playbook and stock
pyinfra, each on its own fresh rigs: a first converge, then the median of --repeat no-change
converges (Ansible: --ansible-repeat, default 1), each of which must report 0 changes.
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

from bench import breakdown, transfer
from bench.peers import ansible as ansible_peer
from bench.peers import table as peers_table
from bench.peers.render import render as render_peers
from bench.replay import scale

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
INVENTORY = "inventory/sandbox.py"
LOCK = Path("/run/lock/rigbook-sandbox.lock")


def _timed(argv: list[str], env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    return time.perf_counter() - start, proc


def _pyinfra(deploy: str, *args: str, inventory: str = INVENTORY,
             extra_env: dict | None = None) -> dict:
    """One counted pyinfra run: wall time, changes, errors and per-host remote work."""
    with tempfile.NamedTemporaryFile(suffix=".json") as counts:
        env = {**os.environ, "RIGBOOK_BENCH_COUNTS": counts.name, "PYINFRA_PROGRESS": "off",
               **(extra_env or {})}
        argv = [sys.executable, "bench/counting_pyinfra.py", "-y", "--json", inventory, deploy]
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


def _sandbox_up(size: int) -> None:
    up = subprocess.run([sys.executable, "-m", "rigbook.cli", "sandbox", "up", str(size)],
                        cwd=ROOT, capture_output=True, text=True)
    if up.returncode != 0:
        raise SystemExit(up.stderr)


def _converge(tool: str, run, repeat: int) -> dict:
    """A first converge, then the median of `repeat` no-change converges; SystemExit when one
    of those reports a change (the tool is not idempotent there, so its time means nothing)."""
    first = run()
    again = [run() for _ in range(repeat)]
    changed = [r["changes"] for r in again if r["changes"]]
    if changed:
        raise SystemExit(f"{tool}: a no-change converge reported {changed[0]} changes")
    return {"first_converge": first, "no_change_converge": _median(again)}


def measure_peers(size: int, repeat: int, full: dict, ansible_repeat: int) -> dict:
    """rigbook's same subset and each peer (bench/peers/), each on freshly booted rigs; `full`
    is measure()'s row for this size (rigbook's full deploy). Ansible gets its own repeat: one
    run takes over a minute at 16 rigs."""
    row = {"rigs": size, "rigbook_full": {key: full[key] for key in
                                          ("first_converge", "no_change_converge")}}
    _sandbox_up(size)
    row["rigbook_subset"] = _converge(
        "rigbook subset", lambda: _pyinfra("bench/peers/rigbook_subset.py"), repeat)
    with tempfile.TemporaryDirectory(prefix="rigbook-peers-") as tmp:
        out = Path(tmp)
        _sandbox_up(size)
        render_peers(out)  # the peers' files, rendered by rigbook, outside the timed runs
        # --chdir: pyinfra then loads no config.py, so nothing of rigbook runs with the peer.
        row["pyinfra_stock"] = _converge("stock pyinfra", lambda: _pyinfra(
            "pyinfra_stock.py", "--chdir", "bench/peers", inventory="inventory.py",
            extra_env={"RIGBOOK_BENCH_PEERS": str(out / "peers.json")}), repeat)
        _sandbox_up(size)
        ansible_peer.write(out, render_peers(out))
        row["ansible"] = _converge("Ansible", lambda: ansible_peer.run(out), ansible_repeat)
    return row


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
    if report.get("peers"):
        lines += ["", peers_table.markdown(report["peers"])]
    if report.get("breakdown"):
        lines += ["", breakdown.markdown(report["breakdown"]),
                  transfer.markdown(report["transfer"])]
    return "\n".join(lines) + "\n"


def _machine() -> dict:
    return {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
            "python": platform.python_version(), "pyinfra": version("pyinfra")}


def replay_main(args) -> None:
    """`--replay`: record where asked (or a recording is missing), replay every size, write
    bench/results/replay.json, replay.md and docs/img/replay-scale.png."""
    missing = [tool for tool in scale.TOOLS if not (scale.RECORDINGS / f"{tool}.json").exists()]
    if args.record or missing:
        scale.record(list(scale.TOOLS) if args.record else missing)
    sizes = [int(size) for size in (args.sizes or "16,100,300,1000").split(",")]
    report = {**_machine(), "replay_command": "python -m bench " + " ".join(sys.argv[1:])}

    def write(rows: list[dict]) -> None:  # after every size: a long run keeps what it measured
        report["replay"] = rows
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "replay.json").write_text(json.dumps(report, indent=2) + "\n")
        (RESULTS / "replay.md").write_text(scale.markdown(report))
        scale.plot(rows, ROOT / "docs" / "img" / "replay-scale.png")

    scale.measure(sizes, write)
    print(scale.markdown(report))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help="fleet sizes (default 1,2,4,8; --replay: "
                        "16,100,300,1000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per median (default 3)")
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the peers (bench/peers/; default: on)")
    parser.add_argument("--ansible-repeat", type=int, default=1,
                        help="no-change runs per median for the Ansible peer (default 1)")
    parser.add_argument("--replay", action="store_true",
                        help="replayed rigs instead of sandbox rigs (bench/replay/)")
    parser.add_argument("--record", action="store_true",
                        help="with --replay: record every tool again on a sandbox rig first")
    args = parser.parse_args()
    if args.replay:
        return replay_main(args)
    if args.peers:
        ansible_peer.require()
    sizes = [int(size) for size in (args.sizes or "1,2,4,8").split(",")]
    report = {**_machine(), "command": "python -m bench " + " ".join(sys.argv[1:]),
              "sizes": [], "peers": []}
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the same lock as the tests: one user of the rigs
        try:
            for size in sizes:
                report["sizes"].append(measure(size, args.repeat))
                print(json.dumps(report["sizes"][-1]), flush=True)
                if size == 1:  # on the rig measure() converged, once a run
                    report["breakdown"] = breakdown.measure(args.repeat)
                    report["transfer"] = transfer.measure(breakdown.rigs()[0], args.repeat)
                    print(json.dumps(report["transfer"]), flush=True)
                if args.peers:
                    report["peers"].append(measure_peers(size, args.repeat, report["sizes"][-1],
                                                         args.ansible_repeat))
                    print(json.dumps(report["peers"][-1]), flush=True)
        finally:
            subprocess.run([sys.executable, "-m", "rigbook.cli", "sandbox", "down"], cwd=ROOT)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "results.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
