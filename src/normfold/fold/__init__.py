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


def analyze(model: nn.Module, example_inputs, *, fold_affine: bool = True, precompute: bool = True,
            fold_batchnorm: bool = True) -> FoldReport:
    """Report, for every norm of ``model``, whether it can become an RMSNorm and why (model untouched).

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments
    (e.g. ``{"input_ids": ids, "use_cache": False}``); what the model returns for them are its outputs.
    ``fold_affine``: plan to move γ/β into the linear layers that read a norm. ``precompute``: a
    LayerNorm applied straight to an embedding lookup is baked into the table (the norm disappears).
    ``fold_batchnorm``: eval-mode BatchNorms right after a Linear/Conv are planned to merge into it
    first (``report.batchnorms`` says which and why not).
    """
    return _analyze(model, example_inputs, fold_affine=fold_affine, precompute=precompute,
                    fold_batchnorm=fold_batchnorm)[0]


def _analyze(model, example_inputs, *, fold_affine, precompute, fold_batchnorm):
    """(report, model with its BatchNorms folded, BatchNorm steps): BatchNorms merge first, so a
    Linear → BatchNorm → LayerNorm chain is analysed as the Linear → LayerNorm it becomes."""
    from .analysis import analyze_captured
    from .graph import capture, check_model_and_inputs

    check_model_and_inputs(model, example_inputs)
    base, bn_steps, bn_entries = model, [], []
    if fold_batchnorm and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        from ..lab.batchnorm import apply_batchnorm_folds, plan_batchnorm_folds

        bn_steps, bn_entries = plan_batchnorm_folds(model, example_inputs)
        if bn_steps:
            base = apply_batchnorm_folds(copy.deepcopy(model), bn_steps)
    captured = capture(base, example_inputs)
    entries, plan, untied = analyze_captured(base, captured, fold_affine=fold_affine, precompute=precompute)
    report = FoldReport(entries, plan, untied, batchnorms=bn_entries)
    return report, base, bn_steps


def fold(model: nn.Module, example_inputs, *, fold_affine: bool = True, precompute: bool = True,
         fold_batchnorm: bool = True, verify: bool = True, fuse: bool = False, approximate: bool = False,
         calibration=None, min_cosine: float = 0.999, output_fn=None):
    """Return ``(folded_copy, report)``: foldable LayerNorms become RMSNorms, outputs unchanged.

    With ``verify=True`` the plan is also applied to a float64 copy and compared with ``model`` in
    float64 (so the transform is judged, not the final rounding to the model's dtype, which is
    reported separately); ``FoldVerificationError`` is raised (nothing returned) if the relative
    error exceeds 1e-9. ``report.verification`` holds the numbers.

    ``approximate=True`` then also replaces norms the exact fold cannot touch, choosing and
    correcting them on ``calibration`` batches while every output row keeps a cosine similarity
    ≥ ``min_cosine`` to the original (``normfold.lab.approximate_fold``; ``output_fn`` picks the
    rows compared, e.g. ``normfold.lab.mean_pooled`` for sentence embeddings). The result is no
    longer exact: ``report.approximate`` holds the measured change, ``report.num_approximate`` the count.

    ``fuse=True`` (opt-in, inference only) then runs each residual add that feeds a new RMSNorm, or
    a LayerNorm the fold kept (post-LN), together with it in one kernel call (``normfold.fold.fuse``);
    ``report.fuse`` says which.
    """
    from .graph import check_model_and_inputs
    from .transform import apply_plan

    check_model_and_inputs(model, example_inputs)  # TypeError before any work
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise FoldError("fold needs the model's weights, but some are on the meta device: load them first "
                        "(analyze works on a meta model; normfold.hf folds checkpoints shard by shard)")
    if approximate:
        if calibration is None:
            raise ValueError("approximate=True needs calibration=[batch, ...] (inputs like example_inputs)")
        if isinstance(min_cosine, bool) or not isinstance(min_cosine, (int, float)) or not 0.0 < min_cosine <= 1.0:
            raise ValueError(f"min_cosine must be a number in (0, 1], got {min_cosine!r}")
    report, base, bn_steps = _analyze(model, example_inputs, fold_affine=fold_affine, precompute=precompute,
                                      fold_batchnorm=fold_batchnorm)
    folded = apply_plan(copy.deepcopy(base), report.plan)
    if verify:
        rms_paths = [s.path for s in report.plan.swap if s.to == "RMSNorm"]
        exact = copy.deepcopy(model).to(torch.float64)
        if bn_steps:
            from ..lab.batchnorm import apply_batchnorm_folds

            exact = apply_batchnorm_folds(exact, bn_steps)
        exact = apply_plan(exact, report.plan)
        result = _verify(model, folded, example_inputs, tolerance=_FLOAT64_TOLERANCE, rms_norm_paths=rms_paths,
                         folded_exact=exact)
        report.verification = result
        if not result.ok:
            raise FoldVerificationError(
                f"folded model differs from the original: float64 max relative error {result.max_rel_error:.3e} "
                f"> {_FLOAT64_TOLERANCE:.0e}\n{report}")
    if fuse:
        from .fuse import fuse_residual_norms

        folded, report.fuse = fuse_residual_norms(folded, example_inputs, inplace=True, verify=verify)
    if approximate:
        from ..lab.approximate import approximate_fold

        folded, report.approximate = approximate_fold(model, folded, report, calibration, min_cosine=min_cosine,
                                                      output_fn=output_fn)
    return folded, report


__all__ = ["analyze", "fold", "verify", "FoldReport", "NormEntry", "VerifyResult", "FoldError",
           "FoldVerificationError", "FoldPlan"]
