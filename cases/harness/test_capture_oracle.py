"""Tie the capture to reality: what it reports after a real DeepSpeed step equals an independent
float64 computation of that step, to fp32 round-off.

The expected values use only ``harness.case.synthetic.local_gradients`` (exact float64 gradients of the
synthetic loss) and the step as docs/deepspeed-0.19.8.md describes it (section 1): DP/GAS-averaged
gradient; Muon with nesterov momentum, quintic Newton-Schulz (3.4445, -4.7750, 2.0315; 5 steps;
F-norm + 1e-7 normalisation), aspect scale sqrt(max(1, rows/cols)); bias-corrected AdamW with
DeepSpeed's Muon-side defaults (betas 0.9/0.95, eps 1e-10). Newton-Schulz is computed here in float64,
and DeepSpeed's is forced to float64 through ``case.ns_dtype`` (otherwise it runs in fp16 and only
agrees to ~1e-2). ``muon_update`` itself is never used for the expected value.

Each step is checked from the captured state before it (a one-step oracle), so an error shows in
the step that makes it. If capture read the wrong slice of a partition, the wrong rank's buffer,
momentum in the wrong layout, or a stale gradient, one of these comparisons fails.

The required case is ZeRO-1, world size 1; the same check also runs on a few other paths (offload,
ZeRO-3, world size 2 with gradient accumulation) because it costs a second or so per case.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harness.case.spec import Case, ParamShape, ds_config
from harness.case.synthetic import local_gradients

pytestmark = pytest.mark.pipeline

# ------------------------------------------------------------------------------------------------
# float64 reference

NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315
BETA = 0.95  # ds_config default momentum
LR_MUON, LR_ADAM = 0.02, 1e-3  # ds_config defaults: lr / muon_lr, adam_lr
ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-10  # MuonWithAuxAdam defaults (original_muon.py:392-395)


def ns5(G: torch.Tensor) -> torch.Tensor:
    """Quintic Newton-Schulz, 5 steps, batched over leading dims, float64."""
    X = G.to(torch.float64)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    for _ in range(5):
        A = X @ X.mT
        B = NS_B * A + NS_C * (A @ A)
        X = NS_A * X + B @ X
    return X.mT if tall else X


def muon_direction(U: torch.Tensor) -> torch.Tensor:
    r, c = U.shape[-2], U.shape[-1]
    return ns5(U) * math.sqrt(max(1.0, r / c))


def averaged_gradient(weights: dict, case: Case, step: int) -> dict:
    W, gas = case.world_size, case.grad_accum
    acc = None
    for r in range(W):
        for mu in range(gas):
            g = local_gradients(weights, case, r, step, mu)
            acc = g if acc is None else {k: acc[k] + g[k] for k in acc}
    return {k: v / (W * gas) for k, v in acc.items()}


def check_trajectory(case: Case, traj) -> list[str]:
    """Compare every captured step with the float64 step from the captured state before it."""
    t64 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float64))  # noqa: E731
    fails: list[str] = []
    worst: dict[str, float] = {}

    def close(what: str, got, want, tol):
        """|got - want| <= tol elementwise (tol: scalar or array)."""
        got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
        tol = np.broadcast_to(np.asarray(tol, dtype=np.float64), want.shape)
        err = np.abs(got - want)
        ratio = float((err / tol).max())
        worst[what.split(":")[0]] = max(worst.get(what.split(":")[0], 0.0), ratio)
        if not ratio <= 1.0:
            i = np.unravel_index(int(np.argmax(err / tol)), want.shape)
            fails.append(f"{what}: |err| {err[i]:.3e} > tol {tol[i]:.3e} at {i}")

    def ulp32(x):
        return np.spacing(np.abs(np.asarray(x, dtype=np.float64)).astype(np.float32)).astype(np.float64)

    muon = set(traj.muon_params)
    theta = {k: t64(v) for k, v in traj.initial.items()}
    model_w = dict(theta)  # fp32 model: the weights the forward uses are the masters
    mom = {k: torch.zeros_like(v) for k, v in theta.items() if k in muon}
    m_ad = {k: torch.zeros_like(v) for k, v in theta.items() if k not in muon}
    v_ad = {k: torch.zeros_like(v) for k, v in theta.items() if k not in muon}
    for s in traj.steps:
        t = s.step
        g = averaged_gradient(model_w, case, t)
        for p in case.params:
            n = p.name
            ps = s.params[n]
            gmax = float(g[n].abs().max())
            # what entered the optimizer: the DP/GAS-averaged gradient (fp32 backward: ~1e-6 rel)
            close(f"grad:{n}@{t}", t64(ps.grad) / ps.grad_scale, g[n], 1e-6 * gmax)
            if n in muon:
                M = BETA * mom[n] + (1 - BETA) * g[n]
                U = (1 - BETA) * g[n] + BETA * M
                O = muon_direction(U)
                close(f"momentum:{n}@{t}", t64(ps.momentum) / ps.momentum_scale, M, 1e-6 * float(M.abs().max()))
                close(f"update:{n}@{t}", t64(ps.update), O, 1e-5 * float(O.abs().max()))
                # the master moved by exactly the captured update (fp32 rounding only); the update
                # itself was checked against the float64 one just above
                applied = LR_MUON * t64(ps.update)
                new = theta[n] - applied
                tol = 2 * ulp32(new) + ulp32(applied)
                mom[n] = t64(ps.momentum) / ps.momentum_scale  # next step starts from the captured state
            else:
                b1, b2 = ADAM_BETAS
                m_ad[n] = b1 * m_ad[n] + (1 - b1) * g[n]
                v_ad[n] = b2 * v_ad[n] + (1 - b2) * g[n] ** 2
                denom = v_ad[n].sqrt() / math.sqrt(1 - b2**t) + ADAM_EPS
                applied = (LR_ADAM / (1 - b1**t)) * m_ad[n] / denom
                new = theta[n] - applied
                # fp32 round-off of the new value and of the step; the step's own error (from the
                # ~1e-7 relative error of the fp32 gradient) is far below that
                tol = 2 * ulp32(new) + 4 * ulp32(applied)
            close(f"master:{n}@{t}", ps.master, new, tol)
            theta[n] = t64(ps.master)
            model_w[n] = t64(ps.model)
    return fails, worst


PARAMS = (
    ParamShape("a.weight", (7, 5)),  # tall: aspect scale sqrt(7/5)
    ParamShape("a.bias", (7,)),
    ParamShape("b.weight", (3, 11)),  # wide, prime
    ParamShape("c.row", (1, 6)),  # 1xN
    ParamShape("c.col", (5, 1)),  # Nx1
    ParamShape("d.w3", (2, 3, 4)),  # 3-D: Newton-Schulz batched over dim 0
    ParamShape("e.v", (13,)),
)


def _case(stage: int, offload: str, ws: int, grad_accum: int = 1) -> Case:
    return Case(name=f"oracle-z{stage}-{offload}-ws{ws}-gas{grad_accum}", params=PARAMS, world_size=ws, steps=2,
                seed=5, batch=8, ns_dtype="float64",
                ds_config=ds_config(stage=stage, offload=offload, world_size=ws, grad_accum=grad_accum))


CASES = {
    1: [_case(1, "none", 1), _case(2, "cpu", 1), _case(3, "none", 1), _case(3, "cpu", 1)],
    2: [_case(1, "none", 2, grad_accum=2), _case(3, "none", 2), _case(2, "cpu", 2)],
}


@pytest.fixture(scope="module")
def ws1_results(pool_manager):
    return CASES[1], [pool_manager.run(c).result for c in CASES[1]]


@pytest.fixture(scope="module")
def ws2_results(pool_manager):
    return CASES[2], [pool_manager.run(c).result for c in CASES[2]]


def test_zero1_ws1_step_matches_float64(ws1_results):
    cases, trajs = ws1_results
    case, traj = cases[0], trajs[0]
    assert case.stage == 1 and case.offload == "none" and case.world_size == 1
    fails, worst = check_trajectory(case, traj)
    print(case.name, {k: round(v, 3) for k, v in worst.items()})
    assert not fails, "\n".join(fails)
    # The check has teeth: a master weight 4 fp32 ulps off, or momentum with the wrong loss-scale
    # units, is caught.
    import copy

    bad = copy.deepcopy(traj)
    m = bad.steps[1].params["a.weight"].master
    m[0, 0] = np.float32(m[0, 0]) + 4 * np.spacing(np.float32(m[0, 0]))
    assert any("master:a.weight@2" in f for f in check_trajectory(case, bad)[0])
    bad = copy.deepcopy(traj)
    bad.steps[0].params["b.weight"].momentum_scale = 2.0
    assert any("momentum:b.weight@1" in f for f in check_trajectory(case, bad)[0])


def _check_all(cases, trajs, skip_first=False):
    all_fails = []
    for i, (case, traj) in enumerate(zip(cases, trajs)):
        if skip_first and i == 0:
            continue
        fails, worst = check_trajectory(case, traj)
        print(case.name, {k: round(v, 3) for k, v in worst.items()})
        all_fails += [f"{case.name}: {f}" for f in fails]
    assert not all_fails, "\n".join(all_fails)


def test_offload_and_zero3_ws1_match_float64(ws1_results):
    _check_all(*ws1_results, skip_first=True)


def test_ws2_with_grad_accumulation_matches_float64(ws2_results):
    _check_all(*ws2_results)
