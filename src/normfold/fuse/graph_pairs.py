"""Which add feeds which norm call, read from a captured graph (``torch.export``) and matched to the parsed forwards.

    found = graph_pairs(captured, rewrites, norm_paths)   # .pairs, as Probe.observed_pairs; .unmatched

A norm call's input is the value the norm module's nodes read from outside the module (the nodes'
``nn_module_stack``; its parameters aside). Followed back through ops that hand on the same tensor
or the same memory in the same row order, which is what a fused call's guard takes at run time
(eval-mode dropout, a ``to`` that changes nothing, an in-place op's result, ``alias`` /
``contiguous`` / ``view`` / ``reshape`` of a contiguous tensor keeping the row length), it is an
``aten.add`` node or it is no pair. The add is then located in the source: the module that ran it
(``nn_module_stack``) must have a parsed forward (``rewrite.py``) with a ``name = a + b`` statement at
a file and line of the add's ``stack_trace`` (a helper written out in place keeps its call's line);
the norm call likewise, at a ``self.<norm>(name)`` of its parent's forward. An add the source does
not show as such a statement is no pair, and the norm it feeds is reported with where that add is
(``unmatched``). As in the probe's run, graph order decides: an add or a call joins one pair at
most (the first).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from ..engine.graph import Captured, module_path, op_packet, shape
from ..engine.op_kinds import DROPOUT_OPS, aten_packets, is_training_dropout
from .rewrite import ForwardRewrite

Site = tuple[str, int]   # (parent module path, index into its ForwardRewrite's adds or calls)

_ADD = torch.ops.aten.add
_CAST_OPS = frozenset(aten_packets("to", "type_as"))   # return their input when they change nothing
# the same memory in the same order when their input is contiguous (what runtime.same_rows takes)
_SAME_MEMORY_OPS = frozenset(aten_packets("alias", "contiguous", "view", "reshape", "_unsafe_view", "flatten",
                                          "view_as", "reshape_as"))
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


@dataclass
class GraphPairs:
    """The pairs found, ``((add parent, add index), (call parent, call index))``, and for each norm fed
    by an add that is no parsed ``name = a + b`` statement, where that add is."""

    pairs: list[tuple[Site, Site]] = field(default_factory=list)
    unmatched: dict[str, str] = field(default_factory=dict)   # norm path -> "the add at <file>:<line> in <module>"


def graph_pairs(captured: Captured, rewrites: dict[str, ForwardRewrite], norm_paths) -> GraphPairs:
    """The add → norm pairs of ``captured``'s graph among the norms ``norm_paths`` (module docstring)."""
    found, used_adds, used_calls = GraphPairs(), set(), set()
    for norm_path, value, reader in _norm_inputs(captured, set(norm_paths)):
        add = _add_feeding(value)
        if add is None:
            continue
        parent, _, name = norm_path.rpartition(".")
        call = _site(reader, parent, rewrites,
                     lambda rewrite: [(j, c.node) for j, c in enumerate(rewrite.calls) if c.norm == name])
        if call is None:  # not a self.<norm>(name) call there: the parsed forward says why not
            continue
        add_site = _site(add, module_path(add), rewrites, lambda rewrite: list(enumerate(a.node for a in rewrite.adds)))
        if add_site is None:
            found.unmatched.setdefault(norm_path, _where(add))
            continue
        if add_site not in used_adds and call not in used_calls:
            found.pairs.append((add_site, call))
            used_adds.add(add_site)
            used_calls.add(call)
    return found


def _norm_inputs(captured: Captured, norm_paths: set[str]):
    """(norm path, the value it reads from outside, the node reading it), once per norm and value, in graph order."""
    weights = captured.param_fqn.keys() | captured.buffer_fqn.keys()
    seen = set()
    for node in captured.graph.nodes:
        path = module_path(node)
        if path not in norm_paths or node.op != "call_function":
            continue
        for value in node.all_input_nodes:
            inside = module_path(value) == path or module_path(value).startswith(path + ".")
            if value not in weights and not inside and (path, value) not in seen:
                seen.add((path, value))
                yield path, value, node


def _add_feeding(node: fx.Node) -> fx.Node | None:
    """The ``aten.add`` node whose result ``node`` is, or a view of all its rows (module docstring), else None."""
    while True:
        packet = op_packet(node)
        if packet == _ADD:
            return node
        if not node.args or not isinstance(node.args[0], fx.Node) or not _hands_on(node, packet):
            return None
        node = node.args[0]


def _hands_on(node: fx.Node, packet) -> bool:
    """``node`` returns its input itself, or the same memory in the same rows, as run on the captured call."""
    if packet in DROPOUT_OPS:
        return not is_training_dropout(node)
    if _writes_and_returns_its_input(node):
        return True
    source, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(source, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if packet in _CAST_OPS:
        return (out.dtype, out.device) == (source.dtype, source.device)
    before, after = shape(node.args[0]), shape(node)
    return (packet in _SAME_MEMORY_OPS and before is not None and after is not None and len(before) > 0
            and len(after) > 0 and before[-1] == after[-1] and source.numel() == out.numel()
            and source.is_contiguous() and out.is_contiguous())


def _writes_and_returns_its_input(node: fx.Node) -> bool:
    """An in-place op (``h.mul_(g)``: ``Tensor(a!) self -> Tensor(a!)``): the same tensor, changed. The pair
    stands as it did for the probe, which saw the same object; ``mutation.py`` (or, across forwards, the
    version counter) then refuses the early output."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or not schema.returns:
        return False
    written, returned = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return written is not None and written.is_write and returned is not None and returned.is_write


def _site(node: fx.Node, parent: str, rewrites: dict[str, ForwardRewrite], sites_of) -> Site | None:
    """``(parent, i)`` for the one site ``(i, ast node)`` of ``sites_of(parent's parsed forward)`` that spans
    a line of that forward in ``node``'s stack trace; None when there is none, or more than one."""
    rewrite = rewrites.get(parent)
    if rewrite is None:
        return None
    code = rewrite.function.__code__
    lines = {int(m["line"]) for m in _FRAME.finditer(node.meta.get("stack_trace") or "")
             if m["file"] == code.co_filename and m["name"] == code.co_name}
    at = [i for i, site in sites_of(rewrite) if any(site.lineno <= line <= site.end_lineno for line in lines)]
    return (parent, at[0]) if len(at) == 1 else None


def _where(add: fx.Node) -> str:
    """``<file>:<line> in <module path>``: the innermost frame of an add's stack trace."""
    frames = list(_FRAME.finditer(add.meta.get("stack_trace") or ""))
    place = f"{os.path.basename(frames[-1]['file'])}:{frames[-1]['line']}" if frames else "an unknown line"
    return f"the add at {place} in {module_path(add) or 'the model'}'s forward"
