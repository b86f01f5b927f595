"""Hadamard matrices of any order this module can build, and the randomised Hadamard rotation.

A Hadamard matrix H of order n has entries ±1 and H·Hᵀ = n·I, so H/√n is orthogonal. Orders
that are a power of two come from Sylvester's doubling; others from a Kronecker product
H_{2^a} ⊗ H_m with a Paley matrix H_m (m = q + 1 for a prime q ≡ 3 mod 4, Paley I; m = 2(q + 1)
for a prime q ≡ 1 mod 4, Paley II), which covers the usual model widths (768 = 2 · 384,
384 = 383 + 1; 5120 = 2⁸ · 20, 20 = 19 + 1). Other orders have no matrix here (none exists unless
n is 1, 2 or a multiple of 4): callers fall back to a random orthogonal matrix and say so.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def sylvester(n: int) -> Tensor:
    """The Sylvester Hadamard matrix of order ``n`` (a power of two): H_{2k} = [[H_k, H_k], [H_k, −H_k]]."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester's construction needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> Tensor:
    """Q[i, j] = χ(j − i), χ the quadratic character mod the prime q (0 at 0, ±1 elsewhere)."""
    residues = {x * x % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in residues else -1.0 for a in range(1, q)], dtype=torch.float64)
    index = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[index]


def paley(m: int) -> Tensor | None:
    """A Paley Hadamard matrix of order ``m``, or None when ``m`` is not q + 1 (q ≡ 3 mod 4 prime) or
    2(q + 1) (q ≡ 1 mod 4 prime)."""
    q = m - 1
    if q % 4 == 3 and _is_prime(q):  # Paley I: H = I + [[0, 1ᵀ], [−1, Q]] (Q antisymmetric)
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return torch.eye(m, dtype=torch.float64) + s
    q = m // 2 - 1
    if m % 2 == 0 and q % 4 == 1 and _is_prime(q):  # Paley II: C ⊗ [[1, 1], [1, −1]] + I ⊗ [[1, −1], [−1, −1]]
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)  # symmetric conference matrix
        plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, plus) + torch.kron(torch.eye(q + 1, dtype=torch.float64), minus)
    return None


def hadamard(n: int) -> tuple[Tensor, str] | None:
    """(H, how it was built) with H a ±1 matrix of order ``n``, H·Hᵀ = n·I; None when no
    construction here reaches ``n``."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"a Hadamard order must be a positive int, got {n!r}")
    power = n & -n  # the largest power of two dividing n: the Paley factor stays as small as it can
    while power >= 1:
        m = n // power
        base = sylvester(1) if m == 1 else paley(m)
        if base is not None:
            h = torch.kron(sylvester(power), base)  # H_a ⊗ H_b is Hadamard: (A⊗B)(A⊗B)ᵀ = AAᵀ ⊗ BBᵀ
            return h, (f"Sylvester {n}" if m == 1 else f"Sylvester {power} ⊗ Paley {m}" if power > 1 else f"Paley {m}")
        power //= 2
    return None


def randomized_hadamard(n: int, generator: torch.Generator) -> tuple[Tensor, str] | None:
    """(Q, how) with Q = diag(s)·H/√n, s a seeded vector of random signs (QuaRot's randomised
    Hadamard, orthogonal); None when :func:`hadamard` has no matrix of order ``n``."""
    built = hadamard(n)
    if built is None:
        return None
    h, how = built
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64).to(torch.float64) * 2 - 1
    return signs[:, None] * h / math.sqrt(n), f"randomised Hadamard ({how}) with seeded signs"
