"""Runs whose optimizer is not Muon (``harness.catalog.matrix.non_muon_cases``): every parameter must take plain
AdamW, whatever ``use_muon`` DeepSpeed's flag logic would set.

The oracle decides that from the optimizer the user configured (``harness.judge.verdict.non_muon_optimizer``),
never from DeepSpeed's tags. The pipeline test shows the checks tell the two routes apart: a real Muon
run whose Adam half has exactly the AdamW settings (so only the matrices' route differs) is judged as
the AdamW case, and it must fail on the matrices and only there -- what a leak of Muon routing into a
non-Muon run looks like to the gate.
"""
from __future__ import annotations

import json

import pytest

from cases.pipelines._support import run_case, suite
from harness.case.spec import canonical_json
from harness.catalog.matrix import NON_MUON_PARAMS, non_muon_cases
from harness.judge.verdict import expected_group_lrs, judge, non_muon_optimizer, step_config
from oracles.layout import deepspeed_uses_muon


def _cases():
    return {c.name: c for c in non_muon_cases()}


def test_every_parameter_is_adam_in_the_oracle_whatever_deepspeed_would_tag():
    for c in non_muon_cases():
        sc = step_config(c)
        assert any(deepspeed_uses_muon(p.name, p.shape) for p in c.params)  # DeepSpeed's rule would say Muon
        assert not any(p.use_muon for p in sc.params), c.name
        assert sc.adam_lr == NON_MUON_PARAMS["lr"] and sc.adam_w_mode == (not c.name.endswith("-adam-l2"))
        assert non_muon_optimizer(c)[0] == ("adam" if c.name.endswith("-adam-l2") else "adamw")
        assert sc.betas == tuple(NON_MUON_PARAMS["betas"]) and sc.eps == NON_MUON_PARAMS["eps"]
        assert sc.weight_decay == NON_MUON_PARAMS["weight_decay"]
        assert expected_group_lrs(c, sc) == {"0": NON_MUON_PARAMS["lr"]}


def test_the_client_case_names_no_optimizer_to_deepspeed():
    c = _cases()["z1-none-fp32-ws2-client-adamw"]
    assert "optimizer" not in c.config and json.loads(c.client_optimizer)["type"] == "AdamW"


def test_an_unstated_setting_is_refused_not_guessed():
    c = _cases()["z2-none-fp32-ws2-adamw"]
    cfg = c.config
    del cfg["optimizer"]["params"]["weight_decay"]
    with pytest.raises(ValueError, match="weight_decay"):
        non_muon_optimizer(c.replace(ds_config=canonical_json(cfg)))
    cfg = c.config
    cfg["optimizer"]["type"] = "SGD"
    with pytest.raises(ValueError, match="oracle knows"):
        non_muon_optimizer(c.replace(ds_config=canonical_json(cfg)))


@pytest.mark.pipeline
@pytest.mark.parametrize("case,column", suite(non_muon_cases))
def test_non_muon(case, column, pool_manager, seed, request):
    """Both columns, through the gate's own decision: plain AdamW for every parameter."""
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.pipeline
@pytest.mark.parametrize("name", ["z2-none-fp32-ws2-adamw", "z1-none-fp32-ws2-client-adamw"])
def test_a_muon_routed_run_fails_the_adamw_case_on_the_matrices_only(pool_manager, name):
    c = _cases()[name]
    assert judge(c, pool_manager.run(c).result).passed
    # the same model, data and ZeRO stage under Muon, its Adam half set exactly as the AdamW case
    cfg = {k: v for k, v in c.config.items() if k != "optimizer"}
    cfg["optimizer"] = {"type": "Muon", "params": {**NON_MUON_PARAMS, "muon_lr": 0.02, "momentum": 0.95}}
    muon = c.replace(name=name + "-as-muon", ds_config=canonical_json(cfg), client_optimizer=None)
    traj = pool_manager.run(muon).result
    assert judge(muon, traj).passed
    v = judge(c, traj)
    matrices = {p.name for p in c.params if deepspeed_uses_muon(p.name, p.shape)}
    failed = {f.param for f in v.failures}
    params = {p for p in failed if not p.startswith("<")}  # "<step>" muon_calls, "<group ...>" lr: run-level
    assert params == matrices, v.message()


def test_adam_rule_follows_deepspeeds_documented_flag_and_torchs_class():
    """A configured "Adam" decouples its weight decay unless adam_w_mode is false; "AdamW" always does; a
    client optimizer is what its torch class is, and adam_w_mode (no torch argument) is refused there."""
    c = _cases()["z2-none-fp32-ws2-adamw"]

    def rule(kind, **extra):
        cfg = c.config
        cfg["optimizer"] = {"type": kind, "params": dict(NON_MUON_PARAMS, **extra)}
        return non_muon_optimizer(c.replace(ds_config=canonical_json(cfg)))[0]

    assert rule("Adam") == "adamw" and rule("Adam", adam_w_mode=True) == "adamw"
    assert rule("Adam", adam_w_mode=False) == "adam" and rule("AdamW", adam_w_mode=False) == "adamw"
    l2 = _cases()["z2-none-fp32-ws2-adam-l2"]
    assert non_muon_optimizer(l2)[0] == "adam" and not step_config(l2).adam_w_mode
    client = _cases()["z1-none-fp32-ws2-client-adamw"]
    spec = json.loads(client.client_optimizer)
    assert non_muon_optimizer(client.replace(client_optimizer=canonical_json(dict(spec, type="Adam"))))[0] == "adam"
    with pytest.raises(ValueError, match="no torch.optim argument"):
        non_muon_optimizer(client.replace(client_optimizer=canonical_json(
            dict(spec, params=dict(spec["params"], adam_w_mode=True)))))
