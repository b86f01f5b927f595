"""Interleaved timing: every contender once per round, the order rotating, so load drifts hit all alike."""
from __future__ import annotations

import time

import torch

from .config import BenchConfig


def time_interleaved(calls: dict, config: BenchConfig) -> dict[str, list[float]]:
    """Seconds per call for every contender, measured round by round in rotating order."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        round_s = 0.0  # one call of every contender, from the last warm-up call
        for name in names:
            call, reset = calls[name]
            for _ in range(max(config.warmup, 1)):
                start = time.perf_counter()
                call()
                elapsed = time.perf_counter() - start
                reset()
            round_s += max(elapsed, config.min_round_s)
        rounds = min(config.rounds, max(config.min_rounds, int(config.shape_budget_s / max(round_s, 1e-9))))
        for r in range(rounds):
            for name in rotated(names, r):
                call, reset = calls[name]
                total, n = 0.0, 0
                while True:  # the reset (KV cache crop) stays outside the timed region
                    start = time.perf_counter()
                    call()
                    total += time.perf_counter() - start
                    reset()
                    n += 1
                    if total >= config.min_round_s:
                        break
                times[name].append(total / n)
    return times


def rotated(names: list[str], r: int) -> list[str]:
    """``names`` starting at position ``r`` (mod its length): round r's order, so no contender always goes first."""
    return names[r % len(names):] + names[:r % len(names)]
