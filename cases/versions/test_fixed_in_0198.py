"""The bugs DeepSpeed 0.19.8 fixed relative to 0.19.7, each shown by one case.

On 0.19.7 each case is a strict xfail carrying exactly its bug id (the divergence or crash the bug
says, nothing else); on 0.19.8 the same case passes. Which of the two is expected comes from the
measured table (``harness.registry.bugs.AFFECTED``, each entry's releases), so the test runs on
either release's venv:
``<venv>/bin/python -m pytest cases/versions/test_fixed_in_0198.py``; CI runs it on 0.19.8.
"""
from __future__ import annotations

import json

import pytest

from harness.env import device, versions
from harness.case.spec import canonical_json
from harness.gate.decide import evaluate
from harness.registry import bugs
from harness.catalog.matrix import gate_cases, tiny_grad_cases
from harness.case.scenarios import pipeline_case

pytestmark = pytest.mark.pipeline



def _with(case, name: str, **top):
    """``case`` with top-level config keys set (``communication_data_type``, ``data_types``...)."""
    cfg = json.loads(case.ds_config)
    cfg.update(top)
    return case.replace(name=name, ds_config=canonical_json(cfg))


# bug id -> a case that shows it on 0.19.7; standard NS and fp32 so that 0.19.8's own bugs stay quiet
# (DSM-108 needs fp16: ZeRO-3 offload with fp32 communication and accumulation, where 0.19.8 keeps Muon in
# fp32, so DSM-001 stays quiet; world size 1 keeps DSM-102 away)
FIXED_IN_0198 = {
    "DSM-101": pipeline_case(1, "cpu", "fp32", 2, ns_method="standard"),
    "DSM-102": pipeline_case(3, "none", "fp32", 2, ns_method="standard"),
    "DSM-103": pipeline_case(2, "none", "fp32", 2, ns_method="standard"),
    "DSM-106": pipeline_case(3, "nvme", "fp32", 2, swapper="pipelined", ns_method="standard"),
    "DSM-108": _with(pipeline_case(3, "cpu", "fp16", 1, ns_method="standard"), "z3-cpu-fp16-ws1-standard-comm32-gad32",
                     communication_data_type="fp32", data_types={"grad_accum_dtype": "fp32"}),
    "DSM-109": pipeline_case(3, "nvme", "fp32", 1, ns_method="standard", save_muon_momentum_buffer_in_memory=True
                             ).replace(name="z3-nvme-part-fp32-ws1-standard-inmem"),
    "DSM-110": pipeline_case(3, "none", "fp32", 1, ns_method="standard", extra_zero={"contiguous_gradients": False}
                             ).replace(name="z3-none-fp32-ws1-standard-nocontig"),
    "DSM-111": pipeline_case(3, "none", "fp32", 1, ns_method="standard", grad_accum=2),
    "DSM-112": pipeline_case(2, "none", "fp32", 3, ns_method="standard"),
    "DSM-115": pipeline_case(1, "none", "fp32", 2, ns_method="standard", extra_zero={"contiguous_gradients": False}
                             ).replace(name="z1-none-fp32-ws2-standard-nocontig"),
    "DSM-119": tiny_grad_cases()[0],  # z1-none-fp32-ws2-tinygrad: gram, every gradient x1e-10
    # a swapped Muon matrix sorted after a smaller one in its ZeRO-3 NVMe sub-group (harness.case.nvme)
    "DSM-123": next(c for c in gate_cases(False) if c.name == "z3-nvme-part-fp32-ws1-sortedlast"),
}
# the ids each case xfails with on 0.19.7 where more than its own bug shows (DSM-112 is DSM-103 on a
# matrix that straddles ranks: both are there; DSM-115's and DSM-119's cases have two Muon matrices in one
# group, so DSM-103)
ALSO = {"DSM-112": ["DSM-103"], "DSM-115": ["DSM-103"], "DSM-119": ["DSM-103"]}
# where 0.19.8 does not pass the case but shows only its own bug there: DSM-123's masters are right on 0.19.8,
# whose gradient read of the same matrix is DSM-021 (registered for 0.19.8, fixed by the patched runtime)
ON_0198 = {"DSM-123": ["DSM-021"]}


def test_every_bug_fixed_in_0198_has_a_case():
    fixed = sorted(b for b, row in bugs.AFFECTED.items() if row.get("0.19.7") and row.get("0.19.8") is False)
    assert fixed == sorted(FIXED_IN_0198)


@pytest.mark.parametrize("bug_id", sorted(FIXED_IN_0198))
def test_fails_on_0197_passes_on_0198(bug_id, pool_manager):
    release = versions.judged_as()
    if release not in ("0.19.7", "0.19.8"):
        pytest.skip(f"DeepSpeed {versions.installed().label}: this test compares 0.19.7 with 0.19.8")
    if bug_id == "DSM-119" and not device.half_support()[0]:
        pytest.skip("DSM-119 needs an accelerator with fp16: without it the gram iteration runs in fp32")
    o = evaluate(FIXED_IN_0198[bug_id], "stock", pool_manager)
    if bugs.excuses(bug_id, release):
        assert o.status == "xfailed" and sorted(o.bug_ids) == sorted([bug_id, *ALSO.get(bug_id, [])]), o.message
    elif bug_id in ON_0198:
        assert o.status == "xfailed" and sorted(o.bug_ids) == ON_0198[bug_id], o.message
    else:
        assert o.status == "passed", o.message
