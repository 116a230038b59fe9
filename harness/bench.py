"""Speed targets, measured in one run (not by timed tests): ``python -m harness bench``.

Prints, for the same tiny cases at one world size:
* seconds per case on a reused pool vs. spawning fresh ranks per case (target: pool >= 5x faster);
* the harness's overhead over a bare DeepSpeed run of the same config: the parent-observed time of a
  captured case on the pool vs. the in-rank time of ``deepspeed.initialize`` + the same steps with no
  capture at all (target: <= 1.3x).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from harness.case import Case
from harness.pool import PoolManager, RankPool
from harness.scenarios import pipeline_case


def bare_run_on_rank(case: Case, rank: int, world_size: int, workdir: Path) -> float:
    """The same engine and steps as ``ds_run.run_case_on_rank`` with no capture; returns seconds."""
    from harness import ds_run
    from harness import model as model_mod

    t0 = time.perf_counter()
    state = ds_run.ProcessState()
    ds_run._seed_everything(case.seed)
    engine, _ = ds_run.build_engine(case, workdir / "nvme")
    try:
        for step in range(1, case.steps + 1):
            for micro in range(engine.gradient_accumulation_steps()):
                loss = engine(model_mod.batch_data(case, rank, step, micro))
                engine.backward(loss)
                engine.step()
    finally:
        ds_run.destroy_engine(engine)
        state.restore()
    return time.perf_counter() - t0


def bench_cases(n: int, world_size: int) -> list[Case]:
    combos = [(1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (2, "cpu"), (3, "cpu")]
    out = []
    for i in range(n):
        stage, offload = combos[i % len(combos)]
        out.append(pipeline_case(stage, offload, world_size=world_size, steps=3, seed=i))
    return out


def main(cases: int = 6, world_size: int = 2) -> int:
    todo = bench_cases(cases, world_size)
    print(f"bench: {len(todo)} cases (ZeRO 1/2/3 x offload none/cpu, 3 steps), world size {world_size}")

    manager = PoolManager()
    try:
        manager.run(todo[0])  # pool start-up and first-use costs are not per-case costs
        pooled, in_rank, bare = [], [], []
        for case in todo:
            t0 = time.perf_counter()
            out = manager.run(case)
            pooled.append(time.perf_counter() - t0)
            in_rank.append(max(out.rank_seconds))
            bare.append(max(manager.run(case, "harness.bench:bare_run_on_rank").rank_seconds))
    finally:
        manager.close()

    spawned = []
    for case in todo:
        t0 = time.perf_counter()
        pool = RankPool(world_size)
        try:
            pool.run(case)
        finally:
            pool.close()
        spawned.append(time.perf_counter() - t0)

    p, s, b = statistics.mean(pooled), statistics.mean(spawned), statistics.mean(bare)
    print(f"  pool:           {p:7.3f} s/case")
    print(f"  spawn per case: {s:7.3f} s/case")
    print(f"  bare DeepSpeed: {b:7.3f} s/case (in-rank, no capture, no shipping)")
    print(f"  (of the pool's time, {statistics.mean(in_rank):.3f} s/case is in-rank run + capture)")
    print(f"  pool speed-up over spawn-per-case: {s / p:5.1f}x   (target >= 5x)")
    print(f"  harness overhead over bare run:    {p / b:5.2f}x   (target <= 1.3x)")
    ok = s / p >= 5 and p / b <= 1.3
    print("  verdict:", "targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1
