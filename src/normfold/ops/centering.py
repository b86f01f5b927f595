"""Centering along one dim, t − mean(t): the projection P = I − 11ᵀ/m that CBWC keeps its tensors in.

``center`` is the differentiable pure-PyTorch definition (and the tests' oracle); ``center_`` applies it in
place to many tensors at once, in one C++ call on CPU (``ops/csrc/center_cpu.cpp``), because a training step
that projects a dozen small tensors twice would otherwise spend more time dispatching ops than computing.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from . import _cpu

_KERNEL_DTYPES = (torch.float32, torch.float64)


def center(t: Tensor, dim: int, group: int | None = None) -> Tensor:
    """t − mean(t) along ``dim``, the mean taken per contiguous ``group`` elements of that dim (None: all).

    For a linear weight W (out, in) and dim 0 this is P·W with P = I − 11ᵀ/m: every output of the layer is
    then zero-mean over the outputs, whatever its input. P is symmetric, so it is also the map from ∂L/∂V to
    ∂L/∂W of V = P·W. In ``t``'s dtype, differentiable.
    """
    view, reduced = _grouped(t, dim, group)
    centered = view - view.mean(reduced, keepdim=True)
    return centered if group is None else centered.flatten(reduced - 1, reduced)


def _grouped(t: Tensor, dim: int, group: int | None) -> tuple[Tensor, int]:
    """``t`` with ``dim`` split into (groups, group) (a view of t's memory; t itself for None), and the dim whose
    mean is taken."""
    dim %= t.dim()
    if group is None:
        return t, dim
    return t.unflatten(dim, (t.shape[dim] // group, group)), dim + 1  # (..., groups, group, ...)


def check_centering(t: Tensor, dim: int, group: int | None) -> int:
    """``dim`` normalised to [0, t.dim()); ValueError for an out-of-range dim or a group that does not divide it."""
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"dim must be in [{-t.dim()}, {t.dim()}) for a {t.dim()}-D tensor, got {dim}")
    dim %= t.dim()
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group <= 0
                              or t.shape[dim] % group):
        raise ValueError(f"group must be a positive divisor of the size {t.shape[dim]} of dim {dim}, got {group!r}")
    return dim


def center_(tensors: Sequence[Tensor], dims: Sequence[int], groups: Sequence[int | None]) -> None:
    """``t.copy_(center(t, dim, group))`` for every (tensor, dim, group), in place, outside autograd.

    On CPU one C++ call checks every dim and group (ValueError before any tensor changes) and centers the
    contiguous float32/float64 tensors (sums in float64, so the result can differ from ``center``'s in the
    last bit); the others, or all of them when the kernel is not built, take ``center``. A training step
    calls this twice: the kernel call costs a fraction of one ``center`` per tensor.
    """
    module = _cpu._module if _cpu._module is not None else _cpu.load()
    if module is None:
        if not len(tensors) == len(dims) == len(groups):
            raise ValueError(f"center_: expected as many dims and groups as tensors, got {len(tensors)} tensors, "
                             f"{len(dims)} dims, {len(groups)} groups")
        left = [(t, check_centering(t, dim, group), group) for t, dim, group in zip(tensors, dims, groups)]
    else:
        _check_group_types(groups)
        left = [(tensors[i], dims[i], groups[i]) for i in module.center_(tensors, dims, groups)]
    if left:
        with torch.no_grad():
            for t, dim, group in left:
                _subtract_mean_(t, dim, group)


def _subtract_mean_(t: Tensor, dim: int, group: int | None) -> None:
    """t −= mean(t) along ``dim`` per ``group``, in place: ``center``'s arithmetic in two kernels and no temporary
    of t's size (on a GPU, where this route runs, each op is a launch)."""
    view, reduced = _grouped(t, dim, group)
    view.sub_(view.mean(reduced, keepdim=True))


def _check_group_types(groups: Sequence[int | None]) -> None:
    """ValueError for a group that is neither None nor an int (a bool is not), as ``check_centering`` raises."""
    for group in groups:
        if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
            raise ValueError(f"group must be a positive divisor of the size of its dim or None, got {group!r}")
