"""A registry trigger that replays the oracle before any rank runs (DSM-005's ``S * max|O|`` overflow,
``harness.registry.bugs._max_update_cached``) replays the case's own model: a user's module through its
float64 autograd, never the synthetic model standing in with the module's parameter names. No ranks."""
from __future__ import annotations

import pytest
import torch

from cases.cli import _user_model
from harness import models
from harness.case import synthetic
from harness.case.spec import Case, canonical_json
from harness.judge import module_oracle
from harness.registry import bugs

CFG = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "fp16": {"enabled": True, "initial_scale_power": 14},
       "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
       "zero_optimization": {"stage": 3, "reduce_scatter": False, "offload_optimizer": {"device": "cpu"}}}


@pytest.fixture
def module_case(tmp_path, monkeypatch) -> Case:
    monkeypatch.syspath_prepend(str(tmp_path))
    model = _user_model.write(tmp_path)
    params = models.param_shapes(models.build_spec(model, 0))
    return Case(name="user-z3-cpu-fp16", params=params, ds_config=canonical_json(CFG), model=model, world_size=1,
                steps=2)


def test_the_replay_of_a_module_case_never_builds_the_synthetic_model(module_case, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the synthetic model stood in for the user's module")

    monkeypatch.setattr(synthetic, "initial_weights", refuse)
    monkeypatch.setattr(synthetic, "local_gradients", refuse)
    plan = bugs._max_update_cached.__wrapped__(module_case.to_json())
    assert len(plan) == module_case.steps and all(m > 0 for _, m, skipped, *_ in plan if not skipped)


def test_the_replay_starts_from_the_modules_weights_and_its_own_gradients(module_case):
    """Independently of the harness: the user's factory, its module in float64, torch autograd on batch
    (rank 0, step 1, micro 0) rounded to fp16."""
    init, gradients = module_oracle.free_gradients(module_case)
    module, batch = _user_model_factory(module_case.model)(0)
    for n, p in module.named_parameters():
        assert torch.equal(init[n], p.detach().to(torch.float64)), n
    m64 = module.to(torch.float64)
    b = {k: (v.to(torch.float16).to(torch.float64) if v.is_floating_point() else v) for k, v in batch(0, 1, 0).items()}
    expected = dict(zip([n for n, _ in m64.named_parameters()], torch.autograd.grad(m64(**b), list(m64.parameters()))))
    got = gradients(init, 1)[0][0]
    assert set(got) == set(expected)
    for n in expected:
        assert torch.equal(got[n], expected[n]), n


def test_the_module_replay_differs_from_the_synthetic_stand_in(module_case):
    own = bugs._max_update_cached.__wrapped__(module_case.to_json())
    stand_in = bugs._max_update_cached.__wrapped__(module_case.replace(model=None).to_json())
    assert [m for _, m, *_ in own] != [m for _, m, *_ in stand_in]


def _user_model_factory(model: str):
    return models.load_factory(model)
