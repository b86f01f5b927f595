"""normfold.bench, benchmarks/bench_e2e.py and benchmarks/gpu_e2e.sh: the statistics, the decode workload,
the result files, and that the scripts run end to end (timings themselves are never asserted)."""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from normfold import ops
from normfold.bench import QUICK, BenchConfig, add_commands, bench_model, ratio_ci, write_results

REPO = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")


def _tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                     attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).eval()


# ------------------------------------------------------------------------------ statistics

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


@pytest.mark.parametrize("kwargs, match", [
    ({"batches": ()}, "batches"), ({"seqs": (0,)}, "seqs"), ({"rounds": 0}, "rounds"),
    ({"confidence": 1.0}, "confidence"), ({"warmup": -1}, "warmup"), ({"min_rounds": 0}, "min_rounds"),
    ({"shape_budget_s": 0.0}, "shape_budget_s"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BenchConfig(**kwargs)


def _row_with(fused_ci, control_ci=None):
    from normfold.bench import BenchRow

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
    from normfold.bench import verdict

    assert verdict(_row_with(fused_ci, control_ci)) == expected


def test_unequal_timings_are_refused():
    with pytest.raises(ValueError, match="same non-zero number"):
        ratio_ci([1.0, 2.0], [1.0], resamples=10, confidence=0.9)


# ------------------------------------------------------------------------------ the measurement

@pytest.fixture(scope="module")
def quick_rows():
    return bench_model(_tiny_gpt2(), replace(QUICK, rounds=3), name="tiny")


def test_quick_run_measures_decode_and_prefill_for_every_contender(quick_rows):
    assert [(r.kind, r.batch, r.seq) for r in quick_rows] == [("decode", 1, 1), ("prefill", 1, 16)]
    for row in quick_rows:
        assert set(row.median_ms) == {"original", "control", "folded", "fused"}
        assert all(v > 0 for v in row.median_ms.values())
        for c in ("control", "folded", "fused"):
            low, high = row.ratio_ci[c]
            assert low <= row.ratio[c] <= high
        assert all(0 < share <= 1 for share in row.norm_share.values())


def test_decode_step_reuses_a_cache_cropped_back_to_the_prefill():
    from normfold.bench import _decode_call

    model = _tiny_gpt2()
    config = replace(QUICK, prefill=6)
    call, reset = _decode_call(model, 2, config)(model)
    with torch.no_grad():
        for _ in range(3):
            out = call()
            assert out.cache.get_seq_length() == 7  # the prefill plus the timed token
            reset()
            assert out.cache.get_seq_length() == 6


def test_only_adds_shaped_like_a_norms_input_count_as_residual_adds():
    from torch.profiler import profile

    from normfold.bench import _is_residual_add, _norm_rows

    norm_rows = {(2 * 3 * 16, 16)}  # a norm saw (2, 3, 16)
    h, r, wide = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(2, 3, 32)
    scores, mask = torch.randn(2, 4, 16, 16), torch.randn(2, 1, 16, 16)  # T = hidden size = 16
    with profile(record_shapes=True) as prof:
        h + r                                  # a residual add: counted
        h.view(6, 16) + r.view(6, 16)          # the same rows flattened (OPT): counted
        torch.randn(1, 3, 16) + h              # broadcast to a norm input's shape (embeddings + positions)
        wide + wide                            # an activation's add at another width: not counted
        h + 1.0                                # a scalar add: not counted
        scores + mask                          # attention scores plus mask, last dim = width: not counted
    adds = [e for e in prof.events() if e.name == "aten::add"]
    assert [_is_residual_add(e, norm_rows) for e in adds] == [True, True, True, False, False, False]

    from normfold.bench import _NORM_LABEL, _label_norms

    model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32))
    with _label_norms([model]), profile(record_shapes=True) as prof:
        model(h)
    assert _norm_rows(e for e in prof.events() if e.name == _NORM_LABEL) == norm_rows


class _SlowWrapperLayerNorm(torch.nn.LayerNorm):
    """Python time around the op: the label's span holds it, the op time must not."""

    def forward(self, x):
        import time

        time.sleep(0.005)
        return super().forward(x)


def test_norm_time_is_the_ops_a_norm_runs_not_the_span_around_them():
    from normfold.bench import _label_norms, _medians, _profiled_forwards

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), _SlowWrapperLayerNorm(16)).eval()
    x = torch.randn(4, 16)
    with _label_norms([model]):
        share, norm_ms = _medians(_profiled_forwards(lambda: model(x), lambda: None, iters=3))
    assert 0 < norm_ms < 1.0  # aten::layer_norm on (4, 16) takes microseconds, the sleep 5 ms
    assert share < 0.2


def test_fused_layer_norm_calls_that_bypass_the_module_are_counted():
    from normfold import ops
    from normfold.bench import _label_norms, _medians, _profiled_forwards

    norm = torch.nn.LayerNorm(16)
    h, r = torch.randn(64, 16), torch.randn(64, 16)
    plain = ops.layer_norm
    with _label_norms([torch.nn.Sequential(norm)]):
        _, norm_ms = _medians(_profiled_forwards(lambda: ops.layer_norm(h, norm.weight, norm.bias, residual=r),
                                                 lambda: None, iters=3))
    assert norm_ms > 0
    assert ops.layer_norm is plain  # the labelling wrapper is removed on exit


def test_profiling_alternates_the_contenders_round_by_round(monkeypatch):
    import normfold.bench as bench

    order = []

    def fake_profile(call, reset, iters):
        order.append(call)
        return [(0.5, 1.0)] * iters
    monkeypatch.setattr(bench, "_profiled_forwards", fake_profile)
    config = replace(QUICK, seqs=(16,), rounds=2, profile_iters=5, control=False)
    (row,) = bench_model(_tiny_gpt2(), config, name="tiny")
    contenders = set(order)
    assert len(contenders) == 3 and len(order) == 15  # original, folded, fused; 5 rounds of one forward each
    assert all(set(order[i:i + 3]) == contenders for i in range(0, 15, 3))
    assert order[0] != order[3]  # each round starts with another contender
    assert row.norm_ms == {"original": 1.0, "folded": 1.0, "fused": 1.0}


def test_slow_shapes_get_fewer_rounds_but_never_below_the_minimum():
    from normfold.bench import _time_interleaved

    calls = {"a": (lambda: None, lambda: None), "b": (lambda: sum(range(20000)), lambda: None)}
    fast = _time_interleaved(calls, replace(QUICK, rounds=12, min_rounds=2, shape_budget_s=60.0))
    assert all(len(t) == 12 for t in fast.values())
    slow = _time_interleaved(calls, replace(QUICK, rounds=12, min_rounds=3, shape_budget_s=1e-6))
    assert all(len(t) == 3 for t in slow.values())


def test_prefill_asks_for_last_position_logits_only():
    from normfold.bench import _plain_call
    from normfold.hf.io import example_inputs_for

    model = _tiny_gpt2()
    inputs = example_inputs_for(model, batch=2, seq=5)
    call, _ = _plain_call(inputs)(model)
    with torch.no_grad():
        assert call().logits.shape[:2] == (2, 1)


def test_only_models_that_generate_get_a_decode_workload():
    from normfold.bench import _cache_argument

    bert = transformers.BertModel(transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                          intermediate_size=64, vocab_size=100))
    assert _cache_argument(bert) is None  # its forward takes `cache` (cross-attention) but returns none
    assert _cache_argument(_tiny_gpt2()) == "cache"


def test_prefill_lengths_past_the_position_limit_are_measured_once():
    from normfold.bench import _workloads

    shapes = [(b, t, kind) for b, t, kind, _ in _workloads(_tiny_gpt2(), replace(QUICK, batches=(1, 2),
                                                                                 seqs=(1, 16, 64, 128, 1024)))]
    assert shapes == [(1, 1, "decode"), (1, 16, "prefill"), (1, 64, "prefill"),
                      (2, 1, "decode"), (2, 16, "prefill"), (2, 64, "prefill")]


def test_decode_prefill_is_clipped_one_short_of_the_position_limit():
    from normfold.bench import _decode_call

    model = _tiny_gpt2()  # 64 positions
    call, reset = _decode_call(model, 1, replace(QUICK, prefill=500))(model)
    with torch.no_grad():
        assert call().cache.get_seq_length() == 64
    reset()


def test_results_are_written_as_csv_markdown_and_png(quick_rows, tmp_path):
    paths = write_results(quick_rows, tmp_path / "e2e", command="pytest")
    assert [p.name for p in paths] == ["e2e.csv", "e2e.md", "e2e.png"]
    rows = list(csv.DictReader(open(paths[0])))
    assert len(rows) == 2 and float(rows[0]["fused_speedup"]) > 0
    text = paths[1].read_text()
    assert "command: `pytest`" in text and "fused C++ CPU kernel" in text


def test_csv_reads_back_into_the_rows_it_was_written_from(quick_rows, tmp_path):
    from normfold.bench import plot_rows, read_rows

    paths = write_results(quick_rows, tmp_path / "e2e", command="pytest", plot=False)
    back = read_rows(paths[0])
    assert [(r.model, r.batch, r.seq, r.kind) for r in back] == [(r.model, r.batch, r.seq, r.kind) for r in quick_rows]
    for got, want in zip(back, quick_rows):
        assert got.ratio == pytest.approx(want.ratio, abs=1e-4)
        assert got.ratio_ci.keys() == want.ratio_ci.keys() and got.norm_ms == pytest.approx(want.norm_ms, abs=1e-4)
    assert plot_rows(back, tmp_path / "again.png").stat().st_size > 0


def test_bench_command_runs_on_a_folder(tmp_path):
    model = _tiny_gpt2()
    model.save_pretrained(tmp_path / "model")
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", str(tmp_path / "model"), "--quick", "--rounds", "2", "--seq", "1",
                              "--no-profile", "--out", str(tmp_path / "out"), "--no-plot"])
    assert args.run(args) == 0
    assert (tmp_path / "out.csv").exists() and (tmp_path / "out.md").exists()


# ------------------------------------------------------------------------------ the scripts

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


def test_compiled_contenders_get_room_under_dynamos_recompile_limit():
    from normfold.bench import _room_for_every_contender

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    with _room_for_every_contender(4):
        assert getattr(config, name) >= 64  # 4 models share one forward's limit
    assert getattr(config, name) == before
