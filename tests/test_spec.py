"""Host data validation: good inventories load, bad ones are refused before any connection."""

from __future__ import annotations

import socket
import subprocess
import textwrap
import threading

import pytest

from rigbook.core.errors import RigbookError
from rigbook.core.spec import parse_rig
from rigbook.docs import host_data_markdown
from rigbook.inventory import cli_override_data, load_inventory, load_rigs
from tests.conftest import PYINFRA, ROOT

GOOD = {"platform": "ubuntu", "gpu_class": "rtx3090", "gpu_count": 2}


#: The commit the example fleet's serving rig pins, as its operator pastes it (the file ships
#: the all-zeros placeholder, which every run refuses: tests/test_recipes.py).
PINNED = {"models": [{"repo": "Lorbus/Qwen3.6-27B-int4-AutoRound", "revision": "a" * 40}]}


def test_example_fleet_validates_with_group_data_and_host_precedence():
    rigs = load_rigs(str(ROOT / "inventory/rigs.py"), PINNED)
    assert set(rigs) == {"rig-dual3090", "rig-5090", "rig-wsl3090"}
    assert rigs["rig-5090"].driver_branch == 595  # host data wins over group data (580)
    assert rigs["rig-dual3090"].driver_branch == 580
    assert rigs["rig-dual3090"].default_cap() == 290  # 3090 air sweet spot
    assert rigs["rig-wsl3090"].default_cap() == 250  # 3090 prefill profile
    assert rigs["rig-5090"].default_cap() == 400


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({**GOOD, "coolng": "air"}, "box: coolng: unknown key (did you mean cooling? "
                                    "docs/host-data.md lists every key)"),
        ({**GOOD, "power_cap_watts": -5}, "box: power_cap_watts: Input should be greater than or "
                                          "equal to 50; allowed: 50 to 1200 (got -5)"),
        ({**GOOD, "gpu_class": "rtx9090"}, "box: gpu_class: Input should be 'rtx3090'"),
        ({**GOOD, "gpu_class": "other"}, "gpu_class other needs gpu_limits_watts"),
        ({**GOOD, "driver_branch": 470}, "box: driver_branch: unknown driver branch 470"),
        ({**GOOD, "power_caps": {"2": 300}},
         "power_caps names GPU 2 but the rig has 2 GPUs, indexes 0-1 (gpu_count)"),
        ({**GOOD, "gpu_count": 1, "power_caps": {"1": 300}},
         "power_caps names GPU 1 but the rig has one GPU, index 0 (gpu_count)"),
        ({**GOOD, "power_caps": {"0": 0}}, "box: power_caps.0: Input should be greater than or "
                                           "equal to 50; allowed: 50 to 1200 (got 0)"),
        ({**GOOD, "gpu_class": "a6000"}, "no documented sweet-spot cap for a6000"),
        ({**GOOD, "power_profile": "prefill", "gpu_class": "rtx4090"}, "no documented prefill cap"),
        ({**GOOD, "gpu_class": "rtx4090", "cooling": "water"},
         "no documented sweet-spot cap for rtx4090 cooled by water: the hardware notes measured "
         "it air-cooled only"),
        ({**GOOD, "gpu_class": "rtx5090", "cooling": "aio"}, "rtx5090 cooled by aio"),
        ({**GOOD, "power_profile": "prefill", "cooling": "water"},
         "no documented prefill cap for rtx3090 cooled by water"),
        ({**GOOD, "shm_size": "lots"}, "box: shm_size: a tmpfs size, e.g. 64G, 512M or 50% "
                                       "(got 'lots')"),
        ({**GOOD, "stale_files": ["etc/x"]}, "box: stale_files.0: an absolute path on the rig"),
        ({**GOOD, "stale_files": ["/etc/passwd"]}, "box: stale_files: /etc/passwd is not in a "
         "folder leftovers live in; allowed: a file directly in /etc/sysctl.d, /etc/modprobe.d"),
        ({**GOOD, "stale_files": ["/etc/modprobe.d/rigbook-nvidia.conf"]},
         "box: stale_files: /etc/modprobe.d/rigbook-nvidia.conf is rigbook's own file"),
        ({**GOOD, "platform": "debian", "driver_server": True}, "driver_server is for Ubuntu"),
        ({"platform": "ubuntu"}, "box: gpu_class: Field required"),
    ],
)
def test_bad_host_data_names_host_and_field(data, expected):
    with pytest.raises(RigbookError) as error:
        parse_rig("box", data)
    assert expected in str(error.value)


def test_every_error_is_reported_at_once():
    with pytest.raises(RigbookError) as error:
        parse_rig("box", {**GOOD, "coolng": "air", "nvlink": "maybe"})
    lines = str(error.value).splitlines()
    assert len(lines) == 2 and all(line.startswith("box: ") for line in lines)


def test_pyinfra_keys_pass_and_per_gpu_caps_override():
    rig = parse_rig("box", {**GOOD, "ssh_hostname": "x", "_sudo": True, "power_caps": {"1": 310}})
    assert rig.default_cap() == 290 and rig.power_caps == {"1": 310}
    assert parse_rig("box", {**GOOD, "power_profile": "stock"}).default_cap() is None
    with pytest.raises(RigbookError, match="power_cap_watts: Input should be a valid integer"):
        parse_rig("box", {**GOOD, "power_cap_watts": "300"})  # strict: a number, not text


def test_cli_override_data_types_values_like_pyinfra():
    argv = ["pyinfra", "inv.py", "d.py", "--data", "power_cap_watts=290", "--data=allow_reboot=1"]
    assert cli_override_data(argv) == {"power_cap_watts": 290, "allow_reboot": 1}


def test_host_data_docs_are_generated_from_the_models():
    docs = (ROOT / "docs" / "host-data.md").read_text()
    assert docs == host_data_markdown(), "run `rigbook docs` to regenerate"


class _CountingListener:
    """A loopback TCP listener that counts connection attempts (stands in for sshd)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture
def listener():
    counting = _CountingListener()
    yield counting
    counting.close()


def _inventory(tmp_path, listener, data: dict) -> str:
    path = tmp_path / "inv.py"
    path.write_text(textwrap.dedent(f"""\
        rigs = [("box-a", {{"ssh_hostname": "127.0.0.1", "ssh_port": {listener.port}, **{data!r}}})]
    """))
    return str(path)


def _pyinfra(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYINFRA, "-y", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_bad_inventory_exits_nonzero_without_connecting(tmp_path, listener):
    inventory = _inventory(tmp_path, listener, {**GOOD, "coolng": "air", "power_cap_watts": -5})
    proc = _pyinfra(inventory, "deploys/rig.py")
    assert proc.returncode != 0
    assert "box-a: coolng: unknown key (did you mean cooling?" in proc.stderr
    assert "box-a: power_cap_watts: Input should be greater than or equal to 50; allowed: 50 to " \
        "1200 (got -5)" in proc.stderr
    assert "nothing was changed" in proc.stderr
    assert listener.connections == 0


def test_bad_cli_data_is_refused_without_connecting(tmp_path, listener):
    inventory = _inventory(tmp_path, listener, GOOD)
    proc = _pyinfra(inventory, "deploys/power_cap.py", "--data", "power_cap_watts=-5")
    assert proc.returncode != 0
    assert "box-a: power_cap_watts: Input should be greater than or equal to 50; allowed: 50 to " \
        "1200 (got -5)" in proc.stderr
    assert listener.connections == 0


def test_data_is_checked_only_against_the_hosts_the_limit_selects():
    fleet = str(ROOT / "inventory/rigs.py")
    prefill = {"power_profile": "prefill"}  # documented for the 3090 only
    _, hosts, rigs = load_inventory(fleet, {**prefill, **PINNED}, limit=["rig-dual3090"])
    assert [host.name for host in hosts] == ["rig-dual3090"]
    assert rigs["rig-dual3090"].default_cap() == 250
    _, _, rigs = load_inventory(fleet, {**prefill, **PINNED})
    assert rigs["rig-5090"].default_cap() == 400  # the notes' prefill knee, 0.618 TPS/W
    with pytest.raises(RigbookError, match="rig-5090: no documented sweet-spot cap for rtx5090 "
                                           "cooled by water"):
        load_inventory(fleet, {"cooling": "water"})
    _, hosts, _ = load_inventory(fleet, {"power_caps": {"0": 280, "1": 300}, **PINNED},
                                 limit=["dual_3090"])
    assert [host.name for host in hosts] == ["rig-dual3090"]
    _, hosts, _ = load_inventory(fleet, PINNED, exclude=["rig-5090"])
    assert [host.name for host in hosts] == ["rig-dual3090", "rig-wsl3090"]
    with pytest.raises(RigbookError, match="--limit rig-dual3009: no such rig or group"):
        load_inventory(fleet, limit=["rig-dual3009"])


# --- ranges a real rig can have, and keys that contradict each other --------------------------

#: (host data on top of GOOD, what the message must say): every numeric key out of its range,
#: with the key and the range named.
OUT_OF_RANGE = [
    ({"gpu_count": 9}, "gpu_count: Input should be less than or equal to 8; allowed: 1 to 8"),
    ({"power_cap_watts": 5}, "power_cap_watts: Input should be greater than or equal to 50; "
                             "allowed: 50 to 1200 (got 5)"),
    ({"power_cap_watts": 100000}, "power_cap_watts: Input should be less than or equal to 1200"),
    ({"power_caps": {"0": 5000}}, "power_caps.0: Input should be less than or equal to 1200; "
                                  "allowed: 50 to 1200"),
    ({"gpu_class": "other", "gpu_limits_watts": [1, 300]},
     "gpu_limits_watts.0: Input should be greater than or equal to 50; allowed: 50 to 1200"),
    ({"sysctl_inotify_max_user_watches": 2**31},
     "sysctl_inotify_max_user_watches: Input should be less than or equal to 16777216; "
     "allowed: 8192 to 16777216"),
    ({"sysctl_inotify_max_user_instances": 10**7}, "sysctl_inotify_max_user_instances: Input "
                                                   "should be less than or equal to 65536; "
                                                   "allowed: 128 to 65536 (got 10000000)"),
    ({"platform": "wsl2", "gpu_count": 1, "wsl_min_memory_gib": 100000},
     "wsl_min_memory_gib: Input should be less than or equal to 1024; allowed: 1 to 1024"),
    ({"serving_max_model_len": 10**9}, "serving_max_model_len: Input should be less than or "
                                       "equal to 16777216; allowed: 256 to 16777216"),
    ({"serving_gpu_memory_utilization": 0.01},
     "serving_gpu_memory_utilization: Input should be greater than or equal to 0.1; allowed: "
     "0.1 to 0.98"),
    ({"verify_prefill_tokens": 10**9}, "verify_prefill_tokens: Input should be less than or "
                                       "equal to 16777216; allowed: 16 to 16777216"),
    ({"verify_needle_fill": 0.001}, "verify_needle_fill: Input should be greater than or equal "
                                    "to 0.01; allowed: 0.01 to 1"),
    ({"verify_needle_fill": True}, "verify_needle_fill: Input should be a valid number"),
    ({"verify_needle_depths": [1.5]}, "verify_needle_depths: depth 1.5 is outside 0..1"),
    ({"driver_branch": 999}, "driver_branch: unknown driver branch 999; allowed: (580, 595)"),
    ({"verify_context_len": 10**9}, "verify_context_len: Input should be less than or equal to "
                                    "16777216; allowed: 256 to 16777216"),
    ({"models_disk_margin_gib": float("inf")}, "models_disk_margin_gib: Input should be less "
                                               "than or equal to 10240; allowed: 0 to 10240"),
    ({"models_disk_margin_gib": "10"}, "models_disk_margin_gib: Input should be a valid number"),
    ({"sweep_watts": "0:300:10"}, "sweep_watts: '0' W is outside 1..2000 W"),
]

#: Keys that contradict each other: refused with both keys named and what is allowed.
CONTRADICTIONS = [
    ({"driver_branch": 580, "driver_version": "595.45.04"},
     "driver_version 595.45.04 is not of driver_branch 580; allowed: a 580.x version, or "
     "driver_branch 595"),
    ({"platform": "debian", "driver_repo_trusted": True},
     "driver_repo_trusted without driver_repo_uri"),
    ({"platform": "wsl2", "gpu_count": 1, "driver_repo_uri": "http://mirror.lan/nvidia"},
     "driver_repo_uri: platform wsl2 uses the Windows driver"),
    ({"driver_repo_uri": "http://mirror.lan/ubuntu", "driver_repo_trusted": True},
     "driver_repo_trusted is for platform debian only (platform is ubuntu)"),
    ({"platform": "wsl2", "gpu_count": 1, "driver_modprobe_options": {"NVreg_X": "1"}},
     "driver_modprobe_options: platform wsl2 uses the Windows driver"),
    ({"platform": "wsl2", "gpu_count": 1, "driver_version": "580.95.05"},
     "driver_version: platform wsl2 uses the Windows driver"),
    ({"platform": "wsl2", "gpu_count": 1, "driver_secure_boot": "enroll"},
     "driver_secure_boot: platform wsl2 uses the Windows driver"),
    ({"platform": "wsl2", "gpu_count": 1, "driver_foreign": "adopt"},
     "driver_foreign: platform wsl2 uses the Windows driver"),
    ({"wsl_tdr_delay": 30}, "wsl_tdr_delay is for platform wsl2 only (platform is ubuntu)"),
    ({"serving_port": 8090, "models_mirror_port": 8090, "models_mirror_token_file": "t"},
     "serving_port and models_mirror_port are both 8090"),
    ({"gpu_count": 1, "gpu_class": "a6000", "power_profile": "stock", "nvlink": True},
     "nvlink with gpu_count 1: a bridge joins two cards"),
    ({"power_caps": {f"GPU-{i}0000000-0000-0000-0000-000000000000": 300 for i in range(3)}},
     "power_caps names 3 GPUs but the rig has 2"),
    ({"gpu_class": "rtx5090", "power_profile": "stock", "driver_open": False},
     "driver_open: false with gpu_class rtx5090: RTX 50 cards run only on NVIDIA's open kernel "
     "module; allowed: true"),
]


@pytest.mark.parametrize(("data", "expected"), OUT_OF_RANGE + CONTRADICTIONS)
def test_a_value_no_rig_can_take_or_keys_that_disagree_are_refused(data, expected):
    with pytest.raises(RigbookError) as error:
        parse_rig("box", {**GOOD, **data})
    assert f"box: {expected}" in str(error.value)


def test_every_numeric_key_has_an_upper_and_a_lower_bound():
    from rigbook.core.spec import Rig, range_of

    numeric = [name for name, field in Rig.model_fields.items()
               if any(word in str(field.annotation) for word in ("int", "float"))]
    unbounded = {name for name in numeric if range_of(name) is None}
    # each of these is checked by its own validator (OUT_OF_RANGE has them) or is free:
    # driver_branch one of a set, verify_needle_depths each 0..1, verify_stress_needles each
    # 64..MAX_TOKENS, sweep_watts each a cap in 1..2000 W (the sweep's parser), sysctl_extra the
    # values of other kernel keys (the kernel decides; the preflight refuses a key it lacks)
    assert unbounded == {"driver_branch", "verify_needle_depths", "verify_stress_needles",
                         "sweep_watts", "sysctl_extra"}


def _tiny(**data):
    return parse_rig("box", {
        "platform": "debian", "gpu_class": "rtx3090", "gpu_count": 1, "recipe": "tiny-cpu-a",
        "serving_recipe_dirs": [str(ROOT / "tests/recipes")],
        "venvs": [{"name": "tiny-cpu", "engine": "llama-cpp-python", "packages": ["x==1.0"]}],
        "models": [{"repo": "local/tiny", "revision": "a" * 40}], **data})


@pytest.mark.parametrize(("data", "expected"), [
    ({"verify_prefill_tokens": 1000}, "box: verify_prefill_tokens: 1000 does not fit the "
                                      "512-token context of tiny-cpu-a; allowed: 16..496"),
    ({"serving_max_model_len": 256, "verify_prefill_tokens": 300},
     "box: verify_prefill_tokens: 300 does not fit the 256-token context of tiny-cpu-a; "
     "allowed: 16..240"),
    ({"verify_context_len": 2048, "verify_prefill_tokens": 1000}, None),  # a claim verify tests
    ({"verify_bench_tokens": 600}, "box: verify_bench_tokens: 600 does not fit the 512-token "
                                   "context of tiny-cpu-a; allowed: 8..496"),
])
def test_verify_sizes_are_checked_against_the_recipes_context_before_connecting(data, expected):
    from rigbook.inventory import rig_problems

    said = "\n".join(rig_problems(_tiny(**data), "box"))
    assert expected in said if expected else not said
    # the defaults (15000 tokens) are verify's run options, not a key the operator set
    assert not rig_problems(_tiny(), "box")
