"""The serving state of a rig, read on the rig: rigbook's ServeProbe fact (roles/serving.py).

Sent as `python3 -c <this file> ARGS` (standard library only, nothing of rigbook installed):
ARGS is one JSON object (`probe_args`: the unit or rigbook's supervisor (its program and
pidfile, where systemd does not run the rig), the serving user, the files to hash, the
engine markers, the nvidia-smi paths, the health check). Prints one JSON object (sorted keys);
read-only except for the health check's quick /v1/models request.

The engine markers come split in two halves and are joined here, so this program's own
command line never holds a marker: the probe cannot count itself as an engine.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys


def supervisor(pidfile: str, program: str) -> dict | None:
    """rigbook's supervisor (no systemd): its pid, and whether that pid is still it."""
    try:
        pid = int(open(pidfile).read().strip())
    except (OSError, ValueError):
        return None
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        cmd = []
    return {"pid": pid, "alive": program.encode() in cmd}


def main(argv: list[str]) -> None:
    a = json.loads(argv[1])
    out = {"files": {}, "engines": [], "unit_pids": [], "rss_kib": 0, "smi": None,
           "apps": None, "answer": None, "entry": os.access(a["entry"], os.X_OK), "user": False}
    for line in open("/proc/meminfo"):
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            out[key] = int(rest.split()[0])
    for path in a["files"]:
        try:
            with open(path, "rb") as handle:
                out["files"][path] = hashlib.sha256(handle.read()).hexdigest()
        except OSError:
            out["files"][path] = None
    systemctl = shutil.which("systemctl")
    out["systemd"] = bool(systemctl) and os.path.isdir("/run/systemd/system")
    show = subprocess.run([systemctl, "show", a["unit"], "-p",
                           "ActiveState,SubState,UnitFileState,LoadState"],
                          capture_output=True, text=True).stdout if systemctl else ""
    out["unit"] = dict(row.split("=", 1) for row in show.splitlines() if "=" in row)
    out["supervisor"] = supervisor(a["pidfile"], a["supervisor"])
    try:
        out["user"] = any(row.split(":")[0] == a["user"] for row in open("/etc/passwd"))
    except OSError:
        pass
    mine, me = "/" + a["unit"], {os.getpid()}
    pid = os.getppid()
    while pid > 1:
        me.add(pid)
        try:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    markers = [x + y for x, y in a["markers"]]
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in me:
            continue
        try:
            cgroup = open(f"/proc/{name}/cgroup").read()
            cmd = open(f"/proc/{name}/cmdline", "rb").read().replace(b"\0", b" ").decode(
                "utf-8", "replace").strip()
            ppid = int(open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        procs[int(name)] = (ppid, cgroup, cmd)
    ours = set()
    if (out["supervisor"] or {}).get("alive"):  # the supervisor and what it started
        ours.add(out["supervisor"]["pid"])
        while True:
            more = {pid for pid, (ppid, _, _) in procs.items() if ppid in ours} - ours
            if not more:
                break
            ours |= more
    for pid, (_ppid, cgroup, cmd) in sorted(procs.items()):
        name = str(pid)
        if pid in ours or any(line.endswith(mine) for line in cgroup.splitlines()):
            out["unit_pids"].append(int(name))
            try:
                for line in open(f"/proc/{name}/status"):
                    if line.startswith("VmRSS:"):
                        out["rss_kib"] += int(line.split()[1])
            except OSError:
                pass
        elif cmd and any(m in cmd for m in markers):
            out["engines"].append([int(name), cmd[:200]])
    if a["gpu"]:
        found = [shutil.which("nvidia-smi")] + a["smi_paths"]
        smi = next((p for p in found if p and os.access(p, os.X_OK)), None)
        if smi:
            try:
                run = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
                out["smi"] = {"path": smi, "rc": run.returncode, "out": run.stdout + run.stderr}
            except subprocess.TimeoutExpired:
                out["smi"] = {"path": smi, "rc": 124,
                              "out": "nvidia-smi -L did not answer in 60 s"}
            if out["smi"]["rc"] == 0:
                try:
                    run = subprocess.run([smi, "--query-compute-apps=gpu_uuid,pid,used_memory",
                                          "--format=csv,noheader,nounits"],
                                         capture_output=True, text=True, timeout=60)
                    if run.returncode == 0:
                        out["apps"] = [[c.strip() for c in row.split(",")]
                                       for row in run.stdout.splitlines() if row.count(",") == 2]
                except subprocess.TimeoutExpired:
                    pass
    up = out["unit"].get("ActiveState") == "active" or (out["supervisor"] or {}).get("alive")
    if up and os.path.exists(a["health"]):
        cmd = [sys.executable, a["health"], "--once", "--url", a["url"]]
        if a["key"]:
            cmd += ["--key-file", a["key"]]
        run = subprocess.run(cmd, capture_output=True, text=True)
        try:
            out["answer"] = json.loads(run.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out["answer"] = {"ok": False, "message": (run.stdout + run.stderr)[-300:]}
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv)
