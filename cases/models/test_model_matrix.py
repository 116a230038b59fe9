"""The built-in models (``harness.models``) on every stage, with and without ``zero.Init``, fp32 and
bf16, with and without CPU offload, world size 2: ``harness.matrix.model_cases``, decided by
``harness.gate.evaluate`` exactly as the gate decides (stock bugs are strict xfails by id).

Without the ``models`` extra the two language models are not generated; ``test_models_extra``
says so by name. Cost (2 busy cores): 16 model + 2 synthetic zero.Init CI cases x 2 columns ~150 s, most of it the first
ResNet case of each pool (~20-30 s: conv kernels' first call); ``--full`` runs 290 per column.
"""
from __future__ import annotations

import pytest

from harness import matrix
from harness.bugs import bugs_for
from harness.gate import columns, evaluate
from harness.models.matrix import missing_extra_note

pytestmark = pytest.mark.pipeline


class KnownBugDivergence(AssertionError):
    """Raised only for divergences (or the crash) a registered bug explains."""


def _params():
    ci = matrix.model_cases(False)
    ci_names = {c.name for c in ci}
    extra = [c for c in matrix.model_cases(True) if c.name not in ci_names]
    out = []
    for col in columns():
        for c in ci + extra:
            bugs = bugs_for(c.replace(patched=col == "patched"), patched=col == "patched")
            marks = [] if c.name in ci_names else [pytest.mark.full]
            if bugs:
                marks.append(pytest.mark.xfail(strict=True, raises=KnownBugDivergence,
                                               reason=", ".join(b.id for b in bugs)))
            out.append(pytest.param(c, col, marks=marks, id=f"{col}-{c.name}"))
    return out


@pytest.mark.parametrize("case,column", _params())
def test_model(case, column, pool_manager, seed):
    o = evaluate(case.replace(seed=seed), column, pool_manager)
    if o.status in ("error", "failed"):
        pytest.fail(o.message, pytrace=False)
    if o.status == "xfailed":
        raise KnownBugDivergence(o.message)


def test_models_extra():
    note = missing_extra_note()
    if note:
        pytest.skip(note)
