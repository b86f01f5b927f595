"""Apply a FoldPlan to a model (in place: callers pass a copy): the plan executor
(``normfold.engine.executor``) over the model's parameters, and the module surgery it needs (the one
norm swap, untying a config)."""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from ..nn import PermutedRMSNorm, RMSNorm
from .executor import run
from .plan import FoldPlan, SwapStep


def apply_plan(model: nn.Module, plan: FoldPlan) -> nn.Module:
    """Merge BatchNorms and layer scales, untie, precompute, center, fold affines, swap norms — in that
    order (see ``normfold.engine.plan``)."""
    run(plan.steps(), ModuleStore(model))
    if plan.untie:
        untie_config(model)
    return model


class ModuleStore:
    """The executor's store for a model: its parameters and buffers by fully-qualified name, changed
    in place, on whole tensors; swapping a norm and removing a merged BatchNorm are module surgery."""

    chunk = None

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def read(self, name: str) -> Tensor:
        try:
            return self.model.get_parameter(name)
        except AttributeError:  # a BatchNorm's running statistics are buffers
            return self.model.get_buffer(name)

    def write(self, name: str, value: Tensor) -> None:
        self.read(name).copy_(value)

    def create(self, name: str, value: Tensor, like: Tensor) -> None:
        owner_path, _, attr = name.rpartition(".")
        setattr(self.model.get_submodule(owner_path), attr, nn.Parameter(value, requires_grad=like.requires_grad))

    def fill(self, name: str, value: float) -> None:
        self.read(name).fill_(value)

    def swap_norm(self, step: SwapStep) -> None:
        swap_norm(self.model, step)

    def remove_module(self, path: str) -> None:
        self.model.set_submodule(path, nn.Identity())


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
    if config is None or emb_in is None or emb_out is None or _share_a_tensor(emb_in, emb_out):
        return
    text = getattr(config, "get_text_config", lambda: config)()
    for holder in {id(config): config, id(text): text}.values():
        for flag in _TIE_FLAGS:
            if getattr(holder, flag, False):
                setattr(holder, flag, False)


def _share_a_tensor(a: nn.Module, b: nn.Module) -> bool:
    """Whether ``a`` and ``b`` hold one Parameter in common (tied embeddings; CSM's input embedding is a
    module holding its tables, with no ``weight`` of its own)."""
    held = {id(p) for p in a.parameters()}
    return any(id(p) in held for p in b.parameters())


def _embedding(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` (or output), None where the model has none: vision models
    (MobileViT, SegFormer) raise NotImplementedError, others return None or lack the method."""
    try:
        return getattr(model, getter)()
    except (AttributeError, NotImplementedError):
        return None


def swap_norm(model: nn.Module, step: SwapStep, *, share_parameters: bool = False) -> None:
    """Carry out one swap step: the norm at ``step.path`` becomes an Identity, a normfold
    ``RMSNorm`` or a torch ``LayerNorm`` holding the old module's γ/β (copies, or with
    ``share_parameters`` the same Parameters, which CBWC trains on)."""
    old = model.get_submodule(step.path)
    if step.to == "Identity":
        model.set_submodule(step.path, nn.Identity().train(old.training))
        return
    if step.to == "LayerNorm" and isinstance(old, nn.LayerNorm) and type(old) is not nn.LayerNorm:
        model.set_submodule(step.path, _same_class_layer_norm(old, step, share_parameters))
        return
    cls = RMSNorm if step.to == "RMSNorm" else nn.LayerNorm
    new = norm_like(old, cls, step.normalized_shape, step.eps,
                    weight=old.weight if step.elementwise_affine else None,
                    bias=old.bias if step.elementwise_affine and step.bias else None,
                    share_parameters=share_parameters, offset=step.offset, permute=step.permute)
    model.set_submodule(step.path, new)


def _same_class_layer_norm(old: nn.LayerNorm, step: SwapStep, share_parameters: bool) -> nn.LayerNorm:
    """A copy of a LayerNorm subclass (ConvNeXt's ``ConvNextLayerNorm``) keeping the γ/β the step keeps:
    its class stays, so a stock loader builds the same module. Its traced form is LN(x)·γ + β with its
    own γ/β (``norm_forms.traced_form``), so with γ/β set to None it computes LN(x), as a torch
    LayerNorm without affine would."""
    new = copy.deepcopy(old)
    keep = {"weight": step.elementwise_affine, "bias": step.elementwise_affine and step.bias}
    for name, kept in keep.items():
        setattr(new, name, (getattr(old, name) if share_parameters else getattr(new, name)) if kept else None)
    new.elementwise_affine = step.elementwise_affine
    return new


def norm_like(old: nn.Module, cls: type[nn.Module], normalized_shape, eps: float, *, weight: Tensor | None,
              bias: Tensor | None, share_parameters: bool = False, offset: float = 0.0,
              permute: tuple[int, ...] = ()) -> nn.Module:
    """A ``cls`` norm (normfold ``RMSNorm`` or torch ``LayerNorm``) to stand where ``old`` stands:
    on its device and dtype, in its train/eval mode, holding γ = ``weight`` and β = ``bias``.

    The one LayerNorm → RMSNorm swap of the fold, the Hugging Face reload, CBWC and the approximate
    fold. Values are copied (cast to ``old``'s dtype), or with ``share_parameters`` the given
    Parameters themselves are held. Neither given: no affine; β without γ: γ = 1. ``offset``: the
    RMSNorm scales by (offset + γ) (a torch LayerNorm has no offset: only 0 is accepted for it).
    ``permute``: the RMSNorm normalizes the last dim of ``x.permute(permute)`` and permutes back
    (``PermutedRMSNorm``, a channels-first norm's replacement).
    """
    if offset and cls is not RMSNorm:
        raise ValueError(f"only normfold's RMSNorm scales by (offset + γ); got offset={offset} for {cls.__name__}")
    if permute and cls is not RMSNorm:
        raise ValueError(f"only normfold's RMSNorm is swapped in around a permute; got permute={permute} for "
                         f"{cls.__name__}")
    ref = next((t for t in (getattr(old, "weight", None), getattr(old, "bias", None)) if t is not None), None)
    factory = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
    affine = weight is not None or bias is not None
    options = {"offset": offset} if offset else {}
    if permute:
        cls, options["order"] = PermutedRMSNorm, tuple(permute)
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
