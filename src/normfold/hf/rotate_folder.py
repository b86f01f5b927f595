"""Writing a rotated Hugging Face folder (``normfold rotate DIR -o OUT``): hf loads the folder, gives the
example inputs and saves atomically; the rotation itself (``normfold.rotate``, which proves the result
in float64) is given by the caller, the CLI, since hf never imports ``rotate`` (docs/CONTRIBUTING.md).

A rotated folder is not stock-loadable: its norms are weightless RMSNorms reading a rotated stream
x·Q, whose mean is not zero, so the LayerNorm stock transformers rebuilds there would subtract it.
``normfold_report.json`` records the layout (:func:`normfold.hf.saving.folded_layout`) from which
:func:`normfold.from_pretrained` rebuilds the rotated model exactly, and says so in ``stock_warning``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from .folder import Step, _noop
from .inputs import example_inputs_for
from .load import check_model_dir, load_model
from .output_dir import REPORT_JSON, atomic_output_dir
from .report import describe_model, folder_report
from .saving import folded_layout, save_folded
from .side_files import copy_side_files

if TYPE_CHECKING:  # the rotation's report type, for annotations only: hf never imports rotate
    from ..rotate import RotationReport

# The rotation, as the caller composes it (the CLI: normfold.rotate with the user's method and seed):
# (model, example inputs) -> (rotated copy proved equal in float64, its RotationReport)
Rotate = Callable[[nn.Module, dict], "tuple[nn.Module, RotationReport]"]

STOCK_WARNING = ("rotated: load with normfold.from_pretrained; stock transformers would rebuild the weightless "
                 "RMSNorms as LayerNorms, which re-center the rotated residual stream (its mean is not zero), "
                 "so its outputs would be wrong")


def rotate_folder(model_dir: str | os.PathLike, out_dir: str | os.PathLike, rotate: Rotate, *,
                  overwrite: bool = False, trust_remote_code: bool = False, step: Step = _noop) -> dict[str, Any]:
    """Rotate a folder's residual stream with ``rotate`` and write OUT_DIR only once it returned (its
    float64 proof passed); any refusal or failed proof raises and leaves no OUT_DIR.

    The weights are saved in the dtype they were proved in (float32, the dtype ``load_model`` gives):
    rounding rotated weights to 16 bits is a change no proof covered. Side files (tokenizer, ...) are
    copied as ``normfold fold`` copies them. Returns the report written to ``normfold_report.json``.
    """
    model_dir = check_model_dir(model_dir)
    with atomic_output_dir(out_dir, overwrite=overwrite, protect=(model_dir,)) as tmp:
        step("loading")
        model = load_model(model_dir, trust_remote_code=trust_remote_code)
        step("rotating and proving in float64")
        rotated, rotation = rotate(model, example_inputs_for(model))
        layout = folded_layout(rotated)
        saved_dtype = next(rotated.parameters()).dtype
        step("saving")
        save_folded(rotated, tmp)
        out = rotated_report(rotation, layout, saved_dtype=str(saved_dtype).replace("torch.", ""),
                             model=describe_model(model, model_dir), skipped_files=copy_side_files(model_dir, tmp))
        (tmp / REPORT_JSON).write_text(json.dumps(out, indent=2, default=str) + "\n")
    out["out_dir"] = str(Path(out_dir).absolute())
    return out


def rotated_report(rotation: RotationReport, layout: dict[str, Any], *, saved_dtype: str,
                   **sections: Any) -> dict[str, Any]:
    """The folder report of a rotated folder: the exact fold's report and layout (:func:`folder_report`),
    the rotation (method, seed, bases, its float64 proof as ``verification``), and ``stock_compatible``
    false with the reason in ``stock_warning``."""
    if not rotation.exact or rotation.verification is None:
        raise ValueError("only an exact, proved rotation is written to a folder (a sliced one is approximate)")
    report = folder_report(rotation.fold, layout, saved_dtype=saved_dtype, **sections)
    report.update(rotation=rotation.to_dict(), verification=rotation.verification.to_dict(),
                  stock_compatible=False, stock_warning=STOCK_WARNING)
    return report
