"""Decoders exported with their KV cache (``export_onnx(..., kv_cache=True)``): optimum's input and output
names, proved on the prompt with an empty cache and on new tokens after it, and greedy generation in ONNX
Runtime (``generate_greedy_ort``) giving transformers' ``generate`` tokens; what must be refused is
refused before anything is written."""
from __future__ import annotations

import pytest
import torch

onnxruntime = pytest.importorskip("onnxruntime", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")
pytest.importorskip("onnxscript", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")
transformers = pytest.importorskip("transformers")

import normfold  # noqa: E402
from normfold.export import KV_CACHE_MODEL_TYPES, RMS_NODE_TYPES, export_onnx, generate_greedy_ort  # noqa: E402
from normfold.hf import default_model_path  # noqa: E402
from normfold.hf.inputs import example_inputs_for  # noqa: E402
from normfold.hf.load import load_model  # noqa: E402
from tiny_models import nontrivial_layer_norms, tiny_bloom_config, tiny_gpt2, tiny_gpt2_config  # noqa: E402

PROMPT = b"The meaning of life is"
NEW_TOKENS = 20


def _generate_pytorch(model, ids, mask, max_new_tokens):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)


def _generate_ort(model, path, ids, mask, max_new_tokens):
    session = onnxruntime.InferenceSession(str(path))
    config = model.generation_config
    return generate_greedy_ort(session, ids, max_new_tokens, attention_mask=mask, eos_token_id=config.eos_token_id,
                               pad_token_id=config.pad_token_id)


def test_bundled_decoder_folded_and_fused_generates_the_same_20_greedy_tokens_in_ort_as_pytorch(tmp_path):
    model = load_model(default_model_path())
    example = example_inputs_for(model)
    folded, fold_report = normfold.fold(model, example, fuse=True, stock_compatible=False)
    report = export_onnx(folded, example, tmp_path / "model.onnx", original=model,
                         original_path=tmp_path / "original.onnx", kv_cache=True)
    layers = model.config.n_layer
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    assert report.input_names == ["input_ids", "attention_mask", "position_ids", *past]  # optimum's names
    assert report.output_names == ["logits", *(n.replace("past_key_values", "present") for n in past)]
    assert report.dynamic_axes["past_key_values.0.key"] == {0: "batch", 2: "past_sequence"}
    assert report.dynamic_axes["attention_mask"] == {0: "batch", 1: "total_sequence"}
    # proved on both calls (the prompt with an empty cache, new tokens after it): logits and every present
    assert report.compared == 2 * (1 + 2 * layers) and report.error <= report.tolerance
    assert sum(report.node_counts[t] for t in RMS_NODE_TYPES) == fold_report.num_norms > 0
    assert report.node_counts["SkipSimplifiedLayerNormalization"] > 0  # fused adds kept fused with the cache

    ids = torch.tensor([list(PROMPT)])
    mask = torch.ones_like(ids)
    want = _generate_pytorch(model, ids, mask, NEW_TOKENS)
    assert want.shape == (1, len(PROMPT) + NEW_TOKENS)  # no early end: all 20 tokens are compared
    assert len(set(want[0, len(PROMPT):].tolist())) > 1  # not one token repeated
    for path in (tmp_path / "model.onnx", tmp_path / "original.onnx"):
        assert torch.equal(_generate_ort(model, path, ids, mask, NEW_TOKENS), want)


def _tiny(model_type: str):
    """A tiny random causal LM of ``model_type`` with random γ/β (so folding them is tested)."""
    configs = {
        "gpt2": lambda: tiny_gpt2(None, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0),
        "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
            num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2, vocab_size=64,
            max_position_embeddings=64, word_embed_proj_dim=32)),
        "bloom": lambda: transformers.BloomForCausalLM(tiny_bloom_config(vocab_size=64)),
    }
    torch.manual_seed(0)
    return nontrivial_layer_norms(configs[model_type]().eval())


@pytest.mark.parametrize("model_type", KV_CACHE_MODEL_TYPES)
def test_tiny_decoder_batch_of_two_left_padded_generates_the_same_greedy_tokens(tmp_path, model_type):
    model = _tiny(model_type)
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 1, 3, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])  # second row left-padded
    # the proof compares every position, padding too; transformers' BLOOM in float64 (the proof's reference)
    # gives NaN at a fully padded position, so BLOOM is proved on the unpadded rows (generation still pads)
    example = {"input_ids": ids, "attention_mask": mask if model_type != "bloom" else torch.ones_like(mask),
               "use_cache": False}
    folded, _ = normfold.fold(model, example, stock_compatible=False)
    report = export_onnx(folded, example, tmp_path / "model.onnx", original=model, kv_cache=True)
    assert report.error <= report.tolerance and report.compared > 0
    assert ("position_ids" in report.input_names) == (model_type != "bloom")  # BLOOM's positions: ALiBi from the mask
    want = _generate_pytorch(model, ids, mask, 8)
    assert torch.equal(_generate_ort(model, tmp_path / "model.onnx", ids, mask, 8), want)


def test_an_example_whose_batch_equals_its_length_exports_and_generates_at_other_sizes(tmp_path):
    model = _tiny("gpt2")
    export_onnx(model, {"input_ids": torch.arange(1, 17).view(4, 4)}, tmp_path / "model.onnx", kv_cache=True)
    ids, mask = torch.tensor([[5, 6, 7, 8, 9], [1, 1, 3, 4, 5]]), torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    assert torch.equal(_generate_ort(model, tmp_path / "model.onnx", ids, mask, 4),
                       _generate_pytorch(model, ids, mask, 4))


def test_the_cache_changes_the_logits_so_generation_compares_it(tmp_path):
    """A cache the graph ignored would still pass a one-call check: the next token's logits after the
    prompt's cache differ from those after an empty cache."""
    model = _tiny("gpt2")
    example = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])}
    export_onnx(model, example, tmp_path / "model.onnx", kv_cache=True)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"))
    names = [i.name for i in session.get_inputs()]
    ids = torch.tensor([[5, 6, 7, 8]])
    empty = {n: torch.zeros(1, 2, 0, 16).numpy() for n in names if n.startswith("past_")}
    feed = {"input_ids": ids.numpy(), "attention_mask": torch.ones(1, 4, dtype=torch.long).numpy(),
            "position_ids": torch.arange(4)[None].numpy()}
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed | empty)))
    past = {n: outputs[n.replace("past_key_values", "present")] for n in empty}
    step = {"input_ids": ids[:, -1:].numpy(), "attention_mask": torch.ones(1, 5, dtype=torch.long).numpy(),
            "position_ids": torch.tensor([[4]]).numpy()}
    with_cache = session.run(["logits"], step | past)[0]
    without = session.run(["logits"], step | {**empty, "attention_mask": torch.ones(1, 1, dtype=torch.long).numpy(),
                                             "position_ids": torch.tensor([[4]]).numpy()})[0]
    assert outputs["present.0.key"].shape == (1, 2, 4, 16)
    assert not torch.allclose(torch.from_numpy(with_cache), torch.from_numpy(without))
    with torch.no_grad():
        pytorch = model(torch.tensor([[5, 6, 7, 8, 8]])).logits[:, -1:]
    torch.testing.assert_close(torch.from_numpy(with_cache), pytorch, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make, kwargs, error, match", [
    (lambda: transformers.GPT2Model(tiny_gpt2_config(n_layer=1, n_embd=16, vocab_size=32, n_positions=1024)), {},
     ValueError, r"kv_cache=True exports a transformers causal LM of type gpt2, opt, bloom .*got GPT2Model"),
    (lambda: transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        num_layers=1, hidden_size=16, num_heads=2, vocab_size=32, attention_types=[[["global"], 1]])), {},
     ValueError, r"causal LM of type gpt2, opt, bloom .*got GPTNeoForCausalLM \(model_type 'gpt_neo'\)"),
    (lambda: _tiny("gpt2"), {"dynamic": False}, ValueError, "kv_cache=True needs dynamic=True"),
    (lambda: _tiny("gpt2"), {"kv_cache": "yes"}, TypeError, "kv_cache must be a bool, got str"),
])
def test_what_cannot_be_exported_with_a_cache_is_refused_before_any_work(tmp_path, make, kwargs, error, match):
    options = {"kv_cache": True} | kwargs
    with pytest.raises(error, match=match):
        export_onnx(make().eval(), {"input_ids": torch.tensor([[1, 2, 3]])}, tmp_path / "m.onnx", **options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("example, match", [
    ({"input_ids": torch.tensor([[1]])}, r"needs example input_ids: .*got shape \(1, 1\)"),
    ({"input_ids": torch.rand(1, 3)}, r"needs example input_ids: integer token ids .*got shape \(1, 3\) torch.float32"),
    ({"attention_mask": torch.ones(1, 3)}, r"needs example input_ids: .*got NoneType"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 2)},
     r"attention_mask in input_ids' shape \(1, 3\); got shape \(1, 2\)"),
])
def test_example_without_token_ids_is_refused_and_nothing_is_written(tmp_path, example, match):
    with pytest.raises(ValueError, match=match):
        export_onnx(_tiny("gpt2"), example, tmp_path / "m.onnx", kv_cache=True)
    assert list(tmp_path.iterdir()) == []


def test_generation_refuses_a_graph_without_a_cache_a_bad_token_count_and_bad_ids(tmp_path):
    model = _tiny("gpt2")
    example = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), "use_cache": False}
    export_onnx(model, example, tmp_path / "plain.onnx")  # exported without its cache
    session = onnxruntime.InferenceSession(str(tmp_path / "plain.onnx"))
    with pytest.raises(ValueError, match="not a decoder exported with its KV cache: its inputs are input_ids"):
        generate_greedy_ort(session, torch.tensor([[1, 2]]), 3)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        generate_greedy_ort(session, torch.tensor([[1, 2]]), 0)
    cached = tmp_path / "cached.onnx"
    export_onnx(model, example, cached, kv_cache=True)
    with pytest.raises(ValueError, match=r"input_ids must be integer token ids of shape \(batch, sequence\), got "
                                         r"shape \(2,\) torch.int64"):
        generate_greedy_ort(onnxruntime.InferenceSession(str(cached)), torch.tensor([1, 2]), 3)
