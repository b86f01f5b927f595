"""Pure-PyTorch reference norms: the test oracle and the portable fallback.

Statistics are computed in float32 (float64 when the input is float64), like flash-attn's
``layer_norm_ref`` and Liger's casting, and the result is cast back to the input dtype.

Affine convention shared by every backend: the scale is ``offset + weight`` when a weight is
given (``offset=1`` is Gemma's ``1 + w``) and 1 when it is not (``offset`` then has nothing to
shift and is ignored).
"""
from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype every backend computes a norm's statistics in: float64 for float64 ``x``, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _pre_norm_stream(x: Tensor, residual: Tensor | None) -> Tensor:
    """s = x + residual, or x, in the compute dtype.

    The add runs in the compute dtype and is rounded once to x's dtype: the norm normalizes
    exactly the s it returns, so a backward that sees only the stored s stays consistent.
    """
    s = x.to(compute_dtype(x))
    if residual is not None:
        s = (s + residual.to(s.dtype)).to(x.dtype).to(s.dtype)
    return s


def _row_stats(s: Tensor, eps: float, is_rms: bool) -> tuple[Tensor | None, Tensor]:
    """(mean, rstd) over the last dim of ``s`` (compute dtype); mean is None for RMSNorm.

    LayerNorm: rstd = 1/sqrt(mean((s − mean)²) + eps), the biased variance as in nn.LayerNorm,
    two-pass so no cancellation. RMSNorm: rstd = 1/sqrt(mean(s²) + eps).
    """
    if is_rms:
        return None, torch.rsqrt(s.square().mean(-1) + eps)
    mean = s.mean(-1)
    return mean, torch.rsqrt((s - mean.unsqueeze(-1)).square().mean(-1) + eps)


def norm_ref(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None, eps: float,
             offset: float, is_rms: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """One reference for both norms: returns (y in x.dtype, s in the compute dtype, mean, rstd)."""
    s = _pre_norm_stream(x, residual)  # (..., N)
    mean, rstd = _row_stats(s, eps, is_rms)
    centered = s if mean is None else s - mean.unsqueeze(-1)
    y = centered * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * (offset + weight.to(y.dtype))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype), s, mean, rstd


def rms_norm_ref(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-6, *,
                 residual: Tensor | None = None, offset: float = 0.0) -> Tensor | tuple[Tensor, Tensor]:
    """y = s / sqrt(mean(s², -1) + eps) · (offset + weight) + bias, s = x (+ residual).

    With ``residual`` returns ``(y, s)``; ``s`` in the input dtype.
    """
    y, s, _, _ = norm_ref(x, weight, bias, residual, eps, offset, is_rms=True)
    return (y, s.to(x.dtype)) if residual is not None else y


def layer_norm_ref(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5, *,
                   residual: Tensor | None = None, offset: float = 0.0) -> Tensor | tuple[Tensor, Tensor]:
    """y = (s − mean(s)) / sqrt(var(s) + eps) · (offset + weight) + bias, s = x (+ residual).

    The variance is the biased one (divide by N), as in ``torch.nn.LayerNorm``.
    """
    y, s, _, _ = norm_ref(x, weight, bias, residual, eps, offset, is_rms=False)
    return (y, s.to(x.dtype)) if residual is not None else y
