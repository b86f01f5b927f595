"""Capture a model as an exported graph and answer questions about its nodes.

The exported program is only read: the fold engine edits a copy of the user's own module.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
import weakref
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from .._text import dtype_name, first_line
from .errors import FoldError


def split_example_inputs(example_inputs) -> tuple[tuple, dict]:
    """A tuple means positional arguments, a dict keyword arguments; nothing else is accepted."""
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    if isinstance(example_inputs, dict):
        if not all(isinstance(k, str) for k in example_inputs):
            raise TypeError("example_inputs as a dict must map argument names (str) to values")
        return (), dict(example_inputs)
    raise TypeError(
        "example_inputs must be a tuple of positional arguments or a dict of keyword arguments "
        f"(or a list of such calls), got {type(example_inputs).__name__}")


def example_calls(example_inputs) -> list:
    """The example calls as given: ``[example_inputs]`` for one call (a tuple or a dict), the list
    itself for several (each checked); TypeError / ValueError for anything else."""
    if not isinstance(example_inputs, list):
        split_example_inputs(example_inputs)
        return [example_inputs]
    if not example_inputs:
        raise ValueError("example_inputs as a list must hold at least one call (a tuple or a dict), got []")
    for i, call in enumerate(example_inputs):
        if not isinstance(call, (tuple, dict)):
            raise TypeError(f"example call {i}: each call in the list must be a tuple of positional arguments or "
                            f"a dict of keyword arguments (example_inputs), got {type(call).__name__}")
        split_example_inputs(call)
    return list(example_inputs)


def split_example_calls(example_inputs) -> list[tuple[tuple, dict]]:
    """One (args, kwargs) per example call (:func:`example_calls`)."""
    return [split_example_inputs(call) for call in example_calls(example_inputs)]


def describe_call(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, str]:
    """Argument name -> "tensor (2, 16) int64" or the value's repr: what a traced call was called with."""
    import inspect

    import torch.utils._pytree as pytree

    try:
        named = dict(inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):  # no signature, or one the call does not fit: plain positions
        named = {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
    described = {}
    for name, value in named.items():
        for path, leaf in pytree.tree_flatten_with_path(value, is_leaf=lambda v: v is None)[0]:
            if isinstance(leaf, torch.Tensor):
                text = f"tensor {tuple(leaf.shape)} {dtype_name(leaf.dtype)}"
            else:
                text = repr(leaf) if len(repr(leaf)) <= 60 else repr(leaf)[:57] + "..."
            described[name + pytree.keystr(path)] = text
    return described


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Put every submodule in eval mode and restore each one's own mode afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


@dataclass
class Captured:
    """An exported graph plus the maps the analysis needs."""

    graph: fx.Graph
    param_fqn: dict[fx.Node, str]          # placeholder -> parameter FQN
    buffer_fqn: dict[fx.Node, str]         # placeholder -> buffer FQN
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # FQN -> every FQN of the same tensor
    # placeholder -> the path of the submodule whose recorded input it is (``engine.submodules``: a value
    # computed outside the graph, so nothing is known about its mean); empty for a whole-model capture
    inputs_from: dict[fx.Node, str] = field(default_factory=dict)
    unsaved_buffers: frozenset[str] = frozenset()   # buffers outside the state dict (non-persistent): rebuilt at load
    mutated_buffers: frozenset[str] = frozenset()   # buffers the forward writes: state, not constants

    def centerable_fqn(self, node) -> str | None:
        """The name under which ``node`` is stored with the weights, so a centered copy is what a reload
        reads: a parameter's, or a buffer's that the state dict holds and the forward never writes
        (a constant table, e.g. sinusoidal positions); None for anything else."""
        if node in self.param_fqn:
            return self.param_fqn[node]
        fqn = self.buffer_fqn.get(node)
        return fqn if fqn is not None and fqn not in self.unsaved_buffers | self.mutated_buffers else None


def check_model_and_inputs(model: nn.Module, example_inputs) -> list:
    """TypeError, before any work, unless ``model`` is a module and the inputs a tuple, a dict or a
    list of them; returns the calls (:func:`example_calls`)."""
    calls = example_calls(example_inputs)
    _require_module(model)
    return calls


def _require_module(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def capture(model: nn.Module, example_inputs) -> Captured:
    """``torch.export`` the model in eval mode (non-strict) and index its placeholders."""
    args, kwargs = split_example_inputs(example_inputs)
    _require_module(model)
    ep = export_call(model, args, kwargs)
    sig = ep.graph_signature
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    param_fqn = {by_name[name]: fqn for name, fqn in sig.inputs_to_parameters.items()}
    buffer_fqn = {by_name[name]: fqn for name, fqn in sig.inputs_to_buffers.items()}
    return Captured(ep.graph, param_fqn, buffer_fqn, parameter_aliases(model),
                    unsaved_buffers=frozenset(sig.non_persistent_buffers),
                    mutated_buffers=frozenset(sig.buffers_to_mutate.values()))


def export_call(model: nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """``torch.export`` of one call of ``model`` in eval mode (non-strict), without gradients;
    ``FoldError`` with export's own first line when it cannot capture it."""
    with eval_mode(model), torch.no_grad():
        try:
            with _stderr_kept_only_on_success():
                return _mark_scalar_constants(torch.export.export(model, args, kwargs, strict=False))
        except Exception as exc:  # export raises many exception types; all mean "cannot capture"
            raise FoldError(
                f"torch.export could not capture {type(model).__name__}: {type(exc).__name__}: "
                f"{first_line(exc)}. Try other example inputs "
                "(e.g. use_cache=False for Hugging Face models), or fold a submodule that export can capture."
            ) from exc


SCALAR_META = "normfold_scalar"  # the value of a one-element constant the graph reads (``x[mask] = 0.0`` lifts one)


def _mark_scalar_constants(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Each placeholder of a one-element tensor constant gets its value as ``meta[SCALAR_META]``: what a
    rule may read of a constant (is it 0?), since the graph itself holds only its fake tensor."""
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for name, constant in ep.graph_signature.inputs_to_lifted_tensor_constants.items():
        value = ep.constants.get(constant)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and name in by_name:
            by_name[name].meta[SCALAR_META] = value.item()
    return ep


# torch.export's loggers that speak of a failed capture (a warning per data-dependent size it cannot place)
_EXPORT_FAILURE_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._subclasses.fake_tensor")


@contextlib.contextmanager
def _stderr_kept_only_on_success():
    """What an export attempt writes to stderr, written there only if it succeeds: on failure torch.export
    prints the partial graph (pages of it) and logs warnings, and normfold says why in one line, often
    after capturing submodules instead. Its failure loggers are quieted for the attempt."""
    held, loggers = io.StringIO(), [logging.getLogger(name) for name in _EXPORT_FAILURE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    sys.stderr.write(held.getvalue())  # reached on success only: the model's own warnings, kept


def parameter_aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """FQN -> all FQNs that name the same Parameter object (tied weights share one entry)."""
    by_id: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(fqn)
    return {fqn: tuple(names) for names in by_id.values() for fqn in names}


def module_path(node: fx.Node) -> str:
    """Path of the innermost module that ran this node ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return _clean_path(path)


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """[(module path, qualified class name)] from outermost to innermost."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(_clean_path(p), t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}") for p, t in stack.values()]


def path_in_root(submodule: str, path: str) -> str:
    """The path, from the root, of what a graph exported from ``submodule`` records at ``path``."""
    path = _clean_path(path)
    return f"{submodule}.{path}" if submodule and path else submodule or path


def _clean_path(path: str) -> str:
    # export spells paths like "L['self'].transformer.h[0]" in some versions, "transformer.h.0" in others
    for prefix in ("L['self'].", "L__self__."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    if path in ("L['self']", "L__self__"):
        return ""
    return path.replace("[", ".").replace("]", "").replace("'", "")


def shape(node) -> tuple[int, ...] | None:
    """Static shape of a node's tensor value, None when it is not a tensor."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    sizes = tuple(static_size(node, dim) for dim in range(val.dim()))
    return None if None in sizes else sizes  # a symbolic size (unbacked too): the shape is unknown


class SymbolicSizeError(Exception):
    """A rule did arithmetic or an ordering on a size that depends on the input's values: the rule
    cannot decide, so the walk breaks there (never a guess from the example's sizes)."""


class SymbolicSize:
    """A size of the trace that depends on the input's values (an unbacked symbol: rows kept by a mask,
    images that are not padding). Equal to the same expression and never to a number, so shape
    comparisons stay exact; arithmetic, ordering and ``int()`` raise :class:`SymbolicSizeError`. The
    export itself treats such a size as not 1 when it broadcasts, as ``!= 1`` does here."""

    __slots__ = ("expr",)

    def __init__(self, expr):
        self.expr = expr  # the sympy expression of the trace's SymInt

    def __eq__(self, other):
        return isinstance(other, SymbolicSize) and self.expr == other.expr

    def __hash__(self):
        return hash(("SymbolicSize", self.expr))

    def __repr__(self):
        return f"SymbolicSize({self.expr})"

    def _undecided(self, *_):
        raise SymbolicSizeError(f"size {self.expr} depends on the input's values")

    __int__ = __index__ = __bool__ = __lt__ = __le__ = __gt__ = __ge__ = _undecided
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _undecided
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = __neg__ = _undecided


def trace_shape(node) -> tuple | None:
    """The shape of a node's tensor value as the trace knows it: numbers, and a :class:`SymbolicSize`
    for each dim that depends on the input's values (None: not a tensor). The rules table reads this,
    so a norm over a static last dim folds whatever the row count is; code that needs numbers uses
    :func:`shape`."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    sizes = (static_size(node, dim) for dim in range(val.dim()))
    return tuple(SymbolicSize(val.shape[dim].node.expr) if size is None else size
                 for dim, size in enumerate(sizes))


def static_size(node, dim: int) -> int | None:
    """The size of one dim of a node's tensor value when it is a number in the trace (None: not a
    tensor, or a symbolic size), whatever the other dims are."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not -val.dim() <= dim < val.dim():
        return None
    return static_dim(val, dim)


def static_dim(val: torch.Tensor, dim: int) -> int | None:
    """The size of one dim of a traced tensor value when it is a number (None: a symbolic size)."""
    try:
        return int(val.shape[dim])
    except (TypeError, ValueError, GuardOnDataDependentSymNode):
        return None


def op_name(node: fx.Node) -> str:
    """'aten.gelu' style name of a node's operator (placeholders: 'input <name>')."""
    if node.op == "placeholder":
        return f"input {node.name}"
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return str(packet)
    return getattr(target, "__name__", str(target))


def describe(node: fx.Node) -> str:
    """Human label: op name and module path."""
    path = module_path(node)
    return f"{op_name(node)} at {path}" if path else op_name(node)


def op_packet(node) -> object | None:
    """The aten overload packet a ``call_function`` node runs (``aten.add``), None for other nodes and
    for values that are not nodes (literals in an op's arguments)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    return getattr(node.target, "overloadpacket", None)


def node_arg(node: fx.Node, index: int, name: str, default=None):
    """An op's argument given positionally at ``index`` or by keyword ``name`` (``default`` when absent)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def owner_path(captured: Captured, node) -> str | None:
    """The path of the module owning a parameter or buffer placeholder (None for any other value)."""
    fqn = (captured.param_fqn.get(node) or captured.buffer_fqn.get(node)) if isinstance(node, fx.Node) else None
    return fqn.rpartition(".")[0] if fqn else None


def use_alias(captured: Captured, param: fx.Node, user: fx.Node) -> str:
    """The name under which ``user`` reads a (possibly tied) parameter placeholder.

    Export may feed every name of a tied tensor through one placeholder; the name whose owning
    module ran ``user`` is the one the user reads.
    """
    fqn = captured.centerable_fqn(param)
    names = captured.aliases.get(fqn, (fqn,))
    if len(names) > 1:
        path = module_path(user)
        owners = [n for n in names if path == n.rpartition(".")[0] or path.startswith(n.rpartition(".")[0] + ".")]
        if owners:
            return max(owners, key=len)
    return fqn


def single_use_param(node, captured: Captured) -> str | None:
    """FQN of a parameter read by one op only, under a name no other tensor shares."""
    if not isinstance(node, fx.Node) or node not in captured.param_fqn:
        return None
    fqn = captured.param_fqn[node]
    return fqn if len(node.users) == 1 and len(captured.aliases.get(fqn, (fqn,))) == 1 else None


_T = TypeVar("_T")


def per_graph(cache: weakref.WeakKeyDictionary, graph: fx.Graph, build: Callable[[fx.Graph], _T]) -> _T:
    """``build(graph)``, computed once per graph and node count: the analysis only reads graphs, and a
    graph that gained or lost nodes is built again. ``cache`` is the caller's own weak dictionary."""
    count, value = cache.get(graph, (-1, None))
    if count != len(graph.nodes):
        value = build(graph)
        cache[graph] = (len(graph.nodes), value)
    return value
