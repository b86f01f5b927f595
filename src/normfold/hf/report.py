"""The folder report (``normfold_report.json``) of a folded folder, built by one function for every
path that writes one (the in-memory and the streaming fold, ``normfold.save_pretrained``), its
per-norm rows (for the table, the picture and ``hf.card``'s markdown), and its seal."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from ..engine.report import FoldReport, ReportSection
from .load import CheckpointError, read_json_object
from .output_dir import REPORT_JSON
from .recipe import file_sha256
from .weight_files import weight_source

# The version of normfold_report.json's layout. Readers accept this one only: a report of another schema
# is refused with both numbers (fold again), never read by guessing. Raise it when a key changes meaning.
REPORT_SCHEMA = 1


def read_folder_report(folder: Path) -> dict[str, Any]:
    """The folder's ``normfold_report.json``, the one reader of it: CheckpointError when it is missing,
    not a JSON object, or of another :data:`REPORT_SCHEMA`."""
    path = Path(folder) / REPORT_JSON
    if not path.is_file():
        raise CheckpointError(f"{path} not found: {folder} is not a folder normfold wrote (with `normfold fold`, "
                              "`normfold rotate` or normfold.save_pretrained)")
    report = read_json_object(path, "a normfold report")
    schema = report.get("schema_version")
    if schema != REPORT_SCHEMA:
        raise CheckpointError(f"{path} has report schema {schema!r}; this normfold reads schema {REPORT_SCHEMA}: "
                              "fold the original again with this normfold")
    return report


def describe_model(model: nn.Module, model_dir: str | os.PathLike) -> dict[str, Any]:
    """The report's ``model`` section: class, model type, source folder, parameter count."""
    return {"architecture": type(model).__name__, "model_type": model.config.model_type,
            "source": str(Path(model_dir).absolute()), "parameters": sum(p.numel() for p in model.parameters())}


def folder_report(fold_report: FoldReport | None, layout: dict[str, Any], *, saved_dtype: str,
                  approximate: ReportSection | None = None, **sections: Any) -> dict[str, Any]:
    """``normfold_report.json`` of a folded folder, for every path that writes one (the in-memory and
    the streaming fold, ``normfold.save_pretrained``): the fold engine's report (norms, plan,
    verification; none for a fold of the caller's own), the ``layout`` ``from_pretrained`` rebuilds
    (``swapped`` at least; ``normfold.hf.saving.folded_layout``), the ``saved_dtype``, the
    ``approximate`` fold's keys (:func:`approximate_summary`), and the caller's further ``sections``
    (``model``: :func:`describe_model`; ``fold_affine``, which re-deriving the weights needs;
    ``skipped_files``; ``streaming`` figures)."""
    report = {"schema_version": REPORT_SCHEMA, **({} if fold_report is None else fold_report.to_dict())}
    report.update(**layout, saved_dtype=saved_dtype, **sections)
    if approximate is not None:
        report.update(approximate_summary(approximate, report["swapped"]))
    return report


def approximate_summary(approx: ReportSection, swapped: list[dict[str, Any]]) -> dict[str, Any]:
    """Report keys of an approximate fold; marks each ``swapped`` entry exact or approximate."""
    replaced = {e.path for e in approx.entries if e.status == "approximate"}
    for entry in swapped:
        entry["approximate"] = entry["path"] in replaced
    calibration = approx.calibration
    stock = {"stock_compatible": False} if replaced else {}  # stock transformers rebuilds them as LayerNorms
    return {"approximate": approx.to_dict(), "num_approximate": approx.num_approximate,
            "approximate_norms": sorted(replaced),
            "calibration_min_cosine": None if calibration is None else calibration.min_cosine, **stock}


def require_norms(fold_report: FoldReport, architecture: str) -> None:
    """CheckpointError when the model holds no norm the engine knows (Llama's and T5's own RMSNorm
    classes, a model without norms): there is nothing to fold, so nothing is written."""
    if not fold_report.norms:
        raise CheckpointError(f"nothing to fold: {architecture} has no LayerNorm (or other norm module normfold "
                              "recognises), so no folded folder is written")


def norm_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per norm, in model order: ``path``, ``kind`` (the norm as found in the model: LayerNorm,
    RMSNorm), ``folded``, ``affine_folded``, ``approximate``, ``reason`` and, for a kept norm, ``blocker`` (the engine's reason: the op that breaks zero mean).

    A norm an ``--approximate`` fold replaced is ``approximate`` (and not ``folded``: the exact fold
    kept it); its reason then says how close the replacement is instead of what blocked the exact fold.
    """
    approx = report.get("approximate") or {}
    entries = {e["path"]: e for e in approx.get("entries", ())}
    approximate = {path: entries.get(path, {}) for path in report.get("approximate_norms", ())}
    calibration = (report.get("recipe") or {}).get("calibration") or {}
    num_inputs = calibration.get("num_sentences")
    return [{"path": e["path"], "kind": e["kind"], "folded": bool(e["foldable"]), "affine_folded": bool(e["affine_folded"]),
             "approximate": e["path"] in approximate,
             "reason": (_approximate_reason(approximate[e["path"]], num_inputs) if e["path"] in approximate
                        else e["reason"]),
             "blocker": None if e["foldable"] or e["path"] in approximate else e["reason"]}
            for e in report["norms"]]


def _approximate_reason(entry: dict[str, Any], num_inputs: int | None) -> str:
    """``approximate: cosine X on N calibration inputs; <what it became>``: the worst output cosine
    with only this norm replaced (from its approximate entry), and the correction."""
    cosine = entry.get("cosine_alone")
    inputs = "the calibration inputs" if num_inputs is None else f"{num_inputs} calibration inputs"
    close = "cosine not measured" if cosine is None else f"cosine {cosine:.6f} on {inputs}"
    return f"approximate: {close}; {entry.get('correction') or 'corrected RMSNorm'}"


# ------------------------------------------------------------------------------------------- the seal

def seal(report: dict[str, Any], folder: Path, renderings: tuple[str, ...] = ()) -> dict[str, Any]:
    """``report`` as written into ``folder``: with the SHA-256 of the weight files that load
    (:func:`normfold.hf.weight_files.weight_source`) and of ``renderings`` (the report's markdown and
    picture) under ``"files"``, and a ``"digest"`` of all the rest.

    The seal is not a proof (anyone can recompute it): what a report claims is re-derived by ``normfold
    verify``. It makes every other byte count: an edited figure or a swapped picture fails instead of
    passing as inert, and ``normfold.from_pretrained`` refuses weights saved over the folder (a stock
    fine-tune), which the report no longer describes."""
    source = weight_source(folder)
    sealed = {k: v for k, v in report.items() if k != "digest"}
    sealed["files"] = {name: file_sha256(folder / name) for name in (*source.names, *renderings)}
    sealed = json.loads(json.dumps(sealed, default=str))  # as it reads back: tuples are lists, paths strings
    sealed["digest"] = report_digest(sealed)
    return sealed


def write_sealed_report(report: dict[str, Any], folder: Path, renderings: tuple[str, ...] = ()) -> dict[str, Any]:
    """Write ``normfold_report.json`` into ``folder``, sealed (:func:`seal`) with the hashes of the
    ``renderings`` already written there; returns the report as written."""
    sealed = seal(report, folder, renderings)
    (folder / REPORT_JSON).write_text(json.dumps(sealed, indent=2) + "\n")
    return sealed


def report_digest(report: dict[str, Any]) -> str:
    """The SHA-256 of the report's canonical JSON without its ``digest``."""
    body = {k: v for k, v in report.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def seal_problems(report: dict[str, Any], folder: Path) -> list[str]:
    """Why ``report`` (read from ``folder``) is not as normfold sealed it; empty when it is."""
    if "digest" not in report:
        return ["normfold_report.json carries no digest (it was edited): fold again"]
    if report["digest"] != report_digest(report):
        return ["normfold_report.json was changed after normfold wrote it (its digest does not match its content)"]
    files = report.get("files")
    if not isinstance(files, dict):
        return ["normfold_report.json lists no \"files\" (the weights it was written with, its renderings)"]
    problems = []
    for name, sha in files.items():
        path = folder / str(name)
        if not isinstance(name, str) or "/" in name or not path.is_file() or path.is_symlink():
            problems.append(f"{name} is listed by normfold_report.json but is not a file of the folder")
        elif file_sha256(path) != sha:
            problems.append(f"{name} was changed after normfold wrote it (its SHA-256 is not the one the report "
                            "records)")
    try:
        source = weight_source(folder)
    except CheckpointError as err:
        return problems + [str(err)]
    unsealed = [name for name in source.names if name not in files]
    if unsealed:
        problems.append(f"the weights load from {', '.join(unsealed)}, which normfold did not write (not in its report)")
    return problems
