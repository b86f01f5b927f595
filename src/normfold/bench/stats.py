"""Statistics of interleaved timings: medians and quartiles, the bootstrap interval of a speed ratio, and
the verdict that compares a contender's interval with the A/A control's noise band."""
from __future__ import annotations

import statistics
from typing import Protocol

import torch


class _RatioIntervals(Protocol):
    """What a verdict reads of a result row (``results.BenchRow``, which imports this module)."""

    ratio_ci: dict[str, tuple[float, float]]


def verdict(row: _RatioIntervals, contender: str = "fused") -> str:
    """``faster`` / ``slower`` when the contender's CI clears the noise band, else ``within noise``.

    The band is the A/A control's CI widened to include 1 (just 1 without a control).
    """
    low, high = row.ratio_ci[contender]
    band_low, band_high = row.ratio_ci.get("control", (1.0, 1.0))
    band_low, band_high = min(band_low, 1.0), max(band_high, 1.0)
    if low > band_high:
        return "faster"
    if high < band_low:
        return "slower"
    return "within noise"


def median_and_iqr(times: list[float]) -> tuple[float, tuple[float, float]]:
    """``(median, (q1, q3))`` of one contender's timings (a single timing is its own quartiles)."""
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return statistics.median(times), (q[0], q[2])


def ratio_ci(base: list[float], other: list[float], *, resamples: int, confidence: float,
             seed: int = 0) -> tuple[float, float, float]:
    """median(base) / median(other) with a percentile bootstrap interval (rounds resampled in pairs)."""
    if len(base) != len(other) or not base:
        raise ValueError(f"need the same non-zero number of timings, got {len(base)} and {len(other)}")
    b, o = torch.tensor(base, dtype=torch.float64), torch.tensor(other, dtype=torch.float64)
    point = (b.median() / o.median()).item()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(base), (resamples, len(base)), generator=gen)
    ratios = b[idx].median(dim=1).values / o[idx].median(dim=1).values
    alpha = (1 - confidence) / 2
    low, high = torch.quantile(ratios, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return point, low, high
