"""Training on N processes under ``torchrun``: DDP (replicated weights) or FSDP2 (``fully_shard``, sharded weights).

Every rank draws the same global batch of B·N windows and trains on its own B rows, so N ranks take
exactly the steps of one process with batch B·N: the gradient of the global mean loss is the mean over
ranks of each rank's mean (equal slices), which DDP's all-reduce and FSDP2's reduce-scatter compute.
Model and optimizer states are moved as full (unsharded) state dicts, the same for every strategy.

``torch.distributed``'s FSDP, DTensor and checkpoint modules take ~1.5 s to import, and every ``normfold``
command imports this module (``normfold train`` is one of them): they are imported where they are used, and
a model can only be sharded (a tensor only be a DTensor) once they have been.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

PARALLEL = ("ddp", "fsdp2")


@dataclass(frozen=True)
class Dist:
    """This process's place among the ranks torchrun started (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> "Dist":
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK (absent: one process)."""
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def local_rows(batch: Tensor, dist: Dist) -> Tensor:
    """This rank's rows of a global batch (B·N rows): rows r·B .. (r+1)·B − 1."""
    rows = batch.shape[0] // dist.world_size
    assert rows * dist.world_size == batch.shape[0], "the global batch is batch_size · world_size rows"
    return batch[dist.rank * rows:(dist.rank + 1) * rows]


def shard_blocks(model: nn.Module) -> nn.Module:
    """FSDP2 in place: each transformer block its own unit (all-gathered only while it runs), the rest
    (embeddings, the tied head, the final norm) the root unit. CBWC's free weights are the parameters
    sharded (``parametrizations.weight.original``); each centered V is computed from the gathered W."""
    from torch.distributed.fsdp import fully_shard  # not at the top: 1.5 s of import (module docstring)

    for block in getattr(getattr(model, "transformer", None), "h", ()):
        fully_shard(block)
    fully_shard(model)
    return model


def wrap_for_training(model: nn.Module, parallel: str, dist: Dist, device: torch.device) -> nn.Module:
    """The module the loop trains: ``model`` itself (one process, or FSDP2 sharded in place) or DDP around it."""
    if not dist.enabled:
        return model
    if parallel == "fsdp2":
        return shard_blocks(model)
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 manages ``model`` (its gradients are reduce-scattered block by block in backward)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing can be sharded yet
    return fsdp is not None and isinstance(getattr(model, "_orig_mod", model), fsdp.FSDPModule)


def no_sync(model: nn.Module, sync: bool):
    """DDP's ``no_sync`` (gradients accumulate locally) unless ``sync``; a no-op for other models.

    FSDP2 reduce-scatters every micro-batch's gradients into the sharded ones, which sums them correctly."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if sync or not isinstance(inner, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return inner.no_sync()


def full_tensor(value: Tensor) -> Tensor:
    """A DTensor gathered to the whole tensor (a collective: every rank calls it); other tensors as they are."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no tensor is a DTensor yet
    return value.full_tensor() if dtensor is not None and isinstance(value, dtensor.DTensor) else value


def _state_dict_api():
    """``torch.distributed.checkpoint.state_dict`` (imported on first use: 1.5 s, see the module docstring)."""
    from torch.distributed.checkpoint import state_dict  # not at the top: 1.5 s of import (module docstring)

    return state_dict


def _full_options(**extra):
    """Options for whole (unsharded) state dicts, plus ``extra``."""
    return _state_dict_api().StateDictOptions(full_state_dict=True, **extra)


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """The unsharded state dict on the CPU for rank 0 (a collective under FSDP2: every rank calls it; the
    others receive an empty dict)."""
    return _state_dict_api().get_model_state_dict(model, options=_full_options(cpu_offload=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's unsharded state keyed by parameter names, for rank 0 (a collective under FSDP2)."""
    return _state_dict_api().get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optimizer_state: dict) -> None:
    """Load full state dicts (as :func:`full_model_state` / :func:`full_optimizer_state` wrote them) into a
    plain, DDP-wrapped or FSDP2-sharded model and its optimizer; every rank calls it."""
    api = _state_dict_api()
    api.set_model_state_dict(model, model_state, options=_full_options(strict=True))
    api.set_optimizer_state_dict(model, optimizer, optimizer_state, options=_full_options())
