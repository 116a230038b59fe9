"""Trajectory -> oracle -> comparison: the judgement of one case.

For every optimizer step the oracle is replayed from DeepSpeed's own previous state (teacher
forcing: its fp32 masters and Muon momentum, and the averaged gradient it fed to the optimizer), so
one early deviation cannot snowball and each step is judged on its own. The gradient itself is
judged separately, against the float64 gradient of the same rounded data at DeepSpeed's own model
weights. Every quantity of every parameter is compared under the tolerance model
(``oracles.tolerance``); a failure names case, parameter, quantity, step, rank partition and region,
and the command that reruns exactly this case.

Which oracle: ``Conventions()`` -- the intended mathematics, with DeepSpeed's one deliberate
convention (the clip norm is taken over the Muon update) -- so that DeepSpeed's accidents show up as
divergences. ``conventions=deepspeed_conventions(...)`` is available for attribution.
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace

import numpy as np
import torch

import oracles
from harness import device
from harness import model as model_mod
from harness.case import Case
from harness.compare import Allowed, Check, LayoutView, compare_arrays, describe, first_divergence
from harness.trajectory import Trajectory

QUANTITIES = ("grad", "momentum", "update", "master", "model", "loss_scale", "skipped", "global_norm",
              "muon_calls")

# Oracle-side hooks for the detection self-test: name -> function(StepConfig) -> StepConfig.
# Only tests install these (never DeepSpeed): they prove a wrong oracle-relevant behaviour is caught.
ORACLE_HOOKS: dict[str, object] = {}


def reproduce_command(case: Case) -> str:
    return f".venv/bin/python -m harness run --case {shlex.quote(case.to_json())}"


def comparison_mode(case: Case) -> str:
    if case.ns_dtype == "float64":
        return "hpns"
    if case.compiled:
        return "exact"  # inductor's NS rounding is not emulated bit for bit
    return "emulated"


def step_config(case: Case) -> oracles.StepConfig:
    """The oracle's reading of the case's DeepSpeed config (semantics doc 1.2 for the lr routing)."""
    cfg = case.config
    opt = cfg.get("optimizer", {}).get("params", {})
    shared_lr = opt.get("lr")
    muon_lr = opt.get("muon_lr", shared_lr if shared_lr is not None else 0.02)
    adam_lr = opt.get("adam_lr", shared_lr if shared_lr is not None else 3e-4)
    scaler = None
    if case.dtype == "fp16":
        f = cfg["fp16"]
        if f.get("loss_scale", 0):
            scaler = oracles.LossScalerConfig(dynamic=False, static_loss_scale=float(f["loss_scale"]))
        else:
            scaler = oracles.LossScalerConfig(
                initial_scale_power=f.get("initial_scale_power", 16),
                loss_scale_window=f.get("loss_scale_window", 1000),
                hysteresis=f.get("hysteresis", 2),
                consecutive_hysteresis=f.get("consecutive_hysteresis", False),
                min_loss_scale=f.get("min_loss_scale", 1.0))
    specs = tuple(oracles.ParamSpec.deepspeed_tagged(p.name, p.shape, p.num_heads) for p in case.params)
    fp16_ok, bf16_ok = device.half_support()
    betas = tuple(opt.get("betas", (0.9, 0.95)))
    sc = oracles.StepConfig(
        params=specs, muon_lr=float(muon_lr), adam_lr=float(adam_lr), momentum=float(opt.get("momentum", 0.95)),
        weight_decay=float(opt.get("weight_decay", 0.0)), ns_method=opt.get("ns_method", "gram"),
        device_fp16=fp16_ok, device_bf16=bf16_ok,
        betas=(float(betas[0]), float(betas[1])), eps=float(opt.get("eps", 1e-10)),
        adam_w_mode=bool(cfg.get("optimizer", {}).get("adam_w_mode", opt.get("adam_w_mode", True))),
        gradient_clipping=float(cfg.get("gradient_clipping", 0.0)),
        gradient_accumulation_steps=case.grad_accum, world_size=case.world_size, model_dtype=case.dtype,
        loss_scaler=scaler)
    for hook in ORACLE_HOOKS.values():
        sc = hook(sc)
    return sc


def layout_for(case: Case, sc: oracles.StepConfig):
    groups = oracles.ds_param_groups(sc.params)
    zero = case.config.get("zero_optimization", {})
    if case.stage == 3:
        return oracles.zero3_layout(groups, case.world_size, sub_group_size=zero.get("sub_group_size"))
    return oracles.zero12_layout(groups, case.world_size, parameter_alignment=bool(zero.get("parameter_alignment")))


def expected_muon_calls(case: Case, sc: oracles.StepConfig, layout) -> int:
    """Newton-Schulz applications per optimizer step, all ranks summed (once per step per matrix and
    computing rank, never per micro-batch): see ``harness.capture`` for who computes what."""
    muon = [p.name for p in sc.params if p.use_muon]
    if case.offload != "none":
        return case.world_size * len(muon)
    if case.stage == 3:
        return len(muon)
    return sum(len(oracles.param_slices(layout, n)) for n in muon)


@dataclass
class Verdict:
    case: Case
    mode: str
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def first(self) -> Check | None:
        return first_divergence(self.checks)

    @property
    def worst_ratio(self) -> float:
        return max((c.worst_ratio for c in self.checks), default=0.0)

    def failed_quantities(self) -> set[tuple[str, str]]:
        return {(c.param, c.quantity) for c in self.failures}

    def message(self, limit: int = 6) -> str:
        if self.passed:
            return f"{self.case.name}: all {len(self.checks)} checks within tolerance (worst {self.worst_ratio:.3g}x)"
        first = self.first
        fails = sorted(self.failures, key=lambda c: (c.step, -c.worst_ratio))
        out = [f"{self.case.name} [{self.mode}]: {len(fails)} of {len(self.checks)} checks out of tolerance"]
        seen = set()
        for c in fails:
            key = (c.param, c.quantity)
            if key in seen:
                continue
            seen.add(key)
            out.append(describe(c, reproduce_command(self.case), first))
            if len(seen) >= limit:
                break
        return "\n".join(out)


def _t(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a), dtype=torch.float64)


def _lp_weights(case: Case, traj: Trajectory, step: int) -> dict[str, torch.Tensor]:
    """The model-dtype weights DeepSpeed's forward saw in ``step`` (as float64)."""
    if step == 1:
        lp = oracles.MODEL_DTYPES[case.dtype]
        return {n: _t(a).to(lp).to(torch.float64) for n, a in traj.initial.items()}
    return {n: _t(ps.model) for n, ps in traj.steps[step - 2].params.items()}


class _OracleLayout(LayoutView):
    def __init__(self, layout):
        self.layout = layout
        self._ranges: dict[str, dict] = {}

    def locate(self, name: str, index: int) -> tuple[int, str]:
        loc = oracles.locate(self.layout, name, index)
        return loc.rank, loc.region

    def ranges(self, name: str) -> dict[str, list[tuple[int, int]]]:
        if name not in self._ranges:
            self._ranges[name] = oracles.region_ranges(self.layout, name)
        return self._ranges[name]


def _grad_term_scale(grads) -> float:
    return max((float(g.abs().max()) for per_rank in grads for per_micro in per_rank for g in per_micro.values()
                if bool(torch.isfinite(g).all())), default=0.0)


def judge(case: Case, traj: Trajectory, *, conventions: oracles.Conventions | None = None,
          mode: str | None = None, keep_maps: bool = True) -> Verdict:
    mode = mode or comparison_mode(case)
    # The intended design keeps the Muon momentum (and what it is blended with) in fp32; the oracle
    # stores it there too, so that in emulated mode a correct implementation feeds Newton-Schulz
    # bit-identical input (a float64 momentum would differ from any fp32 one in the last bit, and one
    # flipped 16-bit rounding cascades through the iteration).
    conv = conventions or oracles.Conventions(momentum_dtype="fp32")
    sc = step_config(case)
    layout = layout_for(case, sc)
    view = _OracleLayout(layout)
    verdict = Verdict(case, mode)
    ns_mode = "emulated" if mode == "emulated" else "exact"
    spec = {p.name: p for p in sc.params}
    W, GAS = case.world_size, case.grad_accum
    lp_dtype = oracles.MODEL_DTYPES[case.dtype]
    # Where DeepSpeed stores the Muon input: fp32 on the Z1/2 offload paths, the model dtype elsewhere.
    grad_store = "fp32" if (case.offload != "none" and case.stage in (1, 2)) else case.dtype
    state = oracles.initial_state(sc, {n: _t(a) for n, a in traj.initial.items()}, conv)
    n_muon_calls = expected_muon_calls(case, sc, layout)

    def add(param, quantity, step, actual, expected, allowance):
        verdict.checks.append(compare_arrays(case.name, param, quantity, step, actual, expected, Allowed.of(allowance),
                                             view if param in spec else None, keep_map=keep_maps))

    for rec in traj.steps:
        s = rec.step
        lp = _lp_weights(case, traj, s)
        grads = [[{n: g for n, g in model_mod.local_gradients(lp, case, r, s, mu).items()} for mu in range(GAS)]
                 for r in range(W)]
        if case.dtype == "fp16":
            # The oracle's fp16-overflow test sees only final gradients; an overflow inside the
            # half-precision backward is the caller's to mark (oracles.step, detect_fp16_overflow).
            S = float(state.scaler.scale)
            for r in range(W):
                for mu in range(GAS):
                    if model_mod.backward_overflows(lp, case, r, s, mu, S):
                        grads[r][mu] = {n: torch.full_like(g, math.inf) for n, g in grads[r][mu].items()}
        true_G = oracles.accumulate(grads, sc)
        term = _grad_term_scale(grads)

        # DeepSpeed's own averaged gradient, in true units, where it captured one (teacher forcing).
        forced = {}
        for n, ps in rec.params.items():
            if ps.grad is not None:
                forced[n] = _t(ps.grad) / float(ps.grad_scale)
        feed = {n: forced.get(n, true_G[n]) for n in true_G}
        feed_grads = [[feed] * GAS] * W  # averages to exactly ``feed``

        # Judge DeepSpeed's gradient against the float64 one (only on steps it was finite).
        for n in spec:
            if n in forced and bool(torch.isfinite(true_G[n]).all()):
                a = oracles.allowances(mode, model_dtype=case.dtype, shape=spec[n].shape, world_size=W, gas=GAS,
                                       grad_dtype=grad_store if spec[n].use_muon else case.dtype,
                                       # The half-precision backward rounds each of the ~4 intermediate
                                       # results of the loss term once (prediction, residual, product,
                                       # output) before the sum: 4 u_lp of the term scale, doubled for
                                       # the two terms of a matrix loss.
                                       grad_term_scale=term * (1.0 + 8.0 * oracles.unit_roundoff(case.dtype)
                                                               / max(oracles.unit_roundoff(grad_store), 1e-300)),
                                       ns_method=sc.ns_method)
                add(n, "grad", s, forced[n].numpy(), true_G[n].numpy(), a.grad)

        new_state, orec = oracles.oracle_step(state, feed_grads, sc, conv, ns_mode=ns_mode)

        # Step-level quantities.
        exact = oracles.Allowance(0.0, 0.0, "deterministic")
        add("<step>", "skipped", s, [float(rec.skipped)], [float(orec.skipped)], exact)
        add("<step>", "loss_scale", s, [rec.loss_scale], [orec.loss_scale_used], exact)
        add("<step>", "loss_scale_after", s, [rec.loss_scale_after], [orec.loss_scale_after], exact)
        if not orec.skipped and rec.global_norm is not None and orec.global_norm is not None:
            a = oracles.allowances(mode, model_dtype=case.dtype, shape=max((p.shape for p in sc.params if p.use_muon),
                                                                           key=lambda sh: math.prod(sh), default=(1, 1)),
                                   world_size=W, gas=GAS, ns_method=sc.ns_method, grad_dtype=grad_store,
                                   momentum_dtype="fp32")
            add("<step>", "global_norm", s, [rec.global_norm], [orec.global_norm], a.norm)
        if not orec.skipped:
            add("<step>", "muon_calls", s, [rec.muon_calls], [n_muon_calls], exact)

        for n, ps in rec.params.items():
            p = spec[n]
            o = orec.params[n]
            weight_scale = float(state.master[n].abs().max())
            step_size = float(o.update.abs().max())
            # Downstream of the gradient the oracle was fed DeepSpeed's own averaged gradient, converted
            # exactly (a power-of-two unscale), so no gradient error enters: grad_dtype="fp64". What
            # remains is fp32 storage of the momentum and masters, and Newton-Schulz.
            a = oracles.allowances(mode, model_dtype=case.dtype, shape=p.shape if len(p.shape) >= 2 else (1,) + tuple(p.shape),
                                   world_size=W, gas=GAS, ns_method=sc.ns_method, grad_dtype="fp64",
                                   momentum_dtype="fp32", num_heads=p.num_heads, weight_scale=weight_scale,
                                   step_to_weight=step_size / weight_scale if weight_scale > 0 else 1.0,
                                   clipping_active=sc.gradient_clipping > 0)
            # muon_update hands back O in the dtype of the gradient buffer it is written into (the model
            # dtype on the non-offload paths): one rounding there is storage, not error (+2 u_store).
            u_store = oracles.unit_roundoff(grad_store)
            direction = oracles.Allowance(a.direction.atol, a.direction.rtol + 2.0 * u_store,
                                          a.direction.derivation + f" + 2 u_store ({grad_store})", a.direction.cap)
            if p.use_muon and ps.momentum is not None:
                add(n, "momentum", s, _t(ps.momentum).numpy() / float(ps.momentum_scale), o.momentum.numpy(), a.momentum)
            if p.use_muon and ps.update is not None and o.direction is not None:
                add(n, "update", s, ps.update, o.direction.numpy(), direction)
            add(n, "master", s, ps.master, o.master.numpy(), a.master)
            add(n, "model", s, ps.model, o.model.numpy(), a.model)

        # Teacher forcing: the next step starts from DeepSpeed's masters and momentum.
        masters = {n: _t(ps.master) for n, ps in rec.params.items()}
        moms = {n: _t(ps.momentum) / float(ps.momentum_scale) for n, ps in rec.params.items()
                if spec[n].use_muon and ps.momentum is not None}
        state = replace(new_state, master={**new_state.master, **masters}, momentum={**new_state.momentum, **moms})
    return verdict
