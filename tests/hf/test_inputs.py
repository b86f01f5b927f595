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


# ------------------------------------------------------------------ clips and image pairs (example inputs)

TINY_VIDEO = dict(image_size=32, num_frames=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                  intermediate_size=64)
VIDEO_CONFIGS = {  # video encoders: position embeddings over num_frames (tubelets of them) x patches
    "timesformer": lambda: transformers.TimesformerConfig(patch_size=8, **TINY_VIDEO),
    "videomae": lambda: transformers.VideoMAEConfig(patch_size=8, tubelet_size=2, **TINY_VIDEO),
    "vivit": lambda: transformers.VivitConfig(tubelet_size=[2, 8, 8], **TINY_VIDEO),
    "videoprism": lambda: transformers.VideoPrismVisionConfig(  # takes pixel_values_videos
        tubelet_size=[1, 8, 8], num_spatial_layers=1, num_temporal_layers=1, num_auxiliary_layers=1,
        **{k: v for k, v in TINY_VIDEO.items() if k != "num_hidden_layers"}),
}


@pytest.mark.parametrize("model_type", sorted(VIDEO_CONFIGS))
def test_a_video_encoder_gets_clips_of_its_num_frames_that_it_runs_on(model_type):
    import torch

    from normfold.hf.inputs import example_inputs_for

    config = VIDEO_CONFIGS[model_type]()
    model = transformers.AutoModel.from_config(config).eval()
    inputs = example_inputs_for(model)
    (name, clips), = inputs.items()
    assert name == ("pixel_values_videos" if model_type == "videoprism" else "pixel_values")
    assert clips.shape == (2, 4, 3, 32, 32)  # (B, T, C, H, W)
    with torch.no_grad():
        model(**inputs)


def test_the_fold_of_a_video_encoder_proves_on_its_clips():
    import normfold
    from normfold.hf.inputs import example_inputs_for

    model = transformers.TimesformerModel(VIDEO_CONFIGS["timesformer"]()).eval()
    _, report = normfold.fold(model, example_inputs_for(model))
    assert report.verification.ok and any(n.foldable for n in report.norms)


def test_a_keypoint_matcher_gets_an_image_pair_per_row_that_it_runs_on():
    import torch

    from normfold.hf.inputs import MATCHED_IMAGE_SIDE, example_inputs_for

    model = transformers.EfficientLoFTRModel(transformers.EfficientLoFTRConfig(num_hidden_layers=1)).eval()
    inputs = example_inputs_for(model)
    assert inputs["pixel_values"].shape == (2, 2, 3, MATCHED_IMAGE_SIDE, MATCHED_IMAGE_SIDE)  # (B, 2, C, H, W)
    with torch.no_grad():
        model(**inputs)


def test_frames_padded_to_max_img_size_get_that_size():
    from normfold.hf.inputs import example_inputs_for

    config = transformers.TvpConfig(max_img_size=96, visual_prompt_size=16, num_frames=2)
    assert example_inputs_for(config)["pixel_values"].shape == (2, 2, 3, 96, 96)
