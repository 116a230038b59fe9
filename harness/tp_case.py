"""The rank side of a tensor-parallel case: DeepSpeed's AutoTP shards a Llama-style attention block
across the ranks (``tensor_parallel.autotp_size``), and per-head Muon steps each rank's shard.

Why a case kind of its own: under AutoTP a parameter is a shard (column-parallel ``q_proj`` /
``k_proj`` / ``v_proj`` hold a contiguous block of rows, row-parallel ``o_proj`` a block of
columns), and DeepSpeed re-derives the per-head count from the shard after sharding
(``deepspeed.resolve_per_head_muon_after_sharding``, called only when ``autotp_size > 1``). The
ordinary capture reads whole parameters out of ZeRO's partitions and knows nothing of shards; this
module records, per rank, the shard before each step, the gradient and momentum DeepSpeed's
optimizer reads, and the shard after, and gathers them on rank 0. The judging is in
``harness.tp_verdict`` (parent side), from the mathematics alone: which rows each rank holds follows
the column-parallel rule, and the per-head blocks follow from the model's head counts.

The model: ``layers.0.self_attn.{q,k,v,o}_proj`` (no biases), ``y = o_proj(q * k + v)`` with ``q,
k, v`` the projections of the input, loss the mean squared error to a target. Every rank builds the
same full weights from the case's seed before AutoTP shards them, and feeds the same batch (AutoTP
checks that the tensor-parallel group sees one batch). ``model.config`` is a Hugging Face Llama
style config (head counts, head width, and Llama's ``base_model_tp_plan``), so DeepSpeed tags the
per-head projections itself (optimizer param ``per_head_muon``) and shards by that plan.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from harness.case import Case

LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj")
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj")  # split on dim 0 (the heads' axis)
ROW_PARALLEL = ("o_proj",)  # split on dim 1
# Hugging Face's LlamaConfig.base_model_tp_plan, restricted to the attention projections.
TP_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
           "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}


def autotp_size(case: Case) -> int:
    """The case's ``tensor_parallel.autotp_size`` (1: not a tensor-parallel case)."""
    return int((case.config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)


def geometry(case: Case) -> dict:
    """(hidden, heads, head width) from the case's params: ``q_proj`` is ``[heads*width, hidden]``."""
    by_leaf = {ps.name.split(".")[-2]: ps for ps in case.params}
    if set(by_leaf) != set(LEAVES) or len(case.params) != len(LEAVES):
        raise ValueError(f"{case.name}: a tensor-parallel case holds exactly the projections {LEAVES}, got "
                         f"{[ps.name for ps in case.params]}")
    q = by_leaf["q_proj"]
    if not q.num_heads or q.shape[0] % q.num_heads:
        raise ValueError(f"{case.name}: q_proj {q.shape} needs a head count dividing its rows")
    return {"hidden": q.shape[1], "heads": q.num_heads, "head_dim": q.shape[0] // q.num_heads}


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.k_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.v_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.o_proj = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.o_proj(self.q_proj(x) * self.k_proj(x) + self.v_proj(x))


class Layer(torch.nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.self_attn = Attention(hidden, inner)

    def forward(self, x):
        return self.self_attn(x)


class TinyLlama(torch.nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(hidden, inner)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


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


def build_model(case: Case) -> TinyLlama:
    from types import SimpleNamespace

    geo = geometry(case)
    model = TinyLlama(geo["hidden"], geo["heads"] * geo["head_dim"])
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in full_weights(case).items():
            named[name].copy_(w)
    model.config = SimpleNamespace(num_attention_heads=geo["heads"], num_key_value_heads=geo["heads"],
                                   head_dim=geo["head_dim"], hidden_size=geo["hidden"],
                                   model_type="llama", base_model_tp_plan=dict(TP_PLAN))
    return model


def _master(p) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(p).detach().clone().float().reshape(p.shape)


def _calls(recorder, named: dict) -> dict:
    """The step's ``muon_update`` calls by shard: the gradient DeepSpeed handed Muon, the momentum after
    the call and the direction it returned (``harness.capture.MuonCallRecorder``)."""
    out = {}
    for call in recorder.calls:
        if call.name in out:
            raise RuntimeError(f"{call.name}: muon_update ran twice in one step")
        shape = named[call.name].shape
        out[call.name] = {k: torch.from_numpy(getattr(call, k).copy()).float().reshape(shape)
                          for k in ("grad", "momentum", "update")}
    return out


def run_on_rank(case: Case, rank: int, world_size: int, workdir: Path) -> dict | None:
    """Run the case on this rank; rank 0 returns every rank's record (``harness.tp_verdict``)."""
    import deepspeed
    import torch.distributed as tdist

    from harness import ds_run

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    if case.stage not in (1, 2) or case.dtype != "fp32":
        raise ValueError(f"{case.name}: the tensor-parallel case kind runs fp32 on ZeRO-1/2 (stage 0 drops "
                         "per-head Muon: muon_optimizer.py calls muon_update without num_heads)")
    torch.manual_seed(case.seed)
    state = ds_run.ProcessState()
    engine = None
    try:
        with contextlib.ExitStack() as stack:
            recorder = stack.enter_context(ds_run.recorded_patches(case))
            model = build_model(case)
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_run.rank_config(case, Path(workdir) / "nvme"))
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
        ds_run.destroy_engine(engine)
        state.restore()
    return {"ranks": gathered} if rank == 0 else None
