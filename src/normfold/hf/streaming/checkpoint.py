"""A safetensors checkpoint read and written one tensor at a time: the key -> file map, the
headers' shapes and dtypes, single-tensor reads, and a writer that streams tensors into a new file."""
from __future__ import annotations

import json
import math
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._deps import require
from ..._text import first_line
from ..load import CheckpointError
from ...engine.graph import parameter_aliases
from ..weight_files import saved_names, stored_tensors, weight_source

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}  # torch dtype -> the code a safetensors header writes
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}  # header code -> torch dtype


class Checkpoint:
    """The tensors of a safetensors folder, from the files transformers loads
    (:func:`normfold.hf.weight_files.weight_source`): which file holds each key, shapes and dtypes from
    the headers, and reads of one tensor at a time (each read opens and closes its file, so no file
    stays mapped and resident memory does not grow with the checkpoint)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.source = weight_source(folder)
        if not self.source.is_safetensors:
            raise CheckpointError(f"streaming needs safetensors weights: {folder} loads from {self.source.entry}")
        safe_open = require("safetensors").safe_open
        self.file_of: dict[str, str] = {key: path.name for key, path in stored_tensors(self.source).items()}
        self.files: dict[str, list[str]] = {}    # file -> keys in file order
        self.meta: dict[str, tuple[str, list[int]]] = {}   # key -> (safetensors dtype, shape)
        for name in self.source.files:
            try:
                with safe_open(folder / name, framework="pt") as f:
                    keys = list(f.keys())
                    for key in keys:
                        sl = f.get_slice(key)
                        self.meta[key] = (sl.get_dtype(), list(sl.get_shape()))
            except Exception as err:  # SafetensorError for a corrupt header
                raise CheckpointError(f"corrupt safetensors file {folder / name}: {first_line(err)}") from err
            self.files[name] = keys
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


def write_safetensors(path: Path, entries: list[tuple[str, str, list[int]]],
                      produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file tensor by tensor: the header (computed from ``entries`` =
    (key, safetensors dtype, shape)) first, then ``produce(key)`` for each key in order.

    Returns the number of bytes of tensor data written.
    """
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * TORCH_DTYPES[dtype].itemsize
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, dtype, shape in entries:
            t = produce(key)
            if t.dtype != TORCH_DTYPES[dtype] or list(t.shape) != list(shape):
                raise AssertionError(f"{key}: produced {t.dtype} {tuple(t.shape)}, header says {dtype} {shape}")
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return offset


class StoredKeys:
    """Which checkpoint key stores each tensor of ``model`` (by the model's names): the name transformers
    saves it under (:func:`normfold.hf.weight_files.saved_names`: some keys are renamed on saving), its
    own name, or those of a name tied to it (a tied tensor is stored once)."""

    def __init__(self, model: nn.Module, checkpoint: Checkpoint) -> None:
        self.model, self.checkpoint = model, checkpoint
        self.aliases = parameter_aliases(model)
        names = {name for name, _ in model.named_parameters(remove_duplicate=False)} | set(model.state_dict())
        self.saved = saved_names(model, sorted(names))

    def key(self, name: str) -> str | None:
        """The key storing tensor ``name``, None when the checkpoint stores none."""
        owner = self.owner(name)
        return None if owner is None else self.own_key(owner)

    def owner(self, name: str) -> str | None:
        """The name, ``name`` or one tied to it, whose own key stores the tensor (None: none does)."""
        return next((tied for tied in (name, *self.aliases.get(name, ())) if self.own_key(tied) is not None), None)

    def own_key(self, name: str) -> str | None:
        """The key stored under ``name`` itself (saved, or as the model names it), not through a tie."""
        return next((key for key in (self.saved_name(name), name) if key in self.checkpoint.meta), None)

    def saved_name(self, name: str) -> str:
        """The key a tensor ``name`` is saved under, also one the model lacks (a tensor the fold creates)."""
        return self.saved[name] if name in self.saved else saved_names(self.model, [name])[name]


def stored_dtype_name(model_dir: Path) -> str:
    """The dtype a checkpoint stores its weights in: bfloat16 or float16 when any tensor is, else float32."""
    ckpt_dtypes = {d for d, _ in Checkpoint(model_dir).meta.values()}
    for name, code in (("bfloat16", "BF16"), ("float16", "F16")):
        if code in ckpt_dtypes:
            return name
    return "float32"


def is_sharded(model_dir: str | os.PathLike) -> bool:
    """Whether ``model_dir``'s weights load from an index (a sharded checkpoint), as transformers resolves them."""
    try:
        return weight_source(model_dir).is_index
    except CheckpointError:  # no weights at all: loading the folder says why
        return False
