"""How far each of DeepSpeed's Muon steps is from Muon's as defined, all departures together.

Why beside the per-departure findings (``harness.judge.departures``): a user asks "is my training Muon?",
and the departures act together (the clip divides the update DeepSpeed orthogonalised, the schedule
replaced the half's lr, Newton-Schulz ran in 16 bit). This replays each applied step from DeepSpeed's own
state before it (its masters and momentum: teacher forcing, as the intended oracle does) with
``oracles.muon_as_defined``, and compares the step DeepSpeed applied to each Muon matrix with the step
Muon as defined applies to the same matrix from the same state: ``gap = ||dW_ds - dW_def|| / ||dW_def||``,
with the norm ratio and cosine of the two steps. Every input is captured data: the raw gradients (true
units), DeepSpeed's momentum and masters, the lr each group ran at.

Every matrix DeepSpeed tags Muon is compared as a Muon matrix, an embedding it tags by name included:
Muon as defined would step that one with Adam, whose state the run did not keep (MUON-BY-NAME names it).
"""
from __future__ import annotations

import math
import statistics

import numpy as np
import torch

from harness.case.schedule_lrs import broadcast_lrs
from harness.case.spec import Case
from harness.case.trajectory import Trajectory
from harness.judge.departures import muon_group_lr
from oracles import muon_as_defined as mad

PEAK_PARAMS = ("warmup_max_lr", "cycle_max_lr", "max_lr")  # a schedule's one peak for every group


def _true(a, scale: float) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float64) / float(scale))


def _row(step: int, name: str, d_ds: torch.Tensor, d_def: torch.Tensor) -> dict:
    n_def, n_ds = float(torch.linalg.vector_norm(d_def)), float(torch.linalg.vector_norm(d_ds))
    cos = float((d_ds * d_def).sum()) / (n_ds * n_def) if n_ds and n_def else math.nan
    return {"step": step, "param": name, "gap": float(torch.linalg.vector_norm(d_ds - d_def)) / n_def,
            "norm_ratio": n_ds / n_def, "cosine": cos if math.isfinite(cos) else None}


def gap(case: Case, traj: Trajectory) -> dict:
    """``{"steps": [...], "missing": [...], "summary": str}``: one row per applied step and Muon matrix whose
    step as defined moves it; what a step lacked is named in ``missing`` instead of a row."""
    opt = case.ds.optimizer.muon
    peak = next((v for k, v in broadcast_lrs(case.schedule).items() if k in PEAK_PARAMS), None)
    prev_w = {n: torch.from_numpy(np.asarray(w, np.float64)) for n, w in traj.initial.items()}
    prev_m: dict[str, torch.Tensor] = {}
    rows, missing = [], []
    for rec in traj.steps:
        lr = muon_group_lr(rec)
        grads = {n: ps.grad for n, ps in rec.params.items()}
        if not rec.skipped and (lr is None or any(g is None for g in grads.values())):
            missing.append(f"step {rec.step}: " + ("no single Muon group lr" if lr is None else "a gradient"))
        elif not rec.skipped:
            factor = mad.clip_factor(mad.global_norm(_true(ps.grad, ps.grad_scale) for ps in rec.params.values()),
                                     case.ds.gradient_clipping)
            eta = mad.half_lr(lr, opt.lr, peak)
            for name in traj.muon_params:
                ps = rec.params[name]
                W = prev_w[name]
                st = mad.matrix_step(W, _true(ps.grad, ps.grad_scale), prev_m.get(name, torch.zeros_like(W)), lr=eta,
                                     momentum=opt.momentum, weight_decay=opt.weight_decay, factor=factor)
                d_def = st.weight - W
                if float(torch.linalg.vector_norm(d_def)):
                    rows.append(_row(rec.step, name, torch.from_numpy(np.asarray(ps.master, np.float64)) - W, d_def))
        for name, ps in rec.params.items():
            prev_w[name] = torch.from_numpy(np.asarray(ps.master, np.float64))
            if ps.momentum is not None:
                prev_m[name] = _true(ps.momentum, ps.momentum_scale)
    return {"steps": rows, "missing": missing, "summary": _summary(rows, missing)}


def _summary(rows: list[dict], missing: list[str]) -> str:
    if not rows:
        return "not measured: " + ("; ".join(missing) or "no applied step in which Muon as defined moves a matrix")
    gaps = [r["gap"] for r in rows]
    worst = max(rows, key=lambda r: r["gap"])
    ratios = [r["norm_ratio"] for r in rows]
    return (f"DeepSpeed's Muon steps are {statistics.median(gaps):.3g} (median) to {worst['gap']:.3g} (worst: "
            f"{worst['param']}, step {worst['step']}) of Muon's own step away from Muon as defined, from the same "
            f"state; DeepSpeed's step is {min(ratios):.3g} to {max(ratios):.3g} times as long"
            + (f"; not measured: {'; '.join(missing)}" if missing else ""))
