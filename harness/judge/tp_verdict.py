"""Judge a tensor-parallel case (``harness.rank.tp_case``) from the mathematics, never from DeepSpeed's state.

What the oracle decides on its own:

* **Which rows (columns) each rank holds.** Column-parallel projections (``q_proj``, ``k_proj``,
  ``v_proj``) are split on dim 0 into ``tp`` contiguous blocks in rank order, the row-parallel
  ``o_proj`` on dim 1 (Megatron's rule, which Llama's ``base_model_tp_plan`` names). Each rank's
  shard before the first step must equal that block of the full weights the seed builds, exactly.
* **Which blocks are orthogonalised.** The per-head rule applied to each rank's shard: a
  column-parallel shard of ``rows`` rows holds ``rows / head_dim`` whole heads of the model's head
  width when ``head_dim`` divides ``rows`` (then Newton-Schulz runs per head block of ``head_dim``
  rows, scaled by ``aspect_scale(head_dim, in)``), and is one matrix otherwise (DeepSpeed documents
  that it drops such a shard to the whole-matrix path); without ``per_head_muon`` every shard is one
  matrix. The head width comes from the case's head
  count (``ParamShape.num_heads``), never from ``muon_num_heads``. Per-head Newton-Schulz on a shard
  of whole heads is exactly the same blocks of per-head Newton-Schulz on the whole matrix, so this is
  Muon's intended per-head update. ``o_proj`` (no heads) is one matrix per shard: Muon on a
  row-parallel shard is DeepSpeed's convention under tensor parallelism (the full matrix never
  exists on a rank), named here rather than hidden.
* **The step.** Teacher-forced from DeepSpeed's own shard, momentum and gradient at each step (as
  ``harness.judge.verdict`` does for whole parameters): ``M' = lerp(M, g, 1 - beta)``, ``U = lerp(g, M',
  beta)``, ``theta' = theta (1 - lr wd) - lr O`` with ``O`` the direction above, evaluated with
  DeepSpeed's production rounding (``oracles.emulate``, bit-faithful on the eager path) and judged
  with the emulated mode's derived allowances (``oracles.allowances``).

What it does not judge: the gradient itself (the forward and backward of AutoTP's layers), which is
taken as DeepSpeed handed it to the optimizer; a wrong gradient still changes nothing about which
blocks Muon orthogonalises, the question this case kind exists for.
"""
from __future__ import annotations

import numpy as np
import torch

import oracles
from harness.case.trajectory import ParamStep, StepRecord, Trajectory
from harness.env import versions
from harness.case.spec import Case
from harness.judge.compare import compare_arrays, missing
from harness.case.tp import COLUMN_PARALLEL, autotp_size, full_weights, geometry
from harness.judge.verdict import Verdict
from oracles import emulate

# A rank's shard before its first step is a copy of the seed's weights: nothing rounds it.
PLACEMENT = oracles.Allowance(0.0, 0.0, "exact: before step 1 each rank's shard must be the column/row block "
                              "the tensor-parallel rule gives of the seed's full weights; any difference means "
                              "the rank does not hold that block")


def shard_key(name: str, rank: int, tp: int) -> str:
    """The parameter a shard's checks are filed under: the shard, not the whole parameter (its values
    are not the ZeRO layout of ``name``, so the report draws its heatmap without one)."""
    return f"{name}[tp {rank}/{tp}]"


def _leaf(name: str) -> str:
    return name.split(".")[-2]


def shard_of(full: torch.Tensor, leaf: str, rank: int, tp: int) -> torch.Tensor:
    """The block of ``full`` that tensor-parallel rank ``rank`` holds (module docstring)."""
    dim = 0 if leaf in COLUMN_PARALLEL else 1
    n = full.shape[dim]
    if n % tp:
        raise ValueError(f"{leaf}: dim {dim} of {tuple(full.shape)} does not split into {tp} equal shards")
    k = n // tp
    return full.narrow(dim, rank * k, k)


def shard_heads(leaf: str, shard_shape, head_dim: int | None) -> int | None:
    """How many per-head blocks the per-head rule gives a shard (None: one matrix; ``head_dim`` None:
    per-head Muon is off)."""
    if leaf not in COLUMN_PARALLEL or head_dim is None:
        return None
    rows = shard_shape[0]
    return rows // head_dim if rows % head_dim == 0 else None


def expected_step(theta, momentum, grad, *, beta: float, lr: float, wd: float, ns_method: str,
                  heads: int | None, fp16_ok: bool, bf16_ok: bool):
    """(momentum', master', direction) of one teacher-forced Muon step on one fp32 shard."""
    m_new, U, _ = emulate.emulated_momentum(momentum.float(), grad.float(), beta)
    O = emulate.emulated_direction(U, ns_method, heads, out_dtype=torch.float32,
                                   compute_dtype=emulate.ns_compute_dtype(ns_method, fp16_ok, bf16_ok))
    master = theta.double() * (1.0 - lr * wd) - lr * O.double()
    return m_new.double(), master, O


def whole_trajectory(case: Case, result: dict) -> Trajectory:
    """The tensor-parallel run as whole matrices: each step's shards (masters after, the gradient, momentum
    and update each rank's Muon call saw) put back together in the tensor-parallel rule's order
    (``shard_of``'s dims). Gradient and momentum are elementwise, so the whole ones are the Muon input of
    the whole matrix, and the update is the shard-wise one DeepSpeed applied: what the departure MUON-TP-SHARD
    compares with the whole matrix's (``harness.judge.departures.tp_finding``)."""
    tp = autotp_size(case)
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])[:tp]

    def whole(name: str, pieces) -> np.ndarray:
        dim = 0 if _leaf(name) in COLUMN_PARALLEL else 1
        return torch.cat([p.double() for p in pieces], dim=dim).numpy()

    names = list(full_weights(case))
    traj = Trajectory(case.name, {n: whole(n, [r["steps"][0]["before"][n] for r in ranks]) for n in names},
                      muon_params=tuple(names))
    for s in range(len(ranks[0]["steps"])):
        params = {}
        for n in names:
            calls = [r["steps"][s]["muon"].get(n) for r in ranks]
            after = whole(n, [r["steps"][s]["after"][n] for r in ranks])
            got = {q: whole(n, [c[q] for c in calls]) if all(c is not None for c in calls) else None
                   for q in ("grad", "momentum", "update")}
            params[n] = ParamStep(master=after, model=after, grad=got["grad"], momentum=got["momentum"],
                                  update=got["update"])
        traj.steps.append(StepRecord(s + 1, 1.0, 1.0, False, None, 0, params))
    return traj


def judge(case: Case, result: dict, *, half_support: tuple[bool, bool] | None = None) -> Verdict:
    """Every rank's shards of every step against the oracle; ``result`` is rank 0's gathered records.
    The same record as every other case (``harness.judge.verdict.Verdict`` of ``harness.judge.compare.Check``): a
    shard's checks are filed under ``shard_key`` with the rank, and the oracle's block rule as region."""
    if half_support is None:
        from harness.env import device

        half_support = device.half_support()
    fp16_ok, bf16_ok = half_support
    tp = autotp_size(case)
    geo = geometry(case)
    opt = case.ds.optimizer
    beta, lr, wd = opt.muon.momentum, opt.muon.lr, opt.muon.weight_decay
    ns_method = opt.muon.ns_method or versions.default_ns_method()  # None: the release has no such option
    per_head = opt.per_head_muon  # the user's opt-in: without it every shard is one matrix
    full = full_weights(case)
    v = Verdict(case, "emulated")
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    if [r["rank"] for r in ranks] != list(range(case.world_size)):
        v.checks.append(missing(case.name, "<case>", "ranks", 0, f"records of ranks {[r['rank'] for r in ranks]}, "
                                f"expected every rank of {case.world_size}"))
        return v
    for rec in ranks:
        rank = rec["rank"] % tp
        for name, w in full.items():
            leaf = _leaf(name)
            key = shard_key(name, rank, tp)
            want = shard_of(w, leaf, rank, tp)
            got = rec["steps"][0]["before"][name]
            where = f"shard {tuple(want.shape)}, rows/cols {rank} of {tp}"
            if tuple(got.shape) != tuple(want.shape):
                chk = missing(case.name, key, "shard", 0, f"shape {tuple(got.shape)} is not the column/row block "
                              f"the tensor-parallel rule gives ({where})")
            else:
                chk = compare_arrays(case.name, key, "shard", 0, got.double(), want.double(), PLACEMENT)
            chk.rank, chk.region = rec["rank"], where
            v.checks.append(chk)
            if not chk.passed:
                continue
            heads = shard_heads(leaf, want.shape, geo["head_dim"] if per_head else None)
            blocks = f"{heads} head blocks of {geo['head_dim']} rows" if heads else "one matrix"
            for s, st in enumerate(rec["steps"]):
                call = st["muon"].get(name)
                if call is None:
                    chk = missing(case.name, key, "update", s + 1, "Muon never ran on this shard")
                    chk.rank = rec["rank"]
                    v.checks.append(chk)
                    continue
                theta, g = st["before"][name], call["grad"]
                # the momentum the step starts from: the previous step's (a fresh optimizer's is zero)
                m = rec["steps"][s - 1]["muon"][name]["momentum"] if s else torch.zeros_like(theta)
                m_new, master, O = expected_step(theta, m, g, beta=beta, lr=lr, wd=wd, ns_method=ns_method,
                                                 heads=heads, fp16_ok=fp16_ok, bf16_ok=bf16_ok)
                weight_scale = float(theta.abs().max())
                step_size = lr * float(O.abs().max())
                a = oracles.allowances("emulated", model_dtype="fp32", shape=tuple(theta.shape), steps=1,
                                       ns_method=ns_method, beta=beta, num_heads=heads, weight_scale=weight_scale,
                                       step_to_weight=step_size / weight_scale if weight_scale > 0 else 1.0,
                                       clipping_active=False, use_muon=True)
                for quantity, actual, expected, allow in (("momentum", call["momentum"], m_new, a.momentum),
                                                          ("update", call["update"], O.double(), a.direction),
                                                          ("master", st["after"][name], master, a.master)):
                    chk = compare_arrays(case.name, key, quantity, s + 1, actual.double(), expected, allow)
                    chk.rank, chk.region = rec["rank"], f"shard {tuple(theta.shape)}, oracle: {blocks}"
                    v.checks.append(chk)
    if not v.checks:
        v.checks.append(missing(case.name, "<case>", "shards", 0, "nothing was checked (no rank records)"))
    return v
