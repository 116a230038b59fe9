"""Checkpoint/resume: the listed state is sufficient (resume is bit-exact) and each part is necessary
(corrupting any one of them changes the run after the resume, and ``compare_states`` says which)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from oracles import (CHECKPOINT_FIELDS, LossScalerConfig, ParamSpec, StepConfig, checkpoint_state, compare_states,
                     initial_state, restore_state, run)

SPECS = (ParamSpec("w", (6, 10), True), ParamSpec("b", (6,), False))


def _setup():
    cfg = StepConfig(params=SPECS, model_dtype="fp16", adam_lr=1e-2, gradient_clipping=1.0,
                     loss_scaler=LossScalerConfig(initial_scale_power=8, loss_scale_window=5, hysteresis=2))
    gen = torch.Generator().manual_seed(8)
    w = {s.name: 0.3 * torch.randn(*s.shape, generator=gen, dtype=torch.float64) for s in SPECS}
    steps = []
    # Scaler story (window 5, hysteresis 2): overflow at step 3 spends the hysteresis; resuming at step
    # 5, a state that forgot the overflow (last_overflow_iter=-1) would grow right away and refill the
    # hysteresis, and one with the hysteresis refilled would only spend it at step 7 instead of backing off.
    for k in range(10):
        g = {s.name: torch.randn(*s.shape, generator=gen, dtype=torch.float64) * 1e-2 for s in SPECS}
        if k in (3, 7):
            g["w"][0, 0] = float("inf")
        steps.append([[g]])
    return cfg, w, steps


def test_resume_is_bit_exact():
    cfg, w, steps = _setup()
    full, recs = run(initial_state(cfg, w), steps, cfg)
    assert [r.skipped for r in recs].count(True) == 2
    mid, _ = run(initial_state(cfg, w), steps[:5], cfg)
    resumed, _ = run(restore_state(checkpoint_state(mid)), steps[5:], cfg)
    assert compare_states(full, resumed) == []


def _corruptions(state):
    sc = state.scaler
    return {
        "master": replace(state, master={**state.master, "w": state.master["w"] + 2 ** -20}),
        "momentum": replace(state, momentum={"w": state.momentum["w"] * 1.5}),
        "adam_m": replace(state, adam_m={"b": state.adam_m["b"] * 1.5}),
        "adam_v": replace(state, adam_v={"b": state.adam_v["b"] * 1.5}),
        "adam_step": replace(state, adam_step=0),
        "scaler.scale": replace(state, scaler=replace(sc, scale=sc.scale * 2)),
        "scaler.cur_iter": replace(state, scaler=replace(sc, cur_iter=0)),
        "scaler.last_overflow_iter": replace(state, scaler=replace(sc, last_overflow_iter=-1)),
        "scaler.cur_hysteresis": replace(state, scaler=replace(sc, cur_hysteresis=2)),  # as if refilled
        "step_count": replace(state, step_count=0),
        "skipped_steps": replace(state, skipped_steps=0),
    }


@pytest.mark.parametrize("field", [f.name for f in CHECKPOINT_FIELDS])
def test_every_checkpointed_field_matters(field):
    cfg, w, steps = _setup()
    full, _ = run(initial_state(cfg, w), steps, cfg)
    mid, _ = run(initial_state(cfg, w), steps[:5], cfg)  # after the first overflow: hysteresis spent
    assert mid.scaler.cur_hysteresis == 1 and mid.scaler.last_overflow_iter == 3
    bad = _corruptions(restore_state(checkpoint_state(mid)))[field]
    assert compare_states(mid, bad), field  # the corruption itself is seen
    resumed, recs = run(bad, steps[5:], cfg)
    _, ref = run(restore_state(checkpoint_state(mid)), steps[5:], cfg)
    trace = lambda rs: [(r.skipped, r.loss_scale_used, r.loss_scale_after) for r in rs]  # noqa: E731
    assert compare_states(full, resumed) or trace(recs) != trace(ref), \
        f"corrupting {field} left no trace after the resume"
