"""The nastiest values rigbook accepts, rendered into the real files it writes on a sandbox rig.

The serving unit and its engine.env are rendered exactly as roles/serving.py renders them, for a
recipe whose engine arguments and environment hold quotes, `$()`, backticks, `%` specifiers,
backslashes, spaces and a leading dash (tests/test_hostile.py lists them). On the rig,
`systemd-analyze verify` checks the unit, and systemd itself starts it with a stand-in engine
that writes down the argv and environment it was given: they must be the recipe's values
exactly, with no extra argument, directive or variable. The recipe is cpu_only: systemd must
report its unit's device policy as closed with no device but the read-only RTC that
ProtectClock=yes adds, and its engine must see an empty
CUDA_VISIBLE_DEVICES.

The other files whose text comes from host data get the same treatment with the most hostile
values their types accept: the /dev/shm reaper's unit (globs with [ ] * ?) and the hub mirror's
unit (a cache path with : = , + @) are verified and started, their argv read back; the driver's
apt source (a URL holding $( ), ;, #, %, & and ?) is read by apt itself, which must see one
repository at that URL; the modprobe options file is read by modprobe itself, which must see one
`options nvidia` line with those values. (The power unit, sysctl file and fstab line take only
numbers, sizes and nvidia-smi's own UUIDs.) Nothing of it is left on the rig.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rigbook.core.render import render, systemd_word
from rigbook.core.spec import Rig
from rigbook.roles.driver import TEMPLATES, AptSource, ModprobeConf
from rigbook.roles.guards import REAPER, REAPER_UNIT
from rigbook.roles.guards import SOURCES as GUARD_FILES
from rigbook.roles.models import MIRROR_SCRIPT, MIRROR_TEMPLATE
from rigbook.roles.serving import (
    ENV_PATH,
    SERVE_HOME,
    SERVE_USER,
    VENV_CHECK_PATH,
    VENV_CHECK_SOURCE,
    render_env,
    render_unit,
    serve_plan,
)
from rigbook.roles.tokens import MIRROR_TOKEN_PATH
from tests.conftest import ROOT, rig_ssh
from tests.test_hostile import ACCEPTED_ARGS, hostile_cpu_rig

pytestmark = pytest.mark.sandbox

UNIT = "rigbook-hostile.service"
DUMP = "/usr/local/bin/rigbook-argv-dump"
#: Written as the unit's user, in its home: the one place its hardened unit may write.
OUT = f"{SERVE_HOME}/rigbook-hostile.json"
ENV_HERE = "/etc/rigbook-hostile/engine.env"
ENV = {"HOSTILE_A": "$HOME", "HOSTILE_B": 'say "hi" `id` \\ %h $(id)', "HOSTILE_C": "-x ;"}
DUMPER = f"""#!/usr/bin/python3
import json, os, sys
json.dump({{"argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items()
                                          if k.startswith("HOSTILE_")}},
           "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}}, open("{OUT}", "w"))
"""
#: For units with a private /tmp: the argv to the journal.
PRINTER = '#!/usr/bin/python3\nimport json, sys\nprint(json.dumps({"argv": sys.argv[1:]}))\n'


def put(rig: dict, path: str, text: str, mode: str = "644") -> None:
    done = subprocess.run(
        ["ssh", "-i", rig["ssh_key"], "-o", "StrictHostKeyChecking=no", "-o",
         "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
         f"root@{rig['address']}", f"mkdir -p $(dirname {path}) && cat > {path} && chmod {mode} "
                                   f"{path}"],
        input=text, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr


def hostile_plan(tmp_path: Path):
    recipe = (ROOT / "tests" / "recipes" / "tiny-cpu-a.toml").read_text()
    recipe = recipe.replace('name = "tiny-cpu-a"', 'name = "hostile-cpu"').replace(
        "[model]", f"extra_args = {json.dumps(ACCEPTED_ARGS)}\n"
                   f"env = {{ {', '.join(f'{k} = {json.dumps(v)}' for k, v in ENV.items())} }}\n"
                   "[model]", 1)
    (tmp_path / "hostile-cpu.toml").write_text(recipe)
    return serve_plan(hostile_cpu_rig(tmp_path), "rig1")


def test_accepted_hostile_values_are_inert_in_the_real_unit_and_env_file(sandbox, tmp_path):
    rig = sandbox["rig1"]
    plan = hostile_plan(tmp_path)
    assert all(arg in plan.argv for arg in ACCEPTED_ARGS)
    unit = render_unit(plan, None).replace(ENV_PATH, ENV_HERE)
    engine = systemd_word(plan.argv[0])
    assert f"ExecStart={engine} " in unit
    unit = unit.replace(f"ExecStart={engine} ", f"ExecStart={DUMP} ", 1)
    try:
        rig_ssh(rig, f"id -u {SERVE_USER} >/dev/null 2>&1 || useradd --system {SERVE_USER}; "
                     f"install -d -o {SERVE_USER} {SERVE_HOME}")
        put(rig, DUMP, DUMPER, "755")
        had_check = rig_ssh(rig, f"test -e {VENV_CHECK_PATH}", check=False).returncode == 0
        put(rig, VENV_CHECK_PATH, VENV_CHECK_SOURCE.read_text())  # as the serving role puts it
        put(rig, ENV_HERE, render_env(plan, None))
        put(rig, f"/etc/systemd/system/{UNIT}", unit)
        verify = rig_ssh(rig, f"systemd-analyze verify /etc/systemd/system/{UNIT}", check=False)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        rig_ssh(rig, f"systemctl daemon-reload && systemctl start {UNIT}")
        rig_ssh(rig, f"timeout 30 sh -c 'until [ -s {OUT} ]; do sleep 0.2; done'")
        seen = json.loads(rig_ssh(rig, f"cat {OUT}").stdout)
        assert seen["argv"] == list(plan.argv[1:])  # every word as the recipe has it, no more
        assert seen["env"] == ENV  # every variable as the recipe has it, no more
        assert seen["cuda"] == ""  # a cpu_only engine sees no GPU
        policy = rig_ssh(rig, f"systemctl show -p DevicePolicy -p DeviceAllow {UNIT}").stdout
        # the unit writes no DeviceAllow=; ProtectClock=yes adds the RTC, read only (systemd.exec)
        assert policy.splitlines() == ["DevicePolicy=closed", "DeviceAllow=char-rtc r"], policy
        shown = rig_ssh(rig, f"systemctl cat {UNIT}").stdout.splitlines()
        directives = [line.split("=", 1)[0] for line in shown if "=" in line
                      and not line.startswith("#")]
        # the one check before the engine: a driver bump's hold (no GPU: no driver to compare)
        checks = [line for line in shown if line.startswith("ExecStartPre=")]
        assert directives.count("ExecStart") == 1 and len(checks) == 1, checks
        assert VENV_CHECK_PATH in checks[0] and "--smi" not in checks[0], checks
        print(f"{UNIT}: systemd-analyze verify clean; argv of {len(seen['argv'])} words and "
              f"{len(seen['env'])} variables read back unchanged; {' '.join(policy.split())}")
    finally:
        rig_ssh(rig, f"systemctl stop {UNIT}; rm -f /etc/systemd/system/{UNIT} {DUMP} {OUT}; "
                     "rm -rf /etc/rigbook-hostile; systemctl daemon-reload", check=False)
        if not had_check:
            rig_ssh(rig, f"rm -f {VENV_CHECK_PATH}", check=False)


#: Accepted by the types (rigbook/core/types.py, rigbook/core/spec.py), and as hostile as they
#: allow.
GLOBS = ("x-_.[a-z]*?.mmap", "_.-a*", "abcd[b]c")
CACHE = "/srv/hf:cache=a,b+c@d"
APT_URL = "https://mirror.lan:8080/nv/$(id);#%41?x=1&y=$HOME,a+b"
MODPROBE = {"NVreg_A": "0x00", "NVreg_B": "a=b,c:d/+-.0"}
#: The rig that declares them: validated here, so they are values rigbook does accept.
ACCEPTED = Rig.model_validate({
    "platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2, "guards_shm_patterns": GLOBS,
    "models_cache": CACHE, "driver_repo_uri": APT_URL, "driver_modprobe_options": MODPROBE,
})


def started_argv(rig: dict, name: str, unit: str, program: str) -> list[str]:
    """Writes `unit` with `program` swapped for the dumper, verifies and starts it: its argv."""
    assert f"ExecStart={program} " in unit
    unit = unit.replace(f"ExecStart={program} ", f"ExecStart={DUMP} ", 1)
    put(rig, f"/etc/systemd/system/{name}", unit)
    verify = rig_ssh(rig, f"systemd-analyze verify /etc/systemd/system/{name}", check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    rig_ssh(rig, f"systemctl daemon-reload && systemctl start {name}")
    rig_ssh(rig, f"timeout 30 sh -c 'until journalctl -u {name} -o cat | grep -q argv; do "
                 "sleep 0.2; done'")
    printed = rig_ssh(rig, f"journalctl -u {name} -o cat | grep argv | tail -n 1").stdout
    return json.loads(printed)["argv"]


def test_accepted_hostile_values_are_inert_in_every_other_file_rigbook_writes(sandbox):
    rig = sandbox["rig1"]
    reaper = render(GUARD_FILES / f"{REAPER_UNIT}.j2", patterns=ACCEPTED.guards_shm_patterns)
    mirror = render(MIRROR_TEMPLATE, cache=ACCEPTED.models_cache, bind="fd00::5", port=8080,
                    script=MIRROR_SCRIPT, token_path=MIRROR_TOKEN_PATH)
    try:
        put(rig, DUMP, PRINTER, "755")
        put(rig, MIRROR_TOKEN_PATH, "x" * 32 + "\n", "600")  # the unit's LoadCredential=
        argv = started_argv(rig, "rigbook-hostile-reaper.service", reaper, "/usr/bin/python3")
        # python3 -I -S: the reaper's interpreter reads no environment and no site folder
        assert argv == ["-I", "-S", REAPER,
                        *[word for glob in GLOBS for word in ("--pattern", glob)]]
        argv = started_argv(rig, "rigbook-hostile-mirror.service", mirror, "/usr/bin/python3")
        assert argv == [MIRROR_SCRIPT, "--cache", CACHE, "--host", "fd00::5", "--port", "8080"]

        put(rig, "/tmp/rigbook-hostile-apt/parts/nvidia.sources",
            render(TEMPLATES / "nvidia.sources.j2",
                   cfg=AptSource(uri=ACCEPTED.driver_repo_uri, trusted=True)))
        apt = "/tmp/rigbook-hostile-apt"
        uris = rig_ssh(rig, f"mkdir -p {apt}/lists/partial && apt-get -o Dir::Etc::SourceList="
                            f"/dev/null -o Dir::Etc::SourceParts={apt}/parts -o "
                            f"Dir::State::Lists={apt}/lists --print-uris update").stdout
        fetched = [line.split(" ", 1)[0].strip("'") for line in uris.splitlines() if line]
        assert fetched and all(uri.rsplit("/", 1)[0] == APT_URL for uri in fetched), uris

        put(rig, "/tmp/rigbook-hostile-modprobe.conf",
            render(TEMPLATES / "modprobe.conf.j2",
                   cfg=ModprobeConf(dict(ACCEPTED.driver_modprobe_options))))
        shown = rig_ssh(rig, "modprobe -C /tmp/rigbook-hostile-modprobe.conf -c").stdout
        # (modprobe -c also lists the kernel command line's options and the module aliases)
        ours = [line for line in shown.splitlines() if "nvidia " in line or "NVreg" in line]
        assert ours == ["options nvidia NVreg_A=0x00 NVreg_B=a=b,c:d/+-.0"], ours
    finally:
        rig_ssh(rig, "systemctl stop rigbook-hostile-reaper.service rigbook-hostile-mirror.service;"
                     " rm -rf /etc/systemd/system/rigbook-hostile-* /tmp/rigbook-hostile-* "
                     f"{DUMP} {MIRROR_TOKEN_PATH}; systemctl reset-failed; systemctl daemon-reload",
                check=False)
