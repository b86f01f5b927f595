"""Fuse residual adds into the norms they feed: ``h = a + b; y = norm(h)`` becomes one kernel call.

    fused, report = normfold.fuse_residual_norms(folded_model, example_inputs)

``ops.rms_norm(a, residual=b)`` (and ``layer_norm``) returns ``(norm(a + b), a + b)`` in one pass over
the row. The add sits in the forward of the norm's parent (``GPT2Block``: ``h = attn_output + residual;
...; self.ln_2(h)``) or at the end of the module before it (block *i*'s last add feeds block *i + 1*'s
``ln_1``), so those forwards are rewritten from their source, per module instance, keeping the classes:

1. **Parse** (``rewrite.py``): each forward's adds ``NAME = A + B`` (or ``(A + B).view(...)``) and norm
   calls ``self.<norm>(NAME)`` / ``self.<norm>(A + B)``; small helpers such as BLOOM's
   ``dropout_add`` are written out first (``inline.py``), and only source that is the code that
   runs is read (``inline.running_definition``, at the line numbers of that code).
2. **Pair** (``graph_pairs.py``): the first example call's ``torch.export`` graph shows which add's
   result (or a view of all its rows) each norm call receives; the add's ``stack_trace`` line, in
   the forward of the module that ran it (``nn_module_stack``), must be a parsed add statement, or
   the norm is skipped saying where its add is. The graph is the fold's when the fold ran just
   before (``StepContext.captured``: nothing is captured again), else captured here
   (``engine.graph.capture``); only where export cannot capture the whole model is the model run
   eagerly with instrumented forwards instead (``rewrite.Probe``). ``report.pairs_from`` says which
   ("graph" / "probe") and ``report.pairs_why`` why.
3. **Rewrite**: a paired add becomes ``add_norm`` and its norm call ``norm_from``, which returns the
   early output only when its argument is still that sum, and otherwise runs the norm
   (``runtime.py``). A pair inside one forward is fused only when the code proves the sum unmodified
   in between (``mutation.py``: torch.compile and inference tensors have no version counter); an add
   handed to another module's norm (``runtime.Handoff``) is checked by the version counter and runs
   unfused where there is none. A norm whose class has its own forward (a channels-first norm such
   as ``PermutedRMSNorm`` normalises another dim than the sum's last) is skipped.
4. **Verify**: the fused model is compared with the input model in float64 (≤ 1e-9), and as
   returned, in its own dtype, against the input model's own error there, on every example call,
   before it is returned; ``report.py`` lists what was fused and why every other norm was not.

Fusion is the step a :class:`FuseConfig` names (registered here with ``normfold.engine.steps``):
``normfold.convert(model, inputs, FuseConfig())`` fuses the folded model, and
:func:`fuse_residual_norms` is that step alone.

The generated forward is an instance attribute: ``torch.compile`` traces it and ``state_dict`` is
unchanged, but ``torch.save(model)`` (pickling the module) is not supported and Hugging Face's
gradient-checkpointing wrapper is dropped (fused models are for inference). A hook registered on a
fused norm afterwards (or a global module hook) runs: while there is one, the norm's calls take the
unfused path (``runtime.runs_hooks``).
"""
from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .._text import first_line
from ..engine.errors import FoldError
from ..engine.graph import Captured, capture, eval_mode, split_example_inputs
from ..engine.steps import StepContext, register_step, run_steps
from ..engine.verify import FOLD_TOLERANCE
from ..engine.verify import verify as verify_models
from ..nn import FusedAddRMSNorm, RMSNorm
from ..nn.kinds import LAYER_NORM_TYPES
from .graph_pairs import graph_pairs
from .inline import SOURCE_CHANGED
from .report import FusedPair, FuseReport
from .rewrite import ForwardRewrite, FusePlan, Probe
from .runtime import Handoff

__all__ = ["fuse_residual_norms", "FuseConfig", "FuseReport", "FusedPair"]


def _require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"FuseConfig.{name} must be a bool, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class FuseConfig:
    """Options of residual-add fusion (:func:`fuse_residual_norms`), inference only.

    ``norm_paths``: the norm modules to consider (default: every normfold RMSNorm, and with
    ``layer_norms`` every LayerNorm the fold kept). ``verify``: prove the fused model equal to the
    unfused one in float64 on every example call.
    """

    norm_paths: tuple[str, ...] | None = None
    layer_norms: bool = True
    verify: bool = True

    def __post_init__(self) -> None:
        if self.norm_paths is not None:
            if isinstance(self.norm_paths, str) or not isinstance(self.norm_paths, Iterable):
                raise TypeError(f"FuseConfig.norm_paths must be None or a sequence of module paths (str), "
                                f"got {type(self.norm_paths).__name__} {self.norm_paths!r}")
            paths = tuple(self.norm_paths)
            not_str = [p for p in paths if not isinstance(p, str)]
            if not_str:
                raise TypeError(f"FuseConfig.norm_paths must hold module paths (str), got {not_str!r}")
            if not paths:
                raise ValueError("FuseConfig.norm_paths must name at least one norm (None considers all of them), "
                                 "got an empty sequence")
            object.__setattr__(self, "norm_paths", paths)
        _require_bool("layer_norms", self.layer_norms)
        _require_bool("verify", self.verify)


def fuse_residual_norms(model: nn.Module, example_inputs, *, norm_paths=None, layer_norms: bool = True,
                        verify: bool = True) -> tuple[nn.Module, FuseReport]:
    """Return ``(fused_model, report)``: residual adds feeding the model's norms run fused with them.

    ``norm_paths``: the norms to consider (default: every ``normfold.nn.RMSNorm`` in the model, e.g.
    the ones ``normfold.fold`` created, and with ``layer_norms=True`` every torch / normfold
    ``LayerNorm``: the ones folding left, which normfold's LayerNorm kernel then runs).
    ``example_inputs`` as for ``normfold.fold`` (a tuple of positional or a dict of keyword
    arguments, or a list of such calls: the first call's graph gives the pairs, every one the float64 check).
    With ``verify=True``, ``FoldVerificationError`` is raised if outputs differ by more than 1e-9 in
    float64, or the fused model in its own dtype by more than the measured tolerance
    (``report.verification``). The step a :class:`FuseConfig` names, alone; ``model`` is untouched.
    """
    config = FuseConfig(norm_paths=norm_paths, layer_norms=layer_norms, verify=verify)
    fused, sections = run_steps(model, example_inputs, [config])
    return fused, sections[FuseConfig]


def fuse_step(model: nn.Module, calls: list, config: FuseConfig, context: StepContext) -> tuple[nn.Module, FuseReport]:
    """The registered step of a :class:`FuseConfig`: a fused copy of ``model`` (its pairs read from the
    first call's graph: the fold's when it ran just before, else captured here; probed eagerly where
    export cannot capture the model) and its report, with ``report.verification`` against ``model`` on
    every call for the runner to prove."""
    norms = _candidate_norms(model, config.norm_paths, config.layer_norms)
    fused = copy.deepcopy(model)
    report = FuseReport()
    by_parent: dict[str, list[str]] = {}
    for path in norms:
        parent_path, _, name = path.rpartition(".")
        reason = _norm_refusal(fused.get_submodule(path))
        if reason:
            report.skipped[path] = reason
        else:
            by_parent.setdefault(parent_path, []).append(name)

    rewrites: dict[str, ForwardRewrite] = {}
    for parent_path, names in by_parent.items():
        parent = fused.get_submodule(parent_path)
        rewrite, reason = ForwardRewrite.parse(parent, names)
        if rewrite is None:
            for name in names:
                report.skipped[_join(parent_path, name)] = reason
            continue
        rewrites[parent_path] = rewrite
    # modules that hold no norm may end with the add a norm elsewhere takes (ViT's ViTOutput)
    norm_set, unread = set(norms), []   # unread: code left alone because its source changed on disk
    for path, module in fused.named_modules():
        if path not in by_parent and path not in norm_set and inspect.isfunction(type(module).forward):
            rewrite, reason = ForwardRewrite.parse(module, [])
            if rewrite is not None and rewrite.adds:
                rewrites[path] = rewrite
            elif SOURCE_CHANGED in reason:
                unread.append(reason)
    unread += [why for rewrite in rewrites.values() for why in rewrite.helpers_refused.values()]

    graph, report.pairs_why = _first_graph(fused, calls, context)
    fed_by: dict[str, str] = {}   # norm path -> the add the graph shows feeding it, where it is no add site
    if graph is None:
        report.pairs_from, pairs = "probe", _probed_pairs(fused, rewrites, calls[0])
    else:
        found = graph_pairs(graph, rewrites, [_join(p, name) for p in rewrites for name in by_parent.get(p, [])])
        report.pairs_from, pairs, fed_by = "graph", found.pairs, found.unmatched

    plans = {path: FusePlan() for path in rewrites}
    for (add_parent, i), (call_parent, j) in pairs:
        if add_parent == call_parent:
            risk = rewrites[add_parent].early_output_risk(i, j)
            if risk:
                rewrites[add_parent].refused[rewrites[add_parent].calls[j].norm] = risk
            else:
                plans[add_parent].local.append((i, j))
        else:  # the add ends one module's forward, the norm starts another's (GPT-2: block i -> block i+1)
            handoff, norm_name = Handoff(), rewrites[call_parent].calls[j].norm
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
                path = _join(parent_path, name)
                report.skipped[path] = rewrite.why_not(name, sorted(set(unread)), fed_by.get(path, ""))
        if plan.local or plan.outgoing or plan.incoming or rewrite.inline:
            parent.forward = types.MethodType(rewrite.fused_function(parent, plan), parent)
        report.fused += [FusedPair(parent_path, _join(parent_path, rewrite.calls[j].norm), rewrite.adds[i].source)
                         for i, j in plan.local]
        report.fused += [FusedPair(parent_path, _join(parent_path, site.norm), site.source)
                         for site in rewrite.inline]

    if config.verify:
        # rms_norm_paths=[]: no watching hooks on the norms, which would send their calls down the unfused path
        report.verification = verify_models(model, fused, calls, tolerance=FOLD_TOLERANCE, rms_norm_paths=[],
                                            judge_model_dtype=True)
    return fused, report


def _first_graph(model: nn.Module, calls: list, context: StepContext) -> tuple[Captured | None, str]:
    """The first example call's graph and where it comes from: the fold's capture when the fold ran just
    before, else ``torch.export`` here; ``(None, why)`` where export cannot capture the whole model."""
    if context.captured is not None:
        if context.captured.submodules:
            return None, (f"the fold captured only submodules ({', '.join(context.captured.submodules)}): "
                          f"torch.export could not capture the whole model ({context.captured.whole_model_error})")
        return context.captured.graphs[0], "the fold's torch.export capture"
    try:
        return capture(model, calls[0]), "torch.export capture of the first example call"
    except FoldError as err:
        cause = err.__cause__ or err
        return None, f"torch.export could not capture the model: {type(cause).__name__}: {first_line(cause)}"


def _probed_pairs(fused: nn.Module, rewrites: dict[str, ForwardRewrite], call) -> list:
    """The pairs one eager run of ``call`` shows: instrumented forwards record which add result each norm
    call received, model-wide (``rewrite.Probe``)."""
    args, kwargs = split_example_inputs(call)
    probe = Probe()
    for parent_path, rewrite in rewrites.items():
        parent = fused.get_submodule(parent_path)
        parent.forward = types.MethodType(rewrite.probe_function(probe, parent_path), parent)
    try:
        with eval_mode(fused), torch.no_grad():
            fused(*args, **kwargs)
    finally:
        for parent_path in rewrites:
            del fused.get_submodule(parent_path).forward
    return probe.observed_pairs()


register_step(FuseConfig, fuse_step, section="fuse", section_type=FuseReport,
              proof="fused model differs from the unfused one")


# ------------------------------------------------------------------------------ which norms

def _candidate_norms(model: nn.Module, norm_paths, layer_norms: bool) -> list[str]:
    """The paths of the norms to consider: ``norm_paths`` checked against the model's, or all of them."""
    kinds = (RMSNorm, *LAYER_NORM_TYPES) if layer_norms else (RMSNorm,)  # not torch's RMSNorm: no offset, eps may be None
    found = [path for path, m in model.named_modules()  # a FusedAddRMSNorm is the fused call already
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
        return "it has forward hooks, which only an unfused call runs"
    if len(norm.normalized_shape) != 1:
        return f"normalized_shape {tuple(norm.normalized_shape)} is not 1-D"
    if type(norm).forward not in _LAST_DIM_FORWARDS:
        return (f"{type(norm).__qualname__} has its own forward (a channels-first norm, such as PermutedRMSNorm or "
                "ConvNeXt's, normalises another dim than the last), and the fused call computes the norm of the "
                "sum's last dim")
    return ""


# the forwards that a fused call (runtime.add_norm) computes: the norm of the input's last dim, nothing else
_LAST_DIM_FORWARDS = (RMSNorm.forward, *(t.forward for t in LAYER_NORM_TYPES))


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name
