"""Writing a rotated Hugging Face folder (``normfold rotate DIR -o OUT``): hf loads the folder, gives the
example inputs and saves atomically; the rotation itself (``normfold.rotate``, which proves the result
in float64) is given by the caller, the CLI, since hf never imports ``rotate`` (docs/CONTRIBUTING.md).
Sharded checkpoints go through the streaming fold with the rotation as its step after the fold
(:func:`rotate_checkpoint`); PCA, slicing and learned bases (``calibration_file``) need the model in
memory. A learned rotation's bases are stored beside the weights (:data:`~normfold.hf.recipe.BASES_FILE`,
:func:`write_bases`), their SHA-256 in the recipe: ``normfold verify`` re-makes the folder from the
original with them (:func:`read_bases`) instead of learning again.

A rotated folder is not stock-loadable: its norms are weightless RMSNorms reading a rotated stream
x·Q, whose mean is not zero, so the LayerNorm stock transformers rebuilds there would subtract it.
``normfold_report.json`` records the layout (:func:`normfold.hf.saving.folded_layout`) from which
:func:`normfold.from_pretrained` rebuilds the rotated model exactly, and says so in ``stock_warning``.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import asdict, replace
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._deps import require
from .._text import dtype_name
from ..engine.report import ReportSection
from .card import write_model_card
from .errors import CheckpointError
from .folder import Step, silent_step
from .inputs import calibration_batches, example_inputs_for, load_tokenizer, read_calibration_file
from .load import check_model_dir, load_model
from .output_dir import atomic_output_dir
from .folder_report import FolderReport, Layout, SkippedFile
from .recipe import BASES_FILE, CalibrationRecord, Recipe, Rotation, file_sha256
from .report import describe_model, folder_report, write_sealed_report
from .saving import folded_layout, save_folded
from .side_files import copy_side_files
from .streaming.publish import PlanAfterFold, fold_checkpoint
from .streaming.rewrite import AfterFold


# The rotation, as the caller composes it (the CLI: normfold.rotate with the user's method, seed and
# slice fraction): (model, example inputs, calibration calls or None) -> (rotated copy, its RotationReport);
# the whole rotation proved equal in float64 (when sliced, before slicing)
Rotate = Callable[[nn.Module, dict, "list[dict] | None"], "tuple[nn.Module, ReportSection]"]

STOCK_WARNING = ("rotated: written for normfold.from_pretrained only (stock transformers refuses the folder: it "
                 "would rebuild the weightless RMSNorms as LayerNorms, which re-center the rotated residual stream, "
                 "whose mean is not zero)")
SLICED_WARNING = ("sliced: approximate, not exact; the whole rotation was proved in float64 before slicing, the "
                  "sliced model is only measured (cosine and loss on the calibration text, in the report)")


def rotate_folder(model_dir: str | os.PathLike, out_dir: str | os.PathLike, rotate: Rotate, *,
                  calibration_file: str | os.PathLike | None = None, calibration_count: int | None = None,
                  overwrite: bool = False, trust_remote_code: bool = False, step: Step = silent_step) -> dict[str, Any]:
    """Rotate a folder's residual stream with ``rotate`` and write OUT_DIR only once it returned (its
    float64 proof passed); any refusal or failed proof raises and leaves no OUT_DIR.

    ``calibration_file`` (PCA): UTF-8 text, one example per line, tokenized with the folder's own
    tokenizer (:func:`normfold.hf.inputs.read_calibration_file`, as ``fold --approximate`` reads it),
    in batches with language-model labels where the model takes them, so the report gives the
    sliced model's loss. A missing or empty file, or a folder without a tokenizer, raises
    ``CheckpointError`` before the model is loaded. ``calibration_count``: only the file's first that
    many sentences (CheckpointError, before loading, when it has fewer).

    A learned rotation (``rotation.method == "learned"``) stores its bases in the folder
    (:func:`write_bases`) and records their SHA-256 in the recipe; what the learning read and did is
    described under ``rotation.learning`` (with the calibration file's record), not in the recipe:
    the folder is re-made from its bases, not learned again.

    The weights are saved in the dtype they were proved in (float32, the dtype ``load_model`` gives):
    rounding rotated weights to 16 bits is a change no proof covered. Side files (tokenizer, ...) are
    copied as ``normfold fold`` copies them. Returns the report written to ``normfold_report.json``.
    """
    model_dir = check_model_dir(model_dir)
    sentences = tokenizer = None
    if calibration_file is not None:  # every user error before the model is loaded
        sentences = read_calibration_file(calibration_file)
        if calibration_count is not None and len(sentences) < calibration_count:
            raise CheckpointError(f"the calibration count {calibration_count} exceeds the {len(sentences)} sentences "
                                  f"of {calibration_file}")
        sentences = sentences[:calibration_count]
        tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    with atomic_output_dir(out_dir, overwrite=overwrite, protect=(model_dir,)) as tmp:
        step("loading")
        model = load_model(model_dir, trust_remote_code=trust_remote_code)
        calibration = None if sentences is None else calibration_calls(model, tokenizer, sentences)
        step("rotating and proving in float64")
        rotated, rotation = rotate(model, example_inputs_for(model), calibration)
        saved_dtype = next(rotated.parameters()).dtype
        step("saving")
        save_folded(rotated, tmp, normfold_only=True)
        learned = rotation.method == "learned"
        bases_sha256 = write_bases(tmp, [s.basis for s in rotation.streams]) if learned else None
        record = None if sentences is None else CalibrationRecord.of_file(calibration_file, len(sentences))
        used = None if record is None else {**asdict(record), "num_batches": len(calibration)}
        slicing = rotation.slicing
        out = rotated_report(rotation, folded_layout(rotated), saved_dtype=dtype_name(saved_dtype),
                             model=describe_model(model, model_dir),
                             skipped_files=SkippedFile.listed(copy_side_files(model_dir, tmp)),
                             calibration=None if learned else used,
                             recipe=Recipe(command="rotate", streaming=False, fold_affine=True, dtype=None,
                                           calibration=None if learned else record, rotation=Rotation(
                                               rotation.method, rotation.seed,
                                               0.0 if slicing is None else slicing.fraction, bases_sha256)))
        learning = out.sections["rotation"].get("learning")
        if learned and used is not None and learning is not None:  # what the learning read, beside how it went
            out = out.with_section("rotation", {**out.sections["rotation"],
                                                "learning": {**learning, "calibration_file": used}})
        write_model_card(out, tmp)
        written = write_sealed_report(out.to_json(), tmp)
    return {**written, "out_dir": str(Path(out_dir).absolute())}


def write_bases(folder: Path, bases: list[Tensor]) -> str:
    """Store a learned rotation's bases (float64, ``stream.0``, ``stream.1``, ... in the order of the
    model's streams) as :data:`~normfold.hf.recipe.BASES_FILE` in ``folder``; returns the file's SHA-256."""
    save_file = require("safetensors.torch").save_file
    path = folder / BASES_FILE
    path.parent.mkdir()
    save_file({f"stream.{i}": q.detach().to(device="cpu", dtype=torch.float64).contiguous()
               for i, q in enumerate(bases)}, str(path))
    return file_sha256(path)


def read_bases(folder: Path, sha256: str) -> list[Tensor]:
    """The bases a learned rotation's folder stores, when the file is the one its recipe names by
    ``sha256``: CheckpointError when it is missing, a link, of another SHA-256, or holds anything but
    ``stream.0`` ... ``stream.{k-1}``. Whether each is an orthogonal (d, d) matrix is checked where
    they are used (``normfold.rotate.RotateConfig``), never believed."""
    path = folder / BASES_FILE
    if path.parent.is_symlink() or path.is_symlink() or not path.is_file():
        raise CheckpointError(f"{BASES_FILE} is missing or not a file: the learned rotation's bases, which the "
                              "recipe names, must be stored in the folder")
    actual = file_sha256(path)
    if actual != sha256:
        raise CheckpointError(f"{BASES_FILE} is not the file the recipe names: its SHA-256 {actual[:12]}... differs "
                              f"from the recorded {sha256[:12]}...")
    tensors = require("safetensors.torch").load_file(str(path))
    names = [f"stream.{i}" for i in range(len(tensors))]
    if not tensors or sorted(tensors) != sorted(names):
        raise CheckpointError(f"{BASES_FILE} must hold stream.0 ... stream.k-1, got {sorted(tensors)[:6]}")
    return [tensors[name] for name in names]


def rotate_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, plan: PlanAfterFold, *,
                      overwrite: bool = False, trust_remote_code: bool = False, step: Step = silent_step) -> dict[str, Any]:
    """Rotate a safetensors checkpoint without loading it (sharded ones larger than memory): the
    streaming fold (:func:`normfold.hf.streaming.fold_checkpoint`) with the rotation ``plan`` (the CLI
    composes it from ``normfold.rotate.streaming.plan_rotation``) as its step after the fold: every
    stream tensor rewritten as t·Q after its fold, every block proved in float64 against the original
    block with Q applied to its stream, the folder published only then. Returns the report."""
    return fold_checkpoint(model_dir, out_dir, overwrite=overwrite, trust_remote_code=trust_remote_code,
                           after_fold=plan, step=step)


def rotation_after_fold(rotation: dict[str, Any], dims: dict[str, int], tensor: Callable, stream: Callable) -> AfterFold:
    """The streaming fold's step after the fold for a rotation (its report section ``rotation``, each
    rotated tensor's stream dim, t ↦ t·Q by name and the stream map x ↦ x·Q), with the stock warning
    (the folder is not stock-compatible: ``AfterFold`` makes it normfold-only); the plan executor runs
    t ↦ t·Q after the fold's steps (``AfterFold.maps``)."""
    return AfterFold(dict(dims), tensor, stream, {"rotation": rotation}, STOCK_WARNING)


def calibration_calls(model: nn.Module, tokenizer, sentences: list[str]) -> list[dict[str, Any]]:
    """The sentences as padded batches (:func:`normfold.hf.inputs.calibration_batches`), with
    ``labels`` (the ids, padding masked by -100) when the model is a causal language model taking
    them, so that its loss is measured too."""
    batches = calibration_batches(model, tokenizer, sentences)
    if not takes_lm_labels(model):
        return batches
    return [{**b, "labels": b["input_ids"].masked_fill(b["attention_mask"] == 0, -100) if "attention_mask" in b
             else b["input_ids"]} for b in batches]


def takes_lm_labels(model: nn.Module) -> bool:
    """Whether ``model`` is a causal language model whose forward computes the next-token loss from ``labels``."""
    transformers = require("transformers")
    causal = transformers.AutoModelForCausalLM._model_mapping
    try:
        is_causal = type(model) is causal[type(model.config)]
    except (KeyError, ValueError):
        is_causal = False
    return is_causal and "labels" in inspect.signature(type(model).forward).parameters


def rotated_report(rotation: ReportSection, layout: Layout, *, saved_dtype: str, **parts: Any) -> FolderReport:
    """The folder report of a rotated folder: the exact fold's report and layout (:func:`folder_report`),
    the rotation (method, seed, bases, slicing), the float64 proof of the whole rotation as
    ``verification`` (when sliced, of the rotation before slicing: ``exact`` false, the slicing's
    cosine and loss under ``rotation.slicing``), the rotation recorded in ``plan`` too, and
    ``stock_compatible`` false with the reason in ``stock_warning``."""
    if rotation.verification is None or not rotation.verification.ok:
        raise ValueError("only a rotation proved in float64 (before any slicing) is written to a folder")
    slicing = rotation.slicing
    report = folder_report(rotation.fold, replace(layout, stock_compatible=False), saved_dtype=saved_dtype,
                           stock_warning=STOCK_WARNING if slicing is None else f"{STOCK_WARNING}; {SLICED_WARNING}",
                           **parts)
    calibration = report.calibration or {}
    plan = {**report.fold.plan, "rotation": {"method": rotation.method, "seed": rotation.seed,
                                             "slice_fraction": 0.0 if slicing is None else slicing.fraction,
                                             "kept": [s.kept for s in rotation.streams],
                                             "calibration_sha256": calibration.get("sha256")}}
    report = replace(report, fold=replace(report.fold, plan=plan))
    return report.with_verification(rotation.verification.to_dict()).with_section("rotation", rotation.to_dict())
