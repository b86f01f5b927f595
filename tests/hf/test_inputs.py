"""Example inputs that the original model runs on (text families whose forward or config asks for more than
ids), and calibration inputs: sentences tokenized into padded batches, with a bar over the batches."""
from __future__ import annotations

import pytest
import torch

import normfold
from normfold.hf.inputs import calibration_batches, example_inputs_for, load_tokenizer

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


TINY_BERT_LIKE = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=64)


def _runs_on_its_example_inputs(config, model_class=None) -> dict:
    """The example inputs of a tiny random model of ``config`` (its AutoModel unless ``model_class``), after
    checking the original runs on them."""
    torch.manual_seed(0)
    model = (model_class(config) if model_class else transformers.AutoModel.from_config(config)).eval()
    return _model_runs_on_its_example_inputs(model)


def _model_runs_on_its_example_inputs(model) -> dict:
    """The model's example inputs, after checking that the original runs on them eagerly."""
    inputs = example_inputs_for(model.eval())
    with torch.no_grad():
        model(**inputs)
    return inputs


def test_a_model_with_language_adapters_gets_one_language_per_row_and_its_fold_proves():
    """X-MOD routes each row through its language's adapter: without ``lang_ids`` (or a default language
    set on the model) its forward raises 'Input language unknown'."""
    config = transformers.XmodConfig(**TINY_BERT_LIKE, languages=("en_XX", "de_DE"))
    inputs = _runs_on_its_example_inputs(config)
    assert inputs["lang_ids"].tolist() == [0, 1]  # both adapters in the proof
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()
    _, report = normfold.fold(model, inputs)  # raises unless the fold is proved on these inputs
    assert report.verification is not None and report.norms


def test_a_model_pooling_its_sequence_between_blocks_gets_enough_tokens_for_every_block():
    """Funnel halves its sequence after each block but the first, keeping the CLS token apart: 4 tokens
    are too few for 3 blocks (its own code fails to broadcast its CLS mask)."""
    config = transformers.FunnelConfig(vocab_size=99, block_sizes=[1, 1, 1], d_model=32, n_head=4, d_head=8,
                                       d_inner=64, num_decoder_layers=1)
    assert _runs_on_its_example_inputs(config, transformers.FunnelModel)["input_ids"].shape == (2, 8)
def test_a_model_masking_patches_by_noise_gets_seeded_noise_so_its_fold_proves():
    """ViT-MAE ranks its patches by ``noise`` to mask them; without that input it draws its own on every
    call, so two runs of the original differ and no fold of it can be proved."""
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
def test_a_conformer_speech_encoder_gets_frames_by_mel_features():
    """Parakeet-style encoders read (B, frames, mel), not Whisper's (B, mel, 3000)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ParakeetEncoderConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                intermediate_size=64, num_mel_bins=8, subsampling_conv_channels=8)
    inputs = _model_runs_on_its_example_inputs(transformers.ParakeetEncoder(config))
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
    inputs = _model_runs_on_its_example_inputs(model)
    assert inputs["input_values"].dim() == 3  # (B, 1, S)
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
    config = VIDEO_CONFIGS[model_type]()
    model = transformers.AutoModel.from_config(config).eval()
    inputs = example_inputs_for(model)
    (name, clips), = inputs.items()
    assert name == ("pixel_values_videos" if model_type == "videoprism" else "pixel_values")
    assert clips.shape == (2, 4, 3, 32, 32)  # (B, T, C, H, W)
# ------------------------------------------------------------- vision-language models without grids

VLM_TEXT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=128, num_key_value_heads=2)
VLM_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=8)


def _vlm(model_type: str):
    """A tiny vision-language model of ``model_type`` whose images are laid out without a grid of patches."""
    if model_type == "llava_next":  # any resolution: each image cut into tiles of one of its layouts
        config = transformers.LlavaNextConfig(vision_config=transformers.CLIPVisionConfig(**VLM_VISION),
                                              text_config=transformers.LlamaConfig(**VLM_TEXT), image_token_index=98,
                                              image_grid_pinpoints=[[32, 64]], projector_hidden_act="gelu")
    elif model_type == "instructblip":  # a Q-Former reading an instruction of its own vocabulary
        config = transformers.InstructBlipConfig(
            vision_config=VLM_VISION, text_config=transformers.OPTConfig(vocab_size=99, hidden_size=32, ffn_dim=64,
                                                                         num_hidden_layers=1, num_attention_heads=4,
                                                                         word_embed_proj_dim=32).to_dict(),
            qformer_config=dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=64, encoder_hidden_size=32), num_query_tokens=4,
            image_token_index=98)
    elif model_type == "kosmos-2":  # image embeddings placed where a position mask says
        config = transformers.Kosmos2Config(text_config=dict(vocab_size=99, embed_dim=32, layers=1, attention_heads=4,
                                                             ffn_dim=64), vision_config=VLM_VISION, latent_query_num=4)
    else:
        raise KeyError(model_type)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config, attn_implementation="eager").eval()


def test_an_any_resolution_model_gets_image_sizes_and_each_image_cut_into_the_tiles_of_its_layout():
    model = _vlm("llava_next")
    inputs = example_inputs_for(model)
    assert inputs["image_sizes"].tolist() == [[32, 64]] * 2
    assert inputs["pixel_values"].shape == (2, 1 + 1 * 2, 3, 32, 32)  # the whole image and its 1 x 2 tiles
    with torch.no_grad():
        model(**inputs)


def test_the_fold_of_a_video_encoder_proves_on_its_clips():
    import normfold
    from normfold.hf.inputs import example_inputs_for

    model = transformers.TimesformerModel(VIDEO_CONFIGS["timesformer"]()).eval()
    _, report = normfold.fold(model, example_inputs_for(model))
    assert report.verification.ok and any(n.foldable for n in report.norms)


def test_a_keypoint_matcher_gets_an_image_pair_per_row_that_it_runs_on():
    from normfold.hf.inputs import MATCHED_IMAGE_SIDE

    model = transformers.EfficientLoFTRModel(transformers.EfficientLoFTRConfig(num_hidden_layers=1)).eval()
    inputs = example_inputs_for(model)
    assert inputs["pixel_values"].shape == (2, 2, 3, MATCHED_IMAGE_SIDE, MATCHED_IMAGE_SIDE)  # (B, 2, C, H, W)
def test_a_q_former_model_gets_its_instruction_ids_within_the_q_former_vocabulary():
    model = _vlm("instructblip")
    inputs = example_inputs_for(model)
    ids = inputs["qformer_input_ids"]
    assert ids.shape[0] == 2 and int(ids.max()) < 50 and inputs["qformer_attention_mask"].shape == ids.shape
    with torch.no_grad():
        model(**inputs)


def test_frames_padded_to_max_img_size_get_that_size():
    from normfold.hf.inputs import example_inputs_for

    config = transformers.TvpConfig(max_img_size=96, visual_prompt_size=16, num_frames=2)
    assert example_inputs_for(config)["pixel_values"].shape == (2, 2, 3, 96, 96)
def test_a_model_placing_image_queries_by_a_position_mask_gets_one_slot_per_query():
    model = _vlm("kosmos-2")
    inputs = example_inputs_for(model)
    mask = inputs["image_embeds_position_mask"]
    assert mask.shape == inputs["input_ids"].shape and mask.sum(dim=1).tolist() == [4, 4]
    with torch.no_grad():
        model(**inputs)


def test_a_conformer_reading_stacked_frames_gets_features_of_its_stacked_width():
    """Granite Speech 5's feature extractor puts each mel frame beside its delta and stacks frames in pairs, in
    code (no config field says so): its encoder reads (B, frames, 4 x num_mel_bins) features, 320 wide for 80 mels."""
    config = transformers.GraniteSpeech5EncoderConfig(
        num_mel_bins=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, vocab_size=99, max_position_embeddings=64, context_size=16)
    torch.manual_seed(0)
    model = transformers.GraniteSpeech5Encoder(config).eval()
    inputs = example_inputs_for(model)
    assert inputs["input_features"].shape[-1] == 4 * 80
    with torch.no_grad():
        model(**inputs)


def test_token_ids_come_from_the_sub_config_naming_a_vocabulary_where_the_text_config_names_none():
    """FastSpeech2 with HiFi-GAN: its text-to-spectrogram model's config is ``model_config`` (not a text config
    transformers looks up): ids below its vocab_size (78), not below the character vocabulary (128)."""
    from normfold.hf.inputs import _vocabulary_config

    config = transformers.FastSpeech2ConformerWithHifiGanConfig()
    assert _vocabulary_config(config) is config.model_config
    assert int(example_inputs_for(config)["input_ids"].max()) < config.model_config.vocab_size


def test_a_block_sparse_model_gets_enough_tokens_to_keep_its_block_sparse_attention():
    """BigBird-Pegasus switches its encoder to full attention, for good, on a call of at most
    (5 + 2 * num_random_blocks) * block_size tokens: the example call must not change the model it folds."""
    config = transformers.BigBirdPegasusConfig(vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1,
                                               encoder_attention_heads=2, decoder_attention_heads=2,
                                               encoder_ffn_dim=37, decoder_ffn_dim=37, block_size=4,
                                               num_random_blocks=1, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.BigBirdPegasusModel(config).eval()
    inputs = _model_runs_on_its_example_inputs(model)
    assert inputs["input_ids"].shape[-1] == (6 + 2) * 4
    assert model.config.attention_type == "block_sparse"
    assert type(model.encoder.layers[0].self_attn.self).__name__ == "BigBirdPegasusBlockSparseAttention"


def test_a_model_that_reads_spans_at_question_tokens_gets_one_per_row_and_its_fold_proves():
    """SplinterForPreTraining raises "All samples in the batch must have at least one question token"; the
    question token was even taken out of the random ids as a control token (found by benchmarks/cli_zoo.py)."""
    config = transformers.SplinterConfig(**TINY_BERT_LIKE, question_token_id=5)
    torch.manual_seed(0)
    model = transformers.SplinterForPreTraining(config).eval()
    inputs = _model_runs_on_its_example_inputs(model)
    assert ((inputs["input_ids"] == 5).sum(-1) >= 1).all()
    _, report = normfold.fold(model, inputs)
    assert report.verification is not None


def test_a_speech_model_sized_by_features_per_channel_gets_features_of_that_width():
    """Speech2Text reads input_feat_per_channel x input_channels features (not a ``num_mel_bins``): a config of 24
    was given normfold's 80-wide features and refused ("expected input ... to have 24 channels"), found by
    benchmarks/cli_zoo.py over the testers' configs."""
    config = transformers.Speech2TextConfig(vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1,
                                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                            decoder_ffn_dim=64, input_feat_per_channel=24, input_channels=1,
                                            conv_channels=32, max_source_positions=64, max_target_positions=64)
    torch.manual_seed(0)
    model = transformers.Speech2TextModel(config).eval()
    inputs = _model_runs_on_its_example_inputs(model)
    assert inputs["input_features"].shape[-1] == 24
    _, report = normfold.fold(model, inputs)
    assert report.verification is not None
