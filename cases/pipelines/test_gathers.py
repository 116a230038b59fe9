"""Chunked Muon all-gathers and the gather-buffer cache (``Case.allgather_caps``,
``harness.rank.gather_cache``): the numbers are judged by the oracle as usual, and the cache's promises --
never above its cap, a matrix gathered in 3+ chunks where the case claims chunking, nothing left
after ``destroy()``, an older entry pushed out by a newer one where the case claims eviction -- become
capture notes that fail the case."""
from __future__ import annotations

from collections import OrderedDict
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
    case = SimpleNamespace(allgather_caps=caps, stage=1)
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


class _LruOpt:
    """A ZeRO-3-like optimizer whose gather stores one entry per key under a cap, least recently used out
    first (``lru``) or, once full, keeping what it has (not ``lru``)."""

    def __init__(self, cap: int, lru: bool):
        self._muon_allgather_max_buffer_bytes = 96
        self._muon_allgather_max_cached_bytes = cap
        self._muon_allgather_buffers = OrderedDict()
        self._muon_allgather_buffer_bytes = 0
        self.lru = lru

    def _partitioned_buffers_all_gather(self, key, nbytes):
        cache = self._muon_allgather_buffers
        if cache.pop(key, None) is not None:
            cache[key] = (None, None, nbytes)
            return
        while cache and self.lru and self._muon_allgather_buffer_bytes + nbytes > self._muon_allgather_max_cached_bytes:
            self._muon_allgather_buffer_bytes -= cache.popitem(last=False)[1][2]
        if self._muon_allgather_buffer_bytes + nbytes <= self._muon_allgather_max_cached_bytes:
            cache[key] = (None, None, nbytes)
            self._muon_allgather_buffer_bytes += nbytes


def _evict_watch(lru: bool, evicts: bool = True):
    opt = _LruOpt(128, lru)
    case = SimpleNamespace(allgather_caps=(96, 128), allgather_evicts=evicts, stage=3)
    return GatherCacheWatch(case, SimpleNamespace(optimizer=opt)), opt


@pytest.mark.parametrize("lru", [True, False])
def test_eviction_is_counted_in_the_optimizers_own_cache(lru):
    """Both caches stay under the cap and are empty after destroy; only the LRU one pushes "a" out for "b",
    so only a cache that keeps its oldest entry (or never fills) leaves a claim of eviction unmet."""
    w, opt = _evict_watch(lru)
    try:
        for key in ("a", "b", "b"):
            opt._partitioned_buffers_all_gather(key, 96)
        assert w.check_step(1, chunked=False) == []
        assert w.evictions == (1 if lru else 0)
        assert list(opt._muon_allgather_buffers) == (["b"] if lru else ["a"])
        opt._muon_allgather_buffers.clear()
        opt._muon_allgather_buffer_bytes = 0
        notes = w.check_destroyed()
        assert any("no gather pushed an older cache entry out" in n for n in notes) is not lru, notes
    finally:
        w.close()


def test_a_cache_swapped_for_another_object_is_a_note_and_no_claim_no_note():
    w, opt = _evict_watch(lru=False, evicts=False)
    try:
        opt._partitioned_buffers_all_gather("a", 96)
        opt._muon_allgather_buffers = OrderedDict(opt._muon_allgather_buffers)
        assert any("not the object it was built with" in n for n in w.check_step(1, chunked=False))
        opt._muon_allgather_buffers.clear()
        opt._muon_allgather_buffer_bytes = 0
        assert w.check_destroyed() == []
    finally:
        w.close()


def test_every_case_that_claims_eviction_lowers_the_caps():
    claims = [c for c in matrix.gather_cases(full=True) if c.allgather_evicts]
    assert {c.stage for c in claims} == {1, 2, 3}
    assert all(c.allgather_caps is not None and c.allgather_caps[1] > 0 for c in claims)
