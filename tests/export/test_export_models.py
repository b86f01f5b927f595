"""Folded and folded+fused zoo models exported with ONNX Runtime's RMS kernels: equal to the PyTorch
original within the dtype rule, and the graph ONNX Runtime runs holds one RMS node per folded norm,
no LayerNorm node for one, and a fused residual add as SkipSimplifiedLayerNormalization."""
from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")
pytest.importorskip("onnxscript", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")

import normfold  # noqa: E402
from normfold.export import LAYER_NORM_NODE_TYPES, RMS_NODE_TYPES, export_onnx  # noqa: E402
from normfold.nn.kinds import norm_modules  # noqa: E402

MODELS = ["gpt2", "opt_pre_ln", "bloom", "vit", "minilm"]
# models with a fused add that runs fused when traced; BLOOM's adds all end a module (attention, MLP) and
# feed a norm of the block around it: a handoff, which runs unfused when traced (no version counter)
FUSED_WHEN_TRACED = {"gpt2", "opt_pre_ln", "vit", "minilm"}


def _kinds(model) -> dict[str, int]:
    kinds = [kind for _, _, kind in norm_modules(model)]
    return {"RMSNorm": kinds.count("RMSNorm"), "LayerNorm": kinds.count("LayerNorm")}


def _export(zoo, name, tmp_path, *, fuse: bool, target: str = "onnxruntime"):
    model = zoo.model(name)
    example = zoo.inputs(name, seed=0)
    converted, report = normfold.fold(model, example, fuse=fuse, stock_compatible=False)
    exported = export_onnx(converted, example, tmp_path / "model.onnx", original=model,
                           original_path=tmp_path / "original.onnx", target=target)
    return model, converted, report, exported


@pytest.mark.parametrize("fuse", [False, True], ids=["folded", "fused"])
@pytest.mark.parametrize("name", MODELS)
def test_exported_model_equals_the_original_and_runs_rms_kernels(zoo, tmp_path, name, fuse):
    model, converted, report, exported = _export(zoo, name, tmp_path, fuse=fuse)
    assert (tmp_path / "model.onnx").is_file() and (tmp_path / "original.onnx").is_file()
    assert exported.compared >= 2 and exported.error <= exported.tolerance  # example + other sizes, proved
    kinds = _kinds(converted)
    if name != "minilm":  # MiniLM is Post-LN: only the embeddings' LayerNorm folds; the others stay (and fuse)
        assert kinds["RMSNorm"] > 0 and kinds["LayerNorm"] == 0
    counts = exported.node_counts
    assert sum(counts[t] for t in RMS_NODE_TYPES) == kinds["RMSNorm"]  # one RMS node per folded norm
    assert sum(counts[t] for t in LAYER_NORM_NODE_TYPES) == kinds["LayerNorm"]  # none for a folded norm
    assert counts["RMSNormalization"] == 0  # target onnxruntime: its own kernels
    original_kinds = _kinds(model)
    assert sum(exported.original_node_counts[t] for t in LAYER_NORM_NODE_TYPES) == original_kinds["LayerNorm"]
    calls = exported.norm_calls  # what torch traced: one call per norm module, the fused ones with a residual
    assert calls["rms"] + calls["rms_residual"] == kinds["RMSNorm"]
    # a LayerNorm the fold kept runs through normfold's op only when fused (else as torch's own)
    assert calls["layer_norm"] + calls["layer_norm_residual"] <= kinds["LayerNorm"]
    # every add fused in the traced graph is inside ONNX Runtime's Skip kernel
    assert counts["SkipSimplifiedLayerNormalization"] == calls["rms_residual"]
    assert counts["SkipLayerNormalization"] >= calls["layer_norm_residual"]
    if not fuse:
        assert calls["rms_residual"] == calls["layer_norm_residual"] == 0
    elif name in FUSED_WHEN_TRACED:  # so the Skip assertions above compare something
        assert calls["rms_residual"] + calls["layer_norm_residual"] > 0


def test_target_onnx_uses_the_standard_rms_normalization(zoo, tmp_path):
    _, converted, _, exported = _export(zoo, "gpt2", tmp_path, fuse=True, target="onnx")
    assert exported.opset == 23
    counts = exported.node_counts
    assert counts["RMSNormalization"] == _kinds(converted)["RMSNorm"] > 0
    assert counts["SimplifiedLayerNormalization"] == counts["SkipSimplifiedLayerNormalization"] == 0
