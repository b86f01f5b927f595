"""The norm ops' argument contract: every refusal and its message, checked here once, before any buffer
is allocated (``functional._norm``; the out= overlap rule inside the op, where the buffers are known).
The backends assume it: the C++ CPU entry declines (returns None for) whatever it does not take so that
these checks raise, and the kernels only guard their own invariants."""
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
    """``out`` must match x in shape, dtype and device, and cannot be used under autograd.

    Overlap with the inputs is checked where the buffers the kernel reads and writes are known
    (``check_out_overlap``, called by the op's implementation).
    """
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must have shape {tuple(x.shape)} and dtype {x.dtype}, "
                         f"got shape {tuple(out.shape)} and dtype {out.dtype}")
    _check_same_device("out", out, x)
    if torch.is_grad_enabled():
        if out.requires_grad:  # torch refuses to overwrite it as well
            raise ValueError("out= does not support autograd: expected an out tensor that does not require grad "
                             "(or torch.no_grad()), got out with requires_grad=True")
        if any(t is not None and t.requires_grad for t in inputs):
            raise ValueError("out= does not support autograd: expected inputs that do not require grad "
                             "(or torch.no_grad()), got an input with requires_grad=True")


# Inputs that ``out`` may be exactly (in-place normalisation): every backend reads an element of
# these before it writes that element, and never reads it again afterwards.
_MAY_BE_OUT = ("x", "residual")


def check_out_overlap(out: Tensor, inputs: dict[str, Tensor | None]) -> None:
    """Raise ValueError when ``out``, the buffer a kernel writes as it goes, shares memory with an input it reads.

    Writing one row while another row (or the weight) is still to be read returns garbage, so such
    overlap is refused as torch refuses it; ``out`` being exactly x or the residual (same memory,
    shape, strides and dtype) is in-place normalisation and allowed.
    """
    for name, t in inputs.items():
        if t is None or not _share_elements(out, t) or (name in _MAY_BE_OUT and _same_view(out, t)):
            continue
        raise ValueError(
            f"out must not share memory with {name}: expected a separate buffer"
            f"{f' or exactly {name} itself' if name in _MAY_BE_OUT else ''}, got out (storage offset "
            f"{out.storage_offset()}, strides {out.stride()}) overlapping {name} (storage offset "
            f"{t.storage_offset()}, strides {t.stride()}): some elements of the input and the written-to "
            "tensor refer to a single memory location; clone() the input or write to another buffer")


def _share_elements(a: Tensor, b: Tensor) -> bool:
    """Whether a and b may share a memory location: same storage and intersecting byte spans.

    Exact for contiguous tensors (what the kernels write and read); two interleaved strided views
    of one storage count as sharing.
    """
    if a.numel() == 0 or b.numel() == 0 or not torch._C._overlaps(a, b):  # _overlaps: same storage
        return False
    (a_start, a_end), (b_start, b_end) = _byte_span(a), _byte_span(b)
    return a_start < b_end and b_start < a_end


def _byte_span(t: Tensor) -> tuple[int, int]:
    """[first, last + 1) byte of t's storage that t covers (torch strides are never negative)."""
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()


def _same_view(a: Tensor, b: Tensor) -> bool:
    """For a and b on one storage: True when they are the same elements in the same order.

    Offsets, not data pointers, so that meta tensors answer too.
    """
    return (a.dtype == b.dtype and a.storage_offset() == b.storage_offset() and a.shape == b.shape
            and a.stride() == b.stride())


def _check_same_device(name: str, t: Tensor, x: Tensor) -> None:
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
