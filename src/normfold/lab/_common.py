"""What the lab's tools share: recognising norm modules, running a model on one batch in any of
the accepted forms, and picking the real (unpadded) tokens of a batch."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..nn import RMSNorm as _NormfoldRMSNorm

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def norm_kind(module: nn.Module) -> str | None:
    """"LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm", "InstanceNorm", or None if not a norm.

    Classes of other libraries (Hugging Face's ``T5LayerNorm``, ``LlamaRMSNorm``, ...) are
    recognised by name: a class whose name ends in ``LayerNorm``/``RMSNorm`` (case-insensitive)
    and that holds a ``weight``.
    """
    if isinstance(module, nn.LayerNorm):
        return "LayerNorm"
    if isinstance(module, (nn.RMSNorm, _NormfoldRMSNorm)):
        return "RMSNorm"
    if isinstance(module, nn.GroupNorm):
        return "GroupNorm"
    if isinstance(module, _BATCH_NORMS):
        return "BatchNorm"
    if isinstance(module, _INSTANCE_NORMS):
        return "InstanceNorm"
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


def as_batches(inputs) -> list:
    """One batch (tensor, tuple of positional args, dict of keyword args) or a list of them → a list.

    A list whose items are all tensors/tuples/dicts is a list of batches; a tuple is one batch.
    """
    if isinstance(inputs, list):
        if not inputs:
            raise ValueError("expected at least one batch, got an empty list")
        if all(isinstance(b, (Tensor, tuple, Mapping)) for b in inputs):
            return inputs
        raise TypeError(f"a list of batches must hold tensors, tuples or dicts, got {[type(b).__name__ for b in inputs]}")
    if isinstance(inputs, (Tensor, tuple, Mapping)):
        return [inputs]
    raise TypeError(f"inputs must be a tensor, a tuple of positional arguments, a dict of keyword arguments "
                    f"or a list of those, got {type(inputs).__name__}")


def call(model: nn.Module, batch) -> Any:
    """model(batch), model(*batch) or model(**batch)."""
    if isinstance(batch, Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(*batch)


def first_tensor(output) -> Tensor:
    """The main tensor of a model's output: the tensor itself, ``last_hidden_state``, ``logits``,
    or the first tensor of a tuple/dict."""
    if isinstance(output, Tensor):
        return output
    for name in ("last_hidden_state", "logits"):
        value = getattr(output, name, None)
        if isinstance(value, Tensor):
            return value
    values: Iterable = output.values() if isinstance(output, Mapping) else output
    for value in values:
        if isinstance(value, Tensor):
            return value
    raise TypeError(f"the model returned no tensor: {type(output).__name__}")


def token_mask(batch, leading_shape: torch.Size) -> Tensor | None:
    """The batch's ``attention_mask`` as a bool (B, T) mask if it matches ``leading_shape``, else None."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, Tensor) and tuple(mask.shape) == tuple(leading_shape[:2]) and len(leading_shape) >= 3:
            return mask.bool()
    return None


def rows(x: Tensor, batch=None) -> Tensor:
    """The feature vectors of ``x`` as (N, C): padded tokens dropped when the batch has a mask."""
    mask = token_mask(batch, x.shape) if batch is not None else None
    if mask is not None:
        return x[mask]  # (N_real, C)
    return x.reshape(-1, x.shape[-1])
