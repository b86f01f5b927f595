"""Fold engine: find LayerNorms whose input is zero-mean by construction and make them RMSNorms.

    report = analyze(model, example_inputs)                  # FoldReport; the model is untouched
    folded, report = fold(model, example_inputs)             # a new model; the original is untouched
    result = verify(model, folded, example_inputs)           # VerifyResult, float64 by default

Pieces, in the order they run: ``graph`` (torch.export capture), ``rules`` (the one table of
zero-mean-preserving ops), ``analysis`` (zero-mean graphs, closedness, the plan), ``plan`` (plain
data), ``math`` (pure tensor functions), ``transform`` (applies a plan to a module), ``verify``,
``report``. Only torch is imported here.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .errors import FoldError, FoldVerificationError
from .plan import FoldPlan
from .report import FoldReport, NormEntry, VerifyResult
from .verify import verify

_verify = verify  # ``fold``'s keyword ``verify`` shadows the function inside it

_FLOAT64_TOLERANCE = 1e-9  # relative error allowed between original and folded outputs in float64


def analyze(model: nn.Module, example_inputs, *, fold_affine: bool = True, precompute: bool = True) -> FoldReport:
    """Report, for every norm of ``model``, whether it can become an RMSNorm and why (model untouched).

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments
    (e.g. ``{"input_ids": ids, "use_cache": False}``); what the model returns for them are its outputs.
    ``fold_affine``: plan to move γ/β into the linear layers that read a norm. ``precompute``: a
    LayerNorm applied straight to an embedding lookup is baked into the table (the norm disappears).
    """
    from .analysis import analyze_captured
    from .graph import capture

    captured = capture(model, example_inputs)
    entries, plan, untied = analyze_captured(model, captured, fold_affine=fold_affine, precompute=precompute)
    return FoldReport(entries, plan, untied)


def fold(model: nn.Module, example_inputs, *, fold_affine: bool = True, precompute: bool = True,
         verify: bool = True):
    """Return ``(folded_copy, report)``: foldable LayerNorms become RMSNorms, outputs unchanged.

    With ``verify=True`` the plan is also applied to a float64 copy and compared with ``model`` in
    float64 (so the transform is judged, not the final rounding to the model's dtype, which is
    reported separately); ``FoldVerificationError`` is raised (nothing returned) if the relative
    error exceeds 1e-9. ``report.verification`` holds the numbers.
    """
    from .transform import apply_plan

    report = analyze(model, example_inputs, fold_affine=fold_affine, precompute=precompute)
    folded = apply_plan(copy.deepcopy(model), report.plan)
    if verify:
        rms_paths = [s.path for s in report.plan.swap if s.to == "RMSNorm"]
        exact = apply_plan(copy.deepcopy(model).to(torch.float64), report.plan)
        result = _verify(model, folded, example_inputs, tolerance=_FLOAT64_TOLERANCE, rms_norm_paths=rms_paths,
                         folded_exact=exact)
        report.verification = result
        if not result.ok:
            raise FoldVerificationError(
                f"folded model differs from the original: float64 max relative error {result.max_rel_error:.3e} "
                f"> {_FLOAT64_TOLERANCE:.0e}\n{report}")
    return folded, report


__all__ = ["analyze", "fold", "verify", "FoldReport", "NormEntry", "VerifyResult", "FoldError",
           "FoldVerificationError", "FoldPlan"]
