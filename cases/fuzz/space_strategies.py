"""Hypothesis strategies over whole rows of the config space (``harness.catalog.space``): one value for every
knob, read from the space at draw time, so a knob added there is drawn with no edit here.

Why each knob is drawn as an index into its domain: the domain's first entry is the baseline (the key left
out, so DeepSpeed's own default; or the harness's default scenario), and Hypothesis shrinks an integer toward
0, so a failing row shrinks toward the baseline config and the knobs left at other values are the ones the
failure needs.

Why a forbidden index falls back to the lowest allowed one instead of rejecting the row: the space's rules
(``space.RULES``) forbid most rows that set many knobs at random (per-head tagging without heads, clipping
with the norm switched off, ...), so a whole-row filter would discard nearly every draw. Drawing the knobs in
the space's order (most constrained first) and checking each rule as soon as its last key has a value keeps
every draw; a value the rules refuse becomes the most default value they allow, which also keeps a shrunk
index meaning the same value wherever the rules allow it. A row with no allowed value for some knob is
rejected; were that common, Hypothesis's filter health check would fail the draws of ``test_fuzz_space``.
"""
from __future__ import annotations

from hypothesis import reject
from hypothesis import strategies as st

from harness.case.spec import Case
from harness.catalog import pairs, space

TAG = "space"  # the case names' tag, beside the covering array's "pair" / "triple"


def _forbidden(row: dict, name: str, rules) -> bool:
    """Whether a rule whose keys all have values in ``row``, ``name`` among them, forbids it."""
    return any(name in r.keys and all(k in row for k in r.keys) and r.forbids(row) for r in rules)


@st.composite
def rows(draw, knobs=None, rules=None) -> dict:
    """A row (knob name -> value) of the space that no rule forbids. ``knobs`` / ``rules`` default to the
    space's own, read when the row is drawn."""
    knobs = space.knobs() if knobs is None else knobs
    rules = space.RULES if rules is None else rules
    row: dict = {}
    for knob in knobs:
        wanted = draw(st.integers(0, len(knob.domain) - 1), label=knob.name)
        allowed = [i for i, v in enumerate(knob.domain) if not _forbidden({**row, knob.name: v}, knob.name, rules)]
        if not allowed:
            reject()
        row[knob.name] = knob.domain[wanted if wanted in allowed else allowed[0]]
    return row


def baseline(knobs=None) -> dict:
    """The row every index 0 gives: each knob at the first value of its domain."""
    return {k.name: k.domain[0] for k in (space.knobs() if knobs is None else knobs)}


def non_default(row: dict, knobs=None) -> dict:
    """The knobs a row sets to other than its domain's first value: what a shrunk failure needs."""
    return {k.name: row[k.name] for k in (space.knobs() if knobs is None else knobs)
            if repr(row[k.name]) != repr(k.domain[0])}


def forbidden_row(row: dict, rules=None) -> bool:
    """Whether any rule of the space forbids the whole row."""
    return any(r.forbids(row) for r in (space.RULES if rules is None else rules))


def row_case(row: dict, seed: int = 0) -> Case:
    """The gate case of a row, as the covering array builds its own (``pairs.case_of``), on the run's seed."""
    return pairs.case_of(row, TAG, 0).replace(seed=seed)
