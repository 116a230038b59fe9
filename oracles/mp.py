"""Arbitrary-precision (mpmath, 60 significant digits) twins of the float64 oracle's kernels.

The float64 oracle is itself a computation with rounding; these versions exist to measure that
rounding. They implement the same mathematics as :mod:`oracles.newton_schulz` and
:mod:`oracles.momentum` (DeepSpeed 0.19.8 ``runtime/zero/muon/original_muon.py``
``zeropower_via_newtonschulz5`` / ``zeropower_via_gram_newtonschulz`` / ``muon_update``), on plain
lists-of-lists matrices, with ``mp.dps = 60``.

The coefficients and the 1e-7 are the *float64 values* of DeepSpeed's decimal literals
(``mpf(3.4445)``, not ``mpf('3.4445')``): the oracle specifies the map that float64 code with those
literals evaluates, so comparing against a slightly different polynomial would measure the wrong
thing. Inputs converted from torch are exact (every float64 is an mpf).
"""
from __future__ import annotations

from typing import List, Sequence

import mpmath
import torch

from .newton_schulz import GRAM_RESTART_AT, NS_A, NS_B, NS_C, NS_EPS, NS_STEPS

DPS = 60
Matrix = List[List["mpmath.mpf"]]


class _Precision:
    """Context manager pinning mpmath's working precision to :data:`DPS` digits."""

    def __enter__(self):
        self._saved = mpmath.mp.dps
        mpmath.mp.dps = DPS
        return self

    def __exit__(self, *exc):
        mpmath.mp.dps = self._saved
        return False


def precision() -> _Precision:
    return _Precision()


def from_torch(t: torch.Tensor) -> Matrix:
    if t.ndim != 2:
        raise ValueError("expects a 2-D tensor")
    rows = t.to(torch.float64).tolist()
    with precision():
        return [[mpmath.mpf(x) for x in row] for row in rows]


def to_torch(M: Matrix, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Round each entry to float64 (then to ``dtype``)."""
    return torch.tensor([[float(x) for x in row] for row in M], dtype=torch.float64).to(dtype)


def shape(M: Matrix) -> tuple[int, int]:
    return len(M), (len(M[0]) if M else 0)


def transpose(M: Matrix) -> Matrix:
    r, c = shape(M)
    return [[M[i][j] for i in range(r)] for j in range(c)]


def matmul(A: Matrix, B: Matrix) -> Matrix:
    n, k = shape(A)
    k2, m = shape(B)
    if k != k2:
        raise ValueError("inner dimensions differ")
    Bt = transpose(B)
    return [[mpmath.fsum(A[i][t] * Bt[j][t] for t in range(k)) for j in range(m)] for i in range(n)]


def add(A: Matrix, B: Matrix, alpha=1, beta=1) -> Matrix:
    return [[alpha * a + beta * b for a, b in zip(ra, rb)] for ra, rb in zip(A, B)]


def scale(A: Matrix, s) -> Matrix:
    return [[s * a for a in row] for row in A]


def identity(n: int) -> Matrix:
    return [[mpmath.mpf(1) if i == j else mpmath.mpf(0) for j in range(n)] for i in range(n)]


def frobenius_norm(M: Matrix):
    with precision():
        return mpmath.sqrt(mpmath.fsum(x * x for row in M for x in row))


def _coeffs():
    return mpmath.mpf(NS_A), mpmath.mpf(NS_B), mpmath.mpf(NS_C)


def _prepare(G: Matrix):
    r, c = shape(G)
    tall = r > c
    X = transpose(G) if tall else [list(row) for row in G]
    nrm = frobenius_norm(X)
    X = scale(X, 1 / (nrm + mpmath.mpf(NS_EPS)))
    return X, tall


def ns_standard(G: Matrix, steps: int = NS_STEPS) -> Matrix:
    """``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, from ``X0 = G/(||G||_F + 1e-7)`` (wide)."""
    with precision():
        a, b, c = _coeffs()
        X, tall = _prepare(G)
        for _ in range(steps):
            A = matmul(X, transpose(X))
            B = add(A, matmul(A, A), b, c)
            X = add(X, matmul(B, X), a, 1)
        return transpose(X) if tall else X


def ns_gram(G: Matrix, steps: int = NS_STEPS, restart_at: int = GRAM_RESTART_AT) -> Matrix:
    """The Gram-matrix evaluation order (see :func:`oracles.newton_schulz.ns_gram`)."""
    with precision():
        a, b, c = _coeffs()
        X, tall = _prepare(G)
        n, m = shape(X)
        if m <= n:
            for _ in range(steps):
                A = matmul(X, transpose(X))
                B = add(A, matmul(A, A), b, c)
                X = add(X, matmul(B, X), a, 1)
            return transpose(X) if tall else X
        I = identity(n)
        R = matmul(X, transpose(X))
        Q = None
        for i in range(steps):
            if i == restart_at and i != 0:
                X = matmul(Q, X)
                R = matmul(X, transpose(X))
                Q = None
            Z = add(R, matmul(R, R), b, c)
            P = add(Z, I, 1, a)
            Q = P if Q is None else matmul(P, Q)
            if i < steps - 1 and i + 1 != restart_at:
                RZ = add(R, matmul(Z, R), a, 1)
                R = add(RZ, matmul(Z, RZ), a, 1)
        X = matmul(Q, X)
        return transpose(X) if tall else X


def aspect_scale(rows: int, cols: int):
    with precision():
        return mpmath.sqrt(mpmath.mpf(rows) / cols) if rows > cols else mpmath.mpf(1)


def muon_momentum(m: Matrix, g: Matrix, beta) -> tuple[Matrix, Matrix]:
    """``m' = beta m + (1-beta) g`` and ``U = (1-beta) g + beta m'`` (``beta`` as its float64 value)."""
    with precision():
        beta = mpmath.mpf(beta)
        one_minus = 1 - beta
        m_new = add(m, g, beta, one_minus)
        U = add(g, m_new, one_minus, beta)
        return m_new, U


def phi(s, steps: int = NS_STEPS):
    """The scalar map of ``steps`` iterations, at 60 digits."""
    with precision():
        a, b, c = _coeffs()
        s = mpmath.mpf(s)
        for _ in range(steps):
            s = a * s + b * s ** 3 + c * s ** 5
        return s


def max_abs_diff(A: Matrix, B: Matrix):
    with precision():
        return max(abs(x - y) for ra, rb in zip(A, B) for x, y in zip(ra, rb))


def max_abs(A: Matrix):
    with precision():
        return max(abs(x) for row in A for x in row)


__all__: Sequence[str] = (
    "DPS", "from_torch", "to_torch", "matmul", "transpose", "frobenius_norm", "ns_standard", "ns_gram",
    "aspect_scale", "muon_momentum", "phi", "max_abs_diff", "max_abs", "precision",
)
