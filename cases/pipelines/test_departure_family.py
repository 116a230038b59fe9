"""The gate's departure family (``harness.catalog.departures``): each case's run reports exactly the
departures from Muon as defined it claims, each held to a second computation of its size
(``harness.judge.departure_pins``), in the gate's own decision; and every departure is pinned somewhere in
the gate (MUON-TP-SHARD by the AutoTP cases)."""
from __future__ import annotations

import pytest

from cases.pipelines._support import run_case, suite
from harness.catalog.departures import departure_cases
from harness.registry.departures import DEPARTURES


@pytest.mark.pipeline
@pytest.mark.parametrize("case,column", suite(departure_cases))
def test_each_case_reports_exactly_the_departures_it_claims(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


def test_every_departure_has_a_gate_case_that_must_report_it_and_one_that_must_not():
    from harness.catalog.matrix import gate_cases

    cases = [c for c in gate_cases() if c.departs is not None]
    claimed = {d for c in cases for d in c.departs}
    silent = {d.id for d in DEPARTURES if any(d.id not in c.departs for c in cases)}
    missing = {d.id for d in DEPARTURES} - claimed
    if "gpt2" not in {c.model for c in cases}:  # the models extra (transformers) is not installed
        missing.discard("MUON-BY-NAME")
    assert not missing, f"departures no gate case claims: {sorted(missing)}"
    assert claimed <= silent and any(c.departs == () for c in cases)
