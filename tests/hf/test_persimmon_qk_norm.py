"""Persimmon's QK-norm after its fused ``query_key_value`` projection: the per-head q and k LayerNorms
fold by centering only the q and k rows of the fused weight (``CenterGroupsStep``), in memory and in
a streamed checkpoint fold, which runs the same plan step shard by shard."""
from __future__ import annotations

import pytest
import torch

import normfold
from normfold.engine.plan import CenterGroupsStep
from normfold.hf import example_inputs_for, fold_folder
from normfold.hf.streaming import fold_checkpoint

from tiny_models import nontrivial_layer_norms

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

HEADS, HEAD_DIM = 4, 8


def _persimmon(head: bool = False):
    config = transformers.PersimmonConfig(vocab_size=96, hidden_size=HEADS * HEAD_DIM, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=HEADS, max_position_embeddings=32,
                                          qk_layernorm=True, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = (transformers.AutoModelForCausalLM if head else transformers.AutoModel).from_config(config).eval()
    return nontrivial_layer_norms(model)  # non-trivial γ/β so that the q/k norms' affine is exercised


def test_persimmon_qk_norms_fold_exactly_in_float64():
    model = _persimmon().double()
    folded, report = normfold.fold(model, {"input_ids": torch.randint(0, 96, (2, 7)), "use_cache": False})
    qk = [e for e in report.norms if e.path.endswith(("q_layernorm", "k_layernorm"))]
    assert len(qk) == 4 and all(e.foldable for e in qk), [(e.path, e.reason) for e in qk]
    q_and_k = tuple(h * 3 + s for h in range(HEADS) for s in (0, 1))
    assert {(s.fqn, s.groups) for s in report.plan.center_groups} == {
        (f"layers.{i}.self_attn.query_key_value.{p}", q_and_k) for i in range(2) for p in ("weight", "bias")}
    assert all(isinstance(s, CenterGroupsStep) and s.group == HEAD_DIM for s in report.plan.center_groups)
    assert report.verification.ok and report.verification.max_rel_error < 1e-12
    assert all(isinstance(folded.get_submodule(e.path), normfold.nn.RMSNorm) for e in qk)


def test_a_streamed_persimmon_fold_centers_the_qk_rows_as_the_in_memory_fold(tmp_path, assert_bitwise_same_weights):
    model = _persimmon(head=True)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="30KB", safe_serialization=True)
    report = fold_checkpoint(tmp_path / "sharded", tmp_path / "streamed")
    folded_qk = [n["path"] for n in report["norms"] if n["path"].endswith(("q_layernorm", "k_layernorm")) and n["foldable"]]
    assert len(folded_qk) == 4 and report["verification"]["ok"]
    fold_folder(tmp_path / "sharded", tmp_path / "in_memory")
    assert_bitwise_same_weights(transformers.AutoModelForCausalLM, tmp_path / "streamed", tmp_path / "in_memory")
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "streamed").eval()
    inputs = example_inputs_for(model)
    with torch.no_grad():
        a, b = model(**inputs).logits, folded(**inputs).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5
