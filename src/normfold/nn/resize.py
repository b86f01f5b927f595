"""Giving a model a parameter of another shape: every module attribute holding the old one (tied names
too) gets the new one, and the layer attributes that state the shape follow (``in_features``,
``embedding_dim``, Hugging Face Conv1D's ``nf``, which its forward reads). Used by slicing
(``normfold.rotate``) and by ``normfold.from_pretrained`` to rebuild a sliced folder."""
from __future__ import annotations

from torch import Tensor, nn


def replace_parameter(model: nn.Module, old: nn.Parameter, value: Tensor) -> nn.Parameter:
    """Put one new Parameter holding ``value`` wherever ``model`` holds ``old``; returns it."""
    new = nn.Parameter(value, requires_grad=old.requires_grad)
    for fqn, p in list(model.named_parameters(remove_duplicate=False)):
        if p is old:
            owner_path, _, attr = fqn.rpartition(".")
            owner = model.get_submodule(owner_path)
            setattr(owner, attr, new)
            sync_shape_attributes(owner)
    return new


def sync_shape_attributes(module: nn.Module) -> None:
    """The attributes of ``module`` that state its weight's shape, set from the weight."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        return
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = weight.shape
    elif isinstance(module, nn.Embedding):
        module.embedding_dim = weight.shape[1]
    elif isinstance(module, nn.modules.conv._ConvNd):
        out_dim, in_dim = (1, 0) if module.transposed else (0, 1)
        module.out_channels = weight.shape[out_dim] * (module.groups if module.transposed else 1)
        module.in_channels = weight.shape[in_dim] * (1 if module.transposed else module.groups)
    elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # Hugging Face: weight (nx, nf)
        module.nx, module.nf = weight.shape
