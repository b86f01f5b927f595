"""normfold.bench.timing: interleaved rounds within the per-shape budget."""
from __future__ import annotations

from dataclasses import replace

from normfold.bench.config import QUICK
from normfold.bench.timing import time_interleaved


def test_slow_shapes_get_fewer_rounds_but_never_below_the_minimum():
    calls = {"a": (lambda: None, lambda: None), "b": (lambda: sum(range(20000)), lambda: None)}
    fast = time_interleaved(calls, replace(QUICK, rounds=12, min_rounds=2, shape_budget_s=60.0))
    assert all(len(t) == 12 for t in fast.values())
    slow = time_interleaved(calls, replace(QUICK, rounds=12, min_rounds=3, shape_budget_s=1e-6))
    assert all(len(t) == 3 for t in slow.values())
