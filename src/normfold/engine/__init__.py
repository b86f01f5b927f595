"""Fold engine: find LayerNorms whose input is zero-mean by construction and make them RMSNorms.

    report = analyze(model, example_inputs)                  # FoldReport; the model is untouched
    folded, report = fold(model, example_inputs)             # a new model; the original is untouched
    result = verify(model, folded, example_inputs)           # VerifyResult, float64 by default

Pieces, in the order they run: ``graph`` (torch.export capture), ``batchnorm`` (BatchNorms that
merge into the Linear/Conv before them), ``rules`` (the one table of zero-mean-preserving ops),
``analysis`` (zero-mean graphs, closedness, the plan), ``affine`` (where γ/β can go), ``plan``
(plain data, and ``FoldConfig``: the fold's options with what a checkpoint's loader imposes),
``math`` (pure tensor functions), ``transform`` (applies a plan to a module: the one norm swap and
config untying), ``verify``, ``report``; ``pipeline`` runs plan → apply → prove for every caller,
as the step ``steps`` runs for a ``FoldConfig`` (registered here). Only torch is imported here.
"""
from __future__ import annotations

from torch import nn

from .errors import ExampleInputsError, FoldError, FoldVerificationError
from .pipeline import fold_step, plan_fold
from .plan import FoldConfig, FoldPlan, PlanConstraints
from .report import FoldReport, NormEntry, VerifyResult
from .steps import register_step, run_steps
from .verify import verify

register_step(FoldConfig, fold_step, section="fold", section_type=FoldReport,
              proof="folded model differs from the original")


def analyze(model: nn.Module, example_inputs, *, fold_affine: bool = True, precompute: bool = True,
            fold_batchnorm: bool = True, keep=()) -> FoldReport:
    """Report, for every norm of ``model``, whether it can become an RMSNorm and why (model untouched).

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments
    (e.g. ``{"input_ids": ids, "use_cache": False}``); what the model returns for them are its outputs.
    The fold is exact for calls that take the same path through the model as the traced one; a
    list of calls (e.g. one with ``input_ids``, one with ``inputs_embeds``) plans only what is exact
    for every one of them (``report.traced_calls`` records what was traced).
    ``fold_affine``: plan to move γ/β into the linear layers that read a norm. ``precompute``: a
    LayerNorm applied straight to an embedding lookup is baked into the table (the norm disappears).
    ``fold_batchnorm``: eval-mode BatchNorms right after a Linear/Conv are planned to merge into it
    first (``report.batchnorms`` says which and why not; ``report.plan.batchnorm`` holds the steps).
    ``keep``: fnmatch patterns of norm module paths left as they are (reason "kept by request"); a
    pattern that matches no norm is a ValueError listing some.
    """
    return plan_fold(model, example_inputs, FoldConfig(fold_affine=fold_affine, precompute=precompute,
                                                       fold_batchnorm=fold_batchnorm, keep=keep))


def fold(model: nn.Module, example_inputs, *, fold_affine: bool = True, precompute: bool = True,
         fold_batchnorm: bool = True, verify: bool = True, keep=()) -> tuple[nn.Module, FoldReport]:
    """Return ``(folded_copy, report)``: foldable LayerNorms become RMSNorms, outputs unchanged.

    The engine's exact fold (``normfold.fold``, the function, adds fusion and the approximate fold
    on top: ``normfold.convert``). With ``verify=True`` the plan is also applied to a float64 copy
    and compared with ``model`` in float64 (the transform, judged at ``FOLD_TOLERANCE``, 1e-9), and
    the returned model is run in its own dtype and judged against the original's own error there
    (``report.verification.model_dtype_check``), on every example call; ``FoldVerificationError`` is
    raised (nothing returned) when either fails or the outputs cannot be compared (none, or of
    different structure). A plan that overflows the model's dtype is refused first (``FoldError``
    naming the tensor). ``report.verification`` holds the numbers. ``example_inputs`` as for :func:`analyze` (one call,
    or a list of calls: only what is exact for all of them folds).
    """
    config = FoldConfig(fold_affine=fold_affine, precompute=precompute, fold_batchnorm=fold_batchnorm, verify=verify,
                        keep=keep)
    return fold_within(model, example_inputs, config)


def fold_within(model: nn.Module, example_inputs, config: FoldConfig) -> tuple[nn.Module, FoldReport]:
    """:func:`fold` with every option of ``config``, among them what the caller's loader can load
    (``FoldConfig.for_stock_checkpoint``: what a stock Hugging Face class loads): the step
    :func:`~normfold.engine.steps.run_steps` runs for a ``FoldConfig``, alone."""
    folded, sections = run_steps(model, example_inputs, [config])
    return folded, sections[FoldConfig]


__all__ = ["analyze", "fold", "fold_within", "verify", "FoldReport", "NormEntry", "VerifyResult", "FoldError", "ExampleInputsError",
           "FoldVerificationError", "FoldPlan", "FoldConfig", "PlanConstraints", "run_steps"]
