"""Streaming folds: plan without loading weights, rewrite shard by shard, check blocks alone."""
from __future__ import annotations

import json
import re

import pytest
import torch

from normfold.hf import CheckpointError, example_inputs_for, fold_folder, load_model
from normfold.hf.streaming import Checkpoint, check_block, fold_checkpoint, plan_for_checkpoint, write_safetensors

from tiny_models import nontrivial_layer_norms, tiny_bloom_config

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")


def _save_sharded(model_dir, folder, max_shard_size: str):
    load_model(model_dir).save_pretrained(folder, max_shard_size=max_shard_size, safe_serialization=True)
    assert len(list(folder.glob("*.safetensors"))) > 2
    return folder


@pytest.fixture(scope="module")
def sharded_opt(tiny_dirs, tmp_path_factory):
    """The tiny OPT saved in ~30 KB shards, so that weights and their biases sit in different files."""
    return _save_sharded(tiny_dirs["opt"], tmp_path_factory.mktemp("sharded") / "opt", "30KB")


def test_plan_from_uninitialised_storage_equals_plan_from_the_loaded_model(sharded_opt):
    from normfold import analyze

    report, skeleton, _ = plan_for_checkpoint(sharded_opt)
    model = load_model(sharded_opt)
    reference = analyze(model, example_inputs_for(model), precompute=False)
    assert [e.foldable for e in report.norms] == [e.foldable for e in reference.norms]
    assert report.plan.center == reference.plan.center and report.plan.untie == reference.plan.untie


def test_streamed_fold_is_bitwise_the_in_memory_fold(sharded_opt, tmp_path, assert_bitwise_same_weights):
    fold_checkpoint(sharded_opt, tmp_path / "streamed")
    fold_folder(sharded_opt, tmp_path / "in_memory")
    assert_bitwise_same_weights(transformers.AutoModelForCausalLM, tmp_path / "streamed", tmp_path / "in_memory")
    index = json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"]  # the untied copy was written next to its source


def test_streamed_fold_loads_in_stock_transformers_with_the_same_outputs(sharded_opt, tmp_path):
    report = fold_checkpoint(sharded_opt, tmp_path / "out")
    original = load_model(sharded_opt)
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    inputs = example_inputs_for(original)
    with torch.no_grad():
        a, b = original(**inputs).logits, folded(**inputs).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5
    assert report["verification"]["ok"] and len(report["verification"]["blocks"]) == 2  # layers 0 and 1
    assert report["verification"]["shell"]["outputs"] == 1 and report["verification"]["shell"]["stack_entries"] == 1


def test_block_check_catches_a_block_that_was_not_folded(sharded_opt, tmp_path):
    fold_checkpoint(sharded_opt, tmp_path / "out")
    ckpt = Checkpoint(tmp_path / "out")
    key = "model.decoder.layers.1.fc2.bias"
    file = tmp_path / "out" / ckpt.file_of[key]
    state = safetensors.torch.load_file(file)
    state[key] = state[key] + 0.5  # the block's output is no longer zero-mean
    safetensors.torch.save_file(state, file, metadata={"format": "pt"})
    assert check_block(sharded_opt, tmp_path / "out", "model.decoder.layers.0")["max_rel_error"] < 1e-6
    assert check_block(sharded_opt, tmp_path / "out", "model.decoder.layers.1")["max_rel_error"] > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_streaming_writer_produces_files_safetensors_reads_back(tmp_path, dtype):
    tensors = {"b": torch.arange(6).reshape(2, 3).to(dtype), "a": torch.ones(5, dtype=dtype), "empty": torch.zeros(0, dtype=dtype)}
    code = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}[dtype]
    write_safetensors(tmp_path / "x.safetensors", [(k, code, list(v.shape)) for k, v in tensors.items()], tensors.__getitem__)
    back = safetensors.torch.load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_streaming_refuses_pickle_only_and_corrupt_checkpoints(tmp_path, sharded_opt):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((sharded_opt / "config.json").read_text())
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"not used")
    with pytest.raises(CheckpointError, match="safetensors"):
        fold_checkpoint(tmp_path / "bin", tmp_path / "out")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((sharded_opt / "config.json").read_text())
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt"):
        fold_checkpoint(tmp_path / "bad", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_math_on_slices_matches_the_math_on_whole_tensors(sharded_opt, tmp_path, monkeypatch):
    import normfold.hf.streaming.rewrite as rewrite

    fold_checkpoint(sharded_opt, tmp_path / "whole")
    monkeypatch.setattr(rewrite, "_CHUNK", 100)  # every 2-D tensor is cut into many slices
    fold_checkpoint(sharded_opt, tmp_path / "sliced")
    whole = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "whole").state_dict()
    sliced = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sliced").state_dict()
    for key in whole:
        torch.testing.assert_close(sliced[key], whole[key], rtol=1e-6, atol=1e-7, msg=key)


# ------------------------------------------------------------------ verify before publishing

def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.normfold-")]


def _corrupt_the_rewrite(monkeypatch, key, change):
    """Make the streamed rewrite write ``change(value)`` for ``key``: a wrong fold to be caught."""
    import normfold.hf.streaming as streaming

    compute = streaming.CheckpointRewrite.compute

    def wrong(self, k):
        values = compute(self, k)
        return {name: change(v) if name == key else v for name, v in values.items()}

    monkeypatch.setattr(streaming.CheckpointRewrite, "compute", wrong)


@pytest.fixture(scope="module")
def sharded_bert(tiny_dirs, tmp_path_factory):
    """The tiny BERT in ~20 KB shards: only embeddings.LayerNorm folds (Post-LN layers)."""
    return _save_sharded(tiny_dirs["bert"], tmp_path_factory.mktemp("sharded") / "bert", "20KB")


def test_a_sharded_encoder_that_folds_only_its_embedding_norm_verifies_without_any_block(sharded_bert, tmp_path):
    report = fold_checkpoint(sharded_bert, tmp_path / "out")
    ver = report["verification"]
    assert report["num_foldable"] == 1 and [s["path"] for s in report["swapped"]] == ["embeddings.LayerNorm"]
    assert ver["ok"] and ver["blocks"] == [] and ver["problems"] == []
    # last_hidden_state and pooler_output compared; the untouched layers compared as copies
    assert ver["shell"]["outputs"] == 2 and ver["copied_tensors"] > 0
    original, folded = load_model(sharded_bert), transformers.AutoModel.from_pretrained(tmp_path / "out").eval()
    inputs = example_inputs_for(original)
    with torch.no_grad():
        torch.testing.assert_close(folded(**inputs).last_hidden_state, original(**inputs).last_hidden_state)


@pytest.mark.parametrize("key, change", [
    ("model.decoder.embed_tokens.weight", lambda v: 2 * v),      # stream entering the layers: not P·x
    ("model.decoder.embed_positions.weight", lambda v: v + 0.1),  # not centered
    ("lm_head.weight", lambda v: 1.1 * v),                        # the untied head
    ("model.decoder.final_layer_norm.weight", lambda v: v + 0.2),
    ("model.decoder.layers.1.fc2.bias", lambda v: v + 0.5),       # a middle block
])
def test_a_wrong_streamed_fold_is_refused_and_nothing_is_written(sharded_opt, tmp_path, monkeypatch, key, change):
    from normfold import FoldVerificationError

    _corrupt_the_rewrite(monkeypatch, key, change)
    with pytest.raises(FoldVerificationError, match="nothing was written"):
        fold_checkpoint(sharded_opt, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def test_a_changed_tensor_in_a_layer_the_fold_leaves_alone_is_refused(sharded_bert, tmp_path, monkeypatch):
    from normfold import FoldVerificationError

    # not a constant shift: the LayerNorm after this bias would remove that, an equal model
    _corrupt_the_rewrite(monkeypatch, "encoder.layer.1.output.dense.bias", lambda v: v + torch.linspace(0, 1, len(v)))
    with pytest.raises(FoldVerificationError, match="encoder.layer.1 relative error"):
        fold_checkpoint(sharded_bert, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failed_check_with_overwrite_keeps_the_previous_output(sharded_opt, tmp_path, monkeypatch):
    from normfold import FoldVerificationError

    out = tmp_path / "out"
    fold_checkpoint(sharded_opt, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _corrupt_the_rewrite(monkeypatch, "model.decoder.layers.0.fc2.bias", lambda v: v + 0.5)
    with pytest.raises(FoldVerificationError):
        fold_checkpoint(sharded_opt, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and _leftovers(tmp_path, "out") == []


def test_the_published_report_holds_the_verification(sharded_opt, tmp_path):
    fold_checkpoint(sharded_opt, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "normfold_report.json").read_text())
    assert saved["verification"]["ok"] is True and saved["verification"]["num_runs"] == 3


@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_streamed_fold_shows_bars_over_its_shards_and_blocks_only_when_progress_is_on(sharded_opt, tmp_path, capsys,
                                                                                      monkeypatch, setting):
    pytest.importorskip("tqdm")
    monkeypatch.setenv("NORMFOLD_PROGRESS", setting)
    fold_checkpoint(sharded_opt, tmp_path / "out")
    err = capsys.readouterr().err
    shards = len(list(sharded_opt.glob("*.safetensors")))
    bars = [rf"rewriting shards: .*\| \d+/{shards} ", r"checking model\.decoder\.layers: .*\| \d+/2 "]  # tqdm: "| 1/2 ["
    assert all(re.search(bar, err) for bar in bars) if setting == "1" else err == ""


# ------------------------------------------------------------------------------- shard names

@pytest.mark.parametrize("shard", ["../moved.safetensors", "ABSOLUTE/moved.safetensors", "sub/moved.safetensors",
                                   "..", "a\0b"])
def test_a_shard_name_that_is_not_a_plain_file_name_is_refused_before_anything_is_written(sharded_opt, tmp_path,
                                                                                          shard):
    """Shard names become output paths: ``../x`` or an absolute name made the fold rewrite the file it
    names, outside the output folder (here the moved shard itself, read as input, then rewritten)."""
    import shutil

    src = tmp_path / "models" / "m"
    shutil.copytree(sharded_opt, src)
    shard = shard.replace("ABSOLUTE", str(tmp_path / "elsewhere"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"].values()))
    victim = (src / shard) if "\0" not in shard and shard != ".." else None
    if victim is not None:
        victim.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(src / first, victim)
        before = victim.read_bytes()
    index["weight_map"] = {k: shard if v == first else v for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="plain file name"):
        fold_checkpoint(src, tmp_path / "models" / "out")
    assert victim is None or victim.read_bytes() == before
    assert not (tmp_path / "models" / "out").exists()


# ------------------------------------------------------------------ families with other block calls

def _family_config(name):
    return {
        # its LayerNorms are kept (the embedding norm blocks them) but their γ/β move into the next layer
        "bloom": tiny_bloom_config(),
        # blocks take the model's ALiBi and attention mask as positional arguments
        "falcon": transformers.FalconConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                            new_decoder_architecture=True, num_kv_heads=2),
        # blocks take the model's rotary tables
        "phi": transformers.PhiConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=32),
    }[name]


@pytest.mark.parametrize("name, foldable", [("bloom", 1), ("falcon", 5), ("phi", 3)])
def test_streamed_folds_of_other_families_verify_and_reload_with_the_same_outputs(tmp_path, name, foldable):
    torch.manual_seed(0)
    model = nontrivial_layer_norms(transformers.AutoModelForCausalLM.from_config(_family_config(name)).eval())
    src = tmp_path / "sharded"
    model.save_pretrained(src, max_shard_size="30KB", safe_serialization=True)
    report = fold_checkpoint(src, tmp_path / "out")
    assert report["num_foldable"] == foldable and report["verification"]["ok"]
    assert len(report["verification"]["blocks"]) == 2  # both layers run: centered, or changed by affine folds
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    inputs = example_inputs_for(model)
    with torch.no_grad():
        a, b = model(**inputs).logits, folded(**inputs).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5
