"""`normfold fold DIR` on a tiny folder of each of ~25 model types of the installed transformers:
it folds and verifies (exit 0), or says why in one line (exit 2; exit 1 for a failed verification),
never a traceback; and `normfold analyze DIR` says, norm by norm, what the fold did. The folders are built
offline from each type's default config, shrunk."""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from normfold.cli import main
from normfold.cli._output import print_norm_table
from normfold.hf.inputs import example_inputs_for
from normfold.hf.folder_report import FoldSection, ReportNorm
from normfold.hf.report import norm_rows, read_folder_report, report_rows

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

# int config fields that size a model, and the small value each gets (lists such as hidden_sizes are kept)
SMALL_SIZES = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "dim": 32, "hidden_dim": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "intermediate_size": 64, "ffn_dim": 64, "d_ff": 64, "d_inner": 64, "n_inner": 64, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_key_value_heads": 2, "d_head": 8, "head_dim": 8, "d_kv": 8,
    "image_size": 32, "patch_size": 8, "vocab_size": 99, "decoder_vocab_size": 99, "max_position_embeddings": 64, "n_positions": 64,
    "max_source_positions": 16, "max_target_positions": 16, "num_mel_bins": 8, "projection_dim": 32,
    "projection_size": 32, "encoder_hidden_size": 32,  # a Q-Former's cross-attention reads the vision width (32)
    # LayoutLMv2/v3's spatial embeddings concatenate 4 coordinate and 2 shape embeddings: 4·4 + 2·8 = 32
    "coordinate_size": 4, "shape_size": 8,
    # rotary slices at most the head size 32 / 4 = 8: GPT-J/CodeGen's rotary_dim, the MLA query/key rope part
    # (DeepSeek-V3 and kin point head_dim at it) beside its no-rope part, values and low-rank projections
    "rotary_dim": 4, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "kv_lora_rank": 16,
    "q_lora_rank": 16, "index_head_dim": 16, "index_n_heads": 4,
    # BROS projects each box pair's sinusoid embedding to one head's size, 32 / 4
    "dim_bbox_projection": 8,
    # Qwen2-VL-style vision towers: their heads (num_heads), the width they hand the text model, and their blocks
    # (depth: 24 to 40 of them by default)
    "num_heads": 4, "out_hidden_size": 32, "depth": 2,
    # Llama 4's vision projector (input and output) and what its tower hands on; MiniMax-M3-VL's projector
    "projector_input_dim": 32, "projector_output_dim": 32, "vision_output_dim": 32, "projector_hidden_size": 32,
    # Kimi-K2.5's projector norms the merged vision states at the vision width
    "projection_hidden_size": 32,
    # Inkling2's vision projector hands the text model its width, through a hidden layer
    "text_hidden_size": 32, "projection_hidden_dim": 64,
    # Gemma 3 pools each image's 4 x 4 patches to mm_tokens_per_image: 2 x 2 tokens, a pooling kernel of 2
    "mm_tokens_per_image": 4,
    # widths a config derives from hidden_size when built (ViT's pooler), or that must equal the projection
    # (X-CLIP's multi-frame transformer reads the projected frame features)
    "pooler_output_size": 32, "mit_hidden_size": 32, "mit_intermediate_size": 64,
    "pooler_hidden_size": 32,  # DeBERTa(-v2)'s classification pooler reads the hidden states: derived as 1536
    # CSM's depth decoder reads the backbone's width; Mimi's upsampling conv is depthwise (a group per channel)
    "backbone_hidden_size": 32, "upsample_groups": 32,
}
TOWERS = ("text_config", "vision_config", "audio_config", "encoder_config", "decoder_config", "encoder", "decoder",
          "adaptor_config",  # FunASR's adaptor: its output width is the shrunk text width
          "adapter_config",  # Molmo2's adapter: pools the vision states into the text width
          "qformer_config", "high_res_vision_config",
          "perceiver_config",  # Idefics2's resampler reads the text width (its hidden_size)
          "sam_config",  # Unlimited-OCR's SAM stage before its CLIP encoder
          "semantic_model_config",  # NeuCodec and X-codec2's semantic branch: a whole Wav2Vec2-BERT
          "speech_config",  # CLVP's speech encoder
          "vlm_config", "dit_config",  # PI0's PaliGemma and its action expert (a Gemma reading the PaliGemma's cache)
          "codec_config", "depth_decoder_config")  # CSM's Mimi codec and depth decoder (unshrunk: 396M parameters)

# one per family: Pre-/Post-LN text, encoder-decoders, vision with and without input embeddings,
# channels-first norms, audio (waveform and log-mel), two-tower multimodal, character-level, RMSNorm-only
MODEL_TYPES = [
    "bert", "roberta", "distilbert", "albert", "electra", "deberta-v2", "mpnet", "canine", "funnel", "xlnet",
    "gpt2", "gpt_neo", "opt", "bloom", "xglm", "llama", "bart", "t5",
    "vit", "deit", "convnext", "segformer", "mobilevit",
    "wav2vec2", "whisper", "clip", "siglip",
]


def shrink(config):
    """The config with every size field in SMALL_SIZES set small, in each tower too (returned for chaining);
    a multi-head attention default (as many key/value heads as heads: ESMC normalizes keys over the whole
    hidden size) stays multi-head, a field its type's CONFIG_OVERRIDES sets keeps that value (the override
    knows what the rule cannot), and the sizes its constructor derived from shrunk ones are derived again."""
    multi_head = getattr(config, "num_key_value_heads", None) == getattr(config, "num_attention_heads", None)
    kept = CONFIG_OVERRIDES.get(getattr(config, "model_type", None), {})
    merges_patches = _merges_patches(config)  # read before the sizes it compares are shrunk
    for name, value in list(vars(config).items()):
        if name in SMALL_SIZES and name not in kept and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            setattr(config, name, SMALL_SIZES[name])
    if multi_head and isinstance(getattr(config, "num_key_value_heads", None), int):
        config.num_key_value_heads = config.num_attention_heads
    if "head_dim" in vars(config) and config.head_dim is None and isinstance(vars(config).get("num_attention_heads"), int):
        # the size the model derives when it reads None (HunYuan and Ministral's modeling reads it as given)
        config.head_dim = config.hidden_size // config.num_attention_heads
    _fit_per_layer_lists(config)
    _keep_every_stage_a_pixel(config)
    _fit_stage_heads(config)
    if merges_patches:
        _fit_windows(config)
    top = SMALL_SIZES["vocab_size"] - 1
    aliased_tokens = _token_fields_named_by_alias(config)
    for name, value in list(vars(config).items()):  # special tokens must stay inside the shrunk vocabulary
        if name.endswith("_token_id") and isinstance(value, int) and value >= SMALL_SIZES["vocab_size"]:
            setattr(config, name, 1)
        elif ((name.endswith("_token_index") or name in aliased_tokens) and isinstance(value, int)
              and value >= SMALL_SIZES["vocab_size"]):
            setattr(config, name, top)  # LLaVA's image token (image_token_id reads it): one id of its own each
            top -= 1
    _fit_mrope_sections(config)
    shrink_grid_pinpoints(config)
    for name in ("image_token_index", "video_token_index"):  # a Q-Former's query outputs (BLIP-2, InstructBLIP-
        if name in vars(config) and vars(config)[name] is None and hasattr(config, "num_query_tokens"):  # Video) take
            setattr(config, name, top)  # the places of this token (None by default: every call fails comparing to it)
    for tower in TOWERS:
        sub = getattr(config, tower, None)
        if isinstance(sub, transformers.PretrainedConfig):
            _set_overrides(shrink(sub))
    derive_sizes_again(config)
    shrink_layer_lists(config)
    if isinstance(getattr(config, "vision_output_dim", None), int) and hasattr(config, "intermediate_layers_indices"):
        # Mllama's projector reads the last state and each intermediate one, concatenated
        config.vision_output_dim = config.hidden_size * (len(config.intermediate_layers_indices) + 1)
    return config


def _token_fields_named_by_alias(config) -> set[str]:
    """The fields a config reads under a ``*_token_id`` alias but names otherwise (Molmo2's ``image_patch_id``
    is its ``image_token_id``): special tokens the shrink keeps inside the vocabulary, each its own id."""
    aliases = getattr(type(config), "attribute_map", None) or {}
    return {field for alias, field in aliases.items()
            if alias.endswith("_token_id") and not field.endswith(("_token_id", "_token_index"))}


def derive_sizes_again(config) -> None:
    """Sizes a config's constructor derives from others, derived again from the shrunk ones (its towers shrunk
    first): an MLA query/key head is its no-rope and rope parts (DeepSeek-V3 and kin); RADIO's flattened
    patch is ``num_channels``·``patch_size``² features; a Llama 4 vision MLP's width
    is what pixel shuffle makes of a patch (``hidden_size / ratio²``); MiniMax-M3-VL's merged patch is
    ``spatial_merge_size²`` text-width features; Granite Speech 5 attends within blocks of ``context_size``
    frames whose relative distances index ``2·max_position_embeddings + 1`` embeddings (its constructor
    checks ``context_size <= max_position_embeddings``): blocks no longer than the shrunk positions; X-codec's
    codebook holds its acoustic and semantic features side by side (``codebook_dim``, their widths' sum)."""
    if isinstance(getattr(config, "qk_head_dim", None), int):
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if all(isinstance(getattr(config, name, None), int) for name in ("patch_dim", "patch_size", "num_channels")):
        config.patch_dim = config.num_channels * config.patch_size ** 2  # RADIO's flattened patch: C·P·P features
    ratio = getattr(config, "pixel_shuffle_ratio", None)
    if isinstance(ratio, float) and hasattr(config, "projector_input_dim"):  # a Llama 4 vision tower
        config.intermediate_size = int(config.hidden_size / ratio ** 2)
    if isinstance(getattr(config, "merged_hidden_size", None), int):
        config.merged_hidden_size = config.text_config.hidden_size * config.vision_config.spatial_merge_size ** 2
    context, positions = getattr(config, "context_size", None), getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and isinstance(positions, int) and context > positions:
        config.context_size = positions  # Granite Speech 5's attention blocks: a distance is one of 2·positions + 1
    acoustic, semantic = getattr(config, "acoustic_model_config", None), getattr(config, "semantic_model_config", None)
    if isinstance(getattr(config, "codebook_dim", None), int) and acoustic is not None and semantic is not None:
        config.codebook_dim = acoustic.hidden_size + semantic.hidden_size  # X-codec: 256 + the shrunk semantic width


# fields a size rule cannot derive (they win over SMALL_SIZES): GPT-Neo lists one attention type per layer;
# LiLT's layout embeddings concatenate 6 slices of hidden_size // 6, so its hidden size is a multiple of 6;
# GLM-4V and GLM-OCR's text rotary defaults its mrope_section in code: made explicit, shrink fits it to the head
# ALIGN projects text to its EfficientNet's output channels (640); EfficientLoFTR's attention runs at its CNN's
# last width (256, 8 heads: rotary over 4x the head size; MLP 2x), LightGlue's at its SuperPoint's descriptor size
# (256; MLP 2x); LW-DETR's default config projects no feature level (projector_scale_factors=()): one level, a
# small windowed ViT backbone whose 2 x 2 windows tile the 14 x 14 patches of a 224 px image, fewer queries than
# tokens; TVP pads each of its num_frames frames to max_img_size (448, 48 frames through a ResNet-50): 2 frames of
# 96 px; DepthPro cuts its image into patch_size squares for DINOv2 towers whose image_size must equal it (384 px,
# 12 layers each, hooks on layers 11 and 5): 32 px squares for 2-layer towers, hooks on their 2 layers
_GLM_MROPE_TEXT = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}}
CONFIG_OVERRIDES = {"gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
                    "lilt": {"hidden_size": 48},
                    "glm4v": {"text_config": _GLM_MROPE_TEXT}, "glm_ocr": {"text_config": _GLM_MROPE_TEXT},
                    "voxtral": {"audio_token_id": 24},  # its default is None (no audio token): its checkpoints' id
                    "align": {"projection_dim": 640},
                    # block-sparse attention needs more than (5 + 2 r) b tokens, else the model swaps it for full
                    # attention for good: 64-token blocks would need 704 of its 64 positions
                    "big_bird": {"block_size": 4, "num_random_blocks": 1},
                    "bigbird_pegasus": {"block_size": 4, "num_random_blocks": 1},
                    "efficientloftr": {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 8,
                                       "intermediate_size": 512},
                    "lightglue": {"hidden_size": 256, "intermediate_size": 512},
                    "lw_detr": {"projector_scale_factors": [1.0], "d_model": 32, "num_queries": 16, "backbone_config": {
                        "model_type": "lw_detr_vit", "image_size": 224, "hidden_size": 32, "num_attention_heads": 4,
                        "intermediate_size": 64, "num_hidden_layers": 4, "window_block_indices": [0, 2],
                        "out_indices": [1, 3], "num_windows": 4}},
                    "tvp": {"max_img_size": 96, "visual_prompt_size": 16, "num_frames": 2},
                    "depth_pro": {"patch_size": 32, "intermediate_hook_ids": [1, 0], **{
                        f"{tower}_model_config": {"model_type": "dinov2", "image_size": 32, "patch_size": 8,
                                                  "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
                        for tower in ("image", "patch", "fov")}}}
# Granite Speech's Q-Former projector (not a tower the size rules shrink) reads the audio encoder's
# hidden states: its encoder_hidden_size is the shrunk encoder's hidden_dim (its default, 1408, is no one's)
_GRANITE_PROJECTOR = {"projector_config": {"model_type": "blip_2_qformer", "hidden_size": 32, "num_hidden_layers": 1,
                                           "num_attention_heads": 4, "intermediate_size": 64,
                                           "encoder_hidden_size": SMALL_SIZES["hidden_dim"]}}
CONFIG_OVERRIDES.update({"granite_speech": _GRANITE_PROJECTOR, "granite_speech_plus": _GRANITE_PROJECTOR})
# PaddleOCR-VL's text rotary, like GLM-4V's, defaults its mrope_section in code ([16, 24, 24]): made explicit
CONFIG_OVERRIDES["paddleocr_vl"] = {"text_config": {"rope_parameters": {
    "rope_type": "default", "rope_theta": 500000.0, "mrope_section": [16, 24, 24]}}}
# The Qwen omni thinkers' rope index reads vision_start_token_id on every call, a field their config classes do not
# declare (checkpoints' config.json sets it), and tells images, audio and their start markers apart by id (the shrink
# maps all of them to 1): each its own id inside the shrunk vocabulary
CONFIG_OVERRIDES.update(dict.fromkeys(("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"), {
    "vision_start_token_id": 90, "audio_start_token_id": 91, "audio_token_id": 92, "image_token_id": 93,
    "video_token_id": 94, "user_token_id": 95}))
# Aria's projector maps each image's patch count to its query count: the shrunk image's 4 x 4 patches to 4 queries
CONFIG_OVERRIDES["aria"] = {"projector_patch_to_query_dict": {16: 4}}
# Unlimited-OCR's SAM stage reads the image at the vision config's size (it names none: 224 px) and hands its last
# downsampling conv's channels to the CLIP encoder, whose width they must be
CONFIG_OVERRIDES["unlimited_ocr_sam_vision_model"] = {"image_size": 224, "downsample_channels": [16, SMALL_SIZES["hidden_size"]]}
# NeoMME's full-attention rotary covers a quarter of each head, split row / column / row / column: a multiple of 4;
# it derives its per-layer settings (per_layer_config, by layer index) from num_hidden_layers when it is built:
# built with the shrunk layers, not cut after
CONFIG_OVERRIDES["neomme"] = {"head_dim": 16, "num_hidden_layers": SMALL_SIZES["num_hidden_layers"]}
# SAM2's HieraDet backbone: a 1024 px image through four stages of 96..768 channels (12 blocks): 64 px (16 x 16
# patches, then 8, 4, 2 per side), its first stage at the shrunk width, one block a stage (two in the third: its
# second global; a stage's first block pools its queries, which a global block cannot), windows inside each grid
_HIERA = {"image_size": [64, 64], "hidden_size": 32, "embed_dim_per_stage": [32, 64, 128, 256],
          "num_attention_heads_per_stage": [1, 2, 4, 8], "blocks_per_stage": [1, 1, 2, 1], "global_attention_blocks": [3],
          "window_size_per_stage": [4, 4, 2, 2], "window_positional_embedding_background_size": [4, 4]}
CONFIG_OVERRIDES["sam2_hiera_det_model"] = _HIERA
# SAM2 itself: that backbone at the size its vision config's images get (it names none: 224 px, 56 x 56 patches), its
# feature pyramid read at the three finest stages' channels and grids, the prompt grid on the coarsest (224 / 16)
CONFIG_OVERRIDES["sam2"] = {"vision_config": {"backbone_config": {"model_type": "sam2_hiera_det_model", **_HIERA,
                                                                  "image_size": [224, 224]},
                                              "backbone_channel_list": [256, 128, 64, 32],
                                              "backbone_feature_sizes": [[56, 56], [28, 28], [14, 14]]},
                            "prompt_encoder_config": {"image_size": 224}}
# Step3p7's forward builds a sliding-window mask for every call (modeling_step3p7.py: create_sliding_window_causal_mask,
# unconditionally), which raises when the config sets no window, as its default does; checkpoints set one
CONFIG_OVERRIDES["step3p7"] = {"text_config": {"sliding_window": 8}}
# MuseGlimmer's vision adapter reads the pixel-shuffled vision states: 2 x 2 patches of the 32-wide tower = 128
CONFIG_OVERRIDES["muse_glimmer"] = {"out_hidden_size": 128}
# SAM's prompt encoder lays its dense embeddings on the vision tower's patch grid (image_size / patch_size, shrunk to
# 32 / 8); SAM-HQ's mask decoder also reads the tower's early states (vit_dim: its width, shrunk to 32)
_SAM_PROMPT_GRID = {"image_size": SMALL_SIZES["image_size"], "patch_size": SMALL_SIZES["patch_size"]}
CONFIG_OVERRIDES["sam"] = {"prompt_encoder_config": _SAM_PROMPT_GRID}
CONFIG_OVERRIDES["sam_hq"] = {"prompt_encoder_config": _SAM_PROMPT_GRID, "mask_decoder_config": {"vit_dim": 32}}
# The Swin backbones of the segmentation and grounding models (MaskFormer, Mask2Former, OneFormer, Grounding DINO):
# the shrink rules reach no backbone_config, and their defaults are Swin-B/T (28 to 87M parameters, 18 blocks in
# the third stage: seconds a forward in float64, and a missed-fold search that grows with each stage's depth); a
# stage keeps 2 blocks (the fourth's, which the fold reaches, as before) at width 32, one head per 32 channels,
# each type's own stages, image size and windows
def _small_swin_backbone(model_type: str) -> dict:
    default = transformers.CONFIG_MAPPING[model_type]().backbone_config.to_dict()
    derived = ("hidden_size", "num_layers", "stage_names", "out_indices", "transformers_version")
    return {**{k: v for k, v in default.items() if k not in derived},
            "embed_dim": 32, "depths": [2, 2, 2, 2], "num_heads": [1, 2, 4, 8]}


for _type in ("maskformer", "mask2former", "oneformer", "grounding-dino", "mm-grounding-dino"):
    CONFIG_OVERRIDES[_type] = {"backbone_config": _small_swin_backbone(_type)}
# Florence-2's DaViT vision tower is sized by lists the rules keep (widths 128..1024, 9 blocks in its third stage:
# 90M parameters): a quarter of each width (heads and channel groups of 8 features, as before at 32 each), 2 blocks
CONFIG_OVERRIDES["florence2"] = {"vision_config": {"embed_dim": [32, 64, 128, 256], "depths": [1, 1, 2, 1]}}
# a time-series transformer forecasts prediction_length steps, None by default (the model refuses to build)
CONFIG_OVERRIDES.update({name: {"prediction_length": 4}
                         for name in ("autoformer", "informer", "time_series_transformer")})
# RF-DETR's two-stage encoder picks num_queries proposals among the tiny image's tokens: 16, not 300
CONFIG_OVERRIDES["rf_detr"] = {"num_queries": 16}
# Nemotron diarization's head reads the audio encoder's states (audio_hidden_size: the shrunk encoder width)
# (the constructor checks the two agree, so the encoder's width is given to it too)
CONFIG_OVERRIDES["nemotron3_diarization"] = {"head_config": {"audio_hidden_size": SMALL_SIZES["hidden_size"]},
                                             "audio_config": {"hidden_size": SMALL_SIZES["hidden_size"]}}
# NeuCodec and X-codec2 quantize the acoustic and semantic features side by side: 32 + 32 shrunk widths
CONFIG_OVERRIDES.update(dict.fromkeys(("neucodec", "xcodec2"), {"quantization_dim": 2 * SMALL_SIZES["hidden_size"]}))
# Qwen3-ASR projects its audio states to output_dim (3584, a size rule cannot tell it is the text width): the shrunk 32
CONFIG_OVERRIDES["qwen3_asr"] = {"audio_config": {"output_dim": SMALL_SIZES["hidden_size"]}}
# CLAP's audio Swin reads a spec_size² image cut from the mel spectrogram in spec_size / num_mel_bins strips, regrouped
# after the last of its 4 stages (spec_size / 32 frequency rows, at least one per strip): the shrunk 8 mel bins leave
# none (256 / 8 = 32 strips of 8 rows: ZeroDivisionError). A 64² image of 32 bins: 2 strips over 2 rows, 16² patches
# that 2-wide windows tile down to the last stage's 2²; its projection reads the last stage's width (hidden_size:
# patch_embeds_hidden_size doubled at each of 4 stages, 32 x 8); kept on the tower too (its own type), or shrink
# sets 8 bins and a width of 32
_CLAP_SPECTROGRAM = {"spec_size": 64, "num_mel_bins": 32, "window_size": 2, "patch_embeds_hidden_size": 32,
                     "hidden_size": 32 * 2 ** 3}
CONFIG_OVERRIDES.update(clap={"audio_config": _CLAP_SPECTROGRAM}, clap_audio_model=_CLAP_SPECTROGRAM)
# CLVP's encoders rotate max(projection_dim / (2·heads), 32) features of each head (at least 32): one 32-wide head
# (4 heads of 8: "size of tensor a (8) must match b (32)"); kept on the encoders too (their own type)
_CLVP_ONE_HEAD = {"num_attention_heads": 1}
CONFIG_OVERRIDES.update(clvp={"text_config": _CLVP_ONE_HEAD, "speech_config": _CLVP_ONE_HEAD}, clvp_encoder=_CLVP_ONE_HEAD)
# CSM embeds each codec frame's codes in its codebook vocabulary (vocab_size, shrunk to 99) and reads its audio at
# audio_token_id, ended by audio_eos_token_id (both beyond the shrunk vocabulary: both 1, the audio overwritten by
# its end marker): codes below 64, the markers ids of their own
CONFIG_OVERRIDES["csm"] = {"codec_config": {"codebook_size": 64}, "audio_token_id": 98, "audio_eos_token_id": 97}
# SegGPT: a canvas of prompt above image, 64 x 32 px (8 x 4 patches; the default 896 x 448 is 6,272 tokens); the
# prompt and image rows merge after the first layer, and the decoder reads both layers' states
# Molmo2's adapter concatenates the vision states of the layers vision_feature_layer names (24 and 18 of 27 by default):
# the shrunk tower's last two; each crop's patches meet a position table of num_position_embeddings (derived from the
# default 378 px image and 14 px patches: 729) when the config is built: the 4 x 4 patches of a 32 px image
CONFIG_OVERRIDES["molmo2"] = {"adapter_config": {"vision_feature_layer": [-1, -2]},
                              "vision_config": {"image_size": [32, 32], "num_position_embeddings": 16}}
# GLM-Image quantizes its vision states (latent_channels: the shrunk vision width) into codebook ids that are the first
# ids of its text vocabulary, then its image start and end markers (16384, 16385), each its own id: a codebook of 64
# (its default 16,384 ids exceed the shrunk vocabulary), the markers after it, the image placeholder the last id
CONFIG_OVERRIDES["glm_image"] = {"vq_config": {"num_embeddings": 64, "latent_channels": SMALL_SIZES["hidden_size"],
                                               "embed_dim": SMALL_SIZES["hidden_size"]},
                                 "image_start_token_id": 64, "image_end_token_id": 65,
                                 "image_token_id": SMALL_SIZES["vocab_size"] - 1}
CONFIG_OVERRIDES["seggpt"] = {"image_size": [64, 32], "pretrain_image_size": 32, "merge_index": 0,
                              "intermediate_hidden_state_indices": [0, 1]}


def shrunk_config(model_type: str):
    """The default config of ``model_type`` shrunk, its CONFIG_OVERRIDES set last (a sub-config's, given as a
    dict, only to the constructor: the shrink rules fit a tower's)."""
    overrides = CONFIG_OVERRIDES.get(model_type, {})
    return _set_overrides(shrink(transformers.CONFIG_MAPPING[model_type](**copy.deepcopy(overrides))))


def _set_overrides(config):
    """``config`` with the plain values its type's CONFIG_OVERRIDES names set (returned for chaining): the
    top-level config's, or a tower's (keyed by the tower's own model type) after the rules shrank it."""
    for name, value in CONFIG_OVERRIDES.get(getattr(config, "model_type", None), {}).items():
        if name not in TOWERS and not isinstance(value, dict):
            setattr(config, name, value)
    return config


def _fit_mrope_sections(config) -> None:
    """Multimodal RoPE (Qwen2-VL, GLM-4V) splits each head's rotary half into temporal / height / width
    sections that the defaults size for 128-dim heads (in the config, or in the modeling code when a
    config that takes ``mrope_section`` names none): rescaled to the shrunk head's rotary half
    (head_dim x ``partial_rotary_factor`` / 2), each section floored, the rest given to the first."""
    rope = getattr(config, "rope_parameters", None)
    takes_sections = "mrope_section" in (getattr(type(config), "ignore_keys_at_rope_validation", None) or ())
    if not isinstance(rope, dict) or not (takes_sections or "mrope_section" in rope):
        return
    sections = rope.get("mrope_section") or [1, 1, 1]  # temporal, height, width
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or not isinstance(getattr(config, "hidden_size", None), int):
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    half = int(head_dim * factor) // 2
    if sum(sections) == half:
        return
    fitted = [section * half // sum(sections) for section in sections]
    fitted[0] += half - sum(fitted)
    rope["mrope_section"] = fitted


def _fit_per_layer_lists(config) -> None:
    """What a config lists per layer, cut to the shrunk ``num_hidden_layers``: ``*layer_types`` (Gemma 3's
    sliding or full attention, Step3p7's MLPs; each kind kept), Mistral Large 4's ``kv_source_layers``, and a backbone's ``stage_names`` ("stem", "stage1", ...) with its outputs
    (BEiT: ``out_indices`` [12]) kept among them, else the last. The model reads only its layers' entries, but
    a saved config is validated when it is loaded (a tiny folder that saves but does not load again)."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or isinstance(layers, bool):
        return
    for name, entries in list(vars(config).items()):  # layer_types, mlp_layer_types (Step3p7's dense or MoE MLPs),
        # kv_source_layers (Mistral Large 4: the earlier layer whose cache each layer reads, so a prefix stays valid)
        if (name.endswith("layer_types") or name == "kv_source_layers") and isinstance(entries, list) \
                and len(entries) > layers:
            setattr(config, name, _kept_kinds(entries, layers) if name.endswith("layer_types") else entries[:layers])
    names = getattr(config, "stage_names", None)
    if isinstance(names, list) and len(names) > layers + 1 and names[1:] == [f"stage{i}" for i in range(1, len(names))]:
        indices = [i for i in (getattr(config, "out_indices", None) or []) if 0 <= i <= layers] or [layers]
        config.stage_names = names[:layers + 1]
        config.out_indices = indices  # its setter names the out_features again


def _kept_kinds(kinds: list, layers: int) -> list:
    """The first ``layers`` of ``kinds``, its last ones replaced by the kinds the cut would lose (NeoMME reads
    its first and last full-attention layers, which 2 sliding-window layers do not have)."""
    kept = kinds[:layers]
    lost = [kind for kind in dict.fromkeys(kinds) if kind not in kept]
    for i, kind in enumerate(lost[:layers]):
        kept[layers - 1 - i] = kind
    return kept


def _keep_every_stage_a_pixel(config) -> None:
    """A staged conv backbone (ConvNeXt: a patch_size stem, then one 2x downsampling per further entry of
    hidden_sizes) gets an image_size its last stage still sees at least one pixel of: the shrunk
    patch_size x 32 px image leaves too few pixels for 4 stages (a kernel larger than its input)."""
    stages, patch, size = (getattr(config, name, None) for name in ("hidden_sizes", "patch_size", "image_size"))
    if isinstance(stages, (list, tuple)) and isinstance(patch, int) and isinstance(size, int) and stages:
        config.image_size = max(size, patch * 2 ** (len(stages) - 1))  # (H, W) at the last stage >= 1 x 1


def _fit_stage_heads(config) -> None:
    """A hierarchical transformer (Swin: ``embed_dim`` doubled at each of the ``depths`` stages, one head
    count a stage) whose default head counts do not divide the shrunk widths (3, 6, 12, 24 heads of
    32·2^i features) gets one head more at each stage than the stage before's double: 1, 2, 4, 8, a
    head of ``embed_dim`` features everywhere, as the defaults keep one head size across stages."""
    heads, depths, width = (getattr(config, name, None) for name in ("num_heads", "depths", "embed_dim"))
    if not (isinstance(heads, (list, tuple)) and isinstance(depths, (list, tuple)) and isinstance(width, int)):
        return
    if len(heads) == len(depths) and any((width * 2 ** i) % h for i, h in enumerate(heads)):
        config.num_heads = [2 ** i for i in range(len(heads))]


def _merges_patches(config) -> bool:
    """A Swin-style config: its width doubles at each of its ``depths`` stages (patch merging halves the
    token grid), so that ``hidden_size`` is ``embed_dim``·2^(stages - 1); Swin2SR keeps one width and grid."""
    depths, width, hidden = (getattr(config, name, None) for name in ("depths", "embed_dim", "hidden_size"))
    return (isinstance(depths, (list, tuple)) and isinstance(width, int) and isinstance(hidden, int)
            and hidden == width * 2 ** (len(depths) - 1))


def _fit_windows(config) -> None:
    """Attention windows of ``window_size``² tokens over a grid that patch merging halves at each stage:
    a stage whose grid is smaller than the window clamps its window but keeps a bias table sized for the
    configured one (Swin: "size of tensor a (16) must match b (49)"). A window of 2 and an image whose
    last stage still holds one window: (image / patch) / 2^(stages - 1) >= 2."""
    window, patch, side = (getattr(config, name, None) for name in ("window_size", "patch_size", "image_size"))
    if not all(isinstance(v, int) for v in (window, patch, side)):
        return
    config.window_size = min(window, 2)
    config.image_size = max(side, patch * config.window_size * 2 ** (len(config.depths) - 1))


def shrink_grid_pinpoints(config) -> None:
    """LLaVA-NeXT's any-resolution layouts (``image_grid_pinpoints``, in pixels, 336 apart) as the one
    layout of a single tile of the shrunk vision tower's ``image_size``: the defaults are no whole
    number of shrunk tiles."""
    vision = getattr(config, "vision_config", None)
    if getattr(config, "image_grid_pinpoints", None) and vision is not None:
        side = SMALL_SIZES["image_size"]
        config.image_grid_pinpoints = [[side, side]]


LAYER_INDEX_LISTS = ("global_attn_indexes", "intermediate_layers_indices", "cross_attention_layers",
                     "vision_feature_layers")


def shrink_layer_lists(config) -> None:
    """Lists of layer indices (SAM's ``global_attn_indexes``, Mllama's intermediate and cross-attention
    layers, VipLLaVA's ``vision_feature_layers`` of its vision tower, negative ones counted from the end)
    kept within the shrunk layers: the last layer where none is left."""
    tower = getattr(config, "vision_config", None)
    for name in LAYER_INDEX_LISTS:
        indices = getattr(config, name, None)
        layers = getattr(tower if name.startswith("vision_") and tower is not None else config, "num_hidden_layers", None)
        if isinstance(layers, int) and isinstance(indices, (list, tuple)) and indices:
            setattr(config, name, [i for i in indices if -layers <= i < layers] or [layers - 1])


def _bare_model_class(config) -> type:
    mapped = transformers.AutoModel._model_mapping[type(config)]
    return mapped[0] if isinstance(mapped, tuple) else mapped  # Funnel maps to (FunnelModel, FunnelBaseModel)


def _folder_model_class(config) -> type:
    """The class a folder of ``config`` holds: the bare model (AutoModel's), else the model its own package
    builds from exactly this config class (a tower's config: AlignTextModel; a type with heads only:
    ZoeDepthForDepthEstimation), a ``*Model`` first, then a ``*For*`` head, the shortest name of each."""
    try:
        return _bare_model_class(config)
    except KeyError:
        pass
    package = importlib.import_module(type(config).__module__.rsplit(".", 1)[0])
    built_from_it = [cls for cls in map(functools.partial(getattr, package), dir(package))  # a lazy module
                     if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
                     and getattr(cls, "config_class", None) is type(config)
                     and not cls.__name__.endswith("PreTrainedModel")]
    if not built_from_it:
        raise KeyError(f"no model class of transformers is built from {type(config).__name__}")
    return min(built_from_it, key=lambda cls: (not cls.__name__.endswith("Model"), "For" not in cls.__name__,
                                               len(cls.__name__), cls.__name__))


def _config(model_type: str):
    """The shrunk config naming the class its folder holds, as the saved tiny folders do."""
    config = shrunk_config(model_type)
    config.architectures = [_folder_model_class(config).__name__]
    return config


@dataclass(frozen=True)
class ZooFold:
    """`normfold fold` run once on the tiny folder of one model type: its exit code and what it printed."""
    folder: Path
    out: Path
    code: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def zoo_fold(tmp_path_factory):
    """``fold(model_type)`` -> its :class:`ZooFold`; each folder is built and folded once for the module's tests
    (skips a type whose shrunk default config builds no model)."""
    root = tmp_path_factory.mktemp("zoo")
    runs: dict[str, ZooFold | str] = {}

    def fold(model_type: str) -> ZooFold:
        if model_type not in runs:
            runs[model_type] = _build_and_fold(model_type, root)
        if isinstance(runs[model_type], str):
            pytest.skip(runs[model_type])
        return runs[model_type]

    return fold


def _build_and_fold(model_type: str, root: Path) -> ZooFold | str:
    """The tiny folder of ``model_type`` folded by the CLI, or why no tiny folder could be built."""
    folder, out = root / model_type, root / f"{model_type}-folded"
    try:
        config = _config(model_type)
        torch.manual_seed(0)
        _bare_model_class(config)(config).save_pretrained(folder)
    except Exception as err:  # noqa: BLE001  a config the size rules cannot shrink consistently
        return f"{model_type}: no tiny model from its shrunk default config ({type(err).__name__}: {err})"
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        patch.setenv("NORMFOLD_PROGRESS", "0")  # stderr holds only what the command says, whatever the environment
        code = main(["fold", str(folder), "-o", str(out)])
    return ZooFold(folder, out, code, stdout.getvalue(), stderr.getvalue())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fold_of_a_tiny_folder_folds_or_says_why_in_one_line(zoo_fold, model_type):
    run = zoo_fold(model_type)
    assert "Traceback" not in run.stderr
    if run.code == 0:
        assert (run.out / "normfold_report.json").is_file()
        return
    assert run.code in (1, 2), run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("normfold: ")]
    assert len(lines) == 1 and lines[0].startswith(("normfold: error: ", "normfold: verification failed")), run.stderr
    assert not run.out.exists()  # nothing published without its proof


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_analyze_says_what_fold_did_for_every_norm(zoo_fold, model_type, capsys):
    """One truth per model: the analysis and the folded folder's report agree on every column of every
    norm (RMSNorm or kept, where γ/β went, the reason), and so do the tables the two commands print; the
    markdown report's headline says whether any γ/β moved."""
    run = zoo_fold(model_type)
    if run.code != 0:
        pytest.skip(f"{model_type}: the fold was refused, so there is no folded report to agree with")
    written = report_rows(read_folder_report(run.out))
    capsys.readouterr()
    assert main(["analyze", str(run.folder), "--json"]) == 0
    analysis = json.loads(capsys.readouterr().out)
    assert written, "a folded report without norms compares nothing"
    analysed = norm_rows(FoldSection(tuple(ReportNorm.from_json(n, "the analysis", "") for n in analysis["norms"])))
    assert analysed == written
    markdown = (run.out / "normfold_report.md").read_text().splitlines()
    headline = next(line for line in markdown if line.startswith("**"))  # says where γ/β went, not what was asked
    assert ("folded into the next linear layers" in headline) == any(row["affine_folded"] for row in written)
    print_norm_table(analysed, analysis["model"]["architecture"])  # what `normfold analyze DIR` prints
    table = capsys.readouterr().out
    assert table.strip() and run.stdout.startswith(table)  # fold prints the same table, then its verification


# ------------------------------------------------------------------------------- example inputs by modality



@pytest.mark.parametrize("model_type", ["llava", "paligemma", "video_llava"])
def test_shrink_keeps_the_image_and_video_tokens_inside_the_vocabulary_each_its_own(model_type):
    config = _config(model_type)
    vocab = config.get_text_config().vocab_size
    tokens = [getattr(config, name) for name in ("image_token_id", "video_token_id") if hasattr(config, name)]
    assert tokens and all(0 <= t < vocab for t in tokens) and len(set(tokens)) == len(tokens)


@pytest.mark.parametrize("model_type", ["swin", "swinv2", "donut-swin", "maskformer-swin"])
def test_shrunk_swin_stages_have_heads_dividing_their_widths_and_grids_holding_a_window(model_type):
    """3, 6, 12, 24 heads do not divide 32·2^i features, and a 4 x 4 grid under a 7 x 7 window breaks
    Swin's bias table: the shrunk config runs on its example inputs (was "missing input" in the zoo table)."""
    config = _config(model_type)
    assert all((config.embed_dim * 2 ** i) % h == 0 for i, h in enumerate(config.num_heads))
    assert config.image_size // config.patch_size // 2 ** (len(config.depths) - 1) >= config.window_size
    model = _bare_model_class(config)(config).eval()
    with torch.no_grad():
        model(**example_inputs_for(model))


@pytest.mark.parametrize("model_type", ["seggpt", "step3p7", "radio", "muse_glimmer", "sam", "sam_hq", "rf_detr",
                                        "mimi_encoder", "pe_audio", "nemotron3_diarization", "neucodec", "xcodec2",
                                        "paddleocr_vl", "kimi_k25", "kimi_k25_vision", "inkling2_vision", "inkling2",
                                        "granite_docling", "instructblipvideo", "qwen3_omni_moe_thinker", "idefics2",
                                        "aria", "unlimited_ocr", "neomme", "sam2_hiera_det_model", "sam2",
                                        "qwen2_audio", "musicflamingo", "qwen3_asr", "speecht5", "granite_speech5_ctc",
                                        "granite_speech5_encoder", "clap", "clvp", "fastspeech2_conformer_with_hifigan",
                                        "csm", "molmo2", "glm_image", "pi0", "seamless_m4t_v2", "xcodec"])
def test_models_that_failed_on_our_example_inputs_run_on_them(model_type):
    """Were "missing input" rows of the zoo table: SegGPT's forward requires a prompt image and mask and
    stacks the prompt above the image (the pixels are half its canvas); Step3p7 builds a sliding-window
    mask on every call, which its default config (no window) cannot; RADIO's patch width is derived from
    the patch size its constructor was given; MuseGlimmer's adapter reads 2 x 2 shuffled vision states;
    SAM's prompt encoder lays its dense embeddings on the vision patch grid; RF-DETR picks fewer proposals
    than the tiny image has tokens; Mimi's encoder passes use_cache on itself (given twice when the call
    adds it through **kwargs); PE Audio reads its padding mask over frames (the call passes none); NeuCodec and
    X-codec2 read 160-wide semantic features (a sub-config's width), X-codec2 one per codec frame;
    PaddleOCR-VL and Kimi-K2.5 read grid patches unflattened (N, C, P, P), Inkling2 one merged token's pixels
    per row, channels last, its grid counted in merged tokens; GraniteDocling masks tiles, not pixels;
    InstructBLIP-Video reads clips (B, frames, C, H, W); the Qwen omni thinkers read an audio clip after every
    audio start marker in the text (random text held some); Idefics2's resampler reads the text width; Aria's
    projector knows query counts for the patch counts of its checkpoints' images only; Unlimited-OCR's SAM stage
    reads the image at the vision config's size and hands the CLIP encoder its width; NeoMME's rotary needs a
    multiple of 4 dims; SAM2's HieraDet pools its queries at each stage's first block, which a global block cannot;
    Qwen2-Audio requires its feature_attention_mask and, like MusicFlamingo (whose get_audio_features needs the
    ids), one audio token per audio tower state; Qwen3-ASR projects its audio to the text width (output_dim);
    SpeechT5Model reads hidden states (no prenet); Granite Speech 5 attends within blocks no longer than its
    relative positions; CLAP's spectrogram image keeps a frequency row per strip after its last stage; CLVP
    rotates 32 features of each head (its speech encoder is shrunk too); FastSpeech2 with HiFi-GAN reads ids of
    its model_config's vocabulary; Molmo2 reads crops of flattened patches with a table of the patches each image
    token pools, through an adapter (now shrunk) reading the shrunk tower's last layers, its image token under
    another name (image_patch_id) kept inside the vocabulary; PI0 requires action_embeds at its action expert's
    width and reads one image token per feature its PaliGemma (vlm, a sub-model shrunk like dit, its expert) makes
    of each camera's image; CSM reads its waveform (B, 1, samples) with the cutoffs of its audio segments and one
    audio token per frame of its codec (shrunk as a tower, codes inside its shrunk codebook vocabulary); GLM-Image
    reads each row's source grid and the grid of the image it generates (no pixels for it), one placeholder per
    codebook id its VQ model (its codebook and width now shrunk to the tiny vocabulary and vision width) gives the
    source; SeamlessM4T v2 reads the call's attention mask over its speech frames (B, frames, 160): one frame per
    text token; X-codec's codebook holds its acoustic and (shrunk) semantic features side by side."""
    config = _config(model_type)
    torch.manual_seed(0)  # CLVP's forward runs its speech decoder on its random weights: some draws of them make
    model = _bare_model_class(config)(config).eval()  # ids past its speech encoder's vocabulary (CI of 6613cc2)
    with torch.no_grad():
        model(**example_inputs_for(model))


def test_a_model_rejecting_every_media_layout_it_takes_as_optional_gets_its_text_alone():
    """Fails on main 5be980f (then CSM, whose segment cutoffs were not built yet): a model whose optional
    pixels fail in every layout built for them, raising in its own code, gets its text alone, a call it is
    made for. A model whose media run keeps them, and one whose media are required keeps its media call (the
    fold then says why)."""
    llava_class = _bare_model_class(_config("llava"))
    assert "pixel_values" in example_inputs_for(llava_class(_config("llava")).eval())

    class OptionalPixelsNoLayoutRuns(llava_class):  # every call with pixels raises; pixels default to None
        def forward(self, input_ids=None, pixel_values=None, attention_mask=None, **kwargs):
            if pixel_values is not None:
                raise ValueError("no layout runs")
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    inputs = example_inputs_for(OptionalPixelsNoLayoutRuns(_config("llava")).eval())
    assert "input_ids" in inputs and "pixel_values" not in inputs

    class RequiredPixels(llava_class):  # rejects every call, and its pixels are required: no text-only call
        def forward(self, pixel_values, input_ids=None, attention_mask=None, **kwargs):
            raise ValueError("no layout runs")

    assert "pixel_values" in example_inputs_for(RequiredPixels(_config("llava")).eval())


def test_a_float64_model_gets_the_example_layout_its_float32_copy_gets():
    """Candidate layouts are tried with their floats in the model's own dtype, as the fold runs them: a float64
    conformer that never casts its features rejected every float32 candidate and was given the first, Whisper's
    (B, mel, 3000), which it cannot read."""
    config = _config("nemotron_asr_streaming_encoder")
    model = _bare_model_class(config)(config).eval()
    in_float32 = {k: tuple(v.shape) for k, v in example_inputs_for(model).items() if torch.is_tensor(v)}
    in_float64 = {k: tuple(v.shape) for k, v in example_inputs_for(model.double()).items() if torch.is_tensor(v)}
    assert in_float64 == in_float32 and in_float32["input_features"][-1] == config.num_mel_bins


def test_untie_config_leaves_a_vision_model_without_input_embeddings_as_it_is():
    from normfold.hf.saving import untie_config

    model = transformers.MobileViTModel(_config("mobilevit"))  # get_input_embeddings raises NotImplementedError
    before = model.config.to_dict()
    untie_config(model)
    assert model.config.to_dict() == before
    assert set(example_inputs_for(model)) == {"pixel_values"}


def test_a_two_tower_model_gets_token_ids_and_pixels_from_each_tower_config():
    config = _config("siglip")
    inputs = example_inputs_for(config)
    assert inputs["pixel_values"].shape[-1] == config.vision_config.image_size
    assert int(inputs["input_ids"].max()) < config.text_config.vocab_size


def test_a_waveform_model_gets_enough_samples_for_its_feature_encoder():
    config = _config("wav2vec2")
    model = transformers.AutoModel.from_config(config).eval()
    inputs = example_inputs_for(model, seq=4)
    with torch.no_grad():
        assert model(**inputs).last_hidden_state.shape[1] == 4  # the conv stack's inverse, exactly


def test_a_log_mel_model_gets_features_of_twice_its_source_positions_and_decoder_ids():
    inputs = example_inputs_for(_config("whisper"))
    assert inputs["input_features"].shape[1:] == (8, 32) and "decoder_input_ids" in inputs


def test_token_ids_of_a_model_without_vocab_size_or_with_unbounded_positions_are_valid():
    assert example_inputs_for(_config("canine"), seq=16)["input_ids"].shape == (2, 16)  # no vocab_size: characters
    assert example_inputs_for(_config("xlnet"), seq=16)["input_ids"].shape == (2, 16)  # max_position_embeddings = -1


def test_a_config_with_several_heads_per_type_resolves_to_a_class():
    config = _config("deit")
    config.architectures = ["DeiTForImageClassificationWithTeacher"]
    assert "pixel_values" in example_inputs_for(config)


@pytest.mark.parametrize("config_class, model_class", [
    ("AlignTextConfig", "AlignTextModel"),  # a tower's config: no AutoModel entry (cli_zoo: 134 such types skipped)
    ("ZoeDepthConfig", "ZoeDepthForDepthEstimation"),  # a type with task heads only
    ("BertConfig", "BertModel"),  # AutoModel's bare model first
])
def test_a_tiny_folder_holds_the_model_transformers_builds_from_its_config(config_class, model_class):
    assert _folder_model_class(getattr(transformers, config_class)()) is getattr(transformers, model_class)


def test_a_config_no_model_of_transformers_is_built_from_gets_no_folder():
    with pytest.raises(KeyError, match="SamMaskDecoderConfig"):  # a part of SAM, built inside SamModel
        _folder_model_class(transformers.SamMaskDecoderConfig())


def test_a_forward_without_any_known_input_is_refused_naming_the_inputs():
    from normfold.hf.load import CheckpointError

    class NoKnownInputs(torch.nn.Module):
        config = transformers.BertConfig()

        def forward(self, mystery):
            return mystery

    with pytest.raises(CheckpointError, match="input_ids, pixel_values, input_values, input_features"):
        example_inputs_for(NoKnownInputs())


# ------------------------------------------------------------------------- the command's last boundary

def _fail_unexpectedly(*_args):
    raise RuntimeError("value cannot be converted to type float without overflow\n  second line")


@pytest.mark.parametrize("command", ["analyze", "fold"])
def test_an_unexpected_engine_error_is_one_line_with_exit_2_naming_the_command(tiny_dirs, tmp_path, monkeypatch,
                                                                                capsys, command):
    monkeypatch.setattr("normfold.hf.folder.example_calls_for", _fail_unexpectedly)
    argv = [command, str(tiny_dirs["gpt2"])] + (["-o", str(tmp_path / "out")] if command == "fold" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [
        f"normfold: error: {command} cannot handle this model: RuntimeError: value cannot be converted to type float "
        f"without overflow (not a known refusal; NORMFOLD_TRACEBACK=1 shows the traceback)"]
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv("NORMFOLD_TRACEBACK", "1")  # for a bug report: the error with its traceback
    with pytest.raises(RuntimeError, match="without overflow"):
        main(argv)


# shrunk configs whose sizes must agree with each other: rotary slices (GPT-J/CodeGen's rotary_dim, MLA's rope
# head dim, GLM-OCR's mrope sections), multi-head attention kept multi-head (ESMC), LiLT's sixths, BROS's box
# projection, Marian's decoder vocabulary, Gemma 3's image pooling, MiniMax-M3-VL's merged patches, T5Gemma 2's
# encoder towers (its images sized by the encoder's vision config, its image tokens counted by the encoder);
# and those whose shrunk default config built a model that failed on any input of the size it asks for
# (staged conv backbones, projections that must equal a tower's width, keypoint matchers, LW-DETR, DepthPro)
@pytest.mark.parametrize("model_type", ["beit", "aya_vision", "audioflamingo3", "cohere2_vision", "step3p7",
                                        "unlimited_ocr", "glm5_next", "mistral_large4", "neomme"])
def test_a_shrunk_config_saved_in_a_tiny_folder_loads_again(model_type, tmp_path):
    """Per-layer lists cut to the shrunk layers: layer_types (Aya Vision's and AudioFlamingo3's text towers) and a
    backbone's stage names and outputs (BEiT's out_features ['stage12'] of 2 layers). Their folders saved but did
    not load ("`num_hidden_layers` (2) must be equal to the number of `layer_types` (40)"), so benchmarks/cli_zoo.py
    measured their config, not the fold; fails on main b48d988."""
    _config(model_type).save_pretrained(tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is type(_config(model_type))


@pytest.mark.parametrize("model_type", ["hunyuan_v1_dense", "ministral", "autoformer", "informer"])
def test_a_default_config_that_builds_no_model_gets_the_size_it_leaves_unset(model_type):
    """HunYuan's and Ministral's default head_dim is None, which their attention reads as given; a time-series
    transformer's prediction_length is None, which it refuses: cli_zoo had no tiny folder of them."""
    config = shrunk_config(model_type)
    _folder_model_class(config)(config)


AGREEING_SIZES = ["codegen", "gptj", "deepseek_v32", "hy_v4", "esmc", "lilt", "bros", "marian", "gemma3", "glm_ocr",
                  "minimax_m3_vl", "t5gemma2", "convnext", "convnextv2", "align", "vision-text-dual-encoder", "xclip",
                  "efficientloftr", "lightglue", "lw_detr", "depth_pro",
                  # images sized by its encoder's config (were 224 px: cli_zoo, 'not valid')
                  "vision-encoder-decoder"]


@pytest.mark.parametrize("model_type", AGREEING_SIZES)
def test_a_shrunk_default_config_builds_a_model_that_runs_on_its_example_inputs(model_type):
    config = shrunk_config(model_type)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = _folder_model_class(config)(config).eval()
    for inputs in (example_inputs_for(model), example_inputs_for(model, batch=3, seq=7, seed=1)):
        with torch.no_grad():
            model(**inputs)


def test_a_vision_model_output_without_pooled_features_counts_its_patches_as_image_tokens():
    """Llama 4's ``get_image_features`` returns its vision model's output (``last_hidden_state``, no
    ``pooler_output``): 4 x 4 patches pixel-shuffled by 0.5 are 4 image tokens per image. (Its forward
    itself then fails in transformers 5.24's own code: ``outputs.image_outputs`` of a text output.)"""
    config = shrunk_config("llama4")
    torch.manual_seed(0)
    inputs = example_inputs_for(_bare_model_class(config)(config).eval())
    assert (inputs["input_ids"] == config.image_token_id).sum(dim=1).tolist() == [4, 4]


def test_use_cache_goes_through_kwargs_only_to_a_text_model_of_another_config():
    """LLaVA passes **kwargs on to its text model: the call turns its cache off there; Mimi's encoder is its own
    text config and passes use_cache on itself, so the call must not add it (it was given twice)."""
    assert example_inputs_for(_config("llava"))["use_cache"] is False
    assert "use_cache" not in example_inputs_for(_config("mimi_encoder"))


@pytest.mark.parametrize("model_type", ["maskformer", "mask2former", "oneformer", "grounding-dino", "florence2"])
def test_vision_towers_sized_by_lists_are_shrunk_and_run(model_type):
    """Swin backbones (backbone_config, which no shrink rule reaches) and Florence-2's DaViT (widths given as
    lists, which the rules keep) were built at their default sizes: 28 to 90M parameters, seconds a float64
    forward, and a missed-fold search the zoo table's time box cut short (55 of MaskFormer's 56 unfolded norms
    not judged). Shrunk, each stays under 6M parameters and runs on its example inputs."""
    config = _config(model_type)
    torch.manual_seed(0)
    model = _bare_model_class(config)(config).eval()
    assert sum(p.numel() for p in model.parameters()) < 6_000_000
    with torch.no_grad():
        model(**example_inputs_for(model))
