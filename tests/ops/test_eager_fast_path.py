"""The eager CPU shortcut (``norm_fwd_eager``): taken for plain no-autograd calls, bit-identical to
the registered op, and declined (None) for everything the full path must see — subclasses,
autograd, dispatch modes, vmap, dtypes and numbers it does not take, and every bad input, which
must still raise the full path's typed errors."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from normfold.ops import _cpu, layer_norm, rms_norm
from test_norm_ops import BAD_INPUTS, _X

pytestmark = pytest.mark.skipif(not _cpu.kernel_available(), reason="needs the fused C++ CPU kernel")


def _fast(x, weight=None, bias=None, residual=None, eps=1e-5, offset=0.0, is_rms=True, out=None):
    return _cpu._module.norm_fwd_eager(x, weight, bias, residual, eps, offset, is_rms, out)


def _args(shape=(3, 5, 33), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(*shape, generator=g).to(dtype)
    return x, (1 + 0.3 * torch.randn(n, generator=g)).to(dtype), torch.randn(n, generator=g).to(dtype), \
        torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("options", ["plain", "weight", "weight+bias", "residual", "all+offset", "noncontig"])
def test_shortcut_is_bit_identical_to_the_registered_op(dtype, is_rms, options):
    x, w, b, r = _args(dtype=dtype)
    weight = w if options in ("weight", "weight+bias", "all+offset") else None
    bias = b if options in ("weight+bias", "all+offset") else None
    residual = r if options in ("residual", "all+offset") else None
    offset = 0.25 if options == "all+offset" and is_rms else 0.0
    if options == "noncontig":
        x = x.transpose(0, 1)
    with torch.no_grad():
        fast = _fast(x, weight, bias, residual, 1e-5, offset, is_rms)
        n = x.shape[-1]
        r2d = None if residual is None else residual.reshape(-1, n)
        y, s, _, _ = torch.ops.normfold.norm_fwd(x.reshape(-1, n), weight, bias, r2d, 1e-5, offset, is_rms)
    y_fast = fast if residual is None else fast[0]
    assert y_fast.shape == x.shape and y_fast.dtype == x.dtype and y_fast.is_contiguous()
    assert y_fast.reshape(-1, n).equal(y)
    if residual is not None:
        assert fast[1].shape == x.shape and fast[1].reshape(-1, n).equal(s)


def test_public_api_returns_the_shortcut_result_and_empty_rows_work():
    x, w, b, r = _args()
    with torch.no_grad():
        assert rms_norm(x, w, b).equal(_fast(x, w, b, eps=1e-6))
        y, s = layer_norm(x, w, b, residual=r)
        y2, s2 = _fast(x, w, b, r, is_rms=False)
        assert y.equal(y2) and s.equal(s2)
        empty = torch.randn(0, 4, 16)
        assert _fast(empty).shape == (0, 4, 16) and rms_norm(empty).shape == (0, 4, 16)


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_shortcut_writes_out_in_place_and_returns_the_callers_tensor(with_residual):
    x, w, b, r = _args((64, 300))
    residual = r if with_residual else None
    buf = torch.full_like(x, math.nan)
    with torch.no_grad():
        expected = rms_norm(x, w, b, residual=residual)
        got = _fast(x, w, b, residual, 1e-6, 0.0, True, buf)
        public = rms_norm(x, w, b, residual=residual, out=torch.empty_like(x))
    y = got[0] if with_residual else got
    assert y is buf
    for e, g in ((expected, got), (expected, public)):
        if with_residual:
            assert e[0].equal(g[0]) and e[1].equal(g[1])
        else:
            assert e.equal(g)


def test_shortcut_leaves_out_sharing_memory_with_an_input_to_the_full_path():
    """A partial overlap (rows written before they are read) or out= the weight goes the full way,
    which raises; out exactly x or the residual (in place, each element read before it is written)
    and a disjoint part of one storage stay on the shortcut."""
    x, w, b, r = _args((4, 33))
    base, square = torch.randn(5, 33), torch.randn(33, 33)
    with torch.no_grad():
        declined = {
            "out partially overlaps x": lambda: _fast(base[:-1], w, out=base[1:]),
            "out partially overlaps the residual": lambda: _fast(x, w, residual=base[:-1], out=base[1:]),
            "out is the weight": lambda: _fast(x[0], w, out=w),
            "out is the bias": lambda: _fast(x[0], w, b, out=b),
            "out is x transposed": lambda: _fast(square.t(), out=square),  # the full path copies x first
        }
        for name, call in declined.items():
            assert call() is None, name
        x_in, r_in = x.clone(), r.clone()
        assert _fast(x_in, w, b, r_in, out=x_in)[0] is x_in
        assert _fast(x, w, b, r_in, out=r_in)[0] is r_in
        assert _fast(base[:2], w, out=base[2:4]) is not None


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Sub(torch.Tensor):
    pass


def test_shortcut_declines_what_the_full_path_must_handle():
    x, w, b, r = _args()
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        declined = {
            "out= under autograd": lambda: _fast(x.clone().requires_grad_(), w, out=torch.empty_like(x)),
            "forward-mode dual x": lambda: _fast(dual, w),
            "forward-mode dual weight": lambda: _fast(x, fwAD.make_dual(w, torch.ones_like(w))),
            "forward-mode dual residual": lambda: _fast(x, residual=fwAD.make_dual(r, torch.ones_like(r))),
        }
        for name, call in declined.items():
            assert call() is None, name
    with torch.no_grad():
        assert _fast(x, torch.nn.Parameter(w.clone())) is not None  # a Parameter is fine without grad
        declined = {
            "tensor subclass": lambda: _fast(x.as_subclass(_Sub), w),
            "float64": lambda: _fast(x.double()),
            "integer x": lambda: _fast(x.long()),
            "0-d x": lambda: _fast(torch.tensor(1.0)),
            "empty last dim": lambda: _fast(torch.ones(3, 0)),
            "meta device": lambda: _fast(x.to("meta")),
            "residual of another dtype": lambda: _fast(x, residual=r.bfloat16()),
            "residual of another shape": lambda: _fast(x, residual=r[:1]),
            "weight of wrong size": lambda: _fast(x, w[:-1]),
            "weight of wrong rank": lambda: _fast(x, w.expand(2, -1)),
            "integer weight": lambda: _fast(x, w.int()),
            "weight not a tensor": lambda: _fast(x, [1.0] * 33),
            "int eps": lambda: _fast(x, eps=1),
            "zero eps": lambda: _fast(x, eps=0.0),
            "nan eps": lambda: _fast(x, eps=math.nan),
            "inf offset": lambda: _fast(x, offset=math.inf),
            "string eps": lambda: _fast(x, eps="1e-5"),
            "sparse x": lambda: _fast(torch.eye(4).to_sparse()),
            "out of another dtype": lambda: _fast(x, out=torch.empty_like(x).bfloat16()),
            "out of another shape": lambda: _fast(x, out=torch.empty(3, 5, 34)),
            "non-contiguous out": lambda: _fast(x, out=torch.empty(5, 3, 33).transpose(0, 1)),
            "out not a tensor": lambda: _fast(x, out=[0.0]),
        }
        for name, call in declined.items():
            assert call() is None, name
        with _PassThrough():
            assert _fast(x, w) is None
        seen_under_vmap = []
        torch.vmap(lambda row: seen_under_vmap.append(_fast(row, w)) or row)(x)
        assert seen_under_vmap == [None]


@pytest.mark.parametrize("fn", [rms_norm, layer_norm], ids=["rms", "ln"])
@pytest.mark.parametrize("kwargs,exc,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_still_raises_once_the_shortcut_is_live(fn, kwargs, exc, message):
    kwargs = dict(kwargs)
    x = kwargs.pop("x", _X)
    with torch.no_grad(), pytest.raises(exc, match=message):
        fn(x, **kwargs)


def test_shortcut_shows_in_the_profiler_as_one_op_per_call():
    from torch.profiler import profile

    x, w, b, r = _args()
    with torch.no_grad(), profile(record_shapes=True) as prof:
        rms_norm(x, w)
        layer_norm(x, w, b, residual=r)
    events = [(e.name, e.input_shapes[0]) for e in prof.events() if e.name.startswith("normfold::")]
    assert events == [("normfold::rms_norm", list(x.shape)), ("normfold::layer_norm", list(x.shape))]


def test_jit_trace_records_the_norm_instead_of_baking_in_its_output():
    from normfold.nn import RMSNorm

    norm = RMSNorm(33, bias=True)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
        traced = torch.jit.trace(norm, torch.randn(4, 33))
        fresh = torch.randn(4, 33)
        assert traced(fresh).equal(norm(fresh))
    assert "normfold::norm_fwd" in str(traced.graph)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("options", ["plain", "weight", "weight+bias", "residual", "all+offset", "noncontig"])
def test_training_calls_take_the_shortcut_with_gradients_bit_identical_to_the_registered_op(dtype, is_rms, options):
    x, w, b, r = _args(dtype=dtype)
    weight = w.float() if options in ("weight", "weight+bias", "all+offset") else None  # fp32 params, as in mixed precision
    bias = b.float() if options in ("weight+bias", "all+offset") else None
    residual = r if options in ("residual", "all+offset") else None
    offset = 0.25 if options == "all+offset" and is_rms else 0.0
    if options == "noncontig":
        x = x.transpose(0, 1)
    n = x.shape[-1]
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias, residual) if t is not None]
    fast = _fast(*_fill(leaves, weight, bias, residual), 1e-5, offset, is_rms)
    assert fast is not None, "an eager training call must take the C++ route"
    y_fast, s_fast = (fast, None) if residual is None else fast
    assert "EagerNormFunction" in y_fast.grad_fn.name()
    leaves_op = [t.detach().clone().requires_grad_() for t in leaves]
    xo, wo, bo, ro = _fill(leaves_op, weight, bias, residual)
    y_op, s_op, _, _ = torch.ops.normfold.norm_fwd(xo.reshape(-1, n), wo, bo, None if ro is None else ro.reshape(-1, n),
                                                   1e-5, offset, is_rms)
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    ds = torch.randn(x.shape, generator=g).to(dtype)
    assert y_fast.reshape(-1, n).equal(y_op)
    outs_fast, outs_op, grads = [y_fast], [y_op.view(x.shape)], [dy]
    if residual is not None:
        assert s_fast.reshape(-1, n).equal(s_op)
        outs_fast.append(s_fast)
        outs_op.append(s_op.view(x.shape))
        grads.append(ds)
    got = torch.autograd.grad(outs_fast, leaves, grads)
    expected = torch.autograd.grad(outs_op, leaves_op, grads)
    for a, e in zip(got, expected):
        assert a.dtype == e.dtype and a.shape == e.shape and a.equal(e)


def _fill(leaves, weight, bias, residual):
    """(x, weight, bias, residual) from the leaves made of the present ones, None where absent."""
    it = iter(leaves)
    return next(it), *(next(it) if t is not None else None for t in (weight, bias, residual))


def test_training_shortcut_works_under_activation_checkpointing_and_saved_tensor_hooks():
    from torch.utils.checkpoint import checkpoint

    x, w, b, _ = _args((4, 7, 64))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    expected = torch.autograd.grad(rms_norm(*leaves).square().sum(), leaves)
    got = torch.autograd.grad(checkpoint(lambda *a: rms_norm(*a).square(), *leaves, use_reentrant=False).sum(),
                              leaves)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = rms_norm(*leaves)
        assert "EagerNormFunction" in y.grad_fn.name()  # the C++ route, not the Python autograd.Function
        hooked = torch.autograd.grad(y.square().sum(), leaves)
    assert len(packed) >= 3, "x, weight and rstd must go through the saved-tensor hooks"
    for e, a, h in zip(expected, got, hooked):
        assert a.equal(e) and h.equal(e)
