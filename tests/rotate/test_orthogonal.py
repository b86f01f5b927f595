"""Seeded Haar matrices and PCA bases: orthogonal to 1e-12, reproducible, ordered by energy."""
from __future__ import annotations

import pytest
import torch

from normfold.rotate.orthogonal import haar_orthogonal, orthogonality_error, pca_basis


@pytest.mark.parametrize("n", [1, 5, 32, 100])
def test_haar_matrix_is_orthogonal_seeded_and_not_the_identity(n: int):
    q = haar_orthogonal(n, torch.Generator().manual_seed(3))
    assert orthogonality_error(q) <= 1e-12
    assert torch.equal(q, haar_orthogonal(n, torch.Generator().manual_seed(3)))
    if n > 1:
        assert (q - torch.eye(n, dtype=torch.float64)).abs().max() > 0.1
        assert not torch.equal(q, haar_orthogonal(n, torch.Generator().manual_seed(4)))


def test_haar_sign_fix_makes_diag_r_positive():
    # without the fix QR returns a Q biased by LAPACK's sign convention; with it, R = Qᵀ·G has a positive diagonal
    generator = torch.Generator().manual_seed(0)
    gaussian = torch.randn(16, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q = haar_orthogonal(16, generator)
    assert (torch.diagonal(q.T @ gaussian) > 0).all()


def test_pca_basis_orders_directions_by_energy_and_finds_the_dominant_one():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(500, 6, generator=generator, dtype=torch.float64) * torch.tensor([1.0, 5, 0.1, 2, 0.5, 3])
    q, values = pca_basis(x.T @ x)
    assert orthogonality_error(q) <= 1e-12
    assert (values[:-1] >= values[1:]).all()
    assert q[:, 0].abs().argmax().item() == 1  # the 5x column dominates
    assert torch.allclose((x @ q).square().sum(0), values)


def test_pca_basis_refuses_a_non_square_matrix():
    with pytest.raises(ValueError, match="square"):
        pca_basis(torch.zeros(3, 4))


def test_orthogonality_error_sees_a_scaled_matrix():
    assert orthogonality_error(1.001 * torch.eye(4, dtype=torch.float64)) > 1e-3
