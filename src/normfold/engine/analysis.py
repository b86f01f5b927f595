"""Zero-mean analysis: which LayerNorms can become RMSNorms, and the plan that makes them so
(where their γ/β can go: ``affine.py``).

For each norm, the requirement "its input is zero-mean along the last dim" is walked back through
the rules table (memoized on (node, dim, group)) to parameter sources or to a Break. A norm whose
walk ends only in sources is a candidate; it is foldable when its zero-mean graph is *closed*:
every node whose value centering changes is read only along the requirement edges of foldable
norms, or by ops that carry the centering shift (x − m·1, the rules table's shift column) to the
inputs of LayerNorms that stay LayerNorms (which ignore a shift along their normalized dim). Dead
code, shape-only reads and sums in which the changed term cancels exactly ((h + e) − h, the rules'
``cancelling_sum``) are not readers. Which norms fold decides which absorb, so the check runs to a
fixpoint.

One idea in one file, long (some 830 lines) because finding the norms, the walk, the closedness check
and its fixpoint, and the agreement of several example calls decide together which norms fold, and
the plan is that decision written as steps; splitting them would spread one decision over files. What is
apart: γ/β placement (``affine.py``), the norm being decided (``analyzed_norm.py``), the ops a walk
sees through (``op_kinds.py``) and what each op does to zero mean (``rules/``).
"""
from __future__ import annotations

import operator
import sys
from fnmatch import fnmatchcase
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import fx, nn

from ..nn.kinds import LAYER_NORM_TYPES, RMS_NORM_TYPES
from .affine import affine_steps
from .analyzed_norm import AnalyzedNorm
from .errors import FoldError, KeepPatternError
from .graph import (Captured, describe, module_path, module_stack, node_arg, shape, single_use_param, static_size,
                    trace_shape, use_alias)
from .graph import op_packet as _packet  # the short name reads better in the walks below
from .layer_scale import LayerScale, find_layer_scales
from .norm_forms import traced_form
from .op_kinds import CAST_OP_NAMES, CAST_OPS, COPY_OP_NAMES, COPY_OPS, aten_packets, passes_values_on
from .plan import CenterGroupsStep, CenterStep, FoldPlan, PlanConstraints, PrecomputeStep, SwapStep, UntieStep
from .report import NormEntry
from .rules import (MULTI_OUTPUT_OPS, Break, Need, NormCall, Requires, Source, cancelling_sum, classify, classify_part,
                    live_nodes, make_need, norm_call, reads_only_shape, rounding_cast, shift_is_additive, shift_passes,
                    shift_support)

_aten = torch.ops.aten
_NOTHING: Mapping[str, str] = MappingProxyType({})


@dataclass
class Walk:
    """Memo entry of :class:`Walker`: the answer for one Need, summarized over its whole requirement subtree."""

    children: tuple[Need, ...] = ()
    broken: Break | None = None
    blocking_path: tuple[str, ...] = ()
    params: frozenset = frozenset()   # {(fqn, dim, group, groups)} of parameter sources below (groups: ``Part.groups``)
    changed: bool = False             # centering changes this node's value


class Walker:
    """Walks a Need ("this node is zero-mean along dim") back through the rules table to parameter
    sources or a Break, memoized per Need. The fold's analysis reads it for zero mean; rotate reads
    the same walk for "commutes with a linear map of the dim" (a rule that commutes with centering
    along a whole dim commutes with any linear map of it)."""

    def __init__(self, captured: Captured, precomputed: frozenset = frozenset(),
                 layer_scales: Mapping[fx.Node, LayerScale] = _NOTHING, *, parts: bool = False):
        self.captured = captured
        self.precomputed = precomputed  # layer_norm nodes that become Identity (their table holds LN(W))
        self.layer_scales = layer_scales  # multiplies by a layer scale: the identity once merged, or refused
        self.parts = parts  # ask about the parts a selection reads (``rules.classify_part``): the fold's, not rotate's
        self.memo: dict[Need, Walk] = {}

    def walk(self, need: Need) -> Walk:
        if need in self.memo:
            return self.memo[need]
        if need.node in self.precomputed:  # LN(W)[idx] = LN(W[idx]): the norm's output is a lookup
            answer = Requires((make_need(need.node.args[0], need.dim, need.group),))
        elif need.node in self.layer_scales:  # γ ⊙ x is x once γ merged into x's producer (same shape)
            scale = self.layer_scales[need.node]
            answer = Requires((make_need(scale.input, need.dim, need.group),)) if scale.step else Break(scale.refused)
        elif need.node in self.captured.inputs_from:  # a submodule's recorded input: its producer is not in the graph
            answer = Break(f"an input of {self.captured.inputs_from[need.node]}, computed outside the submodules "
                           "torch.export captured: not known to be zero-mean")
        else:
            answer = classify_part(need, self.captured) if self.parts else None
            if answer is None:
                answer = classify(need.node, need.dim, need.group, self.captured)
        if isinstance(answer, Break):
            entry = Walk(broken=answer, blocking_path=(describe(need.node),))
        elif isinstance(answer, Source):
            groups = need.part.groups if need.part is not None else None
            params = frozenset({(answer.fqn, need.dim, need.group, groups)}) if answer.kind == "parameter" else frozenset()
            entry = Walk(params=params, changed=bool(params))
        else:
            entry = Walk(children=answer.needs)
            params = set()
            for child in answer.needs:
                sub = self.walk(child)
                if sub.broken is not None:
                    entry = Walk(broken=sub.broken, blocking_path=(describe(need.node), *sub.blocking_path))
                    break
                params |= sub.params
            else:
                entry.params = frozenset(params)
                entry.changed = bool(params)
        self.memo[need] = entry
        return entry

    def graph_of(self, root: Need) -> set[Need]:
        """All Needs reachable from ``root`` (its zero-mean graph)."""
        seen, stack = set(), [root]
        while stack:
            need = stack.pop()
            if need not in seen:
                seen.add(need)
                stack.extend(self.memo[need].children)
        return seen


def effective_users(node: fx.Node):
    """Users that read a node's values, seeing through list-returning ops (split, chunk, unbind) to their
    getitems; dead code (no path to an output, no side effect) and shape-only reads (``sym_size``,
    ``expand_as``'s second argument, ``new_zeros``...) are skipped: a change of the values never reaches them."""
    live = live_nodes(node.graph)
    for user in node.users:
        if user not in live or reads_only_shape(user, node):
            continue
        if _packet(user) in MULTI_OUTPUT_OPS:
            yield from (item for item in user.users if item in live)
        else:
            yield user


def _is_ln_input(user: fx.Node, need: Need) -> bool:
    """``user`` is a LayerNorm over the last dim reading ``need.node`` as its input, whole-dim: one
    that stays absorbs the centering, one that folds has this very need as its root."""
    call = norm_call(user)
    return (call is not None and not call.is_rms and call.x is need.node and call.num_dims == 1
            and need.dim == len(trace_shape(need.node)) - 1 and need.group is None)


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


def _find_norms(model: nn.Module, captured: Captured) -> list[AnalyzedNorm]:
    """Norm calls grouped by the module that owns them, in graph order; then RMSNorm modules the
    graph shows no norm op for (e.g. a decomposed implementation).

    A LayerNorm call belongs to the LayerNorm module that runs it, or, called functionally, to the
    parameter-free leaf module running it (OLMo's ``OlmoLayerNorm``). What such a module computes
    is read from its traced ops (``norm_forms.traced_form``), never assumed from its class: one
    that is not y = LN(x)·(offset + γ) + β is kept, saying what it computes.
    """
    norms: dict[str, AnalyzedNorm] = {}
    called: set[str] = set()
    for node in captured.graph.nodes:
        called.update(p for p, _ in module_stack(node))
        call = norm_call(node)
        if call is None:
            continue
        kind, types = ("RMSNorm", RMS_NORM_TYPES) if call.is_rms else ("LayerNorm", LAYER_NORM_TYPES)
        # the innermost norm module that ran the op, else the module owning its γ (a functional call)
        candidates = [p for p, _ in reversed(module_stack(node))]
        if call.weight is not None and call.weight in captured.param_fqn:
            candidates.append(captured.param_fqn[call.weight].rpartition(".")[0])
        path, module = None, None
        for p in candidates:
            try:
                m = model.get_submodule(p)
            except AttributeError:
                continue
            if isinstance(m, types):
                path, module = p, m
                break
        if path is None and not call.is_rms:
            path, module = _functional_owner(model, call)
        if path is None:
            path = f"{module_path(node) or '<root>'}:{node.name}"
        reason = "already an RMSNorm" if call.is_rms else ""
        if module is not None and _has_hooks(module):  # a swap would silently drop them: keep it, say why
            module, reason = None, "kept: the module carries hooks, which replacing it would drop"
        norms.setdefault(path, AnalyzedNorm(path, kind, [], module, reason=reason)).calls.append(call)
    for norm in norms.values():
        if norm.kind == "LayerNorm" and norm.module is not None:
            form = traced_form(norm.calls, norm.path, captured)
            if isinstance(form, str):
                norm.module, norm.reason = None, f"kept: {type(model.get_submodule(norm.path)).__name__} {form}"
            else:
                norm.form = form
    for path, m in model.named_modules():
        if isinstance(m, RMS_NORM_TYPES) and path in called and path not in norms:
            norms[path] = AnalyzedNorm(path, "RMSNorm", [], m, reason="already an RMSNorm")
    return list(norms.values())


def _functional_owner(model: nn.Module, call: NormCall) -> tuple[str | None, nn.Module | None]:
    """The module running a functional layer_norm when it is a norm module: a leaf with no parameters
    (γ/β, if any, come from elsewhere and are judged by ``traced_form``), normalizing one dim."""
    path = module_path(call.node)
    if not path or call.num_dims != 1:
        return None, None
    module = model.get_submodule(path)
    if list(module.children()) or list(module.parameters(recurse=False)):
        return None, None
    return path, module


def _find_precomputable(norms: list[AnalyzedNorm], captured: Captured) -> list[UntieStep]:
    """Mark LayerNorms applied straight to an embedding lookup for precomputing into the table.

    Returns the untie steps that give the table's other names (a tied output head) the original.
    """
    untie = []
    for norm in norms:
        if norm.kind != "LayerNorm" or norm.module is None or len(norm.calls) != 1 or norm.forced_keep:
            continue
        call = norm.calls[0]
        if call.output is not call.node or call.num_dims != 1:  # aten.layer_norm only
            continue
        lookup = call.x
        while passes_values_on(lookup) and len(lookup.users) == 1:  # copies, eval dropout: not casts
            lookup = lookup.args[0]
        if _packet(lookup) != _aten.embedding or len(lookup.users) != 1:
            continue
        table = lookup.args[0]
        gamma = single_use_param(call.weight, captured) if call.weight is not None else None
        beta = single_use_param(call.bias, captured) if call.bias is not None else None
        if table not in captured.param_fqn or (call.weight is not None and gamma is None) \
                or (call.bias is not None and beta is None):
            continue
        name = use_alias(captured, table, lookup)
        others = [u for u in table.users if u is not lookup]
        if any(use_alias(captured, table, u) == name for u in others):
            continue  # the same name is read elsewhere: its rows must stay as they are
        norm.precompute = PrecomputeStep(norm.path, name, gamma, beta, float(call.eps))
        norm.foldable = True
        norm.reason = f"precomputed into the rows of {name}; the norm becomes Identity"
        for other in captured.aliases.get(name, (name,)):
            if other != name:
                path, _, attr = other.rpartition(".")
                untie.append(UntieStep(path, attr, name))
    return untie


def _walk_norms(walker: Walker, norms: list[AnalyzedNorm]) -> None:
    for norm in norms:
        if norm.kind != "LayerNorm" or norm.precompute is not None or norm.forced_keep:
            continue
        if norm.module is None:
            norm.reason = norm.reason or "functional layer_norm: no nn.LayerNorm module to replace"
            continue
        reasons = []
        for call in norm.calls:
            x = call.x
            if call.num_dims != 1:
                reasons.append((f"kept whole: normalizes over several dims together, "
                                f"{tuple(norm.module.normalized_shape)} (only the last dim alone folds)", (), None))
                continue
            if static_size(x, -1) is None:  # other dims may depend on the input (rows a mask keeps)
                reasons.append(("kept: the size of its normalized dim is not static in the trace", (), None))
                continue
            root = make_need(x, len(trace_shape(x)) - 1, None)
            result = walker.walk(root)
            if result.broken is not None:
                where = result.blocking_path[-1]
                reasons.append((f"blocked: {where}: {result.broken.reason}", result.blocking_path, result.broken.reason))
                continue
            norm.zero_mean_graph |= walker.graph_of(root)
            norm.params |= result.params
        if reasons:
            norm.reason, norm.blocking_path, norm.blocker = reasons[0]
        else:
            norm.foldable = True


def _close(walker: Walker, norms: list[AnalyzedNorm], captured: Captured) -> dict[Need, set[fx.Node]]:
    """Drop candidates until every changed node is read only where a rule allows it or through ops that
    carry its centering shift to LayerNorms that stay LayerNorms: a fixed point, since which norms fold
    decides which absorb. Failures that hold whatever else folds are dropped first; a failure that only
    a folding norm causes (its shift reaching that norm) waits until no other is left.

    Returns the requirement edges of the foldable norms: Need -> the nodes that asked for it.
    """
    while True:
        active = [n for n in norms if n.foldable]
        parents: dict[Need, set[fx.Node]] = {}
        for norm in active:
            for need in norm.zero_mean_graph:
                for child in walker.memo[need].children:
                    parents.setdefault(child, set()).add(need.node)
        folding = _FoldingSet.of(walker, active, captured)
        failures = []
        for norm in active:
            failure = _closedness_failure(walker, norm, parents, captured, folding)
            if failure is None:
                failure = _conflict(norm, active, captured)
            if failure is not None:
                failures.append((norm, failure))
        firm = [(norm, f) for norm, f in failures if not f.waits_on_others]
        for norm, failure in firm or failures:
            norm.foldable, norm.reason = False, failure.reason
        if not failures:
            return parents


@dataclass(frozen=True)
class _Failure:
    reason: str
    waits_on_others: bool  # would pass if some other norm stayed a LayerNorm


@dataclass(frozen=True)
class _FoldingSet:
    """What a centering shift must not reach while these norms fold."""

    norm_paths: Mapping[fx.Node, str]   # norm op node -> path, for every norm that folds (or becomes Identity)
    zero_mean_nodes: frozenset          # nodes that a folding norm needs zero-mean
    changed: frozenset                  # nodes whose values centering may change (downstream of centered tensors)
    captured: Captured | None = None
    parts: Mapping[str, tuple] = field(default_factory=dict)  # canonical tensor -> its (dim, group, groups) centered
    masks: dict = field(default_factory=dict, compare=False)  # node -> where it changes (``_changed_where``)

    @classmethod
    def of(cls, walker: Walker, active: list[AnalyzedNorm], captured: Captured) -> _FoldingSet:
        graph_needs = [need for norm in active for need in norm.zero_mean_graph]
        centered = {need.node for need in graph_needs
                    if captured.centerable_fqn(need.node) is not None and walker.memo[need].changed}
        changed, stack = set(), list(centered)
        while stack:
            node = stack.pop()
            if node not in changed:
                changed.add(node)
                stack.extend(effective_users(node))
        return cls({call.node: norm.path for norm in active for call in norm.calls},
                   frozenset(need.node for need in graph_needs), frozenset(changed), captured,
                   centered_parts(active, captured))

    def leaves_unchanged(self, node: fx.Node) -> bool:
        """``node`` reads changed tensors only where centering changes nothing: v = qkv[..., 2, :] when
        only the q and k rows of the fused weight are centered. Decided by running the op on masks of
        where its inputs change (selections and reshapes move them exactly; a Linear changes the
        output rows whose weight rows change, when its input does not change)."""
        if _packet(node) not in _MASK_OPS and node.target is not operator.getitem:
            return False
        where = self._changed_where(node)
        return where is not None and not bool(where.any())

    def may_change(self, node: fx.Node) -> bool:
        """Centering may change some value of ``node`` (downstream of a centered tensor, and not known to
        be unchanged everywhere, as the output of a LayerNorm whose input only shifts)."""
        if node not in self.changed:
            return False
        where = self._changed_where(node)
        return where is None or bool(where.any())

    def _changed_where(self, node) -> torch.Tensor | None:
        """A boolean tensor of ``node``'s shape, True where centering may change its value; None where
        that is not known (anywhere, then)."""
        if node not in self.masks:
            self.masks[node] = self._where(node)
        return self.masks[node]

    def _where(self, node: fx.Node) -> torch.Tensor | None:
        size = shape(node)
        if size is None:
            return None
        if node not in self.changed:
            return torch.zeros(size, dtype=torch.bool)
        if node in self.captured.param_fqn:
            return _centered_where(size, self.parts.get(_canonical(self.captured.param_fqn[node], self.captured)))
        if _is_layer_norm_output(node) and not {node_arg(node, 2, "weight"), node_arg(node, 3, "bias")} & self.changed:
            return torch.zeros(size, dtype=torch.bool)  # LN(x − m·1) = LN(x); a folded one is exactly the RMSNorm of it
        packet = _packet(node)
        if packet in _MASK_OPS:
            source = self._changed_where(node.args[0]) if isinstance(node.args[0], fx.Node) else None
            if source is None or packet in _VALUE_OPS:
                return source
            if node.all_input_nodes != [node.args[0]]:  # a size computed in the graph: not evaluated here
                return None
            return node.target(source, *node.args[1:], **node.kwargs)
        if node.target is operator.getitem and _packet(node.args[0]) in MULTI_OUTPUT_OPS:
            split = node.args[0]
            source = self._changed_where(split.args[0]) if split.all_input_nodes == [split.args[0]] else None
            return None if source is None else split.target(source, *split.args[1:], **split.kwargs)[node.args[1]]
        if packet == _aten.linear:  # output o changes where row o of W or b[o] does, for an unchanged input
            x, weight, bias = node.args[0], node.args[1], node_arg(node, 2, "bias")
            x_where, w_where = self._changed_where(x), self._changed_where(weight)
            b_where = self._changed_where(bias) if bias is not None else torch.zeros(size[-1], dtype=torch.bool)
            if x_where is None or x_where.any() or w_where is None or b_where is None:
                return None
            return (w_where.any(1) | b_where).expand(size)
        return None


def _is_layer_norm_output(node: fx.Node) -> bool:
    """``node`` is the output of an aten LayerNorm over its last dim: what a change of its input does not
    reach, when the closedness checks hold (a shift it absorbs, or the centering of a norm that folds)."""
    call = norm_call(node)
    return call is not None and call.output is node and not call.is_rms and call.num_dims == 1


def _centered_where(size, part) -> torch.Tensor | None:
    """Where a parameter of ``size`` changes when centered as ``part`` = (dim, group, groups)."""
    if part is None:
        return None
    dim, group, groups = part
    where = torch.zeros(size, dtype=torch.bool)
    if groups is None:
        return where.fill_(True)
    index = [slice(None)] * len(size)
    for g in groups:
        index[dim] = slice(g * group, (g + 1) * group)
        where[tuple(index)] = True
    return where


# ops whose output, run on a mask of where their input changes, says exactly where they change
_MASK_OPS = frozenset(aten_packets("view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze",
                                   "permute", "transpose", "t", "expand", "slice", "select", *COPY_OP_NAMES,
                                   *CAST_OP_NAMES))
_VALUE_OPS = COPY_OPS | CAST_OPS  # the mask passes on as it is


def _closedness_failure(walker: Walker, norm: AnalyzedNorm, parents, captured: Captured,
                        folding: _FoldingSet) -> _Failure | None:
    """Why centering this norm's producers would leak into something that no norm absorbs, or None.

    A use outside the zero-mean graph is allowed when the centering shift it reads (x − m·1 = x + δ)
    reaches, through ops that pass it, only the inputs of LayerNorms that stay LayerNorms
    (LN(x + c·1) = LN(x)). A failure that another norm folding causes is returned only if none other is.
    """
    waiting = None
    for need in sorted(norm.zero_mean_graph, key=lambda n: n.node.name):
        if not walker.memo[need].changed:
            continue
        inside = parents.get(need, set())
        for user in effective_users(need.node):
            if user in inside or _is_ln_input(user, need):
                continue
            if need.node in captured.param_fqn and _untieable(captured, need.node, user,
                                                              _with_readers_in_sums(inside, need.node)):
                continue
            what = captured.param_fqn.get(need.node) or describe(need.node)
            other = next((k for k, users in parents.items() if k.node is need.node and k != need and user in users), None)
            if other is not None and (other.dim, other.group) == (need.dim, need.group):
                continue  # it asks about another part of the same centering (the k rows beside the q rows)
            if other is not None:
                return _Failure(f"conflict: {what} must be zero-mean along dim {need.dim} (group {need.group}) and "
                                f"along dim {other.dim} (group {other.group}); no centering gives both",
                                _whole_waits_for_grouped((need.dim, need.group), [(other.dim, other.group)]))
            if folding.leaves_unchanged(user):
                continue
            if user.op == "output":
                return _Failure(f"not closed: {what} is a model output", False)
            unread = f"not closed: {what} also feeds {describe(user)}, which is not a norm input"
            if need.group is not None:
                return _Failure(f"{unread}, and its centering is per group of {need.group} along dim {need.dim}: "
                                "no LayerNorm over a whole dim absorbs that", False)
            dims = need.dim if isinstance(need.dim, tuple) else (need.dim,)
            blocker = _shift_blocker(user, need.node, dims, folding)
            if blocker is not None:
                failure = _Failure(f"{unread}, and its centering shift reaches {blocker.reason}", blocker.waits_on_others)
                if not failure.waits_on_others:
                    return failure
                waiting = waiting or failure
    return waiting


def _shift_blocker(reader: fx.Node, changed: fx.Node, dims: tuple[int, ...], folding: _FoldingSet) -> _Failure | None:
    """Follow the shift that centering adds to ``changed`` (constant along ``dims``) forward from
    ``reader``: None when every path ends at the input of a LayerNorm that stays one, else the first
    place it is not absorbed (a model output, an op that does not pass it, a norm that folds...)."""
    stack, seen = [(reader, changed, dims, ())], set()
    while stack:
        user, operand, dims, support = stack.pop()
        if (user, operand, dims, support) in seen:
            continue
        seen.add((user, operand, dims, support))
        if user.op == "output":
            return _Failure("a model output", False)
        call = norm_call(user)
        if call is not None and call.x is operand and operand not in (call.weight, call.bias):
            failure = _absorbs(call, operand, dims, folding)
            if failure is not None:
                return failure
            continue
        if (user in folding.zero_mean_nodes and _accounted_in_sum(user, operand)) or _cancels_in_sum(user, changed):
            continue
        if user in folding.zero_mean_nodes:
            return _Failure(f"{describe(user)}, which a folding norm needs zero-mean", True)
        rounding = rounding_cast(user, folding.captured)
        if rounding is not None:  # LN(round(x + δ)) differs from LN(round(x)) by the rounding
            return _Failure(f"{describe(user)}, where {rounding}", False)
        out_support = shift_support(user, operand, support)
        if out_support is None:  # the op reads none of the indices the shift is on
            continue
        out_dims = shift_passes(user, operand, dims)
        if out_dims is None:
            return _Failure(f"{describe(user)}, which does not pass a ones-vector shift", False)
        if not shift_is_additive(user, folding.may_change) and any(
                other is not operand and other in folding.changed for other in user.all_input_nodes):
            return _Failure(f"{describe(user)}, whose other operand changes too", False)
        stack.extend((nxt, user, out_dims, out_support) for nxt in effective_users(user))
    return None


def _with_readers_in_sums(asking: set[fx.Node], term: fx.Node) -> set[fx.Node]:
    """``asking`` (the nodes that need ``term`` zero-mean) and, where one is a cancelling sum, the nodes inside
    it that read ``term`` (x + p in x − (x + p)): the names a tied parameter is read by for those needs.
    Only for naming: their values are not zero-mean, so their other readers are still checked."""
    readers = set(asking)
    for node in asking:
        expansion = cancelling_sum(node)
        if expansion is not None:
            readers.update(n for n in expansion.inner if term in n.all_input_nodes)
    return readers


def _accounted_in_sum(node: fx.Node, operand: fx.Node) -> bool:
    """``node``'s zero-mean rule wrote it as a sum whose terms cancel (x − (x + p) = −p) and ``operand`` is
    one of the nodes that sum expanded: the change arriving here is part of Σ c·term, which the walk
    already required zero-mean term by term (a cancelled term's change cancels too)."""
    expansion = cancelling_sum(node)
    return expansion is not None and operand in expansion.inner | set(node.all_input_nodes)


def _cancels_in_sum(node: fx.Node, changed: fx.Node) -> bool:
    """``node`` is a sum in which the term ``changed`` cancels and no term that stays depends on it
    ((h + e) − h = e): whatever centering does to ``changed``, ``node`` does not change (Σ c·Δterm = 0)."""
    expansion = cancelling_sum(node)
    if expansion is None or changed not in expansion.cancelled:
        return False
    reached, stack = set(), [changed]
    while stack:
        n = stack.pop()
        if n not in reached:
            reached.add(n)
            stack.extend(n.users)
    return not reached.intersection(expansion.terms)


def _absorbs(call: NormCall, x: fx.Node, dims: tuple[int, ...], folding: _FoldingSet) -> _Failure | None:
    """None when this norm removes a shift of its input that is constant along ``dims``: a LayerNorm
    that stays one, over its last dim alone, which is among ``dims`` (LN(x + c·1) = LN(x)); else why not."""
    where = describe(call.node)
    if call.is_rms:
        return _Failure(f"{where}, an RMSNorm (an RMSNorm does not absorb a shift)", False)
    if call.num_dims != 1:
        return _Failure(f"{where}, a LayerNorm over {call.num_dims} dims together (it absorbs a shift along all "
                        "of them, not along one)", False)
    if len(trace_shape(x)) - 1 not in dims:
        return _Failure(f"{where}, which normalizes dim {len(trace_shape(x)) - 1}, while the shift is constant along "
                        f"dims {dims} only", False)
    if call.node in folding.norm_paths:
        return _Failure(f"{folding.norm_paths[call.node]}, which folds to an RMSNorm (an RMSNorm does not absorb "
                        "a shift)", True)
    return None


def _untieable(captured: Captured, param: fx.Node, user: fx.Node, inside: set[fx.Node]) -> bool:
    """A use outside the zero-mean graph that reads the tensor under a name no inside use reads."""
    outside_name = use_alias(captured, param, user)
    return outside_name not in {use_alias(captured, param, u) for u in inside}


def _canonical(fqn: str, captured: Captured) -> str:
    return captured.aliases.get(fqn, (fqn,))[0]


def _conflict(norm: AnalyzedNorm, active: list[AnalyzedNorm], captured: Captured) -> _Failure | None:
    """A tensor centered along two different (dim, group)s cannot satisfy both requirements."""
    wanted: dict[str, set] = {}
    for other in active:
        for fqn, dim, group, _ in other.params:  # parts of one centering (groups of it) agree with each other
            wanted.setdefault(_canonical(fqn, captured), set()).add((dim, group))
    for fqn, dim, group, _ in norm.params:
        ways = wanted[_canonical(fqn, captured)]
        if len(ways) > 1:
            return _Failure(f"conflict: {fqn} must be zero-mean along {sorted(ways, key=str)} for different norms",
                            _whole_waits_for_grouped((dim, group), ways - {(dim, group)}))
    return None


def _whole_waits_for_grouped(mine: tuple, others) -> bool:
    """In a conflict between centering a dim whole (mine) and per group (the others), the grouped norms
    go first: once they stay LayerNorms over their groups, they absorb the whole-dim shift, and the
    whole-dim norm may fold (the reverse never holds: a per-group shift is not constant along a whole dim)."""
    dim, group = mine
    return group is None and all(d == dim and g is not None for d, g in others)


# --------------------------------------------------------------------------- entry point

def analyze_captured(model: nn.Module, captured: Captured, constraints: PlanConstraints = PlanConstraints(), *,
                     kept: Mapping[str, str] = _NOTHING,
                     affine_kept: Mapping[str, str] = _NOTHING) -> tuple[list[NormEntry], FoldPlan, list[str]]:
    """Norm entries, the fold plan and the untied parameters for a captured model, within ``constraints``
    (its ``fold_affine``, ``precompute`` and ``loadable_keys``; BatchNorms are planned before, in
    ``normfold.engine.batchnorm``).

    ``kept``: norm path -> reason, norms that stay LayerNorms whatever this trace says;
    ``affine_kept``: norm path -> reason, norms whose γ/β stay (``analyze_calls`` sets both).
    """
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))  # requirement walks recurse once per op along the residual stream
    try:
        norms = _find_norms(model, captured)
        for norm in norms:
            pattern = next((p for p in constraints.keep if fnmatchcase(norm.path, p)), None)
            if pattern is not None:  # no module to replace: neither swapped nor its γ/β moved, nothing centered for it
                norm.module, norm.reason = None, f"kept by request (keep pattern {pattern!r})"
            if norm.path in kept:
                norm.forced_keep, norm.reason = True, kept[norm.path]
        precompute_untie = _find_precomputable(norms, captured) if constraints.precompute else []
        layer_scales = find_layer_scales(captured)
        walker = Walker(captured, frozenset(n.calls[0].node for n in norms if n.precompute is not None), layer_scales,
                        parts=True)
        _walk_norms(walker, norms)
        parents = _close(walker, norms, captured)
    finally:
        sys.setrecursionlimit(limit)
    plan = FoldPlan()
    foldable = [n for n in norms if n.foldable]
    plan.layer_scale = _merged_layer_scales(layer_scales, foldable)
    centers, plan.untie, untied = _centering_steps(foldable, parents, captured)
    plan.center = [c for c in centers if isinstance(c, CenterStep)]
    plan.center_groups = [c for c in centers if isinstance(c, CenterGroupsStep)]
    for step in precompute_untie:
        if step not in plan.untie:
            plan.untie.append(step)
            untied.append(f"{step.module_path}.{step.attr} (copy of {step.source_fqn})")
    plan.precompute = [n.precompute for n in norms if n.precompute is not None]
    for norm in norms:
        if norm.precompute is not None:
            plan.swap.append(SwapStep(norm.path, "Identity", *_size_and_eps(norm), elementwise_affine=False, bias=False))
        elif norm.foldable:
            n_producers = len({fqn for fqn, *_ in norm.params})
            norm.reason = f"input zero-mean: centered {n_producers} producer{'s' * (n_producers != 1)}"
            if norm.form is not None and norm.form.cast:  # OLMo's: what the float64 proof compares against
                norm.reason += (f"; {type(norm.module).__name__} computes a layer norm of its input cast to "
                                f"{norm.form.cast}, cast back (proved in float64 without the casts)")
            if norm.form is not None and norm.form.cast_back:  # ESMC's: the swap returns x's dtype as well
                norm.reason += (f"; {type(norm.module).__name__} casts its layer norm's output back to its input's "
                                "dtype, as normfold's RMSNorm returns it")
            parts = sorted((fqn, group, sorted(groups)) for fqn, _, group, groups in norm.params if groups is not None)
            if parts:  # which output groups of a fused projection reach this norm
                norm.reason += "; only the groups it reads: " + ", ".join(
                    f"{fqn} groups {groups} of {group}" for fqn, group, groups in parts)
    untie_offers = _untie_offers(captured, plan.untie) if constraints.move_every_gamma else {}
    for norm in norms:
        if norm.module is None or norm.precompute is not None:
            continue
        untied_names = frozenset(f"{u.module_path}.{u.attr}" for u in plan.untie) | frozenset(untie_offers)
        affine, why = (affine_steps(norm, model, captured, untied_names, constraints) if constraints.fold_affine
                       else ([], ""))
        if affine and norm.path in affine_kept:
            affine, why = [], affine_kept[norm.path]
        norm.affine = affine
        if affine:
            plan.affine_fold.extend(affine)
        elif why and why != "no affine" and constraints.fold_affine:
            norm.reason += f"; affine kept: {why}"
            norm.affine_kept = why
        if norm.foldable or affine:
            plan.swap.append(_swap_step(norm, "RMSNorm" if norm.foldable or norm.kind == "RMSNorm" else "LayerNorm"))
    for step in plan.affine_fold:  # the tied names γ folded into: untied, said in the report
        offer = untie_offers.pop(step.weight_fqn, None)
        if offer is not None:
            plan.untie.append(offer)
            untied.append(f"{offer.fqn} (copy of {offer.source_fqn}, to take {step.norm_path}'s γ)")
    entries = [NormEntry(n.path, n.kind, n.foldable, bool(n.affine), n.reason,
                         tuple(sorted({fqn for fqn, *_ in n.params})) if n.foldable else (),
                         n.blocking_path, n.blocker, n.affine_kept) for n in norms]
    return entries, plan, untied


def _untie_offers(captured: Captured, untie: list[UntieStep]) -> dict[str, UntieStep]:
    """Name -> the untie step giving it its own copy, for every later name of a tied parameter (a tied
    output head: ``lm_head.weight`` of ``embed_tokens.weight``) not untied already: a γ may fold into
    such a copy (``FoldConfig.move_every_gamma``); only those it folds into are untied."""
    done = {u.fqn for u in untie}
    offers = {}
    for names in captured.aliases.values():
        for name in names[1:]:
            if name not in done:
                path, _, attr = name.rpartition(".")
                offers[name] = UntieStep(path, attr, names[0])
    return offers


def _merged_layer_scales(layer_scales: Mapping[fx.Node, LayerScale], foldable: list[AnalyzedNorm]) -> list:
    """The merges some folded norm's zero-mean graph walks through (the others would change nothing useful)."""
    walked = {need.node for norm in foldable for need in norm.zero_mean_graph}
    steps = [scale.step for node, scale in layer_scales.items() if scale.step is not None and node in walked]
    return list(dict.fromkeys(steps))


def _size_and_eps(norm: AnalyzedNorm) -> tuple[int, float]:
    """The normalized size and eps the norm's traced call used (a module's own attributes for an
    RMSNorm traced without an explicit eps)."""
    call, module = norm.calls[0], norm.module
    size = static_size(call.x, -1) or module.normalized_shape[0]
    return int(size), float(module.eps if call.eps is None else call.eps)


def _swap_step(norm: AnalyzedNorm, to: str) -> SwapStep:
    """The swap of a norm module: its γ/β stay unless they were folded (``norm.affine``); a LayerNorm's
    come from what its traced call reads (``norm.form``), with the offset of (offset + γ)."""
    folded = bool(norm.affine)
    if norm.form is None:  # an RMSNorm module
        weight, bias, offset = norm.module.weight is not None, getattr(norm.module, "bias", None) is not None, 0.0
    else:
        weight, bias, offset = norm.form.weight_fqn is not None, norm.form.bias_fqn is not None, norm.form.offset
    assert not (folded and offset), "γ read as γ + offset is never folded into a consumer"
    permute = norm.form.permute if norm.form is not None else ()
    assert not (permute and to != "RMSNorm"), "a norm between permutes is swapped only for an RMSNorm between them"
    assert not (norm.form is not None and norm.form.cast and to != "RMSNorm"), "a cast form has no γ/β to fold alone"
    return SwapStep(norm.path, to, *_size_and_eps(norm), elementwise_affine=(weight or bias) and not folded,
                    bias=bias and not folded, offset=offset, permute=permute)


def centered_parts(norms: list[AnalyzedNorm], captured: Captured) -> dict[str, tuple[int, int | None, frozenset | None]]:
    """Canonical tensor -> (dim, group, groups) its centering covers for ``norms``: the union of the
    groups their needs ask for (None: every group, as soon as one asks for the whole tensor)."""
    parts: dict[str, tuple[int, int | None, frozenset | None]] = {}
    for norm in norms:
        for fqn, dim, group, groups in norm.params:
            canonical = _canonical(fqn, captured)
            before = parts.get(canonical, (dim, group, frozenset()))[2]
            parts[canonical] = (dim, group, None if before is None or groups is None else before | groups)
    return parts


def _centering_steps(foldable: list[AnalyzedNorm], parents, captured: Captured):
    """One CenterStep (or CenterGroupsStep, for the groups only some norms read) per distinct tensor;
    UntieSteps for its names that must keep the original."""
    norm_of: dict[str, str] = {}  # canonical tensor -> a norm that centers it (for the error below)
    for norm in foldable:
        for fqn, *_ in norm.params:
            norm_of[_canonical(fqn, captured)] = norm.path
    by_tensor = centered_parts(foldable, captured)
    # a need's readers: the nodes that asked for it, and the norm itself for its own input (a LayerNorm applied
    # straight to a parameter: SEW-D's relative position table)
    centered_names = {use_alias(captured, need.node, user) for norm in foldable for need in norm.zero_mean_graph
                      if captured.centerable_fqn(need.node) is not None
                      for user in _with_readers_in_sums(parents.get(need, set()), need.node)
                      | {call.node for call in norm.calls if call.x is need.node}}
    center, untie, untied = [], [], []
    for canonical, (dim, group, groups) in sorted(by_tensor.items()):
        names = captured.aliases.get(canonical, (canonical,))
        kept = [n for n in names if n in centered_names]
        if not kept:  # no use of it to center was recorded (an internal inconsistency: refuse rather than guess)
            raise FoldError(f"norm {norm_of[canonical]}: planning the centering step: no use of parameter "
                            f"{canonical} inside its zero-mean graph was found, so it cannot be centered")
        center.append(CenterStep(kept[0], dim, group) if groups is None
                      else CenterGroupsStep(kept[0], dim, group, tuple(sorted(groups))))
        for other in names:
            if other not in centered_names:
                path, _, attr = other.rpartition(".")
                untie.append(UntieStep(path, attr, kept[0]))
                untied.append(f"{other} (copy of {kept[0]})")
    return center, untie, untied


# --------------------------------------------------------------------------- several example calls

def analyze_calls(model: nn.Module, captures: list[Captured], constraints: PlanConstraints = PlanConstraints()
                  ) -> tuple[list[NormEntry], FoldPlan, list[str]]:
    """``analyze_captured`` for several traced calls of one model: fold only what is exact for all.

    Each call is analysed; a norm that is not foldable (or not run) in some call, or folds there by
    centering other tensors, is kept in every call, and γ/β whose fold steps differ between calls
    stay; the calls are re-analysed with those restrictions (which may drop more norms through
    closedness) until all agree. Then every call's plan is the same, up to which tied names must be
    untied: those are merged.
    """
    _check_keep_patterns(model, captures, constraints.keep)
    kept: dict[str, str] = {}
    affine_kept: dict[str, str] = {}
    while True:
        results = [analyze_captured(model, c, constraints, kept=kept, affine_kept=affine_kept)
                   for c in captures]
        if not _restrict_to_agreement(results, kept, affine_kept):
            break
    entries, plan, untied = results[0]
    known = {e.path for e in entries}
    for other_entries, other_plan, other_untied in results[1:]:
        entries += [e for e in other_entries if e.path not in known]
        known |= {e.path for e in other_entries}
        plan.untie += [u for u in other_plan.untie if u not in plan.untie]
        plan.layer_scale += [s for s in other_plan.layer_scale if s not in plan.layer_scale]
        untied += [u for u in other_untied if u not in untied]
    return entries, plan, untied


def _check_keep_patterns(model: nn.Module, captures: list[Captured], patterns: tuple[str, ...]) -> None:
    """KeepPatternError for a pattern that matches no norm the calls run (a typo would keep nothing)."""
    if not patterns:
        return
    paths = list(dict.fromkeys(norm.path for c in captures for norm in _find_norms(model, c)))
    for pattern in patterns:
        if not any(fnmatchcase(path, pattern) for path in paths):
            shown = ", ".join(paths[:5]) + (f", ... ({len(paths)} in all)" if len(paths) > 5 else "")
            raise KeepPatternError(f"keep pattern {pattern!r} matches no norm of {type(model).__name__}; its norms: "
                                   f"{shown or 'none'} (fnmatch on module paths, e.g. 'encoder.layer.*.output.LayerNorm')")


def _restrict_to_agreement(results, kept: dict[str, str], affine_kept: dict[str, str]) -> bool:
    """Add to ``kept`` / ``affine_kept`` every norm on which the calls' analyses disagree; True if any."""
    per_call = [({e.path: e for e in entries}, plan) for entries, plan, _ in results]
    paths = list(dict.fromkeys(e.path for entries, _, _ in results for e in entries))
    grown = False
    for path in paths:
        if path not in kept:
            why = _fold_disagreement(path, per_call)
            if why is not None:
                kept[path], grown = why, True
        if path not in affine_kept:
            steps = [[a for a in plan.affine_fold if a.norm_path == path] for _, plan in per_call]
            j = next((j for j, s in enumerate(steps) if s != steps[0]), None)
            if j is not None:
                affine_kept[path], grown = (f"its γ/β fold into different layers (or none) in example call {j} "
                                            "than in call 0"), True
    centers = [set(plan.center) | set(plan.center_groups) for _, plan in per_call]
    if not grown and any(c != centers[0] for c in centers):  # not traced to one norm: keep them all
        for path in paths:
            if path not in kept and any(by_path.get(path) is not None and by_path[path].foldable
                                        for by_path, _ in per_call):
                kept[path], grown = "kept: the example calls need different tensors centered", True
    return grown


def _fold_disagreement(path: str, per_call) -> str | None:
    """Why ``path`` cannot fold for every call (naming the call), or None when all calls agree."""
    entries = [by_path.get(path) for by_path, _ in per_call]
    if not any(e is not None and e.foldable for e in entries):
        return None
    for j, entry in enumerate(entries):
        if entry is None:
            return f"kept: example call {j} does not run it (the fold is proved for calls that run it)"
        if not entry.foldable:
            return f"kept: not foldable in example call {j}: {entry.reason}"

    def how(entry, plan):  # what folding this norm does to the weights in one call
        centered = {c for c in (*plan.center, *plan.center_groups) if c.fqn in entry.producers}
        return entry.producers, centered, [p for p in plan.precompute if p.norm_path == path]

    first = how(entries[0], per_call[0][1])
    for j, (entry, (_, plan)) in enumerate(zip(entries, per_call)):
        if how(entry, plan) != first:
            return (f"kept: folds differently in example call {j} than in call 0 (centered "
                    f"{sorted(entry.producers)} vs {sorted(entries[0].producers)}, or precomputed in only one)")
    return None
