"""The checks taken from DeepSpeed's own Muon updates (teacher forcing of the norm and the masters).

Where Newton-Schulz is not emulated bit for bit (``exact`` mode: compiled cases, older releases, GPU),
the oracle's own direction is only known to Newton-Schulz's allowance, and so are the masters and the
norm derived from it: a step applied with a slightly wrong lr, or a norm over the wrong vectors, hides
inside it. Judged against DeepSpeed's own captured update instead, only the step's fp32 arithmetic is
left to allow for. These tests take a real run, judge it in ``exact`` mode, then move what DeepSpeed
reported by less than the Newton-Schulz allowance and more than the arithmetic's, and require the
own-update check, and only it, to report it.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from harness.case.scenarios import pipeline_case
from harness.judge.verdict import judge

pytestmark = pytest.mark.pipeline


def _own(check) -> bool:
    return check.record is not None and check.record.derivation.startswith(("own update", "norm of DeepSpeed's own"))


@pytest.fixture(scope="module")
def run(pool_manager):
    case = pipeline_case(1, "none", "bf16", 2, steps=2).replace(patched=True)  # no clip: k = 1 exactly
    traj = pool_manager.run(case).result
    base = judge(case, traj, mode="exact")
    assert base.passed, base.message()
    return case, traj


def test_a_step_applied_with_an_lr_one_percent_off_is_caught_by_the_own_update_check(run):
    case, traj = run
    wrong = copy.deepcopy(traj)
    prev = {n: np.asarray(ps.master, dtype=np.float64) for n, ps in wrong.steps[0].params.items()}
    moved = []
    for n, ps in wrong.steps[1].params.items():
        if ps.update is not None:  # a Muon matrix: its step 1 update applied 1% larger
            m = np.asarray(ps.master, dtype=np.float64)
            ps.master = (m + 0.01 * (m - prev[n])).astype(np.float32)
            ps.model = torch.as_tensor(ps.master).to(torch.bfloat16).to(torch.float32).numpy()  # copied on
            moved.append(n)
    assert moved
    step = wrong.steps[1].step
    v = judge(case, wrong, mode="exact")
    failed = {(c.param, c.quantity, c.step) for c in v.failures}
    assert failed and all(q == "master" and s == step and p in moved for p, q, s in failed), v.message()
    assert all(_own(c) for c in v.failures), v.message()
    # the Newton-Schulz-derived master check of the same parameters still passes: it could not tell
    ns = [c for c in v.checks if c.quantity == "master" and c.step == step and c.param in moved and not _own(c)]
    assert ns and all(c.passed for c in ns)


def test_a_norm_over_the_wrong_vectors_is_caught_by_the_own_norm_check(run):
    case, traj = run
    wrong = copy.deepcopy(traj)
    wrong.steps[0].global_norm *= 1.2  # a norm 20% off, well inside Newton-Schulz's norm allowance here
    v = judge(case, wrong, mode="exact")
    norm_checks = [c for c in v.checks if c.quantity == "global_norm" and c.step == wrong.steps[0].step]
    assert any(_own(c) and not c.passed for c in norm_checks), v.message()
    assert any(not _own(c) and c.passed for c in norm_checks)


def test_a_model_weight_one_ulp_off_its_own_master_is_caught(run):
    """The copy of the fp32 master into the bf16 module is one round-to-nearest: a single element one ulp
    away (a stale or mis-sliced copy on one rank) fails the own-master model check, exactly; the
    oracle-derived model check allows a rounding flip and cannot tell."""
    case, traj = run
    wrong = copy.deepcopy(traj)
    rec = wrong.steps[1]
    name = next(n for n, ps in rec.params.items() if ps.update is not None)
    m = torch.as_tensor(np.asarray(rec.params[name].model, dtype=np.float32)).to(torch.bfloat16)
    flat = m.reshape(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=torch.bfloat16))
    rec.params[name].model = m.to(torch.float32).numpy()
    v = judge(case, wrong, mode="exact")
    failed = [(c.param, c.quantity, c.step) for c in v.failures]
    assert failed == [(name, "model", rec.step)] and all(c.record.derivation.startswith("own master")
                                                          for c in v.failures), v.message()
