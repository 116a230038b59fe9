"""The main job: the whole gate over every column (``python -m harness gate``) and the one-case
reproducer (``python -m harness run``), with the mutation self-checks and the report.

Kept apart from ``harness.gate.decide`` (the decision of one case) because the stock kill matrix
(``harness.selfcheck.kill_matrix``) decides its cases with ``gate.evaluate`` while this job runs the kill
matrix: one module doing both would be an import cycle.
"""
from __future__ import annotations

import json
import os
import platform
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from harness.case.spec import Case
from harness.catalog import matrix as catalog
from harness.catalog import sweep
from harness.catalog.matrix import group_of
from harness.env import versions
from harness.gate.decide import columns, evaluate, record
from harness.launch import shard as sharding
from harness.launch.jobs import run_shards
from harness.launch.lifecycle import Interrupted
from harness.launch.pool import PoolManager
from harness.registry import mutants as known_bugs
from harness.report import results
from harness.report.build import prune_maps, render, save_extra
from harness.report.html import BAD_STATUSES, MAIN_COLUMNS
from harness.report.results import load_records, strength_line, strength_summary
from harness.selfcheck.kill_matrix import (default_kill_cases, kill_matrix, selfcheck_cost, stock_kill_cases,
                                           stock_kill_matrix)


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


def _render(results_dir: Path, report: Path, extra: dict, records: list | None = None) -> str | None:

    render(results_dir, report, extra=extra, records=records)
    return str(report)


def _run_cases(pairs: list[tuple[Case, str]], manager, store, quiet: bool, claim=None) -> None:
    """Every case-column in order, each outcome to the store on disk and dropped before the next, so
    the parent stays flat however many cases fail (the summary is read back: ``summary``). In the
    normal order a case's columns run back to back: where the patched run is bit-identical to the
    stock one, the patched column takes the stock verdict instead of judging again (``gate.judged``).
    ``claim(key)``: whether this shard may run that case-column (``shard.claim``); a claimed one is skipped."""
    total = len(pairs)
    for n, (case, col) in enumerate(pairs, start=1):
        if claim is not None and not claim(f"{case.name}\t{col}"):
            continue
        o = evaluate(case, col, manager)
        record(store, o)
        if not quiet:
            ids = f" [{', '.join(o.bug_ids)}]" if o.bug_ids and o.status == "xfailed" else ""
            print(f"[{n}/{total}] {col:7s} {case.name:55s} {o.status.upper()}{ids} ({o.seconds:.1f}s)",
                  flush=True)
        del o


def _mutation_checks(manager, seed: int, patched_check: bool, stock_check: bool, note=None):
    """The mutation self-checks: (patched kill matrix or None, stock kill matrix or None, whether one failed).
    ``note(kind, case, mutant)``, where given, hears of each run as it ends (the progress line's count)."""

    km = skm = None
    failed = False

    def heard(kind):
        return None if note is None else (lambda c, m, _text: note(kind, c, m))

    if patched_check:
        print("\nmutation self-check (patched runtime, every catalogued mutant):", flush=True)
        km = kill_matrix(default_kill_cases(), manager=manager, progress=heard("patched"))
        print(km.table(), flush=True)
        failed |= km.kill_rate < 1.0 or bool(km.surprises()) or not all(km.baseline.values())
    if stock_check:
        print("\nmutation self-check (STOCK DeepSpeed, gate decision: bug-affected cases must still fail):",
              flush=True)
        skm = stock_kill_matrix([c.replace(seed=seed) for c in stock_kill_cases()], manager=manager,
                                progress=heard("stock"))
        print(skm.table(), flush=True)
        failed |= skm.kill_rate < 1.0 or bool(skm.surprises()) or not all(skm.baseline.values())
    return km, skm, failed


@dataclass(frozen=True)
class GateArgs:
    """One gate command. ``results``: the results folder (default: ``<report stem>-results`` next to the
    report). ``resume``: judge only what that folder's runs planned and never judged. ``append``: write
    into the folder as it is (a ``--jobs`` shard; the parent prepared it). ``shuffle``: run the
    case-columns in this seed's random order; ``column``: run this column alone (both for showing that
    a verdict does not depend on what ran before it)."""
    report: str = "reports/gate.html"
    full: bool = False
    seed: int = 0
    only: str | None = None
    quiet: bool = False
    mutate: bool = True
    shard: str | None = None
    jobs: int = 1
    render_report: bool = True
    results: str | None = None
    resume: bool = False
    append: bool = False
    shuffle: int | None = None
    column: str | None = None
    steal: bool = False  # a --jobs shard: self-checks first, then its cases, then the others' untouched ones

    @property
    def results_dir(self) -> Path:
        report = Path(self.report)
        return Path(self.results) if self.results else report.parent / (report.stem + "-results")

    def plan_args(self) -> dict:
        """What ``--resume`` needs to rebuild the same case-columns."""
        return {"report": self.report, "full": self.full, "seed": self.seed, "only": self.only,
                "mutate": self.mutate, "shuffle": self.shuffle, "column": self.column}


KEEP_PREVIOUS = 2  # results folders a plain rerun keeps aside (each --full one is hundreds of MB)


def _move_aside(results_dir: Path) -> Path | None:
    """A plain rerun keeps the last folders instead of deleting them: ``<name>.prev-<UTC time>``,
    the newest ``KEEP_PREVIOUS`` kept."""
    if not results_dir.exists():
        return None
    aside = results_dir.with_name(f"{results_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    results_dir.rename(aside)
    older = sorted(results_dir.parent.glob(results_dir.name + ".prev-*"))[:-KEEP_PREVIOUS]
    for old in older:
        shutil.rmtree(old, ignore_errors=True)
    return aside


def _all_pairs(a: GateArgs) -> list[tuple[Case, str]]:
    cases = [c.replace(seed=a.seed) for c in catalog.gate_cases(a.full) if not a.only or a.only in c.name]
    cols = [a.column] if a.column else columns()
    pairs = [(c, col) for c in cases for col in cols]
    if a.shuffle is not None:
        random.Random(a.shuffle).shuffle(pairs)
    return pairs


def _resumed(a: GateArgs) -> tuple[GateArgs, list[tuple[Case, str]], list[str]]:
    """The arguments a folder's runs were started with, the case-columns they left unjudged, and the
    self-checks they left unrun."""
    plans = results.load_plans(a.results_dir)
    if not plans:
        raise GateInputError(f"--resume {a.results_dir}: no run plan in that folder (run-*.json); it was not "
                             "written by a gate that records its plan, so there is nothing to resume")
    first = plans[0]["args"]
    a = replace(a, report=first["report"], full=first["full"], seed=first["seed"], only=first["only"],
                mutate=first["mutate"], shuffle=first["shuffle"], column=first["column"], append=True)
    state = results.completeness(a.results_dir)
    missing = set(state.missing)
    pairs = [(c, col) for c, col in _all_pairs(a) if results.Planned(c.name, col) in missing]
    if len(pairs) < len(missing):
        raise GateInputError(f"--resume {a.results_dir}: {len(missing) - len(pairs)} planned case-column(s) are no "
                             "longer in the catalogue (the harness changed since the run); rerun the gate instead")
    return a, pairs, state.selfchecks_missing


class GateInputError(ValueError):
    """Arguments that cannot be run; the CLI prints the message and exits 2."""


def _writer(a: GateArgs, part) -> str:
    """The name a run writes under (``results-<writer>.jsonl``, ``run-<writer>.json``): unique per shard
    and per resume of the folder."""
    name = "gate" if part is None else f"gate-shard{part.index}of{part.count}"
    if a.resume:
        name += f"-resume{len(list(a.results_dir.glob(f'run-{name}-resume*.json'))) + 1}"
    return name


def _selfchecks_for(a: GateArgs, part, unrun: list[str] | None) -> list[str]:
    """Each mutation self-check runs once: the patched one on shard 1, the stock one on shard 2 (shard 1
    when there is only one), so that with --jobs 2 neither shard idles while the other runs both."""
    if not a.mutate or a.only or a.column or a.shuffle is not None:
        return []
    mine = []
    if part is None or part.index == 1:
        mine.append("patched")
    if part is None or part.index == min(2, part.count):
        mine.append("stock")
    return [s for s in mine if unrun is None or s in unrun]


def _selfcheck_loads(a: GateArgs, count: int) -> list[float]:
    """Each shard's expected self-check seconds (``kill_matrix.selfcheck_cost``): the shards' cases are
    balanced around them, and the progress line's total counts them."""
    return [sum(selfcheck_cost(kind) for kind in _selfchecks_for(a, sharding.Shard(k, count), None))
            for k in range(1, count + 1)]


def run_gate(**kwargs) -> int:
    """``python -m harness gate``; keyword arguments as :class:`GateArgs`. Exit 0 all as expected, 1 an
    unexpected outcome or a failed self-check, 128 + N when stopped by signal N (the folder then says
    what was not judged; ``--resume`` finishes it)."""
    a = GateArgs(**kwargs)
    unrun = None
    if a.resume:
        a, pairs, unrun = _resumed(a)
    else:
        pairs = _all_pairs(a)
    if not pairs and not a.resume:
        raise GateInputError(f"--only {a.only!r} matches no gate case" + (" of --full" if a.full else
                             " of the CI gate (try --full)"))
    part = sharding.Shard.parse(a.shard) if a.shard else None
    if a.jobs > 1 and part is None:
        return _run_jobs(a, pairs)
    others = []
    if part is not None:
        pairs, others = _shard_pairs(a, part, pairs)
        print(f"gate: shard {part}: {len({c.name for c, _ in pairs})} cases", flush=True)
    print(f"gate: {versions.banner()}", flush=True)
    if not a.append:
        aside = _move_aside(a.results_dir)
        if aside:
            print(f"gate: the previous results moved to {aside}", flush=True)
    writer = _writer(a, part)
    selfchecks = _selfchecks_for(a, part, unrun)
    results.write_plan(a.results_dir, writer, [results.Planned(c.name, col)
                                               for c, col in pairs], selfchecks, a.plan_args())
    return _gate_body(a, pairs, writer, selfchecks, others)


def _shard_pairs(a: GateArgs, part, pairs: list) -> tuple[list, list]:
    """This shard's case-columns and, for a ``--jobs`` shard (``steal``), the other shards' in the order it
    would take them once its own are done (``shard.taken_from_the_end``), each case's columns together."""
    start = _selfcheck_loads(a, part.count) if not a.resume else ()
    cases = list({c.name: c for c, _ in pairs}.values())
    parts = sharding.assign(sharding.costs_for(cases), part.count, start)  # once: ``select``'s split
    mine = set(parts[part.index - 1])
    columns_of: dict = {}
    for c, col in pairs:
        columns_of.setdefault(c.name, []).append((c, col))
    others = [p for c in sharding.taken_from_the_end(cases, part, parts) for p in columns_of[c.name]] \
        if a.steal else []
    return [(c, col) for c, col in pairs if c.name in mine], others


def _gate_body(a: GateArgs, pairs: list, writer: str, selfchecks: list[str], others: list = ()) -> int:
    """A ``--jobs`` shard (``a.steal``) runs its self-checks first, while the other shards can still take
    its cases, then its own cases and whatever the others have not started: the static split is balanced
    on recorded seconds, which another machine runs in other proportions (a self-check left alone at the
    end kept one core idle for a third of the CI gate, docs/measurements.md)."""
    store = results.ResultStore(a.results_dir, writer=writer)
    manager = PoolManager()
    t0 = time.perf_counter()
    km = skm = None
    mutation_failed, stopped = False, None
    claim = (lambda key: sharding.claim(a.results_dir, key)) if a.steal else None

    def selfchecks_now():
        return _mutation_checks(manager, a.seed, "patched" in selfchecks, "stock" in selfchecks,
                                note=_selfcheck_note(a, writer))
    try:
        if a.steal:
            km, skm, mutation_failed = selfchecks_now()
        _run_cases(pairs, manager, store, a.quiet, claim)
        _run_cases(list(others), manager, store, a.quiet, claim)
        if not a.steal:
            km, skm, mutation_failed = selfchecks_now()
    except Interrupted as exc:
        stopped = exc
    finally:
        if stopped:
            manager.close(kill=True)
        else:
            manager.close()
    elapsed = time.perf_counter() - t0
    done = [s for s, m in (("patched", km), ("stock", skm)) if m is not None]
    results.finish_plan(a.results_dir, writer, selfchecks_done=done, interrupted=stopped and stopped.name)
    env = environment()
    env["seed"] = a.seed
    extra = {"environment": env, "elapsed_s": elapsed}
    if km is not None or skm is not None:
        extra.update(mutation_extra(km, skm))
        extra["selfcheck_seconds"] = {k: m.seconds for k, m in (("patched", km), ("stock", skm)) if m is not None}
    save_extra(a.results_dir, extra, name=writer)  # with the results: a merge or a resume keeps it
    if not a.render_report:  # a --jobs shard: the parent reads the folder and reports
        print(f"gate: {writer}: {'stopped by ' + stopped.name if stopped else 'done'} after {elapsed:.0f}s", flush=True)
        return stopped.exit_code if stopped else (1 if mutation_failed else 0)
    return _report_run(a, f"gate: {len({c.name for c, _ in pairs})} cases in {elapsed:.0f}s", stopped,
                       "the mutation self-check failed (tables above)" if mutation_failed else None)


def _selfcheck_note(a: GateArgs, writer: str):
    """Each self-check run as it ends, into the results folder, for a parent's progress line: at its case's
    share of the self-check's planned seconds (``selfcheck_cost``), so that the runs add up to the total
    the line planned with, measured or estimated."""
    rate: dict = {}

    def note(kind, case, mutant):
        if kind not in rate:
            costs = sharding.costs_for(default_kill_cases() if kind == "patched" else stock_kill_cases())
            rate[kind] = (costs, selfcheck_cost(kind) / max(selfcheck_cost(kind, costs), 1e-9))
        costs, scale = rate[kind]
        results.note_selfcheck_run(a.results_dir, writer, kind, case.name, mutant, costs[case.name] / 2 * scale)

    return note


def _report_run(a: GateArgs, headline: str, stopped: Interrupted | None, failed: str | None) -> int:
    """The end of a gate, whole or stopped: the report, the summary (brief when stopped), the exit code.
    The records are read once for all four (a ``--full`` folder's take ~2 s each time)."""
    records = load_records(a.results_dir) if a.results_dir.exists() else []
    rendered = _render(a.results_dir, Path(a.report), {}, records)
    state = results.completeness(a.results_dir, records)
    if state.complete:
        prune_maps(a.results_dir, records)  # after rendering: the page drew these maps, the rest go
        results.compact(a.results_dir)  # every record kept, compressed; a plain file is a run still writing
    if stopped:
        headline = f"gate STOPPED by {stopped.name} ({headline})"
    bad = summary(a.results_dir, headline, brief=stopped is not None, records=records)
    if not state.complete:
        print(state.headline(a.results_dir))
    if failed:
        print(failed)
    print(f"results: {a.results_dir}" + (f"\nreport: {rendered}" if rendered else ""))
    if stopped:
        return stopped.exit_code
    return 1 if bad or failed else 4 if not state.complete else 0


def summary(results_dir: Path, headline: str, brief: bool = False, records: list | None = None) -> int:
    """Print the gate's summary from its stored outcomes: the layout sweep tables, the counts, the
    full-strength share, the time per path group and every unexpected outcome's message. One reading
    for a gate run in one process and for its shards merged; returns how many outcomes were bad."""


    records = [r for r in (load_records(results_dir) if records is None else records) if r.column in MAIN_COLUMNS]
    by_col: dict[str, dict] = {}
    group_time: dict[str, list] = {}
    for r in records:
        tag = r.status + (f" [{', '.join(r.bug_ids)}]" if r.bug_ids else "")
        by_col.setdefault(r.column, {})[r.case_name] = (tag, r.seconds)
        g = group_time.setdefault(group_of(r.case_name), [0, 0.0])
        g[0] += 1
        g[1] += r.seconds
    for col in sorted(by_col, key=MAIN_COLUMNS.index) if not brief else []:  # a stopped run's tables are holes
        table = sweep.gate_summary(col, by_col[col])
        if table:
            print(table, flush=True)
    counts = Counter(r.status for r in records)
    print(f"\n{headline}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    print(strength_line(strength_summary((r.column, r.strength) for r in records)))
    print("time per group (case runs over all columns, seconds): " + ", ".join(
        f"{g} {n}/{sec:.0f}s" for g, (n, sec) in sorted(group_time.items(), key=lambda kv: -kv[1][1])))
    bad = [r for r in records if r.status in BAD_STATUSES]
    for r in bad[:3] if brief else bad:
        print("\n" + r.message)
    if brief and len(bad) > 3:
        print(f"\n... and {len(bad) - 3} more unexpected outcome(s): see the report")
    return len(bad)


def _run_jobs(a: GateArgs, pairs: list) -> int:
    """The gate as ``a.jobs`` local shards (``harness.launch.jobs``) writing into one results folder; the
    summary and the report are read from it."""
    print(f"gate: {len({c.name for c, _ in pairs})} cases as {a.jobs} local shards "
          f"(python -m harness gate --shard K/{a.jobs})", flush=True)
    if not a.append:
        aside = _move_aside(a.results_dir)
        if aside:
            print(f"gate: the previous results moved to {aside}", flush=True)
    # the whole run's plan, so a shard killed before writing its own still counts as missing
    writer = _writer(a, None)
    results.write_plan(a.results_dir, writer, [results.Planned(c.name, col) for c, col in pairs], [], a.plan_args())
    progress = Progress(a.results_dir, pairs, selfcheck_s=sum(_selfcheck_loads(a, a.jobs)))
    sharding.clear_claims(a.results_dir)  # a stopped run's claims: what it never judged is to be run now
    try:
        codes, elapsed, stopped = run_shards(a.jobs, shard_args(a), progress=progress)
    finally:
        sharding.clear_claims(a.results_dir)
    progress(final=True)
    results.finish_plan(a.results_dir, writer, selfchecks_done=[], interrupted=stopped and stopped.name)
    failed = [f"shard {k}/{a.jobs} exited with {c}" for k, c in enumerate(codes, start=1) if c not in (0, 1)]
    for line in failed if not stopped else []:  # a shard's own failure (a crash) is in its output above
        print(line)
    shard_failed = not stopped and (bool(failed) or any(c == 1 for c in codes))
    return _report_run(a, f"gate (all {a.jobs} shards): {len({c.name for c, _ in pairs})} cases in {elapsed:.0f}s "
                       "wall", stopped, "a shard failed (its output above)" if shard_failed else None)


class Progress:
    """One line for all the shards of a ``--jobs`` gate, from the results folder they write into: the
    case-columns judged of those planned, the unexpected ones so far, the elapsed time and an ETA from
    the measured case costs (``harness/data/case_times.json``; a case-column costs half its case), the
    mutation self-checks' runs counted at the same rate (``selfcheck_s``: their planned seconds). Each
    unexpected outcome is printed as it lands, so a failure is seen without waiting for the end."""

    EVERY_S = float(os.environ.get("MUON_HARNESS_PROGRESS_S", "20"))

    def __init__(self, folder: Path, pairs: list[tuple[Case, str]], selfcheck_s: float = 0.0):
        cols = Counter(c.name for c, _ in pairs)
        costs = sharding.costs_for(list({c.name: c for c, _ in pairs}.values()))
        self.cost = {(c.name, col): costs[c.name] / cols[c.name] for c, col in pairs}
        self.selfcheck_s = selfcheck_s
        self.total = sum(self.cost.values()) + selfcheck_s
        self.folder, self.offsets, self.done, self.done_cost, self.bad = folder, {}, set(), 0.0, 0
        self.selfcheck_done = 0.0
        self.t0 = self.last = time.perf_counter()

    def _lines(self, pattern: str):
        for path in sorted(self.folder.glob(pattern)):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]  # a line being written waits for the next poll
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                try:
                    yield json.loads(line)
                except ValueError:
                    continue

    def __call__(self, final: bool = False) -> None:
        for d in self._lines("results-*.jsonl"):
            key = (d["case_name"], d["column"])
            if key not in self.cost or key in self.done:
                continue
            self.done.add(key)
            self.done_cost += self.cost[key]
            if d["status"] in BAD_STATUSES:
                self.bad += 1
                print(f"  {d['status'].upper()} {d['case_name']} [{d['column']}]: "
                      f"{(d['message'] or '').splitlines()[0][:160]}", flush=True)
        for d in self._lines("selfcheck-*.jsonl"):
            self.selfcheck_done += float(d.get("cost", 0.0))
        now = time.perf_counter()
        if final or now - self.last >= self.EVERY_S:
            self.last = now
            print(self.line(now - self.t0, final), flush=True)

    def line(self, elapsed: float, final: bool = False) -> str:
        """The progress line; once every case-column is judged while shards still run, it says the
        mutation self-checks are what runs."""
        done = self.done_cost + min(self.selfcheck_done, self.selfcheck_s)
        share = min(done / self.total, 1.0) if self.total else 1.0
        eta = f"ETA {_mmss(elapsed * (1 - share) / share)}" if share > 0.02 else "ETA after the first cases"
        checks = ""
        if self.selfcheck_s and self.done and len(self.done) == len(self.cost) and not final:
            checks = "; the mutation self-checks are running"
        return (f"gate: {len(self.done)}/{len(self.cost)} case-columns ({100 * share:.0f}% of the measured cost"
                f"{' with the self-checks' if self.selfcheck_s else ''}), {self.bad} unexpected{checks}, "
                f"{_mmss(elapsed)} elapsed, {eta}")


def _mmss(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def shard_args(a: GateArgs) -> list[list[str]]:
    """Each shard's ``gate`` arguments: the same selection, one folder, appended to."""
    out = []
    for k in range(1, a.jobs + 1):
        cmd = ["--shard", f"{k}/{a.jobs}", "--report", a.report, "--seed", str(a.seed), "--no-report", "--append",
               "--steal"]
        cmd += ["--resume" if a.resume else "--results", str(a.results_dir)]
        cmd += ["--full"] if a.full else []
        cmd += [f"--only={a.only}"] if a.only else []  # one token: a filter may start with "-"
        cmd += ["--quiet"]  # the parent prints one progress line for all (``Progress``)
        cmd += [] if a.mutate else ["--no-mutate"]
        cmd += ["--shuffle", str(a.shuffle)] if a.shuffle is not None else []
        cmd += ["--column", a.column] if a.column else []
        out.append(cmd)
    return out


def run_single(case: Case, report: str | None = None) -> int:
    """The reproducer: rerun exactly one case on every column it can run in; print the verdict."""
    manager = PoolManager()
    worst = 0
    print(versions.banner())  # which DeepSpeed this rerun judged: a case may behave otherwise on another tree
    try:
        for col in (["patched"] if case.patched else ["stock"]):
            o = evaluate(case, col, manager)
            print(f"{col}: {o.status.upper()}" + (f" [{', '.join(o.bug_ids)}]" if o.bug_ids else ""))
            print(o.message)
            worst = max(worst, 0 if o.status in ("passed", "xfailed") else 1)
    finally:
        manager.close()
    return worst
