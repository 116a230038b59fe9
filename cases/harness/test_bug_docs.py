"""docs/bugs.md and the README's bug table are generated from the registry entries
(``harness.registry.docs``); a committed copy that differs from what the entries give is stale."""
from __future__ import annotations

import re

import pytest

from harness.catalog import matrix
from harness.registry import docs
from harness.registry.bugs import BUGS, HISTORICAL


def test_committed_bug_pages_match_the_registry():
    stale = docs.stale_files()
    assert not stale, f"{', '.join(stale)} differ from the registry entries: run `{docs.COMMAND}` and commit"


def test_every_bug_has_its_section_and_every_0198_bug_its_table_row():
    page, table = docs.bugs_md(), docs.readme_table()
    for b in BUGS + HISTORICAL:
        assert f"### {b.id}: {b.title}\n" in page, b.id
    rows = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[2:]]
    assert rows == [b.id for b in BUGS]


def test_a_modelled_bug_lists_the_switches_its_model_sets():
    by_id = {b.id: b for b in BUGS + HISTORICAL}
    assert docs.switches(by_id["DSM-023"]) == ["stale_unused_grads"]
    # both branches of the model (the ZeRO paths', and without ZeRO the unscale by the grown scale)
    assert set(docs.switches(by_id["DSM-003"])) == {"scale_update_before_unscale", "muon_update_in_old_scale",
                                                    "muon_in_new_scale", "reported_norm"}
    assert docs.switches(by_id["DSM-012"]) == []  # a crash bug: no model


def test_a_readme_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="bugs:begin"):
        docs.readme_with_table("# no table here\n")


_GATE_REPRODUCER = re.compile(r"python -m harness gate (?P<full>--full )?--only[ =](?P<name>\S+)")


def test_a_gate_reproducer_selects_a_case_its_bug_triggers_on():
    """A reproducer that names gate cases (``--only SUBSTR``) must select, in the gate it names (CI, or
    ``--full``), at least one case the bug's trigger selects: covering-array rows are renumbered when a
    knob joins the space, and a reproducer left on a renumbered row reproduces nothing."""
    gates = {False: matrix.gate_cases(False), True: matrix.gate_cases(True)}
    named = []
    for b in BUGS + HISTORICAL:
        m = _GATE_REPRODUCER.search(b.reproducer or "")
        if m is None:
            continue
        named.append(b.id)
        hits = [c for c in gates[bool(m["full"])] if m["name"] in c.name]
        assert hits, f"{b.id}: `{m[0]}` selects no case of that gate; point it at a case that shows the bug"
        assert any(b.trigger(c) for c in hits), (
            f"{b.id}: `{m[0]}` selects {[c.name for c in hits][:5]}, none of which its trigger selects; point "
            "the reproducer at the row that now shows the bug")
    assert len(named) >= 10, f"only {named} name gate cases: the reproducer pattern no longer matches them"
