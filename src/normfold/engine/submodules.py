"""Capture through submodules: when ``torch.export`` cannot capture the whole model (Python control
flow on a tensor value, an object export does not trace), capture the largest submodules it can,
each with the inputs the whole model's call gave it, and hand the analysis one graph per call.

    captured = capture_calls(model, calls)   # .graphs: one Captured per call; .submodules: () or the paths

The search descends from the root: a child that holds norms is exported with every input it was
called with (recorded by forward pre-hooks on one eager run of the whole model per call); where
export fails, its own children are tried instead. A child is tried only when the modules inside it
run only inside its own calls (otherwise the root reaches its weights some other way). The graphs
of one call are merged into one, with the root's names: a parameter read by two submodules is one
placeholder, and each submodule's inputs are placeholders whose producer lies outside
(``Captured.inputs_from``), so a norm reading one is kept, and every output counts as a model output.
Nothing here proves anything: the fold is proved on the whole model, eagerly, as always.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export.graph_signature import InputKind

from .._text import first_line
from ..nn.kinds import norm_kind, norm_modules
from .errors import ExampleInputsError, FoldError, model_name
from .graph import (Captured, capture, eval_mode, export_call, parameter_aliases, path_in_root,
                    split_example_inputs)


@dataclass
class CapturedCalls:
    """The graphs the analysis reads, one per example call, and how they were captured."""

    graphs: list[Captured]
    submodules: tuple[str, ...] = ()       # the submodules captured; () when the whole model was
    whole_model_error: str | None = None   # why torch.export could not capture the whole model
    uncaptured_norms: tuple[tuple[str, str], ...] = ()  # (path, kind) of norms that ran outside every one


def capture_calls(model: nn.Module, calls: list) -> CapturedCalls:
    """The whole model captured for every call; else, when export fails on it, the largest submodules
    it can capture (:func:`capture_submodules`); else the whole model's ``FoldError``."""
    try:
        return CapturedCalls([capture(model, call) for call in calls])
    except FoldError as whole:
        cause = whole.__cause__ or whole
        through = capture_submodules(model, calls, f"{type(cause).__name__}: {first_line(cause)}")
        if through is None:
            raise
        return through


def capture_submodules(model: nn.Module, calls: list, whole_model_error: str) -> CapturedCalls | None:
    """The largest submodules holding norms that export captures for every input the calls gave them,
    merged per call (module docstring); None when no such submodule exists. ExampleInputsError when the
    model does not run eagerly on the calls either: then the inputs are at fault, not export."""
    splits = [split_example_inputs(call) for call in calls]
    try:
        recording = _record(model, splits, frozenset())
    except Exception as err:  # noqa: BLE001  the model's own code, whatever it raises: the inputs are wrong
        raise ExampleInputsError(
            f"the example inputs are not valid for {model_name(model)}: the original model itself raises "
            f"{type(err).__name__}: {first_line(err, 300)} when run eagerly on them; pass inputs the model "
            f"accepts") from err
    found: dict[str, list[list[tuple[int, torch.export.ExportedProgram]]]] = {}
    frontier = _candidates(model, "", recording)
    while frontier:
        inputs = _record(model, splits, frozenset(frontier)).inputs
        deeper = []
        for path in frontier:
            programs = _export_each(model.get_submodule(path), path, inputs)
            if programs is None:
                deeper += _candidates(model, path, recording)
            else:
                found[path] = programs
        frontier = deeper
    if not found:
        return None
    aliases = parameter_aliases(model)
    graphs = [_merged([(seq, path, ep) for path, per_call in found.items() for seq, ep in per_call[i]], aliases)
              for i in range(len(calls))]
    uncaptured = tuple((path, kind) for path, _, kind in norm_modules(model)
                       if kind in ("LayerNorm", "RMSNorm") and path in recording.ran
                       and not any(_inside(path, sub) for sub in found))
    return CapturedCalls(graphs, tuple(found), whole_model_error, uncaptured)


# --------------------------------------------------------------------------- recording the whole model's call

@dataclass
class _Recording:
    """What one eager run per call showed: which modules ran, which of them have modules run outside
    their own calls, and the inputs of the watched ones, per call: (order of the call, path, args, kwargs)."""

    ran: set[str] = field(default_factory=set)
    entangled: set[str] = field(default_factory=set)
    inputs: list[list[tuple[int, str, tuple, dict]]] = field(default_factory=list)


def _record(model: nn.Module, splits: list[tuple[tuple, dict]], watched: frozenset) -> _Recording:
    """Run the model eagerly (eval mode, no gradients) on each call with hooks on every module."""
    recording, active, seen = _Recording(), [], 0

    def enter(path: str, args: tuple, kwargs: dict) -> None:
        nonlocal seen
        recording.ran.add(path)
        recording.entangled.update(a for a in _ancestors(path) if a not in active)
        if path in watched:  # copies: the model may later write into a tensor it was given
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            recording.inputs[-1].append((seen, path, args, kwargs))
        seen += 1
        active.append(path)

    def leave(*_) -> None:  # returns None: a forward hook's value would replace the module's output
        active.pop()

    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda _m, args, kwargs, path=path: enter(path, args, kwargs), with_kwargs=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with eval_mode(model), torch.no_grad():
            for args, kwargs in splits:
                recording.inputs.append([])
                active.clear()
                seen = 0
                model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return recording


def _ancestors(path: str) -> list[str]:
    """The submodule paths strictly above ``path`` (the root excluded): "a.b.c" -> ["a", "a.b"]."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _inside(path: str, submodule: str) -> bool:
    return path == submodule or path.startswith(submodule + ".")


def _candidates(model: nn.Module, path: str, recording: _Recording) -> list[str]:
    """The children of ``path`` worth exporting: each holds a norm below it, ran, and has no module
    that ran outside its calls; a container that never ran (a ModuleList) or an entangled child is
    looked through to its own children."""
    found = []
    for name, child in model.get_submodule(path).named_children():
        child_path = f"{path}.{name}" if path else name
        if norm_kind(child) is not None or not any(norm_kind(m) is not None for m in child.modules()):
            continue  # a norm alone reads only its input (never zero-mean here); no norm: nothing to analyse
        if child_path in recording.ran and child_path not in recording.entangled:
            found.append(child_path)
        else:
            found += _candidates(model, child_path, recording)
    return found


def _export_each(module: nn.Module, path: str, inputs) -> list[list[tuple[int, torch.export.ExportedProgram]]] | None:
    """Per call, (order, exported program) of every call of ``module``; None when export fails on one."""
    programs = []
    for per_call in inputs:
        programs.append([])
        for seq, called, args, kwargs in per_call:
            if called != path:
                continue
            try:
                programs[-1].append((seq, export_call(module, args, kwargs)))
            except FoldError:
                return None
    return programs


# --------------------------------------------------------------------------- one graph per call

def _merged(parts: list[tuple[int, str, torch.export.ExportedProgram]],
            aliases: dict[str, tuple[str, ...]]) -> Captured:
    """The exported graphs of one call, in the order the call ran them, as one graph with the root's
    names: parameters and buffers one placeholder per name, each part's inputs its own placeholders,
    every part's outputs the graph's outputs."""
    graph = fx.Graph()
    param_fqn, buffer_fqn, inputs_from, shared, outputs = {}, {}, {}, {}, []
    unsaved, mutated = set(), set()  # buffers rebuilt at load, buffers the forward writes (root names)
    for _, path, ep in sorted(parts, key=lambda part: part[0]):
        owned = {spec.arg.name: (spec.kind, spec.target) for spec in ep.graph_signature.input_specs}
        unsaved |= {f"{path}.{name}" for name in ep.graph_signature.non_persistent_buffers}
        mutated |= {f"{path}.{name}" for name in ep.graph_signature.buffers_to_mutate.values()}
        val_map = {}
        for node in ep.graph.find_nodes(op="placeholder"):
            kind, target = owned.get(node.name, (None, None))
            if kind in (InputKind.PARAMETER, InputKind.BUFFER):
                fqn = f"{path}.{target}"
                if fqn not in shared:
                    shared[fqn] = _placeholder(graph, "p_" + fqn.replace(".", "_"), node)
                    (param_fqn if kind == InputKind.PARAMETER else buffer_fqn)[shared[fqn]] = fqn
                val_map[node] = shared[fqn]
            else:
                val_map[node] = _placeholder(graph, f"{path.replace('.', '_')}_{node.name}", node)
                if kind == InputKind.USER_INPUT:
                    inputs_from[val_map[node]] = path
        copied = set(graph.nodes)
        outputs.append(graph.graph_copy(ep.graph, val_map))
        for node in graph.nodes:
            if node not in copied and "nn_module_stack" in node.meta:
                node.meta["nn_module_stack"] = {key: (path_in_root(path, entry), kind)
                                                for key, (entry, kind) in node.meta["nn_module_stack"].items()}
    graph.output(tuple(outputs))
    return Captured(graph, param_fqn, buffer_fqn, aliases, inputs_from=inputs_from,
                    unsaved_buffers=frozenset(unsaved), mutated_buffers=frozenset(mutated))


def _placeholder(graph: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    node = graph.placeholder(name)
    node.meta = dict(like.meta)
    return node
