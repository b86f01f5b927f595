"""What a benchmark run measures (``BenchConfig``), checked when it is made, and the few-seconds ``QUICK`` run."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; every default says why."""

    batches: tuple[int, ...] = (1, 8)          # batch 1 is where norms matter most, 8 a small server batch
    seqs: tuple[int, ...] = (1, 128, 1024)     # 1 = a decode step with KV cache; 128 / 1024 = prefill
    prefill: int = 128                         # tokens in the cache before a timed decode step
    rounds: int = 30                           # interleaved rounds; each contender runs once per round
    shape_budget_s: float = 60.0               # timing seconds per shape at most: slow shapes (seq 1024,
                                               # batch 8) get fewer rounds, so a full grid fits in an hour
    min_rounds: int = 8                        # ... but never fewer than this (a CI needs several pairs)
    warmup: int = 3                            # untimed calls per contender and shape (caches, allocator, compile)
    min_round_s: float = 0.0                   # repeat a call inside one timing until this long (tiny models)
    compile: bool = False                      # also torch.compile every contender (default inductor backend)
    control: bool = True                       # time a deep copy of the original too (A/A): same math, its
                                               # own memory; its ratio shows this run's noise, which the
                                               # bootstrap CI (sampling noise only) does not
    profile: bool = True                       # torch.profiler pass for the norm + add share
    profile_iters: int = 9                     # profiled forwards per contender and shape (median taken)
    bootstrap: int = 2000                      # resamples for the ratio's confidence interval
    confidence: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batches", "seqs"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be positive ints, got {values!r}")
        for name in ("rounds", "min_rounds", "prefill", "bootstrap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shape_budget_s <= 0:
            raise ValueError(f"shape_budget_s must be > 0, got {self.shape_budget_s}")
        if self.warmup < 0 or self.profile_iters < 1:
            raise ValueError(f"warmup must be >= 0 and profile_iters >= 1, got {self.warmup}, {self.profile_iters}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")


QUICK = BenchConfig(batches=(1,), seqs=(1, 16), prefill=8, rounds=5, warmup=1, bootstrap=200, profile_iters=2)
