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

One idea in one file, long (some 1,300 lines) because it is a table: a few lines of rule per op
family, each next to its shift rule, and at the end ``_TABLE`` mapping the aten ops to both; split
by family, every new op would touch the table and a family file, and a reader would follow one
answer across files. Which ops pass values on unchanged (copies, casts, eval dropout) and which
are norms is not the table's to say: ``op_kinds.py`` defines those once for every walk.
"""
from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, NamedTuple

import torch
from torch import fx

from .._text import dtype_name
from .graph import Captured, op_name, op_packet, per_graph, shape
from .graph import node_arg as _arg  # the short name reads better in the many rules below
from .op_kinds import (CAST_OP_NAMES, CAST_OPS, COPY_OP_NAMES, DROPOUT_OP_NAMES, aten_packets, is_training_dropout,
                       norm_node_kind, passes_values_on, through_value_copies)

_aten = torch.ops.aten


class Need(NamedTuple):
    """A question: is ``node`` zero-mean along ``dim`` (per ``group`` elements, None = whole dim)?

    ``dim`` may also be a sorted tuple of dims, with group None: zero-mean jointly over that block
    (features split and permuted by layout ops, e.g. (H, D) → (D, H) before a merge back to C).
    Only layout rules (and scaling by a number) accept blocks; every other op breaks on them.
    ``part``: only a part of ``node`` must be (``Part``, asked by ``classify_part``; None: all of it).
    """

    node: fx.Node
    dim: int | tuple[int, ...]
    group: int | None
    part: Part | None = None


@dataclass(frozen=True)
class Requires:
    needs: tuple[Need, ...]


@dataclass(frozen=True)
class Source:
    kind: str               # "parameter" (centerable), "zero" (literal zeros, a − a, 0·y), "normalized" (weightless LN output)
    fqn: str | None = None  # the parameter's FQN for kind == "parameter"


@dataclass(frozen=True)
class Break:
    reason: str


Answer = Requires | Source | Break


@dataclass(frozen=True)
class NormCall:
    """A norm op in the graph, whatever op spells it (aten.layer_norm, aten.rms_norm, normfold's op)."""

    node: fx.Node
    x: fx.Node                 # the normalized input
    weight: fx.Node | None
    bias: fx.Node | None
    eps: float | None
    is_rms: bool
    output: fx.Node | None     # the node holding the normalized output
    num_dims: int              # number of trailing dims normalized
    offset: float = 0.0        # the norm scales by (offset + weight): normfold's RMSNorm(offset=1), Gemma's


def norm_call(node: fx.Node) -> NormCall | None:
    """Recognize a norm over trailing dims (a LayerNorm or RMSNorm by ``op_kinds.norm_node_kind``);
    fused-residual variants are not norms here."""
    if norm_node_kind(node) not in ("LayerNorm", "RMSNorm"):
        return None
    packet = node.target.overloadpacket
    if packet == _aten.layer_norm:
        return NormCall(node, node.args[0], _arg(node, 2, "weight"), _arg(node, 3, "bias"), _arg(node, 4, "eps", 1e-5),
                        False, node, len(node.args[1]))
    if packet == _aten.rms_norm:
        return NormCall(node, node.args[0], _arg(node, 2, "weight"), None, _arg(node, 3, "eps"), True, node,
                        len(node.args[1]))
    if str(packet) == "normfold.norm_fwd":  # (x, weight, bias, residual, eps, offset, is_rms) -> (y, s, mean, rstd)
        x, weight, bias, residual, eps, offset, is_rms = node.args[:7]
        if residual is not None:
            return None
        output = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), None)
        return NormCall(node, x, weight, bias, eps, bool(is_rms), output, 1, float(offset))
    return None


def make_need(node: fx.Node, dim, group: int | None) -> Need:
    """Canonical Need: a group that spans the whole dim is written None; a block of one dim is that dim."""
    if isinstance(dim, tuple):
        dim = tuple(sorted(dim))
        if len(dim) == 1:
            dim = dim[0]
    s = shape(node)
    if s is not None and group is not None and not isinstance(dim, tuple) and group == s[dim]:
        group = None
    return Need(node, dim, group)


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
    if shape(node) is None:
        return Break(f"{op_name(node)}: output shape unknown (dynamic shapes are not supported)")
    rounding = rounding_cast(node, captured)
    if rounding is not None:
        return Break(rounding)
    key = getattr(node.target, "overloadpacket", node.target)
    rule = RULES.get(key)
    if rule is None:
        return Break(f"{op_name(node)} is not in the rules table (unknown ops break)")
    if isinstance(dim, tuple) and rule not in BLOCK_RULES:
        return Break(f"{op_name(node)} would need zero mean jointly over dims {dim} (only layout ops and scaling by a number allow that)")
    return rule(node, dim, group)


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


# --------------------------------------------------------------------------- helpers

def written_through_a_view(node: fx.Node) -> fx.Node | None:
    """An op that writes into ``node``'s memory through a view of it (``t[:, :k] = v`` is
    ``copy_(slice(t), v)``) while ``node`` or another view of it is read after the write, or None.
    Readers of the written view itself are not at risk: the graph points them at the write, whose
    rule answers for them; likewise an in-place op on ``node`` itself. Views and writes come from
    the ops' schemas (``Tensor(a)`` aliases, ``Tensor(a!)`` writes); an op without a schema reading a
    view counts as a write, never a guess."""
    views, writes = _alias_tree(node)
    if not writes:
        return None
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    live = live_nodes(node.graph)
    for writer, written in writes:
        for tensor in views:
            if tensor is written:
                continue
            for reader in tensor.users:
                if reader is not writer and reader not in views and reader in live and order[reader] > order[writer]:
                    return writer
    return None


def written_in_place(node: fx.Node) -> fx.Node | None:
    """An op that writes into ``node``'s memory, in place or through a view of it (by the ops'
    schemas, as :func:`written_through_a_view`), or None."""
    _, writes = _alias_tree(node)
    if writes:
        return writes[0][0]
    for user in node.users:
        schema = getattr(user.target, "_schema", None) if user.op == "call_function" else None
        if schema is not None and any(value is node and argument.alias_info is not None and argument.alias_info.is_write
                                      for argument, value in _schema_arguments(schema, user)):
            return user
    return None


def _alias_tree(node: fx.Node) -> tuple[set[fx.Node], list[tuple[fx.Node, fx.Node]]]:
    """``node`` and every view of it (transitively), and the (writer, written view) pairs of the ops
    that write into one of those views other than ``node`` itself."""
    views, writes, stack = {node}, [], [node]
    while stack:
        tensor = stack.pop()
        for user in tensor.users:
            if user.op != "call_function" or user in views:
                continue
            if user.target is operator.getitem:  # an item of a list of views is a view
                if tensor is not node:
                    views.add(user)
                    stack.append(user)
                continue
            schema = getattr(user.target, "_schema", None)
            if schema is None:
                if tensor is not node:
                    writes.append((user, tensor))
                continue
            for argument, value in _schema_arguments(schema, user):
                if value is not tensor or argument.alias_info is None:
                    continue
                if argument.alias_info.is_write:
                    if tensor is not node:
                        writes.append((user, tensor))
                elif any(r.alias_info is not None for r in schema.returns):  # the output is a view of tensor
                    views.add(user)
                    stack.append(user)
    return views, writes


def _schema_arguments(schema, node: fx.Node):
    """(schema argument, the value passed for it) for each argument of ``node``'s call."""
    for i, argument in enumerate(schema.arguments):
        if i < len(node.args):
            yield argument, node.args[i]
        elif argument.name in node.kwargs:
            yield argument, node.kwargs[argument.name]


def _rank(node: fx.Node) -> int:
    return len(shape(node))


def _is_zero_literal(value) -> bool:
    """True for the number 0 and for tensors built as literal zeros."""
    if isinstance(value, (int, float, bool)):
        return value == 0
    if isinstance(value, fx.Node) and value.op == "call_function":
        return classify_zero(value) or _is_self_difference(value)
    return False


def classify_zero(node: fx.Node) -> bool:
    key = getattr(node.target, "overloadpacket", None)
    if key in _ZERO_OPS:
        return True
    if key in _FULL_OPS:
        fill = _arg(node, _FULL_OPS[key], "fill_value")
        return isinstance(fill, (int, float)) and fill == 0
    return False


def _broadcast_operand(out: fx.Node, operand, dim: int, group: int | None) -> Need | Break | None:
    """Map ``dim`` of an elementwise op's output to an operand (None: nothing to require)."""
    if not isinstance(operand, fx.Node):
        return None if _is_zero_literal(operand) else Break(
            f"{op_name(out)} adds the constant {operand!r} along the normalized dim")
    s_out, s_in = shape(out), shape(operand)
    if s_in is None:
        return Break(f"{op_name(out)}: operand {operand.name} has no static shape")
    od = dim - (len(s_out) - len(s_in))
    if od < 0 or (s_in[od] == 1 and s_out[dim] != 1):  # constant along dim: only zeros keep the mean 0
        return None if _is_zero_literal(operand) else Break(
            f"{op_name(out)} broadcasts {describe_short(operand)} along the normalized dim")
    return make_need(operand, od, group)


def describe_short(node: fx.Node) -> str:
    return f"{op_name(node)} ({node.name})"


def _collect(node: fx.Node, parts) -> Answer:
    """Requires(all Needs in parts) unless one of them is a Break."""
    needs = []
    for part in parts:
        if isinstance(part, Break):
            return part
        if part is not None:
            needs.append(part)
    return Requires(tuple(needs))


def _is_row_scalar(out: fx.Node, operand, dim: int) -> bool:
    """Constant along ``dim`` of the output: a number or a tensor of size 1 (or absent) there."""
    if not isinstance(operand, fx.Node):
        return isinstance(operand, (int, float, bool))
    s_out, s_in = shape(out), shape(operand)
    if s_in is None:
        return False
    od = dim - (len(s_out) - len(s_in))
    return od < 0 or s_in[od] == 1


# --------------------------------------------------------------------------- rules

def _same_dim(node, dim, group):
    """Ops that return their first input with the same layout (copies, casts, eval dropout)."""
    return Requires((make_need(node.args[0], dim, group),))


def _dropout(node, dim, group):
    if is_training_dropout(node):
        return Break("dropout in training mode")
    return _same_dim(node, dim, group)


def _add_sub(node, dim, group):
    a, b = node.args[0], _arg(node, 1, "other")
    if _is_self_difference(node):
        return Source("zero")
    cancelled = cancelling_sum(node)
    if cancelled is not None:  # x − (x + p) = −p: only the terms left need zero mean
        return _collect(node, [_broadcast_operand(node, t, dim, group) for t in cancelled.terms]) if cancelled.terms \
            else Source("zero")
    return _collect(node, [_broadcast_operand(node, a, dim, group), _broadcast_operand(node, b, dim, group)])


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
        if n not in parts_of and (parts := _linear_parts(n, shape(root))) is not None:
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
    if all(c != 0 for c in terms.values()) or any(_overwrites(n) for n in root.graph.nodes):
        return None
    return LinearSum(tuple(t for t, c in terms.items() if c != 0), frozenset(t for t, c in terms.items() if c == 0),
                     frozenset(parts_of) - {root})


def _linear_parts(n, out_shape) -> list[tuple[fx.Node, Fraction]] | None:
    """n = Σ k·part for an add / sub / neg / scaling by a finite number of shape ``out_shape`` (parts may broadcast)."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or shape(n) != out_shape:
        return None
    packet, args = getattr(n.target, "overloadpacket", None), n.args
    nodes = [a for a in args if isinstance(a, fx.Node)]
    if not all(_broadcasts_to(shape(a), out_shape) for a in nodes) or set(n.kwargs) - {"alpha"}:
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


def _is_self_difference(node: fx.Node) -> bool:
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
    return _same_layout_value(a, b) and not any(_overwrites(n) for n in a.graph.nodes)


def _overwrites(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return bool(schema is not None and schema.is_mutable)


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


def _mul(node, dim, group):
    a, b = node.args[0], node.args[1]
    if isinstance(dim, tuple):
        return _scaled_block(node, a, b, dim) if isinstance(a, fx.Node) else _scaled_block(node, b, a, dim)
    if _is_zero_literal(a) or _is_zero_literal(b):
        return Source("zero")  # 0·y = 0
    a_row, b_row = _is_row_scalar(node, a, dim), _is_row_scalar(node, b, dim)
    if a_row and b_row:
        return Break(f"{op_name(node)} of two factors that are constant along the normalized dim")
    if b_row:  # P(a)·s = P(a·s) when s is constant along dim
        return _collect(node, [_broadcast_operand(node, a, dim, group)])
    if a_row:
        return _collect(node, [_broadcast_operand(node, b, dim, group)])
    return Break(f"{op_name(node)}: elementwise product with a tensor that varies along the normalized dim")


def _div(node, dim, group):
    if "rounding_mode" in node.kwargs and node.kwargs["rounding_mode"] is not None:
        return Break(f"{op_name(node)} with rounding")
    if isinstance(dim, tuple):
        return _scaled_block(node, node.args[0], node.args[1], dim)
    if not _is_row_scalar(node, node.args[1], dim):
        return Break(f"{op_name(node)}: division by a tensor that varies along the normalized dim")
    return _collect(node, [_broadcast_operand(node, node.args[0], dim, group)])


def _in_place(rule):
    """``a.add_(b)`` etc.: the functional rule, if no other reader can see ``a`` overwritten."""
    def in_place_rule(node, dim, group):
        if not overwrites_a_private_value(node):
            return Break(f"{op_name(node)} overwrites a tensor that is also read elsewhere")
        return rule(node, dim, group)
    return in_place_rule


def overwrites_a_private_value(node: fx.Node) -> bool:
    """An in-place op ``a.op_(...)`` acts like its out-of-place form: ``a`` is read by nothing else, or
    ``a`` is new memory (no view, no input) whose other readers all ran before it and return new memory
    too (so no view of ``a`` is read after it changes)."""
    target = node.args[0]
    if not isinstance(target, fx.Node):
        return True
    others = {u for u in target.users if u is not node and u in live_nodes(u.graph)}  # a dead one sees nothing
    if not others:
        return True
    if target.op != "call_function" or getattr(target.target, "overloadpacket", None) not in _FRESH_OUTPUT_OPS:
        return False
    if any(u.op != "call_function" or getattr(u.target, "overloadpacket", None) not in _FRESH_OUTPUT_OPS
           for u in others):
        return False
    for earlier in target.graph.nodes:  # graph order is run order
        if earlier is node:
            return not others
        others.discard(earlier)
    return False


_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def live_nodes(graph: fx.Graph) -> frozenset[fx.Node]:
    """Nodes with a path to the output or to a side effect (in-place ops, asserts); the rest is dead code."""
    return per_graph(_LIVE, graph, _reach_back_from_effects)


def _reach_back_from_effects(graph: fx.Graph) -> frozenset[fx.Node]:
    stack = [n for n in graph.nodes if n.op == "output" or n.is_impure()]
    reached: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node not in reached:
            reached.add(node)
            stack.extend(node.all_input_nodes)
    return frozenset(reached)


def _numpy_t(node, dim, group):
    r = _rank(node)
    return Requires((make_need(node.args[0], _each(dim, lambda d: r - 1 - d), group),))  # reverses all dims


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


def _view(node, dim, group):
    x = node.args[0]
    mapped = map_view_dim(shape(x), shape(node), dim, group)
    if isinstance(mapped, str):
        return Break(mapped)
    return Requires((make_need(x, *mapped),))


def _each(dim, mapping):
    """Apply a dim mapping to a dim or to every dim of a block."""
    return tuple(mapping(d) for d in dim) if isinstance(dim, tuple) else mapping(dim)


def _permute(node, dim, group):
    dims = [d % _rank(node) for d in node.args[1]]
    return Requires((make_need(node.args[0], _each(dim, lambda d: dims[d]), group),))


def _transpose(node, dim, group):
    r = _rank(node)
    a, b = node.args[1] % r, node.args[2] % r
    return Requires((make_need(node.args[0], _each(dim, lambda d: b if d == a else a if d == b else d), group),))


def _t(node, dim, group):
    two_d = _rank(node) == 2
    return Requires((make_need(node.args[0], _each(dim, lambda d: 1 - d if two_d else d), group),))


def _expand(node, dim, group):
    return _collect(node, [_broadcast_operand(node, node.args[0], dim, group)])


def _aligned_part(node, x, part_dim: int, dim: int, group, start: int, length: int):
    """A contiguous part [start, start+length) of x along dim: exact iff groups align."""
    if part_dim != dim:
        return Requires((make_need(x, dim, group),))
    total = shape(x)[dim]
    if start == 0 and length == total:
        return Requires((make_need(x, dim, group),))
    g = group if group is not None else length
    if start % g == 0 and length % g == 0 and total % g == 0:  # P_g(x)[part] = P_g(x[part])
        return Requires((make_need(x, dim, g),))
    return Break(f"{op_name(node)} takes a part of the normalized dim that is not a whole group")


def _slice(node, dim, group):
    x = node.args[0]
    r = _rank(x)
    ds = _arg(node, 1, "dim", 0) % r
    step = _arg(node, 4, "step", 1)
    if ds == dim and step != 1:
        return Break(f"{op_name(node)} with step {step} along the normalized dim")
    total = shape(x)[ds]
    start = _arg(node, 2, "start", 0) or 0
    start = min(max(start + total if start < 0 else start, 0), total)
    return _aligned_part(node, x, ds, dim, group, start, shape(node)[ds])


def _select(node, dim, group):
    ds = node.args[1] % _rank(node.args[0])
    return Requires((make_need(node.args[0], dim if dim < ds else dim + 1, group),))


def _index_select(node, dim, group):
    ds = node.args[1] % _rank(node.args[0])
    if ds == dim:
        return Break(f"{op_name(node)} picks entries along the normalized dim")
    return Requires((make_need(node.args[0], dim, group),))


def _index(node, dim, group):
    x, indices = node.args[0], list(node.args[1])
    r_in = _rank(x)
    last_untouched = len(indices) < r_in or indices[r_in - 1] is None
    if dim == _rank(node) - 1 and last_untouched and shape(node)[-1] == shape(x)[-1]:
        return Requires((make_need(x, r_in - 1, group),))
    return Break(f"{op_name(node)}: advanced indexing that touches the normalized dim")


def _cat(node, dim, group):
    parts = [p for p in node.args[0] if shape(p) is not None and math.prod(shape(p)) > 0]
    dc = _arg(node, 1, "dim", 0) % _rank(node)
    if dc != dim:
        return Requires(tuple(make_need(p, dim, group) for p in parts))
    if group is not None and all(shape(p)[dim] % group == 0 for p in parts):
        return Requires(tuple(make_need(p, dim, group) for p in parts))
    return Break(f"{op_name(node)} along the normalized dim: centering each part does not center the whole")


def _stack(node, dim, group):
    ds = _arg(node, 1, "dim", 0) % _rank(node)
    if ds == dim:
        return Break(f"{op_name(node)} along the normalized dim")
    return Requires(tuple(make_need(p, dim if dim < ds else dim - 1, group) for p in node.args[0]))


_SPLIT_DIM_ARG = {"split": 2, "split_with_sizes": 2, "unsafe_split": 2, "chunk": 2, "tensor_split": 2, "unbind": 1}


def _getitem(node, dim, group):
    src, index = node.args
    packet = getattr(getattr(src, "target", None), "overloadpacket", None)
    name = str(packet).removeprefix("aten.") if packet is not None else None
    call = norm_call(src) if isinstance(src, fx.Node) else None
    if call is not None and call.output is node:
        return _norm_output_source(call, node, dim, group)
    if name not in _SPLIT_DIM_ARG:
        return Break(f"getitem of {op_name(src) if isinstance(src, fx.Node) else src!r} is not in the rules table")
    x = src.args[0]
    ds = _arg(src, _SPLIT_DIM_ARG[name], "dim", 0) % _rank(x)
    if name == "unbind":
        return Requires((make_need(x, dim if dim < ds else dim + 1, group),))
    sizes = [int(v.shape[ds]) for v in src.meta["val"]]
    return _aligned_part(node, x, ds, dim, group, sum(sizes[:index]), sizes[index])


def _pad(node, dim, group):
    if _arg(node, 2, "mode", "constant") != "constant":
        return Break(f"{op_name(node)} in {_arg(node, 2, 'mode')!r} mode")
    return _constant_pad(node, dim, group, value=_arg(node, 3, "value", 0) or 0)


def _constant_pad(node, dim, group, value=None):
    pad = list(node.args[1])
    value = _arg(node, 2, "value", 0) if value is None else value
    if value != 0:
        return Break(f"{op_name(node)} pads with {value}")
    r = _rank(node)
    k = r - 1 - dim  # pad lists (left, right) pairs from the last dim backwards
    if 2 * k + 1 < len(pad) and (pad[2 * k] or pad[2 * k + 1]):
        return Break(f"{op_name(node)} pads the normalized dim: the zeros shift its mean")
    return Requires((make_need(node.args[0], dim, group),))


def _reduce_other_dims(node, dim, group):
    x = node.args[0]
    dims = _arg(node, 1, "dim", None)
    if dims is None:
        return Break(f"{op_name(node)} over all dims")
    r_in = _rank(x)
    reduced = sorted({d % r_in for d in ([dims] if isinstance(dims, int) else dims)})
    keep = _arg(node, 2, "keepdim", False)
    src = dim if keep else [d for d in range(r_in) if d not in reduced][dim]
    if src in reduced:
        return Break(f"{op_name(node)} reduces the normalized dim")
    return Requires((make_need(x, src, group),))


def _linear(node, dim, group):
    x, w, b = node.args[0], node.args[1], _arg(node, 2, "bias")
    if dim == _rank(node) - 1:  # y = x·Wᵀ + b: zero-mean rows iff W's columns and b are (over outputs)
        return _collect(node, [make_need(w, 0, group), make_need(b, 0, group) if b is not None else None])
    if b is not None:
        return Break(f"{op_name(node)} with a bias, along a non-feature dim")
    return Requires((make_need(x, dim, group),))


def _addmm(node, dim, group):
    b, x, w = node.args[0], node.args[1], node.args[2]
    if dim != 1:
        return Break(f"{op_name(node)} along its row dim")
    return _collect(node, [make_need(w, 1, group), _broadcast_operand(node, b, dim, group)])


def _matmul_like(node, dim, group, a, b, bias=None):
    r = _rank(node)
    if _rank(b) < 2 or _rank(a) < 1:
        return Break(f"{op_name(node)} with a vector operand")
    if dim == r - 1:  # out = a·b: every output row is a combination of b's rows
        return _collect(node, [make_need(b, _rank(b) - 1, group),
                               _broadcast_operand(node, bias, dim, group) if bias is not None else None])
    if dim == r - 2 and _rank(a) >= 2 and bias is None:
        return Requires((make_need(a, _rank(a) - 2, group),))
    return Break(f"{op_name(node)} along a batch dim")


def _mm(node, dim, group):
    return _matmul_like(node, dim, group, node.args[0], node.args[1])


def _baddbmm(node, dim, group):
    return _matmul_like(node, dim, group, node.args[1], node.args[2], bias=node.args[0])


def _sdpa(node, dim, group):
    v = node.args[2]
    if _arg(node, 4, "dropout_p", 0.0):
        return Break(f"{op_name(node)} with dropout")
    if dim != _rank(node) - 1:
        return Break(f"{op_name(node)} along a non-head dim")
    return Requires((make_need(v, _rank(v) - 1, group),))  # softmax(QKᵀ)·V: rows combine V's rows


def _conv(node, dim, group, *, transposed_index=None, groups_index=6):
    x, w, b = node.args[0], node.args[1], _arg(node, 2, "bias")
    transposed = bool(node.args[transposed_index]) if transposed_index is not None and len(node.args) > transposed_index else False
    groups = _arg(node, groups_index, "groups", 1)
    channel = 1 if _rank(node) == _rank(w) else 0
    if dim != channel:
        return Break(f"{op_name(node)} along a non-channel dim")
    if groups != 1 and (transposed or not _within_conv_groups(shape(node)[channel] // groups, group)):
        return Break(f"{op_name(node)} with groups={groups} is not a dense map over channels"
                     f"{'' if transposed else ' (only blocks inside one conv group are)'}")
    wdim = 1 if transposed else 0
    return _collect(node, [make_need(w, wdim, group), make_need(b, 0, group) if b is not None else None])


def _within_conv_groups(per_conv_group: int, group: int | None) -> bool:
    """A grouped conv's output block of ``group`` channels lies inside one conv group (blocks tile each
    conv group): all its channels read the same inputs, y_o = Σ_j W[o, j] ⋆ x_j, so Σ_block y_o =
    Σ_j (Σ_block W[o, j]) ⋆ x_j, and centering W (and b) per block along the outputs is exact.
    A larger block or the whole dim spans groups that read different inputs: no weight centering commutes."""
    return group is not None and per_conv_group % group == 0


def _conv_transpose(node, dim, group):
    x, w = node.args[0], node.args[1]
    groups = _arg(node, 6, "groups", 1)
    if dim != (1 if _rank(node) == _rank(w) else 0) or groups != 1:
        return Break(f"{op_name(node)} along a non-channel dim or with groups={groups}")
    b = _arg(node, 2, "bias")
    return _collect(node, [make_need(w, 1, group), make_need(b, 0, group) if b is not None else None])


def _embedding(node, dim, group):
    if dim != _rank(node) - 1:
        return Break(f"{op_name(node)} along an index dim")
    return Requires((make_need(node.args[0], 1, group),))  # rows of W are gathered whole


def _layer_norm_source(node, dim, group):
    return _norm_output_source(norm_call(node), node, dim, group)


def _norm_output_source(call: NormCall, out: fx.Node, dim, group):
    """A LayerNorm without affine returns zero-mean rows: a source that centering leaves unchanged."""
    name = op_name(call.node)
    if call.is_rms:
        return Break(f"{name}: an RMSNorm output is not zero-mean")
    if call.weight is not None or call.bias is not None:
        return Break(f"{name} output with an affine transform is not zero-mean")
    last = _rank(out) - 1
    covers_last = dim == last or (isinstance(dim, tuple) and last in dim)  # a block holding whole rows
    if call.num_dims != 1 or not covers_last or group is not None:
        return Break(f"{name} output is zero-mean only over its whole last dim")
    return Source("normalized")


def _zero_source(node, dim, group):
    if classify_zero(node):
        return Source("zero")
    return Break(f"{op_name(node)} with a non-zero fill value")


# --------------------------------------------------------------------------- ops that treat every feature alike
#
# Each op below moves, copies, averages or zeroes whole rows along the normalized dim, or permutes a
# row's entries, with the same choice for every entry of the row (a mask or an index that is
# constant along the dim, weights that do not depend on the channel). Such an op is linear in each
# row and maps a row of ones to a row of ones (or to zeros), so it commutes with P: op(P·x) = P·op(x).


def constant_along(value, out_rank: int, dim: int) -> bool:
    """``value`` (a number, or a tensor broadcast right-aligned to rank ``out_rank``) holds one entry all
    along ``dim``: a number, a size-1 or absent dim, or a broadcast (``expand``), cast or comparison of
    values that are. Never a guess: anything else is False."""
    if not isinstance(value, fx.Node):
        return isinstance(value, (int, float, bool))
    s = shape(value)
    if s is None:
        return False
    d = dim - (out_rank - len(s))
    if d < 0 or s[d] == 1:
        return True
    packet = op_packet(value)
    if packet in _BROADCAST_OPS or passes_values_on(value, casts=True):
        return constant_along(value.args[0], len(s), d)
    if packet == _aten.unsqueeze:  # the new dim has size 1 (caught above); the others are the input's
        new = value.args[1] % len(s)
        return constant_along(value.args[0], len(s) - 1, d - (d > new))
    if packet in _ELEMENTWISE_PREDICATES:  # eq(ids, k), ~mask, a & b: constant where every operand is
        return all(constant_along(a, len(s), d) for a in value.args)
    return False


def _mask_varies(node, mask, dim) -> Break | None:
    if constant_along(mask, _rank(node), dim):
        return None
    return Break(f"{op_name(node)} with a mask that varies along the normalized dim: it writes part of a row")


def _masked_fill(node, dim, group):
    """Rows of x or rows of zeros, chosen by a mask constant along the dim: P(0) = 0. A non-zero fill
    value is a constant row (not zero-mean); a mask that varies along the dim fills part of a row."""
    x, mask, value = node.args[0], node.args[1], _arg(node, 2, "value")
    if not _is_zero_literal(value):
        return Break(f"{op_name(node)} fills with {value.name if isinstance(value, fx.Node) else value!r}, "
                     "not 0: a filled row is constant, not zero-mean")
    return _mask_varies(node, mask, dim) or _collect(node, [_broadcast_operand(node, x, dim, group)])


def _masked_scatter(node, dim, group):
    """Rows of x, or the next rows of source where a whole-row mask is set (image features merged into
    text embeddings). Source entries are taken in row-major order, so along the last dim a selected
    row is a whole row of source when source's rows have the same length."""
    x, mask, source = node.args[0], node.args[1], _arg(node, 2, "source")
    if shape(source) is None:
        return Break(f"{op_name(node)}: source {source.name} has no static shape")
    if dim != _rank(node) - 1:
        return Break(f"{op_name(node)} along a dim other than the last: its source is read in row-major order")
    if shape(source)[-1] != shape(node)[-1]:
        return Break(f"{op_name(node)}: source rows of {shape(source)[-1]} entries do not fill whole rows of "
                     f"{shape(node)[-1]}")
    return _mask_varies(node, mask, dim) or _collect(
        node, [_broadcast_operand(node, x, dim, group), make_need(source, _rank(source) - 1, group)])


def _index_put(node, dim, group):
    """x with rows written (or, accumulating, added) at indices of the leading dims: each row is x's,
    values', or a sum of them; values broadcast right-aligned, so their last dim is the row. Writing
    along the last dim itself writes part of a row."""
    x, indices, values = node.args[0], list(node.args[1]), _arg(node, 2, "values")
    if any(index is not None and shape(index) is None for index in indices):
        return Break(f"{op_name(node)}: an index has no static shape")
    if dim != _rank(node) - 1 or _indexes_last_dim(indices, _rank(x)):
        return Break(f"{op_name(node)} writes along the normalized dim (only writes of whole rows of the last dim keep "
                     "rows zero-mean)")
    return _collect(node, [make_need(x, dim, group), _broadcast_operand(node, values, dim, group)])


def _indexes_last_dim(indices: list, rank: int) -> bool:
    """An index list (None: a whole dim; a bool mask covers as many dims as it has) reaches the last dim."""
    position = 0
    for index in indices:
        width = _rank(index) if index is not None and index.meta["val"].dtype == torch.bool else 1
        if index is not None and position + width >= rank:
            return True
        position += width
    return False


def _index_copy(node, dim, group):
    """Slices of x replaced by slices of source along another dim: each row is x's or source's."""
    x, d, source = node.args[0], node.args[1] % _rank(node), _arg(node, 3, "source")
    if d == dim:
        return Break(f"{op_name(node)} copies entries along the normalized dim: it writes part of a row")
    return Requires((make_need(x, dim, group), make_need(source, dim, group)))


def _gather(node, dim, group):
    """out[..., i, ..., k] = x[..., index[..., i, ..., k], ..., k] along another dim: a whole row of x
    when the index is constant along the dim and as long as the row."""
    x, d, index = node.args[0], node.args[1] % _rank(node), node.args[2]
    if d == dim:
        return Break(f"{op_name(node)} picks entries along the normalized dim")
    if shape(index) is None:
        return Break(f"{op_name(node)}: index {index.name} has no static shape")
    if shape(index)[dim] != shape(x)[dim]:
        return Break(f"{op_name(node)} keeps {shape(index)[dim]} of the {shape(x)[dim]} entries of each row")
    if not constant_along(index, _rank(node), dim):
        return Break(f"{op_name(node)} with an index that varies along the normalized dim: a row mixes entries "
                     "of different rows")
    return Requires((make_need(x, dim, group),))


def _repeat_counts(node) -> list[int]:
    """One count per output dim: ``repeat`` gives them all; ``tile`` pads missing leading ones with 1."""
    counts = list(node.args[1])
    return [1] * (_rank(node) - len(counts)) + counts


def _repeat(node, dim, group):
    """Copies of x side by side (``repeat``, ``tile``). Along another dim a row is a row of x. Along
    the dim itself a row is [r, r, …, r] for a row r of x, whose mean is r's: centering x centers it
    (per group when the groups do not straddle the copies). A new leading dim, or a dim of size 1
    repeated, makes a constant row: not zero-mean."""
    x = node.args[0]
    new = _rank(node) - _rank(x)
    if dim < new:
        return Break(f"{op_name(node)} copies the tensor along a new normalized dim: a constant row")
    n, count = shape(x)[dim - new], _repeat_counts(node)[dim]
    if count != 1 and n == 1:
        return Break(f"{op_name(node)} fills the normalized dim from a single entry: a constant row")
    if count != 1 and group is not None and n % group and group % n:
        return Break(f"{op_name(node)}: groups of {group} straddle the {count} copies of {n} entries")
    return Requires((make_need(x, dim - new, None if group is not None and group % n == 0 else group),))


def _roll(node, dim, group):
    """A cyclic shift along some dims: along other dims it moves whole rows; along the dim it permutes
    each row's entries, which keeps its mean (a group's, when the shift moves whole groups). With no
    dims it rolls the flattened tensor, moving entries between rows."""
    shifts, dims = node.args[1], _arg(node, 2, "dims", [])
    shifts, dims = [shifts] if isinstance(shifts, int) else list(shifts), [dims] if isinstance(dims, int) else list(dims)
    if not dims:
        return Break(f"{op_name(node)} of the flattened tensor moves entries between rows")
    for amount, d in zip(shifts, dims):
        if d % _rank(node) == dim and group is not None and amount % group:
            return Break(f"{op_name(node)} by {amount} along the normalized dim mixes its groups of {group}")
    return Requires((make_need(node.args[0], dim, group),))


def _spatial(node, dim, group):
    """Upsampling and average pooling over the trailing spatial dims: out[n, c] = A·x[n, c] with the
    same weights A for every channel (and batch entry), so centering over channels commutes with it.
    Along a spatial dim the op mixes the entries of a row."""
    if dim >= _rank(node) - _SPATIAL_DIMS[op_packet(node)]:
        return Break(f"{op_name(node)} mixes entries along the normalized dim (a spatial dim)")
    return Requires((make_need(node.args[0], dim, group),))


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
    if node.op != "call_function" or shape(node) is None or shape(operand) is None:
        return None
    rule = SHIFT_RULES.get(getattr(node.target, "overloadpacket", node.target))
    out = rule(node, operand, frozenset(dims)) if rule is not None else None
    return tuple(sorted(out)) if out else None


def shift_is_additive(node: fx.Node) -> bool:
    """The op's output change is the sum of each operand's own (add, sub, cat, stack): shifts on several
    operands superpose, so the other operands may change too."""
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in SHIFT_ADDITIVE


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


def _only_at(node: fx.Node, operand: fx.Node, index: int) -> bool:
    """``operand`` is argument ``index`` of ``node`` and no other argument."""
    args = list(node.args) + list(node.kwargs.values())
    return len(node.args) > index and node.args[index] is operand and sum(a is operand for a in args) == 1


def _broadcast_dims(out: fx.Node, operand: fx.Node, dims) -> set[int]:
    """Output dims of a broadcasting op along which the operand's shift is constant: its own dims
    (right-aligned) and every dim it is broadcast along (absent or of size 1 there)."""
    offset = _rank(out) - _rank(operand)
    s_in, s_out = shape(operand), shape(out)
    spread = {d for d in range(_rank(out)) if d < offset or (s_in[d - offset] == 1 and s_out[d] != 1)}
    return {d + offset for d in dims} | spread


def _shift_same(node, operand, dims):
    return dims if _only_at(node, operand, 0) else None


def _shift_dropout(node, operand, dims):
    return None if is_training_dropout(node) else _shift_same(node, operand, dims)


def _shift_add_sub(node, operand, dims):
    """(x + δ) ± y = (x ± y) ± δ, δ broadcast to the output (also when x is on both sides: 0 or 2δ)."""
    return _broadcast_dims(node, operand, dims)


def _shift_mul(node, operand, dims):
    """(x + δ)·s = x·s + δ·s: constant along the dims where both δ and s are."""
    a, b = node.args[0], node.args[1]
    if (a is operand) == (b is operand):
        return None
    other = b if a is operand else a
    return {d for d in _broadcast_dims(node, operand, dims) if _is_row_scalar(node, other, d)}


def _shift_div(node, operand, dims):
    if node.kwargs.get("rounding_mode") is not None or not _only_at(node, operand, 0):
        return None
    return {d for d in _broadcast_dims(node, operand, dims) if _is_row_scalar(node, node.args[1], d)}


def _shift_in_place(rule):
    """``a.add_(b)``: the functional rule, if no other reader can see ``a`` overwritten."""
    def in_place_shift(node, operand, dims):
        return rule(node, operand, dims) if overwrites_a_private_value(node) else None
    return in_place_shift


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


def _shift_view(node, operand, dims):
    """A reshape: an output dim is constant where every input dim of its block (size > 1) is."""
    if not _only_at(node, operand, 0):
        return None
    in_s, out_s = shape(operand), shape(node)
    out = set()
    for ins, outs in view_groups(in_s, out_s):
        if all(d in dims or in_s[d] == 1 for d in ins):
            out.update(outs)
    return out


def _shift_permute(node, operand, dims):
    order = [d % _rank(node) for d in node.args[1]]
    return {k for k, d in enumerate(order) if d in dims} if _only_at(node, operand, 0) else None


def _shift_transpose(node, operand, dims):
    r = _rank(node)
    a, b = node.args[1] % r, node.args[2] % r
    return {b if d == a else a if d == b else d for d in dims} if _only_at(node, operand, 0) else None


def _shift_t(node, operand, dims):
    return {1 - d for d in dims} if _rank(node) == 2 and _only_at(node, operand, 0) else _shift_same(node, operand, dims)


def _shift_numpy_t(node, operand, dims):
    return {_rank(node) - 1 - d for d in dims} if _only_at(node, operand, 0) else None


def _shift_expand(node, operand, dims):
    """Broadcasting copies δ along new or size-1 dims: constant along those too."""
    return _broadcast_dims(node, operand, dims) if _only_at(node, operand, 0) else None


def _shift_slice(node, operand, dims):
    """Any part of a constant run (even along the dim itself, with any step) is constant."""
    return dims if _only_at(node, operand, 0) else None


def _shift_select(node, operand, dims):
    ds = node.args[1] % _rank(operand)
    return {d if d < ds else d - 1 for d in dims if d != ds} if _only_at(node, operand, 0) else None


def _shift_index_select(node, operand, dims):
    return dims if _only_at(node, operand, 0) else None  # picked entries of a constant run are constant


def _shift_cat(node, operand, dims):
    """Joined with parts shifted on their own (or not at all): constant along every dim but the joined one."""
    if _rank(operand) != _rank(node):
        return None
    return dims - {_arg(node, 1, "dim", 0) % _rank(node)}


def _shift_stack(node, operand, dims):
    ds = _arg(node, 1, "dim", 0) % _rank(node)
    return {d if d < ds else d + 1 for d in dims}


def _shift_pad(node, operand, dims):
    """Padding with a constant: the change is δ inside and 0 in the padding, constant along unpadded dims."""
    pad = list(node.args[1])
    r = _rank(node)
    padded = {r - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]}
    return dims - padded if _only_at(node, operand, 0) else None


def _shift_reduce(node, operand, dims):
    """Summing (averaging) over other dims: Σ δ is constant where δ was."""
    reduce = _arg(node, 1, "dim", None)
    if reduce is None or not _only_at(node, operand, 0):
        return None
    reduced = {d % _rank(operand) for d in ([reduce] if isinstance(reduce, int) else reduce)}
    if _arg(node, 2, "keepdim", False):
        return dims - reduced
    return {d - sum(r < d for r in reduced) for d in dims - reduced}


def _shift_linear(node, operand, dims):
    """(x + δ)·Wᵀ + b = (x·Wᵀ + b) + δ·Wᵀ: constant along δ's dims except the features, which W mixes."""
    last = _rank(operand) - 1
    return {d + _rank(node) - _rank(operand) for d in dims if d != last} if _only_at(node, operand, 0) else None


def _shift_mm(node, operand, dims):
    """(a + δ)·b = a·b + δ·b, constant along the rows where δ is; a·(b + δ), along the columns."""
    a, b = node.args[0], node.args[1]
    if a is b or _rank(a) < 2 or _rank(b) < 2:
        return None
    if operand is a and _rank(a) - 2 in dims:
        return {_rank(node) - 2}
    if operand is b and _rank(b) - 1 in dims:
        return {_rank(node) - 1}
    return None


def _shift_getitem(node, operand, dims):
    """A part of a split along any dim keeps its constant runs; unbinding a dim drops it."""
    src = node.args[0]
    packet = getattr(getattr(src, "target", None), "overloadpacket", None) if isinstance(src, fx.Node) else None
    name = str(packet).removeprefix("aten.") if packet is not None else None
    if name not in _SPLIT_DIM_ARG or src.args[0] is not operand:
        return None
    ds = _arg(src, _SPLIT_DIM_ARG[name], "dim", 0) % _rank(operand)
    return {d if d < ds else d - 1 for d in dims if d != ds} if name == "unbind" else dims


def _shift_masked(node, operand, dims):
    """x + δ where the mask keeps x, the fill (or source) elsewhere: constant where δ and the mask are."""
    if not _only_at(node, operand, 0):
        return None
    return {d for d in dims if constant_along(node.args[1], _rank(node), d)}


def _shift_repeat(node, operand, dims):
    """Copies of a constant run are constant, along the repeated dims too; new leading dims hold copies."""
    if not _only_at(node, operand, 0):
        return None
    new = _rank(node) - _rank(operand)
    return {d + new for d in dims} | set(range(new))


def _shift_roll(node, operand, dims):
    """A cyclic shift along some dims moves a constant run along them, still constant."""
    return dims if _only_at(node, operand, 0) and _arg(node, 2, "dims", []) else None


def _shift_spatial(node, operand, dims):
    """The same weights for every channel: constant along the non-spatial dims where δ is (along a spatial
    dim, padded pooling weights need not sum to 1)."""
    if not _only_at(node, operand, 0):
        return None
    return {d for d in dims if d < _rank(node) - _SPATIAL_DIMS[op_packet(node)]}


# --------------------------------------------------------------------------- the table


_ZERO_OPS = set(aten_packets("zeros", "zeros_like", "new_zeros"))
# upsampling and average pooling -> how many trailing (spatial) dims they act on
_SPATIAL_OP_NAMES = {
    **dict.fromkeys(("upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_linear1d", "avg_pool1d",
                     "adaptive_avg_pool1d"), 1),
    **dict.fromkeys(("upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
                     "upsample_bicubic2d", "_upsample_bicubic2d_aa", "avg_pool2d", "adaptive_avg_pool2d",
                     "_adaptive_avg_pool2d"), 2),
    **dict.fromkeys(("upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_trilinear3d", "avg_pool3d",
                     "adaptive_avg_pool3d", "_adaptive_avg_pool3d"), 3)}
_SPATIAL_DIMS = {packet: k for name, k in _SPATIAL_OP_NAMES.items() for packet in aten_packets(name)}
_BROADCAST_OPS = set(aten_packets("expand", "expand_as", "broadcast_to"))
# elementwise ops on masks and indices (comparisons, logic): constant along a dim where every operand is
_ELEMENTWISE_PREDICATES = set(aten_packets("eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and",
                                           "logical_or", "logical_xor", "bitwise_not", "bitwise_and", "bitwise_or",
                                           "__and__", "__or__", "__invert__"))
# op -> index of its fill value: full(size, v), full_like(x, v), fill(x, v), new_full(x, size, v)
_FULL_OPS = {**{p: 1 for p in aten_packets("full", "full_like", "fill")}, **{p: 2 for p in aten_packets("new_full")}}

# (aten op names, zero-mean rule, shift rule): the whole table, read top to bottom; an op listed twice
# takes its last rules. The shift column (None: the op does not pass a shift) is read by the
# closedness check: where a ones-vector shift that centering adds to an input comes out.
_TABLE: list[tuple[tuple[str, ...], Callable[[fx.Node, int, int | None], Answer], Callable | None]] = [
    # value-preserving: copies, casts, eval dropout
    ((*COPY_OP_NAMES, *CAST_OP_NAMES), _same_dim, _shift_same),
    (DROPOUT_OP_NAMES, _dropout, _shift_dropout),
    # arithmetic (in place: the same rule if nothing else reads the overwritten tensor)
    (("add", "sub"), _add_sub, _shift_add_sub), (("add_", "sub_"), _in_place(_add_sub), _shift_in_place(_shift_add_sub)),
    (("mul",), _mul, _shift_mul), (("mul_",), _in_place(_mul), _shift_in_place(_shift_mul)),
    (("div",), _div, _shift_div), (("div_",), _in_place(_div), _shift_in_place(_shift_div)),
    (("neg",), _same_dim, _shift_same),  # -P·x = P·(-x)
    # layout
    (("view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"),
     _view, _shift_view),
    (("permute",), _permute, _shift_permute), (("transpose", "swapaxes"), _transpose, _shift_transpose),
    (("t",), _t, _shift_t), (("numpy_T",), _numpy_t, _shift_numpy_t),
    (("expand", "expand_as", "broadcast_to"), _expand, _shift_expand),
    # indexing, joining, padding, reducing
    (("slice",), _slice, _shift_slice), (("select",), _select, _shift_select),
    (("index_select",), _index_select, _shift_index_select), (("index",), _index, None),
    (("cat", "concat", "concatenate"), _cat, _shift_cat), (("stack",), _stack, _shift_stack),
    (("constant_pad_nd",), _constant_pad, _shift_pad), (("pad",), _pad, None),
    (("mean", "sum"), _reduce_other_dims, _shift_reduce),
    # linear maps: zero-mean outputs iff the weight is centered (the parameter sources)
    (("linear",), _linear, _shift_linear), (("addmm",), _addmm, None), (("mm", "matmul", "bmm"), _mm, _shift_mm),
    (("baddbmm",), _baddbmm, None),
    (("scaled_dot_product_attention",), _sdpa, None),
    (("conv1d", "conv2d", "conv3d"), _conv, None),
    (("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"), _conv_transpose, None),
    (("embedding",), _embedding, None),
    # sources (a LayerNorm absorbs a shift of its input: the closedness check decides that, not this column)
    (("layer_norm",), _layer_norm_source, None),
    # ops that treat every feature alike: whole rows moved, copied, averaged or zeroed, or a row's entries permuted
    (("masked_fill",), _masked_fill, _shift_masked), (("masked_fill_",), _in_place(_masked_fill), None),
    (("masked_scatter",), _masked_scatter, _shift_masked), (("masked_scatter_",), _in_place(_masked_scatter), None),
    (("index_put",), _index_put, None), (("index_put_",), _in_place(_index_put), None),
    (("index_copy",), _index_copy, None), (("index_copy_",), _in_place(_index_copy), None),
    (("gather",), _gather, None),
    (("repeat", "tile"), _repeat, _shift_repeat),
    (("roll",), _roll, _shift_roll),
    (tuple(_SPATIAL_OP_NAMES), _spatial, _shift_spatial),
]
RULES: dict[object, Callable[[fx.Node, int, int | None], Answer]] = {
    packet: rule for names, rule, _ in _TABLE for packet in aten_packets(*names)}
RULES[operator.getitem] = _getitem
RULES[_aten.convolution] = lambda n, d, g: _conv(n, d, g, transposed_index=6, groups_index=8)
RULES.update(dict.fromkeys((*_ZERO_OPS, *_FULL_OPS), _zero_source))
SHIFT_RULES: dict[object, Callable[[fx.Node, fx.Node, int], int | None]] = {
    packet: shift for names, _, shift in _TABLE if shift is not None for packet in aten_packets(*names)}
SHIFT_RULES[operator.getitem] = _shift_getitem

SHIFT_ADDITIVE = set(aten_packets("add", "sub", "add_", "sub_", "cat", "concat", "concatenate", "stack"))

# rules that also answer for a block of dims (pure layout: copies, casts, reshapes, permutations; scaling by a number)
BLOCK_RULES = {_same_dim, _dropout, _view, _permute, _transpose, _t, _numpy_t, _layer_norm_source, _mul, _div}

# ops that only read metadata (shape, dtype): a change of their input's values cannot reach them
METADATA_OPS = set(aten_packets("_assert_tensor_metadata", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
                            "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones",
                            "new_empty", "new_full"))
# ops whose output is always new memory (never their input, never a view of it)
_FRESH_OUTPUT_OPS = set(aten_packets(
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d", "conv3d", "convolution", "add", "sub",
    "mul", "div", "neg", "embedding", "layer_norm", "rms_norm", "gelu", "relu", "silu", "tanh", "softmax", "cat",
    "stack", "clone", "scaled_dot_product_attention"))
# ops that only move values (bitwise exact): what ``same_value`` compares, seeing through value copies
# (``op_kinds.through_value_copies``)
_LAYOUT_OPS = set(aten_packets("view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze",
                           "permute", "transpose", "t", "expand", "slice", "select", "cat", "concat", "stack"))
# ops whose result is a list consumed through getitem
MULTI_OUTPUT_OPS = set(aten_packets(*_SPLIT_DIM_ARG))
# op -> the argument read only for its shape (or dtype): ``expand_as(x, other)``, ``view_as(x, other)``
_SHAPE_SOURCE_ARG = {p: 1 for p in aten_packets("expand_as", "view_as", "reshape_as", "type_as")}


# --------------------------------------------------------------------------- partial needs
#
# A norm may read only a part of a tensor: q = qkv.view(B, T, H, 3, D)[..., 0, :] reads the q rows of
# a fused projection. The question is then asked of that part alone, so that only the output rows of
# the fused weight that reach a norm are centered, per group (head), and the v rows stay as they are.
# ``classify_part`` answers such questions for the ops that pick or move parts (selections, reshapes,
# copies) and for the Linear that makes them; every other op is asked about the whole tensor
# (``classify``), which requires more and is therefore never wrong. Which elements centering then
# changes, and that no other reader sees them, the analysis checks (``analysis._FoldingSet``).


class Part(NamedTuple):
    """The part of a node a Need asks about: along the need's own dim, only the groups (of the
    need's ``group`` elements) numbered in ``groups`` (None: every group); along other dims, only
    the indices in ``where`` ((dim, indices) pairs, sorted by dim)."""

    groups: frozenset[int] | None
    where: tuple[tuple[int, frozenset[int]], ...]


def part_need(node: fx.Node, dim: int, group: int | None, groups, where) -> Need:
    """A canonical Need for a part: no Part when it covers the whole node."""
    need = make_need(node, dim, group)
    n_groups = shape(node)[dim] // (need.group or shape(node)[dim])
    groups = None if groups is None or set(groups) >= set(range(n_groups)) else frozenset(groups)
    where = tuple(sorted((d, frozenset(s)) for d, s in dict(where).items()
                         if not set(s) >= set(range(shape(node)[d]))))
    return need if groups is None and not where else need._replace(part=Part(groups, where))


def classify_part(need: Need, captured: Captured) -> Answer | None:
    """The answer for a question about a part of ``need.node``, or for a whole-node question that
    a selection turns into one about a part of its input; None where no rule knows parts (the
    caller then asks about the whole node with ``classify``)."""
    node, dim, group = need.node, need.dim, need.group
    if node.op != "call_function" or isinstance(dim, tuple) or shape(node) is None \
            or written_through_a_view(node) is not None:
        return None
    groups, where = (need.part.groups, dict(need.part.where)) if need.part is not None else (None, {})
    rule = RULES.get(getattr(node.target, "overloadpacket", node.target))
    if rounding_cast(node, captured) is not None:
        return None  # ``classify`` refuses it
    if rule in (_same_dim, _dropout) and not is_training_dropout(node) and isinstance(node.args[0], fx.Node):
        return Requires((part_need(node.args[0], dim, group, groups, where),))
    if rule is _select:
        return _select_part(node, dim, group, groups, where)
    if rule is _slice:
        return _slice_part(node, dim, group, groups, where)
    if rule is _getitem:
        return _split_part(node, dim, group, groups, where)
    if need.part is None:
        return None
    if rule is _view:
        return _view_part(node, dim, group, groups, where)
    if rule is _linear and groups is not None and dim == _rank(node) - 1:
        w, b = node.args[1], _arg(node, 2, "bias")  # output groups g of x·Wᵀ + b are rows g of W and b
        return Requires(tuple(part_need(p, 0, group, groups, ()) for p in (w, b) if p is not None))
    return None


def _picked(x: fx.Node, out_dim: int, ds: int, group, groups, where, indices: list[int], keep_dim: bool) -> Requires:
    """The need on ``x`` of an op that reads ``indices`` of its dim ``ds`` (another dim than the
    asked one): the output dims map back past ``ds`` (dropped by a select), and a part along ``ds``
    maps each output index to the input index it reads."""
    back = (lambda d: d) if keep_dim else (lambda d: d if d < ds else d + 1)
    moved = {back(d): s for d, s in where.items() if keep_dim is False or d != ds}
    moved[ds] = frozenset(indices[i] for i in where[ds]) if keep_dim and ds in where else frozenset(indices)
    return Requires((part_need(x, back(out_dim), group, groups, moved),))


def _select_part(node, dim, group, groups, where):
    x = node.args[0]
    ds = node.args[1] % _rank(x)
    return _picked(x, dim, ds, group, groups, where, [node.args[2] % shape(x)[ds]], keep_dim=False)


def _slice_part(node, dim, group, groups, where):
    x = node.args[0]
    ds = _arg(node, 1, "dim", 0) % _rank(x)
    total = shape(x)[ds]
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
    start, length, total = indices[0], len(indices), shape(x)[dim]
    g = group or length
    if start % g or length % g or total % g:
        return None
    picked = [start // g + j for j in range(length // g) if groups is None or j in groups]
    return Requires((part_need(x, dim, g, picked, where),))


def _split_part(node, dim, group, groups, where):
    src, index = node.args
    name = str(getattr(getattr(src, "target", None), "overloadpacket", "")).removeprefix("aten.")
    if name not in _SPLIT_DIM_ARG:
        return None
    x = src.args[0]
    ds = _arg(src, _SPLIT_DIM_ARG[name], "dim", 0) % _rank(x)
    if name == "unbind":
        return _picked(x, dim, ds, group, groups, where, [index], keep_dim=False)
    sizes = [int(v.shape[ds]) for v in src.meta["val"]]
    start = sum(sizes[:index])
    indices = list(range(start, start + sizes[index]))
    if ds == dim:
        return _groups_of_part(x, dim, group, groups, where, indices) if indices else None
    return _picked(x, dim, ds, group, groups, where, indices, keep_dim=True)


def _view_part(node, dim, group, groups, where):
    """A reshape that splits one input dim into (..., dim) with the asked dim innermost: the asked
    part is a set of contiguous groups of that input dim (qkv (B, T, 3·H·D) viewed as (B, T, H, 3, D):
    q's rows are the groups h·3 + 0 of D elements; viewed as (B, T, H, 3·D), q is group 0 of each
    head's 3·D, the groups h·3 + 0 again). Parts along dims the reshape keeps carry over;
    parts along dims it merges otherwise are dropped (asking about more is never wrong)."""
    x = node.args[0]
    in_s, out_s = shape(x), shape(node)
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
    in_s = shape(x)
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


# --------------------------------------------------------------------------- casts that round
#
# The fold is proved in float64 on a float64 copy of the model, where a cast the code writes as
# ``.to(x.dtype)`` is the identity but a cast to a fixed narrower dtype (``weights @ flat.float()``
# inside a float64 model) still rounds. Rounding does not commute with centering: round(P·x) is
# zero-mean only up to the narrower dtype's unit roundoff, so a norm whose zero-mean input passes
# through such a cast cannot be made an exact RMSNorm, and the analysis refuses it with that reason
# (rather than letting the float64 proof fail). Which casts round is read from the trace: a cast to
# a float dtype narrower than the cast's input and than every floating parameter of the model
# cannot be "the model's dtype", so it is fixed in the code and rounds in the float64 proof too.
# A model traced in float32 shows ``.float()`` as a float32 -> float32 no-op: fold it in float64
# (``model.double()``) for the analysis to see that cast.

_PARAMETER_DTYPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rounding_cast(node: fx.Node, captured: Captured) -> str | None:
    """Why the cast ``node`` rounds in the float64 proof (see above), or None for every other node."""
    if getattr(node.target, "overloadpacket", None) not in CAST_OPS or not node.args:
        return None
    out, x = node.meta.get("val"), node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)
            and out.dtype.is_floating_point and x.dtype.is_floating_point):
        return None
    narrowest = per_graph(_PARAMETER_DTYPES, node.graph, lambda graph: _narrowest_parameter_dtype(captured))
    if _unit_roundoff(out.dtype) <= max(_unit_roundoff(x.dtype), _unit_roundoff(narrowest or out.dtype)):
        return None
    return (f"{op_name(node)} rounds {dtype_name(x.dtype)} to {dtype_name(out.dtype)}, narrower than the model's "
            f"{dtype_name(narrowest)} (a cast fixed in the code, which rounds in the float64 proof too): centering "
            f"upstream makes the norm's input zero-mean only up to {dtype_name(out.dtype)}'s rounding, not exactly")


def _narrowest_parameter_dtype(captured: Captured) -> torch.dtype | None:
    dtypes = [v.dtype for p in captured.param_fqn if isinstance(v := p.meta.get("val"), torch.Tensor)
              and v.dtype.is_floating_point]
    return max(dtypes, key=_unit_roundoff, default=None)


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2
