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

import functools
import json
import os
import shlex
import sys
from pathlib import Path
from dataclasses import dataclass, field, replace

import numpy as np
import torch

import oracles
from harness.env import buildenv, device, versions
from harness.case import synthetic
from oracles import replay, schedules
from oracles.step import fresh_engine_state
from harness.case.spec import Case
from harness.judge import checks
from harness.judge.checks import Uncaptured, grad_allowance, grad_store_dtype  # noqa: F401 (their home was here)
from harness.judge.compare import Check, describe, first_divergence, missing
from harness.case.trajectory import Trajectory
from harness.case.spec import NON_MUON_OPTIMIZERS
from harness.judge import module_oracle as oracle
import weakref

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
    """The command that reruns exactly this case from any directory: this interpreter by its absolute
    path, and on ``PYTHONPATH`` the project and, for a user's ``--model package.module:factory``, the
    folder it is imported from (the ranks of the rerun import it again). The interpreter is the one that
    imports the DeepSpeed tree judged (a case may behave otherwise on another); ``harness run`` prints
    which tree that is before it judges."""
    paths = [str(buildenv.PROJECT_ROOT)] + ([d] if (d := _model_import_root(case.model)) else [])
    return (f"PYTHONPATH={shlex.quote(os.pathsep.join(dict.fromkeys(paths)))} {shlex.quote(sys.executable)} "
            f"-m harness run --case {shlex.quote(case.to_json())}")


def _model_import_root(model: str | None) -> str | None:
    """The folder a ``package.module:factory`` is imported from (None for a built-in, or a module of an
    installed package, which is importable anyway)."""
    import importlib.util
    import sysconfig

    from harness import models

    if not model or model in models.BUILTIN:
        return None
    mod_name = models.factory_path(model).partition(":")[0]
    spec = importlib.util.find_spec(mod_name.split(".")[0])
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    origin = Path(spec.origin).resolve()
    root = origin.parent.parent if origin.name == "__init__.py" else origin.parent
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    return None if root in site else str(root)


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
        world_size=case.dp_size, model_dtype=case.dtype, loss_scaler=_loss_scaler(case), param_hyper=param_hyper,
        # stage 0's all-reduce (engine.py allreduce_bucket) divides after summing unless prescale_gradients;
        # the ZeRO optimizers reduce their own way (pre-divided)
        reduction_sums_ranks=case.stage == 0 and not ds.prescale_gradients and ds.communication_data_type == "fp16")
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

    if case.stage == 3 and versions.z3_muon_placement(case.offload != "none") == "reduce":  # one rank per matrix
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
        return [c for c in self.checks if not c.passed and c.unjudged is None]

    @property
    def unjudged(self) -> list[Check]:
        """The captured quantities without a finite reference (``compare.cannot_judge``)."""
        return [c for c in self.checks if c.unjudged is not None]

    @property
    def passed(self) -> bool:
        return not self.failures and not self.unjudged

    @property
    def first(self) -> Check | None:
        return first_divergence(self.checks)

    @property
    def worst_ratio(self) -> float:
        """Over the compared checks (a check that cannot be judged has no ratio)."""
        return max((c.worst_ratio for c in self.checks if c.unjudged is None), default=0.0)

    def failed_quantities(self) -> set[tuple[str, str]]:
        return {(c.param, c.quantity) for c in self.failures}

    def message(self, limit: int = 6) -> str:
        if self.passed:
            return f"{self.case.name}: all {len(self.checks)} checks within tolerance (worst {self.worst_ratio:.3g}x)"
        first = self.first
        fails = sorted(self.failures, key=lambda c: (c.step, -c.worst_ratio))
        out = [f"{self.case.name} [{self.mode}]: {len(fails)} of {len(self.checks)} checks out of tolerance"
               + (f", {len(self.unjudged)} cannot be judged" if self.unjudged else "")]
        out += [describe(c, reproduce_command(self.case)) for c in self.unjudged[:limit]]
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


def judge(case: Case, traj: Trajectory, *, conventions: oracles.Conventions | None = None,
          mode: str | None = None, keep_maps: bool = True, until_failure: bool = False) -> Verdict:
    """The verdict of the case's run(s): with ``case.model_parallel`` > 1 every model-parallel replica
    (``traj`` and ``traj.replicas``) is its own data-parallel run of ``case.dp_size`` ranks on its own
    data, judged against its own oracle; their checks are merged, each labelled with its replica.

    ``until_failure``: stop each run after its first step with a failing check. Every check a step adds
    is labelled with that step, so ``passed`` and ``first`` are those of the whole verdict: all the
    mutation kill matrix reads of a mutant's run (most are caught in their first step)."""
    mode = mode or comparison_mode(case)
    try:
        return _judge(case, traj, conventions, mode, keep_maps, until_failure)
    except Uncaptured as exc:
        verdict = Verdict(case, mode)
        bad = sorted(n for n, a in traj.initial.items() if np.asarray(a).dtype == object)
        verdict.checks.append(missing(case.name, bad[0] if bad else "<case>", "capture", 0,
                                      f"{exc}{'; uncaptured initial weights: ' + ', '.join(bad) if bad else ''}"))
        return verdict


def _judge(case: Case, traj: Trajectory, conventions, mode: str, keep_maps: bool, until_failure: bool = False
           ) -> Verdict:
    if case.model_parallel == 1:
        return _judge_run(case, traj, conventions, mode, keep_maps, until_failure=until_failure)[0]
    verdict, norms = _judge_run(case, traj, conventions, mode, keep_maps, mp_rank=0, until_failure=until_failure)
    runs = [traj] + list(traj.replicas)
    if len(runs) != case.model_parallel:
        verdict.checks.append(missing(case.name, "<step>", "capture", 0, f"{len(runs)} replica runs captured, "
                                      f"model_parallel is {case.model_parallel}"))
    for k, run in enumerate(runs[1:], 1):
        # DeepSpeed counts a parameter without model-parallel attributes only on model-parallel rank
        # 0 and sums the norm over the model-parallel group (docs/deepspeed-0.19.8.md, "Data-parallel
        # group smaller than the world"): every replica clips with and reports replica 0's norm.
        v, _ = _judge_run(case, run, conventions, mode, keep_maps, mp_rank=k, norm_of=norms,
                          until_failure=until_failure)
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
    trajectory is kept (the parent stays flat); a step whose weights the conventions replace (a
    fresh engine) is never shared."""

    _latest: tuple | None = None  # (weak reference to the trajectory, its entries)

    @classmethod
    def of(cls, traj: Trajectory) -> dict:

        if cls._latest is None or cls._latest[0]() is not traj:
            cls._latest = (weakref.ref(traj), {})
        return cls._latest[1]


def _shared(entries: dict | None, key: tuple, fn, *args):
    if entries is None:
        return fn(*args)
    if key not in entries:
        entries[key] = fn(*args)
    return entries[key]


def _judge_run(case: Case, traj: Trajectory, conventions: oracles.Conventions | None, mode: str,
               keep_maps: bool, *, mp_rank: int = 0, norm_of: dict | None = None,
               until_failure: bool = False) -> tuple[Verdict, dict]:
    """One data-parallel run: model-parallel replica ``mp_rank`` of the case (its data from the global
    ranks ``case.data_rank(r, mp_rank)``). ``norm_of``: step -> the global norm this replica clips with
    and reports (replica 0's oracle norm), instead of its own. Returns the verdict and this run's
    oracle global norm per step. Each quantity's check is ``harness.judge.checks``'; the conventions
    (the intended oracle's, or a bug model's) reach them only through ``oracles.replay``."""
    conv = conventions or INTENDED
    sc = step_config(case)
    layout = layout_for(case, sc)
    verdict = Verdict(case, mode)
    spec = {p.name: p for p in sc.params}
    label = case.name if case.model_parallel == 1 else f"{case.name} (model-parallel rank {mp_rank})"
    run = checks.Run(case, conv, mode, sc, spec, label,
                     checks.add_check(verdict.checks, label, checks.OracleLayout(layout), spec, keep_maps),
                     verdict.checks, verdict.notes,
                     mo=_module_oracle().module_oracle_for(case, traj) if case.model else None,
                     reports_norm=reports_global_norm(case), norm_disabled=grad_norm_disabled(case),
                     muon_calls=replay.muon_calls(conv, expected_muon_calls(case, sc, layout)))
    data_rank = [case.data_rank(r, mp_rank) for r in range(case.dp_size)]
    oracle_norms: dict[int, float | None] = {}
    state = oracles.initial_state(sc, checks.start_weights(case, traj, conv), conv)
    prev = None  # the previous step's record: what it left in the buffers
    for rec in traj.steps:
        state, orec = _judge_step(run, traj, rec, prev, state, data_rank, mp_rank, norm_of)
        oracle_norms[rec.step] = None if orec.skipped else orec.global_norm
        prev = rec
        if until_failure and verdict.failures:
            break
    non_muon = non_muon_optimizer(case)
    if non_muon:
        checks.check_no_muon_tags(run, traj, non_muon[0])
    return verdict, oracle_norms


def _step_gradients(run: checks.Run, traj: Trajectory, state, s: int, data_rank: list, mp_rank: int):
    """(state, the model weights the forward saw, the float64 per-micro gradients, their magnitudes) of
    step ``s``: at DeepSpeed's own weights (teacher forcing), shared with the run's other judges, unless
    the conventions put a fresh engine's weights there (then not shared)."""
    case, conv, sc = run.case, run.conv, run.sc
    lp = checks.lp_weights(case, traj, s)
    fresh_here = replay.fresh_at(conv, s)
    if fresh_here:
        # what a resume left of a fresh engine (built on the variant-1 init, harness.rank.ds_run)
        fresh = {n: w.to(torch.float64) for n, w in synthetic.initial_weights(case, variant=1).items()}
        state = fresh_engine_state(state, sc, fresh, conv)
        lp = replay.fresh_model_weights(conv, lp, {n: checks.round_to_lp(w, case) for n, w in fresh.items()})
    entries = _SharedGradients.of(traj) if not fresh_here else None
    shared = functools.partial(_shared, entries)
    at = (id(case), mp_rank, s)
    W, GAS = case.dp_size, case.grad_accum
    if run.mo is not None:
        grads, mags = run.mo.gradients(s, lp, float(state.scaler.scale)), None
    else:
        grads = [[dict(shared(("grad",) + at + (r, mu), synthetic.local_gradients, lp, case, data_rank[r], s, mu))
                  for mu in range(GAS)] for r in range(W)]
        mags = [[shared(("mag",) + at + (r, mu), synthetic.gradient_magnitudes, lp, case, data_rank[r], s, mu)
                 for mu in range(GAS)] for r in range(W)]
    checks.overflowed_backward(run, shared, lp, state, s, at, data_rank, grads)
    return state, grads, mags


def _judge_step(run: checks.Run, traj: Trajectory, rec, prev, state, data_rank: list, mp_rank: int,
                norm_of: dict | None):
    """Judge one captured step against the oracle replayed from DeepSpeed's previous state; returns the
    next (teacher-forced) state and the oracle's record."""
    case, conv, sc, spec, s = run.case, run.conv, run.sc, run.spec, rec.step
    state, grads, mags = _step_gradients(run, traj, state, s, data_rank, mp_rank)
    use_muon = {n: p.use_muon for n, p in spec.items()}
    bscale = replay.backward_scale(conv, float(state.scaler.scale))
    true_G = replay.stepped_gradients(conv, oracles.accumulate(grads, sc), use_muon,
                                      checks.held_buffers(case, s, prev, spec), oracles.scale_ratio(state, sc, conv))
    true_G = replay.with_carried(conv, true_G, run.carried, bscale)
    forced, k_ds = checks.teacher_forced(run, rec, state)
    feed = {n: forced.get(n, true_G[n]) for n in true_G}
    feed_grads = [[feed] * case.grad_accum] * case.dp_size  # averages to exactly ``feed``
    # The reported norm is also judged against the norm of DeepSpeed's own Muon updates (teacher
    # forcing; oracles.step ``norm_directions``), unless ranks kept different copies of an update.
    own_updates = {n: checks._t(ps.update) for n, ps in rec.params.items() if ps.update is not None}
    rank_split = checks.capture_notes(run, rec, s)
    unjudged = checks.check_gradients(run, rec, s, forced, true_G, grads, mags, bscale)
    # With an lr schedule the step's lrs follow the applied steps so far (the oracle's own count); the
    # replay clips with DeepSpeed's own k, so Newton-Schulz reads its exact input. A model-parallel
    # replica clips with (and reports) replica 0's norm (docs/deepspeed-0.19.8.md section 14).
    sc_s = step_config(case, state.step_count - state.skipped_steps, conv) if case.schedule else sc
    conv_s = replay.step_conventions(conv, frozenset(n for n, k in case.unused if k == s and not spec[n].use_muon))
    new_state, orec = oracles.oracle_step(state, feed_grads, sc_s, conv_s, ns_mode=run.ns_mode, forced_clip_coef=k_ds,
                                          shared_norm=None if norm_of is None else norm_of.get(s),
                                          norm_directions=None if rank_split else own_updates)
    run.carried = replay.carried_after(conv, true_G, use_muon, orec.skipped, bscale)
    checks.check_group_lrs(run, rec, s, expected_group_lrs(case, sc_s))
    checks.check_step(run, rec, orec, s, forced)
    checks.unjudged_gradients(run, unjudged, orec, s, replay.backward_scale(conv, float(state.scaler.scale)))
    for n, ps in rec.params.items():
        checks.check_param(run, n, ps, orec, state, s, feed[n])
    if run.mo is not None:
        run.mo.check_buffers(rec, run.add)
    return checks.forced_state(run, new_state, rec), orec
