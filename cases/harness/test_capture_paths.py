"""Capture works on every ZeRO path: stage 1/2/3 x offload none/cpu/nvme at world sizes 1 and 2.

Each world size runs all nine pipelines one after another in the same ranks (as the pool does), so
this also shows that a process survives a sequence of cases, including ZeRO-3 ones. What a broken
capture would look like here: a missing or non-finite quantity, a shape that is not the declared one
(a partition or a padded buffer leaking out), a ``muon_calls`` count that does not match the path's
documented count, an NVMe case that never reached the swap folder, or two paths that end a fp32 step
at different weights (a wrongly assembled partition).

The ranks are the suite's rank pool (``pool_manager``), so each world size's nine cases run in the
same two processes.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness.case.spec import Case, ParamShape, ds_config
from harness.case.nvme import MIN_AIO_BYTES, expects_swap, nvme_matrix

pytestmark = pytest.mark.pipeline

# ------------------------------------------------------------------------------------------------
# running


def run_in_order(manager, cases: list[Case]) -> list[tuple]:
    """Run ``cases`` in order on the pool; [(Trajectory, seconds inside rank 0's case)]."""
    out = []
    for case in cases:
        o = manager.run(case)
        out.append((o.result, o.rank_seconds[0]))
    return out


# ------------------------------------------------------------------------------------------------
# the matrix

SMALL = (
    ParamShape("layer0.weight", (6, 5)),
    ParamShape("layer0.bias", (6,)),
    ParamShape("layer1.weight", (7, 3)),  # 21 elements: padded / split across partitions at W=2
    ParamShape("layer1.bias", (7,)),
    ParamShape("row", (1, 9)),
    ParamShape("col", (5, 1)),
)
PIPELINES = [(stage, off) for stage in (1, 2, 3) for off in ("none", "cpu", "nvme")]


def _case(stage: int, offload: str, ws: int) -> Case:
    params = SMALL + ((nvme_matrix(ws),) if offload == "nvme" else ())
    return Case(name=f"cap-z{stage}-{offload}-ws{ws}", params=params, world_size=ws, steps=2, seed=3, batch=4,
                ds_config=ds_config(stage=stage, offload=offload, world_size=ws))


def expected_muon_calls(stage: int, offload: str, ws: int, case: Case) -> list[int] | None:
    """Per rank, the number of muon_update calls per step the path is documented to make
    (harness/rank/capture.py). None where it depends on the partition layout (z1/2 without offload)."""
    n = sum(1 for p in case.params if p.uses_muon)
    if offload != "none":
        return [n] * ws  # every rank orthogonalises every matrix
    if stage == 3:
        return [len(range(r, n, ws)) for r in range(ws)]  # round robin over the sub-group's matrices
    return [n] if ws == 1 else None


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"ws{w}")
def matrix_results(request, pool_manager):
    ws = request.param
    cases = [_case(stage, off, ws) for stage, off in PIPELINES]
    results = run_in_order(pool_manager, cases)
    return ws, cases, results


def test_every_path_captures_everything(matrix_results):
    ws, cases, results = matrix_results
    problems = []
    for case, (traj, _) in zip(cases, results):
        stage, off = case.stage, case.offload
        assert traj is not None and traj.case_name == case.name
        assert set(traj.initial) == {p.name for p in case.params}
        assert set(traj.muon_params) == {p.name for p in case.params if p.uses_muon}
        assert len(traj.steps) == case.steps
        for s in traj.steps:
            where = f"{case.name} step {s.step}"
            assert not s.skipped, where
            assert s.global_norm is not None and math.isfinite(s.global_norm), where
            assert s.loss_scale == s.loss_scale_after == 1.0, where
            assert len(s.losses) == ws * case.grad_accum and all(map(math.isfinite, s.losses)), where
            assert s.notes == [], (where, s.notes)
            exp = expected_muon_calls(stage, off, ws, case)
            assert len(s.muon_calls_per_rank) == ws and sum(s.muon_calls_per_rank) == s.muon_calls, where
            if exp is not None:
                assert s.muon_calls_per_rank == exp, (where, s.muon_calls_per_rank, exp)
            else:
                assert s.muon_calls >= len(traj.muon_params), where
            for p in case.params:
                ps = s.params[p.name]
                muon = p.name in traj.muon_params
                quantities = ["master", "model", "grad"] + (["momentum", "update"] if muon else [])
                for q in quantities:
                    a = getattr(ps, q)
                    if a is None:
                        problems.append(f"{where}: {p.name}.{q} missing")
                    elif a.shape != p.shape:
                        problems.append(f"{where}: {p.name}.{q} shape {a.shape} != {p.shape}")
                    elif not np.isfinite(a).all():
                        problems.append(f"{where}: {p.name}.{q} not finite")
                if muon:
                    assert ps.momentum_dtype, where
                    # offload paths hold Muon grad/momentum in true units, the others x S (S = 1 here)
                    assert ps.grad_scale == ps.momentum_scale == 1.0, where
                # fp32 model: the low-precision weights are the masters
                assert np.array_equal(ps.master, ps.model), (where, p.name)
            if off == "nvme":
                if stage == 3:
                    assert expects_swap(case), case.name
                    assert s.swap_bytes_written > 0 and s.swap_bytes_read > 0, (where, s.swap_bytes_written)
                else:  # stage 1/2 treat nvme as cpu (stage_1_and_2.py:219-224)
                    assert s.swap_bytes_written == s.swap_bytes_read == 0, where
            else:
                assert s.swap_bytes_written == s.swap_bytes_read == 0, where
    assert not problems, "\n".join(problems)


def test_paths_agree_on_fp32_weights(matrix_results):
    """Same model, same data, fp32: every path ends each step at the same weights up to fp32
    round-off (the Muon update is recomputed in 16-bit NS on each path, so allow its noise)."""
    ws, cases, results = matrix_results
    by_off: dict[str, list] = {}
    for case, (traj, _) in zip(cases, results):
        by_off.setdefault(case.offload, []).append((case, traj))
    for group in by_off.values():
        ref_case, ref = group[0]
        for case, traj in group[1:]:
            for s_ref, s in zip(ref.steps, traj.steps):
                for p in ref_case.params:
                    a, b = s_ref.params[p.name].master, s.params[p.name].master
                    step = np.abs(s_ref.params[p.name].master - ref.initial[p.name]).max()
                    assert np.abs(a - b).max() <= 1e-6 + 2e-2 * step, (ref_case.name, case.name, s.step, p.name)


def test_nvme_threshold_matches_deepspeed():
    from deepspeed.runtime.swap_tensor import utils as swap_utils

    assert swap_utils.MIN_AIO_BYTES == MIN_AIO_BYTES
    for ws in (1, 2, 4):
        p = nvme_matrix(ws)
        assert math.ceil(p.numel / ws) * 4 >= MIN_AIO_BYTES
    # a 512x512 matrix is only swapped at W=1: the size, not the shape, decides
    big = (ParamShape("big.weight", (512, 512)),)
    for ws, swapped in ((1, True), (2, False)):
        c = Case(name="t", params=big, world_size=ws, ds_config=ds_config(stage=3, offload="nvme", world_size=ws))
        assert expects_swap(c) is swapped


def test_timings_are_reported(matrix_results, record_property):
    ws, cases, results = matrix_results
    for case, (_, secs) in zip(cases, results):
        record_property(f"seconds/{case.name}", round(secs, 3))
    print({case.name: round(secs, 2) for case, (_, secs) in zip(cases, results)})
