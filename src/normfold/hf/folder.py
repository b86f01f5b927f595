"""Folder-level operations behind the ``normfold`` command: analyse, fold + verify + save, verify.

Each returns a plain JSON-able dict (the fold engine's ``FoldReport.to_dict()`` plus the
verification figures and what was written), so the CLI, the report files and tests read one thing.
"""
from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .io import (DTYPES, REPORT_JSON, CheckpointError, atomic_output_dir, check_model_dir, example_inputs_for,
                 from_pretrained, load_model, save_folded, stock_compatible_plan, stock_parameter_shapes,
                 swapped_norms)
from .picture import draw_zero_mean_graph
from .report import norm_rows, render_markdown

REPORT_MD = "normfold_report.md"
PICTURE = "normfold_zero_mean_graph.png"

# Relative float64 error allowed between an original and a *saved* folded model: the folded
# weights are exact in float64 but stored in this dtype (unit roundoff 6e-8, 5e-4, 4e-3),
# and the rounding grows through the layers. A wrong fold gives errors of order 1.
FOLD_TOLERANCE = 1e-9  # the transform itself, float64 against float64 (as normfold.fold)
SAVED_TOLERANCE = {"float32": 1e-4, "float16": 5e-2, "bfloat16": 2e-1}

Step = Callable[[str], None]  # called with a description before each slow step (for progress bars)


def _noop(_: str) -> None:
    pass


def _checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the folder's config records (float32 when it says nothing)."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not a readable JSON config: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(config).__name__}")
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def analyze_folder(model_dir: str | os.PathLike, *, trust_remote_code: bool = False, step: Step = _noop) -> dict[str, Any]:
    """The fold engine's per-norm analysis of a Hugging Face folder."""
    from .. import analyze

    step("loading")
    model = load_model(model_dir, trust_remote_code=trust_remote_code)
    step("analysing")
    report = analyze(model, example_inputs_for(model), precompute=False).to_dict()
    report["model"] = _describe(model, model_dir)
    return report


def fold_folder(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, fold_affine: bool = True,
                dtype: str | None = None, overwrite: bool = False, trust_remote_code: bool = False,
                step: Step = _noop) -> dict[str, Any]:
    """Fold a folder, verify in float64, and write OUT_DIR only if the verification passes.

    The model is folded in float32 (upcast from a half-precision checkpoint) and saved in
    ``dtype`` (default: the checkpoint's own). A failed verification raises
    ``FoldVerificationError`` and leaves no OUT_DIR.
    """
    model_dir = check_model_dir(model_dir)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    save_dtype = DTYPES[dtype] if dtype else _checkpoint_dtype(model_dir)
    with atomic_output_dir(out_dir, overwrite=overwrite, protect=(model_dir,)) as tmp:
        step("loading")
        model = load_model(model_dir, trust_remote_code=trust_remote_code)
        step("folding and verifying in float64")
        folded, report = fold_for_stock(model, example_inputs_for(model), fold_affine=fold_affine)
        out = report.to_dict()
        out.update(model=_describe(model, model_dir), swapped=swapped_norms(folded), fold_affine=fold_affine,
                   saved_dtype=str(save_dtype).replace("torch.", ""))
        step("saving")
        save_folded(folded, tmp, dtype=save_dtype)
        write_report_files(out, tmp)
    out["out_dir"] = str(Path(out_dir).absolute())
    return out


def fold_for_stock(model, example_inputs, *, fold_affine: bool = True):
    """``normfold.fold`` with a plan that stock transformers can load (:func:`stock_compatible_plan`).

    Same steps as ``normfold.fold``: analyse, apply the plan to a copy, verify in float64 against
    the plan applied in float64; raises ``FoldVerificationError`` (nothing is saved) on failure.
    """
    from .. import FoldVerificationError, analyze, verify
    from ..fold.transform import apply_plan

    # precompute=False: a stock folder must keep every norm module (a precomputed norm becomes Identity)
    report = analyze(model, example_inputs, fold_affine=fold_affine, precompute=False)
    stock_keys = set(stock_parameter_shapes(model.config, type(model)))
    report.plan, kept = stock_compatible_plan(report.plan, stock_keys)
    for entry in report.norms:
        if entry.path in kept:
            entry.affine_folded = False
            entry.reason = f"{entry.reason}; {kept[entry.path]}"
    folded = apply_plan(copy.deepcopy(model), report.plan)
    exact = apply_plan(copy.deepcopy(model).to(torch.float64), report.plan)
    rms_paths = [s.path for s in report.plan.swap if s.to == "RMSNorm"]
    report.verification = verify(model, folded, example_inputs, tolerance=FOLD_TOLERANCE, rms_norm_paths=rms_paths,
                                 folded_exact=exact)
    if not report.verification.ok:
        raise FoldVerificationError(f"folded model differs from the original: {report.verification}")
    return folded, report


def verify_folders(orig_dir: str | os.PathLike, folded_dir: str | os.PathLike, *, trust_remote_code: bool = False,
                   step: Step = _noop) -> dict[str, Any]:
    """Compare a folded folder (loaded with its RMSNorms) against the original, in float64.

    The folded weights were rounded to their storage dtype, so the float64 comparison allows that
    dtype's rounding (:data:`SAVED_TOLERANCE`) rather than the transform's 1e-9.
    """
    from .. import verify

    step("loading")
    original = load_model(orig_dir, trust_remote_code=trust_remote_code)
    folded = from_pretrained(folded_dir, trust_remote_code=trust_remote_code)
    report = json.loads((Path(folded_dir) / REPORT_JSON).read_text())
    tolerance = SAVED_TOLERANCE.get(report.get("saved_dtype"), SAVED_TOLERANCE["float32"])
    step("verifying in float64")
    rms_paths = [s["path"] for s in report["swapped"]]
    return verify(original, folded, example_inputs_for(original), tolerance=tolerance,
                  rms_norm_paths=rms_paths).to_dict()


def write_report_files(report: dict[str, Any], out_dir: Path) -> None:
    """``normfold_report.json``, ``normfold_report.md`` and the zero-mean graph picture."""
    (out_dir / REPORT_JSON).write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out_dir / REPORT_MD).write_text(render_markdown(report, picture=PICTURE))
    draw_zero_mean_graph(norm_rows(report), out_dir / PICTURE, title=report["model"]["architecture"])


def _describe(model, model_dir) -> dict[str, Any]:
    return {"architecture": type(model).__name__, "model_type": model.config.model_type,
            "source": str(Path(model_dir).absolute()),
            "parameters": sum(p.numel() for p in model.parameters())}
