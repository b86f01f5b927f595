"""The experiments' shared statistics: t-intervals, paired differences, and prose written from the numbers."""
from __future__ import annotations

import importlib
import math
import statistics
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture
def stats(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    return importlib.import_module("stats")


def test_t_quantiles_match_the_table_and_the_expansion_joins_it(stats):
    assert stats.t_quantile(1) == 12.706 and stats.t_quantile(4) == 2.776
    assert stats.t_quantile(31) == pytest.approx(2.0395, abs=2e-4)
    assert stats.t_quantile(1000) == pytest.approx(1.9623, abs=2e-4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive int"):
            stats.t_quantile(bad)


def test_mean_ci_is_the_t_interval_and_drops_non_finite_runs(stats):
    values = [1.0, 2.0, 4.0, float("nan"), None]
    ci = stats.mean_ci(values)
    half = 4.303 * statistics.stdev([1.0, 2.0, 4.0]) / math.sqrt(3)
    assert ci.n == 3 and ci.mean == pytest.approx(7 / 3)
    assert (ci.low, ci.high) == pytest.approx((7 / 3 - half, 7 / 3 + half))
    one = stats.mean_ci([5.0])
    assert one.n == 1 and math.isnan(one.low) and not one.resolved
    assert stats.mean_ci([]).n == 0


def test_paired_differences_pair_by_seed_and_refuse_disjoint_seeds(stats):
    a, b = {0: 1.0, 1: 2.0, 2: 3.0}, {2: 2.5, 0: 0.5, 9: 7.0}
    assert stats.paired_differences(a, b) == [0.5, 0.5]
    with pytest.raises(ValueError, match="no common seeds"):
        stats.paired_differences({0: 1.0}, {1: 1.0})


def test_compare_says_not_resolved_when_the_interval_contains_zero(stats):
    unresolved = stats.paired_ci({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.1, 1: 1.9, 2: 3.05})
    assert not unresolved.resolved
    assert "not resolved" in stats.compare("rms", "ln", unresolved, "val loss")
    higher = stats.paired_ci({0: 2.0, 1: 2.1, 2: 2.2}, {0: 1.0, 1: 1.0, 2: 1.1})
    text = stats.compare("rms", "ln", higher, "val loss")
    assert higher.resolved and "rms higher than ln" in text and "not resolved" not in text
    lower = stats.paired_ci({0: 0.0, 1: 0.1, 2: 0.0}, {0: 1.0, 1: 1.0, 2: 1.1})
    assert "rms lower than ln" in stats.compare("rms", "ln", lower, "val loss")


def test_between_answers_yes_no_or_not_resolved_from_the_intervals(stats):
    up = stats.mean_ci([0.1, 0.11, 0.12])
    down = stats.mean_ci([-0.1, -0.11, -0.12])
    around = stats.mean_ci([-0.1, 0.0, 0.1])
    assert "? yes:" in stats.between("cbwc", "ln", "rms", up, up)
    assert "? no:" in stats.between("cbwc", "ln", "rms", down, up)
    assert "? no:" in stats.between("cbwc", "ln", "rms", up, down)
    assert "? not resolved:" in stats.between("cbwc", "ln", "rms", up, around)
