"""The stock pyinfra peer of rigbook: the same subset as bench/peers/rig.yml, stock operations only.

    RIGBOOK_BENCH_PEERS=DIR/peers.json pyinfra bench/peers/inventory.py bench/peers/pyinfra_stock.py

Written as a pyinfra user would without rigbook: files.put of the files rigbook rendered
beforehand (host data peer_*, bench/peers/render.py), apt.packages pinned to the exact version,
systemd.service. pyinfra has no apt-mark hold operation: the hold is a server.shell that runs
only when `apt-mark showhold` (the stock Command fact, read when it executes) lacks a package.
"""

from pyinfra import host
from pyinfra.facts.server import Command
from pyinfra.operations import apt, files, server, systemd
from pyinfra.operations.util import any_changed

data = host.data


def _held() -> set[str]:
    """The held packages, read when the hold step executes (after the install)."""
    return set((host.get_fact(Command, "apt-mark showhold") or "").split())


def _put(entries: list[dict]) -> list:
    return [files.put(name=f"Write {f['dest']}", src=f["src"], dest=f["dest"], mode=f["mode"])
            for f in entries]


for path in data.peer_dirs:
    files.directory(name=f"Folder {path}", path=path, mode="755")

source = _put(data.peer_apt_source)
if source:
    apt.update(name="apt-get update (driver source changed)", _if=any_changed(*source))
_put(data.peer_files)

if data.peer_driver_packages:
    apt.packages(name="Driver packages installed", packages=data.peer_driver_packages)
    hold = data.peer_driver_hold
    server.shell(
        name="Driver packages held",
        commands=["apt-mark hold " + " ".join(hold)],
        _if=lambda: not set(hold) <= _held(),
    )

units = _put(data.peer_units)
xid = _put(data.peer_xid_files)
for path in data.peer_absent:
    files.file(name=f"Remove {path}", path=path, present=False)

if data.peer_fstab_line is not None:
    fstab = files.line(
        name="/dev/shm size in /etc/fstab", path="/etc/fstab",
        line=r"^[^#[:space:]]+[[:space:]]+/dev/shm[[:space:]]", replace=data.peer_fstab_line,
        extended_regex=True,
    )
    server.shell(name="Remount /dev/shm", _if=fstab.did_change,
                 commands=[f"mount -o remount,size={data.peer_shm_size} /dev/shm"])

if units or xid:
    systemd.daemon_reload(name="systemctl daemon-reload (units changed)",
                          _if=any_changed(*units, *xid))
for unit in data.peer_enable:
    systemd.service(name=f"{unit} enabled", service=unit, running=None, enabled=True)
for unit in data.peer_services:
    systemd.service(name=f"{unit} enabled and running", service=unit, running=True, enabled=True)
    systemd.service(name=f"{unit} restarted (its files changed)", service=unit, running=True,
                    restarted=True, _if=any_changed(*xid))
