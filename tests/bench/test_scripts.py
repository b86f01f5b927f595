"""benchmarks/bench_e2e.py, gpu_e2e.sh, gpu_train.sh and gpu_overhead.sh run end to end (timings themselves are never asserted)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from normfold import ops

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")


def _run(cmd, tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_bench_e2e_quick_runs_end_to_end(tmp_path):
    _run([sys.executable, "benchmarks/bench_e2e.py", "--quick", "--models", "gpt2", "vit", "--out",
          str(tmp_path / "e2e_quick"), "--no-plot"], tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "e2e_quick.csv")))
    assert {(r["model"], r["kind"]) for r in rows} == {("gpt2", "decode"), ("gpt2", "prefill"), ("vit", "image")}
    ops_table = (tmp_path / "e2e_quick_ops.md").read_text()
    assert "| (1, 768) |" in ops_table
    assert ("fused_sum_cached_us" in ops_table) == ops.cpu_kernel_available()


def test_gpu_e2e_dry_run_times_every_contender_and_writes_tables(tmp_path):
    done = _run(["bash", "benchmarks/gpu_e2e.sh", "--dry-run", "--models", "gpt2"], tmp_path)
    assert "gpu_e2e: wrote" in done.stdout
    rows = list(csv.DictReader(open(tmp_path / "gpu_e2e.csv")))
    assert {r["mode"] for r in rows} == {"eager", "compile", "compile+cuda graphs"}
    assert all(r["fused_speedup"] and not r["failures"] for r in rows)
    assert "cuda graph: needs a CUDA device" in (tmp_path / "gpu_e2e.md").read_text()


def test_gpu_train_dry_run_trains_every_variant_on_the_triton_kernels(tmp_path):
    pytest.importorskip("triton")
    done = _run(["bash", "benchmarks/gpu_train.sh", "--dry-run"], tmp_path)
    calls = int(done.stdout.split("dry run done, ")[1].split()[0])
    assert calls > 0  # the norms ran on the Triton backend (interpreted), as CUDA tensors would
    rows = list(csv.DictReader(open(tmp_path / "norm_comparison_quick_width_cpu.csv")))
    assert {r["variant"] for r in rows} == {"layernorm", "rmsnorm_torch", "rmsnorm", "cbwc_rmsnorm"}
    assert {(r["width"], r["batch_size"]) for r in rows} == {("64", "8"), ("64", "2")}
    assert all(r["diverged"] == "False" and float(r["cpu_s"]) > 0 for r in rows)


def test_gpu_overhead_dry_run_answers_every_question(tmp_path):
    done = _run(["bash", "benchmarks/gpu_overhead.sh", "--dry-run"], tmp_path)
    assert "gpu_overhead: wrote" in done.stdout
    report = (tmp_path / "gpu_overhead.md").read_text()
    assert "failed:" not in report
    for section in ("## Host cost per call", "## cProfile", "## fwd+bwd kernels", "## CUDA graph capture",
                    "## torch.compile"):
        assert section in report
    compiled = report.split("## torch.compile")[1]
    assert all(f"| {name} | 1 | 0 |" in compiled for name in ("original", "folded", "fused"))  # one graph, no break


def test_gpu_e2e_budget_flag_skips_and_lists_what_does_not_fit(tmp_path):
    _run(["bash", "benchmarks/gpu_e2e.sh", "--dry-run", "--models", "gpt2", "--budget-s", "0"], tmp_path)
    assert "over the 0 s budget" in (tmp_path / "gpu_e2e.md").read_text()
