"""``Trajectory.judged_bits``: two runs are the same exactly when every bit the judge reads is, whatever
the array's length (the word-wise comparison's tail), and the digest agrees with the comparison."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from harness.case.trajectory import Trajectory


def _run(n: int) -> Trajectory:
    rng = np.random.default_rng(n)
    initial = {"w": rng.standard_normal(n), "half": rng.standard_normal(n).astype(np.float16)}
    return Trajectory(case_name="c", initial=initial, muon_params=("w",))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("array", ["w", "half"])
def test_one_flipped_bit_anywhere_makes_another_run(n, where, array):
    run = _run(n)
    other = copy.deepcopy(run)
    assert run.judged_bits().same(other.judged_bits()) and run.judged_digest() == other.judged_digest()
    a = other.initial[array]
    i = 0 if where == "first" else a.size - 1
    raw = a.view(np.uint16 if a.dtype == np.float16 else np.uint64)
    raw[i] ^= 1
    assert not run.judged_bits().same(other.judged_bits())
    assert run.judged_digest() != other.judged_digest()


def test_signed_zeros_nan_payloads_dtypes_and_replicas_count():
    run = Trajectory(case_name="c", initial={"w": np.array([0.0, np.nan])})
    negzero = Trajectory(case_name="c", initial={"w": np.array([-0.0, np.nan])})
    payload = Trajectory(case_name="c", initial={"w": np.array([0.0, np.nan])})
    payload.initial["w"].view(np.uint64)[1] ^= 1
    f32 = Trajectory(case_name="c", initial={"w": np.array([0.0, np.nan], dtype=np.float32)})
    replica = copy.deepcopy(run)
    replica.replicas = [copy.deepcopy(run)]
    for other in (negzero, payload, f32, replica):
        assert not run.judged_bits().same(other.judged_bits())
        assert not other.judged_bits().same(run.judged_bits())
    same_replica = copy.deepcopy(replica)
    assert replica.judged_bits().same(same_replica.judged_bits())
    same_replica.replicas[0].initial["w"].view(np.uint64)[0] ^= 1
    assert not replica.judged_bits().same(same_replica.judged_bits())


def test_run_level_notes_are_not_judged_bits():
    run = _run(5)
    noted = copy.deepcopy(run)
    noted.notes.append("seconds: build 9.9")
    assert run.judged_bits().same(noted.judged_bits())
