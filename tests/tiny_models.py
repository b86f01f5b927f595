"""Tests' one factory for tiny transformers models (random weights, no hub): GPT-2, BLOOM, the RMSNorm
families, and non-trivial LayerNorm γ/β. The sizes a test relies on are passed explicitly, everything
else is the factory's small default. Import as ``from tiny_models import ...``
(tests/ is on sys.path, ``tests/conftest.py``); a test without transformers installed is skipped."""
from __future__ import annotations

import copy

import pytest
import torch

# small enough to fold and prove in float64 in well under a second, wide enough for 2 heads
TINY_GPT2 = {"vocab_size": 96, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}


def tiny_gpt2_config(**overrides):
    """A ``transformers.GPT2Config`` of :data:`TINY_GPT2`'s sizes with ``overrides`` (any GPT2Config keyword)."""
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2Config(**{**TINY_GPT2, **overrides})


def tiny_gpt2(seed: int | None = 0, **overrides):
    """A ``GPT2LMHeadModel`` of :func:`tiny_gpt2_config` (lm_head tied to the token embedding), its weights
    drawn after ``torch.manual_seed(seed)`` (None: from the RNG as it stands). In train mode, as
    transformers builds it: a test that compares outputs calls ``.eval()``."""
    transformers = pytest.importorskip("transformers")
    config = tiny_gpt2_config(**overrides)
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


# BLOOM: ALiBi instead of positions, an embedding LayerNorm, one fused query_key_value projection
TINY_BLOOM = {"vocab_size": 96, "hidden_size": 32, "n_layer": 2, "n_head": 2}


def tiny_bloom_config(**overrides):
    """A ``transformers.BloomConfig`` of :data:`TINY_BLOOM`'s sizes with ``overrides`` (any BloomConfig keyword)."""
    transformers = pytest.importorskip("transformers")
    return transformers.BloomConfig(**{**TINY_BLOOM, **overrides})


# the RMSNorm families (LLaMA's and its descendants'): their norms are Python classes written out as ops
TINY_RMS = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
RMS_FAMILIES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "gemma": "GemmaConfig",
                "phi3": "Phi3Config", "olmo2": "Olmo2Config"}


def tiny_rms_lm(family: str, seed: int = 0, **overrides):
    """A tiny causal LM of an RMSNorm ``family`` (:data:`RMS_FAMILIES`) in eval mode, every norm's γ
    drawn in [0.5, 1.5] (Gemma's stored w of (1 + w) in [-0.5, 0.5]) so that moving γ is tested."""
    transformers = pytest.importorskip("transformers")
    extra = {"head_dim": 8} if family == "gemma" else {}
    config = getattr(transformers, RMS_FAMILIES[family])(**{**TINY_RMS, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(-0.5, 0.5) if family == "gemma" else module.weight.uniform_(0.5, 1.5)
    return model


def rms_norm_math(model, dtype=torch.float64):
    """A copy of ``model`` in ``dtype`` whose RMSNorm classes compute their math written here, without
    casts: x·rsqrt(mean(x², -1) + eps)·(offset + γ) (offset 1 for Gemma's): the reference a float64
    proof of a recognised RMSNorm is held to, written independently of normfold."""
    class Math(torch.nn.Module):
        def __init__(self, weight, eps, offset):
            super().__init__()
            self.weight, self.eps, self.offset = weight, eps, offset

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (self.offset + self.weight)

    reference = copy.deepcopy(model).to(dtype)
    for path, module in list(reference.named_modules()):
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
            reference.set_submodule(path, Math(module.weight, eps, 1.0 if name == "GemmaRMSNorm" else 0.0))
    return reference


def tiny_olmo(seed: int = 0):
    """A tiny ``OlmoForCausalLM`` (:data:`TINY_RMS`'s sizes) in eval mode: its ``OlmoLayerNorm`` modules are
    parameter-free layer norms of their input cast to float32, cast back."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    return transformers.OlmoForCausalLM(transformers.OlmoConfig(**TINY_RMS)).eval()


def olmo_layer_norm_math(model, dtype=torch.float64):
    """A copy of ``model`` in ``dtype`` whose OlmoLayerNorms compute (x − mean)/√(var + 1e-5) written
    here, without casts: the reference a float64 proof of OLMo's cast LayerNorm is held to."""
    class Math(torch.nn.Module):
        def forward(self, x):
            centered = x - x.mean(-1, keepdim=True)
            return centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5)

    reference = copy.deepcopy(model).to(dtype)
    for path, module in list(reference.named_modules()):
        if type(module).__name__ == "OlmoLayerNorm":
            reference.set_submodule(path, Math())
    return reference


def lm_call(batch: int, seq: int, seed: int) -> dict:
    """A causal LM call of seeded token ids (above the tiny configs' special tokens), without a cache."""
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, TINY_RMS["vocab_size"], (batch, seq), generator=generator),
            "use_cache": False}


def lm_logits(model, call: dict):
    """``model(**call).logits`` without gradients."""
    with torch.no_grad():
        return model(**call).logits


def nontrivial_layer_norms(model):
    """γ in [0.5, 1.5], β ~ N(0, 0.1) in every LayerNorm: folding γ/β is then tested, not skipped
    (γ = 1, β = 0 at init would hide affine bugs). Returns the model."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
    return model
