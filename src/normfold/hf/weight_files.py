"""Which files a Hugging Face folder's weights load from, resolved as transformers resolves them, and
every tensor they hold.

One answer for every reader (``normfold.from_pretrained``, the streaming fold, ``normfold verify``),
so that a check never looks at other files than the ones that load. transformers (5.x, a local
folder, no ``variant``) takes the first of: the file ``config.json`` names as
``"transformers_weights"``; ``model.safetensors``; ``model.safetensors.index.json``;
``pytorch_model.bin``; ``pytorch_model.bin.index.json``; then every file the config class lists in
``extra_files``. From an index it loads *every* tensor of every shard the index names (sorted by
name; a key in two shards: the last one wins), whatever the index's ``weight_map`` says. A folder only
normfold loads correctly stores its entry under normfold's own name instead
(:mod:`normfold.hf.normfold_only`), which no stock class looks for and ``normfold.from_pretrained`` names.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .._deps import require
from .._text import first_line
from . import normfold_only
from .errors import CheckpointError
from .side_files import WEIGHT_SUFFIXES

SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_SINGLE, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_DEFAULT_ORDER = (SAFE_SINGLE, SAFE_INDEX, BIN_SINGLE, BIN_INDEX)
_NORMFOLD_ORDER = (normfold_only.SINGLE, normfold_only.INDEX)  # only where none of transformers' is present

# What loads weights in some tool: a second one beside the source transformers picks could load instead
# (another library, another transformers option), so a folder holding one is ambiguous.
WEIGHT_FILE_SUFFIXES = (*WEIGHT_SUFFIXES, ".index.json")


@dataclass(frozen=True)
class WeightSource:
    """The weights of ``folder`` as transformers loads them: ``entry`` (the file it opens first: a
    weights file or an index), ``files`` (the weight files it reads, in its order) and ``chosen_by``
    (why that entry, in words)."""

    folder: Path
    entry: str
    files: tuple[str, ...]
    chosen_by: str

    @property
    def names(self) -> tuple[str, ...]:
        """The entry and the weight files, each once (the entry is a weight file unless it is an index)."""
        return tuple(dict.fromkeys((self.entry, *self.files)))

    @property
    def is_index(self) -> bool:
        return self.entry.endswith(".index.json")

    @property
    def is_safetensors(self) -> bool:
        return all(f.endswith(".safetensors") for f in self.files)


def weight_source(folder: str | os.PathLike, *, extra_files: tuple[str, ...] = ()) -> WeightSource:
    """The files ``folder``'s weights load from (module docstring), or CheckpointError when there are
    none or the entry is unusable. ``extra_files``: the config class's own ``extra_files``."""
    folder = Path(folder)
    explicit = _config_field(folder, "transformers_weights")
    if explicit is not None:
        if not isinstance(explicit, str) or not explicit.endswith((".safetensors", ".safetensors.index.json")):
            raise CheckpointError(f"{folder / 'config.json'}: \"transformers_weights\" must name a *.safetensors or "
                                  f"*.safetensors.index.json file, got {explicit!r}")
        entry = check_plain_file_name(explicit, folder / "config.json")
        if not (folder / entry).is_file():
            raise CheckpointError(f"{folder / 'config.json'} names the weights {entry!r} (\"transformers_weights\"), "
                                  f"which {folder} does not hold")
        chosen_by = f"config.json names it (\"transformers_weights\": {entry!r})"
    elif (entry := next((name for name in _DEFAULT_ORDER if (folder / name).is_file()), None)) is not None:
        chosen_by = f"the first of {', '.join(_DEFAULT_ORDER)} present (transformers' order)"
    elif (entry := next((name for name in _NORMFOLD_ORDER if (folder / name).is_file()), None)) is not None:
        chosen_by = "normfold's own name (a folder only normfold.from_pretrained loads)"
    else:
        raise CheckpointError(f"no weights in {folder}: expected {', '.join(_DEFAULT_ORDER)} (transformers' order)")
    files = _shards(folder / entry) if entry.endswith(".index.json") else [entry]
    files += [f for f in extra_files if (folder / f).is_file() and f not in files]
    return WeightSource(folder, entry, tuple(files), chosen_by)


def other_weight_files(source: WeightSource) -> list[str]:
    """Weight files at the top of the folder that ``source`` does not load (a stale ``model.safetensors``
    beside an index, a ``pytorch_model.bin`` beside safetensors, an alternative file): what another
    tool, or transformers with other options, could load instead. A Trainer's ``training_args.bin``
    and ``optimizer.pt``-style state are not weights of the model and are not listed."""
    used = set(source.names)
    return sorted(p.name for p in source.folder.iterdir()
                  if p.name not in used and p.name.endswith(WEIGHT_FILE_SUFFIXES) and not _is_training_state(p.name))


def _is_training_state(name: str) -> bool:
    """Files a Hugging Face Trainer saves beside a checkpoint that hold no model weights."""
    return name in ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth") \
        or (name.startswith("rng_state_") and name.endswith(".pth"))


def stored_tensors(source: WeightSource) -> dict[str, Path]:
    """Tensor name -> the file holding it, for every tensor of every file ``source`` loads.

    CheckpointError for what would make the answer depend on the reader: a name in two files (transformers
    keeps the last, other tools the first), an index whose ``weight_map`` disagrees with the shards.
    """
    found: dict[str, Path] = {}
    for name in source.files:
        for key in tensor_names(source.folder / name):
            if key in found:
                raise CheckpointError(f"{key} is stored twice, in {found[key].name} and {name}: which one loads "
                                      "depends on the reader")
            found[key] = source.folder / name
    if source.is_index:
        listed = _weight_map(source.folder / source.entry)
        wrong = sorted(k for k in listed.keys() | found.keys() if listed.get(k) != (found[k].name if k in found else None))
        if wrong:
            key = wrong[0]
            where = found[key].name if key in found else "no shard"
            raise CheckpointError(f"{source.entry} disagrees with its shards on {len(wrong)} tensor(s), e.g. {key}: "
                                  f"the index says {listed.get(key, 'nothing')}, it is in {where}")
    return found


def tensor_names(file: Path) -> list[str]:
    """The tensor names a weight file holds, read from its header (safetensors) or without its data (.bin)."""
    try:
        if file.suffix == ".safetensors":
            with require("safetensors").safe_open(file, framework="pt") as f:
                return list(f.keys())
        return list(torch.load(file, map_location="meta", weights_only=True, mmap=True))
    except Exception as err:  # safetensors' own SafetensorError, unpickling errors
        raise CheckpointError(f"corrupt weight file {file}: {first_line(err)}") from err


def read_tensor(file: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of weight file ``file``, in its own memory."""
    if file.suffix == ".safetensors":
        with require("safetensors").safe_open(file, framework="pt") as f:
            return f.get_tensor(name)
    return torch.load(file, map_location="cpu", weights_only=True, mmap=True)[name].clone()


def check_plain_file_name(name: object, source: Path) -> str:
    """``name`` when it is a plain file name (no folder part, not ``.``/``..``, not absolute, no NUL),
    else CheckpointError naming ``source``, the file that listed it: names read from files become
    paths, and ``../x`` or ``/etc/x`` would reach outside the folder."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name or "/" in name or "\\" in name \
            or os.path.isabs(name):
        raise CheckpointError(f"{source} lists the file {name!r}: expected a plain file name inside the model folder "
                              "(no '/', '..', absolute path or NUL)")
    return name


def _shards(index: Path) -> list[str]:
    """The shard files an index names, in transformers' order (sorted, each once)."""
    return sorted({check_plain_file_name(f, index) for f in _weight_map(index).values()})


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file); CheckpointError unless it is a non-empty object."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index} is not a weight index: {first_line(err)}") from err
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(k, str) for k in weight_map):
        raise CheckpointError(f"{index}: expected a non-empty \"weight_map\" object, got {weight_map!r:.80}")
    return weight_map


def _config_field(folder: Path, field: str) -> object:
    """A top-level field of ``folder/config.json`` (None when absent or unreadable: loading the config says why)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return config.get(field) if isinstance(config, dict) else None


def saved_names(model: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """Each of ``names`` (the model's own) -> the key ``save_pretrained`` stores that tensor under.

    transformers renames some keys when it saves, and back when it loads (GPT-NeoX's ``lm_head.`` is
    stored as ``embed_out.``, ViT's ``layers.0.attention.q_proj`` as
    ``encoder.layer.0.attention.attention.query``); a tensor normfold reads or writes in a folder
    itself must follow. CheckpointError where transformers stores them otherwise than one tensor per
    name (experts merged into one tensor or split when loading), which a reader by name cannot follow.
    """
    revert = getattr(require("transformers.core_model_loading"), "revert_weight_conversion", None)
    if revert is None or not names:  # a transformers without key conversions stores every name as it is
        return {name: name for name in names}
    marks = {name: torch.tensor(i) for i, name in enumerate(names)}  # each tensor tells which name it came from
    try:
        saved = revert(model, marks)
    except Exception as err:  # noqa: BLE001  a converter that reshapes tensors fails on the one-number marks
        saved, cause = {}, first_line(err)
    else:
        cause = "not one stored tensor per tensor of the model"
    ids = {id(mark) for mark in marks.values()}
    back = {int(t): key for key, t in saved.items() if id(t) in ids}
    if len(saved) != len(names) or len(back) != len(names):
        raise CheckpointError(f"transformers stores the tensors of {type(model).__name__} otherwise than by name "
                              f"(it merges or splits them when loading: {cause}), which a reader of stored "
                              "tensors by name cannot follow")
    return {name: back[i] for i, name in enumerate(names)}
