"""Trajectory -> oracle -> comparison: the judgement of one case.

For every optimizer step the oracle is replayed from DeepSpeed's own previous state (teacher
forcing: its fp32 masters and Muon momentum, and the averaged gradient it fed to the optimizer), so
one early deviation cannot snowball and each step is judged on its own. The gradient itself is
judged separately, against the float64 gradient of the same rounded data at DeepSpeed's own model
weights. Every quantity of every parameter is compared under the tolerance model
(``oracles.tolerance``); a failure names case, parameter, quantity, step, rank partition and region,
and the command that reruns exactly this case.

Which oracle: ``INTENDED`` -- the intended mathematics, with DeepSpeed's one deliberate
convention (the clip norm is taken over the Muon update) -- so that DeepSpeed's accidents show up as
divergences. ``conventions=bug_model(...)`` judges the same case against the oracle with a registered
bug's switches on (``harness.registry.bugs.Bug.model``), at the same tolerances: that is how the gate decides
that a stock divergence is the bug and nothing else.

Nothing is skipped silently: a quantity the capture did not record where the oracle has one, and every
capture note of the step (ranks that disagree, momentum not covered by the gathered pieces, a matrix
orthogonalised twice by one rank) is a failed check of its own.
"""
from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field, replace

import numpy as np
import torch

import oracles
from harness.env import device, versions
from harness.case import synthetic as model_mod
from oracles import schedules
from oracles.step import fresh_engine_state
from harness.case.spec import Case
from harness.judge.compare import Check, LayoutView, compare_arrays, describe, first_divergence, missing
from harness.case.trajectory import Trajectory

# Oracle-side hooks for the detection self-test: name -> function(StepConfig) -> StepConfig.
# Only tests install these (never DeepSpeed): they prove a wrong oracle-relevant behaviour is caught.
ORACLE_HOOKS: dict[str, object] = {}


# The intended design keeps the Muon momentum (and what it is blended with) in fp32; the oracle
# stores it there too, so that in emulated mode a correct implementation feeds Newton-Schulz
# bit-identical input (a float64 momentum would differ from any fp32 one in the last bit, and one
# flipped 16-bit rounding cascades through the iteration).
INTENDED = oracles.Conventions(momentum_dtype="fp32")


def bug_model(changes: dict) -> oracles.Conventions:
    """The oracle with a bug model's switches on (``changes``: merged ``Bug.model(case)`` dicts)."""
    return replace(INTENDED, **changes)


def reproduce_command(case: Case) -> str:
    return f".venv/bin/python -m harness run --case {shlex.quote(case.to_json())}"


def comparison_mode(case: Case) -> str:
    if case.ns_dtype == "float64":
        return "hpns"
    if case.compiled:
        return "exact"  # inductor's NS rounding is not emulated bit for bit
    from harness.env import versions

    if not versions.ns_order_emulated():
        return "exact"  # this DeepSpeed's eager Newton-Schulz rounds in another order than the emulation's
    return "emulated"


def step_config(case: Case, applied: int | None = None,
                conventions: oracles.Conventions | None = None) -> oracles.StepConfig:
    """The oracle's reading of the case's DeepSpeed config (docs/deepspeed-0.19.8.md section 2 for the lr routing).

    ``applied``: the number of optimizer steps applied before the step being configured; with an lr
    schedule (``case.schedule``) every parameter's lr is then the schedule's value for its group
    (``oracles.schedules``), from the group's configured lr. None: the configured lrs. ``conventions``:
    a bug model's, where it changes the schedule (``Conventions.warmup_peak``)."""
    ds = case.ds
    non_muon = non_muon_optimizer(case)
    specs, param_hyper = _user_groups(case, _param_specs(case, non_muon))
    fp16_ok, bf16_ok = device.half_support()
    if non_muon:  # every value the user's own optimizer takes is stated (non_muon_optimizer)
        opt = non_muon[1]
        hyper = dict(muon_lr=float(opt["lr"]), adam_lr=float(opt["lr"]), weight_decay=float(opt["weight_decay"]),
                     betas=(float(opt["betas"][0]), float(opt["betas"][1])), eps=float(opt["eps"]),
                     adam_w_mode=non_muon[0] == "adamw", momentum=ds.optimizer.muon.momentum,
                     ns_method=ds.optimizer.muon.ns_method or versions.default_ns_method())
    else:
        muon, adam = ds.optimizer.muon, ds.optimizer.adam
        if muon.weight_decay != adam.weight_decay:  # the oracle's StepConfig holds one weight decay
            raise ValueError(f"{case.name}: the Muon and Adam halves resolve different weight decays "
                             f"({muon.weight_decay}, {adam.weight_decay}); the oracle takes one")
        # ns_method None: the release has no such option and runs the standard quintic (versions)
        hyper = dict(muon_lr=muon.lr, adam_lr=adam.lr, momentum=muon.momentum, weight_decay=muon.weight_decay,
                     ns_method=muon.ns_method or versions.default_ns_method(), betas=adam.betas, eps=adam.eps,
                     adam_w_mode=ds.optimizer.adam_w_mode)
    sc = oracles.StepConfig(
        params=specs, **hyper, device_fp16=fp16_ok, device_bf16=bf16_ok,
        gradient_clipping=ds.gradient_clipping, gradient_accumulation_steps=case.grad_accum,
        world_size=case.dp_size, model_dtype=case.dtype, loss_scaler=_loss_scaler(case), param_hyper=param_hyper)
    if case.model:  # a real module's parameter groups (harness.judge.module_oracle)
        sc = _module_oracle().with_param_groups(case, sc)
    if applied is not None and case.schedule:
        sc = replace(sc, param_hyper=_scheduled_hyper(case, sc, applied, conventions or INTENDED))
    for hook in ORACLE_HOOKS.values():
        sc = hook(sc)
    return sc


def _param_specs(case: Case, non_muon) -> tuple:
    if non_muon:  # the user chose another optimizer: no parameter is Muon's, whatever DeepSpeed tags
        return tuple(oracles.ParamSpec(p.name, tuple(p.shape), False) for p in case.params)
    return tuple(oracles.ParamSpec.deepspeed_tagged(p.name, p.shape, p.num_heads) for p in case.params)


def _loss_scaler(case: Case) -> oracles.LossScalerConfig | None:
    """fp16's loss scaler as the view resolves it (a static scale, or the dynamic scaler's settings)."""
    if case.dtype != "fp16":
        return None
    f = case.ds.fp16
    if not f.dynamic:
        return oracles.LossScalerConfig(dynamic=False, static_loss_scale=f.loss_scale)
    return oracles.LossScalerConfig(initial_scale_power=f.initial_scale_power, loss_scale_window=f.loss_scale_window,
                                    hysteresis=f.hysteresis, consecutive_hysteresis=f.consecutive_hysteresis,
                                    min_loss_scale=f.min_loss_scale)


# What a non-Muon optimizer's oracle reads from its params: every one stated, since the defaults differ
# between the implementations DeepSpeed may pick (torch AdamW's weight decay 1e-2, FusedAdam's 0).
_NON_MUON_KEYS = ("lr", "betas", "eps", "weight_decay")


def non_muon_optimizer(case: Case) -> tuple[str, dict] | None:
    """(update rule, params) of a case whose optimizer is not Muon: the user's own torch optimizer
    (``Case.client_optimizer``) or a config that names one of ``harness.case.spec.NON_MUON_OPTIMIZERS``;
    None for Muon. The oracle then steps every parameter with Adam, never Muon. The rule is "adamw"
    (decoupled weight decay) or "adam" (L2, the decay added to the gradient): a client torch.optim.Adam
    / AdamW is what its class says; in the config, DeepSpeed's documented rule holds: "AdamW" always
    decouples, and "Adam" decouples too unless its ``adam_w_mode`` is false."""
    from harness.case.spec import NON_MUON_OPTIMIZERS

    opt = case.ds.optimizer
    spec = (json.loads(case.client_optimizer) if case.client_optimizer
            else {"type": opt.type or "muon", "params": opt.params})
    kind = str(spec.get("type", "muon"))
    if kind.lower() == "muon":
        return None
    if kind.lower() not in {n.lower() for n in NON_MUON_OPTIMIZERS}:
        raise ValueError(f"{case.name}: optimizer {kind!r}: the oracle knows Muon and {NON_MUON_OPTIMIZERS}")
    params = dict(spec.get("params", {}))
    w_mode = params.pop("adam_w_mode", spec.get("adam_w_mode"))
    if case.client_optimizer:
        if w_mode is not None:
            raise ValueError(f"{case.name}: adam_w_mode is no torch.optim argument: a client optimizer is Adam (L2) "
                             "or AdamW (decoupled) by its type")
        rule = kind.lower()
    else:
        rule = "adamw" if kind.lower() == "adamw" or opt.adam_w_mode else "adam"
    unset = [k for k in _NON_MUON_KEYS if k not in params]
    if unset:
        raise ValueError(f"{case.name}: a non-Muon optimizer's oracle needs {unset} stated (defaults differ "
                         "between torch.optim and DeepSpeed's FusedAdam)")
    return rule, params


def _scheduled_hyper(case: Case, sc: oracles.StepConfig, applied: int, conv: oracles.Conventions) -> tuple:
    # DSM-121's model: the peak is the configured lr of DeepSpeed's first param group (the Muon half of
    # the first incoming group: expected_group_lrs lists the groups in the engine's order)
    peak = next(iter(expected_group_lrs(case, sc).values())) if conv.warmup_peak == "first_group" else None
    hyper = []
    for p in sc.params:
        base = dict(next((items for n, items in sc.param_hyper if n == p.name), ()))
        base["lr"] = schedules.group_lr(case.schedule, sc.hyper(p)["lr"], applied, default_peak=peak)
        hyper.append((p.name, tuple(base.items())))
    return tuple(hyper)


def expected_group_lrs(case: Case, sc: oracles.StepConfig) -> dict[str, float]:
    """The lr each of DeepSpeed's optimizer param groups should use under ``sc``, by the group's name:
    each incoming group split into its Muon and Adam halves, named "<half>-params" for one incoming
    group and "group<i>-<half>-params" for several (``engine.py _muon_param_groups``)."""
    spec = {p.name: p for p in sc.params}
    if non_muon_optimizer(case) and not case.groups and not case.model:
        return {"0": sc.adam_lr}  # one group, model.parameters(), unnamed: known by its index
    if case.groups:
        incoming = [g.params for g in case.groups]
    elif case.model:  # the groups the model's factory declares (harness.models.incoming_groups)
        from harness import models

        incoming = models.incoming_groups(models.build_spec(case.model, case.seed))
    else:
        incoming = [tuple(spec)]
    out = {}
    for i, names in enumerate(incoming):
        for half, label in ((True, "muon"), (False, "adam")):
            members = [spec[n] for n in names if spec[n].use_muon is half]
            if members:
                prefix = f"group{i}-" if len(incoming) > 1 else ""
                out[f"{prefix}{label}-params"] = sc.hyper(members[0])["lr"]
    return out


# Which of a user group's settings reach which half (DeepSpeed's documented split: Muon takes lr,
# momentum, weight_decay, ns_method; the auxiliary Adam lr, weight_decay).
_HALF_KEYS = {True: ("lr", "momentum", "weight_decay", "ns_method"), False: ("lr", "weight_decay")}


def _user_groups(case: Case, specs: tuple) -> tuple[tuple, tuple]:
    """The case's own param groups (``case.groups``) as the oracle reads them: a group's ``use_muon``
    decides the half of its parameters (the user's intent), its other settings override the config's
    for the keys of that half. Returns (specs, ``StepConfig.param_hyper``)."""
    if not case.groups:
        return specs, ()
    by_name = {s.name: s for s in specs}
    hyper = []
    for g in case.groups:
        for n in g.params:
            sp = by_name[n]
            if g.use_muon is not None and g.use_muon != sp.use_muon:
                sp = oracles.ParamSpec(sp.name, sp.shape, bool(g.use_muon), sp.num_heads if g.use_muon else None)
            by_name[n] = sp
            items = tuple((k, v) for k, v in g.options().items() if k in _HALF_KEYS[sp.use_muon])
            if items:
                hyper.append((n, items))
    return tuple(by_name[s.name] for s in specs), tuple(hyper)


def _spec_groups(case: Case, sc: oracles.StepConfig) -> list:
    """DeepSpeed's optimizer groups: each user group split into its Muon and Adam halves, in order."""
    if not case.groups:
        return oracles.ds_param_groups(sc.params)
    spec = {p.name: p for p in sc.params}
    out = []
    for g in case.groups:
        out.extend(oracles.ds_param_groups([spec[n] for n in g.params]))
    return out


def _module_oracle():
    """The gradient/buffer oracle of a real module (``Case.model``); imported only for those cases."""
    from harness.judge import module_oracle as oracle

    return oracle


def layout_for(case: Case, sc: oracles.StepConfig):
    groups = _spec_groups(case, sc)
    zero = case.ds.zero
    if case.stage == 3:
        return oracles.zero3_layout(groups, case.dp_size, sub_group_size=zero.sub_group_size)
    return oracles.zero12_layout(groups, case.dp_size, parameter_alignment=zero.parameter_alignment)


def reports_global_norm(case: Case) -> bool:
    """Whether the path reports a global norm at all: every ZeRO optimizer and the 16-bit wrappers
    (FP16_UnfusedOptimizer, BF16_Optimizer) keep ``_global_grad_norm`` for the engine to hand out;
    fp32 without ZeRO steps ``MuonWithAuxAdam`` itself, which keeps none (``engine.py`` 3518), so
    ``get_global_grad_norm()`` is None there by design, not a capture hole. So is ZeRO-1/2 told
    ``zero_optimization.compute_grad_norm: false`` (``grad_norm_disabled``)."""
    return not (case.stage == 0 and case.dtype == "fp32") and not grad_norm_disabled(case)


def grad_norm_disabled(case: Case) -> bool:
    """``zero_optimization.compute_grad_norm: false`` (ZeRO-1/2 only, DeepSpeed's config refuses it
    elsewhere): the optimizer sets ``_global_grad_norm = None`` every step (stage_1_and_2.py ``step``),
    so the verdict checks that no norm is reported instead of comparing one."""
    return case.stage in (1, 2) and case.ds.zero.compute_grad_norm is False


def expected_muon_calls(case: Case, sc: oracles.StepConfig, layout) -> int:
    """Newton-Schulz applications per optimizer step, all ranks summed (once per step per matrix and
    computing rank, never per micro-batch): see ``harness.rank.capture`` for who computes what."""
    muon = [p.name for p in sc.params if p.use_muon]
    from harness.env import versions

    if case.stage == 3 and versions.z3_distributed_muon():  # one rank per matrix, offload or not
        return len(muon)
    if case.offload != "none" or case.stage == 0:  # stage 0: every rank steps every (whole) matrix
        return case.dp_size * len(muon)
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


class Uncaptured(ValueError):
    """A captured quantity that holds no numbers (an object array: a parameter DeepSpeed never filled
    in). The judge turns it into a failing check with no data, never a harness error."""


def _t(a) -> torch.Tensor:
    arr = np.asarray(a)
    if arr.dtype == object:
        raise Uncaptured(f"a captured quantity holds no numbers (shape {arr.shape}, elements "
                         f"{sorted({type(x).__name__ for x in arr.ravel()[:8]})})")
    return torch.as_tensor(arr, dtype=torch.float64)


OWN_MODEL = oracles.Allowance(0.0, 0.0, "own master: the model weights are DeepSpeed's fp32 master rounded "
                                        "once to the model dtype (deterministic)")


def round_to_lp(w: torch.Tensor, case: Case) -> torch.Tensor:
    """``w`` as the model-dtype weights of the case hold it (as float64)."""
    return w.to(oracles.MODEL_DTYPES[case.dtype]).to(torch.float64)


def _lp_weights(case: Case, traj: Trajectory, step: int) -> dict[str, torch.Tensor]:
    """The model-dtype weights DeepSpeed's forward saw in ``step`` (as float64)."""
    if step == 1:
        lp = oracles.MODEL_DTYPES[case.dtype]
        return {n: _t(a).to(lp).to(torch.float64) for n, a in traj.initial.items()}
    return {n: _t(ps.model) for n, ps in traj.steps[step - 2].params.items()}


def _start_weights(case: Case, traj: Trajectory, conv: oracles.Conventions) -> dict[str, torch.Tensor]:
    """The weights the oracle starts from: the captured masters after initialize, except where the bug
    model has DeepSpeed step at initialize (``Conventions.warmup_step_at_init``, DSM-014). There the
    captured masters are already decayed once, and rounding them back to the model dtype does not undo
    a decay above half a bf16/fp16 ulp (a user group's lr * weight_decay of 0.003 does not), so the model
    starts from the harness's own weights (``harness.case.synthetic.initial_weights``) and applies the warm-up
    itself. Module cases build their weights elsewhere: they keep the captured masters."""
    if conv.warmup_step_at_init and not case.model:
        return {n: w.to(torch.float64) for n, w in model_mod.initial_weights(case).items()}
    return {n: _t(a) for n, a in traj.initial.items()}


class _OracleLayout(LayoutView):
    def __init__(self, layout):
        self.layout = layout
        self._ranges: dict[str, dict] = {}

    def locate(self, name: str, index: int) -> tuple[int, str]:
        loc = oracles.locate(self.layout, name, index, ranges=self.ranges(name))
        return loc.rank, loc.region

    def ranges(self, name: str) -> dict[str, list[tuple[int, int]]]:
        if name not in self._ranges:
            self._ranges[name] = oracles.region_ranges(self.layout, name)
        return self._ranges[name]


def grad_store_dtype(case: Case) -> str:
    """Where DeepSpeed stores the Muon input: fp32 on the Z1/2 offload paths, the model dtype elsewhere."""
    return "fp32" if (case.offload != "none" and case.stage in (1, 2)) else case.dtype


def grad_allowance(case: Case, sc: oracles.StepConfig, name: str, grads, mode: str,
                   magnitudes=None, grad_units: float = 1.0) -> oracles.Allowance:
    """The allowance of the averaged gradient of parameter ``name`` (``grads[rank][micro][name]``: the
    float64 per-micro gradients), from that parameter's own addends (``oracles.tolerance``, "grad").
    ``magnitudes`` (same layout): the cancellation-free scale of each addend where the model can give
    it (``harness.case.synthetic.gradient_magnitudes``); the backward's rounding is relative to that scale.
    ``grad_units``: the scale DeepSpeed's stored gradient carries (``ParamStep.grad_scale``)."""
    spec = sc.spec(name)
    grad_store = grad_store_dtype(case)
    term = oracles.grad_term_scale(g[name] for per_rank in (magnitudes or grads) for g in per_rank)
    a = oracles.allowances(mode, model_dtype=case.dtype, shape=spec.shape, world_size=case.dp_size,
                           gas=case.grad_accum, grad_dtype=grad_store if spec.use_muon else case.dtype,
                           # The model-dtype backward rounds each of the ~4 intermediate results of the
                           # loss term once (prediction, residual, product, output) before the sum: 4 u_lp
                           # of the term scale, doubled for the two terms of a matrix loss.
                           grad_term_scale=term, backward_term_err=8.0 * oracles.unit_roundoff(case.dtype),
                           ns_method=next(sc.hyper(p) for p in sc.params if p.name == name).get(
                               "ns_method", sc.ns_method), grad_units=grad_units)
    return a.grad


def _exact_at_spectrum(a, case: Case, sc, p, g, m_new, shape, weight_scale: float, step_size: float,
                       momentum_dtype: str = "fp32"):
    """Exact mode's allowances at the step's own spectrum: the Newton-Schulz gain taken over the
    singular values the NS input can have (``oracles.perturbed_sigma_lo`` of the oracle's Nesterov blend
    ``U = lerp(g, M', beta)``, widened by the momentum allowance plus the blend's rounding), instead of
    the rank-deficient worst case 0, which puts the 16-bit allowance near its cap."""
    beta = sc.hyper(p)["momentum"]
    U = torch.lerp(_t(g).to(torch.float64), _t(m_new).to(torch.float64), beta)
    if p.num_heads:
        U = U.reshape(p.num_heads, -1, U.shape[-1])
    elif U.ndim == 4:
        U = U.reshape(U.shape[0], -1)
    elif U.ndim < 2:
        return a
    sigma = oracles.perturbed_sigma_lo(U, a.momentum.rtol + 2.0 * oracles.unit_roundoff(momentum_dtype))
    if sigma <= 0.0:
        return a
    return oracles.allowances("exact", model_dtype=case.dtype, shape=shape, world_size=case.dp_size,
                              gas=case.grad_accum, ns_method=sc.hyper(p)["ns_method"], grad_dtype="fp64",
                              momentum_dtype=momentum_dtype, num_heads=p.num_heads, weight_scale=weight_scale,
                              step_to_weight=step_size / weight_scale if weight_scale > 0 else 1.0,
                              clipping_active=sc.gradient_clipping > 0, sigma_lo=sigma)


def judge(case: Case, traj: Trajectory, *, conventions: oracles.Conventions | None = None,
          mode: str | None = None, keep_maps: bool = True) -> Verdict:
    """The verdict of the case's run(s): with ``case.model_parallel`` > 1 every model-parallel replica
    (``traj`` and ``traj.replicas``) is its own data-parallel run of ``case.dp_size`` ranks on its own
    data, judged against its own oracle; their checks are merged, each labelled with its replica."""
    mode = mode or comparison_mode(case)
    try:
        return _judge(case, traj, conventions, mode, keep_maps)
    except Uncaptured as exc:
        verdict = Verdict(case, mode)
        bad = sorted(n for n, a in traj.initial.items() if np.asarray(a).dtype == object)
        verdict.checks.append(missing(case.name, bad[0] if bad else "<case>", "capture", 0,
                                      f"{exc}{'; uncaptured initial weights: ' + ', '.join(bad) if bad else ''}"))
        return verdict


def _judge(case: Case, traj: Trajectory, conventions, mode: str, keep_maps: bool) -> Verdict:
    if case.model_parallel == 1:
        return _judge_run(case, traj, conventions, mode, keep_maps)[0]
    verdict, norms = _judge_run(case, traj, conventions, mode, keep_maps, mp_rank=0)
    runs = [traj] + list(traj.replicas)
    if len(runs) != case.model_parallel:
        verdict.checks.append(missing(case.name, "<step>", "capture", 0, f"{len(runs)} replica runs captured, "
                                      f"model_parallel is {case.model_parallel}"))
    for k, run in enumerate(runs[1:], 1):
        # DeepSpeed counts a parameter without model-parallel attributes only on model-parallel rank
        # 0 and sums the norm over the model-parallel group (docs/deepspeed-0.19.8.md, "Data-parallel
        # group smaller than the world"): every replica clips with and reports replica 0's norm.
        v, _ = _judge_run(case, run, conventions, mode, keep_maps, mp_rank=k, norm_of=norms)
        verdict.checks.extend(v.checks)
        verdict.notes.extend(f"model-parallel rank {k}: {n}" for n in v.notes)
    return verdict


class _SharedGradients:
    """The float64 gradients, their magnitudes and the fp16-backward overflow flags of one captured run,
    kept for the next judge of the same run.

    Each judge (the intended oracle, then a bug model's) replays the run teacher-forced: every step's
    gradients are taken at DeepSpeed's own captured weights on the case's fixed data, so they do not
    depend on the conventions being judged (only the overflow test's loss scale does, and it is part
    of that key). On a 1 MiB-per-rank NVMe matrix they were a third of each judge. Only the latest
    trajectory is kept (the parent stays flat); a step whose weights a bug model replaces (DSM-010's
    fresh engine) is never shared."""

    _latest: tuple | None = None  # (weak reference to the trajectory, its entries)

    @classmethod
    def of(cls, traj: Trajectory) -> dict:
        import weakref

        if cls._latest is None or cls._latest[0]() is not traj:
            cls._latest = (weakref.ref(traj), {})
        return cls._latest[1]


def stale_gradients(case: Case, step: int, prev, spec: dict) -> dict[str, torch.Tensor]:
    """DSM-023's model: the gradient each parameter unused at ``step`` is stepped on, in true units, from
    the previous step's record ``prev``: what its buffer held when that step ended (an Adam parameter's
    gradient; a Muon matrix's update, which the step wrote over its gradient). Bit for bit what DeepSpeed
    captured there: the buffer is read again, not recomputed."""
    out = {}
    for name, k in case.unused:
        if k != step:
            continue
        ps = prev.params[name]
        held = ps.update if spec[name].use_muon else ps.grad
        if held is None:
            continue  # nothing captured to predict from: the gradient check then holds it to zero and fails
        out[name] = _t(held) / (1.0 if spec[name].use_muon else float(ps.grad_scale))
    return out


def _shared(entries: dict | None, key: tuple, fn, *args):
    if entries is None:
        return fn(*args)
    if key not in entries:
        entries[key] = fn(*args)
    return entries[key]


def _judge_run(case: Case, traj: Trajectory, conventions: oracles.Conventions | None, mode: str,
               keep_maps: bool, *, mp_rank: int = 0, norm_of: dict | None = None) -> tuple[Verdict, dict]:
    """One data-parallel run: model-parallel replica ``mp_rank`` of the case (its data from the global
    ranks ``case.data_rank(r, mp_rank)``). ``norm_of``: step -> the global norm this replica clips with
    and reports (replica 0's oracle norm), instead of its own. Returns the verdict and this run's
    oracle global norm per step."""
    conv = conventions or INTENDED
    # Momentum in loss-scaled units (DSM-004's model): the oracle's state holds DeepSpeed's raw buffer.
    scaled_momentum = conv.momentum_units == "scaled"
    sc = step_config(case)
    layout = layout_for(case, sc)
    view = _OracleLayout(layout)
    verdict = Verdict(case, mode)
    ns_mode = "emulated" if mode == "emulated" else "exact"
    spec = {p.name: p for p in sc.params}
    W, GAS = case.dp_size, case.grad_accum
    label = case.name if case.model_parallel == 1 else f"{case.name} (model-parallel rank {mp_rank})"
    data_rank = [case.data_rank(r, mp_rank) for r in range(W)]
    oracle_norms: dict[int, float | None] = {}
    grad_store = grad_store_dtype(case)
    state = oracles.initial_state(sc, _start_weights(case, traj, conv), conv)
    # DSM-114's model: the release steps the Muon matrices without ever calling muon_update
    n_muon_calls = 0 if conv.muon_as_sgd else expected_muon_calls(case, sc, layout)
    # the Muon momentum's storage as the oracle can follow it: bit for bit (fp32 rounding left) unless a
    # 16-bit momentum is rounded outside emulation (below)
    mom_store = case.dtype if conv.momentum_dtype == "model" and mode != "emulated" else "fp32"
    # Newton-Schulz method per parameter (user groups may differ); the norm takes the looser (bf16) one.
    ns_of = {p.name: (sc.hyper(p)["ns_method"] if p.use_muon else sc.ns_method) for p in sc.params}
    ns_norm = "standard" if any(ns_of[p.name] == "standard" for p in sc.params if p.use_muon) else sc.ns_method
    mo = _module_oracle().module_oracle_for(case, traj) if case.model else None  # float64 autograd of the module

    def add(param, quantity, step, actual, expected, allowance):
        verdict.checks.append(compare_arrays(label, param, quantity, step, actual, expected, allowance,
                                             view if param in spec else None, keep_map=keep_maps))

    prev = None  # the previous step's record (DSM-023's model reads what it left in the buffers)
    for rec in traj.steps:
        s = rec.step
        lp = _lp_weights(case, traj, s)
        fresh_here = conv.fresh_after is not None and s == conv.fresh_after + 1
        if fresh_here:
            # DSM-010's model: what the resume left of a fresh engine (built on the variant-1 init,
            # harness.rank.ds_run) -- its masters, weights and optimizer state for the unrestored parameters.
            fresh = {n: w.to(torch.float64) for n, w in model_mod.initial_weights(case, variant=1).items()}
            state = fresh_engine_state(state, sc, fresh, conv)
            lp = {n: (round_to_lp(fresh[n], case) if n in conv.fresh_params else w) for n, w in lp.items()}
        # DeepSpeed's own weights (teacher forcing) unless a bug model replaced them: then not shared
        shared = _SharedGradients.of(traj) if not fresh_here else None
        at = (id(case), mp_rank, s)
        grads = mo.gradients(s, lp, float(state.scaler.scale)) if mo is not None else [
            [dict(_shared(shared, ("grad",) + at + (r, mu), model_mod.local_gradients, lp, case, data_rank[r], s, mu))
             for mu in range(GAS)] for r in range(W)]
        mags = None if mo is not None else [
            [_shared(shared, ("mag",) + at + (r, mu), model_mod.gradient_magnitudes, lp, case, data_rank[r], s, mu)
             for mu in range(GAS)] for r in range(W)]
        if case.dtype == "fp16" and mo is None:
            # The oracle's fp16-overflow test sees only final gradients; an overflow inside the
            # half-precision backward is the caller's to mark (oracles.step, detect_fp16_overflow).
            # (a raw-loss backward, DSM-015's model, runs at scale 1 whatever the scaler says)
            S = float(state.scaler.scale) if conv.backward_loss_scaled else 1.0
            for r in range(W):
                for mu in range(GAS):
                    if _shared(shared, ("overflow",) + at + (r, mu, S), model_mod.backward_overflows,
                               lp, case, data_rank[r], s, mu, S):
                        grads[r][mu] = {n: torch.full_like(g, math.inf) for n, g in grads[r][mu].items()}
        true_G = oracles.accumulate(grads, sc)
        if conv.adam_grads_lost:  # DSM-019's model: what the Adam half receives is zero
            true_G = {n: (g if spec[n].use_muon else torch.zeros_like(g)) for n, g in true_G.items()}
        if conv.stale_unused_grads and prev is not None:
            true_G.update(stale_gradients(case, s, prev, spec))

        # DeepSpeed's own averaged gradient, in true units, where it captured one (teacher forcing).
        forced = {}
        for n, ps in rec.params.items():
            if ps.grad is not None:
                forced[n] = _t(ps.grad) / float(ps.grad_scale)
        if not conv.backward_loss_scaled:
            # The raw-loss backward divided by S anyway (DSM-015's model): DeepSpeed's gradient is G/S.
            # Judged and fed in true units (times S, exact: a power of two); the oracle divides again.
            forced = {n: g * float(state.scaler.scale) for n, g in forced.items()}
        k_ds = None
        if conv.clip_norm_source == "gradient" and sc.gradient_clipping > 0:
            # Clip before Muon (the BF16_Optimizer route, DSM-013's model): what muon_update received is
            # the clipped gradient G/k. Teacher forcing undoes DeepSpeed's own k (from the norm it
            # reports, itself checked against the oracle's below), so the gradient check and the replay
            # start from the averaged gradient, as on every other path.
            if rec.global_norm is not None and math.isfinite(rec.global_norm):
                # (a reported raw norm carries the backward's scale; the clip divides it by S: DSM-016)
                k_units = float(state.scaler.scale) if conv.reported_norm == "raw" else 1.0
                k_ds = oracles.clip_coefficient(float(rec.global_norm) / k_units, sc.gradient_clipping)
                # (under DSM-114's model no muon_update call hands the Muon gradient over: it was read
                # before the step, unclipped, as Adam's)
                forced = {n: (g * k_ds if spec[n].use_muon and not conv.muon_as_sgd else g)
                          for n, g in forced.items()}
        feed = {n: forced.get(n, true_G[n]) for n in true_G}
        feed_grads = [[feed] * GAS] * W  # averages to exactly ``feed``

        # The reported norm is also judged against the norm of DeepSpeed's own Muon updates (teacher
        # forcing; oracles.step ``norm_directions``), unless ranks kept different copies of an update.
        own_updates = {n: _t(ps.update) for n, ps in rec.params.items() if ps.update is not None}
        rank_split = False
        for note in rec.notes:
            if mode == "exact" and case.compiled and " update of " in note and " differs between rank" in note:
                rank_split = True
                # Inductor compiles muon_update per process and per first-seen shapes, so two ranks that
                # orthogonalise the same matrix can run differently fused kernels and round apart; exact
                # mode judges the update only to the 16-bit Newton-Schulz allowance, which the captured
                # (lowest-rank) copy must meet. Kept visible, not a hole: the grad and momentum fed to
                # both were bit-equal, or the capture would have said so.
                verdict.notes.append(f"step {s}: {note} (compiled kernels per rank; judged on the captured copy)")
                continue
            verdict.checks.append(missing(label, "<step>", "capture", s, f"capture note: {note}"))

        # Judge DeepSpeed's gradient against the float64 one (only on steps it was finite).
        judged_grads = set()
        for n in spec:
            if n in forced and bool(torch.isfinite(true_G[n]).all()):
                a = grad_allowance(case, sc, n, grads, mode, mags, float(rec.params[n].grad_scale))
                add(n, "grad", s, forced[n].numpy(), true_G[n].numpy(), a if mo is None else mo.grad_allowance(n, a))
                judged_grads.add(n)

        # With an lr schedule the step's lrs follow the applied steps so far (the oracle's own count).
        sc_s = step_config(case, state.step_count - state.skipped_steps, conv) if case.schedule else sc
        # ... and the replay clips with DeepSpeed's own k, so Newton-Schulz reads its exact input.
        # A model-parallel replica clips with (and reports) replica 0's norm (docs/deepspeed-0.19.8.md section 14).
        conv_s = conv
        if conv.stale_unused_grads == "norm-drops-adam":  # DSM-023's model on the offload paths
            conv_s = replace(conv, norm_excluded=frozenset(n for n, k in case.unused
                                                           if k == s and not spec[n].use_muon))
        new_state, orec = oracles.oracle_step(state, feed_grads, sc_s, conv_s, ns_mode=ns_mode, forced_clip_coef=k_ds,
                                              shared_norm=None if norm_of is None else norm_of.get(s),
                                              norm_directions=None if rank_split else own_updates)
        oracle_norms[s] = None if orec.skipped else orec.global_norm
        # The lr each optimizer group really used (captured before the step), against the schedule:
        # the same closed form evaluated in float64 in another order, a few roundings apart (16 u_64).
        lr_allow = oracles.Allowance(0.0, 16 * 2.0 ** -53, "lr: float64 evaluation of the schedule's formula")
        if rec.group_lr or case.schedule:  # a scheduled case without captured lrs fails (nan)
            for gname, lr in expected_group_lrs(case, sc_s).items():
                add(f"<group {gname}>", "lr", s, [rec.group_lr.get(gname, math.nan)], [lr], lr_allow)

        # Step-level quantities.
        exact = oracles.Allowance(0.0, 0.0, "deterministic")
        add("<step>", "skipped", s, [float(rec.skipped)], [float(orec.skipped)], exact)
        add("<step>", "loss_scale", s, [rec.loss_scale], [orec.loss_scale_used], exact)
        add("<step>", "loss_scale_after", s, [rec.loss_scale_after], [orec.loss_scale_after], exact)
        for n in spec:
            if n not in forced and not orec.skipped:
                verdict.checks.append(missing(label, n, "grad", s, "the gradient the optimizer read was not "
                                              "captured, but the oracle applied this step"))
            elif n not in judged_grads and not orec.skipped:  # captured and applied, so it must be judged
                verdict.checks.append(missing(label, n, "grad", s, "the gradient was captured and applied, but the "
                                              "oracle's is not finite (its half-precision backward overflows at "
                                              "this loss scale): not judged"))
        if not orec.skipped and rec.global_norm is None and reports_global_norm(case):
            verdict.checks.append(missing(label, "<step>", "global_norm", s, "get_global_grad_norm() gave "
                                          "nothing, but the oracle applied this step"))
        if grad_norm_disabled(case):  # none by design: a reported norm contradicts the config
            add("<step>", "global_norm_reported", s, [float(rec.global_norm is not None)], [0.0], exact)
        if not orec.skipped and rec.global_norm is not None and orec.global_norm is not None:
            widest = max((p.shape for p in sc.params if p.use_muon), key=lambda sh: math.prod(sh), default=(1, 1))
            a = oracles.allowances(mode, model_dtype=case.dtype, shape=widest,
                                   world_size=W, gas=GAS, ns_method=ns_norm, grad_dtype=grad_store,
                                   momentum_dtype="fp32")
            add("<step>", "global_norm", s, [rec.global_norm], [orec.reported_norm], a.norm)
            if orec.reported_norm_own is not None:
                # the same norm from DeepSpeed's own updates: its norm arithmetic only (DSM-016 on compiled
                # stage 0 is 56% off, inside a.norm's Newton-Schulz allowance there)
                n_el = sum(math.prod(p.shape) for p in sc.params)
                add("<step>", "global_norm", s, [rec.global_norm], [orec.reported_norm_own],
                    oracles.own_norm_allowance(n_el, case.dtype, case.dtype))
        if not orec.skipped:
            add("<step>", "muon_calls", s, [rec.muon_calls], [n_muon_calls], exact)

        for n, ps in rec.params.items():
            p = spec[n]
            o = orec.params[n]
            weight_scale = float(state.master[n].abs().max())
            step_size = float(o.update.abs().max())
            # Downstream of the gradient the oracle was fed DeepSpeed's own averaged gradient, converted
            # exactly (a power-of-two unscale), so no gradient error enters: grad_dtype="fp64". What
            # remains is fp32 storage of the momentum and masters, and Newton-Schulz. A 16-bit Muon
            # momentum (DSM-001's model) outside emulation: the oracle rounds each blend to 16 bit as
            # DeepSpeed does, but from a float64 value, not from torch.lerp's fp32 one, so a stored element
            # may land on the neighbouring 16-bit value (2 u_m; measured on 0.19.6, exact mode: gpt2 and
            # llama ZeRO-1/2 bf16, 1-2 elements of 1024 one bf16 ulp apart at step 2).
            shape = p.shape if len(p.shape) >= 2 else (1,) + tuple(p.shape)
            # a Muon matrix stepped by its gradient (DSM-114's model) has no Newton-Schulz error in its step
            newton_schulz = p.use_muon and not conv.muon_as_sgd
            a = oracles.allowances(mode, model_dtype=case.dtype, shape=shape,
                                   world_size=W, gas=GAS, ns_method=ns_of[n], grad_dtype="fp64",
                                   momentum_dtype=mom_store, num_heads=p.num_heads, weight_scale=weight_scale,
                                   step_to_weight=step_size / weight_scale if weight_scale > 0 else 1.0,
                                   clipping_active=sc.gradient_clipping > 0,
                                   use_muon=None if newton_schulz else False)  # Adam: no NS error in its step
            if mode == "exact" and newton_schulz and o.direction is not None:
                a = _exact_at_spectrum(a, case, sc, p, feed[n], o.momentum, shape, weight_scale, step_size,
                                       momentum_dtype=mom_store)
            # muon_update hands back O in the dtype of the gradient buffer it is written into (the model
            # dtype on the non-offload paths): one rounding there is storage, not error (+2 u_store).
            u_store = oracles.unit_roundoff(grad_store)
            direction = oracles.Allowance(a.direction.atol, a.direction.rtol + 2.0 * u_store,
                                          a.direction.derivation + f" + 2 u_store ({grad_store})", a.direction.cap)
            # DeepSpeed creates the momentum buffer at the first applied step: before it, a skipped
            # step has no momentum to capture, and the oracle's is still zero.
            never_applied = orec.skipped and state.step_count == state.skipped_steps
            if p.use_muon and conv.muon_as_sgd:
                pass  # no muon_update, so no momentum or update to capture: the muon_calls check (0) says so
            elif p.use_muon and ps.momentum is None:
                if not (never_applied and not bool(o.momentum.any())):
                    verdict.checks.append(missing(label, n, "momentum", s, "the Muon momentum was not captured"))
            elif p.use_muon:
                o_mom = o.momentum / (orec.loss_scale_used if scaled_momentum else 1.0)
                add(n, "momentum", s, _t(ps.momentum).numpy() / float(ps.momentum_scale), o_mom.numpy(), a.momentum)
            if not newton_schulz:
                pass
            elif o.direction is not None and ps.update is None:
                verdict.checks.append(missing(label, n, "update", s, "muon_update's result was not captured, "
                                              "but the oracle applied this step"))
            elif o.direction is not None:
                add(n, "update", s, ps.update, o.direction.numpy(), direction)
            a_master, a_model = a.master, a.model
            # The 16-bit O is applied (a 16-bit gradient buffer, or DSM-001's 16-bit Muon state, where
            # the oracle rounds O too): outside emulation DeepSpeed's O and the oracle's differ by more
            # than an ulp, so either may round to a neighbouring 16-bit value; one ulp of O (2 u_out)
            # reaches the masters scaled by the step (step_to_weight).
            u_out = max(u_store, oracles.unit_roundoff(case.dtype) if conv.momentum_dtype == "model" else 0.0)
            if mode != "emulated" and newton_schulz and u_out > oracles.unit_roundoff("fp32"):
                extra = 2.0 * u_out * (step_size / weight_scale if weight_scale > 0 else 1.0)
                a_master, a_model = (oracles.Allowance(x.atol, x.rtol + extra, x.derivation
                                                       + f" + 2 u_out ({u_out:.3g}) x step_to_weight", x.cap)
                                     for x in (a.master, a.model))
            add(n, "master", s, ps.master, o.master.numpy(), a_master)
            if o.master_own is not None:
                # the same master from DeepSpeed's own update and its own norm's clip: the step's
                # arithmetic (lr, weight decay, clip) without Newton-Schulz's allowance in it
                clip_rtol = (oracles.own_norm_allowance(sum(math.prod(q.shape) for q in sc.params), case.dtype,
                                                        case.dtype).rtol if sc.gradient_clipping > 0 else 0.0)
                own_step = float((o.master_own - state.master[n].to(torch.float64)).abs().max())
                add(n, "master", s, ps.master, o.master_own.numpy(),
                    oracles.own_master_allowance(own_step / weight_scale if weight_scale > 0 else 1.0,
                                                 clip_rtol, u_store))
            add(n, "model", s, ps.model, o.model.numpy(), a_model)
            # ... and against DeepSpeed's own master rounded once to the model dtype, which is all the
            # copy back to the module does (round to nearest): exact, whatever the Newton-Schulz mode
            add(n, "model", s, ps.model, round_to_lp(_t(ps.master), case).numpy(), OWN_MODEL)

        if mo is not None:
            mo.check_buffers(rec, add)

        # Teacher forcing: the next step starts from DeepSpeed's masters and momentum.
        masters = {n: _t(ps.master) for n, ps in rec.params.items()}
        moms = {n: _t(ps.momentum) / (1.0 if scaled_momentum else float(ps.momentum_scale))
                for n, ps in rec.params.items() if spec[n].use_muon and ps.momentum is not None}
        state = replace(new_state, master={**new_state.master, **masters}, momentum={**new_state.momentum, **moms})
        prev = rec
    non_muon = non_muon_optimizer(case)
    if non_muon:
        # Under another optimizer no parameter is Muon's: DeepSpeed's ``use_muon`` tags (read on rank 0
        # after initialize, ``Trajectory.muon_params``) must name none. A leaked tag changes no AdamW
        # number on 0.19.8 (every reader sits behind a MuonWithAuxAdam test) but routes the parameter
        # through Muon for any code that trusts the tag, the capture's gradient read included.
        tagged = sorted(traj.muon_params)
        verdict.checks.append(compare_arrays(
            label, "<case>", "use_muon", 0, [float(len(tagged))], [0.0],
            oracles.Allowance(0.0, 0.0, f"count of parameters DeepSpeed tagged use_muon under {non_muon[0]} "
                                        f"(none may be): {tagged or 'none'}")))
    return verdict, oracle_norms
