"""The gradient check is the only guard on reduction, averaging and accumulation (everything downstream
is teacher-forced with DeepSpeed's own gradient). Its allowance is derived per parameter from that
parameter's own addends (``oracles.tolerance``, "grad"; ``harness.judge.verdict.grad_allowance``), so a
missing rank, a wrong world size or a lost micro-batch is reported on every dtype and layout -- the
large matrices, whose gradients can be tiny next to the biases', included.

These tests build the wrong averages from the float64 per-(rank, micro) gradients of real cases and run
them through the comparison the verdict uses (``compare_arrays`` with ``grad_allowance``). No ranks.
"""
from __future__ import annotations

import pytest
import torch

import oracles
from harness.case import synthetic
from harness.judge.compare import compare_arrays
from harness.catalog.matrix import _case
from harness.judge.verdict import grad_allowance, grad_store_dtype, step_config

DTYPES = ("fp32", "fp16", "bf16")
LAYOUTS = {  # (stage, offload, world size, grad_accum)
    "z1-none-ws2-ga2": (1, "none", 2, 2),
    "z2-cpu-ws3-ga2": (2, "cpu", 3, 2),
    "z3-none-ws2-ga2": (3, "none", 2, 2),
    "z3-nvme-ws2-ga2": (3, "nvme", 2, 2),  # carries the >= 1 MiB-per-rank matrix
}


def _grads(case):
    lp = oracles.MODEL_DTYPES[case.dtype]
    w = {n: t.to(lp).to(torch.float64) for n, t in synthetic.initial_weights(case).items()}
    return [[synthetic.local_gradients(w, case, r, 1, mu) for mu in range(case.grad_accum)]
            for r in range(case.world_size)]


def _stored(G: torch.Tensor, case) -> torch.Tensor:
    """What a correct DeepSpeed hands the optimizer: the average, rounded once to the storage dtype."""
    return oracles.round_to(G, oracles.MODEL_DTYPES.get(grad_store_dtype(case), torch.float32))


def _wrong_averages(grads, W: int, GAS: int, name: str) -> dict[str, torch.Tensor]:
    total = lambda ranks, micros: sum(grads[r][mu][name] for r in ranks for mu in micros)  # noqa: E731
    return {
        "rank dropped": total(range(W - 1), range(GAS)) / (W * GAS),
        "wrong world size (W-1)": total(range(W), range(GAS)) / ((W - 1) * GAS),
        "wrong world size (W+1)": total(range(W), range(GAS)) / ((W + 1) * GAS),
        "one micro-batch of two kept": total(range(W), range(1)) / W,
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reduction_errors_are_reported_per_parameter(layout, dtype):
    stage, offload, W, GAS = LAYOUTS[layout]
    case = _case(stage, offload, dtype, W, grad_accum=GAS)
    sc = step_config(case)
    grads = _grads(case)
    G = oracles.accumulate(grads, sc)
    checked = 0
    for spec in sc.params:
        allow = grad_allowance(case, sc, spec.name, grads, "emulated")
        good = compare_arrays(case.name, spec.name, "grad", 1, _stored(G[spec.name], case).numpy(),
                              G[spec.name].numpy(), allow)
        assert good.passed, f"{layout} {dtype} {spec.name}: a correct average fails ({good.worst_ratio:.3g}x)"
        for what, wrong in _wrong_averages(grads, W, GAS, spec.name).items():
            chk = compare_arrays(case.name, spec.name, "grad", 1, _stored(wrong, case).numpy(),
                                 G[spec.name].numpy(), allow)
            assert not chk.passed, f"{layout} {dtype} {spec.name}: '{what}' not reported ({chk.worst_ratio:.3g}x)"
            checked += 1
    assert checked == 4 * len(sc.params)


def test_one_global_term_scale_would_hide_a_dropped_rank_in_a_large_matrix():
    """Guards the test above against being vacuous: with the old allowance (one maximum over all
    parameters' addends) a large matrix's dropped rank went unreported in bf16. The matrix is the
    1024x512 the NVMe cases carried before they went wide (``harness.case.nvme``): its data term, divided
    by its 1024 rows, is tiny next to the biases'."""
    from harness.case.spec import ParamShape
    from harness.case.scenarios import TINY_PARAMS

    case = _case(3, "nvme", "bf16", 2, grad_accum=2)
    case = case.replace(params=TINY_PARAMS + (ParamShape("big.weight", (1024, 512)),))
    sc = step_config(case)
    grads = _grads(case)
    G = oracles.accumulate(grads, sc)
    big = max(sc.params, key=lambda p: torch.Size(p.shape).numel()).name
    own = oracles.grad_term_scale(g[big] for per_rank in grads for g in per_rank)
    every = max(oracles.grad_term_scale(g[p.name] for per_rank in grads for g in per_rank) for p in sc.params)
    assert every > 10 * own, (every, own)
    allow = grad_allowance(case, sc, big, grads, "emulated")
    old = oracles.Allowance(allow.atol * every / own, allow.rtol, "one global term scale")
    wrong = _stored(_wrong_averages(grads, 2, 2, big)["rank dropped"], case).numpy()
    assert compare_arrays(case.name, big, "grad", 1, wrong, G[big].numpy(), old).passed
    assert not compare_arrays(case.name, big, "grad", 1, wrong, G[big].numpy(), allow).passed
