"""ZeRO knobs that change the Muon code path (``harness.matrix.knob_cases``): contiguous_gradients
off, overlap_comm on, one reduce bucket per parameter, fp32 gradient accumulation with ZeRO-2 bf16."""
from __future__ import annotations

import pytest

from cases.pipelines._support import gate_params, settle
from harness import matrix
from harness.gate import evaluate
from harness.known_bugs import _z3_muon_in_several_buckets


def _params():
    ci = matrix.knob_cases(False)
    names = {c.name for c in ci}
    extra = [c for c in matrix.knob_cases(True) if c.name not in names]
    return gate_params(ci + extra, {c.name for c in extra})


@pytest.mark.pipeline
@pytest.mark.parametrize("case,column", _params())
def test_knobs(case, column, pool_manager, seed, request):
    settle(evaluate(case.replace(seed=seed), column, pool_manager), request)


def test_every_knob_meets_every_stage_in_ci():
    ci = matrix.knob_cases(False)
    for key in matrix.KNOBS:
        assert {c.stage for c in ci if c.name.endswith(f"-knob-{key}")} == set(matrix.STAGES)
    assert any(_z3_muon_in_several_buckets(c) for c in ci)  # ZeRO-3 Muon gathered in several chunks
    gad = [c for c in ci if c.name.endswith("-knob-gad32")]
    assert {(c.stage, c.dtype, c.config["data_types"]["grad_accum_dtype"]) for c in gad} == {(2, "bf16", "fp32")}
