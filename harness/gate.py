"""Run a case end to end and decide its status; run the whole gate (the main job).

The decision is shared by the pytest suite and ``python -m harness gate``, so the two can never
disagree about what passed:

* passed   -- every quantity within tolerance (and an NVMe case really swapped);
* xfailed  -- stock DeepSpeed diverged, and every divergence is explained by a registered bug the
              case triggers (``harness.bugs``); carries the bug ids;
* xpassed  -- a bug was expected and nothing diverged: the registry is stale (a failure);
* failed   -- a divergence no registered bug explains;
* error    -- the case produced no trajectory (a rank raised, died or hung).
"""
from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.bugs import bugs_for, refusals_for
from harness.case import Case
from harness.pool import CaseFailure, PoolManager
from harness.verdict import Verdict, judge, reproduce_command


@dataclass
class Outcome:
    case: Case
    column: str
    status: str
    bug_ids: list[str]
    message: str
    seconds: float
    verdict: Verdict | None = None
    unexplained: list = field(default_factory=list)
    swapped_bytes: int | None = None
    trajectory: object = None
    refused: bool = False  # the patched runtime refused the case, as its fix for a bug says it must


def patched_available() -> bool:
    try:
        from harness import patched_runtime  # noqa: F401
    except ImportError:
        return False
    return True


def columns() -> list[str]:
    return ["stock", "patched"] if patched_available() else ["stock"]


def evaluate(case: Case, column: str, manager: PoolManager) -> Outcome:
    patched = column == "patched"
    c = case.replace(patched=patched)
    bugs = bugs_for(c, patched=patched)
    ids = [b.id for b in bugs]
    explained = set().union(*(b.quantities for b in bugs)) if bugs else set()
    refusals = refusals_for(c) if patched else []
    t0 = time.perf_counter()
    try:
        out = manager.run(c)
    except CaseFailure as exc:
        text = str(exc)
        if refusals and all(b.refused_when_patched in text for b in refusals):
            names = ", ".join(b.id for b in refusals)
            why = next(line.strip() for line in text.splitlines() if refusals[0].refused_when_patched in line)
            return Outcome(c, column, "passed", [], f"{c.name}: refused by the patched runtime as its fix for "
                           f"{names} requires:\n  {why[:400]}", time.perf_counter() - t0, refused=True)
        return Outcome(c, column, "error", ids, text, time.perf_counter() - t0)
    if refusals:
        return Outcome(c, column, "failed", ids,
                       f"{c.name}: the patched runtime should have refused this case "
                       f"({', '.join(b.id for b in refusals)}) but ran it\n  reproduce: {reproduce_command(c)}",
                       time.perf_counter() - t0, trajectory=out.result)
    traj = out.result
    verdict = judge(c, traj)
    seconds = time.perf_counter() - t0
    problems = [(f.param, f.quantity) for f in verdict.failures]
    extra_msgs = []
    swapped = None
    if c.offload == "nvme":
        swapped = traj.swapped_bytes
        if swapped <= 0:
            problems.append(("<case>", "swap"))
            extra_msgs.append(f"{c.name}: claims NVMe offload but wrote and read 0 bytes in the swap folder "
                              f"(a case that never swapped is not an NVMe check)\n  reproduce: {reproduce_command(c)}")
    unexplained = [p for p in problems if p[1] not in explained]
    message = "\n".join(([] if verdict.passed else [verdict.message()]) + extra_msgs)
    if unexplained:
        status = "failed"
        if ids:
            message = (f"divergences not explained by expected bug(s) {', '.join(ids)}: "
                       f"{sorted(set(unexplained))}\n" + message)
    elif problems:
        status = "xfailed" if ids else "failed"
    else:
        status = "xpassed" if ids else "passed"
        if ids:
            message = f"expected bug(s) {', '.join(ids)} did not show: the bug registry is stale for {c.name}"
        else:
            message = verdict.message()
    return Outcome(c, column, status, ids, message, seconds, verdict, unexplained, swapped, traj)


def environment() -> dict:
    import deepspeed
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "cpu": platform.processor() or platform.machine(), "platform": platform.platform()}


def record(store, o: Outcome) -> None:
    from harness import results

    if o.verdict is None:
        store.add(results.error_record(o.case, column=o.column, message=o.message, seconds=o.seconds,
                                       bug_ids=o.bug_ids, status=o.status))
        return
    rec, maps = results.from_verdict(o.verdict, column=o.column, status=o.status, bug_ids=o.bug_ids,
                                     seconds=o.seconds, message=o.message, swapped_bytes=o.swapped_bytes)
    store.add(rec, maps)


def mutation_extra(km) -> dict:
    """The kill matrix in the report's ``extra`` format."""
    from harness import known_bugs

    rows = []
    for m in km.mutants:
        cells = {r.case: r.killed for r in km.rows if r.mutant == m}
        rows.append({"mutant": m, "description": known_bugs.MUTANTS[m].description, "killed": cells,
                     "killed_by": km.killed_by(m)})
    return {"mutations": rows, "mutation_cases": list(km.cases)}


def _render(results_dir: Path, report: Path, extra: dict) -> str | None:
    try:
        from harness.report import render
    except ImportError:
        return None
    render(results_dir, report, extra=extra)
    return str(report)


def run_gate(report: str = "reports/gate.html", full: bool = False, seed: int = 0, only: str | None = None,
             quiet: bool = False, mutate: bool = True, shard: str | None = None) -> int:
    from harness import results
    from harness import shard as sharding
    from harness.matrix import gate_cases

    cases = [c.replace(seed=seed) for c in gate_cases(full) if not only or only in c.name]
    part = sharding.Shard.parse(shard) if shard else None
    if part is not None:
        # Every machine computes the same split; the mutation self-check runs once, on shard 1.
        cases = sharding.select(cases, part)
        mutate = mutate and part.index == 1
        print(f"gate: shard {part}: {len(cases)} cases", flush=True)
    cols = columns()
    report_path = Path(report)
    results_dir = report_path.parent / (report_path.stem + "-results")
    if results_dir.exists():
        import shutil

        shutil.rmtree(results_dir)
    store = results.ResultStore(results_dir, writer="gate" if part is None else f"gate-shard{part.index}of{part.count}")
    manager = PoolManager()
    counts: dict[str, int] = {}
    bad = []
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
                if o.status in ("failed", "error", "xpassed"):
                    bad.append(o)
                if not quiet:
                    tag = o.status.upper() + (f" [{', '.join(o.bug_ids)}]" if o.bug_ids and o.status == "xfailed" else "")
                    print(f"[{n}/{total}] {col:7s} {case.name:55s} {tag} ({o.seconds:.1f}s)", flush=True)
        km = None
        if mutate and patched_available() and not only:
            from harness import known_bugs

            print("\nmutation self-check (patched runtime, every catalogued mutant):", flush=True)
            km = known_bugs.kill_matrix(known_bugs.default_kill_cases(), manager=manager)
            print(km.table(), flush=True)
            if km.kill_rate < 1.0 or km.surprises() or not all(km.baseline.values()):
                counts["mutation-check-failed"] = 1
    finally:
        manager.close()
    elapsed = time.perf_counter() - t0
    env = environment()
    env["seed"] = seed
    extra = {"environment": env, "elapsed_s": elapsed}
    if km is not None:
        extra.update(mutation_extra(km))
    if part is not None:
        # Stored with the results so that merging the shards' folders keeps the kill matrix.
        from harness.report import save_extra

        save_extra(results_dir, extra, name=f"shard{part.index}of{part.count}")
    rendered = _render(results_dir, report_path, extra)
    print(f"\ngate: {len(cases)} cases x {len(cols)} column(s) in {elapsed:.0f}s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    for o in bad:
        print("\n" + o.message)
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
