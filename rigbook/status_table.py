"""`rigbook status` shown: one row per rig (and per GPU after the first), drift red, warnings
yellow, then every finding in words. It shows a `FleetStatus` (rigbook/status.py builds it);
docs/status.md explains every column.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterable

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from rigbook.core.messages import gib, human
from rigbook.roles.power import watts
from rigbook.roles.tuning import same_sysctl
from rigbook.status import (
    Finding,
    FleetStatus,
    KernelLogStatus,
    ModelStatus,
    RigStatus,
    ServingStatus,
    VenvStatus,
    gather,
)

_RANK = {"warn": 0, "drift": 1, "gone": 2, "mismatch": 3}
_STYLE = {"warn": "yellow", "drift": "red", "gone": "bold red", "mismatch": "bold red"}
_STATE_TEXT = {
    "as-declared": ("as declared", "green"),
    "drift": ("DRIFT", "red"),
    "gpu-gone": ("GPU GONE", "bold red"),
    "unreachable": ("UNREACHABLE", "bold red"),
    "driver-mismatch": ("DRIVER MISMATCH", "bold red"),
}
COLUMNS = (
    "rig", "state", "GPU", "driver", "persist.", "cap W\nwant/unit/live", "tuning", "WSL TDR",
    "disk free", "GPU faults", "venvs / models / serving",
)


def _worst(findings: Iterable[Finding]) -> str | None:
    levels = [finding.level for finding in findings]
    return _STYLE[max(levels, key=_RANK.__getitem__)] if levels else None


def _cell(text: str, findings: Iterable[Finding]) -> Text:
    return Text(text, style=_worst(findings) or "")


def _short_name(name: str) -> str:
    return name.removeprefix("NVIDIA ").removeprefix("GeForce ")


def _w(value: float | None) -> str:
    return "-" if value is None else watts(value)


def _driver_text(rig: RigStatus) -> str:
    driver = rig.driver
    if driver is None:
        return "?"
    if rig.platform == "wsl2":
        return f"{driver.running or '-'}\nWindows driver"
    version = driver.running or driver.loaded or ", ".join(driver.installed) or "none"
    held = "NOT held" if driver.unheld else "held"
    lines = [version, held if driver.packages else driver.source.split(":", 1)[0]]
    if driver.reboot_pending:
        lines.append("reboot pending")
    return "\n".join(lines)


def _tuning_text(rig: RigStatus) -> str:
    lines = []
    if rig.sysctl:
        rows = rig.sysctl
        file = "ok" if all(same_sysctl(s.declared, s.file) for s in rows) else (
            "missing" if all(s.file is None for s in rows) else "differs")
        live = "ok" if all(same_sysctl(s.declared, s.live) for s in rows) else (
            "differs (ro)" if all(s.read_only for s in rows) else "differs")
        lines.append(f"sysctl file {file}, live {live}")
    if rig.shm is not None:
        size = "?" if rig.shm.size_bytes is None else gib(rig.shm.size_bytes)
        lines.append(f"shm {size}" + (f" (want {rig.shm.declared})" if rig.shm.declared else ""))
    if rig.stale_files:
        lines.append(f"{len(rig.stale_files)} leftover file(s)")
    return "\n".join(lines) or "-"


def _wsl_text(rig: RigStatus) -> str:
    if rig.wsl is None:
        return "-"
    if rig.wsl.tdr_error:
        return "registry unreadable"
    return "\n".join(f"{key} {rig.wsl.tdr.get(key)}" for key in rig.wsl.tdr_declared)


def _disk_text(rig: RigStatus) -> str:
    return "\n".join(
        f"{disk.mount} {gib(disk.avail_bytes)} ({disk.avail_bytes / disk.size_bytes:.0%})"
        if disk.size_bytes else f"{disk.mount} ?"
        for disk in rig.disks
    ) or "-"


def _faults_text(rig: RigStatus, index: int | None) -> str:
    """The Xids of GPU `index` (None: those naming no listed GPU), or why they are unknown."""
    log = rig.kernel_log
    if log is None:
        return "?"
    if log.source is None:
        return "log unreadable"
    return _xid_summary(log, index) or "none"


def _xid_summary(log: KernelLogStatus, index: int | None) -> str:
    mine = [event for event in log.xids if event.gpu_index == index]
    now = Counter(f"Xid {e.code} {e.label}" for e in mine if e.this_boot)
    before = sum(1 for e in mine if not e.this_boot)
    lines = [f"{text} x{count}" if count > 1 else text for text, count in now.items()]
    if before:
        lines.append(f"{before} in earlier boots")
    return "\n".join(lines)


def _venv_text(venv: VenvStatus) -> str:
    if venv.state == "stale":
        return (f"venv {venv.name}: stale (built for driver {venv.built_driver or 'none'}, "
                f"running {venv.running_driver})")
    if venv.state == "incompatible":
        return f"venv {venv.name}: incompatible (error 804)"
    if venv.state == "current" and venv.running_driver is None:
        return f"venv {venv.name}: built (driver {venv.built_driver or 'none'}; live unknown)"
    return f"venv {venv.name}: {venv.state.replace('-', ' ')}"


def _model_text(model: ModelStatus) -> str:
    state = model.state
    if state == "complete":
        state = f"complete, {human(model.bytes)}"
    elif state == "partial" and model.missing_files:
        state = f"partial ({model.missing_files} file(s) missing)"
    where = " (recipe)" if model.source == "recipe" else ""
    return f"model {model.repo}{where}: {state}"


def _recipe_text(serving: ServingStatus) -> str:
    running = (f" (unit: {serving.running_recipe})"
               if serving.running_recipe not in (None, serving.recipe) else "")
    state = serving.unit or "?"
    if serving.unit == "active":
        state += ", healthy" if serving.healthy else ", NOT answering"
    elif serving.sub and serving.unit is not None:
        state += f" ({serving.sub})"
    return f"recipe {serving.recipe}{running}: {state}"


def _serving_cell(rig: RigStatus) -> Text:
    """A line per venv, model and the recipe, each coloured by its own state."""
    def level_of(*areas: str) -> str | None:
        levels = [f.level for f in rig.findings if f.area in areas]
        return _STYLE[max(levels, key=_RANK.__getitem__)] if levels else None

    lines: list[tuple[str, str | None]] = []
    for venv in rig.venvs:
        bad = venv.state not in ("current", "unknown")
        lines.append((_venv_text(venv), _STYLE["drift"] if bad else None))
    for model in rig.models:
        bad = model.state in ("partial", "missing")
        lines.append((_model_text(model), _STYLE["drift"] if bad else None))
    cache = rig.models_cache
    if cache is not None and cache.unlisted:
        size = human(sum(repo.bytes for repo in cache.unlisted))
        lines.append((f"+{len(cache.unlisted)} cached repo(s) not in models, {size}",
                      _STYLE["drift" if cache.prune else "warn"]))
    if rig.serving is not None:
        lines.append((_recipe_text(rig.serving), level_of("serving")))
    if not lines:
        return Text("none declared")
    if rig.state == "unreachable":
        lines.append(("(not read)", None))
    text = Text()
    for position, (line, style) in enumerate(lines):
        text.append(("\n" if position else "") + line, style=style or "")
    return text


def _mark(level: str) -> str:
    return {"warn": "!", "drift": "x", "gone": "X", "mismatch": "M"}[level]


def findings_text(fleet: FleetStatus) -> Text:
    """Every finding, one line each under its rig: what differs and why (the table's colours)."""
    text = Text()
    for rig in fleet.rigs:
        if not rig.findings:
            continue
        label, style = _STATE_TEXT[rig.state]
        text.append(f"{rig.name}: ", style="bold")
        text.append(f"{label}\n", style=style)
        for finding in rig.findings:
            text.append(f"  {_mark(finding.level)} {finding.reason}\n", style=_STYLE[finding.level])
    return text


def status_table(fleet: FleetStatus) -> Table:
    """One row per rig, and one more per GPU after the first; drift red, warnings yellow."""
    table = Table(title=f"rigbook status: {fleet.inventory}", show_lines=True)
    for header in COLUMNS:
        table.add_column(header, overflow="fold")
    for rig in fleet.rigs:
        text, style = _STATE_TEXT[rig.state]
        head = Text(f"{rig.name}\n{rig.platform} {rig.gpu_class} x{rig.gpu_count}")
        if rig.state == "unreachable":
            table.add_row(head, Text(text, style=style), Text(rig.error or "", style=style),
                          *[""] * (len(COLUMNS) - 4), _serving_cell(rig))
            continue
        for position, gpu in enumerate(rig.gpus or [None]):
            first = position == 0
            uuid = gpu.uuid if gpu else None

            def here(*areas: str, uuid=uuid, first=first, rig=rig) -> list[Finding]:
                """This row's findings: its GPU's, and on the first row the rig-wide ones."""
                return [f for f in rig.findings
                        if f.area in areas and (f.gpu == uuid or (first and f.gpu is None))]

            def anywhere(*areas: str, rig=rig) -> list[Finding]:
                return [f for f in rig.findings if f.area in areas]

            persist = "-" if gpu is None or gpu.persistence is None else (
                "on" if gpu.persistence else "off")
            in_unit = "n/a" if rig.platform == "wsl2" or gpu is None else _w(gpu.cap_unit_w)
            cap = "-" if gpu is None else (
                f"{_w(gpu.cap_desired_w)} / {in_unit} / {_w(gpu.cap_live_w)}"
            )
            faults = _faults_text(rig, gpu.index if gpu else None)
            if gpu is not None and first and rig.kernel_log and rig.kernel_log.source:
                unmapped = _xid_summary(rig.kernel_log, None)  # cards nvidia-smi lost
                faults += f"\nno GPU listed: {unmapped}" if unmapped else ""
            if first and rig.gpu_lost:  # the Xid watch's mark is about the rig
                faults = f"GPU-lost mark set\n{faults}"
            table.add_row(
                head if first else "",
                Text(text, style=style) if first else "",
                _cell(f"{gpu.index} {_short_name(gpu.name)}" if gpu else "none", here("gpu")),
                _cell(_driver_text(rig), anywhere("driver")) if first else "",
                _cell(persist, here("persistence")),
                _cell(cap, here("power")),
                _cell(_tuning_text(rig), anywhere("tuning")) if first else "",
                _cell(_wsl_text(rig), anywhere("wsl", "platform")) if first else "",
                _cell(_disk_text(rig), anywhere("disk")) if first else "",
                _cell(faults, here("faults")),
                _serving_cell(rig) if first else "",
            )
    return table


def render(fleet: FleetStatus) -> Group:
    """The table, then the findings that colour it."""
    return Group(status_table(fleet), findings_text(fleet))


def status(inventory_file: str, limit: list[str] | None, as_json: bool) -> int:
    """`rigbook status INVENTORY [--limit NAME ...] [--json]`; returns the exit status.

    0: every rig as declared; 1: drift; 2: a rig unreachable or a GPU gone; 4: a driver
    mismatch. Progress and one line per unreachable rig go to stderr; the table (or the JSON)
    to stdout.
    """
    err = Console(stderr=True)
    fleet = gather(inventory_file, limit, err)
    if as_json:
        sys.stdout.write(fleet.model_dump_json(indent=2) + "\n")
    else:
        # a terminal's width, or COLUMNS; piped without COLUMNS, wide enough for the table
        wide = sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
        out = Console(width=None if wide else 200)
        out.print(render(fleet))
    return fleet.exit_code
