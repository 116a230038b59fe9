"""Stage 0 (Muon through the engine without ZeRO): the fixes for DSM-014/015 each with a case that
fails on stock and passes patched, and the stage-0 self-check mutant killed here and nowhere else.

With DSM-016's fix too (``z0-muon-update-norm``: the norm and clip over the Muon updates on the
FP16_UnfusedOptimizer route), a patched fp16/bf16 stage-0 case expects no bug and passes whole.
"""
from __future__ import annotations

import pytest

import json

from harness.registry.bugs import BY_ID, bugs_for
from harness.case.scenarios import pipeline_case
from harness.gate.decide import evaluate
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


def test_warmup_step_with_l2_adam_matches_its_model(pool_manager):
    """DSM-014 under L2 Adam (``adam_w_mode: false``): the warm-up step's decay is a gradient, so Adam
    moves every master by about its lr while the module keeps its weights. Step 1's forward reads the
    module: a judge that rounded the moved masters instead put the bias gradients off by a few percent
    and failed a stock run the model explains."""
    base = pipeline_case(0, "none", "fp16", 2, steps=3, weight_decay=0.1, adam_lr=0.03)
    cfg = json.loads(base.ds_config)
    cfg["optimizer"]["params"]["adam_w_mode"] = False
    case = base.replace(name=base.name + "-l2", ds_config=json.dumps(cfg))
    assert "DSM-014" in [b.id for b in bugs_for(case)]
    o = evaluate(case, "stock", pool_manager)
    assert o.status == "xfailed" and o.strength == "full", o.message


def test_patched_fp16_backward_carries_the_scale_as_zero_does(pool_manager):
    """``z0-fp16-loss-scale`` scales the loss after the division by the accumulation steps, as ZeRO's
    ``scale_if_loss`` does: at ``S = 2^16`` the fp16 graph receives ``S`` itself, past fp16's range, and the
    first step is skipped on every path. Scaling before the division handed it ``S / GAS`` and applied a
    step whose fp16 backward, run as ZeRO runs it, has no finite gradient: the judge could not judge it."""
    case = pipeline_case(0, "none", "fp16", 1, steps=3, grad_accum=2, initial_scale_power=16)
    o = evaluate(case, "patched", pool_manager)
    assert o.trajectory is not None and o.trajectory.steps[0].skipped, (
        "step 1 at S = 2^16 was applied: the scale reached the fp16 graph divided by the accumulation steps")
    assert o.status == "passed", o.message


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
