"""What a norm module computes, read from its traced ops rather than assumed from its class.

A module the fold may replace must compute, on its input x, exactly

    y = LayerNorm(x) · (offset + γ) + β      over the last dim of x,

with γ/β its own parameters (or absent) and offset a constant: torch's ``nn.LayerNorm`` (offset 0),
Nemotron's ``LayerNorm1P`` (``weight + 1``: offset 1) and a parameter-free module calling
``F.layer_norm(x, shape, None, None, eps)`` (OLMo's) all do; that form is an RMSNorm with the same
offset once x is zero-mean. A channels-first norm (ConvNeXt's, GotOcr2's, LW-DETR's) runs the same
form between a permute of its input and the inverse permute of its output: an RMSNorm between the
same permutes (``normfold.nn.PermutedRMSNorm``) once x is zero-mean over the normalized (channel)
dim. Anything else the module runs (a cast to float32 around the norm, arithmetic on its input or
output, permutes that do not undo each other) makes it another function, and the module is kept
with a reason naming those ops.
"""
from __future__ import annotations

import numbers
import operator
import weakref
from dataclasses import dataclass, replace

import torch
from torch import fx

from .graph import Captured, module_stack, op_name, op_packet, per_graph
from .rules import METADATA_OPS, NormCall

_aten = torch.ops.aten


@dataclass(frozen=True)
class NormForm:
    """y = LN(x)·(offset + γ) + β: the parameters the traced call reads (None: absent) and the offset;
    ``permute``: y = LN(x.permute(permute))·(offset + γ) + β, permuted back (empty: no permute)."""

    weight_fqn: str | None
    bias_fqn: str | None
    offset: float = 0.0
    permute: tuple[int, ...] = ()


def module_nodes(captured: Captured, path: str) -> list[fx.Node]:
    """The ops the module at ``path`` ran (every call of it, its submodules' included), in graph order."""
    return _nodes_by_module(captured.graph).get(path, [])


_BY_MODULE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _nodes_by_module(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Module path -> the ops it ran, built once per graph and node count (one pass, not one per norm)."""
    return per_graph(_BY_MODULE, graph, _index_by_module)


def _index_by_module(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    ran: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            for path in dict.fromkeys(p for p, _ in module_stack(node)):
                ran.setdefault(path, []).append(node)
    return ran


def traced_form(calls: list[NormCall], path: str, captured: Captured) -> NormForm | str:
    """The form every traced call of the module at ``path`` computes, or why it is not that form:
    a predicate naming what the module computes instead ("computes aten.permute → ...")."""
    forms = set()
    for call in calls:
        form = _weight_form(call, path, captured)
        if isinstance(form, str):
            return form
        forms.add(form)
    if len(forms) != 1:
        return f"reads different parameters in different calls: {sorted(forms, key=str)}"
    own = {c.node for c in calls} | {c.output for c in calls} | {c.weight for c in calls}
    extra = [n for n in module_nodes(captured, path) if n not in own and op_packet(n) not in METADATA_OPS
             and not _is_norm_statistic(n, calls)]
    order = _permuted_around(extra, calls)
    if extra and order is None:
        return (f"computes {_ops_around(extra, calls)}, not a layer norm of its input alone "
                "(normfold's RMSNorm normalizes its input's last dim, with nothing around it)")
    return replace(forms.pop(), permute=order or ())


def _permuted_around(extra: list[fx.Node], calls: list[NormCall]) -> tuple[int, ...] | None:
    """The order p when the module's other ops are, for every call, exactly x.permute(p) feeding the
    norm and the inverse permute of its output, read by nothing else (a channels-first norm); else None."""
    orders, pairs = set(), set()
    for call in calls:
        before, users = call.x, list(call.output.users) if call.output is not None else []
        if op_packet(before) != _aten.permute or len(before.users) != 1 or len(users) != 1:
            return None
        after = users[0]
        order = tuple(d % len(before.args[1]) for d in before.args[1])
        inverse = tuple(sorted(range(len(order)), key=order.__getitem__))
        if op_packet(after) != _aten.permute or tuple(d % len(order) for d in after.args[1]) != inverse:
            return None
        orders.add(order)
        pairs |= {before, after}
    return orders.pop() if len(orders) == 1 and pairs == set(extra) else None


def _weight_form(call: NormCall, path: str, captured: Captured) -> NormForm | str:
    """The call's γ, β and offset when each is the module's own parameter (γ possibly + a constant)."""
    bias = _own_param(call.bias, path, captured)
    if call.bias is not None and bias is None:
        return f"reads β = {_what(call.bias, captured)}, not a parameter of its own"
    if call.weight is None:
        return NormForm(None, bias)
    weight = _own_param(call.weight, path, captured)
    if weight is not None:
        return NormForm(weight, bias)
    shifted = _constant_offset(call.weight, path, captured)
    if shifted is not None:
        weight, offset = shifted
        return NormForm(weight, bias, offset)
    return f"reads γ = {_what(call.weight, captured)}, not a parameter of its own (plus a constant)"


def _own_param(node, path: str, captured: Captured) -> str | None:
    """The name under which the module at ``path`` holds the parameter ``node`` (a tied one has several)."""
    fqn = captured.param_fqn.get(node) if isinstance(node, fx.Node) else None
    if fqn is None:
        return None
    return next((name for name in captured.aliases.get(fqn, (fqn,)) if name.rpartition(".")[0] == path), None)


def _constant_offset(node: fx.Node, path: str, captured: Captured) -> tuple[str, float] | None:
    """(γ's name, c) when ``node`` is γ + c for a number c and γ a parameter of the module."""
    if op_packet(node) != _aten.add or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    for param, number in (node.args, node.args[::-1]):
        fqn = _own_param(param, path, captured)
        if fqn is not None and isinstance(number, numbers.Real) and not isinstance(number, bool):
            return fqn, float(number)
    return None


def _is_norm_statistic(node: fx.Node, calls: list[NormCall]) -> bool:
    """A getitem of a multi-output norm op (normfold's norm_fwd returns y and its statistics)."""
    return node.target is operator.getitem and any(node.args[0] is c.node for c in calls)


def _ops_around(extra: list[fx.Node], calls: list[NormCall]) -> str:
    """"aten.permute → the norm → aten.permute": the module's other ops before and after its norm op."""
    first = calls[0].node
    order = {n: i for i, n in enumerate(first.graph.nodes)}
    before = [op_name(n) for n in extra if order[n] < order[first]][-3:]
    after = [op_name(n) for n in extra if order[n] > order[first]][:3]
    return " → ".join([*before, op_name(first), *after])


def _what(node, captured: Captured) -> str:
    if isinstance(node, fx.Node):
        return captured.param_fqn.get(node) or captured.buffer_fqn.get(node) or f"computed by {op_name(node) or node.op}"
    return repr(node)
