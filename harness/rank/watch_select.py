"""Which parameters ``watch`` records: by default the ones whose layout is where ZeRO's Muon paths break,
read from the oracle's model of DeepSpeed's flat layout for the run's own parameters and world size.

* a Muon matrix that straddles a partition boundary (ZeRO-1/2: two ranks hold parts of it, each computes
  its update from a gathered whole);
* a Muon matrix next to padding (ZeRO-1/2: the last of its flat group, before the group's padding;
  ZeRO-3: a numel not divisible by the world size);
* the first and a non-first parameter of one ZeRO-3 sub-group (a swapped sub-group addresses all but its
  first parameter by offset);
* an Adam vector.

The set is then cut to the memory bound: everything a rank keeps for a parameter over the watched steps,
in float64, counted before the run (``bytes_per_rank``).
"""
from __future__ import annotations

import fnmatch

import oracles
from oracles.layout import zero3_padded_tail
from harness.case.spec import Case
from harness.judge import verdict

FLOAT64 = 8


def layout_of(case: Case):
    """The oracle's ZeRO layout of the run's parameters (None where the config has no ZeRO layout)."""
    if case.stage not in (1, 2, 3):
        return None
    return verdict.layout_for(case, verdict.step_config(case))


def _z12_picks(case: Case, layout) -> dict[str, str]:
    picks: dict[str, str] = {}
    muon = [p for p in case.params if p.uses_muon]
    for p in muon:
        if len(oracles.param_slices(layout, p.name)) > 1:
            picks.setdefault(p.name, "Muon matrix straddling a partition boundary")
            break
    by_group: dict[int, list] = {}
    for pl in layout.placements:
        by_group.setdefault(pl.group, []).append(pl)
    for g, places in by_group.items():
        last = places[-1]
        if layout.group_numel[g] > layout.group_data_end[g] and any(last.name == p.name for p in muon):
            picks.setdefault(last.name, "Muon matrix followed by the group's padded tail")
            break
    return picks


def _z3_picks(case: Case, layout) -> dict[str, str]:
    picks: dict[str, str] = {}
    W = case.dp_size
    for p in case.params:
        if p.uses_muon and zero3_padded_tail(p.numel, W) is not None:
            picks.setdefault(p.name, "Muon matrix with a padded tail in its last partition")
            break
    by_sub: dict[int, list] = {}
    for pl in layout.placements:
        by_sub.setdefault(pl.group, []).append(pl.name)
    multi = [names for names in by_sub.values() if len(names) > 1]
    if len(by_sub) > 1 and multi:
        picks.setdefault(multi[0][0], "first parameter of a sub-group")
        picks.setdefault(multi[0][1], "non-first parameter of a sub-group")
    return picks


def default_picks(case: Case) -> dict[str, str]:
    """name -> why it is watched, in the order of the reasons above."""
    layout = layout_of(case)
    picks: dict[str, str] = {}
    if layout is not None:
        picks = _z3_picks(case, layout) if case.stage == 3 else _z12_picks(case, layout)
    if not any(p.uses_muon and p.name in picks for p in case.params):
        first = next((p for p in case.params if p.uses_muon), None)
        if first is not None:
            picks[first.name] = "first Muon matrix (no straddling or padded one in this layout)"
    vec = next((p for p in case.params if len(p.shape) == 1), None)
    if vec is not None:
        picks.setdefault(vec.name, "Adam vector")
    return picks


def bytes_per_rank(numel: int, steps: int, gas: int) -> int:
    """Upper bound of what one rank keeps for one parameter: the initial master, and per step the
    local gradient of every micro-batch, the master, model weight, momentum, Muon input and update."""
    return FLOAT64 * numel * (1 + steps * (gas + 5))


def select(case: Case, globs: tuple[str, ...], max_bytes: float, gas: int) -> tuple[dict[str, str], list[str]]:
    """(watched name -> reason, names left out for the memory bound), in model order."""
    if globs:
        picks = {p.name: f"--params {g}" for p in case.params for g in globs if fnmatch.fnmatchcase(p.name, g)}
    else:
        picks = default_picks(case)
    order = [p for p in case.params if p.name in picks]
    kept: dict[str, str] = {}
    dropped: list[str] = []
    total = 0
    for p in order:
        cost = bytes_per_rank(p.numel, case.steps, gas)
        if total + cost > max_bytes:
            dropped.append(p.name)
            continue
        total += cost
        kept[p.name] = picks[p.name]
    return kept, dropped
