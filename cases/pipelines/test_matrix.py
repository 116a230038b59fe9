"""Every ZeRO / offload / precision path of Muon against the oracle, step by step.

The decision (passed / strict xfail by bug id / failed) is ``harness.gate.evaluate``'s, the same
the main job makes. A case a registered stock bug triggers is a strict xfail that only accepts
``KnownBugDivergence``: a divergence the bug does not explain fails the test outright, and a bug
that no longer shows is an XPASS, which strict mode turns into a failure.
"""
from __future__ import annotations

import pytest

from harness import matrix
from harness.bugs import bugs_for
from harness.gate import columns, evaluate, record
from harness.pytest_plugin import RESULT_STORE_KEY

pytestmark = pytest.mark.pipeline


class KnownBugDivergence(AssertionError):
    """Raised only for divergences a registered bug explains."""


def _params(cases, full_only=()):
    out = []
    for col in columns():
        for c in cases:
            bugs = bugs_for(c.replace(patched=col == "patched"), patched=col == "patched")
            marks = [pytest.mark.full] if c.name in full_only else []
            if bugs:
                ids = ", ".join(b.id for b in bugs)
                marks.append(pytest.mark.xfail(strict=True, raises=KnownBugDivergence,
                                               reason=f"{ids}: " + "; ".join(b.title for b in bugs)))
            out.append(pytest.param(c, col, marks=marks, id=f"{col}-{c.name}"))
    return out


def _full_only(ci, full):
    ci_names = {c.name for c in ci}
    return [c for c in full if c.name not in ci_names], {c.name for c in full if c.name not in ci_names}


def _suite(factory):
    ci = factory(False)
    extra, names = _full_only(ci, factory(True))
    return _params(ci + extra, names)


def _run(case, column, pool_manager, seed, request):
    o = evaluate(case.replace(seed=seed), column, pool_manager)
    store = request.config.stash.get(RESULT_STORE_KEY, None)
    if store is not None:
        record(store, o)
    if o.status in ("error", "failed"):
        pytest.fail(o.message, pytrace=False)
    if o.status == "xfailed":
        raise KnownBugDivergence(o.message)
    return o  # passed, or xpassed (strict xfail turns that into a failure)


@pytest.mark.parametrize("case,column", _suite(matrix.base_cases))
def test_base(case, column, pool_manager, seed, request):
    _run(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", _suite(matrix.nvme_cases))
def test_nvme(case, column, pool_manager, seed, request):
    o = _run(case, column, pool_manager, seed, request)
    if not o.refused:  # a refused case (patched fix for DSM-002) never reached the swapper
        assert o.swapped_bytes and o.swapped_bytes > 0


@pytest.mark.parametrize("case,column", _suite(matrix.inmem_cases))
def test_zero3_inmem_momentum(case, column, pool_manager, seed, request):
    _run(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", _suite(matrix.overflow_cases))
def test_overflow_skips_step(case, column, pool_manager, seed, request):
    o = _run(case, column, pool_manager, seed, request)
    # Beyond the oracle's agreement, the promise itself: step 2 skipped, nothing else skipped, the
    # momentum untouched by the skipped step, the scale halved (hysteresis 1).
    steps = {s.step: s for s in o.trajectory.steps}
    assert [s for s, r in steps.items() if r.skipped] == [2]
    assert steps[2].loss_scale_after == steps[2].loss_scale / 2
    for name in o.trajectory.muon_params:
        before, after = steps[1].params[name], steps[2].params[name]
        assert (before.momentum / before.momentum_scale == after.momentum / after.momentum_scale).all(), name
        assert (before.master == after.master).all(), name


@pytest.mark.parametrize("case,column", _suite(matrix.growth_cases))
def test_loss_scale_growth(case, column, pool_manager, seed, request):
    _run(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", _suite(matrix.stage0_cases))
def test_stage0(case, column, pool_manager, seed, request):
    _run(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", _suite(matrix.groups_cases))
def test_param_groups(case, column, pool_manager, seed, request):
    _run(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", _suite(matrix.schedule_cases))
def test_lr_schedules(case, column, pool_manager, seed, request):
    _run(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", _suite(matrix.bf16opt_cases))
def test_bf16_optimizer_and_comm32(case, column, pool_manager, seed, request):
    _run(case, column, pool_manager, seed, request)
