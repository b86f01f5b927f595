"""Functional normalization ops: fused RMSNorm / LayerNorm (+bias, +residual add)."""
from .functional import layer_norm, rms_norm
from .reference import layer_norm_ref, rms_norm_ref

__all__ = ["rms_norm", "layer_norm", "rms_norm_ref", "layer_norm_ref"]
