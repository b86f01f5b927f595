"""Questions about a part of a tensor: only the rows of a fused projection that reach a norm, or only
the class-token row of a residual stream.

A norm may read only a part of a tensor: q = qkv.view(B, T, H, 3, D)[..., 0, :] reads the q rows of
a fused projection. The question is then asked of that part alone, so that only the output rows of
the fused weight that reach a norm are centered, per group (head), and the v rows stay as they are.
``rules.classify_part`` answers such questions with the functions here for the ops that pick or move
parts (selections, reshapes, copies, joins), for sums (each operand at the same place) and for the
Linear that makes them; every other op is asked
about the whole tensor (``classify``), which requires more and is therefore never wrong. Which
elements centering then changes, and that no other reader sees them, the analysis checks
(``analysis._FoldingSet``).
"""
from __future__ import annotations

import math

from torch import fx

from ..graph import node_arg as _arg  # the short name reads better below
from ..graph import trace_shape
from .answers import Requires, part_need, rank
from .elementwise import cancelling_sum, is_self_difference
from .indexing import SPLIT_DIM_ARG, cat_offsets, split_sizes
from .layout import view_groups


def _picked(x: fx.Node, out_dim: int, ds: int, group, groups, where, indices: list[int], keep_dim: bool) -> Requires:
    """The need on ``x`` of an op that reads ``indices`` of its dim ``ds`` (another dim than the
    asked one): the output dims map back past ``ds`` (dropped by a select), and a part along ``ds``
    maps each output index to the input index it reads."""
    back = (lambda d: d) if keep_dim else (lambda d: d if d < ds else d + 1)
    moved = {back(d): s for d, s in where.items() if keep_dim is False or d != ds}
    moved[ds] = frozenset(indices[i] for i in where[ds]) if keep_dim and ds in where else frozenset(indices)
    return Requires((part_need(x, back(out_dim), group, groups, moved),))


def select_part(node, dim, group, groups, where):
    x = node.args[0]
    ds = node.args[1] % rank(x)
    return _picked(x, dim, ds, group, groups, where, [node.args[2] % trace_shape(x)[ds]], keep_dim=False)


def slice_part(node, dim, group, groups, where):
    x = node.args[0]
    ds = _arg(node, 1, "dim", 0) % rank(x)
    total = trace_shape(x)[ds]
    start, stop, step = (_arg(node, i, name, default) for i, name, default in
                         ((2, "start", 0), (3, "end", total), (4, "step", 1)))
    indices = list(range(total))[slice(start, stop, step)]
    if ds == dim:
        return _groups_of_part(x, dim, group, groups, where, indices) if step == 1 and indices else None
    return _picked(x, dim, ds, group, groups, where, indices, keep_dim=True)


def _groups_of_part(x: fx.Node, dim: int, group, groups, where, indices: list[int]) -> Requires | None:
    """A contiguous part of the asked dim itself (``qkv.view(B, T, H, 3·D).split(D, -1)``'s q): its
    groups (the whole part, or its groups of ``group``) as groups of that dim of ``x``, when they
    align; None otherwise (the whole-node rule then decides)."""
    start, length, total = indices[0], len(indices), trace_shape(x)[dim]
    g = group or length
    if start % g or length % g or total % g:
        return None
    picked = [start // g + j for j in range(length // g) if groups is None or j in groups]
    return Requires((part_need(x, dim, g, picked, where),))


def split_part(node, dim, group, groups, where):
    src, index = node.args
    name = str(getattr(getattr(src, "target", None), "overloadpacket", "")).removeprefix("aten.")
    if name not in SPLIT_DIM_ARG:
        return None
    x = src.args[0]
    ds = _arg(src, SPLIT_DIM_ARG[name], "dim", 0) % rank(x)
    if name == "unbind":
        return _picked(x, dim, ds, group, groups, where, [index], keep_dim=False)
    sizes = split_sizes(src, ds)
    start = sum(sizes[:index])
    indices = list(range(start, start + sizes[index]))
    if ds == dim:
        return _groups_of_part(x, dim, group, groups, where, indices) if indices else None
    return _picked(x, dim, ds, group, groups, where, indices, keep_dim=True)


def view_part(node, dim, group, groups, where):
    """A reshape that splits one input dim into (..., dim) with the asked dim innermost: the asked
    part is a set of contiguous groups of that input dim (qkv (B, T, 3·H·D) viewed as (B, T, H, 3, D):
    q's rows are the groups h·3 + 0 of D elements; viewed as (B, T, H, 3·D), q is group 0 of each
    head's 3·D, the groups h·3 + 0 again). Parts along dims the reshape keeps carry over;
    parts along dims it merges otherwise are dropped (asking about more is never wrong)."""
    x = node.args[0]
    in_s, out_s = trace_shape(x), trace_shape(node)
    blocks = view_groups(in_s, out_s)
    ins, outs = next((i, o) for i, o in blocks if dim in o)
    kept = {i_dims[0]: where[o_dims[0]] for i_dims, o_dims in blocks
            if len(i_dims) == len(o_dims) == 1 and o_dims[0] in where and in_s[i_dims[0]] == out_s[o_dims[0]]
            and o_dims[0] not in outs}
    if len(outs) == 1 and len(ins) > 1 and groups is not None:
        return _merged_view_part(x, list(ins), group or out_s[dim], groups, kept)
    if len(ins) != 1 or dim != outs[-1]:
        return None
    k, g = ins[0], group or out_s[dim]
    inner = [d for d in outs if d != dim]
    if groups is None and not any(d in where for d in inner):
        return None  # nothing asked inside the block: the whole-node rule maps it
    sizes = [out_s[d] for d in inner]
    per_prefix = out_s[dim] // g
    picked = [prefix * per_prefix + j for prefix in range(math.prod(sizes)) for j in range(per_prefix)
              if (groups is None or j in groups)
              and all(i in where.get(d, range(out_s[d])) for d, i in zip(inner, _digits(prefix, sizes)))]
    return Requires((part_need(x, k, g, picked, kept),))


def _merged_view_part(x: fx.Node, ins: list[int], g: int, groups, kept: dict) -> Requires | None:
    """Groups of ``g`` elements of an output dim that merges input dims ``ins`` ((H, 3, D) -> (H, 3·D):
    group 0 of each head's 3·D is index 0 of the 3 dim), as a part of ``x``: when ``g`` divides the
    innermost input dim and the groups are a product of indices along each merged dim (else None:
    the whole-node rule decides)."""
    in_s = trace_shape(x)
    k = ins[-1]
    if in_s[k] % g:
        return None
    per, outer = in_s[k] // g, [in_s[d] for d in ins[:-1]]
    digits = [(*_digits(group // per, outer), group % per) for group in groups]
    along = [frozenset(d[i] for d in digits) for i in range(len(ins))]
    if math.prod(len(a) for a in along) != len(set(digits)):
        return None
    return Requires((part_need(x, k, g, along[-1], {**kept, **dict(zip(ins[:-1], along[:-1]))}),))


def _digits(flat: int, sizes: list[int]) -> list[int]:
    """The multi-index of ``flat`` over ``sizes`` (row-major)."""
    out = []
    for size in reversed(sizes):
        flat, digit = divmod(flat, size)
        out.append(digit)
    return out[::-1]


def sum_part(node, dim, group, groups, where):
    """a ± b read at a part: each output element is a's and b's at the same place (broadcast), so the
    part of each operand that lands there (CvT's cls row of the residual stream, its patch rows left
    alone). None where an operand is a number or is broadcast along the asked dim (the whole-node
    rule decides those)."""
    if is_self_difference(node) or cancelling_sum(node) is not None:  # the whole-node rule knows these
        return None
    needs = []
    for operand in (node.args[0], _arg(node, 1, "other")):
        if not isinstance(operand, fx.Node) or trace_shape(operand) is None:
            return None
        s_out, s_in = trace_shape(node), trace_shape(operand)
        lead = len(s_out) - len(s_in)
        if dim - lead < 0 or s_in[dim - lead] != s_out[dim]:
            return None
        moved = {d - lead: (frozenset({0}) if s_in[d - lead] == 1 else s) for d, s in where.items() if d >= lead}
        needs.append(part_need(operand, dim - lead, group, groups, moved))
    return Requires(tuple(needs))


def cat_part(node, dim, group, groups, where):
    """cat along a dim the part picks indices of: each index is one operand's, so only the operands the
    part reaches are asked, about their own indices (torch.cat((cls, patches), 1)[:, 0] is cls)."""
    dc = _arg(node, 1, "dim", 0) % rank(node)
    if dc == dim or dc not in where:
        return None
    if any(trace_shape(operand) is None for operand in node.args[0]):
        return None
    needs = []
    for operand, start in cat_offsets(node):
        picked = frozenset(i - start for i in where[dc] if start <= i < start + trace_shape(operand)[dc])
        if picked:
            needs.append(part_need(operand, dim, group, groups, {**where, dc: picked}))
    return Requires(tuple(needs))
