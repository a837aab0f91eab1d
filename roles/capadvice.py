"""What the caps a rig asks for cost: the power supply that must carry them, and a 3090 capped
near 230 W.

Hardware notes, "Power": "combined power at 330W cap each = ~660W under heavy load — verify
your PSU has at least 850W single rail", and "230W costs ~16% efficiency vs 290W (decode) ...
230W is a low-power / quiet cap, not an efficient one", ~34% of llama.cpp's throughput on a GDN
model (docs/power.md, Power supply and Caps that cost). A PSU that the caps and the host exceed
is refused: before connecting when the host data names every GPU's cap, else once nvidia-smi
gives the cards' default limits (a `stock` rig). The 230 W cost is said, never refused: it is
the notes' cap for a thermal or acoustic goal.
"""

from __future__ import annotations

from collections.abc import Iterable

from rigbook.core.checks import Check, Facts, Finding, error, warn
from rigbook.core.facts import GPUS_READ, usable
from rigbook.core.spec import Rig
from rigbook.rigside.gpus import Gpu

#: The notes' low cap on a 3090, and the band counted as "near" it.
LOW_3090_W = 230
LOW_3090_BAND_W = (220, 240)


def asked_caps(rig: Rig) -> list[float] | None:
    """Every GPU's cap from the host data alone, or None where one is the card's own default
    (stock) or a UUID-keyed cap cannot be placed without the rig."""
    default = rig.default_cap()
    by_index = {key: watts for key, watts in rig.power_caps.items() if key.isdigit()}
    by_uuid = [watts for key, watts in rig.power_caps.items() if not key.isdigit()]
    rest = rig.gpu_count - len(by_index) - len(by_uuid)
    if rest and default is None:
        return None
    return [*by_index.values(), *by_uuid, *([default] * rest)]


def psu_problem(rig: Rig, caps: Iterable[float], seen: str) -> str | None:
    """Why the PSU cannot carry these caps and the host (None: it can, or none is declared)."""
    caps = list(caps)
    if rig.psu_watts is None or not caps:
        return None
    need = sum(caps) + rig.psu_host_watts
    if need <= rig.psu_watts:
        return None
    return (f"{len(caps)} GPU cap(s) of {' + '.join(f'{w:g}' for w in caps)} W ({seen}) plus "
            f"psu_host_watts {rig.psu_host_watts} W is {need:g} W, above psu_watts "
            f"{rig.psu_watts} W: the hardware notes size 2 x 330 W at \"at least 850W single "
            "rail\"; lower the caps or fit a larger supply (docs/power.md, Power supply)")


def psu_inventory_problem(rig: Rig) -> str | None:
    """The PSU check the host data alone decides (before connecting)."""
    caps = asked_caps(rig)
    return psu_problem(rig, caps, "from the host data") if caps is not None else None


def cap_warnings(rig: Rig) -> list[str]:
    """A 3090 capped near 230 W: what the notes measured it to cost."""
    if rig.gpu_class != "rtx3090":
        return []
    asked = {"power_cap_watts": rig.power_cap_watts,
             **{f"power_caps[{gpu}]": watts for gpu, watts in rig.power_caps.items()}}
    low, high = LOW_3090_BAND_W
    near = [f"{key} {watts} W" for key, watts in asked.items()
            if watts is not None and low <= watts <= high]
    if not near:
        return []
    return [f"{', '.join(near)} on an RTX 3090: the hardware notes measured {LOW_3090_W} W at "
            "~16% less efficiency than 290 W (decode) and ~4% less than 250 W (prefill), and "
            "~34% less throughput than stock on llama.cpp with a GDN model (25 vs 38 TPS): a "
            "low-power / quiet cap, not an efficient one (docs/power.md, Caps that cost)"]


def _default_watts(gpu: Gpu) -> float | None:
    return gpu.default_limit_w or gpu.enforced_limit_w or gpu.power_limit_w


def psu_findings(rig: Rig, facts: Facts, rig_name: str) -> list[Finding]:
    """The PSU against the caps the power role will set, stock ones read from the cards."""
    from rigbook.roles.power import asked_cap  # power reads this module's neighbours

    if rig.psu_watts is None or asked_caps(rig) is not None:
        return []  # nothing declared, or decided before connecting
    if facts.missing("probe"):
        return facts.missing("probe")
    if not usable(facts.probe):
        return []
    caps = []
    for gpu in facts.probe.gpus:
        try:
            watts, _ = asked_cap(rig, gpu)
        except ValueError:
            return []  # the power check refuses the double naming
        watts = watts if watts is not None else _default_watts(gpu)
        if watts is None:
            return [warn("power", f"GPU {gpu.index} reports no default power limit: the PSU "
                                  "check cannot add it up", key="psu_watts")]
        caps.append(watts)
    problem = psu_problem(rig, caps, "stock caps: the cards' default limits")
    return [error("power", problem, key="psu_watts")] if problem else []


CHECKS = (Check("power supply", lambda rig, name: [GPUS_READ], psu_findings, gpus=True),)
