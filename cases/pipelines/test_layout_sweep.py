"""The deterministic layout sweep (``harness.sweep``): every (stage, offload, world size, layout class)
cell runs, with the class on a Muon matrix that has Muon neighbours on both sides of it.

``test_sweep_covers_every_cell`` proves the coverage from the layout oracle alone (no DeepSpeed) and
prints the table; ``test_layout_sweep`` runs each case on stock and on the patched runtime through
``harness.gate.evaluate`` -- the decision the gate makes -- so a case a registered stock bug
triggers is a strict xfail that accepts only what that bug explains. Each case's outcome and time go
into the report's ``user_properties`` and the fuzz plugin prints the table with them at the end of
the session (``cases/fuzz/plugin.py``), also under pytest-xdist.
"""
from __future__ import annotations

import json

import pytest

from cases.fuzz.plugin import SWEEP_KEY
from harness import sweep
from harness.bugs import bugs_for
from harness.gate import columns, evaluate, record

CASES = sweep.sweep_cases()



class KnownBugDivergence(AssertionError):
    """Raised only for divergences (or crashes) a registered bug explains."""


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


def _params():
    out = []
    for col in columns():
        for c in CASES:
            bugs = bugs_for(c.replace(patched=col == "patched"), patched=col == "patched")
            marks = []
            if bugs:
                ids = ", ".join(b.id for b in bugs)
                marks.append(pytest.mark.xfail(strict=True, raises=KnownBugDivergence,
                                               reason=f"{ids}: " + "; ".join(b.title for b in bugs)))
            out.append(pytest.param(c, col, marks=marks, id=f"{col}-{c.name}"))
    return out


try:
    from harness.pytest_plugin import RESULT_STORE_KEY
except ImportError:  # the report plugin is optional
    RESULT_STORE_KEY = None


@pytest.mark.pipeline
@pytest.mark.parametrize("case,column", _params())
def test_layout_sweep(case, column, pool_manager, seed, request, record_property):
    o = evaluate(case.replace(seed=seed), column, pool_manager)
    store = request.config.stash.get(RESULT_STORE_KEY, None) if RESULT_STORE_KEY else None
    if store is not None:
        record(store, o)
    status = o.status + (f" [{', '.join(o.bug_ids)}]" if o.bug_ids else "")
    record_property(SWEEP_KEY, json.dumps({"case": case.name, "column": column, "status": status,
                                           "seconds": o.seconds}))
    if o.status in ("error", "failed"):
        pytest.fail(o.message, pytrace=False)
    if o.status == "xfailed":
        raise KnownBugDivergence(o.message)
