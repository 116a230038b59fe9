"""Stage 0 (Muon through the engine without ZeRO): the fixes for DSM-014/015 each with a case that
fails on stock and passes patched, and the stage-0 self-check mutant killed here and nowhere else.

With DSM-016's fix too (``z0-muon-update-norm``: the norm and clip over the Muon updates on the
FP16_UnfusedOptimizer route), a patched fp16/bf16 stage-0 case expects no bug and passes whole.
"""
from __future__ import annotations

import pytest

from harness.registry.bugs import BY_ID, bugs_for
from harness.case.scenarios import pipeline_case
from harness.judge.verdict import judge

pytestmark = pytest.mark.pipeline


@pytest.mark.parametrize("bug,case", [
    ("DSM-014", pipeline_case(0, "none", "bf16", 1, steps=3)),
    ("DSM-015", pipeline_case(0, "none", "fp16", 1, steps=3)),
], ids=["DSM-014-bf16", "DSM-015-fp16"])
def test_stock_shows_the_bug_and_the_patched_runtime_removes_it(bug, case, pool_manager):
    hit = bugs_for(case)
    assert bug in [b.id for b in hit], f"{bug} trigger does not select {case.name}"
    stock = judge(case, pool_manager.run(case).result)
    own = BY_ID[bug].quantities - {"global_norm"}  # the norm is DSM-016's as well
    shown = {f.quantity for f in stock.failures}
    assert shown & own, f"{case.name}: stock shows none of {sorted(own)}; {bug} did not show ({sorted(shown)})"
    explained = set().union(*(b.quantities for b in hit))
    assert shown <= explained, f"stock divergences no registered bug explains: {sorted(shown - explained)}"

    p = case.replace(patched=True)
    assert bugs_for(p, patched=True) == []
    patched = judge(p, pool_manager.run(p).result)
    assert patched.passed, patched.message()


def test_stage0_fp32_passes_stock(pool_manager):
    """fp32 stage 0 steps MuonWithAuxAdam directly: nothing registered, everything within tolerance."""
    case = pipeline_case(0, "none", "fp32", 2, steps=3, grad_accum=2)
    assert bugs_for(case) == []
    v = judge(case, pool_manager.run(case).result)
    assert v.passed, v.message()


def test_muon_as_sgd_mutant_is_killed_by_stage0_only(pool_manager):
    from harness.registry import mutants

    m = mutants.MUTANTS["muon-as-sgd-without-zero"]
    z0 = pipeline_case(0, "none", "fp32", 2, steps=3).replace(patched=True, mutant=m.name)
    z1 = pipeline_case(1, "none", "fp32", 2, steps=3).replace(patched=True, mutant=m.name)
    assert m.expected(z0) and not m.expected(z1)
    killed = judge(z0, pool_manager.run(z0).result)
    assert {"update", "momentum"} <= {f.quantity for f in killed.failures}, killed.message()
    survived = judge(z1, pool_manager.run(z1).result)
    assert survived.passed, survived.message()
