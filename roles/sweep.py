"""Power sweep: the cap that gives the most tokens per watt, measured on the rig's own serving.

deploys/power_sweep.py, per rig (docs/sweep.md):

1. the preflight (`SWEEP_CHECKS`) refuses the rig before anything changes when any cap
   (`sweep_watts`, or by default every card's whole range at 10 W, or for a card class no
   source measured 60-85 % of its default limit: `plan_caps`) lies outside any card's own
   min/max, when no boot unit caps every GPU (the caps could not be restored; without systemd
   none can), or when persistence mode is off; a step over 20 W is a warning;
2. a guard is started on the rig as a unit of its own (files/power/sweep_rig.py under
   `systemd-run`, outside the SSH login, which logind may kill when it ends): it holds
   a lease that the sweep renews before every request, and once the sweep releases it, or the
   lease lapses because the operator's pyinfra died, it sets every live cap back to what
   nvidia-power-limit.service says, naming in its record each GPU it could not set back
   (a hung or missing nvidia-smi); where that record is missing or leaves a GPU out, the sweep
   sets those caps itself and fails the rig;
3. with sweep_concurrency_probe, first, at the unit's caps: decode windows at 1, 2, 4, ...
   streams, whose plateau (the smallest level within noise of the best) the decode-concurrent
   windows then run at; per cap: the live cap of every GPU (`nvidia-smi -i UUID -pl W`, never
   the unit), then the sources' protocol while a meter on the rig samples the draw, the cards'
   state and a PSU's DC output where one reports it (corsairpsu): decode
   windows of sweep_window_s timed from the first token (narrative and code, at 1 stream and at
   verify_bench_concurrency where the engine allows it), and cold prefills of one frozen long
   prompt with a new salt at its very start each time (no cached prefix to hit);
4. the restore is read back and the run stored as JSON beside the verify results
   (rigbook.roles.sweepresult: each window's evidence and intervals, the suggestion, the diagnosis),
   with a chart per workload class (rigbook.roles.charts).
"""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests
from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, QuoteString, StringCommand, deploy, operation

from rigbook import FILES
from rigbook.core.checks import Check, Facts, Finding, Read, error, warn
from rigbook.core.errors import RigbookError
from rigbook.core.facts import GPUS, GPUS_READ, NvidiaGpus, count_finding, usable
from rigbook.core.managed import directory_commands, expect, put_commands
from rigbook.core.messages import refused, warn_once
from rigbook.core.spec import MAX_CAPS, SWEET_SPOTS, Rig
from rigbook.core.tools import TOOLS_PYTHON
from rigbook.core.units import SYSTEMD_READ, outside_login
from rigbook.rigside import cap_check
from rigbook.roles.charts import write_charts
from rigbook.roles.power import (
    UNIT_NAME,
    UNIT_PATH,
    UNIT_READ,
    GpuCap,
    PowerUnitFile,
    _set_cap,
    same_w,
    unit_caps,
)
from rigbook.roles.power import watts as w
from rigbook.roles.recipes import recipe_for
from rigbook.roles.serving import UNIT_NAME as SERVE_UNIT
from rigbook.roles.sweepresult import (
    ConcurrencyProbe,
    Rigs,
    Sample,
    SweepPoint,
    SweepRun,
    decode_window,
    diagnosis,
    plateau_level,
    prefill_window,
    probe_levels,
    probe_line,
    psu_line,
    resolvable_w,
    samples_of,
    suggestions,
    summary_rows,
    sweep_path,
)
from rigbook.roles.verify import (
    BENCH_PROMPTS,
    Client,
    Ladder,
    Settings,
    StepFailed,
    Target,
    haystack_words,
    stream_events,
    truncate,
)

SWEEP_DIR = "/run/rigbook-sweep"  # tmpfs: gone at boot, as the live caps are
RIG_PROGRAM = FILES / "power" / "sweep_rig.py"
#: The lease outlives the longest request by this much (s); then the guard restores the caps.
LEASE_MARGIN_S = 5
#: The lease is renewed at most this often (s).
RENEW_EVERY_S = 3
#: The guard's transient unit (systemd-run): outside the SSH login, gone once it exited.
GUARD_UNIT = "rigbook-sweep-guard.service"
#: A `-pl` call on the rig is given up after this long (s); the guard's own default too.
SMI_TIMEOUT_S = 20
#: How often the meter samples the draw (s): twice as often as the sources' 0.5 s.
METER_INTERVAL_S = 0.25
#: The meter is waited on this long (s) to write its last sample (a loaded rig is slow).
METER_WAIT_S = 60
#: The default sweep's step (W), the hardware notes' resolution; a wider one is warned about.
STEP_W = 10
WIDE_STEP_W = 20


@dataclass(frozen=True)
class SweepSettings:
    """The protocol's knobs (host data sweep_*)."""

    window_s: float = 10.0
    prefill_tokens: int = 40000

    @classmethod
    def of(cls, rig: Rig) -> SweepSettings:
        return cls(window_s=float(rig.sweep_window_s), prefill_tokens=rig.sweep_prefill_tokens)


def default_caps(gpus: Iterable) -> tuple[float, ...]:
    """The whole range every card allows (the highest minimum to the lowest maximum) at 10 W,
    both ends included; the step widened where that would be more than MAX_CAPS caps."""
    lows = [g.min_limit_w for g in gpus if g.min_limit_w is not None]
    highs = [g.max_limit_w for g in gpus if g.max_limit_w is not None]
    if not lows or not highs or max(lows) > min(highs):
        return ()
    low, high = max(lows), min(highs)
    step = STEP_W * max(1, math.ceil((high - low) / STEP_W / (MAX_CAPS - 1)))
    caps = [round(low + i * step, 2) for i in range(int((high - low) // step) + 1)]
    return tuple(sorted(set(caps) | {round(high, 2)}))[-MAX_CAPS:]


#: The card classes a source swept (the hardware notes' measured sweet spots): for them the
#: default is the whole range; for any other, the first range below.
MEASURED = frozenset(card for card, _ in SWEET_SPOTS)
#: The notes' advice for a new card class: start at 60-85 % of the card's stock limit, where
#: their knee fell on consumer Ampere and Ada.
FIRST_RANGE = (0.60, 0.85)


def first_range(gpus: Iterable) -> tuple[float, ...]:
    """60-85 % of the lowest default limit of the cards, at 10 W, inside every card's range; ()
    where a card reports no default limit or the share falls outside the range."""
    gpus = list(gpus)
    whole = default_caps(gpus)
    defaults = [g.default_limit_w for g in gpus]
    if not whole or not defaults or None in defaults:
        return ()
    low = max(STEP_W * math.ceil(FIRST_RANGE[0] * min(defaults) / STEP_W), whole[0])
    high = min(STEP_W * math.floor(FIRST_RANGE[1] * min(defaults) / STEP_W), whole[-1])
    return tuple(float(c) for c in range(int(low), int(high) + 1, STEP_W)) if low <= high else ()


def plan_caps(rig: Rig, gpus: Iterable) -> tuple[tuple[float, ...], str]:
    """What this run sweeps and why: sweep_watts; for a class no source measured, the first
    range; else the cards' whole range."""
    gpus = list(gpus)
    if rig.sweep_watts:
        return rig.sweep_watts, "sweep_watts"
    whole = default_caps(gpus)
    first = first_range(gpus) if rig.gpu_class not in MEASURED else ()
    if first:
        default = min(g.default_limit_w for g in gpus)
        return first, (f"no source measured gpu_class {rig.gpu_class}: the first range is 60-85 % "
                       f"of the card's default limit {w(default)} W at {STEP_W} W (the hardware "
                       "notes' advice for a new card class); the whole range is sweep_watts="
                       f"{w(whole[0])}:{w(whole[-1])}:{STEP_W}")
    return whole, f"the cards' whole range at {STEP_W} W"


def caps_of(rig: Rig, gpus: Iterable) -> tuple[float, ...]:
    """What this run sweeps (plan_caps)."""
    return plan_caps(rig, gpus)[0]


# --- what to sweep -----------------------------------------------------------------------------


def save_sweep(run: SweepRun, root: Path | None = None) -> tuple[Path, list[Path] | str]:
    """The JSON and, beside it, a chart per workload class (or why there are none)."""
    path = sweep_path(run, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run.model_dump_json(indent=2) + "\n")
    return path, write_charts(run, path.parent, path.stem) if run.points else []


# --- the checks ----------------------------------------------------------------------------------


#: Without systemd no boot unit can exist: the caps are the host's or only live, and the guard
#: that restores them is a transient unit itself.
NO_UNIT_HERE = (
    f"no systemd as PID 1: no {UNIT_NAME} can hold the caps here (the host or the live state "
    "owns them), so the sweep has nothing to set them back to afterwards, and its guard runs "
    "under systemd-run; allowed: a rig with systemd whose caps rigbook manages "
    "(docs/no-systemd.md)"
)


def sweep_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """Why the sweep may not touch this rig: WSL2, no systemd (no unit can exist), a cap
    outside a card's range, no unit that caps every GPU (nothing to restore to), persistence
    mode off."""
    if rig.platform == "wsl2":
        return [error("sweep", "WSL2: the Windows driver owns the caps (docs/power.md); "
                      "allowed: a Linux rig", key="platform")]
    if facts.systemd is False:
        return [error("sweep", NO_UNIT_HERE)]
    if facts.missing("probe", "unit") or not usable(facts.probe):
        return facts.missing("probe", "unit")  # the GPU check says why there are no GPUs
    gpus = facts.probe.gpus
    found = [count] if (count := count_finding(rig, gpus)) else []
    restore_to = unit_caps(facts.unit.exec_starts)[0] if facts.unit else {}
    if facts.unit is None:
        found.append(error("sweep", f"no {UNIT_NAME}: nothing to restore the caps to after the "
                           "sweep; allowed: a rig whose caps rigbook manages (deploys/power_cap.py"
                           " or deploys/rig.py first)"))
    caps = caps_of(rig, gpus)
    wide = [(a, b) for a, b in zip(caps, caps[1:], strict=False) if b - a > WIDE_STEP_W]
    if wide:
        shown = ", ".join(f"{w(a)}-{w(b)}" for a, b in wide[:3])
        found.append(warn("sweep", f"steps over {WIDE_STEP_W} W ({shown} W): too coarse to pin "
                          f"down the efficiency knee (the hardware notes sweep at {STEP_W} W); "
                          f"leave sweep_watts out to sweep the cards' whole range at {STEP_W} W",
                          key="sweep_watts"))
    for gpu in gpus:
        label = f"GPU {gpu.index} ({gpu.uuid})"
        if facts.unit is not None and gpu.uuid not in restore_to:
            found.append(error("sweep", f"{label}: {UNIT_NAME} does not cap it, so its cap could"
                               " not be restored; allowed: GPUs the unit caps (deploys/power_cap"
                               ".py)", gpu=gpu.uuid))
        if gpu.min_limit_w is None or gpu.max_limit_w is None:
            found.append(error("sweep", f"{label}: the card reports no power limit range, so it "
                               "cannot be capped", key="sweep_watts", gpu=gpu.uuid))
            continue
        outside = [cap for cap in caps
                   if not gpu.min_limit_w <= cap <= gpu.max_limit_w]
        if outside:
            found.append(error(
                "sweep", f"{label} asks {', '.join(w(cap) for cap in outside)} W; allowed: the "
                f"card's range {w(gpu.min_limit_w)}-{w(gpu.max_limit_w)} W", key="sweep_watts",
                gpu=gpu.uuid))
        if gpu.persistence is False:
            found.append(error("sweep", f"{label}: persistence mode is Disabled: a cap does not "
                               "hold between processes; allowed: driver_persistence: true "
                               "(deploys/rig.py)", key="driver_persistence", gpu=gpu.uuid))
    return found


def _reads(rig: Rig, rig_name: str) -> list[Read]:
    return [GPUS_READ, UNIT_READ, SYSTEMD_READ]


#: The sweep's preflight, for its own job only: the registry gives the sweep role no checks for
#: `rigbook status`, as the caps of a sweep are a run's option, not a state of the rig to report.
SWEEP_CHECKS = (GPUS, Check("power sweep", _reads, sweep_findings, gpus=True))


# --- what a sweep stores: rigbook.roles.sweepresult -----------------------------------------------


def apply_command(rig: str, cap_w: float) -> str:
    """The follow-up that applies a suggestion (the sweep never applies one itself)."""
    return f"pyinfra INVENTORY deploys/power_cap.py --limit {rig} --data power_cap_watts={w(cap_w)}"


# --- on the rig ----------------------------------------------------------------------------------


def _sh(host_, *parts: Any) -> tuple[bool, str]:
    """Run one command on the rig; (ok, stdout and stderr)."""
    ok, output = host_.run_shell_command(StringCommand(*parts))
    return ok, "\n".join(output.stdout_lines + output.stderr_lines)


def lease_command(seconds: int | None, folder: str = SWEEP_DIR) -> str:
    """Shell that holds the guard's lease `seconds` from now (the rig's clock), or releases it
    (None): JSON written whole, then renamed, as the guard reads it. A lease is not renewed once
    the guard has closed (it is restoring, or has)."""
    if seconds is None:
        body = """printf '{"release": true}'"""
    else:
        deadline = f'"$(( $(date +%s) + {int(seconds)} ))"'
        body = (f"[ ! -e {folder}/closed ] && "
                f"""printf '{{"deadline": %s, "release": false}}' {deadline}""")
    return f"{body} > {folder}/lease.tmp && mv {folder}/lease.tmp {folder}/lease"


def guard_command(unit: str = UNIT_PATH, folder: str = SWEEP_DIR) -> StringCommand:
    """Shell that starts the guard as a unit of its own (outside the SSH login: logind with
    KillUserProcesses=yes kills a login's processes when it ends) and waits until it runs."""
    guard = outside_login(GUARD_UNIT, "/usr/bin/python3", "-I", f"{folder}/sweep_rig.py", "guard",
                          "--unit", QuoteString(unit), "--dir", QuoteString(folder),
                          "--smi-timeout", str(SMI_TIMEOUT_S))
    return StringCommand("cd", QuoteString(folder), "&&", guard, "2>&1 && for i in $(seq 100); "
                         "do [ -s guard.pid ] && exit 0; sleep 0.1; done; echo the guard did not "
                         "start; exit 1")


def _lease(host_, seconds: int | None) -> bool:
    return _sh(host_, lease_command(seconds))[0]


def probe_skipped(engine: str, levels: list[int]) -> str | None:
    """Why the concurrency probe cannot run on this engine or recipe (None: it can)."""
    if engine == "llama.cpp":
        return "skipped (llama.cpp: one stream at a time)"
    return "skipped (the recipe's max_num_seqs is 1)" if len(levels) < 2 else None


class LeasedClient(Client):
    """The verify client, renewing the guard's lease before its requests (at most every few
    seconds): while requests go out the caps stay; when they stop, the guard restores them."""

    def __init__(self, target: Target, timeout_s: float, renew: Callable[[], None]) -> None:
        super().__init__(target, timeout_s)
        self.renew, self.renewed, self.lock = renew, 0.0, threading.Lock()

    def post(self, path: str, body: dict, *, stream: bool = False) -> requests.Response:
        with self.lock:
            if time.monotonic() - self.renewed > RENEW_EVERY_S:
                self.renew()
                self.renewed = time.monotonic()
        return super().post(path, body, stream=stream)


class _Sweep:
    """One rig's sweep while the deploy executes."""

    def __init__(self, host_, rig: Rig, target: Target, settings: Settings,
                 smi: str, gpus: tuple, unit: dict[str, float]) -> None:
        self.host, self.rig, self.target, self.settings = host_, rig, target, settings
        self.settings_sweep = SweepSettings.of(rig)
        self.long_prompt: str | None = None  # frozen for the whole run: only the salt differs
        self.smi, self.gpus, self.unit = smi, gpus, unit
        self.lease_s = int(settings.timeout_s) + LEASE_MARGIN_S
        self.ladder = Ladder(target, settings)
        self.ladder.client = LeasedClient(target, settings.timeout_s, self.renew)
        self.points: list[SweepPoint] = []
        self.probe: ConcurrencyProbe | None = None
        self.armed = False
        self.undone: str | None = None  # what the guard's restore left undone (guard_undone)

    def log(self, line: str) -> None:
        logger.info(f"{self.host.print_prefix}sweep {line}")

    def renew(self) -> None:
        if not _lease(self.host, self.lease_s):
            raise RigbookError("the sweep's lease could not be renewed: the guard restored the "
                               "caps (a step outlived the lease, verify_timeout_s + 5 s)")

    def arm(self) -> None:
        """The lease, then the guard: a unit of its own, so it outlives this SSH login even
        where logind kills a login's processes with it (KillUserProcesses=yes)."""
        _sh(self.host, f"cd {SWEEP_DIR} && rm -f restored.json closed guard.pid")
        self.renew()
        ok, said = _sh(self.host, guard_command())
        if not ok:
            raise RigbookError(f"could not start the cap guard on the rig: {truncate(said)}")
        self.armed = True

    def set_caps(self, cap_w: float) -> dict[str, float | None]:
        """Each card at `cap_w`, under a lease: a cap set while the guard closed is set back."""
        self.renew()
        self._set_all(cap_w)
        if _sh(self.host, f"[ -e {SWEEP_DIR}/closed ]")[0]:
            for gpu in self.gpus:
                self._set_all(self.unit[gpu.uuid], (gpu,))
            raise RigbookError("the guard restored the caps while a step began: the sweep stops")
        live = self.live()
        wrong = [u for u, v in live.items() if not same_w(v, cap_w)]
        if wrong:
            raise RigbookError(f"asked {w(cap_w)} W, read back {live}")
        return live

    def _set_all(self, cap_w: float, gpus: tuple | None = None) -> None:
        for gpu in gpus or self.gpus:
            cap = GpuCap(index=gpu.index, uuid=gpu.uuid, name=gpu.name, watts=cap_w,
                         source="sweep_watts", live_w=gpu.power_limit_w, min_w=gpu.min_limit_w,
                         max_w=gpu.max_limit_w)
            if not _set_cap(state, self.host, self.smi, cap):
                raise RigbookError(f"{cap.label}: the cap {w(cap_w)} W did not take")

    def live(self) -> dict[str, float | None]:
        probe = self.host.get_fact(NvidiaGpus)
        return {g.uuid: g.power_limit_w for g in (probe.gpus if probe is not None else ())}

    def meter_start(self, name: str) -> float:
        """Start the meter; the rig's clock minus this machine's (s)."""
        before = time.time()
        ok, said = _sh(self.host, f"cd {SWEEP_DIR} && rm -f {name}.stop {name}.jsonl {name}.done"
                                  f" && py=python3 && if [ -x {TOOLS_PYTHON} ]; then "
                                  f'py={TOOLS_PYTHON}; fi && setsid -f "$py" sweep_rig.py meter '
                                  f"--dir {SWEEP_DIR} --name {name} --interval {METER_INTERVAL_S}"
                                  f" --engine-unit {SERVE_UNIT} --hwmon",
                       QuoteString(self.rig.sweep_hwmon_dir), "--smi", QuoteString(self.smi),
                       "</dev/null >/dev/null 2>&1 && date +%s.%N")
        after = time.time()
        try:
            return float(said.strip().splitlines()[-1]) - (before + after) / 2
        except (ValueError, IndexError):
            raise RigbookError(f"could not start the draw meter: {truncate(said)}") from None

    def meter_stop(self, name: str) -> tuple[str, str | None, list[Sample]]:
        """Stop the meter and read what it took: (source, PSU folder, samples). It writes as it
        samples, so a meter slowed by a loaded machine still hands back every sample it took."""
        ok, said = _sh(self.host, f"cd {SWEEP_DIR} && touch {name}.stop && for i in $(seq "
                                  f"{METER_WAIT_S * 10}); do [ -f {name}.done ] && break; "
                                  f"sleep 0.1; done; cat {name}.jsonl && rm -f {name}.jsonl "
                                  f"{name}.stop {name}.done")
        lines = []
        for line in said.splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        header = next((x for x in lines if isinstance(x, dict)), {})
        samples = samples_of(lines)
        if not samples:
            raise RigbookError(f"the draw meter took no sample: {truncate(said)}")
        psu = header.get("psu")
        return str(header.get("source")), psu if isinstance(psu, str) else None, samples

    def decode(self, prompt: str, level: int, offset: float) -> tuple[float, int, list]:
        """`level` streams of `prompt`, new requests while the window runs: the window is
        window_s from the first token. (begin, requests, [(rig time, tokens)])."""
        window_s, tokens = self.settings_sweep.window_s, self.settings.bench_tokens
        lock, chunks, state_ = threading.Lock(), [], {"begin": None, "requests": 0}

        def over() -> bool:
            begin = state_["begin"]
            return begin is not None and time.time() + offset >= begin + window_s

        def stream() -> None:
            while not over():
                events, usage = stream_events(self.ladder.client, BENCH_PROMPTS[prompt], tokens,
                                              clock=time.time)
                weight = (usage or len(events)) / len(events)
                with lock:
                    state_["requests"] += 1
                    first = events[0][0] + offset
                    if state_["begin"] is None or first < state_["begin"]:
                        state_["begin"] = first
                    chunks.extend((t + offset, weight) for t, _ in events)

        with ThreadPoolExecutor(max_workers=level) as pool:
            for job in [pool.submit(stream) for _ in range(level)]:
                job.result()
        return state_["begin"], state_["requests"], chunks

    def prefill(self, offset: float) -> list[tuple[str, int, float, float]]:
        """bench_runs cold prefills of the frozen long prompt, a new salt at its very start each
        time: no request shares a cached prefix with another (salt, tokens, begin, end)."""
        runs = []
        for _ in range(self.settings.bench_runs):
            salt = secrets.token_hex(8)
            begin = time.time() + offset
            response = self.ladder.client.chat(f"{salt} {self.long_prompt}", max_tokens=1)
            end = time.time() + offset
            data = response.json() if response.status_code == 200 else {}
            usage = (data.get("usage") or {}).get("prompt_tokens")
            if not isinstance(usage, int):
                raise StepFailed("prefill", "a cold prefill answered with usage.prompt_tokens",
                                 truncate(response.text))
            runs.append((salt, usage, begin, end))
        return runs

    def probe_concurrency(self, max_seqs: int | None) -> str:
        """Before any cap is set: narrative decode windows at 1, 2, 4, ... streams at the unit's
        caps; the plateau becomes the decode-concurrent level. Why not, where it cannot run."""
        levels = probe_levels(max_seqs)
        if skipped := probe_skipped(self.target.engine, levels):
            return f"concurrency probe {skipped}"
        live = self.live()
        self.ladder.warm_up("narrative")
        offset = self.meter_start("probe")
        try:
            decoded = [(level, *self.decode("narrative", level, offset)) for level in levels]
        finally:
            _, _, samples = self.meter_stop("probe")
        cap = max((v for v in live.values() if v is not None), default=0.0)
        windows = tuple(decode_window("decode-concurrent", "narrative", level, requests, chunks,
                                      begin, self.settings_sweep.window_s, samples, cap)
                        for level, begin, requests, chunks in decoded)
        self.probe = ConcurrencyProbe(caps_w=live, windows=windows,
                                      plateau=plateau_level(windows))
        return probe_line(self.probe)

    def point(self, cap_w: float) -> SweepPoint:
        self.renew()
        live = self.set_caps(cap_w)
        name = f"cap-{w(cap_w).replace('.', '_')}"
        levels, _ = self.ladder.levels()
        if self.probe is not None:
            levels = sorted({1, self.probe.plateau})
        if self.long_prompt is None:
            want = min(self.settings_sweep.prefill_tokens, self.ladder.context - 64)
            self.long_prompt = haystack_words(self.ladder.sizer.words(want))
        for prompt in BENCH_PROMPTS:
            self.ladder.warm_up(prompt)  # outside the meter: warm-up is no window
        offset = self.meter_start(name)
        decoded, filled = [], []
        try:
            for level in levels:
                for prompt in BENCH_PROMPTS:
                    decoded.append((prompt, level, *self.decode(prompt, level, offset)))
            filled = self.prefill(offset)
        finally:
            source, psu, samples = self.meter_stop(name)
        window_s = self.settings_sweep.window_s
        windows = [decode_window("decode-single" if level == 1 else "decode-concurrent", prompt,
                                 level, requests, chunks, begin, window_s, samples, cap_w)
                   for prompt, level, begin, requests, chunks in decoded]
        windows.append(prefill_window(filled, samples, cap_w, "frozen-long"))
        for win in windows:
            e = win.evidence
            self.log(f"{w(cap_w)} W {win.workload} {win.prompt}: {win.tps.mean:.1f} tok/s "
                     f"({win.tps.low:.1f}-{win.tps.high:.1f}), {e.mean_w:.1f} W mean over "
                     f"{e.seconds:.1f} s ({e.samples} samples), {win.tps_per_w.mean:.4f} tok/s/W"
                     + (f", PSU {e.psu_mean_w:.1f} W DC" if e.psu_mean_w is not None else "")
                     + (f"; OTHER GPU LOAD: {', '.join(e.other_processes)}"
                        if e.other_processes else ""))
        return SweepPoint(cap_w=cap_w, live_caps_w=live, meter=source, windows=tuple(windows),
                          psu=psu)

    def release(self) -> tuple[bool, str]:
        """Release the lease, wait for the guard's restore, read the caps back against the unit.
        Where the guard's record is missing or leaves a GPU out, this side sets those GPUs to
        the unit's caps itself and `self.undone` says what the guard did not do."""
        said = "no guard: no cap was set"
        if self.armed:
            _lease(self.host, None)
            tries = 10 * (SMI_TIMEOUT_S * len(self.unit) + 30)  # the guard's worst case
            said = _sh(self.host, f"cd {SWEEP_DIR} && for i in $(seq {tries}); do [ -f "
                                  "restored.json ] && break; kill -0 \"$(cat guard.pid)\" || "
                                  "break; sleep 0.1; done 2>/dev/null; cat restored.json")[1]
            left = guard_left(said, self.unit)
            if left:
                self.undone = "the cap guard did not restore " + "; ".join(
                    f"{uuid} ({truncate(why)})" for uuid, why in left)
                self.host.log_styled(f"{self.host.name}: {self.undone}; setting {UNIT_NAME}'s "
                                     "caps from here", fg="red", log_func=logger.error)
            for uuid, _ in left:
                _sh(self.host, f"timeout -k 5 {SMI_TIMEOUT_S}", QuoteString(self.smi), "-i",
                    QuoteString(uuid), "-pl", f"{self.unit[uuid]:g}")
        live = self.live()
        wrong = {u: v for u, want in self.unit.items() if not same_w(v := live.get(u), want)}
        if wrong:
            return False, (f"live caps {wrong} differ from {UNIT_NAME} {self.unit} after the "
                           f"restore ({truncate(said)}); deploys/power_cap.py sets them again")
        return True, "live caps as " + UNIT_NAME + " says: " + ", ".join(
            f"{u} {w(v)} W" for u, v in self.unit.items())


def guard_left(said: str, unit: dict[str, float]) -> list[tuple[str, str]]:
    """The unit's GPUs the guard's restore record (restored.json, as `said`) does not name as
    restored, each with why: a missing record, one that does not parse, or one that is not
    complete leaves every GPU it does not name restored."""
    try:
        record = json.loads(said)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("restored"), list):
        return [(uuid, "no restore record: the guard died or hung") for uuid in unit]
    named = record.get("not_restored")
    named = named if isinstance(named, dict) else {}
    complete = record.get("complete") is True
    return [(uuid, str(named.get(uuid, "not in its record" if complete else
                                 "its record is incomplete")))
            for uuid in unit if uuid not in record["restored"] or not complete]


def _run(state, host, rig: Rig, target: Target, settings: Settings, root: Path | None) -> bool:
    """FunctionCommand body: the whole sweep of one rig, the restore always last (pyinfra
    passes `state` and `host` to a body whose parameters are so named)."""
    probe = host.get_fact(NvidiaGpus)
    unit = host.get_fact(PowerUnitFile)
    if probe is None or not probe.gpus or unit is None:  # the preflight saw them: gone since
        host.log_styled(f"{host.name}: sweep refused: the GPUs or {UNIT_NAME} are gone since "
                        "the preflight; nothing was changed", fg="red", log_func=logger.error)
        return False
    restore_to = unit_caps(unit.exec_starts)[0]
    caps = caps_of(rig, probe.gpus)
    sweep = _Sweep(host, rig, target, settings, probe.smi, probe.gpus, restore_to)
    started, clock, failure = datetime.now(UTC), time.monotonic(), None
    try:
        sweep.arm()
        sweep.ladder.health()
        if rig.sweep_concurrency_probe:
            sweep.log(sweep.probe_concurrency(recipe_for(rig, host.name).max_num_seqs))
        for cap_w in caps:
            sweep.points.append(sweep.point(cap_w))
    except (StepFailed, RigbookError, requests.RequestException, ValueError) as failed:
        failure = truncate(str(failed))
        host.log_styled(f"{host.name}: sweep stopped: {failure}", fg="red",
                        log_func=logger.error)
    finally:
        restored, detail = sweep.release()
        run = SweepRun(
            rig=host.name, recipe=target.recipe, url=target.url,
            setup=setup_of(rig, host.name, target, probe), caps_asked_w=caps,
            window_s=sweep.settings_sweep.window_s,
            prefill_tokens=sweep.settings_sweep.prefill_tokens, started=started,
            seconds=round(time.monotonic() - clock, 3), points=tuple(sweep.points),
            error=failure or sweep.undone, unit_caps_w=restore_to, restored=restored,
            restore_detail=detail, concurrency=sweep.probe,
        )
        path, charts = save_sweep(run, root)
    if sweep.undone:  # loud even when this side then set the caps: the guard failed its job
        host.log_styled(f"{host.name}: sweep FAILED: {sweep.undone}; after setting them from "
                        f"here: {detail}", fg="red", log_func=logger.error)
        return False
    if not restored:
        host.log_styled(f"{host.name}: caps NOT restored: {detail}", fg="red",
                        log_func=logger.error)
        return False
    sweep.log(f"restored: {detail}; stored {path}")
    sweep.log("charts: " + (", ".join(map(str, charts)) if isinstance(charts, list) else charts))
    for line in report_lines(run):
        sweep.log(line)
    return failure is None


def report_lines(run: SweepRun) -> list[str]:
    """The suggestion per class (with the caps within noise), the diagnosis lines, the
    resolvable difference and the paste-ready summary rows."""
    lines = [probe_line(run.concurrency)] if run.concurrency else []
    for workload, suggestion in suggestions(run).items():
        lines.append(f"suggested for {workload}: {w(suggestion.least_w)} W ({suggestion.text()})"
                     f"; to apply: {apply_command(run.rig, suggestion.least_w)}")
        lines += diagnosis(run, workload)
    lines.append(psu_line(run))
    if (resolved := resolvable_w(run)) is not None:
        lines.append(f"this sweep resolves draw differences of ~{resolved:g} W (95 %, the median "
                     f"of its {run.window_s:g} s windows); a smaller one is noise")
    return lines + summary_rows(run)


def setup_of(rig: Rig, rig_name: str, target: Target, probe) -> Rigs:
    """The columns that set this sweep beside other rigs' (the hardware notes' anchor rows)."""
    recipe = recipe_for(rig, rig_name)
    return Rigs(gpu_models=tuple(g.name for g in probe.gpus), cooling=rig.cooling,
                engine=target.engine, engine_build=recipe.venv, model=recipe.model.repo,
                driver=probe.driver_version)


@operation(is_idempotent=False)
def sweep_caps(rig: Rig, target: Target, settings: Settings, root: str | None = None):
    """
    Sweep the live power cap over ``rig.sweep_watts`` and bench each step; restore the caps.

    + rig: the rig's validated host data (``sweep_watts``, the verify_* bench settings)
    + target: the running recipe as this machine reaches it (``rigbook.roles.verify.verify_plan``)
    + settings: the bench settings
    + root: results folder; none = ``rigbook.roles.verify.results_dir()``

    Copies the guard and meter (files/power/sweep_rig.py, with rigbook/rigside/cap_check.py) to
    /run/rigbook-sweep, then, when the deploy executes: starts the guard detached, sets each
    cap live (never the unit), benches it while the meter samples the draw, and releases the
    guard, which sets every live cap back to nvidia-power-limit.service's and is read back.
    """
    probe = host.get_fact(NvidiaGpus)
    if not state.is_executing and probe is not None:  # --dry: the caps it would set, per GPU
        warn_once(f"sweep range: {plan_caps(rig, probe.gpus)[1]}")
        if rig.sweep_concurrency_probe:
            levels = probe_levels(recipe_for(rig, host.name).max_num_seqs)
            warn_once("sweep concurrency probe first, at the current cap: " + (
                probe_skipped(target.engine, levels)
                or f"{', '.join(map(str, levels))} streams; the plateau is the decode-concurrent "
                "level"))
        for gpu in probe.gpus:
            warn_once(f"sweep GPU {gpu.index} ({gpu.uuid}): cap {w(gpu.power_limit_w)} W -> "
                      f"{', '.join(w(c) for c in caps_of(rig, probe.gpus))} W live, then "
                      "back to "
                      f"{UNIT_NAME}'s cap")
    copies = {f"{SWEEP_DIR}/{Path(src).name}": str(src)
              for src in (RIG_PROGRAM, cap_check.__file__)}
    expect(*copies)  # rigbook.core.managed: the folder and both files in one read
    yield from directory_commands(SWEEP_DIR, mode="700")
    for dest, src in copies.items():
        yield from put_commands(src, dest, mode="644")
    yield FunctionCommand(_run, (rig, target, settings, Path(root) if root else None), {})


@deploy("Power sweep")
def power_sweep(rig: Rig) -> None:
    """Sweep the rig's live cap over sweep_watts with the verify bench; the caps restored."""
    from rigbook.roles.verify import verify_plan

    if rig.recipe is None:
        refused(name="Check the serving recipe",
                message=f"{host.name}: recipe: no recipe to bench; pass --data recipe=NAME")
        return
    try:
        target, settings = verify_plan(rig, host.name, host.data.get("ssh_hostname") or host.name)
    except RigbookError as failed:
        refused(name="Check the verify settings", message=str(failed))
        return
    probe = host.get_fact(NvidiaGpus)
    caps = caps_of(rig, probe.gpus if probe is not None else ())
    span = f"{w(caps[0])}-{w(caps[-1])} W ({len(caps)} caps)" if caps else "no caps"
    sweep_caps(name=f"Sweep {span} on {target.url}",
               rig=rig, target=target, settings=settings)


def rows(runs: Iterable[SweepRun], rig: str | None = None) -> list[SweepRun]:
    """The latest sweep per rig and recipe, or every sweep of one rig."""
    runs = list(runs)
    if rig is not None:
        return [r for r in runs if r.rig == rig]
    latest = {(r.rig, r.recipe): r for r in runs}
    return sorted(latest.values(), key=lambda r: (r.rig, r.recipe))
