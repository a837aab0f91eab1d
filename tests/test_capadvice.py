"""rigbook.roles.capadvice: the PSU against the caps plus the host, and a 3090 capped near 230 W,
with the hardware notes' own numbers (docs/power.md, Power supply and Caps that cost)."""

from __future__ import annotations

import pytest

from rigbook.core.checks import Facts
from rigbook.core.errors import RigbookError
from rigbook.core.spec import Rig, parse_rig
from rigbook.inventory import rig_problems, rig_warnings
from rigbook.rigside.gpus import Gpu, GpuProbe
from rigbook.roles.capadvice import cap_warnings, psu_findings, psu_inventory_problem


def dual(**data) -> Rig:
    return Rig.model_validate({"platform": "ubuntu", "gpu_class": "rtx3090", "gpu_count": 2,
                               **data})


def test_two_330_w_caps_need_the_notes_850_w_single_rail():
    """"combined power at 330W cap each = ~660W under heavy load — verify your PSU has at least
    850W single rail": 2 x 330 W + the host's 190 W is 850 W."""
    assert psu_inventory_problem(dual(power_cap_watts=330, psu_watts=850)) is None
    problem = psu_inventory_problem(dual(power_cap_watts=330, psu_watts=750))
    assert problem.startswith("2 GPU cap(s) of 330 + 330 W (from the host data) plus "
                              "psu_host_watts 190 W is 850 W, above psu_watts 750 W")
    assert "at least 850W single rail" in problem
    # the notes' "230W cap each = ~460W combined for thermally-constrained builds" fits 750 W
    assert psu_inventory_problem(dual(power_cap_watts=230, psu_watts=750)) is None
    # the sweet spot (air: 290 W) is what an unset cap gets; per-GPU caps count one by one
    assert psu_inventory_problem(dual(psu_watts=770)) == psu_inventory_problem(
        dual(power_caps={"0": 290, "1": 290}, psu_watts=770)) is None
    assert psu_inventory_problem(dual(psu_watts=769)) is not None
    assert psu_inventory_problem(dual(power_caps={"0": 330}, psu_watts=800)) is not None
    assert psu_inventory_problem(dual(power_cap_watts=330)) is None  # no PSU declared


def test_the_psu_refusal_comes_before_connecting_with_the_key():
    rig = dual(power_cap_watts=330, psu_watts=750)
    [line] = rig_problems(rig, "box")
    assert line.startswith("box: psu_watts: 2 GPU cap(s) of 330 + 330 W")


def test_stock_caps_are_added_from_the_cards_default_limits():
    """A stock rig's caps are the cards' own: the notes' water-cooled 3090 ran 388 W stock."""
    rig = dual(power_profile="stock", psu_watts=850)
    assert psu_inventory_problem(rig) is None  # not decidable before connecting
    cards = tuple(Gpu(index=i, uuid=f"GPU-{i}", name="NVIDIA GeForce RTX 3090",
                      bus_id=f"0:{i}:0.0", default_limit_w=388.0) for i in range(2))
    [finding] = psu_findings(rig, Facts(probe=GpuProbe(smi="nvidia-smi", gpus=cards)), "box")
    assert (finding.level, finding.key) == ("error", "psu_watts")
    assert "388 + 388 W (stock caps: the cards' default limits) plus psu_host_watts 190 W is " \
           "966 W, above psu_watts 850 W" in finding.reason
    bigger = dual(power_profile="stock", psu_watts=1000)
    assert psu_findings(bigger, Facts(probe=GpuProbe(smi="nvidia-smi", gpus=cards)), "b") == []


@pytest.mark.parametrize("value", [0, 199, 5001, "850", 850.5, True])
def test_a_psu_rating_no_supply_has_is_refused(value):
    with pytest.raises(RigbookError, match="psu_watts"):
        parse_rig("box", {"platform": "ubuntu", "gpu_class": "rtx3090", "gpu_count": 2,
                          "psu_watts": value})


def test_a_3090_capped_near_230_w_is_told_what_the_notes_measured():
    """"230W costs ~16% efficiency vs 290W (decode) and ~4% vs 250W (prefill)"; "230W costs
    ~34% TPS vs stock (25 vs 38 TPS)" on llama.cpp + a GDN model. Said before connecting."""
    (text,) = cap_warnings(dual(power_cap_watts=230))
    assert text.startswith("power_cap_watts 230 W on an RTX 3090: the hardware notes measured "
                           "230 W at ~16% less efficiency than 290 W (decode)")
    assert "~34% less throughput than stock on llama.cpp with a GDN model (25 vs 38 TPS)" in text
    (text,) = cap_warnings(dual(power_caps={"1": 225}))
    assert text.startswith("power_caps[1] 225 W on an RTX 3090")
    assert cap_warnings(dual(power_cap_watts=250)) == []  # the prefill sweet spot
    assert cap_warnings(dual()) == []
    a4090 = Rig(platform="ubuntu", gpu_class="rtx4090", gpu_count=1, power_cap_watts=230)
    assert cap_warnings(a4090) == []  # the notes' figures are a 3090's
    low = dual(power_cap_watts=230)
    assert rig_warnings(low, "box") == ["box: " + cap_warnings(low)[0]]
