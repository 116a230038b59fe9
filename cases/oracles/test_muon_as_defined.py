"""Muon as defined (``oracles.muon_as_defined``) and the step-by-step gap of a run to it
(``harness.judge.as_defined``), against closed forms: a rank-one update's Newton-Schulz image is the
scalar quintic map of its one singular value (``oracles.newton_schulz.phi``), so the whole step is known
without running the iteration on a matrix."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harness.case.spec import Case, ParamShape, canonical_json, ds_config
from harness.case.trajectory import ParamStep, StepRecord, Trajectory
from harness.judge import as_defined
from oracles import muon_as_defined as mad
from oracles.newton_schulz import NS_EPS, aspect_scale, phi

RNG = np.random.default_rng(11)


def _rank_one(rows: int, cols: int, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma u v^T, u v^T) with unit u, v."""
    u, v = RNG.standard_normal(rows), RNG.standard_normal(cols)
    uv = torch.from_numpy(np.outer(u / np.linalg.norm(u), v / np.linalg.norm(v)))
    return sigma * uv, uv


@pytest.mark.parametrize("shape", [(6, 3), (3, 6), (5, 5)])
@pytest.mark.parametrize("factor", [1.0, 0.25])
def test_one_step_is_the_definition_in_closed_form(shape, factor):
    beta, lr, wd = 0.95, 0.02, 0.1
    G, uv = _rank_one(*shape, sigma=3.0)
    W = torch.from_numpy(RNG.standard_normal(shape))
    st = mad.matrix_step(W, G, torch.zeros(shape, dtype=torch.float64), lr=lr, momentum=beta, weight_decay=wd,
                         factor=factor)
    sigma_u = 3.0 * factor * (1 - beta) * (1 + beta)  # U = (1-b)(1+b) g from zero momentum, g = G * factor
    want_O = phi(sigma_u / (sigma_u + NS_EPS)) * aspect_scale(*shape) * uv
    torch.testing.assert_close(st.update, want_O, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(st.momentum, (1 - beta) * factor * G, rtol=1e-15, atol=0)
    torch.testing.assert_close(st.weight, W * (1 - lr * wd) - lr * want_O, rtol=1e-13, atol=1e-15)


def test_the_clip_acts_on_the_raw_gradient_and_only_when_it_bites():
    assert mad.clip_factor(10.0, 0.0) == 1.0 and mad.clip_factor(0.5, 1.0) == 1.0
    assert mad.clip_factor(4.0, 1.0) == pytest.approx(1.0 / (4.0 + mad.CLIP_EPS), rel=1e-15)


def test_a_broadcast_peak_is_rescaled_to_the_halfs_own_lr():
    # WarmupLR hands both halves 0.01 at its peak and 0.005 half-way: the Muon half configured at 0.02
    # warms up along the same shape to 0.02
    assert mad.half_lr(0.005, 0.02, 0.01) == pytest.approx(0.01, rel=1e-15)
    assert mad.half_lr(0.005, 0.02, None) == 0.005


def _run(shrink: float) -> tuple[Case, Trajectory]:
    """Two steps of one Muon matrix whose applied step is ``shrink`` x the step as defined (1: Muon as defined)."""
    case = Case("t", (ParamShape("w", (6, 3)), ParamShape("b", (6,))),
                canonical_json(ds_config(stage=1, ns_method="standard")))
    opt = case.ds.optimizer.muon
    W, M = torch.from_numpy(RNG.standard_normal((6, 3))), torch.zeros(6, 3, dtype=torch.float64)
    b = np.zeros(6)
    t = Trajectory("t", {"w": W.numpy().copy(), "b": b}, muon_params=("w",))
    for s in (1, 2):
        G = torch.from_numpy(RNG.standard_normal((6, 3)))
        st = mad.matrix_step(W, G, M, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay, factor=1.0)
        W = W + shrink * (st.weight - W)
        M = st.momentum
        params = {"w": ParamStep(master=W.numpy().copy(), model=W.numpy(), grad=G.numpy(), momentum=M.numpy()),
                  "b": ParamStep(master=b, model=b, grad=np.zeros(6))}
        t.steps.append(StepRecord(s, 1.0, 1.0, False, None, 1, params, group_lr={"muon-params": opt.lr,
                                                                                 "adam-params": 1e-3}))
    return case, t


@pytest.mark.parametrize("shrink", [1.0, 0.1])
def test_the_gap_of_a_run_is_how_far_its_steps_are_from_the_definition(shrink):
    case, traj = _run(shrink)
    out = as_defined.gap(case, traj)
    assert [r["step"] for r in out["steps"]] == [1, 2] and out["missing"] == []
    for r in out["steps"]:
        assert r["gap"] == pytest.approx(1 - shrink, abs=1e-12)
        assert r["norm_ratio"] == pytest.approx(shrink, rel=1e-12) and r["cosine"] == pytest.approx(1.0, abs=1e-12)


def test_a_step_without_its_gradient_is_named_not_measured():
    case, traj = _run(1.0)
    traj.steps[1].params["b"].grad = None
    out = as_defined.gap(case, traj)
    assert [r["step"] for r in out["steps"]] == [1] and out["missing"] == ["step 2: a gradient"]
    assert math.isfinite(out["steps"][0]["gap"]) and "not measured: step 2: a gradient" in out["summary"]
