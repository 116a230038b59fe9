"""Test matrices with prescribed singular values (float64), for the Newton-Schulz and tolerance tests."""
from __future__ import annotations

import torch


def with_singular_values(m: int, n: int, svals, seed: int) -> torch.Tensor:
    """An ``m x n`` float64 matrix ``Q1 diag(svals) Q2^T`` with random orthonormal ``Q1``, ``Q2``."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    Q1, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    Q2, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    return Q1 @ torch.diag(torch.as_tensor(svals, dtype=torch.float64)) @ Q2.T
