"""Statistics the experiment reports share: 95% t-intervals over seeds, paired differences, and the
sentences a report prints, written from the numbers (never a fixed claim).

A comparison is *resolved* only when its interval excludes 0; otherwise the report says "not resolved".
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist
from typing import Hashable, Mapping, Sequence

# two-sided 95% quantiles of Student's t, t_{0.975, df}, df = 1..30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
CONFIDENCE = 0.95


def t_quantile(df: int) -> float:
    """t_{0.975, df}: a table up to 30, then the Cornish-Fisher expansion around z (error < 1e-4 there):
    t ≈ z + (z³ + z) / (4 df) + (5z⁵ + 16z³ + 3z) / (96 df²)."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be a positive int, got {df!r}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = NormalDist().inv_cdf(0.975)
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` runs with its 95% t-interval [low, high] (NaN bounds for n < 2)."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def resolved(self) -> bool:
        """The interval excludes 0 (a NaN interval never does)."""
        return self.low > 0 or self.high < 0

    def text(self, digits: int = 4, signed: bool = True) -> str:
        sign = "+" if signed else ""
        if self.n < 2:
            return f"{self.mean:{sign}.{digits}f} (n = {self.n}, no interval)"
        return f"{self.mean:{sign}.{digits}f} [{self.low:{sign}.{digits}f}, {self.high:{sign}.{digits}f}]"


def mean_ci(values: Sequence[float]) -> Interval:
    """Mean and 95% t-interval, mean ± t_{0.975, n-1} · s / √n, of finite values (NaN/None dropped)."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = statistics.fmean(kept)
    if len(kept) < 2:
        return Interval(mean, math.nan, math.nan, 1)
    half = t_quantile(len(kept) - 1) * statistics.stdev(kept) / math.sqrt(len(kept))
    return Interval(mean, mean - half, mean + half, len(kept))


def paired_differences(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> list[float]:
    """a[k] − b[k] over the keys (seeds) both have, in sorted key order; pairing cancels what the seed shares
    (initial weights, batches). ValueError when they share no key."""
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError(f"no common seeds to pair: {sorted(a)} vs {sorted(b)}")
    return [a[k] - b[k] for k in shared]


def paired_ci(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> Interval:
    """The 95% t-interval of the paired difference a − b over seeds."""
    return mean_ci(paired_differences(a, b))


def compare(name_a: str, name_b: str, diff: Interval, quantity: str, lower: str = "lower",
            higher: str = "higher", digits: int = 4) -> str:
    """One sentence on ``diff`` = a − b, from its interval: which is higher, or "not resolved"."""
    numbers = f"{quantity} {name_a} − {name_b} = {diff.text(digits)} (95% CI, {diff.n} paired seeds)"
    if diff.n < 2:
        return f"{numbers}: not resolved (fewer than 2 seeds)"
    if not diff.resolved:
        return f"{numbers}: not resolved (the interval contains 0)"
    return f"{numbers}: {name_a} {higher if diff.mean > 0 else lower} than {name_b}"


def between(middle: str, low_side: str, high_side: str, above_low: Interval, below_high: Interval) -> str:
    """Is ``middle`` between the other two? From ``above_low`` = middle − low_side and ``below_high`` =
    high_side − middle: "yes" when both intervals are above 0, "no" when either is below 0, otherwise
    "not resolved" (an interval contains 0)."""
    if above_low.resolved and below_high.resolved and above_low.mean > 0 and below_high.mean > 0:
        answer = "yes"
    elif (above_low.resolved and above_low.mean < 0) or (below_high.resolved and below_high.mean < 0):
        answer = "no"
    else:
        answer = "not resolved"
    return (f"is {middle} between {low_side} and {high_side}? {answer}: {middle} − {low_side} = "
            f"{above_low.text()}, {high_side} − {middle} = {below_high.text()} (95% CIs over "
            f"{min(above_low.n, below_high.n)} paired seeds)")
