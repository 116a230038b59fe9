"""Rank side of the chunked-gather cases (``Case.allgather_caps``): lower the ZeRO optimizer's Muon
all-gather limits, and watch what they are meant to guarantee.

DeepSpeed 0.19.8 gathers the Muon matrices of the ZeRO-1/2 offload path in chunks of at most
``_muon_allgather_max_buffer_bytes`` (stage_1_and_2.py ``_muon_all_gather_partitions``), keeps the
scratch buffers of each (chunk size, buffer count, dtype) in an LRU cache bounded by
``_muon_allgather_max_cached_bytes``, and frees them in ``destroy()``
(``_clear_muon_allgather_buffers``); ZeRO-3 caches its gather buffers the same way (stage3.py
``_partitioned_buffers_all_gather``, no chunking). What a cache entry holds differs between trees
(0.19.8: ``(local, gathered, bytes)``; DeepSpeed PR #8464's ZeRO-3: ``(local, reduce, rearrange,
bytes)``), so the byte count is read where the tree's own source stores it
(``tree.muon_allgather_entry``); a tree whose entries the probe cannot read, or a ZeRO-1/2 that gathers
in one call (``tree.muon_allgather_chunked``), has its gather cases deselected, and another entry layout
its eviction cases, whose caps are sized for 0.19.8's entries (``harness.env.versions``). The numbers
are judged by the usual oracle; this module turns the three promises into capture notes, each of which
fails the case (``harness.judge.verdict``): the cache held more than its cap (or its byte counter
disagrees with what it holds), a case that claims chunking but whose step had no gather of
``MIN_CHUNKS`` or more chunks (all-gathers in one ``_muon_all_gather_partitions`` call), a buffer left
behind after ``destroy()``, and a case that claims eviction (``Case.allgather_evicts``) whose engine
never saw an older cache entry pushed out by a newer one. That last promise is counted in DeepSpeed's
own cache object (the ``OrderedDict`` the optimizer holds, never replaced): its keys are recorded around
every gather call, and a call after which a key that was there is gone while a new one is there is an
eviction. A cache that never fills, or one that keeps its first entries and refuses the rest, stays
under its cap as well; only the count tells them from an LRU cache.
"""
from __future__ import annotations

from harness.env import tree, versions

MIN_CHUNKS = 3
GATHER_METHODS = ("_muon_all_gather_partitions", "_partitioned_buffers_all_gather")


class GatherCacheWatch:
    """One engine's watch; ``check_step()`` after every optimizer step, ``check_destroyed()`` after
    ``destroy()``. Counts the all-gathers ``_muon_all_gather_partitions`` issues (one per chunk)."""

    def __init__(self, case, engine, caps=None):
        self.case = case
        self.opt = getattr(engine, "optimizer", None)
        self.entry = None  # (length, index of the byte count) of a cache entry, as the tree's source stores it
        self.max_seen = 0
        self.gathers = 0  # the most all-gathers one _muon_all_gather_partitions call issued this step
        self._in_call = 0
        self.max_gathers = 0
        self.evictions_possible = False
        self.evictions = 0  # gather calls after which an older entry was gone and a newer one cached
        self._cache = None  # DeepSpeed's cache object as first seen: a swap for another object is a note
        self._undo = None
        if case.allgather_caps is None or self.opt is None:
            return
        k = caps if caps is not None else tree.capabilities()
        self.entry = k[f"muon_allgather_entry({'z3' if case.stage == 3 else 'z12'})"]
        buf, cap = case.allgather_caps
        if hasattr(self.opt, "_muon_allgather_max_buffer_bytes"):
            self.opt._muon_allgather_max_buffer_bytes = int(buf)
        if hasattr(self.opt, "_muon_allgather_max_cached_bytes"):
            self.opt._muon_allgather_max_cached_bytes = int(cap)
        from deepspeed import comm  # late: DeepSpeed, rank side

        cur = comm.all_gather_into_tensor
        inside = [False]

        def all_gather_into_tensor(*args, **kwargs):
            if inside[0]:
                self._in_call += 1
                self.gathers = max(self.gathers, self._in_call)
            return cur(*args, **kwargs)

        comm.all_gather_into_tensor = all_gather_into_tensor
        opt = self.opt
        self._cache = getattr(opt, "_muon_allgather_buffers", None)
        wrapped = []
        # ZeRO-1/2 gather through _muon_all_gather_partitions (chunked), ZeRO-3 through
        # _partitioned_buffers_all_gather; both store into the same kind of cache
        for attr in GATHER_METHODS:
            method = getattr(type(opt), attr, None)
            if method is not None:
                setattr(opt, attr, self._wrap_gather(method, inside, count_chunks=attr == GATHER_METHODS[0]))
                wrapped.append(attr)

        def undo():
            comm.all_gather_into_tensor = cur
            for attr in wrapped:
                opt.__dict__.pop(attr, None)

        self._undo = undo

    def _wrap_gather(self, method, inside, count_chunks: bool):
        opt = self.opt

        def gather(*args, **kwargs):
            if count_chunks:
                inside[0] = True
                self._in_call = 0
            before = list(self._cache.keys()) if self._cache is not None else []
            try:
                return method(opt, *args, **kwargs)
            finally:
                if count_chunks:
                    inside[0] = False
                self._count_eviction(before)

        return gather

    def _count_eviction(self, before: list) -> None:
        if self._cache is None:
            return
        after = set(self._cache.keys())
        had = set(before)
        if any(k not in after for k in before) and any(k not in had for k in after):
            self.evictions += 1

    @property
    def active(self) -> bool:
        return self._undo is not None

    def before_step(self) -> None:
        self.gathers = 0

    def check_step(self, step: int, chunked: bool) -> list[str]:
        """Notes (failures) for this step: cache over its cap or miscounted; too few chunks."""
        if not self.active:
            return []
        notes = []
        self.max_gathers = max(self.max_gathers, self.gathers)
        cache = getattr(self.opt, "_muon_allgather_buffers", None)
        if cache is None:
            return [f"step {step}: the optimizer has no Muon gather cache to check"]
        held, misread = self._held(cache)
        if misread:
            return [f"step {step}: {misread}"]
        counted = int(getattr(self.opt, "_muon_allgather_buffer_bytes", -1))
        cap = int(self.opt._muon_allgather_max_cached_bytes)
        self.max_seen = max(self.max_seen, held)
        if held > cap:
            notes.append(f"step {step}: the Muon gather cache holds {held} bytes > its cap {cap}")
        if counted != held:
            notes.append(f"step {step}: the Muon gather cache counts {counted} bytes but holds {held}")
        if cache is not self._cache:
            notes.append(f"step {step}: the optimizer's Muon gather cache is not the object it was built with")
        if chunked and self.gathers < MIN_CHUNKS:
            notes.append(f"step {step}: claims chunked Muon all-gathers but no gather spanned more than "
                         f"{self.gathers} chunk(s) (< {MIN_CHUNKS}): the case does not exercise chunking")
        return notes

    def check_destroyed(self) -> list[str]:
        if not self.active:
            return []
        self._undo()
        self._undo = None
        cache = getattr(self.opt, "_muon_allgather_buffers", None) or {}
        left, misread = self._held(cache)
        counted = int(getattr(self.opt, "_muon_allgather_buffer_bytes", 0))
        self.opt = self._cache = None
        notes = [misread] if misread else []
        if cache or counted:
            notes.append(f"destroy() left {len(cache)} Muon gather buffer(s) ({left} bytes, counter {counted})")
        if getattr(self.case, "allgather_evicts", False) and not self.evictions:
            notes.append("claims the Muon gather cache evicts, but no gather pushed an older cache entry out "
                         "for a newer one (the cache never filled, or kept its old entries)")
        return notes

    def _held(self, cache) -> tuple[int, str]:
        """(bytes the cache holds, "" or why its entries cannot be read): each entry's byte count at the index
        the tree's source puts it. An entry of another length than the source stores says the probe misread
        the tree: a note naming the probe, never a guess at another index."""
        length, at = self.entry if self.entry else (0, 0)
        odd = [v for v in cache.values() if not isinstance(v, tuple) or len(v) != length]
        if odd:
            shown = len(odd[0]) if isinstance(odd[0], tuple) else type(odd[0]).__name__
            return 0, (f"a Muon gather cache entry holds {shown} element(s) where this tree's source stores "
                       f"{length} (probe muon_allgather_entry({'z3' if self.case.stage == 3 else 'z12'}))")
        return sum(int(v[at]) for v in cache.values()), ""

    def close(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
        self.opt = self._cache = None


def chunked(case) -> bool:
    """Whether the case claims chunked Muon gathers (``versions.chunked_gathers``: ZeRO-1/2 with optimizer
    offload); a tree that gathers in one call has deselected it before it runs."""
    return versions.chunked_gathers(case)
