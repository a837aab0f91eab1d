"""The power sweep end to end on two sandbox rigs (rig1 dual-3090, rig2 single-4090), each
serving the tiny random-weights model with llama.cpp on CPU (as tests/test_verify_e2e.py).

Set up once: the stand-in driver with persistence mode on, the boot unit from
deploys/power_cap.py (rig1 290 W per card, rig2 260 W: the sweet spots), the engine.

1. caps outside a card's range are refused before anything changes; a sweep of 3 caps on both
   rigs sets each live, runs the protocol (time-bounded decode windows of narrative and code,
   salted cold prefills of the frozen long prompt, capped by the recipe's 512-token context)
   with the draw sampled, restores every live cap to what the unit says (read back from the
   rigs, the unit itself untouched), and stores JSON with every window's evidence and a chart
   per workload class; the engine's own log proves every prefill cold (no cached prefix);
   rig1's simulated corsairpsu is read beside every sample (the host's 110 W plus the cards'),
   rig2 has none and says so;
2. the operator's pyinfra killed mid-sweep: the guard on the rig restores the unit's caps once
   its lease lapses.

The figures are the simulator's (sandbox/simulated/README.md), not measurements.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rigbook import cli
from rigbook.rigside.cap_check import unit_caps
from rigbook.rigside.gpus import parse_query_csv, query_args
from rigbook.roles.power import UNIT_PATH
from rigbook.roles.serving import UNIT_NAME as SERVE_UNIT
from rigbook.roles.sweep import (
    GUARD_UNIT,
    LEASE_MARGIN_S,
    RIG_PROGRAM,
    SWEEP_DIR,
    guard_command,
    lease_command,
)
from rigbook.roles.sweepresult import AC_NOTE, Evidence, load_sweeps
from rigbook.sandbox import SIM_HWMON
from tests.conftest import PYINFRA, ROOT, SANDBOX_INVENTORY, rig_ssh, rigbook, run_pyinfra
from tests.standins import place_model, ssh_with_input, wheelhouse_for_llama
from tests.test_sandbox import OLD, install_driver
from tests.test_serving_e2e import CONVERGE, KEY, data_args
from tests.tinymodel import FILE, revision_of, write_tiny_gguf

pytestmark = pytest.mark.sandbox

SWEEP = "deploys/power_sweep.py"
BOTH = ["--limit", "rig1", "--limit", "rig2"]
TIMEOUT_S = 15  # the lease is this + 5 s: long enough for a step on a loaded CI machine
#: A small protocol: 2 s decode windows, 8-token answers, two cold prefills a cap (the frozen
#: prompt's 40,000-token default capped by the tiny model's context), so a cap takes ~8 s.
WINDOW_S = 2
SMALL = {"verify_bench_warmups": "0", "verify_bench_runs": "2", "verify_bench_tokens": "8",
         "verify_prefill_tokens": "64", "verify_bench_concurrency": "1",
         "verify_timeout_s": str(TIMEOUT_S), "sweep_window_s": str(WINDOW_S),
         "sweep_hwmon_dir": SIM_HWMON}  # rig1's stand-in corsairpsu; rig2 has no PSU
#: rig1's (dual-3090) simulated host draw beside its cards (sandbox/simulated/profiles.json).
HOST_W = 110
#: llama-cpp-python's verbose log (its server's default) of a request that reused a cached
#: prefix, and of the prompt tokens each request evaluated.
PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens")
EVALUATED = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


def live(rig: dict) -> dict[str, float | None]:
    out = rig_ssh(rig, f"nvidia-smi {query_args(header=True)}").stdout
    return {gpu.uuid: gpu.power_limit_w for gpu in parse_query_csv(out)}


def unit(rig: dict) -> tuple[str, dict[str, float]]:
    text = rig_ssh(rig, f"cat {UNIT_PATH}").stdout
    return text, unit_caps(text)[1]


@pytest.fixture(scope="module")
def served(sandbox, tmp_path_factory):
    """rig1 and rig2 with a driver, the power unit, and tiny-cpu-a answering on port 8100; new
    rigs again afterwards."""
    rigbook("sandbox", "up", str(len(sandbox)))  # new rigs: nothing of an earlier test left
    wheelhouse_for_llama()
    tmp = tmp_path_factory.mktemp("sweep")
    gguf = write_tiny_gguf(tmp / FILE)
    revision = revision_of(gguf)
    key_file = tmp / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    rigs = [sandbox["rig1"], sandbox["rig2"]]
    for rig in rigs:
        install_driver(rig, OLD)
        rig_ssh(rig, "nvidia-smi -pm 1")
        place_model(rig, gguf, revision)
    capped = run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", *BOTH)
    assert capped.returncode == 0, capped.explain()
    args = data_args("tiny-cpu-a", revision, key_file)[2:]  # without its --limit rig1
    up = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, *args, *BOTH)
    assert up.returncode == 0, up.explain()
    for key, value in SMALL.items():
        args += ["--data", f"{key}={value}"]
    yield rigs, args, tmp
    # New rigs for the modules after this one: a driver, a power unit and a serving unit were
    # put on rig1 and rig2 here, which the later tests (verify's CPU serving) do not expect.
    rigbook("sandbox", "up", str(len(sandbox)))


def test_sweep_three_caps_on_two_rigs_restores_the_units_caps(served, monkeypatch, capsys):
    rigs, args, tmp = served
    monkeypatch.setenv("RIGBOOK_VERIFY_DIR", str(tmp / "results"))
    units = {rig["name"]: unit(rig) for rig in rigs}
    assert {name: set(caps.values()) for name, (_, caps) in units.items()} == {
        "rig1": {290.0}, "rig2": {260.0}}

    # refused before any change: 450 W is above the 3090's 400 W (the 4090 allows it)
    refused = run_pyinfra(SANDBOX_INVENTORY, SWEEP, *args, "--data", "sweep_watts=250,450",
                          "--limit", "rig1")
    assert refused.returncode != 0
    assert "asks 450 W; allowed: the card's range 100-400 W" in refused.stderr
    assert [live(rig) for rig in rigs] == [caps for _, caps in units.values()]

    since = {rig["name"]: rig_ssh(rig, "date '+%Y-%m-%d %H:%M:%S'").stdout.strip() for rig in rigs}
    swept = run_pyinfra(SANDBOX_INVENTORY, SWEEP, *args, *BOTH, "--data", "sweep_watts=250:270:10")
    print(swept.stderr[-3000:])
    assert swept.returncode == 0, swept.explain()
    for rig in rigs:
        text, caps = units[rig["name"]]
        assert live(rig) == caps  # restored, read back from the rig
        assert unit(rig)[0] == text  # the boot unit was never touched
    stored = {run.rig: (path, run) for path, run in load_sweeps()}
    assert sorted(stored) == ["rig1", "rig2"]
    for name, (path, run) in stored.items():
        assert run.ok and run.restored and run.unit_caps_w == units[name][1]
        assert [p.cap_w for p in run.points] == [250.0, 260.0, 270.0]
        assert run.setup.gpu_models and run.setup.engine == "llama.cpp" and run.setup.model
        assert run.setup.driver and run.setup.cooling == "air"
        stored_json = json.loads(path.read_text())
        salts = []
        for point, raw in zip(run.points, stored_json["points"], strict=True):
            assert set(point.live_caps_w.values()) == {point.cap_w}
            assert point.psu == (f"{SIM_HWMON}/hwmon0" if name == "rig1" else None)
            assert [(win.workload, win.prompt) for win in point.windows] == [
                ("decode-single", "narrative"), ("decode-single", "code"),
                ("prefill-heavy", "frozen-long")]
            for win, raw_win in zip(point.windows, raw["windows"], strict=True):
                e = win.evidence
                assert set(raw_win["evidence"]) == set(Evidence.model_fields)  # item 2, whole
                gpus = len(point.live_caps_w)
                assert win.tps.low <= win.tps.mean <= win.tps.high and win.tps.mean > 0
                assert win.tps_per_w.low <= win.tps_per_w.mean <= win.tps_per_w.high
                assert 0 < e.mean_w <= point.cap_w * gpus + 0.01 and e.median_w <= e.p95_w
                assert e.energy_j > 0 and e.temp_c_max is not None and e.sm_mhz_mean
                assert e.util_pct_mean is not None and e.other_processes == ()
                assert e.interval_s is None or e.interval_s <= 0.5 + 0.01
                if name == "rig1":  # the PSU read beside each sample: the host and the cards
                    assert e.psu_samples == e.samples and e.psu_median_w is not None
                    assert e.psu_mean_w == pytest.approx(HOST_W + e.mean_w, abs=0.5)
                else:
                    assert (e.psu_mean_w, e.psu_samples) == (None, 0)
                if win.workload == "decode-single":
                    assert e.seconds == WINDOW_S  # bounded by time, from the first token
                    assert e.samples >= 2 and win.tps.n_eff >= 1 and win.requests >= 1
                    assert win.tokens == pytest.approx(win.tps.mean * WINDOW_S, abs=0.01)
                else:
                    assert win.requests == 2 and len(win.salts) == 2
                    assert 400 <= win.tokens / 2 <= 512  # 40,000 capped by the context
                    salts += win.salts
        assert len(set(salts)) == len(salts) == 6  # per cap and per run
        charts = sorted(path.parent.glob(path.stem + "-*.png"))
        assert [c.name.removeprefix(path.stem) for c in charts] == [
            "-decode-single.png", "-prefill-heavy.png"]
        assert all(c.read_bytes().startswith(b"\x89PNG") for c in charts)

        # the salt, proven by the engine itself: every cold prefill evaluated its whole prompt,
        # and no request of a prefill's size reused more than the chat template's head
        log = rig_ssh(next(rig for rig in rigs if rig["name"] == name),
                      f"journalctl -u {SERVE_UNIT} --since {shlex.quote(since[name])} "
                      "--no-pager -o cat").stdout
        prompt = min(win.tokens / 2 for p in run.points for win in p.windows
                     if win.workload == "prefill-heavy")
        evaluated = [int(n) for n in EVALUATED.findall(log)]
        assert sum(n >= 0.9 * prompt for n in evaluated) >= 6, evaluated
        hits = [(int(h), int(r)) for h, r in PREFIX_HIT.findall(log)]
        big = [(h, r) for h, r in hits if h + r >= 0.9 * prompt]
        assert all(h <= 16 for h, _ in big), big
    assert "suggested for decode-single" in swept.stderr
    assert f"whole-system power: corsairpsu ({SIM_HWMON}/hwmon0), windows' means" in swept.stderr
    assert AC_NOTE in swept.stderr and "whole-system power: none found" in swept.stderr
    assert "| GPU | Cooling | Engine | Model | Cap | Narr TPS | Code TPS | TPS/W | Source |" in (
        swept.stderr)

    capsys.readouterr()
    assert cli.main(["bench", "sweep", "--rig", "rig2"]) == 0
    out = capsys.readouterr().out
    assert "pyinfra INVENTORY deploys/power_cap.py --limit rig2 --data power_cap_watts=" in out


def test_a_killed_sweep_leaves_the_units_caps_once_the_guard_runs(served, tmp_path):
    rigs, args, _ = served
    rig = rigs[0]
    _, caps = unit(rig)
    said = tmp_path / "pyinfra.log"
    sweep = subprocess.Popen(
        [PYINFRA, "-y", SANDBOX_INVENTORY, SWEEP, *args, "--limit", "rig1", "--data",
         "sweep_watts=200:300:10"],
        cwd=ROOT, stdout=said.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYINFRA_PROGRESS": "off",
             "RIGBOOK_VERIFY_DIR": str(tmp_path / "results")},
    )
    try:
        deadline = time.monotonic() + 120
        while set(live(rig).values()) != {210.0}:  # the second cap: mid-sweep
            assert sweep.poll() is None, said.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)  # the operator's pyinfra, gone without a word
        sweep.wait()
    assert live(rig) != caps  # mid-sweep, and nobody restored them yet
    waited = time.monotonic()
    rig_ssh(rig, f"for i in $(seq {4 * (TIMEOUT_S + LEASE_MARGIN_S + 10)}); do "
                 f"[ -f {SWEEP_DIR}/restored.json ] && break; sleep 0.25; done; "
                 f"cat {SWEEP_DIR}/restored.json")
    assert time.monotonic() - waited < TIMEOUT_S + LEASE_MARGIN_S + 5
    assert live(rig) == caps
    assert rig_ssh(rig, "pgrep -f 'sweep_rig[.]py' || true").stdout.strip() == ""
    assert Path(tmp_path / "results").exists() is False  # the killed run stored nothing


def test_the_guard_outlives_the_ssh_login_where_logind_kills_its_processes(sandbox):
    """Issue 29, finding 7. logind with KillUserProcesses=yes stops a login's session scope when
    the login ends, which kills every process in it (what `setsid` starts stays there). The
    rigs' logins are no logind sessions (no pam_systemd), so a transient scope stands in for
    one and `systemctl stop` of it for the logout: the guard started the old way (setsid -f)
    dies with it and writes no record; started as the sweep starts it now (a unit of its own),
    it lives on, and restores when the lease is released. No cap is touched: the unit it reads
    does not exist, so its record says so."""
    from rigbook.rigside import cap_check

    rig, scope = sandbox["rig1"], "rigbook-test-login.scope"
    # A folder of its own: a sweep's folder may hold its `closed` (no lease is taken then).
    folder, missing_unit = "/run/rigbook-test-sweep", "/run/rigbook-test-no-power.service"

    def in_login(command: str) -> None:
        rig_ssh(rig, f"systemd-run --scope --quiet --unit={scope} -- sh -c {shlex.quote(command)}")

    def guard_alive() -> bool:
        return rig_ssh(rig, f'kill -0 "$(cat {folder}/guard.pid)"', check=False).returncode == 0

    rig_ssh(rig, f"rm -rf {folder} && mkdir -m 700 {folder}")
    for source in (RIG_PROGRAM, Path(cap_check.__file__)):
        ssh_with_input(rig, f"cat > {folder}/{Path(source).name}", Path(source).read_bytes())
    try:
        rig_ssh(rig, lease_command(600, folder))
        in_login(f"cd {folder} && setsid -f /usr/bin/python3 -I sweep_rig.py guard --unit "
                 f"{missing_unit} --dir {folder} </dev/null >/dev/null 2>&1 && for i in "
                 "$(seq 100); do [ -s guard.pid ] && exit 0; sleep 0.1; done; exit 1")
        assert guard_alive()
        rig_ssh(rig, f"systemctl stop {scope}")  # the logout, as logind does it
        assert not guard_alive()  # the finding: killed with the login
        rig_ssh(rig, lease_command(None, folder))
        time.sleep(1)
        assert rig_ssh(rig, f"test -e {folder}/restored.json", check=False).returncode != 0

        rig_ssh(rig, f"rm -f {folder}/guard.pid {folder}/closed && " + lease_command(600, folder))
        in_login(guard_command(missing_unit, folder).get_raw_value())
        assert guard_alive()
        rig_ssh(rig, f"systemctl stop {scope}", check=False)  # the scope may be gone already
        assert guard_alive()  # in its own unit: the logout did not reach it
        assert rig_ssh(rig, f"systemctl is-active {GUARD_UNIT}").stdout.strip() == "active"
        rig_ssh(rig, lease_command(None, folder))
        record = rig_ssh(rig, f"for i in $(seq 100); do [ -f {folder}/restored.json ] && "
                              f"break; sleep 0.1; done; cat {folder}/restored.json").stdout
        assert json.loads(record)["errors"] == [f"cannot read {missing_unit}: No such file or "
                                                "directory"]
        time.sleep(0.5)  # --collect: the unit is gone once the guard exited, failed or not
        state = rig_ssh(rig, f"systemctl show -p LoadState --value {GUARD_UNIT}").stdout.strip()
        assert state == "not-found"
    finally:
        rig_ssh(rig, f"systemctl stop {scope} {GUARD_UNIT} 2>/dev/null; "
                     f"systemctl reset-failed {GUARD_UNIT} 2>/dev/null; rm -rf {folder}",
                check=False)
