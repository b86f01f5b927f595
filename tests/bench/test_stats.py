"""normfold.bench.stats: the speed ratio's bootstrap interval and the verdict against the noise band."""
from __future__ import annotations

import pytest
import torch

from normfold.bench.results import BenchRow
from normfold.bench.stats import ratio_ci, verdict


def test_ratio_of_identical_timings_is_one_with_an_interval_around_it():
    times = [1.0, 1.2, 0.9, 1.1, 1.05]
    point, low, high = ratio_ci(times, times, resamples=500, confidence=0.95)
    assert point == 1.0 and low <= 1.0 <= high


def test_ratio_is_base_over_other_and_a_constant_factor_has_a_point_interval():
    base = [2.0, 2.2, 2.4, 2.1]
    point, low, high = ratio_ci(base, [t / 2 for t in base], resamples=500, confidence=0.9)
    assert point == pytest.approx(2.0) and low == pytest.approx(2.0) and high == pytest.approx(2.0)


def test_interval_widens_with_noise():
    gen = torch.Generator().manual_seed(0)
    base = (1 + 0.01 * torch.randn(40, generator=gen)).tolist()
    noisy = (1 + 0.3 * torch.rand(40, generator=gen)).tolist()
    quiet = (1 + 0.01 * torch.rand(40, generator=gen)).tolist()
    _, ql, qh = ratio_ci(base, quiet, resamples=500, confidence=0.95)
    _, nl, nh = ratio_ci(base, noisy, resamples=500, confidence=0.95)
    assert nh - nl > qh - ql


def test_unequal_timings_are_refused():
    with pytest.raises(ValueError, match="same non-zero number"):
        ratio_ci([1.0, 2.0], [1.0], resamples=10, confidence=0.9)


def _row_with(fused_ci, control_ci=None):
    row = BenchRow("m", "eager", 1, 1, "decode")
    row.ratio_ci["fused"] = fused_ci
    if control_ci is not None:
        row.ratio_ci["control"] = control_ci
    return row


@pytest.mark.parametrize("fused_ci, control_ci, expected", [
    ((1.02, 1.05), (0.99, 1.01), "faster"),
    ((0.95, 0.98), (0.99, 1.01), "slower"),
    ((0.95, 0.98), (0.93, 1.02), "within noise"),   # the A/A copy moved as far: noise, not the fold
    ((1.02, 1.05), (1.00, 1.06), "within noise"),
    ((0.97, 1.03), None, "within noise"),
    ((1.01, 1.03), None, "faster"),                 # without a control the band is just 1
])
def test_verdict_compares_the_fused_interval_with_the_noise_band(fused_ci, control_ci, expected):
    assert verdict(_row_with(fused_ci, control_ci)) == expected
