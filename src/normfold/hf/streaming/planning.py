"""Planning a checkpoint's fold from its skeleton: the model built from its config on storage that
is never touched, only the norms' γ/β read from the files, then the fold engine's analysis."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from torch import nn

from ...engine.pipeline import plan_fold
from ...engine.plan import CenterGroupsStep, CenterStep, FoldConfig, FoldPlan, UntieStep
from ...engine.report import FoldReport
from ...nn.kinds import GROUP_NORM_TYPES, LAYER_NORM_TYPES, RMS_NORM_TYPES
from ..inputs import example_inputs_for
from ..load import CheckpointError, load_config, model_class_for
from ..saving import shared_names, stock_constraints
from .checkpoint import TORCH_DTYPES, Checkpoint, StoredKeys

# The norm modules of a skeleton whose parameters the analysis reads (and where a block check finds
# its stacks and its width): torch's and normfold's LayerNorm, RMSNorm and GroupNorm.
NORM_TYPES: tuple[type[nn.Module], ...] = LAYER_NORM_TYPES + RMS_NORM_TYPES + GROUP_NORM_TYPES


def plan_for_checkpoint(model_dir: Path, *, fold_affine: bool = True, trust_remote_code: bool = False,
                        stored_dtype: torch.dtype | None = None,
                        stock_loadable: bool = True) -> tuple[FoldReport, nn.Module, Checkpoint]:
    """Analyse the model of a checkpoint without loading its weights.

    Returns ``(report, skeleton, checkpoint)``: the fold pipeline's FoldReport, planned within what
    stock transformers loads from a folder stored in ``stored_dtype`` (default: the checkpoint's
    own; ``normfold.hf.saving.stock_constraints``), the model built on uninitialised storage (only its
    norms' γ/β are real), and the checkpoint. ``stock_loadable=False`` (a rotated folder, which only
    ``normfold.from_pretrained`` loads): the plan may create parameters the class lacks (GPT-2's
    ``lm_head.bias``, so that the final norm loses its γ/β) and untie a tied head to fold a γ into it,
    as ``normfold.rotate`` does; it still keeps every module (streaming rewrites tensors, never modules). When the plan unties the word
    embeddings, every other name the skeleton shares with a stored tensor and the stock class built
    from the untied config keeps apart (BERT's ``cls.predictions.decoder.bias``) gets its own copy
    (:func:`_untie_what_stock_keeps_apart`).
    """
    config = load_config(model_dir, trust_remote_code=trust_remote_code)
    cls = model_class_for(config, trust_remote_code=trust_remote_code)
    checkpoint = Checkpoint(model_dir)
    dtype = next((TORCH_DTYPES[d] for d, _ in checkpoint.meta.values() if TORCH_DTYPES[d].is_floating_point),
                 torch.float32)
    with torch.device("meta"):
        skeleton = cls._from_config(config, attn_implementation="eager", dtype=dtype)
    skeleton = skeleton.to_empty(device="cpu").eval()  # virtual memory only: pages are never written
    skeleton.tie_weights()  # to_empty gives tied parameters separate storage; the analysis must see the tie
    _load_norm_parameters(skeleton, checkpoint)
    constraints = stock_constraints(skeleton, stored_dtype or dtype, FoldConfig(fold_affine=fold_affine))
    if not stock_loadable:  # a rotated folder: a tied head may also be untied to take the final norm's γ
        constraints = dataclasses.replace(constraints, loadable_keys=None, move_every_gamma=True)
    report = plan_fold(skeleton, example_inputs_for(skeleton), constraints)
    if report.plan.untie:
        report.plan = _untie_what_stock_keeps_apart(report.plan, skeleton, StoredKeys(skeleton, checkpoint))
    return report, skeleton, checkpoint


def untied_config(config):
    """A copy of ``config`` with the word embeddings untied: the folder's config once the plan gives
    the output embedding its own tensor."""
    config = copy.deepcopy(config)
    config.tie_word_embeddings = False
    return config


def _untie_what_stock_keeps_apart(plan: FoldPlan, skeleton: nn.Module, stored_keys: StoredKeys) -> FoldPlan:
    """``plan`` with an untie step for every name the skeleton ties to a stored tensor but the stock
    class, built from the untied config, keeps apart, and that the checkpoint does not store. Untying
    the word embeddings makes transformers stop tying BERT's ``cls.predictions.decoder.bias`` to
    ``cls.predictions.bias`` too; the checkpoint stores that bias once, so a stock load would draw
    the other name at random (the in-memory fold stores each: ``saving.stock_state_dict``). The copy
    is of the original tensor, as every untie step's; where the plan centers the tied tensor under
    another name of the group, the copy is centered the same way (LED's encoder and decoder embeddings,
    both read centered by the analysis, which saw one tensor)."""
    with torch.device("meta"):
        stock = type(skeleton)._from_config(untied_config(skeleton.config))
    untied = {step.fqn for step in plan.untie}
    added, centered = [], []
    for names in sorted(shared_names(skeleton) - shared_names(stock), key=sorted):
        stored = [name for name in sorted(names) if stored_keys.own_key(name) is not None]
        if not stored:  # nothing to copy: the shell check names the missing tensor
            continue
        # the analysis saw one tensor: a name it centered under another name of the group reads it centered
        centering = [step for step in (*plan.center, *plan.center_groups) if step.fqn in names - untied]
        for name in sorted(names - untied - {stored[0]}):
            if stored_keys.own_key(name) is None:
                module_path, _, attr = name.rpartition(".")
                added.append(UntieStep(module_path, attr, source_fqn=stored[0]))
                centered += [dataclasses.replace(step, fqn=name) for step in centering if step.fqn != name]
    return dataclasses.replace(plan, untie=[*plan.untie, *added],
                               center=[*plan.center, *(s for s in centered if isinstance(s, CenterStep))],
                               center_groups=[*plan.center_groups, *(s for s in centered if isinstance(s, CenterGroupsStep))])


def _load_norm_parameters(skeleton: nn.Module, checkpoint: Checkpoint) -> None:
    """Real values for the (small) norm parameters, the only ones the analysis reads."""
    keys = StoredKeys(skeleton, checkpoint)
    with torch.no_grad():
        for path, module in skeleton.named_modules():
            if not isinstance(module, NORM_TYPES):
                continue
            for name, p in module.named_parameters(recurse=False):
                key = keys.key(f"{path}.{name}")
                if key is None:
                    raise CheckpointError(f"the checkpoint has no tensor for {path}.{name}")
                p.copy_(checkpoint.read(key))


def meta_skeleton(folder: Path, trust_remote_code: bool) -> nn.Module:
    """The model of ``folder``'s config on the meta device: structure only, no memory."""
    config = load_config(folder, trust_remote_code=trust_remote_code)
    cls = model_class_for(config, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return cls._from_config(config, attn_implementation="eager")
