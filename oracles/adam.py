"""The auxiliary Adam/AdamW that MuonWithAuxAdam applies to non-Muon parameters.

Specifies DeepSpeed 0.19.8's four interchangeable Adam implementations for Muon's Adam half
(``runtime/engine.py`` ``_configure_basic_optimizer`` / ``_muon_param_groups`` choose between
``ops/adam/fused_adam.py`` ``FusedAdam``, ``ops/adam/cpu_adam.py`` ``DeepSpeedCPUAdam``,
``torch.optim.AdamW`` and the inline ``adam_update`` of ``runtime/zero/muon/original_muon.py``); all
compute the same function, written here once in float64:

    (L2 mode only)  g <- g + wd * theta
    m <- beta1 m + (1 - beta1) g
    v <- beta2 v + (1 - beta2) g^2
    t <- t + 1                                   (t counts steps that were NOT skipped)
    (AdamW mode)    theta <- theta (1 - lr * wd)  (decoupled decay, before the moment step)
    theta <- theta - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

DeepSpeed's defaults for Muon's Adam half are ``betas=(0.9, 0.95)``, ``eps=1e-10``
(``original_muon.py`` ``MuonWithAuxAdam.__init__`` writes them into the group before the fused
optimizer is built, overriding FusedAdam's own 1e-8/(0.9, 0.999)); ``adam_w_mode`` defaults to True.
``g`` is the unscaled, clipped gradient (``oracles.step`` forms it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BETAS = (0.9, 0.95)
DEFAULT_EPS = 1e-10


@dataclass(frozen=True)
class AdamResult:
    m: torch.Tensor          # first moment after the step
    v: torch.Tensor          # second moment after the step
    direction: torch.Tensor  # m_hat / (sqrt(v_hat) + eps): the step before the lr
    delta: torch.Tensor      # the change applied to theta (decay included)
    theta: torch.Tensor      # theta after the step (not rounded)


def adam_step(theta: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, *,
              lr: float, betas: tuple[float, float] = DEFAULT_BETAS, eps: float = DEFAULT_EPS,
              weight_decay: float = 0.0, adam_w_mode: bool = True) -> AdamResult:
    """One Adam step; ``t`` is the step number *after* incrementing (1 on the first applied step)."""
    if t < 1:
        raise ValueError("t counts applied steps and starts at 1")
    beta1, beta2 = betas
    if not adam_w_mode and weight_decay:
        g = g + weight_decay * theta
    m_new = beta1 * m + (1.0 - beta1) * g
    v_new = beta2 * v + (1.0 - beta2) * g * g
    bc1 = 1.0 - beta1 ** t
    bc2 = 1.0 - beta2 ** t
    direction = (m_new / bc1) / (torch.sqrt(v_new / bc2) + eps)
    decayed = theta * (1.0 - lr * weight_decay) if (adam_w_mode and weight_decay) else theta
    theta_new = decayed - lr * direction
    return AdamResult(m=m_new, v=v_new, direction=direction, delta=theta_new - theta, theta=theta_new)


def bias_corrections(t: int, betas: tuple[float, float] = DEFAULT_BETAS) -> tuple[float, float]:
    return 1.0 - betas[0] ** t, 1.0 - betas[1] ** t


__all__ = ["AdamResult", "adam_step", "bias_corrections", "DEFAULT_BETAS", "DEFAULT_EPS"]
