"""Argument validation shared by every norm entry point, run before any buffer is allocated."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def check_norm_args(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    residual: Tensor | None,
) -> None:
    """Raise TypeError/ValueError naming the expected and the received value."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor (float16, bfloat16, float32, float64), got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized one), got a 0-d tensor")
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"the normalized (last) dimension must be non-empty, got x.shape={tuple(x.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
        if tuple(p.shape) != (n,):
            raise ValueError(f"{name} must have shape ({n},) to match x's last dimension, got {tuple(p.shape)}")
        if not p.is_floating_point():
            raise TypeError(f"{name} must be floating-point, got {p.dtype}")
    if residual is not None:
        if not isinstance(residual, Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if not residual.is_floating_point():
            raise TypeError(f"residual must be floating-point, got {residual.dtype}")
