"""The way back out: what rigbook puts on a rig, and the deploy that takes it off again.

FOOTPRINT is the one list of the paths the roles write (their own constants, not copies); the
offboard deploy removes them in its order and docs/footprint.md is generated from it
(`rigbook docs`). What a rig keeps unless `offboard_remove` names it: the driver (its packages,
apt source, key and nouveau blacklist), the venvs (and the Python builds and uv cache they run
from) and the models (the HF cache). Everything else goes: serving and its user, the guards, the
mirror, the power unit (the caps go back to each card's default), the sysctl file and the
/dev/shm line, the driver's holds, blacklist, pin and module options, rigbook's tokens, logs and
run-time marks. A second offboard finds nothing left and changes nothing.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass

from pyinfra import host, state
from pyinfra.api import FactBase, QuoteString, StringCommand, deploy, operation
from pyinfra.facts.files import FileContents
from pyinfra.facts.server import Groups, Users
from pyinfra.operations import server, systemd
from pyinfra.operations.util import any_changed

from rigbook.core import apt, pins, runfacts, tools
from rigbook.core.apt import DpkgInstalled
from rigbook.core.managed import expect, state_of
from rigbook.core.messages import notice
from rigbook.core.runfacts import once
from rigbook.core.spec import Rig
from rigbook.core.units import booted, service
from rigbook.roles import (
    driver,
    guards,
    kernel,
    models,
    power,
    serving,
    sweep,
    tokens,
    tuning,
    venvs,
    wsl,
)

#: Folders rigbook makes that may hold what is kept (or, for the drop-in folder, the operator's
#: own drop-ins): removed last, and only once nothing is left in them.
ROOTS = ("/opt/rigbook/cache", "/opt/rigbook", "/var/lib/rigbook", "/etc/rigbook",
         posixpath.dirname(driver.PERSISTENCED_DROPIN))

#: The stand-in for the rig's `models_cache` in FOOTPRINT.
MODELS_CACHE = "<models_cache>"


@dataclass(frozen=True)
class Item:
    """One path rigbook writes: a file, or a folder and everything in it."""

    path: str
    role: str
    what: str
    kept_with: str | None = None  # kept unless offboard_remove names it


#: rigbook's units, stopped and disabled first (serving first: it uses the others' files).
UNITS = (serving.UNIT_NAME, models.MIRROR_UNIT, guards.WATCH_UNIT, guards.REAPER_UNIT,
         power.UNIT_NAME)

FOOTPRINT = (
    Item(serving.UNIT_PATH, "serving", "the serving unit"),
    Item(serving.CONF_DIR, "serving", "the engine's env file, API key file, supervisor config"),
    Item(serving.SERVING_DIR, "serving", "the health check, cap check and supervisor"),
    Item(serving.SERVE_HOME, "serving", "the home of the rigbook-serve user"),
    Item(posixpath.dirname(serving.SERVE_LOG), "serving, guards, driver",
         "the supervisor's log, the engine-faults log, the driver bump logs"),
    Item(posixpath.dirname(serving.PIDFILE), "serving, guards, driver",
         "run-time marks: the supervisor's pidfile and refused start, GPU lost, reboot "
         "required (tmpfs)"),
    Item(f"{guards.UNITS_DIR}/{guards.SERVE_UNIT}.d", "guards", "the serving unit's drop-in"),
    Item(f"{guards.UNITS_DIR}/{guards.WATCH_UNIT}", "guards", "the Xid watch unit"),
    Item(f"{guards.UNITS_DIR}/{guards.REAPER_UNIT}", "guards", "the /dev/shm reaper unit"),
    Item(guards.QUARANTINE_TMPFILES, "guards", "the reaper's quarantine, made at boot"),
    Item("/dev/shm/.rigbook-quarantine", "guards", "the reaper's quarantine (tmpfs)"),
    Item(guards.GUARDS_DIR, "guards", "the reaper, the Xid watch and their modules"),
    Item(models.MIRROR_UNIT_PATH, "models", "the mirror's unit"),
    Item(models.MODELS_DIR, "models", "the pull, cache check and mirror programs"),
    Item(tokens.SECRETS_DIR, "models", "the hub token and the mirror token (root only)"),
    Item(power.UNIT_PATH, "power", "the boot unit that sets the caps"),
    Item(tuning.SYSCTL_CONF, "tuning", "the inotify (and sysctl_extra) values"),
    Item(driver.PREFERENCES, "driver", "the apt pin of the driver version"),
    Item(kernel.OTHER_SOURCES_PREF, "driver", "the apt pin against other driver sources"),
    Item(driver.BLACKLIST, "driver", "the driver in unattended-upgrades' blacklist"),
    Item(driver.MODPROBE_CONF, "driver", "the nvidia module options"),
    Item(driver.PERSISTENCED_DROPIN, "driver", "persistence mode on (nvidia-persistenced)"),
    Item(posixpath.dirname(apt.BUMP_SCRIPT), "driver", "the bump's apt script"),
    Item(kernel.MOK_PASSWORD, "driver", "the one-time MOK enrolment password"),
    Item(driver.SOURCES, "driver", "the driver's apt source", kept_with="driver"),
    Item(kernel.NOUVEAU_CONF, "driver", "nouveau blacklisted", kept_with="driver"),
    Item(sweep.SWEEP_DIR, "sweep", "the sweep's guard and meter (tmpfs)"),
    Item(wsl.PROFILE_D, "wsl", "the serving environment of WSL2 logins"),
    Item(tools.TOOLS_VENV, "tools", "rigbook's tools venv (huggingface_hub, uv)"),
    Item(pins.VENVS_DIR, "venvs", "the engine venvs, their builds and env files",
         kept_with="venvs"),
    Item(venvs.PYTHON_DIR, "venvs", "the Python builds the venvs run on", kept_with="venvs"),
    Item(venvs.UV_CACHE, "venvs", "uv's download cache", kept_with="venvs"),
    Item(MODELS_CACHE, "models", "the HF cache (`models_cache`)", kept_with="models"),
)


def footprint(rig: Rig) -> tuple[Item, ...]:
    """FOOTPRINT with this rig's models_cache in place."""
    return tuple(Item(rig.models_cache, i.role, i.what, i.kept_with) if i.path == MODELS_CACHE
                 else i for i in FOOTPRINT)


def roots(rig: Rig) -> tuple[str, ...]:
    """ROOTS and the folders between one of them and a path of the footprint (the HF cache's
    /var/lib/rigbook/hf), deepest first: the order they can be removed in once empty."""
    found = set(ROOTS)
    for item in footprint(rig):
        for root in ROOTS:
            parent = posixpath.dirname(item.path)
            while parent.startswith(root + "/"):
                found.add(parent)
                parent = posixpath.dirname(parent)
    return tuple(sorted(found, key=lambda path: (-path.count("/"), path)))


def kept(rig: Rig) -> tuple[str, ...]:
    """The paths this offboard keeps."""
    return tuple(i.path for i in footprint(rig)
                 if i.kept_with is not None and i.kept_with not in rig.offboard_remove)


class Entries(FactBase[list]):
    """The paths a folder holds (none also when it is not there)::

        /opt/rigbook/venvs
        /opt/rigbook/python
    """

    default = list

    def command(self, path: str) -> StringCommand:
        return StringCommand("find", QuoteString(path), "-mindepth", "1", "-maxdepth", "1",
                             "2>/dev/null; true")

    def process(self, output: list[str]) -> list[str]:
        return [line for line in output if line]


@operation()
def absent_tree(path: str) -> Iterator:
    """
    Remove a file, or a folder with everything in it, when it is there.

    + path: rigbook's own path (FOOTPRINT)

    A link or anything but a file or folder there is left with a notice: rigbook did not put
    it there.
    """
    runfacts.mark_ours()
    now = state_of(path)
    if now is None:
        host.noop(f"{path} does not exist")
        return
    if now.kind not in ("file", "directory"):
        yield notice(f"{host.name}: {path} is a {now.kind}: rigbook did not put it there and "
                     "leaves it")
        return
    yield StringCommand("rm", "-rf", "--one-file-system", "--", QuoteString(path))
    runfacts.remember("files", path, None)


@operation()
def empty_root(path: str, removed: tuple[str, ...]) -> Iterator:
    """
    Remove one of rigbook's own folders once it is empty (what is kept stays, and so does the
    folder).

    + path: the folder
    + removed: the paths this offboard removes before it: a plan (--dry) counts them gone

    Read when it runs, after the removals before it; a plan, where nothing was removed, leaves
    out what the offboard removes before it.
    """
    if state_of(path) is None:
        host.noop(f"{path} does not exist")
        return
    left = set(host.get_fact(Entries, path=path))
    left = sorted(left if state.is_executing else left - set(removed))
    if left:
        host.noop(f"{path} stays: it holds {', '.join(left)}")
        return
    yield StringCommand("rmdir", "--", QuoteString(path))


#: The /dev/shm line of /etc/fstab that tuning.fstab_shm_size writes.
RIGBOOK_SHM_LINE = re.compile(r"tmpfs\s+/dev/shm\s+tmpfs\s+defaults,size=\S+\s+0\s+0")
#: The same, as an ERE for sed.
RIGBOOK_SHM_ERE = (r"^[[:space:]]*tmpfs[[:space:]]+/dev/shm[[:space:]]+tmpfs[[:space:]]+"
                   r"defaults,size=[^[:space:]]+[[:space:]]+0[[:space:]]+0[[:space:]]*$")


@operation()
def shm_default() -> Iterator:
    """
    Take rigbook's /dev/shm line out of /etc/fstab and give the live /dev/shm the default size
    again (half the RAM, as tmpfs and systemd mount it).
    """
    lines = once(FileContents, path=tuning.FSTAB) or []
    if not any(RIGBOOK_SHM_LINE.fullmatch(line.strip()) for line in lines):
        host.noop(f"{tuning.FSTAB} has no /dev/shm line of rigbook's")
        return
    yield StringCommand("sed", "-i", "-E", QuoteString(f"\\|{RIGBOOK_SHM_ERE}|d"), tuning.FSTAB)
    yield StringCommand("mount", "-o", "remount,size=50%", tuning.SHM)


@operation()
def default_caps() -> Iterator:
    """
    Set each GPU's live power limit back to the card's default where it differs (by more than
    power.TOLERANCE_W).
    """
    probe, why = power._visible_gpus()
    if why is not None:
        host.noop(f"no GPUs to set back ({why})")
        return
    todo = [gpu for gpu in probe.gpus if gpu.default_limit_w is not None
            and gpu.power_limit_w is not None
            and not power.same_w(gpu.power_limit_w, gpu.default_limit_w)]
    for gpu in todo:
        yield StringCommand(QuoteString(probe.smi), "-i", QuoteString(gpu.uuid), "-pl",
                            f"{gpu.default_limit_w:g}")
    if not todo:
        host.noop("every GPU is at its default power limit: "
                  + ", ".join(f"GPU {g.index} {g.power_limit_w:g} W" for g in probe.gpus))


@operation()
def no_serve_user() -> Iterator:
    """
    Remove the rigbook-serve user and its group (userdel may take the group with it).
    """
    user = serving.SERVE_USER
    users = host.get_fact(Users)
    groups = host.get_fact(Groups)
    if user not in users and user not in groups:
        host.noop(f"no {user} user or group")
        return
    if user in users:
        yield StringCommand("userdel", user)
    yield StringCommand(f"if getent group {user} >/dev/null; then groupdel {user}; fi")


@operation()
def purge_driver() -> Iterator:
    """
    Purge the installed driver packages (offboard_remove names the driver).
    """
    names = driver.driver_packages(once(DpkgInstalled))
    if not names:
        host.noop("no driver packages are installed")
        return
    yield StringCommand("DEBIAN_FRONTEND=noninteractive", "apt-get", "purge", "-y",
                        *(QuoteString(name) for name in names))


@operation()
def left_as_they_are(platform: str) -> Iterator:
    """
    Say what an offboard does not undo: live sysctl values (the kernel keeps no earlier value:
    they last until the next boot) and, on WSL2, the Windows TDR registry values.

    + platform: the rig's platform
    """
    host.noop("live sysctl values stay until the next boot"
              + ("; the Windows TDR registry values stay (docs/wsl2.md)"
                 if platform == "wsl2" else ""))
    yield from ()


@deploy("Offboard")
def offboard(rig: Rig) -> None:
    """Stop and remove what rigbook put on the rig, keeping what offboard_remove does not name
    of the driver, the venvs and the models (see the module docstring)."""
    keep = kept(rig)
    items = [i for i in footprint(rig) if i.path not in keep]
    folders = roots(rig)
    expect(*(i.path for i in items), *folders, serving.PIDFILE)  # one read for all of them
    on_systemd = booted()
    native = rig.platform != "wsl2"
    if on_systemd:
        for unit in UNITS:
            service(name=f"{unit} stopped and disabled", service=unit, running=False,
                    enabled=False)
    elif state_of(serving.PIDFILE) is not None:
        server.shell(name="Stop the engine (rigbook's supervisor)",
                     commands=[serving.supervisor_command("stop")])
    if native:
        default_caps(name="Power limits back to the cards' defaults")
        driver.hold_driver(name="Release the driver packages (apt-mark unhold)", held=False)
    shm_default(name=f"No /dev/shm line of rigbook's in {tuning.FSTAB}")
    no_serve_user(name=f"Remove the {serving.SERVE_USER} user and group")
    removed = {i.path: absent_tree(name=f"Remove {i.path} ({i.what})", path=i.path)
               for i in items}
    holding = {f for f in folders if any(path.startswith(f + "/") for path in keep)}
    for n, root in enumerate(folders):
        empty_root(name=f"Remove {root} when empty", path=root,
                   removed=(*removed, *(f for f in folders[:n] if f not in holding)))
    if on_systemd:
        systemd.daemon_reload(name="systemctl daemon-reload (rigbook's units gone)",
                              _if=any_changed(*removed.values()))
    dropin = removed.get(driver.PERSISTENCED_DROPIN)
    if on_systemd and native and "driver" not in rig.offboard_remove and dropin is not None \
            and driver.driver_packages(once(DpkgInstalled)):
        service(name="nvidia-persistenced restarted as the package ships it",
                service=driver.PERSISTENCED, running=True, restarted=True,
                _if=dropin.did_change)
    if native and "driver" in rig.offboard_remove:
        purge_driver(name="Purge the driver packages (offboard_remove: driver)")
    left_as_they_are(name="Left as they are", platform=rig.platform)


_DOC_INTRO = """\
# What rigbook puts on a rig

<!-- Generated by `rigbook docs` from roles/offboard.py; do not edit by hand. -->

Every path rigbook writes on a rig, from the list deploys/offboard.py removes
([runbooks/offboard.md](runbooks/offboard.md)). A folder counts with all it holds. "kept with"
names what a rig keeps after an offboard unless `offboard_remove` ([host-data.md](host-data.md))
names it; `<models_cache>` is the rig's `models_cache`.

Beyond these files, rigbook puts on a rig: the units {units} (stopped and disabled by the
offboard), the `{user}` user and group, apt holds on the driver packages (released), the live
power caps (set back to each card's default), a `/dev/shm` line in /etc/fstab (taken out; the
live /dev/shm goes back to half the RAM), the live sysctl values (they stay until the next boot:
the kernel keeps no earlier value), the driver packages and `cuda-keyring` on Debian (kept with
the driver) and, on WSL2, the Windows TDR registry values (they stay: docs/wsl2.md). The
`stale_files` a converge removed are not put back. The run lock in /run/lock/rigbook is taken by
every deploy, the offboard too; /run is gone at the next boot.
"""


def footprint_markdown() -> str:
    """docs/footprint.md: FOOTPRINT as a table."""
    lines = [_DOC_INTRO.format(units=", ".join(f"`{u}`" for u in UNITS),
                               user=serving.SERVE_USER),
             "| path | role | what | kept with |", "| --- | --- | --- | --- |"]
    lines += [f"| `{i.path}` | {i.role} | {i.what} | {i.kept_with or ''} |" for i in FOOTPRINT]
    lines += ["", "Folders rigbook makes, removed once nothing is left in them (what is kept, "
              "or an operator's own drop-in, stays): "
              + ", ".join(f"`{root}`" for root in ROOTS) + ", and the folders between one "
              "of them and a path above (the default HF cache's `/var/lib/rigbook/hf`)."]
    return "\n".join(lines) + "\n"
