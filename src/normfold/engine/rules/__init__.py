"""The one rules table: which ops keep a tensor zero-mean along a dimension.

The analysis asks: "is ``node`` zero-mean along ``dim`` (within contiguous groups of ``group``
elements, or over the whole dim when ``group`` is None) for every input?" Each rule answers with

- ``Requires(needs)``: yes, iff every listed (node, dim, group) is zero-mean;
- ``Source(kind, fqn)``: a leaf that is (``zero``, ``normalized``) or can be made (``parameter``) zero-mean;
- ``Break(reason)``: no.

Every rule is *exact*, not merely sufficient: with P the projection that removes the mean along
(dim, group), the op commutes with P — op(P·x) = P·op(x). Centering the sources then changes the
norm's input from x to P·x, which a LayerNorm cannot see (LN(x − c·1) = LN(x)). A rule that only
guarantees "zero-mean" without commuting (concatenating separately centered parts along the dim,
centering each head when the merged heads must be zero-mean jointly, zero padding along the dim)
would change the model, so those are Breaks. A question may also be asked jointly over a block of
dims (features split and permuted by layout ops); only layout rules answer those. Unknown ops
break: never a guess.

``_TABLE`` below is the one place that maps an aten op to its rules: its zero-mean rule and its
shift rule (see :func:`shift_passes`). This module holds the table and its lookups (``classify``,
``classify_part``, ``shift_passes``); the rules live by op family, each zero-mean rule next to its
shift rule and its exactness argument:

- ``elementwise.py``: copies, casts, eval dropout, arithmetic, literal zeros (and how operands
  broadcast, sums that cancel exactly, values provably equal);
- ``layout.py``: reshapes, permutations, transposes, broadcasts;
- ``indexing.py``: slices, selections, splits, cat, stack, padding;
- ``rows.py``: ops that treat every feature alike (masks, index writes, gather, repeat, roll, sliding windows,
  reductions over other dims, pooling, upsampling, grid sampling);
- ``linear_maps.py``: linear, matmul, attention, convolutions, embeddings and embedding bags (the parameter sources);
- ``norms.py``: norm calls, and a weightless LayerNorm's output as a source;
- ``casts.py``: casts that round in the float64 proof;
- ``parts.py``: questions about a part of a tensor (the rows of a fused projection);
- ``writes.py``: in-place writes and views, and which nodes are live;
- ``answers.py``: the question (``Need``, ``Part``) and its answers.

A new op is a row of the table and, where no existing rule fits, a rule (and its shift rule) in its
family's module. Which ops pass values on unchanged (copies, casts, eval dropout) and which are
norms is not the table's to say: ``op_kinds.py`` defines those once for every walk.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
from torch import fx

from ..graph import Captured, SymbolicSizeError, op_name, trace_shape
from ..graph import node_arg as _arg  # the short name reads better below
from ..op_kinds import CAST_OP_NAMES, COPY_OP_NAMES, DROPOUT_OP_NAMES, aten_packets, is_training_dropout
from .answers import Answer, Break, Need, Part, Requires, Source, make_need, part_need, rank
from .casts import rounding_cast
from .elementwise import (FULL_OPS, ZERO_OPS, cancelling_sum, shift_add_sub, shift_div, shift_dropout, shift_mul,
                          shift_same, zero_mean_add_sub, zero_mean_div, zero_mean_dropout, zero_mean_mul,
                          zero_mean_same_dim, zero_source)
from .indexing import (SPLIT_DIM_ARG, shift_cat, shift_support, shift_getitem, shift_index_select, shift_pad, shift_select,
                       shift_slice, shift_stack, zero_mean_cat, zero_mean_constant_pad, zero_mean_getitem,
                       zero_mean_index, zero_mean_index_select, zero_mean_pad, zero_mean_select, zero_mean_slice,
                       zero_mean_stack)
from .layout import (shift_expand, shift_numpy_t, shift_permute, shift_t, shift_transpose, shift_view,
                     zero_mean_expand, zero_mean_numpy_t, zero_mean_permute, zero_mean_t, zero_mean_transpose,
                     zero_mean_view)
from .linear_maps import (EMBEDDING_BAG_OP_NAMES, shift_linear, shift_mm, zero_mean_addmm, zero_mean_baddbmm, zero_mean_conv,
                          zero_mean_conv_transpose, zero_mean_embedding, zero_mean_linear, zero_mean_mm, zero_mean_sdpa)
from .norms import NormCall, layer_norm_source, norm_call
from .parts import cat_part, select_part, slice_part, split_part, sum_part, view_part
from .rows import (GRID_SAMPLER_OP_NAMES, SPATIAL_OP_NAMES, shift_gather, shift_grid_sample, shift_masked,
                   shift_reduce, shift_repeat, shift_roll, shift_spatial, shift_unfold, shift_where, zero_mean_gather,
                   zero_mean_grid_sample, zero_mean_index_copy, zero_mean_index_put, zero_mean_masked_fill,
                   zero_mean_masked_scatter, zero_mean_reduce_other_dims, zero_mean_repeat, zero_mean_roll, zero_mean_unfold,
                   zero_mean_spatial, zero_mean_where)
from .writes import in_place, live_nodes, shift_in_place, written_in_place, written_through_a_view

_aten = torch.ops.aten

# (aten op names, zero-mean rule, shift rule): the whole table, read top to bottom; an op listed twice
# takes its last rules. The shift column (None: the op does not pass a shift) is read by the
# closedness check: where a ones-vector shift that centering adds to an input comes out.
_TABLE: list[tuple[tuple[str, ...], Callable[[fx.Node, int, int | None], Answer], Callable | None]] = [
    # value-preserving: copies, casts, eval dropout
    ((*COPY_OP_NAMES, *CAST_OP_NAMES), zero_mean_same_dim, shift_same),
    (DROPOUT_OP_NAMES, zero_mean_dropout, shift_dropout),
    # arithmetic (in place: the same rule if nothing else reads the overwritten tensor)
    (("add", "sub"), zero_mean_add_sub, shift_add_sub),
    (("add_", "sub_"), in_place(zero_mean_add_sub), shift_in_place(shift_add_sub)),
    (("mul",), zero_mean_mul, shift_mul), (("mul_",), in_place(zero_mean_mul), shift_in_place(shift_mul)),
    (("div",), zero_mean_div, shift_div), (("div_",), in_place(zero_mean_div), shift_in_place(shift_div)),
    (("neg",), zero_mean_same_dim, shift_same),  # -P·x = P·(-x)
    # layout
    (("view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"),
     zero_mean_view, shift_view),
    (("permute",), zero_mean_permute, shift_permute),
    (("transpose", "swapaxes"), zero_mean_transpose, shift_transpose),
    (("t",), zero_mean_t, shift_t), (("numpy_T",), zero_mean_numpy_t, shift_numpy_t),
    (("expand", "expand_as", "broadcast_to"), zero_mean_expand, shift_expand),
    # indexing, joining, padding, reducing
    (("slice",), zero_mean_slice, shift_slice), (("select",), zero_mean_select, shift_select),
    (("index_select",), zero_mean_index_select, shift_index_select), (("index",), zero_mean_index, None),
    (("cat", "concat", "concatenate"), zero_mean_cat, shift_cat), (("stack",), zero_mean_stack, shift_stack),
    (("constant_pad_nd",), zero_mean_constant_pad, shift_pad), (("pad",), zero_mean_pad, None),
    (("mean", "sum"), zero_mean_reduce_other_dims, shift_reduce),
    # linear maps: zero-mean outputs iff the weight is centered (the parameter sources)
    (("linear",), zero_mean_linear, shift_linear), (("addmm",), zero_mean_addmm, None),
    (("mm", "matmul", "bmm"), zero_mean_mm, shift_mm), (("baddbmm",), zero_mean_baddbmm, None),
    (("scaled_dot_product_attention",), zero_mean_sdpa, None),
    (("conv1d", "conv2d", "conv3d"), zero_mean_conv, None),
    (("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"), zero_mean_conv_transpose, None),
    (("embedding",), zero_mean_embedding, None),
    # sources (a LayerNorm absorbs a shift of its input: the closedness check decides that, not this column)
    (("layer_norm",), layer_norm_source, None),
    # ops that treat every feature alike: whole rows moved, copied, averaged or zeroed, or a row's entries permuted
    (("masked_fill",), zero_mean_masked_fill, shift_masked),
    (("masked_fill_",), in_place(zero_mean_masked_fill), None),
    (("where",), zero_mean_where, shift_where),
    (("masked_scatter",), zero_mean_masked_scatter, shift_masked),
    (("masked_scatter_",), in_place(zero_mean_masked_scatter), None),
    (("index_put",), zero_mean_index_put, None), (("index_put_",), in_place(zero_mean_index_put), None),
    (("index_copy",), zero_mean_index_copy, None), (("index_copy_",), in_place(zero_mean_index_copy), None),
    (("gather",), zero_mean_gather, shift_gather),
    (("repeat", "tile"), zero_mean_repeat, shift_repeat),
    (("roll",), zero_mean_roll, shift_roll),
    (("unfold",), zero_mean_unfold, shift_unfold),
    (tuple(SPATIAL_OP_NAMES), zero_mean_spatial, shift_spatial),
    (GRID_SAMPLER_OP_NAMES, zero_mean_grid_sample, shift_grid_sample),
]
RULES: dict[object, Callable[[fx.Node, int, int | None], Answer]] = {
    packet: rule for names, rule, _ in _TABLE for packet in aten_packets(*names)}
RULES[operator.getitem] = zero_mean_getitem
RULES[_aten.convolution] = lambda n, d, g: zero_mean_conv(n, d, g, transposed_index=6, groups_index=8)
RULES.update(dict.fromkeys((*ZERO_OPS, *FULL_OPS), zero_source))
SHIFT_RULES: dict[object, Callable[[fx.Node, fx.Node, int], int | None]] = {
    packet: shift for names, _, shift in _TABLE if shift is not None for packet in aten_packets(*names)}
SHIFT_RULES[operator.getitem] = shift_getitem

SHIFT_ADDITIVE = set(aten_packets("add", "sub", "add_", "sub_", "cat", "concat", "concatenate", "stack"))

# rules that also answer for a block of dims (pure layout: copies, casts, reshapes, permutations; scaling by a number)
BLOCK_RULES = {zero_mean_same_dim, zero_mean_dropout, zero_mean_view, zero_mean_permute, zero_mean_transpose,
               zero_mean_t, zero_mean_numpy_t, layer_norm_source, zero_mean_mul, zero_mean_div}

# ops that only read metadata (shape, dtype): a change of their input's values cannot reach them
METADATA_OPS = set(aten_packets("_assert_tensor_metadata", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
                            "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones",
                            "new_empty", "new_full"))
# ops whose result is a list or tuple consumed through getitem (the getitem answers for its part)
MULTI_OUTPUT_OPS = set(aten_packets(*SPLIT_DIM_ARG, *EMBEDDING_BAG_OP_NAMES))
# op -> the argument read only for its shape (or dtype): ``expand_as(x, other)``, ``view_as(x, other)``
_SHAPE_SOURCE_ARG = {p: 1 for p in aten_packets("expand_as", "view_as", "reshape_as", "type_as")}


def classify(node: fx.Node, dim: int, group: int | None, captured: Captured) -> Answer:
    """Answer the zero-mean question for one node: the single entry point of the table."""
    writer = written_through_a_view(node)
    if writer is not None:  # later readers of node see what the write left, not what node computed
        return Break(f"written in place through a view by {op_name(writer)} (t[:, :k] = v): later readers "
                     "see what the write left, not what the op computed")
    if node.op == "placeholder":
        if node in captured.buffer_fqn:
            refused = _buffer_refusal(captured, node)
            if refused is not None:
                return refused
        fqn = captured.centerable_fqn(node)
        if fqn is not None and isinstance(dim, tuple):
            return Break(f"parameter {fqn} would be centered jointly over dims {dim}")
        if fqn is not None:
            return Source("parameter", fqn)
        return Break(f"model input {node.name} is not zero-mean by construction")
    if node.op != "call_function":  # get_attr constants and the like: not parameters, not centerable
        return Break(f"{node.op} node {node.name} is not in the rules table")
    if trace_shape(node) is None:
        return Break(f"{op_name(node)}: its output is not a tensor")
    rounding = rounding_cast(node, captured)
    if rounding is not None:
        return Break(rounding)
    key = getattr(node.target, "overloadpacket", node.target)
    rule = RULES.get(key)
    if rule is None:
        return Break(f"{op_name(node)} is not in the rules table (unknown ops break)")
    if isinstance(dim, tuple) and rule not in BLOCK_RULES:
        return Break(f"{op_name(node)} would need zero mean jointly over dims {dim} (only layout ops and scaling by a number allow that)")
    try:
        return rule(node, dim, group)
    except SymbolicSizeError as undecided:  # the rule needs a number the input decides
        return Break(str(undecided))


def _buffer_refusal(captured: Captured, node: fx.Node) -> Break | None:
    """A buffer is centered like a parameter when it is a constant saved with the weights (a persistent
    buffer the forward never writes: a sinusoidal position table); else why not."""
    fqn = captured.buffer_fqn[node]
    if fqn in captured.unsaved_buffers:
        return Break(f"buffer {fqn} is not saved with the weights (non-persistent: the model rebuilds it at load), "
                     "so a centered copy would not survive a reload")
    if fqn in captured.mutated_buffers or written_in_place(node) is not None:
        return Break(f"buffer {fqn} is written by the forward: state, not a constant that centering could change once")
    return None


def classify_part(need: Need, captured: Captured) -> Answer | None:
    """The answer for a question about a part of ``need.node``, or for a whole-node question that
    a selection turns into one about a part of its input; None where no rule knows parts, or where
    the part depends on a size the input decides (the caller then asks about the whole node with
    ``classify``, a stronger question)."""
    try:
        return _part_answer(need, captured)
    except SymbolicSizeError:
        return None


def _part_answer(need: Need, captured: Captured) -> Answer | None:
    node, dim, group = need.node, need.dim, need.group
    if node.op != "call_function" or isinstance(dim, tuple) or trace_shape(node) is None \
            or written_through_a_view(node) is not None:
        return None
    groups, where = (need.part.groups, dict(need.part.where)) if need.part is not None else (None, {})
    rule = RULES.get(getattr(node.target, "overloadpacket", node.target))
    if rounding_cast(node, captured) is not None:
        return None  # ``classify`` refuses it
    if rule in (zero_mean_same_dim, zero_mean_dropout) and not is_training_dropout(node) and isinstance(node.args[0], fx.Node):
        return Requires((part_need(node.args[0], dim, group, groups, where),))
    if rule is zero_mean_select:
        return select_part(node, dim, group, groups, where)
    if rule is zero_mean_slice:
        return slice_part(node, dim, group, groups, where)
    if rule is zero_mean_getitem:
        return split_part(node, dim, group, groups, where)
    if need.part is None:
        return None
    if rule is zero_mean_view:
        return view_part(node, dim, group, groups, where)
    if rule is zero_mean_add_sub:
        return sum_part(node, dim, group, groups, where)
    if rule is zero_mean_cat:
        return cat_part(node, dim, group, groups, where)
    if rule is zero_mean_linear and groups is not None and dim == rank(node) - 1:
        w, b = node.args[1], _arg(node, 2, "bias")  # output groups g of x·Wᵀ + b are rows g of W and b
        return Requires(tuple(part_need(p, 0, group, groups, ()) for p in (w, b) if p is not None))
    return None


# --------------------------------------------------------------------------- the shift column
#
# Centering a producer changes it from x to x − m·1 along a dim (m a per-row mean): a *ones-vector
# shift* δ that is constant along that dim. The shift column follows such a δ forward: a rule gets
# the dims along which the operand's δ is constant and returns the output dims along which
# op(x + δ) − op(x) is constant, for every x and δ of that form (empty or None: the op does not pass
# it). Exact, not merely sufficient; ops not in the column break. A rule decides only how δ flows
# through the operand it arrives on; ops outside SHIFT_ADDITIVE also need their other tensor
# operands unchanged (the closedness check verifies that). A LayerNorm over the last dim removes δ
# when the last dim is among them: LN(x + c·1) = LN(x).

Dims = tuple[int, ...]


def shift_passes(node: fx.Node, operand: fx.Node, dims: Dims) -> Dims | None:
    """The output dims of ``node`` along which a shift of ``operand``, constant along ``dims``, comes out
    constant; None when ``node`` does not pass it (unknown ops, nonlinearities, mixing those dims)."""
    if node.op != "call_function" or trace_shape(node) is None or trace_shape(operand) is None:
        return None
    rule = SHIFT_RULES.get(getattr(node.target, "overloadpacket", node.target))
    try:
        out = rule(node, operand, frozenset(dims)) if rule is not None else None
    except SymbolicSizeError:  # the rule needs a number the input decides: it does not pass the shift
        return None
    return tuple(sorted(out)) if out else None


def shift_is_additive(node: fx.Node, changed: Callable[[fx.Node], bool] = lambda n: True) -> bool:
    """The op's output change is the sum of each operand's own, so the other operands may change too:
    add, sub, cat, stack always; a linear layer when its input x does not change (``changed``), since
    x·(W + δW)ᵀ + (b + δb) = x·Wᵀ + b + x·δWᵀ + δb (a changing x would add the product δx·δWᵀ)."""
    if node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", None)
    if packet in SHIFT_ADDITIVE:
        return True
    return packet is _aten.linear and isinstance(node.args[0], fx.Node) and not changed(node.args[0])


def reads_only_shape(user: fx.Node, operand: fx.Node) -> bool:
    """``user`` reads ``operand`` only for its shape, dtype or device: a change of its values cannot reach it
    (``sym_size``, ``new_zeros``, ``zeros_like``, the second argument of ``expand_as`` / ``view_as`` ...)."""
    packet = getattr(user.target, "overloadpacket", None) if user.op == "call_function" else None
    if packet in METADATA_OPS:
        return True
    index = _SHAPE_SOURCE_ARG.get(packet)
    if index is None:
        return False
    value_args = [a for i, a in enumerate(user.args) if i != index] + list(user.kwargs.values())
    return len(user.args) > index and user.args[index] is operand and operand not in value_args


# what the analysis, the norm forms and rotation's closure check read from the rules
__all__ = ["Answer", "BLOCK_RULES", "Break", "METADATA_OPS", "MULTI_OUTPUT_OPS", "Need", "NormCall", "Part", "RULES",
           "Requires", "SHIFT_ADDITIVE", "SHIFT_RULES", "Source", "cancelling_sum", "classify", "classify_part",
           "live_nodes", "make_need", "norm_call", "reads_only_shape", "rounding_cast", "shift_is_additive", "shift_support",
           "shift_passes"]
