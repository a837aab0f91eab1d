"""Rigs without systemd as PID 1: the fact, what the roles plan there, and rigbook's supervisor.

The supervisor (files/serving/supervise.py) runs here for real, as root, with a stand-in engine
(a small HTTP server that records the signal it got) running as the unprivileged user nobody.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import rigbook.preflight
from rigbook.core.checks import Facts
from rigbook.core.spec import Rig
from rigbook.core.units import NO_SYSTEMD, SYSTEMD, SYSTEMD_READ, SystemdBooted
from rigbook.rigside.gpus import GpuProbe
from rigbook.roles import models, power
from rigbook.roles.guards import GPU_LOST_MARK, REAPER
from rigbook.roles.serving import (
    CAP_CHECK_PATH,
    CAP_CHECK_SOURCE,
    ENV_PATH,
    HEALTH_PATH,
    HEALTH_SOURCE,
    HOLD_PATH,
    PIDFILE,
    PROBE_SOURCE,
    SUPERVISE_CONF,
    SUPERVISE_PATH,
    SUPERVISE_SOURCE,
    SUPERVISOR,
    VENV_CHECK_PATH,
    VENV_CHECK_SOURCE,
    parse_probe,
    probe_args,
    render_env,
    render_supervise,
    serve_plan,
    serve_recipe,
    serving_findings,
    venv_check_args,
)
from tests.opkit import describe, run_op
from tests.test_serving import (
    GPUS,
    LAUNCHER,
    SMI,
    cpu_rig,
    dual_rig,
    launcher_of,
    op_facts,
    sha256,
    state,
)
from tests.test_serving_hold import REASON

HEALTH = Path(HEALTH_SOURCE)
#: The rig's python3 (the engine runs as nobody, who cannot reach this checkout's venv).
PYTHON = "/usr/bin/python3"
ENGINE = """
import http.server, json, os, signal, sys
def term(signum, frame):
    open(os.environ["MARK"], "w").write("SIGTERM\\n")
    if os.environ.get("STUBBORN"):
        return
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "tiny"}]}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
print("engine up as", os.getuid(), os.environ["HOME"], os.environ["QUOTED"], flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the supervisor drops to nobody")


# --- the fact and the check ---------------------------------------------------------------------


def test_systemd_booted_needs_pid1_systemd_and_systemctl():
    fact = SystemdBooted()
    assert fact.process(["##RIGBOOK_SYSTEMD## yes"]) is True
    assert fact.process(["##RIGBOOK_SYSTEMD## no"]) is False
    empty = Path("/nonexistent-rigbook-path")
    run = subprocess.run(["/bin/sh", "-c", fact.command()], capture_output=True, text=True,
                         env={"PATH": str(empty)})  # no systemctl on PATH: never booted
    assert fact.process(run.stdout.splitlines()) is False


def test_no_systemd_is_said_once_by_every_preflight_and_shown_by_status():
    from rigbook.core.checks import reads_of
    from rigbook.roles.guards import CHECKS as GUARDS

    assert [(r.name, r.fact) for r in reads_of(None, "rig1", [SYSTEMD])] == [
        ("systemd", SystemdBooted)]
    (finding,) = SYSTEMD.run(None, Facts(systemd=False), "rig1")
    assert finding.level == "warn" and finding.reason == NO_SYSTEMD
    assert "served by rigbook's supervisor" in NO_SYSTEMD and "docs/no-systemd.md" in NO_SYSTEMD
    assert SYSTEMD.run(None, Facts(systemd=True), "rig1") == []
    assert SYSTEMD in GUARDS
    source = Path(rigbook.preflight.__file__).read_text()
    assert "((SYSTEMD,), *groups)" in source  # read by every deploy's preflight


# --- what the roles plan without systemd ----------------------------------------------------------


def test_power_advises_no_unit_and_writes_none_without_systemd():
    from tests.test_power import DUAL, dual_3090, probe_of

    rig, gpus = dual_3090(power_cap_watts=290), probe_of(DUAL)
    assert SYSTEMD_READ in power._power_reads(rig, "rig1")
    with_unit = power.power_findings(rig, Facts(probe=gpus, unit=None, systemd=True), "rig1")
    assert any("caps are lost at the next reboot" in f.reason for f in with_unit)
    without = power.power_findings(rig, Facts(probe=gpus, systemd=False), "rig1")
    assert without and not any(power.UNIT_NAME in f.reason for f in without), without
    assert all("live cap" in f.reason for f in without)  # the live caps are still checked
    commands, host = run_op(power.power_unit, {"SystemdBooted": False, "NvidiaGpus": gpus}, rig)
    assert commands == []
    assert host.noops == [f"no systemd: no {power.UNIT_NAME}; the live caps are set, and not "
                          "restored at boot (docs/no-systemd.md)"]


def test_a_mirror_port_is_refused_without_systemd(tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    rig = Rig.model_validate({"platform": "debian", "gpu_class": "rtx4090", "gpu_count": 1,
                              "models_mirror_port": 8765, "models_mirror_bind": "10.0.0.5",
                              "models_mirror_token_file": str(token)})
    assert SYSTEMD_READ in models._mirror_reads(rig, "rig1")
    (finding,) = models.mirror_findings(rig, Facts(systemd=False), "rig1")
    assert finding.level == "error" and finding.key == "models_mirror_port"
    assert "needs systemd" in finding.reason
    assert models.mirror_findings(rig, Facts(systemd=True), "rig1") == []


# --- serving: the supervisor's config and the operation -------------------------------------------


def test_the_supervisor_config_carries_the_units_checks_and_no_systemctl():
    plan = serve_plan(dual_rig(), "rig1")
    conf = json.loads(render_supervise(plan, SMI, {"GPU-0": 290.0, "GPU-1": 290.0}))
    assert conf["argv"] == list(plan.argv) and conf["user"] == "rigbook-serve"
    assert conf["env_files"] == [ENV_PATH] and conf["stop_timeout"] == 120
    assert conf["smi"] == SMI and conf["gpu_lost_mark"] == GPU_LOST_MARK
    assert conf["cap_check"] == ["/usr/bin/python3", "-I", "-S", CAP_CHECK_PATH, "--smi", SMI,
                                 "--tolerance", "0.5", "--caps", "GPU-0=290", "GPU-1=290"]
    assert conf["reaper"][:4] == ["/usr/bin/python3", "-I", "-S", REAPER]
    assert "systemctl" not in json.dumps(conf)
    cpu = json.loads(render_supervise(serve_plan(cpu_rig(), "rig1"), SMI, {}))
    assert cpu["smi"] is None and cpu["cap_check"] is None and cpu["gpu_lost_mark"] is None


def supervised(plan, caps=None) -> dict:
    """The files a rig without systemd has after `plan` was deployed (path -> sha256)."""
    launcher = launcher_of_default()
    return {
        SUPERVISE_CONF: sha256(render_supervise(plan, SMI, caps or {})),
        ENV_PATH: sha256(render_env(plan, launcher)), HEALTH_PATH: sha256(HEALTH.read_bytes()),
        CAP_CHECK_PATH: sha256(CAP_CHECK_SOURCE.read_bytes()),
        VENV_CHECK_PATH: sha256(VENV_CHECK_SOURCE.read_bytes()),
        SUPERVISE_PATH: sha256(SUPERVISE_SOURCE.read_bytes()),
    }


def launcher_of_default() -> dict:
    from rigbook.roles.venvs import VenvLayout

    return launcher_of(VenvLayout(LAUNCHER["VIRTUAL_ENV"], "x", None, False, None))


def caps_of(rig: Rig, gpus: GpuProbe) -> dict:
    return {cap.uuid: cap.watts for cap in power.cap_plan(rig, gpus.gpus)[0]}


def test_serving_without_systemd_starts_the_supervisor_and_plans_no_systemctl():
    rig = dual_rig()
    plan = serve_plan(rig, "rig1")
    probe = state(systemd=False, files={})
    steps = [describe(c) for c in run_op(serve_recipe, op_facts(probe), plan=plan)[0]]
    assert not [step for step in steps if "systemctl" in step or "systemd" in step], steps
    assert f"upload {SUPERVISE_CONF}" in steps and f"upload {SUPERVISE_PATH}" in steps
    assert steps[-2:] == [f"/usr/bin/python3 -I -S {SUPERVISE_PATH} start {SUPERVISE_CONF}",
                          "call _await_health"]

    # converged and running: nothing to do, and it says who serves
    done = state(systemd=False, active="active", sub="supervised, pid 7",
                 files=supervised(plan, caps_of(rig, GPUS)), answer={"ok": True, "model": "m"})
    commands, host = run_op(serve_recipe, op_facts(done), plan=plan)
    assert commands == []
    assert host.noops == [f"{SUPERVISOR} already runs {plan.label} and answers (model m)"]

    # a switch stops the old engine through the supervisor first
    new = serve_plan(dual_rig(recipe="dual-3090-tp2"), "rig1")
    steps = [describe(c) for c in run_op(serve_recipe, op_facts(done), plan=new)[0]]
    assert steps[0] == f"/usr/bin/python3 -I -S {SUPERVISE_PATH} stop {SUPERVISE_CONF}"
    assert not [step for step in steps if "systemctl" in step]


def test_status_of_a_supervised_rig_names_the_supervisor_and_advises_no_unit():
    rig = cpu_rig()
    plan = serve_plan(rig, "rig1")
    bare = state(systemd=False, files={})
    (finding,) = serving_findings(rig, Facts(serving=bare, serving_recipe=None), "rig1")
    assert finding.reason == (f"no {SUPERVISE_CONF}: recipe tiny-cpu-a is not set up; run "
                              "deploys/serve.py")
    down = state(systemd=False, sub="stale pidfile /run/rigbook/serve.pid (pid 9)",
                 files=supervised(plan))
    (finding,) = serving_findings(rig, Facts(serving=down,
                                             serving_recipe=["RIGBOOK_RECIPE=tiny-cpu-a"]), "rig1")
    assert "is stale pidfile" in finding.reason and "nothing starts it at boot" in finding.reason
    assert "enabled" not in finding.reason and "journalctl" not in finding.reason


# --- the rig-side programs without systemctl ------------------------------------------------------


def no_systemctl_env(tmp_path: Path) -> dict:
    """A PATH with python3 and nothing else: no systemctl, no nvidia-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if not (bin_dir / "python3").exists():
        (bin_dir / "python3").symlink_to(sys.executable)
    return {"PATH": str(bin_dir)}


def run_probe(tmp_path: Path, pidfile: Path) -> subprocess.CompletedProcess:
    args = json.loads(probe_args(serve_plan(cpu_rig(), "rig1")))
    args.update(pidfile=str(pidfile), health=str(tmp_path / "no-health.py"))
    return subprocess.run([sys.executable, "-c", PROBE_SOURCE.read_text(), json.dumps(args)],
                          capture_output=True, text=True, env=no_systemctl_env(tmp_path))


def test_the_probe_reads_no_systemctl_as_a_state_not_a_traceback(tmp_path):
    run = run_probe(tmp_path, tmp_path / "serve.pid")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    probe = parse_probe(run.stdout)
    assert probe.systemd is False and not probe.running and probe.sub == "not running"

    (tmp_path / "serve.pid").write_text("999999999\n")  # a pid no process has
    probe = parse_probe(run_probe(tmp_path, tmp_path / "serve.pid").stdout)
    assert not probe.running and probe.sub == f"stale pidfile {PIDFILE} (pid 999999999)"


def test_the_health_check_copes_without_systemctl_and_stops_when_the_supervisor_is_gone(tmp_path):
    gone = tmp_path / "serve.pid"
    gone.write_text("999999999\n")
    run = subprocess.run([sys.executable, str(HEALTH), "--url", "http://127.0.0.1:9",
                          "--unit", "rigbook-serve.service", "--pidfile", str(gone),
                          "--timeout", "30"],
                         capture_output=True, text=True, env=no_systemctl_env(tmp_path))
    assert run.returncode == 1 and "Traceback" not in run.stderr
    result = json.loads(run.stdout)
    assert result["stage"] == "engine" and "supervisor" in result["message"]


# --- the supervisor, for real ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def tmp_path():
    """A folder the engine's user (nobody) can reach: pytest's own are root's only (0700)."""
    path = Path(tempfile.mkdtemp(prefix="rigbook-supervise-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def conf_for(tmp_path: Path, **changes) -> Path:
    work = tmp_path / "shared"
    work.mkdir(mode=0o777, exist_ok=True)
    work.chmod(0o777)  # the engine (nobody) writes its mark here
    (tmp_path / "engine.py").write_text(ENGINE)
    (tmp_path / "engine.env").write_text(f'QUOTED="a\\"b\\$c"\nMARK="{work / "signal"}"\n')
    conf = {
        "argv": [PYTHON, str(tmp_path / "engine.py"), str(free_port())],
        "user": "nobody", "home": str(work), "env_files": [str(tmp_path / "engine.env")],
        "smi": None, "gpu_lost_mark": str(tmp_path / "gpu-lost"), "cap_check": None,
        "stop_timeout": 10, "restart_sec": 1, "start_limit": [3, 600],
        "pidfile": str(tmp_path / "run" / "serve.pid"), "log": str(tmp_path / "log" / "serve.log"),
        "reaper": None, **changes,
    }
    path = tmp_path / "supervise.json"
    path.write_text(json.dumps(conf))
    return path


def supervise(action: str, conf: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-S", str(SUPERVISE_SOURCE), action, str(conf)],
                          capture_output=True, text=True, timeout=120)


def wait_for(predicate, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def answers(conf: Path) -> bool:
    port = json.loads(conf.read_text())["argv"][-1]
    try:
        with socket.create_connection(("127.0.0.1", int(port)), timeout=1):
            return True
    except OSError:
        return False


def pid_in(conf: Path) -> int:
    return int(Path(json.loads(conf.read_text())["pidfile"]).read_text())


@pytest.fixture
def stopped_after():
    """Stops every supervisor a test started, whatever the test did."""
    confs: list[Path] = []
    yield confs.append
    for conf in confs:
        supervise("stop", conf)


@needs_root
def test_the_supervisor_starts_once_drops_privileges_and_stops_gracefully(tmp_path, stopped_after):
    conf = conf_for(tmp_path)
    stopped_after(conf)
    first = supervise("start", conf)
    assert first.returncode == 0 and first.stdout.startswith("started (pid "), first.stdout
    pid = pid_in(conf)
    again = supervise("start", conf)
    assert again.returncode == 0 and again.stdout == f"already running (pid {pid})\n"
    assert wait_for(lambda: answers(conf))
    engine = int(subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                text=True).stdout.split()[0])
    assert os.stat(f"/proc/{engine}").st_uid == pwd.getpwnam("nobody").pw_uid
    log = Path(json.loads(conf.read_text())["log"])
    assert wait_for(lambda: 'a"b$c' in log.read_text())  # the env file's escapes undone
    assert f"engine up as {pwd.getpwnam('nobody').pw_uid} {tmp_path / 'shared'}" in log.read_text()

    stop = supervise("stop", conf)
    assert stop.returncode == 0 and stop.stdout == f"stopped (pid {pid})\n"
    assert (tmp_path / "shared" / "signal").read_text() == "SIGTERM\n"  # graceful
    assert not Path(json.loads(conf.read_text())["pidfile"]).exists()
    assert "the engine exited with 0" in log.read_text()
    assert supervise("stop", conf).stdout == "not running\n"


@needs_root
def test_a_stale_pidfile_is_not_running_and_a_start_replaces_it(tmp_path, stopped_after):
    conf = conf_for(tmp_path)
    stopped_after(conf)
    pidfile = Path(json.loads(conf.read_text())["pidfile"])
    pidfile.parent.mkdir()
    pidfile.write_text(f"{os.getpid()}\n")  # a live pid that is not a supervisor
    assert supervise("stop", conf).stdout == "not running (a stale pidfile was removed)\n"
    pidfile.write_text(f"{os.getpid()}\n")
    assert supervise("start", conf).stdout.startswith("started")
    assert pid_in(conf) != os.getpid()


@needs_root
@pytest.mark.parametrize("changes, says", [
    ({"smi": "/bin/false"}, "/bin/false -L failed (exit 1): the card is gone"),
    ({"cap_check": ["/bin/sh", "-c", "echo 'rigbook: not starting the engine uncapped: x'; "
                                      "exit 1"]},
     "rigbook: not starting the engine uncapped: x"),
])
def test_a_failed_gpu_check_refuses_the_start(tmp_path, changes, says):
    conf = conf_for(tmp_path, **changes)
    run = supervise("start", conf)
    assert run.returncode == 1 and run.stdout == f"not starting the engine: {says}\n"
    assert not Path(json.loads(conf.read_text())["pidfile"]).exists()


#: A stand-in nvidia-smi for the venv check: `-L` lists a card, a query prints the driver.
STUB_SMI = """#!/bin/sh
case "$1" in -L) echo "GPU 0: stand-in (UUID: GPU-0)" ;; *) echo 580.159.04 ;; esac
"""


def venv_check_conf(tmp_path: Path, built_for: str) -> tuple[Path, Path]:
    """A GPU recipe's supervise.json whose venv check is venv_check_args' argv, its rig paths
    moved into tmp_path (the check itself from this checkout); (the config, the hold file)."""
    from rigbook.core.pins import venv_link

    plan = serve_plan(dual_rig(), "rig1")
    smi, hold, venv = tmp_path / "nvidia-smi", tmp_path / "serving-held", tmp_path / "venv"
    smi.write_text(STUB_SMI)
    smi.chmod(0o755)
    venv.mkdir()
    (venv / "rigbook-manifest.json").write_text(json.dumps({"driver": built_for}))
    moved = {VENV_CHECK_PATH: str(VENV_CHECK_SOURCE), HOLD_PATH: str(hold),
             venv_link(plan.recipe.venv): str(venv), SMI: str(smi)}
    argv = [moved.get(word, word) for word in venv_check_args(plan, SMI)]
    assert argv[:4] == ["/usr/bin/env", "-i", "-C", "/"] and argv[-2:] == ["--smi", str(smi)]
    conf = conf_for(tmp_path, smi=str(smi), venv_check=argv,
                    refusal=str(tmp_path / "run" / "serve.refused"))
    return conf, hold


def status_of(conf: Path, source: str | None = None) -> subprocess.CompletedProcess:
    """`supervise.py status`, or SupervisorStatus' own command line (the source sent with -c)."""
    if source is None:
        return supervise("status", conf)
    return subprocess.run([sys.executable, "-I", "-S", "-c", source, "status", str(conf)],
                          capture_output=True, text=True, timeout=60)


@needs_root
def test_the_venv_check_refuses_a_held_start_and_a_stale_venv_and_status_says_so(
        tmp_path, stopped_after):
    from rigbook.roles.serving import SupervisorStatus

    conf, hold = venv_check_conf(tmp_path, built_for="580.95.05")
    hold.write_text(f"{REASON}\n")
    run = supervise("start", conf)
    assert run.returncode == 1, run.stdout
    assert run.stdout == f"not starting the engine: {hold}: {REASON}\n"
    assert not Path(json.loads(conf.read_text())["pidfile"]).exists()
    said = status_of(conf)
    assert said.returncode == 3
    assert said.stdout.startswith("not running: the start at ")
    assert said.stdout.endswith(f" was refused: {hold}: {REASON}\n")
    fact = SupervisorStatus()
    same = status_of(conf, SUPERVISE_SOURCE.read_text())  # the fact sends it with -c
    assert fact.process(same.stdout.splitlines()) == said.stdout.strip()

    hold.unlink()  # released, but the venv was built for the driver before the bump
    run = supervise("start", conf)
    assert run.returncode == 1
    assert run.stdout == ("not starting the engine: venv venv was built for driver 580.95.05, "
                          "driver 580.159.04 runs: not starting the engine on it; rebuild it: "
                          "pyinfra INVENTORY deploys/venvs.py\n")
    assert "was built for driver 580.95.05" in status_of(conf).stdout

    venv = tmp_path / "venv" / "rigbook-manifest.json"
    venv.write_text(json.dumps({"driver": "580.159.04"}))  # rebuilt: it starts
    stopped_after(conf)
    assert supervise("start", conf).returncode == 0
    supervisor = pid_in(conf)
    said = status_of(conf)
    assert said.returncode == 0 and said.stdout == f"running (pid {supervisor})\n"
    assert fact.process(said.stdout.splitlines()) == f"running (pid {supervisor})"
    assert not Path(json.loads(conf.read_text())["refusal"]).exists()  # nothing refused now

    # a crash-restart runs the check too: held while it ran, the engine dies, no new start
    assert wait_for(lambda: answers(conf))
    hold.write_text(f"{REASON}\n")
    subprocess.run(["pkill", "-KILL", "-P", str(supervisor)], check=True)
    assert wait_for(lambda: not Path(f"/proc/{supervisor}").exists())
    log = Path(json.loads(conf.read_text())["log"]).read_text()
    assert f"not starting the engine: {hold}: {REASON}" in log
    assert log.count("starting ") - log.count("not starting") == 1  # never restarted
    assert status_of(conf).stdout.endswith(f" was refused: {hold}: {REASON}\n")


@needs_root
def test_no_start_and_no_restart_after_a_gpu_lost_mark(tmp_path, stopped_after):
    conf = conf_for(tmp_path)
    mark = tmp_path / "gpu-lost"
    mark.write_text("GPU lost: do not restart serving\n")
    run = supervise("start", conf)
    assert run.returncode == 1 and "a GPU was lost this boot" in run.stdout
    mark.unlink()

    stopped_after(conf)
    assert supervise("start", conf).returncode == 0
    supervisor = pid_in(conf)
    assert wait_for(lambda: answers(conf))
    mark.write_text("GPU lost: do not restart serving\n")
    subprocess.run(["pkill", "-KILL", "-P", str(supervisor)], check=True)  # the engine dies
    assert wait_for(lambda: not Path(f"/proc/{supervisor}").exists())
    log = Path(json.loads(conf.read_text())["log"]).read_text()
    assert "the engine exited with -9" in log
    assert "not starting the engine: " in log and "a GPU was lost this boot" in log
    assert log.count("starting ") - log.count("not starting") == 1  # never restarted


@needs_root
def test_a_failing_engine_is_restarted_until_the_start_limit(tmp_path):
    conf = conf_for(tmp_path, argv=[PYTHON, "-c", "raise SystemExit(3)"],
                    start_limit=[2, 600])
    assert supervise("start", conf).returncode == 0
    log = Path(json.loads(conf.read_text())["log"])
    assert wait_for(lambda: log.exists() and "giving up" in log.read_text())
    text = log.read_text()
    assert text.count("the engine exited with 3") == 2
    assert "2 starts in 600 s: giving up" in text


@needs_root
def test_an_engine_that_ignores_sigterm_is_killed_after_the_stop_timeout(tmp_path, stopped_after):
    conf = conf_for(tmp_path, stop_timeout=1)
    stopped_after(conf)
    env = tmp_path / "engine.env"
    env.write_text(env.read_text() + 'STUBBORN="1"\n')
    assert supervise("start", conf).returncode == 0
    assert wait_for(lambda: answers(conf))
    start = time.monotonic()
    assert supervise("stop", conf).returncode == 0
    assert 1 <= time.monotonic() - start < 10
    log = Path(json.loads(conf.read_text())["log"]).read_text()
    assert "did not stop in 1 s: SIGKILL" in log and "the engine exited with -9" in log


def test_the_supervisor_is_standard_library_only_package_data():
    from rigbook import FILES

    text = SUPERVISE_SOURCE.read_text()
    imports = {line.split()[1] for line in text.splitlines()
               if line.startswith(("import ", "from "))}
    assert imports == {"json", "os", "pwd", "signal", "subprocess", "sys", "time"}
    assert SUPERVISE_SOURCE == FILES / "serving" / "supervise.py"
