"""A localized overflow (``Overflow.param``): one parameter's gradient poisoned on one rank and micro-step,
the loss and every other gradient finite, the oracle's gradient poisoned at the same element; and the
validation that says how to place one."""
from __future__ import annotations

import math

import pytest
import torch

from harness.case import synthetic
from harness.case.scenarios import pipeline_case
from harness.case.spec import Case, Overflow
from harness.catalog import matrix
from harness.registry.mutants import MUTANTS


def _case(param, value=math.inf):
    c = pipeline_case(2, "none", "fp16", 2, steps=3, grad_accum=2)
    return c.replace(overflows=(Overflow(step=2, rank=1, micro=1, value=value, param=param),))


@pytest.mark.parametrize("param", ["layer0.weight", "layer1.bias"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_only_the_named_parameter_s_gradient_goes_non_finite(param, value):
    c = _case(param, value)
    model = synthetic.build_model(c, dtype=torch.float16)
    loss = model(synthetic.batch_data(c, 1, 2, 1))
    assert bool(torch.isfinite(loss))
    loss.backward()
    weights = {n: p.detach().to(torch.float64) for n, p in model.named_parameters()}
    oracle = synthetic.local_gradients(weights, c, 1, 2, 1)
    for n, p in model.named_parameters():
        g = p.grad.to(torch.float64)
        if n != param:
            assert bool(torch.isfinite(g).all()) and bool(torch.isfinite(oracle[n]).all())
            continue
        bad = ~torch.isfinite(g.view(-1))
        assert bad.nonzero().view(-1).tolist() == [0]  # the first element only
        assert (~torch.isfinite(oracle[n].view(-1))).nonzero().view(-1).tolist() == [0]
        assert math.isnan(float(g.view(-1)[0])) == math.isnan(value)
        # the rest of the poisoned parameter's gradient is the clean one
        clean = synthetic.local_gradients(weights, c.replace(overflows=()), 1, 2, 1)[n]
        assert torch.equal(oracle[n].view(-1)[1:], clean.view(-1)[1:])
    # another rank, or another micro-step of the same rank, is clean
    for rank, micro in ((0, 1), (1, 0)):
        assert all(bool(torch.isfinite(t).all())
                   for t in synthetic.local_gradients(weights, c, rank, 2, micro).values())


@pytest.mark.parametrize("overflow, needle", [
    (dict(step=0), "step 0: must be an integer >= 1"),
    (dict(value=1e30), "must be inf, -inf or nan"),
    (dict(param="layer9.weight"), "is not a parameter of the case"),
    (dict(micro=2), "micro must be 0..1"),
    (dict(rank=2), "rank 0..1"),
    (dict(step=4), "step must be 1..3"),
])
def test_a_misplaced_overflow_says_how_to_place_it(overflow, needle):
    kw = dict(step=2, rank=1, micro=1, param="layer0.weight")
    kw.update(overflow)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        _case(None).replace(overflows=(Overflow(**kw),))


def test_case_json_round_trips_and_old_overflows_keep_their_json():
    c = _case("layer1.bias", math.nan)
    back = Case.from_json(c.to_json())
    assert back.overflows[0].param == "layer1.bias" and math.isnan(back.overflows[0].value)
    old = c.replace(overflows=(Overflow(step=2, rank=1),))
    assert '"param"' not in old.to_json()


def test_the_family_poisons_one_parameter_and_the_mutant_spares_the_old_overflow_cases():
    """Every localized-overflow case poisons one named parameter (a Muon matrix or an Adam vector); the
    catalogued mutant that commits clean Muon momentum on a skipped step is predicted to be caught by
    some of them and by no case that poisons everything."""
    for full in (False, True):
        fam = matrix.local_overflow_cases(full)
        assert fam and all(c.overflows and all(o.param in matrix.LOCAL_OVERFLOW_TARGETS.values()
                                               for o in c.overflows) for c in fam)
        assert {matrix.group_of(c.name) for c in fam} == {"ovfloc"}
    m = MUTANTS["momentum-committed-on-skip"]
    everything = matrix.gate_cases(True)
    assert any(m.expected(c) for c in matrix.local_overflow_cases())
    assert not [c.name for c in everything if c.overflows and m.expected(c)
                and any(o.param is None for o in c.overflows)]
