"""How a folder was made: the command and the options that pick one result among the valid ones,
recorded in its report as ``"recipe"``. ``normfold verify`` re-makes the folder from the original with
them and compares; nothing else a folder says about itself is believed.

A recipe can only *choose* (fold γ/β or not, a saved dtype, a rotation's method and seed, an
approximate fold's cosine bar, a learned rotation's bases by their SHA-256): every choice gives a
correct result, proved when it is re-made, so a folder that lies in its recipe gets re-made as
something else and fails the comparison. A learned rotation is not learned again: its bases are
stored in the folder (:data:`BASES_FILE`), and any orthogonal basis is a correct choice, checked to
1e-12 and proved against the original when the folder is re-made with it. What the
result is judged by (the cosine an approximate folder must keep) comes from the person verifying.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..engine.cosine_bar import is_cosine_bar
from .errors import CheckpointError

COMMANDS = ("fold", "rotate", "save_pretrained")
ROTATION_METHODS = ("hadamard", "random", "pca", "learned")
BASES_FILE = "normfold_rotation/bases.safetensors"  # a learned rotation's bases, stored beside the weights
SEED_RANGE = (0, 2**63 - 1)  # what torch.Generator.manual_seed takes
SAVED_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CalibrationRecord:
    """What an output keeps of a calibration text: never the text (it is the user's data), only what
    identifies it: the SHA-256 of the file's bytes, its sentence count and the path it was read from."""

    sha256: str
    num_sentences: int
    path: str

    @classmethod
    def of_file(cls, path: str | os.PathLike, num_sentences: int) -> CalibrationRecord:
        return cls(file_sha256(path), num_sentences, str(Path(path).absolute()))


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


@dataclass(frozen=True)
class Rotation:
    """A rotation's choices (``normfold rotate``): the basis, its seed, the share of directions sliced
    away, and for a learned basis the SHA-256 of :data:`BASES_FILE` (recorded only then)."""

    method: str
    seed: int
    slice_fraction: float = 0.0
    bases_sha256: str | None = None


@dataclass(frozen=True)
class Recipe:
    """How a folder was made (module docstring).

    ``command``: ``fold``, ``rotate`` or ``save_pretrained`` (a fold made in Python, saved by
    ``normfold.save_pretrained``); ``streaming``: rewritten shard by shard; ``fold_affine``: γ/β moved
    into the next layers where possible; ``dtype``: the dtype asked for (``--dtype``; None: each tensor
    as the original stores it); ``approximate_min_cosine``: the
    bar ``fold --approximate`` fitted the replaced norms to (None: an exact fold); ``rotation``: the
    rotation's choices; ``calibration``: the calibration text an approximate fold or a PCA rotation
    was computed from; ``stock_plan``: planned within what stock transformers loads (``save_pretrained``
    folds may not be); ``side_files``: the original's other files (tokenizer, ...) were carried over
    (``save_pretrained`` without ``source_dir`` carries none); ``keep``: the norms kept by request
    (``--keep`` / ``keep=`` patterns); ``calls``: the kinds of example call the fold was planned for
    (``--call``; empty: the default one). Both are recorded only when set, and only for in-memory folds.
    """

    command: str
    streaming: bool
    fold_affine: bool
    dtype: str | None
    approximate_min_cosine: float | None = None
    rotation: Rotation | None = None
    calibration: CalibrationRecord | None = None
    stock_plan: bool = True
    side_files: bool = True
    keep: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in _RECORDED_WHEN_SET:  # the reports of folds without them stay as they were
            if not data[name]:
                del data[name]
        if data["rotation"] is not None and data["rotation"]["bases_sha256"] is None:  # likewise
            del data["rotation"]["bases_sha256"]
        return data

    @classmethod
    def from_dict(cls, data: object) -> Recipe:
        """The recipe a report records; CheckpointError naming the first field that is missing, of
        another type or out of range (a recipe is read from a folder nobody vouches for)."""
        if not isinstance(data, dict):
            raise CheckpointError(f"the report's recipe must be a JSON object, got {_show(data)}")
        _expect_keys(data, cls, "recipe", optional=_RECORDED_WHEN_SET)
        command = _one_of(data, "command", COMMANDS, "recipe")
        dtype = data["dtype"]
        if dtype is not None and dtype not in SAVED_DTYPES:
            raise CheckpointError(f"recipe.dtype must be null or one of {', '.join(SAVED_DTYPES)}, got {_show(dtype)}")
        min_cosine = data["approximate_min_cosine"]
        if min_cosine is not None and not is_cosine_bar(min_cosine):
            raise CheckpointError(f"recipe.approximate_min_cosine must be null or a number in (0, 1], got "
                                  f"{_show(min_cosine)}")
        recipe = cls(command=command, streaming=_field(data, "streaming", bool, "recipe"),
                     fold_affine=_field(data, "fold_affine", bool, "recipe"), dtype=dtype,
                     approximate_min_cosine=None if min_cosine is None else float(min_cosine),
                     rotation=None if data["rotation"] is None else _rotation(data["rotation"]),
                     calibration=None if data["calibration"] is None else _calibration(data["calibration"]),
                     stock_plan=_field(data, "stock_plan", bool, "recipe"),
                     side_files=_field(data, "side_files", bool, "recipe"),
                     keep=_names(data, "keep"), calls=_names(data, "calls"))
        if recipe.keep and (recipe.streaming or command == "rotate" or min_cosine is not None):
            raise CheckpointError("recipe.keep must be recorded only for in-memory exact folds, got "
                                  f"{list(recipe.keep)} for a {'streamed ' * recipe.streaming}{command}"
                                  f"{' (approximate)' if min_cosine is not None else ''}")
        if recipe.calls and (recipe.streaming or command != "fold"):
            raise CheckpointError(f"recipe.calls must be recorded only for in-memory folds, got {list(recipe.calls)} "
                                  f"for a {'streamed ' * recipe.streaming}{command}")
        if command == "save_pretrained" and dtype is None:
            raise CheckpointError("recipe.dtype must name the saved dtype for command 'save_pretrained', got null")
        needs_calibration = min_cosine is not None or (recipe.rotation is not None and recipe.rotation.method == "pca")
        if needs_calibration != (recipe.calibration is not None):
            raise CheckpointError("recipe.calibration must be recorded exactly for an approximate fold or a PCA "
                                  f"rotation, got {'none' if recipe.calibration is None else 'one'} for this recipe")
        if recipe.rotation is not None and recipe.rotation.method == "learned" and recipe.streaming:
            raise CheckpointError("recipe.rotation.method 'learned' must not be recorded for a streamed rotation "
                                  "(learned bases need the model in memory)")
        if (command == "rotate") != (recipe.rotation is not None):
            raise CheckpointError(f"recipe.rotation must be recorded exactly for command 'rotate', got "
                                  f"{'none' if recipe.rotation is None else 'one'} for command {command!r}")
        return recipe


def _rotation(data: object) -> Rotation:
    if not isinstance(data, dict):
        raise CheckpointError(f"recipe.rotation must be a JSON object, got {_show(data)}")
    _expect_keys(data, Rotation, "recipe.rotation", optional=("bases_sha256",))
    method = _one_of(data, "method", ROTATION_METHODS, "recipe.rotation")
    seed = _field(data, "seed", int, "recipe.rotation")
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise CheckpointError(f"recipe.rotation.seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed}")
    fraction = data["slice_fraction"]
    if not is_finite_number(fraction) or not 0.0 <= fraction < 1.0:
        raise CheckpointError(f"recipe.rotation.slice_fraction must be a number in [0, 1), got {_show(fraction)}")
    bases = data.get("bases_sha256")
    if (method == "learned") != (bases is not None):
        raise CheckpointError(f"recipe.rotation.bases_sha256 must be recorded exactly for method 'learned', got "
                              f"{'none' if bases is None else 'one'} for method {method!r}")
    if bases is not None:
        _check_sha256(_field(data, "bases_sha256", str, "recipe.rotation"), "recipe.rotation.bases_sha256")
    if method == "learned" and fraction:
        raise CheckpointError(f"recipe.rotation.slice_fraction must be 0 for method 'learned', got {fraction!r}")
    return Rotation(method, seed, float(fraction), bases)


def _calibration(data: object) -> CalibrationRecord:
    if not isinstance(data, dict):
        raise CheckpointError(f"recipe.calibration must be a JSON object, got {_show(data)}")
    _expect_keys(data, CalibrationRecord, "recipe.calibration")
    sha = _check_sha256(_field(data, "sha256", str, "recipe.calibration"), "recipe.calibration.sha256")
    count = _field(data, "num_sentences", int, "recipe.calibration")
    if count < 1:
        raise CheckpointError(f"recipe.calibration.num_sentences must be >= 1, got {count}")
    return CalibrationRecord(sha, count, _field(data, "path", str, "recipe.calibration"))


def _check_sha256(sha: str, where: str) -> str:
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise CheckpointError(f"{where} must be 64 lowercase hex digits, got {sha!r:.80}")
    return sha


_RECORDED_WHEN_SET = ("keep", "calls")  # Recipe fields absent from a report when empty


def _names(data: dict, name: str) -> tuple[str, ...]:
    """``recipe.keep`` / ``recipe.calls``: a list of non-empty strings (empty when absent)."""
    value = data.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise CheckpointError(f"recipe.{name} must be a list of non-empty strings, got {_show(value)}")
    return tuple(value)


def _expect_keys(data: dict, cls: type, where: str, optional: tuple[str, ...] = ()) -> None:
    """CheckpointError unless ``data`` holds exactly the fields of dataclass ``cls`` (``optional`` ones may be absent)."""
    expected = {f.name for f in fields(cls)}
    missing, extra = sorted(expected - data.keys() - set(optional)), sorted(data.keys() - expected)
    if missing or extra:
        said = ([f"lacks {', '.join(missing)}"] if missing else []) + ([f"has unknown {', '.join(extra)}"] if extra else [])
        raise CheckpointError(f"{where} {' and '.join(said)} (expected exactly: {', '.join(sorted(expected))})")


def _field(data: dict, name: str, kind: type, where: str):
    value = data[name]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)) or \
            kind is not int and not isinstance(value, kind):
        raise CheckpointError(f"{where}.{name} must be a {kind.__name__}, got {_show(value)}")
    return value


def _one_of(data: dict, name: str, choices: tuple[str, ...], where: str) -> str:
    value = _field(data, name, str, where)
    if value not in choices:
        raise CheckpointError(f"{where}.{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def is_finite_number(value: object) -> bool:
    """A JSON number that is finite (not a bool, which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: object) -> str:
    return f"{type(value).__name__} {value!r:.60}"
