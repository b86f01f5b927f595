"""Public functional norms. (Backends: see ``normfold.ops`` dispatch; this first version runs
the reference and will be routed through the fused custom ops.)"""
from __future__ import annotations

from torch import Tensor

from ._checks import check_norm_args
from .reference import layer_norm_ref, rms_norm_ref


def _write_out(y: Tensor, out: Tensor | None) -> Tensor:
    if out is None:
        return y
    if out.shape != y.shape or out.dtype != y.dtype:
        raise ValueError(f"out must have shape {tuple(y.shape)} and dtype {y.dtype}, got {tuple(out.shape)} {out.dtype}")
    out.copy_(y)
    return out


def rms_norm(x, weight=None, bias=None, eps=1e-6, *, residual=None, offset=0.0, out=None):
    """RMSNorm over the last dimension; with ``residual`` returns ``(y, x + residual)``."""
    check_norm_args(x, weight, bias, eps, residual)
    r = rms_norm_ref(x, weight, bias, eps, residual=residual, offset=offset)
    if residual is None:
        return _write_out(r, out)
    return _write_out(r[0], out), r[1]


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, out=None):
    """LayerNorm over the last dimension; with ``residual`` returns ``(y, x + residual)``."""
    check_norm_args(x, weight, bias, eps, residual)
    r = layer_norm_ref(x, weight, bias, eps, residual=residual)
    if residual is None:
        return _write_out(r, out)
    return _write_out(r[0], out), r[1]
