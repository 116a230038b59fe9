"""Run a case end to end and decide its status.

The decision is shared by the pytest suite and ``python -m harness gate`` (``harness.cli.main_job``), so
the two can never disagree about what passed:

* passed   -- every quantity within tolerance (and an NVMe case swapped as DeepSpeed's swap rule says);
             or, for a config DeepSpeed itself must refuse (``harness.registry.refusals``), refused exactly so;
             or, for a tensor-parallel case (``harness.rank.tp_case``), every rank's shards as
             ``harness.judge.tp_verdict`` says;
* xfailed  -- stock DeepSpeed diverged from the intended oracle as a registered bug the case triggers
              predicts (``harness.registry.bugs``), and matches the oracle with that bug's model switched on at
              the usual tolerances (or crashed exactly as a crash bug says); carries the bug ids;
* xpassed  -- a bug was expected and did not show: the registry is stale (a failure);
* failed   -- a divergence no bug model explains (the usual localised message);
* unjudged -- nothing diverged (or only as a bug's model predicts), but a captured quantity has no finite
              reference ("cannot judge", ``harness.judge.compare.cannot_judge``): not a pass, since the
              verdict covers less than was captured, and not a divergence; the gate counts it as a bad
              outcome of its own (``harness.report.html.BAD_STATUSES``);
* error    -- the case produced no trajectory (a rank raised, died or hung).

``Outcome.strength`` says how strongly the case was judged (``harness.report.results.strength_summary``).
"""
from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field, replace

from harness.judge import departure_pins
from harness.judge import departures as departure_judge
from harness.registry import refusals as ds_refusals
from harness.registry.departures import DEPARTURES
from harness.registry.bugs import NUMERIC, bugs_for, candidates_for, refusals_for
from harness.case import nvme
from harness.case.spec import Case
from harness.case.trajectory import RunBits
from harness.launch.launcher import CaseFailure, Launcher, RankDied, RankFailed
from harness.judge.verdict import ORACLE_HOOKS, Verdict, bug_model, judge, reproduce_command
from harness.env import tree, versions
from harness.judge import tp_verdict
from harness.registry import historical
from harness.case.tp import autotp_size
from harness.report import results


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
    # exception was the expected result), "unjudged" (a captured quantity had no reference), None (no
    # verdict: error).
    strength: str | None = "full"
    intended: Verdict | None = None  # the intended-oracle verdict where ``verdict`` is the bug model's
    model_verdict: Verdict | None = None  # the bug model's verdict of an xfailed case


def columns() -> list[str]:
    """The patched column exists only on the release the patched runtime was written against."""

    return ["stock", "patched"] if versions.patched_applies() else ["stock"]


def _problems(c: Case, verdict: Verdict, traj) -> tuple[list[tuple[str, str]], list[str]]:
    """(param, quantity) of every failed check, plus an NVMe case whose swap folder saw other than what
    DeepSpeed's swap rule says (``harness.case.nvme.swap_expected``): bytes where a sub-group reaches the
    threshold, none where no ZeRO-3 sub-group does; and a case that claims its departures from Muon as
    defined (``Case.departs``) whose findings miss the claim or a second computation of their size."""
    problems = [(f.param, f.quantity) for f in verdict.failures]
    msgs = []
    if c.departs is not None:
        wrong = departure_pins.problems(c, traj, departure_judge.findings(c, traj, departures=DEPARTURES), c.departs)
        problems += [("<case>", "departure")] * bool(wrong)
        msgs += [f"{c.name}: departure from Muon as defined: {w}\n  reproduce: {reproduce_command(c)}" for w in wrong]
    if c.offload != "nvme":
        return problems, msgs
    expected = nvme.swap_expected(c)
    if expected and traj.swapped_bytes <= 0:
        problems.append(("<case>", "swap"))
        msgs.append(f"{c.name}: claims NVMe offload but wrote and read 0 bytes in the swap folder "
                    f"(a case that never swapped is not an NVMe check)\n  reproduce: {reproduce_command(c)}")
    elif not expected and traj.swapped_bytes > 0:
        problems.append(("<case>", "swap"))
        msgs.append(f"{c.name}: moved {traj.swapped_bytes} bytes through the swap folder, but no ZeRO-3 sub-group "
                    f"reaches DeepSpeed's swap threshold ({nvme.min_swap_bytes(c)} bytes per rank)\n"
                    f"  reproduce: {reproduce_command(c)}")
    return problems, msgs


def model_changes(case: Case, bugs) -> dict:
    """The merged oracle switches of the modelled bugs a case triggers (``Bug.model``)."""
    changes: dict = {}
    for b in bugs:
        if b.model is None or b.model(case) is None:
            continue
        for k, v in b.model(case).items():
            if k in changes and changes[k] != v:
                raise ValueError(f"{case.name}: bug models disagree on Conventions.{k}: {changes[k]!r} vs {v!r}")
            changes[k] = v
    return changes


# The last few verdicts, by what decided them: the case without its column, every bit of the run the
# judge reads (``Trajectory.judged_bits``) and the oracle's conventions. The gate runs a case's columns
# back to back (``harness.cli.main_job``), and wherever the patched runtime leaves a case's run bit-identical
# to stock (most passing cases) its verdict is the stock one: the judge is a pure function of those
# three, so judging it again would only repeat the float64 replay. A handful of entries keeps the
# parent's memory flat (one case's verdicts, intended and bug-model, and the runs they were judged on).
_VERDICTS: list = []  # (case and conventions key, RunBits, Verdict), oldest first
_VERDICTS_KEPT = 4
# The judge ``judged`` calls: ``verdict.judge`` unless a run captured outside the harness's cases brings
# its own (``decide_captured``: ``harness.watch`` judges a user's ranks without a model to differentiate).
JUDGE: contextvars.ContextVar = contextvars.ContextVar("judge", default=None)


def judged(c: Case, traj, conventions=None, *, bits: RunBits | None = None) -> Verdict:
    """``verdict.judge``, once per (case without its column, run bits, conventions). ``bits``: the
    run's ``judged_bits()`` where the caller already took them (a bug-model judge follows the intended
    one). The bits are compared only where the rest of the key matches: a patched run against the stock
    run of its case."""
    bits = bits if bits is not None else traj.judged_bits()
    fn = JUDGE.get() or judge
    key = (c.replace(patched=False).to_json(), repr(conventions), id(fn),
           tuple((k, id(f)) for k, f in ORACLE_HOOKS.items()))  # a test's deliberately wrong oracle
    hit = next((v for k, b, v in _VERDICTS if k == key and b.same(bits)), None)
    if hit is None:
        hit = fn(c, traj) if conventions is None else fn(c, traj, conventions=conventions)
        _VERDICTS.append((key, bits, hit))
        del _VERDICTS[:-_VERDICTS_KEPT]
    # the verdict names its case (record key, reproducer): this column's
    return replace(hit, case=c, checks=list(hit.checks), notes=list(hit.notes))


def _judge_refusal(c: Case, column: str, manager: Launcher, refusals) -> Outcome:
    """A config DeepSpeed itself must refuse (``harness.registry.refusals``): passed only when a rank raised
    exactly the refusal; failed when DeepSpeed ran the case; error on any other failure."""
    names = ", ".join(r.name for r in refusals)
    t0 = time.perf_counter()
    try:
        out = manager.run(c)
    except CaseFailure as exc:
        if isinstance(exc, RankFailed) and all(r.matches(exc.details) for r in refusals):
            return Outcome(c, column, "passed", [], f"{c.name}: DeepSpeed refused it as it must ({names}: "
                           f"{refusals[0].etype}: {refusals[0].fragment}, {refusals[0].frame})",
                           time.perf_counter() - t0, strength="refusal")
        return Outcome(c, column, "error", [], f"{c.name}: expected DeepSpeed's refusal {names} "
                       f"({refusals[0].etype}: {refusals[0].fragment}, in {refusals[0].frame}); got:\n{exc}",
                       time.perf_counter() - t0, strength=None)
    return Outcome(c, column, "failed", [],
                   f"{c.name}: DeepSpeed must refuse this config ({names}: {refusals[0].etype} "
                   f"'{refusals[0].fragment}' in {refusals[0].frame}, {refusals[0].source}) but ran it"
                   f"\n  reproduce: {reproduce_command(c)}", time.perf_counter() - t0, trajectory=out.result)


def _judge_tp(c: Case, column: str, manager: Launcher) -> Outcome:
    """A tensor-parallel case (``harness.rank.tp_case``): every rank's shards against the oracle of
    ``harness.judge.tp_verdict``; error when a rank raised. No registered bug applies to this case kind."""

    t0 = time.perf_counter()
    try:
        out = manager.run(c)
    except CaseFailure as exc:
        return Outcome(c, column, "error", [], str(exc), time.perf_counter() - t0, strength=None)
    v = tp_verdict.judge(c, out.result)  # the shared record: the report and the reproducer as for any case
    problems = [(f.param, f.quantity) for f in v.failures]
    wrong = _tp_departure_problems(c, out.result)
    problems += [("<case>", "departure")] * bool(wrong)
    message = "\n".join([v.message()] + [f"{c.name}: departure from Muon as defined: {w}" for w in wrong])
    return Outcome(c, column, "failed" if problems else "passed", [], message, time.perf_counter() - t0,
                   v, problems, trajectory=out.result)


def _tp_departure_problems(c: Case, result) -> list[str]:
    """A tensor-parallel case that claims its departures (``Case.departs``) is measured for MUON-TP-SHARD alone:
    the other measures read the whole matrix's own update, which no rank of it computes."""
    if c.departs is None:
        return []
    traj = tp_verdict.whole_trajectory(c, result)
    tp_only = [d for d in DEPARTURES if d.id == "MUON-TP-SHARD"]
    return departure_pins.problems(c, traj, departure_judge.findings(c, traj, departures=tp_only), c.departs)


def evaluate(case: Case, column: str, manager: Launcher) -> Outcome:
    """``_evaluate``'s decision, with a failure on stock that an intermittent bug of the installed release
    could explain naming that bug (``historical_bugs.INTERMITTENT``); the status stays what it was."""

    o = _evaluate(case, column, manager)
    if o.status in ("failed", "error") and column == "stock":
        notes = historical.intermittent_notes(o.case, versions.installed().release)
        if notes:
            o = replace(o, message=o.message + "\n" + "\n".join(notes))
    return o


def _evaluate(case: Case, column: str, manager: Launcher) -> Outcome:
    """``_decide``, with a probe of the tree that cannot decide (``tree.Undecided``) making the case
    "cannot judge: <probe>": the harness cannot read the tree there, which is no DeepSpeed failure."""
    try:
        needed(case)
        return _decide(case, column, manager)
    except tree.Undecided as exc:
        return Outcome(case.replace(patched=column == "patched"), column, "unjudged", [],
                       f"{case.name}: cannot judge: {exc} (tree {tree.capabilities().root})", 0.0,
                       strength="unjudged")


def needed(case: Case) -> None:
    """Ask, before any rank starts, every probe the run and its judge will ask on this case's path (the
    rank side then reads only answers known to exist)."""
    from harness.rank import capture_adapters  # late: the rank-side module pulls in the capture's names

    capture_adapters.adapter_for()
    if case.stage == 3:
        versions.z3_muon_placement(case.offload != "none")
    if case.runs_muon:
        versions.default_ns_method()
        versions.ns_order_emulated()


def _decide(case: Case, column: str, manager: Launcher) -> Outcome:
    """Run one case on one column and decide its status.

    A case a registered bug triggers is judged twice: (a) against the intended oracle, where it must
    diverge in the bug's quantities (else the registry is stale: xpassed), and (b) against the oracle
    with the bugs' models switched on (``Bug.model`` -> ``oracles.Conventions``), at the same
    tolerances as any passing case: any divergence there fails the case. Only non-numerical
    quantities a modelled bug names ("swap") are excused in (b). A bug without a model for the case
    (``Bug.model`` None) still excuses its quantities by name; such a case is not judged at full strength
    (``Outcome.strength``). A crash bug is accepted only for its exact exception, message and frame.
    """

    patched = column == "patched"
    adapted = versions.adapt(case)  # the installed DeepSpeed's config needs / refusals by design
    if adapted.case is None:
        return Outcome(case.replace(patched=patched), column, "skipped", [], f"{case.name}: {adapted.deselected}",
                       0.0, strength=None)
    c = adapted.case.replace(patched=patched)
    must_refuse = ds_refusals.expected(c)
    if must_refuse:
        return _judge_refusal(c, column, manager, must_refuse)

    if autotp_size(c) > 1:
        return _judge_tp(c, column, manager)
    bugs = bugs_for(c, patched=patched)
    refusals = refusals_for(c) if patched else []
    t0 = time.perf_counter()
    try:
        out = manager.run(c)
    except CaseFailure as exc:
        return _judge_failure(c, column, bugs + candidates_for(c, patched=patched), refusals, exc, t0)
    ids = [b.id for b in bugs]
    if refusals:
        return Outcome(c, column, "failed", ids,
                       f"{c.name}: the patched runtime should have refused this case "
                       f"({', '.join(b.id for b in refusals)}) but ran it\n  reproduce: {reproduce_command(c)}",
                       time.perf_counter() - t0, trajectory=out.result)
    return _judge_trajectory(c, column, bugs, out.result, t0)


def decide_captured(c: Case, column: str, traj, judge_fn) -> Outcome:
    """A run captured elsewhere (a user's own ranks, ``harness.watch``) decided exactly as a case the gate
    ran: against the intended oracle, then against the models of the bugs registered for its pipeline,
    with ``judge_fn`` (``verdict.judge``'s signature) in place of ``verdict.judge``."""
    token = JUDGE.set(judge_fn)
    try:
        return _judge_trajectory(c, column, bugs_for(c, patched=column == "patched"), traj, time.perf_counter())
    finally:
        JUDGE.reset(token)


def _judge_failure(c: Case, column: str, bugs, refusals, exc: CaseFailure, t0: float) -> Outcome:
    """A case whose ranks failed: passed where it is the patched runtime's refusal, xfailed where it is
    exactly a crash bug's crash (a rank killed by a signal, a C++ assert in an op, is a crash too: its
    report carries faulthandler's stack), else an error."""
    text = str(exc)
    crashes = [b for b in bugs if b.crash is not None]
    if refusals and isinstance(exc, RankFailed) and all(b.refusal_matches(exc.details) for b in refusals):
        names = ", ".join(b.id for b in refusals)
        why = next(line.strip() for line in text.splitlines() if refusals[0].refused_when_patched in line)
        return Outcome(c, column, "passed", [], f"{c.name}: refused by the patched runtime as its fix for "
                       f"{names} requires:\n  {why[:400]}", time.perf_counter() - t0, refused=True,
                       strength="refusal")
    if crashes and isinstance(exc, (RankFailed, RankDied)) and any(b.crash_matches(exc.details) for b in crashes):
        hit = [b.id for b in crashes if b.crash_matches(exc.details)]
        return Outcome(c, column, "xfailed", hit, f"{c.name}: crashed exactly as {', '.join(hit)} predicts\n"
                       + text[-1500:], time.perf_counter() - t0, strength="crash")
    # No bug id: only a matched crash signature names a bug; the ones the case triggers are said in words.
    triggered = ", ".join(b.id for b in bugs)
    expected = f"\n  (the case triggers {triggered}; no crash signature of theirs matched)" if bugs else ""
    return Outcome(c, column, "error", [], text + expected, time.perf_counter() - t0, strength=None)


def _judge_trajectory(c: Case, column: str, bugs, traj, t0: float) -> Outcome:
    """A case that ran: judged against the intended oracle; where bugs are expected, (a) they must show
    there and (b) the run must match their models (``_judge_models``)."""
    ids = [b.id for b in bugs]
    crashes = [b for b in bugs if b.crash is not None]
    bits = traj.judged_bits()  # once: the bug model's judge of the same run keys on them too
    verdict = judged(c, traj, bits=bits)
    problems, extra_msgs = _problems(c, verdict, traj)
    seconds = time.perf_counter() - t0
    swapped = traj.swapped_bytes if c.offload == "nvme" else None
    if crashes:
        return Outcome(c, column, "xpassed" if not problems else "failed", ids,
                       f"{c.name}: expected the crash of {', '.join(b.id for b in crashes)}, but the case ran\n"
                       + "\n".join(([] if verdict.passed else [verdict.message()]) + extra_msgs),
                       seconds, verdict, problems, swapped, traj)
    if not bugs:
        status = "failed" if problems else ("unjudged" if verdict.unjudged else "passed")
        message = "\n".join(([] if verdict.passed else [verdict.message()]) + extra_msgs) or verdict.message()
        tried = _try_candidates(c, column, [], traj, bits, verdict, extra_msgs, swapped, t0, problems)
        return tried or Outcome(c, column, status, ids, message, seconds, verdict, problems, swapped, traj,
                                strength="unjudged" if status == "unjudged" else "full")
    named = set().union(*(b.quantities for b in bugs))
    # (a) the bugs must show against the intended oracle, in the quantities they name
    if not any(q in named for _, q in problems):
        stale = f"expected bug(s) {', '.join(ids)} did not show: the bug registry is stale for {c.name}"
        if not problems:
            return Outcome(c, column, "xpassed", ids, stale, seconds, verdict, problems, swapped, traj)
        # something else diverged: that is a failure, whatever the registry expected (an xpass would hide it)
        tried = _try_candidates(c, column, [], traj, bits, verdict, extra_msgs, swapped, t0, problems)
        return tried or Outcome(c, column, "failed", ids, f"{c.name}: diverges where no expected bug predicts "
                                f"({stale})\n" + "\n".join([verdict.message()] + extra_msgs), seconds, verdict,
                                problems, swapped, traj)
    o = _judge_models(c, column, bugs, traj, bits, verdict, extra_msgs, swapped, t0)
    if o.status == "failed":
        return _try_candidates(c, column, bugs, traj, bits, verdict, extra_msgs, swapped, t0, problems) or o
    return o


def _try_candidates(c: Case, column: str, bugs, traj, bits: RunBits, verdict: Verdict, extra_msgs: list, swapped,
                    t0: float, problems) -> Outcome | None:
    """On a tree where they were not measured, try the bugs whose model (or crash) could explain the
    divergence (``bugs.candidates_for``): each alone, then all together, beside the expected ``bugs``. The
    first set whose models leave nothing at the usual tolerances names its bugs; none: None."""
    if not problems:
        return None
    seen = {q for _, q in problems}
    cands = [v for b in candidates_for(c, patched=column == "patched")
             if b.crash is None and b.quantities & seen and b not in bugs
             for v in b.with_variants() if v.model(c) is not None]
    for extra in [[b] for b in cands] + ([cands] if len(cands) > 1 else []):
        try:
            o = _judge_models(c, column, bugs + extra, traj, bits, verdict, extra_msgs, swapped, t0)
        except ValueError:  # two models that disagree on a convention cannot both hold
            continue
        if o.status in ("xfailed", "unjudged"):
            tried = ", ".join(b.id for b in extra)
            return replace(o, message=f"{o.message}\n  ({tried}: not measured on this tree; named because its "
                                      f"model matches at full strength)")
    return None


def _judge_models(c: Case, column: str, bugs, traj, bits: RunBits, verdict: Verdict, extra_msgs: list, swapped,
                  t0: float) -> Outcome:
    """(b) DeepSpeed must match the bug models at full strength: any divergence the models leave, in a
    quantity no bug excuses by name, fails the case."""
    ids = [b.id for b in bugs]
    modelled = [b for b in bugs if b.model is not None and b.model(c) is not None]
    unmodelled = [b for b in bugs if b not in modelled]
    changes = model_changes(c, modelled)
    mverdict = verdict if not changes else judged(c, traj, bug_model(changes), bits=bits)
    seconds = time.perf_counter() - t0
    mproblems, mmsgs = _problems(c, mverdict, traj)
    excused = set().union(*(b.quantities - NUMERIC for b in modelled), *(b.quantities for b in unmodelled))
    residual = [p for p in mproblems if p[1] not in excused]
    model_txt = ", ".join(f"{b.label}: {b.model(c) or 'numbers unchanged'}" for b in modelled)
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
    if mverdict.unjudged:  # the model matched only where there was a reference: that is not an xfail
        said = "\n".join(f"  cannot judge: {u.unjudged}" for u in mverdict.unjudged)
        return Outcome(c, column, "unjudged", ids, f"{c.name}: cannot judge {len(mverdict.unjudged)} captured "
                       f"quantity(ies); the rest {message[len(c.name) + 2:]}\n{said}", seconds, mverdict, [],
                       swapped, traj, strength="unjudged", intended=verdict)
    return Outcome(c, column, "xfailed", ids, message, seconds, verdict, [], swapped, traj, strength=strength,
                   model_verdict=mverdict)


def record(store, o: Outcome) -> None:

    if o.verdict is None:
        store.add(results.error_record(o.case, column=o.column, message=o.message, seconds=o.seconds,
                                       bug_ids=o.bug_ids, status=o.status, strength=o.strength))
        return
    # the bug model's verdict decided an xfail (model_verdict) and a failure that model leaves (verdict)
    model = o.model_verdict if o.model_verdict is not None else (o.verdict if o.intended is not None else None)
    rec, maps = results.from_verdict(o.verdict, column=o.column, status=o.status, bug_ids=o.bug_ids,
                                     seconds=o.seconds, message=o.message, swapped_bytes=o.swapped_bytes,
                                     strength=o.strength, model_verdict=model, intended=o.intended)
    store.add(rec, maps)
