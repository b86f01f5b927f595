"""What a norm module computes, read from its traced ops rather than assumed from its class.

A module the fold may replace must compute, on its input x, exactly

    y = LayerNorm(x) · (offset + γ) + β      over the last dim of x,

with γ/β its own parameters (or absent) and offset a constant: torch's ``nn.LayerNorm`` (offset 0),
Nemotron's ``LayerNorm1P`` (``weight + 1``: offset 1) and a parameter-free module calling
``F.layer_norm(x, shape, None, None, eps)`` all do; that form is an RMSNorm with the same offset once
x is zero-mean. OLMo's ``OlmoLayerNorm`` runs the parameter-free form between a cast of its input to
float32 and a cast back (``NormForm.cast``): equal to it in exact arithmetic, so it becomes an RMSNorm
the same way, proved in float64 against its own code with the casts removed (:func:`without_downcasts`)
and in the model's dtype against the original as it is. ESMC's ``EsmcLayerNorm`` casts the layer
norm's output (γ/β applied) back to its input's dtype, ``super().forward(x).to(x.dtype)``
(``NormForm.cast_back``): normfold's RMSNorm returns its input's dtype too, so the swap computes the
same cast; a cast of the output to another dtype keeps the module. A channels-first norm (ConvNeXt's, GotOcr2's,
LW-DETR's) runs the same form between a permute of its input and the inverse permute of its output: an
RMSNorm between the same permutes (``normfold.nn.PermutedRMSNorm``) once x is zero-mean over the
normalized (channel) dim. Anything else the module runs (arithmetic on its input or output, γ/β inside
casts, permutes that do not undo each other) makes it another function, and the module is kept with a
reason naming those ops.

RMSNorms written out as elementwise ops (Llama's ``LlamaRMSNorm``, Gemma's with (1 + w), ...) are
recognised the same way, from what they compute (:func:`rms_form`): x / √(mean(x², -1) + eps),
optionally inside a cast to float32 and back, times γ or (offset + γ), before or after the cast
back. Such a module becomes normfold's ``RMSNorm`` (:func:`recognized_rms_norms`), whose float64
run is the module's math without the casts (:func:`without_downcasts` runs the original so).
"""
from __future__ import annotations

import functools
import numbers
import operator
import weakref
from dataclasses import dataclass, replace

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from .._text import dtype_name
from ..nn.kinds import LAYER_NORM_TYPES, RMS_NORM_TYPES, norm_kind
from .graph import Captured, module_stack, op_name, op_packet, per_graph, shape, static_size
from .op_kinds import CAST_OPS
from .plan import SwapStep
from .rules import METADATA_OPS, NormCall, norm_call

_aten = torch.ops.aten


@dataclass(frozen=True)
class NormForm:
    """y = LN(x)·(offset + γ) + β: the parameters the traced call reads (None: absent) and the offset;
    ``permute``: y = LN(x.permute(permute))·(offset + γ) + β, permuted back (empty: no permute);
    ``cast``: y = LN(x cast to that dtype), cast back to x's dtype (OLMo's; None: no cast);
    ``cast_back``: y = LN(x)·(offset + γ) + β cast to x's dtype (ESMC's), what normfold's RMSNorm returns."""

    weight_fqn: str | None
    bias_fqn: str | None
    offset: float = 0.0
    permute: tuple[int, ...] = ()
    cast: str | None = None
    cast_back: bool = False


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
    form = forms.pop()
    order = _permuted_around(extra, calls)
    cast = _cast_around(extra, calls) if extra and order is None else None
    back = _casts_after(extra, calls) if extra and order is None and cast is None else None
    if extra and order is None and cast is None and back is None:
        return (f"computes {_ops_around(extra, calls)}, not a layer norm of its input alone "
                "(normfold's RMSNorm normalizes its input's last dim, with nothing around it)")
    if cast is not None and (form.weight_fqn or form.bias_fqn):
        return (f"computes {_ops_around(extra, calls)} with γ/β inside the casts: only a parameter-free layer norm "
                "between casts (OLMo's) is read as one")
    other = next(((to, given) for given, chain in back or () for to in chain if to != given), None)
    if other is not None:
        return (f"computes {_ops_around(extra, calls)}, casting its layer norm's output to {dtype_name(other[0])}, "
                f"not back to its input's {dtype_name(other[1])} (normfold's RMSNorm returns its input's dtype, "
                "rounding nowhere else)")
    if any(len(chain) > 1 for _, chain in back or ()):
        return (f"computes {_ops_around(extra, calls)}, casting its layer norm's output more than once: only one cast "
                "back to its input's dtype is read as normfold's RMSNorm's own (a chain of casts names a dtype fixed "
                "in the code, which this trace shows as its input's and a float64 proof would round to)")
    return replace(form, permute=order or (), cast=cast, cast_back=back is not None)


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


def _cast_around(extra: list[fx.Node], calls: list[NormCall]) -> str | None:
    """The dtype d when the module's other ops are, for every call, exactly a cast of its input x to d
    feeding the norm and a cast of the norm's output back to x's dtype, read by nothing else (OLMo's
    ``F.layer_norm(x.to(torch.float32), ...).to(x.dtype)``); else None. In exact arithmetic the casts
    change nothing, so the form is LN(x); normfold's RMSNorm computes a 16-bit input's statistics in
    float32 too, and the model's dtype is judged against the original as it is."""
    dtypes, pairs = set(), set()
    for call in calls:
        before, users = call.x, _value_users(call.output) if call.output is not None else []
        if op_packet(before) not in CAST_OPS or len(users) != 1:
            return None
        after, source = users[0], before.args[0]
        inner, outer, given = _traced_dtype(before), _traced_dtype(after), _traced_dtype(source)
        if op_packet(after) not in CAST_OPS or after.args[0] is not call.output or inner is None \
                or not inner.is_floating_point or given is None or outer != given:
            return None
        # the cast's value is the norm's alone; export hands a cast to the same dtype (x itself, as
        # eager's .to returns it) to x's later readers too, which then read x
        if inner != given and _value_users(before) != [call.node]:
            return None
        dtypes.add(inner)
        pairs |= {before, after}
    return dtype_name(dtypes.pop()) if len(dtypes) == 1 and pairs == set(extra) else None


def _casts_after(extra: list[fx.Node], calls: list[NormCall]) -> list[tuple[torch.dtype, tuple[torch.dtype, ...]]] | None:
    """Per call, (x's dtype, the dtypes its casts go to) when the module's other ops are, for every call,
    exactly a chain of floating casts of the norm's output, each read by the next alone (ESMC's
    ``super().forward(x).to(x.dtype)``: one cast); else None. One cast to x's own dtype is what
    normfold's RMSNorm does to its output anyway (it computes a 16-bit input's statistics, γ and β in
    float32 and rounds once to x's dtype, as torch's layer norm does; under autocast torch's hands back
    float32, which the cast rounds to x's dtype): the swap computes the same, cast included, in every
    dtype. A cast to another dtype is not: it rounds (float32 in a float64 model) or changes the
    output's dtype."""
    chains, nodes = [], set()
    for call in calls:
        given = _traced_dtype(call.x)
        node, users = call.output, _value_users(call.output) if call.output is not None else []
        if given is None or len(users) != 1:
            return None
        dtypes = []
        while len(users) == 1 and users[0] in extra and op_packet(users[0]) in CAST_OPS and users[0].args[0] is node:
            node = users[0]
            to = _traced_dtype(node)
            if to is None or not to.is_floating_point:
                return None
            dtypes.append(to)
            nodes.add(node)
            users = _value_users(node)
        if not dtypes:
            return None
        chains.append((given, tuple(dtypes)))
    return chains if nodes == set(extra) else None


def _value_users(node: fx.Node) -> list[fx.Node]:
    """The ops reading ``node``'s value (not the metadata assertions export adds)."""
    return [u for u in node.users if op_packet(u) not in METADATA_OPS]


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


# --------------------------------------------------------------------------- RMSNorms written out as ops

@dataclass(frozen=True)
class RMSForm:
    """y = x / √(mean(x², -1) + eps) · (offset + γ), as a module spells it in elementwise ops: ``cast``
    the dtype its statistics are computed in when it casts its input first (None: no cast), and
    whether γ multiplies after the cast back to the input's dtype (Llama) or before it (Gemma, OLMo2)."""

    weight_fqn: str | None
    offset: float
    eps: float
    width: int
    cast: str | None = None
    weight_after_cast: bool = False

    def describe(self) -> str:
        """"x·rsqrt(mean(x², -1) + 1e-06) in float32, times γ after the cast back": the form in words."""
        gamma = "" if self.weight_fqn is None else (f", times ({self.offset:g} + γ)" if self.offset else ", times γ")
        if self.cast is None:
            return f"x·rsqrt(mean(x², -1) + {self.eps:g}){gamma}"
        where = " after the cast back" if self.weight_after_cast else f" in {self.cast}"
        return f"x·rsqrt(mean(x², -1) + {self.eps:g}) in {self.cast}{gamma}{where if gamma else ''}"


@dataclass(frozen=True)
class RecognizedNorms:
    """RMSNorm modules written out as ops: the swaps making them normfold ``RMSNorm``\\ s, and per path
    what was recognised (``swaps``) or why a module named like a norm is kept (the others)."""

    swaps: tuple[SwapStep, ...]
    reasons: dict[str, str]


def recognized_rms_norms(model: nn.Module, captures: list[Captured]) -> RecognizedNorms:
    """Every leaf module that is not a torch / normfold norm and computes an RMSNorm of its input in
    every traced call (:func:`rms_form`, the same form in each), as a swap to normfold's ``RMSNorm``;
    a module whose class is named like an RMSNorm (``nn.kinds.norm_kind``) but computes something
    else is kept, with the reason."""
    swaps, reasons = [], {}
    for path, module in model.named_modules():
        if list(module.children()) or isinstance(module, (*RMS_NORM_TYPES, *LAYER_NORM_TYPES)):
            continue
        ran = [module_nodes(captured, path) for captured in captures]
        if not any(ran) or any(norm_call(n) is not None for nodes in ran for n in nodes):
            continue  # not run, or it calls a norm op the analysis reads itself
        named = norm_kind(module) == "RMSNorm"
        if not named and not any(op_packet(n) == _aten.mean for nodes in ran for n in nodes):
            continue
        forms = {rms_form(captured, path) for captured in captures if module_nodes(captured, path)}
        form = forms.pop() if len(forms) == 1 else "computes different things in different example calls"
        others = [n for n, _ in (*module.named_parameters(), *module.named_buffers()) if n != "weight"]
        if not isinstance(form, str) and others:  # normfold's RMSNorm would drop them
            form = f"holds {', '.join(others)} besides γ, which normfold's RMSNorm would drop"
        name = type(module).__name__
        if isinstance(form, str):
            if named:
                reasons[path] = f"kept: {name} {form}"
            continue
        swaps.append(SwapStep(path, "RMSNorm", form.width, form.eps, elementwise_affine=form.weight_fqn is not None,
                              bias=False, offset=form.offset))
        reasons[path] = f"{name} recognised as an RMSNorm from its traced ops: {form.describe()}"
    return RecognizedNorms(tuple(swaps), reasons)


def rms_form(captured: Captured, path: str) -> RMSForm | str:
    """What the module at ``path`` computes when it is an RMSNorm written out as ops, or why it is not
    one (a predicate: "computes ..."). Every op it runs must belong to the form: the statistic
    mean(t², -1) of its input t (through casts), + eps (a number), rsqrt, t times that, then casts
    and one multiply by γ or by (γ + c), γ its own parameter named ``weight``."""
    nodes = [n for n in module_nodes(captured, path) if op_packet(n) not in METADATA_OPS]
    means = [n for n in nodes if op_packet(n) == _aten.mean]
    if len(means) != 1:
        return f"computes {_op_list(nodes)}, not one x·rsqrt(mean(x², -1) + eps)"
    used: set[fx.Node] = set()
    statistic = _rms_statistic(means[0], used)
    if isinstance(statistic, str):
        return statistic
    t, inverse, eps = statistic
    root = _through_casts(t, used, nodes)
    normalized = next((u for u in inverse.users if op_packet(u) == _aten.mul and len(u.args) == 2
                       and _through_casts(_other_operand(u, inverse), set(), nodes) is root), None)
    if normalized is None:
        return f"computes {_op_list(nodes)}: its rsqrt(mean(x², -1) + eps) does not multiply its input"
    used.add(normalized)
    output = _weight_chain(normalized, path, captured, used, nodes)
    if isinstance(output, str):
        return output
    weight, offset, after_cast = output
    extra = [n for n in nodes if n not in used]
    if extra:
        return f"computes {_op_list(extra)} besides x·rsqrt(mean(x², -1) + eps)·γ, not an RMSNorm of its input alone"
    width = static_size(root, -1)
    if width is None:
        return "normalizes a last dim whose size the trace does not fix"
    dtype = _traced_dtype(t)
    cast = None if t is root else (dtype_name(dtype) if dtype is not None else "another dtype")
    return RMSForm(weight, offset, eps, width, cast, after_cast and cast is not None)


def _rms_statistic(mean: fx.Node, used: set[fx.Node]) -> tuple[fx.Node, fx.Node, float] | str:
    """(t, rsqrt(mean(t², -1) + eps), eps) from the mean node, or why it is not that statistic."""
    square = mean.args[0]
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    rank = len(shape(square) or ())
    if list(dims or ()) not in ([-1], [rank - 1]) or not keepdim:
        return f"takes a mean over dims {dims} (keepdim={keepdim}), not over its last dim"
    t = _squared(square)
    if t is None:
        return f"takes the mean of {op_name(square) or square.op}, not of a square"
    add = _single_user(mean)
    if op_packet(add) == _aten.sqrt:
        return "adds eps outside the square root (x / (√mean(x²) + eps)), which normfold's RMSNorm does not compute"
    if op_packet(add) != _aten.add or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1 \
            or not isinstance(add.args[1], numbers.Real) or isinstance(add.args[1], bool) or add.args[0] is not mean:
        return f"computes {op_name(add) if add is not None else 'nothing'} after mean(x², -1), not + eps (a number)"
    inverse = _single_user(add)
    if op_packet(inverse) != _aten.rsqrt:
        return f"computes {op_name(inverse) if inverse is not None else 'nothing'} of mean(x², -1) + eps, not rsqrt"
    used.update((mean, square, add, inverse))
    return t, inverse, float(add.args[1])


def _squared(node: fx.Node) -> fx.Node | None:
    """t when ``node`` is t², spelled pow(t, 2) or t·t."""
    packet = op_packet(node)
    if packet == _aten.pow and len(node.args) == 2 and node.args[1] == 2:
        return node.args[0]
    if packet == _aten.mul and len(node.args) == 2 and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _other_operand(node: fx.Node, operand: fx.Node):
    """The argument of the binary op ``node`` that is not ``operand`` (``operand`` itself for x·x)."""
    return node.args[1] if node.args[0] is operand else node.args[0]


def _single_user(node: fx.Node) -> fx.Node | None:
    users = [u for u in node.users if op_packet(u) not in METADATA_OPS]
    return users[0] if len(users) == 1 else None


def _through_casts(node, used: set[fx.Node], inside: list[fx.Node]):
    """The tensor ``node`` casts, through the module's own cast ops (recorded in ``used``)."""
    while isinstance(node, fx.Node) and node in inside and op_packet(node) in CAST_OPS:
        used.add(node)
        node = node.args[0]
    return node


def _weight_chain(start: fx.Node, path: str, captured: Captured, used: set[fx.Node], inside: list[fx.Node]):
    """From the normalized tensor to the module's output through casts and at most one multiply by γ
    (or γ + c): (γ's name or None, c, whether γ multiplies after a cast), or why not."""
    current, weight, offset, after_cast, cast_seen = start, None, 0.0, False, False
    while True:
        users = [u for u in current.users if op_packet(u) not in METADATA_OPS and u in inside]
        if not users:
            return weight, offset, after_cast
        if len(users) > 1:
            return f"reads x·rsqrt(mean(x², -1) + eps) in {len(users)} ops ({_op_list(users)})"
        user = users[0]
        if op_packet(user) in CAST_OPS and user.args[0] is current:
            cast_seen = True
        elif op_packet(user) == _aten.mul and len(user.args) == 2 and weight is None:
            gamma = _gamma(_other_operand(user, current), path, captured, used, inside)
            if isinstance(gamma, str):
                return gamma
            (weight, offset), after_cast = gamma, cast_seen
        else:
            return f"computes {op_name(user) or user.op} on x·rsqrt(mean(x², -1) + eps), not a cast or a scale by γ"
        used.add(user)
        current = user


def _gamma(node, path: str, captured: Captured, used: set[fx.Node], inside: list[fx.Node]) -> tuple[str, float] | str:
    """(γ's name, c) when ``node`` is γ or γ + c (γ through casts), γ the module's parameter ``weight``."""
    offset = 0.0
    if isinstance(node, fx.Node) and op_packet(node) == _aten.add and node in inside:
        terms = [a for a in node.args if not isinstance(a, fx.Node)]
        if len(node.args) != 2 or len(terms) != 1 or not isinstance(terms[0], numbers.Real) \
                or isinstance(terms[0], bool) or node.kwargs.get("alpha", 1) != 1:
            return f"scales by {op_name(node)} of γ, not by γ plus a number"
        used.add(node)
        offset = float(terms[0])
        node = next(a for a in node.args if isinstance(a, fx.Node))
    fqn = _own_param(_through_casts(node, used, inside), path, captured)
    if fqn is None:
        return f"scales by {_what(node, captured)}, not by a parameter of its own"
    if fqn.rpartition(".")[2] != "weight":
        return f"holds γ as {fqn}; normfold's RMSNorm holds it as weight"
    return fqn, offset


def _traced_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype of a traced node's value (None when the trace did not record one)."""
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(value, "dtype", None)


def _op_list(nodes: list[fx.Node]) -> str:
    names = [op_name(n) or n.op for n in nodes[:6]]
    return " → ".join(names) + (" → ..." if len(nodes) > 6 else "")


# --------------------------------------------------------------------------- the float64 reference

_CAST_METHODS = frozenset({torch.Tensor.to, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
                           torch.Tensor.type_as, torch.Tensor.type})


class _NoDowncast(TorchFunctionMode):
    """Tensor casts from float64 to a lower floating dtype return the float64 tensor itself."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        if (func in _CAST_METHODS and isinstance(source, torch.Tensor) and source.dtype == torch.float64
                and isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != torch.float64
                and out.device == source.device):
            return source
        return out


def _run_without_downcasts(forward, *args, **kwargs):
    with _NoDowncast():
        return forward(*args, **kwargs)


def without_downcasts(model: nn.Module, paths) -> nn.Module:
    """``model`` (in place: the float64 copy a proof runs) with the modules at ``paths`` running their own
    code without casting float64 down (their ``x.to(torch.float32)`` keeps float64): the original's math
    with the casts removed, which is what a float64 proof of a float32-cast norm compares against (the
    cast is the one thing a float64 run cannot reproduce; the model's own dtype is checked against the
    original as it is)."""
    for path in paths:
        module = model.get_submodule(path)
        if not isinstance(module, (*RMS_NORM_TYPES, *LAYER_NORM_TYPES)):  # torch's and normfold's do not cast
            module.forward = functools.partial(_run_without_downcasts, module.forward)
    return model
