"""Example inputs a multimodal folder's model accepts, built from its config and its forward's signature:
text with pixels wherever the forward takes both, one image token per image feature for models that
merge image features into their text (grids of flattened patches for Qwen2-VL and its kin, one image per
row with its pixel mask for Idefics3), boxes for document models, region features for LXMERT; and
`normfold fold DIR` over tiny folders of such types folds (exit 0, never a traceback)."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

import normfold
from normfold.cli import main
from normfold.engine.errors import FoldError
from normfold.hf.inputs import example_inputs_for

transformers = pytest.importorskip("transformers")

TINY_TEXT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64)
TINY_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32,
                   patch_size=8)
IMAGE_TOKEN = 3


def _tiny(model_type: str):
    """A tiny config of ``model_type`` whose every id fits its vocabulary."""
    if model_type == "lxmert":
        return transformers.LxmertConfig(vocab_size=99, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                         l_layers=1, x_layers=1, r_layers=1, visual_feat_dim=16, visual_pos_dim=4)
    if model_type == "git":
        return transformers.GitConfig(vision_config=TINY_VISION, **TINY_TEXT)
    if model_type == "llava":
        return transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**TINY_VISION),
                                        text_config=transformers.LlamaConfig(**TINY_TEXT, num_key_value_heads=2),
                                        image_token_id=IMAGE_TOKEN, projector_hidden_act="gelu")
    raise KeyError(model_type)


def _model(model_type: str):
    config = _tiny(model_type)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config).eval()


def test_a_model_merging_image_features_into_text_gets_one_image_token_per_feature():
    model = _model("llava")
    inputs = example_inputs_for(model)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        model(**inputs)  # runs: the tokens and the features match
    per_row = (inputs["input_ids"] == IMAGE_TOKEN).sum(dim=1)
    assert per_row.tolist() == [f.shape[0] for f in features] and int(per_row[0]) > 0


def test_a_model_taking_text_and_pixels_gets_both():
    inputs = example_inputs_for(_model("git"))
    assert {"input_ids", "pixel_values"} <= set(inputs)


def test_document_models_get_ordered_boxes_within_their_2d_positions():
    config = transformers.LayoutLMConfig(**TINY_TEXT, max_2d_position_embeddings=100)
    boxes = example_inputs_for(config, seq=6)["bbox"]
    assert boxes.shape == (2, 6, 4) and boxes.dtype == torch.int64
    assert (boxes[..., 0] <= boxes[..., 2]).all() and (boxes[..., 1] <= boxes[..., 3]).all()
    assert 0 <= int(boxes.min()) and int(boxes.max()) <= 99


def test_lxmert_gets_region_features_and_normalized_positions():
    inputs = example_inputs_for(_tiny("lxmert"))
    assert inputs["visual_feats"].shape[-1] == 16 and inputs["visual_pos"].shape[-1] == 4
    assert 0 <= float(inputs["visual_pos"].min()) and float(inputs["visual_pos"].max()) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["lxmert", "git", "llava"])
def test_fold_of_a_tiny_multimodal_folder_folds_with_valid_inputs(model_type, tmp_path, monkeypatch):
    folder, out = tmp_path / model_type, tmp_path / "folded"
    _model(model_type).save_pretrained(folder)
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(["fold", str(folder), "-o", str(out)])
    assert "Traceback" not in stderr.getvalue()
    assert code == 0, stderr.getvalue()
    assert (out / "normfold_report.json").is_file()


# Vision towers that read grids of patches: the text's multimodal RoPE splits each head's 8 dims 2 / 1 / 1
# (temporal, height, width: the defaults' sections are for 128-dim heads)
TINY_GRID_VISION = dict(depth=1, num_heads=4, embed_dim=32, hidden_size=32, out_hidden_size=32, intermediate_size=64,
                        patch_size=4, num_position_embeddings=64, deepstack_visual_indexes=[0])
GRID_TYPES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"]
MASKED_IMAGE_TYPES = ["idefics3", "smolvlm"]


def _tiny_image_text(model_type: str):
    """The default config of a Qwen2-VL- or Idefics3-style type, shrunk, its special tokens inside the vocabulary."""
    config = transformers.CONFIG_MAPPING[model_type]()
    text = config.get_text_config()
    for name, value in {**TINY_TEXT, "num_key_value_heads": 2, "head_dim": 8}.items():
        setattr(text, name, value)
    if model_type in GRID_TYPES:  # the modeling code's default sections, when the config names none, are for 128
        text.rope_parameters["mrope_section"] = [2, 1, 1]
    vision = config.vision_config
    for name, value in ({**TINY_VISION, "patch_size": 8} if model_type in MASKED_IMAGE_TYPES else TINY_GRID_VISION).items():
        if hasattr(vision, name):
            setattr(vision, name, value)
    for i, name in enumerate(n for n in vars(config) if n.endswith("_token_id") and n != "pad_token_id"):
        setattr(config, name, 90 + i)
    return config


def _image_text_model(model_type: str):
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(_tiny_image_text(model_type), attn_implementation="eager").eval()


@pytest.mark.parametrize("model_type", GRID_TYPES)
def test_a_grid_model_gets_flattened_patches_and_one_image_token_per_merged_patch(model_type):
    model = _image_text_model(model_type)
    inputs = example_inputs_for(model)
    vision, merge = model.config.vision_config, model.config.vision_config.spatial_merge_size
    grid = inputs["image_grid_thw"]
    assert grid.shape == (2, 3)  # one image per row
    per_patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    assert inputs["pixel_values"].shape == (int(grid.prod(-1).sum()), per_patch)
    tokens = inputs["input_ids"] == model.config.image_token_id
    assert tokens.sum(dim=1).tolist() == (grid.prod(-1) // merge ** 2).tolist()
    assert torch.equal(inputs["mm_token_type_ids"], tokens.int())  # M-RoPE: 1 where an image feature goes
    with torch.no_grad():
        model(**inputs)  # the model takes them


@pytest.mark.parametrize("model_type", MASKED_IMAGE_TYPES)
def test_an_idefics3_style_model_gets_one_image_per_row_with_its_pixel_mask(model_type):
    model = _image_text_model(model_type)
    inputs = example_inputs_for(model)
    b, n, _, h, w = inputs["pixel_values"].shape
    assert (b, n) == (2, 1) and inputs["pixel_attention_mask"].shape == (b, n, h, w)
    assert inputs["pixel_attention_mask"].all()  # no padding pixels
    vision = model.config.vision_config
    per_image = (vision.image_size // vision.patch_size) ** 2 // model.config.scale_factor ** 2
    assert (inputs["input_ids"] == model.config.image_token_id).sum(dim=1).tolist() == [per_image] * b
    with torch.no_grad():
        model(**inputs)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2_vl", "idefics3"])
def test_the_fold_of_a_grid_or_masked_image_model_proves_or_refuses_for_a_reason_other_than_its_inputs(model_type):
    """torch.export stops on these models' data-dependent control flow (issue 33, item 4): a FoldError
    saying so is accepted, one about the inputs is not."""
    model = _image_text_model(model_type)
    inputs = example_inputs_for(model)
    with torch.no_grad():
        model(**inputs)  # what the fold is given runs: its FoldError cannot be about the inputs
    try:
        _, report = normfold.fold(model, inputs)
    except FoldError as err:
        message = str(err)
        assert not any(name in message for name in ("grid_thw", "pixel_values", "pixel_attention_mask", "input_ids",
                                                    "image features and image tokens", "same reduction dim")), message
        assert "data-dependent" in message or "torch.export" in message, message
    else:
        assert report.verification.ok


AUDIO_TEXT_TYPES = ["audioflamingo3", "glmasr", "moss_transcribe_diarize"]


def _zoo_rules():
    """tests/hf/test_zoo_folders.py: the zoo's shrink rules and config overrides."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_zoo_rules", Path(__file__).with_name("test_zoo_folders.py"))
    zoo = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up
    spec.loader.exec_module(zoo)
    return zoo


def _audio_text_config(model_type: str):
    """The default config of a text+audio type with every size small (the zoo's shrink rules and
    overrides), its audio token inside the vocabulary."""
    zoo = _zoo_rules()
    return zoo.shrink(transformers.CONFIG_MAPPING[model_type](**zoo.CONFIG_OVERRIDES.get(model_type, {})))


def _audio_text_model(model_type: str):
    config = _audio_text_config(model_type)
    torch.manual_seed(0)
    return _zoo_rules()._bare_model_class(config)(config).eval()


@pytest.mark.parametrize("model_type", AUDIO_TEXT_TYPES)
def test_a_model_merging_audio_features_into_text_gets_one_audio_token_per_feature(model_type):
    """Token ids beside the audio (none were built before), led by as many ``audio_token_id`` as the
    model's own ``get_audio_features`` makes, and an all-ones mask for each audio mask it takes."""
    model = _audio_text_model(model_type)
    inputs = example_inputs_for(model)
    assert inputs["input_features_mask"].shape == (2, inputs["input_features"].shape[-1])
    assert inputs["input_features_mask"].all()  # nothing padded
    audio = {k: v for k, v in inputs.items() if k in ("input_features", "input_features_mask", "padding_mask")}
    with torch.no_grad():
        features = model.get_audio_features(**audio).pooler_output
        model(**inputs)  # runs: the tokens and the features match
    tokens = inputs["input_ids"] == model.config.audio_token_id
    assert int(tokens.sum()) == features.numel() // features.shape[-1] > 0


def test_an_audio_mask_is_built_only_where_the_models_get_audio_features_reads_it():
    """Granite Speech's forward takes an ``input_features_mask`` over its projected features, not over
    the frames (its ``get_audio_features`` reads none): an all-ones frame mask would index them wrongly."""
    assert "input_features_mask" in example_inputs_for(_audio_text_config("audioflamingo3"))
    assert "input_features_mask" not in example_inputs_for(_audio_text_config("granite_speech"))
# grid vision towers and VLMs whose configs name the grid, the merge and the frames per patch otherwise
# than Qwen2-VL: ``grid_thw`` (the towers), ``merge_size``/``patch_temporal`` (Muse), no temporal size
# (Cosmos3-Edge, GLM-Image: one frame per patch), ``merge_sizes``/``image_merge_sizes`` (VideoLLaMA3)
GRID_TOWER_TYPES = ["glm_image_vision", "cosmos3_edge_vision", "hunyuan_vl_vision", "muse_spark_vision",
                    "video_llama_3_vision", "cosmos3_edge", "video_llama_3"]
# patch layouts without a grid: a packed strip with target_sizes (MiniCPM-V towers), NaFlex patches with
# spatial_shapes (LFM2-VL), bare flattened patches straight into the text (Fuyu, NeoMME: no vision tower)
PATCH_LAYOUT_TYPES = ["minicpmv4_7_vision", "lfm2_vl", "fuyu"]
TINY_TOWER = dict(hidden_size=32, num_hidden_layers=1, depth=1, num_attention_heads=4, num_heads=4,
                  intermediate_size=64, patch_size=8, out_hidden_size=32)


def _tiny_grid_tower_model(model_type: str):
    """The default config of ``model_type`` with its vision tower (or itself) and its text shrunk."""
    config = transformers.CONFIG_MAPPING[model_type]()
    text = config.get_text_config()
    if text is not config:
        for name, value in {**TINY_TEXT, "num_key_value_heads": 2, "head_dim": 8}.items():
            setattr(text, name, value)
    for name, value in TINY_TOWER.items():
        if hasattr(getattr(config, "vision_config", None) or config, name):
            setattr(getattr(config, "vision_config", None) or config, name, value)
    for i, name in enumerate(n for n in vars(config) if n.endswith("_token_id") and n != "pad_token_id"):
        setattr(config, name, 90 + i)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("model_type", GRID_TOWER_TYPES)
def test_a_grid_tower_gets_its_grid_under_its_own_name_with_patches_of_its_width(model_type):
    model = _tiny_grid_tower_model(model_type)
    inputs = example_inputs_for(model)
    grid = inputs.get("grid_thw", inputs.get("image_grid_thw"))
    assert grid is not None and grid.shape == (2, 3)  # one image per row
    assert inputs["pixel_values"].shape[0] == int(grid.prod(-1).sum())  # one flattened patch a row
    with torch.no_grad():
        model(**inputs)  # the model takes them


@pytest.mark.parametrize("model_type", PATCH_LAYOUT_TYPES)
def test_a_patch_layout_model_gets_patches_it_takes_and_one_image_token_per_feature(model_type):
    model = _tiny_grid_tower_model(model_type)
    inputs = example_inputs_for(model)
    with torch.no_grad():
        model(**inputs)  # the model takes them (and, for a VLM, as many image tokens as image features)
    token = getattr(model.config, "image_token_id", None)
    if isinstance(token, int) and "input_ids" in inputs:
        assert (inputs["input_ids"] == token).sum() > 0


def test_random_text_holds_none_of_the_configs_media_control_tokens_but_may_hold_its_text_tokens():
    """A start marker or placeholder of image, audio or video in random text makes a model parse media that
    is not there (the Qwen omni models read an audio clip after every audio start marker); pad, bos, eos and
    the like are text."""
    config = transformers.LlamaConfig(**TINY_TEXT, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config.forced_bos_token_id = 4  # a text token under another name (BART's)
    controls = {"vision_start_token_id": 5, "audio_start_token_id": 6, "audio_token_index": 7}
    for name, value in controls.items():
        setattr(config, name, value)
    ids = example_inputs_for(config, batch=64, seq=32)["input_ids"]  # 2,048 ids over a vocabulary of 99
    assert not torch.isin(ids, torch.tensor(list(controls.values()))).any()
    assert all((ids == token).any() for token in (0, 1, 2, 4))  # text tokens are kept


@pytest.mark.parametrize("model_type", ["qwen2_audio", "musicflamingo"])
def test_audio_tokens_are_counted_by_the_audio_tower_where_get_audio_features_cannot_count_them(model_type):
    """Qwen2-Audio has no ``get_audio_features`` and MusicFlamingo's needs the ids it would count the tokens
    of (its rotary time stamps): one ``audio_token_id`` per state of the model's ``audio_tower`` (its projector
    keeps them one to one); Qwen2-Audio's required ``feature_attention_mask`` is all ones over the frames."""
    model = _audio_text_model(model_type)
    inputs = example_inputs_for(model)
    audio = {k: v for k, v in inputs.items() if k in ("input_features", "input_features_mask")}
    with torch.no_grad():
        states = model.audio_tower(**audio).last_hidden_state  # (B, frames', D)
        model(**inputs)  # runs: the tokens and the features match
    assert int((inputs["input_ids"] == model.config.audio_token_id).sum()) == states.shape[0] * states.shape[1] > 0
    if model_type == "qwen2_audio":
        assert inputs["feature_attention_mask"].shape == (2, inputs["input_features"].shape[-1])
        assert inputs["feature_attention_mask"].all()


def _tiny_molmo2():
    heads = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8)
    config = transformers.Molmo2Config(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, patch_size=8, image_size=[32, 32],
                           **heads),
        adapter_config=dict(hidden_size=32, intermediate_size=64, text_hidden_size=32, vision_feature_layer=[-1, -2],
                            **heads),
        text_config=dict(TINY_TEXT, num_key_value_heads=2, head_dim=8), image_patch_id=IMAGE_TOKEN,
        **{name: 90 + i for i, name in enumerate(("image_start_token_id", "low_res_image_start_token_id",
                                                   "image_end_token_id", "frame_start_token_id", "frame_end_token_id"))})
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config).eval()


def test_a_model_pooling_its_image_tokens_from_crops_gets_crops_a_pooling_table_and_one_token_per_pooled_feature():
    """Fails on main 04d58aa (Molmo2 was given (B, C, H, W) pixels, which its patch embedding cannot read, then
    its text alone): one crop of the tower's 4 x 4 patches per image, each of its 2 x 2 image tokens pooling a
    2 x 2 window of that crop's patches, its grids counting those tokens; the model reads the images."""
    model = _tiny_molmo2()
    inputs = example_inputs_for(model)
    patches = model.config.vision_config.num_position_embeddings  # 16: a 32 px crop in 8 px patches
    assert inputs["pixel_values"].shape == (2, patches, 3 * 8 * 8)  # (crops, N, C·P·P)
    # (B·tokens, window): indices into the patches of all crops (transformers 5.24), or of each image's own crop
    # (5.25 adds each image's offset itself): either way each image's tokens pool every patch of its crop once
    pooling = inputs["image_token_pooling"]
    assert pooling.shape == (2 * 4, 4)
    assert (pooling[:4] < patches).all() and pooling[:4].unique().numel() == patches
    assert (pooling[4:] % patches).unique().numel() == patches
    assert inputs["image_grids"].tolist() == [[2, 2, 0, 0]] * 2
    assert (inputs["input_ids"] == IMAGE_TOKEN).sum(dim=1).tolist() == [4, 4]
    with torch.no_grad():
        assert model(**inputs).image_outputs is not None  # the vision tower ran


def _tiny_pi0(expert_width: int):
    """A tiny PI0: a PaliGemma (32 wide) and an action expert of ``expert_width`` reading its cache (same heads)."""
    heads = dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8, num_hidden_layers=1, vocab_size=99)
    config = transformers.PI0Config(
        vlm_config={"model_type": "paligemma", "image_token_id": IMAGE_TOKEN, "projection_dim": 32, "hidden_size": 32,
                    "vocab_size": 99,
                    "text_config": {"model_type": "gemma", "hidden_size": 32, "intermediate_size": 64, **heads},
                    "vision_config": {"model_type": "siglip_vision_model", **TINY_VISION, "vision_use_head": False}},
        dit_config={"model_type": "gemma", "hidden_size": expert_width, "intermediate_size": 2 * expert_width, **heads})
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config).eval()


def test_a_robot_policy_gets_action_embeddings_of_its_experts_width_and_image_tokens_its_sub_model_merges():
    """Fails on main 04d58aa (PI0 was given no action_embeds, 224 px images and no image tokens): a required
    ``*_embeds`` argument gets embeddings of the config width the model runs with (the action expert's 16,
    not the PaliGemma's 32); the images are sized by the PaliGemma's vision config, one camera per row with
    its camera mask; the ids lead with one image token per feature its PaliGemma (``vlm``) makes of them."""
    model = _tiny_pi0(expert_width=16)
    inputs = example_inputs_for(model)
    # (B, T, the expert's width); T the call's 4 (transformers 5.24) or the chunk after a state token (5.25)
    assert inputs["action_embeds"].shape[::2] == (2, 16)
    assert inputs["action_embeds"].shape[1] in (4, model.config.chunk_size + 1, model.config.chunk_size)
    assert inputs["pixel_values"].shape == (2, 1, 3, 32, 32)  # (B, cameras, C, H, W)
    assert inputs["pixel_attention_mask"].tolist() == [[True], [True]]  # (B, cameras)
    assert (inputs["input_ids"] == IMAGE_TOKEN).sum(dim=1).tolist() == [16, 16]  # (32 / 8)² patches an image
    with torch.no_grad():
        model(**inputs)


def test_a_speech_lm_reading_codec_frames_gets_segment_cutoffs_and_one_audio_token_per_codec_frame():
    """CSM encodes each row's audio segments with its codec (``input_values_cutoffs``: where each ends, required
    with the waveform) and embeds each codec frame's codes at one ``audio_token_id``: the row's waveform
    (B, 1, samples) is one segment, and the text is led by as many audio tokens as the codec makes frames of it.
    Fails on main 970d944 (the waveform without cutoffs raised in CSM's own code: the text alone was passed)."""
    model = _audio_text_model("csm")
    inputs = example_inputs_for(model)
    waveform = inputs["input_values"]  # (B, 1, S)
    assert waveform.dim() == 3 and waveform.shape[1] == 1
    assert inputs["input_values_cutoffs"].tolist() == [[waveform.shape[-1]]] * waveform.shape[0]
    with torch.no_grad():
        codes = model.codec_model.encode(waveform).audio_codes  # (B, codebooks, frames)
        model(**inputs)  # runs: the audio tokens and the codec frames match
    tokens = inputs["input_ids"] == model.config.audio_token_id
    assert int(tokens.sum()) == codes.shape[0] * codes.shape[-1] > 0


def _tiny_glm_image():
    """A tiny GLM-Image: a 32-wide grid tower whose states a 64-code VQ codebook quantizes into the first ids of
    the text vocabulary, the image markers after them, the placeholder the last id."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    config = transformers.GlmImageConfig(
        vision_config=dict(depth=1, hidden_size=32, num_heads=4, intermediate_size=64, image_size=32, patch_size=8),
        text_config=dict(TINY_TEXT, num_key_value_heads=2, rope_parameters=rope, pad_token_id=0, eos_token_id=1,
                         vision_vocab_size=64),
        vq_config=dict(num_embeddings=64, latent_channels=32, embed_dim=32),
        image_token_id=98, image_start_token_id=64, image_end_token_id=65)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config).eval()


def test_an_image_to_image_generator_gets_a_target_grid_after_each_source_and_a_token_per_codebook_id():
    """Fails on main 04d58aa (GLM-Image read its grids as sources but the last, one grid short, then got its text
    alone): each row's source image grid is followed by the grid of the image it generates (no pixels for it),
    ``images_per_sample`` counts both, and the ids hold one placeholder per id the VQ codebook gives the source."""
    model = _tiny_glm_image()
    inputs = example_inputs_for(model)
    grid = inputs["image_grid_thw"]  # (2·B, 3): source, target per row
    assert grid.shape == (4, 3) and inputs["images_per_sample"].tolist() == [2, 2]
    sources = grid[0::2]
    assert inputs["pixel_values"].shape[0] == int(sources.prod(-1).sum())  # pixels of the sources only
    assert (inputs["input_ids"] == 98).sum(dim=1).tolist() == sources.prod(-1).tolist()  # one id per source patch
    with torch.no_grad():
        assert model(**inputs).image_outputs is not None  # the vision tower ran


def _vitpose_and_vitmatte():
    pose = transformers.VitPoseConfig(backbone_config=transformers.VitPoseBackboneConfig(
        image_size=[32, 24], patch_size=[8, 8], num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, out_indices=[2]))
    matte = transformers.VitMatteConfig(backbone_config=transformers.VitDetConfig(
        image_size=32, patch_size=16, num_channels=4, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        out_features=["stage1"]), hidden_size=8, fusion_hidden_sizes=[32, 16, 8, 8])
    return [(transformers.VitPoseForPoseEstimation, pose, (3, 32, 24)),
            (transformers.VitMatteForImageMatting, matte, (4, 32, 32))]


@pytest.mark.parametrize("model_class, config, shape", _vitpose_and_vitmatte(), ids=["vitpose", "vitmatte"])
def test_a_model_whose_backbone_sizes_its_images_gets_pixels_of_the_backbones_size(model_class, config, shape):
    """ViTPose reads images of its ViT backbone's size (not square), ViTMatte an image plus its trimap (4
    channels): both refused normfold's 224 x 224 RGB pixels ("Input image size (224*224) doesn't match model",
    "Expected 4 but got 3"), found by benchmarks/cli_zoo.py over the testers' configs."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    inputs = example_inputs_for(model)
    assert tuple(inputs["pixel_values"].shape[1:]) == shape
    _, report = normfold.fold(model, inputs)  # raises unless proved
    assert report.verification is not None


def test_a_vision_tower_that_reads_frames_gets_a_clip_as_its_frames():
    """X-CLIP's vision tower alone reads (B·T, C, H, W) frames, not the (B, T, C, H, W) clips its config's
    ``num_frames`` suggests ("too many values to unpack (expected 4)", found by benchmarks/cli_zoo.py)."""
    config = transformers.XCLIPVisionConfig(**TINY_VISION, num_frames=2, mit_hidden_size=32, mit_intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.XCLIPVisionModel(config).eval()
    inputs = example_inputs_for(model)
    assert inputs["pixel_values"].dim() == 4
    _, report = normfold.fold(model, inputs)
    assert report.verification is not None


def test_a_robot_policy_gets_its_state_noise_and_timestep_and_its_fold_proves():
    """PI0ForConditionalGeneration (a checkpoint's architecture) requires the robot's ``state``: every folder of it
    was refused ("missing 1 required positional argument: 'state'"); noise and timestep are given too, so that
    its forward draws no random numbers of its own."""
    from test_zoo_folders import shrunk_config

    torch.manual_seed(0)
    model = transformers.PI0ForConditionalGeneration(shrunk_config("pi0")).eval()
    inputs = example_inputs_for(model)
    config = model.config
    assert inputs["state"].shape == (2, config.max_state_dim)
    assert inputs["noise"].shape == (2, config.chunk_size, config.max_action_dim) and inputs["timestep"].shape == (2,)
    _, report = normfold.fold(model, inputs)
    assert report.verification is not None and not report.verification.random_draws
