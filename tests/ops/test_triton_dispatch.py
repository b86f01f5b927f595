"""The Triton backend behind the public ops: ``normfold.ops.rms_norm`` / ``layer_norm`` (custom
op dispatch, autograd, out=) with the backend choice forced to ``normfold.ops._triton`` on the
CPU (Triton interpreter), as it is for CUDA tensors. Pins the backend contract between the
dispatch and the kernels: argument order, None for absent tensors, returned shapes and dtypes.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")
from normfold import ops  # noqa: E402
from normfold.ops import _library, functional  # noqa: E402
from normfold.ops._triton import selfcheck  # noqa: E402
from normfold.ops._triton.selfcheck import Case  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the CPU route to the Triton kernels needs TRITON_INTERPRET=1", allow_module_level=True)


@pytest.fixture
def triton_backend(monkeypatch):
    """Route every kernel-dtype call to the Triton backend; count the calls."""
    import normfold.ops._triton as backend

    calls = []
    original = _library.select_backend

    def select(x, residual=None):
        if x.dtype in backend.launch.KERNEL_DTYPES and (residual is None or residual.dtype == x.dtype):
            calls.append(tuple(x.shape))
            return backend
        return original(x, residual)

    monkeypatch.setattr(_library, "select_backend", select)
    monkeypatch.setattr(functional, "_eager_cpu_shortcut", False)  # CPU tensors would skip select_backend
    return calls


def public_api_outputs(case: Case, inp: selfcheck.Inputs, shape3d) -> dict:
    """Outputs and gradients through ``normfold.ops`` with 3-D inputs (leading dims flattened)."""
    def leaf(t, reshape=True):
        if t is None:
            return None
        t = t.detach().reshape(shape3d) if reshape else t.detach()
        return t.clone().requires_grad_(True)

    x, r = leaf(inp.x), leaf(inp.residual)
    w, b = leaf(inp.weight, reshape=False), leaf(inp.bias, reshape=False)
    if case.is_rms:
        out = ops.rms_norm(x, w, b, case.eps, residual=r, offset=case.offset)
    else:  # the public layer_norm has no offset
        assert case.offset == 0.0
        out = ops.layer_norm(x, w, b, case.eps, residual=r)
    y, s = out if r is not None else (out, None)
    loss = (y.double() * inp.dy.reshape(shape3d).double()).sum()
    if s is not None:
        loss = loss + (s.double() * inp.ds.reshape(shape3d).double()).sum()
    leaves = {"dx": x, "dresidual": r, "dweight": w, "dbias": b}
    present = {k: v for k, v in leaves.items() if v is not None}
    grads = dict(zip(present, torch.autograd.grad(loss, list(present.values()))))
    flat = {k: (v.reshape(inp.x.shape) if k in ("dx", "dresidual") else v) for k, v in grads.items()}
    return {"y": y.detach().reshape(inp.x.shape), "s": None if s is None else s.detach().reshape(inp.x.shape),
            "dweight": None, "dbias": None, "dresidual": None, **flat}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [
    Case(is_rms=True, bias=True, residual=True, offset=1.0),
    Case(is_rms=False, bias=True, residual=True),
    Case(is_rms=True, weight=False),
], ids=str)
def test_public_ops_on_the_triton_backend_match_fp64_reference(triton_backend, case, dtype):
    inp = selfcheck.make_inputs(case, (6, 40), dtype)
    got = public_api_outputs(case, inp, (2, 3, 40))
    assert triton_backend, "the Triton backend was never called"
    mismatches = selfcheck.compare(case, inp, got)
    assert not mismatches, "; ".join(map(str, mismatches))


def test_public_out_argument_on_the_triton_backend(triton_backend):
    x = torch.randn(2, 3, 50)
    w = torch.randn(50)
    r = torch.randn(2, 3, 50)
    out = torch.empty_like(x)
    y, s = ops.rms_norm(x, w, residual=r, out=out)
    assert triton_backend and y.data_ptr() == out.data_ptr()
    want_y, want_s = ops.rms_norm_ref(x, w, residual=r)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)


@pytest.mark.parametrize("target", ["x", "residual"])
def test_out_on_the_triton_backend_may_be_x_or_the_residual_but_not_overlap_them(triton_backend, target):
    """In place over x / the residual matches the reference; out= one row off refuses before launching."""
    x, w, r = torch.randn(3, 40, 64), torch.randn(64), torch.randn(3, 40, 64)
    want_y, want_s = ops.rms_norm_ref(x, w, residual=r)
    x_in, r_in = x.clone(), r.clone()
    out = x_in if target == "x" else r_in
    y, s = ops.rms_norm(x_in, w, residual=r_in, out=out)
    assert triton_backend and y is out
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    launches = len(triton_backend)
    base = torch.randn(121, 64)
    base[:-1] = (x if target == "x" else r).reshape(120, 64)
    inputs = {"x": x.reshape(120, 64), "residual": r.reshape(120, 64), target: base[:-1]}
    with pytest.raises(ValueError, match=f"out must not share memory with {target}"):
        ops.rms_norm(inputs["x"], w, residual=inputs["residual"], out=base[1:])
    assert len(triton_backend) == launches
