"""Fold safetensors checkpoints larger than memory.

1. Plan: build the model from its config with uninitialised storage (``to_empty``: the pages are
   never touched, so a 13 GB model costs no resident memory), read the norms' γ/β from the files
   (the analysis looks at β), and run the fold engine's analysis. ``torch.export`` traces with fake
   tensors, so it never reads the weights either.
2. Rewrite: every tensor of the plan is read from its shard (``safe_open``, one tensor at a time),
   rewritten with the pure functions of ``normfold.fold.math`` and streamed into new shards by a
   writer that needs only one tensor in memory. Tensors that a step ties together (a weight and
   its bias, an untied copy and its source) are processed as one group; the norms' γ/β, which
   affine folding needs across shards, are read first. All of it goes into a locked temporary
   sibling of the output folder.
3. Verify, piece by piece in float64 (:func:`verify_by_blocks`): every block of the stacks the
   fold touched, the model cut to one block per stack (embeddings, final norm, head), and every
   other tensor as a copy. ``normfold verify`` also re-derives the fold from the original, group
   by group, and compares every stored tensor with it.
4. Publish: only a verified folder replaces the output, in one atomic exchange.

Peak memory: the largest group in float32 plus the γ/β of all norms while rewriting; while
verifying, the model without all but one block per stack in float64, then one block at a time.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..fold.math import fold_batchnorm_into_producer
from ..fold.verify import _cast, _errors, measured_tolerance
from .._deps import require
from .inputs import example_inputs_for
from .load import CheckpointError, _first_line, check_model_dir, load_config, model_class_for
from .output_dir import REPORT_JSON, atomic_output_dir
from .saving import DTYPES, stock_constraints, swap_in_rmsnorm
from .side_files import copy_side_files
from .saved_weights import compare_weights, not_compared, skipped, why_not_rederivable

INDEX = "model.safetensors.index.json"
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}


# ------------------------------------------------------------------------------------ checkpoint

class Checkpoint:
    """The tensors of a safetensors folder: which file holds each key, shapes and dtypes from the
    headers, and reads of one tensor at a time (each read opens and closes its file, so no file
    stays mapped and resident memory does not grow with the checkpoint)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / INDEX
        if index.is_file():
            weight_map = _read_weight_map(index)
        elif (folder / "model.safetensors").is_file():
            weight_map = None
        else:
            raise CheckpointError(f"streaming needs safetensors weights: no model.safetensors or {INDEX} in {folder}")
        safe_open = require("safetensors").safe_open
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self.files: dict[str, list[str]] = {}    # file -> keys in file order
        self.file_of: dict[str, str] = {}
        self.meta: dict[str, tuple[str, list[int]]] = {}   # key -> (safetensors dtype, shape)
        for name in files:
            try:
                with safe_open(folder / name, framework="pt") as f:
                    keys = list(f.keys())
                    for key in keys:
                        sl = f.get_slice(key)
                        self.meta[key] = (sl.get_dtype(), list(sl.get_shape()))
            except Exception as err:  # SafetensorError for a corrupt header
                raise CheckpointError(f"corrupt safetensors file {folder / name}: {str(err).splitlines()[0]}") from err
            self.files[name] = keys
            self.file_of.update(dict.fromkeys(keys, name))
        self.bytes_read = 0
        self.read_seconds = 0.0

    def read(self, key: str) -> torch.Tensor:
        safe_open = require("safetensors").safe_open
        t0 = time.perf_counter()
        with safe_open(self.folder / self.file_of[key], framework="pt") as f:
            t = f.get_tensor(key).clone()  # own memory: nothing keeps the file mapped
        self.bytes_read += t.numel() * t.element_size()
        self.read_seconds += time.perf_counter() - t0
        return t


def _read_weight_map(index: Path) -> dict[str, str]:
    """The index's key -> shard map; CheckpointError unless every shard is a plain file name.

    The names become paths of the output folder: ``../x`` or ``/etc/x`` would write outside it.
    """
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index} is not a safetensors index: {str(err).splitlines()[0]}") from err
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: expected a non-empty \"weight_map\" object, got {weight_map!r:.80}")
    for name in set(weight_map.values()):
        check_plain_file_name(name, index)
    return weight_map


def check_plain_file_name(name: object, source: Path) -> str:
    """``name`` when it is a plain file name (no folder part, not ``.``/``..``, not absolute, no NUL),
    else CheckpointError naming ``source``, the file that listed it."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name or "/" in name or "\\" in name \
            or os.path.isabs(name):
        raise CheckpointError(f"{source} lists the shard {name!r}: expected a plain file name inside the model folder "
                              "(no '/', '..', absolute path or NUL)")
    return name


def write_safetensors(path: Path, entries: list[tuple[str, str, list[int]]],
                      produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file tensor by tensor: the header (computed from ``entries`` =
    (key, safetensors dtype, shape)) first, then ``produce(key)`` for each key in order.

    Returns the number of bytes of tensor data written.
    """
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * _FROM_ST[dtype].itemsize
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, dtype, shape in entries:
            t = produce(key)
            if t.dtype != _FROM_ST[dtype] or list(t.shape) != list(shape):
                raise AssertionError(f"{key}: produced {t.dtype} {tuple(t.shape)}, header says {dtype} {shape}")
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return offset


# ------------------------------------------------------------------------------------------ plan

def plan_for_checkpoint(model_dir: Path, *, fold_affine: bool = True, trust_remote_code: bool = False,
                        stored_dtype: torch.dtype | None = None):
    """Analyse the model of a checkpoint without loading its weights.

    Returns ``(report, skeleton, checkpoint)``: the fold pipeline's FoldReport, planned within what
    stock transformers loads from a folder stored in ``stored_dtype`` (default: the checkpoint's
    own; ``normfold.hf.saving.stock_constraints``), the model built on uninitialised storage (only its
    norms' γ/β are real), and the checkpoint.
    """
    from ..fold.pipeline import plan_fold

    config = load_config(model_dir, trust_remote_code=trust_remote_code)
    cls = model_class_for(config, trust_remote_code=trust_remote_code)
    checkpoint = Checkpoint(model_dir)
    dtype = next((_FROM_ST[d] for d, _ in checkpoint.meta.values() if _FROM_ST[d].is_floating_point), torch.float32)
    with torch.device("meta"):
        skeleton = cls._from_config(config, attn_implementation="eager", dtype=dtype)
    skeleton = skeleton.to_empty(device="cpu").eval()  # virtual memory only: pages are never written
    skeleton.tie_weights()  # to_empty gives tied parameters separate storage; the analysis must see the tie
    _load_norm_parameters(skeleton, checkpoint)
    constraints = stock_constraints(skeleton, stored_dtype or dtype, fold_affine=fold_affine)
    return plan_fold(skeleton, example_inputs_for(skeleton), constraints), skeleton, checkpoint


def _norm_types() -> tuple[type, ...]:
    return (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def _load_norm_parameters(skeleton: nn.Module, checkpoint: Checkpoint) -> None:
    """Real values for the (small) norm parameters, the only ones the analysis reads."""
    aliases = _aliases(skeleton)
    with torch.no_grad():
        for path, module in skeleton.named_modules():
            if not isinstance(module, _norm_types()):
                continue
            for name, p in module.named_parameters(recurse=False):
                key = _resolve(f"{path}.{name}", aliases, checkpoint)
                if key is None:
                    raise CheckpointError(f"the checkpoint has no tensor for {path}.{name}")
                p.copy_(checkpoint.read(key))


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """FQN -> every FQN of the same Parameter (tied weights)."""
    by_id: dict[int, list[str]] = defaultdict(list)
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(fqn)
    return {fqn: names for names in by_id.values() for fqn in names}


def _resolve(fqn: str, aliases: dict[str, list[str]], checkpoint: Checkpoint) -> str | None:
    """The checkpoint key that stores parameter ``fqn`` (a tied parameter is stored once)."""
    for name in [fqn, *aliases.get(fqn, [])]:
        if name in checkpoint.meta:
            return name
    return None


# --------------------------------------------------------------------------------------- rewrite

class _Rewrite:
    """The plan restated per checkpoint key, with the groups of keys that must be computed together."""

    def __init__(self, plan, skeleton: nn.Module, checkpoint: Checkpoint, out_dtype: torch.dtype | None) -> None:
        if getattr(plan, "precompute", None):
            raise CheckpointError("streaming folds cannot precompute embedding norms (internal: plan has precompute steps)")
        if any(not s.keep_module for s in plan.batchnorm):
            raise CheckpointError("streaming folds keep every module: merged BatchNorms must stay as identities "
                                  "(internal: plan removes a BatchNorm)")
        aliases = _aliases(skeleton)
        self.checkpoint = checkpoint
        self.out_dtype = out_dtype

        def key(fqn: str) -> str:
            k = _resolve(fqn, aliases, checkpoint)
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
                    k = _resolve(f"{s.path}.{leaf}", aliases, checkpoint)
                    if k is not None:
                        self.fill[k] = value
        touched = {k for k, *_ in self.center} | {w for w, *_ in self.affine} | {b for _, b, *_ in self.affine if b} \
            | {w for w, *_ in self.batchnorm} | {b for _, b, *_ in self.batchnorm} | set(self.new_keys) | set(self.fill)
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
        if self.out_dtype is not None and _FROM_ST[dtype].is_floating_point:
            dtype = _ST_DTYPES[self.out_dtype]
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
            return {key: self._cast(key, self.checkpoint.read(key))}
        keys = self.groups[self.group_of[key]]
        vals = {k: self.checkpoint.read(k) for k in keys if k in self.checkpoint.meta}
        t0 = time.perf_counter()
        for w, b, mean, var, gamma, beta, eps in self.batchnorm:
            if w in keys:
                values = [self.norm_values.get(k) for k in (mean, var, gamma, beta)]
                vals[w], vals[b] = fold_batchnorm_into_producer(vals[w], vals.get(b), *values, eps)
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
                vals[k] = torch.full(shape, self.fill[k], dtype=_FROM_ST[dtype])
        self.math_seconds += time.perf_counter() - t0
        return {k: self._cast(k, v) for k, v in vals.items()}

    def _cast(self, key: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(_FROM_ST[self.output_meta(key)[0]])


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
    from ..fold.math import center

    for part in _slices(t, dim):
        part.copy_(center(part, dim, group))


def _fold_affine_(weight: torch.Tensor, bias: torch.Tensor | None, gamma, beta, in_dim: int) -> None:
    """In place, by slices of output rows: ``normfold.fold.math.fold_affine_into_consumer``."""
    from ..fold.math import fold_affine_into_consumer

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


class _Prefetcher:
    """Computes the groups of the next keys in a worker thread while the caller writes: reading
    plus math overlap with writing (torch ops and file I/O release the GIL). ``depth`` groups ahead."""

    def __init__(self, rewrite: _Rewrite, order: list[str], depth: int = 2) -> None:
        from concurrent.futures import ThreadPoolExecutor

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

    def __enter__(self) -> "_Prefetcher":
        return self

    def __exit__(self, exc_type, *_) -> None:
        for future in self.queue:
            future.cancel()
        self.pool.shutdown(wait=True)
        assert exc_type is not None or not self.pending, f"computed but never written: {sorted(self.pending)}"


def fold_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, fold_affine: bool = True,
                    dtype: str | None = None, overwrite: bool = False, trust_remote_code: bool = False,
                    step: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Fold a safetensors folder shard by shard without loading the model, verify the result
    piece by piece (:func:`verify_by_blocks`), and only then publish it as ``out_dir``.

    Everything is written into a temporary sibling of ``out_dir`` (:func:`~normfold.hf.output_dir.atomic_output_dir`):
    a failed check raises ``FoldVerificationError`` and leaves ``out_dir`` as it was (with
    ``overwrite``, the previous output stays). Output shards mirror the input shards (same names
    and keys; an untied copy goes into its source's shard). Returns the report dict
    (``streaming`` holds bytes and seconds, ``verification`` the checks).
    """
    from ..fold import FoldVerificationError
    from .folder import write_report_files
    from .saving import DTYPES

    model_dir = check_model_dir(model_dir)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    with atomic_output_dir(out_dir, overwrite=overwrite, protect=(model_dir,)) as tmp:
        report = _write_folded_checkpoint(model_dir, tmp, fold_affine=fold_affine, dtype=dtype,
                                          trust_remote_code=trust_remote_code, step=step)
        report["verification"] = verify_by_blocks(model_dir, tmp, report, dtype=dtype, check_weights=False,
                                                  trust_remote_code=trust_remote_code, step=step)
        if not report["verification"]["ok"]:
            raise FoldVerificationError(f"{_failure(report['verification'])}; nothing was written to {out_dir}")
        step("writing the report")
        write_report_files(report, tmp)
    report["out_dir"] = str(Path(out_dir).absolute())
    return report


def _write_folded_checkpoint(model_dir: Path, folder: Path, *, fold_affine: bool, dtype: str | None,
                             trust_remote_code: bool, step: Callable[[str], None]) -> dict[str, Any]:
    """Plan, then rewrite every shard into ``folder`` (config and side files too); returns the
    report dict without verification. ``folder`` is private: nothing here is checked yet."""
    from .saving import DTYPES

    out_dtype = DTYPES[dtype] if dtype else None
    t0 = time.perf_counter()
    step("planning (no weights loaded)")
    report, skeleton, checkpoint = plan_for_checkpoint(model_dir, fold_affine=fold_affine,
                                                      trust_remote_code=trust_remote_code, stored_dtype=out_dtype)
    from .folder import require_norms

    require_norms(report, type(skeleton).__name__)
    t_plan = time.perf_counter() - t0
    rewrite = _Rewrite(report.plan, skeleton, checkpoint, out_dtype)
    layout = {name: list(keys) for name, keys in checkpoint.files.items()}
    for new, src in rewrite.new_keys.items():
        layout[checkpoint.file_of.get(src) or checkpoint.file_of[rewrite.new_keys[src]]].append(new)
    written, weight_map = 0, {}
    with _Prefetcher(rewrite, [k for keys in layout.values() for k in keys]) as tensors:
        for i, (name, keys) in enumerate(layout.items()):
            step(f"rewriting shard {i + 1}/{len(layout)}")
            entries = [(k, *rewrite.output_meta(k)) for k in keys]
            written += write_safetensors(folder / name, entries, tensors.get)
            weight_map.update(dict.fromkeys(keys, name))
    if len(layout) > 1 or (model_dir / INDEX).is_file():
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": written}, "weight_map": weight_map},
                                               indent=2) + "\n")
    _write_config(skeleton.config, folder, untied=bool(report.plan.untie), dtype=out_dtype)
    skipped_files = copy_side_files(model_dir, folder)
    out = report.to_dict()
    out.update(
        model={"architecture": type(skeleton).__name__, "model_type": skeleton.config.model_type,
               "source": str(model_dir.absolute()), "parameters": sum(p.numel() for p in skeleton.parameters())},
        swapped=[{"path": s.path, "normalized_shape": [s.normalized_shape], "eps": s.eps,
                  "weight": s.elementwise_affine, "bias": s.elementwise_affine and s.bias}
                 for s in report.plan.swap if s.to == "RMSNorm"],
        fold_affine=fold_affine, saved_dtype=dtype or _stored_dtype(model_dir), skipped_files=skipped_files,
        streaming={"bytes_read": checkpoint.bytes_read, "bytes_written": written,
                   "plan_seconds": round(t_plan, 2), "read_seconds": round(checkpoint.read_seconds, 2),
                   "math_seconds": round(rewrite.math_seconds, 2), "seconds": round(time.perf_counter() - t0, 2)},
    )
    return out


def _write_config(config, folder: Path, *, untied: bool, dtype: torch.dtype | None) -> None:
    if untied:
        config.tie_word_embeddings = False
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(folder)


# ---------------------------------------------------------------------------------- verification
#
# The fold never runs the whole model, so it is proved in pieces, each in float64 and alone. In a
# folded Pre-LN model the residual stream is the original's with its mean removed: with
# P = I − 11ᵀ/n, folded stream = P·stream. A stack (the outermost ModuleList holding norms) is
# "centered" when it holds a swapped norm; in the others the stream is the original's. Hence
#   blocks: folded_block(P·x) = P·block(x) in a centered stack, folded_block(x) = block(x) in the
#           others (where a kept norm's γ/β may have moved into the next layer); a block whose
#           tensors all equal the original's is compared as a copy instead;
#   shell:  the model cut to the first block of each stack gives the original's outputs, and the
#           stream entering each stack is P·(the original's) or the original's;
#   copies: every other tensor equals the original's in the saved dtype.
# Together: the stream enters every stack in its relation, each block keeps it, so the stack hands
# the shell's tail (final norm, head) what it maps to the original output.
#
# Each block runs on the original's own stream: the hidden states the shell saw entering the stack,
# carried block by block through the original blocks. An N(0, 1) stream can be far larger than a
# real one, which hides what a block adds to it: in a tiny random GPT-2 a 1.5x MLP weight changed
# such a block's output by 2.9e-3, below bf16's unit roundoff, and by 0.11 on the real stream.
# The folded weights are rounded to the stored dtype, so each piece (the shell, every block run) is
# judged by its own measured tolerance (normfold.fold.verify.measured_tolerance): its error must be
# at most 2x the error the original piece itself makes when cast to that dtype and run in it on the
# same inputs, plus one rounding.

Call = tuple[tuple, dict]  # the (args, kwargs) a stack's first block is called with inside the model


def check_block(orig_dir: str | os.PathLike, folded_dir: str | os.PathLike, block_path: str, *,
                swapped: list[dict[str, Any]] | None = None, centered: bool = True, call: Call | None = None,
                x: torch.Tensor | None = None, stored_dtype: torch.dtype | None = None, batch: int = 2, seq: int = 16,
                seed: int = 0, trust_remote_code: bool = False) -> dict[str, Any]:
    """Compare one residual block of a folded checkpoint with the original, in float64, loading
    only that block's tensors, and judge the error by the block's own error in ``stored_dtype``.

    ``centered`` (a Pre-LN block the fold centered): the folded residual stream is the original's
    with its mean removed (P = I − 11ᵀ/n), so folded_block(P·x) = P·block(x); the error is
    ‖P·block(x) − folded_block(P·x)‖∞ / ‖P·block(x)‖∞. Otherwise folded_block(x) = block(x).
    ``x``: the hidden states the original block reads (default: N(0, 1) of the call's shape, or
    ``(batch, seq, width)``). ``call``: the other arguments the model passes the block (masks,
    rotary tables, ALiBi; :func:`check_shell` records them), x replacing the hidden states.
    ``stored_dtype`` (default: the folded checkpoint's): the result's ``tolerance`` is
    ``measured_tolerance(own_error, stored_dtype)``, ``own_error`` being the original block cast to
    that dtype and run in it (x and the call's float tensors cast too) against float64; ``ok`` says
    whether the error is within it. Also returns the worst |mean|/rms of the RMSNorm inputs.
    ``swapped``: the report's swapped norms (default: read from ``folded_dir``'s report).
    """
    orig_dir, folded_dir = check_model_dir(orig_dir), check_model_dir(folded_dir)
    if swapped is None:
        swapped = json.loads((folded_dir / REPORT_JSON).read_text())["swapped"]
    stored = stored_dtype or DTYPES[_stored_dtype(folded_dir)]
    skeleton = _meta_skeleton(orig_dir, trust_remote_code)
    if x is None:
        x = _random_stream(skeleton, block_path, call, batch=batch, seq=seq, seed=seed)
    result, _ = _check_block(skeleton, Checkpoint(orig_dir), Checkpoint(folded_dir), block_path, swapped,
                             centered, call, x, stored)
    return result


def _check_block(skeleton: nn.Module, orig: Checkpoint, folded: Checkpoint, block_path: str,
                 swapped: list[dict[str, Any]], centered: bool, call: Call | None, x: torch.Tensor,
                 stored: torch.dtype) -> tuple[dict[str, Any], torch.Tensor]:
    """:func:`check_block` on open checkpoints; also returns the original block's output on ``x``
    (the stream the next block reads). One block in float64 in memory at a time."""
    from ..fold.math import center

    project = (lambda t: center(t, -1)) if centered else (lambda t: t)
    with torch.no_grad():
        original = _load_block(skeleton, orig, block_path)
        stream = _first(_call(original, call, x))
        ref = project(stream)
        own = _own_error([ref], original, lambda m, dt: [project(_first(_call(m, _cast(call, dt), x.to(dt))).double())],
                         stored)
        del original
        block = _load_block(skeleton, folded, block_path, swapped)
        ratios = _watch_rms_inputs(block)
        out = _first(_call(block, call, project(x)))
    error = _rel_error(ref, out)
    return {"block": block_path, "centered": centered, "max_rel_error": error, **_judged(error, own, stored),
            "max_input_mean_ratio": max(ratios) if ratios else None}, stream


def _load_block(skeleton: nn.Module, checkpoint: Checkpoint, block_path: str,
                swapped: list[dict[str, Any]] = ()) -> nn.Module:
    """The block at ``block_path`` in float64 with ``checkpoint``'s tensors (only its own read),
    the ``swapped`` norms inside it replaced by RMSNorms."""
    import copy

    prefix = block_path + "."
    state = {k[len(prefix):]: checkpoint.read(k).double() for k in checkpoint.meta if k.startswith(prefix)}
    block = copy.deepcopy(skeleton.get_submodule(block_path))
    block.load_state_dict(state, strict=True, assign=True)
    block = block.double().eval()
    for entry in swapped:
        if entry["path"].startswith(prefix):
            swap_in_rmsnorm(block, {**entry, "path": entry["path"][len(prefix):]})
    return block


def _random_stream(skeleton: nn.Module, block_path: str, call: Call | None = None, *, batch: int = 2, seq: int = 16,
                   seed: int = 0) -> torch.Tensor:
    """N(0, 1) hidden states of the call's shape, or (batch, seq, the block's width)."""
    gen = torch.Generator().manual_seed(seed)
    shape = _hidden(call).shape if call else (batch, seq, _block_width(skeleton.get_submodule(block_path)))
    return torch.randn(shape, generator=gen, dtype=torch.float64)  # (B, T, C)


def _own_error(reference: list[torch.Tensor], original: nn.Module,
               run: Callable[[nn.Module, torch.dtype], list[torch.Tensor]], low_dtype: torch.dtype) -> float:
    """The original piece's own error in ``low_dtype``: ``original`` cast to it (in place, so no
    second copy is held; the float64 one is not used again) and ``run`` in it, against
    ``reference``, its float64 outputs; only elements finite in both count, as in
    :func:`normfold.fold.verify.own_error`."""
    low = run(original.to(low_dtype), low_dtype)
    assert len(low) == len(reference), "the piece gave other outputs in the stored dtype"
    return max((_errors(r, o.double(), where_finite=True)[0] for r, o in zip(reference, low)), default=0.0)


def _judged(error: float, own: float, stored: torch.dtype) -> dict[str, Any]:
    """A piece's tolerance measured from its own error, the rule in words, and whether ``error`` is
    within it (a NaN error is not)."""
    tolerance, rule = measured_tolerance(own, stored)
    return {"own_error": own, "tolerance": tolerance, "tolerance_rule": rule, "ok": error <= tolerance}


def _hidden(call: Call) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _call(block: nn.Module, call: Call | None, x: torch.Tensor):
    """``block`` on hidden states ``x`` with the rest of ``call``'s arguments."""
    if call is None:
        return block(x)
    args, kwargs = call
    return block(x, *args[1:], **kwargs) if args else block(**{**kwargs, "hidden_states": x})


def check_shell(orig_dir: str | os.PathLike, folded_dir: str | os.PathLike, swapped: list[dict[str, Any]],
                stacks: dict[str, bool], *, stored_dtype: torch.dtype | None = None, seed: int = 0,
                trust_remote_code: bool = False) -> tuple[dict[str, Any], dict[str, Call]]:
    """Run the model cut to the first block of each stack (``stacks``: path -> centered) from both
    folders in float64, one after the other, and compare every float output and, where each stack
    starts, the folded stream with P·(the original's) (centered) or the original's.

    This covers what no block check sees: the embeddings (and an embedding norm), the final norm
    and the head, tied or untied. The error is judged by the cut original's own error in
    ``stored_dtype`` (default: the folded checkpoint's) on the same inputs and quantities, as in
    :func:`check_block`. Returns the result (worst relative error, its tolerance, what was
    compared, the checkpoint keys the folded shell loaded under ``keys``) and, per stack, the
    arguments the original model called its first block with.
    """
    orig_dir, folded_dir = check_model_dir(orig_dir), check_model_dir(folded_dir)
    stored = stored_dtype or DTYPES[_stored_dtype(folded_dir)]
    model, _ = _load_shell(orig_dir, [], list(stacks), trust_remote_code)
    inputs = example_inputs_for(model, seed=seed)
    ref, ref_calls = _run_shell(model, list(stacks), inputs)
    ref_seen = _shell_quantities(ref, ref_calls, stacks)
    own = _own_error(ref_seen, model, lambda m, dt: _shell_quantities(*_run_shell(m, list(stacks), _cast(inputs, dt)),
                                                                       stacks), stored)
    del model
    model, keys = _load_shell(folded_dir, swapped, list(stacks), trust_remote_code)
    out, calls = _run_shell(model, list(stacks), inputs)
    del model
    problems = []
    if not ref or len(ref) != len(out) or any(a.shape != b.shape for a, b in zip(ref, out)):
        problems.append(f"the model cut to its first blocks gave {len(ref)} float outputs, the folded one {len(out)} "
                        "(expected the same number and shapes, at least one)")
    problems += [f"the stream entering {stack} was not seen (its first block was never called)"
                 for stack in stacks if stack not in ref_calls or stack not in calls]
    errors = [] if problems else [_rel_error(a, b) for a, b in zip(ref_seen, _shell_quantities(out, calls, stacks))]
    error = max(errors, default=math.nan)
    result = {"block": "model cut to its first block" if stacks else "model", "max_rel_error": error,
              **_judged(error, own, stored), "outputs": len(out), "stack_entries": len(stacks), "problems": problems,
              "keys": sorted(keys)}
    return result, ref_calls


def _shell_quantities(outputs: list[torch.Tensor], calls: dict[str, Call],
                      stacks: dict[str, bool]) -> list[torch.Tensor]:
    """What the shell check compares: the float outputs, then the stream entering each stack seen,
    centered (P·x) for a centered stack. Computed in float64."""
    from ..fold.math import center

    entries = [_hidden(calls[stack]).double() for stack in stacks if stack in calls]
    centered = [stacks[stack] for stack in stacks if stack in calls]
    return [t.double() for t in outputs] + [center(h, -1) if c else h for h, c in zip(entries, centered)]


def _meta_skeleton(folder: Path, trust_remote_code: bool) -> nn.Module:
    """The model of ``folder``'s config on the meta device: structure only, no memory."""
    config = load_config(folder, trust_remote_code=trust_remote_code)
    cls = model_class_for(config, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return cls._from_config(config, attn_implementation="eager")


def _load_shell(folder: Path, swapped: list[dict[str, Any]], stacks: list[str],
                trust_remote_code: bool) -> tuple[nn.Module, set[str]]:
    """``folder``'s model with ``num_hidden_layers`` = 1 (0 without ``stacks``) in float64, its
    tensors loaded from the checkpoint and the RMSNorms swapped in; and the keys loaded."""
    config = load_config(folder, trust_remote_code=trust_remote_code)
    config.num_hidden_layers = 1 if stacks else 0
    cls = model_class_for(config, trust_remote_code=trust_remote_code)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float64).eval()
    checkpoint, aliases = Checkpoint(folder), _aliases(model)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state, keys = {}, set()
    for name in model.state_dict():
        key = _resolve(name, aliases, checkpoint)
        if key is None and name in params:
            raise CheckpointError(f"{folder} has no tensor for {name}")
        if key is not None:
            state[name] = checkpoint.read(key).double()
            keys.add(key)
    model.load_state_dict(state, strict=False)
    for entry in swapped:
        with contextlib.suppress(AttributeError):  # norms of blocks the shell does not hold
            swap_in_rmsnorm(model, entry)
    return model, keys


def _run_shell(model: nn.Module, stacks: list[str],
               inputs: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Call]]:
    """The float outputs of the shell ``model`` on ``inputs``, and the arguments of each stack's first block."""
    calls: dict[str, Call] = {}
    handles = []
    for stack in stacks:
        def keep_call(module, args, kwargs, stack=stack):
            calls[stack] = (args, kwargs)
        with contextlib.suppress(AttributeError):
            handles.append(model.get_submodule(f"{stack}.0").register_forward_pre_hook(keep_call, with_kwargs=True))
    try:
        with torch.no_grad():
            output = model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    leaves = torch.utils._pytree.tree_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()], calls


def _stacks(skeleton: nn.Module, swapped: list[dict[str, Any]]) -> dict[str, tuple[int, bool]]:
    """Stack path -> (number of blocks, centered), for each outermost ModuleList holding a norm;
    centered when it holds a swapped norm."""
    swapped_paths = [entry["path"] for entry in swapped]
    stacks: dict[str, tuple[int, bool]] = {}
    for path, module in skeleton.named_modules():
        if not isinstance(module, _norm_types()):
            continue
        parts = path.split(".")
        for i in range(1, len(parts)):
            stack = ".".join(parts[:i])
            if isinstance(skeleton.get_submodule(stack), nn.ModuleList):
                centered = any(p.startswith(stack + ".") for p in swapped_paths)
                stacks[stack] = (len(skeleton.get_submodule(stack)), centered)
                break
    return stacks


def _compare_copies(orig: Checkpoint, folded: Checkpoint, keys: list[str]) -> list[str]:
    """The keys among ``keys`` whose folded tensor is not the original's cast to its saved dtype
    (one tensor in memory at a time); a key missing from either side counts as different."""
    differ = []
    for key in keys:
        if key not in orig.meta or key not in folded.meta:
            differ.append(key)
            continue
        value = folded.read(key)
        if not torch.equal(orig.read(key).to(value.dtype), value):
            differ.append(key)
    return differ


def _block_width(block: nn.Module) -> int:
    for m in block.modules():
        if isinstance(m, _norm_types()):
            return m.normalized_shape[-1]
    raise CheckpointError("cannot tell the block's width: it has no norm")


def _first(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _rel_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """‖ref − out‖∞ / ‖ref‖∞ (the absolute error where ref is all zeros)."""
    scale = ref.abs().max().item() or 1.0
    return (ref - out).abs().max().item() / scale


def _watch_rms_inputs(block: nn.Module) -> list[float]:
    from ..nn import RMSNorm

    ratios: list[float] = []

    def hook(module, inputs):
        x = inputs[0]
        ratios.append((x.mean(-1).abs() / x.square().mean(-1).sqrt()).max().item())

    for m in block.modules():
        if isinstance(m, RMSNorm):
            m.register_forward_pre_hook(hook)
    return ratios


def verify_by_blocks(orig_dir: str | os.PathLike, folded_dir: str | os.PathLike, report: dict[str, Any] | None = None,
                     *, dtype: str | None = None, trust_remote_code: bool = False, check_weights: bool = True,
                     step: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Prove a folded checkpoint equal to its original without loading either whole (see the
    comment above :func:`check_block`): the shell, every block of every stack (run on the
    original's stream, or compared as a copy when unchanged), and every remaining tensor as a copy;
    then every stored tensor against the fold re-derived from the original
    (:func:`check_streamed_weights`, under ``weights``), which sees what running a piece cannot: in
    a bf16 post-LN BERT a 1.5x MLP weight moves its block's output less than bf16 itself does.

    ``dtype``: the dtype the folded weights were stored in (default: read from the checkpoint).
    Each piece run (``shell``, each of ``blocks``) carries its ``own_error``, ``tolerance``,
    ``tolerance_rule`` and ``ok``; ``ok`` only when every piece is within its own tolerance and
    every tensor of both folders was checked, and the weight check did not fail (a skipped one,
    ``weights["ok"]`` None, does not count). ``tolerance`` is the tightest of the pieces',
    ``tolerance_rule`` names the piece closest to its bound, ``why`` says what failed.
    ``check_weights=False`` skips the weight check (``fold_checkpoint``: the tensors were just
    written by the same code a re-derivation runs, so it would re-read both checkpoints whole to
    compare that code with itself; ``normfold verify`` runs it).
    Memory: the shell (embeddings, head, one block per stack) in float64, then one block at a time;
    the weight check holds one group of tensors the fold rewrites together.
    """
    orig_dir, folded_dir = check_model_dir(orig_dir), check_model_dir(folded_dir)
    if report is None:
        report = json.loads((folded_dir / REPORT_JSON).read_text())
    stored_name = dtype or _stored_dtype(folded_dir)
    if stored_name not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {stored_name!r}")
    stored = DTYPES[stored_name]
    swapped = report["swapped"]
    skeleton = _meta_skeleton(orig_dir, trust_remote_code)
    stacks = _stacks(skeleton, swapped)
    step("checking the embeddings, final norm and head in float64")
    try:
        shell, calls = check_shell(orig_dir, folded_dir, swapped, {s: c for s, (_, c) in stacks.items()},
                                   stored_dtype=stored, trust_remote_code=trust_remote_code)
    except Exception as err:  # a model that cannot run cut short: not proved, so not ok
        shell, calls = {"block": "model cut to its first block", "max_rel_error": math.nan, "ok": False, "keys": [],
                        "problems": [f"could not run the model cut to one block per stack: {_first_line(err)}"]}, {}
    orig, folded = Checkpoint(orig_dir), Checkpoint(folded_dir)
    problems, checks, covered, copies = list(shell["problems"]), [], set(shell["keys"]), 0
    for stack, (n, centered) in stacks.items():
        paths = [f"{stack}.{i}" for i in range(n)]
        keys = {path: sorted(k for k in orig.meta.keys() | folded.meta.keys() if k.startswith(path + "."))
                for path in paths}
        covered.update(k for path in paths for k in keys[path])
        run = [path for path in paths if centered or _compare_copies(orig, folded, keys[path])]
        copies += sum(len(keys[path]) for path in paths if path not in run)
        call = calls.get(stack)
        x = _hidden(call) if call else _random_stream(skeleton, paths[0])  # no shell run: its problem is listed
        for path in paths[:paths.index(run[-1]) + 1] if run else []:
            step(f"checking {path} in float64" if path in run else f"running the original {path} (its stream)")
            try:
                if path in run:
                    result, x = _check_block(skeleton, orig, folded, path, swapped, centered, call, x, stored)
                    checks.append(result)
                else:  # a copy: only the stream the next block reads is needed
                    with torch.no_grad():
                        x = _first(_call(_load_block(skeleton, orig, path), call, x))
            except Exception as err:  # e.g. a block that cannot run alone: not proved, so not ok
                later = [p for p in run if paths.index(p) > paths.index(path)]
                problems.append(f"could not check {path}: {_first_line(err)}"
                                + (f" (so neither {', '.join(later)}, which read its output)" if later else ""))
                break
    step("comparing the tensors the fold does not change")
    rest = sorted((orig.meta.keys() | folded.meta.keys()) - covered)
    problems += [f"{key}: differs from the original (or is missing on one side), though no checked piece holds it"
                 for key in _compare_copies(orig, folded, rest)]
    copies += len(rest)
    if check_weights:
        step("re-deriving the fold and comparing every stored tensor")
        weights = check_streamed_weights(orig_dir, folded, report, trust_remote_code=trust_remote_code)
    else:
        weights = skipped("at fold time the tensors were just written by the streaming code a re-derivation "
                          "would run again; `normfold verify ORIG OUT` re-derives and compares them")
    pieces = [shell, *checks]
    errors = [c["max_rel_error"] for c in pieces]
    ratios = [c["max_input_mean_ratio"] for c in checks if c["max_input_mean_ratio"] is not None]
    verification = {
        "ok": not problems and all(c["ok"] for c in pieces) and weights["ok"] is not False,
        "max_rel_error": math.nan if any(math.isnan(e) for e in errors) else max(errors),
        "max_input_mean_ratio": max(ratios) if ratios else None,
        "tolerance": min((c["tolerance"] for c in pieces if "tolerance" in c), default=math.nan),
        "tolerance_rule": _tolerance_rule(pieces), "stored_dtype": stored_name, "num_runs": len(checks) + 1,
        "blocks": checks, "shell": {k: v for k, v in shell.items() if k != "keys"}, "copied_tensors": copies,
        "problems": problems, "weights": weights}
    verification["why"] = None if verification["ok"] else _failure(verification)
    return verification


def check_streamed_weights(orig_dir: Path, folded: Checkpoint, report: dict[str, Any], *,
                           trust_remote_code: bool = False) -> dict[str, Any]:
    """Every tensor of ``folded`` against the streaming fold re-derived from the original checkpoint.

    The fold is re-run as ``fold_checkpoint`` ran it: :func:`plan_for_checkpoint` with the
    ``fold_affine`` and saved dtype the report records, then ``_Rewrite.compute`` group by group
    (one group of tensors in memory at a time), each tensor compared with the stored one by
    :func:`normfold.hf.saved_weights.compare_weights` (within one ulp of the stored dtype; the
    key sets must be equal). Skipped, with the reason, when the report lacks what the
    re-derivation needs or records another plan than the one derived (another normfold, another
    original); a re-derivation that fails is a failure (nothing was compared).
    """
    from .folder import _same_plan

    reason = why_not_rederivable(report)
    if reason:
        return skipped(reason)
    out_dtype = _rederived_out_dtype(folded, report["saved_dtype"])
    try:
        derived_report, skeleton, original = plan_for_checkpoint(
            orig_dir, fold_affine=bool(report["fold_affine"]), trust_remote_code=trust_remote_code,
            stored_dtype=out_dtype)
        if not _same_plan(derived_report.plan, report["plan"]):
            return skipped("the plan this normfold derives from the original differs from the one the report "
                           "records (folded by another normfold version, or from another original): the weights "
                           "cannot be re-derived")
        derived = _DerivedTensors(_Rewrite(derived_report.plan, skeleton, original, out_dtype))
        names = sorted(folded.meta, key=derived.group_order)  # a group's keys in a row: each group computed once
        return compare_weights(derived, names, folded.read, {})
    except Exception as err:  # e.g. an original that no longer plans: nothing proved, so not ok
        return not_compared(f"could not re-derive the fold from the original and compare: {_first_line(err)}")


def _rederived_out_dtype(folded: Checkpoint, saved_dtype: str) -> torch.dtype | None:
    """The ``out_dtype`` the fold wrote with: the saved dtype when ``folded`` stores every floating
    tensor in it (a fold with ``--dtype``, or of an original in one dtype, where both readings
    agree), else None (a mixed-dtype original folded without ``--dtype`` keeps each tensor's)."""
    floating = {d for d, _ in folded.meta.values() if _FROM_ST[d].is_floating_point}
    return DTYPES[saved_dtype] if floating <= {_ST_DTYPES[DTYPES[saved_dtype]]} else None


class _DerivedTensors(Mapping):
    """The streaming fold's output tensors by key, computed on first access by ``_Rewrite.compute``,
    which yields a key's whole group; only the last group is kept (ask for a group's keys in a row)."""

    def __init__(self, rewrite: _Rewrite) -> None:
        self.rewrite = rewrite
        self.names = [*rewrite.checkpoint.meta, *(k for k in rewrite.new_keys if k not in rewrite.checkpoint.meta)]
        self.known = set(self.names)
        self.group: dict[str, torch.Tensor] = {}

    def group_order(self, key: str) -> tuple[str, str]:
        """Sort key putting the keys of one group next to each other."""
        return self.rewrite.group_of.get(key, key), key

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.known:
            raise KeyError(key)
        if key not in self.group:
            self.group = self.rewrite.compute(key)
        return self.group[key]

    def __contains__(self, key: object) -> bool:
        return key in self.known

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _closest_to_bound(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """The piece with the largest error / tolerance (NaN or unmeasured: infinite)."""
    def ratio(piece: dict[str, Any]) -> float:
        error, tolerance = piece["max_rel_error"], piece.get("tolerance", math.nan)
        if math.isnan(error) or math.isnan(tolerance):
            return math.inf
        return error / tolerance if tolerance > 0 else math.inf

    return max(pieces, key=ratio)


def _tolerance_rule(pieces: list[dict[str, Any]]) -> str:
    """The verification's rule in words, with the numbers of the piece closest to its bound."""
    closest = _closest_to_bound(pieces)
    text = "each piece (the model cut to its first blocks, each block run) within its own tolerance"
    if "tolerance_rule" not in closest:
        return f"{text}; {closest['block']} was not measured"
    return (f"{text}; closest to its bound: {closest['block']}, error {closest['max_rel_error']:.1e}, tolerance "
            f"{closest['tolerance']:.1e} = {closest['tolerance_rule']}")


def _failure(verification: dict[str, Any]) -> str:
    """One line saying why a verification failed."""
    weights = verification.get("weights") or {}
    stored = f"stored weights: {weights['why']}" if weights.get("ok") is False else None
    pieces = [verification["shell"], *verification["blocks"]]
    if verification["problems"]:
        outputs = f"float64 check failed: {verification['problems'][0]}"
    elif all(piece["ok"] for piece in pieces):
        return stored
    else:
        worst = _closest_to_bound(pieces)
        outputs = (f"float64 check failed: {worst['block']} relative error {worst['max_rel_error']:.1e} > tolerance "
                   f"{worst.get('tolerance', math.nan):.1e} = {worst.get('tolerance_rule', 'not measured')}")
    return outputs if stored is None else f"{outputs}; {stored}"


def _stored_dtype(model_dir: Path) -> str:
    ckpt_dtypes = {d for d, _ in Checkpoint(model_dir).meta.values()}
    for name, code in (("bfloat16", "BF16"), ("float16", "F16")):
        if code in ckpt_dtypes:
            return name
    return "float32"


def is_sharded(model_dir: str | os.PathLike) -> bool:
    return (Path(model_dir) / INDEX).is_file()
