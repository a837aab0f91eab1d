"""The power role: cap policy, the unit text, and what its operations yield against given facts.

Operation tests run an operation's generator (`op._inner`) with a fake host whose `get_fact`
answers from a dict, the way pyinfra's own tests/operations fixtures give facts and expect
commands. GPUs come from the real H200 capture (tests/fixtures/nvidia-h200) and from 3090s with
the limits an RTX 3090 reports (min 100 W, max 400 W, default 350 W).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from rigbook.core.errors import RigbookError
from rigbook.core.spec import Rig
from rigbook.core.units import UnitState
from rigbook.rigside.gpus import SMI_ADVICE, Gpu, GpuProbe, parse_query_csv
from rigbook.roles.power import (
    UNIT_NAME,
    UNIT_PATH,
    CapRow,
    GpuCap,
    _set_cap,
    cap_table,
    desired_caps,
    live_power_caps,
    power_unit,
    render_unit,
)
from tests.opkit import FakeHost, describe, file_states, run_op

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "tests" / "fixtures" / "nvidia-h200"
H200_CSV = H200 / "query-gpu.csv"
#: What the NvidiaGpus fact itself ran on the H200 (rigbook's QUERY_FIELDS, csv,nounits).
H200_FACT_CSV = H200 / "query-full-nounits.csv"
H200_SMI = "/usr/local/nvidia/bin/nvidia-smi"
SMI = "/usr/bin/nvidia-smi"
UUID0 = "GPU-5f1c0a3e-0000-4000-8000-000000000000"
UUID1 = "GPU-5f1c0a3e-1111-4000-8000-000000000001"


def rtx3090(index: int, uuid: str, limit: float = 350.0, persistence: bool = True) -> Gpu:
    return Gpu(
        index=index, uuid=uuid, name="NVIDIA GeForce RTX 3090",
        bus_id=f"00000000:0{index + 1}:00.0", driver_version="580.95.05", power_limit_w=limit,
        default_limit_w=350.0,
        min_limit_w=100.0, max_limit_w=400.0, enforced_limit_w=limit, persistence=persistence,
    )


def dual_3090(**data) -> Rig:
    return Rig(platform="debian", gpu_class="rtx3090", gpu_count=2, **data)


DUAL = (rtx3090(0, UUID0), rtx3090(1, UUID1))


def h200_gpus() -> list[Gpu]:
    # The capture appends a second, shorter query after the full one: skip those rows.
    return parse_query_csv(H200_CSV.read_text(), skip_mismatched=True)


def h200_rig(**data) -> Rig:
    return Rig(**{"platform": "ubuntu", "gpu_class": "other", "gpu_count": 1,
                  "gpu_limits_watts": (200, 700), **data})


# --- cap policy ----------------------------------------------------------------------------


def test_profiles_pick_the_hardware_notes_sweet_spots():
    assert [c.watts for c in desired_caps(dual_3090(), "rig1", DUAL)] == [290, 290]
    water = desired_caps(dual_3090(cooling="water"), "rig1", DUAL)
    assert [c.watts for c in water] == [330, 330]
    prefill = desired_caps(dual_3090(power_profile="prefill"), "rig1", DUAL)
    assert [c.watts for c in prefill] == [250, 250]
    assert prefill[0].source == "power_profile prefill (rtx3090, air)"
    aio = desired_caps(dual_3090(cooling="aio"), "rig1", DUAL)
    assert [c.watts for c in aio] == [330, 330]  # the 330 W anchor ran on an AIO


def test_5090_prefill_is_the_notes_400_w_knee():
    """Hardware notes, 5090 per-workload ceilings: prefill "400W (0.618 TPS/W)"."""
    rig = Rig(platform="ubuntu", gpu_class="rtx5090", gpu_count=1, power_profile="prefill")
    assert rig.default_cap() == 400
    with pytest.raises(ValueError, match="rtx5090 cooled by water"):
        Rig(platform="ubuntu", gpu_class="rtx5090", gpu_count=1, cooling="water")


def test_stock_is_the_cards_default_limit():
    caps = desired_caps(dual_3090(power_profile="stock"), "rig1", (rtx3090(0, UUID0, 290),
                                                                  rtx3090(1, UUID1, 290)))
    assert [c.watts for c in caps] == [350.0, 350.0]
    assert not caps[0].in_place


def test_per_gpu_caps_by_index_and_uuid_win_over_the_rest():
    rig = dual_3090(power_cap_watts=300, power_caps={"0": 280, UUID1: 320})
    caps = desired_caps(rig, "rig1", DUAL)
    assert [(c.watts, c.source) for c in caps] == [
        (280, "power_caps[0]"), (320, f"power_caps[{UUID1}]"),
    ]
    only_one = desired_caps(dual_3090(power_cap_watts=300, power_caps={"1": 310}), "rig1", DUAL)
    assert [(c.watts, c.source) for c in only_one] == [
        (300, "power_cap_watts"), (310, "power_caps[1]"),
    ]


def test_one_gpu_named_twice_with_different_caps_is_refused():
    rig = dual_3090(power_caps={"0": 280, UUID0: 300})
    with pytest.raises(RigbookError, match=r"GPU 0 .*names this GPU twice"):
        desired_caps(rig, "rig1", DUAL)


def test_500_w_on_a_3090_is_refused_with_rig_gpu_asked_and_range():
    with pytest.raises(RigbookError) as refused:
        desired_caps(dual_3090(power_cap_watts=500), "rig1", DUAL)
    message = str(refused.value)
    assert message.startswith("rig1: power caps refused, nothing was changed:")
    for gpu in DUAL:
        assert (
            f"rig1: power_cap_watts: GPU {gpu.index} ({gpu.uuid}) asks 500 W (power_cap_watts); "
            "allowed: the card's range 100-400 W"
        ) in message


def test_only_the_bad_gpu_is_named():
    with pytest.raises(RigbookError) as refused:
        desired_caps(dual_3090(power_caps={"1": 50}), "rig1", DUAL)
    assert f"power_caps: GPU 1 ({UUID1}) asks 50 W (power_caps[1])" in str(refused.value)
    assert f"GPU 0 ({UUID0})" not in str(refused.value)


def test_a_gpu_count_other_than_gpu_count_is_refused_naming_both():
    with pytest.raises(RigbookError, match=r"gpu_count: declared 2, nvidia-smi lists 1"):
        desired_caps(dual_3090(), "rig1", DUAL[:1])


def test_a_power_caps_uuid_the_rig_lacks_is_refused():
    other = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(RigbookError, match=f"power_caps: names GPU {other}, which this rig"):
        desired_caps(dual_3090(power_caps={other: 250}), "rig1", DUAL)


def test_persistence_off_is_refused_with_the_fix():
    gpus = (rtx3090(0, UUID0, persistence=False), rtx3090(1, UUID1))
    with pytest.raises(RigbookError) as refused:
        desired_caps(dual_3090(), "rig1", gpus)
    assert f"persistence mode is Disabled on GPU 0 ({UUID0})" in str(refused.value)
    assert "allowed: persistence on (driver_persistence: true" in str(refused.value)
    assert "driver_persistence" in str(refused.value)


def test_a_card_without_a_limit_range_cannot_be_capped():
    gpus = (replace(DUAL[0], min_limit_w=None, max_limit_w=None), DUAL[1])
    with pytest.raises(RigbookError, match="reports no power limit range"):
        desired_caps(dual_3090(), "rig1", gpus)


def test_h200_capture_range_200_to_700():
    gpus = h200_gpus()
    assert len(gpus) == 1
    (cap,) = desired_caps(h200_rig(power_cap_watts=500), "h200", gpus)
    assert (cap.uuid, cap.watts, cap.live_w, cap.range) == (
        "GPU-b76da475-45a0-f91f-b11d-022ca55575ef", 500, 700.0, "200-700 W",
    )
    (stock,) = desired_caps(h200_rig(power_profile="stock"), "h200", gpus)
    assert stock.watts == 700.0 and stock.in_place
    # a cap outside the declared range never reaches the rig: the host data refuses it
    with pytest.raises(ValueError, match="power_cap_watts 800 W is outside gpu_limits_watts"):
        h200_rig(power_cap_watts=800)
    # declared wider than the card really is: the card's own range refuses it on the rig
    wide = {"gpu_limits_watts": (100, 1000)}
    with pytest.raises(RigbookError, match=r"800 W \(power_cap_watts\); allowed: the card's"):
        desired_caps(h200_rig(power_cap_watts=800, **wide), "h200", gpus)
    with pytest.raises(RigbookError, match=r"asks 150 W \(power_cap_watts\); allowed"):
        desired_caps(h200_rig(power_cap_watts=150, **wide), "h200", gpus)


def test_tolerance_half_a_watt():
    cap = desired_caps(dual_3090(), "rig1", (rtx3090(0, UUID0, 290.4), rtx3090(1, UUID1, 289)))
    assert [c.in_place for c in cap] == [True, False]


# --- the unit text -------------------------------------------------------------------------


def test_unit_text():
    caps = desired_caps(dual_3090(power_caps={"1": 300}), "rig1", DUAL)
    text = render_unit(SMI, caps)
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("ExecStart=")] == [
        f"ExecStart=-{SMI} -i {UUID0} -pl 290",
        f"ExecStart=-{SMI} -i {UUID1} -pl 300",
    ]
    for line in ("Type=oneshot", "RemainAfterExit=yes", "After=nvidia-persistenced.service",
                 "Requires=nvidia-persistenced.service", "WantedBy=multi-user.target"):
        assert line in lines
    assert lines.index("[Unit]") < lines.index("[Service]") < lines.index("[Install]")
    assert "\n\n\n" not in text and text.endswith("WantedBy=multi-user.target\n")


def test_unit_text_for_the_h200_capture_by_uuid():
    caps = desired_caps(h200_rig(power_cap_watts=450), "h200", h200_gpus())
    text = render_unit("/usr/local/nvidia/bin/nvidia-smi", caps)
    assert (
        "ExecStart=-/usr/local/nvidia/bin/nvidia-smi -i "
        "GPU-b76da475-45a0-f91f-b11d-022ca55575ef -pl 450\n"
    ) in text


def test_docs_show_the_unit_and_the_refusal_as_the_code_writes_them():
    docs = (ROOT / "docs" / "power.md").read_text()
    unit = render_unit(SMI, desired_caps(dual_3090(), "rig1", DUAL))
    assert "\n".join(f"    {line}" if line else "" for line in unit.splitlines()) in docs
    with pytest.raises(RigbookError) as refused:
        desired_caps(dual_3090(power_cap_watts=500), "rig1", DUAL)
    assert "\n".join(f"    {line}" for line in str(refused.value).splitlines()) in docs


# --- operations against facts --------------------------------------------------------------


def power_op(op, rig: Rig, facts: dict, executing: bool = False) -> tuple[list, FakeHost]:
    return run_op(op, facts, rig, executing=executing)


def unit_facts(probe, unit_text: str | None = None, enabled: bool = False) -> dict:
    """Facts of a rig whose unit file holds unit_text (None: no unit file)."""

    return {
        "NvidiaGpus": probe,
        "FileStates": file_states({UNIT_PATH: unit_text}, dirs={"/etc/systemd/system": 0o755}),
        "UnitStates": lambda units: {"0": UnitState(running=False, enabled=enabled)},
    }


def probe_of(gpus, smi: str = SMI) -> GpuProbe:
    return GpuProbe(smi=smi, gpus=tuple(gpus))


def test_unit_op_writes_reloads_and_enables_a_new_unit():
    commands, _ = power_op(power_unit, dual_3090(), unit_facts(probe_of(DUAL)))
    assert [describe(c) for c in commands] == [
        f"upload {UNIT_PATH}", f"chmod 644 {UNIT_PATH}",
        "systemctl daemon-reload", f"systemctl enable {UNIT_NAME}",
    ]
    uploaded = commands[0].src.getvalue()
    assert uploaded == render_unit(SMI, desired_caps(dual_3090(), "rig1", DUAL))


def test_unit_op_changes_nothing_and_skips_daemon_reload_when_the_unit_matches():
    text = render_unit(SMI, desired_caps(dual_3090(), "rig1", DUAL))
    commands, host = power_op(power_unit, dual_3090(), unit_facts(probe_of(DUAL), text, True))
    assert commands == []
    assert host.noops[-1] == (
        f"{UNIT_NAME} is already enabled and caps GPU 0 at 290 W, GPU 1 at 290 W"
    )


def test_unit_op_rewrites_and_reloads_on_a_cap_change_without_reenabling():
    old = render_unit(SMI, desired_caps(dual_3090(), "rig1", DUAL))
    commands, _ = power_op(power_unit, dual_3090(power_cap_watts=300),
                         unit_facts(probe_of(DUAL), old, True))
    assert [describe(c) for c in commands] == [
        f"upload {UNIT_PATH}", f"chmod 644 {UNIT_PATH}", "systemctl daemon-reload",
    ]
    assert f"-i {UUID1} -pl 300\n" in commands[0].src.getvalue()


def test_unit_op_refuses_500_w_before_writing_anything():
    facts = unit_facts(probe_of(DUAL))
    commands, host = power_op(power_unit, dual_3090(power_cap_watts=500), facts)
    assert [describe(c) for c in commands] == ["call _refuse"]
    message = commands[0].args[0]
    assert "asks 500 W (power_cap_watts); allowed: the card's range 100-400 W" in message
    assert host.logged == []  # the preflight says it before any operation (rigbook/preflight.py)


def test_refusal_fails_the_rig_and_records_unchanged_rows():
    commands, _ = power_op(power_unit, dual_3090(power_cap_watts=500), unit_facts(probe_of(DUAL)))
    host = FakeHost({})
    assert commands[0].function(None, host, *commands[0].args) is False
    assert "allowed: the card's range" in host.logged[0]


@pytest.mark.parametrize("probe, why", [
    (None, "driver not installed: no nvidia-smi"),
    (GpuProbe(smi=SMI, error="Unable to determine the device handle for GPU 0000:02:00.0: GPU "
                             "is lost. Reboot the system to recover this GPU", exit_code=15),
     f"the GPU is lost: reboot the rig, then check the Xids (rigbook status): {SMI}: Unable to "
     "determine the device handle for GPU 0000:02:00.0: GPU is lost. Reboot the system to "
     "recover this GPU"),
    (GpuProbe(smi=SMI, error="Failed to initialize NVML: Driver/library version mismatch",
              exit_code=18),
     f"the driver was upgraded without a reboot: reboot the rig: {SMI}: Failed to initialize "
     "NVML: Driver/library version mismatch"),
])
def test_no_gpus_yet_is_a_noop_that_says_so(probe, why):
    for op in (power_unit, live_power_caps):
        commands, host = power_op(op, dual_3090(), unit_facts(probe))
        assert commands == []
        assert host.noops == [
            f"no GPUs visible yet ({why}): power cap not applied; run again after the reboot"
        ]


def test_live_op_sets_only_the_gpus_that_differ_then_reads_back():
    gpus = (rtx3090(0, UUID0, 290.0), rtx3090(1, UUID1, 350.0))
    commands, _ = power_op(live_power_caps, dual_3090(), unit_facts(probe_of(gpus)))
    assert [describe(c) for c in commands] == [
        "call _set_cap", "call _read_back",
    ]
    assert commands[0].args[1].uuid == UUID1 and commands[0].args[1].watts_arg == "290"


def test_live_op_is_a_noop_when_the_caps_are_in_place():
    gpus = (rtx3090(0, UUID0, 290.0), rtx3090(1, UUID1, 290.2))
    commands, host = power_op(live_power_caps, dual_3090(), unit_facts(probe_of(gpus)))
    assert commands == []
    assert host.noops == ["power caps are already GPU 0 290 W, GPU 1 290 W"]


def test_live_op_refuses_before_setting_anything():
    rig = dual_3090(power_cap_watts=500)
    commands, _ = power_op(live_power_caps, rig, unit_facts(probe_of(DUAL)))
    assert [describe(c) for c in commands] == ["call _refuse"]


def test_read_back_fails_loudly_when_a_card_did_not_take_its_cap():
    commands, _ = power_op(live_power_caps, dual_3090(), unit_facts(probe_of(DUAL)))
    read_back = commands[-1]
    took = FakeHost({"NvidiaGpus": probe_of((rtx3090(0, UUID0, 290), rtx3090(1, UUID1, 290)))})
    assert read_back.function(None, took, *read_back.args) is True
    stuck = FakeHost({"NvidiaGpus": probe_of((rtx3090(0, UUID0, 290), rtx3090(1, UUID1, 350)))})
    assert read_back.function(None, stuck, *read_back.args) is False
    assert f"GPU 1 ({UUID1}): asked 290 W, the card's power.limit reads 350 W" in stuck.logged[0]


def test_read_back_records_the_real_old_and_new_values():
    from rigbook.roles.power import _ROWS, recorded_rows

    _ROWS.clear()
    commands, _ = power_op(live_power_caps, dual_3090(power_cap_watts=300),
                         unit_facts(probe_of((rtx3090(0, UUID0, 290), rtx3090(1, UUID1, 300)))))
    host = FakeHost({"NvidiaGpus": probe_of((rtx3090(0, UUID0, 300), rtx3090(1, UUID1, 300)))})
    assert commands[-1].function(None, host, *commands[-1].args) is True
    assert recorded_rows() == [
        CapRow("rig1", f"0 {UUID0}", 290.0, 300.0, "set"),
        CapRow("rig1", f"1 {UUID1}", 300.0, 300.0, "unchanged"),
    ]
    _ROWS.clear()


def test_h200_fact_output_plans_a_cap_by_uuid_and_a_noop_at_stock():
    probe = probe_of(parse_query_csv(H200_FACT_CSV.read_text()), smi=H200_SMI)
    (gpu,) = probe.gpus
    commands, _ = power_op(live_power_caps, h200_rig(power_cap_watts=500), unit_facts(probe))
    assert [describe(c) for c in commands] == [
        "call _set_cap", "call _read_back",
    ]
    commands, host = power_op(live_power_caps, h200_rig(power_profile="stock"), unit_facts(probe))
    assert commands == [] and host.noops == ["power caps are already GPU 0 700 W"]
    commands, _ = power_op(power_unit, h200_rig(power_cap_watts=500), unit_facts(probe))
    assert f"ExecStart=-{H200_SMI} -i {gpu.uuid} -pl 500\n" in commands[0].src.getvalue()


def test_wsl2_writes_no_unit_and_changes_no_cap_but_reports_them():
    rig = Rig(platform="wsl2", gpu_class="rtx3090", gpu_count=1, power_profile="prefill")
    probe = probe_of([rtx3090(0, UUID0)], smi="/usr/lib/wsl/lib/nvidia-smi")
    commands, host = power_op(power_unit, rig, unit_facts(probe))
    assert commands == [] and "set the cap on the Windows host" in host.noops[0]
    commands, host = power_op(live_power_caps, rig, unit_facts(probe))
    assert commands == []
    (report,) = host.noops
    assert "caps are set on the Windows host" in report
    assert f"GPU 0 ({UUID0}) 350 W (range 100-400 W)" in report
    assert f"nvidia-smi -i {UUID0} -pl 250" in report


def test_cap_table_shows_rig_gpu_old_and_new():
    console = Console(width=200, record=True)
    console.print(cap_table([CapRow("rig1", f"0 {UUID0}", 290.0, 300.0, "set")]))
    text = console.export_text()
    assert "rig1" in text and UUID0 in text and "290 W" in text and "300 W" in text


def test_gpucap_formats_watts():
    cap = GpuCap(0, UUID0, "x", 350.5, "s", 350.0, 100.0, 400.0)
    assert (cap.watts_arg, cap.range, cap.in_place) == ("350.5", "100-400 W", True)


class _Output:
    def __init__(self, text: str):
        self.stdout_lines, self.stderr_lines = text.splitlines(), []


@pytest.mark.parametrize("name, ok, kind", [
    ("pl/permission-container.txt", False, "permission"),
    ("pl/out-of-range-h100-700w.txt", False, "out-of-range"),
    ("pl/not-supported-rtx4080-mobile.txt", True, "not-supported"),
])
def test_a_refused_cap_says_what_nvidia_smi_said_and_what_to_do(name, ok, kind):
    """Real -pl messages (tests/fixtures/real/pl): the laptop's exits 0 and still failed."""
    text = (ROOT / "tests" / "fixtures" / "real" / name).read_text()
    host = FakeHost({})
    host.run_shell_command = lambda command: (ok, _Output(text))
    cap = desired_caps(dual_3090(), "rig1", DUAL)[0]
    assert _set_cap(None, host, SMI, cap) is False
    said = text.strip().splitlines()[0].strip()
    assert host.logged == [f"{cap.label}: {SMI} -pl 290 failed ({said}): {SMI_ADVICE[kind]}"]
