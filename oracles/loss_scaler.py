"""The dynamic loss scaler as a pure state machine.

Specifies DeepSpeed 0.19.8 ``runtime/fp16/loss_scaler.py`` ``DynamicLossScaler.update_scale`` (and the
static ``LossScaler``; selection in ``CreateLossScaler``), with the config defaults of
``runtime/precision_config.py`` (docs/deepspeed-0.19.8.md section 9). Every rule of the scaler is deliberate
design, so the oracle follows it exactly; only *when* the new scale is applied relative to unscaling
is an accident, and that lives in ``oracles.step.Conventions.scale_update_before_unscale``.

The rules, in words (one call per optimizer step, skipped steps included):

* ``it`` counts calls (from 0); ``last_overflow`` is the ``it`` of the latest overflow (-1 at start).
* Overflow: if hysteresis is configured as 1, or the remaining hysteresis ``h`` is down to 1, halve the
  scale (never below ``min_scale``; being at ``min_scale`` already is an error when
  ``raise_error_at_min_scale``). Otherwise only ``h`` drops by one and the scale stays. Either way
  ``last_overflow = it``. Note ``h`` is *not* refilled by a halving, so after one backoff every
  further overflow halves again until ``h`` is refilled.
* Clean step: with ``consecutive_hysteresis`` ``h`` is refilled on every clean step. Let
  ``stable = it - last_overflow - 1`` (clean steps before this one since the last overflow). If
  ``stable > 0`` and ``stable % window == 0`` the scale doubles (and, without consecutive hysteresis,
  ``h`` is refilled here). Hence the first doubling comes after ``window + 1`` clean steps.
* ``it += 1``.

bf16 and fp32 models use a static scale of 1; fp16 with ``loss_scale > 0`` uses that static scale.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


class LossScaleAtMinimum(RuntimeError):
    """DeepSpeed raises ("Current loss scale already at minimum") on an overflow at ``min_scale``."""


@dataclass(frozen=True)
class LossScalerConfig:
    dynamic: bool = True                 # fp16 with loss_scale == 0
    initial_scale_power: int = 16        # S0 = 2**initial_scale_power
    loss_scale_window: int = 1000
    hysteresis: int = 2                  # DeepSpeed's "delayed_shift"
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    static_loss_scale: float = 1.0       # used when not dynamic (fp16 loss_scale > 0; 1 for bf16/fp32)
    raise_error_at_min_scale: bool = True
    scale_factor: float = 2.0

    @staticmethod
    def for_model_dtype(model_dtype: str, **overrides) -> "LossScalerConfig":
        """fp16 -> dynamic (unless overridden); bf16/fp32 -> static 1 (``CreateLossScaler``)."""
        if model_dtype == "fp16":
            return LossScalerConfig(**overrides)
        return LossScalerConfig(dynamic=False, static_loss_scale=1.0)


@dataclass(frozen=True)
class LossScalerState:
    scale: float
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 2


def initial_state(cfg: LossScalerConfig) -> LossScalerState:
    if not cfg.dynamic:
        return LossScalerState(scale=float(cfg.static_loss_scale), cur_hysteresis=cfg.hysteresis)
    return LossScalerState(scale=float(2 ** cfg.initial_scale_power), cur_hysteresis=cfg.hysteresis)


def update_scale(state: LossScalerState, overflow: bool, cfg: LossScalerConfig) -> LossScalerState:
    """The scaler state after one optimizer step that did (``overflow``) or did not overflow."""
    if not cfg.dynamic:
        return state
    scale, h, last = state.scale, state.cur_hysteresis, state.last_overflow_iter
    if overflow:
        if cfg.hysteresis == 1 or h == 1:
            if scale == cfg.min_loss_scale and cfg.raise_error_at_min_scale:
                raise LossScaleAtMinimum(f"loss scale already at minimum {scale}")
            scale = max(scale / cfg.scale_factor, cfg.min_loss_scale)
        else:
            h -= 1
        last = state.cur_iter
    else:
        if cfg.consecutive_hysteresis:
            h = cfg.hysteresis
        stable = state.cur_iter - last - 1
        if stable > 0 and stable % cfg.loss_scale_window == 0:
            if not cfg.consecutive_hysteresis:
                h = cfg.hysteresis
            scale = scale * cfg.scale_factor
    return replace(state, scale=scale, cur_iter=state.cur_iter + 1, last_overflow_iter=last, cur_hysteresis=h)


def scale_plan(cfg: LossScalerConfig, steps: int, overflowed=frozenset(),
               restart_after: int | None = None) -> tuple[tuple[float, float, bool], ...]:
    """Per optimizer step 1..``steps``: (scale its backward used, scale after its update, skipped), when
    exactly the steps in ``overflowed`` overflow. Skipped or not, every step calls the scaler once, so a
    skipped step moves the scale (or spends hysteresis) and nothing else; ``restart_after``: a scaler
    rebuilt from ``cfg`` after that step (a resume that does not restore it)."""
    st = initial_state(cfg)
    out = []
    for s in range(1, steps + 1):
        if restart_after is not None and s == restart_after + 1:
            st = initial_state(cfg)
        used = st.scale
        st = update_scale(st, s in overflowed, cfg)
        out.append((float(used), float(st.scale), s in overflowed))
    return tuple(out)
