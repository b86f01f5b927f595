"""Norm modules backed by normfold's fused ops."""
from .modules import FusedAddRMSNorm, LayerNorm, RMSNorm

__all__ = ["RMSNorm", "FusedAddRMSNorm", "LayerNorm"]
