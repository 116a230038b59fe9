"""Speed targets, measured in one run (not by timed tests): ``python -m harness bench``.

``python -m harness bench --gate [--full]`` instead runs the gate's cases once and prints seconds per
case-column by group and where they go; it also refreshes ``data/case_times.json``, the recorded
costs that ``--shard K/N`` balances on.

Prints, for the same tiny cases at one world size:
* seconds per case on a reused pool vs. spawning fresh ranks per case (target: pool >= 5x faster);
* the harness's overhead over a bare DeepSpeed run of the same config: the parent-observed time of a
  captured case on the pool vs. the in-rank time of ``deepspeed.initialize`` + the same steps with no
  capture at all (target: <= 1.3x).
"""
from __future__ import annotations

import contextlib
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.case.spec import Case
from harness.launch.pool import DEFAULT_ENTRY, PoolManager, RankPool
from harness.case.scenarios import pipeline_case
from harness.catalog.matrix import group_of
from harness.catalog.matrix import gate_cases
from harness.launch import shard as sharding


def bare_run_on_rank(case: Case, rank: int, world_size: int, workdir: Path) -> float:
    """The same engine and steps as ``ds_run.run_case_on_rank`` with no capture; returns seconds."""
    from harness.rank import ds_run  # late: keeps this module numpy-free at import
    from harness.case import synthetic  # late: keeps this module numpy-free at import

    t0 = time.perf_counter()
    state = ds_run.ProcessState()
    ds_run._seed_everything(case.seed)
    engine, _ = ds_run.build_engine(case, workdir / "nvme")
    try:
        for step in range(1, case.steps + 1):
            for micro in range(engine.gradient_accumulation_steps()):
                loss = engine(synthetic.batch_data(case, rank, step, micro))
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
            bare.append(max(manager.run(case, "harness.cli.bench:bare_run_on_rank").rank_seconds))
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


# ------------------------------------------------------------------------------------ the gate's cost

_RANK_SECONDS = re.compile(r"seconds: build ([0-9.]+), steps\+capture ([0-9.]+)")


class _TimedManager(PoolManager):
    """The gate's pool manager, with the rank start-up of each case timed apart from the case."""

    last_start = 0.0

    def run(self, case: Case, entry: str = DEFAULT_ENTRY):
        key = (case.world_size, case.compiled)
        pool = self.pools.get(key)
        self.last_start = 0.0
        if pool is None or pool.broken:
            t0 = time.perf_counter()
            self.pools[key] = RankPool(case.world_size, compiled=case.compiled, root=self.root)
            self.last_start = time.perf_counter() - t0
        return super().run(case, entry)


BUCKETS = ("rank start", "engine build", "steps+capture", "shipping", "judge")


@contextlib.contextmanager
def _timed_judge():
    """Time ``verdict.judge`` inside ``evaluate``: yields the list each call's seconds are appended to."""
    import harness.gate.decide as gate_mod  # late: keeps this module numpy-free at import

    judged: list[float] = []
    real_judge = gate_mod.judge

    def timed_judge(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_judge(*a, **k)
        finally:
            judged.append(time.perf_counter() - t0)

    gate_mod.judge = timed_judge
    try:
        yield judged
    finally:
        gate_mod.judge = real_judge


@dataclass
class _GateTimes:
    """Seconds per group and bucket, case-columns per group, and the seconds of each case (over its columns)."""

    per_group: dict = field(default_factory=dict)
    count: dict = field(default_factory=dict)
    per_case: dict = field(default_factory=dict)

    def add(self, case_name: str, group: str, total: float, start: float, trajectory, judge: float) -> None:
        b = self.per_group.setdefault(group, dict.fromkeys(BUCKETS, 0.0))
        self.count[group] = self.count.get(group, 0) + 1
        self.per_case[case_name] = self.per_case.get(case_name, 0.0) + total - start
        build = steps = 0.0
        for note in getattr(trajectory, "notes", []) or []:
            m = _RANK_SECONDS.search(note)
            if m:
                build, steps = float(m.group(1)), float(m.group(2))
        b["rank start"] += start
        b["engine build"] += build
        b["steps+capture"] += steps
        b["judge"] += judge
        b["shipping"] += max(total - start - build - steps - judge, 0.0)

    def print_table(self) -> None:
        n = sum(self.count.values())
        print(f"  {'group':10s} {'n':>5s} {'s/case-col':>10s} " + " ".join(f"{b:>13s}" for b in BUCKETS))
        for g in sorted(self.per_group, key=lambda k: -sum(self.per_group[k].values())):
            tot = sum(self.per_group[g].values())
            print(f"  {g:10s} {self.count[g]:5d} {tot / self.count[g]:10.3f} "
                  + " ".join(f"{self.per_group[g][b]:12.1f}s" for b in BUCKETS))
        sums = {b: sum(self.per_group[g][b] for g in self.per_group) for b in BUCKETS}
        print(f"  {'all':10s} {n:5d} {sum(sums.values()) / max(n, 1):10.3f} "
              + " ".join(f"{sums[b]:12.1f}s" for b in BUCKETS))


def _time_gate(cases, cols, store) -> _GateTimes:
    """Every case on every column in the gate's order (``harness.cli.main_job``: a case's columns back to back)."""
    from harness.gate.decide import evaluate, record  # late: keeps this module numpy-free at import

    times = _GateTimes()
    manager = _TimedManager()
    t_all = time.perf_counter()
    done = 0
    try:
        with _timed_judge() as judged:
            for case in cases:
                for col in cols:
                    judged.clear()
                    t0 = time.perf_counter()
                    o = evaluate(case, col, manager)
                    total = time.perf_counter() - t0
                    record(store, o)
                    times.add(case.name, group_of(case.name), total, manager.last_start, o.trajectory, sum(judged))
                    o.trajectory = None  # keep the parent flat
                    done += 1
                    if done % 100 == 0:  # a long --full bench says it is alive (and how fast) as it goes
                        print(f"  ... {done}/{len(cases) * len(cols)} case-columns in "
                              f"{time.perf_counter() - t_all:.0f}s", flush=True)
    finally:
        manager.close()
    return times


def gate_bench(full: bool = False, only: str | None = None, write_times: bool = True) -> int:
    """Run the gate's cases on both columns, once, and print where the time goes per group.

    Buckets: ``rank start`` (spawning a pool: once per world size, and per compiled case),
    ``engine build`` and ``steps+capture`` (in rank 0, from the trajectory's own timing notes),
    ``shipping`` (the rest of the parent-observed run: pickling the trajectory, rendezvous waits),
    ``judge`` (oracle replay + comparison), ``report`` (rendering the HTML once at the end).
    """
    from harness.gate.decide import columns  # late: keeps this module numpy-free at import
    from harness.report.build import render  # late: keeps this module numpy-free at import
    from harness.report.results import ResultStore  # late: keeps this module numpy-free at import

    cases = [c for c in gate_cases(full) if not only or only in c.name]
    cols = columns()
    tmp = Path(tempfile.mkdtemp(prefix="gate-bench-"))
    store = ResultStore(tmp / "results", writer="bench")
    t_all = time.perf_counter()
    times = _time_gate(cases, cols, store)
    t_report = time.perf_counter()
    render(tmp / "results", tmp / "bench.html")
    report_s = time.perf_counter() - t_report
    wall = time.perf_counter() - t_all
    print(f"bench --gate: {len(cases)} cases x {len(cols)} column(s) = {sum(times.count.values())} case-columns"
          f"{' (--full)' if full else ' (CI subset)'} in {wall:.1f}s wall")
    times.print_table()
    print(f"  report: {report_s:.1f}s ({(tmp / 'bench.html').stat().st_size / 1e6:.1f} MB)")
    if write_times and not only:
        sharding.write_times(times.per_case, "python -m harness bench --gate" + (" --full" if full else ""))
        print(f"  recorded per-case seconds for sharding in {sharding.TIMES_PATH}")
    return 0


def times_from_results(results_dir: Path, command: str, path: Path | None = None) -> int:
    """Refresh ``data/case_times.json`` from a gate run's stored outcomes (its results folder, or
    its shards' folders merged), instead of running every case again: each outcome carries the
    seconds its case took, summed here over the columns as ``gate_bench`` does. Prints the split
    per path group; the buckets inside a case need ``--gate``."""
    from harness.report.html import MAIN_COLUMNS  # late: keeps this module numpy-free at import
    from harness.report.results import load_records  # late: keeps this module numpy-free at import

    records = [r for r in load_records(results_dir) if r.column in MAIN_COLUMNS]
    if not records:
        print(f"error: no gate outcomes stored under {results_dir}")
        return 2
    per_case: dict[str, float] = {}
    per_group: dict[str, list] = {}
    for r in records:
        per_case[r.case_name] = per_case.get(r.case_name, 0.0) + r.seconds
        g = per_group.setdefault(group_of(r.case_name), [0, 0.0])
        g[0] += 1
        g[1] += r.seconds
    total = sum(s for _, s in per_group.values())
    print(f"{len(records)} case-columns of {len(per_case)} cases, {total:.0f} s of case time")
    print(f"  {'group':10s} {'n':>5s} {'s/case-col':>10s} {'seconds':>9s} {'share':>6s}")
    for g, (n, sec) in sorted(per_group.items(), key=lambda kv: -kv[1][1]):
        print(f"  {g:10s} {n:5d} {sec / n:10.2f} {sec:9.0f} {sec / total:6.1%}")
    sharding.write_times(per_case, command, path or sharding.TIMES_PATH)
    print(f"  recorded per-case seconds for sharding in {path or sharding.TIMES_PATH}")
    return 0
