"""Example inputs for a folder, by one of two routes, and which one was taken:

- ``processor``: the folder's own processor (a tokenizer, image processor, feature extractor, or a
  processor holding several, loaded offline as transformers loads it) applied to normfold's samples
  (:mod:`normfold.hf.samples`), kept only when it makes every main input the config route would
  (token ids, pixels, audio) and the model runs on them;
- ``config``: :func:`normfold.hf.inputs.example_inputs_for`, with the reason the processor route was
  not taken (no processor in the folder, its processor failed, or the model refused what it made).

``normfold analyze``, ``fold`` and ``verify`` take the same route for the same folder, and the report
names it (``example_inputs``).
"""
from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._deps import require
from .._text import first_line
from ..engine.graph import eval_mode
from .inputs import (MAIN_INPUTS, TOKENIZER_FILES, example_inputs_for, least_sequence_length, max_positions,
                     with_call_options)
from .load import check_model_dir
from .samples import SAMPLE_TEXTS, sample_audio, sample_images

PROCESSOR, CONFIG = "processor", "config"  # the two routes

# a folder holds a processor when it has one of these (transformers would otherwise build none, or an empty one)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", *TOKENIZER_FILES)
SAMPLE_TOKENS = 16  # the most tokens a sample text becomes: the fold is exact token by token, each costs proof time
_AUDIO_INPUTS = ("input_values", "input_features")


@dataclass(frozen=True)
class FolderInputs:
    """A folder's example inputs (keyword inputs of one forward pass), the ``route`` that made them
    (:data:`PROCESSOR` or :data:`CONFIG`), the ``processor`` class that made them (processor route) and
    ``why`` the processor route was not taken (config route)."""

    inputs: dict[str, Any]
    route: str
    processor: str | None = None
    why: str | None = None

    def describe(self) -> dict[str, Any]:
        """The report's ``example_inputs`` section: route, processor, why, and the inputs' names."""
        return {"route": self.route, "processor": self.processor, "why": self.why, "names": sorted(self.inputs)}


class _NotFromProcessor(Exception):
    """Why the processor route gives no inputs (the config route's ``why``)."""


def folder_example_inputs(model: nn.Module, model_dir: str | os.PathLike, *,
                          trust_remote_code: bool = False) -> FolderInputs:
    """The example inputs of ``model``, loaded from ``model_dir``: its processor's, else its config's
    (module docstring). Never raises for the processor: every failure of it is the config route's ``why``."""
    path = check_model_dir(model_dir)
    config_inputs = example_inputs_for(model)
    try:
        processor = _load_processor(path, trust_remote_code)
        inputs = _processor_inputs(model, processor, config_inputs)
    except _NotFromProcessor as why:
        return FolderInputs(config_inputs, CONFIG, why=str(why))
    return FolderInputs(inputs, PROCESSOR, processor=type(processor).__name__)


# the loaders tried in turn: the whole processor, else one part alone (AutoProcessor wants every part its
# model type names: a Wav2Vec2 folder with only a feature extractor does not load as Wav2Vec2Processor)
_LOADERS = ("AutoProcessor", "AutoImageProcessor", "AutoFeatureExtractor", "AutoTokenizer")


def _load_processor(path, trust_remote_code: bool):
    """The folder's processor as the first of :data:`_LOADERS` that loads it offline; the first one's
    error when none does."""
    if not any((path / name).is_file() for name in PROCESSOR_FILES):
        raise _NotFromProcessor(f"no processor in the folder (none of {', '.join(PROCESSOR_FILES)})")
    transformers = require("transformers")
    has_tokenizer = any((path / name).is_file() for name in TOKENIZER_FILES)
    errors = []
    for loader in _LOADERS:
        try:
            processor = getattr(transformers, loader).from_pretrained(path, local_files_only=True,
                                                                      trust_remote_code=trust_remote_code)
        except Exception as err:  # noqa: BLE001  the processor's own code, whatever it raises: the config route says it
            errors.append(f"{loader}: {type(err).__name__}: {first_line(err)}")
            continue
        tokenizer = (processor if isinstance(processor, transformers.PreTrainedTokenizerBase)
                     else getattr(processor, "tokenizer", None))
        if tokenizer is not None and not has_tokenizer:
            # transformers 5 builds an empty tokenizer from config.json alone (CLIPProcessor's too): no tokens
            errors.append(f"{loader} gave a tokenizer without vocabulary (no tokenizer file)")
        elif processor is not None and callable(processor):
            return processor
        else:
            errors.append(f"{loader} gave {type(processor).__name__}")
    raise _NotFromProcessor(f"the folder's processor does not load: {errors[0]}")


def _processor_inputs(model: nn.Module, processor, config_inputs: dict[str, Any]) -> dict[str, Any]:
    """What ``processor`` makes of the samples the forward needs, kept to the forward's parameters,
    completed (:func:`normfold.hf.inputs.with_call_options`) and run once through ``model``."""
    params = inspect.signature(type(model).forward).parameters
    name = type(processor).__name__
    try:
        made = _apply(processor, model, {k for k in MAIN_INPUTS if k in config_inputs})
    except Exception as err:  # noqa: BLE001  the processor's own code, whatever it raises
        raise _NotFromProcessor(f"{name} fails on normfold's samples: {type(err).__name__}: {first_line(err)}") from err
    if not isinstance(made, Mapping):  # IdeficsImageProcessor returns the pixel tensor itself
        raise _NotFromProcessor(f"{name} returns a {type(made).__name__}, not named inputs")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v
              for k, v in made.items() if k in params and isinstance(v, torch.Tensor)}
    missing = [k for k in MAIN_INPUTS if k in config_inputs and k not in inputs]
    if missing:
        raise _NotFromProcessor(f"{name} makes no {', '.join(missing)} (it makes {', '.join(sorted(made)) or 'nothing'})")
    least, why = least_sequence_length(model.config)
    if "input_ids" in inputs and inputs["input_ids"].shape[-1] < least:
        raise _NotFromProcessor(f"{name} makes {inputs['input_ids'].shape[-1]} tokens of the samples; {why}")
    inputs = with_call_options(inputs, model.config, params)
    try:
        with torch.no_grad(), eval_mode(model):
            model(**inputs)
    except Exception as err:  # noqa: BLE001  the model's own code, whatever it raises
        raise _NotFromProcessor(f"the model refuses {name}'s inputs ({', '.join(sorted(inputs))}): "
                                f"{type(err).__name__}: {first_line(err)}") from err
    return inputs


def _apply(processor, model: nn.Module, wanted: set[str]):
    """``processor`` on the samples of each modality in ``wanted`` (main input names), by its kind."""
    transformers = require("transformers")
    text, images, audio = "input_ids" in wanted, "pixel_values" in wanted, bool(wanted & set(_AUDIO_INPUTS))
    max_length = min(max_positions(model.config.get_text_config()) or SAMPLE_TOKENS, SAMPLE_TOKENS)
    if isinstance(processor, transformers.PreTrainedTokenizerBase):
        return _tokenize(processor, max_length)
    if isinstance(processor, transformers.ImageProcessingMixin):
        return processor(images=sample_images(), return_tensors="pt")
    if isinstance(processor, transformers.FeatureExtractionMixin):
        rate = getattr(processor, "sampling_rate", 16000)
        return processor(sample_audio(rate), sampling_rate=rate, return_tensors="pt")
    if not isinstance(processor, transformers.ProcessorMixin):
        raise TypeError(f"expected a tokenizer, image processor, feature extractor or processor, got {type(processor)}")
    kwargs: dict[str, Any] = {"return_tensors": "pt"}
    if images:
        kwargs["images"] = sample_images()
    if audio:
        extractor = getattr(processor, "feature_extractor", None)
        kwargs["audio"] = sample_audio(getattr(extractor, "sampling_rate", 16000))
    if text:
        token = getattr(processor, "image_token", None)  # models that merge image features where it stands
        lead = token if images and isinstance(token, str) else ""
        kwargs.update(text=[lead + t for t in SAMPLE_TEXTS], padding=True)
        if not lead:
            kwargs.update(truncation=True, max_length=max_length)
    return processor(**kwargs)


def _tokenize(tokenizer, max_length: int) -> dict[str, torch.Tensor]:
    """The sample texts as (2, T) tensors: padded where the tokenizer pads, else cut to the shorter one
    (GPT-2's tokenizer has no pad token)."""
    if tokenizer.pad_token is not None:
        return tokenizer(list(SAMPLE_TEXTS), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    encoded = tokenizer(list(SAMPLE_TEXTS), truncation=True, max_length=max_length)
    length = min(len(ids) for ids in encoded["input_ids"])
    return {k: torch.tensor([row[:length] for row in rows]) for k, rows in encoded.items()}
