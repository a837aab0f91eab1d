"""The running driver and the reboot gate: which module runs, why the rig must reboot, and a
reboot that knows the rig is back.

The driver role reboots only with allow_reboot; other roles (the module options, nouveau's
blacklist) record why a reboot is needed in REBOOT_MARKER, and the gate reads it with the
driver's own reasons.
"""

from __future__ import annotations

import re
import time

from pyinfra import host, logger
from pyinfra.api import FactBase, FunctionCommand, QuoteString, StringCommand
from pyinfra.api.exceptions import FactProcessError
from pyinfra.connectors.util import clear_askpass_cache, remove_any_sudo_askpass_file

from rigbook.core.facts import LoadedNvidiaModule

#: Reasons for a pending reboot that the packages cannot show (module options); /run is a
#: tmpfs, so the file is gone once the rig has rebooted.
REBOOT_MARKER = "/run/rigbook/driver-reboot-required"


def record_reboot(reason: str) -> StringCommand:
    """The command that adds `reason` to REBOOT_MARKER, for the reboot gate to act on."""
    folder = REBOOT_MARKER.rsplit("/", 1)[0]
    return StringCommand(f"mkdir -p {folder} && echo", QuoteString(reason), ">>", REBOOT_MARKER)


BOOT_ID = "/proc/sys/kernel/random/boot_id"
#: Seconds to wait before looking for the rebooted rig, between looks, and at most.
REBOOT_WAIT_S = (10, 2, 600)

PROC_VERSION = "/proc/driver/nvidia/version"
#: Simulation hook, read only when PROC_VERSION is absent: the sandbox's stand-in driver (which
#: cannot create /proc files) writes the version it "loaded" at boot here. No real rig has it.
SIM_LOADED_VERSION = "/run/rigbook-sim/loaded-version"
_SIM_TAG = "##RIGBOOK_SIMULATED_MODULE##"
#: A driver version as the module and the packages write it: 580.95.05, 580.65.
DRIVER_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")


class LoadedDriverVersion(FactBase[str | None]):
    """
    The version of the loaded nvidia kernel module; None when none is loaded.

    Reads /proc/driver/nvidia/version (parsed by rigbook.core.facts.LoadedNvidiaModule)::

        NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (...)

    Simulation hook: only when that file is absent, the sandbox's stand-in version file
    (SIM_LOADED_VERSION, one line such as ``580.95.05``) answers instead.
    """

    def command(self) -> str:
        return (
            f"if [ -r {PROC_VERSION} ]; then cat {PROC_VERSION}; "
            f"elif [ -r {SIM_LOADED_VERSION} ]; then "
            f'echo "{_SIM_TAG} $(cat {SIM_LOADED_VERSION})"; '
            "fi"
        )

    def process(self, output: list[str]) -> str | None:
        if output and output[0].startswith(_SIM_TAG):
            version = output[0][len(_SIM_TAG):].strip()
            if not version:
                return None
            if not DRIVER_VERSION.match(version):
                raise FactProcessError(f"{SIM_LOADED_VERSION}: not a version: {version!r}")
            return version
        return LoadedNvidiaModule().process(output)


class BootId(FactBase[str]):
    """This boot's random id (``cat /proc/sys/kernel/random/boot_id``): new at every boot,
    including a container's (systemd-nspawn mounts a fresh one)."""

    def command(self) -> str:
        return f"cat {BOOT_ID}"

    def process(self, output: list[str]) -> str:
        return output[0].strip()


class RebootMarker(FactBase[list[str]]):
    """Reasons written to REBOOT_MARKER by changes that need a reboot (one per line)."""

    def command(self) -> str:
        return f"cat {REBOOT_MARKER} 2>/dev/null || true"

    @staticmethod
    def default() -> list[str]:
        return []

    def process(self, output: list[str]) -> list[str]:
        return [line.strip() for line in output if line.strip()]




def reboot_reasons(installed: set[str], loaded: str | None, marker: list[str]) -> list[str]:
    """Why the rig must reboot before the installed driver runs; empty when it need not."""
    reasons = list(marker)
    if not installed:
        return reasons
    have = ", ".join(sorted(installed))
    if loaded is None:
        reasons.append(f"driver {have} is installed but no nvidia module is loaded")
    elif installed != {loaded}:
        reasons.append(f"driver {have} is installed but the loaded module is {loaded}")
    return reasons




def reboot_and_wait():
    """pyinfra's server.reboot, except that it knows the rig is back by a new boot id.

    server.reboot waits for /proc/uptime to drop; a container's uptime is its host's, so on
    the sandbox rigs it would wait out its timeout. The boot id changes at every boot, on real
    rigs and containers alike.
    """
    before = host.get_fact(BootId)
    yield FunctionCommand(forget_askpass, (), {})
    yield StringCommand("( sleep 1 && reboot ) </dev/null >/dev/null 2>&1 &")
    yield FunctionCommand(wait_for_boot, (before, *REBOOT_WAIT_S), {})


def forget_askpass(state, host) -> bool:
    remove_any_sudo_askpass_file(host)  # as server.reboot does: a reboot may lose it
    return True


def wait_for_boot(state, host, before: str, delay: float, interval: float, limit: float) -> bool:
    """Reconnect until the rig answers with a boot id other than `before`; False after `limit`."""
    time.sleep(delay)
    clear_askpass_cache(host)
    host.disconnect()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        host.connect(show_errors=False)
        if host.connected:
            try:
                ok, output = host.run_shell_command(StringCommand("cat", BOOT_ID))
            except Exception:  # the connection died under us: the rig is going down
                ok, output = False, None
            if ok and output.stdout_lines and output.stdout_lines[0].strip() != before:
                return True
            host.disconnect()
        time.sleep(interval)
    host.log_styled(f"did not come back from the reboot within {limit:g} s", fg="red",
                    log_func=logger.error)
    return False
