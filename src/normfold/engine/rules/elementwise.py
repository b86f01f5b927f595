"""Elementwise ops: copies, casts, eval dropout, arithmetic (add, sub, mul, div, neg) and literal zeros.

Each commutes with P, the projection that removes the mean along (dim, group): P·x ± P·y = P·(x ± y),
(P·x)·s = P·(x·s) for an s constant along the dim, and P·0 = 0. Beside the rules: how an operand
broadcasts to the output (shared by every rule with broadcasting operands), sums whose terms cancel
exactly (x − (x + p) = −p) and values provably equal (a − a = 0), each never a guess.
"""
from __future__ import annotations

import math
import weakref
from fractions import Fraction
from typing import NamedTuple

import torch
from torch import fx

from ..graph import node_arg as _arg  # the short name reads better in the rules below
from ..graph import SCALAR_META, op_name, per_graph, trace_shape
from ..op_kinds import aten_packets, is_training_dropout, through_value_copies
from .answers import Break, Need, Requires, Source, collect, make_need, only_at, rank
from .writes import overwrites

_aten = torch.ops.aten

# ops that build literal zeros
ZERO_OPS = set(aten_packets("zeros", "zeros_like", "new_zeros"))
# op -> index of its fill value: full(size, v), full_like(x, v), fill(x, v), new_full(x, size, v)
FULL_OPS = {**{p: 1 for p in aten_packets("full", "full_like", "fill")}, **{p: 2 for p in aten_packets("new_full")}}
# ops that only move values (bitwise exact): what ``same_value`` compares, seeing through value copies
# (``op_kinds.through_value_copies``)
_LAYOUT_OPS = set(aten_packets("view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze",
                           "permute", "transpose", "t", "expand", "slice", "select", "cat", "concat", "stack"))


def is_zero_literal(value) -> bool:
    """True for the number 0, for tensors built as literal zeros, and for a one-element constant 0 (or a
    copy of one: ``x[mask] = 0.0`` writes ``lift_fresh_copy`` of a lifted constant)."""
    if isinstance(value, (int, float, bool)):
        return value == 0
    if isinstance(value, fx.Node) and value.op == "call_function" and (classify_zero(value) or is_self_difference(value)):
        return True
    if isinstance(value, fx.Node):
        source = through_value_copies(value)
        return source.op == "placeholder" and SCALAR_META in source.meta and source.meta[SCALAR_META] == 0
    return False


def classify_zero(node: fx.Node) -> bool:
    key = getattr(node.target, "overloadpacket", None)
    if key in ZERO_OPS:
        return True
    if key in FULL_OPS:
        fill = _arg(node, FULL_OPS[key], "fill_value")
        return isinstance(fill, (int, float)) and fill == 0
    return False


def broadcast_operand(out: fx.Node, operand, dim: int, group: int | None) -> Need | Break | None:
    """Map ``dim`` of an elementwise op's output to an operand (None: nothing to require)."""
    if not isinstance(operand, fx.Node):
        return None if is_zero_literal(operand) else Break(
            f"{op_name(out)} adds the constant {operand!r} along the normalized dim")
    s_out, s_in = trace_shape(out), trace_shape(operand)
    if s_in is None:
        return Break(f"{op_name(out)}: operand {operand.name} is not a tensor")
    od = dim - (len(s_out) - len(s_in))
    if od < 0 or (s_in[od] == 1 and s_out[dim] != 1):  # constant along dim: only zeros keep the mean 0
        return None if is_zero_literal(operand) else Break(
            f"{op_name(out)} broadcasts {describe_short(operand)} along the normalized dim")
    return make_need(operand, od, group)


def describe_short(node: fx.Node) -> str:
    return f"{op_name(node)} ({node.name})"


def is_row_scalar(out: fx.Node, operand, dim: int) -> bool:
    """Constant along ``dim`` of the output: a number or a tensor of size 1 (or absent) there."""
    if not isinstance(operand, fx.Node):
        return isinstance(operand, (int, float, bool))
    s_out, s_in = trace_shape(out), trace_shape(operand)
    if s_in is None:
        return False
    od = dim - (len(s_out) - len(s_in))
    return od < 0 or s_in[od] == 1


def broadcast_dims(out: fx.Node, operand: fx.Node, dims) -> set[int]:
    """Output dims of a broadcasting op along which the operand's shift is constant: its own dims
    (right-aligned) and every dim it is broadcast along (absent or of size 1 there)."""
    offset = rank(out) - rank(operand)
    s_in, s_out = trace_shape(operand), trace_shape(out)
    spread = {d for d in range(rank(out)) if d < offset or (s_in[d - offset] == 1 and s_out[d] != 1)}
    return {d + offset for d in dims} | spread


def zero_mean_same_dim(node, dim, group):
    """Ops that return their first input with the same layout (copies, casts, eval dropout)."""
    return Requires((make_need(node.args[0], dim, group),))


def shift_same(node, operand, dims):
    return dims if only_at(node, operand, 0) else None


def zero_mean_dropout(node, dim, group):
    if is_training_dropout(node):
        return Break("dropout in training mode")
    return zero_mean_same_dim(node, dim, group)


def shift_dropout(node, operand, dims):
    return None if is_training_dropout(node) else shift_same(node, operand, dims)


def zero_mean_add_sub(node, dim, group):
    a, b = node.args[0], _arg(node, 1, "other")
    if is_self_difference(node):
        return Source("zero")
    cancelled = cancelling_sum(node)
    if cancelled is not None:  # x − (x + p) = −p: only the terms left need zero mean
        return collect(node, [broadcast_operand(node, t, dim, group) for t in cancelled.terms]) if cancelled.terms \
            else Source("zero")
    return collect(node, [broadcast_operand(node, a, dim, group), broadcast_operand(node, b, dim, group)])


def shift_add_sub(node, operand, dims):
    """(x + δ) ± y = (x ± y) ± δ, δ broadcast to the output (also when x is on both sides: 0 or 2δ)."""
    return broadcast_dims(node, operand, dims)


class LinearSum(NamedTuple):
    """A node written as Σ c·term over tensors that broadcast to its shape, some of whose terms cancel exactly."""

    terms: tuple[fx.Node, ...]      # the terms whose coefficients do not cancel
    cancelled: frozenset            # the terms whose coefficients sum to exactly 0
    inner: frozenset                # the add / sub / neg / scaling nodes expanded on the way (not the root)


_SUMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cancelling_sum(node: fx.Node) -> LinearSum | None:
    """``node`` expanded through add, sub (alpha), neg and scaling by a number over nodes of its shape, when
    some term's coefficients sum to exactly 0 (exact rational arithmetic on the graph's numbers):
    x − (x + p) = −p. None when nothing cancels or the graph overwrites a tensor (terms read at different
    times could differ). Memoized per graph (the analysis only reads graphs)."""
    memo = per_graph(_SUMS, node.graph, lambda graph: {})
    if node not in memo:
        memo[node] = _expand_sum(node)
    return memo[node]


def _expand_sum(root: fx.Node) -> LinearSum | None:
    parts_of: dict[fx.Node, list[tuple[fx.Node, Fraction]]] = {}
    stack = [root]
    while stack:  # the expandable region above root
        n = stack.pop()
        if n not in parts_of and (parts := _linear_parts(n, trace_shape(root))) is not None:
            parts_of[n] = parts
            stack.extend(part for part, _ in parts)
    if root not in parts_of:
        return None
    waiting = {n: 0 for n in parts_of}  # readers inside the region not yet propagated
    for parts in parts_of.values():
        for part, _ in parts:
            if part in waiting:
                waiting[part] += 1
    coefficients: dict[fx.Node, Fraction] = {root: Fraction(1)}
    ready = [root]
    while ready:  # propagate coefficients in topological order: linear in the region, whatever its diamonds
        n = ready.pop()
        for part, k in parts_of[n]:
            coefficients[part] = coefficients.get(part, Fraction(0)) + coefficients[n] * k
            if part in waiting:
                waiting[part] -= 1
                if not waiting[part]:
                    ready.append(part)
    terms = {t: c for t, c in coefficients.items() if t not in parts_of}
    if all(c != 0 for c in terms.values()) or any(overwrites(n) for n in root.graph.nodes):
        return None
    return LinearSum(tuple(t for t, c in terms.items() if c != 0), frozenset(t for t, c in terms.items() if c == 0),
                     frozenset(parts_of) - {root})


def _linear_parts(n, out_shape) -> list[tuple[fx.Node, Fraction]] | None:
    """n = Σ k·part for an add / sub / neg / scaling by a finite number of shape ``out_shape`` (parts may broadcast)."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or out_shape is None or trace_shape(n) != out_shape:
        return None  # (no shape: not a tensor, e.g. an op's tuple of outputs)
    packet, args = getattr(n.target, "overloadpacket", None), n.args
    nodes = [a for a in args if isinstance(a, fx.Node)]
    if not all(_broadcasts_to(trace_shape(a), out_shape) for a in nodes) or set(n.kwargs) - {"alpha"}:
        return None
    numbers = [a for a in args if not isinstance(a, fx.Node)]
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in numbers):
        return None
    if packet in (_aten.add, _aten.sub) and len(nodes) == 2 == len(args):
        alpha = Fraction(_arg(n, 2, "alpha", 1))
        return [(args[0], Fraction(1)), (args[1], alpha if packet is _aten.add else -alpha)]
    if packet is _aten.neg and len(args) == 1:
        return [(args[0], Fraction(-1))]
    if packet is _aten.mul and len(nodes) == 1 and len(args) == 2:
        return [(nodes[0], Fraction(numbers[0]))]
    if packet is _aten.div and len(args) == 2 and len(nodes) == 1 and args[0] is nodes[0] and numbers[0] != 0:
        return [(args[0], 1 / Fraction(numbers[0]))]
    return None


def _broadcasts_to(s_in, s_out) -> bool:
    """A tensor of shape ``s_in`` broadcasts to ``s_out`` unchanged in size (right-aligned, equal or 1)."""
    return s_in is not None and len(s_in) <= len(s_out) and all(
        a in (1, b) for a, b in zip(reversed(s_in), reversed(s_out)))


def is_self_difference(node: fx.Node) -> bool:
    """``a − a`` (alpha 1): zero whatever ``a`` holds, so zero-mean along every dim."""
    if getattr(node.target, "overloadpacket", None) not in (_aten.sub, _aten.sub_) or _arg(node, 2, "alpha", 1) != 1:
        return False
    a, b = node.args[0], _arg(node, 1, "other")
    return isinstance(a, fx.Node) and isinstance(b, fx.Node) and same_value(a, b)


def same_value(a: fx.Node, b: fx.Node) -> bool:
    """``a`` and ``b`` hold equal values wherever one node reads both: the same node (one tensor, even if
    overwritten in place before), or, in a graph that overwrites nothing, the same copies and layout ops
    (eval dropout, clone, cat, view...: bitwise-exact) of equal values. Never a guess: anything else is False."""
    if a is b:
        return True  # a copy taken before an in-place op differs after it: no structural match then
    return _same_layout_value(a, b) and not any(overwrites(n) for n in a.graph.nodes)


def _same_layout_value(a, b) -> bool:
    """Structural equality of two arguments, seen through copies: nodes of the same layout op on equal
    arguments, lists elementwise, literals by ==."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        a, b = through_value_copies(a), through_value_copies(b)
        if a is b:
            return True
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a.op != "call_function" or a.target != b.target \
                or getattr(a.target, "overloadpacket", None) not in _LAYOUT_OPS or a.kwargs != b.kwargs:
            return False
        return _same_layout_value(list(a.args), list(b.args))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_layout_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _scaled_block(node, x, scale, dim):
    """x·s or x/s over a block of dims: P_block(x)·s = P_block(x·s) when s is a number."""
    if isinstance(scale, (int, float, bool)) and isinstance(x, fx.Node):
        return Requires((make_need(x, dim, None),))
    return Break(f"{op_name(node)} would need zero mean jointly over dims {dim} with a tensor factor")


def zero_mean_mul(node, dim, group):
    a, b = node.args[0], node.args[1]
    if isinstance(dim, tuple):
        return _scaled_block(node, a, b, dim) if isinstance(a, fx.Node) else _scaled_block(node, b, a, dim)
    if is_zero_literal(a) or is_zero_literal(b):
        return Source("zero")  # 0·y = 0
    a_row, b_row = is_row_scalar(node, a, dim), is_row_scalar(node, b, dim)
    if a_row and b_row:
        return Break(f"{op_name(node)} of two factors that are constant along the normalized dim")
    if b_row:  # P(a)·s = P(a·s) when s is constant along dim
        return collect(node, [broadcast_operand(node, a, dim, group)])
    if a_row:
        return collect(node, [broadcast_operand(node, b, dim, group)])
    return Break(f"{op_name(node)}: elementwise product with a tensor that varies along the normalized dim")


def shift_mul(node, operand, dims):
    """(x + δ)·s = x·s + δ·s: constant along the dims where both δ and s are."""
    a, b = node.args[0], node.args[1]
    if (a is operand) == (b is operand):
        return None
    other = b if a is operand else a
    return {d for d in broadcast_dims(node, operand, dims) if is_row_scalar(node, other, d)}


def zero_mean_div(node, dim, group):
    if "rounding_mode" in node.kwargs and node.kwargs["rounding_mode"] is not None:
        return Break(f"{op_name(node)} with rounding")
    if isinstance(dim, tuple):
        return _scaled_block(node, node.args[0], node.args[1], dim)
    if not is_row_scalar(node, node.args[1], dim):
        return Break(f"{op_name(node)}: division by a tensor that varies along the normalized dim")
    return collect(node, [broadcast_operand(node, node.args[0], dim, group)])


def shift_div(node, operand, dims):
    if node.kwargs.get("rounding_mode") is not None or not only_at(node, operand, 0):
        return None
    return {d for d in broadcast_dims(node, operand, dims) if is_row_scalar(node, node.args[1], d)}


def zero_source(node, dim, group):
    if classify_zero(node):
        return Source("zero")
    return Break(f"{op_name(node)} with a non-zero fill value")
