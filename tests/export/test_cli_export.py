"""``normfold export DIR -o OUT``: the folder it writes, and what it refuses before any work."""
from __future__ import annotations

import json

import numpy
import pytest

from normfold.cli import EXIT_OK, EXIT_USAGE, main

pytest.importorskip("rich")
onnxruntime = pytest.importorskip("onnxruntime", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")
pytest.importorskip("onnxscript", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")


def test_export_writes_model_original_config_and_report_then_refuses_to_overwrite(capsys, tmp_path, tiny_dirs):
    out = tmp_path / "onnx"
    assert main(["export", str(tiny_dirs["gpt2"]), "-o", str(out), "--fuse", "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.onnx",
                                                   "normfold_report.json", "original.onnx"]
    assert json.loads((out / "normfold_report.json").read_text()) == report
    onnx = report["onnx"]
    assert report["schema_version"] == 1 and report["kind"] == "onnx_export"  # versioned like a folder's report
    assert report["num_folded"] == report["num_norms"] == 5 and report["fuse"] is True
    assert onnx["opset"] == 20 and onnx["target"] == "onnxruntime" and onnx["error"] <= onnx["tolerance"]
    assert onnx["input_names"] == ["input_ids", "attention_mask"] and onnx["output_names"] == ["logits"]
    assert onnx["dynamic_axes"]["input_ids"] == {"0": "batch", "1": "sequence"}
    rms = onnx["node_counts"]["SimplifiedLayerNormalization"] + onnx["node_counts"]["SkipSimplifiedLayerNormalization"]
    assert rms == 5 and onnx["node_counts"]["LayerNormalization"] == 0
    assert onnx["original_node_counts"]["LayerNormalization"] + onnx["original_node_counts"]["SkipLayerNormalization"] == 5
    # both files run at other batch and sequence sizes
    for name in ("model.onnx", "original.onnx"):
        session = onnxruntime.InferenceSession(str(out / name))
        ids = numpy.ones((3, 6), dtype="int64")
        (logits,) = session.run(None, {"input_ids": ids, "attention_mask": ids})
        assert logits.shape == (3, 6, 96)
    # verify reads folded Hugging Face folders: an export folder is named as such (was: "carries no digest (it was edited)")
    assert main(["verify", str(tiny_dirs["gpt2"]), str(out)]) == EXIT_USAGE
    assert "is an ONNX export folder (written by `normfold export`" in capsys.readouterr().err
    before = (out / "model.onnx").read_bytes()
    assert main(["export", str(tiny_dirs["gpt2"]), "-o", str(out)]) == EXIT_USAGE
    assert "output folder exists" in capsys.readouterr().err
    assert (out / "model.onnx").read_bytes() == before


def test_an_opset_the_target_cannot_use_is_a_usage_error_before_loading(capsys, tmp_path):
    out = tmp_path / "onnx"
    missing = tmp_path / "no-such-model"  # never read: the opset is refused first
    assert main(["export", str(missing), "-o", str(out), "--target", "onnx", "--opset", "20"]) == EXIT_USAGE
    assert "must be >= 23" in capsys.readouterr().err
    assert not out.exists()


def test_kv_cache_writes_both_files_with_the_cache_and_they_generate_the_same_tokens(capsys, tmp_path, tiny_dirs):
    import torch

    from normfold.export import generate_greedy_ort

    out = tmp_path / "onnx"
    assert main(["export", str(tiny_dirs["gpt2"]), "-o", str(out), "--kv-cache", "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    onnx = report["onnx"]
    assert report["kv_cache"] is True and onnx["error"] <= onnx["tolerance"]
    assert onnx["input_names"][:4] == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key"]
    assert onnx["output_names"][:3] == ["logits", "present.0.key", "present.0.value"]
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    folded, original = (generate_greedy_ort(onnxruntime.InferenceSession(str(out / name)), ids, 6)
                        for name in ("model.onnx", "original.onnx"))
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(tiny_dirs["gpt2"]).eval()
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                              eos_token_id=None)
    assert folded.shape == (1, 11) and torch.equal(folded, want) and torch.equal(original, want)


def test_kv_cache_for_a_model_that_is_not_a_supported_decoder_is_a_usage_error_before_folding(capsys, tmp_path,
                                                                                             tiny_dirs):
    out = tmp_path / "onnx"
    assert main(["export", str(tiny_dirs["bert"]), "-o", str(out), "--kv-cache"]) == EXIT_USAGE
    assert "kv_cache=True exports a transformers causal LM of type gpt2, opt, bloom" in capsys.readouterr().err
    assert not out.exists()
