"""Tests' one factory for tiny transformers GPT-2s (random weights, no hub): the sizes a test relies on are
passed explicitly, everything else is the factory's small default. Import as ``from tiny_models import ...``
(tests/ is on sys.path, ``tests/conftest.py``); a test without transformers installed is skipped."""
from __future__ import annotations

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


def nontrivial_layer_norms(model):
    """γ in [0.5, 1.5], β ~ N(0, 0.1) in every LayerNorm: folding γ/β is then tested, not skipped
    (γ = 1, β = 0 at init would hide affine bugs). Returns the model."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
    return model
