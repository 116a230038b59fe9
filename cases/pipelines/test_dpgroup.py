"""ZeRO over a data-parallel group smaller than the world (``Case.model_parallel``, ``harness.rank.mpu``):
world size 4 as 2 model-parallel x 2 data-parallel ranks. Each model-parallel replica is its own
2-rank data-parallel run on its own data, captured and judged on its own (``harness.judge.verdict.judge``),
so that a collective on WORLD instead of the data-parallel group changes the numbers it is judged on."""
from __future__ import annotations

import numpy as np
import pytest

from cases.pipelines._support import run_case, suite
from harness.catalog import matrix
from harness.judge import verdict
from harness.case.spec import Case, Overflow
from harness.rank.mpu import grid_ranks
from harness.case.scenarios import pipeline_case
from harness.judge.verdict import judge, layout_for, step_config


@pytest.mark.pipeline
@pytest.mark.parametrize("case,column", suite(matrix.dpgroup_cases))
def test_dpgroup(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


def _ci_case(name: str) -> Case:
    return next(c for c in matrix.dpgroup_cases() if c.name == name)


@pytest.mark.pipeline
def test_replicas_are_separate_runs_and_a_mixed_up_replica_fails(pool_manager):
    """Both replicas are captured and pass against their own oracle; replica 1's run judged as
    replica 0 (the numbers a WORLD collective would hand replica 0's oracle) fails on its gradient.
    A world-size-4 case without an mpu run next in the same ranks is not left on the grid's
    data-parallel group (``deepspeed.utils.groups.mpu`` restored after the case)."""
    case = _ci_case("z1-none-fp32-ws4-mp2").replace(patched=True)
    traj = pool_manager.run(case).result
    assert len(traj.replicas) == 1
    other = traj.replicas[0]
    v = judge(case, traj)
    assert v.passed, v.message()
    assert any("model-parallel rank 1" in c.case for c in v.checks)
    a, b = traj.steps[0].params["layer0.weight"].grad, other.steps[0].params["layer0.weight"].grad
    assert not np.array_equal(a, b), "the two replicas saw the same data: a WORLD collective would not show"
    swapped = traj.__class__(**{**traj.__dict__, "steps": other.steps, "replicas": [traj]})
    bad = judge(case, swapped)
    assert not bad.passed and any(c.quantity == "grad" for c in bad.failures)

    plain = pipeline_case(1, "none", "fp32", 4, steps=2).replace(patched=True)
    t2 = pool_manager.run(plain).result
    assert not any("reference mode" in n for n in t2.notes), t2.notes
    assert judge(plain, t2).passed


@pytest.mark.pipeline
def test_a_replica_clips_with_replica_0s_norm(pool_manager):
    """With clipping on, model-parallel rank 1 reports and clips with rank 0's norm (DeepSpeed counts
    a parameter without model-parallel attributes only there); judged with its own norm instead, the
    reported norm and the clipped step both diverge, so the rule is checked, not assumed."""
    case = _ci_case("z3-none-fp32-ws4-clip0.05-mp2").replace(patched=True)
    traj = pool_manager.run(case).result
    v = judge(case, traj)
    assert v.passed, v.message()
    own, _ = verdict._judge_run(case, traj.replicas[0], None, verdict.comparison_mode(case), False, mp_rank=1)
    failed = {c.quantity for c in own.failures}
    assert "global_norm" in failed and "master" in failed, failed


def test_grid_is_megatron_layout():
    assert grid_ranks(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert grid_ranks(6, 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    with pytest.raises(ValueError, match="not a multiple"):
        grid_ranks(4, 3)


def test_the_oracle_takes_the_data_parallel_size():
    c = _ci_case("z3-none-fp32-ws4-clip0.05-mp2")
    assert (c.world_size, c.dp_size) == (4, 2)
    assert [c.data_rank(r, 1) for r in range(c.dp_size)] == [1, 3]
    sc = step_config(c)
    assert sc.world_size == 2 and layout_for(c, sc).world_size == 2


@pytest.mark.parametrize("change,match", [
    (dict(model_parallel=3), "dividing world_size"),
    (dict(overflows=(Overflow(1),)), "injected overflows"),
    (dict(ds_config='{"zero_optimization": {"stage": 0}}'), "needs ZeRO-1/2/3"),
    (dict(checkpoint_at=1), "without checkpoint resume"),
])
def test_model_parallel_refusals_name_the_cause(change, match):
    c = _ci_case("z1-none-fp32-ws4-mp2")
    with pytest.raises(ValueError, match=match):
        c.replace(**change)
