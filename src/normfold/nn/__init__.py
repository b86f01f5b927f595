"""Norm modules backed by normfold's fused ops."""
from .modules import FusedAddRMSNorm, LayerNorm, PermutedRMSNorm, RMSNorm

__all__ = ["RMSNorm", "FusedAddRMSNorm", "LayerNorm", "PermutedRMSNorm"]
