"""normfold.bench.workloads: the decode step on a cropped KV cache, prefills, which models decode."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from normfold.bench.config import QUICK
from normfold.bench.workloads import cache_argument, decode_call, plain_call, workloads
from normfold.hf.inputs import example_inputs_for

transformers = pytest.importorskip("transformers")


def test_decode_step_reuses_a_cache_cropped_back_to_the_prefill(tiny_gpt2):
    model = tiny_gpt2()
    config = replace(QUICK, prefill=6)
    call, reset = decode_call(model, 2, config)(model)
    with torch.no_grad():
        for _ in range(3):
            out = call()
            assert out.cache.get_seq_length() == 7  # the prefill plus the timed token
            reset()
            assert out.cache.get_seq_length() == 6


def test_prefill_asks_for_last_position_logits_only(tiny_gpt2):
    model = tiny_gpt2()
    inputs = example_inputs_for(model, batch=2, seq=5)
    call, _ = plain_call(inputs)(model)
    with torch.no_grad():
        assert call().logits.shape[:2] == (2, 1)


def test_only_models_that_generate_get_a_decode_workload(tiny_gpt2):
    bert = transformers.BertModel(transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                          intermediate_size=64, vocab_size=100))
    assert cache_argument(bert) is None  # its forward takes `cache` (cross-attention) but returns none
    assert cache_argument(tiny_gpt2()) == "cache"


def test_prefill_lengths_past_the_position_limit_are_measured_once(tiny_gpt2):
    shapes = [(b, t, kind) for b, t, kind, _ in workloads(tiny_gpt2(), replace(QUICK, batches=(1, 2),
                                                                                 seqs=(1, 16, 64, 128, 1024)))]
    assert shapes == [(1, 1, "decode"), (1, 16, "prefill"), (1, 64, "prefill"),
                      (2, 1, "decode"), (2, 16, "prefill"), (2, 64, "prefill")]


def test_decode_prefill_is_clipped_one_short_of_the_position_limit(tiny_gpt2):
    model = tiny_gpt2()  # 64 positions
    call, reset = decode_call(model, 1, replace(QUICK, prefill=500))(model)
    with torch.no_grad():
        assert call().cache.get_seq_length() == 64
    reset()
