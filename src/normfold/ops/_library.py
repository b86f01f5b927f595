"""The norm ops registered with ``torch.library``, and the backend each call runs on.

Three custom ops in the ``normfold`` namespace, each with a fake (meta) implementation so
``torch.compile(fullgraph=True)`` and ``torch.export`` see one opaque op and never graph-break:

- ``normfold::norm_fwd``     (x, weight?, bias?, residual?, eps, offset, is_rms) -> (y, s, mean, rstd)
- ``normfold::norm_bwd``     (dy, ds?, s, weight?, mean?, rstd, offset, is_rms, has_bias) -> (dx, dweight, dbias)
- ``normfold::norm_fwd_out`` like norm_fwd but writes y into ``out`` (and s into ``residual_out``); no autograd.
  ``out`` may be exactly x or the residual (in place), but share no other memory with an input.

``norm_fwd`` carries autograd through ``norm_bwd``. Inputs are 2-D (M, N) row-major; the
functional API in ``functional.py`` reshapes. Absent outputs (s without residual, mean for
RMSNorm, dweight without weight, ...) are empty tensors, because an op must return tensors.

Backend contract (each of ``_cpu``, ``_triton``, ``_reference_backend`` exposes it)::

    norm_fwd(x, weight, bias, residual, eps, offset, is_rms, out=None, residual_out=None)
        -> (y, s | None, mean | None, rstd)
    norm_bwd(dy, ds, s, weight, mean, rstd, offset, is_rms, has_bias)
        -> (dx, dweight | None, dbias | None)

s = x + residual (fp32 add, stored in x.dtype); y = (s − mean)·rstd·(offset + weight) + bias in
x.dtype; mean, rstd per row in fp32 (fp64 for fp64 inputs). dx includes ds; d(residual) = dx.
"""
from __future__ import annotations

import warnings
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _cpu, _reference_backend
from ._checks import check_out_overlap
from .reference import compute_dtype

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _cpu_backend() -> ModuleType | None:
    if _cpu.kernel_available():
        return _cpu
    error = _cpu.build_error() or ""
    remedy = ("Fix the cache folder's ownership or permissions, or point NORMFOLD_CACHE_DIR at a private folder"
              if error.startswith("UnsafeCacheError") else "Install a C++ compiler and ninja (`pip install ninja`)")
    _warn_once("cpu", f"normfold: the fused C++ CPU kernel is unavailable ({error}); "
                      f"using the slower pure-PyTorch reference. {remedy} to enable it.")
    return None


def _triton_backend() -> ModuleType | None:
    try:
        from . import _triton  # not at the top: it imports triton, an optional dependency
    except ImportError as exc:
        _warn_once("triton", f"normfold: Triton is unavailable ({exc}); CUDA norms use the slower "
                             "pure-PyTorch reference. Install it with `pip install 'normfold[triton]'`.")
        return None
    return _triton


def select_backend(x: Tensor, residual: Tensor | None = None) -> ModuleType:
    """The backend module for an input: fused kernels where they exist, else the reference.

    float64 always takes the reference (exact fp64, backward included); so does a residual
    whose dtype differs from x's, since the kernels add in x's element type.
    """
    if x.dtype not in _KERNEL_DTYPES or (residual is not None and residual.dtype != x.dtype):
        return _reference_backend
    backend = None
    if x.device.type == "cpu":
        backend = _cpu_backend()
    elif x.device.type == "cuda":
        backend = _triton_backend()
    return backend if backend is not None else _reference_backend


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """``t``, or an empty tensor of ``like``'s dtype and device standing for None."""
    return like.new_empty(0) if t is None else t


def _none_if_empty(t: Tensor) -> Tensor | None:
    return None if t.numel() == 0 else t


# ---------------------------------------------------------------- forward
def _norm_fwd_impl(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                   eps: float, offset: float, is_rms: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The chosen backend's forward on contiguous inputs; absent s and mean as empty tensors."""
    x, residual = x.contiguous(), None if residual is None else residual.contiguous()
    y, s, mean, rstd = select_backend(x, residual).norm_fwd(x, weight, bias, residual, eps, offset, is_rms)
    return y, _or_empty(s, x), _or_empty(mean, rstd), rstd


norm_fwd = torch.library.custom_op("normfold::norm_fwd", _norm_fwd_impl, mutates_args=())


@norm_fwd.register_fake
def _(x, weight, bias, residual, eps, offset, is_rms):
    m = x.shape[0]
    stat = compute_dtype(x)
    s = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    mean = x.new_empty(0 if is_rms else m, dtype=stat)
    return x.new_empty(x.shape), s, mean, x.new_empty(m, dtype=stat)


# ---------------------------------------------------------------- backward
def _norm_bwd_impl(dy: Tensor, ds: Optional[Tensor], s: Tensor, weight: Optional[Tensor], mean: Optional[Tensor],
                   rstd: Tensor, offset: float, is_rms: bool, has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    dy, ds = dy.contiguous(), None if ds is None else ds.contiguous()
    dx, dweight, dbias = select_backend(s).norm_bwd(dy, ds, s.contiguous(), weight, mean, rstd, offset,
                                                   is_rms, has_bias)
    # dweight / dbias come in the parameter dtype (weight's, else s's); absent ones are empty
    param = weight if weight is not None else s
    return dx, _or_empty(dweight, param), _or_empty(dbias, param)


norm_bwd = torch.library.custom_op("normfold::norm_bwd", _norm_bwd_impl, mutates_args=())


@norm_bwd.register_fake
def _(dy, ds, s, weight, mean, rstd, offset, is_rms, has_bias):
    n = s.shape[1]
    param_dtype = weight.dtype if weight is not None else s.dtype
    dweight = s.new_empty(n if weight is not None else 0, dtype=param_dtype)
    dbias = s.new_empty(n if has_bias else 0, dtype=param_dtype)
    return s.new_empty(s.shape), dweight, dbias


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, residual, eps, offset, is_rms = inputs
    _, s, mean, rstd = output
    ctx.save_for_backward(s if residual is not None else x, weight, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.offset, ctx.is_rms = offset, is_rms
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype


def _backward(ctx, dy, ds, _dmean, _drstd):
    """norm_fwd's autograd backward, through the norm_bwd op (so traced backwards show it too)."""
    s, weight, mean, rstd = ctx.saved_tensors
    has_residual = ctx.residual_dtype is not None
    if dy is None:  # only the returned residual stream was used
        dy = torch.zeros_like(s)
    dx, dweight, dbias = norm_bwd(dy, ds if has_residual else None, s, weight, _none_if_empty(mean), rstd,
                                  ctx.offset, ctx.is_rms, ctx.bias_dtype is not None)
    dresidual = dx.to(ctx.residual_dtype) if has_residual else None
    return (dx, dweight if weight is not None else None,
            dbias.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None,
            dresidual, None, None, None)


# The one autograd definition of a norm for every backend (the C++ CPU entry records the same
# kernels' backward, see functional.py).
norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- forward into given buffers
def _norm_fwd_out_impl(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                 eps: float, offset: float, is_rms: bool, out: Tensor, residual_out: Optional[Tensor]) -> None:
    x, residual = x.contiguous(), None if residual is None else residual.contiguous()
    # Write straight into contiguous buffers; others get a temporary and one copy.
    # ``out``/``residual_out`` have x's element count in any shape.
    y_buf = out.view(x.shape) if out.is_contiguous() else None
    s_buf = residual_out.view(x.shape) if residual_out is not None and residual_out.is_contiguous() else None
    if y_buf is not None:  # a temporary (copied into out at the end) cannot clash with the inputs
        check_out_overlap(y_buf, {"x": x, "residual": residual, "weight": weight, "bias": bias})
    y, s, _, _ = select_backend(x, residual).norm_fwd(x, weight, bias, residual, eps, offset, is_rms,
                                                     out=y_buf, residual_out=s_buf)
    if y_buf is None:
        out.copy_(y.view(out.shape))
    if residual_out is not None and s_buf is None:
        residual_out.copy_(s.view(residual_out.shape))


norm_fwd_out = torch.library.custom_op("normfold::norm_fwd_out", _norm_fwd_out_impl,
                                       mutates_args=("out", "residual_out"))


@norm_fwd_out.register_fake
def _(x, weight, bias, residual, eps, offset, is_rms, out, residual_out):
    return None


# ---------------------------------------------------------------- entry point
# The compile-time heuristic; its reasons are in ``_inline_for_compile``'s docstring (its one description).
_COMPILE_INLINE_MAX_ELEMENTS = 1 << 18


def _exporting() -> bool:
    """True while torch.export traces, and only then.

    torch 2.11's Dynamo answers ``torch.compiler.is_exporting()`` with True under every torch.compile
    (later releases read the flag), which kept every compiled norm on the opaque op: 0.46-0.48x the
    original's speed for a compiled, folded GPT-2 on an H200 (benchmarks/results/gpu_e2e.md). The flag
    it should read is the answer in every release tested (2.11, 2.13).
    """
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return bool(flag) if isinstance(flag, bool) else torch.compiler.is_exporting()


def _inline_for_compile(x: Tensor) -> bool:
    """True while torch.compile (not torch.export) traces a small 2-D ``x`` with static shape.

    Such a call is written as plain math (the reference's, ``_reference_backend.norm_fwd``) that
    Inductor fuses with its neighbours (the residual add, the consumer's input); autograd
    differentiates that math. Through the opaque op a compiled graph would call the dispatcher and
    the op's Python implementation, ~17 µs a call, more than the whole norm at decode sizes
    ((1..32, N)), and keep its input and output in memory. Measured on the compiled, folded bundled
    model at batch 8 × 128 (131K elements a norm): 1.01-1.02× the original inlined, 0.89-0.98×
    through the op; at GPT-2's 786K both are even (1.01 / 1.00). Larger calls, dynamic shapes,
    ``out=`` and torch.export keep the op: alone, the fused kernel beats Inductor's loop 2-5×
    (benchmarks/results/bench_norm.md, "compiled RMSNorm"), and an exported graph shows one
    ``normfold::norm_fwd`` per norm (what the ONNX translation and the fold's graph read).
    """
    if not torch.compiler.is_compiling() or _exporting():
        return False
    m, n = x.shape
    return isinstance(m, int) and isinstance(n, int) and m * n <= _COMPILE_INLINE_MAX_ELEMENTS


def _plain_eager(x: Tensor) -> bool:
    """True outside torch.compile / export / jit.trace / any dispatch mode: nothing records the call."""
    return (type(x) is Tensor and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and _get_current_dispatch_mode() is None)


def _records_autograd(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------- eager CUDA calls torch computes itself
# The largest call (elements) that plain eager CUDA runs on torch's own fused norm; the reasons are in
# ``_torch_native_suits``'s docstring (its one description).
_NATIVE_EAGER_MAX_ELEMENTS = 1 << 23


def _native_device(x: Tensor) -> bool:
    """x is a CUDA tensor and no CUDA graph is being captured (a replay pays no host cost per call)."""
    return x.is_cuda and not torch.cuda.is_current_stream_capturing()


def _torch_native_suits(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None,
                        offset: float, is_rms: bool) -> bool:
    """True when torch's own fused norm computes this call to the contract and is the cheaper route.

    Measured on an H200 host (benchmarks/results/gpu_overhead.md): an eager call costs the host 11 µs
    through ``F.rms_norm`` and 45-65 µs through the Triton route (Triton's launcher alone 21 µs), and
    a recorded fwd+bwd through the custom op ~1 ms of host time for 0.2 ms of kernels. At the sizes
    where eager models are host-bound (gpu_e2e.md: below ~8M elements a norm for GPT-2 small, where
    the folded model ran at 0.58-0.75x the original's speed) that cost decides. Larger calls keep the
    Triton kernels (1.2-2.7x torch's on the device, gpu_check.md); so do CUDA graph capture (no host
    cost to save), torch.compile, export and tracing (the op shows in their graphs).

    Contract: s = x + residual rounded once to x's dtype (what torch's add returns), y normalizes that
    s with float32 statistics. Torch has no RMSNorm bias or ``offset``, and takes one dtype.
    """
    if x.numel() > _NATIVE_EAGER_MAX_ELEMENTS or (is_rms and (bias is not None or offset != 0.0)):
        return False
    dtype = x.dtype  # one dtype (written out: a generator costs a decode call ~1 µs)
    return ((weight is None or weight.dtype == dtype) and (bias is None or bias.dtype == dtype)
            and (residual is None or residual.dtype == dtype))


def _torch_native_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None,
                       eps: float, is_rms: bool) -> tuple[Tensor, Tensor | None]:
    """(y, s) through ``F.rms_norm`` / ``F.layer_norm``, for calls ``_torch_native_suits`` accepts."""
    s = x if residual is None else x + residual  # (M, N), rounded once to x's dtype
    normalized = (x.shape[-1],)
    y = F.rms_norm(s, normalized, weight, eps) if is_rms else F.layer_norm(s, normalized, weight, bias, eps)
    return y, (s if residual is not None else None)


_LEGACY_ONNX_EXPORT = (
    "normfold's norms export to ONNX only through the dynamo exporter, not the legacy TorchScript one "
    "(dynamo=False): use normfold.export_onnx(model, example_inputs, path), or torch.onnx.export(model, args, "
    "dynamo=True, custom_translation_table=normfold.export.onnx_translations())")


def norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None, eps: float,
         offset: float, is_rms: bool, out: Tensor | None = None,
         residual_out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(y, s) for 2-D ``x`` (s is None without residual); arguments already checked (``_checks``).

    Every call is the registered op (``norm_fwd``, or ``norm_fwd_out`` for ``out=``), with its one
    autograd (``register_autograd`` above), except in three ways that keep its definition:
    small static shapes under torch.compile become plain math (``_inline_for_compile``); plain eager
    CUDA calls up to 8M elements that torch's own fused norm computes run it (``_torch_native_suits``);
    and an eager call that nothing records (no trace, no dispatch mode, no autograd) runs the op's
    implementation itself, without the dispatcher's ~20 µs (a CUDA decode step's norm costs less).
    """
    plain = _plain_eager(x)  # nothing traces: neither the ONNX check nor the compile heuristic applies
    if not plain and torch.jit.is_tracing() and torch.onnx.is_in_onnx_export():
        raise NotImplementedError(_LEGACY_ONNX_EXPORT)
    if not plain and out is None and _inline_for_compile(x):
        y, s, _, _ = _reference_backend.norm_fwd(x, weight, bias, residual, eps, offset, is_rms)
        return y, s
    if (plain and out is None and _native_device(x) and not torch.is_autocast_enabled(x.device.type)
            and _torch_native_suits(x, weight, bias, residual, offset, is_rms)):  # autocast would cast torch's norm
        return _torch_native_norm(x, weight, bias, residual, eps, is_rms)
    unrecorded = plain and not _records_autograd(x, weight, bias, residual)
    if out is not None:  # check_out refused autograd
        (_norm_fwd_out_impl if unrecorded else norm_fwd_out)(x, weight, bias, residual, eps, offset, is_rms, out,
                                                               residual_out)
        return out, residual_out
    y, s, _, _ = (_norm_fwd_impl if unrecorded else norm_fwd)(x, weight, bias, residual, eps, offset, is_rms)
    return y, (s if residual is not None else None)
