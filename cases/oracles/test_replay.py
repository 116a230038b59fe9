"""``oracles.replay``: how a teacher-forced replay reads the conventions. Each reading is checked on the
intended conventions (nothing changes) and on the switch it interprets."""
from __future__ import annotations

import math

import torch

from oracles import Conventions, clip_coefficient, replay


def _grads():
    return {"w": torch.full((2, 2), 3.0, dtype=torch.float64), "b": torch.full((2,), 5.0, dtype=torch.float64)}


USE_MUON = {"w": True, "b": False}
HELD = {"w": (None, torch.full((2, 2), 7.0, dtype=torch.float64)),
        "b": (torch.full((2,), 11.0, dtype=torch.float64), None)}


def test_intended_conventions_step_every_parameter_on_its_own_gradient():
    out = replay.stepped_gradients(Conventions(), _grads(), USE_MUON, HELD)
    assert all(torch.equal(out[n], g) for n, g in _grads().items())


def test_stale_buffers_feed_a_muon_matrix_its_update_and_an_adam_parameter_its_gradient():
    out = replay.stepped_gradients(Conventions(stale_unused_grads="norm-counts"), _grads(), USE_MUON, HELD)
    assert float(out["w"][0, 0]) == 7.0 and float(out["b"][0]) == 11.0
    nothing = replay.stepped_gradients(Conventions(stale_unused_grads="norm-counts"), _grads(), USE_MUON,
                                       {"w": (None, None)})
    assert float(nothing["w"][0, 0]) == 3.0  # nothing captured: the intended gradient stays


def test_lost_adam_gradients_zero_the_adam_half_only():
    out = replay.stepped_gradients(Conventions(adam_grads_lost=True), _grads(), USE_MUON, {})
    assert float(out["b"].abs().sum()) == 0.0 and float(out["w"][0, 0]) == 3.0


def test_a_clip_before_muon_is_read_from_the_reported_norm_in_its_units_and_undone_on_muon_only():
    conv = Conventions(clip_norm_source="gradient", reported_norm="raw")
    k = replay.clip_before_muon(conv, 0.5, 8.0, 4.0)
    assert k == clip_coefficient(2.0, 0.5)
    assert replay.clip_before_muon(Conventions(), 0.5, 8.0, 4.0) is None
    assert replay.clip_before_muon(conv, 0.5, math.inf, 4.0) is None
    out = replay.unclip(conv, _grads(), USE_MUON, k)
    assert float(out["w"][0, 0]) == 3.0 * k and float(out["b"][0]) == 5.0
    assert float(replay.unclip(Conventions(muon_as_sgd=True), _grads(), USE_MUON, k)["w"][0, 0]) == 3.0


def test_scaled_momentum_is_held_raw_and_compared_in_true_units():
    raw = torch.full((2,), 8.0, dtype=torch.float64)
    assert float(replay.state_momentum(Conventions(), raw, 4.0)[0]) == 2.0
    assert float(replay.state_momentum(Conventions(momentum_units="scaled"), raw, 4.0)[0]) == 8.0
    assert float(replay.true_momentum(Conventions(momentum_units="scaled"), raw, 4.0)[0]) == 2.0


def test_the_norm_leaves_out_unused_adam_terms_only_where_the_conventions_say():
    names = frozenset({"b"})
    assert replay.step_conventions(Conventions(), names).norm_excluded == frozenset()
    assert replay.step_conventions(Conventions(stale_unused_grads="norm-drops-adam"), names).norm_excluded == names
    assert replay.muon_calls(Conventions(muon_as_sgd=True), 4) == 0 and replay.muon_calls(Conventions(), 4) == 4


def test_a_skipped_step_leaves_the_adam_half_its_gradient_for_the_next_step_in_the_buffers_units():
    """DSM-029's reading: after a skip the Adam gradients stay in the buffer at the skipped step's backward
    scale and are added (unscaled by this step's) to the next; Muon's are not; an applied step, or the
    intended conventions, carry nothing."""
    conv = Conventions(adam_grads_kept_on_skip=True)
    kept = replay.carried_after(conv, _grads(), USE_MUON, True, 4.0)
    assert set(kept) == {"b"} and float(kept["b"][0]) == 20.0
    assert replay.carried_after(conv, _grads(), USE_MUON, False, 4.0) == {}
    assert replay.carried_after(Conventions(), _grads(), USE_MUON, True, 4.0) == {}
    out = replay.with_carried(conv, _grads(), kept, 2.0)
    assert float(out["b"][0]) == 5.0 + 10.0 and float(out["w"][0, 0]) == 3.0
    assert float(replay.with_carried(Conventions(), _grads(), kept, 2.0)["b"][0]) == 5.0
    # two skips in a row: the buffer holds both, each in its own units
    twice = replay.carried_after(conv, out, USE_MUON, True, 2.0)
    assert float(twice["b"][0]) == (5.0 + 10.0) * 2.0
