"""BatchNorm folding on its own: every foldable eval-mode BatchNorm merged into the Linear/Conv before it.

The planning (which BatchNorm merges where, and why the others do not) is
``normfold.fold.batchnorm``, the math ``normfold.fold.math.fold_batchnorm_into_producer``; the exact
fold runs the same steps as the first section of its plan (``normfold.fold``). This module keeps
the lab's one-call entry point, :func:`fold_batchnorms`.
"""
from __future__ import annotations

import copy

from torch import nn

from ..fold.batchnorm import BatchNormEntry, plan_batchnorms
from ..fold.graph import capture, check_model_and_inputs
from ..fold.math import fold_batchnorm_into_producer
from ..fold.plan import BatchNormFoldStep, FoldPlan
from ..fold.transform import apply_plan
from ..fold.verify import FOLD_TOLERANCE, prove_or_raise
from ..fold.verify import verify as verify_outputs


def fold_batchnorms(model: nn.Module, example_inputs, *, verify: bool = True,
                    tolerance: float = FOLD_TOLERANCE) -> tuple[nn.Module, list[BatchNormEntry]]:
    """Return ``(folded_copy, entries)``: every foldable eval-mode BatchNorm merged into its producer.

    ``example_inputs``: a tuple of positional arguments, a dict of keyword arguments, or a list of
    such calls (a BatchNorm merges only if every call allows it). With ``verify=True`` the same
    steps are applied to a float64 copy, whose outputs are compared with ``model``'s in float64 on
    the calls (so float32 rounding of the new weights does not hide a wrong fold);
    ``FoldVerificationError`` if the error exceeds ``tolerance``.
    """
    calls = check_model_and_inputs(model, example_inputs)
    steps, entries = plan_batchnorms(model, [capture(model, call) for call in calls])
    plan = FoldPlan(batchnorm=steps)
    folded = apply_plan(copy.deepcopy(model), plan)
    if verify and steps:
        exact = apply_plan(copy.deepcopy(model).double(), plan)
        prove_or_raise(verify_outputs(model, folded, calls, num_random=0, tolerance=tolerance, rms_norm_paths=[],
                                      folded_exact=exact), "BatchNorm folding changed the outputs")
    return folded, entries


__all__ = ["fold_batchnorms", "fold_batchnorm_into_producer", "BatchNormFoldStep", "BatchNormEntry"]
