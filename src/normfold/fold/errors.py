"""Exceptions of the fold engine."""
from __future__ import annotations


class FoldError(RuntimeError):
    """The model cannot be analysed or folded (e.g. torch.export cannot capture it)."""


class FoldVerificationError(FoldError):
    """The folded model's outputs differ from the original's beyond the float64 bound."""
