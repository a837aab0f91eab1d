"""Run the Ansible peer (bench/peers/rig.yml) as its users tune it, and read its recap.

Tuning: pipelining on, no fact gathering, forks = number of rigs, SSH ControlMaster with
ControlPersist (one connection per rig, kept between runs), the rigs' python3 named up front so
Ansible does not probe for one. ansible-core comes from the `bench` extra
(`pip install -e '.[bench]'`); nothing else needs it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

PLAYBOOK = Path(__file__).with_name("rig.yml")
#: Installed beside the venv's python by the `bench` extra.
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
_RECAP = re.compile(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$")


def require() -> None:
    """Fail before any rig boots when ansible-core is not installed."""
    if not ANSIBLE_PLAYBOOK.exists():
        raise SystemExit(f"no {ANSIBLE_PLAYBOOK}: install the peers' tools with "
                         "`.venv/bin/pip install -e '.[bench]'`, or run with --no-peers")


def config(forks: int, out: Path) -> str:
    """ansible.cfg for `forks` rigs, its control sockets under `out`."""
    return "\n".join([
        "[defaults]",
        f"forks = {forks}",
        "gathering = explicit",
        "host_key_checking = False",
        "interpreter_python = /usr/bin/python3",
        "retry_files_enabled = False",
        f"local_tmp = {out / 'tmp'}",
        "",
        "[ssh_connection]",
        "pipelining = True",
        "ssh_args = -o ControlMaster=auto -o ControlPersist=60s "
        "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
        f"control_path_dir = {out / 'cp'}",
        "",
    ])


def inventory(hosts: list[dict]) -> dict:
    """The YAML (here JSON) inventory of the rendered rigs: one group, `rigs`."""
    return {"rigs": {"hosts": {
        entry["name"]: {"ansible_host": entry["address"], "ansible_user": entry["user"],
                        "ansible_ssh_private_key_file": entry["key"], **entry["vars"]}
        for entry in hosts
    }}}


def write(out: Path, hosts: list[dict]) -> None:
    """ansible.cfg and inventory.json into `out` (where render() put the rigs' files)."""
    (out / "ansible.cfg").write_text(config(len(hosts), out))
    (out / "inventory.json").write_text(json.dumps(inventory(hosts), indent=2) + "\n")


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP lines into host -> {ok, changed, unreachable, failed, ...}."""
    _, found, recap = output.rpartition("PLAY RECAP")
    if not found:
        return {}
    hosts = {}
    for line in recap.splitlines():
        match = _RECAP.match(line.strip())
        if match:
            hosts[match.group(1)] = {
                key: int(value) for key, value in
                (pair.split("=") for pair in match.group(2).split())
            }
    return hosts


def run(out: Path) -> dict:
    """One playbook run on the rigs written into `out`: wall time and changes (from the
    recap); SystemExit with the tail of its output when a rig failed or was unreachable."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(out / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    argv = [str(ANSIBLE_PLAYBOOK), "-i", str(out / "inventory.json"), str(PLAYBOOK)]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.perf_counter() - start
    recap = parse_recap(proc.stdout)
    bad = {host: r for host, r in recap.items() if r.get("failed") or r.get("unreachable")}
    if proc.returncode != 0 or not recap or bad:
        raise SystemExit(f"ansible-playbook failed (exit {proc.returncode}):\n"
                         f"{(proc.stdout + proc.stderr)[-4000:]}")
    return {"seconds": round(seconds, 2),
            "changes": sum(r.get("changed", 0) for r in recap.values())}
