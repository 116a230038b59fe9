"""Rank-side probes: pool entries (``entry="harness.rank.probes:NAME"``) that run a case as
``harness.rank.ds_run`` does and add an observation the trajectory does not carry.

A module of their own because they import ``harness.rank.ds_run``, which imports ``harness.rank.patches``:
kept in ``patches`` they closed an import cycle.
"""
from __future__ import annotations

from harness.case.spec import Case
import os
from pathlib import Path
import torch.distributed as tdist
import gc


def run_case_listing_swap_files(case: Case, rank: int, world_size: int, workdir):
    """Run the case as ``harness.rank.ds_run`` does (the engine is destroyed at its end), then, once every
    rank is done, list the NVMe swap files left under the case's folder into the trajectory's notes
    (``"swap files after destroy: [...]"``): what DSM-011 leaves behind."""


    from harness.rank.ds_run import run_case_on_rank  # late: keeps this module numpy-free at import

    traj = run_case_on_rank(case, rank, world_size, workdir)
    tdist.barrier()
    if rank == 0:
        left = sorted(str(p.relative_to(workdir)) + f" ({os.path.getsize(p)} bytes)"
                      for p in Path(workdir).rglob("*.swp"))
        traj.notes.append("swap files after destroy: " + repr(left))
    tdist.barrier()
    return traj


def run_case_counting_survivors(case: Case, rank: int, world_size: int, workdir):
    """Run the case as ``harness.rank.ds_run`` does, then count the DeepSpeed engines and harness models
    still alive (``"engines+models alive after the case: N"`` in the notes). Anything alive now would
    be frozen, never collected, by the next case's ``gc.freeze()``: the runner must release it all."""

    from deepspeed.runtime.engine import DeepSpeedEngine  # late: DeepSpeed, rank side

    from harness.rank.ds_run import run_case_on_rank  # late: keeps this module numpy-free at import
    from harness.case.synthetic import SyntheticModel  # late: keeps this module numpy-free at import

    traj = run_case_on_rank(case, rank, world_size, workdir)
    alive = sum(isinstance(o, (DeepSpeedEngine, SyntheticModel)) for o in gc.get_objects())
    if traj is not None:
        traj.notes.append(f"engines+models alive after the case: {alive}")
    return traj
