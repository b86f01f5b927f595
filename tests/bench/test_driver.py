"""normfold.bench.driver: a quick run measures every contender at every shape, profiles them round by round,
and gives compiled contenders room under Dynamo's recompile limit (timings themselves are never asserted)."""
from __future__ import annotations

from dataclasses import replace

import torch

from normfold.bench import driver
from normfold.bench.config import QUICK
from normfold.bench.driver import bench_model, room_for_every_contender


def test_quick_run_measures_decode_and_prefill_for_every_contender(quick_rows):
    assert [(r.kind, r.batch, r.seq) for r in quick_rows] == [("decode", 1, 1), ("prefill", 1, 16)]
    for row in quick_rows:
        assert set(row.median_ms) == {"original", "control", "folded", "fused"}
        assert all(v > 0 for v in row.median_ms.values())
        for c in ("control", "folded", "fused"):
            low, high = row.ratio_ci[c]
            assert low <= row.ratio[c] <= high
        assert all(0 < share <= 1 for share in row.norm_share.values())


def test_profiling_alternates_the_contenders_round_by_round(tiny_gpt2, monkeypatch):
    order = []

    def fake_profile(call, reset, iters):
        order.append(call)
        return [(0.5, 1.0)] * iters
    monkeypatch.setattr(driver, "profiled_forwards", fake_profile)
    config = replace(QUICK, seqs=(16,), rounds=2, profile_iters=5, control=False)
    (row,) = bench_model(tiny_gpt2(), config, name="tiny")
    contenders = set(order)
    assert len(contenders) == 3 and len(order) == 15  # original, folded, fused; 5 rounds of one forward each
    assert all(set(order[i:i + 3]) == contenders for i in range(0, 15, 3))
    assert order[0] != order[3]  # each round starts with another contender
    assert row.norm_ms == {"original": 1.0, "folded": 1.0, "fused": 1.0}


def test_compiled_contenders_get_room_under_dynamos_recompile_limit():
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    with room_for_every_contender(4):
        assert getattr(config, name) >= 64  # 4 models share one forward's limit
    assert getattr(config, name) == before
