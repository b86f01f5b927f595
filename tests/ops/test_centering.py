"""normfold.ops.centering: the batched in-place centering CBWC's projection runs twice per step (C++ kernel)
against the fp64 oracle, over awkward shapes, dims and groups; the fallbacks; refusals before any change.

Tolerance rule: the kernel's error vs the fp64 oracle ≤ 2 × PyTorch's own (``t - t.mean(dim)`` in t's dtype)
+ atol·max|oracle|.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from normfold.engine.math import center as fold_center
from normfold.ops import _cpu
from normfold.ops.centering import center, center_

ATOL = {torch.float32: 1e-6, torch.float64: 1e-14}
needs_kernel = pytest.mark.skipif(not _cpu.kernel_available(), reason="the C++ CPU kernel is not built here")

# (shape, dim, group): contiguous runs (last dim), columns (dim 0 of a matrix), a middle dim, groups, a row of
# one element, an odd count that does not fill a vector, a matrix wide enough to split over column chunks
CASES = [((7, 5), 0, None), ((7, 5), 1, None), ((7, 6), 1, 3), ((3, 8, 5), 1, 4), ((3, 8, 5), 1, None),
         ((2, 3, 4, 5), 2, None), ((1, 9), 1, None), ((9, 1), 1, None), ((13,), 0, None), ((12,), 0, 4),
         ((33, 1031), 0, None), ((5, 2049), 1, None), ((64, 1600), 0, 16)]


def _data(shape, dtype, seed=0, offset=3.0):
    """Values with a large common offset, so an inexact mean shows in the result."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) + offset).to(dtype)


def _assert_close_to_oracle(t, ours, dim, group):
    oracle = center(t.double(), dim, group)
    torch_error = (center(t, dim, group).double() - oracle).abs().max()
    error = (ours.double() - oracle).abs().max()
    bound = 2 * torch_error + ATOL[t.dtype] * oracle.abs().max().clamp_min(1.0)
    assert error <= bound, f"error {error:.3g} > bound {bound:.3g}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,dim,group", CASES)
def test_the_kernel_centers_like_the_fp64_oracle(shape, dim, group, dtype):
    t = _data(shape, dtype)
    ours = t.clone()
    center_([ours], [dim], [group])
    _assert_close_to_oracle(t, ours, dim, group)
    groups = ours.unflatten(dim, (ours.shape[dim] // group, group)).double() if group else ours.double()
    means = groups.mean(dim + 1 if group else dim)
    assert means.abs().max() <= 64 * torch.finfo(dtype).eps * t.double().abs().max()


@needs_kernel
def test_one_call_centers_every_tensor_of_the_list_along_its_own_dim():
    tensors = [_data(shape, torch.float32, seed=i) for i, (shape, _, _) in enumerate(CASES)]
    ours = [t.clone() for t in tensors]
    center_(ours, [dim for _, dim, _ in CASES], [group for _, _, group in CASES])
    for t, o, (_, dim, group) in zip(tensors, ours, CASES):
        _assert_close_to_oracle(t, o, dim, group)


@given(rows=st.integers(1, 40), cols=st.integers(1, 70), dim=st.integers(-2, 1), seed=st.integers(0, 2 ** 16),
       offset=st.floats(-1e3, 1e3))
@settings(max_examples=60, deadline=None)
def test_any_matrix_ends_within_rounding_of_the_oracle(rows, cols, dim, seed, offset):
    t = _data((rows, cols), torch.float32, seed, offset)
    ours = t.clone()
    center_([ours], [dim], [None])
    _assert_close_to_oracle(t, ours, dim, None)


@pytest.mark.parametrize("make", [
    lambda: _data((6, 8), torch.float32).t(),  # not contiguous
    lambda: _data((6, 8), torch.float16),  # a dtype the kernel does not take
    lambda: _data((6, 8), torch.bfloat16),
], ids=["transposed", "float16", "bfloat16"])
def test_tensors_the_kernel_does_not_take_are_centered_by_the_reference(make):
    t = make()
    ours = t.clone()
    center_([ours], [0], [None])
    assert torch.equal(ours, center(t, 0, None))


@pytest.mark.parametrize("dim, group", [(1, 3), (-1, 2), (-2, None), (0, 7)])
def test_without_the_kernel_every_tensor_takes_the_reference(dim, group, monkeypatch):
    monkeypatch.setattr(_cpu, "_module", None)
    monkeypatch.setattr(_cpu, "load", lambda verbose=False: None)
    t = _data((7, 6), torch.float32)
    ours = t.clone()
    center_([ours], [dim], [group])
    assert torch.equal(ours, center(t, dim, group))


def test_a_non_contiguous_tensor_is_centered_in_its_own_memory_with_negative_dims_and_groups():
    base = _data((6, 8), torch.float32)
    ours = base.clone()
    view = ours.t()  # (8, 6), not contiguous: the kernel leaves it to the reference route
    center_([view], [-1], [3])
    assert torch.equal(ours.t(), center(base.t(), -1, 3))


@needs_kernel
def test_the_write_bumps_the_version_counter_as_an_in_place_op_does():
    t = _data((4, 4), torch.float32)
    before = t._version
    center_([t], [0], [None])
    assert t._version > before


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("dims,groups,match", [
    ([2], [None], r"dim must be in \[-2, 2\)"),
    ([1], [3], "group must be a positive divisor of the size 8"),
    ([1], [0], "group must be a positive divisor"),
    ([1, 0], [None], "as many dims and groups as tensors"),
    ([1], [2.0], "group must be a positive divisor"),
])
def test_bad_arguments_are_refused_before_any_tensor_changes(dims, groups, match, kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(_cpu, "_module", None)
        monkeypatch.setattr(_cpu, "load", lambda verbose=False: None)
    elif not _cpu.kernel_available():
        pytest.skip("the C++ CPU kernel is not built here")
    good, bad = _data((5, 8), torch.float32, seed=1), _data((5, 8), torch.float32, seed=2)
    tensors = [good.clone(), bad.clone()]
    with pytest.raises(ValueError, match=match):
        center_(tensors, [0] + dims, [None] + groups)
    assert torch.equal(tensors[0], good) and torch.equal(tensors[1], bad)


@needs_kernel
def test_an_inference_tensor_is_refused_outside_inference_mode_before_any_change():
    good = _data((5, 8), torch.float32)
    with torch.inference_mode():
        frozen = _data((5, 8), torch.float32)
    tensors = [good.clone(), frozen]
    with pytest.raises(RuntimeError, match="inference tensor"):
        center_(tensors, [0, 0], [None, None])
    assert torch.equal(tensors[0], good)
    with torch.inference_mode():  # where torch allows the update, so does center_
        center_(tensors, [0, 0], [None, None])
    _assert_close_to_oracle(good, tensors[1], 0, None)


def test_center_is_differentiable_and_its_backward_is_the_same_projection():
    w = _data((6, 4), torch.float64).requires_grad_()
    g = _data((6, 4), torch.float64, seed=3)
    center(w, 0, 3).backward(g)
    assert torch.allclose(w.grad, center(g, 0, 3), atol=1e-14)


def test_fold_math_center_is_the_same_projection_in_float64():
    t = _data((6, 10), torch.float32)
    assert torch.equal(fold_center(t, 1, 5), center(t.double(), 1, 5).float())
