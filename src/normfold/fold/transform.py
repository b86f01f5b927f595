"""Apply a FoldPlan to a model (in place: callers pass a copy)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn import RMSNorm
from .math import center, fold_affine_into_consumer, fold_batchnorm_into_producer, layer_norm_rows, scale_output_channels
from .plan import BatchNormFoldStep, FoldPlan, LayerScaleStep, SwapStep


def apply_plan(model: nn.Module, plan: FoldPlan) -> nn.Module:
    """Merge BatchNorms and layer scales, untie, precompute, center, fold affines, swap norms — in that
    order (see ``normfold.fold.plan``)."""
    with torch.no_grad():
        for step in plan.batchnorm:
            _merge_batchnorm(model, step)
        for step in plan.layer_scale:
            _merge_layer_scale(model, step)
        for step in plan.untie:  # before centering: the copy keeps the original values
            original = model.get_parameter(step.source_fqn)
            owner = model.get_submodule(step.module_path)
            setattr(owner, step.attr, nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad))
        if plan.untie:
            untie_config(model)
        for step in plan.precompute:
            table = model.get_parameter(step.table_fqn)
            gamma = model.get_parameter(step.gamma_fqn) if step.gamma_fqn else None
            beta = model.get_parameter(step.beta_fqn) if step.beta_fqn else None
            table.copy_(layer_norm_rows(table, gamma, beta, step.eps))
        for step in plan.center:
            p = model.get_parameter(step.fqn)
            p.copy_(center(p, step.dim, step.group))
        for step in plan.affine_fold:
            _fold_affine(model, step)
        for step in plan.swap:
            swap_norm(model, step)
    return model


_TIE_FLAGS = ("tie_word_embeddings", "tie_embeddings")  # Hugging Face's; normfold's GPTConfig


def untie_config(model: nn.Module) -> None:
    """Mark the model's config untied when its input and output embeddings no longer share one tensor.

    Hugging Face models (and normfold's GPT) re-tie the output embedding to the input one on load
    while the config says they are tied, which would undo a fold that gave the head its own
    (uncentered) copy. A model that does not expose both embeddings (``get_input_embeddings`` /
    ``get_output_embeddings``: vision models, encoders without a head), or whose embeddings still
    share, keeps its config. The text config of a multimodal config is untied with it.
    """
    config = getattr(model, "config", None)
    emb_in, emb_out = _embedding(model, "get_input_embeddings"), _embedding(model, "get_output_embeddings")
    if config is None or emb_in is None or emb_out is None or emb_in.weight is emb_out.weight:
        return
    text = getattr(config, "get_text_config", lambda: config)()
    for holder in {id(config): config, id(text): text}.values():
        for flag in _TIE_FLAGS:
            if getattr(holder, flag, False):
                setattr(holder, flag, False)


def _embedding(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` (or output), None where the model has none: vision models
    (MobileViT, SegFormer) raise NotImplementedError, others return None or lack the method."""
    try:
        return getattr(model, getter)()
    except (AttributeError, NotImplementedError):
        return None


def _merge_batchnorm(model: nn.Module, step: BatchNormFoldStep) -> None:
    """The producer takes the BatchNorm's affine map; the BatchNorm becomes Identity, or, with
    ``keep_module``, an exact identity BatchNorm (γ=1, β=0, μ=0, σ²=1 − eps)."""
    weight = model.get_parameter(step.weight_fqn)
    bias = None if step.create_bias else model.get_parameter(step.bias_fqn)
    bn = model.get_submodule(step.norm_path)
    gamma = model.get_parameter(step.gamma_fqn) if step.gamma_fqn else None
    beta = model.get_parameter(step.beta_fqn) if step.beta_fqn else None
    new_weight, new_bias = fold_batchnorm_into_producer(weight, bias, model.get_buffer(step.mean_fqn),
                                                        model.get_buffer(step.var_fqn), gamma, beta, step.eps)
    weight.copy_(new_weight)
    if bias is None:
        owner_path, _, attr = step.bias_fqn.rpartition(".")
        model.get_submodule(owner_path).register_parameter(attr, nn.Parameter(new_bias,
                                                                               requires_grad=weight.requires_grad))
    else:
        bias.copy_(new_bias)
    if not step.keep_module:
        model.set_submodule(step.norm_path, nn.Identity())
        return
    bn.running_mean.zero_()
    bn.running_var.fill_(1.0 - step.eps)
    for p, value in ((gamma, 1.0), (beta, 0.0)):
        if p is not None:
            p.fill_(value)


def _merge_layer_scale(model: nn.Module, step: LayerScaleStep) -> None:
    """The producer takes the layer scale γ; γ becomes 1 (the multiply stays, now the identity)."""
    weight = model.get_parameter(step.weight_fqn)
    bias = model.get_parameter(step.bias_fqn) if step.bias_fqn else None
    scale = model.get_parameter(step.scale_fqn)
    new_weight, new_bias = scale_output_channels(weight, bias, scale)
    weight.copy_(new_weight)
    if bias is not None:
        bias.copy_(new_bias)
    scale.fill_(1.0)


def _fold_affine(model: nn.Module, step) -> None:
    w = model.get_parameter(step.weight_fqn)
    gamma = model.get_parameter(step.gamma_fqn) if step.gamma_fqn else None
    beta = model.get_parameter(step.beta_fqn) if step.beta_fqn else None
    if step.create_bias:
        owner_path, _, attr = step.bias_fqn.rpartition(".")
        owner = model.get_submodule(owner_path)
        n_out = w.shape[1 - step.in_dim]
        owner.register_parameter(attr, nn.Parameter(torch.zeros(n_out, dtype=w.dtype, device=w.device),
                                                     requires_grad=w.requires_grad))
    b = model.get_parameter(step.bias_fqn) if step.bias_fqn else None
    new_w, new_b = fold_affine_into_consumer(w, b, gamma, beta, step.in_dim)
    w.copy_(new_w)
    if b is not None:
        b.copy_(new_b)


def swap_norm(model: nn.Module, step: SwapStep, *, share_parameters: bool = False) -> None:
    """Carry out one swap step: the norm at ``step.path`` becomes an Identity, a normfold
    ``RMSNorm`` or a torch ``LayerNorm`` holding the old module's γ/β (copies, or with
    ``share_parameters`` the same Parameters, which CBWC trains on)."""
    old = model.get_submodule(step.path)
    if step.to == "Identity":
        model.set_submodule(step.path, nn.Identity().train(old.training))
        return
    cls = RMSNorm if step.to == "RMSNorm" else nn.LayerNorm
    new = norm_like(old, cls, step.normalized_shape, step.eps,
                    weight=old.weight if step.elementwise_affine else None,
                    bias=old.bias if step.elementwise_affine and step.bias else None,
                    share_parameters=share_parameters, offset=step.offset)
    model.set_submodule(step.path, new)


def norm_like(old: nn.Module, cls: type[nn.Module], normalized_shape, eps: float, *, weight: Tensor | None,
              bias: Tensor | None, share_parameters: bool = False, offset: float = 0.0) -> nn.Module:
    """A ``cls`` norm (normfold ``RMSNorm`` or torch ``LayerNorm``) to stand where ``old`` stands:
    on its device and dtype, in its train/eval mode, holding γ = ``weight`` and β = ``bias``.

    The one LayerNorm → RMSNorm swap of the fold, the Hugging Face reload, CBWC and the approximate
    fold. Values are copied (cast to ``old``'s dtype), or with ``share_parameters`` the given
    Parameters themselves are held. Neither given: no affine; β without γ: γ = 1. ``offset``: the
    RMSNorm scales by (offset + γ) (a torch LayerNorm has no offset: only 0 is accepted for it).
    """
    if offset and cls is not RMSNorm:
        raise ValueError(f"only normfold's RMSNorm scales by (offset + γ); got offset={offset} for {cls.__name__}")
    ref = next((t for t in (getattr(old, "weight", None), getattr(old, "bias", None)) if t is not None), None)
    factory = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
    affine = weight is not None or bias is not None
    options = {"offset": offset} if offset else {}
    new = cls(normalized_shape, eps=eps, elementwise_affine=affine, bias=bias is not None, **options, **factory)
    with torch.no_grad():
        for name, value in (("weight", weight), ("bias", bias)):
            if value is None:
                continue
            if share_parameters:
                assert isinstance(value, nn.Parameter), f"{name} to share is a {type(value).__name__}"
                setattr(new, name, value)
            else:
                getattr(new, name).copy_(value)
    return new.train(old.training)
