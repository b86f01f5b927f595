"""Folder-level operations behind the ``normfold`` command: analyse, fold + verify + save, verify.

Each returns a plain JSON-able dict (the fold engine's ``FoldReport.to_dict()`` plus the
verification figures and what was written), so the CLI, the report files and tests read one thing.
"""
from __future__ import annotations

import copy
import os
from dataclasses import asdict, replace
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._text import dtype_name
from ..engine import FoldVerificationError, fold_within, run_steps, verify
from ..engine.pipeline import plan_fold, rms_norm_paths
from ..engine.plan import FoldConfig
from .card import render_markdown, write_model_card
from .folder_inputs import folder_example_inputs
from .inputs import (calibration_batches, example_calls_for, example_inputs_for, is_sentence_encoder, load_tokenizer,
                     read_calibration_file)
from .load import CheckpointError, check_model_dir, load_model, read_json_object
from .output_dir import atomic_output_dir
from .picture import draw_zero_mean_graph
from .recipe import CalibrationRecord, Recipe
from .folder_report import FolderReport, SkippedFile
from .report import describe_model, folder_report, report_rows, require_norms, write_sealed_report
from .saving import DTYPES, folded_layout, save_folded, save_pretrained, stock_constraints
from .side_files import copy_side_files

REPORT_MD = "normfold_report.md"
PICTURE = "normfold_zero_mean_graph.png"

Step = Callable[[str], None]  # called with a description before each slow step (for progress bars)

# The approximate fold, as the caller configures it (normfold.folders.approximate_config): hf reads and tokenizes
# the calibration file, builds the step's config from the batches and runs it through the registry of steps
# (normfold.engine.steps) after the exact fold; it never imports the lab (docs/CONTRIBUTING.md):
# (calibration batches, sentence_encoder) -> the step's config (normfold.lab.ApproximateConfig)
ApproximateStep = Callable[[list, bool], Any]


def silent_step(_: str) -> None:
    """The default ``step`` callback: says nothing."""


def _checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the folder's config records (float32 when it says nothing)."""
    config = read_json_object(model_dir / "config.json", "a readable JSON config")
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return DTYPES.get(dtype_name(name), torch.float32)


def analyze_folder(model_dir: str | os.PathLike, *, fold_affine: bool = True, trust_remote_code: bool = False,
                   keep=(), calls=(), step: Step = silent_step) -> dict[str, Any]:
    """The fold engine's per-norm analysis of a Hugging Face folder, planned as ``fold_folder`` plans it
    with the same ``fold_affine``, ``keep``, ``calls`` and example inputs (the folder's processor's, else
    its config's: ``example_inputs`` says which): the two reports agree on every norm."""
    step("loading")
    model = load_model(model_dir, trust_remote_code=trust_remote_code)
    step("making example inputs")
    base = folder_example_inputs(model, model_dir, trust_remote_code=trust_remote_code)
    step("analysing")  # planned as `normfold fold` plans it (stock-loadable), so the two reports agree
    constraints = stock_constraints(model, _checkpoint_dtype(Path(model_dir)), FoldConfig(fold_affine=fold_affine,
                                                                                          keep=keep))
    report = plan_fold(model, example_calls_for(model, calls, base.inputs), constraints).to_dict()
    return {**report, "model": asdict(describe_model(model, model_dir)), "example_inputs": base.describe()}


def fold_folder(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, fold_affine: bool = True,
                dtype: str | None = None, overwrite: bool = False, trust_remote_code: bool = False,
                calibration_file: str | os.PathLike | None = None, approximate: ApproximateStep | None = None,
                keep=(), calls=(), step: Step = silent_step) -> dict[str, Any]:
    """Fold a folder, verify in float64, and write OUT_DIR only if the verification passes.

    The model is folded in float32 (upcast from a half-precision checkpoint) and saved in
    ``dtype`` (default: the checkpoint's own). Two checks, both before anything is written: the
    transform in float64 (:func:`fold_for_stock`), and the folded weights as saved, rounded to
    ``dtype`` (:func:`check_rounded`, reported as ``verification["saved_dtype_check"]``). A failed
    verification raises ``FoldVerificationError`` and leaves no OUT_DIR.

    ``approximate`` with ``calibration_file`` (one sentence per line, tokenized with the folder's own
    tokenizer) runs an approximate fold after the exact one (:data:`ApproximateStep`; the CLI gives
    ``normfold.lab.ApproximateConfig`` with the user's cosine bar): norms the exact fold cannot touch
    become corrected RMSNorms while every output row keeps the promised cosine on the calibration
    sentences. Such norms are listed in the report under ``"approximate"`` and only
    :func:`normfold.from_pretrained` rebuilds them. The sentences are the user's: the report keeps
    only the file's SHA-256, sentence count and path (``normfold verify --calibration FILE`` needs the file).

    The report records the ``recipe`` (:class:`normfold.hf.recipe.Recipe`) that ``normfold verify``
    re-makes the folder from, and is sealed (:func:`normfold.hf.report.seal`). ``keep``: fnmatch
    patterns of norm module paths left as they are (not with ``approximate``, which would replace them).
    ``calls``: the kinds of example call to fold for (:func:`normfold.hf.inputs.example_calls_for`; default
    the model's main input): only what is exact for every one folds. The example inputs are made by the
    folder's own processor from normfold's samples, else from the config
    (:func:`normfold.hf.folder_inputs.folder_example_inputs`); the report's ``example_inputs`` names the route.
    """
    model_dir = check_model_dir(model_dir)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if (calibration_file is None) != (approximate is None):
        raise ValueError(f"an approximate fold needs both calibration_file and approximate, got "
                         f"calibration_file={calibration_file!r} and approximate={approximate!r}")
    if keep and approximate is not None:
        raise ValueError(f"keep={list(keep)} does not go with an approximate fold, which would replace the kept norms")
    sentences = tokenizer = None
    if calibration_file is not None:  # every user error before the model is loaded
        sentences = read_calibration_file(calibration_file)
        tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    save_dtype = DTYPES[dtype] if dtype else _checkpoint_dtype(model_dir)
    with atomic_output_dir(out_dir, overwrite=overwrite, protect=(model_dir,)) as tmp:
        step("loading")
        model = load_model(model_dir, trust_remote_code=trust_remote_code)
        step("making example inputs")
        base = folder_example_inputs(model, model_dir, trust_remote_code=trust_remote_code)
        step("folding and verifying in float64")
        inputs = example_calls_for(model, calls, base.inputs)
        folded, report = fold_for_stock(model, inputs, fold_affine=fold_affine, stored_dtype=save_dtype, keep=keep)
        require_norms(report, type(model).__name__)
        approx = None
        if sentences is not None:
            batches = calibration_batches(model, tokenizer, sentences)
            config = approximate(batches, is_sentence_encoder(model))
            step(f"approximate fold on {len(batches)} calibration batch(es)")  # approximate_fold draws its own bars
            folded, sections = run_steps(folded, inputs, [config], original=model, earlier={FoldConfig: report})
            approx = sections[type(config)]
            saved_check = {"ok": None, "skipped": "approximate fold: its replaced norms are judged by the cosine bar "
                                                  "on the calibration set, not by an exact bound"}
        else:
            step(f"verifying the weights rounded to {dtype_name(save_dtype)}")
            saved_check = check_rounded(model, folded, inputs, save_dtype, report.plan)
        step("saving")
        calibration = None if approx is None else CalibrationRecord.of_file(calibration_file, len(sentences))
        out = folder_report(report, folded_layout(folded), saved_dtype=dtype_name(save_dtype), approximate=approx,
                            model=describe_model(model, model_dir), fold_affine=fold_affine,
                            recipe=Recipe(command="fold", streaming=False, fold_affine=fold_affine, dtype=dtype,
                                          approximate_min_cosine=None if approx is None else approx.min_cosine,
                                          calibration=calibration, keep=tuple(keep), calls=tuple(calls)))
        out = out.with_verification({**out.verification, "saved_dtype_check": saved_check})
        out = out.with_section("example_inputs", base.describe())
        if approx is not None:
            out = out.with_section("approximate", {**out.sections["approximate"], "compared": _compared(model)})
        save_folded(folded, tmp, dtype=save_dtype, normfold_only=not out.layout.stock_compatible)
        out = replace(out, skipped_files=SkippedFile.listed(copy_side_files(model_dir, tmp)))
        written = write_report_files(out, tmp)
    return {**written, "out_dir": str(Path(out_dir).absolute())}


def check_rounded(model, folded, example_inputs, save_dtype: torch.dtype, plan) -> dict[str, Any]:
    """Verify ``folded`` as it will be saved, its weights rounded to ``save_dtype``, against ``model``.

    The float64 proof of the fold compares the exact transform; what is written is that transform
    rounded. This is the check ``normfold verify`` would run on the saved folder (the tolerance is
    measured from the original's own error in ``save_dtype``), run before anything is published.
    Raises ``FoldVerificationError`` when it fails; returns the figures otherwise.
    """
    # .to(save_dtype) rounds exactly what stock_state_dict(folded, save_dtype) writes; float32 back is exact
    rounded = copy.deepcopy(folded).to(save_dtype).to(torch.float32)
    result = verify(model, rounded, example_inputs, stored_dtype=save_dtype, rms_norm_paths=rms_norm_paths(plan))
    if not result.ok:
        raise FoldVerificationError(f"the folded weights rounded to {dtype_name(save_dtype)} (what would be saved) "
                                    f"differ from the original: {result}")
    return result.to_dict()


def _compared(model) -> str:
    """Which outputs an approximate fold's cosine is measured on (sentence encoders: their embeddings)."""
    return "mean-pooled sentence embeddings" if is_sentence_encoder(model) else "token outputs"


def fold_for_stock(model, example_inputs, *, fold_affine: bool = True, stored_dtype: torch.dtype = torch.float32,
                   keep=()):
    """``normfold.fold`` within what stock transformers can load, saved in ``stored_dtype``
    (``normfold.hf.saving.stock_constraints``): the same step (``normfold.engine.fold_within``), proved in
    float64; raises ``FoldVerificationError`` (nothing is saved) on failure.
    """
    return fold_within(model, example_inputs,
                       stock_constraints(model, stored_dtype, FoldConfig(fold_affine=fold_affine, keep=keep)))


def remake_saved(orig_dir: Path, out: Path, recipe: Recipe, *, trust_remote_code: bool = False,
                 step: Step = silent_step) -> dict[str, Any]:
    """Re-make a ``normfold.save_pretrained`` folder from its recipe: the original folded by
    ``normfold.fold`` (``recipe.stock_plan``: within what stock transformers loads, as
    :func:`fold_for_stock`) on normfold's example inputs, saved by ``normfold.save_pretrained``. A fold
    the caller planned differently (other example calls, other options) re-makes as another plan, and
    the comparison with the folder says so."""
    step("loading")
    model = load_model(orig_dir, trust_remote_code=trust_remote_code)
    step("folding")
    dtype = DTYPES[recipe.dtype]
    options = FoldConfig(fold_affine=recipe.fold_affine, keep=recipe.keep)
    folded, report = fold_within(model, example_inputs_for(model),
                                 stock_constraints(model, dtype, options) if recipe.stock_plan else options)
    step("saving")
    with warnings.catch_warnings():  # what stock transformers would do differently was said when the folder was saved
        warnings.simplefilter("ignore", UserWarning)
        return save_pretrained(folded, out, dtype=dtype, source_dir=orig_dir if recipe.side_files else None,
                               report=report)


def write_report_files(report: FolderReport, out_dir: Path) -> dict[str, Any]:
    """``normfold_report.md``, the zero-mean graph picture and the model card's normfold section, then
    ``normfold_report.json`` sealed with the hashes of the first two (:func:`normfold.hf.report.seal`);
    returns the report's JSON as written."""
    (out_dir / REPORT_MD).write_text(render_markdown(report, picture=PICTURE))
    draw_zero_mean_graph(report_rows(report), out_dir / PICTURE, title=report.model.architecture)
    write_model_card(report, out_dir)
    return write_sealed_report(report.to_json(), out_dir, (REPORT_MD, PICTURE))
