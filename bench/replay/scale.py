"""The scale bench: fleets of replayed rigs, from 16 to 1000, on the operator's machine alone.

    python -m bench --replay [--sizes 16,100,300,1000] [--record]

Recording (`--record`, or when a recording is missing; it takes the sandbox lock and boots one
fresh sandbox rig per tool): the real CLI over SSH through bench/replay/record.py, for each
tool: rigbook's full deploy (first converge, no-change converge, a fleet cap change,
`rigbook status`), rigbook's same subset and stock pyinfra's (first and no-change converge),
into bench/replay/recordings/TOOL.json. Replay: for each size N, every recorded run once with N
`@replay` rigs (bench/replay/connector.py): wall time, the operator's CPU seconds (user +
system of the pyinfra or rigbook process) and its peak RSS, and a check that every rig made
exactly the recorded changes (0 on a no-change converge) and none failed. A replayed run has
no rigs and no network to vary, so each figure is one run.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.replay.recording import FORMAT, Identity, identity, load, scrub

ROOT = Path(__file__).resolve().parents[2]
RECORDINGS = ROOT / "bench" / "replay" / "recordings"
DIST = ROOT / "bench" / "replay" / "dist"
LOCK = Path("/run/lock/rigbook-sandbox.lock")
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
PEERS = ROOT / "bench" / "peers"
CAP = ("deploys/power_cap.py", "--data", "power_cap_watts=280")

#: tool -> run -> (deploy file and its arguments, or "status").
TOOLS: dict[str, dict[str, tuple[str, ...]]] = {
    "rigbook-full": {"first": ("deploys/rig.py",), "no_change": ("deploys/rig.py",),
                     "cap_change": CAP, "status": ("status",)},
    "rigbook-subset": {"first": ("bench/peers/rigbook_subset.py",),
                       "no_change": ("bench/peers/rigbook_subset.py",)},
    "pyinfra-stock": {"first": ("pyinfra_stock.py",), "no_change": ("pyinfra_stock.py",)},
}


def changes_by_host(stdout: str) -> dict[str, list[str]]:
    """Per host, the names of the operations that changed it, in order, from pyinfra's --json;
    SystemExit when a host failed."""
    results = json.loads(stdout)["results"]
    if results["failed_hosts"]:
        raise SystemExit(f"failed hosts: {', '.join(results['failed_hosts'][:10])}")
    changed: dict[str, list[str]] = {}
    for op in results["operations"]:
        for host in op["success"]:
            changed.setdefault(host, []).append(op["name"])
    return changed


# --- recording ----------------------------------------------------------------------------


def _cli(tool: str, run: tuple[str, ...], inventory: str) -> list[str]:
    """The command line of one run of `tool` (the record or replay runner put before it)."""
    if run == ("status",):
        return ["rigbook", "status", inventory, "--json"]
    if tool == "pyinfra-stock":
        return ["pyinfra", "-y", "--json", "--chdir", str(PEERS), "inventory.py", *run]
    return ["pyinfra", "-y", "--json", inventory, *run]


def _record_run(argv: list[str], env: dict) -> tuple[dict, str, int]:
    with tempfile.NamedTemporaryFile(suffix=".json") as events:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.replay.record", *argv], cwd=ROOT, text=True,
            capture_output=True, env={**env, "RIGBOOK_REPLAY_EVENTS": events.name}, timeout=1800)
        recorded = json.loads(Path(events.name).read_text() or "{}")
    if proc.returncode not in ((0, 1) if argv[0] == "rigbook" else (0,)):
        raise SystemExit(f"recording {' '.join(argv)} failed:\n{proc.stderr[-4000:]}")
    return recorded, proc.stdout, proc.returncode


def _sandbox(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "rigbook.cli", "sandbox", *args], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)


def _the_rig() -> tuple[Identity, dict]:
    """The one sandbox rig up now: its identity and its host data (ssh_* keys left out)."""
    from bench.peers.render import sim_gpus

    (name, data), = runpy.run_path(str(ROOT / "inventory" / "sandbox.py"))["sandbox_rigs"]
    rig = Identity(name, data["ssh_hostname"], tuple(gpu.uuid for gpu in sim_gpus(name)))
    return rig, {key: value for key, value in data.items() if not key.startswith("ssh_")}


def record_tool(tool: str) -> dict:
    """One fresh sandbox rig, every run of `tool` recorded over SSH: the recording."""
    _sandbox("up", "1")
    rig, host_data = _the_rig()
    env = {**os.environ, "PYINFRA_PROGRESS": "off"}
    peers = None
    with tempfile.TemporaryDirectory(prefix="rigbook-replay-") as tmp:
        if tool == "pyinfra-stock":
            from bench.peers.render import render
            (entry,) = render(Path(tmp))
            env["RIGBOOK_BENCH_PEERS"] = str(Path(tmp) / "peers.json")
            peers = _peer_files(entry)
        runs = {}
        for run, args in TOOLS[tool].items():
            argv = _cli(tool, args, "inventory/sandbox.py")
            recorded, stdout, code = _record_run(argv, env)
            changes = [] if args == ("status",) else changes_by_host(stdout).get(rig.name, [])
            runs[run] = {"argv": argv, "exit": code, "changes": changes,
                         "events": recorded.get(rig.name, [])}
            print(f"recorded {tool} {run}: {len(runs[run]['events'])} exchanges, "
                  f"{len(changes)} changes", flush=True)
    if runs.get("no_change", {}).get("changes"):
        raise SystemExit(f"{tool}: the recorded no-change converge changed "
                         f"{runs['no_change']['changes']}")
    contents = []
    for run in runs.values():  # uploads: their hash only, their text where it names the rig
        for event in run["events"]:
            if event["kind"] == "command":  # the run lock's taker names this machine
                event["command"] = scrub(event["command"])
                event["stdout"] = [scrub(line) for line in event["stdout"]]
            if event["kind"] == "put":
                text = base64.b64decode(event.pop("content")).decode(errors="surrogateescape")
                if any(value in text for value in rig.values()) and text not in contents:
                    contents.append(text)
    recording = {
        "format": FORMAT, "tool": tool, "date": time.strftime("%Y-%m-%d"),
        "rig": {"name": rig.name, "address": rig.address, "uuids": list(rig.uuids),
                "serials": list(rig.serials), "data": host_data},
        "contents": contents, "runs": runs,
    }
    if peers is not None:
        recording["peers"] = peers
    return recording


def _peer_files(entry: dict) -> dict:
    """The stock peer's host vars with every rendered file's text in place of its path (the
    replay writes each rig's own copy)."""
    def inline(value):
        if isinstance(value, list) and value and isinstance(value[0], dict) and "src" in value[0]:
            return [{**f, "src": Path(f["src"]).read_text()} for f in value]
        return value
    return {key: inline(value) for key, value in entry["vars"].items()}


def record(tools: list[str]) -> None:
    """Record every tool under the sandbox lock; the rigs are brought down afterwards."""
    RECORDINGS.mkdir(parents=True, exist_ok=True)
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the tests' lock: one user of the sandbox rigs
        try:
            for tool in tools:
                path = RECORDINGS / f"{tool}.json"
                path.write_text(json.dumps(record_tool(tool), indent=1) + "\n")
        finally:
            subprocess.run([sys.executable, "-m", "rigbook.cli", "sandbox", "down"], cwd=ROOT)


# --- replay -------------------------------------------------------------------------------


def replay_env(recording: Path, run: str, rigs: int) -> dict:
    """The environment of a replayed run: the recording, the run, the fleet size, and
    bench/replay/dist/ on sys.path, where pyinfra finds the @replay connector."""
    return {**os.environ, "PYINFRA_PROGRESS": "off", "RIGBOOK_REPLAY": str(recording),
            "RIGBOOK_REPLAY_RUN": run, "RIGBOOK_REPLAY_RIGS": str(rigs),
            "PYTHONPATH": os.pathsep.join([str(DIST), str(ROOT)])}


def write_peers(recording: Path, rigs: int, out: Path) -> Path:
    """peers.json of `rigs` replayed rigs for bench/peers/inventory.py, each rig's rendered
    files written under out/ with its own identity."""
    loaded = load(str(recording))
    hosts = []
    for index in range(rigs):
        swap, name = loaded.swap(index), identity(index, loaded.identity).name
        peer_vars = {}
        for key, value in loaded.data["peers"].items():
            if isinstance(value, list) and value and isinstance(value[0], dict) \
                    and "src" in value[0]:
                files = []
                for entry in value:
                    src = out / name / entry["dest"].lstrip("/")
                    src.parent.mkdir(parents=True, exist_ok=True)
                    src.write_text(swap.forward(entry["src"]))
                    files.append({**entry, "src": str(src)})
                value = files
            peer_vars[key] = value
        hosts.append({"name": f"@replay/{name}", "address": identity(index, loaded.identity)
                      .address, "user": "root", "key": "/nonexistent", "vars": peer_vars})
    path = out / "peers.json"
    path.write_text(json.dumps({"hosts": hosts}) + "\n")
    return path


@dataclass
class Replayed:
    """One replayed run: its figures and what the CLI printed."""

    figures: dict
    stdout: str
    stderr: str
    exit: int


#: Runs a command and writes its CPU seconds and peak RSS to argv[1]. A child's peak RSS counts
#: the process it was forked from (Linux keeps the larger of the two across exec), so the command
#: is started from this small launcher, not from the bench's own, larger, process.
_LAUNCHER = """
import json, os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as out:
    json.dump({"cpu": usage.ru_utime + usage.ru_stime, "maxrss_kib": usage.ru_maxrss}, out)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _timed(argv: list[str], env: dict) -> Replayed:
    """Run `argv`: wall seconds, CPU seconds (user + system) and peak RSS of the process."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile(suffix=".json") as usage:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, usage.name, *argv],
                              cwd=ROOT, env=env, stdout=out, stderr=err)
        wall = time.perf_counter() - start
        measured = json.loads(Path(usage.name).read_text())
        out.seek(0)
        err.seek(0)
        figures = {"seconds": round(wall, 2), "cpu_seconds": round(measured["cpu"], 2),
                   "peak_rss_mib": round(measured["maxrss_kib"] / 1024, 1)}
        return Replayed(figures, out.read().decode(), err.read().decode(), proc.returncode)


def run_replay(tool: str, run: str, rigs: int, recording: Path | None = None) -> Replayed:
    """The real CLI of one recorded run of `tool` on `rigs` replayed rigs (from `recording`,
    default the tool's own), measured, unchecked."""
    path = recording or RECORDINGS / f"{tool}.json"
    env = replay_env(path, run, rigs)
    with tempfile.TemporaryDirectory(prefix="rigbook-replay-") as tmp:
        if tool == "pyinfra-stock":
            env["RIGBOOK_BENCH_PEERS"] = str(write_peers(path, rigs, Path(tmp)))
        argv = _cli(tool, TOOLS[tool][run], "bench/replay/inventory.py")
        argv = ([sys.executable, "-m", "rigbook.cli", *argv[1:]] if argv[0] == "rigbook"
                else [PYINFRA, *argv[1:]])
        return _timed(argv, env)


def replay(tool: str, run: str, rigs: int) -> dict:
    """One recorded run of `tool` replayed on `rigs` rigs: its figures, once checked that
    every rig made exactly the recorded rig's changes and none failed (else SystemExit)."""
    recording = load(str(RECORDINGS / f"{tool}.json"))
    recorded, done = recording.runs[run], run_replay(tool, run, rigs)
    figures = done.figures
    if done.exit != recorded.exit:
        raise SystemExit(f"replayed {tool} {run} on {rigs} rigs: exit {done.exit}, recorded "
                         f"{recorded.exit}:\n{done.stderr[-4000:]}")
    if TOOLS[tool][run] == ("status",):
        rows = json.loads(done.stdout)["rigs"]
        if len(rows) != rigs:
            raise SystemExit(f"replayed status: {len(rows)} rigs of {rigs}")
        figures["changes"] = 0
    else:
        changed = changes_by_host(done.stdout)
        for index in range(rigs):
            name = identity(index, recording.identity).name
            expected = [recording.swap(index).forward(op) for op in recorded.changes]
            if changed.get(name, []) != expected:
                raise SystemExit(f"replayed {tool} {run}: {name} changed "
                                 f"{changed.get(name, [])}, the recorded rig {expected}")
        figures["changes"] = len(recorded.changes) * rigs
    figures["cpu_ms_per_rig"] = round(1000 * figures["cpu_seconds"] / rigs, 1)
    figures["wall_ms_per_rig"] = round(1000 * figures["seconds"] / rigs, 1)
    return figures


def measure(sizes: list[int], done=None) -> list[dict]:
    """Every tool's every recorded run at each size; `done(rows)` after each size."""
    rows = []
    for rigs in sizes:
        row = {"rigs": rigs}
        for tool, runs in TOOLS.items():
            row[tool] = {run: replay(tool, run, rigs) for run in runs}
            print(json.dumps({"rigs": rigs, tool: row[tool]}), flush=True)
        rows.append(row)
        if done is not None:
            done(rows)
    return rows


# --- results ------------------------------------------------------------------------------

#: Columns of the results table: tool, run, heading.
COLUMNS = (
    ("rigbook-full", "first", "full: first"),
    ("rigbook-full", "no_change", "full: no-change"),
    ("rigbook-full", "cap_change", "full: cap change"),
    ("rigbook-full", "status", "full: status"),
    ("rigbook-subset", "first", "subset: first"),
    ("rigbook-subset", "no_change", "subset: no-change"),
    ("pyinfra-stock", "first", "stock pyinfra: first"),
    ("pyinfra-stock", "no_change", "stock pyinfra: no-change"),
)


def _cell(figures: dict) -> str:
    return (f"{figures['seconds']} s, {figures['cpu_ms_per_rig']} ms/rig, "
            f"{figures['peak_rss_mib']:.0f} MiB")


def markdown(report: dict) -> str:
    """The results table: per size and run, wall time, CPU per rig and peak RSS; then stock
    pyinfra's subset over rigbook's (above 1.0x: rigbook is faster)."""
    rows = report["replay"]
    lines = [
        f"## Replayed fleets ({report['date']})", "",
        f"Command: `{report['replay_command']}`  ",
        f"Machine: {report['cores']} cores, shared with other work while it ran; Python "
        f"{report['python']}, pyinfra {report['pyinfra']}. Every rig is replayed in-process "
        "(bench/replay/): no SSH, no container; one run per figure.", "",
        "Each cell: wall time, the operator's CPU (user + system) per rig, peak RSS.", "",
        "| rigs | " + " | ".join(heading for _, _, heading in COLUMNS) + " |",
        "| --- |" + " --- |" * len(COLUMNS),
    ]
    for row in rows:
        lines.append(f"| {row['rigs']} | " + " | ".join(
            _cell(row[tool][run]) for tool, run, _ in COLUMNS) + " |")
    lines += ["", "Stock pyinfra's subset over rigbook's same subset, first / no-change converge "
              "(above 1.0x:", "rigbook is faster), in wall time and in the operator's CPU:", "",
              "| rigs | wall, first | wall, no-change | CPU, first | CPU, no-change |",
              "| --- | --- | --- | --- | --- |"]
    for row in rows:
        ratios = [row["pyinfra-stock"][run][key] / row["rigbook-subset"][run][key]
                  for key in ("seconds", "cpu_seconds") for run in ("first", "no_change")]
        lines.append(f"| {row['rigs']} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """CPU seconds per rig against fleet size, one line per tool and run."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    fig, ax = pyplot.subplots(figsize=(8, 4.5))
    sizes = [row["rigs"] for row in rows]
    for tool, run, heading in COLUMNS:
        ax.plot(sizes, [row[tool][run]["cpu_ms_per_rig"] for row in rows], marker="o",
                label=heading, linestyle="--" if tool == "pyinfra-stock" else "-")
    ax.set_xscale("log")
    ax.set_xticks(sizes, [str(size) for size in sizes])
    ax.set_xlabel("replayed rigs")
    ax.set_ylabel("operator CPU per rig (ms)")
    ax.set_title("Cost per rig against fleet size (python -m bench --replay)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
