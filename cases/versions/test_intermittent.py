"""Intermittent bugs of older releases (``harness.registry.historical.INTERMITTENT``): named beside a failure they
could explain, never an excuse."""
from __future__ import annotations

from harness.registry import historical
from harness.catalog import matrix


def _case(name):
    return next(c for c in matrix.gate_cases() if c.name == name)


def test_dsm125_is_named_for_zero3_on_the_releases_that_wait_for_one_handle_only():
    z3 = _case("z3-none-fp32-ws3-onematrix")
    notes = historical.intermittent_notes(z3, "0.19.7")
    assert len(notes) == 1 and "DSM-125" in notes[0] and "excuses nothing" in notes[0]
    assert historical.intermittent_notes(z3, "0.19.8") == []  # 0.19.8 waits for every handle
    assert historical.intermittent_notes(z3, None) == []  # an unseen release: nothing measured
    assert historical.intermittent_notes(_case("z1-none-fp32-ws4-emptyshare"), "0.19.7") == []


def test_no_intermittent_bug_is_a_registered_excuse():
    from harness.registry.bugs import AFFECTED, BUGS

    ids = {b["id"] for b in historical.INTERMITTENT}
    assert not ids & {b.id for b in BUGS}
    assert not any(AFFECTED.get(i) for i in ids)
