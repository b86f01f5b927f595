"""Indexing, joining and padding: slices, selections, splits, index_select, cat, stack, pad.

Along another dim than the asked one these move whole rows, so the question passes to the input.
Along the asked dim itself, a part is zero-mean by centering the input only when the part is made
of whole groups (P_g(x)[part] = P_g(x[part])); joining separately centered parts, or padding with
zeros, would center each part and not the whole, so those break.
"""
from __future__ import annotations

import math

from torch import fx

from ..graph import node_arg as _arg  # the short name reads better in the rules below
from ..graph import SymbolicSizeError, op_name, static_dim, trace_shape
from .answers import Break, Requires, make_need, only_at, rank
from .linear_maps import EMBEDDING_BAG_OP_NAMES, shift_embedding_bag, zero_mean_embedding_bag
from .norms import norm_call, norm_output_source


# the ops that split a tensor into a list read through getitem -> the index of their dim argument
SPLIT_DIM_ARG = {"split": 2, "split_with_sizes": 2, "unsafe_split": 2, "chunk": 2, "tensor_split": 2, "unbind": 1}


def _aligned_part(node, x, part_dim: int, dim: int, group, start: int, length: int):
    """A contiguous part [start, start+length) of x along dim: exact iff groups align."""
    if part_dim != dim:
        return Requires((make_need(x, dim, group),))
    total = trace_shape(x)[dim]
    if start == 0 and length == total:
        return Requires((make_need(x, dim, group),))
    g = group if group is not None else length
    if start % g == 0 and length % g == 0 and total % g == 0:  # P_g(x)[part] = P_g(x[part])
        return Requires((make_need(x, dim, g),))
    return Break(f"{op_name(node)} takes a part of the normalized dim that is not a whole group")


def slice_start(node) -> tuple[int, int]:
    """(dim, first index) a slice node reads of its input, the start clamped as Python clamps it."""
    x = node.args[0]
    ds = _arg(node, 1, "dim", 0) % rank(x)
    total = trace_shape(x)[ds]
    start = _arg(node, 2, "start", 0) or 0
    return ds, min(max(start + total if start < 0 else start, 0), total)


def cat_offsets(node) -> list[tuple[fx.Node, int]]:
    """(operand, index of its first entry along the joined dim) for each operand of a cat node that holds
    entries (torch.cat skips empty tensors, legacy 1-D empties too)."""
    dc, start, spans = _arg(node, 1, "dim", 0) % rank(node), 0, []
    for part in node.args[0]:
        shape = trace_shape(part)
        if shape is None or math.prod(shape) == 0:
            continue
        spans.append((part, start))
        start += shape[dc]
    return spans


def zero_mean_slice(node, dim, group):
    x = node.args[0]
    ds, start = slice_start(node)
    step = _arg(node, 4, "step", 1)
    if ds == dim and step != 1:
        return Break(f"{op_name(node)} with step {step} along the normalized dim")
    return _aligned_part(node, x, ds, dim, group, start, trace_shape(node)[ds])


def shift_slice(node, operand, dims):
    """Any part of a constant run (even along the dim itself, with any step) is constant."""
    return dims if only_at(node, operand, 0) else None


def zero_mean_select(node, dim, group):
    ds = node.args[1] % rank(node.args[0])
    return Requires((make_need(node.args[0], dim if dim < ds else dim + 1, group),))


def shift_select(node, operand, dims):
    ds = node.args[1] % rank(operand)
    return {d if d < ds else d - 1 for d in dims if d != ds} if only_at(node, operand, 0) else None


def zero_mean_index_select(node, dim, group):
    ds = node.args[1] % rank(node.args[0])
    if ds == dim:
        return Break(f"{op_name(node)} picks entries along the normalized dim")
    return Requires((make_need(node.args[0], dim, group),))


def shift_index_select(node, operand, dims):
    return dims if only_at(node, operand, 0) else None  # picked entries of a constant run are constant


def zero_mean_index(node, dim, group):
    x, indices = node.args[0], list(node.args[1])
    r_in = rank(x)
    last_untouched = len(indices) < r_in or indices[r_in - 1] is None
    if dim == rank(node) - 1 and last_untouched and trace_shape(node)[-1] == trace_shape(x)[-1]:
        return Requires((make_need(x, r_in - 1, group),))
    return Break(f"{op_name(node)}: advanced indexing that touches the normalized dim")


def zero_mean_getitem(node, dim, group):
    src, index = node.args
    packet = getattr(getattr(src, "target", None), "overloadpacket", None)
    name = str(packet).removeprefix("aten.") if packet is not None else None
    call = norm_call(src) if isinstance(src, fx.Node) else None
    if call is not None and call.output is node:
        return norm_output_source(call, node, dim, group)
    if name in EMBEDDING_BAG_OP_NAMES and index == 0:
        return zero_mean_embedding_bag(node, dim, group)
    if name not in SPLIT_DIM_ARG:
        return Break(f"getitem of {op_name(src) if isinstance(src, fx.Node) else src!r} is not in the rules table")
    x = src.args[0]
    ds = _arg(src, SPLIT_DIM_ARG[name], "dim", 0) % rank(x)
    if name == "unbind":
        return Requires((make_need(x, dim if dim < ds else dim + 1, group),))
    try:
        sizes = split_sizes(src, ds)
    except SymbolicSizeError:
        if ds == dim:
            raise
        return Requires((make_need(x, dim, group),))  # every part at once: stronger than this part, never wrong
    return _aligned_part(node, x, ds, dim, group, sum(sizes[:index]), sizes[index])


def split_sizes(src, ds: int) -> list[int]:
    """The sizes along ``ds`` of the parts of a split, chunk or unbind; SymbolicSizeError when one is
    decided by the input's values (a split at data-dependent sizes: PaddleOCR-VL's per-image patches)."""
    sizes = [static_dim(v, ds) for v in src.meta["val"]]
    if None in sizes:
        raise SymbolicSizeError(f"{op_name(src)} into parts whose sizes depend on the input's values")
    return sizes


def shift_getitem(node, operand, dims):
    """A part of a split along any dim keeps its constant runs; unbinding a dim drops it."""
    src = node.args[0]
    packet = getattr(getattr(src, "target", None), "overloadpacket", None) if isinstance(src, fx.Node) else None
    name = str(packet).removeprefix("aten.") if packet is not None else None
    if name in EMBEDDING_BAG_OP_NAMES:  # the bags (output 0) carry it; the offsets and counts do not
        return shift_embedding_bag(src, operand, dims) if node.args[1] == 0 else None
    if name not in SPLIT_DIM_ARG or src.args[0] is not operand:
        return None
    ds = _arg(src, SPLIT_DIM_ARG[name], "dim", 0) % rank(operand)
    return {d if d < ds else d - 1 for d in dims if d != ds} if name == "unbind" else dims


def zero_mean_cat(node, dim, group):
    parts = [p for p in node.args[0] if trace_shape(p) is not None and math.prod(trace_shape(p)) > 0]
    dc = _arg(node, 1, "dim", 0) % rank(node)
    if dc != dim:
        return Requires(tuple(make_need(p, dim, group) for p in parts))
    if group is not None and all(trace_shape(p)[dim] % group == 0 for p in parts):
        return Requires(tuple(make_need(p, dim, group) for p in parts))
    return Break(f"{op_name(node)} along the normalized dim: centering each part does not center the whole")


def shift_cat(node, operand, dims):
    """Joined with parts shifted on their own (or not at all): constant along every dim but the joined one."""
    if rank(operand) != rank(node):
        return None
    return dims - {_arg(node, 1, "dim", 0) % rank(node)}


def zero_mean_stack(node, dim, group):
    ds = _arg(node, 1, "dim", 0) % rank(node)
    if ds == dim:
        return Break(f"{op_name(node)} along the normalized dim")
    return Requires(tuple(make_need(p, dim if dim < ds else dim - 1, group) for p in node.args[0]))


def shift_stack(node, operand, dims):
    ds = _arg(node, 1, "dim", 0) % rank(node)
    return {d if d < ds else d + 1 for d in dims}


def zero_mean_pad(node, dim, group):
    if _arg(node, 2, "mode", "constant") != "constant":
        return Break(f"{op_name(node)} in {_arg(node, 2, 'mode')!r} mode")
    return zero_mean_constant_pad(node, dim, group, value=_arg(node, 3, "value", 0) or 0)


def zero_mean_constant_pad(node, dim, group, value=None):
    pad = list(node.args[1])
    value = _arg(node, 2, "value", 0) if value is None else value
    if value != 0:
        return Break(f"{op_name(node)} pads with {value}")
    r = rank(node)
    k = r - 1 - dim  # pad lists (left, right) pairs from the last dim backwards
    if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
        return Break(f"{op_name(node)} pads the normalized dim: the zeros shift its mean")
    return Requires((make_need(node.args[0], dim, group),))


def shift_pad(node, operand, dims):
    """Padding with a constant: the change is δ inside and 0 in the padding, constant along unpadded dims."""
    pad = list(node.args[1])
    r = rank(node)
    padded = {r - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]}
    return dims - padded if only_at(node, operand, 0) else None


# --------------------------------------------------------------------------- where a shift is not zero
#
# The shift column says along which dims a centering shift is constant; these say where it can be
# non-zero at all: per dim, a range [start, stop) of indices (a dim absent from the support: anywhere).
# Joining a shifted tensor to others confines its shift to its own indices; a slice or a select that
# leaves them out drops the shift (X-CLIP's message token: appended to the frame's tokens, run through
# the block, sliced off again). Every other op forgets the support (anywhere), which asks more of the
# closedness check and is therefore never wrong.

Support = tuple  # sorted ((dim, start, stop), ...)


def shift_support(node, operand, support: Support) -> Support | None:
    """Where ``node``'s output shift can be non-zero when ``operand``'s is non-zero only in ``support``;
    None when the op drops it entirely (nothing of the shifted indices is read)."""
    packet = str(getattr(node.target, "overloadpacket", "")).removeprefix("aten.") if node.op == "call_function" else ""
    ranges = {d: (a, b) for d, a, b in support}
    shape = trace_shape(node)
    if packet in ("cat", "concat", "concatenate") and trace_shape(operand) is not None and rank(operand) == rank(node):
        dc = _arg(node, 1, "dim", 0) % rank(node)
        starts = [start for part, start in cat_offsets(node) if part is operand]
        if len(starts) != 1:  # joined twice (or not at all): its indices are not one range
            return ()
        a, b = ranges.get(dc, (0, trace_shape(operand)[dc]))
        ranges[dc] = (starts[0] + a, starts[0] + b)
        return tuple(sorted((d, a, b) for d, (a, b) in ranges.items()))
    if packet == "slice" and only_at(node, operand, 0) and _arg(node, 4, "step", 1) == 1:
        ds, start = slice_start(node)
        stop = start + shape[ds]
        if ds in ranges:
            a, b = max(ranges[ds][0], start), min(ranges[ds][1], stop)
            if a >= b:
                return None
            ranges[ds] = (a - start, b - start)
        return tuple(sorted((d, a, b) for d, (a, b) in ranges.items()))
    if packet == "select" and only_at(node, operand, 0):
        ds = node.args[1] % rank(operand)
        index = node.args[2] % trace_shape(operand)[ds]
        if ds in ranges and not ranges[ds][0] <= index < ranges[ds][1]:
            return None
        return tuple(sorted((d if d < ds else d - 1, a, b) for d, (a, b) in ranges.items() if d != ds))
    if packet in ("add", "sub", "clone", "alias", "detach", "dropout") and trace_shape(operand) == shape:
        return support  # element to element, same shape
    return ()
