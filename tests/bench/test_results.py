"""normfold.bench.results: rows written as CSV, markdown and PNG, and read back."""
from __future__ import annotations

import csv

import pytest

from normfold.bench.results import RATIO_AXIS, plot_rows, ratio_axis, read_rows, write_results


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


def test_the_plot_axis_keeps_one_noisy_row_from_squashing_the_others():
    """A CI to 70x on a busy machine used to set the y axis to 70, every other bar a line."""
    assert ratio_axis([0.97, 1.03, 0.9, 70.0]) == (pytest.approx(0.9 / 1.02), RATIO_AXIS[1])
    assert ratio_axis([0.01, 1.1]) == (RATIO_AXIS[0], pytest.approx(1.1 * 1.02))
    low, high = ratio_axis([1.01, 1.02])
    assert low < 1.0 < high  # "no change" is always on the axis


def test_a_plot_with_a_clipped_row_is_still_written(quick_rows, tmp_path):
    noisy = quick_rows[0]
    noisy.ratio_ci = {c: (low, 70.0) for c, (low, _) in noisy.ratio_ci.items()}
    assert plot_rows(quick_rows, tmp_path / "noisy.png").stat().st_size > 0


def test_a_point_estimate_outside_its_interval_is_still_plotted(tmp_path):
    """With a few rounds the median ratio can lie outside its bootstrap interval: no error bar on that
    side, rather than matplotlib's "yerr must not contain negative values"."""
    pytest.importorskip("matplotlib")
    from normfold.bench.results import BenchRow

    row = BenchRow(model="gpt2", mode="fp32 1t", batch=1, seq=1, kind="decode")
    row.ratio = {"control": 0.98, "folded": 1.20, "fused": 0.90}
    row.ratio_ci = {"control": (0.95, 1.02), "folded": (0.90, 1.10), "fused": (0.95, 1.05)}
    assert plot_rows([row], tmp_path / "outside.png").stat().st_size > 0
