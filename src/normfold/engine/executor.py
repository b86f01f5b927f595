"""The one executor of fold plans: each step declares the tensors it reads, writes and creates
(``normfold.engine.plan``), and its kernel here applies the pure math of ``normfold.engine.math``
through a store, so a step is written once for every place a plan runs:

- the module store (``normfold.engine.transform.ModuleStore``): a model's parameters and buffers by
  fully-qualified name, changed in place; swapping a norm and removing a merged BatchNorm are
  module surgery there (``apply_plan``: the in-memory fold, the folder fold, rotation's plan);
- the checkpoint store (``normfold.hf.streaming.rewrite``): one group of checkpoint keys at a time,
  read lazily from the shards, which keeps every module (the streaming fold, and ``normfold
  rotate`` on a checkpoint, whose t ↦ t·Q runs as :class:`TensorMap` steps after the plan).

A store's ``chunk`` bounds the row-wise steps (centering, the affine fold, a :class:`TensorMap`):
they run on slices of at most that many elements, so a whole table never exists in the compute
dtype; None runs them on whole tensors.

A new plan step is three edits: its dataclass in ``plan.py`` (fields, ``reads``/``writes``/``creates``,
a section in ``_STEP_TYPES`` at its place in the order), its math in ``math.py``, and its kernel in
:data:`_KERNELS` here; both stores then run it (a checkpoint store groups keys and sizes created
tensors from the declarations alone: ``tests/engine/test_executor.py`` checks a kernel keeps to them).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .math import (center, center_groups, fold_affine_into_consumer, fold_batchnorm_into_producer, layer_norm_rows,
                   scale_output_channels)
from .plan import (AffineFoldStep, BatchNormFoldStep, CenterGroupsStep, CenterStep, LayerScaleStep, PrecomputeStep, Step,
                   SwapStep, UntieStep)


class TensorStore(Protocol):
    """Where the tensors a plan names live; ``chunk``: elements per slice of the row-wise math (None: whole)."""

    chunk: int | None

    def read(self, name: str) -> Tensor:
        """The stored tensor itself (a step may change it in place)."""

    def write(self, name: str, value: Tensor) -> None:
        """New values (same shape) for the tensor ``name``."""

    def create(self, name: str, value: Tensor, like: Tensor) -> None:
        """A new tensor ``name`` (a created bias, an untied copy), trainable as ``like`` is."""

    def fill(self, name: str, value: float) -> None:
        """Every element of ``name`` set to ``value``, rounded in the dtype it is stored in."""

    def swap_norm(self, step: SwapStep) -> None:
        """The module-level swap step."""

    def remove_module(self, path: str) -> None:
        """The module at ``path`` becomes the identity (a BatchNorm merged away)."""


@dataclass(frozen=True)
class TensorMap(Step):
    """A row-wise map of one tensor after a plan (``normfold rotate`` on a checkpoint: t ↦ t·Q along
    ``dim``): ``fn`` gives the new values (same shape and dtype) of tensor ``name`` or of a slice of
    it cut along another dim than ``dim``."""

    name: str
    dim: int
    fn: Callable[[Tensor], Tensor]

    def reads(self) -> tuple[str, ...]:
        return (self.name,)

    def writes(self) -> tuple[str, ...]:
        return (self.name,)


def run(steps: Iterable[Step], store: TensorStore) -> None:
    """Apply ``steps`` to ``store``, in order."""
    with torch.no_grad():
        for step in steps:
            _KERNELS[type(step)](step, store)


def _merge_batchnorm(step: BatchNormFoldStep, store: TensorStore) -> None:
    """The producer takes the BatchNorm's affine map; the BatchNorm becomes Identity, or, with
    ``keep_module``, an exact identity BatchNorm (γ=1, β=0, μ=0, σ²=1 − eps:
    ``math.identity_batchnorm_variance`` says where that is exact)."""
    weight = store.read(step.weight_fqn)
    bias = None if step.create_bias else store.read(step.bias_fqn)
    new_weight, new_bias = fold_batchnorm_into_producer(weight, bias, store.read(step.mean_fqn),
                                                        store.read(step.var_fqn), _read(store, step.gamma_fqn),
                                                        _read(store, step.beta_fqn), step.eps)
    store.write(step.weight_fqn, new_weight)
    if bias is None:
        store.create(step.bias_fqn, new_bias, like=weight)
    else:
        store.write(step.bias_fqn, new_bias)
    if not step.keep_module:
        store.remove_module(step.norm_path)
        return
    for fqn, value in ((step.mean_fqn, 0.0), (step.var_fqn, 1.0 - step.eps), (step.gamma_fqn, 1.0),
                       (step.beta_fqn, 0.0)):
        if fqn:
            store.fill(fqn, value)


def _merge_layer_scale(step: LayerScaleStep, store: TensorStore) -> None:
    """The producer takes the layer scale γ; γ becomes 1 (the multiply stays, now the identity)."""
    bias = _read(store, step.bias_fqn)
    new_weight, new_bias = scale_output_channels(store.read(step.weight_fqn), bias, store.read(step.scale_fqn))
    store.write(step.weight_fqn, new_weight)
    if bias is not None:
        store.write(step.bias_fqn, new_bias)
    store.fill(step.scale_fqn, 1.0)


def _untie(step: UntieStep, store: TensorStore) -> None:
    """The copy keeps the original values (untie runs before centering)."""
    source = store.read(step.source_fqn)
    store.create(step.fqn, source.detach().clone(), like=source)


def _precompute(step: PrecomputeStep, store: TensorStore) -> None:
    table = store.read(step.table_fqn)
    store.write(step.table_fqn, layer_norm_rows(table, _read(store, step.gamma_fqn), _read(store, step.beta_fqn),
                                                step.eps))


def _center(step: CenterStep, store: TensorStore) -> None:
    """In place, slice by slice (the mean along ``dim`` is exact per slice cut along another dim)."""
    for part in _slices(store.read(step.fqn), step.dim, store.chunk):
        part.copy_(center(part, step.dim, step.group))


def _center_groups(step: CenterGroupsStep, store: TensorStore) -> None:
    """In place, slice by slice, as :func:`_center`."""
    for part in _slices(store.read(step.fqn), step.dim, store.chunk):
        part.copy_(center_groups(part, step.dim, step.group, step.groups))


def _fold_affine(step: AffineFoldStep, store: TensorStore) -> None:
    """In place, by slices of output rows (a created bias starts at zero)."""
    weight = store.read(step.weight_fqn)
    gamma, beta = _read(store, step.gamma_fqn), _read(store, step.beta_fqn)
    out_axis = 1 - step.in_dim
    if step.create_bias:
        store.create(step.bias_fqn, torch.zeros(weight.shape[out_axis], dtype=weight.dtype, device=weight.device),
                     like=weight)
    bias = _read(store, step.bias_fqn)
    start = 0
    for part in _slices(weight, step.in_dim, store.chunk):
        n = part.shape[out_axis]
        bias_part = None if bias is None else bias.narrow(0, start, n)
        new_weight, new_bias = fold_affine_into_consumer(part, bias_part, gamma, beta, step.in_dim,
                                                         gamma_offset=step.gamma_offset)
        part.copy_(new_weight)
        if bias_part is not None:
            bias_part.copy_(new_bias)
        start += n


def _swap(step: SwapStep, store: TensorStore) -> None:
    store.swap_norm(step)


def _map(step: TensorMap, store: TensorStore) -> None:
    for part in _slices(store.read(step.name), step.dim, store.chunk):
        part.copy_(step.fn(part))


_KERNELS: dict[type, Callable] = {BatchNormFoldStep: _merge_batchnorm, LayerScaleStep: _merge_layer_scale,
                                  UntieStep: _untie, PrecomputeStep: _precompute, CenterStep: _center,
                                  CenterGroupsStep: _center_groups,
                                  AffineFoldStep: _fold_affine, SwapStep: _swap, TensorMap: _map}


def _read(store: TensorStore, name: str | None) -> Tensor | None:
    """The tensor ``name``, or None where the step names none (no γ, no bias)."""
    return store.read(name) if name else None


def _slices(t: Tensor, keep_dim: int, chunk: int | None) -> Iterator[Tensor]:
    """Views of ``t`` cut along an axis other than ``keep_dim``, each of at most ~``chunk`` elements
    (``t`` itself when ``chunk`` is None or ``t`` is small)."""
    if chunk is None or t.dim() < 2 or t.numel() <= chunk:
        yield t
        return
    axis = 1 if keep_dim % t.dim() == 0 else 0
    step = max(1, chunk * t.shape[axis] // t.numel())
    for start in range(0, t.shape[axis], step):
        yield t.narrow(axis, start, min(step, t.shape[axis] - start))
