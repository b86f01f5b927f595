"""Which modules are norms, and of which kind: the one definition the fold engine, the lab, fusion,
the benchmarks and the Hugging Face paths share.

The type tuples name the classes normfold knows exactly (torch's and normfold's own);
:func:`norm_kind` also recognises other libraries' norms by their class name.
"""
from __future__ import annotations

from torch import nn

from .modules import LayerNorm, RMSNorm

__all__ = ["LAYER_NORM_TYPES", "RMS_NORM_TYPES", "GROUP_NORM_TYPES", "BATCH_NORM_TYPES",
           "INSTANCE_NORM_TYPES", "norm_kind", "norm_modules"]

LAYER_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, LayerNorm)
RMS_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.RMSNorm, RMSNorm)  # FusedAddRMSNorm is an RMSNorm
GROUP_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.GroupNorm,)
BATCH_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
INSTANCE_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

_KINDS_BY_TYPE = (("LayerNorm", LAYER_NORM_TYPES), ("RMSNorm", RMS_NORM_TYPES), ("GroupNorm", GROUP_NORM_TYPES),
                  ("BatchNorm", BATCH_NORM_TYPES), ("InstanceNorm", INSTANCE_NORM_TYPES))


def norm_kind(module: nn.Module) -> str | None:
    """"LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm", "InstanceNorm", or None if not a norm.

    Classes of other libraries (Hugging Face's ``T5LayerNorm``, ``LlamaRMSNorm``, ...) are
    recognised by name: a leaf class whose name ends in ``LayerNorm``/``RMSNorm`` (case-insensitive)
    and that holds a ``weight``.
    """
    for kind, types in _KINDS_BY_TYPE:
        if isinstance(module, types):
            return kind
    name = type(module).__name__.lower()
    if hasattr(module, "weight") and not list(module.children()):
        if name.endswith("rmsnorm"):
            return "RMSNorm"
        if name.endswith("layernorm") or name.endswith("layer_norm"):
            # T5's "LayerNorm" has no mean subtraction and no bias: it is an RMSNorm.
            return "LayerNorm" if getattr(module, "bias", None) is not None else "RMSNorm"
    return None


def norm_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(path, module, kind) of every norm module, in registration order."""
    found = []
    for path, module in model.named_modules():
        kind = norm_kind(module)
        if kind is not None:
            found.append((path, module, kind))
    return found
