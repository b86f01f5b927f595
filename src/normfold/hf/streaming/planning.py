"""Planning a checkpoint's fold from its skeleton: the model built from its config on storage that
is never touched, only the norms' γ/β read from the files, then the fold engine's analysis."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from ...fold.graph import parameter_aliases
from ...fold.pipeline import plan_fold
from ...fold.plan import FoldConfig
from ...fold.report import FoldReport
from ...nn.kinds import GROUP_NORM_TYPES, LAYER_NORM_TYPES, RMS_NORM_TYPES
from ..inputs import example_inputs_for
from ..load import CheckpointError, load_config, model_class_for
from ..saving import stock_constraints
from .checkpoint import TORCH_DTYPES, Checkpoint, resolve_key

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
    ``lm_head.bias``, so that the final norm loses its γ/β), as ``normfold.fold`` does; it still
    keeps every module (streaming rewrites tensors, never modules).
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
    if not stock_loadable:
        constraints = dataclasses.replace(constraints, loadable_keys=None)
    return plan_fold(skeleton, example_inputs_for(skeleton), constraints), skeleton, checkpoint


def _load_norm_parameters(skeleton: nn.Module, checkpoint: Checkpoint) -> None:
    """Real values for the (small) norm parameters, the only ones the analysis reads."""
    aliases = parameter_aliases(skeleton)
    with torch.no_grad():
        for path, module in skeleton.named_modules():
            if not isinstance(module, NORM_TYPES):
                continue
            for name, p in module.named_parameters(recurse=False):
                key = resolve_key(f"{path}.{name}", aliases, checkpoint)
                if key is None:
                    raise CheckpointError(f"the checkpoint has no tensor for {path}.{name}")
                p.copy_(checkpoint.read(key))


def meta_skeleton(folder: Path, trust_remote_code: bool) -> nn.Module:
    """The model of ``folder``'s config on the meta device: structure only, no memory."""
    config = load_config(folder, trust_remote_code=trust_remote_code)
    cls = model_class_for(config, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return cls._from_config(config, attn_implementation="eager")
