"""Newton-Schulz orthogonalisation as Muon intends it, in float64.

What this module specifies
--------------------------
Muon replaces an update matrix ``U`` by an approximation of its polar factor. DeepSpeed 0.19.8
(``runtime/zero/muon/original_muon.py``: ``zeropower_via_newtonschulz5``,
``zeropower_via_gram_newtonschulz``, ``_aspect_ratio_scale``, ``_per_head_orthogonalize`` and
``muon_update``) computes it with a fixed quintic polynomial iteration. The mathematics is:

* Normalise: ``X0 = U / (||U||_F + 1e-7)``. The ``1e-7`` is added to the norm (it is *outside* the
  norm, not a ``max(norm, eps)`` clamp as ``torch.optim.Muon`` does). Frobenius normalisation puts
  every singular value in ``[0, 1]``.
* Work on the wide orientation: a tall matrix (rows > cols) is transposed first and transposed back
  at the end. This only chooses which Gram matrix (``X X^T``) is the small one; in exact arithmetic
  the result is the same.
* Five times: ``X <- p(X X^T) X`` with ``p`` acting on singular values as
  ``p(s) = a s + b s^3 + c s^5``, ``(a, b, c) = (3.4445, -4.7750, 2.0315)`` taken as the float64
  values of those decimal literals. Each singular value ``s`` of ``X0`` becomes ``phi_5(s)``
  (``phi_k`` = ``p`` composed ``k`` times) with the singular vectors unchanged.
* Multiply by the aspect scale ``sqrt(max(1, rows/cols))``.

Two evaluation orders exist (DeepSpeed's ``ns_method``): "standard" iterates on ``X`` directly;
"gram" iterates on the small Gram matrix ``R = X X^T``, accumulates the polynomial in ``Q`` and
applies it to ``X`` only twice (a restart after two iterations). Both are the same polynomial map in
exact arithmetic; in float64 they agree to ~1e-15 (tested in ``cases/oracles``). DeepSpeed runs them
in 16-bit (gram: fp16, standard: bf16); the bit-faithful 16-bit evaluation lives in
:mod:`oracles.emulate`. This module is the float64 reference.

Besides the iteration this module exposes the scalar map ``phi_k`` and quantities derived from the
polynomial alone (the band singular values settle into, the gain of the map) that the tolerance
model and the property tests use.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

# The float64 values of the decimal literals used by Keller Jordan's Muon and by DeepSpeed 0.19.8.
NS_A = 3.4445
NS_B = -4.7750
NS_C = 2.0315
NS_COEFFICIENTS = (NS_A, NS_B, NS_C)
NS_STEPS = 5
NS_EPS = 1e-7  # added to the Frobenius norm (outside it)
# The iteration restarts (re-forms X and R from Q) before this iteration index in the gram variant.
GRAM_RESTART_AT = 2

NS_METHODS = ("gram", "standard")


# --------------------------------------------------------------------------------------------------
# Scalar polynomial facts
# --------------------------------------------------------------------------------------------------

def quintic(s: float, coeffs: Sequence[float] = NS_COEFFICIENTS) -> float:
    """``p(s) = a s + b s^3 + c s^5`` -- what one iteration does to one singular value."""
    a, b, c = coeffs
    s2 = s * s
    return s * (a + s2 * (b + c * s2))


def quintic_derivative(s: float, coeffs: Sequence[float] = NS_COEFFICIENTS) -> float:
    a, b, c = coeffs
    s2 = s * s
    return a + s2 * (3.0 * b + 5.0 * c * s2)


def phi(s: float, steps: int = NS_STEPS, coeffs: Sequence[float] = NS_COEFFICIENTS) -> float:
    """``phi_steps(s)``: the singular value that ``steps`` iterations make of a normalised ``s``."""
    for _ in range(steps):
        s = quintic(s, coeffs)
    return s


def phi_derivative(s: float, steps: int = NS_STEPS, coeffs: Sequence[float] = NS_COEFFICIENTS) -> float:
    """``d phi_steps / ds`` by the chain rule."""
    d = 1.0
    for _ in range(steps):
        d *= quintic_derivative(s, coeffs)
        s = quintic(s, coeffs)
    return d


def quintic_band(coeffs: Sequence[float] = NS_COEFFICIENTS) -> tuple[float, float]:
    """The interval ``[L, H]`` that the iteration maps into itself, derived from ``p`` alone.

    ``p'(s) = a + 3b s^2 + 5c s^4`` vanishes at ``s^2 = (-3b -+ sqrt(9b^2 - 20ac)) / (10c)``: a local
    maximum ``s1`` and a local minimum ``s2 > s1``. Every ``s`` in ``(0, 1]`` is pushed up until it
    passes ``s1``; from then on it stays in ``[L, H]`` with ``H = p(s1)`` (the largest value ``p``
    takes on ``[0, H]``) and ``L = min(p(s2), p(H))`` (the smallest value on ``[s1, H]``). The
    promise of the coefficients is therefore "orthogonal up to a factor in ``[L, H]``", about
    ``[0.68, 1.20]``; the exact numbers come from this function, not from a constant.
    """
    a, b, c = coeffs
    disc = math.sqrt(9.0 * b * b - 20.0 * a * c)
    s1 = math.sqrt((-3.0 * b - disc) / (10.0 * c))
    s2 = math.sqrt((-3.0 * b + disc) / (10.0 * c))
    high = quintic(s1, coeffs)
    # Minimum of p over [s1, high]: at the interior critical point s2 if it lies inside, else at an end.
    candidates = [quintic(high, coeffs), quintic(s1, coeffs)]
    if s1 <= s2 <= high:
        candidates.append(quintic(s2, coeffs))
    low = min(candidates)
    return low, high


def band_entry_threshold(steps: int = NS_STEPS, coeffs: Sequence[float] = NS_COEFFICIENTS) -> float:
    """Smallest normalised input singular value ``s0`` with ``phi_steps(s) >= L`` for all ``s >= s0``.

    ``phi_steps`` is increasing on ``[0, s0]`` (each ``p`` is increasing below ``s1`` and values
    below ``s1`` stay below ``p(s1)``), so a bisection on ``phi_steps(s) - L`` finds it. Inputs with a
    normalised singular value at least this large are guaranteed to come out inside the band.
    """
    low, _ = quintic_band(coeffs)
    lo, hi = 0.0, 1.0
    # phi is not monotone on all of [0,1]; find the first crossing by scanning, then bisect.
    grid = [i / 4096 for i in range(1, 4097)]
    prev = 0.0
    for s in grid:
        if phi(s, steps, coeffs) >= low:
            lo, hi = prev, s
            break
        prev = s
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if phi(mid, steps, coeffs) >= low:
            hi = mid
        else:
            lo = mid
    return hi


def aspect_scale(rows: int, cols: int) -> float:
    """``sqrt(max(1, rows/cols))`` -- Keller Jordan's scale, DeepSpeed ``_aspect_ratio_scale``.

    It makes the RMS of the update of a tall matrix comparable with that of a wide one. DeepSpeed
    applies it to ``O`` (the lr is not adjusted); ``torch.optim.Muon(adjust_lr_fn="original")``
    applies the same factor to the lr instead.
    """
    return math.sqrt(rows / cols) if rows > cols else 1.0


# --------------------------------------------------------------------------------------------------
# The iteration on matrices (float64 by default; batched over leading dimensions)
# --------------------------------------------------------------------------------------------------

def _normalise(G: torch.Tensor, eps: float) -> torch.Tensor:
    norm = torch.linalg.vector_norm(G, ord=2, dim=(-2, -1), keepdim=True)
    return G / (norm + eps)


def _wide(G: torch.Tensor) -> tuple[torch.Tensor, bool]:
    tall = G.size(-2) > G.size(-1)
    return (G.mT if tall else G), tall


def ns_standard(G: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.float64,
                eps: float = NS_EPS, coeffs: Sequence[float] = NS_COEFFICIENTS) -> torch.Tensor:
    """Newton-Schulz on ``X`` itself (DeepSpeed ``zeropower_via_newtonschulz5`` maths).

    Each iteration forms ``A = X X^T`` and ``X <- a X + (b A + c A^2) X``. Works on the last two
    dims; leading dims are a batch. Returns ``dtype`` (float64 by default), orientation of ``G``.
    No aspect scale here: see :func:`muon_direction`.
    """
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(G.shape)}")
    a, b, c = coeffs
    X, tall = _wide(G.to(dtype))
    X = _normalise(X, eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.mT if tall else X


def ns_gram(G: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.float64,
            eps: float = NS_EPS, coeffs: Sequence[float] = NS_COEFFICIENTS,
            restart_at: Optional[int] = GRAM_RESTART_AT) -> torch.Tensor:
    """Newton-Schulz through the small Gram matrix (DeepSpeed ``zeropower_via_gram_newtonschulz``).

    With ``X`` wide (``n x m``, ``n < m``) and ``R = X X^T`` (``n x n``), one iteration is
    ``X <- P X`` with ``P = a I + b R + c R^2``, and then ``R <- P R P = P^2 R`` (all of these commute,
    being polynomials in ``R``). So the iteration can run on ``n x n`` matrices, accumulating
    ``Q = P_k ... P_1`` and touching the long dimension only at the end: ``X_out = Q X_0``.
    ``R`` is advanced as ``RZ = a R + Z R``, ``R <- a RZ + Z RZ`` (``Z = b R + c R^2``), which is
    ``P (P R)``. At iteration ``restart_at`` the accumulated ``Q`` is applied to ``X`` and ``R`` is
    re-formed from the new ``X``: the same value in exact arithmetic, but the error accumulated in
    ``R`` is discarded (this matters in 16-bit; DeepSpeed restarts at 2). A square input has no
    long dimension to save and takes the standard iteration, as DeepSpeed does.
    """
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(G.shape)}")
    a, b, c = coeffs
    X, tall = _wide(G.to(dtype))
    X = _normalise(X, eps)
    n, m = X.size(-2), X.size(-1)
    if m <= n:
        for _ in range(steps):
            A = X @ X.mT
            X = a * X + (b * A + c * (A @ A)) @ X
        return X.mT if tall else X
    eye = torch.eye(n, dtype=dtype, device=X.device).expand(*X.shape[:-2], n, n)
    R = X @ X.mT
    Q: Optional[torch.Tensor] = None
    for i in range(steps):
        if restart_at is not None and i == restart_at and i != 0 and Q is not None:
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = b * R + c * (R @ R)
        P = Z + a * eye
        Q = P if Q is None else P @ Q
        # R is needed again only if another iteration follows and no restart re-forms it.
        if i < steps - 1 and not (restart_at is not None and i + 1 == restart_at):
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    X = Q @ X
    return X.mT if tall else X


def newton_schulz(G: torch.Tensor, ns_method: str = "gram", steps: int = NS_STEPS,
                  dtype: torch.dtype = torch.float64, eps: float = NS_EPS) -> torch.Tensor:
    if ns_method == "gram":
        return ns_gram(G, steps=steps, dtype=dtype, eps=eps)
    if ns_method == "standard":
        return ns_standard(G, steps=steps, dtype=dtype, eps=eps)
    raise ValueError(f"ns_method must be one of {NS_METHODS}, got {ns_method!r}")


def muon_direction(U: torch.Tensor, ns_method: str = "gram", num_heads: Optional[int] = None, *,
                   steps: int = NS_STEPS, dtype: torch.dtype = torch.float64, eps: float = NS_EPS,
                   conv_aspect: str = "reshaped", batched: bool = False) -> torch.Tensor:
    """The Muon direction ``O`` for an update ``U`` of any supported rank, in ``dtype`` and ``U``'s shape.

    * 2-D ``(rows, cols)``: ``NS(U) * aspect_scale(rows, cols)``.
    * ``num_heads = H`` (2-D ``[H*hd, in]`` attention projection): view ``[H, hd, in]``, Newton-Schulz
      per head, scale ``aspect_scale(hd, in)`` (DeepSpeed ``_per_head_orthogonalize``).
    * 3-D (or ``batched=True``, DeepSpeed's ``is_expert_group``): Newton-Schulz per leading index,
      scale from the last two dims. DeepSpeed gives a 3-D non-expert tensor the same result.
    * 4-D conv kernel ``(out, in, kh, kw)``: DeepSpeed 0.19.8 crashes on these
      (``original_muon.py`` ``muon_update``: the final ``torch.where`` broadcasts the 2-D update
      against the 4-D grad; docs/deepspeed-0.19.8.md section 3). The *intended* semantics, Keller Jordan's,
      orthogonalise the reshaped matrix ``(out, in*kh*kw)``. Choice made here
      (``conv_aspect="reshaped"``, the default): the aspect scale is that of the matrix actually
      orthogonalised, ``aspect_scale(out, in*kh*kw)``, and the result is reshaped back to
      ``(out, in, kh, kw)``. The reason: the scale exists to equalise update RMS across shapes, which
      is a property of the orthogonalised matrix; Keller's ``sqrt(max(1, kh/kw))`` (from
      ``grad.size(-2), grad.size(-1)``) is 1 for square kernels and arbitrary otherwise, an accident
      of reusing the 2-D code. ``conv_aspect="last_two_dims"`` reproduces that accident.
    """
    if ns_method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {ns_method!r}")
    if U.ndim < 2:
        raise ValueError(f"Muon needs a tensor with >= 2 dims, got shape {tuple(U.shape)}")
    if num_heads is not None:
        if U.ndim != 2:
            raise ValueError(f"per-head Muon expects a 2-D projection, got {tuple(U.shape)}")
        rows, cols = U.shape
        if num_heads < 1 or rows % num_heads:
            raise ValueError(f"{rows} rows do not split into {num_heads} heads")
        hd = rows // num_heads
        O = newton_schulz(U.reshape(num_heads, hd, cols), ns_method, steps, dtype, eps)
        return (O * aspect_scale(hd, cols)).reshape(rows, cols)
    if U.ndim == 2 or U.ndim == 3 or batched or U.ndim > 4:
        O = newton_schulz(U, ns_method, steps, dtype, eps)
        return O * aspect_scale(U.size(-2), U.size(-1))
    # 4-D conv kernel
    out = U.size(0)
    M = U.reshape(out, -1)
    O = newton_schulz(M, ns_method, steps, dtype, eps)
    if conv_aspect == "reshaped":
        scale = aspect_scale(M.size(0), M.size(1))
    elif conv_aspect == "last_two_dims":
        scale = aspect_scale(U.size(-2), U.size(-1))
    else:
        raise ValueError(f"conv_aspect must be 'reshaped' or 'last_two_dims', got {conv_aspect!r}")
    return (O * scale).reshape(U.shape)
