"""User param groups: DSM-006 (ZeRO-3 applies the last Muon group's ns_method to all) as a matrix
case that fails on stock and passes patched, and bad groups refused before any rank starts."""
from __future__ import annotations

import pytest

from harness.registry.bugs import bugs_for
from harness.case.spec import ParamGroup
from harness.catalog.matrix import GROUP_WD, user_groups
from harness.case.scenarios import pipeline_case
from harness.judge.verdict import judge


@pytest.mark.pipeline
def test_dsm006_stock_fails_patched_passes(pool_manager):
    c = pipeline_case(3, "none", "fp32", 2, steps=3, weight_decay=GROUP_WD)
    c = c.replace(name=c.name + "-groups", groups=user_groups(3, "none"))
    assert [b.id for b in bugs_for(c)] == ["DSM-006"]
    stock = judge(c, pool_manager.run(c).result)
    failed = {(f.param, f.quantity) for f in stock.failures}
    assert ("layer0.weight", "update") in failed, stock.message()
    assert {q for _, q in failed} <= {"update", "master", "model", "global_norm"}, stock.message()
    p = c.replace(patched=True)
    assert bugs_for(p, patched=True) == []
    v = judge(p, pool_manager.run(p).result)
    assert v.passed, v.message()


@pytest.mark.parametrize("groups,why", [
    ((ParamGroup(("layer0.weight",)),), "in no group"),
    ((ParamGroup(("layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias", "nope")),), "unknown"),
    ((ParamGroup(("layer0.weight", "layer0.bias")), ParamGroup(("layer0.weight", "layer1.weight", "layer1.bias"))),
     "listed twice"),
    ((ParamGroup(("layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias"), ns_method="cubic"),), "ns_method"),
    ((ParamGroup(("layer0.weight", "layer0.bias"), loose=True), ParamGroup(("layer1.weight", "layer1.bias"))),
     "loose group"),
    ((ParamGroup(("layer0.weight", "layer0.bias")), ParamGroup(("layer1.weight", "layer1.bias"), lr=0.1, loose=True)),
     "loose group"),
])
def test_bad_groups_refused_before_any_rank(groups, why):
    c = pipeline_case(1, "none", "fp32", 1)
    with pytest.raises(ValueError, match=why):
        c.replace(groups=groups)


def test_groups_round_trip_json():
    c = pipeline_case(2, "cpu", "bf16", 2).replace(groups=user_groups(2, "cpu"))
    from harness.case.spec import Case

    assert Case.from_json(c.to_json()) == c


def test_a_loose_group_goes_to_deepspeed_as_bare_tensors_ahead_of_the_dicts():
    """DeepSpeed moves bare tensors after the dict groups itself; the harness puts them first so that it must."""
    import torch

    from harness.rank.ds_run import model_parameters

    c = pipeline_case(1, "none", "fp32", 2)
    c = c.replace(groups=(ParamGroup(("layer0.weight", "layer0.bias"), lr=0.03),
                          ParamGroup(("layer1.weight", "layer1.bias"), loose=True)))
    model = torch.nn.Module()
    for p in c.params:
        model.register_parameter(p.name.replace(".", "_"), torch.nn.Parameter(torch.zeros(p.shape)))
    named = {p.name: getattr(model, p.name.replace(".", "_")) for p in c.params}
    model.named_parameters = lambda: iter(named.items())
    got = model_parameters(c, model)
    assert [x is named["layer1.weight"] or x is named["layer1.bias"] for x in got[:2]] == [True, True]
    assert got[2] == {"params": [named["layer0.weight"], named["layer0.bias"]], "lr": 0.03} and len(got) == 3
