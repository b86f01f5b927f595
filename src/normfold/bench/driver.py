"""``bench_model``: every contender at every shape, eager and optionally compiled, timed then profiled."""
from __future__ import annotations

import contextlib
import statistics

import torch
from torch import nn

from ..hf.inputs import example_inputs_for
from .config import BenchConfig
from .profiling import label_norms, median_share_and_ms, profiled_forwards
from .results import BenchRow
from .stats import median_and_iqr, ratio_ci
from .timing import rotated, time_interleaved
from .workloads import prepare_contenders, workloads


def bench_model(model: nn.Module, config: BenchConfig = BenchConfig(), *, name: str | None = None,
                contenders: dict[str, nn.Module] | None = None, progress=None) -> list[BenchRow]:
    """Measure original / folded / fused ``model`` at every shape of ``config`` (eager, and compiled if asked)."""
    if not isinstance(config, BenchConfig):
        raise TypeError(f"config must be a BenchConfig, got {type(config).__name__}")
    name = name or type(model).__name__
    if contenders is None:
        contenders, _ = prepare_contenders(model, example_inputs_for(model, batch=2, seq=8, seed=config.seed),
                                           control=config.control)
    modes = [("eager", contenders)]
    if config.compile:
        modes.append(("compile", {k: torch.compile(m) for k, m in contenders.items()}))
    rows = []
    with room_for_every_contender(len(contenders)):
        for mode, models in modes:
            rows += _bench_mode(name, mode, models, contenders["original"], config, progress)
    return rows


@contextlib.contextmanager
def room_for_every_contender(count: int):
    """Raise Dynamo's per-function recompile limit while the compiled contenders run.

    The contenders share their classes' forward code, so each one's graphs (prefill, decode, every
    batch) count against one limit (8): with four models the last one compiled would hit it and
    silently run eagerly, which measured as a 2.3× "slowdown" of folded+fused.
    """
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(**{name: max(getattr(config, name), 16 * count)}):
        yield


def _bench_mode(name, mode, models, original, config, progress) -> list[BenchRow]:
    """One row per workload of ``original`` for ``models`` run in ``mode`` ("eager" or "compile")."""
    rows = []
    for batch, seq, kind, make in workloads(original, config):
        if progress:
            progress(f"{name} {mode} batch {batch} {kind} {seq}")
        calls = {k: make(m) for k, m in models.items()}
        times = time_interleaved(calls, config)
        row = BenchRow(name, mode, batch, seq, kind)
        for c, ts in times.items():
            median, (q1, q3) = median_and_iqr(ts)
            row.median_ms[c], row.iqr_ms[c] = median * 1e3, (q1 * 1e3, q3 * 1e3)
            if c != "original":
                point, low, high = ratio_ci(times["original"], ts, resamples=config.bootstrap,
                                            confidence=config.confidence, seed=config.seed)
                row.ratio[c], row.ratio_ci[c] = point, (low, high)
        if config.profile and mode == "eager":
            profiled = [c for c in calls if c != "control"]  # the original's copy: same numbers
            # a quarter of the shape's budget at most, but 5 forwards for a median (3 proved erratic
            # at shapes whose ops run at DRAM bandwidth)
            slowest = max(statistics.median(times[c]) for c in profiled)
            iters = max(5, min(config.profile_iters, int(config.shape_budget_s / 4 / len(calls) / max(slowest, 1e-9))))
            samples: dict[str, list] = {c: [] for c in profiled}
            with label_norms(models.values()):
                for r in range(iters):  # one profiled forward per contender per round, rotating, like the timing
                    for c in rotated(profiled, r):
                        samples[c] += profiled_forwards(*calls[c], 1)
            for c, forwards in samples.items():
                row.norm_share[c], row.norm_ms[c] = median_share_and_ms(forwards)
        rows.append(row)
    return rows
