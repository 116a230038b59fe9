"""The rank side of a tensor-parallel case: DeepSpeed's AutoTP shards a Llama-style attention block
across the ranks (``tensor_parallel.autotp_size``), and per-head Muon steps each rank's shard.

Why a case kind of its own: under AutoTP a parameter is a shard (column-parallel ``q_proj`` /
``k_proj`` / ``v_proj`` hold a contiguous block of rows, row-parallel ``o_proj`` a block of
columns), and DeepSpeed re-derives the per-head count from the shard after sharding
(``deepspeed.resolve_per_head_muon_after_sharding``, called only when ``autotp_size > 1``). The
ordinary capture reads whole parameters out of ZeRO's partitions and knows nothing of shards; this
module records, per rank, the shard before each step, the gradient and momentum DeepSpeed's
optimizer reads, and the shard after, and gathers them on rank 0. The judging is in
``harness.judge.tp_verdict`` (parent side), from the mathematics alone: which rows each rank holds follows
the column-parallel rule, and the per-head blocks follow from the model's head counts.

The model: ``layers.0.self_attn.{q,k,v,o}_proj`` (or ``linear_attn``, a ``KimiDeltaAttention``; no
biases), ``y = o_proj(q * k + v)`` with ``q, k, v`` the projections of the input, loss the mean squared
error to a target. Every rank builds the same full weights from the case's seed before AutoTP shards
them, and feeds the same batch (AutoTP checks that the tensor-parallel group sees one batch).
``model.config`` is a Hugging Face Llama style config (head counts, head width, and Llama's
``base_model_tp_plan``), so DeepSpeed tags the per-head projections itself (optimizer param
``per_head_muon``) and shards by that plan.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from harness.case.spec import Case
from harness.case.tp import LINEAR_ATTN, autotp_size, batch, full_weights, geometry, loss_fn, tp_plan
from types import SimpleNamespace
import torch.distributed as tdist

class Attention(torch.nn.Module):
    def __init__(self, hidden: int, inner: int, kv_inner: int | None = None):
        super().__init__()
        kv_inner = inner if kv_inner is None else kv_inner
        # o_proj (no heads) is registered first: DeepSpeed's per-shard re-resolution then meets a parameter
        # without a head width before the tagged ones, as it meets the embedding first in any real model.
        self.o_proj = torch.nn.Linear(inner, hidden, bias=False)
        self.q_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_inner, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_inner, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if k.shape[-1] == q.shape[-1]:
            return self.o_proj(q * k + v)
        # grouped key/value heads (fewer rows than q): each still reaches the loss, through a sum
        return self.o_proj(q) + (k * v).sum(-1, keepdim=True)


class KimiDeltaAttention(Attention):
    """A linear-attention module of the class DeepSpeed 0.19.8 lists (``deepspeed/__init__.py``
    ``_LINEAR_ATTENTION_OWNERS``): its own ``num_heads`` x ``head_dim`` decide the per-head blocks of its
    projections, over the model config's head counts (which describe the softmax-attention layers)."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__(hidden, heads * head_dim)
        self.num_heads, self.head_dim = heads, head_dim


class Layer(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, attn: str, kv_heads: int | None = None):
        super().__init__()
        self.attn_name = attn
        setattr(self, attn, KimiDeltaAttention(hidden, heads, head_dim) if attn == LINEAR_ATTN
                else Attention(hidden, heads * head_dim, (kv_heads or heads) * head_dim))

    def forward(self, x):
        return getattr(self, self.attn_name)(x)


class TinyLlama(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, attn: str, kv_heads: int | None = None):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(hidden, heads, head_dim, attn, kv_heads)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_model(case: Case) -> TinyLlama:
    """The model with the seed's full weights and a Llama-style ``model.config``. With a linear-attention
    module the config describes the softmax layers of a hybrid model: one head per tensor-parallel rank
    over the same rows, which the module's own geometry overrides for per-head Muon; a model that read the
    config there would orthogonalise each rank's heads as one block."""

    geo = geometry(case)
    model = TinyLlama(geo["hidden"], geo["heads"], geo["head_dim"], geo["attn"], geo["kv_heads"])
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in full_weights(case).items():
            named[name].copy_(w)
    heads, width = geo["heads"], geo["head_dim"]
    if geo["attn"] == LINEAR_ATTN:
        # AutoTP splits on the config's head boundaries: one config head per rank keeps the split even
        tp = autotp_size(case)
        if heads == tp or (heads * width) % tp:
            raise ValueError(f"{case.name}: the linear-attention case describes {tp} config heads, which must "
                             f"differ from its {heads} heads and divide its {heads * width} rows")
        heads, width = tp, heads * width // tp
    kv_heads = heads if geo["attn"] == LINEAR_ATTN else geo["kv_heads"]
    model.config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=width,
                                   hidden_size=geo["hidden"], model_type="llama",
                                   base_model_tp_plan=tp_plan(geo["attn"]))
    return model


def _master(p) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param  # late: DeepSpeed, rank side

    return safe_get_full_fp32_param(p).detach().clone().float().reshape(p.shape)


def _calls(recorder, named: dict) -> dict:
    """The step's ``muon_update`` calls by shard: the gradient DeepSpeed handed Muon, the momentum after
    the call and the direction it returned (``harness.rank.capture.MuonCallRecorder``)."""
    out = {}
    for call in recorder.calls:
        if call.name in out:
            raise RuntimeError(f"{call.name}: muon_update ran twice in one step")
        shape = named[call.name].shape
        out[call.name] = {k: torch.from_numpy(getattr(call, k).copy()).float().reshape(shape)
                          for k in ("grad", "momentum", "update")}
    return out


def run_on_rank(case: Case, rank: int, world_size: int, workdir: Path, *, process_state, patches, config
                ) -> dict | None:
    """Run the case on this rank; rank 0 returns every rank's record (``harness.judge.tp_verdict``).

    Called by ``harness.rank.ds_run.run_case_on_rank`` (the ranks' one entry), which hands over its own
    per-case machinery, so that this module does not import it back: ``process_state`` (what a case
    must leave as it found it), ``patches`` (the patched runtime and the Muon call recorder, a context
    manager yielding the recorder) and ``config`` (the case's DeepSpeed config on this rank)."""
    import deepspeed  # late: DeepSpeed, rank side

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    if case.stage not in (1, 2) or case.dtype != "fp32":
        raise ValueError(f"{case.name}: the tensor-parallel case kind runs fp32 on ZeRO-1/2 (stage 0 drops "
                         "per-head Muon: muon_optimizer.py calls muon_update without num_heads)")
    torch.manual_seed(case.seed)
    state = process_state()
    engine = None
    try:
        with contextlib.ExitStack() as stack:
            recorder = stack.enter_context(patches(case))
            model = build_model(case)
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=config(case, Path(workdir) / "nvme"))
            named = dict(engine.module.named_parameters())
            recorder.set_params(list(named.items()))
            rec = {"rank": rank, "tags": {n: getattr(p, "muon_num_heads", None) for n, p in named.items()},
                   "steps": []}
            for s in range(case.steps):
                before = {n: _master(p) for n, p in named.items()}
                recorder.reset()
                x, t = batch(case, s)
                loss = loss_fn(engine(x), t)
                engine.backward(loss)
                engine.step()
                after = {n: _master(p) for n, p in named.items()}
                rec["steps"].append({"before": before, "after": after, "muon": _calls(recorder, named)})
            gathered = [None] * world_size
            tdist.all_gather_object(gathered, rec)
    finally:
        if engine is not None:
            engine.destroy()
        state.restore()
    return {"ranks": gathered} if rank == 0 else None
