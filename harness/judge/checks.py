"""The per-quantity checks of one judged run: each step's gradient, capture notes, group lrs, step-level
quantities (skip, loss scale, norm, Newton-Schulz calls) and each parameter's momentum, update, master
and model weights, plus the teacher forcing that carries DeepSpeed's state into the next step.

Why a module of its own: ``harness.judge.verdict`` orchestrates the replay (which oracle, which steps);
what each quantity is compared against, and at which allowance, is here, one function per quantity.
A bug's model reaches these checks only through the conventions and ``oracles.replay``'s readings of
them: no check names a bug or a bug's switch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

import oracles
from harness.case import synthetic
from harness.case.spec import Case
from harness.case.trajectory import Trajectory
from harness.judge.compare import LayoutView, cannot_judge, compare_arrays, missing
from oracles import replay


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
EXACT = oracles.Allowance(0.0, 0.0, "deterministic")
# The lr each optimizer group really used (captured before the step), against the schedule: the same
# closed form evaluated in float64 in another order, a few roundings apart (16 u_64).
LR_ALLOWANCE = oracles.Allowance(0.0, 16 * 2.0 ** -53, "lr: float64 evaluation of the schedule's formula")


def round_to_lp(w: torch.Tensor, case: Case) -> torch.Tensor:
    """``w`` as the model-dtype weights of the case hold it (as float64)."""
    return w.to(oracles.MODEL_DTYPES[case.dtype]).to(torch.float64)


def lp_weights(case: Case, traj: Trajectory, step: int) -> dict[str, torch.Tensor]:
    """The model-dtype weights DeepSpeed's forward saw in ``step`` (as float64). Step 1 sees the module
    as the harness built it, rounded: the captured masters after initialize are the same numbers, except
    where an optimizer step at initialize moved them (DSM-014) and left the module as it was. Module
    cases build their weights elsewhere and keep the captured masters."""
    if step == 1:
        lp = oracles.MODEL_DTYPES[case.dtype]
        start = traj.initial if case.model else synthetic.initial_weights(case)
        return {n: _t(a).to(lp).to(torch.float64) for n, a in start.items()}
    return {n: _t(ps.model) for n, ps in traj.steps[step - 2].params.items()}


def start_weights(case: Case, traj: Trajectory, conv: oracles.Conventions) -> dict[str, torch.Tensor]:
    """The weights the oracle starts from: the captured masters after initialize, except where the
    conventions step at initialize (``oracles.replay.starts_before_initialize``): the captured masters
    are then already stepped, and rounding them back to the model dtype does not undo a decay above half
    a 16-bit ulp, so the replay starts from the harness's own weights and applies that step itself.
    Module cases build their weights elsewhere: they keep the captured masters."""
    if replay.starts_before_initialize(conv) and not case.model:
        return {n: w.to(torch.float64) for n, w in synthetic.initial_weights(case).items()}
    return {n: _t(a) for n, a in traj.initial.items()}


class OracleLayout(LayoutView):
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
                   magnitudes=None, grad_units: float = 1.0, backward_units: float | None = None) -> oracles.Allowance:
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
                               "ns_method", sc.ns_method), grad_units=grad_units,
                           backward_units=grad_units if backward_units is None else backward_units)
    return a.grad


def exact_at_spectrum(a, case: Case, sc, p, g, m_new, shape, weight_scale: float, step_size: float,
                      momentum_dtype: str = "fp32", stored_dtype: str | None = None):
    """Exact mode's allowances at the step's own spectrum: the Newton-Schulz gain taken over the
    singular values the NS input can have (``oracles.perturbed_sigma_lo`` of the oracle's Nesterov blend
    ``U = lerp(g, M', beta)``, widened by the momentum allowance plus the blend's rounding), instead of
    the rank-deficient worst case 0, which puts the 16-bit allowance near its cap. ``momentum_dtype``: the
    rounding between the blend Newton-Schulz read and the oracle's (``replay.ns_input_storage``);
    ``stored_dtype``, where the stored ``M'`` carries a rounding that blend never read (a fused blend), widens
    the spectrum's perturbation by it, since ``U`` here is formed from the stored ``M'``."""
    beta = sc.hyper(p)["momentum"]
    U = torch.lerp(_t(g).to(torch.float64), _t(m_new).to(torch.float64), beta)
    rel_err = a.momentum.rtol + 2.0 * oracles.unit_roundoff(momentum_dtype)
    if stored_dtype not in (None, momentum_dtype) and bool(U.any()):
        rel_err += beta * oracles.unit_roundoff(stored_dtype) * float(_t(m_new).abs().max() / U.abs().max())
    if p.num_heads:
        U = U.reshape(p.num_heads, -1, U.shape[-1])
    elif U.ndim == 4:
        U = U.reshape(U.shape[0], -1)
    elif U.ndim < 2:
        return a
    sigma = oracles.perturbed_sigma_lo(U, rel_err)
    if sigma <= 0.0:
        return a
    return oracles.allowances("exact", model_dtype=case.dtype, shape=shape, world_size=case.dp_size,
                              gas=case.grad_accum, ns_method=sc.hyper(p)["ns_method"], grad_dtype="fp64",
                              momentum_dtype=momentum_dtype, num_heads=p.num_heads, weight_scale=weight_scale,
                              step_to_weight=step_size / weight_scale if weight_scale > 0 else 1.0,
                              clipping_active=sc.gradient_clipping > 0, sigma_lo=sigma)


@dataclass
class Run:
    """What every check of one judged run reads: the case, the oracle's configuration and conventions,
    the comparison mode, and where the checks go (``add`` compares and records; ``checks``/``notes``
    are the verdict's lists)."""
    case: Case
    conv: oracles.Conventions
    mode: str
    sc: oracles.StepConfig
    spec: dict
    label: str
    add: Callable
    checks: list
    notes: list
    mo: object = None  # the module oracle of a real module's case
    reports_norm: bool = True
    norm_disabled: bool = False
    muon_calls: int = 0
    # the Adam gradients skipped steps left in DeepSpeed's buffer (``oracles.replay.carried_after``)
    carried: dict = field(default_factory=dict)

    @property
    def ns_mode(self) -> str:
        return "emulated" if self.mode == "emulated" else "exact"

    @property
    def grad_store(self) -> str:
        return grad_store_dtype(self.case)

    @property
    def mom_store(self) -> str:
        return replay.momentum_storage(self.conv, self.case.dtype, self.mode == "emulated")

    @property
    def ns_in_store(self) -> str:
        return replay.ns_input_storage(self.conv, self.case.dtype, self.mode == "emulated")

    def ns_of(self, p) -> str:
        return self.sc.hyper(p)["ns_method"] if p.use_muon else self.sc.ns_method

    @property
    def ns_norm(self) -> str:
        """The Newton-Schulz method the norm is allowed for: the looser (standard) one where any has it."""
        return "standard" if any(self.ns_of(p) == "standard" for p in self.sc.params if p.use_muon) \
            else self.sc.ns_method

    def missing(self, param: str, quantity: str, step: int, why: str) -> None:
        self.checks.append(missing(self.label, param, quantity, step, why))


def add_check(run_checks: list, label: str, view, spec: dict, keep_maps: bool) -> Callable:
    """The ``add(param, quantity, step, actual, expected, allowance)`` of one run."""
    def add(param, quantity, step, actual, expected, allowance):
        run_checks.append(compare_arrays(label, param, quantity, step, actual, expected, allowance,
                                         view if param in spec else None, keep_map=keep_maps))
    return add


def overflowed_backward(run: Run, shared, lp, state, s: int, at: tuple, data_rank: list, grads) -> None:
    """Mark (as inf) the micro-batches whose fp16 backward overflowed: the oracle's fp16-overflow test
    sees only final gradients; an overflow inside the half-precision backward is the caller's to mark
    (``oracles.step``, ``detect_fp16_overflow``). The backward runs at ``oracles.replay.backward_scale``."""
    if run.case.dtype != "fp16" or run.mo is not None:
        return
    S = replay.backward_scale(run.conv, float(state.scaler.scale))
    for r in range(run.case.dp_size):
        for mu in range(run.case.grad_accum):
            if shared(("overflow",) + at + (r, mu, S), synthetic.backward_overflows,
                      lp, run.case, data_rank[r], s, mu, S):
                grads[r][mu] = {n: torch.full_like(g, math.inf) for n, g in grads[r][mu].items()}


def held_buffers(case: Case, step: int, prev, spec: dict) -> dict:
    """For each parameter without a gradient at ``step``: what the previous step's record ``prev`` left in
    its buffers, (its gradient in true units, its Muon update), as captured (None where not captured)."""
    if prev is None:
        return {}
    out = {}
    for name, k in case.unused:
        if k != step:
            continue
        ps = prev.params[name]
        grad = None if ps.grad is None or spec[name].use_muon else _t(ps.grad) / float(ps.grad_scale)
        update = None if ps.update is None or not spec[name].use_muon else _t(ps.update)
        out[name] = (grad, update)
    return out


def clip_norm_seen(rec) -> float | None:
    """The norm DeepSpeed clipped with: the one it reports, else the one its engine's clip computed and
    dropped (stage 0 fp32, ``StepRecord.engine_clip_norm``)."""
    return rec.global_norm if rec.global_norm is not None else rec.engine_clip_norm


def teacher_forced(run: Run, rec, state) -> tuple[dict, float | None]:
    """DeepSpeed's own averaged gradient, in true units, where it captured one (teacher forcing), and the
    clip coefficient it applied before Muon where it did (undone here, so the gradient check and the
    replay start from the averaged gradient as on every other path; the replay clips with it again, so
    Newton-Schulz reads exactly DeepSpeed's input)."""
    S = float(state.scaler.scale)
    units = replay.read_in_true_units(run.conv, S)
    forced = {n: _t(ps.grad) / float(ps.grad_scale) * units for n, ps in rec.params.items() if ps.grad is not None}
    k = replay.clip_before_muon(run.conv, run.sc.gradient_clipping, clip_norm_seen(rec), S)
    use_muon = {n: p.use_muon for n, p in run.spec.items()}
    return replay.unclip(run.conv, forced, use_muon, k), k


def capture_notes(run: Run, rec, s: int) -> bool:
    """Each capture note of the step is a failed check, except ranks whose compiled update copies differ
    in exact mode (returned True: the norm is then judged without DeepSpeed's own updates). Inductor
    compiles muon_update per process and per first-seen shapes, so two ranks that orthogonalise the same
    matrix can run differently fused kernels and round apart; exact mode judges the update only to the
    16-bit Newton-Schulz allowance, which the captured (lowest-rank) copy must meet. Kept visible, not a
    hole: the grad and momentum fed to both were bit-equal, or the capture would have said so."""
    rank_split = False
    for note in rec.notes:
        if run.mode == "exact" and run.case.compiled and " update of " in note and " differs between rank" in note:
            rank_split = True
            run.notes.append(f"step {s}: {note} (compiled kernels per rank; judged on the captured copy)")
            continue
        run.missing("<step>", "capture", s, f"capture note: {note}")
    return rank_split


def check_gradients(run: Run, rec, s: int, forced: dict, true_G: dict, grads, mags,
                    backward_scale: float) -> set[str]:
    """DeepSpeed's gradient against the float64 one where that is finite; returns the captured gradients
    left unjudged because the oracle's is not (``unjudged_gradients`` says "cannot judge" where applied).
    ``backward_scale``: the units the model-dtype backward stored each addend in, whatever units the
    capture later reads the sum in (an offload path hands Muon the gradient unscaled in fp32)."""
    unjudged = set()
    for n in run.spec:
        if n not in forced:
            continue
        if not bool(torch.isfinite(true_G[n]).all()):
            unjudged.add(n)
            continue
        a = grad_allowance(run.case, run.sc, n, grads, run.mode, mags, float(rec.params[n].grad_scale),
                           backward_scale)
        run.add(n, "grad", s, forced[n].numpy(), true_G[n].numpy(),
                a if run.mo is None else run.mo.grad_allowance(n, a))
    return unjudged


def unjudged_gradients(run: Run, unjudged: set[str], orec, s: int, scale: float) -> None:
    """A gradient captured on a step the oracle applied, whose float64 reference is not finite, cannot be
    judged: its own verdict (``compare.cannot_judge``), never a pass, since a verdict over fewer quantities
    than were captured must not read as complete, and never a divergence, since nothing says DeepSpeed's
    gradient is wrong. The reference is non-finite where the oracle's model-dtype backward overflowed at
    the step's loss scale (``overflowed_backward``) while DeepSpeed's did not."""
    if orec.skipped:
        return
    for n in sorted(unjudged):
        run.checks.append(cannot_judge(
            run.label, n, "grad", s, f"{n} gradient at step {s}: DeepSpeed's {run.case.dtype} backward at loss "
            f"scale {scale:g} gave a finite gradient and applied the step, but the oracle's {run.case.dtype} "
            "backward of the same loss overflows there, so it has no finite reference"))


def check_group_lrs(run: Run, rec, s: int, expected: dict) -> None:
    """The lr each optimizer group used against ``expected`` (a scheduled case without captured lrs fails)."""
    if rec.group_lr or run.case.schedule:
        for gname, lr in expected.items():
            run.add(f"<group {gname}>", "lr", s, [rec.group_lr.get(gname, math.nan)], [lr], LR_ALLOWANCE)


def check_step(run: Run, rec, orec, s: int, forced: dict) -> None:
    """Step-level quantities: skip, loss scale before and after, gradients and norm the capture must
    hold, the reported norm (against the oracle's and DeepSpeed's own updates' norm), Muon calls."""
    run.add("<step>", "skipped", s, [float(rec.skipped)], [float(orec.skipped)], EXACT)
    run.add("<step>", "loss_scale", s, [rec.loss_scale], [orec.loss_scale_used], EXACT)
    run.add("<step>", "loss_scale_after", s, [rec.loss_scale_after], [orec.loss_scale_after], EXACT)
    for n in run.spec:
        if n not in forced and not orec.skipped:
            run.missing(n, "grad", s, "the gradient the optimizer read was not captured, but the oracle applied "
                        "this step")
    if not orec.skipped and rec.global_norm is None and run.reports_norm:
        run.missing("<step>", "global_norm", s, "get_global_grad_norm() gave nothing, but the oracle applied "
                    "this step")
    if run.norm_disabled:  # none by design: a reported norm contradicts the config
        run.add("<step>", "global_norm_reported", s, [float(rec.global_norm is not None)], [0.0], EXACT)
    if not orec.skipped and rec.global_norm is not None and orec.global_norm is not None:
        check_norm(run, rec, orec, s)
    if not orec.skipped and rec.global_norm is None and rec.engine_clip_norm is not None:
        check_engine_clip_norm(run, rec, orec, s)
    if not orec.skipped:
        run.add("<step>", "muon_calls", s, [rec.muon_calls], [run.muon_calls], EXACT)


def norm_allowances(run: Run):
    """The allowances a global norm of this run is judged by (its widest Muon matrix's)."""
    case, sc = run.case, run.sc
    widest = max((p.shape for p in sc.params if p.use_muon), key=lambda sh: math.prod(sh), default=(1, 1))
    return oracles.allowances(run.mode, model_dtype=case.dtype, shape=widest, world_size=case.dp_size,
                              gas=case.grad_accum, ns_method=run.ns_norm, grad_dtype=run.grad_store,
                              momentum_dtype="fp32")


def check_norm(run: Run, rec, orec, s: int) -> None:
    case, sc = run.case, run.sc
    a = norm_allowances(run)
    run.add("<step>", "global_norm", s, [rec.global_norm], [orec.reported_norm], a.norm)
    if orec.reported_norm_own is not None:
        # the same norm from DeepSpeed's own updates: its norm arithmetic only (a norm over the raw
        # gradients on compiled stage 0 is 56% off, inside a.norm's Newton-Schulz allowance there)
        n_el = sum(math.prod(p.shape) for p in sc.params)
        run.add("<step>", "global_norm", s, [rec.global_norm], [orec.reported_norm_own],
                oracles.own_norm_allowance(n_el, case.dtype, case.dtype))


def check_engine_clip_norm(run: Run, rec, orec, s: int) -> None:
    """The norm the engine's own clip took (it reports none) against the oracle's global norm: the norm
    the step's clip must read, by the same allowance as a reported one."""
    a = norm_allowances(run)
    run.add("<step>", "global_norm", s, [rec.engine_clip_norm], [orec.global_norm], a.norm)


def param_allowances(run: Run, p, o, state, feed_g) -> tuple:
    """(allowances, the update's, the master's, the model's) of one parameter at one step.

    Downstream of the gradient the oracle was fed DeepSpeed's own averaged gradient, converted exactly
    (a power-of-two unscale), so no gradient error enters: grad_dtype="fp64". What remains is fp32
    storage of the momentum and masters, and Newton-Schulz. A 16-bit Muon momentum outside emulation:
    the oracle rounds each blend to 16 bit as DeepSpeed does, but from a float64 value, not from
    torch.lerp's fp32 one, so a stored element may land on the neighbouring 16-bit value (2 u_m;
    measured on 0.19.6, exact mode: gpt2 and llama ZeRO-1/2 bf16, 1-2 elements of 1024 one bf16 ulp apart).
    A fused blend (compiled) never rounds what Newton-Schulz reads to that storage: the direction and what
    follows from it are allowed only the blend's own fp32 arithmetic (``Run.ns_in_store``), the stored
    momentum its 16-bit rounding; allowing the direction the 16-bit one would let the worst-case
    Newton-Schulz gain cover a changed update."""
    case, sc, mode = run.case, run.sc, run.mode
    weight_scale = float(state.master[p.name].abs().max())
    step_size = float(o.update.abs().max())
    to_weight = step_size / weight_scale if weight_scale > 0 else 1.0
    shape = p.shape if len(p.shape) >= 2 else (1,) + tuple(p.shape)
    newton_schulz = replay.runs_muon_update(run.conv, p.use_muon)  # else no Newton-Schulz error in its step
    # a replay that starts before initialize applies the warm-up step there too: the first step's masters
    # carry two steps' roundings from the weights it started from
    steps = 2 if replay.starts_before_initialize(run.conv) and state.step_count == 0 else 1
    kw = dict(model_dtype=case.dtype, shape=shape, world_size=case.dp_size, gas=case.grad_accum, steps=steps,
              ns_method=run.ns_of(p), grad_dtype="fp64", num_heads=p.num_heads, weight_scale=weight_scale,
              step_to_weight=to_weight, clipping_active=sc.gradient_clipping > 0,
              use_muon=None if newton_schulz else False, adam_betas=tuple(sc.betas), adam_step=state.adam_step + 1)
    a = oracles.allowances(mode, momentum_dtype=run.ns_in_store, **kw)
    if mode == "exact" and newton_schulz and o.direction is not None:
        a = exact_at_spectrum(a, case, sc, p, feed_g, o.momentum, shape, weight_scale, step_size,
                              momentum_dtype=run.ns_in_store, stored_dtype=run.mom_store)
    if run.ns_in_store != run.mom_store:
        a = replace(a, momentum=oracles.allowances(mode, momentum_dtype=run.mom_store, **kw).momentum)
    # muon_update hands back O in the dtype of the gradient buffer it is written into (the model
    # dtype on the non-offload paths): one rounding there is storage, not error (+2 u_store).
    u_store = oracles.unit_roundoff(run.grad_store)
    direction = oracles.Allowance(a.direction.atol, a.direction.rtol + 2.0 * u_store,
                                  a.direction.derivation + f" + 2 u_store ({run.grad_store})", a.direction.cap)
    a_master, a_model = a.master, a.model
    # Where the applied O is 16-bit (the gradient buffer, or a 16-bit Muon state the oracle rounds O into)
    # outside emulation, DeepSpeed's O and the oracle's differ by more than an ulp, so either may round to a
    # neighbouring 16-bit value; one ulp of O (2 u_out) reaches the masters scaled by the step.
    u_out = replay.update_rounding(run.conv, run.grad_store, case.dtype)
    if mode != "emulated" and newton_schulz and u_out > oracles.unit_roundoff("fp32"):
        extra = 2.0 * u_out * to_weight
        a_master, a_model = (oracles.Allowance(x.atol, x.rtol + extra, x.derivation
                                               + f" + 2 u_out ({u_out:.3g}) x step_to_weight", x.cap)
                             for x in (a.master, a.model))
    return a, direction, a_master, a_model


def check_muon_state(run: Run, n: str, ps, o, orec, state, s: int, a, direction) -> None:
    """A Muon parameter's momentum and update, where ``muon_update`` runs for it."""
    p = run.spec[n]
    if not replay.runs_muon_update(run.conv, p.use_muon):
        return  # no muon_update, so no momentum or update to capture: the muon_calls check says so
    # DeepSpeed creates the momentum buffer at the first applied step: before it, a skipped step has no
    # momentum to capture, and the oracle's is still zero.
    never_applied = orec.skipped and state.step_count == state.skipped_steps
    if ps.momentum is None:
        if not (never_applied and not bool(o.momentum.any())):
            run.missing(n, "momentum", s, "the Muon momentum was not captured")
    else:
        o_mom = replay.true_momentum(run.conv, o.momentum, orec.loss_scale_used)
        run.add(n, "momentum", s, _t(ps.momentum).numpy() / float(ps.momentum_scale), o_mom.numpy(), a.momentum)
    if o.direction is not None and ps.update is None:
        run.missing(n, "update", s, "muon_update's result was not captured, but the oracle applied this step")
    elif o.direction is not None:
        run.add(n, "update", s, ps.update, o.direction.numpy(), direction)


def check_param(run: Run, n: str, ps, orec, state, s: int, feed_g) -> None:
    """One parameter's momentum, update, master (against the oracle's, and against DeepSpeed's own update
    through the step's arithmetic) and model weights."""
    case, sc = run.case, run.sc
    o = orec.params[n]
    a, direction, a_master, a_model = param_allowances(run, run.spec[n], o, state, feed_g)
    check_muon_state(run, n, ps, o, orec, state, s, a, direction)
    run.add(n, "master", s, ps.master, o.master.numpy(), a_master)
    if o.master_own is not None:
        # the same master from DeepSpeed's own update and its own norm's clip: the step's arithmetic
        # (lr, weight decay, clip) without Newton-Schulz's allowance in it
        weight_scale = float(state.master[n].abs().max())
        clip_rtol = (oracles.own_norm_allowance(sum(math.prod(q.shape) for q in sc.params), case.dtype,
                                                case.dtype).rtol if sc.gradient_clipping > 0 else 0.0)
        own_step = float((o.master_own - state.master[n].to(torch.float64)).abs().max())
        run.add(n, "master", s, ps.master, o.master_own.numpy(),
                oracles.own_master_allowance(own_step / weight_scale if weight_scale > 0 else 1.0,
                                             clip_rtol, oracles.unit_roundoff(run.grad_store)))
    run.add(n, "model", s, ps.model, o.model.numpy(), a_model)
    # ... and against DeepSpeed's own master rounded once to the model dtype, which is all the copy back
    # to the module does (round to nearest): exact, whatever the Newton-Schulz mode
    run.add(n, "model", s, ps.model, round_to_lp(_t(ps.master), case).numpy(), OWN_MODEL)


def forced_state(run: Run, new_state, rec):
    """Teacher forcing: the next step starts from DeepSpeed's masters and momentum (in the state's units)."""
    masters = {n: _t(ps.master) for n, ps in rec.params.items()}
    moms = {n: replay.state_momentum(run.conv, _t(ps.momentum), float(ps.momentum_scale))
            for n, ps in rec.params.items() if run.spec[n].use_muon and ps.momentum is not None}
    return replace(new_state, master={**new_state.master, **masters}, momentum={**new_state.momentum, **moms})


def check_no_muon_tags(run: Run, traj: Trajectory, rule: str) -> None:
    """Under another optimizer no parameter is Muon's: DeepSpeed's ``use_muon`` tags (read on rank 0
    after initialize, ``Trajectory.muon_params``) must name none. A leaked tag changes no AdamW number on
    0.19.8 (every reader sits behind a MuonWithAuxAdam test) but routes the parameter through Muon for any
    code that trusts the tag, the capture's gradient read included."""
    tagged = sorted(traj.muon_params)
    run.checks.append(compare_arrays(
        run.label, "<case>", "use_muon", 0, [float(len(tagged))], [0.0],
        oracles.Allowance(0.0, 0.0, f"count of parameters DeepSpeed tagged use_muon under {rule} "
                                    f"(none may be): {tagged or 'none'}")))
