"""Orthogonal bases for the residual stream: seeded Haar-random and PCA (float64 throughout)."""
from __future__ import annotations

import torch
from torch import Tensor


def haar_orthogonal(n: int, generator: torch.Generator) -> Tensor:
    """A Haar-distributed orthogonal matrix of order ``n``: Q from the QR of a Gaussian matrix, with
    each column's sign fixed by diag(R) (without the fix the distribution is not uniform)."""
    gaussian = torch.randn(n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return q * torch.sign(torch.diagonal(r))[None, :]


def pca_basis(covariance: Tensor) -> tuple[Tensor, Tensor]:
    """(Q, eigenvalues): the eigenvectors of a symmetric second-moment matrix as columns, by
    decreasing eigenvalue, so that x·Q[:, :k] keeps the k directions of largest energy."""
    if covariance.dim() != 2 or covariance.shape[0] != covariance.shape[1]:
        raise ValueError(f"covariance must be a square matrix, got shape {tuple(covariance.shape)}")
    values, vectors = torch.linalg.eigh(covariance.to(torch.float64))
    order = torch.argsort(values, descending=True)
    return vectors[:, order], values[order]


def orthogonality_error(q: Tensor) -> float:
    """max |QᵀQ − I| over the columns of ``q`` (0 for exactly orthonormal columns)."""
    q = q.to(torch.float64)
    return (q.T @ q - torch.eye(q.shape[1], dtype=torch.float64)).abs().max().item()
