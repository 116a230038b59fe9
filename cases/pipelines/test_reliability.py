"""Reliability of the verdict itself: the same case gives the same bits; a wrong oracle-relevant
behaviour is reported naming the right quantity."""
from __future__ import annotations

import hashlib

import pytest

from harness.judge import verdict as verdict_mod
from harness.catalog.matrix import _case
from harness.judge.verdict import judge

pytestmark = pytest.mark.pipeline


@pytest.mark.parametrize("stage,offload,dtype", [(1, "none", "fp32"), (2, "cpu", "bf16"), (3, "none", "fp16"),
                                                 (3, "nvme", "fp32")])
def test_same_case_same_bits(stage, offload, dtype, pool_manager, seed):
    """Two runs of one case (the second after an unrelated case on the same ranks) are bit-identical:
    a reused rank must not carry state from one case into the next."""
    case = _case(stage, offload, dtype, 2, grad_accum=2, clip=0.05).replace(seed=seed)
    first = pool_manager.run(case).result
    pool_manager.run(_case(3, "cpu", "fp32", 2).replace(seed=seed + 1))  # something in between
    second = pool_manager.run(case).result
    a, b = hashlib.sha256(first.fingerprint()).hexdigest(), hashlib.sha256(second.fingerprint()).hexdigest()
    assert a == b, f"{case.name}: two runs of the same case differ"


def test_momentum_beta_off_by_1e3_is_reported_as_momentum(pool_manager, seed, monkeypatch):
    """A deliberately broken oracle-relevant behaviour (Muon beta off by 1e-3, injected through the
    harness's test-only oracle hook, not into DeepSpeed) must fail the check and name the momentum."""
    case = _case(2, "cpu", "fp32", 2).replace(seed=seed)
    traj = pool_manager.run(case).result
    assert judge(case, traj).passed, "the unbroken comparison must pass first"

    def off_by(sc):
        from dataclasses import replace

        return replace(sc, momentum=sc.momentum + 1e-3)

    monkeypatch.setitem(verdict_mod.ORACLE_HOOKS, "beta+1e-3", off_by)
    broken = judge(case, traj)
    assert not broken.passed
    first = broken.first
    assert first.quantity == "momentum", broken.message()
    assert first.step == 1
    assert "momentum diverged at step 1" in broken.message()
    assert "reproduce: " in broken.message()
