"""The normalization lab: diagnostics (``inspect``), configuration checks (``check``) and
approximate folding of norms the exact fold cannot touch (``approximate_fold``).

Only torch is imported here; matplotlib and rich are imported by the functions that draw or print.
"""
from __future__ import annotations

from .approximate import ApproximateReport, ApproxEntry, OutputChange, approximate_fold, compare_outputs, mean_pooled, retrieval_agreement
from .diagnostics import InspectResult, NormInputStats, ScalePoint, inspect

__all__ = ["inspect", "InspectResult", "NormInputStats", "ScalePoint",
           "approximate_fold", "ApproximateReport", "ApproxEntry", "OutputChange", "compare_outputs",
           "mean_pooled", "retrieval_agreement"]
