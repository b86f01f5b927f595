"""Fuse residual adds into the norms they feed: ``h = a + b; y = norm(h)`` becomes one kernel call.

    fused, report = fuse_residual_norms(folded_model, example_inputs)

normfold's ``rms_norm(a, residual=b)`` (and ``layer_norm``) returns ``(y, h)`` with ``h = a + b``:
one pass over the row instead of an add pass and a norm pass. The norms are normfold ``RMSNorm``s
(what ``normfold.fold`` made) and the LayerNorms it left (post-LN models such as BERT, where the
add feeds the norm directly). The add sits in the *parent's* forward
(``GPT2Block.forward``: ``hidden_states = attn_output + residual; ...; self.ln_2(hidden_states)``),
or in the forward of the module before it (the add ending block *i* feeds ``ln_1`` of block
*i + 1*), so the rewrite is done on those forwards, per module instance, keeping the user's classes:

1. **Candidates** (source, per class of a module that holds a norm): every statement
   ``NAME = A + B`` or ``NAME = (A + B).view(...)`` / ``.reshape(...)``, every call
   ``self.<norm>(NAME)`` and every call ``self.<norm>(A + B)``; small helpers the forward calls
   (BLOOM's ``dropout_add``) are written out first, so their adds count (``inline.py``).
2. **Probe** (one eager run on ``example_inputs``): instrumented forwards record, model-wide,
   which add's result each ``self.<norm>(NAME)`` call actually received: the result object itself
   or a contiguous view of all its rows (OPT flattens the sum to 2-D before its norm). Only observed
   pairs are fused, so a norm in an untaken branch (OPT's post-LN ``if``) never costs an extra
   norm. An inline ``self.<norm>(A + B)`` needs no probe: its add feeds the norm by construction.
3. **Rewrite**, in the same forward: a paired add becomes
   ``y_i, NAME = _add_norm(self.<norm>, A, B)`` and keeps ``(NAME, y_i, NAME's version)``; the norm
   call becomes ``_norm_from(kept, self.<norm>, NAME)``, which returns ``y_i`` (reshaped like its
   argument) only when the argument is that sum or a view of all its rows, not modified in place
   since, and otherwise runs the norm: a branch that reassigns, slices or scales ``NAME`` stays
   exact. An inline call becomes ``_norm_of_sum(self.<norm>, A, B)``. Across forwards: the add
   computes the other module's norm too and leaves what it keeps in a ``_Handoff``, which that
   module's norm call checks the same way.
4. **Exact wherever it runs**: torch.compile and inference tensors have no version counter to check.
   So a pair inside one forward is fused only when the forward's code proves the sum unmodified
   between the add and the norm (``mutation.py``: no in-place op, augmented or item assignment on
   it or an alias or view, no call it is passed to); otherwise that norm is skipped with the reason.
   A handoff is checked by the version counter alone: while compiling or in inference mode the add
   runs plain and the receiving norm runs as usual (the unfused model's computation).

Source is read from disk; a forward or helper whose file no longer compiles to the code that runs
(edited since import) is not rewritten (``inline.running_definition``).

The result is checked with ``normfold.verify`` in float64 (≤ 1e-9) before it is returned. The
generated forward is an instance attribute: ``torch.compile`` traces it, ``state_dict`` and
``save_pretrained`` are unchanged, but ``torch.save(model)`` (pickling the module object) is not
supported, norm-module hooks are bypassed for fused calls, and Hugging Face's gradient-checkpointing
wrapper is dropped (fused models are for inference).
"""
from __future__ import annotations

import ast
import copy
import inspect
import types
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from .. import ops
from ..nn import RMSNorm
from .errors import FoldVerificationError
from .graph import eval_mode, split_example_inputs
from .inline import SOURCE_CHANGED, inline_helper_calls, is_docstring, running_definition
from .mutation import early_output_risk

_FLOAT64_TOLERANCE = 1e-9
_CHECKPOINT_WRAPPER = "forward_with_checkpointing"  # transformers' GradientCheckpointingLayer wrapper


@dataclass
class FusedPair:
    """One add in ``parent``'s forward fused into the call of its child norm ``norm``."""

    parent: str      # module path of the module whose forward was rewritten
    norm: str        # module path of the norm (RMSNorm or LayerNorm)
    add: str         # the source of the add ("hidden_states = attn_output + residual", "self.ln(h + x)")


@dataclass
class FuseReport:
    """What ``fuse_residual_norms`` fused, and for every other candidate norm why not."""

    fused: list[FusedPair] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)   # norm path -> reason
    verification: object | None = None                     # VerifyResult of the float64 check

    def to_dict(self) -> dict:
        ver = self.verification.to_dict() if self.verification is not None else None
        return {"fused": [asdict(p) for p in self.fused], "skipped": dict(self.skipped), "verification": ver}

    def __str__(self) -> str:
        lines = [f"fused {len(self.fused)} residual add(s) into norms, {len(self.skipped)} norm(s) left alone"]
        lines += [f"  fused   {p.norm}  <-  {p.add}" for p in self.fused]
        lines += [f"  skipped {path}: {why}" for path, why in self.skipped.items()]
        return "\n".join(lines)


def fuse_residual_norms(model: nn.Module, example_inputs, *, norm_paths=None, layer_norms: bool = True,
                        verify: bool = True, inplace: bool = False) -> tuple[nn.Module, FuseReport]:
    """Return ``(fused_model, report)``: residual adds feeding the model's norms run fused with them.

    ``norm_paths``: the norms to consider (default: every ``normfold.nn.RMSNorm`` in the model, e.g.
    the ones ``normfold.fold`` created, and with ``layer_norms=True`` every torch / normfold
    ``LayerNorm``: the ones folding left, which normfold's LayerNorm kernel then runs).
    ``example_inputs`` as for ``normfold.fold`` (a tuple of positional or a dict of keyword
    arguments); they drive the probe and the float64 check. With ``verify=True``,
    ``FoldVerificationError`` is raised if outputs differ by more than 1e-9.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = split_example_inputs(example_inputs)
    norms = _candidate_norms(model, norm_paths, layer_norms)
    fused = model if inplace else copy.deepcopy(model)
    report = FuseReport()
    by_parent: dict[str, list[str]] = {}
    for path in norms:
        parent_path, _, name = path.rpartition(".")
        reason = _norm_refusal(fused.get_submodule(path))
        if reason:
            report.skipped[path] = reason
        else:
            by_parent.setdefault(parent_path, []).append(name)

    # probe: instrumented forwards record which add result each norm call received, model-wide
    probe = _Probe()
    rewrites: dict[str, _Rewrite] = {}
    for parent_path, names in by_parent.items():
        parent = fused.get_submodule(parent_path)
        rewrite, reason = _Rewrite.parse(parent, names)
        if rewrite is None:
            for name in names:
                report.skipped[_join(parent_path, name)] = reason
            continue
        rewrites[parent_path] = rewrite
    # modules that hold no norm may end with the add a norm elsewhere takes (ViT's ViTOutput)
    norm_set, unread = set(norms), []   # unread: code left alone because its source changed on disk
    for path, module in fused.named_modules():
        if path not in by_parent and path not in norm_set and inspect.isfunction(type(module).forward):
            rewrite, reason = _Rewrite.parse(module, [])
            if rewrite is not None and rewrite.adds:
                rewrites[path] = rewrite
            elif SOURCE_CHANGED in reason:
                unread.append(reason)
    unread += [why for rewrite in rewrites.values() for why in rewrite.helpers_refused.values()]
    for parent_path, rewrite in rewrites.items():
        parent = fused.get_submodule(parent_path)
        parent.forward = types.MethodType(rewrite.probe_function(probe, parent_path), parent)
    try:
        with eval_mode(fused), torch.no_grad():
            fused(*args, **kwargs)
    finally:
        for parent_path in rewrites:
            del fused.get_submodule(parent_path).forward

    plans = {path: _FusePlan() for path in rewrites}
    for (add_parent, i), (call_parent, j) in probe.observed_pairs():
        if add_parent == call_parent:
            risk = rewrites[add_parent].early_output_risk(i, j)
            if risk:
                rewrites[add_parent].refused[rewrites[add_parent].calls[j].norm] = risk
            else:
                plans[add_parent].local.append((i, j))
        else:  # the add ends one module's forward, the norm starts another's (GPT-2: block i -> block i+1)
            handoff, norm_name = _Handoff(), rewrites[call_parent].calls[j].norm
            plans[add_parent].outgoing[i] = (handoff, fused.get_submodule(call_parent).get_submodule(norm_name))
            plans[call_parent].incoming[j] = handoff
            report.fused.append(FusedPair(add_parent, _join(call_parent, norm_name),
                                          rewrites[add_parent].adds[i].source))
    for parent_path, rewrite in rewrites.items():
        parent, plan = fused.get_submodule(parent_path), plans[parent_path]
        fused_norms = ({rewrite.calls[j].norm for _, j in plan.local} | {site.norm for site in rewrite.inline}
                       | {rewrite.calls[j].norm for j in plan.incoming})
        for name in by_parent.get(parent_path, []):
            if name not in fused_norms:
                report.skipped[_join(parent_path, name)] = rewrite.why_not(name, sorted(set(unread)))
        if plan.local or plan.outgoing or plan.incoming or rewrite.inline:
            parent.forward = types.MethodType(rewrite.fused_function(parent, plan), parent)
        report.fused += [FusedPair(parent_path, _join(parent_path, rewrite.calls[j].norm), rewrite.adds[i].source)
                         for i, j in plan.local]
        report.fused += [FusedPair(parent_path, _join(parent_path, site.norm), site.source)
                         for site in rewrite.inline]

    if verify:
        from .verify import verify as verify_models

        result = verify_models(model, fused, example_inputs, tolerance=_FLOAT64_TOLERANCE)
        report.verification = result
        if not result.ok:
            raise FoldVerificationError(
                f"fused model differs from the unfused one: float64 max relative error {result.max_rel_error:.3e} "
                f"> {_FLOAT64_TOLERANCE:.0e}\n{report}")
    return fused, report


# ------------------------------------------------------------------------------ runtime helpers

def _add_norm(norm: nn.Module, a, b):
    """``(norm(a + b), a + b)`` in one fused call; ``(None, a + b)`` when the operands do not fit it.

    Both operands contiguous: the fused op's sum is contiguous, ``a + b`` keeps ``a``'s layout, and
    later code (a ``.view``, or torch.compile's replay of one) may depend on that layout.
    """
    if (isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and a.dtype == b.dtype
            and a.device == b.device and a.dim() > 0 and a.shape[-1] == norm.normalized_shape[0]
            and a.is_contiguous() and b.is_contiguous()):
        # ops.* looked up at call time, so a profiler (normfold.bench) can label these calls
        if isinstance(norm, RMSNorm):
            return ops.rms_norm(a, norm.weight, norm.bias, norm.eps, residual=b, offset=norm.offset)
        return ops.layer_norm(a, norm.weight, norm.bias, norm.eps, residual=b)
    return None, a + b


def _norm_of_sum(norm: nn.Module, a, b):
    """``norm(a + b)`` for an inline ``self.<norm>(a + b)``: fused where the operands fit."""
    y, s = _add_norm(norm, a, b)
    return norm(s) if y is None else y


def _pending(h, y):
    """What a fused add leaves for its norm call: ``(h, y, h's version)``, or None when it did not fuse.

    The version counter (shared by every view of ``h``) tells whether ``h`` was modified in place
    since. It is None where it cannot be read: while torch.compile traces (Dynamo cannot guard on
    it) and for inference tensors (they have none). A pair inside one forward is fused only when
    the forward's code proves ``h`` unmodified (``mutation.py``), so there the identity test is
    enough; a handoff across forwards needs the version (``_Handoff``).
    """
    if y is None:
        return None
    return h, y, _version_of(h)


def _version_of(h: Tensor) -> int | None:
    """``h._version``, or None while compiling or for an inference tensor (no version counter)."""
    if torch.compiler.is_compiling() or h.is_inference():
        return None
    return h._version


def _norm_from(pending, norm: nn.Module, x):
    """The early output when ``x`` is the fused add's result, unmodified, else ``norm(x)``.

    ``x`` may be the result itself or a contiguous view of exactly its rows (OPT reshapes the
    residual stream to 2-D between the add and the norm: ``h.reshape(-1, h.size(-1))``); the norm
    acts on rows, so the early output reshaped the same way is ``norm(x)``.
    """
    if pending is not None:
        h, y, version = pending
        if (x is h or _same_rows(x, h)) and (version is None or torch.compiler.is_compiling()
                                              or x._version == version):
            return y if y.shape == x.shape else y.reshape(x.shape)  # the sum may have been viewed
    return norm(x)


def _same_rows(x, h) -> bool:
    """True when ``x`` and ``h`` are contiguous views of all of one tensor's memory, rows of one length.

    Covering the whole base (instead of comparing storage offsets, which torch.compile cannot trace)
    makes the two the same memory in the same row-major order.
    """
    if not isinstance(x, Tensor) or not isinstance(h, Tensor) or x._base is None:
        return False
    base = h if h._base is None else h._base
    return (x._base is base and x.numel() == h.numel() == base.numel() and x.dim() > 0 and h.dim() > 0
            and x.shape[-1] == h.shape[-1] and x.is_contiguous() and h.is_contiguous() and base.is_contiguous())


class _Handoff:
    """A norm's output computed early, by the fused add at the end of another module's forward.

    The add's module calls ``add(norm, a, b)``; the norm's module calls ``norm(module, x)``, which
    returns the early output only when ``x`` is that sum (or a view of its rows) and its version
    counter shows it unmodified since: the caller's code between the two forwards is not analysed,
    so the version is the proof. Where there is none (torch.compile, inference mode) the add runs
    alone and the norm runs as usual, which is exactly the unfused model; any other path, and a
    model reused after an exception, stays exact too.
    """

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = None

    def add(self, norm: nn.Module, a, b):
        """``a + b``, with ``norm(a + b)`` kept for the receiving call when it can be checked there."""
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            self.pending = None
            return a + b
        y, h = _add_norm(norm, a, b)
        pending = _pending(h, y)
        self.pending = pending if pending is not None and pending[2] is not None else None
        return h

    def norm(self, module: nn.Module, x):
        pending, self.pending = self.pending, None
        if torch.compiler.is_compiling():  # an early output left by eager code cannot be checked here
            return module(x)
        return _norm_from(pending, module, x)


@dataclass
class _FusePlan:
    """What one parent's fused forward does: pairs inside it, adds handed on, norms handed to."""

    local: list[tuple[int, int]] = field(default_factory=list)           # (add index, call index)
    outgoing: dict[int, tuple[_Handoff, nn.Module]] = field(default_factory=dict)   # add index -> (handoff, norm)
    incoming: dict[int, _Handoff] = field(default_factory=dict)          # call index -> handoff


class _Probe:
    """Model-wide record, during the probe run, of which add's result each norm call received."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], object] = {}   # (parent path, add index) -> its latest result
        self.pairs: list[tuple[tuple[str, int], tuple[str, int]]] = []

    def saw(self, parent: str, add_index: int, value) -> None:
        self.seen[(parent, add_index)] = value

    def note(self, parent: str, call_index: int, value):
        for add, result in self.seen.items():
            pair = (add, (parent, call_index))
            if (result is value or _same_rows(value, result)) and pair not in self.pairs:
                self.pairs.append(pair)
        return value

    def observed_pairs(self) -> list[tuple[tuple[str, int], tuple[str, int]]]:
        """((parent, add index), (parent, call index)) pairs; an add or a call joins one pair at most (first seen)."""
        used_adds, used_calls, pairs = set(), set(), []
        for add, call in self.pairs:
            if add not in used_adds and call not in used_calls:
                pairs.append((add, call))
                used_adds.add(add)
                used_calls.add(call)
        return pairs


# ------------------------------------------------------------------------------ source rewriting

@dataclass
class _AddSite:
    node: ast.Assign   # NAME = A + B, or NAME = (A + B).view(...) / .reshape(...)
    target: str
    source: str


@dataclass
class _CallSite:
    node: ast.Call
    norm: str        # child attribute name
    arg: str         # the variable passed


@dataclass
class _InlineSite:
    node: ast.Call   # self.<norm>(A + B)
    norm: str
    source: str


class _Rewrite:
    """The parsed forward of one parent module and the functions generated from it."""

    def __init__(self, function, tree: ast.FunctionDef, adds: list[_AddSite], calls: list[_CallSite],
                 inline: list[_InlineSite], self_name: str) -> None:
        self.function, self.tree, self.adds, self.calls, self.self_name = function, tree, adds, calls, self_name
        self.inline = inline
        self.wrappers: list = []  # decorators around the forward, outermost first
        self.norm_names: frozenset[str] = frozenset()   # the candidate norms among self's children
        self.refused: dict[str, str] = {}               # norm -> why its observed pair was not fused
        self.helpers_refused: dict[str, str] = {}       # helper -> why it was not inlined (source mismatch)

    @classmethod
    def parse(cls, parent: nn.Module, norm_names: list[str]) -> tuple["_Rewrite | None", str]:
        function = type(parent).forward
        if "forward" in vars(parent):
            return None, "its parent's forward is already replaced on the instance"
        wrappers = []
        while hasattr(function, "__wrapped__"):  # decorators (functools.wraps) are kept: see _rewrap
            if not _holds(function, function.__wrapped__):
                return None, f"its parent's forward is wrapped by a decorator ({function.__code__.co_name}) " \
                             "that does not hold the function it wraps"
            wrappers.append(function)
            function = function.__wrapped__
        if function.__code__.co_freevars:
            return None, (f"its parent's forward ({function.__qualname__}) uses closure variables "
                          f"{list(function.__code__.co_freevars)} (e.g. super())")
        tree, mismatch = running_definition(function)
        if tree is None:
            return None, mismatch
        if not tree.args.args:
            return None, f"{function.__qualname__} is not a plain method"
        tree.decorator_list = []
        self_name = tree.args.args[0].arg
        helpers_refused: dict[str, str] = {}
        from_helpers = inline_helper_calls(tree, function.__globals__, _add_in, helpers_refused)  # BLOOM's dropout_add
        adds, calls, inline = [], [], []
        for node in _walk_body(tree):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and _add_in(node.value) is not None):
                adds.append(_AddSite(node, node.targets[0].id, from_helpers.get(id(node), ast.unparse(node))))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == self_name
                    and node.func.attr in norm_names and len(node.args) == 1 and not node.keywords):
                if isinstance(node.args[0], ast.Name):
                    calls.append(_CallSite(node, node.func.attr, node.args[0].id))
                elif _is_add(node.args[0]):
                    inline.append(_InlineSite(node, node.func.attr, ast.unparse(node)))
        if not adds and not calls and not inline:
            return None, (f"{function.__qualname__} has no `name = a + b` (or `(a + b).view(...)`) statement and "
                          "never calls the norm as self.<norm>(name) or self.<norm>(a + b)")
        rewrite = cls(function, tree, adds, calls, inline, self_name)
        rewrite.wrappers, rewrite.norm_names = wrappers, frozenset(norm_names)
        rewrite.helpers_refused = helpers_refused
        return rewrite, ""

    def early_output_risk(self, add_index: int, call_index: int) -> str:
        """Why the pair's early output may be stale at the call ('' when the code proves it never is)."""
        return early_output_risk(self.tree, self.adds[add_index].node, self.calls[call_index].node,
                                 self.self_name, self.norm_names)

    def why_not(self, norm: str, unread: list[str]) -> str:
        """Why ``norm`` was not fused; ``unread``: code not rewritten because its source changed on disk."""
        if norm in self.refused:
            return self.refused[norm]
        if not any(c.norm == norm for c in self.calls):
            return f"{self.function.__qualname__} never calls it as self.{norm}(name) or self.{norm}(a + b)"
        return ("no `name = a + b` result reaches it unchanged on the example inputs (its input is scaled or "
                "copied after the add, or added by a function that cannot be inlined)"
                + "".join(f"; not rewritten: {why}" for why in unread))

    # the two generated functions -------------------------------------------------------------
    def probe_function(self, probe: _Probe, key: str):
        """The forward with ``probe.saw(key, i, NAME)`` after each add, ``probe.note(key, j, NAME)`` per norm call."""
        tree = copy.deepcopy(self.tree)
        adds = {id(a.node): i for i, a in enumerate(self.adds)}
        calls = {id(c.node): j for j, c in enumerate(self.calls)}
        mapping = {id(new): id(old) for new, old in zip(_walk_body(tree), list(_walk_body(self.tree)))}

        class Instrument(ast.NodeTransformer):
            def visit_Assign(self, node):
                self.generic_visit(node)
                i = adds.get(mapping.get(id(node), -1))
                if i is None:
                    return node
                record = ast.parse(f"_nf_probe.saw(_nf_key, {i}, {node.targets[0].id})").body[0]
                return [node, record]

            def visit_Call(self, node):
                j = calls.get(mapping.get(id(node), -1))
                self.generic_visit(node)
                if j is None:
                    return node
                arg = node.args[0].id
                node.args[0] = ast.parse(f"_nf_probe.note(_nf_key, {j}, {arg})", mode="eval").body
                return node

        tree = Instrument().visit(tree)
        return self._compile(tree, {"_nf_probe": probe, "_nf_key": key})

    def fused_function(self, parent: nn.Module, plan: _FusePlan):
        """The forward with each paired add fused into its norm call (guarded: see ``_norm_from``).

        Handed-on adds reach their norm and handoff through attributes of the instance
        (``self._nf_targets``, ``self._nf_handoffs``), not closure cells, so ``copy.deepcopy`` of the
        model gives the copy's forward the copy's norms.
        """
        tree = copy.deepcopy(self.tree)
        mapping = {id(new): id(old) for new, old in zip(_walk_body(tree), list(_walk_body(self.tree)))}
        pairs = plan.local
        add_pair = {id(self.adds[i].node): i for i, _ in pairs}
        call_pair = {id(self.calls[j].node): i for i, j in pairs}  # observed_pairs: one add per call
        assert len(call_pair) == len(pairs)
        self_name = self.self_name
        call_norm = {i: self.calls[j].norm for i, j in pairs}
        inline = {id(site.node) for site in self.inline}
        outgoing = {id(self.adds[i].node): (k, i) for k, i in enumerate(plan.outgoing)}
        incoming = {id(self.calls[j].node): k for k, j in enumerate(plan.incoming)}
        parent.__dict__["_nf_targets"] = [norm for _, norm in plan.outgoing.values()]  # plain attributes:
        parent.__dict__["_nf_handoffs"] = [h for h, _ in plan.outgoing.values()]       # not submodules
        parent.__dict__["_nf_handoffs_in"] = list(plan.incoming.values())

        class Fuse(ast.NodeTransformer):
            def visit_Assign(self, node):
                original = mapping.get(id(node), -1)
                i = add_pair.get(original)
                self.generic_visit(node)
                if i is None and original not in outgoing:
                    return node
                name, add = node.targets[0].id, _add_in(node.value)
                operands = f"({ast.unparse(add.left)}), ({ast.unparse(add.right)})"
                sum_name = name if add is node.value else f"_nf_s{i if i is not None else outgoing[original][1]}"
                if i is None:  # handed on to a norm in another module's forward
                    k, i = outgoing[original]
                    code = f"{sum_name} = {self_name}._nf_handoffs[{k}].add({self_name}._nf_targets[{k}], {operands})"
                    keep = ""
                else:
                    code = f"_nf_y{i}, {sum_name} = _nf_add_norm({self_name}.{call_norm[i]}, {operands})"
                    keep = f"\n_nf_p{i} = _nf_pending({name}, _nf_y{i})"
                if add is not node.value:  # NAME = (A + B).view(...): the view is taken of the sum
                    node.value.func.value = ast.Name(sum_name, ast.Load())
                    code += f"\n{name} = {ast.unparse(node.value)}"
                return ast.parse(code + keep).body

            def visit_Call(self, node):
                original = mapping.get(id(node), -1)
                i = call_pair.get(original)
                self.generic_visit(node)
                if original in inline:
                    add = node.args[0]
                    return ast.parse(f"_nf_norm_of_sum({ast.unparse(node.func)}, ({ast.unparse(add.left)}), "
                                     f"({ast.unparse(add.right)}))", mode="eval").body
                if original in incoming:
                    return ast.parse(f"{self_name}._nf_handoffs_in[{incoming[original]}].norm("
                                     f"{ast.unparse(node.func)}, {node.args[0].id})", mode="eval").body
                if i is None:
                    return node
                return ast.parse(f"_nf_norm_from(_nf_p{i}, {ast.unparse(node.func)}, {node.args[0].id})",
                                 mode="eval").body

        tree = Fuse().visit(tree)
        init = "\n".join(f"_nf_p{i} = None" for i, _ in pairs)
        start = _first_statement(tree)
        tree.body[start:start] = ast.parse(init).body
        return self._compile(tree, {"_nf_add_norm": _add_norm, "_nf_norm_of_sum": _norm_of_sum,
                                    "_nf_pending": _pending, "_nf_norm_from": _norm_from})

    def _compile(self, tree: ast.FunctionDef, helpers: dict):
        """Compile ``tree`` in the original module's globals; ``helpers`` reach it as closure variables.

        The globals dict is the module's own (not a copy), so torch.compile's guards on globals
        resolve; the helpers live in a factory's closure instead of being added to that module.
        """
        tree.name = self.function.__name__
        factory = ast.FunctionDef(name="_nf_factory", args=ast.arguments(
            posonlyargs=[], args=[ast.arg(arg=name) for name in helpers], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=[tree, ast.Return(ast.Name(tree.name, ast.Load()))], decorator_list=[], returns=None, type_params=[])
        module = ast.fix_missing_locations(ast.Module(body=[factory], type_ignores=[]))
        namespace: dict = {}
        code = compile(module, f"<normfold fused {self.function.__qualname__}>", "exec")
        exec(code, self.function.__globals__, namespace)  # noqa: S102 (generated from the model's own source)
        new = namespace["_nf_factory"](*helpers.values())
        new.__defaults__, new.__kwdefaults__ = self.function.__defaults__, self.function.__kwdefaults__
        new.__qualname__ = self.function.__qualname__
        return _rewrap(self.wrappers, self.function, new)


def _holds(wrapper, inner) -> bool:
    """True when ``wrapper`` reaches ``inner`` through a closure cell (so a copy can hold another function)."""
    return any(_cell_value(c) is inner for c in wrapper.__closure__ or ())


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


def _rewrap(wrappers: list, original, new):
    """Copies of the decorator functions around ``original``, each holding the new inner function instead.

    A decorator made with ``functools.wraps`` (transformers' ``deprecate_kwarg``, its gradient
    checkpointing wrapper) keeps the wrapped function in a closure cell; the copy gets a fresh cell
    with the rewritten function in its place and otherwise runs the same code.
    """
    inner_old, inner_new = original, new
    for wrapper in reversed(wrappers):
        cells = tuple(types.CellType(inner_new) if _cell_value(c) is inner_old else c for c in wrapper.__closure__)
        copy_ = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, cells)
        copy_.__kwdefaults__ = wrapper.__kwdefaults__
        copy_.__dict__.update(wrapper.__dict__)
        copy_.__wrapped__ = inner_new
        inner_old, inner_new = wrapper, copy_
    return inner_new


def _is_add(node: ast.AST) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)


def _add_in(value: ast.AST) -> ast.BinOp | None:
    """The add of ``A + B`` or of ``(A + B).view(...)`` / ``.reshape(...)`` (OPT's layer end), else None."""
    if _is_add(value):
        return value
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ("view", "reshape")
            and _is_add(value.func.value)):
        return value.func.value
    return None


def _walk_body(tree: ast.FunctionDef):
    """Nodes of the function body in a fixed order, not entering nested functions, lambdas or classes."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _first_statement(tree: ast.FunctionDef) -> int:
    """Index after the docstring, where generated initialisations go."""
    return 1 if tree.body and is_docstring(tree.body[0]) else 0


# ------------------------------------------------------------------------------ which norms

def _candidate_norms(model: nn.Module, norm_paths, layer_norms: bool) -> list[str]:
    from ..nn import FusedAddRMSNorm, LayerNorm

    kinds = (RMSNorm, nn.LayerNorm, LayerNorm) if layer_norms else (RMSNorm,)
    found = [path for path, m in model.named_modules()
             if isinstance(m, kinds) and not isinstance(m, FusedAddRMSNorm) and path]
    if norm_paths is None:
        return found
    norm_paths = list(norm_paths)
    unknown = [p for p in norm_paths if p not in found]
    if unknown:
        kind = "normfold RMSNorm or LayerNorm" if layer_norms else "normfold RMSNorm"
        raise ValueError(f"norm_paths must name {kind} modules of the model; not found: {unknown} "
                         f"(present: {found})")
    return norm_paths


def _norm_refusal(norm: nn.Module) -> str:
    """Why a norm must not be fused ('' if it may)."""
    if norm._forward_hooks or norm._forward_pre_hooks:
        return "it has forward hooks, which a fused call would bypass"
    if len(norm.normalized_shape) != 1:
        return f"normalized_shape {tuple(norm.normalized_shape)} is not 1-D"
    return ""


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name
