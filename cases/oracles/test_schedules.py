"""oracles.schedules against the real schedulers run on a throw-away optimizer (torch's and
DeepSpeed's, stepped the way the engine steps them: once after each applied step), and its refusals."""
from __future__ import annotations

import math

import pytest
import torch

from harness.catalog.matrix import SCHEDULES
from oracles.schedules import group_lr, validate


def _live_lrs(schedule, base_lrs, steps):
    """The lr each group holds before each of ``steps`` optimizer steps."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in base_lrs]
    opt = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, base_lrs)], lr=base_lrs[0])
    kind, kw = schedule["type"], dict(schedule.get("params", {}))
    if hasattr(torch.optim.lr_scheduler, kind) and kind in ("StepLR", "ExponentialLR"):
        sched = getattr(torch.optim.lr_scheduler, kind)(opt, **kw)
    else:
        from deepspeed.runtime import lr_schedules

        sched = getattr(lr_schedules, kind)(opt, **kw)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("key", sorted(SCHEDULES))
@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_matches_the_live_scheduler_per_group(key, warmup_type):
    sched = {"type": SCHEDULES[key]["type"], "params": dict(SCHEDULES[key]["params"])}
    if key != "torch":
        sched["params"]["warmup_type"] = warmup_type
        if sched["type"] != "WarmupLR":
            sched["params"]["total_num_steps"] = 9
        sched["params"]["warmup_num_steps"] = 4
    bases = [0.02, 0.001]  # a Muon half and an Adam half
    live = _live_lrs(sched, bases, 10)
    for applied, lrs in enumerate(live):
        for base, lr in zip(bases, lrs):
            assert math.isclose(group_lr(sched, base, applied), float(lr), rel_tol=16 * 2.0 ** -53, abs_tol=0.0), \
                (key, warmup_type, applied, base)


@pytest.mark.parametrize("bad,why", [
    ({"type": "OneCycle"}, "OneCycle"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "positive integer"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cubic"}}, "log/linear"),
    ({"type": "WarmupCosineLR", "params": {}}, "total_num_steps"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}, "per-group list"),
])
def test_refuses_what_it_cannot_compute(bad, why):
    with pytest.raises(ValueError, match=why):
        validate(bad)


def test_constant_without_schedule():
    assert group_lr(None, 0.02, 7) == 0.02
