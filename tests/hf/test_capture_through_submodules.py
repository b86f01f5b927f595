"""`normfold fold DIR` on a folder whose model torch.export cannot capture whole (LED: data-dependent
control flow in its encoder): it folds what the captured submodules prove, and every view of the report
(the printed table, `normfold_report.md`, `normfold_report.json`, `normfold analyze`) names them."""
from __future__ import annotations

import json

import pytest
import torch

from normfold.cli import main
from normfold.hf.output_dir import REPORT_JSON

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def led_dir(tmp_path_factory):
    config = transformers.LEDConfig(vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1,
                                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, attention_window=4, max_encoder_position_embeddings=64,
                                    max_decoder_position_embeddings=64, architectures=["LEDModel"])
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("led") / "led"
    transformers.LEDModel(config).save_pretrained(folder)
    return folder


def test_a_folder_export_cannot_capture_whole_folds_through_submodules_and_says_so(led_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    out = tmp_path / "folded"
    assert main(["fold", str(led_dir), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / REPORT_JSON).read_text())
    assert "decoder" in report["captured_through"] and report["verification"]["ok"]
    assert any(norm["foldable"] for norm in report["norms"])
    line = report["capture_line"]
    assert line.startswith("captured through submodules: " + ", ".join(report["captured_through"]))
    assert " ".join(line.split()) in " ".join(printed.split())  # as printed, wrapped or not
    assert line[0].upper() + line[1:] in (out / "normfold_report.md").read_text()
    assert main(["analyze", str(led_dir)]) == 0
    assert "captured through submodules: " in capsys.readouterr().out
