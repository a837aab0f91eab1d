"""Serving: the rig's recipe as one systemd unit, started only after preflights, proven healthy.

One unit per rig, rigbook-serve.service, so two engines never share a GPU. It runs the
recipe's command line (roles/recipes.py `engine_argv`) from its venv as the unprivileged user
rigbook-serve, with an env file (HF_HUB_OFFLINE=1 and HF_HUB_CACHE: a missing model is a failed
boot, not a silent download; the venv's CUDA_HOME; the recipe's NCCL and allocator settings;
expandable_segments:False on WSL2 and NVLink rigs). The API binds to serving_bind; an API key
(required wider than loopback) reaches the engine from a root-only env file that systemd reads
before it drops privileges: never on a command line. Stops are graceful (SIGTERM, vLLM
--shutdown-timeout 30, TimeoutStopSec=120): vLLM unlinks its /dev/shm buffer only then.

`serve_recipe` does it all in one operation, deciding when it executes (facts are read then):

1. nothing differs and the unit runs: no change (a quick /v1/models check is reported);
2. otherwise, when the engine must (re)start: preflights, before anything changes. The GPUs are
   there (`nvidia-smi -L` works: if it fails the card is gone and nothing is ever restarted),
   the model and draft are complete in the HF cache, the venv's engine is there, no other
   engine runs, and the recipe's weights + KV estimate fits free VRAM and host RAM (counting
   what others hold; what the running rigbook-serve holds is freed by the switch). A failure
   names the check and by how much, and changes nothing: the old engine keeps running;
3. the old engine is stopped gracefully, the files written, the new one started, and the
   health check (files/serving/health.py, run on the rig) waits for /v1/models and one short
   completion. A failure prints the unit's last journal lines, stops the unit (no crash loop
   holding GPU memory) and fails the rig.

docs/serving.md has the unit, the environment, the preflights and the health check.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pyinfra import host, logger, state
from pyinfra.api import FactBase, FunctionCommand, QuoteString, StringCommand, deploy, operation
from pyinfra.api.exceptions import FactProcessError
from pyinfra.facts.files import File, FileContents, FindInFile
from pyinfra.operations import server

from rigbook import FILES
from rigbook.core.cards import Card, facts_card
from rigbook.core.checks import Check, Facts, Finding, Read, drift, error, refusal, warn
from rigbook.core.errors import RigbookError
from rigbook.core.facts import GPUS, GPUS_READ, NVIDIA_SMI_PATHS, NvidiaGpus
from rigbook.core.managed import put_commands
from rigbook.core.messages import GIB, connector_arguments, gib, refuse, refused, warn_once
from rigbook.core.pins import venv_link
from rigbook.core.render import env_line, render, systemd_word
from rigbook.core.runfacts import once
from rigbook.core.secrets import Secret, read_secret_file
from rigbook.core.spec import ModelSpec, Rig
from rigbook.core.types import JsonValue
from rigbook.core.units import booted, start_command, state_of
from rigbook.rigside import cap_check, venv_check
from rigbook.rigside.gpus import GpuProbe
from rigbook.roles import power
from rigbook.roles.guards import (
    GPU_LOST_MARK,
    REAPER,
    GpuLostMark,
    GpuTopology,
    Topology,
    gpu_lost_reason,
    p2p_disable_problem,
)
from rigbook.roles.journal import SpecAcceptance, acceptance_warning, journal_hints
from rigbook.roles.models import CacheState, ModelCache, snapshot_status
from rigbook.roles.recipes import (
    GDN_CUDA,
    VRAM_MARGIN_GIB,
    WEIGHT_INDEX,
    Recipe,
    api_key_variable,
    bind_of,
    card_problems,
    card_warnings,
    engine_argv,
    gdn_index_problem,
    gpu_memory_utilization_of,
    is_loopback,
    model_path,
    mtp_index_problem,
    port_of,
    recipe_for,
    recipe_pins,
    shm_offload_problem,
    vram_need_gib,
)
from rigbook.roles.tokens import secret_upload
from rigbook.roles.venvs import (
    VenvBuilds,
    VenvState,
    incompatibility,
    launcher_environment,
    staleness,
)
from rigbook.roles.wsl import serving_environment

UNIT_NAME = "rigbook-serve.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT_NAME}"
UNIT_TEMPLATE = FILES / "serving" / "rigbook-serve.service.j2"
SERVE_USER = "rigbook-serve"
SERVE_HOME = "/var/lib/rigbook-serve"
CONF_DIR = "/etc/rigbook/serving"
ENV_PATH = f"{CONF_DIR}/engine.env"
KEY_PATH = f"{CONF_DIR}/api-key.env"
SERVING_DIR = "/opt/rigbook/serving"
HEALTH_PATH = f"{SERVING_DIR}/health.py"
HEALTH_SOURCE = FILES / "serving" / "health.py"
#: ServeProbe's program, sent with `python3 -c` (standard library only, read-only).
PROBE_SOURCE = FILES / "serving" / "probe.py"
#: The unit's ExecStartPre that refuses a start when the live caps differ from the power unit.
CAP_CHECK_PATH = f"{SERVING_DIR}/cap_check.py"
CAP_CHECK_SOURCE = Path(cap_check.__file__)
#: The unit's ExecStartPre that refuses a start from a venv built for another driver.
VENV_CHECK_PATH = f"{SERVING_DIR}/venv_check.py"
VENV_CHECK_SOURCE = Path(venv_check.__file__)
#: Written by a driver bump that stopped serving (hold_serving), removed by deploys/venvs.py
#: after its rebuilds (resume_serving); while it is there the unit's venv check refuses a start.
HOLD_PATH = "/var/lib/rigbook/serving-held"
#: Without systemd (docs/no-systemd.md): rigbook's supervisor, its config, pidfile and log.
SUPERVISE_PATH = f"{SERVING_DIR}/supervise.py"
SUPERVISE_SOURCE = FILES / "serving" / "supervise.py"
SUPERVISE_CONF = f"{CONF_DIR}/supervise.json"
PIDFILE = "/run/rigbook/serve.pid"
#: The supervisor's record of the start its checks refused last (`supervise.py status`).
REFUSAL_PATH = "/run/rigbook/serve.refused"
SERVE_LOG = "/var/log/rigbook/serve.log"
SUPERVISOR = f"rigbook's supervisor ({SUPERVISE_PATH})"
#: systemd's TimeoutStopSec: above vLLM's 30 s drain, as the runbook's units carry it
#: (docs/sources.md, "Shutdown drain and /dev/shm").
STOP_TIMEOUT_S = 120
JOURNAL_LINES = 40
KIB, MIB = 1024, 1024**2  # bytes

#: Process command lines that are an inference engine (built from parts, so that the probe's
#: own command line, which carries this list, never matches itself).
ENGINE_MARKERS = (
    ("vllm", " serve"), ("vllm", ".entrypoints"), ("sglang", ".launch_server"),
    ("llama_cpp", ".server"), ("llama", "-server"),
)


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


# --- the plan: everything decided from host data, before connecting ---------------------------


@dataclass(frozen=True)
class ServePlan:
    """What the rig should run, rendered from its host data and recipe (no rig state in it)."""

    rig_name: str
    rig: Rig
    recipe: Recipe
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    bind: str
    port: int
    health_timeout_s: int
    pins: tuple[ModelSpec, ...]
    key: Secret | None = None  # the whole VAR=key line of the key env file

    @property
    def gpu(self) -> bool:
        return not self.recipe.cpu_only

    @property
    def capped(self) -> bool:
        """Whether the engine starts only on caps the power unit set (WSL2: Windows owns them)."""
        return self.gpu and self.rig.platform != "wsl2"

    @property
    def url(self) -> str:
        """Where the health check on the rig itself reaches the API."""
        if self.bind in ("0.0.0.0", "::"):
            address = "127.0.0.1" if self.bind == "0.0.0.0" else "[::1]"
        else:
            address = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{address}:{self.port}"

    @property
    def label(self) -> str:
        return f"{self.recipe.name} ({self.recipe.engine}, {self.recipe.served_name()})"


def read_api_key(path: str) -> str:
    """The API key in an operator-side file: one word that needs no quoting in an env file."""
    return read_secret_file("serving_api_key_file", path, "key", forbidden="\"'\\$%`")


def engine_environment(recipe: Recipe, rig: Rig) -> dict[str, str]:
    """The recipe's, the platform's and rigbook's variables (the venv's own come first, read
    from the rig when the operation executes: `rigbook.roles.venvs.launcher_environment`). A
    cpu_only recipe's engine is shown no GPU (an empty CUDA_VISIBLE_DEVICES), as its unit allows
    none."""
    env = dict(recipe.env)
    env.update(serving_environment(rig))
    env.update(rig.serving_env)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": rig.models_cache,
        "RIGBOOK_RECIPE": recipe.name,
    })
    if recipe.cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def serve_plan(rig: Rig, rig_name: str) -> ServePlan:
    """The plan for a rig with a recipe; RigbookError names the rig, the field and the fix."""
    recipe = recipe_for(rig, rig_name)
    try:
        argv = engine_argv(recipe, rig)
        pins = recipe_pins(recipe, rig)
    except RigbookError as error:
        raise RigbookError(f"{rig_name}: recipe {recipe.name}: {error}") from None
    bind, port = bind_of(recipe, rig), port_of(recipe, rig)
    key_file = rig.serving_api_key_file or recipe.api_key_file
    if not is_loopback(bind) and key_file is None:
        raise RigbookError(
            f"{rig_name}: serving_bind: {bind} is wider than loopback and no API key is set; "
            "set serving_api_key_file, or bind 127.0.0.1"
        )
    key = None
    if key_file is not None:
        variable = api_key_variable(recipe)
        if variable is None:
            raise RigbookError(
                f"{rig_name}: serving_api_key_file: {recipe.engine} has no verified way to take "
                "an API key outside its command line; bind it to 127.0.0.1 without a key"
            )
        try:
            key = Secret(f"{variable}={read_api_key(key_file)}")
        except RigbookError as error:
            raise RigbookError(f"{rig_name}: {error}") from None
    env = engine_environment(recipe, rig)
    return ServePlan(
        rig_name=rig_name, rig=rig, recipe=recipe, argv=tuple(argv), env=tuple(env.items()),
        bind=bind, port=port, health_timeout_s=rig.serving_health_timeout_s, pins=pins, key=key,
    )


# --- rendering ---------------------------------------------------------------------------------

def render_unit(plan: ServePlan, smi: str | None) -> str:
    """rigbook-serve.service for the plan; `smi` is the nvidia-smi that the unit runs -L with."""
    return render(
        UNIT_TEMPLATE,
        plan=plan, user=SERVE_USER, home=SERVE_HOME, env_path=ENV_PATH,
        key_path=KEY_PATH if plan.key is not None else None, smi=smi if plan.gpu else None,
        exec_start=" ".join(systemd_word(arg) for arg in plan.argv),
        stop_timeout=STOP_TIMEOUT_S, cap_check=CAP_CHECK_PATH if plan.capped else None,
        power_unit=power.UNIT_PATH, tolerance=power.TOLERANCE_W,
        venv_check=venv_check_args(plan, smi),
    )


def venv_check_args(plan: ServePlan, smi: str | None) -> list[str]:
    """The venv check's argv, the same for the unit's ExecStartPre and the supervisor's check
    before every start: as root, in an empty environment, an isolated interpreter (the engine's
    user cannot switch it off); --smi for a GPU recipe (a cpu_only one checks the hold only)."""
    return ["/usr/bin/env", "-i", "-C", "/", "/usr/bin/python3", "-I", "-S", VENV_CHECK_PATH,
            "--hold", HOLD_PATH, "--venv", venv_link(plan.recipe.venv),
            *(("--smi", smi) if plan.gpu and smi else ())]


def render_supervise(plan: ServePlan, smi: str | None, caps: Mapping[str, float]) -> str:
    """supervise.json: what files/serving/supervise.py runs in place of the unit (no systemd):
    the same argv, user, env files, GPU and venv checks before a start and stop timeout."""
    cap_check = None
    if plan.capped:
        cap_check = ["/usr/bin/python3", "-I", "-S", CAP_CHECK_PATH, "--smi", smi or "nvidia-smi",
                     "--tolerance", str(power.TOLERANCE_W), "--caps",
                     *(f"{uuid}={watts:g}" for uuid, watts in sorted(caps.items()))]
    conf = {
        "argv": list(plan.argv), "user": SERVE_USER, "home": SERVE_HOME,
        "env_files": [ENV_PATH] + ([KEY_PATH] if plan.key is not None else []),
        "smi": smi if plan.gpu else None, "gpu_lost_mark": GPU_LOST_MARK if plan.gpu else None,
        "cap_check": cap_check, "venv_check": venv_check_args(plan, smi),
        "stop_timeout": STOP_TIMEOUT_S, "restart_sec": 10,
        "start_limit": [3, 600], "pidfile": PIDFILE, "log": SERVE_LOG, "refusal": REFUSAL_PATH,
        "reaper": ["/usr/bin/python3", "-I", "-S", REAPER,
                   *(arg for pattern in plan.rig.guards_shm_patterns
                     for arg in ("--pattern", pattern))],
    }
    return json.dumps(conf, indent=1, sort_keys=True) + "\n"


def render_env(plan: ServePlan, launcher: Mapping[str, str] | None) -> str:
    """engine.env: the venv's launcher environment, then the plan's variables (later wins).

    Values are one line without quotes or backslashes (the recipe model checks its own).
    """
    lines = [
        "# Managed by rigbook (roles/serving.py): the environment of rigbook-serve.service.",
        f"# Recipe {plan.recipe.name}. The API key is not here (root-only {KEY_PATH}).",
    ]
    for key, value in {**(launcher or {}), **dict(plan.env)}.items():
        lines.append(env_line(key, value))
    return "\n".join(lines) + "\n"


# --- the rig's serving state --------------------------------------------------------------------



@dataclass(frozen=True)
class ServeState(JsonValue):
    """What ServeProbe read on the rig."""

    mem_total_kib: int
    mem_available_kib: int
    active: str  # systemd ActiveState of rigbook-serve ("inactive" when it does not exist)
    sub: str
    enabled: str  # UnitFileState ("" when the unit does not exist)
    files: Mapping[str, str | None]  # path -> sha256, None when absent
    user: bool
    entry: bool  # the recipe's venv executable is there
    unit_pids: tuple[int, ...] = ()
    rss_kib: int = 0  # what the running rigbook-serve holds in host RAM
    engines: tuple[tuple[int, str], ...] = ()  # other engine processes
    smi: Mapping[str, object] | None = None  # {"path", "rc", "out"} of nvidia-smi -L
    apps: tuple[tuple[str, int, int | None], ...] | None = None  # (GPU uuid, pid, MiB)
    answer: Mapping[str, object] | None = None  # health.py --once, when the unit is active
    systemd: bool = True  # False: rigbook's supervisor serves (active/sub then describe it)

    @property
    def running(self) -> bool:
        return self.active == "active"


class ServeProbe(FactBase[ServeState]):
    """
    The serving state of a rig: unit, files, memory, other engines, GPUs (nvidia-smi -L).

    Runs files/serving/probe.py with the rig's python3 (sent as ``python3 -c``, one round
    trip); it prints one JSON object like::

        {"MemAvailable": 7862000, "MemTotal": 16367000, "answer": null, "apps": null,
         "engines": [], "entry": true, "files": {"/etc/systemd/system/rigbook-serve.service":
         "3b9c...", "/etc/rigbook/serving/engine.env": null}, "rss_kib": 0, "smi": null,
         "unit": {"ActiveState": "inactive", "LoadState": "not-found", "SubState": "dead",
         "UnitFileState": ""}, "unit_pids": [], "user": false}
    """

    def command(self, args: str) -> StringCommand:
        source = PROBE_SOURCE.read_text()
        return StringCommand("python3", "-c", QuoteString(source), QuoteString(args))

    def process(self, output: list[str]) -> ServeState:
        return parse_probe("\n".join(output))


def probe_args(plan: ServePlan) -> str:
    """ServeProbe's argument: one JSON string (a fact's arguments must be hashable)."""
    return json.dumps({
        "unit": UNIT_NAME, "user": SERVE_USER, "entry": plan.argv[0],
        "files": [UNIT_PATH, ENV_PATH, KEY_PATH, HEALTH_PATH, CAP_CHECK_PATH, VENV_CHECK_PATH,
                  power.UNIT_PATH, SUPERVISE_PATH, SUPERVISE_CONF, HOLD_PATH],
        "supervisor": SUPERVISE_PATH, "pidfile": PIDFILE,
        "markers": ENGINE_MARKERS, "gpu": plan.gpu, "smi_paths": list(NVIDIA_SMI_PATHS),
        "health": HEALTH_PATH, "url": plan.url, "key": KEY_PATH if plan.key else None,
    }, sort_keys=True)


def parse_probe(text: str) -> ServeState:
    try:
        data = json.loads(text)
        unit = data["unit"]
        apps = None
        if data.get("apps") is not None:
            apps = tuple(
                (uuid, int(pid), int(mib) if mib.isdigit() else None)
                for uuid, pid, mib in data["apps"]
            )
        systemd = bool(data.get("systemd", True))
        active, sub = unit.get("ActiveState", "inactive"), unit.get("SubState", "")
        if not systemd:  # the supervisor is the unit: alive, stale pidfile, or none
            sup = data.get("supervisor")
            active = "active" if sup and sup["alive"] else "inactive"
            sub = (f"supervised, pid {sup['pid']}" if sup and sup["alive"]
                   else f"stale pidfile {PIDFILE} (pid {sup['pid']})" if sup else "not running")
        return ServeState(
            mem_total_kib=int(data["MemTotal"]),
            mem_available_kib=int(data["MemAvailable"]),
            active=active, sub=sub,
            enabled=unit.get("UnitFileState", "") if systemd else "",
            files=dict(data["files"]),
            user=bool(data["user"]),
            entry=bool(data["entry"]),
            unit_pids=tuple(data["unit_pids"]),
            rss_kib=int(data["rss_kib"]),
            engines=tuple((int(pid), cmd) for pid, cmd in data["engines"]),
            smi=data.get("smi"),
            apps=apps,
            answer=data.get("answer"),
            systemd=systemd,
        )
    except (ValueError, KeyError, TypeError) as error:
        raise FactProcessError(f"the serving probe printed no usable JSON ({error}): "
                               f"{text[:300]!r}") from None


# --- preflight ----------------------------------------------------------------------------------


def gpu_gone(state_: ServeState) -> str | None:
    """Why the GPUs cannot be trusted (nvidia-smi -L absent or failing), None when they can."""
    smi = state_.smi
    if smi is None:
        return "no nvidia-smi on the rig (driver not installed)"
    if smi["rc"] != 0:
        out = " ".join(str(smi["out"]).split())[:200]
        return (
            f"{smi['path']} -L failed (exit {smi['rc']}: {out}): the card is gone or the driver "
            "is broken; a model is never (re)started then: reboot the rig and check the Xids"
        )
    return None


@dataclass
class Preflight:
    """Every failed check, by name, with the numbers."""

    problems: list[str] = field(default_factory=list)

    def fail(self, check: str, message: str) -> None:
        self.problems.append(f"{check}: {message}")


def preflight(plan: ServePlan, probe: ServeState, gpus: GpuProbe | None, cache: CacheState,
              venv: VenvState, topology: Topology | None = None,
              weight_index: str | None = None) -> list[str]:
    """Reasons not to start the plan's engine now (empty: go ahead). Reads no rig state itself.

    `probe`, `gpus` (NvidiaGpus; None for a cpu_only recipe), `cache` (ModelCache), `venv`
    (VenvBuilds of the recipe's venv) and `topology` (GpuTopology) are the facts as the
    operation read them.
    """
    checks = Preflight()
    recipe = plan.recipe
    if plan.gpu:
        why = gpu_gone(probe)
        if why is None and (gpus is None or not gpus.ok):
            why = f"nvidia-smi --query-gpu failed: {gpus.error if gpus else 'no nvidia-smi'}"
        if why is not None:
            checks.fail("gpus", why)
        if plan.capped and probe.systemd and probe.files.get(power.UNIT_PATH) is None:
            checks.fail("power caps", f"no {power.UNIT_PATH}: the engine would start uncapped; "
                                      "run deploys/power_cap.py (or deploys/rig.py) first")
        p2p = p2p_disable_problem(dict(plan.env), plan.rig, topology)
        if p2p is not None:
            checks.fail("topology", p2p)
    for pin, spec in zip(recipe.models, plan.pins, strict=True):
        status = snapshot_status(cache, spec)
        name = f"{spec.repo}@{spec.revision[:12]}"
        if not status.complete:
            checks.fail("model", f"{name} is not complete in {cache.cache}: {status.reason}; "
                                 "add it to the rig's models and run deploys/models.py")
        elif pin.file and pin.file not in cache.repos[spec.repo].snapshots[spec.revision]:
            checks.fail("model", f"{name} has no {pin.file}")
    for problem in (mtp_index_problem(recipe, weight_index),
                    gdn_index_problem(recipe, weight_index)):
        if problem is not None:
            checks.fail("model", problem)
    _venv(checks, plan, probe, gpus, venv)
    if probe.engines:
        listed = "; ".join(f"pid {pid} `{cmd[:80]}`" for pid, cmd in probe.engines)
        checks.fail("one engine", f"another engine runs outside {UNIT_NAME}: {listed}; stop it "
                                  "first (never two big models at once)")
    return checks.problems + fit_problems(plan, probe, gpus)


def reads_weight_index(recipe: Recipe) -> bool:
    """Whether the preflight reads the checkpoint's weight index: for an MTP head's storage,
    and for an SGLang GDN model's linear-attention layers."""
    spec = recipe.speculative
    return ((spec is not None and spec.method == "mtp")
            or (recipe.engine == "sglang" and recipe.model.gdn))


def fit_problems(plan: ServePlan, probe: ServeState, gpus: GpuProbe | None) -> list[str]:
    """The recipe against the rig as it is now: cards for its tensor parallelism, host RAM,
    VRAM free per card (what a running rigbook-serve holds counts as free)."""
    checks = Preflight()
    if plan.gpu and gpus is not None and gpus.ok:
        if len(gpus.gpus) < plan.recipe.tensor_parallel_size:
            checks.fail("gpus", f"the recipe splits over {plan.recipe.tensor_parallel_size} "
                                f"cards; the rig shows {len(gpus.gpus)}")
        else:
            _vram(checks, plan, probe, gpus)
            card = serving_card(plan, gpus)
            for problem in card_problems(plan.recipe, plan.rig, card) if card else ():
                checks.fail("card", problem)
    _host_ram(checks, plan, probe)
    shm = shm_offload_problem(plan.recipe, plan.rig.shm_size, probe.mem_total_kib * KIB)
    if shm is not None:
        checks.fail("host RAM", shm)
    return checks.problems


def serving_card(plan: ServePlan, gpus: GpuProbe) -> Card | None:
    """The card the recipe runs on, as nvidia-smi shows the GPUs it is split over."""
    return facts_card(sorted(gpus.gpus, key=lambda g: g.index)[: plan.recipe.tensor_parallel_size])


def _venv(checks: Preflight, plan: ServePlan, probe: ServeState, gpus: GpuProbe | None,
          venv: VenvState) -> None:
    name = plan.recipe.venv
    if venv.manifest is None:
        checks.fail("venv", f"{name} is not built ({venv_link(name)} -> {venv.target or 'nothing'})"
                            ": deploys/rig.py or deploys/venvs.py builds it")
        return
    if not probe.entry:
        checks.fail("venv", f"{name} has no {plan.argv[0]}: it is not a {plan.recipe.engine} venv")
    if plan.gpu and gpus is not None and gpus.ok:
        why = incompatibility(venv.manifest, gpus.driver_version) or staleness(
            venv.manifest, gpus.driver_version
        )
        if why is not None:
            checks.fail("venv", f"{name} is not current for the driver: {why}: run "
                                "deploys/venvs.py")
    runtime = venv.manifest.get("cuda_runtime")
    gdn = any(pin.gdn for pin in plan.recipe.models)
    if gdn and runtime and str(runtime).split(".")[:2] != GDN_CUDA.split("."):
        checks.fail("venv", f"{name} carries the CUDA {runtime} runtime; the recipe's GDN model "
                            f"needs CUDA {GDN_CUDA} exactly (12.8 hangs on load, 13.3 fails to "
                            "build: the failure log; docs/sources.md, GDN models)")


def _host_ram(checks: Preflight, plan: ServePlan, probe: ServeState) -> None:
    need = plan.recipe.estimate.host_ram_gib * GIB
    freed = probe.rss_kib * KIB if probe.running else 0
    available = probe.mem_available_kib * KIB + freed
    if need > available:
        also = f" + {gib(freed)} the running {UNIT_NAME} frees" if freed else ""
        checks.fail(
            "host RAM",
            f"the recipe needs {gib(need)}, {gib(available)} is available (MemAvailable "
            f"{gib(probe.mem_available_kib * KIB)}{also}): short by {gib(need - available)}",
        )


def _vram(checks: Preflight, plan: ServePlan, probe: ServeState, gpus: GpuProbe) -> None:
    recipe = plan.recipe
    need = vram_need_gib(recipe, plan.rig) * GIB
    share = gpu_memory_utilization_of(recipe, plan.rig)
    margin = VRAM_MARGIN_GIB * GIB
    ours = set(probe.unit_pids)
    for gpu in sorted(gpus.gpus, key=lambda g: g.index)[: recipe.tensor_parallel_size]:
        total = (gpu.memory_total_mib or 0) * MIB
        used = (gpu.memory_used_mib or 0) * MIB
        if probe.apps is not None:
            mine = sum(mib or 0 for uuid, pid, mib in probe.apps
                       if uuid == gpu.uuid and pid in ours) * MIB
        else:  # no per-process numbers (WSL2): what a running rigbook-serve holds is freed
            mine = used if probe.running else 0
        others = max(used - mine, 0)
        label = f"GPU {gpu.index} ({gpu.name})"
        if share is not None:
            claim = share * total
            if need > claim:
                checks.fail("VRAM", f"{label}: the recipe needs {gib(need)} per card but claims "
                                    f"only {share:g} x {gib(total)} = "
                                    f"{gib(claim)}: short by {gib(need - claim)}")
            elif total - claim < margin:
                checks.fail("VRAM", f"{label}: the engine would claim {share:g} x {gib(total)} "
                                    f"= {gib(claim)}, leaving {gib(total - claim)}; "
                                    f"{gib(margin)} per card is kept for the driver and display "
                                    "(docs/sources.md, VRAM margins): lower "
                                    "serving_gpu_memory_utilization")
            elif others > total - claim:
                checks.fail("VRAM", f"{label}: other processes hold {gib(others)}; the engine "
                                    f"claims {gib(claim)} of {gib(total)}, leaving "
                                    f"{gib(total - claim)}: short by "
                                    f"{gib(others - (total - claim))}")
        elif need > total - max(others, margin):
            free = total - max(others, margin)
            checks.fail("VRAM", f"{label}: the recipe needs {gib(need)}, {gib(free)} "
                                f"is free ({gib(others)} held by others, {gib(margin)} kept "
                                f"per card): short by {gib(need - free)}")


# --- health --------------------------------------------------------------------------------------

def health_command(plan: ServePlan, systemd: bool = True) -> StringCommand:
    args = ["python3", HEALTH_PATH, "--url", plan.url, "--timeout", str(plan.health_timeout_s),
            *(("--unit", UNIT_NAME) if systemd else ("--pidfile", PIDFILE))]
    if plan.key is not None:
        args += ["--key-file", KEY_PATH]
    return StringCommand(*args)


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.strip().startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def supervisor_command(action: str) -> StringCommand:
    """Start or stop the engine through rigbook's supervisor (no systemd), as root."""
    return StringCommand("/usr/bin/python3", "-I", "-S", SUPERVISE_PATH, action, SUPERVISE_CONF)


def what_serves(systemd: bool) -> str:
    """What runs the engine, for messages: the unit, or rigbook's supervisor (no systemd)."""
    return UNIT_NAME if systemd else SUPERVISOR


def stop_command(systemd: bool) -> StringCommand:
    """A graceful stop of the engine: the unit's, or the supervisor's (no systemd)."""
    return StringCommand("systemctl", "stop", UNIT_NAME) if systemd \
        else supervisor_command("stop")


def _await_health(state, host, plan: ServePlan, arguments: dict, systemd: bool = True) -> bool:
    """FunctionCommand body: wait for the API; on failure show the journal (the supervisor's
    log) and stop the engine."""
    _ok, output = host.run_shell_command(health_command(plan, systemd), **arguments)
    result = _last_json(output.stdout) or {"ok": False, "message": output.stderr[-300:]}
    if result.get("ok"):
        logger.info(
            f"{host.print_prefix}{plan.label} answers on {plan.url} after "
            f"{result.get('seconds')} s: model {result.get('model')}, "
            f"completion {result.get('completion')!r}"
        )
        return True
    what = what_serves(systemd)
    if systemd:
        read = StringCommand("journalctl", "-u", UNIT_NAME, "-n", str(JOURNAL_LINES), "--no-pager")
    else:
        read = StringCommand("tail", "-n", str(JOURNAL_LINES), SERVE_LOG)
    _ok, journal = host.run_shell_command(read, **arguments)
    host.run_shell_command(stop_command(systemd), **arguments)
    lines = journal.stdout
    if plan.key is not None:
        lines = plan.key.redact(lines).replace(plan.key.reveal().split("=", 1)[1], "***")
    hints = "".join(f"\nWhat it shows: {hint}" for hint in journal_hints(lines, plan.rig))
    host.log_styled(
        f"{plan.label} did not come up healthy on {plan.url} "
        f"({result.get('stage', '?')}: {result.get('message')}). Last {JOURNAL_LINES} "
        f"{'journal' if systemd else 'log'} lines of {what}:\n{lines}{hints}\n{what} is "
        "stopped: this rig serves nothing now.",
        fg="red", log_func=logger.error,
    )
    return False


# --- the operation --------------------------------------------------------------------------------


def _put(text: str, dest: str, mode: str = "644") -> Iterator:
    yield from put_commands(src=io.StringIO(text), dest=dest, mode=mode)


@operation()
def serve_recipe(plan: ServePlan) -> Iterator:
    """
    Run the plan's recipe as rigbook-serve.service (or, without systemd, under rigbook's
    supervisor): preflight, graceful switch, health.

    + plan: a ``ServePlan`` (``serve_plan(rig, name)``): recipe, command line, env, bind, key

    Nothing differs and the engine runs: no change (the answer of one /v1/models request is
    reported). Unit (supervisor config), env file or key changed, or the engine not running:
    the preflights run first and a failure changes nothing; then the running engine is stopped
    (SIGTERM, graceful), the files are written, the engine started and the health check waits
    for /v1/models and one completion (serving_health_timeout_s). The user, directories and
    health script are converged too, without a restart. Without systemd no unit is written and
    no systemctl runs: files/serving/supervise.py runs the same checks before each start
    (docs/no-systemd.md).
    """
    probe = once(ServeProbe, args=probe_args(plan))
    gpus = once(NvidiaGpus) if plan.gpu else None
    gone = (gpu_gone(probe) or gpu_lost_reason(once(GpuLostMark))) if plan.gpu else None
    smi = str(probe.smi["path"]) if probe.smi else (gpus.smi if gpus else "nvidia-smi")
    env_text = render_env(plan, launcher_environment(plan.recipe.venv))
    systemd = probe.systemd
    if systemd:
        runner, runner_text, runner_source = UNIT_PATH, render_unit(plan, smi), None
    else:
        caps = power.cap_plan(plan.rig, gpus.gpus)[0] if gpus is not None and gpus.ok else ()
        runner = SUPERVISE_CONF
        runner_text = render_supervise(plan, smi, {cap.uuid: cap.watts for cap in caps})
        runner_source = SUPERVISE_PATH
    wanted = {
        runner: _sha(runner_text), ENV_PATH: _sha(env_text),
        KEY_PATH: plan.key.sha256 if plan.key else None,
        HEALTH_PATH: _sha(HEALTH_SOURCE.read_bytes()),
        CAP_CHECK_PATH: _sha(CAP_CHECK_SOURCE.read_bytes()),
        VENV_CHECK_PATH: _sha(VENV_CHECK_SOURCE.read_bytes()),
    }
    if runner_source is not None:
        wanted[runner_source] = _sha(SUPERVISE_SOURCE.read_bytes())
    differs = {path for path, sha in wanted.items() if probe.files.get(path) != sha}
    restart = bool(differs & {runner, ENV_PATH, KEY_PATH, SUPERVISE_PATH}) or not probe.running
    what = what_serves(systemd)
    where = f"{host.name}: {what} ({plan.label})"

    if gone is not None:
        yield refuse(f"{where}: GPU check failed, nothing was changed: {gone}")
        return
    if restart and probe.files.get(HOLD_PATH) is not None:
        warn_once(f"{where}: serving is held by a driver bump ({HOLD_PATH}): deploys/venvs.py "
                  "rebuilds the venvs and starts it again")
        host.noop(f"{what} is held by a driver bump")
        return
    if restart:
        cache = once(ModelCache, cache=plan.rig.models_cache)
        venv = once(VenvBuilds, venv_name=plan.recipe.venv)
        topology = once(GpuTopology) if plan.gpu else None
        index = None
        if reads_weight_index(plan.recipe):
            folder = model_path(plan.recipe.model, plan.rig)
            index = host.get_fact(FileContents, path=f"{folder}/{WEIGHT_INDEX}")
            index = "\n".join(index) if index else None
        problems = preflight(plan, probe, gpus, cache, venv, topology, index)
        if problems:
            keeps = f" ({what} keeps running)"
            message = (f"{where}: preflight failed, nothing was changed"
                       + (keeps if probe.running else "") + ":\n"
                       + "\n".join(f"  - {p}" for p in problems))
            if not state.is_executing:
                warn_once(message)
            yield refuse(message)
            return
        if probe.running:
            yield stop_command(systemd)

    if not probe.user:
        yield from server.group._inner(SERVE_USER, system=True)
        yield from server.user._inner(
            SERVE_USER, group=SERVE_USER, home=SERVE_HOME, shell="/usr/sbin/nologin",
            system=True, ensure_home=True,
        )
    sources = ((HEALTH_PATH, HEALTH_SOURCE), (CAP_CHECK_PATH, CAP_CHECK_SOURCE),
               (VENV_CHECK_PATH, VENV_CHECK_SOURCE), (SUPERVISE_PATH, SUPERVISE_SOURCE))
    for path, source in sources:
        if path in differs:
            yield from put_commands(src=str(source), dest=path, mode="644")
    if ENV_PATH in differs:
        yield from _put(env_text, ENV_PATH)
    if plan.key is not None and KEY_PATH in differs:
        yield from secret_upload(plan.key, KEY_PATH)
    elif plan.key is None and probe.files.get(KEY_PATH) is not None:
        yield StringCommand("rm", "-f", KEY_PATH)
    if runner in differs:
        yield from _put(runner_text, runner)
        if systemd:
            yield StringCommand("systemctl", "daemon-reload")
    if systemd and probe.enabled != "enabled":
        yield StringCommand("systemctl", "enable", UNIT_NAME)
    if restart:
        yield start_command(UNIT_NAME) if systemd else supervisor_command("start")
        yield FunctionCommand(_await_health, (plan, connector_arguments(), systemd), {})
        return
    answer = probe.answer or {}
    if answer.get("ok"):
        host.noop(f"{what} already runs {plan.label} and answers (model {answer['model']})")
    else:
        log = f"journalctl -u {UNIT_NAME}" if systemd else SERVE_LOG
        warn_once(f"{where} is active but /v1/models does not answer: {answer.get('message')} "
                  f"({log})")
        host.noop(f"{what} already runs {plan.label}")


# --- the driver bump's hold -----------------------------------------------------------------------


class SupervisorStatus(FactBase[str | None]):
    """
    `supervise.py status` of rigbook's supervisor (no systemd), one line::

        running (pid 812)
        not running: the start at 2026-12-04T19:02:11+0000 was refused: /var/lib/rigbook/...

    Run with this rigbook's supervise.py (sent as ``python3 -c``), so that an older copy on the
    rig answers alike; None where the rig has no supervise.json (no supervisor set up).
    """

    def command(self) -> StringCommand:
        return StringCommand(
            "test", "-r", SUPERVISE_CONF, "&&", "python3", "-I", "-S", "-c",
            QuoteString(SUPERVISE_SOURCE.read_text()), "status", SUPERVISE_CONF, "||", "true")

    def process(self, output: list[str]) -> str | None:
        return output[0].strip() if output else None


def _serving_now() -> tuple[str, bool] | None:
    """(what serves, whether it runs) for the bump's hold: rigbook-serve.service, or rigbook's
    supervisor where systemd is not PID 1; None when the rig has neither set up."""
    if booted():
        if host.get_fact(File, path=UNIT_PATH) is None:
            return None
        return UNIT_NAME, state_of(UNIT_NAME).running
    said = host.get_fact(SupervisorStatus)
    return None if said is None else (SUPERVISOR, said.startswith("running "))


@operation()
def hold_serving(reason: str) -> Iterator:
    """
    Stop serving (rigbook-serve.service, or rigbook's supervisor without systemd) and keep it
    from starting until deploys/venvs.py releases it: the hold file (HOLD_PATH) that the venv
    check before every start (the unit's ExecStartPre, the supervisor's) refuses on, with its
    line.

    + reason: the hold's one line (which bump, what to run)

    Nothing on a rig where neither is set up, or when held already.
    """
    serving_now = _serving_now()
    if serving_now is None:
        host.noop(f"no {UNIT_NAME if booted() else SUPERVISE_CONF}: nothing to hold")
        return
    what, running = serving_now
    line = reason.replace("\n", " ")
    if host.get_fact(FileContents, path=HOLD_PATH) == [line] and not running:
        host.noop(f"{what} is held already")
        return
    yield StringCommand("mkdir", "-p", str(Path(HOLD_PATH).parent))
    yield from _put(line + "\n", HOLD_PATH)
    if running:
        yield stop_command(booted())


@operation(is_idempotent=False)
def resume_serving(plan: ServePlan) -> Iterator:
    """
    Start serving again after a driver bump held it: remove the hold, start rigbook-serve.service
    (without systemd: rigbook's supervisor) and wait for its health check; nothing when no bump
    holds it.

    + plan: the rig's ``ServePlan``

    deploys/venvs.py runs it after its rebuilds. The venv check before the start still refuses
    a GPU recipe whose venv does not match the running driver: the start then fails with its
    line.
    """
    probe = once(ServeProbe, args=probe_args(plan))
    if probe.files.get(HOLD_PATH) is None:
        host.noop("serving is not held by a driver bump")
        return
    yield StringCommand("rm", "-f", HOLD_PATH)
    yield start_command(UNIT_NAME) if probe.systemd else supervisor_command("start")
    yield FunctionCommand(_await_health, (plan, connector_arguments(), probe.systemd), {})


@operation()
def stop_held(plan: ServePlan) -> Iterator:
    """
    Stop serving where a driver bump holds it: after the reboot systemd retries the start its
    check refused (Restart=on-failure), and a venv swap's try-restart would start it again
    while held (without systemd: a supervisor started by hand, or by a copy older than its venv
    check); nothing when no bump holds it or it is stopped already.

    + plan: the rig's ``ServePlan``
    """
    probe = once(ServeProbe, args=probe_args(plan))
    if probe.files.get(HOLD_PATH) is None:
        host.noop("serving is not held by a driver bump")
    elif probe.active in ("inactive", "failed"):
        host.noop(f"{what_serves(probe.systemd)} is held and {probe.active}")
    else:
        yield stop_command(probe.systemd)


def _held_plan(rig: Rig) -> ServePlan | None:
    if rig.recipe is None:
        return None
    try:
        return serve_plan(rig, host.name)
    except RigbookError as error:
        refused(name="Check the serving recipe", message=str(error))
        return None


@deploy("Serving")
def settle_held(rig: Rig) -> None:
    """Before deploys/venvs.py rebuilds: serving held by a driver bump stays stopped."""
    plan = _held_plan(rig)
    if plan is not None:
        what = UNIT_NAME if booted() else "rigbook's supervisor"
        stop_held(name=f"Keep {what} stopped while held", plan=plan)


@deploy("Serving")
def resume_after_bump(rig: Rig) -> None:
    """Start the rig's recipe again once deploys/venvs.py rebuilt what a driver bump made stale."""
    plan = _held_plan(rig)
    if plan is None:
        return
    resume_serving(name=f"Start {plan.recipe.name} again (the driver bump's hold)", plan=plan)


# --- the role ------------------------------------------------------------------------------------


@deploy("Serving")
def serving(rig: Rig) -> None:
    """Run the rig's recipe (rig.recipe) as rigbook-serve.service (without systemd: under
    rigbook's supervisor); no recipe: leave serving be."""
    if rig.recipe is None:
        return
    try:
        plan = serve_plan(rig, host.name)
    except RigbookError as error:
        refused(name="Check the serving recipe", message=str(error))
        return
    runner = f"as {UNIT_NAME}" if booted() else "under rigbook's supervisor"
    serve_recipe(name=f"Serve {plan.recipe.name} {runner}", plan=plan)


# --- the serving checks ---------------------------------------------------------------------------

#: The engine.env line that names the recipe the unit runs (render_env writes it).
RECIPE_LINE = "RIGBOOK_RECIPE="


def running_recipe(lines: list[str] | None) -> str | None:
    """The recipe named by engine.env's RIGBOOK_RECIPE= line (FindInFile's value), if any."""
    for line in lines or ():
        if line.startswith(RECIPE_LINE):
            return line[len(RECIPE_LINE):].strip().strip('"') or None
    return None


def plan_of(rig: Rig, rig_name: str) -> tuple[ServePlan | None, Finding | None]:
    """(the serving plan, None) for a rig with a recipe; (None, why not) when it cannot be made
    (unknown recipe, a fit, bind or key problem: all decided on this machine); (None, None)
    without a recipe."""
    if rig.recipe is None:
        return None, None
    try:
        return serve_plan(rig, rig_name), None
    except RigbookError as e:
        return None, refusal("serving", e, rig_name)


def serving_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """The declared recipe against rigbook-serve.service: installed for it, enabled, active,
    answering /v1/models, and alone. A recipe that cannot be planned is an error."""
    plan, problem = plan_of(rig, rig_name)
    if plan is None:
        return [problem] if problem else []
    if facts.missing("serving", "serving_recipe") or facts.serving is None:
        return facts.missing("serving", "serving_recipe")
    probe, found = facts.serving, []
    running = running_recipe(facts.serving_recipe)
    if not probe.systemd:
        found += _supervised_findings(rig, probe, running)
    elif probe.files.get(UNIT_PATH) is None:
        found.append(drift("serving", f"no {UNIT_NAME}: recipe {rig.recipe} is not set up; run "
                                      "deploys/serve.py"))
    else:
        if running != rig.recipe:
            found.append(drift("serving", f"{UNIT_NAME} is set up for recipe {running or '?'}, "
                                          f"inventory {rig.recipe}: run deploys/serve.py"))
        if probe.enabled != "enabled":
            found.append(drift("serving", f"{UNIT_NAME} is {probe.enabled or 'not enabled'}, "
                                          "not enabled: it does not start at boot"))
        if probe.files.get(HOLD_PATH) is not None:
            found.append(held_finding(UNIT_NAME, probe.running))
        elif not probe.running:
            found.append(drift("serving", f"{UNIT_NAME} is {probe.active} ({probe.sub}): recipe "
                                          f"{rig.recipe} is not served; journalctl -u "
                                          f"{UNIT_NAME}, then deploys/serve.py"))
    if probe.running and not (probe.answer or {}).get("ok"):
        found.append(drift("serving", f"{plan.url}/v1/models does not answer: "
                                      f"{health_text(probe)}"))
    found += [drift("serving", f"another engine runs outside {UNIT_NAME}: pid {pid} "
                               f"`{cmd[:80]}`") for pid, cmd in probe.engines]
    return found


def _supervised_findings(rig: Rig, probe: ServeState, running: str | None) -> list[Finding]:
    """serving_findings without systemd: the supervisor set up for the recipe, and running."""
    if probe.files.get(SUPERVISE_CONF) is None:
        return [drift("serving", f"no {SUPERVISE_CONF}: recipe {rig.recipe} is not set up; run "
                                 "deploys/serve.py")]
    found = []
    if running != rig.recipe:
        found.append(drift("serving", f"{SUPERVISOR} is set up for recipe {running or '?'}, "
                                      f"inventory {rig.recipe}: run deploys/serve.py"))
    if probe.files.get(HOLD_PATH) is not None:
        found.append(held_finding(SUPERVISOR, probe.running))
    elif not probe.running:
        found.append(drift("serving", f"{SUPERVISOR} is {probe.sub}: recipe {rig.recipe} is not "
                                      f"served (nothing starts it at boot here); {SERVE_LOG}, "
                                      "then deploys/serve.py"))
    return found


def held_finding(what: str, running: bool) -> Finding:
    """A driver bump holds serving (HOLD_PATH): one finding, with systemd or without."""
    now = "runs all the same (started by hand?)" if running else "is stopped"
    return drift("serving", "serving held by the driver bump until venvs are rebuilt: run "
                            f"deploys/venvs.py ({HOLD_PATH}; {what} {now})")


def health_text(probe: ServeState) -> str:
    """What the running unit's health answer says: the model it serves, or why it does not."""
    answer = probe.answer or {}
    if answer.get("ok"):
        return f"serves {answer.get('model')}"
    return str(answer.get("message") or f"not checked: no {HEALTH_PATH} on the rig")


def fit_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """The recipe against the GPUs, VRAM and host RAM the rig really has (errors)."""
    plan, _ = plan_of(rig, rig_name)
    if plan is None:
        return []
    if facts.missing("probe", "serving") or facts.serving is None:
        return facts.missing("probe", "serving")
    gpus = facts.probe if plan.gpu else None
    return [error("serving", f"recipe {plan.recipe.name}: {problem}", key="recipe")
            for problem in fit_problems(plan, facts.serving, gpus)]


def advice_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """What the card the rig shows costs its recipe, short of refusing it (warnings)."""
    plan, _ = plan_of(rig, rig_name)
    probe = facts.probe
    if plan is None or not plan.gpu or probe is None or not probe.ok or not probe.gpus:
        return []
    card = serving_card(plan, probe)
    return [warn("serving", f"recipe {plan.recipe.name}: {text}", key="recipe")
            for text in (card_warnings(plan.recipe, rig, card) if card else ())]


def _serving_reads(rig: Rig, rig_name: str) -> list[Read]:
    plan, _ = plan_of(rig, rig_name)
    if plan is None:
        return []
    return [
        GPUS_READ,
        Read("serving", ServeProbe, f"serving state ({UNIT_NAME})", (("args", probe_args(plan)),)),
        Read("serving_recipe", FindInFile, ENV_PATH,
             (("path", ENV_PATH), ("pattern", f"^{RECIPE_LINE}"))),
    ]


def _speculation_reads(rig: Rig, rig_name: str) -> list[Read]:
    plan, _ = plan_of(rig, rig_name)
    if plan is None or plan.recipe.speculative is None:
        return []
    return [Read("acceptance", SpecAcceptance, "speculative acceptance (the engine's log)",
                 (("unit", UNIT_NAME), ("log", SERVE_LOG)))]


def speculation_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """A recipe that speculates, against the acceptance its engine logged (a warning)."""
    plan, _ = plan_of(rig, rig_name)
    if plan is None or plan.recipe.speculative is None:
        return []
    text = acceptance_warning(facts.acceptance)
    return [warn("serving", f"recipe {plan.recipe.name}: {text}", key="recipe")] if text else []


CHECKS = (
    Check("serving", _serving_reads, serving_findings),
    Check("speculation", _speculation_reads, speculation_findings),
    GPUS,
    Check("serving fit", _serving_reads, fit_findings, gpus=True),
    Check("card advice", _serving_reads, advice_findings, gpus=True, said=True),
)
