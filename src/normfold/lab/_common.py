"""What the lab's tools share: running a model on one batch in any of the accepted forms, and
picking the real (unpadded) tokens of a batch. Which modules are norms: :mod:`normfold.nn.kinds`."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn


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
