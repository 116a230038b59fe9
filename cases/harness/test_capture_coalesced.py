"""The coalesced capture (the default: every rank reads only its own fragments/partitions, one object
gather per case) gives exactly the trajectory of the reference capture (one public-helper collective
per parameter and quantity: ``safe_get_full_fp32_param``, ``safe_get_full_grad``,
``safe_get_full_optimizer_state``, ``GatheredParameters``; entry
``harness.rank.ds_run:run_case_on_rank_reference``), bit for bit: every array (bytes, dtype and shape),
every scalar of every step, every step note, and the trajectory notes apart from timings.

What a broken coalesced capture would look like here: a fragment placed at the wrong offset (z1/2: a
matrix straddling the partition boundary), a ZeRO-3 partition concatenated out of rank order or not
cut to ``ds_numel`` (the odd 7x3 matrix pads at W=2), a value read before/after the wrong point of the
step (Adam grads are only valid between backward and step), a dtype the helper would have cast
through (fp16 model weights, fp32 helper buffers), or a shared buffer captured as a view that later
steps overwrite (every step would then show the last step's values).
"""
from __future__ import annotations

import numpy as np
import pytest

from harness.case.spec import Overflow
from harness.case.scenarios import pipeline_case

pytestmark = pytest.mark.pipeline

REFERENCE_ENTRY = "harness.rank.ds_run:run_case_on_rank_reference"

# The required grid: ZeRO 1/2/3 x offload none/cpu, fp32, world size 2.
CORE = [pipeline_case(stage, offload, world_size=2, steps=3, seed=11 + 3 * stage + (offload == "cpu"))
        for stage in (1, 2, 3) for offload in ("none", "cpu")]

# Layouts and dtypes the core grid does not reach.
EXTRA = [
    # fp16: fp16 model weights and grads, loss scale, a skipped step (overflow on rank 1)
    pipeline_case(1, "none", "fp16", world_size=2, steps=3, seed=5, ).replace(overflows=(Overflow(step=2, rank=1),)),
    pipeline_case(2, "cpu", "fp16", world_size=2, steps=3, seed=6),
    pipeline_case(3, "none", "fp16", world_size=2, steps=3, seed=7).replace(overflows=(Overflow(step=2, rank=1),)),
    pipeline_case(3, "cpu", "fp16", world_size=2, steps=3, seed=8),
    # bf16
    pipeline_case(1, "none", "bf16", world_size=2, steps=2, seed=9),
    pipeline_case(3, "cpu", "bf16", world_size=2, steps=2, seed=10),
    # ZeRO-3 params that are not persistent: model weights come from the ds_tensor partitions
    pipeline_case(3, "none", world_size=2, steps=2, seed=12,
                  extra_zero={"stage3_param_persistence_threshold": 0}).replace(name="z3-none-fp32-ws2-nonpersistent"),
    pipeline_case(3, "cpu", "fp16", world_size=2, steps=2, seed=13,
                  extra_zero={"stage3_param_persistence_threshold": 0}).replace(name="z3-cpu-fp16-ws2-nonpersistent"),
    # gradient accumulation, in-memory ZeRO-3 momentum, several sub-groups
    pipeline_case(2, "none", world_size=2, steps=2, seed=14, grad_accum=2),
    pipeline_case(3, "none", world_size=2, steps=2, seed=15, save_muon_momentum_buffer_in_memory=True,
                  sub_group_size=32).replace(name="z3-none-fp32-ws2-inmem-sg32"),
    # NVMe: sub-groups swapped in/out by the local helpers; the big matrix makes each rank's pieces
    # larger than capture.GATHER_CHUNK_BYTES, so the final gather also sends point-to-point
    pipeline_case(3, "nvme", world_size=2, steps=2, seed=18),
    # checkpoint and resume into a fresh engine mid-case
    pipeline_case(2, "cpu", world_size=2, steps=3, seed=16).replace(checkpoint_at=1, name="z2-cpu-fp32-ws2-resume"),
    pipeline_case(3, "none", world_size=2, steps=3, seed=17).replace(checkpoint_at=1, name="z3-none-fp32-ws2-resume"),
]

CASES = CORE + EXTRA

ARRAY_FIELDS = ("master", "model", "grad", "momentum", "update")
SCALAR_FIELDS = ("grad_scale", "momentum_scale", "momentum_dtype", "grad_dtype")
STEP_FIELDS = ("step", "loss_scale", "loss_scale_after", "skipped", "global_norm", "muon_calls",
               "swap_bytes_written", "swap_bytes_read", "losses", "muon_calls_per_rank", "notes")


def _same_array(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _notes(traj) -> list[str]:
    return [n for n in traj.notes if not n.startswith("seconds")]


def compare_trajectories(got, ref) -> list[str]:
    """Every difference between two trajectories of the same case (empty: bit-identical)."""
    diffs = []
    if got.case_name != ref.case_name or got.muon_params != ref.muon_params:
        diffs.append("case name / muon params differ")
    if set(got.initial) != set(ref.initial):
        diffs.append(f"initial: names {sorted(got.initial)} vs {sorted(ref.initial)}")
    for name in ref.initial:
        if not _same_array(got.initial.get(name), ref.initial[name]):
            diffs.append(f"initial/{name} differs")
    if _notes(got) != _notes(ref):
        diffs.append(f"notes differ: {_notes(got)} vs {_notes(ref)}")
    if len(got.steps) != len(ref.steps):
        diffs.append(f"{len(got.steps)} steps vs {len(ref.steps)}")
    for g, r in zip(got.steps, ref.steps):
        for f in STEP_FIELDS:
            if getattr(g, f) != getattr(r, f):
                diffs.append(f"step {r.step} {f}: {getattr(g, f)!r} vs {getattr(r, f)!r}")
        if set(g.params) != set(r.params):
            diffs.append(f"step {r.step}: params {sorted(g.params)} vs {sorted(r.params)}")
            continue
        for name, rp in r.params.items():
            gp = g.params[name]
            for f in ARRAY_FIELDS:
                if not _same_array(getattr(gp, f), getattr(rp, f)):
                    diffs.append(f"step {r.step}/{name}/{f} differs")
            for f in SCALAR_FIELDS:
                if getattr(gp, f) != getattr(rp, f):
                    diffs.append(f"step {r.step}/{name}/{f}: {getattr(gp, f)!r} vs {getattr(rp, f)!r}")
    return diffs


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_coalesced_capture_equals_public_helper_capture(pool_manager, case):
    got = pool_manager.run(case).result
    ref = pool_manager.run(case, REFERENCE_ENTRY).result
    assert got.steps and all(s.params for s in got.steps)
    diffs = compare_trajectories(got, ref)
    assert not diffs, (f"{case.name}: coalesced capture differs from the public-helper capture:\n"
                       + "\n".join(diffs[:40]))


def test_comparison_sees_a_single_flipped_bit(pool_manager):
    """The comparison itself is bit-exact: one ULP in one captured master is a difference."""
    case = CORE[0]
    got = pool_manager.run(case).result
    assert not compare_trajectories(got, got)
    name = next(iter(got.steps[-1].params))
    m = got.steps[-1].params[name].master
    m.view(np.uint64).reshape(-1)[0] ^= np.uint64(1)
    ref = pool_manager.run(case).result
    assert compare_trajectories(got, ref) == [f"step {got.steps[-1].step}/{name}/master differs"]
