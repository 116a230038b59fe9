"""The layouts the DeepSpeed PR #8464 scenarios need (docs/upstream-pr8464.md), checked from the case
definitions with DeepSpeed's own swap and sub-group rules (``harness.case.nvme``), so a catalogue edit
that quietly stops exercising one fails here rather than passing the gate for the wrong reason."""
from __future__ import annotations

import math

from harness.case import nvme
from harness.catalog import matrix


def _fragment_bytes(case, name: str) -> int:
    p = next(p for p in case.params if p.name == name)
    return nvme.FP32_BYTES * math.ceil(p.numel / case.dp_size)


def test_unswapped_grad_cases_swap_a_muon_subgroup_of_unswapped_fragments_only():
    cases = matrix.unswapped_grad_cases(full=True)
    assert {c.ds.zero.offload_optimizer.pipelined for c in cases} == {False, True}
    assert {c.world_size for c in cases} == {1, 2}
    for c in cases:
        muon = [s for s in nvme.predict_swapped_subgroups(c) if s["group"] == "muon"]
        assert len(muon) == 1 and muon[0]["swapped"], c.name
        assert all(_fragment_bytes(c, n) < nvme.min_swap_bytes(c) for n in muon[0]["params"]), c.name


def test_nvme_cases_mix_a_swapped_matrix_with_unswapped_ones_and_a_padded_partition():
    """The mixed sub-group: a swapped matrix and sub-threshold matrices in one swapped Muon sub-group, on
    both swappers at one and two ranks, with a matrix whose element count is odd (padded at two ranks)."""
    seen = set()
    for c in matrix.nvme_cases():
        if c.stage != 3:
            continue
        muon = next(s for s in nvme.predict_swapped_subgroups(c) if s["group"] == "muon")
        sizes = [_fragment_bytes(c, n) for n in muon["params"]]
        big = [b >= nvme.min_swap_bytes(c) for b in sizes]
        odd = any(p.numel % 2 for p in c.params if p.name in muon["params"])
        if muon["swapped"] and any(big) and not all(big) and odd and c.steps >= 3:
            seen.add((c.ds.zero.offload_optimizer.pipelined, c.world_size))
    assert {(False, 1), (False, 2), (True, 1), (True, 2)} <= seen, seen


def test_clip_scale_cases_clip_at_two_more_loss_scales_on_every_stage_with_cpu_offload():
    cases = matrix.clip_scale_cases()
    by_stage = {}
    for c in cases:
        assert c.offload == "cpu" and c.dtype == "fp16" and c.config["gradient_clipping"] == matrix.CLIP
        by_stage.setdefault(c.stage, set()).add(c.config["fp16"]["initial_scale_power"])
    assert by_stage == {st: set(matrix.CLIP_SCALE_POWERS) for st in matrix.STAGES}


def test_inmem_and_resume_cases_cover_both_swappers_with_the_resident_momentum():
    inmem = [c for c in matrix.inmem_cases() + matrix.resume_cases() if c.offload == "nvme"
             and c.ds.zero.save_muon_momentum_buffer_in_memory]
    kinds = {(c.ds.zero.offload_optimizer.pipelined, c.checkpoint_at is not None) for c in inmem}
    assert kinds == {(False, False), (True, False), (False, True), (True, True)}, kinds
    assert all(nvme.expects_swap(c) and c.steps >= 3 for c in inmem)
