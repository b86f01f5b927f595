"""The export's graph passes (``normfold.export.graph_passes``) on hand-built graphs: a norm reading a 2-D
view of a residual add becomes one ``SkipSimplifiedLayerNormalization`` with the same outputs in ONNX
Runtime, and what would change the result is left alone (a view that changes the last axis, a
broadcasting add, dims that are unknown); and the fold's options for an export create no parameter."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

onnxruntime = pytest.importorskip("onnxruntime", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")
onnx = pytest.importorskip("onnx")
ir = pytest.importorskip("onnx_ir")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import normfold  # noqa: E402
from normfold.export import fold_config_for_export  # noqa: E402
from normfold.export.graph_passes import optimize_exported  # noqa: E402
from tiny_models import tiny_gpt2  # noqa: E402

WIDTH = 8


def _residual_norm_graph(a_shape, b_shape, view_shape, *, sum_read_later: bool = True):
    """y = SimplifiedLayerNormalization(Reshape(a + b, view_shape)) (and a + b as a second output: the
    residual stream reading the sum), as normfold's translation exports a norm on a 2-D view."""
    rng = np.random.default_rng(0)
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape),
              helper.make_tensor_value_info("b", TensorProto.FLOAT, b_shape)]
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]),
             helper.make_node("Reshape", ["sum", "view"], ["rows"], allowzero=1),
             helper.make_node("SimplifiedLayerNormalization", ["rows", "gamma"], ["y"], axis=-1, epsilon=1e-5,
                              stash_type=1)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if sum_read_later:
        nodes.append(helper.make_node("Mul", ["sum", "two"], ["later"]))
        outputs.append(helper.make_tensor_value_info("later", TensorProto.FLOAT, None))
    initializers = [numpy_helper.from_array(np.array(view_shape, dtype=np.int64), "view"),
                    numpy_helper.from_array((0.5 + rng.random(view_shape[-1])).astype(np.float32), "gamma"),
                    numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


def _run(proto, feed) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _pass(proto, target: str = "onnxruntime"):
    model = ir.from_proto(proto)
    done = optimize_exported(model, target)
    return ir.to_proto(model), done


def _feed(a_dims, b_dims):
    rng = np.random.default_rng(1)
    return {"a": rng.standard_normal(a_dims).astype(np.float32), "b": rng.standard_normal(b_dims).astype(np.float32)}


def test_a_norm_on_a_view_of_a_residual_add_becomes_one_skip_kernel_with_the_same_outputs():
    proto = _residual_norm_graph(["batch", "sequence", WIDTH], ["batch", "sequence", WIDTH], [-1, WIDTH])
    fused, done = _pass(proto)
    assert done == {"views_moved": 1, "residual_adds_fused": 1}
    ops = collections.Counter(node.op_type for node in fused.graph.node)
    assert ops["SkipSimplifiedLayerNormalization"] == 1 and ops["Add"] == 0 and ops["SimplifiedLayerNormalization"] == 0
    feed = _feed((3, 5, WIDTH), (3, 5, WIDTH))
    for want, got in zip(_run(proto, feed), _run(fused, feed)):
        assert want.shape == got.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # the sum read later is the Skip kernel's


def test_target_onnx_moves_the_view_but_keeps_standard_ops():
    proto = _residual_norm_graph(["batch", "sequence", WIDTH], ["batch", "sequence", WIDTH], [-1, WIDTH])
    _, done = _pass(proto, target="onnx")
    assert done == {"views_moved": 1, "residual_adds_fused": 0}


@pytest.mark.parametrize("a_shape, b_shape, view_shape, feed_dims, moved", [
    # a view that changes the last axis: the norm's rows are not the tensor's rows
    (["batch", 2, WIDTH // 2], ["batch", 2, WIDTH // 2], [-1, WIDTH], ((3, 2, WIDTH // 2), (3, 2, WIDTH // 2)), 0),
    # a broadcasting add (GPT-2's token + position embeddings): not a Skip kernel's input
    (["batch", "sequence", WIDTH], [1, "sequence", WIDTH], [-1, WIDTH], ((3, 5, WIDTH), (1, 5, WIDTH)), 1),
    # dims nobody named may differ
    ([None, None, WIDTH], [None, None, WIDTH], [-1, WIDTH], ((3, 5, WIDTH), (3, 5, WIDTH)), 1),
])
def test_what_would_change_the_result_is_not_fused(a_shape, b_shape, view_shape, feed_dims, moved):
    proto = _residual_norm_graph(a_shape, b_shape, view_shape)
    fused, done = _pass(proto)
    assert done == {"views_moved": moved, "residual_adds_fused": 0}
    assert not any(node.op_type.startswith("Skip") for node in fused.graph.node)
    feed = _feed(*feed_dims)
    for want, got in zip(_run(proto, feed), _run(fused, feed)):
        np.testing.assert_array_equal(got, want)


def test_the_fold_for_an_export_creates_no_parameter_so_no_vocabulary_wide_bias():
    """With every γ/β folded, GPT-2's ln_f β becomes a new lm_head.bias: a vocabulary-wide Add on every call
    in ONNX Runtime. The export's fold keeps it in the RMSNorm (a width-wide one) and still folds the rest."""
    model = tiny_gpt2(0, n_layer=1, n_embd=16, vocab_size=64, n_positions=1024, tie_word_embeddings=False).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.bias.normal_(0.0, 0.1)
    example = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "use_cache": False}
    everything, _ = normfold.fold(model, example, stock_compatible=False)
    assert "lm_head.bias" in everything.state_dict()  # what the export's options avoid
    folded, report = normfold.convert(model, example, fold=fold_config_for_export(model))
    assert set(folded.state_dict()) <= set(model.state_dict())
    assert report.num_foldable == report.num_norms == 3
    assert folded.transformer.ln_f.bias is not None


def test_op_times_profiles_the_kernels_onnx_runtime_runs_and_refuses_no_runs(tmp_path):
    from normfold.export.runtime import op_times

    fused, _ = _pass(_residual_norm_graph(["batch", "sequence", WIDTH], ["batch", "sequence", WIDTH], [-1, WIDTH]))
    path = tmp_path / "m.onnx"
    path.write_bytes(fused.SerializeToString())
    times = op_times(path, _feed((2, 4, WIDTH), (2, 4, WIDTH)), runs=3)
    assert {"SkipSimplifiedLayerNormalization", "Mul"} <= set(times) and all(t > 0 for t in times.values())
    with pytest.raises(ValueError, match="runs must be an int >= 1, got 0"):
        op_times(path, {}, runs=0)
