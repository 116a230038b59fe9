"""The main job: the whole gate over every column (``python -m harness gate``) and the one-case
reproducer (``python -m harness run``), with the mutation self-checks and the report.

Kept apart from ``harness.gate.decide`` (the decision of one case) because the stock kill matrix
(``harness.selfcheck.kill_matrix``) decides its cases with ``gate.evaluate`` while this job runs the kill
matrix: one module doing both would be an import cycle.
"""
from __future__ import annotations

import platform
import shutil
import sys
import time
from pathlib import Path

from harness.case.spec import Case
from harness.gate.decide import columns, evaluate, record
from harness.launch.pool import PoolManager
import torch
from harness.registry import mutants as known_bugs
from harness.report.build import render
from harness.selfcheck.kill_matrix import default_kill_cases, kill_matrix, stock_kill_cases, stock_kill_matrix
from harness.report import results
from harness.catalog import matrix as catalog
from harness.env import versions
from harness.launch import shard as sharding
from collections import Counter
from harness.catalog import sweep
from harness.catalog.matrix import group_of
from harness.report.html import BAD_STATUSES, MAIN_COLUMNS
from harness.report.results import load_records, strength_line, strength_summary
from harness.launch.jobs import run_shards


def environment() -> dict:
    import deepspeed  # late: DeepSpeed, rank side

    return {"python": sys.version.split()[0], "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "cpu": platform.processor() or platform.machine(), "platform": platform.platform()}


def mutation_extra(km, stock_km=None) -> dict:
    """The kill matrices in the report's ``extra`` format (either may be None: a shard ran the other);
    ``stock_km``: the stock-column rows, shown as "<mutant> (stock)" over their own cases."""

    rows = []
    for matrix, tag in ((km, ""), (stock_km, " (stock)")):
        if matrix is None:
            continue
        for m in matrix.mutants:
            cells = {r.case: r.killed for r in matrix.rows if r.mutant == m}
            rows.append({"mutant": m + tag, "description": known_bugs.MUTANTS[m].description, "killed": cells,
                         "killed_by": matrix.killed_by(m)})
    cases: list = []
    for matrix in (km, stock_km):
        cases += [c for c in (matrix.cases if matrix else []) if c not in cases]
    return {"mutations": rows, "mutation_cases": cases}


def _render(results_dir: Path, report: Path, extra: dict) -> str | None:

    render(results_dir, report, extra=extra)
    return str(report)


def _run_cases(cases: list, cols: list[str], manager, store, quiet: bool) -> None:
    """Every case on every column, each outcome to the store on disk and dropped before the next case,
    so the parent stays flat however many cases fail (the summary is read back: ``summary``). A case's
    columns run back to back: where the patched run is bit-identical to the stock one, the patched
    column takes the stock verdict instead of judging again (``gate.judged``)."""
    total = len(cases) * len(cols)
    n = 0
    for case in cases:
        for col in cols:
            n += 1
            o = evaluate(case, col, manager)
            record(store, o)
            if not quiet:
                ids = f" [{', '.join(o.bug_ids)}]" if o.bug_ids and o.status == "xfailed" else ""
                print(f"[{n}/{total}] {col:7s} {case.name:55s} {o.status.upper()}{ids} ({o.seconds:.1f}s)",
                      flush=True)
            del o


def _mutation_checks(manager, seed: int, patched_check: bool, stock_check: bool):
    """The mutation self-checks: (patched kill matrix or None, stock kill matrix or None, whether one failed)."""

    km = skm = None
    failed = False
    if patched_check:
        print("\nmutation self-check (patched runtime, every catalogued mutant):", flush=True)
        km = kill_matrix(default_kill_cases(), manager=manager)
        print(km.table(), flush=True)
        failed |= km.kill_rate < 1.0 or bool(km.surprises()) or not all(km.baseline.values())
    if stock_check:
        print("\nmutation self-check (STOCK DeepSpeed, gate decision: bug-affected cases must still fail):",
              flush=True)
        skm = stock_kill_matrix([c.replace(seed=seed) for c in stock_kill_cases()], manager=manager)
        print(skm.table(), flush=True)
        failed |= skm.kill_rate < 1.0 or bool(skm.surprises()) or not all(skm.baseline.values())
    return km, skm, failed


def _fresh_store(report_path: Path, part):

    results_dir = report_path.parent / (report_path.stem + "-results")
    if results_dir.exists():
        shutil.rmtree(results_dir)
    writer = "gate" if part is None else f"gate-shard{part.index}of{part.count}"
    return results_dir, results.ResultStore(results_dir, writer=writer)


def run_gate(report: str = "reports/gate.html", full: bool = False, seed: int = 0, only: str | None = None,
             quiet: bool = False, mutate: bool = True, shard: str | None = None, jobs: int = 1,
             render_report: bool = True) -> int:

    cases = [c.replace(seed=seed) for c in catalog.gate_cases(full) if not only or only in c.name]
    part = sharding.Shard.parse(shard) if shard else None
    if jobs > 1 and part is None:
        return _run_jobs(jobs, cases, Path(report), full=full, seed=seed, only=only, quiet=quiet, mutate=mutate)
    if part is not None:
        # Every machine computes the same split. Each mutation self-check runs once: the patched one on
        # shard 1, the stock one on shard 2 (shard 1 when there is only one), so that with --jobs 2
        # neither shard idles while the other runs both.
        cases = sharding.select(cases, part)
        print(f"gate: shard {part}: {len(cases)} cases", flush=True)
    cols = columns()
    print(f"gate: {versions.banner()}", flush=True)
    report_path = Path(report)
    results_dir, store = _fresh_store(report_path, part)
    manager = PoolManager()
    t0 = time.perf_counter()
    try:
        _run_cases(cases, cols, manager, store, quiet)
        km, skm, mutation_failed = _mutation_checks(
            manager, seed, patched_check=mutate and not only and (part is None or part.index == 1),
            stock_check=mutate and not only and (part is None or part.index == min(2, part.count)))
    finally:
        manager.close()
    elapsed = time.perf_counter() - t0
    env = environment()
    env["seed"] = seed
    extra = {"environment": env, "elapsed_s": elapsed}
    if km is not None or skm is not None:
        extra.update(mutation_extra(km, skm))
    if part is not None:
        # Stored with the results so that merging the shards' folders keeps the kill matrices.
        from harness.report.build import save_extra

        save_extra(results_dir, extra, name=f"shard{part.index}of{part.count}")
    rendered = _render(results_dir, report_path, extra) if render_report else None
    bad = summary(results_dir, f"gate: {len(cases)} cases x {len(cols)} column(s) in {elapsed:.0f}s")
    if mutation_failed:
        print("the mutation self-check failed (tables above)")
    print(f"results: {results_dir}" + (f"\nreport: {rendered}" if rendered else ""))
    return 1 if bad or mutation_failed else 0


def summary(results_dir: Path, headline: str) -> int:
    """Print the gate's summary from its stored outcomes: the layout sweep tables, the counts, the
    full-strength share, the time per path group and every unexpected outcome's message. One reading
    for a gate run in one process and for its shards merged; returns how many outcomes were bad."""


    records = [r for r in load_records(results_dir) if r.column in MAIN_COLUMNS]
    by_col: dict[str, dict] = {}
    group_time: dict[str, list] = {}
    for r in records:
        tag = r.status + (f" [{', '.join(r.bug_ids)}]" if r.bug_ids else "")
        by_col.setdefault(r.column, {})[r.case_name] = (tag, r.seconds)
        g = group_time.setdefault(group_of(r.case_name), [0, 0.0])
        g[0] += 1
        g[1] += r.seconds
    for col in sorted(by_col, key=MAIN_COLUMNS.index):
        table = sweep.gate_summary(col, by_col[col])
        if table:
            print(table, flush=True)
    counts = Counter(r.status for r in records)
    print(f"\n{headline}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    print(strength_line(strength_summary((r.column, r.strength) for r in records)))
    print("time per group (case runs over all columns, seconds): " + ", ".join(
        f"{g} {n}/{sec:.0f}s" for g, (n, sec) in sorted(group_time.items(), key=lambda kv: -kv[1][1])))
    bad = [r for r in records if r.status in BAD_STATUSES]
    for r in bad:
        print("\n" + r.message)
    return len(bad)


def _run_jobs(jobs: int, cases: list, report_path: Path, *, full: bool, seed: int, only: str | None, quiet: bool,
              mutate: bool) -> int:
    """The gate as ``jobs`` local shards (``harness.launch.jobs``); the summary is read from the merged results."""

    results_dir = report_path.parent / (report_path.stem + "-results")
    print(f"gate: {len(cases)} cases as {jobs} local shards (python -m harness gate --shard K/{jobs})", flush=True)
    codes, elapsed = run_shards(jobs, report_path, results_dir, full=full, seed=seed, only=only, quiet=quiet,
                                mutate=mutate)
    rendered = _render(results_dir, report_path, {"elapsed_s": elapsed})
    bad = summary(results_dir, f"gate (all {jobs} shards merged): {len(cases)} cases in {elapsed:.0f}s wall")
    failed_shards = [f"shard {k}/{jobs} exited with {c}" for k, c in enumerate(codes, start=1) if c != 0]
    for line in failed_shards:  # a shard's own failure (its mutation self-check, a crash) is in its output above
        print(line)
    print(f"results: {results_dir}\nreport: {rendered}")
    return 1 if failed_shards or bad else 0


def run_single(case: Case, report: str | None = None) -> int:
    """The reproducer: rerun exactly one case on every column it can run in; print the verdict."""
    manager = PoolManager()
    worst = 0
    try:
        for col in (["patched"] if case.patched else ["stock"]):
            o = evaluate(case, col, manager)
            print(f"{col}: {o.status.upper()}" + (f" [{', '.join(o.bug_ids)}]" if o.bug_ids else ""))
            print(o.message)
            worst = max(worst, 0 if o.status in ("passed", "xfailed") else 1)
    finally:
        manager.close()
    return worst
