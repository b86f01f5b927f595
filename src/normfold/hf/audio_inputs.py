"""Example audio inputs: waveforms (``input_values``) and spectrogram features (``input_features``)
in the layout the model reads.

Audio models disagree on layout: Whisper reads (B, mel, 2 x positions) log-mels, conformer encoders
(Parakeet, LASR, Granite Speech) (B, frames, mel), CLAP (B, 1, frames, mel), AST a spectrogram under
the name ``input_values``, codecs (Mimi, X-codec) (B, channels, samples), and the mel width is not
always a config field. So the config and the forward's signature name candidate layouts, most
likely first (the first is what normfold always built, so models that ran on it keep their inputs),
and given a model the first one the original runs on eagerly is kept."""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..engine.verify import cast_floats, float_dtype

WHISPER_FRAMES = 3000  # 30 s of 10 ms frames: Whisper's input when the config names no positions
COMMON_MEL_BINS = (80, 128)  # the usual filter-bank widths, tried after the config's own
MEL_FIELDS = ("num_mel_bins", "feature_size", "input_feat_size", "feature_projection_input_dim", "n_mels",
              "input_dim")  # the last: Granite Speech's encoder (160 = 2 stacked 80-bin frames)
HOP_FIELDS = ("upsampling_ratios", "downsampling_ratios")  # codecs: samples per frame is their product
STACKING_FACTORS = (2, 4)  # a mel frame beside its delta (x 2), and (x 2 again) frames stacked in pairs
MAX_FRAME_DOUBLINGS = 4  # features: seq x 8 (a conformer's usual subsampling) .. x 64 frames
MAX_SAMPLES = 1 << 14  # waveforms are doubled up to this many samples (Moonshine's convs need 2047 for 4 frames)

# all-ones masks over frames or samples a forward may read, by name (Qwen2-Audio requires its feature_attention_mask)
FEATURE_MASKS = ("input_features_mask", "padding_mask", "feature_attention_mask")
# where each audio segment of a row's waveform ends, -1 padded (B, segments): CSM cuts its rows' waveforms into the
# segments its codec encodes one by one, and requires the cutoffs with its waveforms
SEGMENT_CUTOFFS = "input_values_cutoffs"

Candidate = Callable[[torch.Generator], dict[str, torch.Tensor]]


def audio_inputs_for(audio_config, params, masks, batch: int, seq: int, gen: torch.Generator,
                     model: nn.Module | None = None, finish: Callable[[dict], dict] = dict) -> dict[str, Any]:
    """The audio inputs of one example call: the first candidate (:func:`audio_candidates`) the
    original ``model`` runs on eagerly (called with ``finish(inputs)``: the rest of the call added,
    token ids too), or the first candidate without a model or when none runs. ``masks``: the names of
    the all-ones masks to pass (``input_features_mask``, ``padding_mask``: those the model reads over
    frames or samples). ``gen`` ends as after building the kept one."""
    start = gen.get_state()
    candidates = list(audio_candidates(audio_config, params, masks, batch, seq))
    if model is not None:
        for candidate in candidates:
            gen.set_state(start)
            inputs = candidate(gen)
            if runs_eagerly(model, finish(dict(inputs))):
                return inputs
    gen.set_state(start)
    return candidates[0](gen)


def audio_candidates(audio_config, params, masks, batch: int, seq: int) -> Iterator[Candidate]:
    """Builders of candidate audio inputs, most likely first: waveforms for a forward that takes
    ``input_values`` (with spectrogram features too where it also takes ``input_features``:
    codecs with a semantic branch; with their segment cutoffs where it takes ``input_values_cutoffs``),
    then hidden states (:func:`_hidden_states`), else spectrogram features."""
    if "input_values" in params:
        for waveform in _waveform_candidates(audio_config, masks, batch, seq):
            if SEGMENT_CUTOFFS in params:
                waveform = _with_segment_cutoffs(waveform)
            if "input_features" not in params:
                yield waveform
                continue
            for features in _feature_candidates(audio_config, masks, batch, seq):
                yield _joined(waveform, features)
        if isinstance(width := getattr(audio_config, "hidden_size", None), int):
            yield _hidden_states(params, batch, seq, width)
    elif "input_features" in params:
        yield from _feature_candidates(audio_config, masks, batch, seq)


def _joined(*builders: Candidate) -> Candidate:
    """One builder whose inputs are those of ``builders``, built in order."""
    return lambda gen: {k: v for build in builders for k, v in build(gen).items()}


def runs_eagerly(model: nn.Module, inputs: dict[str, Any]) -> bool:
    """Whether the original model runs on ``inputs``, their floats in its own dtype as the fold runs them
    (any exception: it does not; a float64 model that never casts its input rejects float32 features)."""
    dtype = float_dtype(model)
    try:
        with torch.no_grad():
            model(**(inputs if dtype is None else cast_floats(inputs, dtype)))
    except Exception:  # noqa: BLE001  a layout the model rejects, whatever its error
        return False
    return True


# ---------------------------------------------------------------------------------- waveforms

def _waveform_candidates(audio_config, masks, batch: int, seq: int) -> Iterator[Candidate]:
    """Waveforms: (B, S) and (B, channels, S) for growing S, the fewest samples first, each with an
    all-ones ``padding_mask`` (B, S) where ``masks`` names one, then the same without it (the mask is
    optional, and some models read it over frames, not samples); then an AST spectrogram (B, max_length,
    mel) where the config names both (AST reads it as ``input_values``)."""
    channels = getattr(audio_config, "audio_channels", 1)
    # with the padding mask over samples first; then without it, for a model that reads it over frames (PE Audio)
    for mask in dict.fromkeys((frozenset(masks & {"padding_mask"}), frozenset())):
        for samples in _sample_counts(audio_config, seq):
            for shape in ((batch, samples), (batch, channels, samples)):  # (B, S), (B, C, S)
                yield _with_masks(lambda gen, shape=shape: {"input_values": torch.randn(*shape, generator=gen)},
                                  mask, batch, samples)
    mel, frames = _first_field(audio_config, MEL_FIELDS), getattr(audio_config, "max_length", None)
    if isinstance(mel, int) and isinstance(frames, int):
        yield lambda gen: {"input_values": torch.randn(batch, frames, mel, generator=gen)}  # (B, frames, mel)


def _with_segment_cutoffs(build: Candidate) -> Candidate:
    """``build`` with ``input_values_cutoffs`` (B, 1): each row's waveform one audio segment, cut at its end."""
    def built(gen: torch.Generator) -> dict[str, torch.Tensor]:
        inputs = build(gen)
        samples = inputs["input_values"].shape[-1]  # (B, S) or (B, C, S)
        return {**inputs, SEGMENT_CUTOFFS: torch.full((inputs["input_values"].shape[0], 1), samples)}
    return built


def _hidden_states(params, batch: int, seq: int, width: int) -> Candidate:
    """Hidden states (B, seq, hidden_size) as ``input_values``, for a bare encoder-decoder whose encoder
    has no prenet (SpeechT5Model: its speech and text prenets are other classes' modules), with its
    decoder's hidden states (B, seq, hidden_size) as ``decoder_input_values`` where the forward takes them."""
    names = ["input_values"] + (["decoder_input_values"] if "decoder_input_values" in params else [])
    return lambda gen: {name: torch.randn(batch, seq, width, generator=gen) for name in names}  # (B, T, D)


def _sample_counts(audio_config, seq: int) -> list[int]:
    """Candidate waveform lengths: ``seq`` codec frames (x the hop named by the config) or, more where
    the conv feature encoder needs them, the fewest samples it turns into ``seq`` frames
    (:func:`fewest_samples`); then the fewest alone,
    doubled up to ``MAX_SAMPLES`` until the widest first conv fits."""
    fewest = fewest_samples(audio_config, seq)
    hop = math.prod(next((v for f in HOP_FIELDS if isinstance(v := getattr(audio_config, f, None), (list, tuple))), ()))
    start = max(fewest, seq * hop)
    counts = [start, fewest]
    while counts[-1] * 2 <= MAX_SAMPLES:
        counts.append(counts[-1] * 2)
    return list(dict.fromkeys(counts))


def fewest_samples(audio_config, seq: int) -> int:
    """The fewest samples the convolutional feature encoder (``conv_kernel``, ``conv_stride``) turns
    into ``seq`` frames: each conv maps L to (L - k) // s + 1, so walking back L = (L' - 1) * s + k."""
    samples = seq
    for kernel, stride in reversed(list(zip(getattr(audio_config, "conv_kernel", ()), getattr(audio_config, "conv_stride", ())))):
        samples = (samples - 1) * stride + kernel
    return samples


# ---------------------------------------------------------------------------- spectrogram features

def _feature_candidates(audio_config, masks, batch: int, seq: int) -> Iterator[Candidate]:
    """Spectrogram features: Whisper's (B, mel, 2 x positions) first, then (B, frames, mel) (conformer
    encoders), (B, mel, frames) and (B, 1, frames, mel) (CLAP) for each candidate mel width and
    growing frame counts; each with an all-ones ``input_features_mask`` / ``padding_mask`` (B, frames)
    where ``masks`` names one (AudioFlamingo3 and FunASR need it)."""
    mels = _mel_widths(audio_config)
    whisper_frames = 2 * getattr(audio_config, "max_source_positions", WHISPER_FRAMES // 2)
    yield _features(batch, mels[0], whisper_frames, "mel_first", masks)
    # a conformer's subsampled frames first; then one frame per codec frame (X-codec2 joins its semantic features
    # to the waveform's codec frames, seq of them, side by side)
    frame_counts = [seq * 8 * 2 ** k for k in range(MAX_FRAME_DOUBLINGS)] + [seq]
    # then the widths of features stacked in code (tried last: a model that ran on the widths before keeps its inputs)
    for widths in (mels, _stacked_widths(audio_config, mels)):
        for layout in ("frames_first", "mel_first", "one_channel"):
            for mel in widths:
                for frames in frame_counts:
                    yield _features(batch, mel, frames, layout, masks)


def _features(batch: int, mel: int, frames: int, layout: str, masks) -> Candidate:
    """A builder of random features of one layout (+ the masks ``masks`` names)."""
    shape = {"frames_first": (batch, frames, mel), "mel_first": (batch, mel, frames),
             "one_channel": (batch, 1, frames, mel)}[layout]
    return _with_masks(lambda gen: {"input_features": torch.randn(*shape, generator=gen)}, masks, batch, frames)


def _with_masks(build: Candidate, masks, batch: int, length: int) -> Candidate:
    """``build`` with an all-ones (B, length) mask (frames or samples: nothing padded) for each of
    ``input_features_mask`` and ``padding_mask`` in ``masks``."""
    names = [m for m in FEATURE_MASKS if m in masks]
    return lambda gen: {**build(gen), **{m: torch.ones(batch, length, dtype=torch.long) for m in names}}


def _mel_widths(audio_config) -> list[int]:
    """Candidate feature widths: the config's own (``num_mel_bins``, ``feature_size``, ...; Speech2Text's
    ``input_feat_per_channel`` x ``input_channels``) first, and that times ``num_stacked_frames`` where the config stacks frames, then the common filter-bank
    widths, then those its sub-configs name; the first is 80 where the config names none (Whisper's)."""
    named = [v for f in MEL_FIELDS if isinstance(v := getattr(audio_config, f, None), int)]
    per_channel = getattr(audio_config, "input_feat_per_channel", None)  # Speech2Text: features x input channels
    if isinstance(per_channel, int):
        named.append(per_channel * (getattr(audio_config, "input_channels", None) or 1))
    stacked = getattr(audio_config, "num_stacked_frames", None)  # low-frame-rate features (FunASR): frames side by side
    if named and isinstance(stacked, int):
        named.append(named[0] * stacked)
    # a codec whose semantic branch is another model (NeuCodec, X-codec2: a Wav2Vec2-BERT reading 160 = 2 x 80),
    # tried last so that a model that ran on the usual widths keeps its inputs
    nested = [v for sub in vars(audio_config).values() if hasattr(sub, "to_dict") and not isinstance(sub, dict)
              for f in MEL_FIELDS if isinstance(v := getattr(sub, f, None), int)]
    return list(dict.fromkeys(named + list(COMMON_MEL_BINS) + nested))


def _stacked_widths(audio_config, tried: list[int]) -> list[int]:
    """Feature widths a feature extractor makes of the config's mel width in code, with no config field
    saying so: each frame beside its delta and frames stacked in pairs, x ``STACKING_FACTORS`` (Granite
    Speech 5: mel x 2 x 2); those not in ``tried``."""
    mel = _first_field(audio_config, MEL_FIELDS)
    if not isinstance(mel, int):
        return []
    return [w for w in dict.fromkeys(mel * k for k in STACKING_FACTORS) if w not in tried]


def _first_field(config, fields) -> Any:
    """The value of the first of ``fields`` the config sets, or None."""
    return next((v for f in fields if (v := getattr(config, f, None)) is not None), None)

