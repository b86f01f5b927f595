"""Is the residual stream closed under rotation? Read from the graph of a folded model.

For an orthogonal Q, a weightless RMSNorm commutes with it: RMSNorm(x·Q) = RMSNorm(x)·Q, because
‖x·Q‖ = ‖x‖. So if every tensor that *writes* the stream is rotated on its output side
(x ↦ x·Q) and every linear layer that reads a norm of the stream on its input side (W ↦ W·Q),
the model computes the same function. That holds only when, from the graph:

- every writer of the stream is a linear map of its output: a Linear / Conv1D / Conv / Embedding
  weight, a bias, a parameter table; the ops between writers and the stream commute with a linear
  map of the feature dim (the fold's rules table: adds, views, transposes, eval dropout, ...);
- every reader of the stream is a weightless RMSNorm over its last dim, whose output reaches only
  linear layers (through views and selections that keep each row's features);
- nothing else reads the stream or its writers' tensors (not a model output, not an activation).

The walk from each norm's input to the writers is the fold engine's own (``engine.analysis``): a
rule that commutes with centering along a whole dim commutes with any linear map of that dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from ..engine.analysis import effective_users, Walker
from ..engine.errors import FoldError
from ..engine.graph import Captured, describe, module_stack, shape
from ..engine.graph import op_packet as _packet
from ..engine.report import FoldReport
from ..engine.rules import METADATA_OPS, Need, NormCall, Requires, Source, classify, make_need, norm_call
from ..nn.kinds import RMS_NORM_TYPES

_aten = torch.ops.aten


@dataclass(frozen=True)
class StreamTensor:
    """A parameter with one dim in the stream's space: rotate it as t ↦ t·Q along ``dim``.

    ``role``: "writer" (its output side writes the stream), "reader" (a linear layer reading a
    stream norm), or "writer+reader" (a tied table that does both, e.g. GPT-2's wte / lm_head).
    """

    fqn: str
    dim: int
    role: str


@dataclass(frozen=True)
class Stream:
    """One residual stream closed under rotation: its width, the RMSNorms that read it, its tensors."""

    width: int
    norms: tuple[str, ...]
    tensors: tuple[StreamTensor, ...]

    def to_dict(self) -> dict:
        return {"width": self.width, "norms": list(self.norms),
                "tensors": [{"fqn": t.fqn, "dim": t.dim, "role": t.role} for t in self.tensors]}


def _blocked(what: str) -> FoldError:
    return FoldError(f"cannot rotate: the residual stream is not closed under rotation: {what}")


def find_streams(model: nn.Module, captured: Captured, fold_report: FoldReport | None = None) -> list[Stream]:
    """The streams of a folded model (one per connected set of norms and writers), or ``FoldError``
    naming the first thing that blocks rotating them. ``fold_report`` gives the reasons of norms
    the fold kept."""
    reasons = {e.path: e.reason for e in fold_report.norms} if fold_report is not None else {}
    calls = [(node, call) for node in captured.graph.nodes if (call := norm_call(node)) is not None]
    _check_no_offset_norms(model)
    if not calls:
        raise FoldError(f"cannot rotate: the graph shows no norm op (layer_norm, rms_norm, normfold's norm), so there "
                        f"is no normalized residual stream to rotate{_unrecognized_norms(model)}")
    walker = Walker(captured)
    roots: dict[Need, tuple[str, NormCall]] = {}
    for node, call in calls:
        path = norm_path(model, node)
        _check_reader_norm(path, call, reasons.get(path, ""))
        root = make_need(call.x, len(shape(call.x)) - 1, None)
        result = walker.walk(root)
        if result.broken is not None:
            raise _blocked(f"{path} reads {' <- '.join(result.blocking_path)}: {result.broken.reason}")
        roots[root] = (path, call)
    return [_stream(walker, captured, members) for members in _components(walker, roots)]


def _check_no_offset_norms(model: nn.Module) -> None:
    """``FoldError`` for an RMSNorm scaling by (offset + γ) (Gemma's (1 + w)): that γ stays in the norm
    (the fold moves a parameter γ into the readers, not offset + γ), and RMSNorm(x·Q)·(1 + γ) ≠
    (RMSNorm(x)·(1 + γ))·Q."""
    for path, module in model.named_modules():
        offset = getattr(module, "offset", 0.0) if isinstance(module, RMS_NORM_TYPES) else 0.0
        if offset and module.weight is not None:
            raise _blocked(f"{path} scales by ({offset:g} + γ) (Gemma's RMSNorm), which stays in the norm: the fold "
                           f"moves a parameter γ into the layers that read it, not ({offset:g} + γ), and "
                           f"RMSNorm(x·Q)·({offset:g} + γ) ≠ (RMSNorm(x)·({offset:g} + γ))·Q")


def _unrecognized_norms(model: nn.Module) -> str:
    """", though <class> modules look like norms: ..." for norm classes written out as elementwise ops."""
    names = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Norm")})
    if not names:
        return ""
    return (f"; the model has {', '.join(names)} modules, written out as elementwise ops the fold engine does not "
            "recognize as norms (replace them by torch.nn.RMSNorm / nn.LayerNorm with the same weights first)")


def norm_path(model: nn.Module, node: fx.Node) -> str:
    """The path of the norm module that ran ``node`` (innermost module of a norm type), else the node."""
    for path, _ in reversed(module_stack(node)):
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(module, (*RMS_NORM_TYPES, nn.LayerNorm)):
            return path
    return f"functional norm {node.name}"


def _check_reader_norm(path: str, call: NormCall, fold_reason: str) -> None:
    why = f" (the fold: {fold_reason})" if fold_reason else ""
    if not call.is_rms:
        raise _blocked(f"{path} is still a LayerNorm after the exact fold{why}; a LayerNorm re-centers its input, "
                       "so LayerNorm(x·Q) ≠ LayerNorm(x)·Q")
    if call.weight is not None or call.bias is not None:
        raise _blocked(f"{path} kept its γ/β{why}; RMSNorm(x·Q)·γ ≠ (RMSNorm(x)·γ)·Q unless γ moves into the "
                       "layers that read it")
    if call.num_dims != 1 or call.output is None:
        raise _blocked(f"{path} normalizes over {call.num_dims} dims; only a norm over the last dim commutes with Q")


def _components(walker: Walker, roots: dict[Need, tuple[str, NormCall]]) -> list[dict[Need, tuple[str, NormCall]]]:
    """Group the norms whose streams share a node (a tensor, an add) into one stream each."""
    owner: dict[fx.Node, Need] = {}
    parent = {root: root for root in roots}

    def find(r: Need) -> Need:
        while parent[r] is not r:
            r = parent[r]
        return r

    for root in roots:
        for need in walker.graph_of(root):
            other = owner.setdefault(need.node, root)
            parent[find(other)] = find(root)
    groups: dict[Need, dict] = {}
    for root, value in roots.items():
        groups.setdefault(find(root), {})[root] = value
    return list(groups.values())


def _stream(walker: Walker, captured: Captured, members: dict[Need, tuple[str, NormCall]]) -> Stream:
    """One stream from its member norms: checked closed, with every tensor to rotate and its role."""
    needs = set().union(*(walker.graph_of(root) for root in members))
    widths = {shape(root.node)[root.dim] for root in members}
    if len(widths) != 1:
        raise _blocked(f"norms of one stream normalize different widths {sorted(widths)}")
    width = widths.pop()
    parents: dict[Need, set[fx.Node]] = {}
    for need in needs:
        for child in walker.memo[need].children:
            parents.setdefault(child, set()).add(need.node)
    _check_whole_features(walker, captured, needs, width)
    reader_uses: dict[fx.Node, set[tuple[fx.Node, int]]] = {}  # weight placeholder -> {(node reading it, in_dim)}
    for path, call in members.values():
        for weight, in_dim, reading in _linear_readers(path, call, captured, width):
            reader_uses.setdefault(weight, set()).add((reading, in_dim))
    _check_closed(walker, captured, needs, parents, {call.x for _, call in members.values()}, reader_uses)
    return Stream(width, tuple(dict.fromkeys(path for path, _ in members.values())),
                  _stream_tensors(walker, captured, needs, reader_uses))


def _check_whole_features(walker: Walker, captured: Captured, needs: set[Need], width: int) -> None:
    """Each stream node is rotated along one dim holding all ``width`` features, and no norm output writes it."""
    along: dict[fx.Node, Need] = {}
    for need in sorted(needs, key=lambda n: n.node.name):
        if isinstance(need.dim, tuple) or need.group is not None or shape(need.node)[need.dim] != width:
            raise _blocked(f"{describe(need.node)} splits the stream's features (into heads or groups); a rotation "
                           "of the whole width does not commute with that")
        if along.setdefault(need.node, need) != need:
            raise _blocked(f"{describe(need.node)} would be rotated along two dims ({along[need.node].dim} and "
                           f"{need.dim})")
        answer = classify(need.node, need.dim, need.group, captured) if not walker.memo[need].children else None
        if isinstance(answer, Source) and answer.kind == "normalized":
            raise _blocked(f"{describe(need.node)}, a norm's output, writes the stream (a Post-LN layout): the "
                           "stream is not written by linear maps only")


def _stream_tensors(walker: Walker, captured: Captured, needs: set[Need], reader_uses) -> tuple[StreamTensor, ...]:
    """The parameters to rotate: writers (from the walk) and readers' weights, one dim each."""
    tensors: dict[str, tuple[int, set[str]]] = {}

    def add(fqn: str, dim: int, role: str) -> None:
        known_dim, roles = tensors.setdefault(fqn, (dim, set()))
        if known_dim != dim:
            raise _blocked(f"{fqn} would be rotated along dim {known_dim} and dim {dim}")
        roles.add(role)

    for need in needs:
        if need.node in captured.buffer_fqn and walker.memo[need].changed:  # rotation rewrites parameters only
            raise _blocked(f"buffer {captured.buffer_fqn[need.node]} writes the stream: only parameters are rotated")
        if need.node in captured.param_fqn and walker.memo[need].changed:
            add(_first_name(captured, need.node), need.dim, "writer")
    for weight, uses in reader_uses.items():
        for _, in_dim in uses:
            add(_first_name(captured, weight), in_dim, "reader")
    return tuple(StreamTensor(fqn, dim, "+".join(sorted(roles, reverse=True)))
                 for fqn, (dim, roles) in sorted(tensors.items()))


def _first_name(captured: Captured, param: fx.Node) -> str:
    """A parameter's first name in ``named_parameters`` order (export may name a tied tensor by another)."""
    fqn = captured.param_fqn[param]
    return captured.aliases.get(fqn, (fqn,))[0]


def _check_closed(walker: Walker, captured: Captured, needs: set[Need], parents, norm_inputs, reader_uses) -> None:
    """Every node the rotation changes is read only inside the stream, by a stream norm, or (a
    weight) by a linear reader along the same dim."""
    for need in sorted(needs, key=lambda n: n.node.name):
        if not walker.memo[need].changed:
            continue  # e.g. literal zeros: rotating changes nothing there
        inside = parents.get(need, set())
        allowed_readers = {user for user, in_dim in reader_uses.get(need.node, ()) if in_dim == need.dim}
        for user in effective_users(need.node):
            if user in inside or user in allowed_readers or _packet(user) in METADATA_OPS:
                continue
            if need.node in norm_inputs and (call := norm_call(user)) is not None and call.x is need.node:
                continue
            what = captured.param_fqn.get(need.node) or f"the stream at {describe(need.node)}"
            if user.op == "output":
                raise _blocked(f"{what} is a model output (e.g. hidden states): rotating the stream would change it")
            raise _blocked(f"{what} is also read by {describe(user)}, which is neither a weightless RMSNorm nor a "
                           "linear map of the stream")
    for weight, uses in reader_uses.items():
        stream_users = {user for need in needs if need.node is weight for user in parents.get(need, ())}
        for user in weight.users:
            if user not in stream_users and user not in {u for u, _ in uses}:
                raise _blocked(f"{captured.param_fqn[weight]} reads a stream norm but is also used by "
                               f"{describe(user)}")


def _linear_readers(path: str, call: NormCall, captured: Captured, width: int) -> list[tuple[fx.Node, int, fx.Node]]:
    """(weight placeholder, the weight's input dim, the node reading the weight: the linear op or the
    transpose feeding it) for every linear layer reading the norm's
    output, through ops that keep each row's features (views, selections along other dims, eval
    dropout: certified by the rules table); ``FoldError`` for any other reader."""
    found, frontier = [], [call.output]
    while frontier:
        current = frontier.pop()
        for user in effective_users(current):
            if _packet(user) in METADATA_OPS:
                continue
            if user.op == "output":
                raise _blocked(f"the output of {path} is a model output: rotating the stream would change it")
            reader = _linear_reader(user, current)
            if reader is not None:
                weight, in_dim, reading = reader
                if weight not in captured.param_fqn or len(shape(weight)) != 2 or shape(weight)[in_dim] != width:
                    raise _blocked(f"{describe(user)} reads {path} with a weight that is not a 2-D parameter of "
                                   f"input width {width}")
                found.append((weight, in_dim, reading))
            elif _keeps_features(user, current, captured):
                frontier.append(user)
            else:
                raise _blocked(f"the output of {path} feeds {describe(user)}, not a linear layer; only linear "
                               "layers can absorb the rotation (W·Q)")
    return found


def _linear_reader(user: fx.Node, x: fx.Node) -> tuple[fx.Node, int, fx.Node] | None:
    """(weight, input dim of the weight, the node reading the weight) when ``user`` is a linear map
    with ``x`` as its input."""
    packet = _packet(user)
    if packet == _aten.linear and user.args[0] is x:
        return user.args[1], 1, user                     # x·Wᵀ, W (out, in)
    if packet == _aten.addmm and user.args[1] is x:
        return user.args[2], 0, user                     # b + x·W, W (in, out): Hugging Face Conv1D
    if packet in (_aten.mm, _aten.matmul) and user.args[0] is x:
        weight = user.args[1]
        if _packet(weight) in (_aten.t, _aten.numpy_T) and len(weight.users) == 1:
            return weight.args[0], 1, weight             # x·Wᵀ spelled with a transpose (Falcon)
        return weight, 0, user
    return None


def _keeps_features(user: fx.Node, x: fx.Node, captured: Captured) -> bool:
    """``user``'s last dim is ``x``'s last dim, row by row: the rules table maps the one to the other
    and nothing else (so the op commutes with a linear map of the features)."""
    out, inp = shape(user), shape(x)
    if out is None or inp is None or not out:
        return False
    answer = classify(user, len(out) - 1, None, captured)
    return isinstance(answer, Requires) and answer.needs == (make_need(x, len(inp) - 1, None),)
