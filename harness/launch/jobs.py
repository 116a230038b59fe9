"""``python -m harness gate --jobs N``: the gate as N local shards run side by side, one report.

Why it looks the way it does: a gate case spends most of its time in one process at a time. The
ranks run the steps while the parent waits; then the parent replays the float64 oracle while the
ranks wait (the judge is ~60% of a synthetic case and ~80% of a real-model case). One gate
therefore keeps about one core busy, whatever the machine has. Running the gate's cost-balanced
shards (``harness.launch.shard``) as N processes overlaps one shard's judge with another's ranks.
Processes, not threads: the judge is Python-heavy and would serialise on the GIL.

Each shard is the ordinary ``gate --shard K/N`` command (its own rank pools, its own results
folder, the patched mutation self-check on shard 1 and the stock one on shard 2), so a local run
and N CI machines split the same way, and the merge is the same ``harness.launch.shard.merge_results``
that ``python -m harness report`` uses. The shards' folders are removed once merged; the parent is
killed cleanly: it terminates its shards, whose ranks die with them (``harness.launch.pool``).
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from harness.launch.shard import merge_results


def shard_command(k: int, n: int, *, report: Path, full: bool, seed: int, only: str | None, quiet: bool,
                  mutate: bool) -> list[str]:
    cmd = [sys.executable, "-m", "harness", "gate", "--shard", f"{k}/{n}", "--report", str(report),
           "--seed", str(seed), "--no-report"]
    if full:
        cmd.append("--full")
    if only:
        cmd += ["--only", only]
    if quiet:
        cmd.append("--quiet")
    if not mutate:
        cmd.append("--no-mutate")
    return cmd


def run_shards(n: int, report_path: Path, results_dir: Path, *, full: bool, seed: int, only: str | None,
               quiet: bool, mutate: bool) -> tuple[list[int], float]:
    """Run shards 1..n of the gate at once; merge their results into ``results_dir``.

    Returns the shards' exit codes and the wall seconds. Their output goes to this process's
    stdout as it comes (each progress line names its case and column)."""

    work = report_path.parent / f"{report_path.stem}-shards"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    reports = [work / f"shard{k}.html" for k in range(1, n + 1)]
    procs: list[subprocess.Popen] = []
    t0 = time.perf_counter()
    try:
        for k, rep in enumerate(reports, start=1):
            procs.append(subprocess.Popen(shard_command(k, n, report=rep, full=full, seed=seed, only=only,
                                                        quiet=quiet, mutate=mutate)))
        codes = [p.wait() for p in procs]
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    elapsed = time.perf_counter() - t0
    folders = [rep.parent / (rep.stem + "-results") for rep in reports]
    present = [f for f in folders if f.is_dir()]
    merge_results(present, results_dir)
    shutil.rmtree(work, ignore_errors=True)
    return codes + [2] * (len(folders) - len(present)), elapsed
