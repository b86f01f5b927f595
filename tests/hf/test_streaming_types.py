"""Streamed folds of sharded folders whose model the streaming fold refused on main f840f32, though the
in-memory fold of each proves: GPT-Neo (a causal-mask buffer not saved with the weights: the block check
ran it on the meta device), GPT-NeoX (its head saved as ``embed_out``), ViT and DeiT (every layer saved
under transformers' older names) and LED (captured through submodules: its decoder's embedding is untied
from the ``shared`` table it is stored as). Each folds streamed bit for bit as in memory, and ``normfold
verify`` passes. XGLM, which cannot run in float64, stays refused, now with that reason."""
from __future__ import annotations

import contextlib

import json

import pytest
import torch

from normfold.cli import EXIT_OK, EXIT_USAGE, EXIT_VERIFY_FAILED, main
from normfold.engine.plan import FoldPlan, UntieStep
from normfold.hf import CheckpointError, fold_folder, load_model
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.streaming import Checkpoint, CheckpointRewrite, is_sharded
from normfold.hf.weight_files import saved_names

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TYPES = {  # type -> (class, tiny config)
    "gpt_neo": (transformers.GPTNeoForCausalLM,
                transformers.GPTNeoConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=2,
                                          attention_types=[[["global", "local"], 1]], max_position_embeddings=32,
                                          window_size=8)),
    "gpt_neox": (transformers.GPTNeoXForCausalLM,
                 transformers.GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                            intermediate_size=64, max_position_embeddings=32)),
    "xglm": (transformers.XGLMForCausalLM,
             transformers.XGLMConfig(vocab_size=96, d_model=32, num_layers=2, attention_heads=2, ffn_dim=64,
                                     max_position_embeddings=32)),
    "vit": (transformers.ViTModel,
            transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   image_size=16, patch_size=4)),
    "deit": (transformers.DeiTModel,
             transformers.DeiTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     image_size=16, patch_size=4)),
    "led": (transformers.LEDModel,
            transformers.LEDConfig(vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                   decoder_ffn_dim=64, attention_window=4, max_encoder_position_embeddings=64,
                                   max_decoder_position_embeddings=64)),
}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """type -> its tiny model (non-zero biases, γ ≠ 1) saved in ~20 KB shards, made on first use."""
    root, cache = tmp_path_factory.mktemp("streaming_types"), {}

    def get(name: str):
        if name not in cache:
            cls, config = TYPES[name]
            torch.manual_seed(0)
            model = cls(config).eval()
            with torch.no_grad():  # a tensor loaded at random, or an affine moved wrongly, shows
                for path, p in model.named_parameters():
                    if path.endswith("bias"):
                        p.normal_(0, 0.1)
                    elif "norm" in path.lower() and path.endswith("weight"):
                        p.uniform_(0.5, 1.5)
            model.save_pretrained(root / name, max_shard_size="20KB")
            assert is_sharded(root / name) and len(list((root / name).glob("*.safetensors"))) > 2
            cache[name] = root / name
        return cache[name]

    return get


def _stored(folder) -> dict[str, torch.Tensor]:
    checkpoint = Checkpoint(folder)
    return {key: checkpoint.read(key) for key in checkpoint.meta}


def _fold_both_ways_and_verify(source, tmp_path, capsys) -> dict:
    """Fold ``source`` streamed (the CLI on a sharded folder) and in memory; assert the same stored
    tensors bit for bit and ``normfold verify`` exit 0; return the streamed report."""
    streamed, in_memory = tmp_path / "streamed", tmp_path / "in_memory"
    assert main(["fold", str(source), "-o", str(streamed)]) == EXIT_OK, capsys.readouterr().err
    report = json.loads((streamed / REPORT_JSON).read_text())
    assert report["recipe"]["streaming"] is True and report["verification"]["ok"] is True
    fold_folder(source, in_memory)
    a, b = _stored(streamed), _stored(in_memory)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    capsys.readouterr()
    assert main(["verify", str(source), str(streamed)]) == EXIT_OK, capsys.readouterr().out
    return report


@pytest.mark.parametrize("name", ["gpt_neo", "gpt_neox", "vit", "deit"])
def test_a_sharded_folder_that_main_refused_to_stream_folds_streamed_bitwise_as_in_memory_and_verifies(
        sharded, tmp_path, capsys, monkeypatch, name):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    source = sharded(name)
    report = _fold_both_ways_and_verify(source, tmp_path, capsys)
    original, streamed = _stored(source), _stored(tmp_path / "streamed")
    assert report["num_foldable"] > 0 and report["verification"]["blocks"]  # blocks were run, not only copied
    changed = [key for key in original if not torch.equal(original[key], streamed[key])]
    assert changed  # the fold rewrote tensors: the bitwise comparison compared a fold


def test_renamed_keys_are_rewritten_under_the_names_the_checkpoint_stores(sharded, tmp_path, monkeypatch):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    for name, model_name, stored_name in (
            ("vit", "layers.0.attention.q_proj.weight", "encoder.layer.0.attention.attention.query.weight"),
            ("gpt_neox", "lm_head.weight", "embed_out.weight")):
        source = sharded(name)
        model = load_model(source)
        assert model_name in model.state_dict() and saved_names(model, [model_name]) == {model_name: stored_name}
        keys = Checkpoint(source).meta.keys()
        assert stored_name in keys and model_name not in keys


def test_xglm_whose_forward_makes_tensors_in_the_default_dtype_streams_and_proves_in_float64(sharded, tmp_path,
                                                                                            monkeypatch):
    """Fails on main 61708a4: XGLM fills a tensor of the float32 default dtype with float64's minimum, so every
    float64 run raised (streamed: refused; in memory: proved in float32 only). Each float64 run now has
    float64 as torch's default dtype."""
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    out = tmp_path / "streamed"
    assert main(["fold", str(sharded("xglm")), "-o", str(out)]) == 0
    assert json.loads((out / REPORT_JSON).read_text())["verification"]["ok"]
    fold_folder(sharded("xglm"), tmp_path / "in_memory")
    report = json.loads((tmp_path / "in_memory" / REPORT_JSON).read_text())
    assert report["verification"]["ok"] and report["verification"]["compared_in"] == "float64"
    assert torch.get_default_dtype() == torch.float32  # restored


def test_a_model_that_cannot_run_in_float64_is_refused_streamed_with_that_reason(sharded, tmp_path, capsys,
                                                                                monkeypatch):
    """Every streamed piece is proved in float64: a model whose float64 runs raise (here XGLM with its
    float64 runs left in the float32 default dtype) is refused, and told to fold in memory."""
    import normfold.hf.streaming.blocks as blocks

    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    monkeypatch.setattr(blocks, "default_dtype_of", lambda model: contextlib.nullcontext())
    out = tmp_path / "streamed"
    assert main(["fold", str(sharded("xglm")), "-o", str(out)]) == EXIT_VERIFY_FAILED
    err = capsys.readouterr().err
    assert ("the model cannot run in float64 (RuntimeError: value cannot be converted to type float without "
            "overflow), and a streamed fold proves every piece in float64") in err and "fold it in memory" in err
    assert not out.exists()


def test_a_model_that_fails_cut_short_in_float32_too_is_not_said_to_fail_for_float64(sharded, tmp_path,
                                                                                     monkeypatch):
    """The float64 reason is given only where float32 runs: a cut model that fails in both keeps the
    plain reason."""
    import normfold.hf.streaming.blocks as blocks
    from normfold.hf.streaming import verify_by_blocks

    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    source = sharded("gpt_neox")
    out = tmp_path / "streamed"
    assert main(["fold", str(source), "-o", str(out)]) == EXIT_OK

    def broken(*_args, **_kwargs):
        raise RuntimeError("broken in every dtype")

    monkeypatch.setattr(blocks, "_run_shell", broken)
    verification = verify_by_blocks(source, out)
    assert verification["ok"] is False
    assert verification["why"] == ("float64 check failed: could not run the model cut to one block per stack: "
                                   "broken in every dtype")


@pytest.mark.slow
def test_a_sharded_folder_captured_through_submodules_folds_streamed_bitwise_as_in_memory(sharded, tmp_path, capsys,
                                                                                            monkeypatch):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    source = sharded("led")
    report = _fold_both_ways_and_verify(source, tmp_path, capsys)
    assert "decoder" in report["captured_through"] and report["num_foldable"] > 0
    keys = Checkpoint(tmp_path / "streamed").meta
    # stored once as shared.weight; the encoder's and the decoder's centered copies are stored apart (both
    # embedding norms fold: the encoder's since the code between its captured submodules is followed)
    assert {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"} <= keys.keys()
    assert "decoder.embed_tokens.weight" not in Checkpoint(source).meta


@pytest.mark.slow
@pytest.mark.parametrize("shards", ["20KB", None])
def test_rotating_a_model_captured_through_submodules_is_refused_with_the_reason(tmp_path, capsys, monkeypatch,
                                                                                 shards):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    cls, config = TYPES["led"]
    torch.manual_seed(0)
    source = tmp_path / "led"
    cls(config).save_pretrained(source, **({"max_shard_size": shards} if shards else {}))
    assert is_sharded(source) == bool(shards)  # streamed and in memory
    capsys.readouterr()
    assert main(["rotate", str(source), "-o", str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot rotate: the fold was captured through submodules: decoder" in err
    assert "one graph of the whole model" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_sharded_folder_whose_tensors_transformers_merges_on_load_is_refused_by_name(tmp_path, capsys,
                                                                                       monkeypatch):
    """Mixtral's experts are one tensor in the model and one per expert in the checkpoint: no tensor
    of the model has a stored name, so neither the rewrite nor the block check can read it."""
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    with pytest.raises(CheckpointError, match="merges or splits them when loading"):
        saved_names(model, list(model.state_dict()))
    model.save_pretrained(tmp_path / "mixtral", max_shard_size="20KB")
    capsys.readouterr()
    assert main(["fold", str(tmp_path / "mixtral"), "-o", str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("normfold: error: transformers stores the tensors of MixtralForCausalLM otherwise than by "
                          "name (it merges or splits them when loading") and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_sharded_gpt_neox_rotates_streamed_bitwise_as_in_memory_and_verifies(sharded, tmp_path, capsys,
                                                                              monkeypatch):
    """Its head, stored as embed_out, is rotated under that key; the rotation reloads to the in-memory one."""
    import normfold
    from normfold.hf.inputs import example_inputs_for

    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    source, out = sharded("gpt_neox"), tmp_path / "rotated"
    assert main(["rotate", str(source), "-o", str(out), "--method", "hadamard", "--seed", "1"]) == EXIT_OK
    original = load_model(source)
    in_memory, _ = normfold.rotate(original, example_inputs_for(original), method="hadamard", seed=1)
    expected, got = in_memory.state_dict(), normfold.from_pretrained(out).state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert "embed_out.weight" in Checkpoint(out).meta
    capsys.readouterr()
    assert main(["verify", str(source), str(out)]) == EXIT_OK, capsys.readouterr().out


def test_a_sharded_vit_rotation_gets_the_closure_checks_answer_not_a_device_error(sharded, tmp_path, capsys,
                                                                                  monkeypatch):
    """The structure-only capture ran ViT's patch convolution on CPU pixels with meta weights."""
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    assert main(["rotate", str(sharded("vit")), "-o", str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot rotate: the residual stream is not closed under rotation: layernorm kept its γ/β" in err
    assert "aten.select at pooler" in err and "device" not in err


def test_untying_the_stored_owner_of_a_tensor_others_still_share_is_refused(tmp_path):
    """GPT-2 stores its tied head once, as transformer.wte.weight: a plan giving wte its own values
    while lm_head keeps the tie cannot be written key by key."""
    from tiny_models import tiny_gpt2

    tiny_gpt2().save_pretrained(tmp_path / "gpt2")
    model = load_model(tmp_path / "gpt2")
    plan = FoldPlan(untie=[UntieStep("transformer.wte", "weight", source_fqn="lm_head.weight")])
    with pytest.raises(CheckpointError, match="gives transformer.wte.weight its own values, but the checkpoint "
                                              "stores it once for lm_head.weight too"):
        CheckpointRewrite(plan, model, Checkpoint(tmp_path / "gpt2"), out_dtype=None)
