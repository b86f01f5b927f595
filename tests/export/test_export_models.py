"""Folded and folded+fused zoo models exported with ONNX Runtime's RMS kernels: equal to the PyTorch
original within the dtype rule, and the graph ONNX Runtime runs holds one RMS node per folded norm,
no LayerNorm node for one, and every residual add that feeds a norm inside a Skip* kernel."""
from __future__ import annotations

import pytest
import torch
from torch import fx

pytest.importorskip("onnxruntime", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")
pytest.importorskip("onnxscript", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")

import normfold  # noqa: E402
from normfold.export import LAYER_NORM_NODE_TYPES, RMS_NODE_TYPES, export_onnx, fold_config_for_export  # noqa: E402
from normfold.engine.graph import capture, shape  # noqa: E402
from normfold.engine.op_kinds import norm_node_kind, passes_values_on  # noqa: E402
from normfold.nn.kinds import norm_modules  # noqa: E402

MODELS = ["gpt2", "opt_pre_ln", "bloom", "vit", "minilm"]
# models with a fused add that runs fused when traced; BLOOM's adds all end a module (attention, MLP) and
# feed a norm of the block around it: a handoff, which runs unfused when traced (no version counter)
FUSED_WHEN_TRACED = {"gpt2", "opt_pre_ln", "vit", "minilm"}


def _kinds(model) -> dict[str, int]:
    kinds = [kind for _, _, kind in norm_modules(model)]
    return {"RMSNorm": kinds.count("RMSNorm"), "LayerNorm": kinds.count("LayerNorm")}


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def _norms_reading_a_residual_add(model, example) -> int:
    """LayerNorms whose input, in the original's torch.export graph, is an add of two tensors of one shape
    (views and copies looked through): a residual add ONNX Runtime can run inside a Skip* kernel."""
    count = 0
    for node in capture(model, example).graph.nodes:
        if norm_node_kind(node) != "LayerNorm":
            continue
        source = node.args[0]
        while source.target in _VIEWS or passes_values_on(source):
            source = source.args[0]
        operands = source.args[:2]
        count += (source.target == torch.ops.aten.add.Tensor and all(isinstance(a, fx.Node) for a in operands)
                  and shape(operands[0]) == shape(operands[1]) is not None)
    return count


def _export(zoo, name, tmp_path, *, fuse: bool, target: str = "onnxruntime"):
    model = zoo.model(name)
    example = zoo.inputs(name, seed=0)
    converted, report = normfold.convert(model, example, fold=fold_config_for_export(model),
                                         fuse=normfold.FuseConfig() if fuse else None)
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
    # every add fused in the traced graph is inside ONNX Runtime's Skip kernel, and so is every residual add
    # that feeds a norm, folded or not (the export's graph passes): as fused as the original, and more
    assert counts["SkipSimplifiedLayerNormalization"] >= calls["rms_residual"]
    assert counts["SkipLayerNormalization"] >= calls["layer_norm_residual"]
    residual_adds = _norms_reading_a_residual_add(model, zoo.inputs(name, seed=0))
    assert counts["SkipSimplifiedLayerNormalization"] + counts["SkipLayerNormalization"] == residual_adds > 0
    original_skips = exported.original_node_counts["SkipLayerNormalization"]
    assert counts["SkipSimplifiedLayerNormalization"] + counts["SkipLayerNormalization"] >= original_skips
    assert exported.graph_passes["residual_adds_fused"] + calls["rms_residual"] == counts["SkipSimplifiedLayerNormalization"]
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
