"""ZeRO knobs that change the Muon code path (``harness.catalog.matrix.knob_cases``): contiguous_gradients
off, overlap_comm on, one reduce bucket per parameter, fp32 gradient accumulation with ZeRO-2 bf16."""
from __future__ import annotations

import pytest

from cases.pipelines._support import run_case, suite
from harness.catalog import matrix
from harness.registry.mutants import _z3_muon_in_several_buckets


@pytest.mark.pipeline
@pytest.mark.parametrize("case,column", suite(matrix.knob_cases))
def test_knobs(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


def test_every_knob_meets_every_stage_in_ci():
    ci = matrix.knob_cases(False)
    for key in matrix.KNOBS:
        assert {c.stage for c in ci if c.name.endswith(f"-knob-{key}")} == set(matrix.STAGES)
    assert any(_z3_muon_in_several_buckets(c) for c in ci)  # ZeRO-3 Muon gathered in several chunks
    gad = [c for c in ci if c.name.endswith("-knob-gad32")]
    assert {(c.stage, c.dtype, c.config["data_types"]["grad_accum_dtype"]) for c in gad} == {(2, "bf16", "fp32")}
