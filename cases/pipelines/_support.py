"""What every pipeline test module shares: the parametrisation of cases over the gate's columns with
their strict xfails, and running one case through the gate's own decision.

A case a registered stock bug triggers is a strict xfail that accepts only ``KnownBugDivergence``,
raised only when ``harness.gate.decide.evaluate`` says the divergence matched the bug's model: any other
divergence fails the test outright, and a bug that no longer shows is an XPASS, which strict mode
turns into a failure.
"""
from __future__ import annotations

import pytest

from harness.registry.bugs import bugs_for
from harness.gate.decide import columns, evaluate, record
from harness.report.pytest_plugin import RESULT_STORE_KEY


class KnownBugDivergence(AssertionError):
    """Raised only for divergences (or the crash) a registered bug explains."""


def gate_params(cases, full_only=(), cols=None) -> list:
    """``pytest.param(case, column)`` for every column; cases named in ``full_only`` carry the
    ``full`` mark (deselected without ``--full``), bug-affected ones a strict xfail with the ids."""
    out = []
    for col in (cols if cols is not None else columns()):
        for c in cases:
            bugs = bugs_for(c.replace(patched=col == "patched"), patched=col == "patched")
            marks = [pytest.mark.full] if c.name in full_only else []
            if bugs:
                ids = ", ".join(b.id for b in bugs)
                marks.append(pytest.mark.xfail(strict=True, raises=KnownBugDivergence,
                                               reason=f"{ids}: " + "; ".join(b.title for b in bugs)))
            out.append(pytest.param(c, col, marks=marks, id=f"{col}-{c.name}"))
    return out


def suite(factory) -> list:
    """The CI subset of a matrix factory plus its ``--full``-only cases (marked ``full``)."""
    ci = factory(False)
    ci_names = {c.name for c in ci}
    extra = [c for c in factory(True) if c.name not in ci_names]
    return gate_params(ci + extra, {c.name for c in extra})


def run_case(case, column, pool_manager, seed, request):
    """The gate's decision for one case, recorded for the report; raises as the test must."""
    return settle(evaluate(case.replace(seed=seed), column, pool_manager), request)


def settle(o, request):
    """Record an outcome for the report and turn its status into the test's result."""
    store = request.config.stash.get(RESULT_STORE_KEY, None)
    if store is not None:
        record(store, o)
    if o.status == "skipped":  # the installed DeepSpeed refuses the combination by design (harness.env.versions)
        pytest.skip(o.message)
    if o.status in ("error", "failed", "unjudged"):  # "cannot judge" is never a pass
        pytest.fail(o.message, pytrace=False)
    if o.status == "xfailed":
        raise KnownBugDivergence(o.message)
    return o  # passed, or xpassed (strict xfail turns that into a failure)
