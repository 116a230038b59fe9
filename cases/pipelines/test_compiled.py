"""The compiled path, as users run it (DeepSpeed wraps muon_update in torch.compile), in fresh ranks
per case: ``-compiled-hpns`` cases force the Newton-Schulz compute dtype to float64, so the compiled
plumbing is judged to fp32 round-off; ``-compiled-exact`` cases keep the 16-bit Newton-Schulz and are
judged in ``exact`` mode at the step's measured smallest singular value (``harness.catalog.matrix.compiled_cases``)."""
from __future__ import annotations

import pytest

from cases.pipelines._support import gate_params, settle
from harness.catalog import matrix
from harness.gate.decide import evaluate
from harness.registry.bugs import bugs_for

pytestmark = [pytest.mark.pipeline, pytest.mark.compiled]


def _params():
    ci = matrix.compiled_cases(False)
    ci_names = {c.name for c in ci}
    extra = [c for c in matrix.compiled_cases(True) if c.name not in ci_names]
    # pytest's CI subset runs the patched column only (each compiled case starts fresh ranks and
    # compiles, ~20 s here); the gate runs both columns, and ``--full`` here adds the stock one.
    full = {c.name for c in extra}
    stock = gate_params(ci + extra, {c.name for c in ci + extra}, cols=["stock"])
    return gate_params(ci + extra, full, cols=["patched"]) + stock


@pytest.mark.parametrize("case,column", _params())
def test_compiled(case, column, pool_manager, seed, request):
    o = evaluate(case.replace(seed=seed), column, pool_manager)
    want = "hpns" if case.name.endswith("-hpns") else "exact"
    assert o.verdict is None or o.verdict.mode == want
    settle(o, request)


def _excused_on_stock() -> list:
    """The CI compiled cases a modelled stock bug makes xfail (the 16-bit ones: DSM-001)."""
    return [c for c in matrix.compiled_cases(False)
            if any(b.model is not None and b.model(c) is not None for b in bugs_for(c, patched=False))]


@pytest.mark.parametrize("case", _excused_on_stock(), ids=lambda c: c.name)
def test_a_broken_update_is_not_excused_by_the_bug_model(case, pool_manager, seed):
    """A bug excuses only what its model predicts: with the Nesterov blend dropped in the compiled
    ``muon_update`` (``compiled-nesterov-dropped``) the Muon update leaves the model of the case's stock bug,
    and the case fails on that update instead of staying an xfail."""
    o = evaluate(case.replace(seed=seed, mutant="compiled-nesterov-dropped"), "stock", pool_manager)
    assert o.status == "failed", o.message
    assert "update" in {q for _, q in o.unexplained}, o.message


def test_ci_subset_has_a_compiled_case_per_stage_and_offload():
    cases = matrix.compiled_cases(False)
    hpns = {(c.stage, c.offload) for c in cases if c.ns_dtype == "float64" and c.compiled}
    assert hpns == {(0, "none")} | {(s, o) for s in (1, 2, 3) for o in ("none", "cpu")}
    assert any(c.compiled and c.ns_dtype is None for c in cases)  # and DeepSpeed's own 16-bit NS


def test_exact_mode_uses_the_measured_spectrum():
    """The exact-mode Newton-Schulz allowance at the step's own smallest singular value is far below
    the worst case (sigma_lo = 0), and the bound never exceeds the unperturbed one."""
    import torch

    import oracles

    torch.manual_seed(0)
    U = torch.randn(7, 3, dtype=torch.float64)
    s0 = oracles.normalised_sigma_lo(U)
    s1 = oracles.perturbed_sigma_lo(U, 1e-7)
    assert 0.0 < s1 <= s0
    assert oracles.perturbed_sigma_lo(U, 1.0) == 0.0  # a perturbation as large as U: nothing is known
    worst = oracles.allowances("exact", shape=(7, 3), sigma_lo=0.0).direction.rtol
    measured = oracles.allowances("exact", shape=(7, 3), sigma_lo=s1).direction.rtol
    assert measured < worst / 10
