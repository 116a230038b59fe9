"""The state that must survive a checkpoint save/resume, and a comparison of two such states.

A resumed run must continue *bit for bit* as if it had never stopped, so every piece of state that a
step reads has to be saved. For Muon-with-aux-Adam under ZeRO (DeepSpeed 0.19.8:
``runtime/zero/stage_1_and_2.py`` ``state_dict`` / ``load_state_dict``, ``runtime/zero/stage3.py``
``_rigid_state_dict`` / ``_rigid_load_state_dict``, the Muon momentum kept in the optimizer state as
``momentum_buffer``, ``runtime/fp16/loss_scaler.py`` ``DynamicLossScaler`` attributes, and the engine
counters in ``runtime/engine.py``) that is the list in :data:`CHECKPOINT_FIELDS`. Forgetting any one
of them changes a later step: e.g. dropping ``cur_hysteresis`` turns the next overflow from a skip
into a backoff; dropping ``last_overflow_iter`` moves the next scale growth; dropping Adam's ``t``
redoes the bias correction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .loss_scaler import LossScalerState
from .step import OracleState


@dataclass(frozen=True)
class StateField:
    name: str
    per_param: bool
    description: str
    deepspeed: str   # where DeepSpeed 0.19.8 keeps it


CHECKPOINT_FIELDS: tuple[StateField, ...] = (
    StateField("master", True, "fp32 master weights (not only the model-dtype copy: rounding them "
               "through fp16/bf16 loses the low bits)",
               "single_partition_of_fp32_groups / fp32_partitioned_groups_flat"),
    StateField("momentum", True, "Muon momentum buffer, in its units (true or loss-scaled) and dtype",
               "optimizer state 'momentum_buffer' (ZeRO-1/2 staged copy committed per step; ZeRO-3 per sub-group)"),
    StateField("adam_m", True, "Adam first moment", "optimizer state 'exp_avg'"),
    StateField("adam_v", True, "Adam second moment", "optimizer state 'exp_avg_sq'"),
    StateField("adam_step", False, "Adam step count t (applied steps only; drives bias correction)",
               "optimizer state 'step'"),
    StateField("scaler.scale", False, "current loss scale", "DynamicLossScaler.cur_scale"),
    StateField("scaler.cur_iter", False, "scaler iteration counter", "DynamicLossScaler.cur_iter"),
    StateField("scaler.last_overflow_iter", False, "iteration of the last overflow (-1: none)",
               "DynamicLossScaler.last_overflow_iter"),
    StateField("scaler.cur_hysteresis", False, "remaining hysteresis", "DynamicLossScaler.cur_hysteresis"),
    StateField("step_count", False, "optimizer steps taken, skipped included", "engine.global_steps"),
    StateField("skipped_steps", False, "skipped steps", "engine.skipped_steps"),
)


def checkpoint_state(state: OracleState) -> dict:
    """A plain dict of exactly the checkpointed fields (tensors cloned)."""
    return {
        "master": {k: v.clone() for k, v in state.master.items()},
        "momentum": {k: v.clone() for k, v in state.momentum.items()},
        "adam_m": {k: v.clone() for k, v in state.adam_m.items()},
        "adam_v": {k: v.clone() for k, v in state.adam_v.items()},
        "adam_step": state.adam_step,
        "scaler": {"scale": state.scaler.scale, "cur_iter": state.scaler.cur_iter,
                   "last_overflow_iter": state.scaler.last_overflow_iter,
                   "cur_hysteresis": state.scaler.cur_hysteresis},
        "step_count": state.step_count,
        "skipped_steps": state.skipped_steps,
    }


def restore_state(saved: dict) -> OracleState:
    sc = saved["scaler"]
    return OracleState(
        master={k: v.clone() for k, v in saved["master"].items()},
        momentum={k: v.clone() for k, v in saved["momentum"].items()},
        adam_m={k: v.clone() for k, v in saved["adam_m"].items()},
        adam_v={k: v.clone() for k, v in saved["adam_v"].items()},
        adam_step=int(saved["adam_step"]),
        scaler=LossScalerState(float(sc["scale"]), int(sc["cur_iter"]), int(sc["last_overflow_iter"]),
                               int(sc["cur_hysteresis"])),
        step_count=int(saved["step_count"]),
        skipped_steps=int(saved["skipped_steps"]),
    )


@dataclass(frozen=True)
class StateDifference:
    field: str
    param: Optional[str]
    detail: str


def compare_states(a: OracleState, b: OracleState, *, atol: float = 0.0, rtol: float = 0.0
                   ) -> list[StateDifference]:
    """Every checkpointed field on which ``a`` and ``b`` differ (empty list: equivalent).

    Tensors are compared as ``max|a-b| <= atol + rtol*max|b|`` (defaults: bit-exact; NaN equals NaN);
    counters and the scaler exactly.
    """
    diffs: list[StateDifference] = []
    for fname in ("master", "momentum", "adam_m", "adam_v"):
        da, db = getattr(a, fname), getattr(b, fname)
        if set(da) != set(db):
            diffs.append(StateDifference(fname, None, f"parameters differ: {sorted(set(da) ^ set(db))}"))
        for name in sorted(set(da) & set(db)):
            x, y = da[name].to(torch.float64), db[name].to(torch.float64)
            if x.shape != y.shape:
                diffs.append(StateDifference(fname, name, f"shape {tuple(x.shape)} vs {tuple(y.shape)}"))
                continue
            both_nan = torch.isnan(x) & torch.isnan(y)
            same = (x == y) | both_nan
            if bool(same.all()):
                continue
            d = (x - y).abs()[~same]
            err = float(d.max()) if d.numel() else math.inf
            scale = float(y[torch.isfinite(y)].abs().max()) if bool(torch.isfinite(y).any()) else 0.0
            if not (math.isfinite(err) and err <= atol + rtol * scale):
                diffs.append(StateDifference(fname, name, f"max |diff| {err:.3e} (bound {atol + rtol * scale:.3e})"))
    for fname in ("adam_step", "step_count", "skipped_steps"):
        if getattr(a, fname) != getattr(b, fname):
            diffs.append(StateDifference(fname, None, f"{getattr(a, fname)} vs {getattr(b, fname)}"))
    for fname in ("scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
        x, y = getattr(a.scaler, fname), getattr(b.scaler, fname)
        if x != y:
            diffs.append(StateDifference(f"scaler.{fname}", None, f"{x} vs {y}"))
    return diffs
