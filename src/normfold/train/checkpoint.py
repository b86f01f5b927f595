"""Checkpoints: a Hugging Face GPT-2 folder when the architecture is GPT-2's, else a torch file.

A GPT-2 folder (``GPT2LMHeadModel.save_pretrained``) is what ``normfold fold`` and the rest of
the ecosystem read. A CBWC model is saved as its LayerNorm twin (free weights W, LayerNorm with
the same γ/β): the two compute the same function, and folding the twin gives back the RMSNorm model.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from .model import GPT, GPTConfig

_GPT2_NORMS = ("layernorm", "layernorm_handrolled", "cbwc_rmsnorm")


def gpt2_incompatibility(config: GPTConfig) -> str | None:
    """Why this architecture has no GPT-2 equivalent, or None when it has one."""
    if config.norm not in _GPT2_NORMS:
        return f"norm={config.norm!r} (GPT-2 uses LayerNorm)"
    if config.placement != "pre":
        return f"placement={config.placement!r} (GPT-2 is Pre-LN)"
    if config.qk_norm:
        return "qk_norm=True (GPT-2 has no QK-norm)"
    if not config.bias:
        return "bias=False (GPT-2 has biases)"
    if not config.tie_embeddings:
        return "tie_embeddings=False (GPT-2 ties lm_head to wte)"
    return None


def _free_state(model: GPT, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """State dict (``state``, else the model's own) with CBWC parametrizations read as their free tensors
    (the LayerNorm twin)."""
    free = {}
    for name, tensor in (model.state_dict() if state is None else state).items():
        name = name.replace(".parametrizations.", ".").replace(".weight.original", ".weight").replace(
            ".bias.original", ".bias")
        free[name] = tensor.detach()
    return free


def to_gpt2(model: GPT, state: dict[str, torch.Tensor] | None = None):
    """The equivalent ``transformers.GPT2LMHeadModel`` (eager attention, fp32 weights copied from ``state``,
    else from the model's own state dict)."""
    reason = gpt2_incompatibility(model.config)
    if reason is not None:
        raise ValueError(f"this model has no GPT-2 equivalent: {reason}")
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("saving Hugging Face checkpoints needs transformers: pip install 'normfold[hf]'") from e
    c = model.config
    hf_config = GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        n_inner=4 * c.n_embd, activation_function="gelu_new", resid_pdrop=c.dropout, embd_pdrop=c.dropout,
        attn_pdrop=c.dropout, layer_norm_epsilon=c.norm_eps, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )
    hf = GPT2LMHeadModel(hf_config)
    hf_state = {}
    for name, tensor in _free_state(model, state).items():
        if name == "lm_head.weight":
            continue  # tied to wte
        # GPT-2's Conv1D stores (in, out): the transpose of nn.Linear's (out, in)
        if name.endswith(".weight") and any(k in name for k in ("c_attn", "c_proj", "c_fc")):
            tensor = tensor.t()
        hf_state[name] = tensor.to(torch.float32).contiguous()
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GPT-2 conversion is out of sync with the model: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf


def save_checkpoint(model: nn.Module, directory: str | Path, *, state: dict[str, torch.Tensor] | None = None) -> str:
    """Save ``model`` under ``directory``; returns ``"gpt2"`` (a Hugging Face folder) or ``"torch"``
    (``model.pt`` + ``config.json``, for architectures GPT-2 cannot express). ``state``: the model's whole
    state dict where its own is sharded (FSDP2: ``parallel.full_model_state``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if gpt2_incompatibility(model.config) is None:
        to_gpt2(model, state).save_pretrained(directory)
        return "gpt2"
    torch.save(_free_state(model, state), directory / "model.pt")
    (directory / "config.json").write_text(json.dumps({"normfold_gpt": asdict(model.config)}, indent=2))
    return "torch"
