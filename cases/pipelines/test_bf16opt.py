"""DSM-013 (the BF16_Optimizer route clips the raw gradients and reports their norm): a case that
fails on stock and passes on the patched runtime (``bf16-optimizer-muon-norm``)."""
from __future__ import annotations

import pytest

from harness.registry.bugs import bugs_for
from harness.catalog.matrix import bf16opt_cases
from harness.judge.verdict import judge

pytestmark = pytest.mark.pipeline


def test_dsm013_stock_fails_patched_passes(pool_manager):
    case = next(c for c in bf16opt_cases() if c.name == "z1-none-bf16-ws2-ga2-clip0.05-gad32")
    assert [b.id for b in bugs_for(case)] == ["DSM-013"]
    stock = judge(case, pool_manager.run(case).result)
    shown = {f.quantity for f in stock.failures}
    assert {"global_norm", "master"} <= shown, stock.message()
    assert shown <= bugs_for(case)[0].quantities, stock.message()
    p = case.replace(patched=True)
    assert bugs_for(p, patched=True) == []
    v = judge(p, pool_manager.run(p).result)
    assert v.passed, v.message()
