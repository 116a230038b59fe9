"""The built-in models (``harness.models``) on every stage, with and without ``zero.Init``, fp32 and
bf16, with and without CPU offload, world size 2: ``harness.catalog.matrix.model_cases``, decided by
``harness.gate.decide.evaluate`` exactly as the gate decides (stock bugs are strict xfails by id).

Without the ``models`` extra the two language models are not generated; ``test_models_extra``
says so by name. Cost (2 busy cores): 16 model + 2 synthetic zero.Init CI cases x 2 columns ~150 s, most of it the first
ResNet case of each pool (~20-30 s: conv kernels' first call); ``--full`` runs 290 per column.
"""
from __future__ import annotations

import pytest

from cases.pipelines._support import run_case, suite
from harness.catalog import matrix
from harness.catalog.models import missing_extra_note

pytestmark = pytest.mark.pipeline


@pytest.mark.parametrize("case,column", suite(matrix.model_cases))
def test_model(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


def test_models_extra():
    note = missing_extra_note()
    if note:
        pytest.skip(note)
