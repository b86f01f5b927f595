"""Inputs for a model: seeded example inputs for one forward pass (text, vision, audio, two-tower),
and calibration batches from a text file tokenized by the folder's own tokenizer."""
from __future__ import annotations

import inspect
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .._deps import require
from .._progress import progress
from .._text import first_line
from .audio_inputs import audio_inputs_for, runs_eagerly
from .load import CheckpointError, check_model_dir, model_class_for


# ---------------------------------------------------------------------------------- example inputs

# The fold is exact token by token, so a short example proves as much as a long one: 4 positions so
# that attention mixes tokens, 2 rows so that rows are kept apart. Each token costs time: the proof
# runs the original and the fold three times each in float64 (and in the model's dtype).
EXAMPLE_BATCH = 2
EXAMPLE_LENGTH = 4
_BOX_SCALE = 1000  # document models' box coordinates run 0..1000 (LayoutLM) unless their config says otherwise


def example_inputs_for(model_or_config, batch: int = EXAMPLE_BATCH, seq: int = EXAMPLE_LENGTH, *,
                       seed: int = 0) -> dict[str, Any]:
    """Keyword inputs for one forward pass, built from the model's modality and config: token ids
    (+ attention mask) for text, pixel values for vision, waveforms (``input_values``) or log-mel
    features (``input_features``) for audio, ids and pixels together wherever the forward takes both
    (CLIP, SigLIP, GIT, UDOP), led by one image token per image feature for a model that merges them
    into its text (LLaVA, PaliGemma: counted by its own ``get_image_features``, given a model); images
    as grids of flattened patches with their ``image_grid_thw`` (Qwen2-VL) or one image per row with
    its ``pixel_attention_mask`` (Idefics3), wherever the forward takes those (:func:`_image_inputs`); ordered
    boxes per token for document models (``bbox``), region features and positions for LXMERT;
    decoder ids for encoder-decoders and ``use_cache=False``.

    Task heads get the call they are made for (:func:`_fitted_to_head`): choices for a multiple-choice head,
    one row for a sequence classifier with no pad token, an end-of-sequence token per row where the classifier
    pools there.

    Deterministic (seeded); the values are random: folding is exact for any input.
    """
    if isinstance(model_or_config, nn.Module):
        config, model_class = model_or_config.config, type(model_or_config)
    else:
        config = model_or_config
        model_class = model_class_for(config)
    head = _task_of(model_class)
    if head == "SEQUENCE_CLASSIFICATION" and getattr(config, "pad_token_id", None) is None:
        batch = 1  # a decoder's classifier reads each row at its last non-pad token: without a pad token, one row
    return _fitted_to_head(head, config, _example_call(model_or_config, config, model_class, batch, seq, seed))


def _task_of(model_class: type) -> str | None:
    """The task mapping of transformers that names ``model_class`` ("MULTIPLE_CHOICE", "SEQUENCE_CLASSIFICATION"),
    among the heads whose calls differ from their backbone's; None for any other class."""
    modeling_auto = require("transformers").models.auto.modeling_auto
    for task in ("MULTIPLE_CHOICE", "SEQUENCE_CLASSIFICATION"):
        names = getattr(modeling_auto, f"MODEL_FOR_{task}_MAPPING_NAMES", {}).values()
        if any(model_class.__name__ in (name if isinstance(name, (list, tuple)) else (name,)) for name in names):
            return task
    return None


def _fitted_to_head(head: str | None, config, call: dict[str, Any]) -> dict[str, Any]:
    """``call`` as the ``head`` reads it: a multiple-choice head scores CHOICES candidates per row, each (B, T)
    token input laid out (B, CHOICES, T) (the second choice the first rolled by one position); an
    encoder-decoder's sequence classifier (BART, T5) pools at each row's end-of-sequence token, so each row ends
    in one."""
    ids = call.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return call
    if head == "MULTIPLE_CHOICE":
        return {name: (torch.stack([value, value.roll(1, dims=1)], dim=1)
                       if isinstance(value, torch.Tensor) and value.shape == ids.shape else value)
                for name, value in call.items()}  # (B, CHOICES, T)
    eos = getattr(config, "eos_token_id", None)
    if head == "SEQUENCE_CLASSIFICATION" and getattr(config, "is_encoder_decoder", False) and isinstance(eos, int):
        ids = ids.masked_fill(ids == eos, eos - 1 if eos > 0 else eos + 1)  # every row as many eos: one, the last
        ids[:, -1] = eos
        call = {**call, "input_ids": ids}
    return call


def _example_call(model_or_config, config, model_class: type, batch: int, seq: int, seed: int) -> dict[str, Any]:
    """:func:`example_inputs_for` before the task head's fitting."""
    params = inspect.signature(model_class.forward).parameters
    gen = torch.Generator().manual_seed(seed)
    seq = max(seq, least_sequence_length(config)[0])
    model = model_or_config if isinstance(model_or_config, nn.Module) else None
    vision_config = _vision_config(config)
    if "pixel_values" in params or "pixel_values_videos" in params:
        media = (_clip_or_pair_inputs(config, vision_config, params, batch, gen)
                 or _image_inputs(vision_config, params, batch, gen, model_config=config))
        media.update(_companion_inputs(config, params, media, seq, gen))
        layouts = _other_image_layouts(media, vision_config, config) if model is not None else []
        if layouts:
            call = _first_call_that_runs(model, config, params, [media, *layouts], batch, seq, gen)
            return _text_only_where_media_fails(model, config, params, call, batch, seq, seed)
    elif "input_values" in params or "input_features" in params:
        def whole_call(audio: dict[str, Any]) -> dict[str, Any]:  # what a candidate layout is tried in
            return _completed_call(model, config, params, dict(audio), batch, seq, torch.Generator().manual_seed(seed))

        media = audio_inputs_for(_audio_config(config), params, _audio_mask_params(model_class, params), batch, seq,
                                 gen, model, finish=whole_call)
    else:
        media = {}
    call = _completed_call(model, config, params, media, batch, seq, gen)
    return _text_only_where_media_fails(model, config, params, call, batch, seq, seed) if media else call


def _text_only_where_media_fails(model: nn.Module | None, config, params, call: dict[str, Any], batch: int, seq: int,
                                 seed: int) -> dict[str, Any]:
    """``call``, or the text of a model whose forward takes its media as optional (default None) when the
    original ``model`` rejects every media layout built for it but runs on the text alone (media in a layout
    we do not build yet; CSM, Molmo2 and GLM-Image took this path before theirs were): a text-only call is one
    the model is made for, and the fold is exact for calls like it (``report.exactness_scope``). ``call``
    as it is for a model without token ids, with required media, or that runs on it."""
    if model is None or "input_ids" not in params:
        return call
    text_only = _completed_call(model, config, params, {}, batch, seq, torch.Generator().manual_seed(seed))
    media_names = [name for name in call if name not in text_only]
    if (not media_names or any(name in params and params[name].default is not None for name in media_names)
            or runs_eagerly(model, call)):
        return call
    return text_only if runs_eagerly(model, text_only) else call


def _completed_call(model: nn.Module | None, config, params, inputs: dict[str, Any], batch: int, seq: int,
                    gen: torch.Generator) -> dict[str, Any]:
    """``inputs`` (the call's media: pixels, audio) with the rest of the call the forward's ``params`` take:
    token ids led by the media's placeholder tokens (given the ``model``, :func:`_with_media_tokens`), their
    masks, boxes and language ids, LXMERT's regions, masking noise, and the call options."""
    if "input_ids" in params:
        ids = _token_ids(_vocabulary_config(config), batch, seq, gen)  # with pixels or audio: text and media (CLIP, Voxtral)
        ids = _without_media_control_tokens(ids, config, config.get_text_config())
        question = getattr(config, "question_token_id", None)
        if isinstance(question, int) and ids.shape[1] > 1:  # Splinter reads each row's spans at its question tokens
            ids[:, 1] = question
        if model is not None:
            ids = _with_media_tokens(model, ids, inputs)
        if "pixel_values" in inputs:  # slots for the image given (Kosmos-2.5 reads flattened patches instead)
            ids, positions = _with_latent_query_slots(config, params, ids)
            inputs.update(positions)
        inputs["input_ids"] = ids
        if "mm_token_type_ids" in params and isinstance(getattr(config, "image_token_id", None), int):
            inputs["mm_token_type_ids"] = (ids == config.image_token_id).int()  # 1 where an image feature goes
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones_like(ids)
        if "bbox" in params:  # document models: one box per token
            inputs["bbox"] = _boxes(*ids.shape, getattr(config, "max_2d_position_embeddings", _BOX_SCALE + 1) - 1, gen)
        if "lang_ids" in params and getattr(config, "languages", None):  # X-MOD: one language adapter per row
            inputs["lang_ids"] = torch.arange(ids.shape[0]) % len(config.languages)  # (B,)
    inputs.update(_cross_attended_images(params, inputs))
    if "visual_feats" in params and "visual_pos" in params and hasattr(config, "visual_feat_dim"):
        inputs["visual_feats"] = torch.randn(batch, seq, config.visual_feat_dim, generator=gen)  # LXMERT's regions
        inputs["visual_pos"] = _boxes(batch, seq, _BOX_SCALE, gen) / _BOX_SCALE  # normalized to [0, 1]
    if "noise" in params and "pixel_values" in inputs:
        inputs["noise"] = _patch_masking_noise(_vision_config(config), inputs["pixel_values"], gen)
    inputs.update(_robot_inputs(config, params, batch, gen))
    inputs = _with_required_embeddings(model, config, params, inputs, batch, seq, gen)
    inputs = _with_cross_attended_states(model, config, params, inputs, batch, seq, gen)
    if not inputs:
        raise CheckpointError(f"cannot build example inputs for {type(config).__name__}: its forward takes none of "
                              f"input_ids, pixel_values, input_values, input_features")
    return with_call_options(inputs, config, params, seq=seq, gen=gen)


def _robot_inputs(config, params, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A vision-language-action policy's robot inputs (PI0ForConditionalGeneration requires ``state``): the
    robot's state (B, ``max_state_dim``), and the denoising step's noise (B, ``chunk_size``, ``max_action_dim``)
    and timestep (B,) in (0, 1), given so that the forward draws no random numbers of its own."""
    state, chunk, action = (getattr(config, name, None) for name in ("max_state_dim", "chunk_size", "max_action_dim"))
    if "state" not in params or not isinstance(state, int):
        return {}
    found = {"state": torch.randn(batch, state, generator=gen)}  # (B, S)
    if "noise" in params and isinstance(chunk, int) and isinstance(action, int):
        found["noise"] = torch.randn(batch, chunk, action, generator=gen)  # (B, chunk, A)
    if "timestep" in params:
        found["timestep"] = torch.rand(batch, generator=gen) * 0.8 + 0.1  # (B,)
    return found


def _with_required_embeddings(model: nn.Module | None, config, params, inputs: dict[str, Any], batch: int, seq: int,
                              gen: torch.Generator) -> dict[str, Any]:
    """``inputs`` with random (B, T, width) embeddings for each ``*_embeds`` parameter the forward requires (no
    default; PI0's ``action_embeds``: its action expert reads them as they are, there is no id for them): the
    width is one of the config's hidden sizes (its own and its sub-configs', :func:`_hidden_widths`) and T the
    call's length or, where the config names a ``chunk_size`` (PI0's action chunk; transformers 5.25 reads exactly
    that many after a state token), chunk + 1 or chunk: the first pair with which the original ``model`` runs on
    the whole call (the first, without a model)."""
    required = [name for name, param in params.items() if name.endswith("_embeds") and name not in inputs
                and param.default is inspect.Parameter.empty
                and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    widths = _hidden_widths(config)
    if not required or not widths:
        return inputs
    chunk = getattr(config, "chunk_size", None)
    lengths = [seq] + ([chunk + 1, chunk] if isinstance(chunk, int) and chunk > 0 else [])
    start = gen.get_state()
    for length in lengths:
        for width in widths:
            gen.set_state(start)
            call = {**inputs, **{name: torch.randn(batch, length, width, generator=gen) for name in required}}
            if model is None or runs_eagerly(model, with_call_options(dict(call), config, params, seq=seq)):
                return call
    gen.set_state(start)
    return {**inputs, **{name: torch.randn(batch, seq, widths[0], generator=gen) for name in required}}


# a Q-Former cross-attends to an image encoder's states, of its config's encoder_hidden_size: a standalone one
# (Blip2QFormerModel) cannot run without them, though its forward gives them a default
CROSS_ATTENDED_STATES, CROSS_ATTENDED_WIDTH = "encoder_hidden_states", "encoder_hidden_size"


def _with_cross_attended_states(model: nn.Module | None, config, params, inputs: dict[str, Any], batch: int,
                                seq: int, gen: torch.Generator) -> dict[str, Any]:
    """``inputs`` with random encoder states (B, T, encoder_hidden_size) for a forward that takes
    ``encoder_hidden_states`` and whose config names their width, where the original ``model`` does not run
    without them (every such forward, without a model); ``inputs`` as they are otherwise."""
    width = getattr(config, CROSS_ATTENDED_WIDTH, None)
    if CROSS_ATTENDED_STATES not in params or CROSS_ATTENDED_STATES in inputs or not isinstance(width, int) \
            or isinstance(width, bool) or width <= 0:
        return inputs
    if model is not None and runs_eagerly(model, with_call_options(dict(inputs), config, params, seq=seq)):
        return inputs
    return {**inputs, CROSS_ATTENDED_STATES: torch.randn(batch, seq, width, generator=gen)}  # (B, T, width)


def _hidden_widths(config) -> list[int]:
    """The distinct ``hidden_size`` values of ``config`` and of the configs it holds, at any depth, in field order
    (PI0: its PaliGemma's text and vision widths and its action expert's)."""
    widths: list[int] = []
    pending = [config]
    while pending:
        current = pending.pop(0)
        width = getattr(current, "hidden_size", None)
        if isinstance(width, int) and not isinstance(width, bool) and width not in widths:
            widths.append(width)
        pending.extend(_sub_configs(current))
    return widths


def _first_call_that_runs(model: nn.Module, config, params, layouts: list[dict[str, Any]], batch: int, seq: int,
                          gen: torch.Generator) -> dict[str, Any]:
    """The whole call (:func:`_completed_call`) for the first of ``layouts`` (the same media laid out in
    different ways, the usual one first) that the original ``model`` runs on eagerly, each completed from
    the same generator state (the text is the same for every layout); the first layout's call when none runs
    (the fold then says how the original fails on it)."""
    start = gen.get_state()
    for layout in layouts:
        gen.set_state(start)
        call = _completed_call(model, config, params, dict(layout), batch, seq, gen)
        if runs_eagerly(model, call):
            return call
    gen.set_state(start)
    return _completed_call(model, config, params, dict(layouts[0]), batch, seq, gen)


def with_call_options(inputs: dict[str, Any], config, params, *, seq: int = EXAMPLE_LENGTH,
                      gen: torch.Generator | None = None) -> dict[str, Any]:
    """``inputs`` (the model's own: ids, pixels, audio) with what every example call of it adds, whoever
    made them: random decoder ids for an encoder-decoder (``seq`` of them, one row per input row) and
    ``use_cache=False`` (no KV cache objects in the captured graph). ``params``: the forward's parameters."""
    gen = torch.Generator().manual_seed(0) if gen is None else gen
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        rows = next(v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor))
        inputs["decoder_input_ids"] = _token_ids(config.get_text_config(decoder=True), rows, seq, gen)
    # a multimodal model (LLaVA) passes **kwargs on to its text model, which takes use_cache; a model that is its
    # own text model and takes no use_cache passes it on itself where it has one (Mimi's encoder: given twice)
    text = config.get_text_config()
    passes_on = text is not config and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "use_cache" in params or (passes_on and hasattr(text, "use_cache")):
        inputs["use_cache"] = False
    return inputs


# the kinds of example call a command line can ask for: the main input the call passes (the default
# call's own, or ``inputs_embeds``: the embeddings of its token ids, passed instead of the ids)
MAIN_INPUTS = ("input_ids", "pixel_values", "input_values", "input_features")
EMBEDS = "inputs_embeds"


def example_calls_for(model: nn.Module, kinds=(), base: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One example call per kind (``normfold fold --call KIND``), each built from ``base`` (default
    :func:`example_inputs_for`; a folder's: :func:`normfold.hf.folder_inputs.folder_example_inputs`):
    ``input_ids`` (or the model's other main input: ``pixel_values``, ...) is that call itself;
    ``inputs_embeds`` passes the embeddings of its token ids instead of the ids (the model's own input
    embedding layer on them, so they have the width the model reads). No kinds: the default call alone.
    A fold planned on several calls keeps what is exact for all of them. CheckpointError for a kind
    the model does not take, naming the ones it does."""
    base = example_inputs_for(model) if base is None else base
    if not kinds:  # the default call, whatever its main input (Q-Former: query_embeds)
        return [base]
    available = [name for name in MAIN_INPUTS if name in base]
    if "input_ids" in base and EMBEDS in inspect.signature(type(model).forward).parameters:
        available.append(EMBEDS)
    calls = []
    for kind in kinds:
        if kind not in available:
            raise CheckpointError(f"example call {kind!r}: {type(model).__name__} takes {', '.join(available)}")
        if kind != EMBEDS:
            calls.append(base)
            continue
        with torch.no_grad():
            embeds = model.get_input_embeddings()(base["input_ids"])  # (B, T, width)
        calls.append({EMBEDS: embeds, **{k: v for k, v in base.items() if k != "input_ids"}})
    return calls


CHARACTER_VOCAB = 128  # models that read characters (Canine: Unicode code points) have no vocab_size: ASCII ids


def max_positions(text_config) -> int | None:
    """The most tokens the model takes (``max_position_embeddings`` / ``n_positions`` of its text
    config), or None when the config sets no bound (a value <= 0, XLNet's -1, means unbounded)."""
    limits = (getattr(text_config, name, None) for name in ("max_position_embeddings", "n_positions"))
    return min([v for v in limits if isinstance(v, int) and v > 0], default=None)


def _vision_config(config):
    """The config that sizes the model's images: its ``vision_config``, its encoder's (T5Gemma 2: the images
    go through the encoder), a sub-model's (PI0: its PaliGemma, ``vlm_config``); else the config itself where it
    sets an ``image_size`` (a vision model) or its encoder's (VisionEncoderDecoder: TrOCR's and Donut's vision
    encoder), else the config itself. (A backbone's ``image_size`` is not the model's: RF-DETR windows any size.)"""
    for holder in (config, getattr(config, "encoder", None), *_sub_configs(config)):
        vision = getattr(holder, "vision_config", None)
        if vision is not None:
            return vision
    sizers = (config, getattr(config, "encoder", None))
    return next((holder for holder in sizers if getattr(holder, "image_size", None) is not None), config)


def _sub_configs(config) -> list:
    """The configs ``config`` holds as fields (its towers and sub-models), in field order."""
    return [value for value in vars(config).values() if hasattr(value, "to_dict") and not isinstance(value, dict)]


def _vocabulary_config(config):
    """The config that sizes the token ids: the text config, or where that names no ``vocab_size`` the first
    sub-config that does (FastSpeech2 with HiFi-GAN: its text-to-spectrogram model's ``model_config``)."""
    text = config.get_text_config()
    if isinstance(getattr(text, "vocab_size", None), int):
        return text
    return next((sub for sub in _sub_configs(config) if isinstance(getattr(sub, "vocab_size", None), int)), text)


def least_sequence_length(config) -> tuple[int, str]:
    """The fewest tokens an example call needs to take the path the config asks for, and why (0, "" when
    any length does):

    - a model that pools its sequence between blocks (Funnel: ``block_sizes``, each block after the first
      halving it): 2 ** blocks tokens, so that every block still has 2 tokens beside the CLS token it keeps;
    - BigBird's block-sparse attention (BigBird, BigBird-Pegasus): on a sequence of at most (5 + 2 r) · b
      tokens (b = ``block_size``, r = ``num_random_blocks``) the model swaps its attention modules for full
      attention, for good, so the folded model would not be the one its config rebuilds: one block more.
    """
    blocks = getattr(config, "block_sizes", None)
    if isinstance(blocks, (list, tuple)):
        return 2 ** len(blocks), f"{type(config).__name__} pools its sequence in {len(blocks)} blocks"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "attention_type", None) == "block_sparse":
        block, random_blocks = text.block_size, text.num_random_blocks
        needed = (6 + 2 * random_blocks) * block
        limit = max_positions(text)
        return (min(needed, limit) if limit else needed), (
            f"{type(config).__name__}'s block-sparse attention runs on more than (5 + 2 * num_random_blocks) * "
            f"block_size = {needed - block} tokens only (shorter, the model switches itself to full attention)")
    return 0, ""


def _token_ids(text_config, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """(B, T) random ids below the vocabulary size, T at most the model's positions."""
    vocab = getattr(text_config, "vocab_size", None) or CHARACTER_VOCAB
    limit = max_positions(text_config)
    return torch.randint(0, vocab, (batch, seq if limit is None else min(seq, limit)), generator=gen)


# the special tokens a sentence may hold; a config's other *_token_id / *_token_index fields mark media (image, audio
# and video placeholders, their start and end markers) that the model parses out of the ids
_TEXT_TOKENS = ("pad", "bos", "eos", "sep", "cls", "mask", "unk", "decoder_start")


def _without_media_control_tokens(ids: torch.Tensor, *configs) -> torch.Tensor:
    """``ids`` with every media control token of ``configs`` (a vision start marker, an audio placeholder, ...)
    replaced by the smallest id that is none: random text holding one makes the model parse media that is
    not there (the Qwen omni models' rope index reads an audio clip after each audio start marker)."""
    control = {value for config in configs for name, value in vars(config).items()
               if name.endswith(("_token_id", "_token_index")) and isinstance(value, int) and not isinstance(value, bool)
               and not name.rsplit("_token", 1)[0].endswith(_TEXT_TOKENS)}  # forced_bos, decoder_start: text
    if not control:
        return ids
    plain = next(i for i in range(len(control) + 1) if i not in control)
    return ids.masked_fill(torch.isin(ids, torch.tensor(sorted(control))), plain)


GRID_INPUTS = ("image_grid_thw", "grid_thw")  # the grid of each image: its name in a VLM's forward, in its vision tower's
MERGE_SIZES = ("image_merge_sizes", "merge_sizes")  # VideoLLaMA3 (model, vision tower): each image's merge size
TARGET_SIZES = "target_sizes"  # NaViT-style packers (MiniCPM-V): each image's (h, w) in patches
SPATIAL_SHAPES = "spatial_shapes"  # SigLIP2 NaFlex (LFM2-VL): each image's (h, w) in patches
TOKEN_POOLING = ("image_token_pooling", "image_grids", "image_num_crops")  # Molmo2: the patches each image token pools
IMAGES_PER_SAMPLE = "images_per_sample"  # GLM-Image: each row's source grids and the grid it generates
_IMAGE_INPUTS = ("pixel_values", *GRID_INPUTS, *MERGE_SIZES, TARGET_SIZES, SPATIAL_SHAPES, *TOKEN_POOLING,
                 IMAGES_PER_SAMPLE,
                 "pixel_attention_mask",
                 "image_sizes", "high_res_pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")  # what describes a call's images
GRID_SIDE = 2  # merged patches along each side of a grid image (Qwen2-VL): 4 image tokens per image
_MERGE_FIELDS = ("spatial_merge_size", "merge_size", "merge_kernel_size")  # patches merged per side, by family
_TEMPORAL_FIELDS = ("temporal_patch_size", "patch_temporal")  # frames per patch, by family (none: 1)


def _config_int(config, names, default: int) -> int:
    """The first of the config fields ``names`` that is set: an int, or the first of a list ((2, 2)
    merge kernels), or ``default`` when none is."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def _reads_bare_patches(config) -> bool:
    """Whether the model reads images as flattened patches with no vision tower of its own (Fuyu,
    NeoMME: a config with an image token and a ``patch_size`` but no ``vision_config``)."""
    return (getattr(config, "vision_config", None) is None and isinstance(getattr(config, "image_token_id", None), int)
            and isinstance(getattr(config, "patch_size", None), int))


def _bare_patch_inputs(config, channels: int, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """GRID_SIDE² flattened patches per image, ``pixel_values`` (B·n, C·P·P): each patch is one image
    token, projected by a linear layer straight into the text."""
    width = getattr(config, "patch_dim", None) or channels * config.patch_size ** 2
    return {"pixel_values": torch.randn(batch * GRID_SIDE ** 2, width, generator=gen)}  # (B·n, C·P·P)


def _naflex_inputs(vision_config, model_config, channels: int, batch: int,
                   gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Each image's patches flattened in its row (SigLIP2 NaFlex, LFM2-VL): ``pixel_values`` (B, h·w, C·P·P)
    with its ``spatial_shapes`` (B, 2) = (h, w) in patches, h = w = GRID_SIDE x the model's
    ``downsample_factor`` (or merge size: the merged blocks must tile the grid), and an all-true
    ``pixel_attention_mask`` (B, h·w) (no padding patches)."""
    patch = vision_config.patch_size
    side = GRID_SIDE * _config_int(model_config, ("downsample_factor", *_MERGE_FIELDS),
                                   _config_int(vision_config, _MERGE_FIELDS, 1))
    return {"pixel_values": torch.randn(batch, side * side, channels * patch * patch, generator=gen),  # (B, N, C·P·P)
            SPATIAL_SHAPES: torch.tensor([[side, side]] * batch),  # (B, 2)
            "pixel_attention_mask": torch.ones(batch, side * side, dtype=torch.bool)}  # (B, N)


def _packed_strip_inputs(vision_config, channels: int, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Images packed patch after patch into one strip (MiniCPM-V's vision tower): ``pixel_values``
    (1, C, P, B·h·w·P) with each image's ``target_sizes`` (B, 2) = (h, w) in patches, h = w =
    GRID_SIDE x the window kernel (``window_kernel_size``; merges and windows must tile the grid)."""
    patch = vision_config.patch_size
    side = GRID_SIDE * _config_int(vision_config, ("window_kernel_size", *_MERGE_FIELDS), 1)
    pixels = torch.randn(1, channels, patch, batch * side * side * patch, generator=gen)  # (1, C, P, N·P)
    return {"pixel_values": pixels, TARGET_SIZES: torch.tensor([[side, side]] * batch)}  # (images, 2)


def _pooled_crop_inputs(vision_config, params, channels: int, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One crop per image, its N patches flattened in its row (Molmo2): ``pixel_values`` (B, N, C·P·P), N the
    vision tower's ``num_position_embeddings`` (one position per patch of a crop); each image's GRID_SIDE x
    GRID_SIDE tokens each pool a k x k window of its crop's √N x √N patches (k = √N / GRID_SIDE):
    ``image_token_pooling`` (B·GRID_SIDE², k²), indices into the patches of all crops; ``image_grids`` (B, 4),
    each image's low- and high-resolution token grids (GRID_SIDE x GRID_SIDE and none: its crop is its
    low-resolution view), and ``image_num_crops`` (B,) = 1 where the forward takes it."""
    patch = vision_config.patch_size
    h, w = _image_side(vision_config)
    patches = getattr(vision_config, "num_position_embeddings", None) or (h // patch) * (w // patch)
    side = math.isqrt(patches)
    tokens = min(GRID_SIDE, side)
    window = side // tokens
    corners = (torch.arange(tokens)[:, None] * side + torch.arange(tokens)[None, :]).flatten() * window  # (t²,)
    offsets = (torch.arange(window)[:, None] * side + torch.arange(window)[None, :]).flatten()  # (k²,)
    per_image = corners[:, None] + offsets[None, :]  # (t², k²): patch indices within one crop
    inputs = {"pixel_values": torch.randn(batch, patches, channels * patch * patch, generator=gen),  # (B, N, C·P·P)
              "image_token_pooling": torch.cat([per_image + image * patches for image in range(batch)]),
              "image_grids": torch.tensor([[tokens, tokens, 0, 0]] * batch)}  # (images, 4)
    if "image_num_crops" in params:
        inputs["image_num_crops"] = torch.ones(batch, dtype=torch.long)  # (images,)
    return inputs


def _grid_image_inputs(vision_config, params, grid_name: str, channels: int, batch: int,
                       gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One image per row as a (1, h, w) grid of patches, h = w = GRID_SIDE x the merge size (the
    config's ``spatial_merge_size``/``merge_size``/``merge_kernel_size``), its patches flattened:
    ``pixel_values`` (B·h·w, C·T·P·P), T the frames per patch (``temporal_patch_size``/
    ``patch_temporal``, 1 without), P the ``patch_size``; the grid under the forward's own name
    (``image_grid_thw`` in a VLM, ``grid_thw`` in its vision tower) and, where the forward takes
    them, each image's ``merge_sizes`` / ``image_merge_sizes`` (VideoLLaMA3)."""
    patch = vision_config.patch_size
    merge = _config_int(vision_config, _MERGE_FIELDS, 1)
    temporal = _config_int(vision_config, _TEMPORAL_FIELDS, 1)
    side = GRID_SIDE * merge
    inputs = {"pixel_values": torch.randn(batch * side * side, channels * temporal * patch * patch, generator=gen),
              grid_name: torch.tensor([[1, side, side]] * batch)}  # (images, 3): temporal, height, width in patches
    for name in MERGE_SIZES:
        if name in params:
            inputs[name] = torch.full((batch,), merge)  # (images,)
    if IMAGES_PER_SAMPLE in params:
        inputs.update(_with_target_grids(inputs[grid_name], grid_name))
    return inputs


def _with_target_grids(grid: torch.Tensor, grid_name: str) -> dict[str, torch.Tensor]:
    """For an image-to-image generator (GLM-Image: ``images_per_sample``) the ``grid`` (images, 3) of one source
    image per row, each followed by the grid of the image that row generates (the same size; it has no pixels),
    and ``images_per_sample`` (B,) = 2: the model reads all but each row's last grid as its source images."""
    return {grid_name: grid.repeat_interleave(2, dim=0),  # (2·B, 3): source, target, source, target, ...
            IMAGES_PER_SAMPLE: torch.full((grid.shape[0],), 2)}


def _image_inputs(vision_config, params, batch: int, gen: torch.Generator, *,
                  model_config=None) -> dict[str, torch.Tensor]:
    """Random images, one per row, in the layout the forward's parameters ask for:

    - ``image_grid_thw`` or ``grid_thw`` (Qwen2-VL, GLM-4V and their vision towers): grids of
      flattened patches, :func:`_grid_image_inputs`;
    - no vision tower, an image token and a patch size (Fuyu, NeoMME): :func:`_bare_patch_inputs`;
    - ``spatial_shapes`` (SigLIP2 NaFlex, LFM2-VL): :func:`_naflex_inputs`;
    - ``target_sizes`` (MiniCPM-V's vision tower): images packed into one strip, :func:`_packed_strip_inputs`;
    - ``image_token_pooling`` (Molmo2): crops of flattened patches that each image token pools from,
      :func:`_pooled_crop_inputs`;
    - ``pixel_attention_mask`` (Idefics2/3): ``pixel_values`` (B, 1, C, H, W), one image per row, with
      an all-true (B, 1, H, W) mask (no padding);
    - otherwise (B, C, H, W) pixels at the config's image size (an int or (H, W)).
    """
    channels = _image_channels(vision_config)
    grid_name = next((name for name in GRID_INPUTS if name in params), None)
    if grid_name is not None and isinstance(getattr(vision_config, "patch_size", None), int):
        return _grid_image_inputs(vision_config, params, grid_name, channels, batch, gen)
    if _reads_bare_patches(vision_config):
        return _bare_patch_inputs(vision_config, channels, batch, gen)
    if SPATIAL_SHAPES in params and isinstance(getattr(vision_config, "patch_size", None), int):
        return _naflex_inputs(vision_config, model_config or vision_config, channels, batch, gen)
    if TARGET_SIZES in params and isinstance(getattr(vision_config, "patch_size", None), int):
        return _packed_strip_inputs(vision_config, channels, batch, gen)
    if TOKEN_POOLING[0] in params and isinstance(getattr(vision_config, "patch_size", None), int):
        return _pooled_crop_inputs(vision_config, params, channels, batch, gen)
    h, w = _image_side(vision_config)
    if "pixel_attention_mask" in params:
        return {"pixel_values": torch.randn(batch, 1, channels, h, w, generator=gen),
                "pixel_attention_mask": torch.ones(batch, 1, h, w, dtype=torch.bool)}
    return {"pixel_values": torch.randn(batch, channels, h, w, generator=gen)}


def _other_image_layouts(media: dict[str, Any], vision_config, model_config=None) -> list[dict[str, Any]]:
    """The same images (``media``: :func:`_image_inputs` and its companions) in the other layouts that
    models read under the same names, tried when the original rejects the usual one:

    - grids of flattened patches (N, C·T·P·P): unflattened, (N, C, P, P) or (N, C, T, P, P), for a tower
      whose patch embedding is a conv over each patch (PaddleOCR-VL, Kimi-K2.5); and one row per merged
      token, (N / m², m·P, m·P, C) channels last with the grid counted in merged tokens (Inkling2);
    - a per-pixel ``pixel_attention_mask`` (B, 1, H, W): a per-tile one, (B, 1) (GraniteDocling: the real tiles);
    - (B, C, H, W) pixels with nothing else describing them: one-frame clips, (B, 1, C, H, W) (InstructBLIP-Video);
      clips (B, T, C, H, W) as their frames, (B·T, C, H, W) (X-CLIP's vision tower alone reads frames);
    - an ``image_token_pooling`` table indexing the patches of all crops: each image's rows indexing its own
      crop's patches only (Molmo2 from transformers 5.25 adds each image's offset itself);
    - (B, C, H, W) pixels sized by the model's backbone (``backbone_config``: its image size and channels),
      for a model whose backbone is the whole image tower (ViTPose's ViT at 256 x 192, ViTMatte's image plus
      trimap: 4 channels); a detector windowing any size (RF-DETR) runs on the usual ones first.
    """
    pixels = media.get("pixel_values")
    if not isinstance(pixels, torch.Tensor):
        return []
    if TOKEN_POOLING[0] in media and pixels.dim() == 3:  # (crops, N, C·P·P), one crop per image
        return [{**media, TOKEN_POOLING[0]: media[TOKEN_POOLING[0]] % pixels.shape[1]}]
    grid_name = next((name for name in GRID_INPUTS if name in media), None)
    patch = getattr(vision_config, "patch_size", None)
    if grid_name is not None and pixels.dim() == 2 and isinstance(patch, int):
        return _other_patch_layouts(media, grid_name, vision_config)
    mask = media.get("pixel_attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        return [{**media, "pixel_attention_mask": mask.flatten(2).any(-1)}]  # (B, 1, H, W) -> (B, tiles)
    layouts = []
    backbone = getattr(model_config, "backbone_config", None)
    if pixels.dim() == 4 and backbone is not None:
        shape = (_image_channels(backbone), *_image_side(backbone, default=pixels.shape[-1]))  # (C, H, W)
        if tuple(pixels.shape[1:]) != shape:
            gen = torch.Generator().manual_seed(0)
            layouts.append({**media, "pixel_values": torch.randn(len(pixels), *shape, generator=gen, dtype=pixels.dtype)})
    if pixels.dim() == 4 and not set(media) & set(_IMAGE_INPUTS) - {"pixel_values"}:
        layouts.append({**media, "pixel_values": pixels.unsqueeze(1)})  # (B, C, H, W) -> (B, frames = 1, C, H, W)
    if pixels.dim() == 5 and not set(media) & set(_IMAGE_INPUTS) - {"pixel_values"}:
        layouts.append({**media, "pixel_values": pixels.flatten(0, 1)})  # (B, T, C, H, W) -> (B·T, C, H, W)
    return layouts


def _other_patch_layouts(media: dict[str, Any], grid_name: str, vision_config) -> list[dict[str, Any]]:
    """The grid-patch layouts of :func:`_other_image_layouts`, for ``media`` built by :func:`_grid_image_inputs`."""
    pixels, grid = media["pixel_values"], media[grid_name]  # (N, C·T·P·P), (images, 3)
    patch, channels = vision_config.patch_size, _image_channels(vision_config)
    temporal = _config_int(vision_config, _TEMPORAL_FIELDS, 1)
    merge = _config_int(vision_config, _MERGE_FIELDS, 1)
    frames = (temporal,) if temporal > 1 else ()
    layouts = [{**media, "pixel_values": pixels.reshape(pixels.shape[0], channels, *frames, patch, patch)}]
    if temporal == 1 and merge > 1:
        # the random values need no reordering: (N, C·P·P) -> (N / m², m·P, m·P, C), a merged token's pixels per row
        blocks = pixels.reshape(-1, merge * patch, merge * patch, channels)
        merged_grid = grid.clone()
        merged_grid[:, 1:] //= merge
        layouts.append({**media, "pixel_values": blocks, grid_name: merged_grid})
    return layouts


def _patch_masking_noise(vision_config, pixel_values: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """(B, patches) seeded uniform noise for a forward that takes ``noise`` to rank its image patches
    for random masking (ViT-MAE keeps the patches of lowest noise): without it the model draws its own
    on every call, so its eval forward is random and no comparison could prove a fold of it. One value
    per patch of ``pixel_values`` (B, C, H, W) at the config's ``patch_size`` (an int or (h, w))."""
    patch = getattr(vision_config, "patch_size", None) or 16
    ph, pw = (patch, patch) if isinstance(patch, int) else tuple(patch)[-2:]
    patches = (pixel_values.shape[-2] // ph) * (pixel_values.shape[-1] // pw)
    return torch.rand(pixel_values.shape[0], patches, generator=gen)  # (B, patches)


# keypoint matchers read images of any size (no position table) and set none; their cost grows fast with
# it (EfficientLoFTR: ~1 s a call at 64 px, ~100 s at 224 px on one CPU core), and 64 px still leaves
# each conv stage (stride 8 in all) and attention window several positions
MATCHED_IMAGE_SIDE = 64


def _clip_or_pair_inputs(config, vision_config, params, batch: int,
                         gen: torch.Generator) -> dict[str, torch.Tensor] | None:
    """Pixels for a forward that reads several images per row, or None for one image per row
    (:func:`_image_inputs`):

    - ``pixel_values_videos`` and no ``pixel_values`` (VideoPrism): clips, :func:`_video_clips`;
    - ``pixel_values`` of a vision config with ``num_frames`` (TimeSformer, VideoMAE, ViViT, X-CLIP):
      clips, :func:`_video_clips`;
    - ``pixel_values`` of a keypoint matcher (``AutoModelForKeypointMatching`` maps its config:
      LightGlue, EfficientLoFTR, SuperGlue): (B, 2, C, H, W), the two images it matches per row,
      MATCHED_IMAGE_SIDE pixels square unless its config sets an image size.
    """
    if "pixel_values" not in params:
        return {"pixel_values_videos": _video_clips(vision_config, batch, gen)}
    if isinstance(getattr(vision_config, "num_frames", None), int):
        return {"pixel_values": _video_clips(vision_config, batch, gen)}
    if _is_keypoint_matcher(config):
        channels, (h, w) = _image_channels(vision_config), _image_side(vision_config, MATCHED_IMAGE_SIDE)
        return {"pixel_values": torch.randn(batch, 2, channels, h, w, generator=gen)}  # (B, 2, C, H, W)
    return None


def _video_clips(vision_config, batch: int, gen: torch.Generator) -> torch.Tensor:
    """(B, T, C, H, W) random clips, T the config's ``num_frames`` (1 when it sets none), at its image size:
    video encoders' position embeddings count exactly that many frames (tubelets of them)."""
    frames = getattr(vision_config, "num_frames", None) or 1
    h, w = _image_side(vision_config)
    return torch.randn(batch, frames, _image_channels(vision_config), h, w, generator=gen)


def _is_keypoint_matcher(config) -> bool:
    """Whether transformers' ``AutoModelForKeypointMatching`` maps ``config``: a model that matches the
    keypoints of two images, so its ``pixel_values`` hold an image pair per row."""
    transformers = require("transformers")
    return type(config) in transformers.MODEL_FOR_KEYPOINT_MATCHING_MAPPING


def _image_channels(vision_config) -> int:
    """The config's colour channels (``num_channels`` or ``in_channels``), 3 when it sets none."""
    return getattr(vision_config, "num_channels", None) or getattr(vision_config, "in_channels", None) or 3


def _image_side(vision_config, default: int = 224) -> tuple[int, int]:
    """(H, W) of the config's ``image_size`` (an int or a sequence ending in H, W), else of its
    ``max_img_size`` (TVP pads every frame up to it, so a smaller one does not broadcast), else ``default``."""
    size = getattr(vision_config, "image_size", None) or getattr(vision_config, "max_img_size", None) or default
    return (size, size) if isinstance(size, int) else tuple(size)[-2:]


def _companion_inputs(config, params, inputs: dict[str, Any], seq: int, gen: torch.Generator) -> dict[str, Any]:
    """What the forward needs beside the images it was given (``inputs``), named by its parameters:

    - ``image_sizes``: each image's (height, width) in pixels, where the config lays images out at any
      resolution or the vision tower reads them (LLaVA-NeXT, Pixtral; not LLaVA, whose forward takes
      them for its Pixtral towers only);
    - ``aspect_ratio_ids`` / ``aspect_ratio_mask`` (tiled images, Mllama): every image one tile of
      aspect ratio 1:1 (its 1-based id among ``supported_aspect_ratios``) padded to ``max_num_tiles``,
      and ``pixel_values`` laid out (B, images, tiles, C, H, W) with zero padding tiles;
    - ``high_res_pixel_values``: the same images at the size of ``high_res_vision_config`` (DeepSeek-VL hybrid);
    - ``qformer_input_ids`` (+ mask): the instruction the Q-Former reads (InstructBLIP), ``seq`` ids of
      its ``qformer_config`` vocabulary;
    - ``task_inputs``: the task prompt's ``task_seq_len`` ids (OneFormer's text encoder vocabulary);
    - ``prompt_*`` images the forward requires (SegGPT's ``prompt_pixel_values`` and ``prompt_masks``: an
      example image and its mask, painted as an image): random images of the pixels' shape, the pixels
      cut to the top half of the config's canvas, which the forward stacks below the prompt.
    """
    found: dict[str, Any] = {}
    pixels = inputs.get("pixel_values")
    vision = _vision_config(config)
    if isinstance(pixels, torch.Tensor) and pixels.dim() == 4:
        batch, channels, h, w = pixels.shape  # (B, C, H, W)
        if "image_sizes" in params and _reads_image_sizes(config, vision):
            found.update(_any_resolution_images(config, pixels, gen))
        ratios, tiles = getattr(vision, "supported_aspect_ratios", None), getattr(vision, "max_num_tiles", None)
        if "aspect_ratio_ids" in params and ratios and isinstance(tiles, int):
            padded = torch.zeros(batch, 1, tiles, channels, h, w, dtype=pixels.dtype)  # (B, images, tiles, C, H, W)
            padded[:, 0, 0] = pixels
            found["pixel_values"] = padded
            found["aspect_ratio_ids"] = torch.full((batch, 1), [list(r) for r in ratios].index([1, 1]) + 1)
            mask = torch.zeros(batch, 1, tiles, dtype=torch.long)  # (B, images, tiles): the first tile is real
            mask[:, :, 0] = 1
            found["aspect_ratio_mask"] = mask
        high_res = getattr(config, "high_res_vision_config", None)
        if "high_res_pixel_values" in params and high_res is not None:
            size = getattr(high_res, "image_size", None) or h
            found["high_res_pixel_values"] = torch.randn(batch, channels, size, size, generator=gen)
        prompts = [name for name, param in params.items()
                   if name.startswith("prompt_") and param.default is inspect.Parameter.empty]
        if "prompt_pixel_values" in prompts:  # SegGPT stacks the prompt above the image: each is half the canvas
            found["pixel_values"] = pixels = pixels[:, :, : h // 2]  # (B, C, H/2, W)
        for name in prompts:
            found[name] = torch.randn(pixels.shape, generator=gen)
    rows = next((v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor)), EXAMPLE_BATCH)
    qformer = getattr(config, "qformer_config", None)
    if "qformer_input_ids" in params and qformer is not None:
        found["qformer_input_ids"] = _token_ids(qformer, rows, seq, gen)
        if "qformer_attention_mask" in params:
            found["qformer_attention_mask"] = torch.ones_like(found["qformer_input_ids"])
    task_length = getattr(config, "task_seq_len", None)
    if "task_inputs" in params and isinstance(task_length, int):
        vocab = getattr(config, "text_encoder_vocab_size", None) or CHARACTER_VOCAB
        found["task_inputs"] = torch.randint(0, vocab, (rows, task_length), generator=gen)
    return found


def _reads_image_sizes(config, vision_config) -> bool:
    """Whether a forward's optional ``image_sizes`` is read for this config: any-resolution layouts
    (``image_grid_pinpoints``), or a vision tower whose own forward takes ``image_sizes`` (Pixtral)."""
    if getattr(config, "image_grid_pinpoints", None):
        return True
    if vision_config is config:
        return False
    try:
        tower = model_class_for(vision_config)
    except CheckpointError:
        return False
    return "image_sizes" in inspect.signature(tower.forward).parameters


def _any_resolution_images(config, pixels: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``image_sizes`` (B, 2) for (B, C, H, W) ``pixels``: each image's (height, width). Where the config
    lays images out at any resolution (``image_grid_pinpoints``, LLaVA-NeXT), each image is its first
    layout's size, cut into its H x W tiles plus the whole image resized: ``pixel_values`` (B, 1 + tiles, C, H, W)."""
    batch, channels, h, w = pixels.shape
    layouts = getattr(config, "image_grid_pinpoints", None)
    if not layouts or layouts[0][0] % h or layouts[0][1] % w:
        return {"image_sizes": torch.tensor([[h, w]] * batch)}
    height, width = layouts[0]
    tiles = 1 + (height // h) * (width // w)
    return {"image_sizes": torch.tensor([[height, width]] * batch),
            "pixel_values": torch.randn(batch, tiles, channels, h, w, generator=gen)}


def _cross_attended_images(params, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """For a forward whose text cross-attends to a list of images per row through an
    ``image_attention_mask`` (B, T, images) (IDEFICS): the (B, C, H, W) pixels as one image per row,
    (B, 1, C, H, W), seen by every token. Nothing for any other forward."""
    pixels, ids = inputs.get("pixel_values"), inputs.get("input_ids")
    if "image_attention_mask" not in params or not isinstance(pixels, torch.Tensor) or pixels.dim() != 4 or ids is None:
        return {}
    return {"pixel_values": pixels.unsqueeze(1),  # (B, 1, C, H, W)
            "image_attention_mask": torch.ones(*ids.shape, 1, dtype=torch.long)}  # (B, T, 1)


def _with_latent_query_slots(config, params, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """For a forward that places its image's ``latent_query_num`` query embeddings at the positions its
    ``image_embeds_position_mask`` marks (Kosmos-2): ``ids`` led by that many slots (the ids there are
    replaced by the image embeddings) and the (B, T) mask, 1 at the slots. Otherwise ``ids`` as they are."""
    slots = getattr(config, "latent_query_num", None)
    if "image_embeds_position_mask" not in params or not isinstance(slots, int):
        return ids, {}
    ids = torch.cat([torch.ones(ids.shape[0], slots, dtype=ids.dtype), ids], dim=1)  # (B, slots + T)
    mask = torch.zeros_like(ids)
    mask[:, :slots] = 1
    return ids, {"image_embeds_position_mask": mask}


def _with_media_tokens(model: nn.Module, ids: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``ids`` led by one placeholder token per media feature, for a model that merges image or audio
    features into its text at the positions of its config's ``image_token_id`` (LLaVA, PaliGemma,
    Qwen2-VL, Idefics3) or ``audio_token_id`` / ``audio_token_index`` (Voxtral, GraniteSpeech): as
    many per row as its own ``get_image_features`` / ``get_audio_features`` gives each row's media
    (``inputs``: the call's media inputs, :func:`_image_inputs`, :func:`_audio_inputs`); the merging
    module is the model or its encoder (:func:`_media_merger`). ``ids`` unchanged for any other model."""
    for field, method, names in _MEDIA:
        merger, get_features = _media_merger(model, method)
        token = getattr(getattr(merger, "config", None), field, None)
        media = {k: v for k, v in inputs.items() if k in names}
        if isinstance(token, int) and merger is not None and media:
            counts = (_feature_count(count, media) for count in get_features)
            return _led_by_tokens(ids, token, next((n for n in counts if n is not None), None))
    return ids


# the towers whose states a model projects one to one into its text, where its ``get_audio_features`` is missing
# (Qwen2-Audio) or needs the ids it would count the tokens of (MusicFlamingo: its rotary time stamps), and the
# method that computes them: the audio tower itself (None), or a codec's encode (CSM embeds each codec frame's codes
# as one token)
_FEATURE_TOWERS = {"get_audio_features": (("audio_tower", None), ("codec_model", "encode"))}


def _media_merger(model: nn.Module, method: str) -> tuple[nn.Module | None, list[Callable]]:
    """The module that merges media features into the text and what computes them, tried in order: the
    model (LLaVA), its encoder for an encoder-decoder whose encoder reads the media (T5Gemma 2), or the
    sub-model that does (PI0: its PaliGemma, ``vlm``), with its ``method`` (e.g. ``get_image_features``),
    then the model's media tower (``audio_tower``, whose states its projector keeps one to one; ``codec_model``,
    whose frames it embeds one to one); (None, []) when none of them has one."""
    get_encoder = getattr(model, "get_encoder", None)
    encoder = get_encoder() if callable(get_encoder) and not hasattr(model, method) else None
    merger = next((m for m in (model, encoder, *model.children()) if hasattr(m, method)), None)
    towers = [getattr(tower, compute) if compute else tower for name, compute in _FEATURE_TOWERS.get(method, ())
              if isinstance(tower := getattr(model, name, None), nn.Module) and hasattr(tower, compute or "forward")]
    if merger is not None:
        return merger, [*_image_token_ids(merger, method), getattr(merger, method), *towers]
    return (model, towers) if towers else (None, [])


def _image_token_ids(merger: nn.Module, method: str) -> list[Callable]:
    """For a model that quantizes its image features into ids of its own vocabulary, which replace its
    placeholder tokens one for one (GLM-Image: ``get_image_tokens(hidden_states)``, a VQ codebook), what
    computes those ids from the media; nothing for any other model (Chameleon's ``get_image_tokens`` reads
    pixels, and its image features are counted as they are)."""
    quantize = getattr(merger, "get_image_tokens", None)
    if method != "get_image_features" or quantize is None:
        return []
    if next(iter(inspect.signature(quantize).parameters), None) != "hidden_states":
        return []
    get_features = getattr(merger, method)

    def image_token_ids(**media):
        return quantize(_media_features(get_features(**_accepted(get_features, media))))  # (tokens,) ids
    return [image_token_ids]


def _feature_count(get_features, media: dict[str, torch.Tensor]) -> int | None:
    """How many feature vectors ``get_features`` (a model's ``get_image_features`` or
    ``get_audio_features``) makes of ``media`` over the whole batch, None when it fails or gives no
    tensors."""
    media = _accepted(get_features, media)
    found = _features_or_none(get_features, media)
    pixels = media.get("pixel_values")
    if found is None and isinstance(pixels, torch.Tensor) and pixels.dim() == 5:
        # several images per row (PI0's cameras, (B, n, C, H, W)) for a tower that reads one image a row
        found = _features_or_none(get_features, {**media, "pixel_values": pixels.flatten(0, 1)})
    if found is None:
        return None
    features = _media_features(found)
    if isinstance(features, torch.Tensor) and not features.is_floating_point() and features.dim() == 1:
        return features.numel()  # (tokens,) ids of a quantized image (GLM-Image's): one placeholder each
    parts = features if isinstance(features, (list, tuple)) else [features]
    if not all(isinstance(f, torch.Tensor) and f.dim() >= 2 for f in parts):
        return None
    return sum(f.numel() // f.shape[-1] for f in parts)  # feature vectors over the whole batch


def _features_or_none(get_features, media: dict[str, torch.Tensor]):
    """What ``get_features`` returns for ``media``, or None when it raises."""
    try:
        with torch.no_grad():
            return get_features(**media)
    except Exception:  # noqa: BLE001  the model's own code, whatever it raises: plain text ids, as before
        return None


def _accepted(function, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``kwargs`` that ``function`` takes by name (all of them where it takes ``**kwargs``)."""
    params = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _led_by_tokens(ids: torch.Tensor, token: int, total: int | None) -> torch.Tensor:
    """(B, total / B + T) ``ids`` led by ``total / B`` placeholder ``token``s per row, the token itself
    taken out of the text; ``ids`` unchanged when ``total`` is None or does not split evenly over the rows."""
    if total is None or total % ids.shape[0]:
        return ids
    text = ids.masked_fill(ids == token, 1 if token == 0 else 0)  # no placeholder token among the text
    return torch.cat([torch.full((ids.shape[0], total // ids.shape[0]), token, dtype=ids.dtype), text], dim=1)


def _media_features(found):
    """The features in what a model's ``get_image_features`` / ``get_audio_features`` returned: a ModelOutput's projected
    ``pooler_output``, else its ``last_hidden_state`` (Llama 4: its vision model's output, adapted patches
    that its projector keeps one to one), else a codec's ``audio_codes`` (B, codebooks, frames) as one vector of
    codes per frame (B, frames, codebooks), else ``found`` itself (a tensor or a list of them)."""
    for name in ("pooler_output", "last_hidden_state"):
        features = getattr(found, name, None)
        if features is not None:
            return features
    codes = getattr(found, "audio_codes", None)
    if isinstance(codes, torch.Tensor) and codes.dim() == 3:
        return codes.transpose(1, 2)  # (B, frames, codebooks)
    return found


def _boxes(batch: int, count: int, bound: int, gen: torch.Generator) -> torch.Tensor:
    """(B, N, 4) integer boxes (x0, y0, x1, y1) in [0, bound], with x0 <= x1 and y0 <= y1."""
    corners = torch.randint(0, bound + 1, (batch, count, 2, 2), generator=gen)  # two (x, y) corners per box
    return torch.cat([corners.min(dim=2).values, corners.max(dim=2).values], dim=-1)


_AUDIO_INPUTS = ("input_values", "input_features", "input_features_mask", "padding_mask")  # what describes the audio of a call


def _audio_config(config):
    """The config that describes the audio input: the ``audio_config``, ``encoder_config`` or ``codec_config``
    of a composite model (an audio LM, an ASR encoder-decoder, a speech LM reading its audio as codec
    frames: CSM), else the config itself."""
    return next((sub for name in ("audio_config", "encoder_config", "codec_config")
                 if (sub := getattr(config, name, None))), config)


def _audio_mask_params(model_class, params) -> set[str]:
    """The audio masks over samples or frames that a call may pass: those the model's own
    ``get_audio_features`` reads (AudioFlamingo3, MOSS: the encoder's frames), all of ``params`` for a
    model without one. A forward's ``input_features_mask`` that its ``get_audio_features`` does not
    read masks something else (Granite Speech: the projected features), so none is built for it."""
    get_features = getattr(model_class, "get_audio_features", None)
    if get_features is None:
        return set(params)
    return set(params) & set(inspect.signature(get_features).parameters)


# what a model that merges media features into its text reads: the config field of the placeholder
# token, the method that computes the features, and the inputs that describe the media
_MEDIA = (("image_token_id", "get_image_features", _IMAGE_INPUTS),
          ("audio_token_id", "get_audio_features", _AUDIO_INPUTS),
          ("audio_token_index", "get_audio_features", _AUDIO_INPUTS))


# ------------------------------------------------------------------------------- calibration text

CALIBRATION_BATCH = 16  # sentences per calibration batch: small enough for CPU memory, large enough to be fast
CALIBRATION_MAX_TOKENS = 128  # longer sentences are truncated: calibration needs typical tokens, not long contexts


def read_calibration_file(path: str | os.PathLike) -> list[str]:
    """The non-blank lines of a UTF-8 text file, one calibration sentence each."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"calibration file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"calibration file {path} is not readable UTF-8 text: {first_line(err)}") from err
    sentences = [line.strip() for line in lines if line.strip()]
    if not sentences:
        raise CheckpointError(f"calibration file {path} is empty: expected one sentence per line")
    return sentences


# a folder holds a tokenizer when it has one of these (transformers 5 otherwise builds an empty one from config.json)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                    "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(model_dir: str | os.PathLike, *, trust_remote_code: bool = False):
    """The folder's own tokenizer (offline), or CheckpointError when the folder has none."""
    transformers = require("transformers")
    path = check_model_dir(model_dir)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"no tokenizer in {path} (needed to tokenize the calibration file): expected one of "
                              f"{', '.join(TOKENIZER_FILES)}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                               trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"no usable tokenizer in {path} (needed to tokenize the calibration file): "
                              f"{first_line(err)}") from err
    if tokenizer is None or not callable(tokenizer):
        raise CheckpointError(f"no usable tokenizer in {path} (needed to tokenize the calibration file)")
    return tokenizer


def calibration_batches(model: nn.Module, tokenizer, sentences: list[str],
                        batch_size: int = CALIBRATION_BATCH) -> list[dict[str, Any]]:
    """The sentences tokenized in padded batches, as keyword inputs ``model`` accepts."""
    params = inspect.signature(type(model).forward).parameters
    text = getattr(model.config, "get_text_config", lambda: model.config)()
    max_len = min(max_positions(text) or CALIBRATION_MAX_TOKENS, CALIBRATION_MAX_TOKENS)
    if tokenizer.pad_token is None:  # e.g. GPT-2: pad with EOS, the attention mask hides it
        tokenizer.pad_token = tokenizer.eos_token
    batches = []
    for start in progress(range(0, len(sentences), batch_size), desc="tokenizing calibration sentences", unit="batch"):
        encoded = tokenizer(sentences[start:start + batch_size], padding=True, truncation=True, max_length=max_len,
                            return_tensors="pt")
        batch = {k: v for k, v in encoded.items() if k in params}  # (B, T) each
        if "use_cache" in params:
            batch["use_cache"] = False
        batches.append(batch)
    return batches


def is_sentence_encoder(model: nn.Module) -> bool:
    """A bare encoder backbone (what ``AutoModel`` builds for BERT-like configs): no LM head, its
    token states are pooled into sentence embeddings, so its outputs are compared mean-pooled."""
    transformers = require("transformers")
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return False
    try:
        backbone = transformers.AutoModel._model_mapping[type(config)]
        transformers.AutoModelForMaskedLM._model_mapping[type(config)]  # an encoder family
    except (KeyError, ValueError):
        return False
    return type(model) is backbone
