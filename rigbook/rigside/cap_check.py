"""Refuse to start an engine on GPUs whose live power caps are not what the boot unit says.

Installed by rigbook (roles/serving.py) at /opt/rigbook/serving/cap_check.py and run by
rigbook-serve.service as an ExecStartPre (as the engine's user: reading caps needs no
privilege), with the rig's python3 (standard library only):

    python3 cap_check.py --unit /etc/systemd/system/nvidia-power-limit.service --tolerance 0.5

The power unit caps each GPU on its own line (`ExecStart=-<nvidia-smi> -i <UUID> -pl <W>`), so
one replaced card fails only its own line at boot. This check is what keeps that from failing
open: every GPU the unit names must be listed with its cap, and every listed GPU must be named by
the unit. Prints one line; exit 0 = every cap as the unit says, 1 = refuse the start.
Standard library only: roles/power.py reads the unit's lines with the same LINE.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

#: One cap line of the power unit (roles/power.py writes it).
LINE = re.compile(
    r"^ExecStart=-?(?P<smi>\S+)\s+-i\s+(?P<gpu>\S+)\s+-pl\s+(?P<watts>\d+(?:\.\d+)?)\s*$"
)


def unit_caps(text: str) -> tuple[str | None, dict[str, float]]:
    """(nvidia-smi path, {GPU UUID: watts}) of the power unit's ExecStart lines."""
    smi, caps = None, {}
    for line in text.splitlines():
        match = LINE.match(line.strip())
        if match:
            smi = match.group("smi")
            caps[match.group("gpu")] = float(match.group("watts"))
    return smi, caps


def live_caps(smi: str) -> dict[str, float | None]:
    """{GPU UUID: live cap in W, None where nvidia-smi has no number} of every listed GPU."""
    out = subprocess.run(
        [smi, "--query-gpu=uuid,power.limit", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    caps: dict[str, float | None] = {}
    for row in out.splitlines():
        uuid, _, watts = (cell.strip() for cell in row.partition(","))
        if uuid:
            try:
                caps[uuid] = float(watts)
            except ValueError:
                caps[uuid] = None
    return caps


def problems(wanted: dict[str, float], live: dict[str, float | None], tolerance: float) -> list:
    found = []
    for uuid, watts in wanted.items():
        if uuid not in live:
            found.append(f"{uuid} (capped at {watts:g} W by the unit) is not listed: replaced "
                         "or off the bus")
        elif live[uuid] is None:
            found.append(f"{uuid} reports no power cap, the unit says {watts:g} W")
        elif abs(live[uuid] - watts) > tolerance:
            found.append(f"{uuid} runs at a {live[uuid]:g} W cap, the unit says {watts:g} W")
    found += [f"{uuid} is not capped by the unit" for uuid in live if uuid not in wanted]
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--unit", help="the power-limit unit file")
    source.add_argument("--caps", nargs="+", metavar="UUID=W", help="the caps themselves, "
                        "where no unit can hold them (no systemd: files/serving/supervise.py)")
    parser.add_argument("--smi", default="nvidia-smi", help="nvidia-smi, with --caps")
    parser.add_argument("--tolerance", type=float, default=0.5, help="watts")
    args = parser.parse_args(argv)
    refuse = "rigbook: not starting the engine uncapped"
    if args.caps:
        args.unit, smi = "the rig's caps", args.smi
        wanted = {uuid: float(w) for uuid, _, w in (cap.partition("=") for cap in args.caps)}
    else:
        try:
            with open(args.unit) as handle:
                smi, wanted = unit_caps(handle.read())
        except OSError as error:
            print(f"{refuse}: cannot read {args.unit}: {error.strerror}", flush=True)
            return 1
    if not wanted:
        print(f"{refuse}: {args.unit} caps no GPU", flush=True)
        return 1
    try:
        live = live_caps(smi)
    except (OSError, subprocess.SubprocessError) as error:
        print(f"{refuse}: {smi} cannot list the caps: {error}", flush=True)
        return 1
    found = problems(wanted, live, args.tolerance)
    if found:
        print(f"{refuse}: " + "; ".join(found) + " (deploys/power_cap.py sets them again; "
              "rigbook status shows the rig)", flush=True)
        return 1
    print(("caps as the unit says: " if args.caps is None else "caps as the rig says: ")
          + ", ".join(f"{uuid} {watts:g} W" for uuid, watts in wanted.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
