"""The mutation catalogue (``harness.registry.mutants``): every mutant installs and undoes cleanly, and the
default kill set kills all of them where predicted (the kill matrix, ~2 min on 2 cores: ``full`` and
``mutate``)."""
from __future__ import annotations

import types

import pytest

from harness.judge import verdict as verdict_module
from harness.judge.verdict import judge
from harness.selfcheck import kill_matrix
from harness.registry import mutants
from harness import fixes


def _snapshot():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.muon import original_muon
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper
    from deepspeed.runtime.zero.muon import muon_optimizer

    import deepspeed

    out = {"muon_update": original_muon.muon_update, "muon_optimizer.muon_update": muon_optimizer.muon_update,
           "deepspeed.set_optimizer_flags": deepspeed.set_optimizer_flags,
           "original_muon._aspect_ratio_scale": original_muon._aspect_ratio_scale}
    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, MuonWithAuxAdam, DeepSpeedEngine,
                BF16_Optimizer, OptimizerSwapper):
        for k, v in vars(cls).items():
            out[f"{cls.__name__}.{k}"] = v
    return out


def test_catalogue():
    assert len(mutants.MUTANTS) >= 12
    assert "padded-tail-misslice" in mutants.MUTANTS
    for m in mutants.MUTANTS.values():
        assert m.description and (callable(m.catches) or m.catches), m.name


@pytest.mark.parametrize("patched", [False, True])
def test_every_mutant_installs_and_undoes(patched):
    fixes.remove()
    if patched:
        fixes.apply()
    try:
        before = _snapshot()
        for name in mutants.MUTANTS:
            undo = mutants.install(name)
            assert _snapshot() != before, f"{name} changed nothing"
            undo()
            after = _snapshot()
            changed = [k for k in before if after.get(k) is not before[k]]
            assert not changed, f"{name} left {changed}"
    finally:
        fixes.remove()


def test_unknown_mutant_is_an_error():
    with pytest.raises(KeyError, match="unknown mutant"):
        mutants.install("no-such-mutant")


@pytest.mark.pipeline
@pytest.mark.mutate
def test_kill_matrix_kills_every_mutant_where_predicted(pool_manager):
    km = kill_matrix.kill_matrix(kill_matrix.default_kill_cases(), manager=pool_manager)
    assert all(km.baseline.values()), km.table()
    assert km.kill_rate == 1.0, km.table()
    assert not km.surprises(), km.table()


def test_a_mutant_that_leaves_the_baselines_bits_is_not_judged_again(monkeypatch):
    """A mutated run with every bit the judge reads equal to its passing baseline's has the baseline's
    verdict without a second replay; a run whose bits differ is judged, and a kill is still a kill."""
    class Bits:
        def __init__(self, reached):
            self.reached = reached

        def same(self, other):
            return self.reached == other.reached

    class Run:  # a run shows the mutant only where it reaches this case
        def __init__(self, reached):
            self.reached = reached

        def judged_bits(self):
            return Bits(self.reached)

    class Launcher:
        def run(self, case):
            return types.SimpleNamespace(result=Run(case.mutant == "nesterov-dropped"))

        def close(self, kill=False):
            pass

    judged = []

    def fake_judge(case, traj, until_failure=False, **_):
        judged.append(case.mutant)
        first = types.SimpleNamespace(param="w", quantity="param", step=1, worst_ratio=9.0) if traj.reached else None
        return types.SimpleNamespace(passed=not traj.reached, first=first)

    monkeypatch.setattr(verdict_module, "judge", fake_judge)
    case = next(c for c in kill_matrix.default_kill_cases() if c.name == "z2-none-fp32-ws2")
    km = kill_matrix.kill_matrix([case], ["nesterov-dropped", "momentum-beta-offset-1e-3"], manager=Launcher())
    assert judged == [None, "nesterov-dropped"]
    rows = {r.mutant: r for r in km.rows}
    assert rows["nesterov-dropped"].killed is True and rows["momentum-beta-offset-1e-3"].killed is False
    assert rows["momentum-beta-offset-1e-3"].detail == kill_matrix.SAME_AS_BASELINE


def _first(v):
    return None if v.first is None else (v.first.param, v.first.quantity, v.first.step, v.first.worst_ratio)


@pytest.mark.pipeline
def test_a_mutants_verdict_stopped_at_its_first_divergent_step_says_what_the_whole_verdict_says(pool_manager):
    """The kill matrix judges a mutant's run ``until_failure``: whether the mutant was caught and where
    first must be the whole verdict's, and a run caught in an early step is judged over fewer steps."""
    cases = {c.name: c for c in kill_matrix.default_kill_cases()}
    shorter = 0
    for name in ("z2-none-fp32-ws2", "z3-cpu-bf16-ws2"):
        for mutant in ("nesterov-dropped", "momentum-beta-offset-1e-3", None):
            case = cases[name].replace(patched=True, mutant=mutant)
            traj = pool_manager.run(case).result
            whole, early = judge(case, traj), judge(case, traj, until_failure=True)
            assert (whole.passed, _first(whole)) == (early.passed, _first(early)), (name, mutant)
            assert whole.passed == (mutant is None)
            if early.passed:
                assert len(early.checks) == len(whole.checks)
            shorter += max(c.step for c in early.checks) < max(c.step for c in whole.checks)
    assert shorter == 4

