"""The folder steps hf cannot compose itself, composed once for the CLI and for Python users.

``normfold.hf`` folds, saves and judges folders, but never imports the lab (the approximate fold) or
``normfold.rotate`` (dependency rules, ``docs/CONTRIBUTING.md``): it takes those steps as callables.
This top-level module, like :mod:`normfold.convert`, builds them — the approximate fold for a cosine
bar, the rotation of a recipe, the measurements of an approximate or sliced folder's promise — and
offers :func:`verify_folder`, what ``normfold verify ORIG FOLDED`` runs::

    result = normfold.verify_folder("bert-base-uncased", "bert-folded")
    assert result["ok"], result["why"]

The promise of an approximate folder is a cosine bar: every output row (a token, or a sentence
embedding for sentence encoders) keeps a cosine ≥ ``min_cosine`` to the original's on the calibration
sentences, measured against the bar of the person verifying (default 0.999), never the folder's.
"""
from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .engine.cosine_bar import check_cosine_bar
from .hf.folder import fold_folder, silent_step
from .hf.inputs import calibration_batches, is_sentence_encoder, load_tokenizer, read_calibration_file
from .hf.judge import Remake, partial_remake_exact, verify_folders
from .hf.load import resolve_model
from .hf.recipe import Recipe
from .hf.rotate_folder import calibration_calls, read_bases, rotate_checkpoint, rotate_folder, rotation_after_fold
from .lab.approximate import ApproximateConfig, compare_outputs, mean_pooled, token_outputs
from .rotate import LearnConfig, learn_rotation, rotate
from .rotate.calibration import output_agreement
from .rotate.streaming import plan_rotation, stream_rotation

__all__ = ["verify_folder", "approximate_config", "rotation_step", "learned_rotation_step", "given_bases_step",
           "streaming_rotation_step", "measure_approximate", "measure_sliced"]


def verify_folder(orig: str | os.PathLike, folded: str | os.PathLike, *, revision: str | None = None,
                  calibration_file: str | os.PathLike | None = None, min_cosine: float | None = None,
                  trust_remote_code: bool = False, step: Callable[[str], None] = silent_step) -> dict[str, Any]:
    """Judge the folder ``folded`` against its original ``orig`` (folders or hub ids; ``revision`` of
    ``orig``), as ``normfold verify`` does (:func:`normfold.hf.judge.verify_folders`): re-made from
    the original by the steps its recipe names and compared file by file, then loaded as users load
    it and compared with the original. Returns ``ok``, ``why``, ``problems``, ``files``, ``outputs``.

    Folders made with ``--approximate`` or ``--method pca`` need the ``calibration_file`` they were
    made from; approximate results are judged against ``min_cosine`` (default 0.999). A learned
    rotation is re-made from the bases the folder stores, once their SHA-256 matches the recipe's and
    each is orthogonal to 1e-12, never learned again."""
    if min_cosine is not None:
        check_cosine_bar(min_cosine)
    if calibration_file is not None and not Path(calibration_file).is_file():
        raise FileNotFoundError(f"calibration file not found: {calibration_file}")
    return verify_folders(resolve_model(orig, revision), resolve_model(folded), remake=_remake(trust_remote_code),
                          measure=_measure(trust_remote_code), stream_map_for=stream_map_for,
                          calibration_file=calibration_file, min_cosine=min_cosine,
                          trust_remote_code=trust_remote_code, step=step)


# ------------------------------------------------------------------------------ the steps, as hf takes them

def approximate_config(min_cosine: float) -> Callable[[list, bool], ApproximateConfig]:
    """hf's ``ApproximateStep`` for a cosine bar: the ``ApproximateConfig`` of the calibration batches,
    with sentence encoders compared on mean-pooled embeddings, every other model on its token outputs."""
    def config(batches: list, sentence_encoder: bool) -> ApproximateConfig:
        return ApproximateConfig(batches, min_cosine=min_cosine, output_fn=mean_pooled if sentence_encoder else None)
    return config


def rotation_step(method: str, seed: int, slice_fraction: float):
    """hf's ``Rotate``: :func:`normfold.rotate` with this method, seed and slice fraction (a command's,
    or a recipe's when a folder is re-made)."""
    def run(model, example, calibration):
        return rotate(model, example, method=method, seed=seed, calibration=calibration, slice_fraction=slice_fraction)
    return run


def learned_rotation_step(seed: int, learning: LearnConfig):
    """hf's ``Rotate`` for ``normfold rotate --method learned``: the bases learned on the calibration
    calls (:func:`normfold.rotate.learn_rotation`), then the rotation by them (:func:`given_bases_step`,
    the step ``normfold verify`` re-makes the folder with), its report carrying the learning."""
    def run(model, example, calibration):
        bases, learned = learn_rotation(model, example, calibration=calibration, seed=seed, learning=learning)
        rotated, report = given_bases_step(seed, bases)(model, example, None)
        report.learning = learned
        return rotated, report
    return run


def given_bases_step(seed: int, bases: list):
    """hf's ``Rotate`` by bases learned before (``normfold.rotate(..., method="learned", bases=...)``:
    each checked orthogonal to 1e-12, the result proved against the original in float64)."""
    def run(model, example, calibration):
        return rotate(model, example, method="learned", seed=seed, bases=bases)
    return run


def streaming_rotation_step(method: str, seed: int):
    """hf's ``PlanAfterFold`` for a checkpoint rewritten tensor by tensor: the data-free rotation
    (:func:`normfold.rotate.streaming.plan_rotation`) with this method and seed."""
    def plan(skeleton, fold_report, example):
        rotation = plan_rotation(skeleton, fold_report, example, method=method, seed=seed)
        return rotation_after_fold(rotation.report.to_dict(), rotation.along, rotation.rotate_tensor,
                                   rotation.rotate_stream)
    return plan


def stream_map_for(recipe: Recipe):
    """For the judge of a streamed rotated folder: x ↦ x·Q with the Q its recipe's method and seed give
    again (the width is the model's; a recipe naming another rotation re-makes another folder)."""
    rotation = recipe.rotation

    def rotate_stream(x):
        return stream_rotation(rotation.method, rotation.seed, int(x.shape[-1])).rotate_stream(x)
    return rotate_stream


def _remake(trust_remote_code: bool) -> Remake:
    """The judge's ``Remake``: hf's own for exact folds; approximate folds and rotations composed here."""
    exact = partial_remake_exact(trust_remote_code)

    def remake(orig_dir: Path, out: Path, recipe: Recipe, calibration_file: str | None, step, folder: Path) -> dict:
        if recipe.approximate_min_cosine is not None:
            return fold_folder(orig_dir, out, fold_affine=recipe.fold_affine, dtype=recipe.dtype, calls=recipe.calls,
                               calibration_file=calibration_file,
                               approximate=approximate_config(recipe.approximate_min_cosine),
                               trust_remote_code=trust_remote_code, step=step)
        rotation = recipe.rotation
        if rotation is not None and recipe.streaming:
            return rotate_checkpoint(orig_dir, out, streaming_rotation_step(rotation.method, rotation.seed),
                                     trust_remote_code=trust_remote_code, step=step)
        if rotation is not None and rotation.method == "learned":  # not learned again: rotated by its stored bases
            return rotate_folder(orig_dir, out, given_bases_step(rotation.seed, read_bases(folder, rotation.bases_sha256)),
                                 trust_remote_code=trust_remote_code, step=step)
        if rotation is not None:
            return rotate_folder(orig_dir, out, rotation_step(rotation.method, rotation.seed, rotation.slice_fraction),
                                 calibration_file=calibration_file, trust_remote_code=trust_remote_code, step=step)
        return exact(orig_dir, out, recipe, calibration_file, step, folder)
    return remake


# --------------------------------------------------------------------------------- promises, measured

def _measure(trust_remote_code: bool):
    """The judge's ``MeasurePromise``: the cosine of an approximate fold or of a sliced rotation."""
    def measure(original, loaded, orig_dir: Path, calibration_file: Path, bar: float, recipe: Recipe) -> dict:
        sentences = read_calibration_file(calibration_file)
        how = measure_sliced if recipe.rotation is not None else measure_approximate
        return how(original, loaded, orig_dir, sentences, bar, trust_remote_code=trust_remote_code)
    return measure


def _promise(ok: bool, min_cosine: float, bar: float, sentences: list[str], **figures: Any) -> dict[str, Any]:
    """A measured cosine promise: ``ok`` when the lowest output cosine keeps ``bar`` (the verifying
    person's, never the folder's), and why not."""
    why = None if ok else (f"the lowest output cosine {min_cosine!r} is below the bar {bar!r} on the "
                           f"{len(sentences)} calibration sentences")
    return {"ok": ok, **figures, "min_cosine": min_cosine, "promised_min_cosine": bar,
            "num_inputs": len(sentences), "why": why}


def measure_approximate(original: nn.Module, loaded: nn.Module, tokenizer_dir: Path, sentences: list[str],
                        bar: float, *, trust_remote_code: bool = False) -> dict[str, Any]:
    """An approximate folder's promise, measured: the lowest output cosine of ``loaded`` to ``original``
    on the calibration ``sentences`` (tokenized with the original's tokenizer), against ``bar``."""
    batches = calibration_batches(original, load_tokenizer(tokenizer_dir, trust_remote_code=trust_remote_code), sentences)
    sentence_encoder = is_sentence_encoder(original)
    output_fn = mean_pooled if sentence_encoder else token_outputs
    with torch.no_grad():
        reference = torch.cat([output_fn(original.eval(), b) for b in batches])
        result = torch.cat([output_fn(loaded.eval(), b) for b in batches])
    change = compare_outputs(reference, result)
    return _promise(change.min_cosine >= bar, change.min_cosine, bar, sentences, kind="approximate",
                    mean_cosine=change.mean_cosine, max_abs_error=change.max_abs_error,
                    num_rows=int(reference.shape[0]),
                    compared="mean-pooled sentence embeddings" if sentence_encoder else "token outputs")


def measure_sliced(original: nn.Module, loaded: nn.Module, tokenizer_dir: Path, sentences: list[str], bar: float, *,
                   trust_remote_code: bool = False) -> dict[str, Any]:
    """A sliced folder measured against the original on the calibration ``sentences`` in float64 (its
    whole rotation is proved exactly when the folder is re-made; the slicing is approximate)."""
    calls = calibration_calls(original, load_tokenizer(tokenizer_dir, trust_remote_code=trust_remote_code), sentences)
    agreement = output_agreement(copy.deepcopy(original).double(), copy.deepcopy(loaded).double(),
                                 [((), call) for call in calls])
    ok = math.isfinite(agreement.min_cosine) and agreement.min_cosine >= bar
    return _promise(ok, agreement.min_cosine, bar, sentences, kind="sliced rotation (approximate)",
                    mean_cosine=agreement.mean_cosine, losses=agreement.losses, num_rows=None,
                    compared="output rows (float64)")

