"""The ``emulated`` Newton-Schulz mode: DeepSpeed's 16-bit arithmetic, rounding point by rounding point.

Why this exists
---------------
DeepSpeed 0.19.8 always runs Newton-Schulz in 16 bit (``original_muon.py`` ``ns_compute_dtype``:
fp16 for ``ns_method="gram"``, bf16 for ``"standard"``, whenever the accelerator supports them, which
CUDA sm>=80 and the CPU accelerator do). Against a float64 oracle that costs 1e-2 .. 1 relative
error in the Muon direction (semantics doc section 8), far too coarse to see a bug elsewhere. This
module evaluates the same mathematics as :mod:`oracles.newton_schulz` in the same 16-bit dtypes, with
every intermediate rounded where DeepSpeed's *eager* code rounds it. Given bit-identical inputs on
the same device it reproduces DeepSpeed's eager ``muon_update`` bit for bit (verified on CPU in
``cases/oracles/test_oracle_vs_deepspeed.py``: 56 cases -- fp32/fp16/bf16 storage, gram/standard, wide,
tall, square, 1xN, Nx1, rank-deficient, per-head, batched, non-finite -- all bit-equal, direction and
momentum; also bit-equal at 256x512 and with 1 vs 2 threads). ``torch.compile`` fuses elementwise ops
into fp32 and is *not* reproducible this way (doc section 8: 4-8% apart from eager); neither are
GPU matmuls, whose accumulation order differs.

It is written from the mathematics plus the documented operation order, using the same torch
primitives (a 16-bit matmul, ``torch.lerp``, a Frobenius ``vector_norm``) because those primitives
*are* the rounding behaviour being emulated. It never imports DeepSpeed.

The rounding points, for a 16-bit compute dtype ``h``
------------------------------------------------------
Every product or sum of two tensors is one rounded tensor op; a Python-float coefficient times a
tensor is one rounded op (the coefficient enters at the op's internal precision, it is *not* first
rounded to ``h``); ``b*A + (c*A)@A`` is therefore four rounded ops (``b*A``, ``c*A``, ``(c*A)@A``, the
sum), and ``a*X + B@X`` three.

* standard (``zeropower_via_newtonschulz5``): cast ``G`` to ``h``; transpose if tall; the norm, the
  ``+1e-7`` and the division are all in ``h``; then the five iterations in ``h``.
* gram (``zeropower_via_gram_newtonschulz``): normalise in ``n_dt`` = fp32 when ``G`` is fp16 (so a
  loss-scaled fp16 gradient does not overflow) and ``G.dtype`` otherwise; cast the normalised matrix
  to ``h``. Square inputs then run the standard iteration in ``h``. Otherwise ``R = X X^T``; the first
  ``Q`` is ``Z`` with ``a`` added in place to its diagonal (one rounding of ``z_ii + a``, not of a
  rounded ``a I``); later ``Q <- a*Q + Z@Q``; ``R`` advances through ``RZ = a*R + Z@R``,
  ``R <- a*RZ + Z@RZ`` except before the last iteration and before the restart; the restart at
  iteration 2 forms ``X <- Q@X``, ``R <- X@X^T``; the output is ``Q@X`` (wide) or ``X^T@Q^T`` (tall,
  a different matmul than the transpose of ``Q@X``).
* ``muon_update`` (the momentum part): ``M' = lerp(M, g, 1-beta)`` in ``M``'s dtype (one rounding,
  internal precision fp32 for 16-bit storage), kept only if ``g`` is all finite;
  ``U = lerp(g, M', beta)`` in ``g``'s dtype (one rounding). Then the direction: NS output in ``h``,
  aspect scale multiplied in ``h`` (a no-op when the scale is 1), cast to ``g``'s dtype; for a
  non-finite ``g`` the blend ``U`` (which the in-place lerp left in the gradient buffer, non-finite) is
  returned in place of the direction, so the overflow is still detected -- except on the per-head
  path, where DeepSpeed has no such guard and the NaN/inf run through the iteration.
"""
from __future__ import annotations

from typing import Optional

import torch

from .newton_schulz import GRAM_RESTART_AT, NS_A, NS_B, NS_C, NS_EPS, NS_STEPS, aspect_scale

# Production compute dtypes (CUDA sm>=80 and DeepSpeed's CPU accelerator).
PRODUCTION_NS_DTYPE = {"gram": torch.float16, "standard": torch.bfloat16}


def ns_compute_dtype(ns_method: str, fp16_supported: bool = True, bf16_supported: bool = True) -> torch.dtype:
    """The dtype DeepSpeed 0.19.8 runs Newton-Schulz in (its documented rule): fp16 for "gram" and
    bf16 for "standard" where the accelerator supports that dtype, fp32 where it does not. DeepSpeed's
    CPU accelerator reports fp16 only on CPUs with oneDNN fp16 kernels (e.g. AVX512-FP16); an AMD
    EPYC without them runs the gram iteration in fp32. The caller says what the device supports."""
    try:
        dt = PRODUCTION_NS_DTYPE[ns_method]
    except KeyError:
        raise ValueError(f"unknown ns_method {ns_method!r}") from None
    supported = fp16_supported if dt == torch.float16 else bf16_supported
    return dt if supported else torch.float32


def _frobenius(X: torch.Tensor) -> torch.Tensor:
    # One reduction, result rounded to X's dtype.
    return torch.linalg.vector_norm(X, ord=2, dim=(-2, -1), keepdim=True)


def _poly_step_in_place_order(X: torch.Tensor) -> torch.Tensor:
    """One standard iteration with DeepSpeed's rounding points (every op rounds to X.dtype)."""
    gram = X @ X.mT
    quad = (NS_C * gram) @ gram
    poly = NS_B * gram + quad
    return NS_A * X + poly @ X


def emulated_ns_standard(G: torch.Tensor, steps: int = NS_STEPS,
                         compute_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Standard Newton-Schulz, everything in ``compute_dtype``. Returns ``compute_dtype``."""
    X = G.to(compute_dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (_frobenius(X) + NS_EPS)
    for _ in range(steps):
        X = _poly_step_in_place_order(X)
    return X.mT if tall else X


def emulated_ns_gram(G: torch.Tensor, steps: int = NS_STEPS,
                     compute_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Gram Newton-Schulz with DeepSpeed's dtypes and rounding points. Returns ``compute_dtype``."""
    norm_dtype = torch.float32 if G.dtype == torch.float16 else G.dtype
    X = G.to(norm_dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    n, m = X.size(-2), X.size(-1)
    X = (X / (_frobenius(X) + NS_EPS)).to(compute_dtype)
    if m <= n:
        for _ in range(steps):
            X = _poly_step_in_place_order(X)
        return X.mT if tall else X

    R = X @ X.mT
    Q: Optional[torch.Tensor] = None
    for i in range(steps):
        if i == GRAM_RESTART_AT and i != 0:
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = NS_B * R + (NS_C * R) @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(NS_A)
        else:
            Q = NS_A * Q + Z @ Q
        if i < steps - 1 and (i + 1) != GRAM_RESTART_AT:
            RZ = NS_A * R + Z @ R
            R = NS_A * RZ + Z @ RZ
    if tall:
        return X.mT @ Q.mT
    return Q @ X


def emulated_ns(G: torch.Tensor, ns_method: str, steps: int = NS_STEPS,
                compute_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    dt = compute_dtype or ns_compute_dtype(ns_method)
    if ns_method == "gram":
        return emulated_ns_gram(G, steps, dt)
    if ns_method == "standard":
        return emulated_ns_standard(G, steps, dt)
    raise ValueError(f"unknown ns_method {ns_method!r}")


def emulated_direction(U: torch.Tensor, ns_method: str = "gram", num_heads: Optional[int] = None, *,
                       batched: bool = False, out_dtype: Optional[torch.dtype] = None,
                       compute_dtype: Optional[torch.dtype] = None, conv_aspect: str = "reshaped",
                       steps: int = NS_STEPS) -> torch.Tensor:
    """The Muon direction with production rounding; returned in ``out_dtype`` (default ``U.dtype``).

    Same shape rules as :func:`oracles.newton_schulz.muon_direction`. For 4-D tensors DeepSpeed has
    no working path (it crashes), so there is nothing to be bit-faithful to: the intended semantics
    are evaluated with the 16-bit iteration on the reshaped matrix.
    """
    out_dtype = out_dtype or U.dtype
    if num_heads is not None:
        rows, cols = U.shape
        hd = rows // num_heads
        O = emulated_ns(U.reshape(num_heads, hd, cols), ns_method, steps, compute_dtype)
        O = O * aspect_scale(hd, cols)
        return O.reshape(rows, cols).to(out_dtype)
    if U.ndim == 4 and not batched:
        M = U.reshape(U.size(0), -1)
        O = emulated_ns(M, ns_method, steps, compute_dtype)
        if conv_aspect == "reshaped":
            s = aspect_scale(M.size(0), M.size(1))
        else:
            s = aspect_scale(U.size(-2), U.size(-1))
        O = O * s
        return O.reshape(U.shape).to(out_dtype)
    O = emulated_ns(U, ns_method, steps, compute_dtype)
    O = O * aspect_scale(U.size(-2), U.size(-1))
    return O.to(out_dtype)


def emulated_momentum(momentum: torch.Tensor, grad: torch.Tensor, beta: float
                      ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(M', U, finite)`` with DeepSpeed's rounding: two ``lerp``s, each rounded once to its storage.

    ``M' = M + (1-beta)(g - M)`` in ``M``'s dtype; ``U = g + beta (M' - g)`` in ``g``'s dtype. When
    ``g`` has a non-finite entry ``M`` is left as it is (the guard DeepSpeed added so that one
    overflow does not poison the momentum for good). Inputs are not modified.
    """
    finite = bool(torch.isfinite(grad).all())
    new_m = momentum.lerp(grad.to(momentum.dtype), 1 - beta) if finite else momentum.clone()
    update = grad.lerp(new_m.to(grad.dtype), beta)
    return new_m, update, finite


def emulated_muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95,
                         ns_method: str = "gram", num_heads: Optional[int] = None, *,
                         batched: bool = False, compute_dtype: Optional[torch.dtype] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional twin of DeepSpeed's eager ``muon_update``: returns ``(new_momentum, direction)``.

    The direction is in ``grad``'s dtype. Unlike DeepSpeed nothing is modified in place.
    """
    new_m, U, finite = emulated_momentum(momentum, grad, beta)
    if num_heads is not None:
        # DeepSpeed's per-head path has no finite guard: NaN/inf flow through the iteration.
        return new_m, emulated_direction(U, ns_method, num_heads, out_dtype=grad.dtype,
                                         compute_dtype=compute_dtype)
    O = emulated_direction(U, ns_method, None, batched=batched, out_dtype=grad.dtype,
                           compute_dtype=compute_dtype, conv_aspect="last_two_dims")
    if not finite:
        # DeepSpeed passes "the gradient" through, but its Nesterov lerp ran in place on the gradient
        # buffer, so what comes back is U (non-finite wherever the blend is).
        return new_m, U.to(grad.dtype)
    return new_m, O
