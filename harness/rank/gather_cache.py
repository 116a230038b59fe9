"""Rank side of the chunked-gather cases (``Case.allgather_caps``): lower the ZeRO optimizer's Muon
all-gather limits, and watch what they are meant to guarantee.

DeepSpeed 0.19.8 gathers the Muon matrices of the ZeRO-1/2 offload path in chunks of at most
``_muon_allgather_max_buffer_bytes`` (stage_1_and_2.py ``_muon_all_gather_partitions``), keeps the
scratch buffers of each (chunk size, buffer count, dtype) in an LRU cache bounded by
``_muon_allgather_max_cached_bytes``, and frees them in ``destroy()`` (``_clear_muon_allgather_buffers``);
ZeRO-3 caches its gather buffers the same way (stage3.py ``_partitioned_buffers_all_gather``, no
chunking). The numbers are judged by the usual oracle; this module turns the three promises into
capture notes, each of which fails the case (``harness.judge.verdict``): the cache held more than its cap
(or its byte counter disagrees with what it holds), a case that claims chunking but whose step had
no gather of ``MIN_CHUNKS`` or more chunks (all-gathers in one ``_muon_all_gather_partitions``
call), and a buffer left behind after ``destroy()``.
"""
from __future__ import annotations

MIN_CHUNKS = 3


class GatherCacheWatch:
    """One engine's watch; ``check_step()`` after every optimizer step, ``check_destroyed()`` after
    ``destroy()``. Counts the all-gathers ``_muon_all_gather_partitions`` issues (one per chunk)."""

    def __init__(self, case, engine):
        self.case = case
        self.opt = getattr(engine, "optimizer", None)
        self.max_seen = 0
        self.gathers = 0  # the most all-gathers one _muon_all_gather_partitions call issued this step
        self._in_call = 0
        self.max_gathers = 0
        self.evictions_possible = False
        self._undo = None
        if case.allgather_caps is None or self.opt is None:
            return
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
        method = getattr(type(opt), "_muon_all_gather_partitions", None)
        if method is not None:
            def _muon_all_gather_partitions(*args, **kwargs):
                inside[0] = True
                self._in_call = 0
                try:
                    return method(opt, *args, **kwargs)
                finally:
                    inside[0] = False

            opt._muon_all_gather_partitions = _muon_all_gather_partitions

        def undo():
            comm.all_gather_into_tensor = cur
            opt.__dict__.pop("_muon_all_gather_partitions", None)

        self._undo = undo

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
        held = sum(int(v[2]) for v in cache.values())
        counted = int(getattr(self.opt, "_muon_allgather_buffer_bytes", -1))
        cap = int(self.opt._muon_allgather_max_cached_bytes)
        self.max_seen = max(self.max_seen, held)
        if held > cap:
            notes.append(f"step {step}: the Muon gather cache holds {held} bytes > its cap {cap}")
        if counted != held:
            notes.append(f"step {step}: the Muon gather cache counts {counted} bytes but holds {held}")
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
        left = sum(int(v[2]) for v in cache.values())
        counted = int(getattr(self.opt, "_muon_allgather_buffer_bytes", 0))
        self.opt = None
        if cache or counted:
            return [f"destroy() left {len(cache)} Muon gather buffer(s) ({left} bytes, counter {counted})"]
        return []

    def close(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
        self.opt = None


def chunked(case) -> bool:
    """Whether DeepSpeed chunks this case's Muon gathers (ZeRO-1/2 with optimizer offload; nvme runs
    as cpu there, DSM-002)."""
    return case.allgather_caps is not None and case.stage in (1, 2) and case.offload != "none"
