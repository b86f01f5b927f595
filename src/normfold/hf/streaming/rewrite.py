"""Rewriting a checkpoint's tensors: the fold plan restated per checkpoint key, the groups of keys
computed together (a weight and its bias, an untied copy and its source), the math on slices so a
whole table never exists in the compute dtype, and a prefetcher that computes the next groups
while the caller writes."""
from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...fold.graph import parameter_aliases
from ...fold.math import center, fold_affine_into_consumer, fold_batchnorm_into_producer, scale_output_channels
from ...fold.plan import FoldPlan
from ..load import CheckpointError
from .checkpoint import SAFETENSORS_DTYPES, TORCH_DTYPES, Checkpoint, resolve_key


@dataclass
class AfterFold:
    """A step after the fold that rewrites tensors one at a time (``normfold rotate``: t ↦ t·Q), as the
    caller composes it: ``tensor(name, t)`` gives the new values (same shape and dtype) of a tensor
    of ``dims`` or of a slice of it cut along another dim than ``dims[name]`` (a row-wise map: the
    rewrite applies it slice by slice, so no whole table exists in its compute dtype); ``stream``
    maps the folded model's residual stream to the new one (x ↦ x·Q), for the per-block proof;
    ``sections`` go into the report."""

    dims: dict[str, int]
    tensor: Callable[[str, torch.Tensor], torch.Tensor]
    stream: Callable[[torch.Tensor], torch.Tensor]
    sections: dict[str, Any]


class CheckpointRewrite:
    """The plan restated per checkpoint key, with the groups of keys that must be computed together;
    ``after`` (optional) rewrites folded tensors before they are cast to their output dtype."""

    def __init__(self, plan: FoldPlan, skeleton: nn.Module, checkpoint: Checkpoint,
                 out_dtype: torch.dtype | None, after: AfterFold | None = None) -> None:
        if getattr(plan, "precompute", None):
            raise CheckpointError("streaming folds cannot precompute embedding norms (internal: plan has precompute steps)")
        if any(not s.keep_module for s in plan.batchnorm):
            raise CheckpointError("streaming folds keep every module: merged BatchNorms must stay as identities "
                                  "(internal: plan removes a BatchNorm)")
        aliases = parameter_aliases(skeleton)
        self.checkpoint = checkpoint
        self.out_dtype = out_dtype
        self.after = after

        def key(fqn: str) -> str:
            k = resolve_key(fqn, aliases, checkpoint)
            if k is None:
                raise CheckpointError(f"the plan names {fqn}, which the checkpoint does not store")
            return k

        parent: dict[str, str] = {}

        def find(k: str) -> str:
            while parent.setdefault(k, k) != k:
                k = parent[k]
            return k

        def union(a: str, b: str) -> None:
            parent[find(a)] = find(b)

        self.new_keys: dict[str, str] = {}          # new key -> source key (untied copies, created biases)
        self.norm_params: set[str] = set()          # small tensors read up front: BatchNorm statistics, norms' γ/β
        # norms whose γ/β moved elsewhere keep their stock keys with identity values (``fill``)
        self.fill: dict[str, float] = {}
        self.batchnorm = []
        for s in plan.batchnorm:  # first, as in apply_plan: the producer takes the BatchNorm's affine map
            w = key(s.weight_fqn)
            b = s.bias_fqn if s.create_bias else key(s.bias_fqn)
            if s.create_bias:
                self.new_keys[b] = w
            stats = [key(f) if f else None for f in (s.mean_fqn, s.var_fqn, s.gamma_fqn, s.beta_fqn)]
            self.norm_params.update(k for k in stats if k)
            self.batchnorm.append((w, b, *stats, s.eps))
            union(w, b)
            # the BatchNorm stays for the stock loader as an exact identity: μ=0, σ²=1−ε, γ=1, β=0
            self.fill.update({k: v for k, v in zip(stats, (0.0, 1.0 - s.eps, 1.0, 0.0)) if k})
        self.layer_scale = []
        for s in plan.layer_scale:  # then, as in apply_plan: the producer takes γ, γ becomes 1
            w, g = key(s.weight_fqn), key(s.scale_fqn)
            b = key(s.bias_fqn) if s.bias_fqn else None
            self.norm_params.add(g)
            self.layer_scale.append((w, b, g))
            self.fill[g] = 1.0
            if b:
                union(w, b)
        self.untie = []
        for s in plan.untie:
            new, src = f"{s.module_path}.{s.attr}", key(s.source_fqn)
            self.new_keys[new] = src
            self.untie.append((new, src))
            union(new, src)
        self.center = [(key(s.fqn), s.dim, s.group) for s in plan.center]
        self.affine = []
        for s in plan.affine_fold:
            w = s.weight_fqn if s.weight_fqn in self.new_keys else key(s.weight_fqn)
            b = (s.bias_fqn if s.create_bias else key(s.bias_fqn)) if s.bias_fqn else None
            if s.create_bias:
                self.new_keys[b] = w
            g = key(s.gamma_fqn) if s.gamma_fqn else None
            be = key(s.beta_fqn) if s.beta_fqn else None
            self.norm_params.update(k for k in (g, be) if k)
            self.affine.append((w, b, g, be, s.in_dim))
            if b:
                union(w, b)
        # norms whose γ/β moved into the next layer (RMSNorms, and LayerNorms the fold kept) keep
        # their stock keys as γ = 1, β = 0: left as they were, γ/β would apply twice
        for s in plan.swap:
            if not s.elementwise_affine:
                for leaf, value in (("weight", 1.0), ("bias", 0.0)):
                    k = resolve_key(f"{s.path}.{leaf}", aliases, checkpoint)
                    if k is not None:
                        self.fill[k] = value
        touched = {k for k, *_ in self.center} | {w for w, *_ in self.affine} | {b for _, b, *_ in self.affine if b} \
            | {w for w, *_ in self.batchnorm} | {b for _, b, *_ in self.batchnorm} | set(self.new_keys) | set(self.fill) \
            | {k for w, b, _ in self.layer_scale for k in (w, b) if k}
        self.groups: dict[str, set[str]] = defaultdict(set)
        for k in touched:
            self.groups[find(k)].add(k)
        self.group_of = {k: find(k) for k in touched}
        self.norm_values = {k: checkpoint.read(k) for k in sorted(self.norm_params)}
        self.math_seconds = 0.0  # in the worker thread: overlaps the writing

    def output_meta(self, key: str) -> tuple[str, list[int]]:
        """(safetensors dtype, shape) of an output key."""
        if key in self.checkpoint.meta:
            dtype, shape = self.checkpoint.meta[key]
        else:  # an untied copy or a created bias
            src_dtype, src_shape = self.checkpoint.meta.get(self.new_keys[key]) or self.output_meta(self.new_keys[key])
            dtype = src_dtype
            shape = src_shape if key in dict(self.untie) else [self._bias_len(key)]
        if self.out_dtype is not None and TORCH_DTYPES[dtype].is_floating_point:
            dtype = SAFETENSORS_DTYPES[self.out_dtype]
        return dtype, shape

    def _bias_len(self, bias_key: str) -> int:
        for w, b, *_ in self.batchnorm:  # output channels: dim 0 of the producer's weight
            if b == bias_key:
                return self.output_meta(w)[1][0]
        for w, b, _, _, in_dim in self.affine:
            if b == bias_key:
                return self.output_meta(w)[1][1 - in_dim]
        raise AssertionError(bias_key)

    def compute(self, key: str) -> dict[str, torch.Tensor]:
        """New values for every key of ``key``'s group, in the checkpoint's dtype (the math runs
        in ``fold.math.compute_dtype`` on slices of at most :data:`_CHUNK` elements, then rounds once per step)."""
        if key not in self.group_of:
            return {key: self._cast(key, self._post(key, self.checkpoint.read(key)))}
        keys = self.groups[self.group_of[key]]
        vals = {k: self.checkpoint.read(k) for k in keys if k in self.checkpoint.meta}
        t0 = time.perf_counter()
        for w, b, mean, var, gamma, beta, eps in self.batchnorm:
            if w in keys:
                values = [self.norm_values.get(k) for k in (mean, var, gamma, beta)]
                vals[w], vals[b] = fold_batchnorm_into_producer(vals[w], vals.get(b), *values, eps)
        for w, b, g in self.layer_scale:
            if w in keys:
                vals[w], scaled_bias = scale_output_channels(vals[w], vals.get(b) if b else None, self.norm_values[g])
                if b:
                    vals[b] = scaled_bias
        for new, src in self.untie:  # the copy keeps the original values
            if new in keys:
                vals[new] = vals[src].clone()
        for k, dim, group in self.center:
            if k in keys:
                _center_(vals[k], dim, group)
        for w, b, g, be, in_dim in self.affine:
            if w in keys:
                if b and b not in vals:  # a created bias starts at zero
                    vals[b] = torch.zeros(self.output_meta(b)[1], dtype=vals[w].dtype)
                _fold_affine_(vals[w], vals.get(b) if b else None, self.norm_values.get(g), self.norm_values.get(be),
                              in_dim)
        for k in keys:
            if k in self.fill:  # made in the output dtype: 1 − ε must round there, not in the checkpoint's
                dtype, shape = self.output_meta(k)
                vals[k] = torch.full(shape, self.fill[k], dtype=TORCH_DTYPES[dtype])
        self.math_seconds += time.perf_counter() - t0
        return {k: self._cast(k, self._post(k, v)) for k, v in vals.items()}

    def _post(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """The folded tensor ``key`` (own memory) rewritten in place by the ``after`` step, slice by slice."""
        if self.after is None or key not in self.after.dims:
            return t
        t0 = time.perf_counter()
        for part in _slices(t, self.after.dims[key]):
            part.copy_(self.after.tensor(key, part))
        self.math_seconds += time.perf_counter() - t0
        return t

    def _cast(self, key: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(TORCH_DTYPES[self.output_meta(key)[0]])


_CHUNK = 1 << 22  # elements per slice of the math (at most 32 MB in float64), so a whole table never exists in the compute dtype


def _slices(t: torch.Tensor, keep_dim: int):
    """Views of ``t`` cut along an axis other than ``keep_dim``, each of at most ~_CHUNK elements."""
    if t.dim() < 2 or t.numel() <= _CHUNK:
        yield t
        return
    axis = 1 if keep_dim % t.dim() == 0 else 0
    step = max(1, _CHUNK * t.shape[axis] // t.numel())
    for start in range(0, t.shape[axis], step):
        yield t.narrow(axis, start, min(step, t.shape[axis] - start))


def _center_(t: torch.Tensor, dim: int, group: int | None) -> None:
    """In place, slice by slice: ``normfold.fold.math.center`` (the mean along ``dim`` is per slice exact)."""
    for part in _slices(t, dim):
        part.copy_(center(part, dim, group))


def _fold_affine_(weight: torch.Tensor, bias: torch.Tensor | None, gamma, beta, in_dim: int) -> None:
    """In place, by slices of output rows: ``normfold.fold.math.fold_affine_into_consumer``."""
    out_axis = 1 - in_dim
    start = 0
    for part in _slices(weight, in_dim):
        n = part.shape[out_axis] if part is not weight else weight.shape[out_axis]
        b_part = None if bias is None else bias.narrow(0, start, n)
        new_w, new_b = fold_affine_into_consumer(part, b_part, gamma, beta, in_dim)
        part.copy_(new_w)
        if b_part is not None:
            b_part.copy_(new_b)
        start += n


class Prefetcher:
    """Computes the groups of the next keys in a worker thread while the caller writes: reading
    plus math overlap with writing (torch ops and file I/O release the GIL). ``depth`` groups ahead."""

    def __init__(self, rewrite: CheckpointRewrite, order: list[str], depth: int = 2) -> None:
        self.rewrite, self.order, self.depth = rewrite, order, depth
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="normfold-fold")
        self.queue: deque = deque()
        self.scheduled: set[str] = set()
        self.next = 0
        self.pending: dict[str, torch.Tensor] = {}

    def _fill(self) -> None:
        while len(self.queue) < self.depth and self.next < len(self.order):
            key = self.order[self.next]
            self.next += 1
            group = self.rewrite.group_of.get(key, key)
            if group not in self.scheduled:
                self.scheduled.add(group)
                self.queue.append(self.pool.submit(self.rewrite.compute, key))

    def get(self, key: str) -> torch.Tensor:
        """The new value of ``key`` (keys must be asked for in ``order``)."""
        self._fill()
        while key not in self.pending:
            self.pending.update(self.queue.popleft().result())
            self._fill()
        return self.pending.pop(key)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, exc_type, *_) -> None:
        for future in self.queue:
            future.cancel()
        self.pool.shutdown(wait=True)
        assert exc_type is not None or not self.pending, f"computed but never written: {sorted(self.pending)}"


