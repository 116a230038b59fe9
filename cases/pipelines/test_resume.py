"""Checkpoint resume: save after step k, load into a fresh engine built on a differently initialised
model, continue -- the trajectory must equal the uninterrupted one, bit for bit, and both must agree
with the oracle. A load that silently restored nothing (or restored a stale momentum) shows as a
difference at step k+1.
"""
from __future__ import annotations

import numpy as np
import pytest

from cases.pipelines._support import KnownBugDivergence, gate_params
from harness.catalog import matrix
from harness.gate.decide import evaluate

pytestmark = pytest.mark.pipeline

QUANTITIES = ("master", "model", "momentum")


def _differences(resumed, straight, after_step):
    diffs = []
    for a, b in zip(resumed.steps, straight.steps):
        if a.step <= after_step:
            continue
        for name, pa in a.params.items():
            pb = b.params[name]
            for q in QUANTITIES:
                x, y = getattr(pa, q), getattr(pb, q)
                if x is None and y is None:
                    continue
                if q == "momentum":
                    x, y = x / pa.momentum_scale, y / pb.momentum_scale
                if x is None or y is None or not np.array_equal(x, y):
                    err = float("inf") if x is None or y is None else float(np.max(np.abs(x - y)))
                    diffs.append((a.step, name, q, err))
        if (a.loss_scale, a.skipped) != (b.loss_scale, b.skipped):
            diffs.append((a.step, "<step>", "loss_scale/skipped", float("nan")))
    return diffs


@pytest.mark.parametrize("case,column", gate_params(matrix.resume_cases()))
def test_resume_equals_uninterrupted(case, column, pool_manager, seed):
    resumed = evaluate(case.replace(seed=seed), column, pool_manager)
    straight = evaluate(case.replace(seed=seed, checkpoint_at=None, name=case.name + "-straight"), column,
                        pool_manager)
    assert straight.status in ("passed", "xfailed"), straight.message
    if resumed.refused and straight.refused:
        return  # the patched runtime refuses this configuration outright (see the bug's fix)
    if resumed.trajectory is None:
        pytest.fail(resumed.message, pytrace=False)
    diffs = _differences(resumed.trajectory, straight.trajectory, case.checkpoint_at)
    msg = "\n".join(f"  step {s} {n} {q}: max |resumed - uninterrupted| = {e:.3g}" for s, n, q, e in diffs[:12])
    # The gate's decision, unchanged: only a case it xfailed (a registered bug that showed, and matched
    # its model or is excused by name) is an expected failure; a failed or xpassed one is not.
    if resumed.status in ("failed", "error"):
        pytest.fail(resumed.message, pytrace=False)
    if resumed.status == "xfailed":
        raise KnownBugDivergence(resumed.message)
    if diffs:
        pytest.fail(f"{case.name}: resume after step {case.checkpoint_at} differs from the uninterrupted run\n{msg}",
                    pytrace=False)
    # passed, or xpassed (strict xfail turns that into a failure)
