"""Hadamard matrices: ±1 entries, H·Hᵀ = n·I, for every order the builder claims; none where none can exist."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from normfold.rotate.hadamard import hadamard, paley, randomized_hadamard, sylvester


def _is_hadamard(h: torch.Tensor) -> bool:
    n = h.shape[0]
    return h.shape == (n, n) and bool(((h == 1) | (h == -1)).all()) and torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype))


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=400))
def test_every_matrix_the_builder_returns_is_hadamard_of_the_order_asked(n: int):
    built = hadamard(n)
    if built is None:
        return
    h, how = built
    assert _is_hadamard(h) and h.shape == (n, n), how


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=4), st.sampled_from([1, 12, 20, 28, 36, 44, 60]))
def test_widths_of_real_models_are_reached_without_a_fallback(power: int, base: int):
    # 2^a times a Paley order: the same construction covers 768 (64·12), 1280 (64·20), 5120 (256·20), ...
    n = 2 ** power * base
    built = hadamard(n)
    assert built is not None and _is_hadamard(built[0]), n


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=1, max_value=200))
def test_no_matrix_for_orders_where_no_hadamard_matrix_exists(k: int):
    # A Hadamard matrix of order n > 2 needs 4 | n: odd orders and orders ≡ 2 (mod 4) get None (the fallback)
    for n in (2 * k + 1, 4 * k + 2):
        if n > 2:
            assert hadamard(n) is None, n


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([2, 4, 12, 24, 32, 48, 96, 128]), st.integers(min_value=0, max_value=2**31 - 1))
def test_randomized_hadamard_is_orthogonal_seeded_and_not_the_plain_matrix(n: int, seed: int):
    q, how = randomized_hadamard(n, torch.Generator().manual_seed(seed))
    again, _ = randomized_hadamard(n, torch.Generator().manual_seed(seed))
    assert torch.equal(q, again)  # same seed, same Q
    assert (q.T @ q - torch.eye(n, dtype=torch.float64)).abs().max() <= 1e-12
    assert torch.allclose(q.abs(), torch.full_like(q, 1 / math.sqrt(n)))
    assert "randomised Hadamard" in how


def test_different_seeds_flip_different_signs():
    a, _ = randomized_hadamard(64, torch.Generator().manual_seed(0))
    b, _ = randomized_hadamard(64, torch.Generator().manual_seed(1))
    assert not torch.equal(a, b)


def test_paley_gives_none_for_orders_it_cannot_build():
    assert paley(16) is None  # 15 is not prime, 7 is ≡ 3 (mod 4): neither Paley I nor II
    assert paley(12) is not None and paley(28) is not None  # Paley I (q = 11), Paley II (q = 13)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, "8"])
def test_bad_orders_raise_value_error(bad):
    with pytest.raises(ValueError, match="positive int"):
        hadamard(bad)


def test_sylvester_refuses_a_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        sylvester(12)
