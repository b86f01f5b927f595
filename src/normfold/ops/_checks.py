"""Argument validation shared by every norm entry point, run before any buffer is allocated."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def check_finite_number(name: str, value, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        expected = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_norm_args(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    residual: Tensor | None,
    offset: float = 0.0,
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
    check_finite_number("eps", eps, positive=True)
    check_finite_number("offset", offset, positive=False)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
        if tuple(p.shape) != (n,):
            raise ValueError(f"{name} must have shape ({n},) to match x's last dimension, got {tuple(p.shape)}")
        if not p.is_floating_point():
            raise TypeError(f"{name} must be floating-point, got {p.dtype}")
        _check_same_device(name, p, x)
    if residual is not None:
        if not isinstance(residual, Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if not residual.is_floating_point():
            raise TypeError(f"residual must be floating-point, got {residual.dtype}")
        _check_same_device("residual", residual, x)


def check_out(out: Tensor, x: Tensor, inputs: tuple[Tensor | None, ...]) -> None:
    """``out`` must match x in shape, dtype and device, and cannot be used under autograd."""
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must have shape {tuple(x.shape)} and dtype {x.dtype}, "
                         f"got shape {tuple(out.shape)} and dtype {out.dtype}")
    _check_same_device("out", out, x)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        raise ValueError("out= does not support autograd: expected inputs that do not require grad "
                         "(or torch.no_grad()), got an input with requires_grad=True")


def _check_same_device(name: str, t: Tensor, x: Tensor) -> None:
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
