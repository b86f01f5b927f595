"""Rotate (and slice) a folded model's residual stream: pure tensor math plus module rewiring.

With the stream x ↦ x·Q (Q of shape (d, k), orthonormal columns; k = d for a rotation, k < d when
slicing), every tensor with a dim in stream space changes the same way, t ↦ t·Q along that dim:

- a writer y = x·Wᵀ + b (W (d, in)) must give y·Q: Wᵀ ↦ Wᵀ·Q, b ↦ b·Q; an embedding or position
  table's rows ↦ rows·Q; a conv's output channels likewise;
- a reader z = x̂·Wᵀ (W (out, d)) must see x̂·Q: (x̂·Q)·(W·Q)ᵀ = x̂·Q·Qᵀ·Wᵀ, which is x̂·Wᵀ when
  Q·Qᵀ = I (k = d) and the projection onto the kept directions when slicing.

Sliced norms: the sliced stream holds only x·Q_k, whose sum of squares misses the dropped
directions' energy. We keep SliceGPT's choice: the norm divides the kept sum of squares by the
*full* width d, rms² ≈ ‖x·Q_k‖²/d (dividing by k would scale every normalized vector up by
√(d/k), an error the PCA cannot make small; dividing by d errs only by the dropped energy, which
the PCA minimises). An RMSNorm of width k computes that exactly with eps·d/k and its output
scaled by √(d/k): x/√(‖x‖²/d + eps) = √(d/k) · x/√(‖x‖²/k + eps·d/k). The scale goes into the
readers, so the norms stay weightless.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..engine.math import weight_math_dtype
from ..nn import RMSNorm
from ..nn.resize import replace_parameter
from .closure import Stream


def rotate_along(t: Tensor, dim: int, q: Tensor, scale: float = 1.0) -> Tensor:
    """scale · t·Q along ``dim`` (that dim, moved last, times Q), computed in float64 (float32 for
    16-bit storage) and cast back once."""
    if not -t.dim() <= dim < t.dim() or t.shape[dim] != q.shape[0]:
        raise ValueError(f"dim {dim} of a tensor of shape {tuple(t.shape)} must have Q's {q.shape[0]} rows")
    x = t.detach().to(weight_math_dtype(t))
    rotated = (x.movedim(dim, -1) @ q.to(device=x.device, dtype=x.dtype)) * scale
    return rotated.movedim(-1, dim).to(t.dtype)


def sliced_rms_eps(eps: float, width: int, kept: int) -> float:
    """eps of the width-``kept`` RMSNorm that divides by the full ``width`` (see the module docstring)."""
    return eps * width / kept


def apply_rotation(model: nn.Module, streams: list[Stream], bases: list[Tensor]) -> nn.Module:
    """Rotate each stream by its basis Q (d, k), in place (callers pass a copy); with k < d, slice it:
    tensors shrink, the stream's norms become weightless RMSNorms of width k (eps·d/k) and the
    readers take the √(d/k) scale."""
    with torch.no_grad():
        for stream, q in zip(streams, bases, strict=True):
            kept = q.shape[1]
            assert kept == stream.width or all(t.role != "writer+reader" for t in stream.tensors), \
                "a tensor that writes and reads the stream cannot take the readers' slicing scale"
            reader_scale = math.sqrt(stream.width / kept)
            for tensor in stream.tensors:
                param = model.get_parameter(tensor.fqn)
                scale = reader_scale if tensor.role == "reader" else 1.0
                new = rotate_along(param, tensor.dim, q, scale)
                if new.shape == param.shape:
                    param.copy_(new)
                else:
                    replace_parameter(model, param, new)
            if kept != stream.width:
                for path in stream.norms:
                    _swap_sliced_norm(model, path, stream.width, kept)
    return model


def _swap_sliced_norm(model: nn.Module, path: str, width: int, kept: int) -> None:
    old = model.get_submodule(path)
    eps = old.eps if getattr(old, "eps", None) is not None else torch.finfo(torch.float32).eps
    new = RMSNorm(kept, eps=sliced_rms_eps(eps, width, kept), elementwise_affine=False)
    new.train(old.training)
    model.set_submodule(path, new)
