"""Decoders exported with their KV cache, and greedy generation with them in ONNX Runtime.

A causal LM of transformers keeps its cache in a ``DynamicCache`` object, which the exporter cannot take
as a graph input. :class:`DecoderWithCache` takes the cache as flat tensors, builds the cache object
for the model and returns the grown cache flat again, with optimum's names:

    inputs   input_ids (batch, sequence), attention_mask (batch, total_sequence),
             position_ids (batch, sequence) where the model takes them,
             past_key_values.{i}.key / .value (batch, heads, past_sequence, head_dim)
    outputs  logits (batch, sequence, vocab), present.{i}.key / .value (batch, heads, past_sequence + sequence, head_dim)

total_sequence = past_sequence + sequence. The first call of a generation loop feeds an empty cache
(past_sequence 0), so one graph serves the prompt and every next token (:func:`generate_greedy_ort`).
"""
from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .._deps import require
from ..engine.graph import eval_mode

__all__ = ["KV_CACHE_MODEL_TYPES", "PAST_AXIS", "TOTAL_AXIS", "DecoderWithCache", "check_decoder", "ExportCalls",
           "cache_calls", "position_ids_from_mask", "generate_greedy_ort"]

# the architectures whose cache is one (key, value) pair of (batch, heads, positions, head_dim) per layer
# in a DynamicCache, checked by tests/export/test_kv_cache.py
KV_CACHE_MODEL_TYPES = ("gpt2", "opt", "bloom")
PAST_AXIS, TOTAL_AXIS = "past_sequence", "total_sequence"


def check_decoder(model: nn.Module) -> None:
    """ValueError unless ``model`` is a transformers causal LM of an architecture in :data:`KV_CACHE_MODEL_TYPES`."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    can_generate = getattr(model, "can_generate", None)
    if model_type not in KV_CACHE_MODEL_TYPES or not callable(can_generate) or not can_generate():
        raise ValueError(f"kv_cache=True exports a transformers causal LM of type {', '.join(KV_CACHE_MODEL_TYPES)} "
                         f"(GPT2LMHeadModel, OPTForCausalLM, BloomForCausalLM); got {type(model).__name__}"
                         + (f" (model_type {model_type!r})" if model_type else ""))


def _takes_position_ids(model: nn.Module) -> bool:
    return "position_ids" in inspect.signature(model.forward).parameters


class DecoderWithCache(nn.Module):
    """A causal LM called with its cache as flat tensors: ``forward(input_ids, attention_mask, position_ids,
    past_key_values)`` with ``past_key_values`` the list key 0, value 0, key 1, ...; returns
    ``{"logits", "present.0.key", "present.0.value", ...}`` (the cache after this call)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config  # errors name the model by its type (engine.errors.model_name)
        self.takes_position_ids = _takes_position_ids(model)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None,
                past_key_values: list[Tensor]) -> dict[str, Tensor]:
        cache_utils = require("transformers.cache_utils")
        pairs = [(past_key_values[i], past_key_values[i + 1]) for i in range(0, len(past_key_values), 2)]
        cache = cache_utils.DynamicCache(ddp_cache_data=pairs, config=self.config)
        extra = {"position_ids": position_ids} if self.takes_position_ids else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True, **extra)
        result = {"logits": out.logits}
        for i, layer in enumerate(out.cache.layers):
            result[f"present.{i}.key"], result[f"present.{i}.value"] = layer.keys, layer.values
        return result


class ExportCalls(NamedTuple):
    """How a model is exported and proved: ``traced`` the call the exporter traces, ``calls`` the calls
    the proof compares, ``axes`` each graph input's dynamic axes (dim -> name), ``dynamic_shapes``
    torch.export's (None: fixed shapes), ``input_names`` the graph inputs' (None: the exporter's)."""

    traced: tuple[tuple, dict]
    calls: list[tuple[tuple, dict]]
    axes: list[dict[int, str]]
    dynamic_shapes: dict[str, Any] | None
    input_names: list[str] | None


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Each token's position: how many unmasked tokens precede it (0 at padding), as transformers'
    ``generate`` computes it."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def cache_calls(decoder: DecoderWithCache, example: dict) -> ExportCalls:
    """The calls that export and prove ``decoder`` from a causal LM's example (``input_ids``, optional
    ``attention_mask``; other keys such as ``use_cache`` are ignored): the prompt with an empty cache, and
    new tokens after the prompt's cache (as many as neither the batch nor the prompt, so the traced sizes
    tell the axes apart).
    """
    ids = example.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.shape[1] < 2:
        got = f"shape {tuple(ids.shape)} {ids.dtype}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"kv_cache=True needs example input_ids: integer token ids of shape (batch, sequence >= 2); "
                         f"got {got}")
    mask = example.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    if not isinstance(mask, Tensor) or mask.shape != ids.shape:
        got = f"shape {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"kv_cache=True needs the example attention_mask in input_ids' shape {tuple(ids.shape)}; "
                         f"got {got}")
    batch, length = ids.shape
    with eval_mode(decoder), torch.no_grad():
        prompt = _call(decoder, ids, mask, _empty_cache(decoder, ids, mask))
        past = list(decoder(*prompt[0]).values())[1:]
    new = next(n for n in range(2, batch + length + 4) if n not in (batch, length) and length + n != batch)
    new_ids = ids.repeat(1, new)[:, :new].flip(1)
    traced = _call(decoder, new_ids, torch.cat([mask, torch.ones_like(new_ids)], dim=1), past)
    past_names = [f"past_key_values.{i // 2}.{'key' if i % 2 == 0 else 'value'}" for i in range(len(past))]
    names = ["input_ids", "attention_mask", *(["position_ids"] if decoder.takes_position_ids else []), *past_names]
    token_axes, past_axes = {0: "batch", 1: "sequence"}, {0: "batch", 2: PAST_AXIS}
    axes = [token_axes, {0: "batch", 1: TOTAL_AXIS}, *([token_axes] if decoder.takes_position_ids else []),
            *[past_axes] * len(past)]
    shapes = {"input_ids": token_axes, "attention_mask": axes[1],
              "position_ids": token_axes if decoder.takes_position_ids else None,
              "past_key_values": [past_axes] * len(past)}
    return ExportCalls(traced, [prompt, traced], axes, shapes, names)


def _empty_cache(decoder: DecoderWithCache, ids: Tensor, mask: Tensor) -> list[Tensor]:
    """A cache of no positions in the shapes the model's own cache has (read from one call without one)."""
    with torch.no_grad():
        out = decoder.model(input_ids=ids[:, :1], attention_mask=mask[:, :1], use_cache=True)
    return [t[:, :, :0] for layer in out.cache.layers for t in (layer.keys, layer.values)]


def _call(decoder: DecoderWithCache, ids: Tensor, mask: Tensor, past: list[Tensor]) -> tuple[tuple, dict]:
    """``decoder``'s call for new tokens ``ids`` after ``past``; ``mask`` covers past and new tokens."""
    positions = position_ids_from_mask(mask)[:, -ids.shape[1]:] if decoder.takes_position_ids else None
    return (ids, mask, positions, past), {}


def generate_greedy_ort(session, input_ids: Tensor, max_new_tokens: int, *, attention_mask: Tensor | None = None,
                        eos_token_id: int | None = None, pad_token_id: int | None = None) -> Tensor:
    """Greedy generation with an ONNX Runtime session of a decoder exported with ``kv_cache=True``: the
    prompt with an empty cache, then one token a call with the cache the previous call returned.

    Returns the prompt and the new tokens, ``(batch, prompt + new)``, as transformers' ``generate(do_sample=
    False)``: after ``eos_token_id`` a row gets ``pad_token_id`` (default the eos), and generation stops
    early once every row has ended. ``attention_mask``: 0 at (left) padding of the prompt.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    inputs = {i.name: i for i in session.get_inputs()}
    past_names = [n for n in inputs if n.startswith("past_key_values.")]
    if "input_ids" not in inputs or not past_names:
        raise ValueError(f"the session is not a decoder exported with its KV cache: its inputs are "
                         f"{', '.join(inputs)} (expected input_ids, attention_mask, past_key_values.{{i}}.key/value)")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = f"shape {tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, Tensor) else \
            type(input_ids).__name__
        raise ValueError(f"input_ids must be integer token ids of shape (batch, sequence), got {got}")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(mask.shape)}")
    batch = input_ids.shape[0]
    past = {n: _empty_past(inputs[n], batch) for n in past_names}
    pad = eos_token_id if pad_token_id is None else pad_token_id
    tokens, new, done = input_ids, input_ids, torch.zeros(batch, dtype=torch.bool)
    for _ in range(max_new_tokens):
        feed = {"input_ids": new, "attention_mask": mask} | past
        if "position_ids" in inputs:
            feed["position_ids"] = position_ids_from_mask(mask)[:, -new.shape[1]:]
        outputs = dict(zip([o.name for o in session.get_outputs()],
                           session.run(None, {n: _numpy(v) for n, v in feed.items()})))
        next_token = torch.from_numpy(outputs["logits"][:, -1]).argmax(-1)
        if eos_token_id is not None:
            next_token = torch.where(done, torch.full_like(next_token, pad), next_token)
            done = done | (next_token == eos_token_id)
        new = next_token[:, None].to(input_ids.dtype)
        tokens, mask = torch.cat([tokens, new], dim=1), torch.cat([mask, torch.ones_like(new)], dim=1)
        past = {n: outputs[n.replace("past_key_values.", "present.")] for n in past_names}
        if done.all():
            break
    return tokens


def _empty_past(value_info, batch: int):
    """A zero-length cache tensor for one ``past_key_values`` input (heads and head_dim from its shape)."""
    numpy = require("numpy")
    dtypes = {"tensor(float)": numpy.float32, "tensor(double)": numpy.float64, "tensor(float16)": numpy.float16}
    if value_info.type not in dtypes:  # numpy has no bfloat16
        raise ValueError(f"generate_greedy_ort feeds caches of type {', '.join(dtypes)}; {value_info.name} is "
                         f"{value_info.type}")
    dtype = dtypes[value_info.type]
    _, heads, _, head_dim = value_info.shape
    return numpy.zeros((batch, heads, 0, head_dim), dtype=dtype)


def _numpy(value):
    return value.detach().cpu().numpy() if isinstance(value, Tensor) else value
