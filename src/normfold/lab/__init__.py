"""The normalization lab: diagnostics (``inspect``), configuration checks (``check``), approximate
folding of norms the exact fold cannot touch (``approximate_fold``) and BatchNorm folding
(``fold_batchnorms``).

Only torch is imported here; matplotlib, rich and the export-based graph capture are imported by
the functions that need them.
"""
from __future__ import annotations

from .approximate import (ApproxEntry, ApproximateConfig, ApproximateReport, OutputChange, approximate_fold,
                          compare_outputs, mean_pooled, retrieval_agreement)
from .batchnorm import BatchNormConfig, BatchNormEntry, BatchNormFold, fold_batchnorms
from .check import Finding, check
from .diagnostics import InspectResult, NormInputStats, ScalePoint, inspect

__all__ = ["inspect", "InspectResult", "NormInputStats", "ScalePoint",
           "check", "Finding",
           "approximate_fold", "ApproximateConfig", "ApproximateReport", "ApproxEntry", "OutputChange",
           "compare_outputs",
           "mean_pooled", "retrieval_agreement",
           "fold_batchnorms", "BatchNormConfig", "BatchNormFold", "BatchNormEntry"]
