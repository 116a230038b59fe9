"""The loss scaler state machine against the rules, stated independently in this file.

The reference below is phrased differently from ``oracles.loss_scaler`` on purpose: it counts the
run of clean steps since the last overflow instead of subtracting iteration numbers. Rules (semantics
doc section 5): grow by 2 on a clean step that ends a run of ``1 + j*window`` clean steps (j >= 1);
on an overflow halve if hysteresis is exhausted (configured 1 or remaining 1), else spend one unit of
hysteresis; refill hysteresis on growth (or on every clean step with consecutive hysteresis).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import LossScaleAtMinimum, LossScalerConfig, initial_scaler_state, scale_plan, update_scale


def reference_scales(overflows, *, s0, window, hysteresis, consecutive, min_scale):
    """Scale in force at each step (before its update), and after the last step."""
    scale, h, run = s0, hysteresis, 0
    used = []
    for ovf in overflows:
        used.append(scale)
        if ovf:
            run = 0
            if hysteresis == 1 or h == 1:
                scale = max(scale / 2, min_scale)
            else:
                h -= 1
        else:
            run += 1
            if consecutive:
                h = hysteresis
            if run > 1 and (run - 1) % window == 0:
                scale *= 2
                if not consecutive:
                    h = hysteresis
    return used, scale


def oracle_scales(overflows, cfg):
    st_ = initial_scaler_state(cfg)
    used = []
    for ovf in overflows:
        used.append(st_.scale)
        st_ = update_scale(st_, ovf, cfg)
    return used, st_.scale


def test_window_two_growth_sequence_from_the_rule():
    """No overflow, window 2: the first growth ends the (window+1)-th clean step, then one every
    ``window`` steps: scale at step i is S0 * 2**floor((i-1)/window) for i >= 1 (S0 at i = 0)."""
    cfg = LossScalerConfig(initial_scale_power=8, loss_scale_window=2)
    used, _ = oracle_scales([False] * 8, cfg)
    expect = [256.0 * 2 ** (max(i - 1, 0) // 2) for i in range(8)]
    assert used == expect
    assert used[:6] == [256.0, 256.0, 256.0, 512.0, 512.0, 1024.0]  # the doc's example follows


@settings(max_examples=150, deadline=None)
@given(overflows=st.lists(st.booleans(), min_size=1, max_size=40), window=st.integers(1, 5),
       hysteresis=st.integers(1, 4), consecutive=st.booleans(), power=st.integers(4, 16))
def test_matches_reference_rules(overflows, window, hysteresis, consecutive, power):
    min_scale = 1.0
    cfg = LossScalerConfig(initial_scale_power=power, loss_scale_window=window, hysteresis=hysteresis,
                           consecutive_hysteresis=consecutive, min_loss_scale=min_scale,
                           raise_error_at_min_scale=False)
    assert oracle_scales(overflows, cfg) == reference_scales(
        overflows, s0=2.0 ** power, window=window, hysteresis=hysteresis, consecutive=consecutive,
        min_scale=min_scale)


def test_hysteresis_delays_the_first_backoff_only():
    cfg = LossScalerConfig(initial_scale_power=10, hysteresis=2, loss_scale_window=1000)
    used, final = oracle_scales([True, True, True], cfg)
    # first overflow spends hysteresis, second halves, third halves again (not refilled)
    assert used == [1024.0, 1024.0, 512.0] and final == 256.0


def test_backoff_stops_at_min_scale_and_raises_there():
    cfg = LossScalerConfig(initial_scale_power=2, hysteresis=1, min_loss_scale=2.0)
    s = initial_scaler_state(cfg)
    s = update_scale(s, True, cfg)
    assert s.scale == 2.0
    with pytest.raises(LossScaleAtMinimum):
        update_scale(s, True, cfg)
    relaxed = LossScalerConfig(initial_scale_power=2, hysteresis=1, min_loss_scale=2.0, raise_error_at_min_scale=False)
    assert update_scale(s, True, relaxed).scale == 2.0


def test_static_scalers_never_move():
    for dtype in ("bf16", "fp32"):
        cfg = LossScalerConfig.for_model_dtype(dtype)
        s = initial_scaler_state(cfg)
        assert s.scale == 1.0
        for ovf in (True, False, False, True):
            s = update_scale(s, ovf, cfg)
        assert s.scale == 1.0
    assert initial_scaler_state(LossScalerConfig.for_model_dtype("fp16")).scale == 2.0 ** 16


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(1, 12), max_size=6), st.sampled_from((1, 2, 3)), st.sampled_from((1, 2, 3)))
def test_scale_plan_is_the_rule_over_a_case_s_steps(overflowed, window, hysteresis):
    """``scale_plan``: per step the scale used, the scale after and whether it was skipped, every step
    (skipped ones included) calling the scaler once, against this file's own statement of the rules."""
    cfg = LossScalerConfig(initial_scale_power=8, loss_scale_window=window, hysteresis=hysteresis)
    plan = scale_plan(cfg, 12, frozenset(overflowed))
    flags = [s in overflowed for s in range(1, 13)]
    used, last = reference_scales(flags, s0=256.0, window=window, hysteresis=hysteresis, consecutive=False,
                                  min_scale=1.0)
    assert [u for u, _, _ in plan] == used
    assert [a for _, a, _ in plan] == used[1:] + [last]
    assert [sk for _, _, sk in plan] == flags


def test_default_hysteresis_skips_twice_before_the_first_backoff():
    """Hysteresis 2 (DeepSpeed's documented default): overflows at steps 2 and 3 keep the scale at step
    2 and halve it at step 3; with hysteresis 1 step 2 halves already."""
    two = scale_plan(LossScalerConfig(initial_scale_power=8, hysteresis=2), 4, frozenset({2, 3}))
    assert two == ((256.0, 256.0, False), (256.0, 256.0, True), (256.0, 128.0, True), (128.0, 128.0, False))
    one = scale_plan(LossScalerConfig(initial_scale_power=8, hysteresis=1), 3, frozenset({2}))
    assert one == ((256.0, 256.0, False), (256.0, 128.0, True), (128.0, 128.0, False))


def test_an_overflow_on_the_growth_step_does_not_grow():
    """Window 2 grows after step 3 when nothing overflows; an overflow there spends hysteresis instead,
    and the count of clean steps restarts, so no growth follows within the next two steps."""
    cfg = LossScalerConfig(initial_scale_power=8, loss_scale_window=2)
    clean = scale_plan(cfg, 5)
    assert [a > u for u, a, _ in clean].index(True) == 2  # step 3
    hit = scale_plan(cfg, 5, frozenset({3}))
    assert [a for _, a, _ in hit] == [256.0] * 5
    with_restart = scale_plan(cfg, 5, restart_after=3)
    assert with_restart[3][0] == 256.0  # a rebuilt scaler starts from 2**initial_scale_power again
