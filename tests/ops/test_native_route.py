"""The eager CUDA route through torch's own fused norms (``_library._torch_native_suits``).

Which calls take it (plain eager, no out=, no graph capture, at most 8M elements, what torch's norm
can compute: no RMSNorm bias or offset, one dtype), and that it keeps the contract: y and every
gradient within the ops' tolerance of the fp64 oracle, s = x + residual rounded once. The CUDA test
is replaced by ``_native_device`` answering True for CPU tensors; the routing itself is the same code.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from normfold.ops import _library, functional, layer_norm, rms_norm
from normfold.ops.reference import layer_norm_ref, rms_norm_ref

ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def native_on_cpu(monkeypatch):
    """CPU tensors routed as CUDA ones would be; every call that reaches a backend is recorded."""
    reached = []
    select = _library.select_backend

    def spy(x, residual=None):
        reached.append(tuple(x.shape))
        return select(x, residual)

    monkeypatch.setattr(_library, "_native_device", lambda x: True)
    monkeypatch.setattr(_library, "select_backend", spy)
    monkeypatch.setattr(functional, "_eager_cpu_shortcut", False)
    return reached


def _t(shape, dtype, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) + 0.5).to(dtype)


def test_accepts_what_torch_computes_to_the_contract():
    x = torch.empty(4, 8, dtype=torch.bfloat16)
    w, b = torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
    assert _library._torch_native_suits(x, w, None, x, 0.0, True)      # RMSNorm, fused residual
    assert _library._torch_native_suits(x, w, b, None, 0.0, False)     # LayerNorm with bias
    assert _library._torch_native_suits(x, None, None, None, 0.0, True)


@pytest.mark.parametrize("case", ["rms bias", "offset", "fp32 weight", "fp32 residual", "too large"])
def test_refuses_what_torch_cannot_compute_or_should_not(case):
    x = torch.empty(4, 8, dtype=torch.bfloat16)
    w, b = torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
    args = {"rms bias": (x, w, b, None, 0.0, True),
            "offset": (x, w, None, None, 1.0, True),                       # Gemma's 1 + w
            "fp32 weight": (x, w.float(), None, None, 0.0, True),
            "fp32 residual": (x, w, None, x.float(), 0.0, True),
            "too large": (torch.empty(1 << 12, (1 << 11) + 1, device="meta"), None, None, None, 0.0, True)}[case]
    assert not _library._torch_native_suits(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_native_route_matches_the_fp64_oracle_forward_and_gradients(native_on_cpu, dtype, is_rms, with_residual):
    shape, n = (3, 5, 96), 96
    x, r = _t(shape, dtype, 0), (_t(shape, dtype, 1) if with_residual else None)
    w, b = _t(n, dtype, 2), (None if is_rms else _t(n, dtype, 3))
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b, r)]
    leaves64 = [t.double().requires_grad_() if t is not None else None for t in (x, w, b, r)]
    ours = (rms_norm if is_rms else layer_norm)(leaves[0], leaves[1], leaves[2], 1e-5, residual=leaves[3])
    ref = (rms_norm_ref if is_rms else layer_norm_ref)(leaves64[0], leaves64[1], leaves64[2], 1e-5,
                                                       residual=leaves64[3])
    assert native_on_cpu == [], "the call reached a backend: it did not take the native route"
    (y, s), (y64, s64) = (ours, ref) if with_residual else ((ours, None), (ref, None))
    assert y.dtype == dtype and y.shape == shape
    if with_residual:  # s = x + residual rounded once to x's dtype
        torch.testing.assert_close(s, (x.double() + r.double()).to(dtype), rtol=0, atol=0)
    dy = _t(shape, dtype, 4)
    outs, outs64 = ((y, s), (y64, s64)) if with_residual else ((y,), (y64,))
    ups = (dy, dy) if with_residual else (dy,)
    live = [i for i, t in enumerate(leaves) if t is not None]
    grads = torch.autograd.grad(outs, [leaves[i] for i in live], ups)
    grads64 = torch.autograd.grad(outs64, [leaves64[i] for i in live], tuple(u.double() for u in ups))
    for got, want in zip((y, *grads), (y64, *grads64)):
        bound = ATOL[dtype] * max(1.0, want.abs().max().item()) * 8
        assert (got.double() - want).abs().max().item() <= bound


def test_out_and_traced_calls_keep_the_registered_op(native_on_cpu):
    x, w = _t((4, 32), torch.float32, 0), _t(32, torch.float32, 1)
    out = torch.empty_like(x)
    rms_norm(x, w, out=out)
    assert native_on_cpu == [(4, 32)], "out= must keep the kernels' route (no extra buffer)"

    class Ops(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as mode:
        rms_norm(x, w)
    assert any("normfold.norm_fwd" in op for op in mode.seen), mode.seen


def test_without_cuda_the_route_is_never_taken():
    x = torch.randn(2, 16)
    assert not _library._native_device(x)


def test_native_route_is_torch_rms_norm_for_plain_rms(native_on_cpu):
    x, w = _t((6, 64), torch.bfloat16, 0), _t(64, torch.bfloat16, 1)
    torch.testing.assert_close(rms_norm(x, w, eps=1e-6), F.rms_norm(x, (64,), w, 1e-6), rtol=0, atol=0)


def test_autocast_keeps_the_kernels_route_and_x_dtype(native_on_cpu):
    """Under autocast torch's own norm would return float32; the contract's y is in x's dtype."""
    x, w = _t((4, 64), torch.bfloat16, 0), _t(64, torch.bfloat16, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer_norm(x, w)
    assert native_on_cpu == [(4, 64)] and y.dtype == torch.bfloat16
