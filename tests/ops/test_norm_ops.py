"""normfold.ops.rms_norm / layer_norm against the fp64 reference: forward, every gradient, dtypes,
layouts, options, bad input, NaN isolation, the registered custom ops and the fallback path.

Tolerance rule: our error vs the fp64 oracle ≤ 2 × torch's own error in the same dtype
(``torch.nn.functional.rms_norm`` / ``layer_norm``) + atol·max|oracle|.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from normfold.ops import _cpu, _library, _reference_backend, layer_norm, rms_norm
from normfold.ops.reference import layer_norm_ref, rms_norm_ref

ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ours(is_rms):
    return rms_norm if is_rms else layer_norm


def _oracle(is_rms):
    return rms_norm_ref if is_rms else layer_norm_ref


def _torch_norm(x, weight, bias, eps, is_rms):
    """torch's own kernel in x's dtype: the yardstick for the error we may make."""
    if is_rms:
        y = F.rms_norm(x, (x.shape[-1],), weight, eps)
        return y if bias is None else y + bias
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _make(shape, dtype, *, affine=True, with_bias=True, with_residual=False, noncontig=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]

    def rand(*s):
        return torch.randn(*s, generator=g)

    if noncontig:  # same values seen through a transposed, non-contiguous view
        x = (rand(*shape[:-2], n, shape[-2]) * 2 + 0.5).to(dtype).transpose(-1, -2)
        assert not x.is_contiguous()
    else:
        x = (rand(*shape) * 2 + 0.5).to(dtype)
    r = rand(*shape).to(dtype) if with_residual else None
    w = (1 + 0.3 * rand(n)).to(dtype) if affine else None
    b = (0.1 * rand(n)).to(dtype) if affine and with_bias else None
    return x, w, b, r


def _grads(outputs, inputs, upstream):
    live = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(outputs, live, upstream))
    return [next(got) if t is not None else None for t in inputs]


def _leaf(t, dtype=None):
    if t is None:
        return None
    return t.detach().to(dtype or t.dtype).requires_grad_(True)


def _max_err(a, ref):
    return (a.double() - ref).abs().max().item() if a is not None else 0.0


def _assert_close_to_oracle(name, ours, theirs, ref, dtype):
    err, torch_err = _max_err(ours, ref), _max_err(theirs, ref)
    bound = 2 * torch_err + ATOL[dtype] * max(1.0, ref.abs().max().item())
    assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g} (torch's error {torch_err:.3g})"


def _check_against_oracle(shape, dtype, is_rms, *, affine=True, with_bias=True, with_residual=False,
                          noncontig=False, eps=1e-5):
    """Forward and all gradients (dx, dweight, dbias, dresidual, grad into the returned s)."""
    x, w, b, r = _make(shape, dtype, affine=affine, with_bias=with_bias, with_residual=with_residual,
                       noncontig=noncontig)
    inputs = [_leaf(t) for t in (x, w, b, r)]
    inputs64 = [_leaf(t, torch.float64) for t in (x, w, b, r)]
    inputs_torch = [_leaf(t) for t in (x, w, b, r)]
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(shape, generator=g).to(dtype)
    ds = torch.randn(shape, generator=g).to(dtype)

    xs, ws, bs, rs = inputs
    out = _ours(is_rms)(xs, ws, bs, eps, residual=rs)
    x64, w64, b64, r64 = inputs64
    ref = _oracle(is_rms)(x64, w64, b64, eps, residual=r64)
    xt, wt, bt, rt = inputs_torch
    st_ = xt + rt if rt is not None else xt  # torch: the add rounded to dtype, then the norm
    theirs = _torch_norm(st_, wt, bt, eps, is_rms)

    if with_residual:
        (y, s), (y64, s64) = out, ref
        assert s.dtype == dtype and s.shape == x.shape
        _assert_close_to_oracle("s = x + residual", s, st_, s64, dtype)
        grads = _grads((y, s), inputs, (dy, ds))
        grads64 = _grads((y64, s64), inputs64, (dy.double(), ds.double()))
        grads_torch = _grads((theirs, st_), inputs_torch, (dy, ds))
    else:
        y, y64 = out, ref
        grads = _grads(y, inputs, dy)
        grads64 = _grads(y64, inputs64, dy.double())
        grads_torch = _grads(theirs, inputs_torch, dy)
    assert y.dtype == dtype and y.shape == x.shape
    _assert_close_to_oracle("y", y, theirs, y64, dtype)
    for name, gi, g64, gt in zip(("dx", "dweight", "dbias", "dresidual"), grads, grads64, grads_torch):
        if g64 is None:
            continue
        assert gi.dtype == inputs[("dx", "dweight", "dbias", "dresidual").index(name)].dtype
        _assert_close_to_oracle(name, gi, gt, g64, dtype)


SHAPES = [(1, 1), (3, 7, 1023), (2, 5, 1500), (4, 131072), (513, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_forward_and_gradients_match_fp64_oracle(shape, dtype, is_rms):
    _check_against_oracle(shape, dtype, is_rms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7, 1023), (4, 131072)], ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_residual_add_forward_and_gradients_match_fp64_oracle(shape, dtype, is_rms):
    _check_against_oracle(shape, dtype, is_rms, with_residual=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_noncontiguous_3d_input_matches_fp64_oracle(dtype, is_rms, with_residual):
    _check_against_oracle((2, 33, 80), dtype, is_rms, noncontig=True, with_residual=with_residual)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("affine,with_bias", [(False, False), (True, False)], ids=["no-affine", "weight-only"])
def test_optional_weight_and_bias_match_fp64_oracle(is_rms, affine, with_bias):
    _check_against_oracle((6, 300), torch.float32, is_rms, affine=affine, with_bias=with_bias, with_residual=True)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_float64_is_exact_forward_and_backward(is_rms):
    x, w, b, r = _make((5, 257), torch.float64, with_residual=True)
    inputs = [_leaf(t) for t in (x, w, b, r)]
    y, s = _ours(is_rms)(*inputs[:3], 1e-5, residual=inputs[3])
    inputs64 = [_leaf(t) for t in (x, w, b, r)]
    y64, s64 = _oracle(is_rms)(*inputs64[:3], 1e-5, residual=inputs64[3])
    torch.testing.assert_close(y, y64, rtol=0, atol=1e-12)
    torch.testing.assert_close(s, s64, rtol=0, atol=0)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    for got, want in zip(_grads((y, s), inputs, (dy, ds)), _grads((y64, s64), inputs64, (dy, ds))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_float64_gradients_pass_gradcheck():
    x, w, b, r = (_leaf(t) for t in _make((3, 17), torch.float64, with_residual=True))
    for fn in (rms_norm, layer_norm):
        assert torch.autograd.gradcheck(lambda *a: fn(a[0], a[1], a[2], residual=a[3]), (x, w, b, r))


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's own kernel, the yardstick
def test_bf16_input_with_fp32_weight_gives_bf16_output_and_fp32_weight_grads(is_rms):
    x, _, _, _ = _make((4, 9, 384), torch.bfloat16)
    _, w, b, _ = _make((4, 9, 384), torch.float32)
    xs, ws, bs = _leaf(x), _leaf(w), _leaf(b)
    y = _ours(is_rms)(xs, ws, bs)
    assert y.dtype == torch.bfloat16
    x64, w64, b64 = (_leaf(t, torch.float64) for t in (x, w, b))
    y64 = _oracle(is_rms)(x64, w64, b64)
    dy = torch.randn_like(y)
    grads = _grads(y, [xs, ws, bs], dy)
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float32]
    grads64 = _grads(y64, [x64, w64, b64], dy.double())
    # torch's kernel rounds the same way in this dtype mix; its error is the yardstick
    xt, wt, bt = _leaf(x), _leaf(w), _leaf(b)
    theirs = _torch_norm(xt, wt, bt, 1e-5, is_rms)
    _assert_close_to_oracle("y", y, theirs, y64, torch.bfloat16)
    for name, gi, g64, gt in zip(("dx", "dweight", "dbias"), grads, grads64, _grads(theirs, [xt, wt, bt], dy)):
        _assert_close_to_oracle(name, gi, gt, g64, torch.bfloat16)


def test_residual_in_another_dtype_is_added_in_fp32_and_rounded_once():
    x = torch.randn(3, 64).to(torch.bfloat16)
    r = torch.randn(3, 64) * 1e-3  # fp32, near bf16's resolution relative to x
    y, s = rms_norm(x, residual=r)
    assert s.dtype == torch.bfloat16
    assert s.equal((x.float() + r).to(torch.bfloat16))
    assert y.equal(rms_norm(s))  # the norm normalizes exactly the stream it returns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_offset_scales_by_offset_plus_weight(dtype):
    x, w, b, r = _make((7, 200), dtype, with_residual=True)
    y, s = rms_norm(x, w, b, residual=r, offset=1.0)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    y_shifted, _ = rms_norm(x, w.to(wide) + 1.0, b, residual=r)
    torch.testing.assert_close(y, y_shifted, rtol=0, atol=ATOL[dtype] * 10)
    xs, ws = _leaf(x), _leaf(w)
    dy = torch.randn(7, 200).to(dtype)
    dx, dw = torch.autograd.grad(rms_norm(xs, ws, offset=1.0), (xs, ws), dy)
    x64, w64 = _leaf(x, torch.float64), _leaf(w, torch.float64)
    dx64, dw64 = torch.autograd.grad(rms_norm_ref(x64, w64, offset=1.0), (x64, w64), dy.double())
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(dx.double(), dx64, rtol=tol, atol=tol)
    torch.testing.assert_close(dw.double(), dw64, rtol=tol, atol=tol)


def test_offset_without_weight_is_ignored():
    x = torch.randn(4, 32)
    torch.testing.assert_close(rms_norm(x, offset=1.0), rms_norm(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_over_one_element_is_constant_with_zero_input_gradient(dtype):
    """LN of one element is β whatever x is: y = β and dx = 0 exactly, even when rstd = 1/sqrt(eps) is huge."""
    x, w, b = _leaf(torch.randn(5, 1).to(dtype)), _leaf(torch.randn(1).to(dtype)), _leaf(torch.randn(1).to(dtype))
    y = layer_norm(x, w, b, eps=1e-12)
    assert torch.equal(y, b.detach().expand(5, 1))
    dx, = torch.autograd.grad(y, (x,), torch.randn(5, 1).to(dtype))
    assert torch.equal(dx, torch.zeros_like(dx))


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_layernorm_of_rows_with_large_mean_keeps_fp32_accuracy(is_rms):
    """The shifted one-pass variance must not cancel when |mean| ≫ std."""
    x = torch.randn(64, 768) * 0.01 + 1000.0
    y = _ours(is_rms)(x, eps=1e-12)
    y64 = _oracle(is_rms)(x.double(), eps=1e-12)
    theirs = _torch_norm(x, None, None, 1e-12, is_rms)
    _assert_close_to_oracle("y", y, theirs, y64, torch.float32)


def test_gradient_through_only_one_output_of_the_residual_form():
    x, w, b, r = (_leaf(t) for t in _make((4, 50), torch.float32, with_residual=True))
    y, s = rms_norm(x, w, b, residual=r)
    dx, dr = torch.autograd.grad(s.sum(), (x, r))  # y unused: the stream's gradient passes straight through
    assert torch.equal(dx, torch.ones_like(x)) and torch.equal(dr, torch.ones_like(r))
    y, s = rms_norm(x, w, b, residual=r)
    dx, dr = torch.autograd.grad(y.sum(), (x, r))  # s unused
    x64, w64, b64, r64 = (_leaf(t, torch.float64) for t in (x, w, b, r))
    dx64, = torch.autograd.grad(rms_norm_ref(x64, w64, b64, residual=r64)[0].sum(), (x64,))
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-5)
    assert torch.equal(dx, dr)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_outputs_large_enough_for_streaming_stores_match_fp64_oracle(is_rms):
    """≥ 16 MiB of fp32 output takes the kernel's non-temporal store path, forward and backward."""
    _check_against_oracle((1024, 4096), torch.float32, is_rms, with_residual=True)


def test_misaligned_out_buffer_is_written_correctly():
    """A contiguous but not vector-aligned ``out`` (storage offset 1) cannot take streaming stores."""
    x = torch.randn(1024, 4096)
    out = torch.empty(1024 * 4096 + 1)[1:].view(1024, 4096)
    rms_norm(x, out=out)
    torch.testing.assert_close(out, rms_norm(x), rtol=0, atol=0)


# ---------------------------------------------------------------- out=
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_out_receives_the_result_in_place(dtype, is_rms):
    x, w, b, r = _make((3, 5, 129), dtype, with_residual=True)
    fn = _ours(is_rms)
    out = torch.empty_like(x)
    pointer = out.data_ptr()
    y, s = fn(x, w, b, residual=r, out=out)
    assert y is out and out.data_ptr() == pointer
    y_ref, s_ref = fn(x, w, b, residual=r)
    torch.testing.assert_close(out, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert fn(x, w, b, out=torch.empty_like(x)).equal(fn(x, w, b))


def test_out_may_be_noncontiguous():
    x = torch.randn(6, 40)
    out = torch.empty(40, 6).t()
    assert rms_norm(x, out=out) is out
    torch.testing.assert_close(out, rms_norm(x), rtol=0, atol=0)


def test_out_with_wrong_shape_or_dtype_is_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"out must have shape \(4, 8\) and dtype torch.float32, got shape \(4, 9\)"):
        rms_norm(x, out=torch.empty(4, 9))
    with pytest.raises(ValueError, match="dtype torch.float32, got shape .* dtype torch.float16"):
        layer_norm(x, out=torch.empty(4, 8, dtype=torch.float16))


def test_out_is_refused_under_autograd():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="out= does not support autograd"):
        rms_norm(x, out=torch.empty(4, 8))
    with torch.no_grad():
        rms_norm(x, out=torch.empty(4, 8))


def test_out_that_requires_grad_is_refused_like_torch():
    """torch refuses to overwrite an out= tensor that requires grad, except under no_grad."""
    out = torch.zeros(4, 8, requires_grad=True)
    for fn in (rms_norm, layer_norm):
        for _ in range(2):  # the second call may take the eager shortcut
            with pytest.raises(ValueError, match="out= does not support autograd: expected an out tensor that "
                                                 "does not require grad"):
                fn(torch.randn(4, 8), out=out)
    assert out.detach().eq(0).all()
    with torch.no_grad():
        x = torch.randn(4, 8)
        assert rms_norm(x, out=out).equal(rms_norm(x))


def _overlap_case(name):
    """(x, weight, bias, residual, out) with out placed as named; x is 2-D float32 unless the name says."""
    shape, dtype = ((1024, 4096), torch.float32) if "streaming" in name else ((4, 8), torch.float32)
    dtype = {"bfloat16": torch.bfloat16, "float64": torch.float64}.get(name.rsplit(", ", 1)[-1], dtype)
    x, w, b, r = _make(shape, dtype, with_residual=True)
    base = torch.randn(5, 8)
    if name == "out partially overlaps x":
        base[:-1] = x
        return base[:-1], w, b, r, base[1:]
    if name == "out partially overlaps the residual":
        base[:-1] = r
        return x, w, b, base[:-1], base[1:]
    if name == "out is x shifted by one element":
        flat = torch.randn(33)
        return flat[:32].view(4, 8), w, b, r, flat[1:].view(4, 8)
    if name == "out is the weight":
        return x[0], w, b, None, w
    if name == "out is the bias":
        return x[0], w, b, None, b
    if name == "out is x viewed as another dtype":
        x = x.bfloat16()
        return x, None, None, x.view(torch.float16), x
    if name.startswith("out is x"):
        return x, w, b, r, x
    if name.startswith("out is the residual"):
        return x, w, b, r, r
    if name == "out is a disjoint part of x's storage":
        base = torch.randn(8, 8)
        base[:4] = x
        return base[:4], w, b, r, base[4:]
    if name == "out is x transposed":  # x is read through a contiguous copy before out is written
        x, w, b, r = _make((8, 8), dtype, with_residual=True)
        return x.t(), w, b, r, x
    if name == "out is another storage":
        return x, w, b, r, torch.empty_like(x)
    raise AssertionError(name)


OVERLAP_REFUSED = ["out partially overlaps x", "out partially overlaps the residual", "out is x shifted by one element",
                   "out is the weight", "out is the bias", "out is x viewed as another dtype"]
OVERLAP_ACCEPTED = ["out is x", "out is x, bfloat16", "out is x, float64", "out is the residual",
                    "out is the residual, bfloat16", "out is x (streaming sizes)", "out is the residual (streaming sizes)",
                    "out is a disjoint part of x's storage", "out is x transposed", "out is another storage"]


@pytest.mark.parametrize("shortcut", [True, False], ids=["eager-shortcut", "full-path"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("case", OVERLAP_REFUSED + OVERLAP_ACCEPTED)
def test_out_may_share_memory_only_as_exactly_x_or_the_residual(case, is_rms, shortcut, monkeypatch):
    """out= sharing elements with an input returned garbage (rows written before they were read); now
    ValueError with the inputs untouched. out exactly x or the residual is in-place normalisation:
    the same bits as a separate buffer, within the fp64 oracle's tolerance, and s = x + residual
    from before the write. Streaming sizes take the kernel's non-temporal stores."""
    from normfold.ops import functional

    monkeypatch.setattr(functional, "_eager_cpu_shortcut", shortcut)
    fn = _ours(is_rms)
    fn(torch.randn(2, 8))  # loads the kernel, so the shortcut (when on) is live
    x, w, b, r, out = _overlap_case(case)
    inputs = [t for t in (x, w, b, r) if t is not None]
    before = [t.clone() for t in inputs]
    if case in OVERLAP_REFUSED:
        with pytest.raises(ValueError, match="out must not share memory with (x|residual|weight|bias): expected "
                                             "a separate buffer.*refer to a single memory location"):
            fn(x, w, b, residual=r, out=out)
        assert all(t.equal(t0) for t, t0 in zip(inputs, before))
        return
    x0, r0 = before[0], before[-1]
    y_want, s_want = fn(x0, w, b, residual=r0)  # into fresh buffers
    y, s = fn(x, w, b, residual=r, out=out)
    assert y is out and y.equal(y_want) and s.equal(s_want)
    y64, s64 = _oracle(is_rms)(x0.double(), w.double(), b.double(), residual=r0.double())
    tol = 2 * ATOL[x0.dtype] * max(1.0, y64.abs().max().item())
    torch.testing.assert_close(y.double(), y64, rtol=0, atol=tol)
    assert all(t.equal(t0) for t, t0 in zip(inputs, before) if t is not out)


def test_out_overlap_is_refused_inside_a_compiled_graph_too():
    """Inductor re-inplaces the out= op onto the caller's view: the overlap check lives in the op's
    implementation, so the compiled call raises instead of writing garbage; out=x stays exact."""
    torch._dynamo.reset()
    w = 1 + 0.3 * torch.randn(64)

    def shifted(x, w):
        rms_norm(x[:-1], w, out=x[1:])
        return x

    def in_place(x, w):
        rms_norm(x, w, out=x)
        return x

    with pytest.raises(ValueError, match="out must not share memory with x"):
        torch.compile(shifted, fullgraph=True)(torch.randn(9, 64), w)
    x = torch.randn(9, 64)
    want = rms_norm_ref(x.double(), w.double())
    torch.testing.assert_close(torch.compile(in_place, fullgraph=True)(x.clone(), w).double(), want,
                               rtol=0, atol=1e-5 * want.abs().max().item())


# ---------------------------------------------------------------- bad input
class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


_X = torch.randn(2, 3, 8)
BAD_INPUTS = [
    # (kwargs, exception, message naming expected and received)
    (dict(weight=torch.ones(7)), ValueError, r"weight must have shape \(8,\).*got \(7,\)"),
    (dict(bias=torch.ones(2, 8)), ValueError, r"bias must have shape \(8,\).*got \(2, 8\)"),
    (dict(residual=torch.ones(2, 8)), ValueError, r"residual must have x's shape \(2, 3, 8\), got \(2, 8\)"),
    (dict(eps=0.0), ValueError, r"eps must be a finite number > 0, got 0.0"),
    (dict(eps=-1e-5), ValueError, r"eps must be a finite number > 0, got -1e-05"),
    (dict(eps=math.nan), ValueError, r"eps must be a finite number > 0, got nan"),
    (dict(eps=math.inf), ValueError, r"eps must be a finite number > 0, got inf"),
    (dict(x=torch.ones(3, 0)), ValueError, r"must be non-empty, got x.shape=\(3, 0\)"),
    (dict(x=torch.ones(2, 8, dtype=torch.int64)), TypeError, r"floating-point.*got torch.int64"),
    (dict(x=torch.ones(2, 8, dtype=torch.bool)), TypeError, r"floating-point.*got torch.bool"),
    (dict(x=torch.ones(2, 8, dtype=torch.complex64)), TypeError, r"floating-point.*got torch.complex64"),
    (dict(x=[1.0, 2.0]), TypeError, r"x must be a torch.Tensor, got list"),
    (dict(weight=torch.ones(8, dtype=torch.int32)), TypeError, r"weight must be floating-point, got torch.int32"),
]


@pytest.mark.parametrize("fn", [rms_norm, layer_norm], ids=["rms", "ln"])
@pytest.mark.parametrize("kwargs,exc,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_is_refused_before_any_work(fn, kwargs, exc, message):
    kwargs = dict(kwargs)
    x = kwargs.pop("x", _X)
    with _RecordOps() as recorder, pytest.raises(exc, match=message):
        fn(x, **kwargs)
    assert recorder.ops == [], f"ran {recorder.ops} before refusing"


def test_bad_offset_is_refused():
    with pytest.raises(ValueError, match="offset must be a finite number, got nan"):
        rms_norm(_X, offset=math.nan)


# ---------------------------------------------------------------- NaN / Inf isolation
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_row_stays_in_its_row(dtype, is_rms, bad):
    x = torch.randn(6, 300).to(dtype)
    x[2, 0] = bad  # first element: LayerNorm's shift value
    x[4, 150] = bad
    y = _ours(is_rms)(x, torch.ones(300, dtype=dtype))
    assert not torch.isfinite(y[2]).all() and not torch.isfinite(y[4]).all()
    clean = [0, 1, 3, 5]
    assert torch.isfinite(y[clean]).all()
    y_clean = _ours(is_rms)(x[clean], torch.ones(300, dtype=dtype))
    torch.testing.assert_close(y[clean], y_clean, rtol=0, atol=0)


def test_nonfinite_row_does_not_poison_weight_gradient_of_other_rows_in_backward():
    x = torch.randn(5, 64)
    x[1, 3] = math.nan
    xs, w = _leaf(x), torch.ones(64, requires_grad=True)
    dy = torch.zeros(5, 64)
    dy[[0, 2, 3, 4]] = torch.randn(4, 64)  # no gradient flows from the NaN row
    dx, _ = torch.autograd.grad(rms_norm(xs, w), (xs, w), dy)
    assert torch.isfinite(dx[[0, 2, 3, 4]]).all()


# ---------------------------------------------------------------- property test
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 300), is_rms=st.booleans(), with_residual=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_any_shape_and_scale_matches_fp64_oracle(m, n, is_rms, with_residual, dtype, seed, scale):
    x, w, b, r = _make((m, n), dtype, with_residual=with_residual, seed=seed)
    x = (x.float() * scale).to(dtype)
    out = _ours(is_rms)(x, w, b, residual=r)
    ref = _oracle(is_rms)(x.double(), w.double(), b.double(), residual=None if r is None else r.double())
    y, y64 = (out[0], ref[0]) if with_residual else (out, ref)
    st_ = x + r if r is not None else x
    theirs = _torch_norm(st_, w, b, 1e-5, is_rms)
    _assert_close_to_oracle("y", y, theirs, y64, dtype)


# ---------------------------------------------------------------- custom ops and dispatch
def _op_samples():
    x, w, b, r = _make((5, 70), torch.float32, with_residual=True)
    yield (x, w, b, r, 1e-5, 0.0, True)
    yield (x, w, b, None, 1e-5, 0.0, False)
    yield (x.to(torch.bfloat16), w, None, None, 1e-6, 1.0, True)
    yield (x.double(), w.double(), b.double(), r.double(), 1e-5, 0.0, False)
    yield (x.half(), w.half(), None, None, 1e-5, 0.0, False)


@pytest.mark.parametrize("args", list(_op_samples()), ids=["rms+res", "ln", "bf16+offset", "fp64", "fp16-no-bias"])
def test_registered_ops_pass_opcheck(args):
    x, w, b, r = (t.detach().requires_grad_(t.dtype != torch.bfloat16) if t is not None else None for t in args[:4])
    torch.library.opcheck(torch.ops.normfold.norm_fwd.default, (x, w, b, r, *args[4:]))
    y, s, mean, rstd = torch.ops.normfold.norm_fwd(*(t.detach() if t is not None else None for t in (x, w, b, r)),
                                                   *args[4:])
    has_res = r is not None
    bwd_args = (torch.randn_like(y), torch.randn_like(y) if has_res else None, s if has_res else x.detach(),
                w.detach(), mean if mean.numel() else None, rstd, args[5], args[6], b is not None)
    torch.library.opcheck(torch.ops.normfold.norm_bwd.default, bwd_args)
    out = torch.empty_like(x)
    torch.library.opcheck(torch.ops.normfold.norm_fwd_out.default,
                          (x.detach(), w.detach(), None, None, *args[4:], out, None))


def test_traced_op_path_and_eager_path_agree():
    x, w, b, r = _make((9, 130), torch.float32, with_residual=True)
    y, s, _, _ = torch.ops.normfold.norm_fwd(x, w, b, r, 1e-5, 0.0, False)
    y_eager, s_eager = layer_norm(x, w, b, residual=r)
    assert y.equal(y_eager) and s.equal(s_eager)


@pytest.mark.parametrize("case", ["float64", "float32, C++ entry off"])
def test_training_calls_off_the_cpp_entry_record_the_ops_one_autograd(case, monkeypatch):
    """Eager calls under autograd that the C++ CPU entry does not take (float64, CUDA, the reference
    fallback) are recorded by the registered op's autograd (``register_autograd``), the same as
    compiled and exported calls: no second Python autograd.Function. Gradients match the oracle."""
    from normfold.ops import functional

    dtype = torch.float64 if case == "float64" else torch.float32
    if case != "float64":
        monkeypatch.setattr(functional, "_eager_cpu_shortcut", False)
    x, w, b, r = (_leaf(t) for t in _make((12, 40), dtype, with_residual=True))  # 2-D: no view after the op
    y, s = rms_norm(x, w, b, residual=r, offset=0.5)
    assert "normfold_norm_fwd" in y.grad_fn.name() and "normfold_norm_fwd" in s.grad_fn.name()
    got = torch.autograd.grad((y.square().sum() + s.sum()), (x, w, b, r))
    leaves64 = [_leaf(t, torch.float64) for t in (x, w, b, r)]
    y64, s64 = rms_norm_ref(leaves64[0], leaves64[1], leaves64[2], residual=leaves64[3], offset=0.5)
    want = torch.autograd.grad((y64.square().sum() + s64.sum()), leaves64)
    for g, g64 in zip(got, want):
        torch.testing.assert_close(g.double(), g64, rtol=1e-4, atol=1e-5)


def test_backend_selection_by_dtype():
    x = torch.randn(2, 8)
    expected_cpu = _cpu if _cpu.kernel_available() else _reference_backend
    assert _library.select_backend(x) is expected_cpu
    assert _library.select_backend(x.to(torch.bfloat16)) is expected_cpu
    assert _library.select_backend(x.double()) is _reference_backend
    assert _library.select_backend(x.to(torch.bfloat16), residual=x) is _reference_backend


def test_cpu_kernel_builds_where_a_compiler_exists():
    import shutil

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine")
    assert _cpu.kernel_available(), _cpu.build_error()


def test_missing_cpu_kernel_falls_back_to_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(_cpu, "_module", None)
    monkeypatch.setattr(_cpu, "_error", "RuntimeError: no compiler (simulated)")
    monkeypatch.setattr(_library, "_warned", set())
    x, w, b, r = _make((4, 100), torch.float32, with_residual=True)
    with pytest.warns(RuntimeWarning, match=r"fused C\+\+ CPU kernel is unavailable .*no compiler \(simulated\)"):
        assert _library.select_backend(x) is _reference_backend
        xs, ws = _leaf(x), _leaf(w)
        y, s = rms_norm(xs, ws, b, residual=r)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        dx, dw = torch.autograd.grad((y * y).sum(), (xs, ws))
        layer_norm(x)
    y64, _ = rms_norm_ref(x.double(), w.double(), b.double(), residual=r.double())
    torch.testing.assert_close(y.double(), y64, rtol=0, atol=1e-5)
    x64, w64 = _leaf(x, torch.float64), _leaf(w, torch.float64)
    y64, _ = rms_norm_ref(x64, w64, b.double(), residual=r.double())
    dx64, dw64 = torch.autograd.grad((y64 * y64).sum(), (x64, w64))
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_reference_backend_backward_formula_matches_autograd(is_rms):
    """The analytic backward (the formula the kernels implement) against autograd in fp64."""
    x, w, _, _ = _make((6, 45), torch.float64)
    _, _, mean, rstd = _reference_backend.norm_fwd(x, w, None, None, 1e-5, 0.5, is_rms)
    dy, ds = torch.randn_like(x), torch.randn_like(x)
    dx, dw, db = _reference_backend.norm_bwd(dy, ds, x, w, mean, rstd, 0.5, is_rms, True)
    x64, w64, b64 = _leaf(x), _leaf(w), torch.zeros(45, dtype=torch.float64, requires_grad=True)
    y = _oracle(is_rms)(x64, w64, b64, 1e-5, offset=0.5)
    gx, gw, gb = torch.autograd.grad(y, (x64, w64, b64), dy)
    torch.testing.assert_close(dx, gx + ds)
    torch.testing.assert_close(dw, gw)
    torch.testing.assert_close(db, gb)


@pytest.mark.skipif(not _cpu.kernel_available(), reason="fused CPU kernel not built")
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_cpu_kernel_float64_matches_reference_backend(is_rms):
    """The dispatch sends fp64 to the reference, but the kernel compiles a double version too: pin it."""
    x, w, b, r = _make((7, 300), torch.float64, with_residual=True)
    got = _cpu.norm_fwd(x, w, b, r, 1e-5, 0.25, is_rms)
    want = _reference_backend.norm_fwd(x, w, b, r, 1e-5, 0.25, is_rms)
    for g, wt in zip(got, want):
        if wt is None:
            assert g is None
        else:
            torch.testing.assert_close(g, wt, rtol=1e-12, atol=1e-12)
    dy, ds = torch.randn_like(x), torch.randn_like(x)
    s, mean, rstd = want[1], want[2], want[3]
    for g, wt in zip(_cpu.norm_bwd(dy, ds, s, w, mean, rstd, 0.25, is_rms, True),
                     _reference_backend.norm_bwd(dy, ds, s, w, mean, rstd, 0.25, is_rms, True)):
        torch.testing.assert_close(g, wt, rtol=1e-12, atol=1e-12)
