"""The fold, written once: plan → apply → prove. ``normfold.fold``, the Hugging Face folder fold and
the streaming fold of sharded checkpoints all run these functions.

    report = plan_fold(model, calls, config)             # FoldReport; model untouched
    folded = apply_fold(model, report.plan)              # a new model
    report.verification = prove_fold(model, folded, calls, report.plan)   # float64, FOLD_TOLERANCE

:func:`fold_step` runs the three as the registered step of a :class:`~normfold.engine.plan.FoldConfig`
(``normfold.engine.steps``: the runner raises ``FoldVerificationError`` when the proof fails);
applying refuses a plan that overflows the model's dtype (``FoldError`` naming the tensor), and the
proof judges the returned model in its own dtype besides the float64 transform. What a caller's
checkpoint can load (no new parameters outside its keys, every module kept) is part of the
``FoldConfig`` given to the planning, never an edit of the plan afterwards.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from .analysis import analyze_calls
from .batchnorm import has_batchnorms, plan_batchnorms
from .errors import FoldError, failures_as_fold_error, model_name
from .._text import first_line
from .graph import check_model_and_inputs, describe_call, split_example_inputs
from .norm_forms import recognized_rms_norms, without_downcasts
from .plan import (AffineFoldStep, BatchNormFoldStep, CenterGroupsStep, CenterStep, FoldConfig, FoldPlan, LayerScaleStep,
                   PrecomputeStep)
from .report import FoldReport, NormEntry, VerifyResult
from .steps import StepContext
from .submodules import CapturedCalls, capture_calls
from . import transform  # looked up at call time: tests substitute a broken apply_plan
from .verify import FOLD_TOLERANCE, cast_copy, float_dtype, cast_floats, dtype_name, verify


def plan_fold(model: nn.Module, example_inputs, constraints: FoldConfig = FoldConfig()) -> FoldReport:
    """The report and the whole plan (BatchNorm merges first): the model is untouched.

    BatchNorms merge first, so a Linear → BatchNorm → LayerNorm chain is analysed as the
    Linear → LayerNorm it becomes (on a copy with the merges applied).
    """
    return plan_calls(model, check_model_and_inputs(model, example_inputs), constraints)  # the user's errors first


def plan_calls(model: nn.Module, calls: list, constraints: FoldConfig) -> FoldReport:
    """:func:`plan_fold` of calls already checked (``check_model_and_inputs``)."""
    return plan_and_capture(model, calls, constraints)[0]


def plan_and_capture(model: nn.Module, calls: list, constraints: FoldConfig) -> tuple[FoldReport, CapturedCalls]:
    """:func:`plan_calls` and the graphs the plan was read from (of the model the plan applies to)."""
    with failures_as_fold_error(model_name(model), "planning (capture and analysis)"):
        return _plan(model, calls, constraints)


def _plan(model: nn.Module, calls: list, constraints: FoldConfig) -> tuple[FoldReport, CapturedCalls]:
    captured = capture_calls(model, calls)
    bn_steps, bn_entries = [], []
    if constraints.fold_batchnorm and has_batchnorms(model):
        bn_steps, bn_entries = plan_batchnorms(model, captured.graphs, constraints)
    base = model
    if bn_steps:  # analysed with the BatchNorms gone: an identity BatchNorm kept for a loader computes the same
        merged = FoldPlan(batchnorm=[_dropping_module(s) for s in bn_steps])
        base = transform.apply_plan(copy.deepcopy(model), merged)
        captured = capture_calls(base, calls)
    recognized = recognized_rms_norms(base, captured.graphs)
    if recognized.swaps:  # RMSNorms written out as ops: analysed as the normfold RMSNorms they become
        base = transform.apply_plan(base if bn_steps else copy.deepcopy(model), FoldPlan(swap=list(recognized.swaps)))
        captured = capture_calls(base, calls)
    entries, plan, untied = analyze_calls(base, captured.graphs, constraints)
    entries += [NormEntry(path, kind, False, False, _UNCAPTURED) for path, kind in captured.uncaptured_norms]
    entries = _with_recognized(entries, recognized.reasons)
    replaced = {step.path for step in plan.swap}  # a later swap of the same norm (its γ folded) replaces the first
    plan = replace(plan, batchnorm=bn_steps, swap=[s for s in recognized.swaps if s.path not in replaced] + plan.swap)
    return FoldReport(entries, plan, untied, batchnorms=bn_entries,
                      traced_calls=[describe_call(model, *split_example_inputs(call)) for call in calls],
                      constraints=constraints, captured_through=list(captured.submodules),
                      whole_model_capture_error=captured.whole_model_error), captured


_UNCAPTURED = "kept: outside every submodule torch.export could capture (the whole model it could not)"


def _with_recognized(entries: list[NormEntry], reasons: dict[str, str]) -> list[NormEntry]:
    """The analysis' entries with what was recognised in each RMSNorm written out as ops, and an entry
    for each module named like an RMSNorm that was kept (with why)."""
    known = {e.path for e in entries}
    kept = [NormEntry(path, "RMSNorm", False, False, reason) for path, reason in reasons.items() if path not in known]
    return [replace(e, reason=f"{reasons[e.path]}; {e.reason}") if e.path in reasons else e for e in entries] + kept


def _dropping_module(step):
    return replace(step, keep_module=False)


def apply_fold(model: nn.Module, plan: FoldPlan) -> nn.Module:
    """A copy of ``model`` with ``plan`` applied (the original is untouched); ``FoldError`` naming the
    tensor when the plan, carried out in the model's dtype, overflows it (:func:`refuse_overflow`)."""
    with failures_as_fold_error(model_name(model), "applying the plan"):
        folded = transform.apply_plan(copy.deepcopy(model), plan)
    refuse_overflow(model, folded, plan)
    return folded


def refuse_overflow(model: nn.Module, folded: nn.Module, plan: FoldPlan) -> None:
    """``FoldError`` when a floating parameter or buffer of ``folded`` holds inf/nan where ``model``'s
    tensor of that name is finite (a tensor the plan created: where every tensor its steps read is),
    naming the tensor, the steps that wrote it, its largest value in float64 and what to do instead:
    a model stored in float16 cannot hold γ·W beyond 65504."""
    before = dict(_floating_tensors(model))
    for name, tensor in _floating_tensors(folded):
        broken = ~torch.isfinite(tensor)
        if not broken.any():
            continue
        old = before.get(name)
        if old is not None and old.shape == tensor.shape:
            if not (broken & torch.isfinite(old)).any():
                continue  # inf/nan the original already held there
        elif not all(torch.isfinite(before[source]).all() for step in _steps_writing(plan, name)
                     for source in _step_reads(step) if source in before):
            continue
        raise FoldError(f"{model_name(model)}: {_overflow_message(model, plan, name, tensor.dtype)}")


def _overflow_message(model: nn.Module, plan: FoldPlan, name: str, dtype: torch.dtype) -> str:
    """``<name> overflows <dtype> after <the steps> (max |value| <in float64> > <finfo.max>): <what to do>``."""
    exact = dict(_floating_tensors(transform.apply_plan(copy.deepcopy(model).double(), plan)))
    largest = exact[name].abs().max().item() if name in exact else float("nan")
    steps = _steps_writing(plan, name)
    done = " and ".join(_WRITES[type(step)][1](step) for step in steps) or "applying the plan"
    options = sorted({_WRITES[type(step)][2] for step in steps} - {None})
    instead = "fold in float32 (model.float())" + "".join(f" or with {option}=False" for option in options)
    return (f"{name} overflows {dtype_name(dtype)} after {done} (max |value| {largest:.3g} > "
            f"{torch.finfo(dtype).max:g}): {instead}")


def _floating_tensors(model: nn.Module):
    """(name, tensor) of every floating parameter and buffer, tied names included."""
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        if t.is_floating_point():
            yield name, t.detach()


def _steps_writing(plan: FoldPlan, name: str) -> list:
    """The plan's steps that write the tensor ``name``."""
    return [step for section in (plan.batchnorm, plan.layer_scale, plan.precompute, plan.center, plan.center_groups,
                                 plan.affine_fold)
            for step in section if name in (getattr(step, field) for field in _WRITES[type(step)][0])]


def _step_reads(step) -> list[str]:
    """The tensors a plan step reads: every field naming one."""
    return [value for key, value in vars(step).items()
            if (key == "fqn" or key.endswith("_fqn")) and isinstance(value, str)]


_WRITES = {  # step type -> (the fields naming what it writes, what it did to such a tensor, the option that stops it)
    BatchNormFoldStep: (("weight_fqn", "bias_fqn"), lambda s: f"merging the BatchNorm {s.norm_path} into it",
                        "fold_batchnorm"),
    LayerScaleStep: (("weight_fqn", "bias_fqn"), lambda s: f"merging the layer scale {s.scale_fqn} into it", None),
    PrecomputeStep: (("table_fqn",), lambda s: f"baking {s.norm_path} into its rows", "precompute"),
    CenterStep: (("fqn",), lambda s: "centering it", None),
    CenterGroupsStep: (("fqn",), lambda s: f"centering {len(s.groups)} groups of it", None),
    AffineFoldStep: (("weight_fqn", "bias_fqn"), lambda s: f"folding {s.norm_path}'s γ/β into it", "fold_affine"),
}


def prove_fold(model: nn.Module, folded: nn.Module, example_inputs, plan: FoldPlan) -> VerifyResult:
    """Compare ``folded`` with ``model`` in float64 on every example call, the float64 side being the
    plan applied to verify's float64 copy of ``model`` once that copy's outputs are recorded (so the
    transform is judged, not its rounding to the model's dtype, with one float64 copy of the model);
    and ``folded`` itself, the model returned, in its own dtype against the original
    (``judge_model_dtype``: the measured tolerance, no inf/nan where the original is finite)."""
    return verify(model, folded, example_inputs, tolerance=FOLD_TOLERANCE, rms_norm_paths=rms_norm_paths(plan),
                  exact_transform=lambda exact: transform.apply_plan(exact, plan), judge_model_dtype=True,
                  reference_transform=float64_reference(plan))


def float64_reference(plan: FoldPlan):
    """What a float64 proof runs the original as: its norms that become RMSNorms run their own code
    without casting float64 down (``norm_forms.without_downcasts``: an RMSNorm written out in float32
    is compared as its math, not as float32 rounding)."""
    paths = rms_norm_paths(plan)
    return lambda reference: without_downcasts(reference, paths)


def fold_step(model: nn.Module, calls: list, config: FoldConfig, context: StepContext) -> tuple[nn.Module, FoldReport]:
    """The registered step of a :class:`FoldConfig` (first in a run: ``context`` holds nothing it
    reads): ``(folded copy, report)``, planned within
    ``config``, applied, and (``config.verify``) ``report.verification`` measured for the runner to
    prove: the float64 error within ``FOLD_TOLERANCE``, the returned model in its own dtype within its
    measured tolerance, the outputs comparable. ``FoldError`` for a model whose weights are not loaded.
    The graphs it planned from are left in ``context.captured`` for the next step (fusion's pairs)."""
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise FoldError("fold needs the model's weights, but some are on the meta device: load them first "
                        "(analyze works on a meta model; normfold.hf folds checkpoints shard by shard)")
    report, captured = plan_and_capture(model, calls, config)
    folded = apply_fold(model, report.plan)
    # the graphs describe the folded model's forwards unless a BatchNorm stays in it (an identity the graph lacks)
    context.captured = None if any(step.keep_module for step in report.plan.batchnorm) else captured
    if config.verify:
        try:
            report.verification = prove_fold(model, folded, calls, report.plan)
        except FoldError as err:
            if not report.plan.affine_fold:
                raise
            report, context.captured = _plan_keeping_affine(model, calls, config, report, err)
            folded = apply_fold(model, report.plan)
            report.verification = prove_fold(model, folded, calls, report.plan)  # fails again: raises
        if _float64_error_too_large(report.verification) and float_dtype(model) != torch.float64:
            replanned = _plan_in_float64(model, calls, config, report)
            if replanned is not None:  # a cast the model's own dtype hid: the narrower plan, proved again
                report, context.captured = replanned, None  # float64 graphs: not the folded model's forwards
                folded = apply_fold(model, report.plan)
                report.verification = prove_fold(model, folded, calls, report.plan)
    return folded, report


def _plan_keeping_affine(model: nn.Module, calls: list, config: FoldConfig, report: FoldReport,
                         err: FoldError) -> tuple[FoldReport, CapturedCalls]:
    """The plan with every γ/β kept in its norm, for a fold whose proof could not run with them moved out
    (``err``): a model whose own code reads a norm's weight (FunASR casts its features to
    ``layers[0].input_layernorm.weight.dtype``) fails on a weightless norm. The same norms fold; the
    graphs it was planned from for the next step."""
    replanned, captured = plan_and_capture(model, calls, replace(config, fold_affine=False))
    why = f"the fold with γ/β moved out did not run ({first_line(err, 200)})"
    moved = {e.path for e in report.norms if e.affine_folded}
    entries = [replace(e, reason=f"{e.reason}; affine kept: {why}", affine_kept=why) if e.path in moved else e
               for e in replanned.norms]
    return replace(replanned, norms=entries), captured


def _float64_error_too_large(result: VerifyResult) -> bool:
    return result.why is None and result.compared_in == "float64" and not result.max_rel_error <= result.tolerance


def _plan_in_float64(model: nn.Module, calls: list, config: FoldConfig, report: FoldReport) -> FoldReport | None:
    """The plan read from a float64 copy's trace, when it folds fewer norms than ``report``'s: there a cast
    the code fixes to a narrower dtype (``.float()`` in a float32 model, a no-op in its own trace) shows,
    and the rules keep the norms whose input passes through it (``rules/casts.py``); else None."""
    double = cast_copy(model, torch.float64)
    narrower, _ = plan_and_capture(double, [cast_floats(call, torch.float64) for call in calls], config)
    folds = {e.path for e in report.norms if e.foldable}
    if not {e.path for e in narrower.norms if e.foldable} < folds:
        return None
    note = "; seen in a float64 trace (the float64 proof of the plan read in the model's dtype failed)"
    entries = [replace(e, reason=e.reason + note) if e.path in folds and not e.foldable else e for e in narrower.norms]
    return replace(narrower, norms=entries, traced_calls=report.traced_calls)


def rms_norm_paths(plan: FoldPlan) -> list[str]:
    """The norms the plan turns into RMSNorms (their inputs must be zero-mean)."""
    return [s.path for s in plan.swap if s.to == "RMSNorm"]
