"""Learning-rate schedules: the lr a parameter group uses in an optimizer step, from the schedule's
documented formula (DeepSpeed's ``WarmupLR`` / ``WarmupDecayLR`` / ``WarmupCosineLR`` docstrings and
the DeepSpeed config documentation; torch's ``StepLR`` / ``ExponentialLR`` documentation).

Pure functions of (schedule, the group's base lr, the number of optimizer steps already applied).
Nothing here reads a live scheduler or optimizer.

Counting. A DeepSpeed schedule is indexed by ``last_batch_iteration``, which is -1 when it is built
(and sets the groups' lr then) and advances by one after each *applied* optimizer step (the engine
does not step the scheduler on a skipped step): a step that follows ``applied`` applied steps uses
iteration ``applied - 1`` (the first step runs at the build-time value, iteration -1). A torch scheduler steps
once when it is built (epoch 0) and once after each applied step: epoch ``applied``.

Per group. ``WarmupLR`` without ``warmup_max_lr`` warms each group up to the group's own lr (the
Muon half to ``muon_lr``, the Adam half to ``adam_lr``); a float ``warmup_max_lr`` / ``warmup_min_lr``
is the same for every group. ``WarmupDecayLR``'s ``warmup_max_lr`` defaults to 0.001 for every group.
``WarmupCosineLR`` scales each group's own lr by one ratio. Torch schedules scale each group's own lr.
"""
from __future__ import annotations

import math
from typing import Mapping

DEEPSPEED_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
TORCH_SCHEDULES = ("StepLR", "ExponentialLR")
SCHEDULES = DEEPSPEED_SCHEDULES + TORCH_SCHEDULES


def _float(params: Mapping, key: str, default):
    v = params.get(key, default)
    if isinstance(v, (list, tuple)):
        raise ValueError(f"scheduler {key}: a per-group list is not supported by the oracle, give one number")
    return None if v is None else float(v)


def _warmup_fraction(i: int, n: int, kind: str) -> float:
    """Fraction of the warm-up done at iteration ``i`` (0 <= i < n): log(i+1)/log(n) or i/n."""
    if kind == "linear":
        return i / n
    return math.log(i + 1) / math.log(n)


def validate(schedule: Mapping) -> None:
    """Raise ValueError naming the cause for a schedule the oracle cannot compute."""
    kind = schedule.get("type")
    if kind not in SCHEDULES:
        raise ValueError(f"scheduler type {kind!r}: the oracle knows {list(SCHEDULES)}")
    params = schedule.get("params", {}) or {}
    if kind in DEEPSPEED_SCHEDULES:
        n = params.get("warmup_num_steps", 1000)
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"scheduler warmup_num_steps must be a positive integer, got {n!r}")
        if params.get("warmup_type", "log") not in ("log", "linear"):
            raise ValueError(f"scheduler warmup_type {params.get('warmup_type')!r} is not log/linear")
        for key in ("warmup_min_lr", "warmup_max_lr", "warmup_min_ratio", "cos_min_ratio"):
            _float(params, key, None)
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in params:
        raise ValueError(f"scheduler {kind} needs total_num_steps")
    if kind == "StepLR" and "step_size" not in params:
        raise ValueError("scheduler StepLR needs step_size")


def group_lr(schedule: Mapping | None, base_lr: float, applied: int, default_peak: float | None = None) -> float:
    """The lr of a group whose own (configured) lr is ``base_lr`` in the optimizer step that follows
    ``applied`` applied steps. ``schedule``: ``{"type": ..., "params": {...}}`` or None (constant).
    ``default_peak``: the peak a ``WarmupLR`` without ``warmup_max_lr`` warms to, where it is not the
    group's own lr (a bug model's; the documented rule is the group's own)."""
    if not schedule:
        return float(base_lr)
    validate(schedule)
    kind = schedule["type"]
    p = schedule.get("params", {}) or {}
    if kind in TORCH_SCHEDULES:
        epoch = applied
        gamma = float(p.get("gamma", 0.1))
        if kind == "StepLR":
            return float(base_lr) * gamma ** (epoch // int(p["step_size"]))
        return float(base_lr) * gamma ** epoch
    i = applied - 1  # last_batch_iteration
    n = max(2, int(p.get("warmup_num_steps", 1000)))
    wtype = p.get("warmup_type", "log")
    if kind in ("WarmupLR", "WarmupDecayLR"):
        lo = _float(p, "warmup_min_lr", 0.0)
        hi = _float(p, "warmup_max_lr", None if kind == "WarmupLR" else 0.001)
        hi = float(base_lr if default_peak is None else default_peak) if hi is None else hi
        if i < 0:
            return lo
        if i < n:
            g = _warmup_fraction(i, n, wtype)
        elif kind == "WarmupLR":
            g = 1.0
        else:
            total = int(p["total_num_steps"])
            g = max(0.0, (total - i) / max(1.0, total - n))
        return lo + (hi - lo) * g
    # WarmupCosineLR
    if i < 0:
        return 0.0
    wmin = _float(p, "warmup_min_ratio", 0.0)
    cmin = _float(p, "cos_min_ratio", 0.0001)
    if i < n:
        ratio = wmin + _warmup_fraction(i, n, wtype) * (1.0 - wmin)
    else:
        total = int(p["total_num_steps"])
        progress = min(1.0, (i - n + 1) / max(1, total - n))
        ratio = max(0.0, cmin + (1.0 - cmin) * (1.0 + math.cos(math.pi * progress)) / 2.0)
    return float(base_lr) * ratio
