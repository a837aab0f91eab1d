"""The sweep's statistics against synthetic power traces whose true mean and autocorrelation are
known: AR(1) series x_t = mu + phi (x_{t-1} - mu) + e_t have the integrated autocorrelation time
dt (1 + phi) / (1 - phi) and the stationary sd sigma_e / sqrt(1 - phi^2). And once on a real
load: the meter's capture on the H200 host."""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from rigbook.core.stats import (
    autocorrelation_time,
    estimate,
    indistinguishable,
    ratio,
    resolvable,
    t95,
)
from rigbook.roles.sweepresult import evidence, samples_of
from tests.conftest import ROOT


def ar1(n: int, mean: float, sd: float, tau_s: float, dt: float, seed: int) -> list[float]:
    """n samples every dt s with stationary `sd` and integrated autocorrelation time `tau_s`."""
    g = tau_s / dt
    phi = (g - 1) / (g + 1)
    rng = random.Random(seed)
    noise = sd * math.sqrt(1 - phi * phi)
    x, out = mean + rng.gauss(0, sd), []
    for _ in range(n):
        x = mean + phi * (x - mean) + rng.gauss(0, noise)
        out.append(x)
    return out


def test_the_runbooks_figures_22_w_over_10_minutes_and_9_w_over_an_hour():
    assert resolvable(50, 16, 600) == pytest.approx(22.6, abs=0.2)
    assert resolvable(50, 16, 3600) == pytest.approx(9.2, abs=0.1)


def test_a_trace_like_the_runbooks_gives_its_tau_and_its_resolvable_difference():
    """sd 50 W, tau 16 s, 10 minutes at 0.5 s: tau measured within a factor of the truth (10
    minutes hold only ~37 independent stretches), and the resolvable difference near 22 W."""
    taus, widths = [], []
    for seed in range(6):
        trace = ar1(1200, 400, 50, 16, 0.5, seed)
        e = estimate(trace, 0.5)
        taus.append(e.tau_s)
        widths.append(resolvable(e.sd, e.tau_s, 600))
    median = sorted(taus)[len(taus) // 2]
    assert 9 < median < 24
    assert 14 < sorted(widths)[len(widths) // 2] < 30


def test_white_noise_has_tau_of_one_sample_and_a_classical_interval():
    trace = [random.Random(1).gauss(0, 1) for _ in range(10)]  # too short: dt
    assert autocorrelation_time(trace[:3], 0.5) == 0.5
    rng = random.Random(7)
    white = [rng.gauss(100, 10) for _ in range(2000)]
    e = estimate(white, 0.5)
    assert e.tau_s == pytest.approx(0.5, rel=0.3)
    assert e.half_width == pytest.approx(1.96 * 10 / math.sqrt(2000), rel=0.2)


def test_the_interval_covers_the_true_mean_about_95_percent_where_naive_ones_do_not():
    covered = naive = 0
    runs = 150
    for seed in range(runs):
        trace = ar1(400, 300, 40, 4.0, 0.5, seed)  # tau = 8 samples
        e = estimate(trace, 0.5)
        covered += e.low <= 300 <= e.high
        naive_half = 1.96 * e.sd / math.sqrt(e.n)
        naive += abs(e.mean - 300) <= naive_half
    assert covered / runs >= 0.85  # nominal 95 %; tau is itself estimated
    assert naive / runs < 0.7  # every sample counted as new: far too narrow


def test_constant_and_single_samples_are_handled():
    assert estimate([5.0] * 10, 0.5).half_width == 0
    one = estimate([5.0], 0.5)
    assert one.mean == 5 and math.isinf(one.half_width)
    with pytest.raises(ValueError):
        estimate([], 0.5)
    assert t95(0.5) == 12.706 and t95(10) == 2.228 and t95(1000) == pytest.approx(1.96, abs=0.01)


def test_ratio_interval_covers_the_true_tokens_per_watt():
    covered, runs = 0, 120
    for seed in range(runs):
        watts = ar1(300, 300, 30, 3.0, 0.5, seed)
        rng = random.Random(1000 + seed)
        tokens = [0.1 * w + rng.gauss(0, 2) for w in watts]  # true ratio 0.1
        e = ratio(tokens, watts, 0.5)
        covered += e.low <= 0.1 <= e.high
    assert covered / runs >= 0.85
    with pytest.raises(ValueError):
        ratio([1.0], [1.0, 2.0], 0.5)


def test_indistinguishable_caps_within_noise_and_distinct_ones_apart():
    a = estimate(ar1(200, 0.110, 0.01, 2, 0.5, 1), 0.5)
    b = estimate(ar1(200, 0.1095, 0.01, 2, 0.5, 2), 0.5)
    c = estimate(ar1(200, 0.080, 0.01, 2, 0.5, 3), 0.5)
    assert indistinguishable(a, b)
    assert not indistinguishable(a, c)


def test_the_meter_and_the_statistics_on_a_real_h200_load_at_its_own_cap():
    """tests/fixtures/nvidia-h200/meter: rigbook's meter (NVML) on the H200 host, idle 20 s,
    then 60 s of bf16 matmuls at the card's own 700 W cap (nothing was set; capture.sh)."""
    folder = ROOT / "tests" / "fixtures" / "nvidia-h200" / "meter"
    cap = float(re.search(r"Current Power Limit\s*:\s*([\d.]+) W",
                          (folder / "power-before.txt").read_text()).group(1))
    after = re.search(r"Current Power Limit\s*:\s*([\d.]+) W",
                      (folder / "power-after.txt").read_text()).group(1)
    assert cap == float(after) == 700.0  # the live cap, before and after: untouched

    def window(name: str):
        lines = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
        assert lines[0] == {"source": "nvml", "interval": 0.25}
        samples = samples_of(lines[1:])
        return samples, evidence(samples, samples[0].t, samples[-1].t, cap)

    idle, quiet = window("idle")
    load, busy = window("load")
    assert 0.24 <= busy.interval_s <= 0.26 and busy.samples == len(load) > 200
    assert quiet.mean_w < 0.2 * cap and "gpu_idle" in quiet.clock_reasons and not quiet.cap_bound
    assert "sw_power_cap" in busy.clock_reasons and busy.cap_bound  # the load meets the cap
    assert busy.p95_w <= cap * 1.01 and busy.median_w > 0.95 * cap
    assert busy.energy_source == "counter" and busy.other_processes  # the matmuls' own process
    draws = [s.total_w for s in load]
    found = estimate(draws, 0.25)
    # the samples are not independent: fewer effective ones, a wider interval than naive
    assert 1 < found.n_eff < len(draws) and found.tau_s > 0.25
    assert found.half_width > 1.96 * found.sd / math.sqrt(len(draws))
    assert busy.resolvable_w == pytest.approx(
        resolvable(found.sd, found.tau_s, busy.seconds), rel=0.01)
