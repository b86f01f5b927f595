"""Pure-PyTorch reference norms: the test oracle and the portable fallback.

Statistics are computed in float32 (float64 when the input is float64), like flash-attn's
``layer_norm_ref`` and Liger's casting, and the result is cast back to the input dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _pre_norm_stream(x: Tensor, residual: Tensor | None) -> Tensor:
    """s = x + residual (in the compute dtype), or x."""
    s = x.to(_compute_dtype(x))
    if residual is not None:
        s = s + residual.to(s.dtype)
    return s


def rms_norm_ref(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-6,
    *,
    residual: Tensor | None = None,
    offset: float = 0.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """y = s / sqrt(mean(s², -1) + eps) · (offset + weight) + bias, s = x (+ residual).

    With ``residual`` returns ``(y, s)``; ``s`` in the input dtype.
    """
    s = _pre_norm_stream(x, residual)
    y = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (offset + weight.to(y.dtype))
    elif offset != 0.0:
        y = y * offset
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = y.to(x.dtype)
    return (y, s.to(x.dtype)) if residual is not None else y


def layer_norm_ref(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """y = (s − mean(s)) / sqrt(var(s) + eps) · weight + bias, s = x (+ residual).

    The variance is the biased one (divide by N), as in ``torch.nn.LayerNorm``.
    """
    s = _pre_norm_stream(x, residual)
    centered = s - s.mean(-1, keepdim=True)
    y = centered * torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = y.to(x.dtype)
    return (y, s.to(x.dtype)) if residual is not None else y
