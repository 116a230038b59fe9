"""Rank copies of a ``muon_update`` call are compared on rank 0 by digest (``capture.share_calls_once``).

With optimizer offload every rank orthogonalises every matrix, and the capture's only use of the
copies is to say when ranks disagree (a capture note, which fails the case). Shipping digests instead
of the copies must keep exactly that: equal digests only for equal values, and every disagreement a
note naming the quantity, the parameter and both ranks. (That nothing changes when ranks agree is
``test_capture_coalesced.py``: the coalesced trajectory, notes included, equals the reference one.)
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from harness.rank import capture
from harness.rank.capture import MuonCall, calls_by_param, share_calls_once, value_digest

VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64),
                   st.sampled_from([0.0, -0.0, float("nan"), -float("nan")]))
ARRAYS = hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=2, max_side=4), elements=VALUES)


def _same(a, b) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


@given(ARRAYS, st.data())
def test_digest_is_equal_exactly_when_the_values_are(a, data):
    # b: a with some zeros' signs flipped, some NaN payloads changed, maybe one element changed or a reshape
    b = a.copy()
    flat = b.reshape(-1)
    for i in range(flat.size):
        if flat[i] == 0 and data.draw(st.booleans()):
            flat[i] = -flat[i]
        elif np.isnan(flat[i]) and data.draw(st.booleans()):
            flat[i] = np.frombuffer(np.uint64(0x7FF8000000000ABC).tobytes(), dtype=np.float64)[0]
    if data.draw(st.booleans()):
        flat[data.draw(st.integers(0, flat.size - 1))] = data.draw(VALUES)
    if data.draw(st.booleans()) and a.ndim == 1:
        b = b.reshape(1, -1)
    assert (value_digest(a) == value_digest(b)) == _same(a, b)


def _call(name, g, u, m):
    return MuonCall(name, np.array(g, float), "float32", np.array(u, float), np.array(m, float), "float32", True)


def _share(monkeypatch, per_rank: list[list[MuonCall]], model_parallel: int = 1) -> list[dict]:
    """Run ``share_calls_once`` as each rank would (the all-gather answered from ``per_rank``) and
    return the one-step dicts rank 0 would gather."""
    names = [[[c.name for c in calls]] for calls in per_rank]
    monkeypatch.setattr(capture.tdist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), names))
    gathered = []
    for r, calls in enumerate(per_rank):
        pending = [{"rank": r, "calls": calls}]
        share_calls_once(pending, r, len(per_rank), model_parallel)
        gathered.append(pending[0])
    return gathered


def test_only_the_lowest_rank_ships_values_and_agreeing_copies_leave_no_note(monkeypatch):
    per_rank = [[_call("w", [1.0, -0.0], [0.5, 0.5], [2.0, 0.0])],
                [_call("w", [1.0, 0.0], [0.5, 0.5], [2.0, -0.0]), _call("w", [1.0, 0.0], [0.5, 0.5], [2.0, 0.0])]]
    gathered = _share(monkeypatch, per_rank)
    assert gathered[0]["calls"][0].grad is not None
    assert all(c.grad is None and c.update is None and c.momentum is None for c in gathered[1]["calls"])
    by_param, notes = calls_by_param(gathered, step=3)
    assert by_param["w"][0][1].update is not None
    assert notes == ["step 3: muon_update ran 3 times for w (ranks [0, 1, 1])"]


@pytest.mark.parametrize("which", ["grad", "update", "momentum"])
def test_a_copy_that_differs_in_one_element_is_a_note_naming_it(monkeypatch, which):
    base = {"grad": [1.0, 2.0], "update": [0.5, 0.5], "momentum": [2.0, 0.0]}
    other = {**base, which: [1.0, np.nextafter(2.0, 3.0)] if which == "grad" else [0.5, 0.25]}
    gathered = _share(monkeypatch, [[_call("w", *base.values())], [], [_call("w", *other.values())]])
    assert gathered[2]["calls"][0].update is None  # compared by digest, not shipped
    _, notes = calls_by_param(gathered, step=2)
    assert notes == [f"step 2: muon_update {which} of w differs between rank 0 and rank 2"]


def test_with_model_parallelism_each_replica_keeps_its_own_values(monkeypatch):
    # ranks 0, 2 are replica 0 and ranks 1, 3 replica 1 (records assembled from gathered[k::2])
    per_rank = [[_call("w", [1.0], [1.0], [1.0])] for _ in range(4)]
    gathered = _share(monkeypatch, per_rank, model_parallel=2)
    assert [c.grad is not None for g in gathered for c in g["calls"]] == [True, True, False, False]


def test_a_call_made_once_is_shipped_whole_and_not_hashed(monkeypatch):
    # without offload each matrix has one owner: nothing to agree with, so no digest work on that path
    gathered = _share(monkeypatch, [[_call("a", [1.0], [1.0], [1.0])], [_call("b", [2.0], [2.0], [2.0])]])
    assert all(c.digest is None and c.grad is not None for g in gathered for c in g["calls"])
    _, notes = calls_by_param(gathered, step=1)
    assert notes == []
