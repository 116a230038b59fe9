"""Behaviour of the full oracle step: averaging, skipping, clipping, conventions, rounding, teacher forcing.

Expected values are built here from the module-level pieces (``muon_momentum``, ``muon_direction``,
``adam_step``, ``clip_coefficient``) or from invariances, never from numbers of a previous run.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from oracles import (Conventions, LossScalerConfig, OracleState, ParamSpec, StepConfig, adam_step, clip_coefficient,
                     deepspeed_conventions, initial_state, muon_direction, muon_momentum, ns_relative_error,
                     oracle_step, round_to, run)

SPECS = (ParamSpec("w1", (6, 10), True), ParamSpec("w2", (12, 4), True), ParamSpec("heads", (8, 6), True, 2),
         ParamSpec("conv", (4, 2, 3, 3), True), ParamSpec("bias", (6,), False), ParamSpec("scale", (5,), False))


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(*s.shape, generator=gen, dtype=torch.float64) * 0.2 for s in SPECS}


def _grads(W, GAS, seed=1, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [[{s.name: torch.randn(*s.shape, generator=gen, dtype=torch.float64) * scale for s in SPECS}
             for _ in range(GAS)] for _ in range(W)]


def _cfg(**kw):
    base = dict(params=SPECS, muon_lr=0.02, adam_lr=1e-3, weight_decay=0.01, gradient_clipping=0.0)
    base.update(kw)
    return StepConfig(**base)


def test_averaging_over_ranks_and_micro_batches():
    """W=2, GAS=2 gives the step of W=1, GAS=1 fed the mean gradient (powers of two: exact)."""
    cfg4 = _cfg(world_size=2, gradient_accumulation_steps=2)
    cfg1 = _cfg()
    grads = _grads(2, 2)
    mean = {n: sum(grads[r][m][n] for r in range(2) for m in range(2)) / 4 for n in grads[0][0]}
    s4, r4 = oracle_step(initial_state(cfg4, _weights()), grads, cfg4)
    s1, r1 = oracle_step(initial_state(cfg1, _weights()), [[mean]], cfg1)
    for n in mean:
        assert torch.equal(r4.params[n].grad, r1.params[n].grad)
        assert torch.equal(s4.master[n], s1.master[n])


def test_muon_and_adam_updates_are_the_intended_formulas():
    cfg = _cfg(gradient_clipping=0.5)
    st0 = initial_state(cfg, _weights())
    grads = _grads(1, 1)
    st1, rec = oracle_step(st0, grads, cfg)
    G = {n: grads[0][0][n] for n in grads[0][0]}
    O = {}
    for s in SPECS:
        if s.use_muon:
            m, U = muon_momentum(st0.momentum[s.name], G[s.name], cfg.momentum)
            O[s.name] = muon_direction(U, cfg.ns_method, s.num_heads)
            assert torch.equal(rec.params[s.name].momentum, m)
    norm = math.sqrt(sum(float(o.square().sum()) for o in O.values())
                     + sum(float(G[s.name].square().sum()) for s in SPECS if not s.use_muon))
    k = clip_coefficient(norm, 0.5)
    assert k > 1 and rec.clip_coef == k and rec.global_norm == pytest.approx(norm, rel=1e-14)
    for s in SPECS:
        th = st0.master[s.name]
        if s.use_muon:
            expect = th * (1 - 0.02 * 0.01) - 0.02 * O[s.name] / k
        else:
            expect = adam_step(th, G[s.name] / k, st0.adam_m[s.name], st0.adam_v[s.name], 1, lr=1e-3,
                               weight_decay=0.01).theta
        assert torch.allclose(rec.params[s.name].master, round_to(expect, torch.float32), rtol=0, atol=1e-15)
        assert torch.equal(st1.master[s.name], round_to(st1.master[s.name], torch.float32))  # fp32 storage
    assert st1.adam_step == 1


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_gradient_skips_and_only_the_scaler_moves(bad):
    cfg = _cfg(model_dtype="fp16", loss_scaler=LossScalerConfig(initial_scale_power=10, hysteresis=1))
    st0 = initial_state(cfg, _weights())
    st0, _ = oracle_step(st0, _grads(1, 1, seed=3), cfg)  # one clean step first: nonzero momentum, t=1
    grads = _grads(2, 1, seed=4)
    grads[1][0]["w1"][0, 0] = bad
    st1, rec = oracle_step(st0, grads, replace(cfg, world_size=2))
    assert rec.skipped and rec.skip_reason == "nonfinite_grad"
    assert st1.scaler.scale == st0.scaler.scale / 2 and st1.skipped_steps == 1
    assert st1.adam_step == st0.adam_step
    for n in st0.master:
        assert torch.equal(st1.master[n], st0.master[n])
    for n in st0.momentum:
        assert torch.equal(st1.momentum[n], st0.momentum[n])
    for n in st0.adam_m:
        assert torch.equal(st1.adam_m[n], st0.adam_m[n]) and torch.equal(st1.adam_v[n], st0.adam_v[n])


def test_fp16_overflow_of_the_scaled_gradient_skips():
    cfg = _cfg(model_dtype="fp16", loss_scaler=LossScalerConfig(initial_scale_power=16))
    st0 = initial_state(cfg, _weights())
    small = _grads(1, 1, scale=1e-3)        # |S g| ~ 65536e-3 * 4: fine
    big = _grads(1, 1, scale=1e-3)
    big[0][0]["bias"][2] = 1.0              # S * 1.0 = 65536 >= 65520: overflows fp16
    assert not oracle_step(st0, small, cfg)[1].skipped
    _, rec = oracle_step(st0, big, cfg)
    assert rec.skipped and rec.skip_reason == "fp16_overflow"
    _, rec2 = oracle_step(st0, big, cfg, Conventions(detect_fp16_overflow=False))
    assert not rec2.skipped


def test_intended_step_does_not_depend_on_the_loss_scale():
    grads = _grads(1, 1, scale=1e-3)
    outs = []
    for power in (4, 12):
        cfg = _cfg(model_dtype="fp16", loss_scaler=LossScalerConfig(initial_scale_power=power, loss_scale_window=1),
                   gradient_clipping=0.3)
        st = initial_state(cfg, _weights())
        st, recs = run(st, [grads, grads, grads], cfg)  # window 1: the scale grows every step after the first
        assert recs[-1].loss_scale_after > recs[0].loss_scale_used
        outs.append(st)
    for n in outs[0].master:
        assert torch.equal(outs[0].master[n], outs[1].master[n])


def test_scale_update_before_unscale_halves_adam_on_growth_steps_only():
    cfg = _cfg(model_dtype="fp16", loss_scaler=LossScalerConfig(initial_scale_power=8, loss_scale_window=2))
    grads = [_grads(1, 1, seed=s, scale=1e-2) for s in range(4)]
    intended = run(initial_state(cfg, _weights()), grads, cfg)[1]
    ds = run(initial_state(cfg, _weights()), grads, cfg, Conventions(scale_update_before_unscale=True))[1]
    offload = run(initial_state(cfg, _weights()), grads, cfg,
                  Conventions(scale_update_before_unscale=True, muon_update_in_old_scale=True))[1]
    for i, (a, b, c) in enumerate(zip(intended, ds, offload)):
        assert (a.loss_scale_after > a.loss_scale_used) == (i == 2)  # window 2: growth ends the 3rd clean step
        if i < 2:  # no growth yet: the three conventions coincide exactly
            for n in a.params:
                assert torch.equal(a.params[n].update, b.params[n].update)
                assert torch.equal(a.params[n].update, c.params[n].update)
    lr, wd = cfg.muon_lr, cfg.weight_decay

    def muon_step(recs, i, name="w1"):  # the -lr*O/k part of the update
        return -(recs[i].params[name].update + lr * wd * recs[i - 1].params[name].master)

    # growth step: the ordering alone leaves Muon alone (S' multiplies and divides) ...
    assert torch.equal(ds[2].params["w1"].direction, intended[2].params["w1"].direction)
    # (the update is recovered as a difference of |theta| <= 1 values: ~2u = 2.2e-16 absolute error)
    assert torch.allclose(muon_step(ds, 2), muon_step(intended, 2), rtol=0, atol=1e-15)
    # ... halves it on the offload paths (S*O formed with the old S, divided by S' = 2S) ...
    assert torch.allclose(muon_step(offload, 2), muon_step(intended, 2) / 2, rtol=0, atol=1e-15)
    # ... and Adam sees G/2: its first moment takes (1-beta1) * G/2 instead of (1-beta1) * G
    G = grads[2][0][0]["bias"]
    m_prev = intended[1].params["bias"].adam_m
    assert torch.allclose(ds[2].params["bias"].adam_m, 0.9 * m_prev + 0.1 * G / 2, rtol=1e-14, atol=0)
    assert torch.allclose(intended[2].params["bias"].adam_m, 0.9 * m_prev + 0.1 * G, rtol=1e-14, atol=0)


def test_momentum_in_scaled_units_equals_true_units_while_the_scale_is_constant():
    cfg = _cfg(model_dtype="fp16", loss_scaler=LossScalerConfig(initial_scale_power=10, loss_scale_window=100))
    grads = [_grads(1, 1, seed=s, scale=5.0) for s in range(3)]  # |S g| < 2^10 * 5 * 5: no fp16 overflow
    true_u = run(initial_state(cfg, _weights()), grads, cfg)
    scaled = run(initial_state(cfg, _weights()), grads, cfg, Conventions(momentum_units="scaled"))
    for n in true_u[0].momentum:
        # S = 2^10 throughout: scaled momentum is exactly S times the true one ...
        assert torch.equal(scaled[0].momentum[n], true_u[0].momentum[n] * 2.0 ** 10)
    for i, (rt, rs) in enumerate(zip(true_u[1], scaled[1])):
        for n, r in rt.params.items():
            if not r.use_muon:
                continue
            # ... and NS is scale-invariant except for the 1e-7 added to the norm: a relative input
            # change of ~1e-7/||U||, amplified at most as the tolerance model says (worst case
            # sigma_lo = 0), plus float64 round-off
            U = (1 - cfg.momentum) * grads[i][0][0][n] + cfg.momentum * r.momentum
            U_norm = float(torch.linalg.vector_norm(U))
            rtol = ns_relative_error(2.0 ** -53, 0.0, long_dim=max(r.direction.shape[-2:]),
                                     input_rel_err=1e-7 / U_norm)
            assert (rs.params[n].direction - r.direction).abs().max().item() <= rtol * r.direction.abs().max().item()


def test_momentum_in_scaled_units_misweights_history_after_a_scale_change():
    cfg = _cfg(model_dtype="fp16", loss_scaler=LossScalerConfig(initial_scale_power=10, loss_scale_window=1))
    grads = [_grads(1, 1, seed=s, scale=1e-2) for s in range(3)]
    true_u = run(initial_state(cfg, _weights()), grads, cfg)[1]
    scaled = run(initial_state(cfg, _weights()), grads, cfg, Conventions(momentum_units="scaled"))[1]
    d_true, d_scaled = true_u[-1].params["w1"].direction, scaled[-1].params["w1"].direction
    assert (d_true - d_scaled).abs().max().item() > 1e-3  # a visible, attributable divergence


def test_storage_rounding_conventions():
    cfg = _cfg(model_dtype="bf16")
    st, rec = oracle_step(initial_state(cfg, _weights()), _grads(1, 1), cfg,
                          Conventions(momentum_dtype="model", grad_dtype="model"))
    for r in rec.params.values():
        assert torch.equal(r.model, round_to(r.model, torch.bfloat16))
        assert torch.equal(r.master, round_to(r.master, torch.float32))
        if r.momentum is not None:
            assert torch.equal(r.momentum, round_to(r.momentum, torch.bfloat16))
    st64, rec64 = oracle_step(initial_state(cfg, _weights()), _grads(1, 1), cfg,
                              Conventions(round_master_to_fp32=False))
    assert any(not torch.equal(r.master, round_to(r.master, torch.float32)) for r in rec64.params.values())


def test_gradient_clip_source_clips_before_momentum():
    cfg = _cfg(gradient_clipping=0.1)
    grads = _grads(1, 1)
    st0 = initial_state(cfg, _weights())
    _, rec = oracle_step(st0, grads, cfg, Conventions(clip_norm_source="gradient"))
    G = grads[0][0]
    norm = math.sqrt(sum(float(g.square().sum()) for g in G.values()))
    k = clip_coefficient(norm, 0.1)
    assert rec.clip_coef == pytest.approx(k, rel=1e-14) and rec.global_norm == pytest.approx(norm, rel=1e-14)
    k = rec.clip_coef
    m, U = muon_momentum(st0.momentum["w1"], G["w1"] / k, cfg.momentum)
    assert torch.equal(rec.params["w1"].momentum, m)
    O = muon_direction(U, cfg.ns_method)
    assert torch.allclose(rec.params["w1"].update, -cfg.muon_lr * cfg.weight_decay * st0.master["w1"]
                          - cfg.muon_lr * O, rtol=0, atol=1e-15)  # O not divided by k


def test_per_head_switch_and_deepspeed_conventions():
    cfg = _cfg()
    st0 = initial_state(cfg, _weights())
    _, on = oracle_step(st0, _grads(1, 1), cfg)
    _, off = oracle_step(st0, _grads(1, 1), cfg, Conventions(honor_num_heads=False))
    assert not torch.allclose(on.params["heads"].direction, off.params["heads"].direction, atol=1e-3)
    assert torch.equal(on.params["w1"].direction, off.params["w1"].direction)
    c = deepspeed_conventions(2, offload=False, model_dtype="fp16", parameter_alignment=True)
    assert c.momentum_units == "scaled" and c.momentum_dtype == "model" and not c.honor_num_heads
    c = deepspeed_conventions(3, offload=True, model_dtype="bf16")
    assert c.muon_update_in_old_scale and c.momentum_units == "true" and c.skip_on_nonfinite == "fp16_only"


def test_teacher_forcing_reproduces_a_free_run():
    cfg = _cfg(world_size=2, gradient_accumulation_steps=2, gradient_clipping=1.0)
    grads = [_grads(2, 2, seed=s) for s in range(3)]
    free, _ = run(initial_state(cfg, _weights()), grads, cfg)
    st = initial_state(cfg, _weights())
    for g in grads:
        st, _ = oracle_step(st, g, cfg)
        # rebuild the state from plain tensors, as a harness would from DeepSpeed's buffers
        st = OracleState(master={n: t.clone() for n, t in st.master.items()},
                         momentum={n: t.clone() for n, t in st.momentum.items()},
                         adam_m={n: t.clone() for n, t in st.adam_m.items()},
                         adam_v={n: t.clone() for n, t in st.adam_v.items()},
                         adam_step=st.adam_step, scaler=st.scaler, step_count=st.step_count)
    for n in free.master:
        assert torch.equal(free.master[n], st.master[n])


def test_emulated_mode_stays_close_to_exact():
    cfg = _cfg()
    grads = _grads(1, 1)
    st0 = initial_state(cfg, _weights())
    _, ex = oracle_step(st0, grads, cfg)
    _, em = oracle_step(st0, grads, cfg, Conventions(momentum_dtype="fp32"), ns_mode="emulated")
    for n, r in ex.params.items():
        if r.use_muon:
            d = (em.params[n].direction - r.direction).abs().max().item() / r.direction.abs().max().item()
            assert 0 < d < 0.5  # 16-bit NS: inexact but the same direction (tight checks: test_tolerance)


def test_clip_coefficient_puts_the_epsilon_on_the_norm():
    """DeepSpeed's ``unscale_and_clip_grads``: ``clip = ((N/S) + 1e-6) / c``, clamped below at 1. So a
    norm exactly at the threshold is still clipped, by ``1 + 1e-6/c`` -- visible for a small ``c``
    (an epsilon added after the division would give ``1 + 1e-6``)."""
    c = 1e-3
    assert clip_coefficient(c, c) == pytest.approx(1 + 1e-6 / c, rel=1e-12)
    assert clip_coefficient(0.5 * c, c) == 1.0
    assert clip_coefficient(123.0, 0.0) == 1.0 and clip_coefficient(123.0, -1.0) == 1.0
    assert clip_coefficient(float("inf"), 1.0) == float("inf")


def test_a_reduction_that_sums_before_dividing_overflows_where_no_rank_does():
    """Two ranks each at 0.6 of fp16's overflow threshold: their average is finite, their sum is not. Only
    a reduction that sums first (stage 0 without prescale_gradients) overflows."""
    import torch

    from oracles import ParamSpec, StepConfig
    from oracles.step import FP16_OVERFLOW, fp16_overflow

    spec = ParamSpec("w", (2, 2), use_muon=True)
    g = {"w": torch.full((2, 2), 0.6 * FP16_OVERFLOW, dtype=torch.float64)}
    grads = [[g], [g]]
    predivided = StepConfig(params=(spec,), world_size=2, model_dtype="fp16")
    assert not fp16_overflow(grads, predivided, 1.0)
    assert fp16_overflow(grads, StepConfig(params=(spec,), world_size=2, model_dtype="fp16",
                                           reduction_sums_ranks=True), 1.0)


def test_a_clip_before_muon_takes_its_norm_before_a_grown_scale_halves_the_muon_gradient():
    """Without ZeRO on a growth step (DSM-003's stage-0 model) Muon reads ``G S / S'`` but the raw norm the
    clip and the report read was taken before the unscale: the Muon terms count at ``G``, Adam's as read."""
    import torch

    from oracles import Conventions, ParamSpec, StepConfig
    from oracles.step import _raw_norm_terms

    cfg = StepConfig(params=(ParamSpec("w", (2, 2), use_muon=True), ParamSpec("b", (2,), use_muon=False)))
    Gs = {"w": torch.full((2, 2), 1.0, dtype=torch.float64), "b": torch.full((2,), 3.0, dtype=torch.float64)}
    grown = Conventions(clip_norm_source="gradient", scale_update_before_unscale=True, muon_in_new_scale=True)
    w, b = _raw_norm_terms(Gs, cfg, grown, 0.5)
    assert float(w[0, 0]) == 2.0 and float(b[0]) == 3.0
    assert all(t is Gs[n] for t, n in zip(_raw_norm_terms(Gs, cfg, grown, 1.0), Gs))
    assert all(t is Gs[n] for t, n in zip(_raw_norm_terms(Gs, cfg, Conventions(clip_norm_source="gradient"), 0.5), Gs))
