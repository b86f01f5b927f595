"""Calibration inputs: sentences tokenized into padded batches, with a bar over the batches."""
from __future__ import annotations

import pytest

from normfold.hf.inputs import calibration_batches, load_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("setting", ["1", "0"])
def test_calibration_batches_show_a_bar_over_the_batches_only_when_progress_is_on(minilm_dir, capsys, monkeypatch,
                                                                                 setting):
    pytest.importorskip("tqdm")
    monkeypatch.setenv("NORMFOLD_PROGRESS", setting)
    model = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                           intermediate_size=64))
    sentences = [f"sentence number {i}." for i in range(5)]
    batches = calibration_batches(model, load_tokenizer(minilm_dir), sentences, batch_size=2)
    assert [len(b["input_ids"]) for b in batches] == [2, 2, 1]
    err = capsys.readouterr().err
    assert ("calibration" in err and "| 0/3 " in err) if setting == "1" else err == ""
