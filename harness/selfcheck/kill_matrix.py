"""The mutation kill matrix (parent side): run the kill cases unmutated, then under every mutant of
``harness.registry.mutants``, and tabulate which case killed which mutant against the mutants' predictions.

Kept apart from ``harness.registry.mutants`` because the mutants are installed inside the ranks while this
driver starts and drives them (through a launcher); one module doing both made an import cycle
(``ds_run -> patches -> known_bugs -> pool -> ds_run``).

Usage: ``python -m harness mutate [--mutant NAME] [--only SUBSTR] [--stock] [--case NAME] [-v]``.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from harness.case.spec import Case, ParamShape
from harness.registry.mutants import MUTANTS
from harness.registry.mutants import _wd as case_weight_decay  # the mutants' own reading of a case
from harness.launch.launcher import CaseFailure, Launcher
from harness.catalog.matrix import GROUP_WD, user_groups
from harness.case.scenarios import pipeline_case
from harness.catalog.matrix import SCHEDULE_STEPS, scheduled
from harness.catalog.matrix import bf16opt_cases
from harness.catalog.matrix import subgroup_cases
from harness.catalog.matrix import knob_cases
from harness.catalog.matrix import gather_cases
from harness.catalog.matrix import inmem_cases
from harness.catalog.matrix import unswapped_grad_cases
from harness.catalog.matrix import dpgroup_cases
from harness.catalog.matrix import compiled_cases
from harness.catalog.matrix import local_overflow_cases
from harness.catalog.models import kill_cases as model_kill_cases
from harness.catalog.departures import departure_cases
from harness.launch.pool import PoolManager
from harness.catalog.matrix import gate_cases


def _groups_kill_case() -> Case:
    """ZeRO-2 with the user's param groups (harness.catalog.matrix.user_groups) and weight decay on."""

    c = pipeline_case(2, "none", "fp32", 2, steps=3, weight_decay=GROUP_WD)
    return c.replace(name=c.name + "-groups", groups=user_groups(2, "none"))


def _schedule_kill_case() -> Case:
    """ZeRO-1 under the linear WarmupLR of the matrix (harness.catalog.matrix.SCHEDULES)."""

    return scheduled(pipeline_case(1, "none", "fp32", 2, steps=SCHEDULE_STEPS), "warmup")


def _bf16_route_kill_case() -> Case:
    """ZeRO-1 bf16 with fp32 gradient accumulation: the BF16_Optimizer route (harness.catalog.matrix.bf16opt_cases)."""

    return next(c for c in bf16opt_cases() if c.name == "z1-none-bf16-ws1-gad32")


def _subgroups_kill_case() -> Case:
    """ZeRO-3 with one sub-group per matrix (harness.catalog.matrix.subgroup_cases)."""

    return next(c for c in subgroup_cases() if c.name == "z3-none-fp32-ws2-subgroups")


def _knob_kill_case() -> Case:
    """ZeRO-3 with one reduce bucket per parameter (harness.catalog.matrix.knob_cases)."""

    return next(c for c in knob_cases() if c.name == "z3-none-bf16-ws2-knob-buckets")


def _gather_kill_case() -> Case:
    """ZeRO-1 CPU offload with lowered all-gather chunk and cache limits (harness.catalog.matrix.gather_cases)."""

    return next(c for c in gather_cases() if c.name == "z1-cpu-fp32-ws2-gather")


def _resident_kill_case() -> Case:
    """ZeRO-3 NVMe (pipelined) with the Muon momentum kept in memory (harness.catalog.matrix.inmem_cases): the
    resident buffer's promises (harness.rank.resident) on a swapped sub-group."""

    return next(c for c in inmem_cases() if c.name == "z3-nvme-pipe-fp32-ws2-inmem")


def _unswapped_grads_kill_case() -> Case:
    """ZeRO-3 NVMe at one rank with a swapped Muon sub-group of unswapped gradient fragments only
    (harness.catalog.matrix.unswapped_grad_cases)."""

    return next(c for c in unswapped_grad_cases() if c.name == "z3-nvme-part-fp32-ws1-unswappedgrads")


def _dpgroup_kill_case() -> Case:
    """ZeRO-1 at world size 4 as 2 model-parallel x 2 data-parallel ranks (harness.catalog.matrix.dpgroup_cases)."""

    return next(c for c in dpgroup_cases() if c.name == "z1-none-fp32-ws4-mp2")


def _compiled_kill_case() -> Case:
    """A compiled ZeRO-1 case with float64 Newton-Schulz (harness.catalog.matrix.compiled_cases)."""

    return next(c for c in compiled_cases() if c.name == "z1-none-fp32-ws2-compiled-hpns")


def _local_overflow_kill_case() -> Case:
    """ZeRO-2 with one Adam vector's gradient overflowing on the would-be growth step
    (harness.catalog.matrix.local_overflow_cases): a skipped step that still holds clean Muon momentum."""

    return next(c for c in local_overflow_cases() if c.name == "z2-none-fp16-ws2-ga2-ovfloc-adaminf-growth")


def default_kill_cases() -> list[Case]:
    """Small cases (world size 1-2, and the model-parallel case at 4) that together kill every mutant."""
    from harness.case.scenarios import TINY_PARAMS, pipeline_case

    heads = TINY_PARAMS + (ParamShape("attn.qkv.weight", (8, 6), num_heads=2),)
    cases = [
        pipeline_case(1, "none", "fp16", 1, steps=3, clip=0.05, params=heads),
        pipeline_case(2, "none", "fp32", 2, steps=3),
        pipeline_case(3, "none", "fp32", 2, steps=3, grad_accum=2),
        pipeline_case(2, "cpu", "fp16", 2, steps=3),
        pipeline_case(3, "cpu", "bf16", 2, steps=3),
        pipeline_case(3, "cpu", "fp32", 1, steps=3, weight_decay=0.1).replace(checkpoint_at=1),
        pipeline_case(0, "none", "fp32", 2, steps=3),  # stage 0: no ZeRO optimizer at all
        _groups_kill_case(),
        _schedule_kill_case(),
        _bf16_route_kill_case(),
        _subgroups_kill_case(),
        _knob_kill_case(),
        _gather_kill_case(),
        _resident_kill_case(),
        _unswapped_grads_kill_case(),
        _dpgroup_kill_case(),
        _compiled_kill_case(),
        _local_overflow_kill_case(),
    ]
    out = []
    for c in cases:
        extra = ("-heads" if any(p.num_heads for p in c.params) else "") + \
                ("-wd" if case_weight_decay(c) and not c.groups else "") + \
                (f"-ckpt{c.checkpoint_at}" if c.checkpoint_at else "")
        out.append(c.replace(name=c.name + extra))

    return out + model_kill_cases() + [c for c in departure_cases() if "MUON-BY-NAME" in (c.departs or ())]


@dataclass
class KillRow:
    mutant: str
    case: str
    killed: bool | None  # None: baseline failed, not counted
    expected: bool
    detail: str = ""
    seconds: float = 0.0


@dataclass
class KillMatrix:
    cases: list[str]
    mutants: list[str]
    baseline: dict[str, bool] = field(default_factory=dict)  # case -> passes unmutated (patched)
    rows: list[KillRow] = field(default_factory=list)
    seconds: float = 0.0

    def killed_by(self, mutant: str) -> list[str]:
        return [r.case for r in self.rows if r.mutant == mutant and r.killed]

    @property
    def kill_rate(self) -> float:
        return sum(bool(self.killed_by(m)) for m in self.mutants) / max(1, len(self.mutants))

    def surprises(self) -> list[KillRow]:
        """Cells where a kill was expected and not seen, or seen and not expected."""
        return [r for r in self.rows if r.killed is not None and r.killed != r.expected]

    def table(self) -> str:
        short = [f"c{i + 1}" for i in range(len(self.cases))]
        width = max(len(m) for m in self.mutants) if self.mutants else 10
        lines = ["cases: " + "; ".join(f"{s}={n}" for s, n in zip(short, self.cases)),
                 "baseline (unmutated): " + " ".join(
                     f"{s}={'pass' if self.baseline.get(n) else 'FAIL'}" for s, n in zip(short, self.cases)),
                 "legend: K killed (expected), k killed (not predicted), . survived, ! survived although "
                 "predicted, - baseline failed, ~ not run (compiled case: only COMPILED_MUTANTS; model-parallel "
                 "case: only DPGROUP_MUTANTS)",
                 f"{'mutant':<{width}} " + " ".join(f"{s:>3}" for s in short) + "  killed"]
        cell = {(r.mutant, r.case): r for r in self.rows}
        for m in self.mutants:
            marks = []
            for n in self.cases:
                r = cell.get((m, n))
                if r is not None and r.detail in (NOT_RUN, NOT_RUN_DPGROUP):
                    marks.append("~")
                elif r is None or r.killed is None:
                    marks.append("-")
                elif r.killed:
                    marks.append("K" if r.expected else "k")
                else:
                    marks.append("!" if r.expected else ".")
            lines.append(f"{m:<{width}} " + " ".join(f"{x:>3}" for x in marks)
                         + f"  {'yes' if self.killed_by(m) else 'NO'}")
        n_killed = sum(bool(self.killed_by(m)) for m in self.mutants)
        lines.append(f"kill rate: {n_killed}/{len(self.mutants)} = {100 * self.kill_rate:.0f}% "
                     f"({len(self.cases)} cases, {self.seconds:.0f} s)")
        s = self.surprises()
        if s:
            lines.append("expectation mismatches: " + ", ".join(f"{r.mutant}@{r.case}" for r in s))
        return "\n".join(lines)


NOT_RUN = "not run (compiled case: only the compiled path's mutants)"
SAME_AS_BASELINE = "pass (every bit the judge reads is the passing baseline's)"
COMPILED_MUTANTS = ("compiled-aspect-truncated", "compiled-nesterov-dropped")
# A model-parallel case (world size 4) runs only the mutants about the data-parallel group -- its
# own, and those of the partition layout and the average it changes -- (~1.5 s each here); the
# world-size 1-2 cases show every other mutant's reach, at a quarter of the ranks.
NOT_RUN_DPGROUP = "not run (model-parallel case: only the data-parallel group's mutants)"
DPGROUP_MUTANTS = ("dp-average-over-world", "rank-contribution-dropped", "partition-slice-muon",
                   "padded-tail-misslice")


def _skip_reason(c: Case, m: str) -> str | None:
    """Why mutant ``m`` is not run on case ``c`` (its baseline aside), or None when it is."""
    if c.compiled and m not in COMPILED_MUTANTS:
        # A compiled case retraces under dynamo (a few seconds): it runs only the mutants of the
        # compiled path; the eager cases show every other mutant's reach.
        return NOT_RUN
    if c.model_parallel > 1 and m not in DPGROUP_MUTANTS:
        return NOT_RUN_DPGROUP
    return None


def planned_runs(cases, names) -> list[tuple[Case, str | None]]:
    """The runs a kill matrix makes, in order: each case unmutated (mutant None), then each mutant on
    each case it runs on (``_skip_reason``, as ``_run_matrix`` decides), for the gate's estimate of its
    cost (``selfcheck_cost``); a case whose baseline fails skips its mutant runs, which only shortens it."""
    runs: list[tuple[Case, str | None]] = [(c, None) for c in cases]
    runs += [(c, m) for m in names for c in cases if _skip_reason(c, m) is None]
    return runs


def selfcheck_cost(kind: str, costs=None) -> float:
    """Seconds the gate's ``kind`` ("patched" | "stock") self-check is expected to take: as last measured
    (``data/case_times.json``), else each of its runs at one case-column of its case (half of
    ``harness.launch.shard``'s two-column cost; that overestimates, since a mutated run is judged once)."""
    from harness.launch import shard as sharding  # late: the recorded costs live with the sharding

    recorded = sharding.load_selfcheck_times().get(kind) if costs is None else None
    if recorded is not None:
        return recorded
    cases, names = (default_kill_cases(), list(MUTANTS)) if kind == "patched" else \
        (stock_kill_cases(), list(STOCK_KILL_MUTANTS))
    costs = sharding.costs_for(cases) if costs is None else costs
    return sum(costs[c.name] / 2 for c, _ in planned_runs(cases, names))


def _run_matrix(cases, names, manager, baseline, outcome, progress) -> KillMatrix:
    """Baselines first, then every mutant on every case whose baseline is good. ``baseline(case)``
    says whether the unmutated case is good; ``outcome(case)`` gives (killed, detail) for a mutated
    one. ``manager``: a launcher (a ``PoolManager`` is made and closed if None). ``progress(case,
    mutant, text)``, where given, hears of each run as it ends (mutant None: a baseline)."""

    own = manager is None
    manager = manager or PoolManager()
    km = KillMatrix(cases=[c.name for c in cases], mutants=list(names))
    t_all = time.perf_counter()
    try:
        for c in cases:
            km.baseline[c.name], detail = baseline(c, manager)
            if progress:
                progress(c, None, f"baseline {c.name}: {detail}")
        for m in km.mutants:
            for c in cases:
                expected = MUTANTS[m].expected(c)
                skipped = "baseline fails" if not km.baseline.get(c.name) else _skip_reason(c, m)
                if skipped:
                    km.rows.append(KillRow(m, c.name, None, expected, skipped))
                    continue
                t0 = time.perf_counter()
                killed, detail = outcome(c.replace(mutant=m), manager)
                km.rows.append(KillRow(m, c.name, killed, expected, detail, time.perf_counter() - t0))
                if progress:
                    progress(c, m, f"{m} x {c.name}: {'killed' if killed else 'survived'} ({detail})")
    finally:
        km.seconds = time.perf_counter() - t_all
        if own:
            manager.close()
    return km


def kill_matrix(cases, mutants=None, manager: Launcher | None = None, *, patched: bool = True,
                progress=None) -> KillMatrix:
    """Run every case unmutated (the baseline), then under every mutant; a mutant is killed by a case
    when the verdict fails there and the case passes unmutated. ``patched`` runs everything on the
    patched runtime so the baseline is clean."""
    from harness.judge.verdict import judge  # late: keeps this module numpy-free at import

    passing_bits: dict[str, object] = {}  # a passing baseline's ``judged_bits``, by case without its mutant

    def judged(case, manager, until_failure: bool = False):
        try:
            traj = manager.run(case).result
        except CaseFailure as e:
            return False, "crashed: " + str(e).splitlines()[0][:160]
        key, bits = case.replace(mutant=None).to_json(), traj.judged_bits()
        if case.mutant is not None and key in passing_bits and passing_bits[key].same(bits):
            # A mutant that left every bit the judge reads as the passing baseline's has that verdict:
            # the judge is a pure function of the case (it never reads the mutant) and those bits.
            return True, SAME_AS_BASELINE
        v = judge(case, traj, until_failure=until_failure)
        if case.mutant is None and v.passed:
            passing_bits[key] = bits
        first = v.first
        return v.passed, (f"{first.param}.{first.quantity}@{first.step} x{first.worst_ratio:.3g}"
                          if first is not None else "pass")

    def baseline(c, manager):
        return judged(c.replace(patched=patched, mutant=None), manager)

    def outcome(c, manager):  # whether and where first: a verdict that stops at its first divergent step
        passed, detail = judged(c.replace(patched=patched), manager, until_failure=True)
        return not passed, detail

    names = list(mutants) if mutants is not None else list(MUTANTS)
    return _run_matrix(cases, names, manager, baseline, outcome, progress)


STOCK_KILL_MUTANTS = ("nesterov-dropped", "momentum-beta-offset-1e-3", "rank-contribution-dropped")
# Stock xfail cases of the CI gate, one per bug model combination that is cheap to run (world size 2,
# so a dropped rank reaches each): DSM-001 on ZeRO-1 and on ZeRO-3 offload, DSM-001+004 across an
# overflow, DSM-003 across a growth step on offload, DSM-001 as the 16-bit update store of ZeRO-3 comm32,
# DSM-014/015/016 without ZeRO (fp16 and bf16), DSM-013 on the BF16_Optimizer route with clipping.
STOCK_KILL_CASES = ("z1-none-bf16-ws2-ga2-clip0.05-standard", "z3-cpu-bf16-ws2-heads", "z1-none-fp16-ws2-overflow",
                    "z1-cpu-fp16-ws2-growth", "z3-none-bf16-ws2-comm32", "z0-none-fp16-ws2",
                    "z0-none-bf16-ws2-ga2-standard", "z1-none-bf16-ws2-ga2-clip0.05-gad32")


def stock_kill_cases() -> list[Case]:

    by_name = {c.name: c for c in gate_cases()}
    return [by_name[n] for n in STOCK_KILL_CASES]


def stock_kill_matrix(cases, mutants=STOCK_KILL_MUTANTS, manager=None, progress=None) -> KillMatrix:
    """The kill matrix on the stock column, with the gate's decision (``harness.gate.decide.evaluate``): the
    baseline of a case is good when it passes or is an xfail whose divergence matched its bug model;
    a mutant kills a case when the case then fails (or errors, or the expected bug no longer shows)."""
    from harness.gate.decide import evaluate  # late: keeps this module numpy-free at import

    def baseline(c, manager):
        o = evaluate(c.replace(mutant=None), "stock", manager)
        return o.status in ("passed", "xfailed"), o.status

    def outcome(c, manager):
        o = evaluate(c, "stock", manager)
        return (o.status in ("failed", "error", "xpassed"),
                o.status + (": " + o.message.splitlines()[0][:160] if o.message else ""))

    return _run_matrix(cases, mutants, manager, baseline, outcome, progress)


def run(mutants: list[str] | None = None, only: str | None = None, stock: bool = False,
        case_names: list[str] | None = None, verbose: bool = False) -> int:
    """``python -m harness mutate``: the default kill set (or ``case_names``) against every mutant; print the
    table and the kill rate. Returns 0 when every mutant is killed and every prediction held, 2 on an
    unknown case name."""
    if case_names:
        from harness.catalog.matrix import gate_cases

        by_name = {c.name: c for c in gate_cases()}
        unknown = [n for n in case_names if n not in by_name]
        if unknown:
            print(f"error: unknown gate case(s): {unknown}", file=sys.stderr)
            return 2
        cases = [by_name[n] for n in case_names]
    elif stock:
        cases = [c for c in stock_kill_cases() if not only or only in c.name]
    else:
        cases = [c for c in default_kill_cases() if not only or only in c.name]
    progress = (lambda _c, _m, text: print(text, flush=True)) if verbose else None
    if stock:
        km = stock_kill_matrix(cases, mutants or STOCK_KILL_MUTANTS, progress=progress)
    else:
        km = kill_matrix(cases, mutants, patched=True, progress=progress)
    print(km.table())
    return 0 if km.kill_rate == 1.0 and not km.surprises() else 1
