"""Capture through submodules: when ``torch.export`` cannot capture the whole model (Python control
flow on a tensor value, an object export does not trace), capture the largest submodules it can,
each with the inputs the whole model's call gave it, and hand the analysis one graph per call.

    captured = capture_calls(model, calls)   # .graphs: one Captured per call; .submodules: () or the paths

The search descends from the root: a child that holds norms or weights is exported with every input
it was called with (recorded by forward pre-hooks on one eager run of the whole model per call);
where export fails, its own children are tried instead. A child is tried only when the modules
inside it run only inside its own calls (otherwise the root reaches its weights some other way).
The graphs of one call are merged into one, with the root's names: a parameter read by two
submodules is one placeholder. A submodule's input that is the very tensor an earlier captured call
returned, unchanged since (the same object, the same version), is wired to that output: the
embeddings' output feeding the encoder's first layer, each layer's output the next. Every other input
is a placeholder whose producer lies outside (``Captured.inputs_from``), so a norm reading one is kept.
An output counts as a model output unless its only readers are captured calls it was wired to (the
eager run watches every torch call the uncaptured code makes). Nothing here proves anything: the fold
is proved on the whole model, eagerly, as always.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export.graph_signature import InputKind

from .._text import first_line
from ..nn.kinds import norm_kind, norm_modules
from .errors import FoldError, invalid_example_inputs
from .graph import (Captured, capture, eval_mode, export_call, parameter_aliases, path_in_root,
                    split_example_inputs, static_size)
from .wiring import CallWiring, Follower, Followed, GlueOp, Key, Unknown


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
        raise invalid_example_inputs(model, err) from err
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
    wirings = _wirings(model, splits, frozenset(found))
    if not any(_analysable(model, path, per_call, wirings) for path, per_call in found.items()):
        return None  # nothing a norm could fold through: export's own error says more
    aliases = parameter_aliases(model)
    graphs = [_merged({seq: (path, ep) for path, per_call in found.items() for seq, ep in per_call[i]}, aliases,
                      wirings[i], model)
              for i in range(len(calls))]
    uncaptured = tuple((path, kind) for path, _, kind in norm_modules(model)
                       if kind in ("LayerNorm", "RMSNorm") and path in recording.ran
                       and not any(_inside(path, sub) for sub in found))
    return CapturedCalls(graphs, tuple(found), whole_model_error, uncaptured)


def _analysable(model: nn.Module, path: str, per_call, wirings: list[CallWiring]) -> bool:
    """A captured submodule holds a norm whose input may be traced back: one inside it, below it, or the
    submodule itself a norm whose input is wired to what the run followed, in some call."""
    module = model.get_submodule(path)
    if norm_kind(module) is None:
        return any(norm_kind(m) is not None for m in module.modules())
    return any((order, 0) in wirings[call].wired for call, programs in enumerate(per_call) for order, _ in programs)


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

    with _hooked(model, enter, leave):
        for args, kwargs in splits:
            recording.inputs.append([])
            active.clear()
            seen = 0
            model(*args, **kwargs)
    return recording


def _wirings(model: nn.Module, splits: list[tuple[tuple, dict]], captured: frozenset) -> list[CallWiring]:
    """One eager run per call under a :class:`~.wiring.Follower`: how the ``captured`` submodules' calls
    connect (``wiring.py``). Calls are numbered as :func:`_record` numbers them (every module's entry)."""
    follower, active, seen, wirings = Follower(model), [], 0, []

    def enter(path: str, args: tuple, kwargs: dict) -> None:
        nonlocal seen
        if path in captured:
            follower.enter(seen, (args, kwargs))
        active.append((path, seen))
        seen += 1

    def leave(_module, _args, output) -> None:  # returns None: a hook's value would replace the output
        path, order = active.pop()
        if path in captured:
            follower.leave(order, output)

    with _hooked(model, enter, leave):
        for args, kwargs in splits:
            active.clear()
            seen = 0
            wirings.append(follower.start())
            with follower:
                output = model(*args, **kwargs)
            follower.returned(output)
    return wirings


@contextlib.contextmanager
def _hooked(model: nn.Module, enter, leave):
    """``model`` in eval mode without gradients, ``enter(path, args, kwargs)`` called before every module's
    forward and ``leave(module, args, output)`` after it (exceptions too)."""
    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda _m, args, kwargs, path=path: enter(path, args, kwargs), with_kwargs=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with eval_mode(model), torch.no_grad():
            yield
    finally:
        for handle in handles:
            handle.remove()


def _ancestors(path: str) -> list[str]:
    """The submodule paths strictly above ``path`` (the root excluded): "a.b.c" -> ["a", "a.b"]."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _inside(path: str, submodule: str) -> bool:
    return path == submodule or path.startswith(submodule + ".")


def _candidates(model: nn.Module, path: str, recording: _Recording) -> list[str]:
    """The children of ``path`` worth exporting: each holds a norm or a weight (a producer to center, or
    a norm whose input may be wired to one), ran, and has no module that ran outside its calls; a
    container that never ran (a ModuleList) or an entangled child is looked through to its own children."""
    found = []
    for name, child in model.get_submodule(path).named_children():
        child_path = f"{path}.{name}" if path else name
        if not any(norm_kind(m) is not None for m in child.modules()) \
                and next(child.parameters(), None) is None and next(child.buffers(), None) is None:
            continue  # no norm, no weight: nothing to analyse
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

def _merged(parts: dict[int, tuple[str, torch.export.ExportedProgram]], aliases: dict[str, tuple[str, ...]],
            wiring: CallWiring, model: nn.Module) -> Captured:
    """The exported graphs of one call and the glue ops between them, in the order the call ran them, as
    one graph with the root's names: parameters and buffers one placeholder per name; each input the node
    it is wired to, else a placeholder of its own; the parts' outputs the graph's outputs, but for those
    read only inside the graph; a glue op's outputs only where something outside reads them."""
    graph = fx.Graph()
    param_fqn, buffer_fqn, inputs_from, shared = {}, {}, {}, {}
    made: dict[Key, fx.Node] = {}  # what the run followed, as nodes of the merged graph
    outputs: dict[Key, fx.Node] = {}  # the parts' output leaves, in order
    consumed: set[Key] = set()
    unsaved, mutated = set(), set()  # buffers rebuilt at load, buffers the forward writes (root names)

    def weight(fqn: str, kind, like) -> fx.Node:
        if fqn not in shared:
            shared[fqn] = graph.placeholder("p_" + fqn.replace(".", "_"))
            shared[fqn].meta = dict(like.meta) if isinstance(like, fx.Node) else {"val": like}
            (param_fqn if kind == InputKind.PARAMETER else buffer_fqn)[shared[fqn]] = fqn
        return shared[fqn]

    def outside(name: str, value, where: str) -> fx.Node:
        node = graph.placeholder(name)
        node.meta = dict(value.meta) if isinstance(value, fx.Node) else {"val": value}
        inputs_from[node] = where
        return node

    glue_count = 0
    for event in wiring.events:
        if isinstance(event, GlueOp):
            where = f"{getattr(event.func, 'overloadpacket', event.func)} between the captured submodules"

            def argument(value, index=glue_count, where=where):
                if isinstance(value, Followed):
                    kind, *rest = value.key
                    if kind in ("parameter", "buffer"):
                        return weight(rest[0], InputKind.PARAMETER if kind == "parameter" else InputKind.BUFFER, value.value)
                    if value.key in made:
                        consumed.add(value.key)
                        return made[value.key]
                    return outside(f"glue_{index}_input", value.value, where)
                if isinstance(value, Unknown):
                    return outside(f"glue_{index}_input", value.value, where)
                return value

            node = graph.call_function(event.func, pytree.tree_map(argument, event.args, is_leaf=_is_argument),
                                       pytree.tree_map(argument, event.kwargs, is_leaf=_is_argument))
            node.meta["val"] = event.outputs[0] if event.single else list(event.outputs)
            for index, value in enumerate(event.outputs):
                if value is not None:
                    made[("glue", glue_count, index)] = node if event.single else _item(graph, node, index, value)
            glue_count += 1
            continue
        if event not in parts:
            continue
        order, (path, ep) = event, parts[event]
        owned = {spec.arg.name: (spec.kind, spec.target) for spec in ep.graph_signature.input_specs}
        user_leaf = {spec.arg.name: index for index, spec in enumerate(
            [spec for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT])}
        unsaved |= {f"{path}.{name}" for name in ep.graph_signature.non_persistent_buffers}
        mutated |= {f"{path}.{name}" for name in ep.graph_signature.buffers_to_mutate.values()}
        val_map = {}
        for node in ep.graph.find_nodes(op="placeholder"):
            kind, target = owned.get(node.name, (None, None))
            key = wiring.wired.get((order, user_leaf.get(node.name)))
            if kind in (InputKind.PARAMETER, InputKind.BUFFER):
                val_map[node] = weight(f"{path}.{target}", kind, node)
            elif (producer := _wired_node(node, made.get(key) if key is not None else None)) is not None:
                val_map[node] = producer
                consumed.add(key)
            else:
                val_map[node] = _placeholder(graph, f"{path.replace('.', '_')}_{node.name}", node)
                if kind == InputKind.USER_INPUT:
                    inputs_from[val_map[node]] = path
        copied = set(graph.nodes)
        returned = graph.graph_copy(ep.graph, val_map)  # the output leaves, flat, in the call's order
        for index, value in enumerate(returned):
            made[("call", order, index)] = outputs[("call", order, index)] = value
        for node in graph.nodes:
            if node not in copied and "nn_module_stack" in node.meta:
                node.meta["nn_module_stack"] = {key: (path_in_root(path, entry), kind)
                                                for key, (entry, kind) in node.meta["nn_module_stack"].items()}
    # a part's output read only inside the graph is not a model output: its change reaches those readers alone
    kept = [None if key in consumed - wiring.read_elsewhere else value for key, value in outputs.items()]
    kept += [made[key] for key in wiring.read_elsewhere if key[0] == "glue" and key in made]
    graph.output(tuple(kept))
    return Captured(graph, param_fqn, buffer_fqn, aliases, inputs_from=inputs_from,
                    unsaved_buffers=frozenset(unsaved), mutated_buffers=frozenset(mutated))


def _is_argument(value) -> bool:
    return isinstance(value, (Followed, Unknown))


def _item(graph: fx.Graph, node: fx.Node, index: int, value) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = value
    return item


def _wired_node(node: fx.Node, value: fx.Node | None) -> fx.Node | None:
    """``value``, the merged graph's node an input placeholder is wired to, when the two agree on what the
    trace knows of the tensor (shape and dtype); else None (the input stays a placeholder)."""
    if not isinstance(value, fx.Node):
        return None
    mine, theirs = node.meta.get("val"), value.meta.get("val")
    if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)):
        return None
    same_shape = mine.dim() == theirs.dim() and all(static_size(node, d) is not None and static_size(node, d) == static_size(value, d)
                                                    for d in range(mine.dim()))
    return value if same_shape and mine.dtype == theirs.dtype else None


def _placeholder(graph: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    node = graph.placeholder(name)
    node.meta = dict(like.meta)
    return node
