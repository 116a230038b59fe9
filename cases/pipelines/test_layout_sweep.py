"""The deterministic layout sweep (``harness.catalog.sweep``): every (stage, offload, world size, layout class)
cell runs, with the class on a Muon matrix that has Muon neighbours on both sides of it.

``test_sweep_covers_every_cell`` proves the coverage from the layout oracle alone (no DeepSpeed) and
prints the table; ``test_layout_sweep`` runs each case on stock and on the patched runtime through
``harness.gate.decide.evaluate`` -- the decision the gate makes -- so a case a registered stock bug
triggers is a strict xfail that accepts only what that bug explains. Each case's outcome and time go
into the report's ``user_properties`` and the fuzz plugin prints the table with them at the end of
the session (``cases/fuzz/plugin.py``), also under pytest-xdist.
"""
from __future__ import annotations

import json

import pytest

from cases.fuzz.plugin import SWEEP_KEY
from cases.pipelines._support import gate_params, settle
from harness.catalog import sweep
from harness.registry.bugs import BY_ID, bugs_for
from harness.case.spec import ParamShape
from harness.gate.decide import evaluate
from harness.launch.pool import RankFailed
from harness.case.scenarios import pipeline_case
from harness.judge.verdict import judge

CASES = sweep.sweep_cases()



def test_sweep_covers_every_cell():
    sweep.check_coverage(CASES)
    print(sweep.coverage_table(CASES))
    # every cell is met with other matrices in the same group on both sides (one documented exception)
    for (stage, off, ws, cls), hits in sweep.coverage(CASES).items():
        assert any(sweep._covers(m, stage, ws, cls) for _, m in hits), (stage, off, ws, cls, hits)
    assert {c.stage for c in CASES} == set(sweep.STAGES)
    assert {c.world_size for c in CASES} == set(sweep.WORLD_SIZES)
    assert {c.offload for c in CASES} == set(sweep.OFFLOADS)


def test_sweep_reorders_parameters():
    """The declared (model) order is not DeepSpeed's order, so the oracle must re-sort like DeepSpeed."""
    for c in CASES:
        mats = [tuple(p.shape) for p in c.params if len(p.shape) >= 2]
        if len(set(mats)) > 1:  # (two equal 1x1s have one order)
            assert mats != sorted(mats, reverse=True), c.name


def test_coverage_detects_a_missing_cell():
    """The coverage check can fail: drop the world-size-4 cases and their cells are reported."""
    short = [c for c in CASES if c.world_size != 4]
    miss = sweep.missing_cells(short)
    assert miss and all(ws == 4 for _, _, ws, _ in miss)
    assert len(miss) == len(sweep.STAGES) * len(sweep.OFFLOADS) * len(sweep.LAYOUT_CLASSES)
    with pytest.raises(AssertionError, match="uncovered"):
        sweep.check_coverage(short)


def test_sweep_takes_stage_zero_when_it_exists():
    """Stage 0 joins through ``sweep.STAGES`` alone: no offload, no layout class to cover, no missing cell."""
    with_zero = sweep.sweep_cases(stages=(0,) + tuple(sweep.STAGES))
    zero = [c for c in with_zero if c.stage == 0]
    assert zero and all(c.offload == "none" for c in zero)
    assert {c.world_size for c in zero} == set(sweep.WORLD_SIZES)
    assert sweep.missing_cells(with_zero, stages=(0,) + tuple(sweep.STAGES)) == []
    assert "n/a" in sweep.coverage_table(with_zero)


@pytest.mark.parametrize("case,column", gate_params(CASES))
def test_layout_sweep(case, column, pool_manager, seed, request, record_property):
    o = evaluate(case.replace(seed=seed), column, pool_manager)
    status = o.status + (f" [{', '.join(o.bug_ids)}]" if o.bug_ids else "")
    record_property(SWEEP_KEY, json.dumps({"case": case.name, "column": column, "status": status,
                                           "seconds": o.seconds}))
    settle(o, request)


# --------------------------------------------------------------------------------------------------
# DSM-017, found by this sweep (sweep-z3-none-ws4-L0-ga2): its minimal reproducer, stock and patched

DSM_017 = pipeline_case(3, "none", "fp32", 4, params=(ParamShape("w.weight", (1, 5)),)).replace(
    name="z3-none-fp32-ws4-1x5")


@pytest.mark.pipeline
def test_dsm_017_minimal_reproducer_crashes_stock_and_trains_patched(pool_manager):
    assert [b.id for b in bugs_for(DSM_017)] == ["DSM-017"]
    assert bugs_for(DSM_017.replace(patched=True), patched=True) == []
    with pytest.raises(RankFailed) as info:
        pool_manager.run(DSM_017)
    assert info.value.rank == 3, info.value  # the one rank whose share (elements 6..7) starts past n = 5
    assert BY_ID["DSM-017"].crash_matches(info.value.details), info.value.details[-800:]
    p = DSM_017.replace(patched=True)
    v = judge(p, pool_manager.run(p).result)
    assert v.passed, v.message()


def test_dsm_017_trigger_is_exact():
    """The trigger selects exactly the (n, W) whose first rank past the end starts strictly past n, and
    only on ZeRO-3 without offload (the offload path clamps its slice)."""
    def hit(n, ws, stage=3, offload="none"):
        return any(b.id == "DSM-017" for b in bugs_for(
            pipeline_case(stage, offload, "fp32", ws, params=(ParamShape("w.weight", (1, n)),))))

    # on 4 ranks only n = 5 (q = 2, rank 3 starts at 6); n = 6 starts rank 3 exactly at n: no crash
    assert [n for n in range(1, 40) if hit(n, 4)] == [5]
    assert [n for n in range(1, 40) if hit(n, 5)] == [7, 11] and hit(9, 6)
    assert not any(hit(n, ws) for ws in (1, 2, 3) for n in range(1, 40))  # impossible below 4 ranks
    assert not hit(5, 4, stage=2) and not hit(5, 4, offload="cpu")
