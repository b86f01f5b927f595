"""Streaming folds: plan without loading weights, rewrite shard by shard, check blocks alone."""
from __future__ import annotations

import json

import pytest
import torch

from normfold.hf import CheckpointError, example_inputs_for, fold_folder, load_model
from normfold.hf.streaming import (Checkpoint, check_block, fold_and_check, fold_checkpoint, plan_for_checkpoint,
                                   write_safetensors)

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def sharded_opt(tiny_dirs, tmp_path_factory):
    """The tiny OPT saved in ~30 KB shards, so that weights and their biases sit in different files."""
    folder = tmp_path_factory.mktemp("sharded") / "opt"
    load_model(tiny_dirs["opt"]).save_pretrained(folder, max_shard_size="30KB", safe_serialization=True)
    assert len(list(folder.glob("*.safetensors"))) > 2
    return folder


def test_plan_from_uninitialised_storage_equals_plan_from_the_loaded_model(sharded_opt):
    from normfold import analyze

    report, skeleton, _ = plan_for_checkpoint(sharded_opt)
    model = load_model(sharded_opt)
    reference = analyze(model, example_inputs_for(model), precompute=False)
    assert [e.foldable for e in report.norms] == [e.foldable for e in reference.norms]
    assert report.plan.center == reference.plan.center and report.plan.untie == reference.plan.untie


def test_streamed_fold_is_bitwise_the_in_memory_fold(sharded_opt, tmp_path):
    fold_checkpoint(sharded_opt, tmp_path / "streamed")
    fold_folder(sharded_opt, tmp_path / "in_memory")
    streamed = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "streamed").state_dict()
    in_memory = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "in_memory").state_dict()
    assert streamed.keys() == in_memory.keys()
    for key in streamed:
        assert torch.equal(streamed[key], in_memory[key]), key
    index = json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"]  # the untied copy was written next to its source


def test_streamed_fold_loads_in_stock_transformers_with_the_same_outputs(sharded_opt, tmp_path):
    report = fold_and_check(sharded_opt, tmp_path / "out")
    original = load_model(sharded_opt)
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    inputs = example_inputs_for(original)
    with torch.no_grad():
        a, b = original(**inputs).logits, folded(**inputs).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5
    assert report["verification"]["ok"] and len(report["verification"]["blocks"]) == 2  # layers 0 and 1


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
    import normfold.hf.streaming as streaming

    fold_checkpoint(sharded_opt, tmp_path / "whole")
    monkeypatch.setattr(streaming, "_CHUNK", 100)  # every 2-D tensor is cut into many slices
    fold_checkpoint(sharded_opt, tmp_path / "sliced")
    whole = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "whole").state_dict()
    sliced = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sliced").state_dict()
    for key in whole:
        torch.testing.assert_close(sliced[key], whole[key], rtol=1e-6, atol=1e-7, msg=key)
