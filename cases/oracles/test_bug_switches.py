"""The oracle switches that model stock DeepSpeed bugs (``Conventions.reported_norm``,
``scaled_update_dtype``, ``padded_tail_momentum_dtype``): each changes exactly what its bug changes.
Expected values come from the intended step and the bug's stated mechanism, not from earlier runs.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from oracles import Conventions, LossScalerConfig, ParamSpec, StepConfig, initial_state, oracle_step, round_to
from oracles.newton_schulz import muon_direction

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


def test_a_fused_blend_rounds_the_stored_momentum_only():
    """DSM-001 compiled: the momentum is stored in bf16, but Newton-Schulz reads the blend of the gradient
    and the new momentum before that rounding, itself unrounded; only the returned direction is bf16."""
    cfg = StepConfig(SPECS, model_dtype="bf16")
    sixteen = Conventions(momentum_dtype="model")
    st = initial_state(cfg, _weights(), sixteen)
    m = round_to(_grads(seed=9, scale=1e-2)[0][0]["w"], torch.bfloat16)  # an earlier step's stored momentum
    st = replace(st, momentum={**st.momentum, "w": m})
    _, eager = oracle_step(st, _grads(), cfg, sixteen)
    _, fused = oracle_step(st, _grads(), cfg, replace(sixteen, fused_blend=True))
    beta, g = cfg.momentum, round_to(_grads()[0][0]["w"], torch.bfloat16)
    wide = beta * m + (1.0 - beta) * g
    assert torch.equal(fused.params["w"].momentum, round_to(wide, torch.bfloat16))
    assert torch.equal(fused.params["w"].momentum, eager.params["w"].momentum)
    U = (1.0 - beta) * g + beta * wide
    assert torch.equal(fused.params["w"].direction, round_to(muon_direction(U, cfg.ns_method), torch.bfloat16))
    assert not torch.equal(fused.params["w"].direction, eager.params["w"].direction)


def test_warmup_step_at_init_starts_adam_at_step_one_and_decays_the_masters_once():
    """DSM-014: the inner optimizer's step on zero gradients at initialize: Adam's count is 1, its moments
    stay zero (AdamW), each half's decoupled decay shrinks the masters once; the scaler does not move."""
    cfg = StepConfig(SPECS, model_dtype="bf16", weight_decay=0.1, muon_lr=0.02, adam_lr=1e-3)
    plain = initial_state(cfg, _weights())
    warm = initial_state(cfg, _weights(), Conventions(warmup_step_at_init=True))
    assert plain.adam_step == 0 and warm.adam_step == 1 and warm.step_count == 0
    assert warm.scaler == plain.scaler
    assert torch.equal(warm.adam_m["b"], plain.adam_m["b"]) and torch.equal(warm.adam_v["b"], plain.adam_v["b"])
    assert torch.equal(warm.master["w"], round_to(plain.master["w"] * (1 - 0.02 * 0.1), torch.float32))
    assert torch.equal(warm.master["b"], round_to(plain.master["b"] * (1 - 1e-3 * 0.1), torch.float32))
    # the first real step is then Adam's second: bias correction 1 - beta^2, not 1 - beta
    _, r0 = oracle_step(plain, _grads(), cfg, Conventions())
    _, r1 = oracle_step(warm, _grads(), cfg, Conventions(warmup_step_at_init=True))
    d0, d1 = r0.params["b"].direction, r1.params["b"].direction
    (b1, b2) = cfg.betas
    expected = d0 * ((1 - b1) / (1 - b1 ** 2)) / ((1 - b2) / (1 - b2 ** 2)) ** 0.5
    assert torch.allclose(d1, expected, rtol=1e-6) and not torch.allclose(d1, d0, rtol=1e-3)
    nodecay = StepConfig(SPECS, model_dtype="bf16")
    w0 = initial_state(nodecay, _weights(), Conventions(warmup_step_at_init=True))
    assert torch.equal(w0.master["w"], initial_state(nodecay, _weights()).master["w"])


def test_unscaled_backward_feeds_g_over_s_and_reports_the_raw_norm():
    """DSM-015 (+ DSM-016's raw norm): the loss is never scaled but the gradients are divided by S: the
    optimizer reads G/S (Muon's momentum holds it), the raw norm is ||G||; with a scaled backward the
    raw norm carries S."""
    cfg = StepConfig(SPECS, model_dtype="fp16", loss_scaler=LossScalerConfig(initial_scale_power=8))
    S = 256.0
    base = Conventions(clip_norm_source="gradient", reported_norm="raw")
    bug = Conventions(clip_norm_source="gradient", reported_norm="raw", backward_loss_scaled=False)
    st = initial_state(cfg, _weights())
    _, ok = oracle_step(st, _grads(), cfg, base)
    _, r = oracle_step(st, _grads(), cfg, bug)
    assert torch.allclose(r.params["w"].momentum, ok.params["w"].momentum / S, rtol=1e-12, atol=0)
    assert torch.allclose(r.params["b"].adam_m, ok.params["b"].adam_m / S, rtol=1e-12, atol=0)
    assert r.global_norm == ok.global_norm / S
    assert r.reported_norm == ok.global_norm and ok.reported_norm == S * ok.global_norm
    # the fp16 overflow test sees the raw gradient: S*g beyond fp16 no longer skips
    huge = _grads(scale=400.0)  # S*|g| >= 65520 somewhere, |g| itself far below
    assert oracle_step(st, huge, cfg, base)[1].skipped
    assert not oracle_step(st, huge, cfg, bug)[1].skipped


def test_gradient_clip_source_clips_before_muon_with_the_forced_coefficient():
    """DSM-013/016: the clip acts on the raw gradients before Muon; teacher forcing hands the replay the
    k the implementation applied, and Muon's momentum then holds exactly (1-beta) G / k."""
    cfg = StepConfig(SPECS, model_dtype="bf16", gradient_clipping=1e-4)
    conv = Conventions(clip_norm_source="gradient")
    st = initial_state(cfg, _weights())
    _, own = oracle_step(st, _grads(), cfg, conv)
    assert own.clip_coef > 1  # the clip is active
    _, same = oracle_step(st, _grads(), cfg, conv, forced_clip_coef=own.clip_coef)
    assert torch.equal(same.params["w"].momentum, own.params["w"].momentum)
    _, forced = oracle_step(st, _grads(), cfg, conv, forced_clip_coef=2 * own.clip_coef)
    g = _grads()[0][0]["w"]
    assert torch.allclose(forced.params["w"].momentum, (1 - cfg.momentum) * g / (2 * own.clip_coef), rtol=1e-12)
    assert forced.global_norm == own.global_norm  # the norm is the step's own, checked on its own
    assert forced.clip_coef == 2 * own.clip_coef


def test_momentum_lost_at_resume_restarts_muon_from_zero_once():
    """DSM-007: the step after the resume (step count k) starts from zero Muon momentum; other steps, the
    Adam state and the masters read are untouched."""
    cfg = StepConfig(SPECS, model_dtype="fp32")
    conv = Conventions(muon_momentum_lost_after=1)
    st0 = initial_state(cfg, _weights())
    st1, _ = oracle_step(st0, _grads(), cfg, Conventions())
    assert bool(st1.momentum["w"].any())
    a1, lost = oracle_step(st1, _grads(5), cfg, conv)
    fresh = replace(st1, momentum={"w": torch.zeros_like(st1.momentum["w"])})
    _, ref = oracle_step(fresh, _grads(5), cfg, Conventions())
    _, kept = oracle_step(st1, _grads(5), cfg, Conventions())
    assert torch.equal(lost.params["w"].momentum, ref.params["w"].momentum)
    assert not torch.equal(lost.params["w"].momentum, kept.params["w"].momentum)
    assert torch.equal(lost.params["b"].master, kept.params["b"].master)
    _, later = oracle_step(a1, _grads(6), cfg, conv)  # step count 2: nothing lost any more
    _, later_ref = oracle_step(a1, _grads(6), cfg, Conventions())
    assert torch.equal(later.params["w"].momentum, later_ref.params["w"].momentum)
    _, first = oracle_step(st0, _grads(), cfg, conv)  # step count 0: not the resume step
    intended = oracle_step(st0, _grads(), cfg, Conventions())[1]
    assert torch.equal(first.params["w"].momentum, intended.params["w"].momentum)


def test_fresh_engine_state_replaces_only_the_unrestored_parameters():
    """DSM-010: after an NVMe resume the parameters of unswapped sub-groups hold a fresh engine's masters
    and zero optimizer state, Adam's count restarts when all of Adam is fresh, the scaler restarts."""
    from oracles.step import fresh_engine_state

    cfg = StepConfig(SPECS, model_dtype="fp16",
                     loss_scaler=LossScalerConfig(initial_scale_power=8, loss_scale_window=1))
    st = initial_state(cfg, _weights())
    for seed in (4, 5):
        st, _ = oracle_step(st, _grads(seed), cfg, Conventions())
    assert st.adam_step == 2 and st.scaler.scale == 512  # window 1: grown once by the second step
    other = {n: w * 2 for n, w in _weights().items()}
    new = fresh_engine_state(st, cfg, other, Conventions(fresh_after=2, fresh_params=("b",)))
    assert torch.equal(new.master["b"], round_to(round_to(other["b"], torch.float16), torch.float32))
    assert not bool(new.adam_m["b"].any()) and not bool(new.adam_v["b"].any()) and new.adam_step == 0
    assert torch.equal(new.master["w"], st.master["w"]) and torch.equal(new.momentum["w"], st.momentum["w"])
    assert new.scaler.scale == 256 and new.step_count == st.step_count
    both = fresh_engine_state(st, cfg, other, Conventions(fresh_after=2, fresh_params=("w", "b")))
    assert not bool(both.momentum["w"].any())
    none = fresh_engine_state(st, cfg, other, Conventions(fresh_after=2))
    assert none.adam_step == 2 and torch.equal(none.master["b"], st.master["b"]) and none.scaler.scale == 256
    two_adam = StepConfig(SPECS + (ParamSpec("c", (3,), False),))
    st2 = initial_state(two_adam, {**_weights(), "c": torch.ones(3, dtype=torch.float64)})
    try:
        fresh_engine_state(st2, two_adam, {**other, "c": torch.ones(3)},
                           Conventions(fresh_after=1, fresh_params=("b",)))
    except ValueError as e:
        assert "step count" in str(e)
    else:
        raise AssertionError("part of Adam restarting accepted")


def test_norm_excluded_drops_exactly_those_terms_and_steps_them_all_the_same():
    """DSM-023's norm on the offload paths: an excluded Adam parameter's term leaves the norm, by the
    Pythagorean rule, and nothing else of the step changes."""
    cfg = StepConfig(SPECS, model_dtype="fp32")
    st = initial_state(cfg, _weights())
    _, full = oracle_step(st, _grads(), cfg)
    _, part = oracle_step(st, _grads(), cfg, Conventions(norm_excluded=frozenset({"b"})))
    b = float(_grads()[0][0]["b"].norm())
    assert abs(part.global_norm ** 2 - (full.global_norm ** 2 - b ** 2)) < 1e-12 * full.global_norm ** 2
    assert part.global_norm < full.global_norm
    for n in ("w", "b"):
        assert torch.equal(part.params[n].master, full.params[n].master)


def test_switch_values_are_checked():
    for bad in ({"reported_norm": "x"}, {"scaled_update_dtype": "fp32"}, {"padded_tail_momentum_dtype": "fp32"},
                {"update_store_dtype": "fp32"}, {"reported_norm": "scaled"}, {"stale_unused_grads": True}):
        try:
            Conventions(**bad)
        except ValueError as e:
            assert next(iter(bad)) in str(e)
        else:
            raise AssertionError(f"{bad} accepted")


def test_reported_norm_over_the_implementations_own_updates():
    """``norm_directions`` (teacher forcing of the norm): given the oracle's own directions it reproduces
    the reported norm to float64 summation; given another update it is that update's norm by the same
    rule (Muon update + Adam gradient); where the clip reads the gradients it is the fed gradients'
    norm whatever the updates; a shared (other replica's) norm leaves nothing of this run's to judge."""
    cfg = StepConfig(SPECS, model_dtype="fp32")
    st = initial_state(cfg, _weights())
    _, rec = oracle_step(st, _grads(), cfg)
    O = rec.params["w"].direction
    _, same = oracle_step(st, _grads(), cfg, norm_directions={"w": O})
    assert abs(same.reported_norm_own - rec.reported_norm) <= 4 * 2.0 ** -53 * rec.reported_norm
    other = 2.0 * O
    _, twice = oracle_step(st, _grads(), cfg, norm_directions={"w": other})
    g_b = _grads()[0][0]["b"]
    expected = float(torch.sqrt((other ** 2).sum() + (g_b ** 2).sum()))
    assert abs(twice.reported_norm_own - expected) <= 4 * 2.0 ** -53 * expected
    assert twice.reported_norm == rec.reported_norm  # the oracle's own norm and step are untouched
    assert torch.equal(twice.params["w"].master, rec.params["w"].master)
    _, none = oracle_step(st, _grads(), cfg)
    assert none.reported_norm_own is None  # nothing given, nothing to judge
    g = Conventions(clip_norm_source="gradient")
    _, by_grad = oracle_step(initial_state(cfg, _weights(), g), _grads(), cfg, g, norm_directions={"w": other})
    g_w = _grads()[0][0]["w"]
    grad_norm = float(torch.sqrt((g_w ** 2).sum() + (g_b ** 2).sum()))
    assert abs(by_grad.reported_norm_own - grad_norm) <= 4 * 2.0 ** -53 * grad_norm
    _, shared = oracle_step(st, _grads(), cfg, shared_norm=1.5, norm_directions={"w": other})
    assert shared.reported_norm_own is None and shared.reported_norm == 1.5


def test_invalid_norm_skip_commits_the_momentum_muon_wrote():
    """DSM-025: bf16, the raw-gradient test for fp16 only (``skip_on_nonfinite="fp16_only"``): an Adam vector's
    inf reaches the norm, which skips the step; with ``momentum_committed_on_invalid_norm`` the clean
    matrix's momentum is the one Muon wrote, M' = beta M + (1 - beta) G, computed here from the mechanism;
    without it the momentum, the masters and Adam's state are unchanged."""
    cfg = StepConfig(SPECS, model_dtype="bf16")
    base = Conventions(skip_on_nonfinite="fp16_only")
    st = initial_state(cfg, _weights(), base)
    st, first = oracle_step(st, _grads(), cfg, base)  # an applied step: momentum and Adam state exist
    assert not first.skipped
    grads = _grads(6)
    grads[0][0]["b"] = grads[0][0]["b"].clone()
    grads[0][0]["b"][0] = float("inf")
    beta = cfg.momentum
    for commits in (False, True):
        conv = replace(base, momentum_committed_on_invalid_norm=commits)
        new, rec = oracle_step(st, grads, cfg, conv)
        assert rec.skipped and rec.skip_reason == "nonfinite_norm"
        expect = beta * st.momentum["w"] + (1 - beta) * grads[0][0]["w"] if commits else st.momentum["w"]
        assert torch.allclose(new.momentum["w"], expect, rtol=0, atol=1e-15)
        assert torch.equal(new.master["w"], st.master["w"]) and torch.equal(new.master["b"], st.master["b"])
        assert torch.equal(new.adam_m["b"], st.adam_m["b"]) and new.adam_step == st.adam_step
    _, intended = oracle_step(st, grads, cfg, Conventions())
    assert intended.skip_reason == "nonfinite_grad"  # the intended test catches it before Muon


def test_invalid_norm_skip_keeps_a_poisoned_matrix_s_own_momentum():
    """DSM-025 on a poisoned Muon matrix: Muon leaves the momentum of a matrix whose gradient is not finite
    where it was, so only the clean matrices' momentum is committed by the invalid-norm skip."""
    specs = SPECS + (ParamSpec("u", (4, 6), True),)
    cfg = StepConfig(specs, model_dtype="bf16")
    conv = Conventions(skip_on_nonfinite="fp16_only", momentum_committed_on_invalid_norm=True)
    gen = torch.Generator().manual_seed(8)

    def grads():
        return [[{s.name: torch.randn(*s.shape, generator=gen, dtype=torch.float64) * 1e-3 for s in specs}]]

    st = initial_state(cfg, {**_weights(), "u": torch.randn(4, 6, generator=gen, dtype=torch.float64)}, conv)
    st, _ = oracle_step(st, grads(), cfg, conv)
    g = grads()
    g[0][0]["u"][1, 2] = float("nan")
    new, rec = oracle_step(st, g, cfg, conv)
    assert rec.skipped and rec.skip_reason == "nonfinite_norm"
    assert torch.equal(new.momentum["u"], st.momentum["u"])
    beta = cfg.momentum
    assert torch.allclose(new.momentum["w"], beta * st.momentum["w"] + (1 - beta) * g[0][0]["w"], rtol=0, atol=1e-15)


def test_muon_in_new_scale_counts_the_muon_update_doubled_in_the_norm_and_leaves_its_step():
    """DeepSpeed PR #8464's offload path on a growth step (S' = 2S): the norm counts the Muon update as
    O S'/S while Adam's gradient is halved, as DSM-003's; the Muon step itself is O / k. Expected values
    from the mechanism: the norm over (2 O, G_adam), the clip on that norm times S/S'."""
    from oracles import global_norm, clip_coefficient
    from oracles.replay import stepped_gradients

    cfg = StepConfig(SPECS, model_dtype="fp16", gradient_clipping=0.05,
                     loss_scaler=LossScalerConfig(initial_scale_power=8, loss_scale_window=1))
    base = Conventions(scale_update_before_unscale=True)
    pr = replace(base, muon_in_new_scale=True)
    st, _ = oracle_step(initial_state(cfg, _weights(), base), _grads(), cfg, base)
    _, old = oracle_step(st, _grads(5), cfg, base)
    _, rec = oracle_step(st, _grads(5), cfg, pr)
    assert rec.loss_scale_after == 2 * rec.loss_scale_used
    O, g_adam = rec.params["w"].direction, rec.params["b"].grad
    assert torch.equal(O, old.params["w"].direction)  # the fed gradient is the caller's: the same here
    assert abs(rec.global_norm - global_norm([2 * O, g_adam])) <= 1e-12 * rec.global_norm
    k = clip_coefficient(rec.global_norm / 2, 0.05)
    assert rec.clip_coef == k and k > 1
    hp = cfg.hyper(SPECS[0])
    theta = st.master["w"].to(torch.float64)
    want = -hp["lr"] * hp["weight_decay"] * theta - hp["lr"] * O / k  # not halved: the PR's S' cancels
    assert torch.allclose(rec.params["w"].update, want, rtol=1e-10, atol=0)
    G = {"w": torch.ones(7, 3, dtype=torch.float64), "b": torch.ones(5, dtype=torch.float64)}
    fed = stepped_gradients(pr, G, {"w": True, "b": False}, {}, scale_ratio=0.5)
    assert torch.equal(fed["w"], G["w"] * 0.5) and torch.equal(fed["b"], G["b"])
    assert torch.equal(stepped_gradients(base, G, {"w": True, "b": False}, {}, scale_ratio=0.5)["w"], G["w"])
