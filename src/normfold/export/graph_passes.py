"""Passes over the exported graph (``onnx_ir``) that let ONNX Runtime run a folded model as fused as the original.

normfold's op normalizes 2-D rows: its functional API views a ``(..., N)`` tensor as ``(M, N)`` and the
result back, so the exported graph reads ``Add → Reshape → norm → Reshape`` where the original's reads
``Add → LayerNormalization``. The ``Reshape`` between the residual add and the norm hides the pair from
every fusion (ONNX Runtime's and onnxscript's match an ``Add`` feeding the norm). Two passes:

1. :func:`move_views_after_norms`: a norm over the last axis commutes with a ``Reshape`` that keeps the
   last axis, so the norm reads the ``(..., N)`` tensor itself and the ``Reshape`` moves to its
   outputs; the ``Add`` then feeds the norm directly.
2. :func:`fuse_residual_adds` (target ``onnxruntime``): ``Add → SimplifiedLayerNormalization`` becomes
   ``SkipSimplifiedLayerNormalization``, whose sum output replaces the ``Add``'s where the residual
   stream reads it later. ONNX Runtime's own fusion leaves such a pair alone (it fuses an ``Add`` whose
   sum nothing else reads), so the original's pre-norm residual adds stay unfused and the folded
   model's become one kernel.

The sum is the same addition; the norm is ONNX Runtime's kernel either way (its Skip kernel
accumulates the statistics its own way: within float32 rounding, proved like every export).
"""
from __future__ import annotations

from .._deps import require

__all__ = ["LAST_AXIS_NORMS", "move_views_after_norms", "fuse_residual_adds", "optimize_exported"]

_MS_DOMAIN = "com.microsoft"
# (domain, op type) -> how many leading inputs are normalized rows (x, and the skip of a Skip* kernel);
# every one normalizes over the last axis
LAST_AXIS_NORMS = {
    ("", "SimplifiedLayerNormalization"): 1,
    ("", "RMSNormalization"): 1,
    ("", "LayerNormalization"): 1,
    (_MS_DOMAIN, "SkipSimplifiedLayerNormalization"): 2,
    (_MS_DOMAIN, "SkipLayerNormalization"): 2,
}
# outputs shaped like the rows: Y, and a Skip* kernel's input_skip_bias_sum
_ROW_OUTPUTS = {1: (0,), 2: (0, 3)}


def move_views_after_norms(model) -> int:
    """Make each last-axis norm that reads a ``Reshape`` keeping the last axis read the reshape's input,
    and reshape its row-shaped outputs instead (same values: rows are normalized one by one). Skip*
    kernels only when both inputs come from tensors of one known shape (:func:`_same_known_shape`). Repeated
    until no view is left to move (a model's own view may precede normfold's); returns how many moved."""
    total = 0
    while moved := _move_views_once(model):
        total += moved
    return total


def _move_views_once(model) -> int:
    graph = model.graph
    moved = 0
    for node in list(graph):
        rows = LAST_AXIS_NORMS.get((node.domain, node.op_type))
        if rows is not None and node.attributes.get_int("axis", -1) == -1:
            moved += _move_view(graph, node, rows)
    return moved


def _move_view(graph, node, rows: int) -> bool:
    """One norm ``node`` off the views before its ``rows`` inputs, if they keep the last axis."""
    ir = require("onnx_ir")
    views = [value.producer() if value is not None else None for value in node.inputs[:rows]]
    if not all(_keeps_last_axis(view, value) for view, value in zip(views, node.inputs)):
        return False
    sources = [view.inputs[0] for view in views]
    if rows == 2 and not _same_known_shape(*sources):
        return False
    if any(node.outputs[i].uses() or node.outputs[i].is_graph_output()
           for i in range(len(node.outputs)) if i not in _ROW_OUTPUTS[rows]):
        return False  # statistics outputs shaped by the rows' count: not ours to move
    norm = ir.Node(node.domain, node.op_type, [*sources, *node.inputs[rows:]], node.attributes.values(),
                   num_outputs=len(node.outputs), version=node.version)
    reshapes = []
    for i in _ROW_OUTPUTS[rows]:
        old, new = node.outputs[i], norm.outputs[i]
        new.type, new.shape = sources[0].type, sources[0].shape
        for use in list(old.uses()):  # a reshape that ignores its input's shape can read the norm's directly
            if use.idx == 0 and _ignores_input_shape(use.node):
                use.node.replace_input_with(0, new)
        if old.uses() or old.is_graph_output():
            # the view's own shape and attributes, on a tensor of its input's shape: the same result
            reshape = ir.Node("", "Reshape", [new, views[0].inputs[1]], views[0].attributes.values(), num_outputs=1)
            reshape.outputs[0].type, reshape.outputs[0].shape = old.type, old.shape
            reshapes.append((old, reshape))
    graph.insert_before(node, [norm, *(reshape for _, reshape in reshapes)])
    for old, reshape in reshapes:
        if old.is_graph_output():
            reshape.outputs[0].name, old.name = old.name, None
        old.replace_all_uses_with(reshape.outputs[0], replace_graph_outputs=True)
    graph.remove(node, safe=True)
    for view in dict.fromkeys(views):  # a Skip kernel's two inputs may share one view
        if not view.outputs[0].uses() and not view.outputs[0].is_graph_output():
            graph.remove(view, safe=True)
    return True


def _ignores_input_shape(node) -> bool:
    """Whether ``node`` is a ``Reshape`` whose result depends on its input's size only, not its shape (no
    ``0`` meaning "copy this dim": ``allowzero=1``, or a constant shape without zeros)."""
    if node.op_type != "Reshape" or node.domain != "":
        return False
    if node.attributes.get_int("allowzero", 0) == 1:
        return True
    shape = require("onnx_ir").convenience.get_const_tensor(node.inputs[1])
    return shape is not None and 0 not in shape.numpy().tolist()


def _keeps_last_axis(view, value) -> bool:
    """Whether ``view`` is a ``Reshape`` whose input and output ``value`` share a known last axis."""
    if view is None or view.op_type != "Reshape" or view.domain != "":
        return False
    source = view.inputs[0]
    if source is None or source.shape is None or value.shape is None or source.shape.rank() < 1:
        return False
    width = value.shape[-1]
    return isinstance(width, int) and source.shape[-1] == width


def fuse_residual_adds(model) -> int:
    """Each ``Add → SimplifiedLayerNormalization`` of two tensors of one rank-2 or rank-3 shape as one
    ``SkipSimplifiedLayerNormalization``, whose sum output replaces the ``Add``'s wherever else it is read
    (the residual stream). Returns how many were fused."""
    ir = require("onnx_ir")
    graph = model.graph
    fused = 0
    for node in list(graph):
        if (node.domain, node.op_type) != ("", "SimplifiedLayerNormalization") or \
                node.attributes.get_int("axis", -1) != -1 or node.attributes.get_int("stash_type", 1) != 1:
            continue  # the Skip kernel normalizes the last axis, statistics in float32
        add = node.inputs[0].producer()
        if add is None or (add.domain, add.op_type) != ("", "Add") or add.outputs[0].is_graph_output():
            continue
        if not _same_known_shape(*add.inputs) or node.outputs[0].is_graph_output():
            continue
        a, b = add.inputs
        epsilon = node.attributes.get_float("epsilon", 1e-5)
        skip = ir.Node(_MS_DOMAIN, "SkipSimplifiedLayerNormalization", [a, b, node.inputs[1]],
                       [ir.AttrFloat32("epsilon", epsilon)], num_outputs=4, version=1)
        y, total = skip.outputs[0], skip.outputs[3]
        y.type, y.shape = node.outputs[0].type, node.outputs[0].shape
        total.type, total.shape = add.outputs[0].type, add.outputs[0].shape
        graph.insert_after(add, skip)  # where the sum was: every reader of it comes later
        node.outputs[0].replace_all_uses_with(y)
        add.outputs[0].replace_all_uses_with(total)
        graph.remove([node, add], safe=True)
        fused += 1
    if fused:
        model.opset_imports.setdefault(_MS_DOMAIN, 1)
        # γ may be computed between the Add and the norm (ones for a norm without weight)
        require("onnx_ir.passes.common").TopologicalSortPass()(model)
    return fused


def _same_known_shape(a, b) -> bool:
    """Whether ``a`` and ``b`` have one shape, every dim a number or a named symbol (two unknown dims
    may differ), of rank 2 or 3 (what ONNX Runtime's Skip kernels take): no broadcasting."""
    ir = require("onnx_ir")
    if a is None or b is None or a.shape is None or a.shape != b.shape or a.shape.rank() not in (2, 3):
        return False
    return all(isinstance(d, int) or (isinstance(d, ir.SymbolicDim) and d.value is not None) for d in a.shape)


def optimize_exported(model, target: str) -> dict[str, int]:
    """Both passes (the second for target ``onnxruntime``), then unused nodes removed; returns what each did."""
    common = require("onnx_ir.passes.common")
    done = {"views_moved": move_views_after_norms(model),
            "residual_adds_fused": fuse_residual_adds(model) if target == "onnxruntime" else 0}
    common.RemoveUnusedNodesPass()(model)
    return done
