"""The first range of a card class no source measured: 60-85 % of the card's default limit at
10 W (the hardware notes' advice for a new class), when sweep_watts is not given; a class the
notes swept takes its whole range."""

from __future__ import annotations

from dataclasses import replace

from rigbook.core.spec import parse_rig
from rigbook.roles.sweep import first_range, plan_caps
from tests.test_power import DUAL, UUID0, h200_gpus, rtx3090
from tests.test_sweep import BASE


def rig(gpu_class: str, **data):
    return parse_rig("rig1", {**BASE, "gpu_class": gpu_class, "power_profile": "stock", **data})


def test_a_measured_class_sweeps_the_whole_range_an_unmeasured_one_its_first_range():
    caps, why = plan_caps(rig("rtx3090"), DUAL)
    assert caps == tuple(float(c) for c in range(100, 401, 10))
    assert why == "the cards' whole range at 10 W"
    ti = tuple(replace(g, default_limit_w=450.0, max_limit_w=450.0) for g in DUAL)
    caps, why = plan_caps(rig("rtx3090ti"), ti)
    assert caps == tuple(float(c) for c in range(270, 381, 10))  # 60-85 % of 450 W
    assert why == ("no source measured gpu_class rtx3090ti: the first range is 60-85 % of the "
                   "card's default limit 450 W at 10 W (the hardware notes' advice for a new "
                   "card class); the whole range is sweep_watts=100:450:10")
    # sweep_watts always wins
    assert plan_caps(rig("rtx3090ti", sweep_watts="300,310"), ti) == ((300.0, 310.0),
                                                                       "sweep_watts")


def test_the_h200s_first_range_from_its_own_nvidia_smi():
    """The H200 capture (tests/fixtures/nvidia-h200/): default 700 W, range 200-700 W."""
    gpus = h200_gpus()
    assert {(g.default_limit_w, g.min_limit_w, g.max_limit_w) for g in gpus} == {
        (700.0, 200.0, 700.0)}
    assert first_range(gpus) == tuple(float(c) for c in range(420, 591, 10))
    h200 = parse_rig("h200", {"platform": "ubuntu", "gpu_class": "other", "gpu_count": 1,
                              "gpu_limits_watts": (200, 700), "power_profile": "stock"})
    assert plan_caps(h200, gpus)[0] == first_range(gpus)


def test_no_default_limit_or_a_share_outside_the_range_falls_back_to_the_whole_range():
    unknown = tuple(replace(g, default_limit_w=None) for g in DUAL)
    assert first_range(unknown) == ()
    assert plan_caps(rig("a5000"), unknown)[1] == "the cards' whole range at 10 W"
    narrow = (replace(rtx3090(0, UUID0), min_limit_w=320.0),)  # 60-85 % of 350 W: 210-290 W
    assert first_range(narrow) == ()
