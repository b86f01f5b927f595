"""The CLI's verification table names the dtype it compared in, instead of calling every figure float64."""
from __future__ import annotations

import pytest

pytest.importorskip("rich")

from normfold.cli._output import print_verification  # noqa: E402


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
