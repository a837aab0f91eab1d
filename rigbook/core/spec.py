"""Typed host data: every key a rig may carry, its default, and what is allowed.

pyinfra host data is a flat dict merged from the inventory, group data and `--data`; rigbook
validates that dict into one frozen `Rig` before any operation is planned, so a typo or an
out-of-range value stops the run with the host and the field named, and nothing changes.
Keys are prefixed by the role that reads them (driver_*, power_*, sysctl_*, shm_*, wsl_*).
docs/host-data.md is generated from these models (`rigbook docs`); a test fails when it is stale.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from rigbook.core.cards import CLASS_CARDS
from rigbook.core.envvars import env_problems
from rigbook.core.errors import RigbookError
from rigbook.core.secrets import looks_secret
from rigbook.core.types import (
    Glob,
    HttpUrl,
    IpAddress,
    Line,
    LocalPath,
    RepoId,
    Requirement,
    RigPath,
    SourceUrl,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictModel,
    http_url,
    rig_path,
)
from rigbook.rigside.shmglob import pattern_problem

GpuClass = Literal["rtx3090", "rtx3090ti", "rtx4090", "rtx5090", "a5000", "a6000", "other"]
Cooling = Literal["air", "water", "aio"]
Platform = Literal["ubuntu", "debian", "wsl2"]
PowerProfile = Literal["sweet-spot", "prefill", "stock"]

#: Driver branches rigbook installs: CUDA 13 needs >= 580; 590 is transitional to 595 on Ubuntu.
DRIVER_BRANCHES = (580, 595)

#: A GPU power limit or cap in watts: from below any card's own minimum to above the largest
#: board power a workstation or server card has (a range no card can take is refused here; the
#: card's own range is checked on the rig, docs/power.md).
Watts = Annotated[StrictInt, Field(ge=50, le=1200)]
#: Tokens of a context or a prompt: up to 2**24 (16 Mi), beyond any model's context.
MAX_TOKENS = 2**24

#: Per-card sweet spots (watts), by workload profile and cooling: only the caps the hardware notes
#: measured (docs/sources.md, "Power sweet spots", quotes each row). A missing cooling has no
#: measurement (the 4090 and 5090 sweeps were air-cooled, the 3090 prefill sweep too): rigbook
#: refuses it rather than guess. The 3090's 330 W "water" anchor ran on an AIO (Alphacool Eiswolf
#: 2 AIO 360mm), so it stands for both. The 5090's prefill knee is 400 W (0.618 TPS/W); stock
#: 600 W buys prefill throughput at ~30% efficiency (power_profile stock).
SWEET_SPOTS: dict[tuple[str, str], dict[str, int]] = {
    ("rtx3090", "sweet-spot"): {"air": 290, "water": 330, "aio": 330},
    ("rtx3090", "prefill"): {"air": 250},
    ("rtx4090", "sweet-spot"): {"air": 260},
    ("rtx5090", "sweet-spot"): {"air": 400},
    ("rtx5090", "prefill"): {"air": 400},
}

#: VRAM per card class in GiB, for recipe fit checks (rigbook.core.cards.CLASS_CARDS).
VRAM_GIB = {name: card.vram_gib for name, card in CLASS_CARDS.items()}

#: Host-data keys that belong to pyinfra itself (connectors, global arguments), not to rigbook.
PYINFRA_KEY = re.compile(r"^(_|ssh_|winrm_|docker_|local_|chroot_|podman_|vagrant_)")

_SIZE = re.compile(r"[1-9][0-9]*[KMG]|[1-9][0-9]?%")
#: A sysctl key: dotted path under /proc/sys (a slash stands for a dot inside one part).
_SYSCTL_KEY = re.compile(r"[a-z][a-z0-9_]*(\.[A-Za-z0-9_/:-]+)+")
_SYSCTL_VALUE = re.compile(r"[A-Za-z0-9_.,:/-]+( [A-Za-z0-9_.,:/-]+)*")
#: A power_caps key: a GPU index or an NVIDIA GPU UUID.
_GPU_KEY = re.compile(
    r"0|[1-9][0-9]?|GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
)
#: The folders leftovers of rigbook, of NVIDIA's packages and of engine setups live in: the
#: kernel's (sysctl, modules), apt's, login profiles, udev rules and tmpfiles. `stale_files` may
#: name a file directly in one of them, or a unit file of /etc/systemd/system or a .conf drop-in
#: of one of its UNIT.d folders; nothing else (/etc/passwd, /boot, /dev are not leftovers).
LEFTOVER_FOLDERS = (
    "/etc/sysctl.d", "/etc/modprobe.d", "/etc/modules-load.d", "/etc/apt/sources.list.d",
    "/etc/apt/preferences.d", "/etc/apt/apt.conf.d", "/etc/profile.d", "/etc/udev/rules.d",
    "/etc/tmpfiles.d",
)
_FILE_NAME = r"[A-Za-z0-9_@+=:,-][A-Za-z0-9_@+=:,.-]*"
_UNIT_FILE = r"[A-Za-z0-9_:@-][A-Za-z0-9_:@.-]*\.(service|socket|timer|path|mount|target|slice)"
_LEFTOVER = re.compile(
    "(" + "|".join(re.escape(folder) for folder in LEFTOVER_FOLDERS) + f")/{_FILE_NAME}"
    f"|/etc/systemd/system/{_UNIT_FILE}(\\.d/{_FILE_NAME}\\.conf)?"
)
#: Folders that belong to a user other than root on every rig: the serving user's home
#: (roles/serving.py's SERVE_HOME), login homes, users' runtime folders. A models_cache in one
#: could be changed by that user; every other path is checked on the rig (roles/models.py).
USER_WRITABLE = ("/var/lib/rigbook-serve", "/home", "/run/user")
#: Card classes without an NVLink connector (GeForce 40 and 50 series dropped it).
NO_NVLINK = ("rtx4090", "rtx5090")
#: Card classes that the proprietary kernel module does not drive (NVIDIA's open module only).
OPEN_ONLY = ("rtx5090",)
#: sysctl keys with their own host-data field, so sysctl_extra may not set them.
_SYSCTL_OWN = {
    "fs.inotify.max_user_watches": "sysctl_inotify_max_user_watches",
    "fs.inotify.max_user_instances": "sysctl_inotify_max_user_instances",
}


class VenvSpec(StrictModel):
    """One serving venv (built by the venvs role)."""

    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9_.-]*$", description="Stable name: /opt/rigbook/venvs/<name>."
    )
    engine: Literal["vllm", "sglang", "llama-cpp-python", "none"] = Field(
        description="The engine it serves; none = a plain venv (its smoke test imports the first "
        "package)."
    )
    python: str = Field("3.12", pattern=r"^3\.1[1-4]$", description="Python version for the venv.")
    packages: tuple[Requirement, ...] = Field(
        min_length=1, description="Pinned requirements: name==version, e.g. 'vllm==0.33.0'."
    )
    torch_backend: Literal["cu130"] = Field("cu130", description="CUDA build of torch.")
    extra_index_urls: tuple[HttpUrl, ...] = Field(
        (), description="More package indexes for this venv (e.g. an engine's own CUDA wheels)."
    )
    services: tuple[str, ...] = Field(
        (),
        description="systemd units that run from this venv: restarted (if running) after a swap.",
    )

    @field_validator("services")
    @classmethod
    def _unit_names(cls, units: tuple[str, ...]) -> tuple[str, ...]:
        for unit in units:
            if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9:_.@-]*\.service", unit):
                raise ValueError(f"{unit!r} is not a systemd service name (e.g. vllm.service)")
        return units


class ModelSpec(StrictModel):
    """One model snapshot in the Hugging Face cache (pulled by the models role)."""

    repo: RepoId = Field(description="Hub repo id, ORG/NAME.")
    revision: str = Field(pattern=r"^[0-9a-f]{40}$", description="Pinned commit hash (40 hex).")
    allow_patterns: tuple[Glob, ...] = Field(
        (), description="Only files matching these globs (none: all; for the GGUF repo of the "
        "rig's llama.cpp recipe, without ignore_patterns either: its model.file only)."
    )
    ignore_patterns: tuple[Glob, ...] = Field((), description="Skip files matching these globs.")
    manifest_sha256: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$",
        description="The sha256 (64 hex) of rigbook's manifest of this snapshot on the rig that "
        "pulled it from the hub (its 'is complete' line shows it): a pull from models_endpoint "
        "accepts that manifest only; required with models_endpoint.",
    )



# --- the power sweep's caps (sweep_watts) --------------------------------------------------------

#: At most this many caps per sweep: each one is a full bench.
MAX_CAPS = 64
#: No card takes more than this (W): a larger number is a typo, refused before any range check.
MAX_WATTS = 2000
_NUMBER = re.compile(r"\d{1,4}(?:\.\d{1,2})?")


def _cap(value: Any) -> float:
    """One cap in watts from a number or a numeric word; ValueError says what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a cap in watts")
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        number = float(value.strip())
    else:
        raise ValueError(f"{value!r} is not a cap in watts (digits, up to 2 decimals)")
    if not math.isfinite(number) or not 1 <= number <= MAX_WATTS:
        raise ValueError(f"{value!r} W is outside 1..{MAX_WATTS} W")
    return round(number, 2)


def parse_watts(value: Any) -> tuple[float, ...]:
    """The caps of sweep_watts, ascending and each once: START:STOP:STEP (both ends included),
    a comma list, a JSON list, or one cap. ValueError names what is wrong and what is allowed."""
    if value is None or value == "" or value == () or value == []:
        return ()
    if isinstance(value, list | tuple):
        caps = [_cap(item) for item in value]
    elif isinstance(value, str) and ":" in value:
        parts = value.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"{value!r}: a range is START:STOP:STEP, e.g. 250:350:10")
        start, stop = _cap(parts[0]), _cap(parts[1])
        try:
            step = _cap(parts[2])
        except ValueError:
            raise ValueError(f"{value!r}: STEP {parts[2]!r} is not a step of 1 W or more") from None
        if stop < start:
            raise ValueError(f"{value!r}: STOP {stop:g} is below START {start:g}")
        count = math.floor((stop - start) / step + 1e-9) + 1
        if count > MAX_CAPS:
            raise ValueError(f"{value!r} asks {count} caps; allowed: at most {MAX_CAPS}")
        caps = [round(start + i * step, 2) for i in range(count)]
    elif isinstance(value, str):
        caps = [_cap(part) for part in value.split(",")]
    else:
        caps = [_cap(value)]
    caps = sorted(set(caps))
    if len(caps) > MAX_CAPS:
        raise ValueError(f"{len(caps)} caps asked; allowed: at most {MAX_CAPS}")
    return tuple(caps)


class Rig(StrictModel):
    """The host data of one rig. Every key is optional unless marked required."""

    # -- hardware -----------------------------------------------------------------------------
    platform: Platform = Field(description="Operating system family; wsl2 means Ubuntu under WSL2.")
    gpu_class: GpuClass = Field(description="Card class of every GPU in the rig.")
    gpu_count: StrictInt = Field(ge=1, le=8, description="How many GPUs the rig has.")
    gpu_limits_watts: tuple[Watts, Watts] | None = Field(
        None, description="(min, max) power limit of the card; required when gpu_class is other."
    )
    cooling: Cooling = Field("air", description="How the cards are cooled; picks the sweet spot.")
    nvlink: StrictBool = Field(False, description="An NVLink bridge is installed and working.")

    # -- driver -------------------------------------------------------------------------------
    driver_branch: StrictInt = Field(
        580,
        description=f"NVIDIA driver branch; one of {DRIVER_BRANCHES}.",
    )
    driver_version: str | None = Field(
        None,
        pattern=r"^\d{3}\.\d{2,3}(\.\d{2})?$",
        description=(
            "Exact driver version to install (e.g. 580.95.05); none = newest of the branch."
        ),
    )
    driver_open: StrictBool = Field(
        True,
        description="Open kernel modules (the default from 560 on).",
    )
    driver_server: StrictBool = Field(
        False,
        description="Ubuntu only: the -server driver packages.",
    )
    driver_repo_uri: SourceUrl | None = Field(
        None,
        description="Debian: apt repository of the driver; none = NVIDIA's CUDA repository. "
        "Ubuntu: the one of the rig's own apt sources the driver comes from (a mirror or "
        "snapshot you control, which rigbook does not write); none = Ubuntu's archive.",
    )
    driver_repo_trusted: StrictBool = Field(
        False, description="Trust driver_repo_uri without a signing key (local test repositories)."
    )
    driver_persistence: StrictBool = Field(
        True, description="Run nvidia-persistenced with persistence mode on (Ubuntu ships it off)."
    )
    driver_modprobe_options: dict[str, str] = Field(
        {}, description="nvidia module options, e.g. {'NVreg_DynamicPowerManagement': '0x00'}."
    )
    driver_secure_boot: Literal["refuse", "enroll"] = Field(
        "refuse",
        description=(
            "With Secure Boot on and the DKMS signing key not enrolled (on Ubuntu: where no "
            "prebuilt signed module fits, docs/driver.md): refuse the rig and list the steps "
            "(refuse), or make the key when there is none and queue its enrolment, leaving one "
            "step at the console (enroll; docs/driver.md, Onboarding a real box)."
        ),
    )
    driver_foreign: Literal["refuse", "adopt"] = Field(
        "refuse",
        description=(
            "A driver rigbook does not own (a .run install, a host-mounted driver, packages "
            "from another source): refuse the rig before any change and name the steps to hand "
            "it over (refuse), or keep it as it is: install, hold, bump, pin and blacklist "
            "nothing, and check that it runs driver_version (adopt; docs/driver.md, Drivers "
            "rigbook does not own)."
        ),
    )
    allow_reboot: StrictBool = Field(
        False, description="A deploy may reboot the rig when a change needs it."
    )

    # -- the SSH link (rigbook/core/link.py) -------------------------------------------------------
    link_keepalive: Annotated[StrictInt, Field(ge=1, le=300)] = Field(
        15,
        description=(
            "Seconds between SSH keepalives while nothing else is sent to the rig: a rig that "
            "stops answering leaves one unacknowledged (docs/faults-fleet.md)."
        ),
    )
    link_lost_after: Annotated[StrictInt, Field(ge=5, le=3600)] = Field(
        45,
        description=(
            "Seconds that data sent to the rig may stay unacknowledged before its connection "
            "counts as lost (TCP_USER_TIMEOUT): the rig fails with 'lost the connection to "
            "RIG' at most link_keepalive + link_lost_after seconds after it stopped answering, "
            "and the other rigs go on."
        ),
    )

    # -- power --------------------------------------------------------------------------------
    power_profile: PowerProfile = Field(
        "sweet-spot",
        description="Named cap: sweet-spot (by card and cooling), prefill (3090: 250 W, 5090: "
        "400 W) or stock.",
    )
    power_cap_watts: Watts | None = Field(
        None, description="One cap for every GPU, in watts; overrides power_profile."
    )
    power_caps: dict[str, Watts] = Field(
        {}, description="Per-GPU caps in watts keyed by GPU index ('0') or UUID; override the rest."
    )

    psu_watts: Annotated[StrictInt, Field(ge=200, le=5000)] | None = Field(
        None,
        description="The power supply's rating in watts (single rail); none = not checked. The "
        "GPUs' caps (stock: each card's default limit, read on the rig) plus psu_host_watts "
        "must fit in it: the hardware notes' \"2 x 330 W ... at least 850 W single rail\" "
        "(docs/power.md, Power supply).",
    )
    psu_host_watts: Annotated[StrictInt, Field(ge=0, le=2000)] = Field(
        190,
        description="What the rest of the host draws under load, in watts, beside the GPUs' "
        "caps (the notes' 850 W for 2 x 330 W leaves 190 W).",
    )

    # -- host tuning --------------------------------------------------------------------------
    sysctl_inotify_max_user_watches: StrictInt = Field(
        1048576,
        ge=8192,
        le=2**24,  # each watch can pin about 1 KiB of kernel memory: 16 GiB at the top
        description="fs.inotify.max_user_watches (an engine died of ENOSPC at 65536).",
    )
    sysctl_inotify_max_user_instances: StrictInt = Field(
        1024, ge=128, le=65536, description="fs.inotify.max_user_instances."
    )
    sysctl_extra: dict[str, StrictInt | str] = Field(
        {}, description="Other sysctl keys for /etc/sysctl.d/90-rigbook.conf."
    )
    shm_size: str | None = Field(
        None, description="/dev/shm tmpfs size (e.g. 64G or 50%); none = leave it as it is."
    )
    stale_files: tuple[RigPath, ...] = Field(
        (),
        description="Leftover files to remove, e.g. /etc/sysctl.d/99-vllm-swap.conf: a file "
        f"directly in {', '.join(LEFTOVER_FOLDERS)}, a unit file of /etc/systemd/system or a "
        ".conf drop-in of its UNIT.d folders, never one of rigbook's own (it removes those "
        "itself). Only a regular file is removed: a folder, link, device or FIFO there is "
        "refused on the rig.",
    )

    @field_validator("models_cache")
    @classmethod
    def _cache_only_root_writes(cls, path: str) -> str:
        inside = next((top for top in USER_WRITABLE if path == top or path.startswith(top + "/")),
                      None)
        if inside:
            raise ValueError(f"{path} is in {inside}, which another user (the engine's, or a "
                             "login) can write: root's pulls and the engines' loads would trust "
                             "it; allowed: a folder only root can write, e.g. the default "
                             "/var/lib/rigbook/hf/hub")
        return path

    @field_validator("stale_files")
    @classmethod
    def _leftovers(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        for path in paths:
            if not _LEFTOVER.fullmatch(path):
                raise ValueError(
                    f"{path} is not in a folder leftovers live in; allowed: a file directly in "
                    f"{', '.join(LEFTOVER_FOLDERS)}, a unit file of /etc/systemd/system or a "
                    ".conf drop-in of its UNIT.d folders"
                )
            if "rigbook" in path:  # no folder above has it in its name: a file of rigbook's
                raise ValueError(f"{path} is rigbook's own file: rigbook writes it, or removes "
                                 "it when a key turns it off; allowed: other leftovers")
        return paths

    # -- WSL2 ---------------------------------------------------------------------------------
    wsl_tdr_delay: StrictInt = Field(60, ge=2, le=600, description="Windows TdrDelay in seconds.")
    wsl_tdr_ddi_delay: StrictInt = Field(
        60, ge=5, le=600,
        description="Windows TdrDdiDelay in seconds.",
    )
    wsl_tdr_disable: StrictBool = Field(False, description="Also set TdrLevel=0 (no TDR at all).")
    wsl_min_memory_gib: StrictInt = Field(
        24, ge=1, le=1024,
        description="Least WSL2 memory for model loading.",
    )

    # -- guards (roles/guards.py) -------------------------------------------------------------
    guards_shm_patterns: tuple[str, ...] = Field(
        ("vllm_offload_*.mmap",),
        min_length=1,
        description=(
            "File-name globs in /dev/shm the reaper may delete when no process holds them "
            "(leaked engine offload buffers). Each starts with at least 4 literal characters "
            "(letters, digits, _ . -; not . or - first) before any * ? [ ]."
        ),
    )
    guards_xid_watch: StrictBool = Field(
        True, description="Run the Xid watch (marks a lost GPU, logs engine faults)."
    )

    # -- the way back out (roles/offboard.py, deploys/offboard.py) ----------------------------
    offboard_remove: tuple[Literal["driver", "venvs", "models"], ...] = Field(
        (),
        description=(
            "What deploys/offboard.py removes beyond rigbook's own files, units, user and "
            "settings: `driver` (purges the driver packages, its apt source and the nouveau "
            "blacklist), `venvs` (the engine venvs, Python builds, uv cache), `models` (the "
            "HF cache). None: the driver, venvs and models stay (docs/footprint.md)."
        ),
    )

    @field_validator("guards_shm_patterns")
    @classmethod
    def _shm_patterns(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in patterns:
            problem = pattern_problem(pattern)  # the reaper on the rig checks the same rule
            if problem:
                raise ValueError(problem)
        return patterns

    # -- python packages ----------------------------------------------------------------------
    python_find_links: str | None = Field(
        None,
        description="Directory on the rig (absolute) or http(s) URL of wheels that pip and uv "
        "also install from (--find-links).",
    )
    python_no_index: StrictBool = Field(
        False, description="Install only from python_find_links, never from an index (offline)."
    )
    venvs_keep: StrictInt = Field(
        1, ge=0, le=10, description="Older builds of each venv kept for rollback."
    )
    rebuild_all: StrictBool = Field(
        False, description="Run option of deploys/venvs.py: rebuild every venv, stale or not."
    )

    @field_validator("venvs")
    @classmethod
    def _unique_venvs(cls, venvs: tuple[VenvSpec, ...]) -> tuple[VenvSpec, ...]:
        names = [spec.name for spec in venvs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"venvs names {', '.join(twice)} more than once")
        return venvs

    @model_validator(mode="after")
    def _driver_flavour(self) -> Rig:
        """RTX 50 cards (Blackwell) run only on NVIDIA's open kernel module."""
        if self.gpu_class in OPEN_ONLY and not self.driver_open and self.platform != "wsl2":
            raise ValueError(f"driver_open: false with gpu_class {self.gpu_class}: RTX 50 cards "
                             "run only on NVIDIA's open kernel module; allowed: true")
        return self

    @model_validator(mode="after")
    def _python_packages(self) -> Rig:
        if self.python_no_index and not self.python_find_links:
            raise ValueError("python_no_index needs python_find_links (nothing to install from)")
        return self

    # -- serving ------------------------------------------------------------------------------
    venvs: tuple[VenvSpec, ...] = Field((), description="Serving venvs to build (venvs role).")
    models: tuple[ModelSpec, ...] = Field((), description="Models to hold in the HF cache.")
    recipe: str | None = Field(
        None, pattern=r"^[a-z0-9][a-z0-9-]*$",
        description="Name of the serving recipe to run (docs/recipes.md).",
    )

    # -- serving (rigbook-serve.service) ------------------------------------------------------
    serving_bind: IpAddress | None = Field(
        None,
        description=(
            "Address the API binds to; none = the recipe's (127.0.0.1). Wider than loopback "
            "needs serving_api_key_file."
        ),
    )
    serving_port: StrictInt | None = Field(
        None, ge=1024, le=65535, description="API port; none = the recipe's (8000)."
    )
    serving_max_model_len: StrictInt | None = Field(
        None,
        ge=256,
        le=MAX_TOKENS,
        description="Lower the recipe's context on this rig (a card that also drives a display, "
        "e.g. a 4090 at ~23.5 GB usable); the KV estimate shrinks with it. None = the recipe's.",
    )
    serving_gpu_memory_utilization: StrictFloat | None = Field(
        None,
        ge=0.1,
        le=0.98,
        description="vLLM/SGLang: this rig's share of each card instead of the recipe's (other GPU "
        "consumers on the card). None = the recipe's.",
    )
    serving_api_key_file: LocalPath | None = Field(
        None,
        description=(
            "API key file on the operator's machine, readable by its owner only (chmod 600); "
            "copied root-only to the rig, passed to the engine in its environment, never on its "
            "command line."
        ),
    )
    serving_health_timeout_s: StrictInt = Field(
        900, ge=10, le=7200, description="How long a start may take to answer /v1/models."
    )
    serving_recipe_dirs: tuple[LocalPath, ...] = Field(
        (), description="More recipe folders on the operator's machine (no shadowing names)."
    )
    serving_env: dict[str, Line] = Field(
        {},
        description="Engine environment for this rig over the recipe's and the platform's, e.g. "
        "{'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:False'} (the hardware notes' override "
        "knob, \"no edits to tracked files\"): no copied recipe needed. Refused like a "
        "recipe's env: rigbook's own names, the loader's, and a name that reads as a secret "
        "(a key goes in serving_api_key_file).",
    )

    @field_validator("serving_env")
    @classmethod
    def _serving_env(cls, env: dict[str, str]) -> dict[str, str]:
        problems = env_problems(env)
        problems += [f"{name} reads as a secret; a key goes in a file "
                     "(serving_api_key_file)" for name in env if _SECRET_FIELD.search(name)]
        if problems:
            raise ValueError("; ".join(problems))
        return env

    @model_validator(mode="after")
    def _serving_section(self) -> Rig:
        if self.serving_bind is not None:
            address = ipaddress.ip_address(self.serving_bind)  # IpAddress: valid, no scope id
            if not address.is_loopback and self.serving_api_key_file is None:
                raise ValueError(
                    f"serving_bind {self.serving_bind} is wider than loopback: "
                    "set serving_api_key_file"
                )
        return self

    # -- verify (roles/verify.py, deploys/verify.py) -------------------------------------------
    verify_url: HttpUrl | None = Field(
        None,
        description="Where this machine reaches the rig's API (e.g. an SSH tunnel); none = "
        "http://<serving_bind or the rig's SSH address>:<port>.",
    )
    verify_prefill_tokens: StrictInt = Field(
        15000, ge=16, le=MAX_TOKENS,
        description="Run option: prompt size (tokens) the prefill step sends.",
    )
    verify_needle_depths: tuple[StrictFloat, ...] = Field(
        (0.1, 0.5, 0.9), min_length=1,
        description="Where the needle sits in its haystack (0 = start, 1 = end), one probe each.",
    )
    verify_needle_fill: StrictFloat = Field(
        0.9, ge=0.01, le=1, description="Haystack size as a share of the context (max_model_len)."
    )
    verify_needle_exact: StrictBool = Field(
        True,
        description="The needle must be answered back exactly (real models); false = the probe "
        "must only be accepted and complete (random-weights test models).",
    )
    verify_context_len: StrictInt | None = Field(
        None, ge=256, le=MAX_TOKENS,
        description="Context the ladder expects; none = the recipe's max_model_len.",
    )
    verify_bench_warmups: StrictInt = Field(
        2, ge=0, le=20,
        description="Unmeasured runs per prompt.",
    )
    verify_bench_runs: StrictInt = Field(5, ge=1, le=50, description="Measured runs per prompt.")
    verify_bench_tokens: StrictInt = Field(
        256, ge=8, le=8192, description="Tokens each bench run generates (min = max)."
    )
    verify_bench_concurrency: StrictInt = Field(
        4, ge=1, le=64, description="Streams at once in the concurrent bench (1 = skip it)."
    )
    verify_timeout_s: StrictInt = Field(
        300, ge=5, le=3600, description="Limit of one request (the longest prefill included)."
    )
    verify_level: Literal["quick", "stress", "soak"] = Field(
        "quick",
        description="Run option: quick = the ladder (health to bench); stress = salted needles "
        "at verify_stress_needles tokens and the context ceiling ladder with free VRAM per "
        "rung; soak = multi-turn sessions for verify_soak_seconds / verify_soak_requests "
        "(docs/verify.md).",
    )
    verify_stress_needles: tuple[StrictInt, ...] = Field(
        (10000, 30000, 60000, 90000), min_length=1, max_length=16,
        description="Run option (stress): prompt sizes (tokens) of the salted needles; those "
        "that do not fit the context are skipped.",
    )
    verify_ceiling_start: StrictInt = Field(
        95000, ge=64, le=MAX_TOKENS,
        description="Run option (stress): the ceiling ladder's first prompt (tokens); half of "
        "the top rung when that is not above it.",
    )
    verify_ceiling_rungs: StrictInt = Field(
        5, ge=1, le=20,
        description="Run option (stress): rungs from verify_ceiling_start to 0.92 of the context.",
    )
    verify_soak_seconds: StrictInt = Field(
        600, ge=5, le=7200,
        description="Run option (soak): no new turn after this many seconds.",
    )
    verify_soak_requests: StrictInt = Field(
        200, ge=2, le=5000, description="Run option (soak): at most this many turns in all."
    )
    verify_soak_turns: StrictInt = Field(
        8, ge=2, le=64, description="Run option (soak): turns of each session."
    )
    verify_soak_context_tokens: StrictInt = Field(
        25000, ge=64, le=MAX_TOKENS,
        description="Run option (soak): the prompt a session's last turn ramps to (at most 0.9 "
        "of the context); the hardware notes' multi-turn out-of-memory came at ~22-25K.",
    )
    verify_soak_min_retention: StrictFloat = Field(
        0.8, ge=0, le=1,
        description="Run option (soak): the last session's decode tok/s over the first's must "
        "reach this, unless the difference is inside the noise.",
    )

    # -- power sweep (roles/sweep.py, deploys/power_sweep.py) ----------------------------------
    sweep_watts: tuple[float, ...] = Field(
        (),
        description="Run option: the caps (W) deploys/power_sweep.py measures, as START:STOP:STEP "
        "(250:350:10, both ends included), a comma list (250,290,330) or one cap; at most 64. "
        "Left out: the whole range (power.min_limit to power.max_limit) at 10 W for a card class "
        "the notes measured (3090, 4090, 5090), else a first range, 60-85 % of the default limit.",
    )
    sweep_window_s: StrictInt = Field(
        10, ge=1, le=600,
        description="Run option: seconds of each decode window of the power sweep, timed from "
        "the first token (narrative and code, each concurrency); the hardware notes use 10, the "
        "power-sweep runbook 45.",
    )
    sweep_prefill_tokens: StrictInt = Field(
        40000, ge=64, le=MAX_TOKENS,
        description="Run option: tokens of the power sweep's frozen cold-prefill prompt (a new "
        "salt at its start each request; capped by the recipe's context); the runbook used "
        "39,760.",
    )
    sweep_concurrency_probe: StrictBool = Field(
        False,
        description="Run option: before the caps, find where decode concurrency plateaus at the "
        "rig's current cap (1, 2, 4, ... streams up to the recipe's max_num_seqs, or 64): the "
        "smallest level within noise of the best becomes the sweep's decode-concurrent level. "
        "Not on llama.cpp (one stream at a time).",
    )
    sweep_hwmon_dir: RigPath = Field(
        "/sys/class/hwmon",
        description="Run option: where the sweep's meter looks for a PSU's telemetry (a hwmon "
        "folder named corsairpsu, the kernel's corsair-psu driver) to record whole-system power "
        "beside the cards'.",
    )

    @field_validator("sweep_watts", mode="before")
    @classmethod
    def _sweep_watts(cls, value: Any) -> tuple[float, ...]:
        return parse_watts(value)

    @field_validator("verify_stress_needles")
    @classmethod
    def _stress_needles(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        for size in sizes:
            if not 64 <= size <= MAX_TOKENS:
                raise ValueError(f"needle size {size} is outside 64..{MAX_TOKENS} tokens")
        return tuple(sorted(set(sizes)))

    @field_validator("verify_needle_depths")
    @classmethod
    def _needle_depths(cls, depths: tuple[float, ...]) -> tuple[float, ...]:
        for depth in depths:
            if not 0 <= depth <= 1:
                raise ValueError(f"depth {depth} is outside 0..1 (0 = start, 1 = end)")
        return depths

    # -- models (Hugging Face cache) ----------------------------------------------------------
    models_cache: RigPath = Field(
        "/var/lib/rigbook/hf/hub",
        description="HF_HUB_CACHE on the rig: models are pulled into it and served from it. "
        "Only root may be able to write it: a path in /var/lib/rigbook-serve (the engine's "
        "home), /home or /run/user is refused before connecting; on the rig, a folder above or "
        "in it that is not root's or is open to others' writes, or a link outside the "
        "snapshots, is refused by the preflight.",
    )
    models_endpoint: HttpUrl | None = Field(
        None,
        description="rigbook mirror to pull from (another rig's models_mirror_port, e.g. "
        "http://10.0.0.5:8090; needs models_mirror_token_file and every model's manifest_sha256); "
        "none = the hub.",
    )
    models_disk_margin_gib: StrictFloat = Field(
        10, ge=0, le=10240,
        description="Free space (GiB) a pull must leave on the cache filesystem.",
    )
    models_token_file: LocalPath | None = Field(
        None,
        description=("HF token file on the operator's machine, readable by its owner only (chmod "
                     "600); wins over the HF_TOKEN env var."),
    )
    models_prune: StrictBool = Field(
        False, description="Remove cached repos that models does not list (else only report)."
    )
    models_only: RepoId | None = Field(
        None, description="Run option: pull only this repo (ORG/NAME, one of models)."
    )
    models_mirror_port: StrictInt | None = Field(
        None, ge=1024, le=65535,
        description="Serve this rig's complete snapshots to other rigs on this port (needs "
        "models_mirror_token_file); none = off.",
    )
    models_mirror_bind: IpAddress | None = Field(
        None,
        description="Address the mirror listens on, one of the rig's own (not 0.0.0.0 or ::); "
        "none = the rig's address that the operator's SSH connection reached (SSH_CONNECTION).",
    )
    models_mirror_token_file: LocalPath | None = Field(
        None,
        description="The fleet's mirror token file on the operator's machine, readable by its "
        "owner only (chmod 600): the mirror answers only requests with it, a rig with "
        "models_endpoint sends it (never the HF token).",
    )

    @model_validator(mode="after")
    def _models_section(self) -> Rig:
        repos = [spec.repo for spec in self.models]
        twice = sorted({repo for repo in repos if repos.count(repo) > 1})
        if twice:
            raise ValueError(f"models lists {', '.join(twice)} more than once; pin one revision")
        if self.models_only is not None and self.models_only not in repos:
            raise ValueError(
                f"models_only {self.models_only!r} is not in models "
                f"(allowed: {', '.join(repos) or 'none: models is empty'})"
            )
        for key in ("models_mirror_port", "models_endpoint"):
            if getattr(self, key) is not None and self.models_mirror_token_file is None:
                raise ValueError(f"{key} needs models_mirror_token_file: rigbook's mirror "
                                 "answers only requests with the fleet's token")
        unpinned = [f"models[{index}] ({spec.repo})" for index, spec in enumerate(self.models)
                    if spec.manifest_sha256 is None]
        if self.models_endpoint is not None and unpinned:
            raise ValueError(
                f"{', '.join(unpinned)}: no manifest_sha256, which models_endpoint needs: a "
                "pull from a mirror accepts only the manifest you pinned (allowed: 64 hex). "
                "Take it from the rig that pulled the model from the hub: its run says "
                "'ORG/NAME@<commit> is complete in ... manifest sha256 <64 hex>', or run "
                "sha256sum <models_cache>/models--ORG--NAME/rigbook/<revision>.json there"
            )
        if self.models_mirror_bind is not None:
            if self.models_mirror_port is None:
                raise ValueError("models_mirror_bind without models_mirror_port: no mirror runs")
            address = ipaddress.ip_address(self.models_mirror_bind)  # IpAddress: no scope id
            if address.is_unspecified or address.is_multicast:
                raise ValueError(
                    f"models_mirror_bind {self.models_mirror_bind} is not one address of the "
                    "rig (0.0.0.0 and :: serve every network it is on); allowed: its LAN "
                    "address, e.g. 10.0.0.5, or unset for the address SSH reaches"
                )
        return self

    @field_validator("driver_branch")
    @classmethod
    def _known_branch(cls, value: int) -> int:
        if value not in DRIVER_BRANCHES:
            raise ValueError(f"unknown driver branch {value}; allowed: {DRIVER_BRANCHES}")
        return value

    @field_validator("driver_modprobe_options")
    @classmethod
    def _modprobe_options(cls, options: dict[str, str]) -> dict[str, str]:
        for key, value in options.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError("module parameter names are letters, digits and _, e.g. "
                                 "NVreg_DynamicPowerManagement")
            if not re.fullmatch(r"[A-Za-z0-9_.,:+/=-]+", value):
                raise ValueError(f"{key}: a value is one word of letters, digits and _ . , : + / "
                                 "= - (no spaces, quotes or #), e.g. 0x00")
        return options

    @field_validator("shm_size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None and not _SIZE.fullmatch(value):
            raise ValueError("a tmpfs size, e.g. 64G, 512M or 50%")
        return value

    @field_validator("sysctl_extra")
    @classmethod
    def _sysctl_keys(cls, extra: dict[str, int | str]) -> dict[str, int | str]:
        for key, value in extra.items():
            if not _SYSCTL_KEY.fullmatch(key):
                raise ValueError("sysctl keys are dotted names, e.g. vm.max_map_count")
            if key in _SYSCTL_OWN:
                raise ValueError(f"{key} has its own key: set {_SYSCTL_OWN[key]} instead")
            if isinstance(value, str) and not _SYSCTL_VALUE.fullmatch(value):
                raise ValueError(f"{key}: a sysctl value is a number or words of letters, digits "
                                 "and _ . , : / - separated by single spaces (no '#', quotes or "
                                 "newline)")
        return extra

    @field_validator("power_caps")
    @classmethod
    def _caps(cls, caps: dict[str, int]) -> dict[str, int]:
        for gpu in caps:
            if not _GPU_KEY.fullmatch(gpu):
                raise ValueError("power_caps keys are a GPU index (0, 1, ...; no leading zero) "
                                 "or a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
        return caps

    @field_validator("python_find_links")
    @classmethod
    def _find_links(cls, value: str | None) -> str | None:
        if value is None or value.startswith("/"):
            return value if value is None else rig_path(value)
        return http_url(value)

    @model_validator(mode="after")
    def _consistent(self) -> Rig:
        if self.gpu_class == "other" and self.gpu_limits_watts is None:
            raise ValueError("gpu_class other needs gpu_limits_watts: (min, max)")
        if self.gpu_limits_watts and self.gpu_limits_watts[0] >= self.gpu_limits_watts[1]:
            raise ValueError(f"gpu_limits_watts {self.gpu_limits_watts}: min must be below max")
        if self.platform != "ubuntu" and self.driver_server:
            raise ValueError("driver_server is for Ubuntu's -server packages only")
        if self.power_cap_watts is None and self.power_profile != "stock":
            self.default_cap()  # raises when the card has no documented cap for the profile
        for gpu in self.power_caps:
            if gpu.isdigit() and int(gpu) >= self.gpu_count:
                has = ("one GPU, index 0" if self.gpu_count == 1
                       else f"{self.gpu_count} GPUs, indexes 0-{self.gpu_count - 1}")
                raise ValueError(f"power_caps names GPU {gpu} but the rig has {has} (gpu_count)")
        if self.nvlink and self.gpu_class in NO_NVLINK:
            raise ValueError(f"nvlink: {self.gpu_class} cards have no NVLink connector")
        low, high = self.gpu_limits_watts or (None, None)
        if low is not None:
            asked = {"power_cap_watts": self.power_cap_watts, **{
                f"power_caps[{gpu}]": watts for gpu, watts in self.power_caps.items()}}
            for key, watts in asked.items():
                if watts is not None and not low <= watts <= high:
                    raise ValueError(f"{key} {watts} W is outside gpu_limits_watts {low}-{high} W")
        return self

    @model_validator(mode="after")
    def _pairs(self) -> Rig:
        """Keys that contradict each other: each names both keys and what is allowed."""
        branch = self.driver_version.split(".")[0] if self.driver_version else None
        if branch is not None and branch != str(self.driver_branch):
            raise ValueError(
                f"driver_version {self.driver_version} is not of driver_branch "
                f"{self.driver_branch}; allowed: a {self.driver_branch}.x version, or "
                f"driver_branch {branch}"
            )
        if self.driver_repo_trusted and self.driver_repo_uri is None:
            raise ValueError("driver_repo_trusted without driver_repo_uri: NVIDIA's repository "
                             "is always checked with its key; allowed: driver_repo_uri set")
        if self.driver_repo_uri is not None and self.platform == "wsl2":
            raise ValueError("driver_repo_uri: platform wsl2 uses the Windows driver; "
                             "allowed: leave it unset")
        if self.driver_repo_trusted and self.platform != "debian":
            raise ValueError(f"driver_repo_trusted is for platform debian only (platform is "
                             f"{self.platform}): rigbook writes no source on Ubuntu; allowed: "
                             "leave it unset")
        native = {"driver_version": self.driver_version is not None,
                  "driver_modprobe_options": bool(self.driver_modprobe_options),
                  "driver_secure_boot": self.driver_secure_boot == "enroll",
                  "driver_foreign": self.driver_foreign == "adopt"}
        native_keys = [key for key, given in native.items() if given]
        if self.platform == "wsl2" and native_keys:
            raise ValueError(f"{native_keys[0]}: platform wsl2 uses the Windows driver (rigbook "
                             "installs no driver there); allowed: leave it unset")
        wsl_keys = sorted(key for key in self.model_fields_set if key.startswith("wsl_"))
        if self.platform != "wsl2" and wsl_keys:
            raise ValueError(f"{wsl_keys[0]} is for platform wsl2 only (platform is "
                             f"{self.platform}); allowed: leave it unset")
        if self.serving_port is not None and self.serving_port == self.models_mirror_port:
            raise ValueError(f"serving_port and models_mirror_port are both "
                             f"{self.serving_port}: one port, two listeners; allowed: two ports")
        if self.nvlink and self.gpu_count < 2:
            raise ValueError("nvlink with gpu_count 1: a bridge joins two cards; allowed: "
                             "nvlink false, or gpu_count 2 or more")
        if len(self.power_caps) > self.gpu_count:
            raise ValueError(f"power_caps names {len(self.power_caps)} GPUs but the rig has "
                             f"{self.gpu_count} (gpu_count); allowed: at most one cap per GPU")
        return self

    def default_cap(self) -> int | None:
        """The cap every GPU gets unless power_caps names it; None means the card's default."""
        if self.power_cap_watts is not None:
            return self.power_cap_watts
        if self.power_profile == "stock":
            return None
        table = SWEET_SPOTS.get((self.gpu_class, self.power_profile))
        if table is None:
            raise ValueError(
                f"no documented {self.power_profile} cap for {self.gpu_class}: "
                "set power_cap_watts or power_profile: stock"
            )
        if self.cooling not in table:
            measured = ", ".join(table)
            raise ValueError(
                f"no documented {self.power_profile} cap for {self.gpu_class} cooled by "
                f"{self.cooling}: the hardware notes measured it {measured}-cooled only "
                "(docs/sources.md, Power sweet spots); set power_cap_watts or power_profile: stock"
            )
        return table[self.cooling]


#: What a field with a pattern allows, in words (pydantic would show the raw regex).
PATTERN_WORDS = {
    "driver_version": "a driver version such as 580.95.05",
    "name": "a name of lowercase letters, digits and _ . - that starts with a letter or digit",
    "repo": "a Hugging Face repo id, owner/name",
    "models_only": "a Hugging Face repo id, owner/name",
    "revision": "a commit: 40 hex digits",
    "python": "a Python version from 3.11 to 3.14",
    "recipe": "a recipe name of lowercase letters, digits and - (docs/recipes.md lists them)",
}
#: A field whose value is never shown back, whatever it looks like.
_SECRET_FIELD = re.compile(r"(?i)token|secret|password|api_?key")
_DOCS = "docs/host-data.md lists every key"


def _shown(value: Any, field: str) -> str:
    """How a refused value is shown: short, and never when it could be a secret."""
    text = repr(value)
    if looks_secret(text) or _SECRET_FIELD.search(field) or _SECRET_FIELD.search(text):
        return "a value that looks like a secret (not shown)"
    return text if len(text) <= 80 else text[:77] + "..."


def _bounds(items) -> dict[str, float]:
    """The ge/gt/le/lt bounds among pydantic metadata and the types they annotate."""
    found: dict[str, float] = {}
    for item in items:
        if isinstance(item, FieldInfo):
            found |= _bounds(item.metadata)
            continue
        for bound in ("ge", "gt", "le", "lt"):
            if isinstance(getattr(item, bound, None), (int, float)):
                found[bound] = getattr(item, bound)
        found |= _bounds(get_args(item))
    return found


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def range_of(key: str) -> str | None:
    """What a numeric key of Rig allows, in words ("1 to 8"); None for a key with no range."""
    field = Rig.model_fields.get(key)
    bounds = _bounds([*field.metadata, field.annotation]) if field else {}
    low = (_number(bounds["ge"]) if "ge" in bounds
           else f"more than {_number(bounds['gt'])}" if "gt" in bounds else None)
    high = (_number(bounds["le"]) if "le" in bounds
            else f"less than {_number(bounds['lt'])}" if "lt" in bounds else None)
    return f"{low} to {high}" if low is not None and high is not None else None


_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _field_error(host: str, error: dict[str, Any], fields: set[str]) -> str:
    loc = [str(part) for part in error["loc"]]
    where = ".".join(loc)
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(loc[0], fields, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        if _SECRET_FIELD.search(loc[0]):
            hint += "a token or key goes in a file: models_token_file, serving_api_key_file; "
        return f"{host}: {where}: unknown key ({hint}{_DOCS})"
    if error["type"] == "string_pattern_mismatch":
        field = next((part for part in reversed(loc) if not part.isdigit()), "")
        message = f"allowed: {PATTERN_WORDS.get(field, error['ctx']['pattern'])}"
    if error["type"] in _BOUND_ERRORS and loc and range_of(loc[0]):
        message += f"; allowed: {range_of(loc[0])}"
    if not loc:  # the rig as a whole: say what is wrong, never dump its host data
        return f"{host}: {message}"
    if "input" in error and error["type"] != "missing":
        message += f" (got {_shown(error['input'], where)})"
    return f"{host}: {where}: {message}"


def rig_data(data: dict[str, Any]) -> dict[str, Any]:
    """The keys of a host's data that rigbook owns (pyinfra's connector keys left out)."""
    return {key: value for key, value in data.items() if not PYINFRA_KEY.match(key)}


def parse_rig(host: str, data: dict[str, Any]) -> Rig:
    """Validate one host's data; RigbookError lists every bad field with the host's name."""
    try:
        return Rig.model_validate(rig_data(data))
    except ValidationError as exc:
        fields = set(Rig.model_fields)
        lines = [_field_error(host, error, fields) for error in exc.errors()]
        raise RigbookError("\n".join(lines)) from None

