"""The main job: the whole gate over every column (``python -m harness gate``) and the one-case
reproducer (``python -m harness run``), with the mutation self-checks and the report.

Kept apart from ``harness.gate`` (the decision of one case) because the stock kill matrix
(``harness.kill_matrix``) decides its cases with ``gate.evaluate`` while this job runs the kill
matrix: one module doing both would be an import cycle.
"""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

from harness.case import Case
from harness.gate import columns, evaluate, record
from harness.pool import PoolManager


def environment() -> dict:
    import deepspeed
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "cpu": platform.processor() or platform.machine(), "platform": platform.platform()}


def mutation_extra(km, stock_km=None) -> dict:
    """The kill matrix in the report's ``extra`` format; ``stock_km``: the stock-column rows, shown as
    "<mutant> (stock)" over their own cases."""
    from harness import known_bugs

    rows = []
    for matrix, tag in ((km, ""), (stock_km, " (stock)")):
        if matrix is None:
            continue
        for m in matrix.mutants:
            cells = {r.case: r.killed for r in matrix.rows if r.mutant == m}
            rows.append({"mutant": m + tag, "description": known_bugs.MUTANTS[m].description, "killed": cells,
                         "killed_by": matrix.killed_by(m)})
    cases = list(km.cases) + [c for c in (stock_km.cases if stock_km else []) if c not in km.cases]
    return {"mutations": rows, "mutation_cases": cases}


def _render(results_dir: Path, report: Path, extra: dict) -> str | None:
    from harness.report import render

    render(results_dir, report, extra=extra)
    return str(report)


def run_gate(report: str = "reports/gate.html", full: bool = False, seed: int = 0, only: str | None = None,
             quiet: bool = False, mutate: bool = True, shard: str | None = None) -> int:
    from harness import results
    from harness import shard as sharding
    from harness.matrix import gate_cases, group_of

    cases = [c.replace(seed=seed) for c in gate_cases(full) if not only or only in c.name]
    part = sharding.Shard.parse(shard) if shard else None
    if part is not None:
        # Every machine computes the same split; the mutation self-checks run once, on shard 1.
        cases = sharding.select(cases, part)
        mutate = mutate and part.index == 1
        print(f"gate: shard {part}: {len(cases)} cases", flush=True)
    cols = columns()
    from harness import versions

    print(f"gate: {versions.banner()}", flush=True)
    report_path = Path(report)
    results_dir = report_path.parent / (report_path.stem + "-results")
    if results_dir.exists():
        import shutil

        shutil.rmtree(results_dir)
    store = results.ResultStore(results_dir, writer="gate" if part is None else f"gate-shard{part.index}of{part.count}")
    manager = PoolManager()
    counts: dict[str, int] = {}
    group_time: dict[str, tuple[int, float]] = {}  # path group -> (case runs, seconds), both columns
    sweep_runs: dict[str, dict] = {}  # column -> case name -> (status, seconds), for the layout sweep table
    # Only the messages of what went wrong stay in memory: every outcome (verdict, trajectory, error
    # maps) goes to the store on disk and is dropped before the next case, so the parent stays flat
    # however many cases fail.
    bad: list[str] = []
    strengths: list[tuple[str, str | None]] = []
    t0 = time.perf_counter()
    try:
        total = len(cases) * len(cols)
        n = 0
        for col in cols:
            for case in cases:
                n += 1
                o = evaluate(case, col, manager)
                record(store, o)
                counts[o.status] = counts.get(o.status, 0) + 1
                n_g, s_g = group_time.get(group_of(case.name), (0, 0.0))
                group_time[group_of(case.name)] = (n_g + 1, s_g + o.seconds)
                tag = o.status + (f" [{', '.join(o.bug_ids)}]" if o.bug_ids else "")
                sweep_runs.setdefault(col, {})[case.name] = (tag, o.seconds)
                strengths.append((o.column, o.strength))
                if o.status in ("failed", "error", "xpassed"):
                    bad.append(o.message)
                if not quiet:
                    ids = f" [{', '.join(o.bug_ids)}]" if o.bug_ids and o.status == "xfailed" else ""
                    print(f"[{n}/{total}] {col:7s} {case.name:55s} {o.status.upper()}{ids} ({o.seconds:.1f}s)",
                          flush=True)
                del o
        km = skm = None
        if mutate and not only:
            from harness.kill_matrix import default_kill_cases, kill_matrix, stock_kill_cases, stock_kill_matrix

            print("\nmutation self-check (patched runtime, every catalogued mutant):", flush=True)
            km = kill_matrix(default_kill_cases(), manager=manager)
            print(km.table(), flush=True)
            if km.kill_rate < 1.0 or km.surprises() or not all(km.baseline.values()):
                counts["mutation-check-failed"] = 1
            print("\nmutation self-check (STOCK DeepSpeed, gate decision: bug-affected cases must still fail):",
                  flush=True)
            skm = stock_kill_matrix([c.replace(seed=seed) for c in stock_kill_cases()], manager=manager)
            print(skm.table(), flush=True)
            if skm.kill_rate < 1.0 or skm.surprises() or not all(skm.baseline.values()):
                counts["mutation-check-failed"] = 1
    finally:
        manager.close()
    elapsed = time.perf_counter() - t0
    from harness import sweep

    for col, runs in sweep_runs.items():
        table = sweep.gate_summary(col, runs)
        if table:
            print(table, flush=True)
    env = environment()
    env["seed"] = seed
    from harness.results import strength_line, strength_summary

    strength = strength_summary(strengths)
    extra = {"environment": env, "elapsed_s": elapsed}
    if km is not None:
        extra.update(mutation_extra(km, skm))
    if part is not None:
        # Stored with the results so that merging the shards' folders keeps the kill matrices.
        from harness.report import save_extra

        save_extra(results_dir, extra, name=f"shard{part.index}of{part.count}")
    rendered = _render(results_dir, report_path, extra)
    print(f"\ngate: {len(cases)} cases x {len(cols)} column(s) in {elapsed:.0f}s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    print(strength_line(strength))
    print("time per group (case runs over all columns, seconds): " + ", ".join(
        f"{g} {n}/{sec:.0f}s" for g, (n, sec) in sorted(group_time.items(), key=lambda kv: -kv[1][1])))
    for message in bad:
        print("\n" + message)
    print(f"results: {results_dir}" + (f"\nreport: {rendered}" if rendered else ""))
    return 1 if bad or "mutation-check-failed" in counts else 0


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
