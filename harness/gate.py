"""Run a case end to end and decide its status; run the whole gate (the main job).

The decision is shared by the pytest suite and ``python -m harness gate``, so the two can never
disagree about what passed:

* passed   -- every quantity within tolerance (and an NVMe case really swapped);
* xfailed  -- stock DeepSpeed diverged from the intended oracle as a registered bug the case triggers
              predicts (``harness.bugs``), and matches the oracle with that bug's model switched on at
              the usual tolerances (or crashed exactly as a crash bug says); carries the bug ids;
* xpassed  -- a bug was expected and did not show: the registry is stale (a failure);
* failed   -- a divergence no bug model explains (the usual localised message);
* error    -- the case produced no trajectory (a rank raised, died or hung).

``Outcome.strength`` says how strongly the case was judged (``harness.results.strength_summary``).
"""
from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.bugs import NUMERIC, bugs_for, refusals_for
from harness.case import Case
from harness.launcher import CaseFailure, Launcher, RankFailed
from harness.pool import PoolManager
from harness.verdict import Verdict, bug_model, judge, reproduce_command


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
    # How strongly the case was judged: "full" (no excuse, or every excuse matched its bug model),
    # "excused" (a bug without a model excused quantities by name), "crash" / "refusal" (an exact
    # exception was the expected result), None (no verdict: error).
    strength: str | None = "full"
    intended: Verdict | None = None  # the intended-oracle verdict where ``verdict`` is the bug model's
    model_verdict: Verdict | None = None  # the bug model's verdict of an xfailed case


def columns() -> list[str]:
    return ["stock", "patched"]


def _problems(c: Case, verdict: Verdict, traj) -> tuple[list[tuple[str, str]], list[str]]:
    """(param, quantity) of every failed check, plus an NVMe case that never swapped."""
    problems = [(f.param, f.quantity) for f in verdict.failures]
    msgs = []
    if c.offload == "nvme" and traj.swapped_bytes <= 0:
        problems.append(("<case>", "swap"))
        msgs.append(f"{c.name}: claims NVMe offload but wrote and read 0 bytes in the swap folder "
                    f"(a case that never swapped is not an NVMe check)\n  reproduce: {reproduce_command(c)}")
    return problems, msgs


def model_changes(case: Case, bugs) -> dict:
    """The merged oracle switches of the modelled bugs a case triggers (``Bug.model``)."""
    changes: dict = {}
    for b in bugs:
        if b.model is None:
            continue
        for k, v in b.model(case).items():
            if k in changes and changes[k] != v:
                raise ValueError(f"{case.name}: bug models disagree on Conventions.{k}: {changes[k]!r} vs {v!r}")
            changes[k] = v
    return changes


def evaluate(case: Case, column: str, manager: Launcher) -> Outcome:
    """Run one case on one column and decide its status.

    A case a registered bug triggers is judged twice: (a) against the intended oracle, where it must
    diverge in the bug's quantities (else the registry is stale: xpassed), and (b) against the oracle
    with the bugs' models switched on (``Bug.model`` -> ``oracles.Conventions``), at the same
    tolerances as any passing case: any divergence there fails the case. Only non-numerical
    quantities a modelled bug names ("swap") are excused in (b). A bug without a model (checkpoint
    state losses) still excuses its quantities by name; such a case is not judged at full strength
    (``Outcome.strength``). A crash bug is accepted only for its exact exception, message and frame.
    """
    patched = column == "patched"
    c = case.replace(patched=patched)
    bugs = bugs_for(c, patched=patched)
    ids = [b.id for b in bugs]
    refusals = refusals_for(c) if patched else []
    crashes = [b for b in bugs if b.crash is not None]
    t0 = time.perf_counter()
    try:
        out = manager.run(c)
    except CaseFailure as exc:
        text = str(exc)
        if refusals and isinstance(exc, RankFailed) and all(b.refusal_matches(exc.details) for b in refusals):
            names = ", ".join(b.id for b in refusals)
            why = next(line.strip() for line in text.splitlines() if refusals[0].refused_when_patched in line)
            return Outcome(c, column, "passed", [], f"{c.name}: refused by the patched runtime as its fix for "
                           f"{names} requires:\n  {why[:400]}", time.perf_counter() - t0, refused=True,
                           strength="refusal")
        if crashes and isinstance(exc, RankFailed) and any(b.crash_matches(exc.details) for b in crashes):
            hit = [b.id for b in crashes if b.crash_matches(exc.details)]
            return Outcome(c, column, "xfailed", hit, f"{c.name}: crashed exactly as {', '.join(hit)} predicts\n"
                           + text[-1500:], time.perf_counter() - t0, strength="crash")
        return Outcome(c, column, "error", ids, text, time.perf_counter() - t0, strength=None)
    if refusals:
        return Outcome(c, column, "failed", ids,
                       f"{c.name}: the patched runtime should have refused this case "
                       f"({', '.join(b.id for b in refusals)}) but ran it\n  reproduce: {reproduce_command(c)}",
                       time.perf_counter() - t0, trajectory=out.result)
    traj = out.result
    verdict = judge(c, traj)
    problems, extra_msgs = _problems(c, verdict, traj)
    seconds = time.perf_counter() - t0
    if crashes:
        return Outcome(c, column, "xpassed" if not problems else "failed", ids,
                       f"{c.name}: expected the crash of {', '.join(b.id for b in crashes)}, but the case ran\n"
                       + "\n".join(([] if verdict.passed else [verdict.message()]) + extra_msgs),
                       seconds, verdict, problems, traj.swapped_bytes if c.offload == "nvme" else None, traj)
    swapped = traj.swapped_bytes if c.offload == "nvme" else None
    if not bugs:
        status = "failed" if problems else "passed"
        message = "\n".join(([] if verdict.passed else [verdict.message()]) + extra_msgs) or verdict.message()
        return Outcome(c, column, status, ids, message, seconds, verdict, problems, swapped, traj)

    modelled = [b for b in bugs if b.model is not None]
    unmodelled = [b for b in bugs if b.model is None]
    named = set().union(*(b.quantities for b in bugs))
    # (a) the bugs must show against the intended oracle, in the quantities they name
    if not any(q in named for _, q in problems):
        message = (f"expected bug(s) {', '.join(ids)} did not show: the bug registry is stale for {c.name}"
                   + ("" if not problems else "\n" + verdict.message()))
        return Outcome(c, column, "xpassed", ids, message, seconds, verdict, problems, swapped, traj)
    # (b) DeepSpeed must match the bug models at full strength
    changes = model_changes(c, modelled)
    mverdict = verdict if not changes else judge(c, traj, conventions=bug_model(changes))
    seconds = time.perf_counter() - t0
    mproblems, mmsgs = _problems(c, mverdict, traj)
    excused = set().union(*(b.quantities - NUMERIC for b in modelled), *(b.quantities for b in unmodelled))
    residual = [p for p in mproblems if p[1] not in excused]
    model_txt = ", ".join(f"{b.id}: {b.model(c) or 'numbers unchanged'}" for b in modelled)
    if residual:
        message = (f"{c.name}: stock DeepSpeed does not match the model of {', '.join(b.id for b in modelled)} "
                   f"({model_txt}); divergences the bug(s) do not predict: {sorted(set(residual))}\n"
                   + "\n".join(([] if mverdict.passed else [mverdict.message()]) + mmsgs))
        return Outcome(c, column, "failed", ids, message, seconds, mverdict, residual, swapped, traj,
                       intended=verdict)
    strength = "full" if not unmodelled else "excused"
    message = (f"{c.name}: diverges from the intended oracle as {', '.join(ids)} predicts and matches the bug "
               f"model(s) ({model_txt or 'none'}) within the usual tolerances"
               + (f"; not modelled, excused by quantity: {', '.join(b.id for b in unmodelled)}" if unmodelled else "")
               + "\n" + "\n".join(([] if verdict.passed else [verdict.message()]) + extra_msgs))
    return Outcome(c, column, "xfailed", ids, message, seconds, verdict, [], swapped, traj, strength=strength,
                   model_verdict=mverdict)


def environment() -> dict:
    import deepspeed
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "cpu": platform.processor() or platform.machine(), "platform": platform.platform()}


def record(store, o: Outcome) -> None:
    from harness import results

    if o.verdict is None:
        store.add(results.error_record(o.case, column=o.column, message=o.message, seconds=o.seconds,
                                       bug_ids=o.bug_ids, status=o.status, strength=o.strength))
        return
    rec, maps = results.from_verdict(o.verdict, column=o.column, status=o.status, bug_ids=o.bug_ids,
                                     seconds=o.seconds, message=o.message, swapped_bytes=o.swapped_bytes,
                                     strength=o.strength)
    store.add(rec, maps)


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
             quiet: bool = False, mutate: bool = True) -> int:
    from harness import results
    from harness.matrix import gate_cases

    cases = [c.replace(seed=seed) for c in gate_cases(full) if not only or only in c.name]
    cols = columns()
    report_path = Path(report)
    results_dir = report_path.parent / (report_path.stem + "-results")
    if results_dir.exists():
        import shutil

        shutil.rmtree(results_dir)
    store = results.ResultStore(results_dir, writer="gate")
    manager = PoolManager()
    counts: dict[str, int] = {}
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
    env = environment()
    env["seed"] = seed
    from harness.results import strength_line, strength_summary

    strength = strength_summary(strengths)
    extra = {"environment": env, "elapsed_s": elapsed}
    if km is not None:
        extra.update(mutation_extra(km, skm))
    rendered = _render(results_dir, report_path, extra)
    print(f"\ngate: {len(cases)} cases x {len(cols)} column(s) in {elapsed:.0f}s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    print(strength_line(strength))
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
