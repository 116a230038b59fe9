"""Chunked Muon all-gathers and the gather-buffer cache (``Case.allgather_caps``,
``harness.rank.gather_cache``): the numbers are judged by the oracle as usual, and the cache's promises --
never above its cap, a matrix gathered in 3+ chunks where the case claims chunking, nothing left
after ``destroy()`` -- become capture notes that fail the case."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cases.pipelines._support import run_case, suite
from harness.catalog import matrix
from harness.rank.gather_cache import GatherCacheWatch


@pytest.mark.pipeline
@pytest.mark.parametrize("case,column", suite(matrix.gather_cases))
def test_gathers(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


def test_pack_case_puts_two_matrices_behind_each_other_on_one_rank():
    """The -gather-pack layout: two Muon matrices that fit one batch (budget // 8 elements) sit wholly on
    one rank, so that rank packs the second behind the first."""
    from harness.judge import verdict
    from oracles.layout import param_slices

    case = next(c for c in matrix.gather_cases() if c.name.endswith("-gather-pack"))
    layout = verdict.layout_for(case, verdict.step_config(case))
    budget = case.allgather_caps[0] // 8
    small = [p for p in case.params if p.uses_muon and p.numel <= budget // 2]
    owners = [{s.rank for s in param_slices(layout, p.name)} for p in small]
    assert len(small) == 2 and sum(p.numel for p in small) <= budget
    assert owners[0] == owners[1] and len(owners[0]) == 1, owners


class _Opt:
    def __init__(self):
        self._muon_allgather_max_buffer_bytes = 1 << 26
        self._muon_allgather_max_cached_bytes = 1 << 28
        self._muon_allgather_buffers = {}
        self._muon_allgather_buffer_bytes = 0


def _watch(caps=(96, 128)):
    case = SimpleNamespace(allgather_caps=caps)
    opt = _Opt()
    return GatherCacheWatch(case, SimpleNamespace(optimizer=opt)), opt


def test_watch_lowers_the_caps_and_flags_a_cache_over_its_cap():
    w, opt = _watch()
    try:
        assert (opt._muon_allgather_max_buffer_bytes, opt._muon_allgather_max_cached_bytes) == (96, 128)
        opt._muon_allgather_buffers = {"a": (None, None, 96), "b": (None, None, 96)}
        opt._muon_allgather_buffer_bytes = 192
        notes = w.check_step(1, chunked=False)
        assert any("192 bytes > its cap 128" in n for n in notes)
    finally:
        w.close()


def test_watch_flags_a_miscounted_cache_too_few_chunks_and_buffers_left_after_destroy():
    w, opt = _watch()
    try:
        opt._muon_allgather_buffers = {"a": (None, None, 96)}
        opt._muon_allgather_buffer_bytes = 0
        notes = w.check_step(1, chunked=True)
        assert any("counts 0 bytes but holds 96" in n for n in notes)
        assert any("does not exercise chunking" in n for n in notes)
        assert any("left 1 Muon gather buffer" in n for n in w.check_destroyed())
    finally:
        w.close()


def test_watch_is_silent_on_a_clean_cache_and_inactive_without_caps():
    w, opt = _watch()
    try:
        assert w.check_step(1, chunked=False) == [] and w.check_destroyed() == []
    finally:
        w.close()
    w, opt = _watch(caps=None)
    assert not w.active and w.check_step(1, chunked=True) == []
    assert opt._muon_allgather_max_cached_bytes == 1 << 28
