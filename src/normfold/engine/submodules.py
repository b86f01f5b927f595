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

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export.graph_signature import InputKind
from torch.overrides import TorchFunctionMode

from .._text import first_line
from ..nn.kinds import norm_kind, norm_modules
from .errors import ExampleInputsError, FoldError, model_name
from .graph import (Captured, capture, eval_mode, export_call, parameter_aliases, path_in_root,
                    split_example_inputs, static_size)


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
    wiring = _record(model, splits, frozenset(found), wiring=True)
    if not any(_analysable(model, path, per_call, wiring) for path, per_call in found.items()):
        return None  # nothing a norm could fold through: export's own error says more
    aliases = parameter_aliases(model)
    graphs = [_merged([(seq, path, ep) for path, per_call in found.items() for seq, ep in per_call[i]], aliases,
                      wiring.wired[i], wiring.read_elsewhere[i])
              for i in range(len(calls))]
    uncaptured = tuple((path, kind) for path, _, kind in norm_modules(model)
                       if kind in ("LayerNorm", "RMSNorm") and path in recording.ran
                       and not any(_inside(path, sub) for sub in found))
    return CapturedCalls(graphs, tuple(found), whole_model_error, uncaptured)


def _analysable(model: nn.Module, path: str, per_call, wiring: _Recording) -> bool:
    """A captured submodule holds a norm whose input may be traced back: one inside it, below it, or the
    submodule itself a norm whose input is wired to an earlier captured output in some call."""
    module = model.get_submodule(path)
    if norm_kind(module) is None:
        return any(norm_kind(m) is not None for m in module.modules())
    return any((order, 0) in wiring.wired[call] for call, programs in enumerate(per_call) for order, _ in programs)


# --------------------------------------------------------------------------- recording the whole model's call

Leaf = tuple[int, int]  # (order of a module call in the whole call, index of a leaf of its flattened inputs/outputs)


@dataclass
class _Recording:
    """What one eager run per call showed: which modules ran, which of them have modules run outside
    their own calls, the inputs of the watched ones, per call: (order of the call, path, args, kwargs);
    and per call, which inputs of watched calls are outputs of earlier ones (consumer leaf -> producer
    leaf), and which of those outputs something other than a watched call's input reads."""

    ran: set[str] = field(default_factory=set)
    entangled: set[str] = field(default_factory=set)
    inputs: list[list[tuple[int, str, tuple, dict]]] = field(default_factory=list)
    wired: list[dict[Leaf, Leaf]] = field(default_factory=list)
    read_elsewhere: list[set[Leaf]] = field(default_factory=list)


def _record(model: nn.Module, splits: list[tuple[tuple, dict]], watched: frozenset, *,
            wiring: bool = False) -> _Recording:
    """Run the model eagerly (eval mode, no gradients) on each call with hooks on every module; with
    ``wiring``, also follow the watched calls' outputs (:class:`_Wiring`)."""
    recording, active, seen = _Recording(), [], 0
    wires = _Wiring() if wiring else None

    def enter(path: str, args: tuple, kwargs: dict) -> None:
        nonlocal seen
        recording.ran.add(path)
        recording.entangled.update(a for a in _ancestors(path) if a not in {p for p, _ in active})
        if path in watched:
            if wires is not None:
                wires.enter(seen, (args, kwargs))
            # copies: the model may later write into a tensor it was given
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            recording.inputs[-1].append((seen, path, args, kwargs))
        active.append((path, seen))
        seen += 1

    def leave(_module, _args, output) -> None:  # returns None: a hook's value would replace the output
        path, order = active.pop()
        if wires is not None and path in watched:
            wires.leave(order, output)

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
                if wires is None:
                    model(*args, **kwargs)
                    continue
                wires.reset()
                with wires:
                    output = model(*args, **kwargs)
                wires.returned(output)
                recording.wired.append(wires.wired)
                recording.read_elsewhere.append(wires.read_elsewhere)
    finally:
        for handle in handles:
            handle.remove()
    return recording


class _Wiring(TorchFunctionMode):
    """Follows the tensors the watched calls return through one eager run: an input of a watched call
    that is such a tensor, the same object at the same version (nothing wrote it since), is wired to
    it; any other torch call that reads it (outside the watched calls, or inside one that was not given
    it), and the root's own output, makes it read elsewhere: its change would be seen there."""

    def reset(self) -> None:
        self.made: dict[int, tuple[torch.Tensor, Leaf, int]] = {}  # id -> (tensor, its leaf, its version)
        self.given: list[set[int]] = []  # per active watched call, the ids of its input tensors
        self.wired: dict[Leaf, Leaf] = {}
        self.read_elsewhere: set[Leaf] = set()

    def enter(self, order: int, inputs) -> None:
        ids = set()
        for index, leaf in enumerate(pytree.tree_leaves(inputs)):
            if isinstance(leaf, torch.Tensor):
                ids.add(id(leaf))
                made = self._made(leaf)
                if made is not None and made[2] == leaf._version:
                    self.wired[(order, index)] = made[1]
        self.given.append(ids)

    def leave(self, order: int, output) -> None:
        self.given.pop()
        for index, leaf in enumerate(pytree.tree_leaves(output)):
            if isinstance(leaf, torch.Tensor):
                self.made[id(leaf)] = (leaf, (order, index), leaf._version)

    def returned(self, output) -> None:
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and (made := self._made(leaf)) is not None:
                self.read_elsewhere.add(made[1])

    def _made(self, tensor: torch.Tensor):
        made = self.made.get(id(tensor))
        return made if made is not None and made[0] is tensor else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _reads_only_metadata(func):
            given = self.given[-1] if self.given else ()
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and id(leaf) not in given and (made := self._made(leaf)) is not None:
                    self.read_elsewhere.add(made[1])
        return func(*args, **kwargs)


_METADATA_METHODS = frozenset({"size", "dim", "numel", "stride", "is_floating_point", "is_complex", "element_size",
                               "get_device", "is_contiguous", "__len__"})
_METADATA_PROPERTIES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "is_meta", "layout", "requires_grad",
                                  "_version"})


def _reads_only_metadata(func) -> bool:
    """A torch call that reads a tensor's shape, dtype or device, never its values."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA_PROPERTIES
    return name in _METADATA_METHODS


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

def _merged(parts: list[tuple[int, str, torch.export.ExportedProgram]], aliases: dict[str, tuple[str, ...]],
            wired: dict[Leaf, Leaf], read_elsewhere: set[Leaf]) -> Captured:
    """The exported graphs of one call, in the order the call ran them, as one graph with the root's
    names: parameters and buffers one placeholder per name; each part's inputs the earlier part's
    output they are ``wired`` to, else its own placeholders; the parts' outputs the graph's outputs,
    but for those read only by the parts they are wired to."""
    graph = fx.Graph()
    param_fqn, buffer_fqn, inputs_from, shared = {}, {}, {}, {}
    made: dict[Leaf, fx.Node] = {}  # each part's output leaves, copied into the merged graph
    consumed: set[Leaf] = set()
    unsaved, mutated = set(), set()  # buffers rebuilt at load, buffers the forward writes (root names)
    for order, path, ep in sorted(parts, key=lambda part: part[0]):
        owned = {spec.arg.name: (spec.kind, spec.target) for spec in ep.graph_signature.input_specs}
        user_leaf = {spec.arg.name: index for index, spec in enumerate(
            [spec for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT])}
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
            elif (producer := _wired_node(node, made, wired.get((order, user_leaf.get(node.name))))) is not None:
                val_map[node] = producer
                consumed.add(wired[(order, user_leaf[node.name])])
            else:
                val_map[node] = _placeholder(graph, f"{path.replace('.', '_')}_{node.name}", node)
                if kind == InputKind.USER_INPUT:
                    inputs_from[val_map[node]] = path
        copied = set(graph.nodes)
        returned = graph.graph_copy(ep.graph, val_map)  # the output leaves, flat, in the call's order
        made.update(((order, index), value) for index, value in enumerate(returned))
        for node in graph.nodes:
            if node not in copied and "nn_module_stack" in node.meta:
                node.meta["nn_module_stack"] = {key: (path_in_root(path, entry), kind)
                                                for key, (entry, kind) in node.meta["nn_module_stack"].items()}
    # an output read only by the parts it is wired to is not a model output: its change reaches those alone
    graph.output(tuple(None if leaf in consumed - read_elsewhere else value for leaf, value in made.items()))
    return Captured(graph, param_fqn, buffer_fqn, aliases, inputs_from=inputs_from,
                    unsaved_buffers=frozenset(unsaved), mutated_buffers=frozenset(mutated))


def _wired_node(node: fx.Node, made: dict[Leaf, fx.Node], producer: Leaf | None) -> fx.Node | None:
    """The merged graph's node for the earlier output an input placeholder is wired to, when the two agree
    on what the trace knows of the tensor (shape and dtype); else None (the input stays a placeholder)."""
    value = made.get(producer) if producer is not None else None
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
