"""The oracle switches that model stock DeepSpeed bugs (``Conventions.reported_norm``,
``scaled_update_dtype``, ``padded_tail_momentum_dtype``): each changes exactly what its bug changes.
Expected values come from the intended step and the bug's stated mechanism, not from earlier runs.
"""
from __future__ import annotations


import torch

from oracles import Conventions, LossScalerConfig, ParamSpec, StepConfig, initial_state, oracle_step, round_to

SPECS = (ParamSpec("w", (7, 3), True), ParamSpec("b", (5,), False))


def _weights():
    gen = torch.Generator().manual_seed(3)
    return {s.name: torch.randn(*s.shape, generator=gen, dtype=torch.float64) * 0.3 for s in SPECS}


def _grads(seed=4, scale=1e-3):
    """Small enough that S * g stays inside fp16's range at the default scale 2^16."""
    gen = torch.Generator().manual_seed(seed)
    return [[{s.name: torch.randn(*s.shape, generator=gen, dtype=torch.float64) * scale for s in SPECS}]]


def test_reported_norm_after_the_scale_update_is_halved_on_a_growth_step_only():
    cfg = StepConfig(SPECS, model_dtype="fp16",
                     loss_scaler=LossScalerConfig(initial_scale_power=8, loss_scale_window=1))
    conv = Conventions(scale_update_before_unscale=True, reported_norm="clip_norm")
    st, first = oracle_step(initial_state(cfg, _weights(), conv), _grads(), cfg, conv)
    assert first.loss_scale_after == first.loss_scale_used and first.reported_norm == first.global_norm
    _, rec = oracle_step(st, _grads(5), cfg, conv)
    assert rec.loss_scale_after == 2 * rec.loss_scale_used  # window 1: the second clean step grows
    assert rec.reported_norm == rec.global_norm / 2
    _, plain = oracle_step(st, _grads(5), cfg, Conventions(scale_update_before_unscale=True))
    assert plain.reported_norm == plain.global_norm


def test_scaled_update_overflow_skips_with_the_momentum_committed():
    """DSM-005: S*O beyond fp16's range: the step is skipped and the scale backs off, but the momentum
    has already advanced -- exactly the intended momentum of that step."""
    big = StepConfig(SPECS, model_dtype="fp16", loss_scaler=LossScalerConfig(initial_scale_power=16, hysteresis=1))
    conv = Conventions(scaled_update_dtype="model")
    st = initial_state(big, _weights(), conv)
    _, intended = oracle_step(st, _grads(), big, Conventions())
    st1, rec = oracle_step(st, _grads(), big, conv)
    assert not intended.skipped and rec.skipped and rec.skip_reason == "update_overflow"
    assert float(intended.params["w"].direction.abs().max()) * 65536 >= 65520
    assert rec.loss_scale_after == rec.loss_scale_used / 2
    assert torch.equal(st1.momentum["w"], intended.params["w"].momentum)
    assert torch.equal(st1.master["w"], st.master["w"]) and torch.equal(st1.master["b"], st.master["b"])
    small = StepConfig(SPECS, model_dtype="fp16", loss_scaler=LossScalerConfig(initial_scale_power=8))
    _, ok = oracle_step(initial_state(small, _weights(), conv), _grads(), small, conv)
    assert not ok.skipped  # 256 * max|O| stays finite in fp16


def test_padded_tail_momentum_rounds_only_the_tail_rank_slice():
    """DSM-009: 21 elements over 2 ranks: partitions of 11; the rank holding [11, 21) rounds its slice."""
    cfg = StepConfig(SPECS, model_dtype="fp16", world_size=2)
    grads = _grads() * 2
    st = initial_state(cfg, _weights())
    _, exact = oracle_step(st, grads, cfg, Conventions())
    _, tail = oracle_step(st, grads, cfg, Conventions(padded_tail_momentum_dtype="fp16"))
    m, t = exact.params["w"].momentum.reshape(-1), tail.params["w"].momentum.reshape(-1)
    assert torch.equal(t[:11], m[:11])
    assert torch.equal(t[11:], round_to(m[11:], torch.float16))
    assert not torch.equal(t[11:], m[11:])
    even = StepConfig((ParamSpec("w", (6, 4), True),), model_dtype="fp16", world_size=2)
    g = [[{"w": _grads()[0][0]["w"][:6, :3].repeat(1, 2)[:, :4]}]] * 2
    s0 = initial_state(even, {"w": torch.ones(6, 4, dtype=torch.float64)})
    _, a = oracle_step(s0, g, even, Conventions())
    _, b = oracle_step(s0, g, even, Conventions(padded_tail_momentum_dtype="fp16"))
    assert torch.equal(a.params["w"].momentum, b.params["w"].momentum)  # 24 = 2 x 12: no padded tail


def test_update_stored_in_a_16_bit_partition_rounds_the_applied_update_only():
    """DSM-001 on ZeRO-3 with communication_data_type fp32 over a bf16 partition: the momentum is the
    intended one, the direction the norm and the step read is the intended direction rounded to bf16."""
    cfg = StepConfig(SPECS, model_dtype="bf16", world_size=2, muon_lr=0.05)
    grads = _grads() * 2
    st = initial_state(cfg, _weights())
    _, exact = oracle_step(st, grads, cfg, Conventions())
    _, stored = oracle_step(st, grads, cfg, Conventions(update_store_dtype="bf16"))
    e, s = exact.params["w"], stored.params["w"]
    assert torch.equal(s.momentum, e.momentum)
    assert torch.equal(s.direction, round_to(e.direction, torch.bfloat16))
    assert not torch.equal(s.direction, e.direction)
    assert torch.equal(s.master, round_to(st.master["w"] - 0.05 * s.direction, torch.float32))
    assert stored.params["b"].master.equal(exact.params["b"].master)  # Adam is not a Muon update
    assert stored.global_norm != exact.global_norm  # the norm reads the rounded update


def test_switch_values_are_checked():
    for bad in ({"reported_norm": "x"}, {"scaled_update_dtype": "fp32"}, {"padded_tail_momentum_dtype": "fp32"},
                {"update_store_dtype": "fp32"}):
        try:
            Conventions(**bad)
        except ValueError as e:
            assert next(iter(bad)) in str(e)
        else:
            raise AssertionError(f"{bad} accepted")
