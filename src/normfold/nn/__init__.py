"""Norm modules backed by normfold's fused ops."""
from .modules import FusedAddRMSNorm, RMSNorm

__all__ = ["RMSNorm", "FusedAddRMSNorm"]
