"""The parts of bench/peers/ that need no sandbox rig and no Ansible: the recap parser, the
Ansible config and inventory, the rendered plan of a rig, the peers table, and the bench's
refusal to time a "no-change" run that changed something."""

import json

import pytest

from bench.__main__ import _converge
from bench.peers import ansible, table
from bench.peers.render import render, sim_packages
from rigbook.core.render import render as render_template
from rigbook.core.spec import Rig
from rigbook.roles.tuning import SYSCTL_TEMPLATE

RECAP = """
TASK [Services enabled and running] ********************************************
ok: [rig1] => (item=rigbook-xid-watch.service)

PLAY RECAP *********************************************************************
rig1                       : ok=14   changed=0    unreachable=0    failed=0    skipped=0    rescued=0    ignored=0
rig2                       : ok=12   changed=3    unreachable=0    failed=0    skipped=2    rescued=0    ignored=0
"""  # noqa: E501


def test_recap_gives_each_hosts_counts():
    recap = ansible.parse_recap(RECAP)
    assert recap["rig1"]["changed"] == 0 and recap["rig1"]["ok"] == 14
    assert recap["rig2"] == {"ok": 12, "changed": 3, "unreachable": 0, "failed": 0,
                             "skipped": 2, "rescued": 0, "ignored": 0}


def test_output_without_a_recap_gives_no_hosts():
    assert ansible.parse_recap("ERROR! the playbook could not be found") == {}


def test_ansible_is_tuned_as_its_users_tune_it(tmp_path):
    cfg = ansible.config(16, tmp_path)
    for line in ("forks = 16", "gathering = explicit", "pipelining = True",
                 "interpreter_python = /usr/bin/python3"):
        assert line in cfg.splitlines()
    assert "ControlPersist=" in cfg


def test_ansible_inventory_carries_login_and_peer_vars():
    hosts = [{"name": "rig1", "address": "10.0.0.2", "user": "root", "key": "/k",
              "vars": {"peer_dirs": ["/opt/x"]}}]
    rig1 = ansible.inventory(hosts)["rigs"]["hosts"]["rig1"]
    assert rig1 == {"ansible_host": "10.0.0.2", "ansible_user": "root",
                    "ansible_ssh_private_key_file": "/k", "peer_dirs": ["/opt/x"]}


def test_stand_in_driver_packages_come_with_their_dependencies():
    install, hold = sim_packages(("nvidia-open", "nvidia-persistenced"), "580.95.05-*")
    assert install == ["nvidia-open=580.95.05-1", "nvidia-persistenced=580.95.05-1"]
    assert hold == ["libnvidia-ml1", "nvidia-kernel-open-dkms", "nvidia-open",
                    "nvidia-persistenced", "nvidia-smi"]


def test_a_version_glob_matching_several_versions_is_refused():
    with pytest.raises(SystemExit, match="matches"):
        sim_packages(("nvidia-open",), "580.*")


def _sandbox(tmp_path, monkeypatch, profile: str, gpus: int) -> None:
    """A sandbox state dir as `rigbook sandbox up 1` leaves it, without a rig."""
    monkeypatch.setenv("RIGBOOK_SANDBOX_DIR", str(tmp_path / "sandbox"))
    sim = tmp_path / "sandbox/rig1/root/etc/rigbook-sim"
    sim.mkdir(parents=True)
    card = {"name": "NVIDIA GeForce RTX 3090", "power_default_w": 350, "power_min_w": 100,
            "power_max_w": 400}
    sim.joinpath("gpus.json").write_text(json.dumps({"gpus": [
        {"index": i, "uuid": f"GPU-{i}", "pci_bus_id": f"00000000:0{i}:00.0", **card}
        for i in range(gpus)
    ]}))
    (tmp_path / "sandbox/hosts.json").write_text(json.dumps([
        {"name": "rig1", "address": "10.0.0.2", "profile": profile, "ssh_key": "/k"}]))


def test_a_dual_3090_rig_renders_what_rigbook_writes(tmp_path, monkeypatch):
    _sandbox(tmp_path, monkeypatch, "dual-3090", 2)
    (rig1,) = render(tmp_path / "out")
    peer = rig1["vars"]
    assert json.loads((tmp_path / "out/peers.json").read_text())["hosts"] == [rig1]
    assert peer["peer_fstab_line"] == "tmpfs /dev/shm tmpfs defaults,size=2G 0 0"
    assert peer["peer_absent"] == ["/etc/sysctl.d/99-vllm-swap.conf"]
    assert peer["peer_enable"] == ["nvidia-power-limit.service"]
    files = {f["dest"]: f for key in ("peer_apt_source", "peer_files", "peer_units",
                                      "peer_xid_files") for f in peer[key]}
    unit = open(files["/etc/systemd/system/nvidia-power-limit.service"]["src"]).read()
    assert "ExecStart=-/usr/bin/nvidia-smi -i GPU-1 -pl 290" in unit
    assert files["/opt/rigbook/guards/rigbook-xid-watch"]["mode"] == "0755"
    sysctl = open(files["/etc/sysctl.d/90-rigbook.conf"]["src"]).read()
    rig = Rig.model_validate({"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2})
    assert sysctl == render_template(SYSCTL_TEMPLATE, cfg=rig)  # the sandbox sets no sysctl_*


def test_a_wsl2_rig_gets_no_driver_and_no_power_unit(tmp_path, monkeypatch):
    _sandbox(tmp_path, monkeypatch, "wsl2-3090", 1)
    (rig1,) = render(tmp_path / "out")
    peer = rig1["vars"]
    assert peer["peer_driver_packages"] == [] and peer["peer_apt_source"] == []
    assert peer["peer_enable"] == [] and peer["peer_fstab_line"] is None
    assert peer["peer_services"] == ["rigbook-xid-watch.service"]


def _row(rigs: int, subset: tuple[float, float], ansible_s: tuple[float, float]) -> dict:
    def times(first, again, runs=3):
        return {"first_converge": {"seconds": first},
                "no_change_converge": {"seconds": again, "runs": [again] * runs}}

    return {"rigs": rigs, "rigbook_full": times(6.0, 3.0), "rigbook_subset": times(*subset),
            "ansible": times(*ansible_s, runs=1), "pyinfra_stock": times(*subset)}


def test_peers_table_gives_each_tool_and_the_ratio_to_rigbooks_subset():
    text = table.markdown([_row(1, (4.0, 2.0), (26.0, 16.0)), _row(16, (10.0, 5.0), (80.0, 60.0))])
    lines = text.splitlines()
    assert lines[4] == ("| rigs | rigbook, full deploy | rigbook, same subset | Ansible "
                        "| stock pyinfra |")
    assert lines[6] == ("| 1 | 6.0 s / 3.0 s | 4.0 s / 2.0 s | 26.0 s / 16.0 s (6.5x / 8.0x) "
                        "| 4.0 s / 2.0 s (1.0x / 1.0x) |")
    assert lines[7].startswith("| 16 | ") and "(8.0x / 12.0x)" in lines[7]
    assert "medians of 3 runs (Ansible: 1)" in lines[2]


def test_equal_repeats_are_named_once():
    row = _row(1, (4.0, 2.0), (26.0, 16.0))
    row["ansible"]["no_change_converge"]["runs"] *= 3
    assert "medians of 3 runs;" in table.markdown([row])


def test_ratio_without_a_base_time_is_a_dash():
    assert table.ratio(3.0, 0) == "-"


def test_a_no_change_run_that_changed_something_fails_the_bench():
    runs = iter([{"seconds": 5.0, "changes": 30}, {"seconds": 2.0, "changes": 0},
                 {"seconds": 2.5, "changes": 1}])
    with pytest.raises(SystemExit, match="Ansible: a no-change converge reported 1 changes"):
        _converge("Ansible", lambda: next(runs), repeat=2)


def test_converge_gives_the_first_run_and_the_median_of_the_rest():
    runs = iter([{"seconds": s, "changes": c} for s, c in ((5.0, 30), (2.0, 0), (3.0, 0),
                                                            (2.5, 0))])
    result = _converge("stock pyinfra", lambda: next(runs), repeat=3)
    assert result["first_converge"]["changes"] == 30
    assert result["no_change_converge"]["seconds"] == 2.5
