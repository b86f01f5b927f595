"""The experiment scripts run end to end and write their CSV, markdown and plots (tiny budgets).

They run in-process (``main(argv)``) to avoid a fresh interpreter and torch import per script.
"""
from __future__ import annotations

import csv
import importlib
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
pytest.importorskip("matplotlib")


@pytest.fixture
def experiment(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    return importlib.import_module


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_norm_comparison_quick_writes_one_row_per_variant_and_seed(tmp_path, experiment):
    experiment("norm_comparison").main(["--quick", "--steps=2", "--seeds=2", "--variants=layernorm,rmsnorm,cbwc_rmsnorm",
                                        f"--out={tmp_path}"])
    rows = _rows(tmp_path / "norm_comparison_quick.csv")
    expected = [(v, s) for s in "01" for v in ("layernorm", "rmsnorm", "cbwc_rmsnorm")]
    assert [(r["variant"], r["seed"]) for r in rows] == expected
    assert all(float(r["final_val_loss"]) > 0 for r in rows)
    report = (tmp_path / "norm_comparison_quick.md").read_text()
    assert "| cbwc_rmsnorm |" in report and "Command:" in report
    for png in ("norm_comparison_quick_loss.png", "norm_comparison_quick_speed.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_norm_comparison_refuses_unknown_variants(tmp_path, experiment, capsys):
    with pytest.raises(SystemExit) as exc:
        experiment("norm_comparison").main(["--variants=batchnorm", f"--out={tmp_path}"])
    assert exc.value.code == 2 and "unknown variants" in capsys.readouterr().err


def test_placement_quick_covers_the_grid(tmp_path, experiment):
    experiment("placement").main(["--quick", "--steps=4", f"--out={tmp_path}"])
    rows = _rows(tmp_path / "placement_quick.csv")
    cells = {(r["placement"], r["depth"], r["warmup_steps"]) for r in rows}
    assert cells == {(p, d, w) for p in ("pre", "post") for d in ("2", "8") for w in ("0", "2")}
    assert {r["outcome"] for r in rows} <= {"trained", "failed", "diverged"}
    assert (tmp_path / "placement_quick_loss.png").stat().st_size > 1000
    assert "| depth |" in (tmp_path / "placement_quick.md").read_text()


def test_cbwc_equivalence_quick_reports_a_rounding_level_gap_without_dropout(tmp_path, experiment):
    experiment("cbwc_equivalence").main(["--quick", "--steps=3", "--precisions=fp64", "--dropouts=0",
                                         f"--out={tmp_path}"])
    rows = _rows(tmp_path / "cbwc_equivalence_quick.csv")
    exact = [r for r in rows if r["model"] == "cbwc_rmsnorm"]
    assert len(exact) == 1 and float(exact[0]["max_rel_gap_train_loss"]) < 1e-12


def test_step_time_writes_every_contender_with_a_ratio_to_layernorm_and_its_interval(tmp_path, experiment):
    experiment("step_time").main(["--widths=16", "--budget-s=0", "--min-rounds=3", f"--out={tmp_path}"])
    rows = _rows(tmp_path / "step_time.csv")
    assert [r["contender"] for r in rows] == ["layernorm", "cbwc_rmsnorm", "rmsnorm", "layernorm (A/A control)"]
    assert all(int(r["rounds"]) == 3 for r in rows)
    assert rows[0]["time_vs_ln"] == "1.0" and rows[0]["verdict"] == "—"
    for r in rows[1:]:
        assert float(r["ci_low"]) <= float(r["time_vs_ln"]) <= float(r["ci_high"])
    assert len(_rows(tmp_path / "step_time_ops.csv")) == 4
    text = (tmp_path / "step_time.md").read_text()
    assert "A/A control's interval" in text and "What CBWC's centering adds to a step" in text
