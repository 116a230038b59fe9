"""Every pair of the config space (``harness.catalog.space``) in the CI gate, every triple in ``--full``: a
covering array whose rows are gate cases, judged on both columns like any other.

Why a covering array: the gate's other families vary a knob or two around one baseline, so a bug that needs
two settings at once (a loss-scale growth step under ZeRO-2 offload with clipping, say) is met only where a
family happens to combine them. A t-wise covering array holds every combination of t values of any t knobs
that can run, in few rows.

Why allpairspy and a completion step: allpairspy (an established greedy generator) builds the array with
the space's rules as its filter, but it stops as soon as one greedy row covers nothing new, which with
three-way coverage, or with rules, leaves combinations out (how many: docs/measurements.md).
``_complete`` then builds one row for each combination still missing, by a depth-first search under the
same rules, or proves that no row can hold it; ``cases/harness/test_space.py`` checks that every pair is
either covered or ruled out. A knob added to the space (``space.knobs``) enters the array
with no edit here.
"""
from __future__ import annotations

import functools
import itertools

from allpairspy import AllPairs

from harness.case.spec import Case, Overflow, ParamGroup, canonical_json
from harness.catalog import space

TAGS = {2: "pair", 3: "triple"}
SEARCH_BUDGET = 200_000  # nodes per missing combination: the rules are shallow, a real search needs hundreds


class _Rules:
    """The space's rules by the last column they read, over rows of domain indices."""

    def __init__(self, knobs):
        self.names = [k.name for k in knobs]
        self.domains = [k.domain for k in knobs]
        pos = {n: i for i, n in enumerate(self.names)}
        self.keys = [(r, tuple(pos[k] for k in r.keys)) for r in space.RULES]

    def row(self, idx) -> dict:
        return {self.names[i]: self.domains[i][v] for i, v in enumerate(idx) if v is not None}

    def ok(self, idx, at: int) -> bool:
        """No rule reading column ``at`` and only assigned columns forbids ``idx`` (None: unassigned)."""
        rules = [r for r, ps in self.keys if at in ps and all(idx[p] is not None for p in ps)]
        if not rules:
            return True
        row = self.row(idx)
        return not any(r.forbids(row) for r in rules)

    def prefix_ok(self, prefix) -> bool:
        """allpairspy's filter: it extends a row one column at a time and asks about each prefix."""
        idx = list(prefix) + [None] * (len(self.names) - len(prefix))
        return self.ok(idx, len(prefix) - 1)


def _tuples(row, n: int):
    return {tuple(itertools.chain.from_iterable((p, row[p]) for p in ps))
            for ps in itertools.combinations(range(len(row)), n)}


def _search(fixed: dict, rules: _Rules, missing_at: dict):
    """A row holding ``fixed`` (column -> value index) that no rule forbids, each free column taking the value
    that completes the most missing combinations; None when none exists."""
    n_cols = len(rules.names)
    idx = [fixed.get(i) for i in range(n_cols)]
    if not all(rules.ok(idx, p) for p in fixed):
        return None
    free = [i for i in range(n_cols) if i not in fixed]
    budget = [SEARCH_BUDGET]

    def gain(p, v):
        return sum(all(idx[t[j]] == t[j + 1] for j in range(0, len(t), 2) if t[j] != p)
                   for t in missing_at.get((p, v), ()))

    def rec(k: int) -> bool:
        if k == len(free):
            return True
        budget[0] -= 1
        if budget[0] < 0:
            raise RuntimeError(f"covering array: no verdict on {fixed} within {SEARCH_BUDGET} nodes")
        p = free[k]
        for v in sorted(range(len(rules.domains[p])), key=lambda v: (-gain(p, v), v)):
            idx[p] = v
            if rules.ok(idx, p) and rec(k + 1):
                return True
        idx[p] = None
        return False

    return tuple(idx) if rec(0) else None


def _complete(rows: list, n: int, rules: _Rules) -> tuple[list, list]:
    """``rows`` with a row added for each n-wise combination they miss; and the combinations no row can hold."""
    covered = set().union(*(_tuples(r, n) for r in rows)) if rows else set()
    missing = []
    for ps in itertools.combinations(range(len(rules.names)), n):
        for vs in itertools.product(*(range(len(rules.domains[p])) for p in ps)):
            t = tuple(itertools.chain.from_iterable(zip(ps, vs)))
            if t not in covered:
                missing.append(t)
    missing_at: dict = {}
    for t in missing:
        for j in range(0, len(t), 2):
            missing_at.setdefault((t[j], t[j + 1]), set()).add(t)
    impossible = []
    for t in missing:
        if t in covered:
            continue
        row = _search(dict(zip(t[::2], t[1::2])), rules, missing_at)
        if row is None:
            impossible.append(t)
            continue
        rows.append(row)
        new = _tuples(row, n) - covered
        covered |= new
        for u in new:
            for j in range(0, len(u), 2):
                missing_at.get((u[j], u[j + 1]), set()).discard(u)
    return rows, impossible


@functools.cache
def covering_array(n: int) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    """(rows, combinations no row can hold), each a dict of knob name -> value: every n-wise combination of
    the space's values is in a row or forbidden by its rules."""
    lacking = space.keys_without_domain()
    if lacking:
        raise ValueError(f"the typed view reads {lacking}, which have no domain in harness.catalog.space: give each "
                         "its values there")
    knobs = space.knobs()
    rules = _Rules(knobs)
    generated = AllPairs([list(range(len(k.domain))) for k in knobs], filter_func=rules.prefix_ok, n=n)
    rows, impossible = _complete([tuple(r) for r in generated], n, rules)
    names = rules.names
    as_dict = [{names[p]: rules.domains[p][v] for p, v in zip(t[::2], t[1::2])} for t in impossible]
    return tuple(rules.row(r) for r in rows), tuple(as_dict)


def _overflows(row: dict, params) -> tuple[Overflow, ...]:
    """The row's injected overflow on its last rank: every gradient (inf), or one Muon matrix (inf), or one
    Adam vector (NaN); at step 2's first or last micro-batch, or at the first of steps 2 and 3."""
    kind = row["overflow"]
    if kind == "none":
        return ()
    target = {"all": None, "muon": next((p.name for p in params if p.uses_muon), None),
              "adam": next((p.name for p in params if not p.uses_muon), None)}[kind]
    micro = space.resolved(row, "gradient_accumulation_steps") - 1 if row["overflow_at"] == "last" else 0
    steps = (2, 3) if row["overflow_at"] == "row" else (2,)
    value = float("nan") if kind == "adam" else float("inf")
    return tuple(Overflow(step=s, rank=row["world_size"] - 1, micro=micro, value=value, param=target)
                 for s in steps)


def _groups(row: dict, params) -> tuple[ParamGroup, ...]:
    """Two user groups: the first layer's parameters with their own lr, decay, momentum and ns_method; the
    rest with the config's."""
    if row["groups"] == "none":
        return ()
    first = params[0].name.rpartition(".")[0] + "."
    mine = tuple(p.name for p in params if p.name.startswith(first))
    return (ParamGroup(mine, lr=0.03, weight_decay=0.1, momentum=0.9, ns_method="standard"),
            ParamGroup(tuple(p.name for p in params if p.name not in mine)))


def case_of(row: dict, tag: str, index: int) -> Case:
    """The gate case of one row: its config (``space.config_of``), model, groups, overflow and gradient scale."""
    params = space.SHAPES[row["shapes"]]
    off = space.resolved(row, space.OFF)
    name = (f"z{space.resolved(row, space.ST)}-{off}-{space.model_dtype(row)}-ws{row['world_size']}-"
            f"{tag}-{index:03d}")
    tp = (space.resolved(row, space.TP) or 0) > 1
    return Case(name=name, params=params, ds_config=canonical_json(space.config_of(row)),
                world_size=row["world_size"], steps=space.STEPS, batch=4 if tp else 8,
                overflows=_overflows(row, params), groups=_groups(row, params), grad_scale=row["grad_scale"])


def pairs_cases(full: bool = False) -> list[Case]:
    """CI: a row for every pair of values of any two knobs; ``--full``: for every triple (which holds every
    pair too)."""
    n = 3 if full else 2
    rows, _ = covering_array(n)
    return [case_of(r, TAGS[n], i) for i, r in enumerate(rows)]
