"""Rewriting a checkpoint's tensors: the fold plan (and a step after it) run by the fold's one
executor (``normfold.engine.executor``) over a store of checkpoint keys, one group of keys at a time
(the keys a step writes together: a weight and its bias, an untied copy and its source), the
row-wise math on slices so a whole table never exists in the compute dtype, and a prefetcher that
computes the next groups while the caller writes."""
from __future__ import annotations

import dataclasses
import functools
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...engine.executor import TensorMap, run
from ...engine.plan import FoldPlan, Step, SwapStep, UntieStep
from ..load import CheckpointError
from .checkpoint import SAFETENSORS_DTYPES, TORCH_DTYPES, Checkpoint, StoredKeys


@dataclass
class AfterFold:
    """A step after the fold that rewrites tensors one at a time (``normfold rotate``: t ↦ t·Q), as the
    caller composes it: ``tensor(name, t)`` gives the new values (same shape and dtype) of a tensor
    of ``dims`` or of a slice of it cut along another dim than ``dims[name]`` (a row-wise map: the
    executor applies it slice by slice, so no whole table exists in its compute dtype); ``stream``
    maps the folded model's residual stream to the new one (x ↦ x·Q), for the per-block proof;
    ``sections`` go into the report by name, and ``stock_warning`` says why the folder it writes is for
    ``normfold.from_pretrained`` only."""

    dims: dict[str, int]
    tensor: Callable[[str, torch.Tensor], torch.Tensor]
    stream: Callable[[torch.Tensor], torch.Tensor]
    sections: dict[str, Any]
    stock_warning: str

    def maps(self) -> list[TensorMap]:
        """The executor's steps: one row-wise map a tensor."""
        return [TensorMap(name, dim, functools.partial(self.tensor, name)) for name, dim in self.dims.items()]


class CheckpointRewrite:
    """The checkpoint store of the plan executor: the plan's steps (then ``after``'s maps, before the
    cast to the output dtype) by checkpoint key, in groups of keys computed together.

    A group is every key a step writes (with the tensors it reads that are not vectors: an untied
    copy's source); vectors a step only reads (norm γ/β, running statistics) are read once, as
    stored, unless an earlier step wrote them. A checkpoint keeps every module: a swapped norm's
    stored γ/β stay as γ = 1, β = 0 (left as they were, γ/β would apply twice), and a merged
    BatchNorm stays as an exact identity.
    """

    def __init__(self, plan: FoldPlan, skeleton: nn.Module, checkpoint: Checkpoint,
                 out_dtype: torch.dtype | None, after: AfterFold | None = None) -> None:
        if getattr(plan, "precompute", None):
            raise CheckpointError("streaming folds cannot precompute embedding norms (internal: plan has precompute steps)")
        if any(not s.keep_module for s in plan.batchnorm):
            raise CheckpointError("streaming folds keep every module: merged BatchNorms must stay as identities "
                                  "(internal: plan removes a BatchNorm)")
        self.checkpoint = checkpoint
        self.out_dtype = out_dtype
        self.new_keys: dict[str, str] = {}          # created key -> the key it is shaped from
        self._created_dim: dict[str, int | None] = {}  # created key -> that key's dim giving its length (None: its shape)
        self.created: dict[str, str] = {}           # created name -> its key (the name transformers saves it under)
        self.key_of: dict[str, str] = {}            # every name a step uses -> its checkpoint key
        self.stored = StoredKeys(skeleton, checkpoint)
        steps: list[Step] = [*_untie_by_key(plan, self.stored), *([] if after is None else after.maps())]
        keyed = [(step, *self._keys(step)) for step in steps]
        self.group_of, side = _group(keyed, self._is_vector)
        self.groups: dict[str, set[str]] = defaultdict(set)
        for k, group in self.group_of.items():
            self.groups[group].add(k)
        self.steps_of: dict[str, list[Step]] = defaultdict(list)  # group -> its steps, in plan order
        for step, _, writes in keyed:
            if writes:
                self.steps_of[self.group_of[writes[0]]].append(step)
        self.side_values = {k: checkpoint.read(k) for k in sorted(side)}
        self.math_seconds = 0.0  # in the worker thread: overlaps the writing

    def _keys(self, step: Step) -> tuple[list[str], list[str]]:
        """The keys ``step`` reads and writes (registering those it creates); a swap writes the γ/β
        the checkpoint stores for its norm."""
        reads = [self._key(n) for n in step.reads()]
        for name, (like, dim) in step.creates().items():
            key = self.created[name] = self.stored.saved_name(name)
            self.new_keys[key], self._created_dim[key] = self._key(like), dim
        names = step.writes()
        if isinstance(step, SwapStep):
            names = [n for n in names if n in self.created or self.stored.key(n) is not None]
        return reads, [self._key(n) for n in names]

    def _key(self, name: str) -> str:
        """The key storing ``name``: a tensor a step created, or the checkpoint's (a tied parameter is stored once)."""
        key = self.created.get(name) or self.stored.key(name)
        if key is None:
            raise CheckpointError(f"the plan names {name}, which the checkpoint does not store")
        if self.key_of.setdefault(name, key) != key:
            raise CheckpointError(f"internal: the plan names {name} before the step that creates it")
        return key

    def _is_vector(self, key: str) -> bool:
        return len(self.output_meta(key)[1]) <= 1

    def output_meta(self, key: str) -> tuple[str, list[int]]:
        """(safetensors dtype, shape) of an output key."""
        if key in self.checkpoint.meta:
            dtype, shape = self.checkpoint.meta[key]
        else:  # an untied copy or a created bias: shaped from the tensor it is made for
            dtype, like = self.output_meta(self.new_keys[key])
            dim = self._created_dim[key]
            shape = like if dim is None else [like[dim]]
        if self.out_dtype is not None and TORCH_DTYPES[dtype].is_floating_point:
            dtype = SAFETENSORS_DTYPES[self.out_dtype]
        return dtype, shape

    def compute(self, key: str) -> dict[str, torch.Tensor]:
        """New values for every key of ``key``'s group, in their output dtypes (the math runs in
        ``fold.math.weight_math_dtype`` on slices of at most :data:`_CHUNK` elements, rounding once per step)."""
        if key not in self.group_of:
            return {key: self._cast(key, self.checkpoint.read(key))}
        group = self.group_of[key]
        values = {k: self.checkpoint.read(k) for k in self.groups[group] if k in self.checkpoint.meta}
        t0 = time.perf_counter()
        run(self.steps_of[group], _GroupStore(self, values))
        self.math_seconds += time.perf_counter() - t0
        return {k: self._cast(k, v) for k, v in values.items()}

    def _cast(self, key: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(TORCH_DTYPES[self.output_meta(key)[0]])


def _group(keyed: list[tuple[Step, list[str], list[str]]],
           is_vector: Callable[[str], bool]) -> tuple[dict[str, str], set[str]]:
    """(key -> its group, the vectors read as stored) for steps given with the keys they read and write.

    A step's writes are computed together, with what it reads that an earlier step wrote (it must
    see the new values) or that is not a vector (an untied copy's source: read once for both); the
    vectors it reads otherwise (norm γ/β, running statistics) are read once, as stored.
    """
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    written: set[str] = set()
    side: set[str] = set()
    for _, reads, writes in keyed:
        together = set(writes) | {k for k in reads if k in written or not is_vector(k)}
        side.update(set(reads) - together)
        if writes:
            root = find(writes[0])
            for k in together:
                parent[find(k)] = root
        written.update(writes)
    return {k: find(k) for k in parent}, side


def _untie_by_key(plan: FoldPlan, stored: StoredKeys) -> list[Step]:
    """The plan's steps with its untie steps as a checkpoint needs them. A tied tensor is stored once,
    under the key of one of its names (its owner); the plan gives some of its names their own copy.
    An untied name that owns the key keeps it (LED's ``shared.weight`` when its decoder's embedding
    is centered and its encoder's not); every other untied name gets a new key, a copy of the owner's
    (the source is always the owner: until untied, every name of the group reads the owner's key, so
    the copy holds the values the plan's source holds; and the plan's source, read under the owner's
    key, may be a name untied later, which then could not get its own key). CheckpointError when an
    owner is untied while other names still share its key: they would read its new values."""
    untied = {step.fqn for step in plan.untie}
    steps: list[Step] = []
    for step in plan.steps():
        if not isinstance(step, UntieStep):
            steps.append(step)
            continue
        owner = stored.owner(step.fqn)
        if owner is None:
            raise CheckpointError(f"the plan names {step.fqn}, which the checkpoint does not store")
        if owner != step.fqn:
            steps.append(dataclasses.replace(step, source_fqn=owner))
            continue
        still_tied = sorted(set(stored.aliases.get(owner, ())) - untied - {owner})
        if still_tied:
            raise CheckpointError(f"the fold gives {owner} its own values, but the checkpoint stores it once for "
                                  f"{', '.join(still_tied)} too, which keep the original values: a streamed fold "
                                  "cannot store them apart; fold it in memory")
    return steps


_CHUNK = 1 << 22  # elements per slice of the math (at most 32 MB in float64), so a whole table never exists in the compute dtype

_DROPPED_VALUE = {"weight": 1.0, "bias": 0.0}  # a swapped norm's γ/β as the identity


class _GroupStore:
    """One group's tensors (own memory, changed in place), and the vectors read as stored."""

    def __init__(self, rewrite: CheckpointRewrite, values: dict[str, torch.Tensor]) -> None:
        self.rewrite, self.values = rewrite, values
        self.chunk = _CHUNK

    def read(self, name: str) -> torch.Tensor:
        key = self.rewrite.key_of[name]
        return self.values[key] if key in self.values else self.rewrite.side_values[key]

    def write(self, name: str, value: torch.Tensor) -> None:
        self.values[self.rewrite.key_of[name]] = value

    def create(self, name: str, value: torch.Tensor, like: torch.Tensor) -> None:
        self.write(name, value)

    def fill(self, name: str, value: float) -> None:
        """Made in the output dtype: 1 − ε must round there, not in the checkpoint's."""
        key = self.rewrite.key_of[name]
        dtype, shape = self.rewrite.output_meta(key)
        self.values[key] = torch.full(shape, value, dtype=TORCH_DTYPES[dtype])

    def swap_norm(self, step: SwapStep) -> None:
        for name in step.writes():
            if name in self.rewrite.key_of:
                self.fill(name, _DROPPED_VALUE[name.rpartition(".")[2]])

    def remove_module(self, path: str) -> None:
        raise AssertionError(f"a checkpoint keeps every module ({path}): refused when the rewrite was built")


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


