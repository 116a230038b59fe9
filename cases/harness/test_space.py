"""The config space (``harness.catalog.space``) and its covering arrays (``harness.catalog.pairs``): every key
the typed view reads has a domain whose default is the view's, every pair of values that can run is in a
CI row, nothing DeepSpeed refuses is, and a knob added to the space enters the array with no other edit."""
from __future__ import annotations

import itertools

import pytest

from harness.case import dsconfig
from harness.catalog import matrix, pairs, space
from harness.env import tree
from harness.registry import refusals


def test_every_key_the_view_reads_has_a_domain():
    assert space.view_keys(), "the view lists no key: nothing would be checked"
    assert space.keys_without_domain() == []
    stale = sorted({r for k in space.CONFIG_KNOBS for r in k.reads} - set(space.view_keys()) - {"scheduler"})
    assert stale == [], f"domains for keys the view no longer reads: {stale}"


def test_a_key_without_a_domain_is_named(monkeypatch):
    dropped = space.CONFIG_KNOBS[3]
    monkeypatch.setattr(space, "CONFIG_KNOBS", tuple(k for k in space.CONFIG_KNOBS if k is not dropped))
    assert space.keys_without_domain() == list(dropped.reads)
    with pytest.raises(ValueError, match=dropped.reads[0]):
        pairs.covering_array.__wrapped__(2)


@pytest.mark.parametrize("knob", space.CONFIG_KNOBS, ids=lambda k: k.name)
def test_a_domain_is_the_views_default_and_other_values(knob):
    """The default appears once, as the key left out (so the view's own default is what runs), beside at
    least one value set in the config."""
    assert knob.domain[0] is space.ABSENT and knob.values
    default = space.view_default(knob.reads[0])
    assert all(v != default and v is not space.ABSENT for v in knob.values), (knob.name, default)
    assert len(set(map(repr, knob.domain))) == len(knob.domain)


def _row(**given) -> dict:
    row = {k.name: k.default for k in space.knobs()}
    return {**row, **given}


def test_absent_resolves_to_the_views_default_and_is_left_out():
    row = _row()
    cfg = space.config_of(row)
    view = dsconfig.resolve(cfg, row["world_size"])
    for k in space.CONFIG_KNOBS:
        for key in k.reads:
            if key != "scheduler":
                assert "default" in view.source(key) or "batch rule" in view.source(key), key
    assert space.resolved(row, "gradient_clipping") == view.gradient_clipping
    assert space.resolved(row, "zero_optimization.stage") == view.zero.stage


@pytest.mark.parametrize("rule", [r for r in space.RULES if r.by == "deepspeed"], ids=lambda r: r.said_by)
def test_deepspeed_rules_quote_the_installed_source(rule):
    rel, _, fragment = rule.said_by.partition(":")
    assert tree.installed().says(rel, fragment), rule.said_by


@pytest.mark.parametrize("rule", [r for r in space.RULES if r.by == "registry"], ids=lambda r: r.said_by)
def test_registry_rules_refuse_what_the_registry_refuses(rule):
    """Over every combination of the rule's keys (the rest at defaults), the rule forbids exactly the rows the
    refusals registry says DeepSpeed refuses by that refusal."""
    assert rule.said_by in {r.name for r in refusals.REFUSALS}
    domains = [space.by_name()[k].domain for k in rule.keys]
    verdicts = set()
    for values in itertools.product(*domains):
        row = _row(**dict(zip(rule.keys, values)))
        refused = rule.said_by in {r.name for r in refusals.expected(pairs.case_of(row, "probe", 0))}
        assert refused == bool(rule.forbids(row)), space.config_of(row)
        verdicts.add(refused)
    assert verdicts == {True, False}


def _covered(rows, n):
    names = [k.name for k in space.knobs()]
    return {tuple((names[i], repr(r[names[i]])) for i in ps) for r in rows
            for ps in itertools.combinations(range(len(names)), n)}


def _ruled_out(combo: dict) -> bool:
    """Forbidden by a rule reading only the combination's keys, or, for every value of some third knob, by a
    rule reading only those keys and that knob's: a proof of its own, apart from the search that built the
    array."""
    def direct(row):
        return any(set(r.keys) <= set(row) and r.forbids(row) for r in space.RULES)

    if direct(combo):
        return True
    return any(all(direct({**combo, k.name: v}) for v in k.domain) for k in space.knobs() if k.name not in combo)


def test_every_pair_that_can_run_is_in_a_ci_row():
    rows, impossible = pairs.covering_array(2)
    covered = _covered(rows, 2)
    knobs = space.knobs()
    missing = []
    for a, b in itertools.combinations(knobs, 2):
        for va, vb in itertools.product(a.domain, b.domain):
            if ((a.name, repr(va)), (b.name, repr(vb))) not in covered:
                missing.append({a.name: va, b.name: vb})
    assert sorted(map(repr, missing)) == sorted(map(repr, impossible))
    unproven = [m for m in missing if not _ruled_out(m)]
    assert unproven == [], f"pairs left out that no rule rules out: {unproven[:5]}"


def test_no_row_breaks_a_rule_or_is_refused():
    for n in (2,):
        rows, _ = pairs.covering_array(n)
        for i, row in enumerate(rows):
            broken = [r.said_by for r in space.RULES if r.forbids(row)]
            assert broken == [], (i, broken)
            case = pairs.case_of(row, pairs.TAGS[n], i)
            assert refusals.expected(case) == [], (case.name, [r.name for r in refusals.expected(case)])


def test_every_pair_row_is_a_ci_gate_case_and_every_triple_row_a_full_one():
    """The covering array's rows are gate cases of their own path group: the pairs in CI, the triples
    (which hold every pair too) in ``--full``."""
    for full, tag in ((False, "-pair-"), (True, "-triple-")):
        rows = pairs.pairs_cases(full)
        gate = {c.name for c in matrix.gate_cases(full)}
        assert rows and all(tag in c.name and c.name in gate for c in rows)
        assert {matrix.group_of(c.name) for c in rows} == {"pairs"}
        assert len({c.ds_config for c in rows}) > 1


def test_a_knob_added_to_the_space_enters_the_array(monkeypatch):
    extra = space.Knob("zero_optimization.round_robin_gradients", (True,), "probe", ("probe.key",))
    monkeypatch.setattr(space, "CONFIG_KNOBS", space.CONFIG_KNOBS + (extra,))
    space.by_name.cache_clear()
    try:
        rows, _ = pairs.covering_array.__wrapped__(2)
        written = [space.config_of(r).get("zero_optimization", {}).get("round_robin_gradients") for r in rows]
    finally:
        monkeypatch.undo()
        space.by_name.cache_clear()
    stages = {r["zero_optimization.stage"] for r in rows if r[extra.name] is True}
    assert len(stages) == len(space.by_name()["zero_optimization.stage"].domain)
    assert True in written
