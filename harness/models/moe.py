"""A tiny mixture-of-experts language model in plain torch: token embedding, one mixture-of-experts
block with 3-D expert weights ``[experts, in, out]`` (DeepSpeed tags them Muon: >= 2 dims; the oracle
orthogonalises each expert's matrix, ``oracles.muon_direction``), an untied ``lm_head``, and parameter
groups. It needs no optional package, so it carries everything the model-specific mutants need:
``embed``/``lm_head`` names (Adam by DeepSpeed's rule), group overrides, and ``zero.Init``.

Routing is dense (every token is a softmax-weighted mixture of every expert) rather than top-k: a
top-k choice is a discontinuity, and the float64 oracle replaying the forward at the same weights
could pick a different expert than the low-precision run on a near-tie, which would be a difference
of routing, not of the optimizer.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from harness.models import ModelSpec, ParamGroup
from harness.models._data import generator, seeded_init
from oracles import ParamSpec

D, H, E = 16, 24, 4  # model width, expert hidden width, experts
VOCAB, BATCH, TOKENS = 32, 2, 6


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(E, D, H) / math.sqrt(D))
        self.w_out = nn.Parameter(torch.randn(E, H, D) / math.sqrt(H))

    def forward(self, x, gates):
        h = F.gelu(torch.einsum("btd,edh->bteh", x, self.w_in))
        y = torch.einsum("bteh,ehd->bted", h, self.w_out)
        return (gates.unsqueeze(-1) * y).sum(dim=-2)


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = Experts()

    def forward(self, x):
        h = self.norm(x)
        gates = torch.softmax(self.router(h), dim=-1)
        return x + self.experts(h, gates)


class MoELM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.block = MoEBlock()
        self.proj = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        h = torch.tanh(self.proj(self.block(self.embed(input_ids))))
        logits = self.lm_head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def moe(seed: int) -> ModelSpec:
    """With parameter groups as many Muon recipes set them: the matrices decayed, everything else
    (norm, biases) not, and the auxiliary Adam at its own learning rate."""
    seeded_init(seed, 0x30E)
    module = MoELM()

    def batch(rank: int, step: int, micro: int) -> dict:
        g = generator(seed, 0x30EB, rank, step, micro)
        ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g)
        return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}

    return ModelSpec(module, batch, param_groups=default_groups(module))


def moe_ep(seed: int) -> ModelSpec:
    """The same model with its expert weights tagged ``is_expert_group``, as DeepSpeed's own grouped experts
    tag theirs (``deepspeed/moe/ep_experts.py``, ``GroupedExperts``): ``muon_update`` then runs Newton-Schulz
    per expert through its expert branch (``original_muon.py:219-222``) instead of its general one. For a
    3-D weight both compute each expert's orthogonalised matrix with its own aspect scale, so the oracle is
    the same; what the tag changes is which of DeepSpeed's code runs (ZeRO-3 without offload does not pass
    the tag to ``muon_update``: docs/deepspeed-0.19.8.md, section 13)."""
    spec = moe(seed)
    for p in (spec.module.block.experts.w_in, spec.module.block.experts.w_out):
        p.is_expert_group = True
    return spec


def default_groups(module: nn.Module, weight_decay: float = 0.1, adam_lr: float = 2e-3) -> tuple[ParamGroup, ...]:
    """Matrices (>= 2 dims, no "embed"/"lm_head" in the name: the Muon half) with ``weight_decay``,
    the rest without decay and at ``adam_lr``. The split follows the tagging rule so that each
    incoming group is exactly one of DeepSpeed's Muon/Adam halves (the layout of the optimizer's
    flat groups is then the same as without groups)."""

    muon, other = [], []
    for n, p in module.named_parameters():
        shape = tuple(getattr(p, "ds_shape", p.shape))  # under zero.Init p.shape is a 1-D placeholder
        (muon if ParamSpec.deepspeed_tagged(n, shape).use_muon else other).append(n)
    return (ParamGroup(tuple(muon), (("weight_decay", weight_decay),)),
            ParamGroup(tuple(other), (("weight_decay", 0.0), ("lr", adam_lr))))
