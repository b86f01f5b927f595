"""The folder report (``normfold_report.json``, typed in :mod:`normfold.hf.folder_report`) of a folded
folder: its readers, built by one function for every path that writes one (the in-memory and the
streaming fold, ``normfold.save_pretrained``, ``normfold rotate``), its per-norm rows (for the table,
the picture and ``hf.card``'s markdown), and its seal."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from ..engine.report import FoldReport, ReportSection
from .folder_report import (FOLD_KEYS, ApproximateNorms, FolderReport, FoldSection, Layout, ModelInfo,
                            check_schema)
from .folder_report import REPORT_SCHEMA  # noqa: F401  the readers' name for it, re-exported
from .load import CheckpointError, read_json_object
from .output_dir import REPORT_JSON
from .recipe import file_sha256
from .weight_files import weight_source

def read_report_json(folder: Path) -> dict[str, Any]:
    """The folder's ``normfold_report.json`` as the JSON it holds, of this normfold's schema: what the
    seal and ``normfold verify``'s comparison read (they judge the bytes, not a reading of them);
    CheckpointError when it is missing, not a JSON object, an ONNX export's, or of another schema version."""
    path = Path(folder) / REPORT_JSON
    if not path.is_file():
        raise CheckpointError(f"{path} not found: {folder} is not a folder normfold wrote (with `normfold fold`, "
                              "`normfold rotate` or normfold.save_pretrained)")
    data = read_json_object(path, "a normfold report")
    if data.get("kind") == "onnx_export":  # the same file name, written by `normfold export` (cli/onnx_export.py)
        raise CheckpointError(f"{folder} is an ONNX export folder (written by `normfold export`, proved in ONNX "
                              "Runtime when written), not a folded Hugging Face folder: verify and from_pretrained "
                              "read the folders `normfold fold` and `normfold rotate` write")
    check_schema(data, path)
    return data


def read_folder_report(folder: Path) -> FolderReport:
    """The folder's ``normfold_report.json``, the one reader of it: CheckpointError when it is missing,
    not a JSON object, of another :data:`REPORT_SCHEMA`, or lacks a section (:meth:`FolderReport.from_json`)."""
    return FolderReport.from_json(read_report_json(folder), Path(folder) / REPORT_JSON)


def describe_model(model: nn.Module, model_dir: str | os.PathLike) -> ModelInfo:
    """The report's ``model`` section: class, model type, source folder, parameter count."""
    return ModelInfo(type(model).__name__, model.config.model_type, str(Path(model_dir).absolute()),
                     sum(p.numel() for p in model.parameters()))


def folder_report(fold_report: FoldReport | None, layout: Layout, *, saved_dtype: str,
                  approximate: ReportSection | None = None, **parts: Any) -> FolderReport:
    """``normfold_report.json`` of a folded folder, for every path that writes one (the in-memory and
    the streaming fold, ``normfold.save_pretrained``, ``normfold rotate``): the fold engine's report
    (norms, plan, verification, the later steps' sections; none for a fold of the caller's own), the
    ``layout`` ``from_pretrained`` rebuilds (``normfold.hf.saving.folded_layout``), the ``saved_dtype``,
    the ``approximate`` fold's replacements (each swapped norm marked exact or approximate), and the
    caller's further ``parts`` (:class:`FolderReport`'s fields: ``model``, ``fold_affine``,
    ``skipped_files``, ``streaming``, ...)."""
    fold, sections = (None, {}) if fold_report is None else fold_section(fold_report)
    report = FolderReport(layout, saved_dtype, fold=fold, sections=sections, **parts)
    return report if approximate is None else with_approximate(report, approximate)


def fold_section(fold_report: FoldReport) -> tuple[FoldSection, dict[str, Any]]:
    """The engine's report as the folder report's fold section, and the sections of the steps after it."""
    data = fold_report.to_dict()
    return (FoldSection.from_json(data, "the fold's report"),
            {name: value for name, value in data.items() if name not in FOLD_KEYS})


def with_approximate(report: FolderReport, approx: ReportSection) -> FolderReport:
    """``report`` with an approximate fold's replacements: each swapped norm marked exact or
    approximate, and not stock-compatible when any was replaced (stock transformers rebuilds them as
    LayerNorms)."""
    replaced = {e.path for e in approx.entries if e.status == "approximate"}
    layout = report.layout
    layout = replace(layout, swapped=tuple(replace(s, approximate=s.path in replaced) for s in layout.swapped),
                     stock_compatible=layout.stock_compatible and not replaced)
    calibration = approx.calibration
    return replace(report.with_section("approximate", approx.to_dict()), layout=layout,
                   fold=replace(report.fold, num_approximate=approx.num_approximate),
                   approximate=ApproximateNorms(tuple(sorted(replaced)),
                                                None if calibration is None else calibration.min_cosine))


def require_norms(fold_report: FoldReport, architecture: str) -> None:
    """CheckpointError when the model holds no norm the engine knows (Llama's and T5's own RMSNorm
    classes, a model without norms): there is nothing to fold, so nothing is written."""
    if not fold_report.norms:
        raise CheckpointError(f"nothing to fold: {architecture} has no LayerNorm (or other norm module normfold "
                              "recognises), so no folded folder is written")


def report_rows(report: FolderReport) -> list[dict[str, Any]]:
    """:func:`norm_rows` of a folder report: its approximate replacements with their entries, on the
    number of calibration sentences its recipe records."""
    assert report.fold is not None, "a report without the fold's (save_pretrained of the caller's fold) has no norms"
    entries = {e["path"]: e for e in (report.sections.get("approximate") or {}).get("entries", ())}
    replaced = {} if report.approximate is None else {path: entries.get(path, {}) for path in report.approximate.norms}
    calibration = None if report.recipe is None else report.recipe.calibration
    return norm_rows(report.fold, replaced, None if calibration is None else calibration.num_sentences)


def norm_rows(fold: FoldSection, replaced: Mapping[str, Mapping[str, Any]] | None = None,
              num_inputs: int | None = None) -> list[dict[str, Any]]:
    """One row per norm, in model order: ``path``, ``kind`` (the norm as found in the model: LayerNorm,
    RMSNorm), ``folded``, ``affine_folded``, ``approximate``, ``reason`` and, for a kept norm,
    ``blocker`` (the engine's reason: the op that breaks zero mean).

    A norm an ``--approximate`` fold replaced (``replaced``: path -> its approximate entry) is
    ``approximate`` (and not ``folded``: the exact fold kept it); its reason then says how close the
    replacement is on ``num_inputs`` calibration inputs instead of what blocked the exact fold.
    """
    replaced = replaced or {}
    return [{"path": n.path, "kind": n.kind, "folded": n.foldable, "affine_folded": n.affine_folded,
             "approximate": n.path in replaced,
             "reason": _approximate_reason(replaced[n.path], num_inputs) if n.path in replaced else n.reason,
             "blocker": None if n.foldable or n.path in replaced else n.reason}
            for n in fold.norms]


def _approximate_reason(entry: Mapping[str, Any], num_inputs: int | None) -> str:
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
