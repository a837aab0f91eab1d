"""What the GPUs are and how they are set, parsed from nvidia-smi, and the NVML health probe.

Every role that looks at GPUs (power caps, driver checks, serving preflight, the status table)
reads them through this one module, so a GPU means the same `Gpu` everywhere. It is plain Python
on purpose: it imports no pyinfra, so `python3 gpus.py --probe` also runs on a rig on its own,
where only nvidia-ml-py (pynvml) is needed, and the facts in rigbook/core/facts.py only build
commands around it.

- `nvidia-smi --query-gpu=... --format=csv` (`parse_query_csv`): what the GPU facts read;
- the NVML probe below (`nvml_probe`, `--probe`): `rigbook status` runs it on a rig with the
  tools venv's python for the GPU health readings (roles/health.py parses its JSON).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any

#: Exit status of `--probe` when NVML cannot be loaded or initialised (no driver, mismatch).
PROBE_NO_NVML = 3


class ProbeError(RuntimeError):
    """The NVML probe could not run: the GPU layer is broken or missing on that host."""


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi reports it; None where it did not say.

    Power is in watts, memory in MiB (as nvidia-smi counts it), temperature in degrees C.
    `bus_id` is nvidia-smi's `00000000:00:06.0` form.
    """

    index: int
    uuid: str
    name: str
    bus_id: str
    driver_version: str | None = None
    power_limit_w: float | None = None
    default_limit_w: float | None = None
    min_limit_w: float | None = None
    max_limit_w: float | None = None
    enforced_limit_w: float | None = None
    power_draw_w: float | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    persistence: bool | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    temperature_c: int | None = None
    compute_cap: str | None = None


@dataclass(frozen=True)
class GpuProbe:
    """What asking one nvidia-smi gave: the GPUs, or why the GPU layer is broken.

    A broken layer (driver/library mismatch after an upgrade without reboot, no device found)
    is a state to report and act on, not a crash: `error` holds nvidia-smi's own message and
    `gpus` is empty then. `smi` is the path of the nvidia-smi that answered.
    """

    smi: str
    gpus: tuple[Gpu, ...] = ()
    error: str | None = None
    exit_code: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def driver_version(self) -> str | None:
        """The driver version nvidia-smi reports (one per host), None when it could not say."""
        return self.gpus[0].driver_version if self.gpus else None

    def to_json(self) -> dict[str, Any]:
        """JSON-able form; pyinfra's CLI calls it (`pyinfra @rig fact
        rigbook.core.facts.NvidiaGpus`)."""
        return asdict(self)


# --- nvidia-smi --query-gpu ----------------------------------------------------------------


def na(value: str) -> bool:
    """nvidia-smi writes every value it cannot give in brackets ([N/A], [Not Supported], ...)."""
    return value in ("", "N/A", "Not Supported") or (value.startswith("[") and value.endswith("]"))


_NUMBER = re.compile(r"^(-?\d+(?:\.\d+)?)(?:\s*[A-Za-z%]+)?$")


def number(value: str) -> str:
    """'700.00 W' / '143771 MiB' / '38' -> the number alone (csv with or without units)."""
    match = _NUMBER.match(value)
    if not match:
        raise ValueError(f"not a number: {value!r}")
    return match.group(1)


def _int(value: str) -> int:
    return int(number(value))


def _float(value: str) -> float:
    return float(number(value))


def _enabled(value: str) -> bool:
    if value not in ("Enabled", "Disabled"):
        raise ValueError(f"not Enabled/Disabled: {value!r}")
    return value == "Enabled"


#: --query-gpu field -> (Gpu attribute, converter). The order is QUERY_FIELDS' order.
_COLUMNS: dict[str, tuple[str, Any]] = {
    "index": ("index", _int),
    "uuid": ("uuid", str),
    "name": ("name", str),
    "pci.bus_id": ("bus_id", str),
    "driver_version": ("driver_version", str),
    "power.limit": ("power_limit_w", _float),
    "power.default_limit": ("default_limit_w", _float),
    "power.min_limit": ("min_limit_w", _float),
    "power.max_limit": ("max_limit_w", _float),
    "enforced.power.limit": ("enforced_limit_w", _float),
    "power.draw": ("power_draw_w", _float),
    "memory.total": ("memory_total_mib", _int),
    "memory.used": ("memory_used_mib", _int),
    "persistence_mode": ("persistence", _enabled),
    "pcie.link.gen.current": ("pcie_gen", _int),
    "pcie.link.gen.max": ("pcie_gen_max", _int),
    "pcie.link.width.current": ("pcie_width", _int),
    "pcie.link.width.max": ("pcie_width_max", _int),
    "temperature.gpu": ("temperature_c", _int),
    "compute_cap": ("compute_cap", str),
}

#: The --query-gpu fields that fill a Gpu, in the order query_args() asks for them.
QUERY_FIELDS: tuple[str, ...] = tuple(_COLUMNS)

_REQUIRED = ("index", "uuid", "name", "pci.bus_id")

#: A header cell: a field name (lower-case first; later capitals, as in pci.baseClass), with its
#: unit. A value never looks like one: values are numbers, [N/A], names with spaces, or words
#: with a capital first ("Enabled").
_HEADER_CELL = re.compile(r"[a-z][A-Za-z0-9_.]*(?: \[[^\]]*\])?")


def query_args(header: bool = False) -> str:
    """nvidia-smi arguments that print QUERY_FIELDS as csv without units.

    The facts ask with header=True: the header then names each column, so the parse cannot
    silently shift if a field is ever added, dropped or reordered on one side.
    """
    fmt = "csv,nounits" if header else "csv,noheader,nounits"
    return f"--query-gpu={','.join(QUERY_FIELDS)} --format={fmt}"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in next(csv.reader([line], skipinitialspace=True))]


def csv_header(line: str) -> list[str] | None:
    """Field names if this csv line is nvidia-smi's header ('power.limit [W]'), else None."""
    cells = _cells(line)
    if not all(_HEADER_CELL.fullmatch(cell) for cell in cells):
        return None
    return [cell.split(" [", 1)[0] for cell in cells]


def parse_fields(columns: list[str], lines: list[str], *, start: int = 1,
                 skip_mismatched: bool = False) -> list[tuple[int, str, dict[str, str]]]:
    """(line number, line, {field: cell}) per row of a --query-gpu csv without its header (`start`:
    the first line's number). A row with another number of cells than columns is a ValueError
    naming it (nvidia-smi never writes one: two outputs were mixed), or skipped."""
    rows = []
    for number, line in enumerate(lines, start):
        if not line.strip():
            continue
        cells = _cells(line)
        if len(cells) != len(columns):
            if skip_mismatched:
                continue
            raise ValueError(
                f"line {number}: expected {len(columns)} columns, got {len(cells)}: {line!r}"
            )
        rows.append((number, line, dict(zip(columns, cells, strict=True))))
    return rows


def parse_query_csv(
    text: str, fields: tuple[str, ...] | list[str] = QUERY_FIELDS, *, skip_mismatched: bool = False
) -> list[Gpu]:
    """GPUs from `nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]` output.

    A header line, when the first line is one, names the columns and `fields` is not used;
    otherwise `fields` are the columns in order. Units are stripped; [N/A], N/A and
    [Not Supported] become None; columns that are not Gpu fields are ignored. index, uuid, name
    and pci.bus_id must be among the columns. Rows are read by `parse_fields`; skip_mismatched
    skips rows of another width, for captures that append a second, different query (the H200
    fixture does).
    """
    lines = text.splitlines()
    columns, start = list(fields), 1
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    header = csv_header(lines[first]) if first is not None else None
    if header is not None:
        columns, lines, start = header, lines[first + 1:], first + 2
    missing = [name for name in _REQUIRED if name not in columns]
    if missing:
        raise ValueError(f"query lacks required fields: {', '.join(missing)}")
    gpus = []
    for number, line, row in parse_fields(columns, lines, start=start,
                                          skip_mismatched=skip_mismatched):
        values: dict[str, Any] = {}
        for column, cell in row.items():
            if column not in _COLUMNS:
                continue
            attribute, convert = _COLUMNS[column]
            if na(cell):
                if column in _REQUIRED:
                    raise ValueError(f"line {number}: {column} is {cell}: {line!r}")
                values[attribute] = None
                continue
            try:
                values[attribute] = convert(cell)
            except ValueError as e:
                raise ValueError(f"line {number}: bad {column} ({e}): {line!r}") from None
        gpus.append(Gpu(**values))
    return gpus


# --- nvidia-smi failures, in its own words ------------------------------------------------------

#: What nvidia-smi says when it cannot answer, and what that means (real messages: see
#: tests/fixtures/real/smi-errors and pl). The first pattern that matches names the kind.
_SMI_FAILURES = (
    ("gpu-lost", re.compile(r"GPU is lost|fallen off the bus")),
    ("version-mismatch", re.compile(r"Driver/library version mismatch")),
    ("no-driver", re.compile(r"couldn't communicate with the NVIDIA driver|Driver Not Loaded")),
    ("no-devices", re.compile(r"No devices were found")),
    ("handle-unknown-error", re.compile(r"Unable to determine the device handle.*Unknown Error")),
    ("permission", re.compile(r"Insufficient Permissions")),
    ("out-of-range", re.compile(r"is not a valid power limit")),
    ("not-supported", re.compile(r"(?i)not supported")),
    ("bad-option", re.compile(r"is not recognized")),
)
#: What the operator does about each kind.
SMI_ADVICE = {
    "gpu-lost": "the GPU is lost: reboot the rig, then check the Xids (rigbook status)",
    "version-mismatch": "the driver was upgraded without a reboot: reboot the rig",
    "no-driver": "no NVIDIA driver is loaded: install it (deploys/rig.py) or reboot into it",
    "no-devices": "the driver sees no GPU: check that the cards are seated and powered",
    "handle-unknown-error": "the GPU does not answer: reboot the rig, then check the Xids",
    "permission": "setting a cap needs root on the host (not in a container)",
    "out-of-range": "the card does not allow that cap: pick one inside its range",
    "not-supported": "this card does not let the driver change it (laptop GPUs, some GeForce)",
    "bad-option": "this nvidia-smi is too old for the command: update the driver",
}
_PL_RANGE = re.compile(r"between (\d+(?:\.\d+)?) W and (\d+(?:\.\d+)?) W")


def smi_failure(text: str) -> str | None:
    """The kind of failure nvidia-smi's output reports (SMI_ADVICE's keys), None when none."""
    return next((kind for kind, pattern in _SMI_FAILURES if pattern.search(text)), None)


def pl_range(text: str) -> tuple[float, float] | None:
    """(min, max) watts that a refused `nvidia-smi -pl` names, when it names them."""
    match = _PL_RANGE.search(text)
    return (float(match.group(1)), float(match.group(2))) if match else None


# --- NVML ----------------------------------------------------------------------------------


def nvml_probe() -> dict[str, Any]:
    """Ask NVML directly (no nvidia-smi) for every GPU's health readings, as a JSON-able dict.

    Shape (what roles/health.py reads; tests/fixtures/nvidia-h200/nvml-health.json is a real
    one, captured when the probe also read power, memory and processes):

        {"gpus": [{"index": 0, "uuid": "GPU-...", "temp": 36, "pcie_gen": 5, "pcie_gen_max": 5,
                   "pcie_width": 16, "pcie_width_max": 16, "tlimit": 51,
                   "ecc_uncorrected": [0, 0], "retired_pending": null,
                   "remapped": [0, 0, 0, 0], "events": 1, "util": 0,
                   "power_usage_mw": 79005, "enforced_mw": 700000}]}

    A value the card does not support is null. Raises ProbeError when pynvml is missing or
    NVML does not initialise.
    """
    try:
        import pynvml
    except ImportError as e:
        raise ProbeError(f"pynvml (nvidia-ml-py) is not importable: {e}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise ProbeError(f"NVML did not initialise: {e}") from None

    def ask(function, *args):
        try:
            return function(*args)
        except pynvml.NVMLError:
            return None

    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append({
                "index": index,
                "uuid": pynvml.nvmlDeviceGetUUID(handle),
                "temp": ask(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
                "pcie_gen": ask(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
                "pcie_gen_max": ask(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                "pcie_width": ask(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
                "pcie_width_max": ask(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
                **_nvml_health(pynvml, ask, handle),
            })
        return {"gpus": gpus}
    except pynvml.NVMLError as e:
        raise ProbeError(f"NVML query failed: {e}") from None
    finally:
        ask(pynvml.nvmlShutdown)


def _nvml_health(pynvml, ask, handle) -> dict[str, Any]:
    """The readings of roles/health.py, as NVML gives them (null where the card has none)."""
    margin = (ask(pynvml.nvmlDeviceGetMarginTemperature, handle)  # nvidia-ml-py 12.555+
              if hasattr(pynvml, "nvmlDeviceGetMarginTemperature") else None)
    remapped = ask(pynvml.nvmlDeviceGetRemappedRows, handle)
    utilization = ask(pynvml.nvmlDeviceGetUtilizationRates, handle)
    errors = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    return {
        "tlimit": getattr(margin, "marginTemperature", margin),
        "ecc_uncorrected": [ask(pynvml.nvmlDeviceGetTotalEccErrors, handle, errors, counter)
                            for counter in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC)],
        "retired_pending": ask(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle),
        "remapped": list(remapped) if remapped is not None else None,
        "events": ask(pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle),
        "util": getattr(utilization, "gpu", None),
        "power_usage_mw": ask(pynvml.nvmlDeviceGetPowerUsage, handle),
        "enforced_mw": ask(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle),
    }


def main(argv: list[str] | None = None) -> int:
    """`python3 -m rigbook.rigside.gpus --probe` (or `python3 gpus.py --probe` on a rig): NVML as
    JSON.

    Exits 0 with the probe, or PROBE_NO_NVML (3) with {"error": "..."} when NVML cannot load.
    """
    parser = argparse.ArgumentParser(prog="gpus", description=__doc__.splitlines()[0])
    parser.add_argument("--probe", action="store_true", required=True,
                        help="print what NVML reports as JSON")
    parser.parse_args(argv)
    try:
        result, status = nvml_probe(), 0
    except ProbeError as e:
        result, status = {"error": str(e)}, PROBE_NO_NVML
    json.dump(result, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
