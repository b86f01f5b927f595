"""normfold.bench.profiling: what counts as norm and residual-add time in the profiler pass."""
from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch.profiler import profile

from normfold import ops
from normfold.bench.profiling import (NORM_LABEL, is_residual_add, label_norms, median_share_and_ms,
                                     normalized_rows, profiled_forwards)


def test_only_adds_shaped_like_a_norms_input_count_as_residual_adds():
    seen_rows = {(2 * 3 * 16, 16)}  # a norm saw (2, 3, 16)
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
    assert [is_residual_add(e, seen_rows) for e in adds] == [True, True, True, False, False, False]

    model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32))
    with label_norms([model]), profile(record_shapes=True) as prof:
        model(h)
    assert normalized_rows(e for e in prof.events() if e.name == NORM_LABEL) == seen_rows


class _SlowWrapperLayerNorm(torch.nn.LayerNorm):
    """Python time around the op: the label's span holds it, the op time must not."""

    def forward(self, x):
        import time

        time.sleep(0.005)
        return super().forward(x)


def test_norm_time_is_the_ops_a_norm_runs_not_the_span_around_them():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), _SlowWrapperLayerNorm(16)).eval()
    x = torch.randn(4, 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a loaded machine OpenMP's barriers alone took 14-29 ms a layer_norm call
    try:
        with label_norms([model]):
            share, norm_ms = median_share_and_ms(profiled_forwards(lambda: model(x), lambda: None, iters=3))
    finally:
        torch.set_num_threads(threads)
    assert 0 < norm_ms < 1.0  # aten::layer_norm on (4, 16) takes microseconds, the sleep 5 ms
    assert share < 0.2


def test_fused_layer_norm_calls_that_bypass_the_module_are_counted():
    norm = torch.nn.LayerNorm(16)
    h, r = torch.randn(64, 16), torch.randn(64, 16)
    plain = ops.layer_norm
    with label_norms([torch.nn.Sequential(norm)]):
        fused_call = lambda: ops.layer_norm(h, norm.weight, norm.bias, residual=r)  # noqa: E731
        forwards = profiled_forwards(fused_call, lambda: None, iters=3)
        _, norm_ms = median_share_and_ms(forwards)
    assert norm_ms > 0
    assert ops.layer_norm is plain  # the labelling wrapper is removed on exit


_PROFILE_TWICE = """
import torch
from normfold.bench.profiling import profiled_forwards
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).eval()
for _ in range(2):
    profiled_forwards(lambda: model(torch.randn(2, 8)), lambda: None, iters=2)
print("profiled")
"""


def _profile_in_a_fresh_process(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"} | env_extra
    return subprocess.run([sys.executable, "-c", _PROFILE_TWICE], capture_output=True, text=True, env=env,
                          timeout=120, check=True)


def test_the_profiler_pass_prints_nothing_on_stderr():
    # kineto prints a 'profiler_start' / 'profiler_stop' pair a profile (~60 lines in bench --quick)
    run = _profile_in_a_fresh_process({})
    assert run.stdout.strip() == "profiled" and "profiler_st" not in run.stderr, run.stderr


def test_a_kineto_log_level_the_user_set_is_respected():
    run = _profile_in_a_fresh_process({"KINETO_LOG_LEVEL": "0"})
    assert "profiler_start" in run.stderr  # they asked for kineto's logs: they get them
