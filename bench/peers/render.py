"""The state the peers converge, rendered by rigbook before they run, so all reach identical files.

`render(out)` reads the sandbox rigs (inventory/sandbox.py, and each rig's simulated GPUs from
its root on this machine, which is what nvidia-smi will report there) and writes into `out`:
every file rigbook's driver, tuning, guards and power roles write, rendered with rigbook's own
templates and values, and `peers.json`: per rig, its login and what to converge (vars named
`peer_*`). The Ansible inventory and the stock pyinfra inventory are both made from it.
"""

from __future__ import annotations

import json
import runpy
import shutil
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

from rigbook.core.render import render as render_template
from rigbook.core.spec import Rig, parse_rig
from rigbook.rigside.gpus import Gpu
from rigbook.roles import driver, guards, power, tuning
from rigbook.sandbox import SIM_DIR, state_dir

INVENTORY = Path(__file__).resolve().parents[2] / "inventory" / "sandbox.py"
#: Where the stand-in driver's nvidia-smi lands on a rig (what rigbook's GPU fact finds there).
SMI = "/usr/bin/nvidia-smi"


@dataclass
class Plan:
    """What one rig converges: files by how a change is followed up, packages, paths."""

    dirs: list[str] = field(default_factory=list)
    apt_source: list[dict] = field(default_factory=list)  # a change: apt-get update
    files: list[dict] = field(default_factory=list)
    units: list[dict] = field(default_factory=list)  # a change: daemon-reload
    xid_files: list[dict] = field(default_factory=list)  # a change: reload, restart the watch
    driver_packages: list[str] = field(default_factory=list)  # name=exact version
    driver_hold: list[str] = field(default_factory=list)
    enable: list[str] = field(default_factory=list)  # enabled, not started
    services: list[str] = field(default_factory=list)  # enabled and running
    absent: list[str] = field(default_factory=list)
    fstab_line: str | None = None
    shm_size: str | None = None


class _Writer:
    """Writes rendered text under out/<rig>/ and records it as one managed file."""

    def __init__(self, out: Path, rig_name: str):
        self.out, self.rig = out, rig_name

    def text(self, into: list[dict], dest: str, content: str, mode: str = "0644") -> None:
        src = self.out / self.rig / dest.lstrip("/")
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(content)
        into.append({"src": str(src), "dest": dest, "mode": mode})

    def copy(self, into: list[dict], dest: str, source: Path, mode: str = "0644") -> None:
        self.text(into, dest, source.read_text(), mode)


def sim_gpus(rig_name: str) -> tuple[Gpu, ...]:
    """The GPUs the stand-in nvidia-smi will report on a sandbox rig, from its root here."""
    spec = json.loads((state_dir() / rig_name / "root/etc/rigbook-sim/gpus.json").read_text())
    return tuple(
        Gpu(index=gpu["index"], uuid=gpu["uuid"], name=gpu["name"], bus_id=gpu["pci_bus_id"],
            power_limit_w=gpu["power_default_w"], default_limit_w=gpu["power_default_w"],
            min_limit_w=gpu["power_min_w"], max_limit_w=gpu["power_max_w"])
        for gpu in spec["gpus"]
    )


def sim_packages(roots: tuple[str, ...], glob: str) -> tuple[list[str], list[str]]:
    """(name=version to install, every package that comes with them) from the stand-in
    driver's packages.json; stock tools pin one exact version, so the glob must match one."""
    spec = json.loads((SIM_DIR / "packages.json").read_text())
    versions = [v for v in spec["versions"] if fnmatch(v, glob)]
    if len(versions) != 1:
        raise SystemExit(f"peers: driver version {glob} matches {versions} in packages.json")
    closure, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in closure:
            closure.add(name)
            todo += spec["packages"][name]["depends"]
    return [f"{name}={versions[0]}" for name in roots], sorted(closure)


def _driver(rig: Rig, write: _Writer, plan: Plan) -> None:
    if rig.platform != "debian":
        raise SystemExit(f"peers: only debian sandbox rigs have a driver here, not {rig.platform}")
    glob = driver.version_glob(rig)
    source = driver.AptSource(rig.driver_repo_uri, trusted=rig.driver_repo_trusted)
    write.text(plan.apt_source, driver.SOURCES,
               render_template(driver.TEMPLATES / "nvidia.sources.j2", cfg=source))
    pin = driver.PinConf(glob, "driver_version" if rig.driver_version else "driver_branch",
                         driver.DRIVER_PACKAGE_GLOBS)
    write.text(plan.files, driver.PREFERENCES,
               render_template(driver.TEMPLATES / "preferences.j2", cfg=pin))
    blacklist = driver.BlacklistConf(driver.DRIVER_PACKAGE_PATTERNS)
    write.text(plan.files, driver.BLACKLIST,
               render_template(driver.TEMPLATES / "blacklist.j2", cfg=blacklist))
    meta = "nvidia-open" if rig.driver_open else "cuda-drivers"
    plan.driver_packages, plan.driver_hold = sim_packages((meta, "nvidia-persistenced"), glob)


def _power(rig: Rig, name: str, write: _Writer, plan: Plan) -> None:
    caps = power.desired_caps(rig, name, sim_gpus(name))
    write.text(plan.units, power.UNIT_PATH, power.render_unit(SMI, caps))
    plan.enable.append(power.UNIT_NAME)


def _tuning(rig: Rig, write: _Writer, plan: Plan) -> None:
    plan.absent += rig.stale_files
    write.text(plan.files, tuning.SYSCTL_CONF, render_template(tuning.SYSCTL_TEMPLATE, cfg=rig))
    if rig.shm_size is not None:
        plan.shm_size, plan.fstab_line = rig.shm_size, tuning.fstab_line(rig.shm_size)


def _guards(rig: Rig, write: _Writer, plan: Plan) -> None:
    plan.dirs += [guards.GUARDS_DIR, str(Path(guards.SERVE_DROPIN).parent)]
    write.copy(plan.files, guards.SHMGLOB_COPY, guards.SHMGLOB_SOURCE)
    write.copy(plan.files, guards.REAPER, guards.SOURCES / "rigbook-shm-reaper", "0755")
    write.text(plan.units, f"{guards.UNITS_DIR}/{guards.REAPER_UNIT}", render_template(
        guards.SOURCES / f"{guards.REAPER_UNIT}.j2", patterns=rig.guards_shm_patterns))
    write.copy(plan.units, guards.SERVE_DROPIN, guards.SOURCES / "rigbook-serve-guards.conf")
    write.copy(plan.xid_files, guards.XID_COPY, guards.XID_SOURCE)
    write.copy(plan.xid_files, guards.WATCH, guards.SOURCES / "rigbook-xid-watch", "0755")
    watch_unit = f"{guards.UNITS_DIR}/{guards.WATCH_UNIT}"
    if rig.guards_xid_watch:
        write.copy(plan.xid_files, watch_unit, guards.SOURCES / guards.WATCH_UNIT)
        plan.services.append(guards.WATCH_UNIT)
    else:
        plan.absent.append(watch_unit)


def plan_rig(name: str, data: dict, out: Path) -> Plan:
    """Render one rig's files under out/<name>/ and say what converges them."""
    rig, write, plan = parse_rig(name, data), _Writer(out, name), Plan()
    if rig.platform != "wsl2":  # WSL2: no Linux driver, no power unit (the Windows side's)
        _driver(rig, write, plan)
        _power(rig, name, write, plan)
    _tuning(rig, write, plan)
    _guards(rig, write, plan)
    return plan


def render(out: Path) -> list[dict]:
    """Render every sandbox rig into `out`; write and return peers.json's hosts."""
    sandbox_rigs = runpy.run_path(str(INVENTORY))["sandbox_rigs"]  # the rigs up right now
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    hosts = [
        {"name": name, "address": data["ssh_hostname"], "user": data["ssh_user"],
         "key": data["ssh_key"], "vars": {f"peer_{k}": v for k, v in
                                          vars(plan_rig(name, data, out)).items()}}
        for name, data in sandbox_rigs
    ]
    (out / "peers.json").write_text(json.dumps({"hosts": hosts}, indent=2) + "\n")
    return hosts
