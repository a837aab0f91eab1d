"""Serve the rig's recipe without systemd: start, supervise and stop one engine process.

Installed by rigbook (roles/serving.py) at /opt/rigbook/serving/supervise.py on rigs where
systemd is not PID 1 (containers, WSL2 without systemd) and run as root with the rig's python3
(standard library only), where rigbook-serve.service would run the engine:

    python3 -I -S supervise.py start /etc/rigbook/serving/supervise.json
    python3 -I -S supervise.py stop /etc/rigbook/serving/supervise.json
    python3 -I -S supervise.py status /etc/rigbook/serving/supervise.json

`start` returns once the supervisor runs in the background (its pid in the pidfile; already
running: nothing to do), or fails with the reason when a check refuses the start. The
supervisor does what the unit does: before every start the unit's ExecStartPre checks (no
GPU-lost mark, `nvidia-smi -L` works, the live caps are the rig's, and the venv check: no
driver bump holds serving and a GPU recipe's venv was built for the running driver), and a
failed check ends it without a start, its one line in the log and in the refusal record; the
engine runs as the serving user with only the env files' variables, its output appended to
the log; a failed engine is restarted after 10 s, at most 3 starts in 10 minutes; on SIGTERM
it stops the engine gracefully (SIGTERM, then SIGKILL after the config's stop timeout) and
runs the /dev/shm reaper. `stop` asks it to and waits. `status` prints `running (pid N)`
(exit 0), or `not running` and the last refused start's line (exit 3).
"""

import json
import os
import pwd
import signal
import subprocess
import sys
import time

#: The name the pidfile's process must have in its command line (a reused pid is stale).
NAME = "supervise.py"


def log(handle, text: str) -> None:
    handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} rigbook-supervise: {text}\n")
    handle.flush()


def running(pidfile: str) -> int | None:
    """The supervisor's pid when the pidfile names a live supervisor; None otherwise."""
    try:
        pid = int(open(pidfile).read().strip())
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if any(part.endswith(NAME.encode()) for part in cmd) else None


def env_of(paths: list[str], user: str, home: str) -> dict[str, str]:
    """KEY="value" lines of the env files (rigbook writes them escaped: \\", \\\\, \\$)."""
    env = {"HOME": home, "USER": user, "LOGNAME": user,
           "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    for path in paths:
        for line in open(path):
            line = line.strip()
            if not line or line.startswith("#") or "=" not in line:
                continue
            key, value = line.split("=", 1)
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1]
                out, i = [], 0
                while i < len(value):
                    if value[i] == "\\" and i + 1 < len(value):
                        i += 1
                    out.append(value[i])
                    i += 1
                value = "".join(out)
            env[key] = value
    return env


def kill(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except OSError:  # already gone
        pass


def refusal_of(argv: list[str]) -> str | None:
    """What a check program printed when it refused (exit not 0), as root in /, no environment
    but a PATH (the venv check's own argv empties even that); None when it passed."""
    run = subprocess.run(argv, capture_output=True, text=True, cwd="/",
                         env={"PATH": "/usr/bin:/bin"})
    return " ".join((run.stdout + run.stderr).split())[-300:] if run.returncode != 0 else None


def checks(conf: dict) -> str | None:
    """Why the engine must not start now (the unit's ExecStartPre lines); None: go on."""
    mark = conf.get("gpu_lost_mark")
    if mark and os.path.exists(mark):
        return f"{mark} exists: a GPU was lost this boot; never (re)start a model then"
    if conf.get("smi"):
        try:
            run = subprocess.run([conf["smi"], "-L"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"{conf['smi']} -L: {error}"
        if run.returncode != 0:
            return f"{conf['smi']} -L failed (exit {run.returncode}): the card is gone"
    for check in ("cap_check", "venv_check"):
        if conf.get(check):
            why = refusal_of(conf[check])
            if why is not None:
                return why
    return None


def record(conf: dict, why: str | None) -> None:
    """Keep the refused start's line for `status` (a tmpfs: gone at the next boot); None: a
    start went ahead, so nothing is refused any more."""
    path = conf.get("refusal")
    if not path:
        return
    if why is None:
        if os.path.exists(path):
            os.unlink(path)
        return
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    with open(path, "w") as handle:
        handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {why}\n")


def supervise(conf: dict, out) -> int:
    """The supervisor's loop (a daemon by now): start, restart on failure, stop on SIGTERM."""
    stopping, engine, starts = [], None, []

    def on_term(signum, frame):
        stopping.append(signum)
        if engine is not None and engine.poll() is None:
            kill(engine.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    limit, window = conf.get("start_limit", [3, 600])
    while not stopping:
        why = checks(conf)
        record(conf, why)
        if why is not None:
            log(out, f"not starting the engine: {why}")
            return 1
        starts = [t for t in starts if time.monotonic() - t < window] + [time.monotonic()]
        env = env_of(conf["env_files"], conf["user"], conf["home"])
        log(out, f"starting {conf['argv'][0]} as {conf['user']}")
        engine = subprocess.Popen(
            conf["argv"], cwd=conf["home"], env=env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, user=conf["user"], group=pwd.getpwnam(conf["user"]).pw_gid,
            extra_groups=[],
            umask=0o077, start_new_session=True,
        )
        deadline = None
        while engine.poll() is None:
            if stopping and deadline is None:
                deadline = time.monotonic() + conf["stop_timeout"]
            if deadline is not None and time.monotonic() > deadline:
                log(out, f"the engine did not stop in {conf['stop_timeout']} s: SIGKILL")
                kill(engine.pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.2)
        kill(engine.pid, signal.SIGKILL)  # what the engine left running in its session
        log(out, f"the engine exited with {engine.returncode}")
        if conf.get("reaper"):
            subprocess.run(conf["reaper"], stdout=out, stderr=subprocess.STDOUT, cwd="/",
                           env={"PATH": "/usr/bin:/bin"})
        if stopping or engine.returncode == 0:
            break
        if len(starts) >= limit:
            log(out, f"{limit} starts in {window} s: giving up (rigbook status shows it)")
            return 1
        for _ in range(conf.get("restart_sec", 10) * 5):
            if stopping:
                break
            time.sleep(0.2)
    return 0


def start(conf: dict) -> int:
    pid = running(conf["pidfile"])
    if pid is not None:
        print(f"already running (pid {pid})")
        return 0
    why = checks(conf)  # said here too, so that a refused start fails the deploy with it
    record(conf, why)
    if why is not None:
        print(f"not starting the engine: {why}")
        return 1
    for path in (conf["pidfile"], conf["log"]):
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    child = os.fork()
    if child == 0:  # the daemon: its own session, no terminal, the log for output
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        os.chdir("/")
        out = open(conf["log"], "a")
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null if fd == 0 else out.fileno(), fd)
        with open(conf["pidfile"], "w") as handle:
            handle.write(f"{os.getpid()}\n")
        code = 1
        try:
            code = supervise(conf, out)
        except Exception as error:  # said in the log; never back into the caller's code
            log(out, f"supervisor failed: {error!r}")
        if running(conf["pidfile"]) == os.getpid():
            os.unlink(conf["pidfile"])
        log(out, "supervisor exits")
        os._exit(code)
    os.waitpid(child, 0)
    for _ in range(100):
        pid = running(conf["pidfile"])
        if pid is not None:
            print(f"started (pid {pid})")
            return 0
        time.sleep(0.1)
    print(f"the supervisor did not write {conf['pidfile']}: see {conf['log']}")
    return 1


def stop(conf: dict) -> int:
    pid = running(conf["pidfile"])
    if pid is None:
        if os.path.exists(conf["pidfile"]):
            os.unlink(conf["pidfile"])
            print("not running (a stale pidfile was removed)")
        else:
            print("not running")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + conf["stop_timeout"] + 30
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            print(f"stopped (pid {pid})")
            return 0
        time.sleep(0.2)
    print(f"the supervisor (pid {pid}) did not exit: see {conf['log']}")
    return 1


def status(conf: dict) -> int:
    """One line: running and its pid (0), or not running and the last refused start (3)."""
    pid = running(conf["pidfile"])
    if pid is not None:
        print(f"running (pid {pid})")
        return 0
    try:
        with open(conf.get("refusal") or os.devnull) as handle:
            stamp, _, why = handle.readline().strip().partition(" ")
    except OSError:
        why = ""
    print(f"not running: the start at {stamp} was refused: {why}" if why else "not running")
    return 3


def main(argv: list[str]) -> int:
    actions = {"start": start, "stop": stop, "status": status}
    if len(argv) != 3 or argv[1] not in actions:
        print(f"usage: {NAME} start|stop|status CONFIG")
        return 2
    with open(argv[2]) as handle:
        conf = json.load(handle)
    return actions[argv[1]](conf)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
