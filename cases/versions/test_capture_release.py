"""On whatever DeepSpeed is installed, the capture records every quantity of every parameter.

Run it once per release (``<venv>/bin/python -m pytest cases/versions/test_capture_release.py``, with
that release's venv from ``scripts/deepspeed_venv.sh``); CI runs it on the pinned 0.19.8. The paths
are ones every release since 0.18.9 supports and no known bug removes a quantity from: ZeRO-1/2
without offload at world size 2 and ZeRO-3 at world size 1, standard Newton-Schulz (the one method
0.18.9 has). What a broken capture adapter looks like here: no ``muon_update`` call recorded (the
release binds it where the recorder does not reach), a missing momentum/update/gradient, a capture
note (ranks that disagree), a non-finite value.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness.rank import capture_adapters
from harness.env import versions
from harness.case.scenarios import pipeline_case

pytestmark = pytest.mark.pipeline

CASES = [pipeline_case(1, "none", "fp32", 2, ns_method="standard"),
         pipeline_case(2, "none", "bf16", 2, ns_method="standard"),
         pipeline_case(3, "none", "fp32", 1, ns_method="standard")]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_quantity_is_captured(case, pool_manager):
    adapted = versions.adapt(case)
    assert adapted.case is not None, adapted.deselected  # chosen so that every release runs them
    c = adapted.case
    traj = pool_manager.run(c).result
    muon = [p.name for p in c.params if p.uses_muon]
    adam = [p.name for p in c.params if not p.uses_muon]
    assert muon and adam
    assert len(traj.steps) == c.steps
    for rec in traj.steps:
        where = f"DeepSpeed {versions.installed().label}, {c.name} step {rec.step}"
        assert not rec.notes, f"{where}: capture notes {rec.notes}"
        # one muon_update per Muon matrix per step, on at least one rank
        assert rec.muon_calls >= len(muon), f"{where}: muon_update recorded {rec.muon_calls} times"
        assert rec.global_norm is not None and math.isfinite(rec.global_norm), where
        assert set(rec.params) == {p.name for p in c.params}, f"{where}: parameters captured {sorted(rec.params)}"
        for p in c.params:
            ps = rec.params[p.name]
            wanted = ["master", "model", "grad"] + (["momentum", "update"] if p.uses_muon else [])
            for q in wanted:
                v = getattr(ps, q)
                assert v is not None, f"{where}: {p.name} {q} not captured"
                assert tuple(np.shape(v)) == tuple(p.shape), f"{where}: {p.name} {q} has shape {np.shape(v)}"
                assert np.isfinite(v).all(), f"{where}: {p.name} {q} not finite"


# The BF16_Optimizer route (bf16 + grad_accum_dtype fp32 + ZeRO-1) at world size 2, where a rank's partition
# starts inside the parameter list: the gradient list is indexed differently before 0.19.8
# (capture_adapters.bf16_grad_index; 0.19.6 raised "fragment of (7,) param has 6 elements" here), and before
# 0.19.7 no muon_update runs on this route, so the Muon gradient is read before the step.
BF16_ROUTE = "z1-none-bf16-ws2-ga2-clip0.05-gad32"


def test_every_quantity_is_captured_on_the_bf16_optimizer_route(pool_manager):
    from harness.catalog.matrix import bf16opt_cases

    case = next(c for c in bf16opt_cases() if c.name == BF16_ROUTE)
    adapted = versions.adapt(case)
    if adapted.case is None:
        pytest.skip(f"DeepSpeed {versions.installed().label}: {adapted.deselected}")  # 0.19.7 refuses the route
    _every_quantity_without_muon_update(adapted.case, "bf16_opt", pool_manager)


def test_every_quantity_is_captured_without_zero(pool_manager):
    """Stage 0 (bf16: the wrapper reports a norm): before 0.19.7 ``MuonWithAuxAdam.step`` moves the Muon matrices
    by lr times their gradient without ``muon_update`` (DSM-114), so their gradient is read before the step."""
    case = pipeline_case(0, "none", "bf16", 2, ns_method="standard")
    adapted = versions.adapt(case)
    assert adapted.case is not None, adapted.deselected
    _every_quantity_without_muon_update(adapted.case, "z0", pool_manager)


def _every_quantity_without_muon_update(c, kind: str, pool_manager):
    """Every quantity of every parameter, the Muon momentum and update only where the release runs
    ``muon_update`` on path ``kind``."""
    traj = pool_manager.run(c).result
    muon_runs = not capture_adapters.muon_grads_before_step(kind)
    assert len(traj.steps) == c.steps
    for rec in traj.steps:
        where = f"DeepSpeed {versions.installed().label}, {c.name} step {rec.step}"
        assert not rec.notes, f"{where}: capture notes {rec.notes}"
        assert rec.global_norm is not None and math.isfinite(rec.global_norm), where
        assert set(rec.params) == {p.name for p in c.params}, f"{where}: parameters captured {sorted(rec.params)}"
        for p in c.params:
            ps = rec.params[p.name]
            wanted = ["master", "model", "grad"] + (["momentum", "update"] if p.uses_muon and muon_runs else [])
            for q in wanted:
                v = getattr(ps, q)
                assert v is not None, f"{where}: {p.name} {q} not captured"
                assert tuple(np.shape(v)) == tuple(p.shape), f"{where}: {p.name} {q} has shape {np.shape(v)}"
                assert np.isfinite(v).all(), f"{where}: {p.name} {q} not finite"
