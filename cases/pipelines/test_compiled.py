"""The compiled path, as users run it (DeepSpeed wraps muon_update in torch.compile). Inductor's
Newton-Schulz rounds differently from eager, so these are judged in ``exact`` mode (float64 oracle,
16-bit NS tolerance); each case runs in fresh ranks."""
from __future__ import annotations

import pytest

from cases.pipelines._support import gate_params, settle
from harness import matrix
from harness.gate import evaluate

pytestmark = [pytest.mark.pipeline, pytest.mark.compiled]


def _params():
    ci = matrix.compiled_cases(False)
    ci_names = {c.name for c in ci}
    extra = [c for c in matrix.compiled_cases(True) if c.name not in ci_names]
    return gate_params(ci + extra, {c.name for c in extra}, cols=["stock"])


@pytest.mark.parametrize("case,column", _params())
def test_compiled(case, column, pool_manager, seed, request):
    o = evaluate(case.replace(seed=seed), column, pool_manager)
    assert o.verdict is None or o.verdict.mode == "exact"
    settle(o, request)
