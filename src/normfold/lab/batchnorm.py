"""BatchNorm folding on its own: every foldable eval-mode BatchNorm merged into the Linear/Conv before it.

The planning (which BatchNorm merges where, and why the others do not) is
``normfold.engine.batchnorm``, the math ``normfold.engine.math.fold_batchnorm_into_producer``; the exact
fold runs the same steps as the first section of its plan (``normfold.fold``). This module keeps
the lab's one-call entry point, :func:`fold_batchnorms`.
"""
from __future__ import annotations

import copy
import math
import numbers
from dataclasses import asdict, dataclass, field

from torch import nn

from ..engine.batchnorm import BatchNormEntry, plan_batchnorms
from ..engine.graph import capture
from ..engine.math import fold_batchnorm_into_producer
from ..engine.plan import BatchNormFoldStep, FoldPlan
from ..engine.report import VerifyResult
from ..engine.steps import StepContext, register_step, run_steps
from ..engine.transform import apply_plan
from ..engine.verify import FOLD_TOLERANCE
from ..engine.verify import verify as verify_outputs


@dataclass(frozen=True)
class BatchNormConfig:
    """Options of BatchNorm folding on its own (:func:`fold_batchnorms`). ``verify``: prove the
    merged model equal to the original in float64 on the example calls, within ``tolerance``."""

    verify: bool = True
    tolerance: float = FOLD_TOLERANCE

    def __post_init__(self) -> None:
        if not isinstance(self.verify, bool):
            raise TypeError(f"BatchNormConfig.verify must be a bool, got {type(self.verify).__name__} {self.verify!r}")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, numbers.Real) \
                or not (math.isfinite(self.tolerance) and self.tolerance > 0):
            raise ValueError(f"BatchNormConfig.tolerance must be a finite number > 0, got {self.tolerance!r}")


@dataclass
class BatchNormFold:
    """What BatchNorm folding did: one entry per BatchNorm (merged or why not), and the proof."""

    entries: list[BatchNormEntry] = field(default_factory=list)
    verification: VerifyResult | None = None

    def to_dict(self) -> dict:
        return {"entries": [asdict(e) for e in self.entries],
                "verification": None if self.verification is None else self.verification.to_dict()}

    def __str__(self) -> str:
        lines = [f"BatchNorm {e.path}: {'folded' if e.folded else 'kept'} ({e.reason})" for e in self.entries]
        return "\n".join(lines + ([] if self.verification is None else [str(self.verification)]))


def fold_batchnorms(model: nn.Module, example_inputs, *, verify: bool = True,
                    tolerance: float = FOLD_TOLERANCE) -> tuple[nn.Module, list[BatchNormEntry]]:
    """Return ``(folded_copy, entries)``: every foldable eval-mode BatchNorm merged into its producer.

    ``example_inputs``: a tuple of positional arguments, a dict of keyword arguments, or a list of
    such calls (a BatchNorm merges only if every call allows it). With ``verify=True`` the same
    steps are applied to a float64 copy, whose outputs are compared with ``model``'s in float64 on
    the calls (so float32 rounding of the new weights does not hide a wrong fold);
    ``FoldVerificationError`` if the error exceeds ``tolerance``. The step a
    :class:`BatchNormConfig` names, alone.
    """
    folded, sections = run_steps(model, example_inputs, [BatchNormConfig(verify=verify, tolerance=tolerance)])
    return folded, sections[BatchNormConfig].entries


def batchnorm_step(model: nn.Module, calls: list, config: BatchNormConfig,
                   context: StepContext) -> tuple[nn.Module, BatchNormFold]:
    """The registered step of a :class:`BatchNormConfig`: the merged copy and its section, with the
    float64 comparison (the steps applied to a float64 copy) for the runner to prove."""
    steps, entries = plan_batchnorms(model, [capture(model, call) for call in calls])
    plan = FoldPlan(batchnorm=steps)
    folded = apply_plan(copy.deepcopy(model), plan)
    section = BatchNormFold(entries)
    if config.verify:
        exact = apply_plan(copy.deepcopy(model).double(), plan)
        section.verification = verify_outputs(model, folded, calls, num_random=0, tolerance=config.tolerance,
                                              rms_norm_paths=[], folded_exact=exact)
    return folded, section


register_step(BatchNormConfig, batchnorm_step, section="batchnorm_fold", section_type=BatchNormFold,
              proof="BatchNorm folding changed the outputs")


__all__ = ["fold_batchnorms", "BatchNormConfig", "BatchNormFold", "fold_batchnorm_into_producer", "BatchNormFoldStep",
           "BatchNormEntry"]
