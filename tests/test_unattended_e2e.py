"""An unattended upgrade on the dual-3090 sandbox rig (rig1), by Debian's real unattended-upgrades.

The seeds' first hazard, for real: the sandbox's repository offers a newer stand-in driver
(580.159.04) than the converge installs (580.95.05), and Debian's own `unattended-upgrades`
package (from Debian's archive, through the rig's apt: `debian_subset` in tests/standins.py)
runs on the rig, allowed to take packages from that repository, as Ubuntu's allows its
restricted archive. One story, in order:

1. the converge installs 580.95.05, holds it and writes the unattended-upgrades blacklist (a
   second converge changes nothing);
2. with them, nothing moves: `apt-get -s upgrade` keeps the driver back,
   `unattended-upgrade --dry-run -d` and a real `unattended-upgrade -d` upgrade none of it;
3. with the hold and the blacklist removed by hand, `unattended-upgrade -d` moves the driver
   to 580.159.04 under the loaded 580.95.05 module: the stand-in nvidia-smi fails with the
   version mismatch, `rigbook status` says DRIVER MISMATCH (exit 4), a GPU deploy's preflight
   refuses, and the serving unit of a GPU recipe (as roles/serving.py renders it) refuses to
   start: its `nvidia-smi -L` pre-start fails.

The apt pin the driver role also writes is moved aside throughout, so that the hold and the
blacklist are what is tested. The teardown puts rig1 back as a converge leaves it.
"""

from __future__ import annotations

import pytest

from rigbook.core.spec import Rig
from rigbook.roles.driver import BLACKLIST, PREFERENCES
from rigbook.roles.serving import (
    CONF_DIR,
    ENV_PATH,
    UNIT_NAME,
    UNIT_PATH,
    render_env,
    render_unit,
    serve_plan,
)
from tests.conftest import ROOT, SANDBOX_INVENTORY, rig_ssh, rigbook, run_pyinfra
from tests.standins import debian_subset, ssh_with_input
from tests.test_driver_e2e import (
    NEW,
    OLD,
    PACKAGES,
    forget_driver,
    holds,
    smi_driver,
    status_says_mismatch,
    versions,
)

pytestmark = pytest.mark.sandbox

SUBSET = "/var/lib/rigbook-sim/debian-subset"
SUBSET_LIST = "/etc/apt/sources.list.d/rigbook-sim-debian-subset.list"
#: What lets unattended-upgrades take packages from the sandbox's flat file: repository (no
#: Release file: every origin field is empty), as Ubuntu's default lets it take the restricted
#: archive's driver.
ORIGINS = "/etc/apt/apt.conf.d/52rigbook-sim-unattended-origins"
UNATTENDED = "DEBIAN_FRONTEND=noninteractive unattended-upgrade -d"
#: A GPU recipe of tests/recipes: its unit starts with `nvidia-smi -L`, as every GPU recipe's.
GPU_RECIPE = "tiny-gpu-fat"


def install_unattended_upgrades(rig: dict) -> None:
    """Debian's unattended-upgrades, installed by the rig's apt from a subset of Debian's archive
    (what the rig lacks of its dependencies); the subset's source is gone afterwards."""
    installed = set(rig_ssh(rig, "dpkg-query -W -f='${Package}\\n'").stdout.split())
    tarball = debian_subset("unattended-upgrades", installed)
    ssh_with_input(rig, f"rm -rf {SUBSET} && mkdir -p {SUBSET} && tar -x -C {SUBSET}", tarball)
    rig_ssh(rig, f"echo 'deb [trusted=yes] file:{SUBSET} ./' > {SUBSET_LIST} && "
                 "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "
                 f"--no-install-recommends unattended-upgrades && rm -f {SUBSET_LIST} && "
                 "rm -rf " + SUBSET + " && apt-get update -qq")
    rig_ssh(rig, f"printf '%s\\n' 'Unattended-Upgrade::Origins-Pattern:: \"site=\";' > {ORIGINS}")


def put_gpu_serving_unit(rig: dict) -> None:
    """The serving unit and env file roles/serving.py writes for a GPU recipe, and its user
    (sandbox rigs cannot build that recipe's CUDA venv, so no engine: only the pre-start runs)."""
    spec = Rig(platform="debian", gpu_class="rtx3090", gpu_count=2, driver_version=OLD,
               recipe=GPU_RECIPE, serving_recipe_dirs=[str(ROOT / "tests" / "recipes")],
               venvs=[{"name": "tiny-cpu", "engine": "llama-cpp-python", "python": "3.11",
                       "packages": ["llama-cpp-python[server]==0.3.36"]}],
               models=[{"repo": "local/tiny", "revision": "1" * 40}])
    plan = serve_plan(spec, "rig1")
    rig_ssh(rig, "id rigbook-serve >/dev/null 2>&1 || useradd --system --create-home "
                 "--home-dir /var/lib/rigbook-serve --shell /usr/sbin/nologin rigbook-serve")
    ssh_with_input(rig, f"mkdir -p {CONF_DIR} && cat > {ENV_PATH}", render_env(plan, None).encode())
    ssh_with_input(rig, f"cat > {UNIT_PATH} && systemctl daemon-reload",
                   render_unit(plan, "/usr/bin/nvidia-smi").encode())


def test_unattended_upgrade_moves_nothing_held_and_breaks_the_driver_unheld(sandbox):
    rig = sandbox["rig1"]
    forget_driver(rig)
    try:
        # 1. the converge: 580.95.05 installed, held and blacklisted; 580.159.04 is offered
        first = run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py", "--limit", "rig1")
        assert first.returncode == 0, first.explain()
        assert versions(rig) == {name: f"{OLD}-1" for name in PACKAGES}
        again = run_pyinfra(SANDBOX_INVENTORY, "deploys/rig.py", "--limit", "rig1")
        assert again.returncode == 0 and again.changed() == {}, again.explain()
        install_unattended_upgrades(rig)
        rig_ssh(rig, f"mv {PREFERENCES} /root/rigbook-nvidia.pref && apt-get update -qq")
        assert f"{NEW}-1" in rig_ssh(rig, "apt-cache madison nvidia-open").stdout

        # 2. hold and blacklist in place: nothing moves, in a simulation or for real
        simulated = rig_ssh(rig, "apt-get -s upgrade").stdout
        assert "kept back" in simulated and "Inst nvidia" not in simulated, simulated
        for name in PACKAGES:
            assert f"Inst {name} " not in simulated
        dry = rig_ssh(rig, f"{UNATTENDED} --dry-run", check=False)
        assert dry.returncode == 0, dry.stdout + dry.stderr
        said = dry.stdout + dry.stderr
        # it saw the newer driver and left it: rigbook's blacklist, then nothing to upgrade
        assert "Initial blacklist: nvidia- libnvidia- " in said, said
        assert "skipping blacklisted package libnvidia-ml1" in said, said
        assert "No packages found that can be upgraded unattended" in said, said
        real = rig_ssh(rig, UNATTENDED, check=False)
        assert real.returncode == 0, real.stdout + real.stderr
        assert "No packages found that can be upgraded unattended" in real.stdout + real.stderr
        assert versions(rig) == {name: f"{OLD}-1" for name in PACKAGES}
        assert smi_driver(rig) == OLD

        # 3. hold and blacklist removed by hand: unattended-upgrades moves the driver under
        #    the loaded module
        rig_ssh(rig, f"apt-mark unhold {' '.join(PACKAGES)} && "
                     f"mv {BLACKLIST} /root/rigbook-nvidia-blacklist")
        moved = rig_ssh(rig, UNATTENDED, check=False)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert "Packages that will be upgraded: libnvidia-ml1" in moved.stdout + moved.stderr, (
            moved.stdout + moved.stderr)
        assert versions(rig) == {name: f"{NEW}-1" for name in PACKAGES}, moved.stdout
        smi = rig_ssh(rig, "nvidia-smi -L", check=False)
        assert smi.returncode == 18 and "Driver/library version mismatch" in smi.stdout + smi.stderr

        line = status_says_mismatch()
        table = rigbook("status", SANDBOX_INVENTORY, "--limit", "rig1", check=False)
        assert table.returncode == 4 and "DRIVER MISMATCH" in table.stdout, table.stdout

        refused = run_pyinfra(SANDBOX_INVENTORY, "deploys/power_cap.py", "--limit", "rig1")
        assert refused.returncode != 0 and line in refused.stderr, refused.explain()
        assert refused.changed() == {}, refused.explain()

        put_gpu_serving_unit(rig)
        start = rig_ssh(rig, f"systemctl start {UNIT_NAME}", check=False)
        assert start.returncode != 0
        journal = rig_ssh(rig, f"journalctl -u {UNIT_NAME} -b 0 --no-pager").stdout
        assert "Driver/library version mismatch" in journal, journal
        assert "Control process exited, code=exited, status=18" in journal, journal
        assert "llama_cpp.server" not in rig_ssh(rig, "ps -eo args").stdout  # no engine ran
    finally:  # rig1 as a converge leaves it: 580.95.05 held and loaded, no unattended-upgrades
        rig_ssh(rig, " ; ".join((
            f"systemctl stop {UNIT_NAME}", f"rm -rf {UNIT_PATH} {CONF_DIR}",
            "userdel -r rigbook-serve", "systemctl daemon-reload",
            f"test -e /root/rigbook-nvidia.pref && mv /root/rigbook-nvidia.pref {PREFERENCES}",
            f"test -e /root/rigbook-nvidia-blacklist && "
            f"mv /root/rigbook-nvidia-blacklist {BLACKLIST}",
            f"rm -f {ORIGINS} {SUBSET_LIST}", f"rm -rf {SUBSET} /var/log/unattended-upgrades",
            "DEBIAN_FRONTEND=noninteractive apt-get purge -y -q --autoremove unattended-upgrades",
            "apt-get update -qq",
            "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --allow-downgrades "
            "--allow-change-held-packages " + " ".join(f"{name}={OLD}-1" for name in PACKAGES),
            f"apt-mark hold {' '.join(PACKAGES)}",
            "rm -f /run/rigbook-sim/loaded-version", "systemctl restart rigbook-sim-driver",
        )), check=False)
    assert smi_driver(rig) == OLD
    assert holds(rig) >= set(PACKAGES)
    assert rig_ssh(rig, "command -v unattended-upgrade", check=False).returncode != 0
