"""One verdict per run: the patched column takes the stock verdict only when its run is bit-identical.

``gate.judged`` keys a verdict on the case without its column, every bit the judge reads
(``Trajectory.judged_bits``) and the oracle's conventions. Reusing a verdict for a run that differs in
any one bit would let a patched-runtime divergence pass as the stock run's verdict, so these tests
move one bit (or one step field) and require a fresh judge, and require the reused verdict to be the
one a fresh judge gives, under the patched column's own name.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

import harness.gate.decide as gate_mod
from harness.judge import verdict as verdict_mod
from harness.gate.decide import evaluate, judged
from harness.case.scenarios import pipeline_case
from harness.judge.verdict import judge

pytestmark = pytest.mark.pipeline


@pytest.fixture(scope="module")
def both(pool_manager):
    """A case no registered bug touches: its stock and patched runs, and their outcomes."""
    case = pipeline_case(1, "none", "fp32", 1, steps=2)
    stock = evaluate(case, "stock", pool_manager)
    patched = evaluate(case, "patched", pool_manager)
    return case, stock, patched


def _rows(v):
    return [(c.param, c.quantity, c.step, c.passed, c.worst_ratio) for c in v.checks]


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = gate_mod.judge

    def counting(*a, **k):
        calls.append(a[0].name)
        return real(*a, **k)

    monkeypatch.setattr(gate_mod, "judge", counting)
    monkeypatch.setattr(gate_mod, "_VERDICTS", type(gate_mod._VERDICTS)())
    return calls


def test_a_patched_run_identical_to_stock_gets_the_verdict_a_fresh_judge_gives_under_its_own_name(both):
    case, stock, patched = both
    assert stock.status == patched.status == "passed", (stock.message, patched.message)
    assert stock.trajectory.judged_digest() == patched.trajectory.judged_digest()
    assert patched.verdict.case.patched and not stock.verdict.case.patched
    assert "patched" in verdict_mod.reproduce_command(patched.verdict.case)
    fresh = judge(case.replace(patched=True), patched.trajectory)
    assert _rows(patched.verdict) == _rows(fresh)


def test_one_flipped_bit_or_step_field_is_judged_anew(both, counted):
    case, stock, _ = both
    traj = stock.trajectory
    judged(case, traj)
    judged(case.replace(patched=True), copy.deepcopy(traj))
    assert len(counted) == 1  # the same bits: judged once

    flipped = copy.deepcopy(traj)
    name, ps = next((n, p) for n, p in flipped.steps[-1].params.items() if p.update is not None)
    m = np.array(ps.master, copy=True)
    m.flat[0] = np.nextafter(m.flat[0], np.inf)  # the last bit of one master element, in its stored dtype
    ps.master = m
    v = judged(case.replace(patched=True), flipped)
    assert len(counted) == 2
    assert _rows(v) == _rows(judge(case, flipped))

    noted = copy.deepcopy(traj)
    noted.steps[0].notes.append("ranks disagree on something")
    judged(case, noted)
    lr = copy.deepcopy(traj)
    lr.steps[0].group_lr = {k: v * 2 for k, v in lr.steps[0].group_lr.items()} or {"muon": 1.0}
    judged(case, lr)
    assert len(counted) == 4


def test_run_level_notes_are_timings_and_do_not_split_the_digest(both):
    _, stock, _ = both
    other = copy.deepcopy(stock.trajectory)
    other.notes.append("seconds: build 9.9, steps+capture 9.9")
    assert other.judged_digest() == stock.trajectory.judged_digest()


def test_an_oracle_hook_is_never_served_a_verdict_judged_without_it(both, counted, monkeypatch):
    case, stock, _ = both
    judged(case, stock.trajectory)
    monkeypatch.setitem(verdict_mod.ORACLE_HOOKS, "beta+1e-3", lambda sc: sc)
    judged(case, stock.trajectory)
    assert len(counted) == 2


def test_a_second_judge_of_one_run_reuses_its_gradients_except_where_a_model_replaces_the_weights(
        pool_manager, monkeypatch):
    """``verdict._SharedGradients``: the float64 gradients are taken at DeepSpeed's captured weights,
    so a bug model's judge of the same run reuses the intended judge's; a step whose weights the
    model replaces (DSM-010's fresh engine, ``fresh_after``) and another run get their own."""
    import oracles
    from harness.case import synthetic

    case = pipeline_case(3, "none", "fp16", 2, steps=3)
    traj = pool_manager.run(case).result
    seen = []
    real = synthetic.local_gradients

    def counting(lp, c, rank, step, micro):
        seen.append(step)
        return real(lp, c, rank, step, micro)

    monkeypatch.setattr(synthetic, "local_gradients", counting)
    intended = judge(case, traj)
    first = len(seen)
    assert first == case.dp_size * case.grad_accum * len(traj.steps)
    again = judge(case, traj, conventions=oracles.Conventions(backward_loss_scaled=False))
    assert len(seen) == first, "the second judge of the same run recomputed its gradients"
    assert [c.worst_ratio for c in judge(case, traj).checks] == [c.worst_ratio for c in intended.checks]
    assert again.checks  # judged, not skipped
    fresh = oracles.Conventions(fresh_after=1, fresh_params=frozenset(p.name for p in case.params))
    judge(case, traj, conventions=fresh)
    assert seen[first:] == [2] * case.dp_size * case.grad_accum, "a model's replaced weights reused gradients"
    other = pool_manager.run(case).result
    judge(case, other)
    assert len(seen) == first + case.dp_size * case.grad_accum * (1 + len(other.steps))


def test_an_uncaptured_weight_is_a_failing_check_not_a_harness_error(both):
    """A parameter DeepSpeed never filled in reaches the judge as an object array (a source mutant of
    engine._muon_param_groups did this, and the judge raised TypeError: a harness error, not a verdict)."""
    case, stock, _ = both
    traj = copy.deepcopy(stock.trajectory)
    name = sorted(traj.initial)[0]
    traj.initial[name] = np.array([None] * 3, dtype=object)
    v = judge(case, traj)
    assert not v.passed
    bad = [c for c in v.checks if not c.passed]
    assert [(c.param, c.quantity) for c in bad] == [(name, "capture")], [(c.param, c.quantity) for c in bad]
