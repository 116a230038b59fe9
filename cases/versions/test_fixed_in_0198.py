"""The bugs DeepSpeed 0.19.8 fixed relative to 0.19.7, each shown by one case.

On 0.19.7 each case is a strict xfail carrying exactly its bug id (the divergence or crash the bug
says, nothing else); on 0.19.8 the same case passes. Which of the two is expected comes from the
measured table (``harness.versions.AFFECTED``), so the test runs on either release's venv:
``<venv>/bin/python -m pytest cases/versions/test_fixed_in_0198.py``; CI runs it on 0.19.8.
"""
from __future__ import annotations

import pytest

from harness import versions
from harness.gate import evaluate
from harness.scenarios import pipeline_case

pytestmark = pytest.mark.pipeline

# bug id -> a case that shows it on 0.19.7; standard NS and fp32 so that 0.19.8's own bugs stay quiet
FIXED_IN_0198 = {
    "DSM-101": pipeline_case(1, "cpu", "fp32", 2, ns_method="standard"),
    "DSM-102": pipeline_case(3, "none", "fp32", 2, ns_method="standard"),
    "DSM-103": pipeline_case(2, "none", "fp32", 2, ns_method="standard"),
    "DSM-106": pipeline_case(3, "nvme", "fp32", 2, swapper="pipelined", ns_method="standard"),
}


def test_every_bug_fixed_in_0198_has_a_case():
    fixed = sorted(b for b, row in versions.AFFECTED.items() if row.get("0.19.7") and row.get("0.19.8") is False)
    assert fixed == sorted(FIXED_IN_0198)


@pytest.mark.parametrize("bug_id", sorted(FIXED_IN_0198))
def test_fails_on_0197_passes_on_0198(bug_id, pool_manager):
    release = versions.judged_as()
    if release not in ("0.19.7", "0.19.8"):
        pytest.skip(f"DeepSpeed {versions.installed().label}: this test compares 0.19.7 with 0.19.8")
    o = evaluate(FIXED_IN_0198[bug_id], "stock", pool_manager)
    if versions.excuses(bug_id, release):
        assert o.status == "xfailed" and o.bug_ids == [bug_id], o.message
    else:
        assert o.status == "passed", o.message
