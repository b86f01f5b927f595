"""Triton GPU backend of the norm ops (imports triton; ``import normfold`` never imports this).

``norm_fwd`` / ``norm_bwd`` follow the backend contract shared with the CPU kernel: 2-D
row-major (M, N) inputs, fp32 statistics, RMSNorm or LayerNorm with optional weight, bias,
residual add and weight offset. Under ``TRITON_INTERPRET=1`` they run on CPU tensors.
"""
try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("normfold's GPU kernels need Triton: pip install 'normfold[triton]'") from e

from .launch import BWD_MAX_BLOCK, FWD_MAX_BLOCK, LaunchPlan, norm_bwd, norm_fwd, plan_launch

__all__ = ["norm_fwd", "norm_bwd", "plan_launch", "LaunchPlan", "FWD_MAX_BLOCK", "BWD_MAX_BLOCK"]
