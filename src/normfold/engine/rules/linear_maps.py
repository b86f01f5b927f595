"""Linear maps: linear, addmm, matmul, attention's value mixing, convolutions, embeddings.

y = x·Wᵀ + b has zero-mean rows (along the output features) iff W's columns and b are zero-mean over
the outputs: these rules turn the question into one about the weight, a parameter source the fold
centers. Along another dim (a batch or position) a linear map combines whole rows of its input.
"""
from __future__ import annotations

from ..graph import node_arg as _arg  # the short name reads better in the rules below
from ..graph import op_name, trace_shape
from .answers import Break, Requires, collect, make_need, only_at, rank
from .elementwise import broadcast_operand


def zero_mean_linear(node, dim, group):
    x, w, b = node.args[0], node.args[1], _arg(node, 2, "bias")
    if dim == rank(node) - 1:  # y = x·Wᵀ + b: zero-mean rows iff W's columns and b are (over outputs)
        return collect(node, [make_need(w, 0, group), make_need(b, 0, group) if b is not None else None])
    if b is not None:
        return Break(f"{op_name(node)} with a bias, along a non-feature dim")
    return Requires((make_need(x, dim, group),))


def shift_linear(node, operand, dims):
    """How a shift of one operand of x·Wᵀ + b comes out:

    x + δ:  + δ·Wᵀ, constant along δ's dims except the features, which W mixes;
    W + δ, δ[o, i] = c_i (constant along the output rows, what centering W adds): + x·δᵀ, whose entry o
            is Σ_i x_i·c_i for every o, so constant along the output features only;
    b + δ, δ = c·1: + c·1, constant along every output dim (b is broadcast over the leading dims).
    """
    last = rank(operand) - 1
    if only_at(node, operand, 0):
        return {d + rank(node) - rank(operand) for d in dims if d != last}
    if only_at(node, operand, 1) and rank(operand) == 2:
        return {rank(node) - 1} if 0 in dims else None
    if only_at(node, operand, 2) and rank(operand) == 1:
        return set(range(rank(node))) if 0 in dims else None
    return None


def zero_mean_addmm(node, dim, group):
    b, x, w = node.args[0], node.args[1], node.args[2]
    if dim != 1:
        return Break(f"{op_name(node)} along its row dim")
    return collect(node, [make_need(w, 1, group), broadcast_operand(node, b, dim, group)])


def _matmul_like(node, dim, group, a, b, bias=None):
    r = rank(node)
    if rank(b) < 2 or rank(a) < 1:
        return Break(f"{op_name(node)} with a vector operand")
    if dim == r - 1:  # out = a·b: every output row is a combination of b's rows
        return collect(node, [make_need(b, rank(b) - 1, group),
                               broadcast_operand(node, bias, dim, group) if bias is not None else None])
    if dim == r - 2 and rank(a) >= 2 and bias is None:
        return Requires((make_need(a, rank(a) - 2, group),))
    return Break(f"{op_name(node)} along a batch dim")


def zero_mean_mm(node, dim, group):
    return _matmul_like(node, dim, group, node.args[0], node.args[1])


def shift_mm(node, operand, dims):
    """(a + δ)·b = a·b + δ·b, constant along the rows where δ is; a·(b + δ), along the columns."""
    a, b = node.args[0], node.args[1]
    if a is b or rank(a) < 2 or rank(b) < 2:
        return None
    if operand is a and rank(a) - 2 in dims:
        return {rank(node) - 2}
    if operand is b and rank(b) - 1 in dims:
        return {rank(node) - 1}
    return None


def zero_mean_baddbmm(node, dim, group):
    return _matmul_like(node, dim, group, node.args[1], node.args[2], bias=node.args[0])


def zero_mean_sdpa(node, dim, group):
    v = node.args[2]
    if _arg(node, 4, "dropout_p", 0.0):
        return Break(f"{op_name(node)} with dropout")
    if dim != rank(node) - 1:
        return Break(f"{op_name(node)} along a non-head dim")
    return Requires((make_need(v, rank(v) - 1, group),))  # softmax(QKᵀ)·V: rows combine V's rows


def zero_mean_conv(node, dim, group, *, transposed_index=None, groups_index=6):
    x, w, b = node.args[0], node.args[1], _arg(node, 2, "bias")
    transposed = bool(node.args[transposed_index]) if transposed_index is not None and len(node.args) > transposed_index else False
    groups = _arg(node, groups_index, "groups", 1)
    channel = 1 if rank(node) == rank(w) else 0
    if dim != channel:
        return Break(f"{op_name(node)} along a non-channel dim")
    if groups != 1 and (transposed or not _within_conv_groups(trace_shape(node)[channel] // groups, group)):
        return Break(f"{op_name(node)} with groups={groups} is not a dense map over channels"
                     f"{'' if transposed else ' (only blocks inside one conv group are)'}")
    wdim = 1 if transposed else 0
    return collect(node, [make_need(w, wdim, group), make_need(b, 0, group) if b is not None else None])


def _within_conv_groups(per_conv_group: int, group: int | None) -> bool:
    """A grouped conv's output block of ``group`` channels lies inside one conv group (blocks tile each
    conv group): all its channels read the same inputs, y_o = Σ_j W[o, j] ⋆ x_j, so Σ_block y_o =
    Σ_j (Σ_block W[o, j]) ⋆ x_j, and centering W (and b) per block along the outputs is exact.
    A larger block or the whole dim spans groups that read different inputs: no weight centering commutes."""
    return group is not None and per_conv_group % group == 0


def zero_mean_conv_transpose(node, dim, group):
    x, w = node.args[0], node.args[1]
    groups = _arg(node, 6, "groups", 1)
    if dim != (1 if rank(node) == rank(w) else 0) or groups != 1:
        return Break(f"{op_name(node)} along a non-channel dim or with groups={groups}")
    b = _arg(node, 2, "bias")
    return collect(node, [make_need(w, 1, group), make_need(b, 0, group) if b is not None else None])


def zero_mean_embedding(node, dim, group):
    if dim != rank(node) - 1:
        return Break(f"{op_name(node)} along an index dim")
    return Requires((make_need(node.args[0], 1, group),))  # rows of W are gathered whole


EMBEDDING_BAG_OP_NAMES = ("_embedding_bag", "embedding_bag", "_embedding_bag_forward_only")
_BAG_MODES = ("sum", "mean", "max")  # an embedding bag's ``mode`` argument, by its number


def zero_mean_embedding_bag(node, dim, group):
    """The bags (output 0, ``node``) of an embedding bag (Kimi-K2.5's interpolated position table): with
    mode sum or mean each bag is a weighted sum of whole rows of W, y_b = Σ_i s_i W[idx_i] (mean: s_i =
    1 / count), so P·W gives P·y and centering W is exact; mode max picks each feature from its own row."""
    bag = node.args[0]
    mode = _BAG_MODES[_arg(bag, 4, "mode", 0)]
    if dim != rank(node) - 1:
        return Break(f"{op_name(bag)} along its bag dim")
    if mode == "max":
        return Break(f"{op_name(bag)} with mode max: each feature comes from its own row")
    return Requires((make_need(bag.args[0], 1, group),))


def shift_embedding_bag(node, operand, dims):
    """An embedding bag (sum or mean) is linear in W: a shift of W constant along its features (dim 1) gives
    each bag Σ_i s_i δ[idx_i], constant along the features too (``node``: the bag op, asked at its getitem 0);
    mode max, or a shift through the indices or weights: none passes."""
    if not only_at(node, operand, 0) or 1 not in dims or _BAG_MODES[_arg(node, 4, "mode", 0)] == "max":
        return None
    return {1}
