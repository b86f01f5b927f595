"""Public functional norms: where every norm call enters, and the one route it takes.

The modules (``nn.RMSNorm``, ``nn.FusedAddRMSNorm``, ``nn.LayerNorm``) and fused forwards
(``fuse/runtime.py``) call ``rms_norm`` / ``layer_norm``, never a backend or a ``torch.ops.normfold``
op. A call goes through three stages, each in one place:

1. ``_norm`` offers an eager CPU call to the C++ kernel's entry (``norm_fwd_eager``, in
   ``ops/csrc/norm_cpu.cpp``): one C++ call that takes only plain calls (plain CPU tensors of a
   kernel dtype, Python floats, nothing tracing, no dispatch mode, vmap or forward-mode AD) and
   runs the kernel; under autograd it records the same kernels' backward in C++
   (``EagerNormFunction``, what ``_library``'s autograd does, without a Python autograd.Function,
   whose apply costs as much as the kernel at (2048, 144)). It raises for no argument: it returns
   None for anything it does not take, and the call goes on.
2. The argument contract, ``_checks.check_norm_args`` / ``check_out``: every refusal and its message
   (the backends only guard their own invariants). Leading dimensions are then flattened.
3. ``_library.norm``: the registered op ``normfold::norm_fwd`` (``norm_fwd_out`` for ``out=``) with
   its one autograd, on the backend ``_library.select_backend`` picks (C++ on CPU, Triton on CUDA,
   the reference for float64, mixed dtypes or a missing backend). Small static shapes under
   torch.compile are the op's math inlined for Inductor (the heuristic: ``_library._inline_for_compile``).
"""
from __future__ import annotations

from torch import Tensor

from torch.compiler import is_compiling

from . import _cpu, _library
from ._checks import check_norm_args, check_out

# False skips stage 1, so every call reaches ``_library.select_backend`` (tests that substitute a
# backend switch it off).
_eager_cpu_shortcut = True


def _norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, residual: Tensor | None,
          offset: float, out: Tensor | None, is_rms: bool) -> Tensor | tuple[Tensor, Tensor]:
    # Stage 1 (module docstring): ~2 µs instead of ~8 µs of Python around the kernel, what a batch-1
    # decode step is made of. None means "not plain": the stages below check, raise, trace or record.
    kernel = _cpu._module  # None until the first full-path call has built / loaded it
    if kernel is not None and _eager_cpu_shortcut and getattr(x, "is_cpu", False) and not is_compiling():
        result = kernel.norm_fwd_eager(x, weight, bias, residual, eps, offset, is_rms, out)
        if result is not None:
            return result
    check_norm_args(x, weight, bias, eps, residual, offset)
    if out is not None:
        check_out(out, x, (x, weight, bias, residual))
    shape, n = x.shape, x.shape[-1]
    flat = x.dim() == 2  # already (M, N): no reshape to pay for
    x2d = x if flat else x.reshape(-1, n)  # (M, N)
    r2d = None if residual is None else (residual if flat else residual.reshape(-1, n))
    eps, offset = float(eps), float(offset)
    s_out = None if out is None or residual is None else x.new_empty(shape)
    y, s = _library.norm(x2d, weight, bias, r2d, eps, offset, is_rms, out, s_out)
    if out is not None:
        return out if residual is None else (out, s_out)
    if x.dim() != 2:  # back to the caller's leading dimensions
        y, s = y.view(shape), None if s is None else s.view(shape)
    return y if residual is None else (y, s)


def rms_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-6, *,
             residual: Tensor | None = None, offset: float = 0.0,
             out: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dimension: y = s / sqrt(mean(s²) + eps) · (offset + weight) + bias.

    s = x, or x + residual; with ``residual`` returns ``(y, s)``, the pre-norm residual stream.
    ``out`` (x's shape and dtype) receives y without an extra copy; it does not support autograd. It may
    be x or the residual itself (in place); any other memory shared with an input raises ValueError.
    """
    return _norm(x, weight, bias, eps, residual, offset, out, is_rms=True)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5, *,
               residual: Tensor | None = None, out: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """LayerNorm over the last dimension: y = (s − mean(s)) / sqrt(var(s) + eps) · weight + bias.

    Same options as ``rms_norm`` (biased variance, as ``torch.nn.LayerNorm``).
    """
    return _norm(x, weight, bias, eps, residual, 0.0, out, is_rms=False)
