"""Hypothesis over whole configs of the space (``harness.catalog.space``): a row draws one value for every knob
(``cases.fuzz.space_strategies``), becomes a gate case as the covering array's rows do (``pairs.case_of``),
runs on the session's rank pool on every column of the gate, and must come out as the gate requires
(``harness.gate.decide.evaluate``: passed, skipped by design, or xfailed exactly as a registered bug's model
predicts; never one of ``harness.report.html.BAD_STATUSES``).

Why beside the covering array: the array holds every pair (CI) or triple (``--full``) of values once; a bug
that needs four settings at once, or a pair only in one context, is met there only by chance. The search
draws whole configs, climbs the worst normalised error (``hypothesis.target``), and shrinks a failure toward
the baseline config, so the knobs its report names are the ones the failure needs.

``test_fuzz_space_finds_a_two_knob_mutant`` is the search's self-check: under a catalogued mutant that only a
combination of two knobs exposes, the search must kill it and shrink the kill to a row whose every
non-default knob is needed.

Profiles: ``MUON_FUZZ_PROFILE=ci|dev|nightly`` (``support.py``); the ci profile runs a few seeded examples and
does not shrink (the nightly replays the stored failure from the example database and shrinks it).
"""
from __future__ import annotations

import collections
import math
import time

import pytest
from hypothesis import HealthCheck, Phase, event, find, given, note, settings, target
from hypothesis.errors import NoSuchExample

from cases.fuzz import space_strategies as SS
from cases.fuzz import support
from harness.catalog import space
from harness.gate import decide
from harness.judge.verdict import reproduce_command
from harness.registry.mutants import MUTANTS
from harness.report.html import BAD_STATUSES

pytestmark = pytest.mark.fuzz

# The ci profile's share: a few rows, each on every column, within about a minute on 2 cores.
CI = {"max_examples": 4, "phases": (Phase.explicit, Phase.reuse, Phase.generate)}
# Exposed only where ZeRO-3 meets gradient accumulation: two knobs away from the baseline row.
MUTANT = "ns-per-micro-batch"
MESSAGE_LINES = 12  # of each bad outcome's message in a failure report; its reproducer has the rest


class UnexpectedOutcome(AssertionError):
    """A row whose outcome on some column the gate counts as bad."""


# One exception type per bad status: Hypothesis tells failures apart by type and line, so a crash is shrunk
# as a crash and never into another row's divergence.
FAILURES = {s: type(f"Unexpected{s.title()}", (UnexpectedOutcome,), {"__module__": __name__}) for s in BAD_STATUSES}


# --------------------------------------------------------------------------------------------------
# judging a row as the gate does


def _new_pool(pool_manager, case) -> bool:
    pools = getattr(pool_manager, "pools", {})
    key = (case.world_size, case.compiled)
    return key not in pools or pools[key].broken


def _ratio(o) -> float:
    """The worst normalised error of what decided a good outcome: the bug model's verdict for an xfail
    (the intended oracle's is the bug's own divergence), else the verdict; none for a refusal or a skip."""
    v = o.model_verdict if o.model_verdict is not None else o.verdict
    return v.worst_ratio if v is not None else 0.0


def judge_row(pool_manager, row: dict, seed: int, worst: support.Worst, *, mutant: str | None = None,
              columns=None) -> list:
    """The gate's outcome of a row on each column (all of the gate's by default), timed into ``worst``."""
    case = SS.row_case(row, seed).replace(mutant=mutant)
    outcomes = []
    for col in columns or decide.columns():
        new = _new_pool(pool_manager, case)
        t0 = time.perf_counter()
        o = decide.evaluate(case, col, pool_manager)
        worst.timed(case, o.seconds, max(0.0, time.perf_counter() - t0 - o.seconds), 0.0, new)
        outcomes.append(o)
    bad = [o for o in outcomes if o.status in BAD_STATUSES]
    ratio = math.inf if bad else max(map(_ratio, outcomes), default=0.0)
    worst.update(case, ratio, "; ".join(f"{o.column}: {o.status}: {o.message.splitlines()[0][:200]}"
                                        for o in (bad or outcomes)))
    return outcomes


def failure_report(row: dict, bad) -> str:
    """What a failing row needs and how to rerun it: each bad column's status and first lines, the knobs
    the row sets away from the baseline, and one reproducer line per bad column."""
    lines = []
    for o in bad:
        msg = o.message.splitlines()
        lines += [f"[{o.column}] {o.status}"] + msg[:MESSAGE_LINES] + (["  ..."] if len(msg) > MESSAGE_LINES else [])
    lines.append(f"non-default knobs: {SS.non_default(row)}")
    lines += [f"reproduce ({o.column}): {reproduce_command(o.case)}" for o in bad]
    return "\n".join(lines)


def assert_as_expected(row: dict, outcomes) -> None:
    """Raise, typed by the first bad column's status, unless every column's outcome is good for the gate."""
    bad = [o for o in outcomes if o.status in BAD_STATUSES]
    if bad:
        raise FAILURES[bad[0].status](failure_report(row, bad))


def bad_statuses(outcomes) -> list[str]:
    return [o.status for o in outcomes if o.status in BAD_STATUSES]


# --------------------------------------------------------------------------------------------------
# the search


@pytest.mark.pipeline
@support.fuzz_settings(ci=CI)
@given(row=SS.rows())
def test_fuzz_space(row, pool_manager, seed):
    worst = support.tracker("test_fuzz_space")
    case = SS.row_case(row, seed)
    support.record_events(case)
    note(f"non-default knobs: {SS.non_default(row)}\nreproduce (stock): {reproduce_command(case)}")
    outcomes = judge_row(pool_manager, row, seed, worst)
    for o in outcomes:
        event(f"{o.column}: {o.status}")
    good = [o for o in outcomes if o.status not in BAD_STATUSES]
    target(support.finite_score(max(map(_ratio, good), default=0.0)), label=support.TARGET_LABEL)
    assert_as_expected(row, outcomes)


# --------------------------------------------------------------------------------------------------
# self-check against a catalogued mutant


def kills(pool_manager, row: dict, seed: int, worst: support.Worst, column: str) -> bool:
    """The kill matrix's rule (``harness.selfcheck.kill_matrix``) on one row: bad under the mutant, good
    without it (a row bad on its own says nothing about the mutant)."""
    if not bad_statuses(judge_row(pool_manager, row, seed, worst, mutant=MUTANT, columns=[column])):
        return False
    return not bad_statuses(judge_row(pool_manager, row, seed, worst, columns=[column]))


@pytest.mark.pipeline
@pytest.mark.mutate
def test_fuzz_space_finds_a_two_knob_mutant(pool_manager, seed):
    assert MUTANT in MUTANTS, f"harness.registry.mutants no longer catalogues {MUTANT!r}"
    predicted = MUTANTS[MUTANT].expected
    assert not predicted(SS.row_case(SS.baseline(), seed)), f"{MUTANT} shows on the baseline row: nothing to search"
    column = decide.columns()[0]  # stock: the column every tree has
    worst = support.Worst()
    s = support.search_settings(derandomize=True)
    try:
        shrunk = find(SS.rows(), lambda r: kills(pool_manager, r, seed, worst, column), settings=s)
    except NoSuchExample:
        pytest.fail(f"profile {support.active_profile_name()}: {MUTANT} killed by no row in {s.max_examples} "
                    f"examples; {worst.describe()}")
    case = SS.row_case(shrunk, seed).replace(mutant=MUTANT)
    report = (f"shrunk to non-default knobs {SS.non_default(shrunk)}\n  reproduce: {reproduce_command(case)}\n"
              f"--- {worst.describe_split()}")
    assert predicted(case), f"a kill {MUTANT}'s catalogue entry does not predict:\n{report}"
    for name in SS.non_default(shrunk):
        reset = {**shrunk, name: space.by_name()[name].domain[0]}
        needed = SS.forbidden_row(reset) or not kills(pool_manager, reset, seed, worst, column)
        assert needed, f"{name} is not needed: the row without it is still a kill\n{report}"
    print(report)


# --------------------------------------------------------------------------------------------------
# the strategy, without DeepSpeed

DRAWS = 300


def draw_rows(strategy, n: int) -> list[dict]:
    # filter_too_much stays on: rejected rows would trip it
    return support.draw(strategy, n, suppress=(HealthCheck.too_slow,))


@pytest.fixture(scope="module")
def drawn() -> list[dict]:
    return draw_rows(SS.rows(), DRAWS)


def test_rows_set_every_knob_and_break_no_rule(drawn):
    names = [k.name for k in space.knobs()]
    assert all(list(r) == names for r in drawn)
    broken = [SS.non_default(r) for r in drawn if SS.forbidden_row(r)]
    assert not broken, f"{len(broken)} drawn rows break a rule of the space, first: {broken[0]}"


def test_every_value_a_row_can_hold_is_drawn(drawn):
    """A value no drawn row holds is one the search never tries: each must be forbidden with every other knob
    at the baseline's first value the rules allow (``_alone`` is that row), else the strategy misses it."""
    seen = collections.defaultdict(set)
    for r in drawn:
        for name, v in r.items():
            seen[name].add(repr(v))
    missing = [(k.name, v) for k in space.knobs() for v in k.domain
               if repr(v) not in seen[k.name] and not SS.forbidden_row(_alone(k.name, v))]
    assert not missing, f"never drawn in {len(drawn)} rows, though a row can hold them: {missing}"


def _alone(name: str, value) -> dict:
    return {**SS.baseline(), name: value}


def test_a_row_shrinks_to_the_baseline():
    assert find(SS.rows(), lambda r: True, settings=settings(database=None)) == SS.baseline()


@pytest.mark.parametrize("knob", [k for k in space.knobs() if not SS.forbidden_row(_alone(k.name, k.domain[-1]))],
                         ids=lambda k: k.name)
def test_a_row_needing_one_value_shrinks_to_that_value_alone(knob):
    """Hypothesis shrinks a failure to the baseline plus what it needs: a row that must hold one value of one
    knob shrinks to exactly that knob set (where the rules allow it alone)."""
    value = knob.domain[-1]
    # derandomized: a shrink that depends on the draw order of the random start could stop at a local minimum
    shrunk = find(SS.rows(), lambda r: repr(r[knob.name]) == repr(value),
                  settings=settings(database=None, derandomize=True))
    assert SS.non_default(shrunk) == {knob.name: value}


def test_a_knob_added_to_the_space_is_drawn(monkeypatch):
    extra = space.Knob("zero_optimization.round_robin_gradients", (True,), "probe", ("probe.key",))
    monkeypatch.setattr(space, "CONFIG_KNOBS", space.CONFIG_KNOBS + (extra,))
    space.by_name.cache_clear()
    try:
        rows = draw_rows(SS.rows(), 50)
    finally:
        monkeypatch.undo()
        space.by_name.cache_clear()
    assert {repr(r.get(extra.name, "not drawn")) for r in rows} == {repr(v) for v in extra.domain}


# --------------------------------------------------------------------------------------------------
# the gate's rule, without DeepSpeed


def _outcome(status: str, column: str = "stock"):
    return decide.Outcome(SS.row_case(SS.baseline()).replace(patched=column == "patched"), column, status, [],
                          f"{status} message", 0.0)


@pytest.mark.parametrize("status", BAD_STATUSES)
def test_a_bad_status_on_any_column_fails_with_its_reproducer(status):
    row = {**SS.baseline(), "world_size": 3}
    with pytest.raises(FAILURES[status]) as info:
        assert_as_expected(row, [_outcome("passed"), _outcome(status, "patched")])
    text = str(info.value)
    assert "[patched] " + status in text and "non-default knobs: {'world_size': 3}" in text
    assert "reproduce (patched): " in text and "-m harness run --case '" in text and "[stock]" not in text


@pytest.mark.parametrize("status", ["passed", "xfailed", "skipped"])
def test_the_gates_good_statuses_pass(status):
    assert status not in BAD_STATUSES
    assert_as_expected(SS.baseline(), [_outcome(status), _outcome(status, "patched")])
