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


def _runs_on_its_example_inputs(model) -> dict:
    """The model's example inputs, after checking that the original runs on them eagerly."""
    import torch

    from normfold.hf.inputs import example_inputs_for

    inputs = example_inputs_for(model.eval())
    with torch.no_grad():
        model(**inputs)
    return inputs


def test_a_conformer_speech_encoder_gets_frames_by_mel_features():
    """Parakeet-style encoders read (B, frames, mel), not Whisper's (B, mel, 3000)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ParakeetEncoderConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                intermediate_size=64, num_mel_bins=8, subsampling_conv_channels=8)
    inputs = _runs_on_its_example_inputs(transformers.ParakeetEncoder(config))
    assert inputs["input_features"].shape[-1] == 8  # (B, frames, mel)


def test_a_waveform_encoder_gets_a_mono_channel_axis_where_it_reads_one():
    """OmniASR reads (B, 1, samples): a 2-D waveform was taken as one unbatched (channels=B, samples)."""
    pytest.importorskip("transformers")
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_zoo.py"
    spec = importlib.util.spec_from_file_location("_hf_zoo_for_test", path)
    zoo_script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = zoo_script
    spec.loader.exec_module(zoo_script)
    model = zoo_script.tiny_model("omniasr_ctc", zoo_script._zoo_helpers())
    inputs = _runs_on_its_example_inputs(model)
    assert inputs["input_values"].dim() == 3  # (B, 1, S)
