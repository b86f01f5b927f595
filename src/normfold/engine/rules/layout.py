"""Layout ops: reshapes, permutations, transposes and broadcasts.

They move values without changing them, so a question about an output dim is the same question
about the input dim it came from (P commutes with any relabelling of dims). A reshape that merges
dims into the asked one asks about them jointly, as a block: only layout rules (and scaling by a
number) answer block questions.
"""
from __future__ import annotations

import math

from ..graph import trace_shape
from .answers import Break, Requires, collect, make_need, only_at, rank
from .elementwise import broadcast_dims, broadcast_operand, shift_same


def map_view_dim(in_s: tuple[int, ...], out_s: tuple[int, ...], dim, group: int | None):
    """Input (dim, group) equivalent to output (dim, group) under a reshape, or a Break reason.

    ``dim`` is an output dim or a block of contiguous output dims. Same extent: the matching input
    dim. Output extent is the inner factor of a split input dim (C → H·D): that input dim per group
    of D. Output extent merges input dims j..k (H·D → C): the block (j..k) for a whole-dim question,
    or dim k when the group divides it.
    """
    first, last = (min(dim), max(dim)) if isinstance(dim, tuple) else (dim, dim)
    if isinstance(dim, tuple) and sorted(dim) != list(range(first, last + 1)):
        return f"reshape {in_s} -> {out_s}: dims {dim} are not next to each other"
    n = math.prod(out_s[first:last + 1])
    if n == 1:
        return "reshape: the normalized dim has size 1"
    inner_out = math.prod(out_s[last + 1:])
    k = next((j for j in range(len(in_s) - 1, -1, -1)
              if math.prod(in_s[j + 1:]) == inner_out and in_s[j] != 1), None)
    if k is None:
        return f"reshape {in_s} -> {out_s} does not keep dim {dim} contiguous"
    g = group if group is not None else n
    if in_s[k] == n:
        return k, group
    if in_s[k] % n == 0:  # split: the output extent is the inner factor of input dim k
        return k, g
    if n % in_s[k] == 0:  # merge of input dims j..k
        size, j = in_s[k], k
        while size < n and j > 0:
            j -= 1
            size *= in_s[j]
        if size != n:
            return f"reshape {in_s} -> {out_s} mixes the normalized dim with others"
        if group is None:  # P over the merged extent = P jointly over the input block j..k
            return tuple(d for d in range(j, k + 1) if in_s[d] != 1), None
        if in_s[k] % group == 0:
            return k, group
        return (f"reshape {in_s} -> {out_s} merges dims into the normalized dim: groups of {group} "
                "straddle the merged dims")
    return f"reshape {in_s} -> {out_s} mixes the normalized dim with others"


def zero_mean_view(node, dim, group):
    x = node.args[0]
    mapped = map_view_dim(trace_shape(x), trace_shape(node), dim, group)
    if isinstance(mapped, str):
        return Break(mapped)
    return Requires((make_need(x, *mapped),))


def view_groups(in_s: tuple[int, ...], out_s: tuple[int, ...]) -> list[tuple[range, range]]:
    """A reshape as its smallest blocks of input dims and output dims holding the same elements
    ((6, 4) -> (2, 3, 4): [(0..0, 0..1), (1..1, 2..2)]); size-1 dims join the block next to them."""
    groups, i, j = [], 0, 0
    while i < len(in_s) or j < len(out_s):
        i0, j0 = i, j
        a = in_s[i] if i < len(in_s) else 1
        b = out_s[j] if j < len(out_s) else 1
        i, j = min(i + 1, len(in_s)), min(j + 1, len(out_s))
        while a != b:
            if (i >= len(in_s) and a < b) or (j >= len(out_s) and b < a):  # not a reshape (empty tensors)
                return [(range(len(in_s)), range(len(out_s)))]
            if a < b:
                a, i = a * in_s[i], i + 1
            else:
                b, j = b * out_s[j], j + 1
        groups.append((range(i0, i), range(j0, j)))
    return groups


def shift_view(node, operand, dims):
    """A reshape: an output dim is constant where every input dim of its block (size > 1) is."""
    if not only_at(node, operand, 0):
        return None
    in_s, out_s = trace_shape(operand), trace_shape(node)
    out = set()
    for ins, outs in view_groups(in_s, out_s):
        if all(d in dims or in_s[d] == 1 for d in ins):
            out.update(outs)
    return out


def _each(dim, mapping):
    """Apply a dim mapping to a dim or to every dim of a block."""
    return tuple(mapping(d) for d in dim) if isinstance(dim, tuple) else mapping(dim)


def zero_mean_permute(node, dim, group):
    dims = [d % rank(node) for d in node.args[1]]
    return Requires((make_need(node.args[0], _each(dim, lambda d: dims[d]), group),))


def shift_permute(node, operand, dims):
    order = [d % rank(node) for d in node.args[1]]
    return {k for k, d in enumerate(order) if d in dims} if only_at(node, operand, 0) else None


def zero_mean_transpose(node, dim, group):
    r = rank(node)
    a, b = node.args[1] % r, node.args[2] % r
    return Requires((make_need(node.args[0], _each(dim, lambda d: b if d == a else a if d == b else d), group),))


def shift_transpose(node, operand, dims):
    r = rank(node)
    a, b = node.args[1] % r, node.args[2] % r
    return {b if d == a else a if d == b else d for d in dims} if only_at(node, operand, 0) else None


def zero_mean_t(node, dim, group):
    two_d = rank(node) == 2
    return Requires((make_need(node.args[0], _each(dim, lambda d: 1 - d if two_d else d), group),))


def shift_t(node, operand, dims):
    return {1 - d for d in dims} if rank(node) == 2 and only_at(node, operand, 0) else shift_same(node, operand, dims)


def zero_mean_numpy_t(node, dim, group):
    r = rank(node)
    return Requires((make_need(node.args[0], _each(dim, lambda d: r - 1 - d), group),))  # reverses all dims


def shift_numpy_t(node, operand, dims):
    return {rank(node) - 1 - d for d in dims} if only_at(node, operand, 0) else None


def zero_mean_expand(node, dim, group):
    return collect(node, [broadcast_operand(node, node.args[0], dim, group)])


def shift_expand(node, operand, dims):
    """Broadcasting copies δ along new or size-1 dims: constant along those too."""
    return broadcast_dims(node, operand, dims) if only_at(node, operand, 0) else None
