"""The two layout rules every trigger and mutant asks (one home each, ``oracles.layout``): which
parameters DeepSpeed puts on Muon, and which elements of a ZeRO-3 parameter share a partition with
padding."""
from __future__ import annotations

import types

import pytest

from harness.registry import bugs, mutants as known_bugs
from harness.case.spec import ParamShape
from harness.case.scenarios import pipeline_case
from oracles import ParamSpec
from oracles.layout import deepspeed_uses_muon, param_slices, zero3_layout, zero3_padded_tail

NAMES_SHAPES = [
    ("layer0.weight", (8, 6)), ("layer0.bias", (8,)), ("model.embed_tokens.weight", (10, 4)),
    ("lm_head.weight", (10, 4)), ("LM_HEAD.weight", (3, 3)), ("conv.weight", (4, 3, 2, 2)),
    ("Embedding.table", (5, 5)), ("scalar", ()), ("attn.qkv.weight", (12, 4)),
]


def test_muon_tag_agrees_with_deepspeed_set_optimizer_flags():
    """The rule against DeepSpeed's own tagging of a module holding each name and shape."""
    import torch
    from deepspeed import set_optimizer_flags
    from deepspeed.runtime.config import MUON_OPTIMIZER

    model = torch.nn.Module()
    for name, shape in NAMES_SHAPES:
        # a dotted name cannot be a parameter name; nest modules instead
        owner = model
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    cfg = types.SimpleNamespace(optimizer_name=MUON_OPTIMIZER, optimizer_params={})
    set_optimizer_flags(cfg, model)
    tagged = {n: bool(p.use_muon) for n, p in model.named_parameters()}
    assert set(tagged) == {n for n, _ in NAMES_SHAPES}
    assert any(tagged.values()) and not all(tagged.values())
    for name, shape in NAMES_SHAPES:
        assert deepspeed_uses_muon(name, shape) == tagged[name], name


@pytest.mark.parametrize("name, shape", NAMES_SHAPES)
def test_every_consumer_uses_the_one_rule(name, shape):
    want = deepspeed_uses_muon(name, shape)
    assert ParamShape(name, shape).uses_muon == want
    assert ParamSpec.deepspeed_tagged(name, shape).use_muon == want
    assert bugs._is_muon(ParamShape(name, shape)) == want


def _tail_from_layout(n: int, W: int):
    """The same question answered from the layout's rank slices: the slice shorter than q."""
    q = -(-n // W)
    short = [s for s in param_slices(zero3_layout([[("p", (n,))]], W), "p") if s.param_end - s.param_start < q]
    assert len(short) <= 1
    return (short[0].param_start, short[0].param_end) if short else None


@pytest.mark.parametrize("W", [1, 2, 3, 4, 5, 8])
def test_padded_tail_matches_the_layout_slices(W):
    for n in range(1, 70):
        assert zero3_padded_tail(n, W) == _tail_from_layout(n, W), (n, W)


def test_padded_tail_five_elements_on_four_ranks():
    """q = 2: ranks 0, 1 hold [0,2), [2,4); rank 2 holds element 4 and one zero; rank 3 only zeros.
    The tail is on rank 2, not on the last rank (where the kill-matrix copy used to look)."""
    assert zero3_padded_tail(5, 4) == (4, 5)
    assert zero3_padded_tail(6, 4) is None  # q = 2 divides 6: rank 3 holds padding only, no shared partition
    assert zero3_padded_tail(7, 2) == (4, 7)
    assert zero3_padded_tail(8, 4) is None


def test_bug_trigger_and_mutant_prediction_agree_on_the_tail():
    for n, W, tail in [(5, 4, True), (6, 4, False), (7, 2, True), (9, 3, False), (10, 3, True)]:
        c = pipeline_case(3, "none", "fp32", W, params=(ParamShape("w", (1, n)),))
        assert bugs._z3_padded_tail(c) is tail, (n, W)
        assert known_bugs._z3_padded_tail(c) is tail, (n, W)
