"""The compiled path, as users run it (DeepSpeed wraps muon_update in torch.compile). Inductor's
Newton-Schulz rounds differently from eager, so these are judged in ``exact`` mode (float64 oracle,
16-bit NS tolerance); each case runs in fresh ranks."""
from __future__ import annotations

import pytest

from harness import matrix
from harness.bugs import bugs_for
from harness.gate import evaluate

pytestmark = [pytest.mark.pipeline, pytest.mark.compiled]


class KnownBugDivergence(AssertionError):
    pass


def _params():
    ci = {c.name for c in matrix.compiled_cases(False)}
    out = []
    for c in matrix.compiled_cases(True):
        marks = [] if c.name in ci else [pytest.mark.full]
        bugs = bugs_for(c)
        if bugs:
            marks.append(pytest.mark.xfail(strict=True, raises=KnownBugDivergence,
                                           reason=", ".join(b.id for b in bugs)))
        out.append(pytest.param(c, marks=marks, id=c.name))
    return out


@pytest.mark.parametrize("case", _params())
def test_compiled(case, pool_manager, seed):
    o = evaluate(case.replace(seed=seed), "stock", pool_manager)
    assert o.verdict is None or o.verdict.mode == "exact"
    if o.status in ("error", "failed"):
        pytest.fail(o.message, pytrace=False)
    if o.status == "xfailed":
        raise KnownBugDivergence(o.message)
