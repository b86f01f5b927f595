"""Folders of models with norm variants and layer scales (issue 16 items 3 and 4): Nemotron's
LayerNorm1P comes back from ``normfold.from_pretrained`` as an RMSNorm with offset 1 (and stock
loading stays right), and the streaming fold's rewrite merges a layer scale as the in-memory fold does."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import normfold
from normfold.hf import fold_folder, load_model
from normfold.engine.plan import FoldPlan, LayerScaleStep
from normfold.engine.transform import apply_plan
from normfold.hf.streaming import Checkpoint
from normfold.hf.streaming.rewrite import CheckpointRewrite
from normfold.nn import RMSNorm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the zoo's randomiser, as tests/fuse does
from engine.conftest import _randomize_constant_parameters  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _randomised(model):
    _randomize_constant_parameters(model)  # γ, β, biases and layer scales start constant: a wrong fold would hide
    return model


def _save(model, folder, **kwargs):
    model.config._attn_implementation = "eager"
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def test_a_folded_nemotron_folder_reloads_its_offset_rms_norms(tmp_path):
    config = transformers.NemotronConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=64)
    torch.manual_seed(0)
    source = _save(_randomised(transformers.NemotronForCausalLM(config).eval()), tmp_path / "nemotron")
    report = fold_folder(source, tmp_path / "folded")  # before: the proof failed (γ swapped without its + 1)
    assert report["verification"]["ok"] and all(e.get("offset") == 1.0 for e in report["swapped"])
    original = load_model(source)
    fast = normfold.from_pretrained(tmp_path / "folded")
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folded").eval()
    assert sum(isinstance(m, RMSNorm) and m.offset == 1.0 for m in fast.modules()) == 5
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = original(input_ids=ids).logits
        for folded in (fast, stock):
            assert float((folded(input_ids=ids).logits - ref).abs().max() / ref.abs().max()) < 1e-5


def test_a_streaming_rewrite_merges_a_layer_scale_step_like_the_in_memory_fold(tiny_dirs):
    """The streaming fold replays ``plan.layer_scale`` per checkpoint key as ``apply_plan`` does (a
    sharded DINOv2 cannot be streamed yet: transformers 5 saves it under older key names)."""
    folder = tiny_dirs["opt"]
    model = load_model(folder)
    layer = "model.decoder.layers.0"
    step = LayerScaleStep(f"{layer}.final_layer_norm.weight", f"{layer}.fc2.weight", f"{layer}.fc2.bias")
    plan = FoldPlan(layer_scale=[step])  # a (hidden,) tensor standing in for γ: the math is what is checked
    rewrite = CheckpointRewrite(plan, model, Checkpoint(folder), out_dtype=None)
    streamed = {**rewrite.compute(step.weight_fqn), **rewrite.compute(step.scale_fqn)}
    expected = dict(apply_plan(copy.deepcopy(model), plan).named_parameters())
    for fqn in (step.weight_fqn, step.bias_fqn, step.scale_fqn):  # before: W, b untouched and γ kept
        assert torch.equal(streamed[fqn], expected[fqn]), fqn
    assert bool((streamed[step.scale_fqn] == 1).all())
