"""The fold, written once: plan → apply → prove. ``normfold.fold``, the Hugging Face folder fold and
the streaming fold of sharded checkpoints all run these functions.

    report = plan_fold(model, calls, constraints)        # FoldReport; model untouched
    folded = apply_fold(model, report.plan)              # a new model
    report.verification = prove_fold(model, folded, calls, report.plan)   # float64, FOLD_TOLERANCE

:func:`fold_exactly` runs the three and raises ``FoldVerificationError`` (returning nothing) when
the proof fails. What a caller's checkpoint can load (no new parameters outside its keys, every
module kept) is a :class:`~normfold.fold.plan.PlanConstraints` given to the planning, never an
edit of the plan afterwards.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from .analysis import analyze_calls
from .batchnorm import has_batchnorms, plan_batchnorms
from .errors import FoldVerificationError, failures_as_fold_error, model_name
from .graph import capture, check_model_and_inputs, describe_call, split_example_inputs
from .plan import FoldPlan, PlanConstraints
from .report import FoldReport, VerifyResult
from . import transform  # looked up at call time: tests substitute a broken apply_plan
from .verify import FOLD_TOLERANCE, verify


def plan_fold(model: nn.Module, example_inputs, constraints: PlanConstraints = PlanConstraints()) -> FoldReport:
    """The report and the whole plan (BatchNorm merges first): the model is untouched.

    BatchNorms merge first, so a Linear → BatchNorm → LayerNorm chain is analysed as the
    Linear → LayerNorm it becomes (on a copy with the merges applied).
    """
    calls = check_model_and_inputs(model, example_inputs)  # the user's errors first, as TypeError/ValueError
    with failures_as_fold_error(model_name(model), "planning (capture and analysis)"):
        return _plan(model, calls, constraints)


def _plan(model: nn.Module, calls: list, constraints: PlanConstraints) -> FoldReport:
    bn_steps, bn_entries = [], []
    if constraints.fold_batchnorm and has_batchnorms(model):
        bn_steps, bn_entries = plan_batchnorms(model, [capture(model, call) for call in calls], constraints)
    base = model
    if bn_steps:  # analysed with the BatchNorms gone: an identity BatchNorm kept for a loader computes the same
        merged = FoldPlan(batchnorm=[_dropping_module(s) for s in bn_steps])
        base = transform.apply_plan(copy.deepcopy(model), merged)
    entries, plan, untied = analyze_calls(base, [capture(base, call) for call in calls], constraints)
    plan = FoldPlan(batchnorm=bn_steps, layer_scale=plan.layer_scale, center=plan.center, untie=plan.untie, precompute=plan.precompute,
                    affine_fold=plan.affine_fold, swap=plan.swap)
    return FoldReport(entries, plan, untied, batchnorms=bn_entries,
                      traced_calls=[describe_call(model, *split_example_inputs(call)) for call in calls])


def _dropping_module(step):
    return replace(step, keep_module=False)


def apply_fold(model: nn.Module, plan: FoldPlan) -> nn.Module:
    """A copy of ``model`` with ``plan`` applied (the original is untouched)."""
    with failures_as_fold_error(model_name(model), "applying the plan"):
        return transform.apply_plan(copy.deepcopy(model), plan)


def prove_fold(model: nn.Module, folded: nn.Module, example_inputs, plan: FoldPlan) -> VerifyResult:
    """Compare ``folded`` with ``model`` in float64 on every example call, the float64 side being the
    plan applied to verify's float64 copy of ``model`` once that copy's outputs are recorded (so the
    transform is judged, not its rounding to the model's dtype, with one float64 copy of the model)."""
    return verify(model, folded, example_inputs, tolerance=FOLD_TOLERANCE, rms_norm_paths=rms_norm_paths(plan),
                  exact_transform=lambda exact: transform.apply_plan(exact, plan))


def fold_exactly(model: nn.Module, example_inputs, constraints: PlanConstraints = PlanConstraints(), *,
                 prove: bool = True) -> tuple[nn.Module, FoldReport]:
    """``(folded copy, report)``: plan, apply, and (``prove``) prove in float64, raising
    ``FoldVerificationError`` when the relative error exceeds ``FOLD_TOLERANCE`` or the outputs cannot
    be compared. ``report.verification`` holds the numbers."""
    report = plan_fold(model, example_inputs, constraints)
    folded = apply_fold(model, report.plan)
    if prove:
        report.verification = prove_fold(model, folded, example_inputs, report.plan)
        if not report.verification.ok:
            raise FoldVerificationError(f"folded model differs from the original: {failure(report.verification)}"
                                        f"\n{report}")
    return folded, report


def rms_norm_paths(plan: FoldPlan) -> list[str]:
    """The norms the plan turns into RMSNorms (their inputs must be zero-mean)."""
    return [s.path for s in plan.swap if s.to == "RMSNorm"]


def failure(result: VerifyResult) -> str:
    """One line saying why a verification failed."""
    return result.why or f"float64 max relative error {result.max_rel_error:.3e} > {result.tolerance:.0e}"
