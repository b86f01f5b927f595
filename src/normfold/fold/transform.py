"""Apply a FoldPlan to a model (in place: callers pass a copy)."""
from __future__ import annotations

import torch
from torch import nn

from .math import center, fold_affine_into_consumer, fold_batchnorm_into_producer, layer_norm_rows
from .plan import BatchNormFoldStep, FoldPlan, SwapStep


def apply_plan(model: nn.Module, plan: FoldPlan) -> nn.Module:
    """Merge BatchNorms, untie, precompute, center, fold affines, swap norms — in that order (see
    ``normfold.fold.plan``)."""
    with torch.no_grad():
        for step in plan.batchnorm:
            _merge_batchnorm(model, step)
        for step in plan.untie:  # before centering: the copy keeps the original values
            original = model.get_parameter(step.source_fqn)
            owner = model.get_submodule(step.module_path)
            setattr(owner, step.attr, nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad))
        if plan.untie:
            _untie_config(model)
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
            _swap(model, step)
    return model


def _untie_config(model: nn.Module) -> None:
    """Hugging Face models re-tie embeddings on load unless the config says otherwise."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False


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


def _swap(model: nn.Module, step: SwapStep) -> None:
    from ..nn import RMSNorm

    old = model.get_submodule(step.path)
    parent_path, _, name = step.path.rpartition(".")
    if step.to == "Identity":
        setattr(model.get_submodule(parent_path), name, nn.Identity())
        return
    ref = old.weight if getattr(old, "weight", None) is not None else None
    factory = {"device": ref.device if ref is not None else None, "dtype": ref.dtype if ref is not None else None}
    if step.to == "RMSNorm":
        new = RMSNorm(step.normalized_shape, eps=step.eps, elementwise_affine=step.elementwise_affine,
                      bias=step.bias, **factory)
    else:
        new = nn.LayerNorm(step.normalized_shape, eps=step.eps, elementwise_affine=step.elementwise_affine,
                           bias=step.bias, **factory)
    if step.elementwise_affine:
        new.weight.copy_(old.weight)
        if step.bias:
            new.bias.copy_(old.bias)
    new.train(old.training)
    parent_path, _, name = step.path.rpartition(".")
    setattr(model.get_submodule(parent_path), name, new)
