"""The CLI's verification table names the dtype it compared in, instead of calling every figure float64."""
from __future__ import annotations

import pytest

pytest.importorskip("rich")

from normfold.cli._output import print_norm_table, print_verification  # noqa: E402
from normfold.hf.folder_report import FoldSection, ReportNorm  # noqa: E402
from normfold.hf.report import norm_rows  # noqa: E402


def _table(capsys, ver: dict) -> str:
    print_verification(ver)
    return capsys.readouterr().out


def test_a_float32_fallback_check_says_float32_and_why(capsys):
    text = _table(capsys, {"ok": True, "compared_in": "float32", "max_rel_error": 1.5e-7, "tolerance": 6e-7,
                           "fallback": "the model cannot run in float64 (overflow): checked in float32 instead"})
    assert "compared in" in text and "float32" in text
    assert "why not float64" in text and "cannot run in float64" in text
    assert "max relative error, float64" not in text and "(relative, float64)" not in text


def test_a_float64_check_shows_no_empty_fallback_row(capsys):
    text = _table(capsys, {"ok": True, "compared_in": "float64", "fallback": None, "max_rel_error": 8e-16,
                           "tolerance": 1e-9})
    assert "float64" in text and "why not float64" not in text and "n/a" not in text


def test_the_norm_table_names_a_kept_norm_by_its_kind(capsys):
    """Fails on main f840f32: a kept RMSNorm read "no: LayerNorm kept"."""
    print_norm_table(norm_rows(FoldSection((ReportNorm("model.norm", "RMSNorm", False, False, "kept: x"),
                                            ReportNorm("model.ln", "LayerNorm", False, False, "blocked: y")))), "M")
    text = capsys.readouterr().out
    assert "no: RMSNorm kept" in text and text.count("no: LayerNorm kept") == 1
