"""What is timed: the contenders (original, A/A control, folded, folded+fused) and one call per shape.

``seq = 1`` is a decode step: one token after ``BenchConfig.prefill`` tokens in the KV cache, which is
cropped back after every step, outside the timed region; longer sequences are prefills, images one
forward of ``pixel_values``.
"""
from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from ..engine import fold
from ..fuse import fuse_residual_norms
from ..hf.inputs import example_inputs_for
from .config import BenchConfig


def prepare_contenders(model: nn.Module, example_inputs, *, control: bool = True) -> tuple[dict[str, nn.Module], dict]:
    """``{"original", "control", "folded", "fused"}`` models (eval mode) and what fold / fuse reported.

    ``control`` is a deep copy of the original (left out with ``control=False``).
    """
    model = model.eval()
    folded, fold_report = fold(model, example_inputs)
    fused, fuse_report = fuse_residual_norms(folded, example_inputs)
    info = {"num_norms": fold_report.num_norms, "num_rms": sum(e.foldable for e in fold_report.norms),
            "num_fused": len(fuse_report.fused)}
    contenders = {"original": model}
    if control:
        contenders["control"] = copy.deepcopy(model).eval()
    contenders.update(folded=folded.eval(), fused=fused.eval())
    return contenders, info


def cache_argument(model: nn.Module) -> str | None:
    """The forward's KV-cache keyword (transformers 5 says ``cache``, 4 ``past_key_values``), None if none."""
    params = _forward_params(model)
    can_generate = getattr(model, "can_generate", None)
    if "input_ids" not in params or not (callable(can_generate) and can_generate()):
        return None  # encoders (BERT) take a cache argument for cross-attention but return none
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def _forward_params(model: nn.Module):
    """The parameters of the model class's ``forward``."""
    return inspect.signature(type(model).forward).parameters


def workloads(model: nn.Module, config: BenchConfig):
    """(batch, seq, kind, make_call) per shape; ``make_call(m)`` returns ``(call, reset)`` for contender m."""
    params = _forward_params(model)
    if "pixel_values" in params:
        for b in config.batches:
            inputs = example_inputs_for(model, batch=b, seed=config.seed)
            yield b, inputs["pixel_values"].shape[-1], "image", plain_call(inputs)
        return
    causal = cache_argument(model) is not None
    for b in config.batches:
        seen = set()  # lengths past the model's position limit are clipped to it: measure each once
        for t in config.seqs:
            if t == 1:
                if causal:
                    yield b, 1, "decode", decode_call(model, b, config)
                continue
            inputs = example_inputs_for(model, batch=b, seq=t, seed=config.seed)
            length = inputs["input_ids"].shape[-1]
            if length not in seen:
                seen.add(length)
                yield b, length, "prefill", plain_call(inputs)


def plain_call(inputs: dict):
    """``make(m) -> (call, reset)``: one forward of ``m`` on ``inputs`` (a prefill or an image), nothing to reset."""
    def make(m: nn.Module):
        # A prefill as generation runs it: logits for the last position only, where the model offers
        # that (transformers' ``logits_to_keep``); otherwise the vocabulary projection of every
        # position (50k × 768 per token for GPT-2) would be most of what is timed.
        kwargs = dict(inputs, logits_to_keep=1) if "logits_to_keep" in _forward_params(m) else inputs
        return (lambda: m(**kwargs)), (lambda: None)
    return make


def decode_call(model: nn.Module, batch: int, config: BenchConfig):
    """One new token per call, on a KV cache holding ``prefill`` tokens (cropped back after each call)."""
    # one position short of the model's limit at most (example_inputs_for clips to it): the timed token needs one
    prompt = example_inputs_for(model, batch=batch, seq=config.prefill + 1, seed=config.seed)["input_ids"][:, :-1]
    prefill = prompt.shape[-1]
    token = prompt[:, -1:]  # (B, 1)

    cache_arg = cache_argument(model)
    extra = {"position_ids": torch.full((batch, 1), prefill)} if "position_ids" in _forward_params(model) else {}

    def make(m: nn.Module):
        with torch.no_grad():
            out = m(input_ids=prompt, use_cache=True)
        cache = out[cache_arg] if cache_arg in out else out["past_key_values"]

        def call():
            return m(input_ids=token, use_cache=True, **{cache_arg: cache}, **extra)

        def reset():
            grown = cache.get_seq_length() - prefill
            if grown > 0:
                cache.crop(-grown)
        return call, reset
    return make
