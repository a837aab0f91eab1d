"""Refuse to start an engine from a venv that was built for another driver than the one running.

Installed by rigbook (roles/serving.py) at /opt/rigbook/serving/venv_check.py and run by
rigbook-serve.service as an ExecStartPre (as root, in an empty environment, `python3 -I -S`:
the engine's user cannot switch it off), with the rig's python3 (standard library only):

    python3 venv_check.py --hold /var/lib/rigbook/serving-held --venv /opt/rigbook/venvs/vllm-0.33 \
        --smi /usr/bin/nvidia-smi

A driver bump moves the CUDA stack under every venv built before it; after the bump's reboot
the enabled unit would start the engine on that stale venv. So the bump stops serving and
writes the hold file (roles/driver.py), which deploys/venvs.py removes once it rebuilt the venvs
(roles/serving.py): while it exists, this refuses with its line. With --smi (a GPU recipe's
unit; a cpu_only one reaches no GPU device) it also reads the live venv's manifest
(rigbook-manifest.json, written by the build's smoke test with the driver nvidia-smi reported)
and the driver nvidia-smi reports now, the same two values rigbook.roles.venvs.staleness compares.
Prints one line; exit 0 = start (not held, and the venv was built for the running driver), 1 =
refuse the start (held, no manifest, another driver, or no driver to read: nvidia-smi fails
while the user-space driver and the loaded module disagree, before the reboot).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MANIFEST = "rigbook-manifest.json"  # rigbook.roles.venvs.MANIFEST (a test keeps them equal)
REBUILD = "rebuild it: pyinfra INVENTORY deploys/venvs.py"


def built_for(venv: str) -> str | None:
    """The driver the venv's live build names; raises ValueError when it has no manifest."""
    path = os.path.join(venv, MANIFEST)
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: {getattr(error, 'strerror', None) or error}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: not a manifest")
    driver = manifest.get("driver")
    return driver if isinstance(driver, str) else None


def running_driver(smi: str) -> str:
    """The driver nvidia-smi reports (one version for every GPU); raises ValueError if none."""
    try:
        run = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"{smi}: {error}") from None
    versions = {line.strip() for line in run.stdout.splitlines() if line.strip()}
    if run.returncode != 0 or len(versions) != 1:
        said = " ".join((run.stdout + run.stderr).split())[-200:]
        raise ValueError(f"{smi} reports no driver (exit {run.returncode}: {said})")
    return versions.pop()


def held(hold: str) -> str | None:
    """The hold file's first line (why serving is held), None when there is none."""
    try:
        with open(hold, encoding="utf-8", errors="replace") as handle:
            return handle.readline().strip() or "held"
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"{hold}: {error.strerror}"


def verdict(venv: str, smi: str | None, hold: str) -> tuple[bool, str]:
    """(start allowed, the one line that says why)."""
    name = os.path.basename(venv.rstrip("/"))
    why = held(hold)
    if why is not None:
        return False, f"{hold}: {why}"
    if smi is None:
        return True, f"serving is not held ({hold} is absent)"
    try:
        built = built_for(venv)
    except ValueError as error:
        return False, f"venv {name} has no build to run ({error}): build it: pyinfra " \
                      "INVENTORY deploys/venvs.py"
    try:
        running = running_driver(smi)
    except ValueError as error:
        return False, f"venv {name}: cannot read the running driver: {error}"
    if built != running:
        return False, (f"venv {name} was built for driver {built or 'none'}, driver {running} "
                       f"runs: not starting the engine on it; {REBUILD}")
    return True, f"venv {name} was built for driver {running}, which runs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", required=True, help="the venv's stable path (its symlink)")
    parser.add_argument("--smi", help="the nvidia-smi to ask (a GPU recipe's unit)")
    parser.add_argument("--hold", required=True, help="the hold file a driver bump writes")
    args = parser.parse_args(argv)
    ok, line = verdict(args.venv, args.smi, args.hold)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
