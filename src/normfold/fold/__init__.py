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
import dataclasses

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
    The fold is exact for calls that take the same path through the model as the traced one; a
    list of calls (e.g. one with ``input_ids``, one with ``inputs_embeds``) plans only what is exact
    for every one of them (``report.traced_calls`` records what was traced).
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
    from .analysis import analyze_calls
    from .graph import capture, check_model_and_inputs, describe_call, split_example_inputs

    calls = check_model_and_inputs(model, example_inputs)
    base, bn_steps, bn_entries = model, [], []
    if fold_batchnorm and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        bn_steps, bn_entries = _plan_batchnorms(model, calls)
        if bn_steps:
            from ..lab.batchnorm import apply_batchnorm_folds

            base = apply_batchnorm_folds(copy.deepcopy(model), bn_steps)
    captures = [capture(base, call) for call in calls]
    entries, plan, untied = analyze_calls(base, captures, fold_affine=fold_affine, precompute=precompute)
    report = FoldReport(entries, plan, untied, batchnorms=bn_entries,
                        traced_calls=[describe_call(model, *split_example_inputs(call)) for call in calls])
    return report, base, bn_steps


def _plan_batchnorms(model, calls):
    """BatchNorm merges that every call allows (one that a call does not allow is kept, naming it)."""
    from ..lab.batchnorm import plan_batchnorm_folds

    steps, entries = plan_batchnorm_folds(model, calls[0])
    for j, call in enumerate(calls[1:], start=1):
        other_steps, other_entries = plan_batchnorm_folds(model, call)
        why = {e.path: e.reason for e in other_entries if not e.folded}
        for i, entry in enumerate(entries):
            step = next((s for s in steps if s.norm_path == entry.path), None)
            if step is not None and step not in other_steps:
                steps.remove(step)
                entries[i] = dataclasses.replace(entry, folded=False, reason=(
                    f"not foldable in example call {j}: {why.get(entry.path, 'that call does not run it')}"))
    return steps, entries


def fold(model: nn.Module, example_inputs, *, fold_affine: bool = True, precompute: bool = True,
         fold_batchnorm: bool = True, verify: bool = True, fuse: bool = False, approximate: bool = False,
         calibration=None, min_cosine: float = 0.999, output_fn=None):
    """Return ``(folded_copy, report)``: foldable LayerNorms become RMSNorms, outputs unchanged.

    With ``verify=True`` the plan is also applied to a float64 copy and compared with ``model`` in
    float64 (so the transform is judged, not the final rounding to the model's dtype, which is
    reported separately), on every example call; ``FoldVerificationError`` is raised (nothing
    returned) if the relative error exceeds 1e-9 or the outputs cannot be compared (none, or of
    different structure). ``report.verification`` holds the numbers. ``example_inputs`` as for
    :func:`analyze` (one call, or a list of calls: only what is exact for all of them folds).

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

    calls = check_model_and_inputs(model, example_inputs)  # TypeError before any work
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
        result = _verify(model, folded, example_inputs, tolerance=_FLOAT64_TOLERANCE,
                         rms_norm_paths=rms_paths, folded_exact=exact)
        report.verification = result
        if not result.ok:
            raise FoldVerificationError(f"folded model differs from the original: {_failure(result)}\n{report}")
    if fuse:
        from ..fuse import fuse_residual_norms

        unfused = copy.deepcopy(folded) if verify and len(calls) > 1 else None
        folded, report.fuse = fuse_residual_norms(folded, calls[0], inplace=True, verify=verify)
        if unfused is not None:  # fuse checked the first call; the others are checked here
            result = _verify(unfused, folded, calls[1:], tolerance=_FLOAT64_TOLERANCE)
            if not result.ok:
                raise FoldVerificationError(f"fused model differs from the unfused one: {_failure(result)}")
    if approximate:
        from ..lab.approximate import approximate_fold

        folded, report.approximate = approximate_fold(model, folded, report, calibration, min_cosine=min_cosine,
                                                      output_fn=output_fn)
    return folded, report


def _failure(result: VerifyResult) -> str:
    return result.why or (f"float64 max relative error {result.max_rel_error:.3e} > {result.tolerance:.0e}")


__all__ = ["analyze", "fold", "verify", "FoldReport", "NormEntry", "VerifyResult", "FoldError",
           "FoldVerificationError", "FoldPlan"]
