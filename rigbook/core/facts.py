"""rigbook's own pyinfra facts: rig state that pyinfra's built-in facts do not read.

Each fact is a small class with `command()` and `process()`, and a docstring that shows real
output. Parsing lives in plain modules (rigbook/rigside/gpus.py for anything nvidia-smi or NVML
prints) so that tests feed real captured output to the same code the facts run.

A fact whose command exits non-zero fails the host in pyinfra (api/facts.py), and only stdout
reaches `process()`. Facts that read a layer which can be broken on a live rig (a driver
mismatch after an upgrade without reboot) therefore run their command inside a shell wrapper
that always exits 0 and reports the real exit status and stderr on marked stdout lines.

Grouped by concern:

- GPU layer: NvidiaGpus, NvidiaDriverVersion, LoadedNvidiaModule
- the GPU check every GPU-using role shares (GPUS): nvidia-smi against gpu_count and gpu_class
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyinfra.api import FactBase, ShortFactBase
from pyinfra.api.exceptions import FactProcessError

from rigbook.core.checks import Check, Facts, Finding, Read, drift, error, warn
from rigbook.core.spec import Rig
from rigbook.core.types import JsonValue
from rigbook.rigside.gpus import Gpu, GpuProbe, parse_query_csv, query_args, smi_failure
from rigbook.rigside.xid import (
    MISMATCH_PATTERN,
    Mismatch,
    Module,
    current_mismatch,
    parse_module,
)

# --- GPU layer -----------------------------------------------------------------------------

#: Where else nvidia-smi lives, tried in this order after the one on PATH (distro packages):
#: WSL2's copy of the Windows driver's tool (a distro nvidia-smi on PATH shadows it there and
#: fails), and the NVIDIA container-toolkit / cloud image location (the H200 host's only one).
WSL_NVIDIA_SMI = "/usr/lib/wsl/lib/nvidia-smi"
NVIDIA_SMI_PATHS = (WSL_NVIDIA_SMI, "/usr/local/nvidia/bin/nvidia-smi")

_SMI = "##RIGBOOK_SMI##"
_RC = "##RIGBOOK_RC##"
_NO_SMI = "##RIGBOOK_NO_SMI##"

#: Seconds one nvidia-smi call may take: a card that fell off the bus can hang it for ever.
SMI_TIMEOUT_S = 60


def smi_script(args: str) -> str:
    """Shell that runs `nvidia-smi ARGS` from the first place that works, always exiting 0.

    Each attempt prints `_SMI path`, the tool's stdout and stderr, and `_RC status`; it stops at
    the first attempt that exits 0. No nvidia-smi anywhere prints `_NO_SMI`.
    """
    candidates = " ".join(f"'{path}'" for path in NVIDIA_SMI_PATHS)
    return (
        'tried=" "; limit=""; '
        f'command -v timeout >/dev/null 2>&1 && limit="timeout {SMI_TIMEOUT_S}"; '
        f'for c in "$(command -v nvidia-smi)" {candidates}; do '
        '[ -n "$c" ] && [ -x "$c" ] || continue; '
        'case "$tried" in *" $c "*) continue;; esac; '
        'tried="$tried$c "; '
        f'echo "{_SMI} $c"; '
        f'$limit "$c" {args} 2>&1; rc=$?; '
        f"printf '\\n{_RC} %s\\n' \"$rc\"; "
        '[ "$rc" -eq 0 ] && break; '
        "done; "
        f'[ "$tried" = " " ] && echo "{_NO_SMI}"; '
        "true"
    )


def smi_attempts(output: list[str]) -> list[tuple[str, list[str], int]] | None:
    """(path, output lines, exit status) per nvidia-smi tried; None when there was none."""
    if output and output[0].strip() == _NO_SMI:
        return None
    attempts: list[tuple[str, list[str], int]] = []
    path, lines = None, []
    for line in output:
        if line.startswith(_SMI):
            path, lines = line[len(_SMI):].strip(), []
        elif line.startswith(_RC):
            if path is None:
                raise FactProcessError(f"nvidia-smi status without a path: {output!r}")
            attempts.append((path, [x for x in lines if x.strip()], int(line[len(_RC):])))
            path = None
        else:
            lines.append(line)
    if not attempts:
        raise FactProcessError(f"no nvidia-smi attempt in the output: {output!r}")
    return attempts


def smi_answer(attempts: list[tuple[str, list[str], int]]) -> tuple[str, list[str], int]:
    """The first nvidia-smi that exited 0; if none did, the first one, whose message (what a user
    on that host gets by typing nvidia-smi) says what is broken."""
    return next((attempt for attempt in attempts if attempt[2] == 0), attempts[0])


class NvidiaGpus(FactBase[GpuProbe | None]):
    """
    The GPUs as nvidia-smi reports them, or why it cannot; None when no nvidia-smi exists.

    Runs ``nvidia-smi --query-gpu=<rigbook.rigside.gpus.QUERY_FIELDS> --format=csv,nounits``, whose
    output is like (real, H200)::

        index, uuid, name, pci.bus_id, driver_version, power.limit [W], ...
        0, GPU-b76da475-45a0-f91f-b11d-022ca55575ef, NVIDIA H200, 00000000:00:06.0, ...

    and returns a ``rigbook.rigside.gpus.GpuProbe``:

    .. code:: python

        GpuProbe(smi="/usr/local/nvidia/bin/nvidia-smi", gpus=(Gpu(index=0, ...),))

    When nvidia-smi exists but fails, the deploy goes on and the probe carries its message:

    .. code:: python

        GpuProbe(smi="/usr/bin/nvidia-smi", gpus=(), exit_code=18,
                 error="Failed to initialize NVML: Driver/library version mismatch")
    """

    def command(self) -> str:
        return smi_script(query_args(header=True))

    def process(self, output: list[str]) -> GpuProbe | None:
        attempts = smi_attempts(output)
        if attempts is None:
            return None
        path, lines, status = smi_answer(attempts)
        text = "\n".join(lines)
        if status == 124:  # coreutils timeout: the card hangs nvidia-smi
            text = f"nvidia-smi did not answer within {SMI_TIMEOUT_S} s\n{text}"
        if status != 0:
            return GpuProbe(smi=path, error=text.strip() or f"exit {status}", exit_code=status)
        try:
            return GpuProbe(smi=path, gpus=tuple(parse_query_csv(text)))
        except ValueError as e:  # e.g. "No devices were found" printed with exit 0
            return GpuProbe(smi=path, error=f"{text.strip()} ({e})")


class NvidiaDriverVersion(ShortFactBase[str | None]):
    """
    The driver version nvidia-smi reports (``"580.159.04"``), from NvidiaGpus.

    None when there is no nvidia-smi or it fails: a mismatch after an upgrade without reboot has
    no single version; compare LoadedNvidiaModule (the kernel side) with the packages then.
    """

    fact = NvidiaGpus

    def process_data(self, data: GpuProbe | None) -> str | None:
        return data.driver_version if data is not None else None


class LoadedNvidiaModule(FactBase[str | None]):
    """
    The version of the loaded nvidia kernel module, from /proc/driver/nvidia/version.

    None when the module is not loaded (no file; also always on WSL2, where the Windows driver
    serves the GPU). Real output of the open module (H200 host)::

        NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (...)
        GCC version:  gcc version 15.3.0 (GCC)

    The proprietary module writes ``NVRM version: NVIDIA UNIX x86_64 Kernel Module  515.76  ...``.
    """

    def command(self) -> str:
        return "! test -r /proc/driver/nvidia/version || cat /proc/driver/nvidia/version"

    def process(self, output: list[str]) -> str | None:
        for module in map(parse_module, output):
            if module is not None:
                return module.version
        raise FactProcessError(f"no NVRM version line in /proc/driver/nvidia/version: {output!r}")


_KLOG_MARK = "##RIGBOOK_KLOG##"


@dataclass(frozen=True)
class RunningDriver(JsonValue):
    """The kernel module that runs (None: not loaded) and this boot's API mismatch, if any."""

    module: Module | None = None
    mismatch: Mismatch | None = None


class RunningDriverFact(FactBase[RunningDriver]):
    """
    The loaded module's flavour and version (/proc/driver/nvidia/version, rigbook.rigside.xid's
    parse_module) and the kernel's API mismatch of this boot (``journalctl -k -b 0``, else
    dmesg; rigbook.rigside.xid's current_mismatch). Output::

        NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ...
        ##RIGBOOK_KLOG##
        Aug 26 14:08:07 rig1 kernel: NVRM: API mismatch: the client has the version 580.173.02,
                                     NVRM: but this kernel module has the version 580.159.04.
    """

    @staticmethod
    def default() -> RunningDriver:
        return RunningDriver()

    def command(self) -> str:
        journal = "journalctl -k -b 0 -o short -q --no-pager"
        return (
            "head -n 1 /proc/driver/nvidia/version 2>/dev/null; "
            f"echo '{_KLOG_MARK}'; "
            f'if [ -n "$({journal} -n 1 2>/dev/null)" ]; then {journal} 2>/dev/null; '
            f"else dmesg 2>/dev/null; fi | grep -E '{MISMATCH_PATTERN}' | tail -n 200; true"
        )

    def process(self, output: list[str]) -> RunningDriver:
        at = output.index(_KLOG_MARK) if _KLOG_MARK in output else len(output)
        module = next((m for m in map(parse_module, output[:at]) if m), None)
        return RunningDriver(module, current_mismatch(output[at + 1:]))


#: nvidia-smi's mismatch message may name NVML's version: "NVML library version: 570.124".
_NVML_VERSION = re.compile(r"NVML library version: (\d+(?:\.\d+){1,3})")


def mismatch_finding(probe: GpuProbe | None, running: RunningDriver | None) -> Finding | None:
    """One finding for a driver whose user space and loaded kernel module disagree, from the
    kernel's API mismatch (both versions) or nvidia-smi's "Driver/library version mismatch"
    (the module from /proc/driver/nvidia/version, NVML's version where it prints it)."""
    running = running or RunningDriver()
    nvml = probe is not None and not probe.ok and smi_failure(probe.error or "") == (
        "version-mismatch")
    logged = running.mismatch
    module = running.module.version if running.module else (logged.module if logged else None)
    if logged is not None and logged.module != module:
        logged = None  # the log names another module than the one that runs now
    if logged is None and not nvml:
        return None
    if logged is not None and probe is not None and probe.ok:
        who = f"{logged.process} (pid {logged.pid})" if logged.process else "a client"
        return warn("driver", f"{who} has driver user-space {logged.client} against kernel "
                    f"module {module} (kernel log, {logged.when or 'this boot'}); nvidia-smi "
                    "works: restart that client")
    nvml_version = _NVML_VERSION.search(probe.error or "") if nvml and probe else None
    client = logged.client if logged else nvml_version.group(1) if nvml_version else None
    user = client or "(version not printed)"
    reinstall = f"the {module} user-space packages" if module else (
        "the user-space packages of the loaded module")
    return Finding(
        "mismatch", "driver",
        f"driver user-space {user}, kernel module {module or '(not read)'}: reboot to load the "
        f"{user} module (or reinstall {reinstall}); nothing serves until then",
    )


def flavour_finding(rig: Rig, running: RunningDriver | None) -> Finding | None:
    """Drift when the module that runs is not the flavour `driver_open` asks for."""
    module = running.module if running else None
    if module is None or rig.platform == "wsl2":
        return None
    wanted = "open" if rig.driver_open else "proprietary"
    if module.flavour == wanted:
        return None
    return drift("driver", f"the {module.flavour} kernel module {module.version} runs; "
                 f"driver_open: {str(rig.driver_open).lower()} asks for the {wanted} one "
                 "(/proc/driver/nvidia/version)", key="driver_open")


# --- the GPU check -------------------------------------------------------------------------

#: What nvidia-smi calls the cards of each gpu_class. A rig declared `other` must have none of
#: these: `other` is for cards rigbook has no class for (a modded 20 GB 3080), and a known card
#: declared as `other` would skip its class's name, SM86 and VRAM checks.
CLASS_NAMES = {
    "rtx3090": re.compile(r"RTX 3090(?! Ti)"),
    "rtx3090ti": re.compile(r"RTX 3090 Ti"),
    "rtx4090": re.compile(r"RTX 4090"),
    "rtx5090": re.compile(r"RTX 5090"),
    "a5000": re.compile(r"RTX A5000"),
    "a6000": re.compile(r"RTX A6000"),
}

GPUS_READ = Read("probe", NvidiaGpus, "GPUs (nvidia-smi)")
RUNNING_READ = Read("running", RunningDriverFact, "loaded module and API mismatch (kernel log)")


def usable(probe: GpuProbe | None) -> bool:
    """nvidia-smi exists, answers and lists GPUs."""
    return probe is not None and probe.ok and bool(probe.gpus)


def count_finding(rig: Rig, gpus: tuple[Gpu, ...]) -> Finding | None:
    """An error when the rig shows another number of GPUs than gpu_count."""
    if len(gpus) == rig.gpu_count:
        return None
    seen = ", ".join(f"{gpu.index} {gpu.uuid}" for gpu in gpus) or "none"
    return error("gpu", f"declared {rig.gpu_count}, nvidia-smi lists {len(gpus)} ({seen}); "
                 "allowed: the number the rig has: fix gpu_count or the hardware",
                 key="gpu_count")


def gpu_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """The GPU layer as nvidia-smi shows it against gpu_count and gpu_class."""
    if facts.missing("probe", "running"):
        return facts.missing("probe", "running")
    probe = facts.probe
    mismatch = mismatch_finding(probe, facts.running)
    if mismatch is not None and mismatch.level == "mismatch":
        return [mismatch]  # nvidia-smi's own failure says the same, in fewer words
    if probe is None:
        where = f"{WSL_NVIDIA_SMI} (update the Windows driver)" if (
            rig.platform == "wsl2") else "nvidia-smi (no driver installed?)"
        return [drift("gpu", f"no {where}")]
    if not probe.ok:
        return [Finding("gone", "gpu", f"{probe.smi} fails: {probe.error}")]
    if not probe.gpus:
        return [Finding("gone", "gpu", f"{probe.smi} lists no GPUs")]
    count = count_finding(rig, probe.gpus)
    found = [f for f in (count, mismatch, flavour_finding(rig, facts.running)) if f]
    pattern = CLASS_NAMES.get(rig.gpu_class)
    for gpu in probe.gpus:
        known = known_class(gpu.name)
        if rig.gpu_class == "other" and known is not None:
            found.append(error(
                "gpu", f"other declared, card is {gpu.name}: rigbook knows it as {known}; "
                f"allowed: gpu_class {known} (other would skip its checks: card, SM86 limits, "
                "VRAM)", key="gpu_class", gpu=gpu.uuid))
        elif pattern is not None and not pattern.search(gpu.name):
            found.append(drift("gpu", f"gpu_class {rig.gpu_class} declared, card is {gpu.name}",
                               gpu=gpu.uuid))
    return found


def known_class(name: str) -> str | None:
    """The gpu_class nvidia-smi's card name belongs to (None: a card rigbook has no class for)."""
    return next((cls for cls, pattern in CLASS_NAMES.items() if pattern.search(name)), None)


#: Shared by every role whose checks need the GPUs (power, venvs, serving) and by status.
GPUS = Check("GPUs", lambda rig, name: [GPUS_READ, RUNNING_READ], gpu_findings, gpus=True)
CHECKS = (GPUS,)
