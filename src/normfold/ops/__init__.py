"""Functional normalization ops: fused RMSNorm / LayerNorm (+bias, +residual add).

CPU runs a fused C++ kernel (built on first use, see ``cpu_kernel_available``), CUDA runs
Triton kernels, float64 and other devices the pure-PyTorch reference.

On CPU the kernel's outputs of 256 KiB or more come from a bounded cache of freed buffers
(``NORMFOLD_CPU_CACHE_MB``, default 256, 0 = off): a freed large block would otherwise go
back to the OS and cost page faults when the next norm asks for it. See ``cpu_cache_info``
and ``empty_cpu_cache``. A float32 residual sum of 1 MiB or more is written with streaming
stores (``NORMFOLD_STREAM_SUM_KB``, default 1024, 0 = never): a model reads it only after the
next sublayer, when it would have left the cache anyway.
"""
from typing import NamedTuple

from . import _cpu
from .functional import layer_norm, rms_norm
from .reference import layer_norm_ref, rms_norm_ref


def cpu_kernel_available() -> bool:
    """True when the fused C++ CPU kernel is built and loaded (builds it on the first call)."""
    return _cpu.kernel_available()


class CpuCacheInfo(NamedTuple):
    """State of the CPU output-buffer cache (all zeros when the C++ kernel is not loaded)."""

    cached_bytes: int   # held now, ready for reuse
    cached_blocks: int
    hits: int           # allocations served from the cache since start
    misses: int         # allocations of cacheable size that had to go to the system
    limit_bytes: int    # NORMFOLD_CPU_CACHE_MB, read once at load


def cpu_cache_info() -> CpuCacheInfo:
    """How much the CPU kernel's output cache holds, and how often it served an allocation."""
    module = _cpu._module
    return CpuCacheInfo(*module.cpu_cache_info()) if module is not None else CpuCacheInfo(0, 0, 0, 0, 0)


def empty_cpu_cache() -> None:
    """Free every cached output buffer (tensors in use are not affected)."""
    if _cpu._module is not None:
        _cpu._module.empty_cpu_cache()


__all__ = ["rms_norm", "layer_norm", "rms_norm_ref", "layer_norm_ref", "cpu_kernel_available", "CpuCacheInfo",
           "cpu_cache_info", "empty_cpu_cache"]
