"""Fold engine: find LayerNorms whose input is zero-mean by construction and make them RMSNorms.

Placeholder until the engine lands; the names below are the public contract.
"""
from __future__ import annotations


class FoldError(RuntimeError):
    """The model cannot be analysed or folded (e.g. torch.export cannot capture it)."""


class FoldVerificationError(FoldError):
    """The folded model's outputs differ from the original's beyond the float64 bound."""


def analyze(model, example_inputs):  # pragma: no cover - placeholder
    raise NotImplementedError("the fold engine is not implemented yet")


def fold(model, example_inputs, *, fold_affine: bool = True, verify: bool = True):  # pragma: no cover
    raise NotImplementedError("the fold engine is not implemented yet")


def verify(original, folded, example_inputs):  # pragma: no cover - placeholder
    raise NotImplementedError("the fold engine is not implemented yet")


FoldReport = NormEntry = VerifyResult = None

__all__ = ["analyze", "fold", "verify", "FoldReport", "NormEntry", "VerifyResult", "FoldError", "FoldVerificationError"]
