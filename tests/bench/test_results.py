"""normfold.bench.results: rows written as CSV, markdown and PNG, and read back."""
from __future__ import annotations

import csv

import pytest

from normfold.bench.results import plot_rows, read_rows, write_results


def test_results_are_written_as_csv_markdown_and_png(quick_rows, tmp_path):
    paths = write_results(quick_rows, tmp_path / "e2e", command="pytest")
    assert [p.name for p in paths] == ["e2e.csv", "e2e.md", "e2e.png"]
    rows = list(csv.DictReader(open(paths[0])))
    assert len(rows) == 2 and float(rows[0]["fused_speedup"]) > 0
    text = paths[1].read_text()
    assert "command: `pytest`" in text and "fused C++ CPU kernel" in text


def test_csv_reads_back_into_the_rows_it_was_written_from(quick_rows, tmp_path):
    paths = write_results(quick_rows, tmp_path / "e2e", command="pytest", plot=False)
    back = read_rows(paths[0])
    assert [(r.model, r.batch, r.seq, r.kind) for r in back] == [(r.model, r.batch, r.seq, r.kind) for r in quick_rows]
    for got, want in zip(back, quick_rows):
        assert got.ratio == pytest.approx(want.ratio, abs=1e-4)
        assert got.ratio_ci.keys() == want.ratio_ci.keys() and got.norm_ms == pytest.approx(want.norm_ms, abs=1e-4)
    assert plot_rows(back, tmp_path / "again.png").stat().st_size > 0
