"""In-place writes and views: when a value a rule reasons about can be overwritten behind its back.

A rule reads what an op computed; an in-place write through a view (``t[:, :k] = v``) changes what
later readers see, and an in-place op (``a.add_(b)``) acts like its functional form only when no
other reader sees ``a`` change. Views and writes come from the ops' schemas; dead readers (no path
to the output or a side effect) see nothing.
"""
from __future__ import annotations

import operator
import weakref

from torch import fx

from ..graph import op_name, per_graph
from ..op_kinds import aten_packets
from .answers import Break


# ops whose output is always new memory (never their input, never a view of it)
_FRESH_OUTPUT_OPS = set(aten_packets(
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d", "conv3d", "convolution", "add", "sub",
    "mul", "div", "neg", "embedding", "layer_norm", "rms_norm", "gelu", "relu", "silu", "tanh", "softmax", "cat",
    "stack", "clone", "scaled_dot_product_attention"))


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


def overwrites(node: fx.Node) -> bool:
    """``node`` writes one of its inputs (its op's schema is mutable)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return bool(schema is not None and schema.is_mutable)


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


def in_place(rule):
    """``a.add_(b)`` etc.: the functional rule, if no other reader can see ``a`` overwritten."""
    def in_place_rule(node, dim, group):
        if not overwrites_a_private_value(node):
            return Break(f"{op_name(node)} overwrites a tensor that is also read elsewhere")
        return rule(node, dim, group)
    return in_place_rule


def shift_in_place(rule):
    """``a.add_(b)``: the functional rule, if no other reader can see ``a`` overwritten."""
    def in_place_shift(node, operand, dims):
        return rule(node, operand, dims) if overwrites_a_private_value(node) else None
    return in_place_shift
