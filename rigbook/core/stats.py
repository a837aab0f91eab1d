"""How far a mean of a series can be trusted: the power sweep's samples and verify's bench runs.

Power draw and token rates sampled every 0.5 s are not independent samples: a card's draw
wanders over seconds (the power-sweep runbook measured DC power with sd ~50 W and an
autocorrelation time ~16 s). A mean over N such samples is worth only about N x dt / tau
independent ones, so an interval that counts every sample as new is too narrow by sqrt(tau/dt).

Here tau is the integrated autocorrelation time, tau = dt x (1 + 2 sum_k rho(k)), estimated with
Sokal's automatic window (the sum stops at the first lag M >= 5 tau); the effective sample size
is n_eff = n x dt / tau. With the runbook's figures this gives its own numbers: over 10 minutes
n_eff = 600 / 16 = 37.5, the standard error of a mean 50 / sqrt(37.5) = 8.2 W, and the smallest
difference of two such means resolvable at 95 % 1.96 x sqrt(2) x 8.2 = 22.6 W (9.2 W over an
hour).

Plain Python (statistics, math): the sweep runs on an operator's machine where numpy is not a
dependency, and the series are short (a few hundred samples).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: Sokal's window constant: the autocorrelation sum stops at the first lag M >= C x tau(M).
SOKAL_C = 5.0
#: Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (above: the normal's).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z95 = 1.959964


def t95(dof: float) -> float:
    """The 95 % two-sided quantile of Student's t at `dof` (rounded down: the wider interval)."""
    if dof < 1:
        return _T95[0]
    return _T95[int(dof) - 1] if dof <= len(_T95) else Z95


def autocorrelation_time(xs: Sequence[float], dt: float) -> float:
    """Integrated autocorrelation time (s) of a series sampled every `dt` s; `dt` for a series
    without memory, a constant series or one too short to tell (fewer than 4 samples)."""
    n = len(xs)
    if n < 4:
        return dt
    mean = statistics.fmean(xs)
    centred = [x - mean for x in xs]
    var = sum(c * c for c in centred) / n
    if var <= 0:
        return dt
    tau = 1.0  # in samples
    for lag in range(1, n // 2):
        rho = sum(centred[i] * centred[i + lag] for i in range(n - lag)) / (n * var)
        tau += 2.0 * rho
        if lag >= SOKAL_C * tau:
            break
    return max(tau, 1.0) * dt


@dataclass(frozen=True)
class Estimate:
    """A mean with its 95 % interval, from a series sampled every `dt` s."""

    mean: float
    sd: float
    n: int
    tau_s: float
    n_eff: float
    half_width: float  # of the 95 % interval

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def se(self) -> float:
        return self.sd / math.sqrt(self.n_eff) if self.n_eff > 0 else math.inf


def estimate(xs: Sequence[float], dt: float) -> Estimate:
    """Mean and 95 % interval, the samples' autocorrelation counted (n_eff = n dt / tau)."""
    n = len(xs)
    if n == 0:
        raise ValueError("no samples")
    mean = statistics.fmean(xs)
    if n == 1:
        return Estimate(mean, 0.0, 1, dt, 1.0, math.inf)
    sd = statistics.stdev(xs)
    tau = autocorrelation_time(xs, dt)
    n_eff = max(min(n * dt / tau, float(n)), 1.0)
    half = t95(n_eff - 1) * sd / math.sqrt(n_eff) if n_eff > 1 else math.inf
    return Estimate(mean, sd, n, tau, n_eff, half)


def resolvable(sd: float, tau_s: float, seconds: float) -> float:
    """The smallest difference of two means over `seconds` each (same sd and tau) that a 95 %
    test tells apart: 1.96 x sqrt(2) x sd / sqrt(seconds / tau)."""
    n_eff = max(seconds / tau_s, 1.0)
    return Z95 * math.sqrt(2.0) * sd / math.sqrt(n_eff)


def ratio(tokens: Sequence[float], watts: Sequence[float], dt: float) -> Estimate:
    """tok/s per W as (mean rate) / (mean draw) over paired bins, with its 95 % interval by the
    delta method: the linearised series rate - R x watts carries both series' noise and their
    correlation, and its own autocorrelation sets n_eff."""
    if len(tokens) != len(watts) or not tokens:
        raise ValueError("a ratio needs paired, non-empty series")
    rate, draw = statistics.fmean(tokens), statistics.fmean(watts)
    if draw <= 0:
        raise ValueError("no draw")
    r = rate / draw
    linear = estimate([t - r * w for t, w in zip(tokens, watts, strict=True)], dt)
    half = linear.half_width / draw
    return Estimate(r, linear.sd / draw, linear.n, linear.tau_s, linear.n_eff, half)


def indistinguishable(best: Estimate, other: Estimate) -> bool:
    """Whether `other` cannot be told apart from `best` at 95 %: their difference lies within
    1.96 standard errors of the difference (Welch's, without its dof correction)."""
    se = math.hypot(best.se, other.se)
    return not math.isfinite(se) or abs(best.mean - other.mean) <= Z95 * se
