"""Build a Cosmic Ray session restricted to the scoped functions (run by the engine's interpreter).

``cosmic-ray init`` mutates whole modules; here the same work items (Cosmic Ray's own operators and
occurrence numbering, ``cosmic_ray.commands.init``) are kept only where the mutated span starts on a
scoped line, given a job id derived from what they mutate (so a seeded sample names the same mutants
on every machine and every run), optionally sampled, and written into the session database. Mutants
on lines the coverage map says no case executes get their result at once ("not reached"), as do the
ones listed in ``equivalents.txt`` ("equivalent": a listed mutant survives every case that reaches it,
which costs a survivor's full run, ~40 s each, ~80 min over the list, for a verdict already argued in
writing; ``--judge-equivalents`` judges them anyway, to audit the list), so ``cosmic-ray exec`` only
runs the ones a case can kill, and a resumed exec runs only what is pending.

Runs as ``<engine python> -m harness.selfcheck.source_mutation.session ...`` with the checkout on PYTHONPATH and
the copy's package folder as the working directory (module paths are relative to it, so an HTTP
worker on another machine resolves them in its own copy). Imports only the standard library, Cosmic
Ray and the stdlib-only ``scope``, ``selection`` and ``equivalents`` modules.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

from harness.selfcheck.source_mutation import ledger, patched, scope
from harness.selfcheck.source_mutation.selection import CoverageMap

RESULT_TAG = "MUTATION-RESULT "  # the worker's tag (harness.selfcheck.source_mutation.worker.RESULT_TAG)


def mutant_key(rel: str, operator: str, occurrence: int, start) -> str:
    """The stable name of one mutant: file:line:col operator#occurrence (equivalents file, report)."""
    return f"{rel}:{start[0]}:{start[1]} {operator}#{occurrence}"


def mutant_key_of(w) -> str:
    m = w.mutations[0]
    return mutant_key(str(m.module_path), m.operator_name, m.occurrence, m.start_pos)


def job_id(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()[:32]


def _selected(only: str, text: str, fn) -> bool:
    """``--only``: a scoped function's exact qualified name (``muon_update``,
    ``DeepSpeedZeroOptimizer.step``), or a substring of the mutant key (a file, ``stage3.py:17``)."""
    return only == fn.entry.qualname or only in text


def scoped_items(ds_root: Path, only: str | None = None):
    """(key, WorkItem, Resolved) for every Cosmic Ray mutant whose span starts on a scoped line
    (with ``only``: in a file or function whose name contains it)."""
    from cosmic_ray.commands.init import _all_work_items
    from cosmic_ray.work_item import WorkItem

    resolved = scope.resolve(ds_root)
    out = []
    for rel in scope.files():
        if only and not any(r.entry.file == rel and _selected(only, rel, r) for r in resolved):
            continue  # parsing a module for every operator costs seconds: skip files the filter excludes
        for item in _all_work_items([Path(rel)], {}):
            m = item.mutations[0]
            fn = scope.owner(resolved, rel, m.start_pos[0])
            if fn is None:
                continue
            key = mutant_key(rel, m.operator_name, m.occurrence, m.start_pos)
            out.append((key, WorkItem.single(job_id(key), m), fn))
    out.sort(key=lambda t: t[0])
    return out, resolved


def _premark(db, w, resolved, cmap: CoverageMap, replaced: list[dict], equivalent: dict[str, str],
             carried: dict[str, dict] | None = None) -> str | None:
    """Give a mutant its result now when no worker is needed: inside a function the patched runtime
    replaces (patched column only: ``replaced`` is empty on stock), on a line no case executes,
    listed in ``equivalent`` (key -> reason; empty to judge the listed ones too), or judged before
    (``carried``: the ledger's lines, ``harness.selfcheck.source_mutation.ledger``)."""
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    m = w.mutations[0]
    rel = str(m.module_path)
    fn = scope.owner(resolved, rel, m.start_pos[0])
    if fn is None:
        return None
    lines = list(range(m.start_pos[0], m.end_pos[0] + 1))
    where = [f"{rel}:{m.start_pos[0]} ({fn.entry.qualname})"]
    hit = patched.replaced_by(replaced, rel, lines)
    if hit is not None:
        rec = patched.record(hit, where)
    elif not cmap.cases_for(resolved, rel, lines):
        rec = {"status": "not-reached", "where": where, "detail": "no candidate case executes this line"}
    elif (key := mutant_key_of(w)) in equivalent:
        rec = {"status": "equivalent", "where": where, "detail": "listed in equivalents.txt, not judged: "
               + equivalent[key]}
    elif carried and key in carried:
        rec = {**ledger.as_record(carried[key]), "where": where}
    else:
        return None
    db.set_result(w.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                       output=RESULT_TAG + json.dumps(rec, sort_keys=True)))
    return rec["status"]


def build(session: Path, ds_root: Path, cmap_path: Path, sample: int | None, seed: int,
          only: str | None = None, replaced: list[dict] | None = None, judge_equivalents: bool = False,
          ledger_path: Path | None = None) -> dict:
    from cosmic_ray.work_db import WorkDB, use_db

    from harness.selfcheck.source_mutation import equivalents

    items, resolved = scoped_items(ds_root, only)
    if only:
        items = [t for t in items if _selected(only, t[0], t[2])]
    total = len(items)
    cmap = CoverageMap.load(cmap_path)
    per_fn: dict[str, dict[str, int]] = {r.name: {"mutants": 0, "reached": 0} for r in resolved}
    for _, w, fn in items:
        m = w.mutations[0]
        per_fn[fn.name]["mutants"] += 1
        if cmap.cases_for(resolved, fn.entry.file, range(m.start_pos[0], m.end_pos[0] + 1)):
            per_fn[fn.name]["reached"] += 1
    Path(str(session) + ".scope.json").write_text(json.dumps(per_fn, indent=1, sort_keys=True))
    if sample is not None and sample < len(items):
        items = sorted(random.Random(seed).sample(items, sample), key=lambda t: t[0])
    marked: dict[str, int] = {}
    listed = {} if judge_equivalents else equivalents.load("patched" if replaced else "stock")
    carried = ledger.load(ledger_path) if ledger_path else {}
    with use_db(str(session), WorkDB.Mode.create) as db:
        db.clear()
        db.add_work_items([w for _, w, _ in items])
        for _, w, _ in items:
            st = _premark(db, w, resolved, cmap, replaced or [], listed, carried)
            if st:
                marked[st] = marked.get(st, 0) + 1
                marked["from_ledger"] = marked.get("from_ledger", 0) + (mutant_key_of(w) in carried
                                                                      and st in ledger.JUDGED)
    print("KEYS " + "; ".join(k for k, _, _ in items), file=sys.stderr)
    return {"scoped_mutants": total, "in_session": len(items), "not_reached": marked.get("not-reached", 0),
            "equivalent_not_judged": marked.get("equivalent", 0), "from_ledger": marked.get("from_ledger", 0),
            **({patched.STATUS: marked.get(patched.STATUS, 0)} if replaced else {}), "functions": len(resolved)}


def retry(session: Path, ds_root: Path, cmap_path: Path, statuses: set[str],
          replaced: list[dict] | None = None) -> dict:
    """Make the mutants whose recorded status is in ``statuses`` pending again (after a new case or a
    sharper tolerance), except listed equivalents; re-mark the ones the current coverage map still
    does not reach."""
    from cosmic_ray.work_db import WorkDB, WorkResultStorage, use_db

    from harness.selfcheck.source_mutation import equivalents

    resolved = scope.resolve(ds_root)
    cmap = CoverageMap.load(cmap_path)
    # a listed equivalent is not retried: nothing can kill it
    equivalent = equivalents.load("patched" if replaced else "stock")
    again, unreached = [], 0
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in list(db.completed_work_items):
            rec = {}
            for line in (result.output or "").splitlines():
                if line.startswith(RESULT_TAG):
                    rec = json.loads(line[len(RESULT_TAG):])
            m = item.mutations[0]
            key = mutant_key(str(m.module_path), m.operator_name, m.occurrence, m.start_pos)
            if rec.get("status") in statuses and key not in equivalent:
                again.append(item)
        ids = [w.job_id for w in again]
        with db._session_maker.begin() as s:  # Cosmic Ray has no public "forget this result"
            s.query(WorkResultStorage).filter(WorkResultStorage.job_id.in_(ids)).delete(synchronize_session=False)
        for w in again:
            unreached += _premark(db, w, resolved, cmap, replaced or [], {}) == "not-reached"
    return {"retried": len(again), "still_not_reached": unreached}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="harness.selfcheck.source_mutation.session")
    ap.add_argument("--session", required=True)
    ap.add_argument("--map", required=True)
    ap.add_argument("--sample", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None)
    ap.add_argument("--retry", default=None, help="comma-separated statuses to make pending again")
    ap.add_argument("--replaced", default=None, help="the patched column's replaced functions (patched.dump)")
    ap.add_argument("--judge-equivalents", action="store_true", help="judge the listed equivalents too")
    ap.add_argument("--ledger", default=None, help="take the results of mutants judged before from this ledger")
    args = ap.parse_args(argv)
    replaced = patched.load(args.replaced)
    if args.retry:
        print(json.dumps(retry(Path(args.session), Path("."), Path(args.map), set(args.retry.split(",")), replaced)))
        return 0
    print(json.dumps(build(Path(args.session), Path("."), Path(args.map), args.sample, args.seed, args.only,
                           replaced, args.judge_equivalents, Path(args.ledger) if args.ledger else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
