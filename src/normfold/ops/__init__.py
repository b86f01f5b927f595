"""Functional normalization ops: fused RMSNorm / LayerNorm (+bias, +residual add).

CPU runs a fused C++ kernel (built on first use, see ``cpu_kernel_available``), CUDA runs
Triton kernels, float64 and other devices the pure-PyTorch reference.
"""
from .functional import layer_norm, rms_norm
from .reference import layer_norm_ref, rms_norm_ref


def cpu_kernel_available() -> bool:
    """True when the fused C++ CPU kernel is built and loaded (builds it on the first call)."""
    from . import _cpu

    return _cpu.kernel_available()


__all__ = ["rms_norm", "layer_norm", "rms_norm_ref", "layer_norm_ref", "cpu_kernel_available"]
