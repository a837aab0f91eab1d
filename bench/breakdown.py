"""Where a no-change converge of deploys/rig.py spends its time, role by role, on one rig.

    python -m bench.breakdown [--repeat 3]

Boots one sandbox rig, converges it once, then runs the no-change converge --repeat times under
bench/counting_pyinfra.py with RIGBOOK_BENCH_EVENTS and keeps the run of median wall time. Every
remote command and operation is given to the role that planned it (the outermost `rigbook.*`
module on the call stack); a role's seconds are its planning (its @deploy call while pyinfra
reads the deploy file, fact reads included) plus the execution of its operations. `preflight`
is what the deploy script does outside the roles' @deploy calls (the rig's validation, every
role's checks, the deferred GPU checks); `pyinfra` is the rest of the wall time: start-up,
inventory, SSH connection, output.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rigbook.registry import CONVERGED, role_of_module

ROOT = Path(__file__).resolve().parent.parent
INVENTORY = "inventory/sandbox.py"
LOCK = Path("/run/lock/rigbook-sandbox.lock")
DEPLOY = "deploys/rig.py"
#: The roles deploys/rig.py runs, in its order (rigbook/registry.py); every other rigbook module
#: the deploy script calls directly (rigbook.jobs, rigbook.preflight) is the preflight.
ROLES = tuple(role.name for role in CONVERGED)
PREFLIGHT = "preflight"
#: Work no rigbook module asked for, and the wall time outside planning and execution.
PYINFRA = "pyinfra"


@contextmanager
def sandbox_rigs(size: int) -> Iterator[list[dict]]:
    """`size` fresh sandbox rigs under the machine-wide lock the tests take (one user of the
    rigs at a time; waiting for it is normal), down again afterwards."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            rigbook("sandbox", "up", str(size))
            yield rigs()
        finally:
            rigbook("sandbox", "down", check=False)


def rigs() -> list[dict]:
    """The sandbox rigs that are up: name, address, SSH key, profile."""
    return json.loads(rigbook("sandbox", "list", "--json").stdout)


def rigbook(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "rigbook.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if check and done.returncode != 0:
        raise SystemExit(f"rigbook {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return done


def role_of(module: str | None) -> str:
    """The role a piece of work belongs to, from the outermost rigbook module that asked for it."""
    if module is None:
        return PYINFRA
    return role_of_module(module) or PREFLIGHT


def per_role(events: list[dict], wall: float) -> list[dict]:
    """One host's timeline (bench/counting_pyinfra.py) -> a row per role, in deploy order:
    operations, remote commands (at planning, at execution), seconds (planning, execution) and
    the seconds of those spent waiting on the rig's commands."""
    rows = {role: {"role": role, "operations": 0, "commands_plan": 0, "commands_exec": 0,
                   "seconds_plan": 0.0, "seconds_exec": 0.0, "seconds_waiting": 0.0}
            for role in (PREFLIGHT, *ROLES, PYINFRA)}
    planned = 0.0
    for event in events:
        row = rows[role_of(event.get("module"))]
        if event["kind"] == "op_added":
            row["operations"] += 1
        elif event["kind"] == "command":
            row[f"commands_{event['phase']}"] += 1
            row["seconds_waiting"] += event["seconds"]
        elif event["kind"] == "deploy":
            row["seconds_plan"] += event["seconds"]
        elif event["kind"] == "op":
            row["seconds_exec"] += event["seconds"]
        elif event["kind"] == "plan":
            planned += event["seconds"]
    in_roles = sum(row["seconds_plan"] for role, row in rows.items() if role in ROLES)
    rows[PREFLIGHT]["seconds_plan"] += planned - in_roles
    rows[PYINFRA]["seconds_plan"] += wall - planned - sum(r["seconds_exec"] for r in rows.values())
    out = []
    for row in rows.values():
        row["commands"] = row["commands_plan"] + row["commands_exec"]
        row["seconds"] = row["seconds_plan"] + row["seconds_exec"]
        out.append({key: round(value, 3) if isinstance(value, float) else value
                    for key, value in row.items()})
    return out


def slowest(events: list[dict], count: int = 8) -> list[dict]:
    """The `count` operations that took longest to execute, with their remote commands."""
    commands: dict[str, int] = {}
    for event in events:
        if event["kind"] == "command" and event["phase"] == "exec":
            commands[event["op"]] = commands.get(event["op"], 0) + 1
    ops = sorted((e for e in events if e["kind"] == "op"), key=lambda e: -e["seconds"])[:count]
    return [{"operation": ", ".join(op["names"]), "role": role_of(op["module"]),
             "seconds": round(op["seconds"], 3), "commands": commands.get(op["op"], 0)}
            for op in ops]


def counted_run(deploy: str, *args: str) -> dict:
    """One pyinfra run under the counting wrapper: its wall time and each host's timeline."""
    with tempfile.NamedTemporaryFile(suffix=".json") as events:
        env = {**os.environ, "RIGBOOK_BENCH_EVENTS": events.name, "PYINFRA_PROGRESS": "off"}
        argv = [sys.executable, "bench/counting_pyinfra.py", "-y", "--json", INVENTORY, deploy,
                *args]
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env,
                              timeout=1800)
        wall = time.perf_counter() - start
        timeline = json.loads(Path(events.name).read_text() or "{}")
    if proc.returncode != 0:
        raise SystemExit(f"{deploy} failed:\n{proc.stderr[-4000:]}")
    changes = sum(len(op["success"]) for op in json.loads(proc.stdout)["results"]["operations"])
    return {"seconds": wall, "changes": changes, "events": timeline}


def measure(repeat: int = 3) -> dict:
    """The breakdown on the one sandbox rig that is up: a converge, then `repeat` no-change
    converges, the median one broken down by role."""
    counted_run(DEPLOY)
    runs = sorted((counted_run(DEPLOY) for _ in range(repeat)), key=lambda run: run["seconds"])
    median = runs[len(runs) // 2]
    (host, events), = median["events"].items()
    return {
        "deploy": DEPLOY,
        "rig": host,
        "seconds": round(median["seconds"], 2),
        "runs": [round(run["seconds"], 2) for run in runs],
        "median_of": len(runs),
        "changes": median["changes"],
        "roles": per_role(events, median["seconds"]),
        "slowest_operations": slowest(events),
    }


def markdown(result: dict) -> str:
    """The breakdown as a markdown section."""
    lines = [
        f"## No-change converge of {result['deploy']} by role (one rig)",
        "",
        f"Median of {result['median_of']} runs: {result['seconds']} s "
        f"({', '.join(f'{s} s' for s in result['runs'])}), {result['changes']} changes. Seconds "
        "are planning (the role's @deploy call, facts read then included) plus execution of its "
        "operations; `waiting` is the part spent in remote commands.",
        "",
        "| role | operations | remote commands (plan + exec) | seconds (plan + exec) "
        "| waiting on the rig |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in result["roles"]:
        lines.append(
            f"| {row['role']} | {row['operations']} | {row['commands']} "
            f"({row['commands_plan']} + {row['commands_exec']}) | {row['seconds']:.2f} "
            f"({row['seconds_plan']:.2f} + {row['seconds_exec']:.2f}) "
            f"| {row['seconds_waiting']:.2f} |"
        )
    total = {key: sum(row[key] for row in result["roles"]) for key in
             ("operations", "commands", "seconds_waiting")}
    lines.append(f"| total | {total['operations']} | {total['commands']} | {result['seconds']:.2f} "
                 f"| {total['seconds_waiting']:.2f} |")
    lines += ["", "Slowest operations at execution:", "",
              "| operation | role | seconds | remote commands |", "| --- | --- | --- | --- |"]
    lines += [f"| {op['operation'].replace('|', '&#124;')} | {op['role']} | {op['seconds']:.2f} "
              f"| {op['commands']} |" for op in result["slowest_operations"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.breakdown",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="no-change runs (default 3)")
    args = parser.parse_args()
    with sandbox_rigs(1):
        result = measure(args.repeat)
    print(json.dumps(result, indent=2))
    print(markdown(result))


if __name__ == "__main__":
    main()
