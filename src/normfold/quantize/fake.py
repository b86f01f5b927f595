"""Fake quantization: round-to-nearest onto a symmetric integer grid and back, pure tensor math.

    q(t) = s · clamp(round(t / s), −(2^(b−1) − 1), 2^(b−1) − 1),   s = max|t| / (2^(b−1) − 1)

with one scale s per group of entries along a dim (a weight's input dim: per output channel, or per
group of ``group_size`` input entries; an activation's feature dim: per token). Each entry moves by
at most s/2, and the group's largest entry is kept exactly. Computed in float32 at least (float64
stays float64) and cast back once. :func:`fake_quantize_ste` passes gradients straight through
(the straight-through estimator: d q(t)/dt taken as 1), so a loss of the quantized model can be
differentiated with respect to what produced ``t`` (a rotation).
"""
from __future__ import annotations

import torch
from torch import Tensor


def grid_max(bits: int) -> int:
    """The largest integer level of a symmetric ``bits``-bit grid, 2^(b−1) − 1 (7 for 4 bits)."""
    return 2 ** (bits - 1) - 1


def group_scales(t: Tensor, bits: int, dim: int = -1, group_size: int | None = None) -> Tensor:
    """The scale s = max|t|/(2^(b−1) − 1) of each group of ``group_size`` entries along ``dim`` (the
    whole dim when None), shaped (..., groups, 1) with ``dim`` moved last; a group of zeros gets a
    tiny positive scale, so it stays zero."""
    grouped = _grouped(t, dim, group_size)
    return grouped.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(grouped.dtype).tiny) / grid_max(bits)


def fake_quantize(t: Tensor, bits: int, dim: int = -1, group_size: int | None = None) -> Tensor:
    """``t`` rounded to the nearest point of its group's symmetric ``bits``-bit grid (module docstring)."""
    grouped = _grouped(t, dim, group_size)
    scale = group_scales(t, bits, dim, group_size)
    levels = grid_max(bits)
    quantized = (grouped / scale).round().clamp(-levels, levels) * scale
    return quantized.reshape(*quantized.shape[:-2], -1).movedim(-1, dim).to(t.dtype)


def fake_quantize_ste(t: Tensor, bits: int, dim: int = -1, group_size: int | None = None) -> Tensor:
    """:func:`fake_quantize` forward, identity backward (straight-through estimator)."""
    return t + (fake_quantize(t, bits, dim, group_size) - t).detach()


def _grouped(t: Tensor, dim: int, group_size: int | None) -> Tensor:
    """``t`` in its math dtype with ``dim`` moved last and split into (groups, group_size)."""
    x = t.movedim(dim, -1)
    x = x if x.dtype == torch.float64 else x.float()
    size = x.shape[-1]
    group = size if group_size is None else group_size
    assert size % group == 0, f"checked by the caller: a dim of {size} in groups of {group}"
    return x.reshape(*x.shape[:-1], size // group, group)
