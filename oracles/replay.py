"""What a teacher-forced replay of a captured run reads from the conventions.

Why a module of its own: :func:`oracles.step.step` computes one step from a state and gradients; a judge
that replays a captured run also has to know, from the same ``Conventions``, how the captured numbers
are to be read (the units of a stored momentum, which gradient a parameter is stepped on, whether a clip
happened before Muon and must be undone, whether ``muon_update`` runs at all). Every such reading is
one small pure function here, so the judge applies a bug's model without naming any bug or switch.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Optional

import torch

from .clipping import clip_coefficient
from .step import Conventions
from .tolerance import unit_roundoff


def starts_before_initialize(conv: Conventions) -> bool:
    """Whether the replay starts from the run's weights before ``initialize``, not the captured masters
    after it: where the conventions step at initialize (``warmup_step_at_init``), the captured masters
    already carry that step, which rounding back to the model dtype cannot undo."""
    return conv.warmup_step_at_init


def runs_muon_update(conv: Conventions, use_muon: bool) -> bool:
    """Whether a parameter goes through ``muon_update`` (momentum, Newton-Schulz): a Muon parameter,
    unless the conventions step it by its gradient (``muon_as_sgd``)."""
    return use_muon and not conv.muon_as_sgd


def muon_calls(conv: Conventions, calls: int) -> int:
    """Newton-Schulz applications per step, given ``calls`` where Muon runs at all."""
    return 0 if conv.muon_as_sgd else calls


def momentum_storage(conv: Conventions, model_dtype: str, emulated: bool) -> str:
    """The Muon momentum's storage dtype as the replay can follow it: bit for bit (fp32 left) unless a
    model-dtype momentum is rounded outside emulation."""
    return model_dtype if conv.momentum_dtype == "model" and not emulated else "fp32"


def ns_input_storage(conv: Conventions, model_dtype: str, emulated: bool) -> str:
    """The dtype whose rounding separates the Nesterov blend Newton-Schulz reads from the replay's: the
    momentum's storage (``momentum_storage``), except where the blend is fused (``fused_blend``): it then
    reads the new momentum before its 16-bit rounding and is itself unrounded, so it is as close to the
    replay's as fp32 arithmetic, while the stored momentum still carries its own rounding."""
    return "fp32" if conv.fused_blend else momentum_storage(conv, model_dtype, emulated)


def state_momentum(conv: Conventions, raw: torch.Tensor, raw_scale: float) -> torch.Tensor:
    """A captured momentum (``raw``, carrying ``raw_scale``) in the units the oracle's state holds."""
    return raw if conv.momentum_units == "scaled" else raw / raw_scale


def true_momentum(conv: Conventions, m: torch.Tensor, scale: float) -> torch.Tensor:
    """The oracle's state momentum ``m`` (at loss scale ``scale``) in true units."""
    return m / scale if conv.momentum_units == "scaled" else m


def backward_scale(conv: Conventions, scale: float) -> float:
    """The loss scale the backward ran at: the scaler's, unless the loss is never scaled."""
    return scale if conv.backward_loss_scaled else 1.0


def read_in_true_units(conv: Conventions, scale: float) -> float:
    """The factor that brings the gradient the optimizer read back to true units: ``S`` where the
    optimizer divided an unscaled backward's gradient by ``S`` anyway, else 1 (a power of two: exact)."""
    return 1.0 if conv.backward_loss_scaled else scale


def fresh_at(conv: Conventions, step: int) -> bool:
    """Whether ``step`` is the first after a resume that left a fresh engine's state (``fresh_after``)."""
    return conv.fresh_after is not None and step == conv.fresh_after + 1


def fresh_model_weights(conv: Conventions, weights: Mapping[str, torch.Tensor],
                        fresh: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model weights the step's forward sees: ``fresh`` for the parameters a fresh engine holds."""
    return {n: (fresh[n] if n in conv.fresh_params else w) for n, w in weights.items()}


def stepped_gradients(conv: Conventions, G: Mapping[str, torch.Tensor], use_muon: Mapping[str, bool],
                      held: Mapping[str, tuple[Optional[torch.Tensor], Optional[torch.Tensor]]],
                      scale_ratio: float = 1.0) -> dict:
    """The gradient each parameter is stepped on, from the intended average ``G``. ``held``: for each
    parameter without a gradient this step, (its previous gradient in true units, its previous Muon
    update), as its buffers were left. ``adam_grads_lost``: the Adam half reads zeros;
    ``stale_unused_grads``: a parameter without a gradient reads what its buffer held (a Muon matrix:
    the update written over its gradient; an Adam parameter: its gradient); ``muon_in_new_scale``: a Muon
    matrix reads ``G S / S'`` (``scale_ratio``, the step's ``S / S'``)."""
    out = {n: (torch.zeros_like(g) if conv.adam_grads_lost and not use_muon[n] else g) for n, g in G.items()}
    if conv.muon_in_new_scale and conv.scale_update_before_unscale:
        out = {n: (g * scale_ratio if use_muon[n] else g) for n, g in out.items()}
    if conv.stale_unused_grads:
        for n, (grad, update) in held.items():
            left = update if use_muon[n] else grad
            if left is not None:  # nothing captured to predict from: the gradient check holds it to zero
                out[n] = left
    return out


def with_carried(conv: Conventions, G: Mapping[str, torch.Tensor], carried: Mapping[str, torch.Tensor],
                 backward_scale: float) -> dict:
    """The gradient each parameter is stepped on where skipped steps' Adam gradients stayed in the buffer
    (``adam_grads_kept_on_skip``): ``carried`` holds them in the units the buffer kept them (each step's
    backward scale), which this step's unscale divides by its own."""
    if not conv.adam_grads_kept_on_skip or not carried:
        return dict(G)
    return {n: (g + carried[n] / backward_scale if n in carried else g) for n, g in G.items()}


def carried_after(conv: Conventions, stepped: Mapping[str, torch.Tensor], use_muon: Mapping[str, bool],
                  skipped: bool, backward_scale: float) -> dict:
    """What the Adam half's buffer keeps for the next step: nothing after an applied step; after a skipped
    one (``adam_grads_kept_on_skip``), everything it was stepped on, in the buffer's units."""
    if not (conv.adam_grads_kept_on_skip and skipped):
        return {}
    return {n: g * backward_scale for n, g in stepped.items() if not use_muon[n]}


def clip_before_muon(conv: Conventions, clipping: float, reported: Optional[float], scale: float) -> Optional[float]:
    """The clip coefficient the implementation applied before Muon, from the norm it reported (None: no
    clip before Muon, or no finite norm to read it from). A raw reported norm carries the backward's
    scale, which the clip divided out."""
    if conv.clip_norm_source != "gradient" or clipping <= 0 or reported is None or not math.isfinite(reported):
        return None
    units = scale if conv.reported_norm == "raw" else 1.0
    return clip_coefficient(float(reported) / units, clipping)


def unclip(conv: Conventions, forced: Mapping[str, torch.Tensor], use_muon: Mapping[str, bool],
           k: Optional[float]) -> dict[str, torch.Tensor]:
    """The captured Muon gradients (read after a clip before Muon by ``k``) as the averaged gradient;
    where no ``muon_update`` hands them over, they were read before the clip and stay as they are."""
    if k is None:
        return dict(forced)
    return {n: (g * k if runs_muon_update(conv, use_muon[n]) else g) for n, g in forced.items()}


def step_conventions(conv: Conventions, unused_adam: frozenset) -> Conventions:
    """The conventions of one step: where the reported norm leaves out an unused Adam parameter's term
    (``stale_unused_grads="norm-drops-adam"``), the names ``unused_adam`` of this step are excluded."""
    if conv.stale_unused_grads == "norm-drops-adam":
        return replace(conv, norm_excluded=frozenset(unused_adam))
    return conv


def update_rounding(conv: Conventions, grad_store: str, model_dtype: str) -> float:
    """The unit roundoff of the dtype the applied Muon update is held in: the gradient buffer's, or the
    model dtype's where the Muon state is kept there."""
    return max(unit_roundoff(grad_store), unit_roundoff(model_dtype) if conv.momentum_dtype == "model" else 0.0)
