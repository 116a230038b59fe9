"""What a tensor-parallel case declares: the AutoTP size, the attention block's geometry, the full
weights and batches every rank starts from. Pure functions of the case, so that the judge
(``harness.judge.tp_verdict``) and the refusals (``harness.registry.refusals``) read them without
importing the rank side (``harness.rank.tp_case``).
"""
from __future__ import annotations

import torch

from harness.case.spec import Case

LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj")
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj")  # split on dim 0 (the heads' axis)
ROW_PARALLEL = ("o_proj",)  # split on dim 1
SOFTMAX_ATTN, LINEAR_ATTN = "self_attn", "linear_attn"  # the attention module's name in the layer


def tp_plan(attn: str) -> dict:
    """Hugging Face's LlamaConfig.base_model_tp_plan, restricted to the attention projections."""
    return {f"layers.*.{attn}.{leaf}": ("rowwise" if leaf in ROW_PARALLEL else "colwise") for leaf in LEAVES}


def autotp_size(case: Case) -> int:
    """The number of ranks AutoTP shards the case over (1: not a tensor-parallel case; DeepSpeed's
    ``autotp_size`` default 0 means the same, ``DSConfig.tp_size``)."""
    return case.ds.tp_size


def geometry(case: Case) -> dict:
    """(hidden, heads, head width, attention module name) from the case's params: ``q_proj`` is
    ``[heads*width, hidden]``, named ``layers.0.<attn>.q_proj.weight``."""
    by_leaf = {ps.name.split(".")[-2]: ps for ps in case.params}
    attn = {ps.name.split(".")[-3] for ps in case.params}
    if set(by_leaf) != set(LEAVES) or len(case.params) != len(LEAVES) or len(attn) != 1 \
            or attn.issubset({SOFTMAX_ATTN, LINEAR_ATTN}) is False:
        raise ValueError(f"{case.name}: a tensor-parallel case holds exactly the projections {LEAVES} of one "
                         f"{SOFTMAX_ATTN} or {LINEAR_ATTN} module, got {[ps.name for ps in case.params]}")
    q, k = by_leaf["q_proj"], by_leaf["k_proj"]
    if not q.num_heads or q.shape[0] % q.num_heads:
        raise ValueError(f"{case.name}: q_proj {q.shape} needs a head count dividing its rows")
    width = q.shape[0] // q.num_heads
    kv_heads = k.num_heads or q.num_heads
    if k.shape != by_leaf["v_proj"].shape or k.shape[0] != kv_heads * width:
        raise ValueError(f"{case.name}: k_proj and v_proj must be {kv_heads} heads of q_proj's width {width}")
    return {"hidden": q.shape[1], "heads": q.num_heads, "kv_heads": kv_heads, "head_dim": width,
            "attn": attn.pop()}


def full_weights(case: Case) -> dict[str, torch.Tensor]:
    """The unsharded float32 weights every rank starts from (the seed alone decides them)."""
    g = torch.Generator().manual_seed(case.seed)
    out = {}
    for ps in case.params:
        fan_in = ps.shape[1]
        out[ps.name] = (torch.randn(ps.shape, generator=g, dtype=torch.float64) / fan_in ** 0.5).float()
    return out


def batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of one step: the same on every rank of the tensor-parallel group."""
    geo = geometry(case)
    g = torch.Generator().manual_seed(10_000 * case.seed + step + 1)
    x = torch.randn(case.batch, geo["hidden"], generator=g, dtype=torch.float64).float()
    t = torch.randn(case.batch, geo["hidden"], generator=g, dtype=torch.float64).float()
    return x, t


def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).mean()
