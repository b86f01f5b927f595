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


def test_a_model_masking_patches_by_noise_gets_seeded_noise_so_its_fold_proves():
    """ViT-MAE ranks its patches by ``noise`` to mask them; without that input it draws its own on every
    call, so two runs of the original differ and no fold of it can be proved."""
    import torch

    import normfold
    from normfold.hf.inputs import example_inputs_for

    config = transformers.ViTMAEConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                       intermediate_size=64, image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = transformers.ViTMAEModel(config).eval()
    inputs = example_inputs_for(model)
    assert inputs["noise"].shape == (2, 16)  # (B, patches): (32 / 8)²
    with torch.no_grad():
        first, second = model(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    assert torch.equal(first, second)
    _, report = normfold.fold(model, inputs)
    assert report.verification.ok
