"""Each reported departure from Muon as defined held to a computation that does not share its reading.

Why: ``harness.judge.departures`` turns a run into the numbers ``check`` prints beside its verdict (by what
factor the clip divided every Muon step, the lr each half ran at, ...). A wrong number there misleads as
much as a wrong verdict, and the verdict cannot see it: the departures are what DeepSpeed intends. So the
gate's departure family (``harness.catalog.departures``) claims, per case, which departures apply
(``Case.departs``), and this module checks the findings against that claim and each one's size against
a second computation from other data:

* MUON-CLIP: the factor the step really applied, read off the fp32 masters (``theta' = theta (1 - lr wd) -
  lr f O``, so ``f`` is the projection of the master change on the captured update), against the factor
  the finding derived from the reported global norm;
* MUON-SCHED-LR, MUON-PLAIN-LR: the lrs from ``oracles.schedules`` and the config's raw ``lr`` /
  ``muon_lr`` / ``adam_lr`` keys, never the view the finding resolved them through;
* MUON-BY-NAME: the module's ``nn.Embedding`` weights (and what shares their storage) that DeepSpeed
  tagged Muon, every one of them among the finding's;
* MUON-NS16: the oracle's bit-faithful 16-bit Newton-Schulz (``oracles.emulate``) of the captured inputs,
  whose error against float64 must be the finding's: on the CPU the emulation reproduces DeepSpeed's update
  bit for bit from the captured gradient and momentum, so the two errors are one float64 computation on
  equal inputs;
* MUON-TP-SHARD: the cosine and norm ratio again with the tensor-parallel judge's own block rule
  (``harness.judge.tp_verdict``), which the gate's AutoTP verdict holds DeepSpeed's shards to.

A finding that says "not measured", a departure without a second computation here, or a claim the
findings do not meet, is a problem: a check without data fails.
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch
from torch import nn

from harness import models
from harness.case.spec import Case
from harness.case.trajectory import Trajectory
from harness.case.tp import COLUMN_PARALLEL
from harness.case.tp import geometry as tp_geometry
from harness.judge import tp_verdict
from harness.judge.departures import NOT_MEASURED, Finding, muon_group_lr, muon_input
from oracles import schedules
from oracles.emulate import emulated_direction
from oracles.newton_schulz import muon_direction

U32 = 2.0 ** -24  # fp32 unit round-off: the masters and DeepSpeed's O / k are fp32
U64 = 2.0 ** -53


def problems(case: Case, traj: Trajectory, found: list[Finding], claimed: tuple[str, ...]) -> list[str]:
    """What is wrong with ``found`` for a case that claims exactly the departures ``claimed``."""
    ids = [f.id for f in found]
    out = [f"{d} applies to this case but was not reported" for d in claimed if d not in ids]
    out += [f"{d} was reported but does not apply to this case" for d in ids if d not in claimed]
    for f in found:
        if f.magnitude.startswith(NOT_MEASURED):
            out.append(f"{f.id}: {f.magnitude}")
            continue
        pin = PINS.get(f.id)
        if pin is None:
            out.append(f"{f.id}: no second computation of its size (harness.judge.departure_pins)")
            continue
        out += [f"{f.id}: {p}" for p in pin(case, traj, f)]
    return out


def _raw_params(case: Case) -> dict:
    return (json.loads(case.ds_config).get("optimizer") or {}).get("params") or {}


def _half_lr(case: Case, half: str) -> float:
    """The configured lr of a half from the config's own keys (``muon_lr`` / ``adam_lr``, else ``lr``)."""
    p = _raw_params(case)
    return float(p[f"{half}_lr"] if f"{half}_lr" in p else p["lr"])


def _applied_factor(prev: np.ndarray, cur: np.ndarray, O: np.ndarray, lr: float, wd: float) -> tuple[float, float]:
    """(f, allowance): the factor the step applied to ``O``, least squares over the matrix, and its round-off
    bound: each fp32 master carries u32 |theta| (and the decayed product and ``lr f O`` one more rounding each),
    which moves the projection by at most ``||e|| / (lr ||O||)`` (Cauchy-Schwarz); ``O / k`` itself is one fp32
    rounding of f."""
    r = cur - prev * (1.0 - lr * wd)
    on = float(np.dot(O.ravel(), O.ravel()))
    f = -float(np.dot(r.ravel(), O.ravel())) / (lr * on)
    err = 3.0 * U32 * (np.linalg.norm(cur) + np.linalg.norm(prev))
    return f, float(err / (lr * math.sqrt(on)) + 2.0 * U32 * abs(f))


def _clip(case: Case, traj: Trajectory, f: Finding) -> list[str]:
    rows = {r["step"]: r for r in f.detail.get("steps", [])}
    muon, wd = set(traj.muon_params), case.ds.optimizer.muon.weight_decay
    prev = dict(traj.initial)
    out, seen = [], 0
    for rec in traj.steps:
        lr = muon_group_lr(rec)
        for name, ps in rec.params.items():
            if name in muon and not rec.skipped and lr and ps.update is not None and np.any(ps.update):
                row = rows.get(rec.step, {})
                got, tol = _applied_factor(np.asarray(prev[name], np.float64), np.asarray(ps.master, np.float64),
                                           np.asarray(ps.update, np.float64), lr, wd)
                seen += 1
                if "factor" not in row or abs(row["factor"] - got) > tol:
                    out.append(f"step {rec.step}, {name}: the masters moved by {got:.9g} x lr x O, the finding says "
                               f"{row.get('factor')} (allowance {tol:.3g})")
            prev[name] = ps.master
    return out or ([] if seen else ["no applied step at lr > 0 moved a Muon matrix: nothing to hold the factor to"])


def _lr_rows(case: Case, traj: Trajectory, f: Finding, half: str) -> list[str]:
    """Each step's used lr of a half against ``oracles.schedules`` on the config's own lr keys."""
    out, applied = [], 0
    rows = {(r["step"], r["group"]): r for r in f.detail.get("steps", [])}
    for rec in traj.steps:
        for group in rec.group_lr:
            if not group.endswith(f"{half}-params"):
                continue
            want = schedules.group_lr(case.schedule, _half_lr(case, half), applied)
            row = rows.get((rec.step, group))
            if row is None or abs(row["lr"] - want) > 4 * U64 * abs(want):
                out.append(f"step {rec.step}, {group}: the schedule gives lr {want:.9g}, the finding says "
                           f"{None if row is None else row['lr']}")
        applied += not rec.skipped
    return out


def _sched(case: Case, traj: Trajectory, f: Finding) -> list[str]:
    out = _lr_rows(case, traj, f, "muon") + _lr_rows(case, traj, f, "adam")
    configured = _half_lr(case, "muon") / _half_lr(case, "adam")
    for pair in f.detail.get("muon_to_adam", []):
        if abs(pair["configured"] - configured) > 4 * U64 * configured:
            out.append(f"step {pair['step']}: configured Muon:Adam lr {configured:.9g}, the finding says "
                       f"{pair['configured']}")
    if not f.detail.get("muon_to_adam"):
        out.append("no step with both halves' lr: the ratio the schedule overrides is not shown")
    return out


def _plain(case: Case, traj: Trajectory, f: Finding) -> list[str]:
    raw = _raw_params(case)
    out = [] if "adam_lr" not in raw else ["the config gives adam_lr: its plain lr does not reach the Adam half"]
    if f.detail.get("adam_lr") != float(raw.get("lr", math.nan)):
        out.append(f"the config's plain lr is {raw.get('lr')}, the finding says the Adam half takes "
                   f"{f.detail.get('adam_lr')}")
    return out + _lr_rows(case, traj, f, "adam")


def _by_name(case: Case, traj: Trajectory, f: Finding) -> list[str]:
    if not case.model:
        return ["no Case.model to read the module's embeddings from"]
    module = models.build_spec(case.model, case.seed).module
    emb = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    tagged = set(traj.muon_params)
    want = {n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in emb} & tagged
    said = {p["name"] for p in f.detail.get("params", [])}
    out = [f"{n}: an nn.Embedding weight DeepSpeed tagged Muon, not reported" for n in sorted(want - said)]
    out += [f"{n}: reported, but DeepSpeed did not tag it Muon" for n in sorted(said - tagged)]
    return out + ([] if want else ["no nn.Embedding weight on Muon in this model: nothing to hold the finding to"])


def _ns16(case: Case, traj: Trajectory, f: Finding) -> list[str]:
    rows = {(r["step"], r["param"]): r for r in f.detail.get("steps", [])}
    beta, out = case.ds.optimizer.muon.momentum, []
    for rec in (s for s in traj.steps if not s.skipped):
        for name in traj.muon_params:
            ps = rec.params.get(name)
            U = muon_input(ps, beta) if ps is not None else None
            row = rows.get((rec.step, name))
            if U is None or row is None:
                out.append(f"step {rec.step}, {name}: no finding row or no captured input")
                continue
            dt = getattr(torch, ps.grad_dtype.removeprefix("torch.")) if ps.grad_dtype else torch.float32
            g = torch.from_numpy(np.asarray(ps.grad, np.float64) / (ps.grad_scale / ps.momentum_scale)).to(dt)
            m = torch.from_numpy(np.asarray(ps.momentum, np.float64)).to(dt)
            ns = row["ns_method"]
            emul = emulated_direction(g.lerp(m, beta), ns, out_dtype=dt, conv_aspect="last_two_dims").double()
            ref = muon_direction(torch.from_numpy(U), ns)
            want = float(torch.linalg.vector_norm(emul - ref) / torch.linalg.vector_norm(ref))
            if abs(row["relative_frobenius"] - want) > 16 * U64 * want * math.sqrt(ref.numel()):
                out.append(f"step {rec.step}, {name}: 16-bit Newton-Schulz as the oracle emulates it is {want:.9g} "
                           f"off float64, the finding says {row['relative_frobenius']}")
    return out


def _shardwise(U: torch.Tensor, name: str, case: Case, ns: str) -> torch.Tensor:
    """Float64 Newton-Schulz of each rank's block of ``U`` by the tensor-parallel judge's own rule (its block
    and per-head split, ``harness.judge.tp_verdict``), put back together."""
    tp, leaf = case.ds.tp_size, name.split(".")[-2]
    head_dim = tp_geometry(case)["head_dim"] if case.ds.optimizer.per_head_muon else None
    blocks = [tp_verdict.shard_of(U, leaf, r, tp) for r in range(tp)]
    out = [muon_direction(b, ns, tp_verdict.shard_heads(leaf, tuple(b.shape), head_dim)) for b in blocks]
    return torch.cat(out, dim=0 if leaf in COLUMN_PARALLEL else 1)


def _tp(case: Case, traj: Trajectory, f: Finding) -> list[str]:
    """The finding's cosine and norm ratio again, with the blocks the tensor-parallel judge holds DeepSpeed's
    shards to (the gate's AutoTP verdict checks DeepSpeed orthogonalises exactly those); the whole matrix
    alike. Float64 on both sides, so they agree to float64 round-off over the matrix."""
    out, beta = [], case.ds.optimizer.muon.momentum
    ns = case.ds.optimizer.muon.ns_method or "standard"
    spec = {p.name: p for p in case.params}
    for row in f.detail.get("steps", []):
        ps = traj.steps[row["step"] - 1].params[row["param"]]
        U = torch.from_numpy(muon_input(ps, beta))
        heads = spec[row["param"]].num_heads if case.ds.optimizer.per_head_muon else None
        whole, split = muon_direction(U, ns, heads), _shardwise(U, row["param"], case, ns)
        wn, sn = float(torch.linalg.vector_norm(whole)), float(torch.linalg.vector_norm(split))
        cos, ratio = float((whole * split).sum()) / (wn * sn), sn / wn
        tol = 8 * U64 * U.numel()
        if abs(cos - row["cosine"]) > tol or abs(ratio - row["norm_ratio"]) > tol * ratio:
            out.append(f"step {row['step']}, {row['param']}: by the tensor-parallel judge's blocks, cosine {cos:.12g} "
                       f"and norm ratio {ratio:.12g}; the finding says {row['cosine']} and {row['norm_ratio']}")
    return out or ([] if f.detail.get("steps") else ["no sharded Muon matrix measured"])


PINS = {"MUON-CLIP": _clip, "MUON-SCHED-LR": _sched, "MUON-PLAIN-LR": _plain, "MUON-BY-NAME": _by_name,
        "MUON-NS16": _ns16, "MUON-TP-SHARD": _tp}
