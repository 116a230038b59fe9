"""One step of Muon as its authors define it: the second reference, beside what DeepSpeed intends.

DeepSpeed's Muon departs from Muon as defined (Keller Jordan's ``muon.py``, ``torch.optim.Muon``) by
design (``harness.registry.departures``); the intended oracle (``oracles.step`` with DeepSpeed's
``Conventions``) follows DeepSpeed, so a run can pass it and still not be Muon. This module is the
definition, for a hidden weight matrix ``W`` (two or more dims, not an embedding or an output head):

    G   the raw gradient, averaged over ranks and micro-batches, in true units (no loss scale)
    N   the global norm of every parameter's raw gradient
    k   = max(1, (N + 1e-6) / c) where clipping c > 0, else 1     (the clip acts on the raw gradient)
    g   = G / k
    M'  = beta M + (1 - beta) g                                    (momentum)
    U   = (1 - beta) g + beta M'                                   (Nesterov)
    O   = NS5(U) sqrt(max(1, rows / cols))                         (Newton-Schulz in float64: the
                                                                    mathematics; the references' bf16 is
                                                                    the departure MUON-NS16's to measure)
    W'  = W (1 - eta wd) - eta O

with ``eta`` the lr configured for the Muon half, shaped by the lr schedule but never replaced by one number
for both halves: where a schedule hands every group one peak ``P`` (``warmup_max_lr`` and the like), the
half's lr at a step is the schedule's lr there times ``eta_configured / P`` -- the same shape, warming
up to the half's own lr. The matrix is orthogonalised whole (no per-head or tensor-parallel split).

Pure functions on float64 tensors; nothing here knows DeepSpeed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oracles.newton_schulz import muon_direction

CLIP_EPS = 1e-6  # added to the norm before dividing by the clip (DeepSpeed's and the references' rule alike)


def clip_factor(global_norm: float, clip: float) -> float:
    """``1 / k``: what the clip multiplies every raw gradient by (1 where clipping is off or does not bite)."""
    if clip <= 0:
        return 1.0
    return 1.0 / max(1.0, (global_norm + CLIP_EPS) / clip)


def half_lr(scheduled: float, configured: float, broadcast_peak: float | None) -> float:
    """The Muon half's lr as defined: the schedule's lr at this step rescaled from the one peak it hands every
    group to the half's own configured lr (unchanged where the schedule hands no such peak)."""
    if not broadcast_peak:
        return scheduled
    return scheduled * configured / broadcast_peak


@dataclass(frozen=True)
class MatrixStep:
    weight: torch.Tensor  # W'
    momentum: torch.Tensor  # M'
    update: torch.Tensor  # O


def matrix_step(W: torch.Tensor, G: torch.Tensor, M: torch.Tensor, *, lr: float, momentum: float,
                weight_decay: float, factor: float) -> MatrixStep:
    """The step of the module docstring for one matrix, ``factor`` = 1 / k; float64 throughout."""
    W, G, M = (t.to(torch.float64) for t in (W, G, M))
    g = G * factor
    m = momentum * M + (1.0 - momentum) * g
    U = (1.0 - momentum) * g + momentum * m
    O = muon_direction(U, "standard")
    return MatrixStep(W * (1.0 - lr * weight_decay) - lr * O, m, O)


def global_norm(grads) -> float:
    """The norm of every raw gradient together (the clip's ``N``)."""
    return math.sqrt(sum(float(torch.sum(torch.as_tensor(g, dtype=torch.float64) ** 2)) for g in grads))
