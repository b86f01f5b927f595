"""End-to-end speed: the original model against its folded and folded+fused versions, side by side.

    rows = bench_model(model, BenchConfig(batches=(1, 8), seqs=(1, 128)))
    normfold bench [MODEL_DIR] [--quick] [--compile] [--out STEM]

Contenders (``workloads.py``: original, an A/A control copy, folded, folded+fused) run interleaved in
one process, the order rotating every round, so that load drifts hit all of them alike
(``timing.py``). Each row reports per-contender medians with their interquartile range, and the speed
ratio original/contender (> 1 = faster) with a bootstrap confidence interval, judged against the
control's noise band (``stats.py``). A profiler pass measures the forward time spent in norms and
residual adds (``profiling.py``). ``driver.py`` runs the grid, ``results.py`` writes and reads the
CSV / markdown / PNG, ``single_op.py`` times one norm call; the ``normfold bench`` command is
``normfold/cli/bench.py``.
"""
from __future__ import annotations

from .config import QUICK, BenchConfig
from .driver import bench_model
from .results import CONTENDERS, BenchRow, cpu_model, plot_rows, read_rows, write_results
from .single_op import bench_ops
from .stats import ratio_ci, verdict
from .workloads import prepare_contenders

__all__ = ["BenchConfig", "QUICK", "BenchRow", "CONTENDERS", "bench_model", "bench_ops", "prepare_contenders",
           "ratio_ci", "verdict", "write_results", "read_rows", "plot_rows", "cpu_model"]
