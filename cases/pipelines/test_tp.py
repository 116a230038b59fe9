"""Tensor parallelism (AutoTP) with per-head Muon: the gate's tensor-parallel cases
(``harness.catalog.matrix.tp_cases``, rank side ``harness.rank.tp_case``, judged by ``harness.judge.tp_verdict``), and
that the judge fails the updates it exists to catch.

The judge's own tests build rank records from the oracle's step (no ranks) and change one thing:
a shard orthogonalised as one matrix instead of per head, a shard holding another rank's rows, a
master stepped with the wrong lr. Each must fail, naming what it found; the unchanged record passes.
"""
from __future__ import annotations

import pytest
import torch

from cases.pipelines._support import run_case, suite
from harness.catalog import matrix
from harness.judge import tp_verdict
from harness.case.tp import COLUMN_PARALLEL, full_weights, geometry

HALF = (True, True)  # fp16 and bf16 Newton-Schulz, as on an accelerator (and the CPU stand-in)


@pytest.mark.pipeline
@pytest.mark.parametrize("case,column", suite(matrix.tp_cases))
def test_tp(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


def _records(case, *, heads_rule=tp_verdict.shard_heads, lr_factor=1.0, swap_ranks=False) -> dict:
    """Rank records of ``case.steps`` steps whose every number is the oracle's own step, with the
    per-head rule replaced by ``heads_rule`` (the mutants' effect) where asked."""
    tp = case.world_size
    geo = geometry(case)
    opt = case.config["optimizer"]["params"]
    beta, lr = opt["momentum"], opt["lr"]
    g = torch.Generator().manual_seed(7)
    ranks = []
    for rank in range(tp):
        held = (tp - 1 - rank) if swap_ranks else rank
        theta = {n: tp_verdict.shard_of(w, n.split(".")[-2], held, tp).clone() for n, w in full_weights(case).items()}
        mom = {n: torch.zeros_like(t) for n, t in theta.items()}
        steps = []
        for _ in range(case.steps):
            st = {"before": dict(theta), "after": {}, "muon": {}}
            for n, t in theta.items():
                grad = torch.randn(t.shape, generator=g, dtype=torch.float64).float()
                heads = heads_rule(n.split(".")[-2], t.shape, geo["head_dim"])
                m_new, master, O = tp_verdict.expected_step(t, mom[n], grad, beta=beta, lr=lr * lr_factor, wd=0.0,
                                                            ns_method=opt["ns_method"], heads=heads,
                                                            fp16_ok=HALF[0], bf16_ok=HALF[1])
                st["muon"][n] = {"grad": grad, "momentum": m_new.float(), "update": O}
                st["after"][n] = master.float()
                mom[n], theta[n] = m_new.float(), master.float()
            steps.append(st)
        ranks.append({"rank": rank, "tags": {}, "steps": steps})
    return {"ranks": ranks}


def _case():
    return matrix.tp_cases()[0]


def test_judge_passes_the_per_head_step_on_each_shard():
    case = _case()
    v = tp_verdict.judge(case, _records(case), half_support=HALF)
    assert v.passed, v.message()
    # every shard: its placement, then momentum, update and master per step
    assert len(v.checks) == case.world_size * len(case.params) * (1 + 3 * case.steps)


def test_judge_fails_a_shard_orthogonalised_as_one_matrix():
    """What a wrong head width that leaves one head per shard does (or per-head Muon dropped, as stage 0
    does): the per-head blocks of each shard are orthogonalised together."""
    case = _case()
    whole = _records(case, heads_rule=lambda leaf, shape, hd: None)
    v = tp_verdict.judge(case, whole, half_support=HALF)
    assert not v.passed
    bad = {c.param.split("[")[0] for c in v.failures}
    assert bad == {f"layers.0.self_attn.{leaf}.weight" for leaf in COLUMN_PARALLEL}, v.message()
    assert "update diverged at step 1" in v.message() and "oracle: 3 head blocks of 3 rows" in v.message()


def test_judge_fails_a_shard_of_the_wrong_rows():
    case = _case()
    v = tp_verdict.judge(case, _records(case, swap_ranks=True), half_support=HALF)
    assert not v.passed and {c.quantity for c in v.failures} == {"shard"}, v.message()
    assert "does not hold that block" in v.message() and "reproduce: " in v.message()


def test_a_failing_judge_is_the_gate_s_shared_record():
    """One divergence record for every case kind: a tp failure is stored like any other (rank, region,
    the error map for the report's heatmap, the one-line reproducer)."""
    from harness.report import results

    case = _case()
    v = tp_verdict.judge(case, _records(case, lr_factor=1.01), half_support=HALF)
    rec, maps = results.from_verdict(v, column="stock", status="failed", bug_ids=[], seconds=0.0)
    bad = [r for r in rec.checks if r.quantity == "master" and r.record and r.record["ratio"] > 1]
    assert bad and all(r.rank is not None and "oracle:" in r.region for r in bad)
    assert any(k.endswith("|master|1") and "[tp " in k for k in maps)
    assert rec.reproduce.startswith("PYTHONPATH=") and " -m harness run --case " in rec.reproduce


def test_judge_fails_a_master_stepped_with_another_lr():
    case = _case()
    v = tp_verdict.judge(case, _records(case, lr_factor=1.01), half_support=HALF)
    assert not v.passed and "master diverged" in v.message()


def test_judge_wants_one_matrix_per_shard_without_per_head_muon():
    """The same block without the user's ``per_head_muon``: per-head updates there fail, whole-shard ones pass."""
    case = next(c for c in matrix.tp_cases() if c.name.endswith("-noheads"))
    assert not tp_verdict.judge(case, _records(case), half_support=HALF).passed
    whole = _records(case, heads_rule=lambda leaf, shape, hd: None)
    v = tp_verdict.judge(case, whole, half_support=HALF)
    assert v.passed, v.message()


def test_gqa_case_drops_the_first_tagged_projection_and_keeps_a_later_one():
    """The grouped key/value case is what it is for: on each shard q_proj (the first tagged projection
    DeepSpeed re-tags after sharding) cuts a head and goes whole, k_proj / v_proj hold one whole head."""
    case = next(c for c in matrix.tp_cases() if c.name.endswith("-autotp-gqa-cut"))
    geo, tp = geometry(case), case.world_size
    assert (geo["heads"], geo["kv_heads"], geo["head_dim"]) == (3, 2, 2)
    for rank in range(tp):
        rule = {n.split(".")[-2]: tp_verdict.shard_heads(n.split(".")[-2], tp_verdict.shard_of(
            w, n.split(".")[-2], rank, tp).shape, geo["head_dim"]) for n, w in full_weights(case).items()}
        assert rule == {"q_proj": None, "k_proj": 1, "v_proj": 1, "o_proj": None}, rule
