"""Tests' helpers for folders they change: the file their weights load from (its name differs for folders
only normfold loads), and the report sealed again, as someone who means it would, so that a test reaches
the checks behind the seal (``normfold.hf.report.seal``)."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.report import write_sealed_report
from normfold.hf.weight_files import weight_source


def weights_file(folder: Path) -> Path:
    """The single weights file of ``folder``: ``model.safetensors``, or ``normfold_model.safetensors`` in a
    folder only normfold.from_pretrained loads (``normfold.hf.normfold_only``)."""
    source = weight_source(folder)
    assert not source.is_index, f"{folder} is sharded: its weights are in {source.files}"
    return folder / source.entry


def reseal(folder: Path, edit: Callable[[dict], object] | None = None) -> dict:
    """``edit`` the folder's report (a function of the report dict; None: leave it), then seal it
    again over what the folder now holds, its renderings included; returns the report written."""
    report = json.loads((folder / REPORT_JSON).read_text())
    if edit is not None:
        edit(report)
    weights = set(weight_source(folder).names)
    return write_sealed_report(report, folder, tuple(name for name in report["files"] if name not in weights))
