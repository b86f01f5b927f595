"""The backend contract implemented with the pure-PyTorch reference.

Used for float64 (the fold engine and CBWC training need exact fp64, backward included), for
devices without a fused kernel, and as the fallback when the C++ kernel cannot be built or
Triton is missing. The backward is the analytic formula the fused kernels implement, written
with PyTorch ops; tests check it against autograd through the fp64 reference.
"""
from __future__ import annotations

from torch import Tensor

from .reference import norm_ref


def norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None,
             eps: float, offset: float, is_rms: bool, out: Tensor | None = None,
             residual_out: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """(y, s, mean, rstd) for 2-D ``x``; see ``normfold.ops._library`` for the contract."""
    y, s, mean, rstd = norm_ref(x, weight, bias, residual, eps, offset, is_rms)
    if out is not None:
        y = out.copy_(y)
    s_stored = None
    if residual is not None:
        s_stored = residual_out.copy_(s) if residual_out is not None else s.to(x.dtype)
    return y, s_stored, mean, rstd


def norm_bwd(dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, mean: Tensor | None,
             rstd: Tensor, offset: float, is_rms: bool,
             has_bias: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(dx, dweight, dbias) from the cached row statistics, in the compute dtype.

    With x̂ = (s − mean)·rstd and g = dy·(offset + w):
      RMSNorm   dx = rstd · (g − x̂·mean(g·x̂))
      LayerNorm dx = rstd · (g − mean(g) − x̂·mean(g·x̂))
    dweight = Σ_rows dy·x̂, dbias = Σ_rows dy; ``ds`` (grad of the returned s) is added to dx.
    """
    acc = rstd.dtype
    s_acc = s.to(acc)  # (M, N)
    xhat = (s_acc if mean is None else s_acc - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dy_acc = dy.to(acc)
    g = dy_acc if weight is None else dy_acc * (offset + weight.to(acc))
    proj = (g * xhat).mean(-1, keepdim=True)
    centered_g = g if is_rms else g - g.mean(-1, keepdim=True)
    dx = rstd.unsqueeze(-1) * (centered_g - xhat * proj)
    if ds is not None:
        dx = dx + ds.to(acc)
    dweight = (dy_acc * xhat).sum(0).to(weight.dtype) if weight is not None else None
    dbias = dy_acc.sum(0).to(weight.dtype if weight is not None else s.dtype) if has_bias else None
    return dx.to(s.dtype), dweight, dbias
