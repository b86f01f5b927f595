"""The cosine bar an approximate result is held to (``min_cosine``): what a valid one is, defined once.

A bar is a real number in (0, 1]: not a bool (which Python counts as an int), not NaN or ±inf.
Every place that takes one checks it here: ``ApproximateConfig``, ``lab.approximate_fold``, a
folder's recipe (``hf.recipe``), ``hf.judge`` and the command line, each naming the bar its own way.
"""
from __future__ import annotations

import math

DEFAULT_MIN_COSINE = 0.999  # the bar approximate results are fitted to, and judged by, when nobody gives one


def is_cosine_bar(value: object) -> bool:
    """``value`` is a valid cosine bar: a finite real number (not a bool) with 0 < value ≤ 1."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and 0.0 < value <= 1.0


def check_cosine_bar(value: object, name: str = "min_cosine", error: type[ValueError] = ValueError) -> float:
    """``value`` as a float, or ``error`` (a ValueError type) saying that ``name`` must be a number in (0, 1]."""
    if not is_cosine_bar(value):
        raise error(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


__all__ = ["DEFAULT_MIN_COSINE", "check_cosine_bar", "is_cosine_bar"]
