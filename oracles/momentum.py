"""Muon's momentum and Nesterov blend, in true units and high precision.

DeepSpeed 0.19.8 ``runtime/zero/muon/original_muon.py`` ``muon_update`` writes both steps as
``torch.lerp`` (``momentum.lerp(grad, 1-beta)``, then ``grad.lerp_(momentum, beta)``). As mathematics
these are the two convex combinations below; what the oracle fixes on top of DeepSpeed is *where*
they are evaluated: in float64 (or at least fp32) on the true, unscaled gradient. DeepSpeed's
non-offload paths instead keep the momentum in loss-scaled units and, for fp16/bf16 models, in the
model dtype (docs/deepspeed-0.19.8.md sections 5, 11); those are accidents the oracle offers only as
opt-in conventions (``oracles.step.Conventions.momentum_units`` / ``momentum_dtype``).

Nesterov is always on in DeepSpeed (not configurable), so the blend is always applied.
"""
from __future__ import annotations

import torch


def muon_momentum(m: torch.Tensor, g: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m_new, U)`` with ``m_new = beta*m + (1-beta)*g`` and ``U = (1-beta)*g + beta*m_new``.

    ``U`` is built from the *updated* momentum, so ``U = (1-beta)(1+beta) g + beta^2 m``: the current
    gradient is weighted ``(1 - beta^2)`` rather than ``(1 - beta)``. Computed in the promoted dtype of
    the inputs (pass float64 tensors for the oracle). Pure: the inputs are not modified.
    """
    one_minus = 1.0 - beta
    m_new = beta * m + one_minus * g
    U = one_minus * g + beta * m_new
    return m_new, U


def round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``t`` to ``dtype`` (round-to-nearest-even) and return it as float64 again.

    Models storing a value in a narrower buffer: the oracle keeps float64 tensors throughout, and
    ``round_to`` marks each point where an implementation must drop precision.
    """
    if dtype == torch.float64:
        return t.to(torch.float64)
    return t.to(dtype).to(torch.float64)
