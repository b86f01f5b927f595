"""Fixtures of the bench tests: a tiny GPT-2, and one quick benchmark run whose rows several tests read."""
from __future__ import annotations

from dataclasses import replace

import pytest

import tiny_models


@pytest.fixture(scope="session")
def tiny_gpt2():
    """A function that builds a fresh tiny GPT-2 (1 layer, width 32, 64 positions), the same weights every call."""
    def build():
        return tiny_models.tiny_gpt2(n_layer=1, vocab_size=100, n_positions=64, attn_implementation="eager").eval()
    return build


@pytest.fixture(scope="session")
def quick_rows(tiny_gpt2):
    """The rows of one QUICK run (3 rounds) on the tiny GPT-2: decode and a 16-token prefill."""
    from normfold.bench import QUICK, bench_model

    return bench_model(tiny_gpt2(), replace(QUICK, rounds=3), name="tiny")
