"""Norm modules on normfold's fused ops, with the state-dict keys of ``torch.nn.RMSNorm`` / ``LayerNorm``."""
from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn

from ..ops import layer_norm, rms_norm
from ..ops._checks import check_finite_number


def _as_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        shape = (int(normalized_shape),)
    else:
        shape = tuple(int(d) for d in normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"normfold norms normalize the last dimension only: normalized_shape must be an int or a 1-tuple, got {shape}")
    if shape[0] <= 0:
        raise ValueError(f"normalized_shape must be a positive size, got {shape[0]}")
    return shape


def _as_eps(eps) -> float:
    check_finite_number("eps", eps, positive=True)
    return float(eps)


class _LastDimNorm(nn.Module):
    """What both norms hold: the normalized size, eps, and optional γ (``weight``) and β (``bias``)
    Parameters, named as in torch so state dicts are interchangeable."""

    def __init__(self, normalized_shape, eps, elementwise_affine, bias, device, dtype) -> None:
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = _as_eps(eps)
        self.elementwise_affine = bool(elementwise_affine)
        factory = {"device": device, "dtype": dtype}
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)


class RMSNorm(_LastDimNorm):
    """y = x / sqrt(mean(x², -1) + eps) · (offset + weight) + bias.

    ``bias=True`` holds a LayerNorm's β after folding; ``offset=1.0`` is Gemma's (1 + w). Called with
    ``residual``, it normalizes s = x + residual and returns ``(y, s)``: the add runs inside the kernel (one pass
    over the stream; the backward adds the residual's gradient in the same pass).
    """

    def __init__(self, normalized_shape, eps: float = 1e-6, elementwise_affine: bool = True,
                 bias: bool = False, offset: float = 0.0, device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.offset = float(offset)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.offset)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        return rms_norm(x, self.weight, self.bias, self.eps, residual=residual, offset=self.offset)

    def extra_repr(self) -> str:
        s = f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        if self.bias is not None:
            s += ", bias=True"
        if self.offset:
            s += f", offset={self.offset}"
        return s


class PermutedRMSNorm(RMSNorm):
    """An :class:`RMSNorm` over the last dim of ``x.permute(order)``, permuted back: what a channels-first
    LayerNorm (ConvNeXt's ``data_format="channels_first"``: permute → layer_norm → permute) becomes once
    its input is zero-mean over the channels. Same parameters and state-dict keys as :class:`RMSNorm`."""

    def __init__(self, normalized_shape, order, **options) -> None:
        super().__init__(normalized_shape, **options)
        self.order = tuple(int(d) for d in order)
        if sorted(self.order) != list(range(len(self.order))):
            raise ValueError(f"order must be a permutation of 0..{len(self.order) - 1}, got {self.order}")
        self.inverse = tuple(sorted(range(len(self.order)), key=self.order.__getitem__))

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x.permute(self.order)).permute(self.inverse)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, order={self.order}"


class FusedAddRMSNorm(RMSNorm):
    """``(rms_norm(x + residual), x + residual)``: the add and the norm in one pass."""

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return rms_norm(x, self.weight, self.bias, self.eps, residual=residual, offset=self.offset)


class LayerNorm(_LastDimNorm):
    """Drop-in ``torch.nn.LayerNorm`` over the last dimension, on the fused kernel.

    Same constructor, attributes and state-dict keys as torch's; only a 1-D
    ``normalized_shape`` is supported. ``residual`` as for :class:`RMSNorm`.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        return layer_norm(x, self.weight, self.bias, self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
