"""Speed targets, measured in one run (not by timed tests): ``python -m harness bench``.

``python -m harness bench --gate [--full]`` instead runs the gate's cases once and prints seconds per
case-column by group and where they go; it also refreshes ``data/case_times.json``, the recorded
costs that ``--shard K/N`` balances on.

Prints, for the same tiny cases at one world size, the pool's seconds per case against:

* a fresh interpreter per case, the way DeepSpeed's own unit tests (``DistributedTest``) run a test:
  a new ``python`` per rank that imports torch and DeepSpeed, joins the process group (``env://``),
  builds the engine and runs the case, then exits. This is the alternative a user has without the
  pool. Target: the pool at least ``FRESH_TARGET`` times faster.
* a bare DeepSpeed run of the same config in warm ranks: ``deepspeed.initialize`` and the same steps
  with no capture, timed in the rank (the floor any harness pays). Target: the pool's
  parent-observed time at most ``BARE_TARGET`` times that. Both are medians over ``WARM_REPEATS``
  alternated runs per case; the two below are one run per case (their cost dwarfs the noise).
* a forked rank pool per case (fork from this parent, which has torch and DeepSpeed imported): no
  target, shown because it was the earlier baseline and says what the rendezvous alone costs.

Each fresh-interpreter rank is ``python -m harness.launch.torchrun`` (the torchrun mode's rank side)
started directly with ``RANK``/``WORLD_SIZE``/``MASTER_PORT`` set, without torchrun's agent, so the
case runs exactly as on the pool (``harness.rank.ds_run.run_case_on_rank``).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.case.spec import Case
from harness.env import buildenv
from harness.launch.pool import DEFAULT_ENTRY, PoolManager, RankPool
from harness.launch.torchrun import ENTRY_MODULE, PARENT_PID_VAR, launch_env, write_case_file
from harness.case.scenarios import pipeline_case
from harness.catalog.matrix import group_of
from harness.catalog.matrix import gate_cases
from harness.cli.parser import BENCH_BARE_TARGET, BENCH_CASES, BENCH_FRESH_TARGET, BENCH_QUICK_CASES
from harness.launch import shard as sharding

FRESH_TARGET, BARE_TARGET = BENCH_FRESH_TARGET, BENCH_BARE_TARGET
FRESH_TIMEOUT_S = 300.0
WARM_REPEATS = 6  # pool and bare runs per case (a few tenths of a second each), alternated


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


@dataclass(frozen=True)
class Figures:
    """Mean seconds per case of each way of running the same cases."""

    pool: float
    fresh: float  # a fresh interpreter per rank and case (DistributedTest)
    bare: float  # bare DeepSpeed in warm ranks, in-rank time
    forked: float  # a forked rank pool per case

    @property
    def fresh_ratio(self) -> float:
        """Rounded as printed, so the verdict and the printed ratio cannot disagree at a target's edge."""
        return round(self.fresh / self.pool, 1)

    @property
    def bare_ratio(self) -> float:
        return round(self.pool / self.bare, 2)

    def missed(self) -> list[str]:
        """One line per target the figures miss (none: every target met)."""
        out = []
        if self.fresh_ratio < FRESH_TARGET:
            out.append(f"pool only {self.fresh_ratio:.1f}x faster than a fresh interpreter per case "
                       f"(target >= {FRESH_TARGET:g}x)")
        if self.bare_ratio > BARE_TARGET:
            out.append(f"pool {self.bare_ratio:.2f}x a bare DeepSpeed run (target <= {BARE_TARGET:g}x)")
        return out

    def lines(self) -> list[str]:
        return [f"  pool:                    {self.pool:7.3f} s/case",
                f"  fresh interpreter/case:  {self.fresh:7.3f} s/case (DistributedTest style: new python per rank, "
                "imports, env:// rendezvous, engine, steps)",
                f"  bare DeepSpeed:          {self.bare:7.3f} s/case (warm ranks, in-rank, no capture, no shipping)",
                f"  forked pool per case:    {self.forked:7.3f} s/case (fork of this parent, torch already imported)",
                f"  pool vs fresh interpreter: {self.fresh_ratio:6.1f}x faster   (target >= {FRESH_TARGET:g}x)",
                f"  pool vs bare DeepSpeed:    {self.bare_ratio:6.2f}x the time  (target <= {BARE_TARGET:g}x)",
                f"  pool vs forked pool/case:  {self.forked / self.pool:6.1f}x faster   (no target)"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_interpreter_run(case: Case, root: Path) -> float:
    """Wall seconds of one case run as DeepSpeed's unit tests run one: a new interpreter per rank
    (imports, rendezvous, engine, steps, exit). Raises when a rank fails: a figure from a run that
    did not finish would flatter the pool."""
    run_dir = Path(tempfile.mkdtemp(prefix="fresh-", dir=root))
    case_file = write_case_file(run_dir / "case.json", case)
    out, logs = run_dir / "result.pkl", run_dir / "logs"
    env = dict(os.environ, **launch_env("cpu"), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(case.world_size), **{PARENT_PID_VAR: str(os.getpid())})
    env["PYTHONPATH"] = os.pathsep.join([str(buildenv.PROJECT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                        else []))
    cmd = [sys.executable, "-m", ENTRY_MODULE, "--case-file", str(case_file), "--out", str(out),
           "--accelerator", "cpu", "--log-dir", str(logs), "--workdir", str(run_dir / "work")]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, cwd=str(buildenv.PROJECT_ROOT), env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
             for r in range(case.world_size)]
    try:
        codes = [p.wait(timeout=FRESH_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    seconds = time.perf_counter() - t0
    if any(codes) or not out.exists():
        tail = "".join((logs / f"rank{r}.log").read_text()[-2000:] for r in range(case.world_size)
                       if (logs / f"rank{r}.log").exists())
        raise RuntimeError(f"bench: fresh-interpreter run of {case.name} failed (exit codes {codes}):\n{tail}")
    return seconds


def forked_pool_run(case: Case) -> float:
    t0 = time.perf_counter()
    pool = RankPool(case.world_size)
    try:
        pool.run(case)
    finally:
        pool.close()
    return time.perf_counter() - t0


def _pool_and_bare(todo: list[Case]) -> tuple[list[float], list[float], list[float]]:
    """Per case, the median over ``WARM_REPEATS`` of (parent-observed pool seconds, the in-rank seconds of
    the same, bare DeepSpeed in-rank seconds). Repeated and alternated (pool first, then bare first):
    a tenth of a second on loaded cores is mostly noise, and whichever runs second would find the
    caches warmer."""
    manager = PoolManager()
    pooled: dict[int, list] = {i: [] for i in range(len(todo))}
    in_rank: dict[int, list] = {i: [] for i in range(len(todo))}
    bare: dict[int, list] = {i: [] for i in range(len(todo))}

    def timed_pool(i, case):
        t0 = time.perf_counter()
        out = manager.run(case)
        pooled[i].append(time.perf_counter() - t0)
        in_rank[i].append(max(out.rank_seconds))

    def timed_bare(i, case):
        bare[i].append(max(manager.run(case, "harness.cli.bench:bare_run_on_rank").rank_seconds))

    try:
        for case in todo:  # start-up and each config's first-use costs (lazy imports, op loads) are paid
            manager.run(case)  # once per pool, not per case
        for rep in range(WARM_REPEATS):
            for i, case in enumerate(todo):
                for run in ((timed_pool, timed_bare) if rep % 2 == 0 else (timed_bare, timed_pool)):
                    run(i, case)
    finally:
        manager.close()
    med = statistics.median
    return ([med(pooled[i]) for i in pooled], [med(in_rank[i]) for i in in_rank], [med(bare[i]) for i in bare])


def main(cases: int = BENCH_CASES, world_size: int = 2, quick: bool = False) -> int:
    todo = bench_cases(BENCH_QUICK_CASES if quick else cases, world_size)
    print(f"bench: {len(todo)} case(s) (ZeRO {'/'.join(str(c.stage) for c in todo)}, 3 steps), world size "
          f"{world_size}, on {os.cpu_count()} CPUs", flush=True)
    t_all = time.perf_counter()
    pooled, in_rank, bare = _pool_and_bare(todo)
    forked = [forked_pool_run(case) for case in todo]
    with tempfile.TemporaryDirectory(prefix="bench-fresh-") as root:
        fresh = [fresh_interpreter_run(case, Path(root)) for case in todo]
    fig = Figures(pool=statistics.mean(pooled), fresh=statistics.mean(fresh), bare=statistics.mean(bare),
                  forked=statistics.mean(forked))
    print("\n".join(fig.lines()))
    print(f"  (of the pool's time, {statistics.mean(in_rank):.3f} s/case is in-rank run + capture; "
          f"bench took {time.perf_counter() - t_all:.0f} s)")
    missed = fig.missed()
    for line in missed:
        print(f"  TARGET MISSED: {line}")
    if not missed:
        print("  verdict: targets met")
    return 1 if missed else 0


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
    checks: dict[str, float] = {}
    for extra in sorted(Path(results_dir).glob("extra-*.json")):
        checks.update(json.loads(extra.read_text()).get("selfcheck_seconds", {}))
    if checks:
        print("  self-checks: " + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(checks.items())))
    sharding.write_times(per_case, command, path or sharding.TIMES_PATH, selfchecks=checks)
    print(f"  recorded per-case seconds for sharding in {path or sharding.TIMES_PATH}")
    return 0
