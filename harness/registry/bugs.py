"""Stock DeepSpeed 0.19.8 bugs the harness has confirmed, each with the cases it affects.

A pipeline case on stock DeepSpeed that a bug's ``trigger`` selects is a strict xfail carrying the
bug id only when (a) it diverges from the intended oracle in the quantities the bug names
(``quantities``) and (b) it matches the oracle with the bug's ``model`` switched on (changes to
``oracles.Conventions``) at the same tolerances as any passing case; any other divergence in the same
case is a plain failure (``harness.gate.decide.evaluate``). A bug whose trigger selects a case that then shows
nothing is an XPASS, which strict mode turns into a failure: the registry must stay exact. A crash bug
(``crash``) is accepted only for its exact exception type, message fragment and frame.

``fixed_by`` reads the entries of ``harness.fixes`` that remove the bug (each fix names its bugs);
``releases`` the releases it was measured on (``harness.registry.releases.measured``): only there does it
excuse anything (``excuses``). docs/bugs.md and the README's bug table are generated from these entries
(``python -m harness.registry.docs``).

Triggers are pure functions of the case. Where a bug depends on the loss-scale trajectory they
replay DeepSpeed's dynamic loss scaler (``oracles.loss_scaler``) over the case's steps and injected
overflows; DSM-005 (an fp16 overflow of ``S*O``) replays the float64 oracle to get ``max|O|`` per step.
Two confirmed bugs cannot be expressed as a ``Case`` (DSM-006 needs two Muon param groups, DSM-011 is
about files left on disk): their trigger selects no case, and ``reproducer`` names the standalone
test that shows them.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, replace
from typing import Callable

from harness.env import versions
from harness.judge.raised import raised_in
from harness.registry import historical, refusals
from harness.registry.releases import measured
from harness.case import nvme
from harness.case.spec import Case
from harness.fixes._registry import Refusal
from oracles.layout import zero3_padded_tail
import oracles
import torch
from harness.case.nvme import predict_swapped_subgroups
from harness import fixes

REFUSAL_LINE = f"{Refusal.__module__}.{Refusal.__qualname__}:"  # how a rank's traceback ends in one


@dataclass(frozen=True)
class Bug:
    id: str
    title: str
    symptom: str
    trigger: Callable[[Case], bool]
    quantities: frozenset  # quantities it may make diverge ("swap" = NVMe never touched, "crash" = the case raises)
    where: str  # the DeepSpeed 0.19.8 code responsible
    reproducer: str = ""  # the case or test that shows it
    # Where the fix is a refusal rather than a repair: text the patched runtime's error must contain.
    # A patched case this bug triggers then passes when, and only when, it is refused with that text.
    refused_when_patched: str | None = None
    # The bug model: what stock DeepSpeed computes because of this bug, as changes to the oracle's
    # ``oracles.Conventions`` for the case (``{}``: the numbers are the intended ones, only the
    # non-numerical quantities in ``quantities`` differ). None: not modelled (crash bugs, DSM-011's files
    # on disk, and the few cases a model declines, e.g. DSM-010 on a module case); such an excuse is not
    # full strength.
    model: Callable[[Case], dict | None] | None = None  # a None answer: not modelled for that case
    # Crash bugs: (exception type, message fragment, a frame on the call path) the rank's traceback
    # must show; the stock case is an xfail only for exactly that crash.
    crash: tuple[str, str, str] | None = None
    # Further (type, fragment, frame) signatures of the same crash where it surfaces elsewhere for
    # some shapes; each is matched exactly like ``crash``.
    crash_also: tuple[tuple[str, str, str], ...] = ()
    # Where the fix covers only part of the trigger: the cases it does fix (None: every case the bug
    # triggers). On the patched column the bug stays expected, with its model, where this says False.
    fix_covers: Callable[[Case], bool] | None = None
    # release -> whether a gate run there showed the bug (``harness.registry.releases.measured``); a release
    # absent from it was not measured for the bug, which then excuses nothing there
    releases: dict = field(default_factory=dict, compare=False)
    # Why a numerical bug has no model (it then excuses its quantities by name, below full strength);
    # every bug is modelled, a crash, a refusal, or says this
    unmodelled: str | None = None

    @property
    def fixed_by(self) -> tuple[str, ...]:
        """The patched runtime's fixes that remove this bug. Each fix names the bugs it removes
        (``harness.fixes``), so the link is declared there, once."""
        return tuple(fixes.fixes_for(self.id))
    # Where the tree's own source shows this bug's mechanism for a case (a probe of ``harness.env.tree``):
    # on a tree where the bug was not measured (a source checkout, a pull request), an unmodelled bug
    # excuses its quantities by name only where this says so (None: never)
    present: Callable[[Case], bool] | None = None
    # Other code of the same bug seen on trees that were not measured (a pull request that moved it): models
    # tried only there, beside ``model``, and only as candidates (``harness.gate.decide``); each says which
    # code it is the model of in its comment
    variants: tuple[Callable[[Case], dict | None], ...] = ()
    variant: str | None = None  # on a bug ``with_variants`` made: which variant model it carries

    def with_variants(self) -> list["Bug"]:
        """This bug with its own model, then once per variant model (the same id, trigger and quantities), each
        named by its function (``_muon_in_new_scale``: "muon in new scale") so a verdict can say which matched."""
        return [self] + [replace(self, model=v, variants=(), variant=v.__name__.strip("_").replace("_", " "))
                         for v in self.variants]

    @property
    def label(self) -> str:
        """The id, and the variant where this is one: what a verdict names."""
        return self.id + (f" (variant: {self.variant})" if self.variant else "")

    @property
    def modelled(self) -> str:
        """For the README's bug table: "yes" (an oracle model), "crash", "refusal", or "no"."""
        if self.model is not None:
            return "yes"
        if self.crash is not None:
            return "crash"
        if self.refused_when_patched is not None:
            return "refusal"
        return "no"

    def refusal_matches(self, traceback: str) -> bool:
        """Is a rank's traceback the patched runtime's refusal for this bug: a ``Refusal`` (the patched
        runtime's ``ValueError``) whose message carries ``refused_when_patched``?"""
        if self.refused_when_patched is None:
            return False
        return any(line.startswith(REFUSAL_LINE) and self.refused_when_patched in line
                   for line in traceback.splitlines())

    def crash_matches(self, traceback: str) -> bool:
        """Does a rank's traceback show exactly this bug's crash (type, message, call path)?"""
        if self.crash is None:
            return False
        return any(raised_in(traceback, etype, fragment, frame)
                   for etype, fragment, frame in (self.crash, *self.crash_also))


# ------------------------------------------------------------------------------------------------
# facts about a case


def _half(c: Case) -> bool:
    return c.dtype in ("fp16", "bf16")


def _comm(c: Case) -> str:
    return c.ds.communication_data_type


def _gad(c: Case) -> str:
    return c.ds.grad_accum_dtype


def _z3_inmem(c: Case) -> bool:
    return bool(c.ds.zero.save_muon_momentum_buffer_in_memory)


def _is_muon(p) -> bool:
    return p.uses_muon


def _has_muon(c: Case) -> bool:
    return c.runs_muon


def _per_head(c: Case) -> bool:
    """A Muon matrix tagged with more than one head: what a path that drops ``num_heads`` changes."""
    return any(_is_muon(p) and (p.num_heads or 1) > 1 for p in c.params)


def _poisoned(c: Case) -> bool:
    """Some injected gradient is inf or NaN (a finite injection only scales)."""
    return any(not math.isfinite(o.value) for o in c.overflows)


def _has_adam(c: Case) -> bool:
    return any(not _is_muon(p) for p in c.params)


_bf16_optimizer = historical.bf16_optimizer_route  # the BF16_Optimizer route (one home: historical_bugs)


def _resumes(c: Case) -> bool:
    return c.checkpoint_at is not None and 1 <= c.checkpoint_at < c.steps


def _fp16_dynamic(c: Case) -> bool:
    return c.dtype == "fp16" and c.ds.fp16.dynamic


@functools.lru_cache(maxsize=512)
def _scale_plan_cached(case_json: str, restart_at):
    from harness.judge.verdict import step_config  # late: keeps this module numpy-free at import

    c = Case.from_json(case_json)
    cfg = step_config(c).loss_scaler or oracles.LossScalerConfig.for_model_dtype(c.dtype)  # None: a static 1
    poisoned = frozenset(o.step for o in c.overflows if not math.isfinite(o.value))
    return oracles.scale_plan(cfg, c.steps, poisoned, restart_at)


def scale_plan(c: Case, restart_at: int | None = None) -> tuple:
    """Per step ``(S used, S after, skipped)`` as DeepSpeed's scaler will run it, assuming no overflow
    other than the case's injected ones (``restart_at``: a scaler that restarts after that step)."""
    return _scale_plan_cached(c.replace(name="plan").to_json(), restart_at)


def _z1_fp32_accumulated(c: Case) -> bool:
    """ZeRO-1 accumulating in fp32 without contiguous gradients: ``get_param_gradient_attribute`` hands Muon
    the fp32 ``grad_accum`` and ``_muon_momentum_buffer`` follows it, so the momentum is fp32 (measured:
    a triples row, ZeRO-1 fp16 at 3 ranks, passes the intended oracle, and with contiguous_gradients on, or without
    grad_accum_dtype fp32, DSM-001 shows)."""
    return c.stage == 1 and _gad(c) == "fp32" and not c.ds.zero.contiguous_gradients


# Below this, every scaled fp16 gradient element of magnitude up to 4 rounds to zero (half of fp16's
# smallest subnormal, 2^-24, is 2^-25 = 4 * 2^-27)
FP16_FLUSHED_SCALE = 2.0 ** -27


def _fp16_flushed(c: Case) -> bool:
    """fp16 whose backward at the first loss scale flushes the gradients to zero: no momentum for a 16-bit
    buffer to round (measured on a triples row, ZeRO-2 fp16 at 3 ranks, grad_scale 1e-8 at a static scale 0.5: it passes
    the intended oracle; at grad_scale 1, or the dynamic 2^12, DSM-001 shows)."""
    return c.dtype == "fp16" and c.grad_scale * scale_plan(c)[0][0] < FP16_FLUSHED_SCALE


def _grows(c: Case) -> bool:
    return _fp16_dynamic(c) and any(not sk and after > used for used, after, sk in scale_plan(c))


def _momentum_sees_scale_change(c: Case) -> bool:
    """A step whose loss scale differs from the one of the last step that committed Muon momentum."""
    last = None
    for used, _, sk in scale_plan(c):
        if last is not None and used != last:
            return True
        if not sk:
            last = used
    return False


def _padded_head_group(c: Case) -> bool:
    """ZeRO-1/2 with parameter_alignment pads every Muon param but the group's last to 16 bytes
    (stage_1_and_2.py:444-500); any padding sends the group down get_flat_partition's padded branch."""
    if not c.ds.zero.parameter_alignment:
        return False
    muon = sorted((p for p in c.params if _is_muon(p)), key=lambda p: tuple(p.shape), reverse=True)
    if not any((p.num_heads or 1) > 1 for p in muon):
        return False
    align = 16 // math.gcd(16, 4 if c.dtype == "fp32" else 2)
    offset = 0
    for i, p in enumerate(muon):
        offset += p.numel
        if i < len(muon) - 1 and (-offset) % align:
            return True
    return False


def _z3_padded_tail(c: Case) -> bool:
    W = c.dp_size
    return W > 1 and any(_is_muon(p) and zero3_padded_tail(p.numel, W) is not None for p in c.params)


def _free_gradients(c: Case):
    """(initial weights, ``grads(weights, step)``) of the case's own model, free of DeepSpeed: the synthetic
    model's closed form, or a real module's float64 autograd (``harness.judge.module_oracle.free_gradients``),
    never the synthetic model standing in for a module with the same parameter names."""
    if c.model:
        from harness.judge import module_oracle  # late: keeps this module numpy-free at import

        return module_oracle.free_gradients(c)
    from harness.case import synthetic  # late: keeps this module numpy-free at import

    init = {n: t.to(torch.float64) for n, t in synthetic.initial_weights(c).items()}
    return init, lambda w, s: [[synthetic.local_gradients(w, c, c.data_rank(r), s, mu) for mu in range(c.grad_accum)]
                               for r in range(c.dp_size)]


@functools.lru_cache(maxsize=128)
def _max_update_cached(case_json: str) -> tuple:
    """Per step (S used, max|O| over Muon params, skipped, S after, the clip's norm in true units) from the
    float64 oracle run free of DeepSpeed, on the case's own model (``_free_gradients``)."""

    from harness.judge.verdict import step_config  # late: keeps this module numpy-free at import

    c = Case.from_json(case_json)
    sc = step_config(c)
    conv = oracles.Conventions(momentum_dtype="fp32")
    lp = oracles.MODEL_DTYPES[c.dtype]
    init, gradients = _free_gradients(c)
    state = oracles.initial_state(sc, init, conv)
    out = []
    for s in range(1, c.steps + 1):
        w = {n: m.to(lp).to(torch.float64) for n, m in state.master.items()}
        state, rec = oracles.oracle_step(state, gradients(w, s), sc, conv, ns_mode="exact")
        m = max((float(p.direction.abs().max()) for p in rec.params.values()
                 if p.use_muon and p.direction is not None), default=0.0)
        out.append((float(rec.loss_scale_used), m, bool(rec.skipped), float(rec.loss_scale_after), rec.global_norm))
    return tuple(out)


FP16_INF_THRESHOLD = 65520.0  # the smallest value that rounds to inf in fp16


def _z3_offload_fp16_update_overflows(c: Case) -> bool:
    if not (c.stage == 3 and c.offload != "none" and c.dtype == "fp16" and _gad(c) != "fp32" and _has_muon(c)):
        return False
    # cheap pre-filter: |O_ij| <= sigma_max(NS5 output) * aspect scale, and sigma_max < 1.5
    bound = max(1.5 * math.sqrt(max(1.0, p.shape[0] / (p.numel / p.shape[0]))) for p in c.params if _is_muon(p))
    if max(used for used, _, _ in scale_plan(c)) * bound < FP16_INF_THRESHOLD:
        return False
    return any(not sk and used * m >= FP16_INF_THRESHOLD
               for used, m, sk, *_ in _max_update_cached(c.replace(name="plan").to_json()))


def _clip_undoes_growth(c: Case) -> bool:
    """DSM-003 on ZeRO-1/2 with optimizer offload halves every vector the clip's norm covers (the Muon update
    formed as S O with the old scale, each Adam gradient, both unscaled by the new one) and so the norm; a clip
    that still acts at half the norm multiplies them back by 2, so the step is the intended one and nothing
    shows (measured: ZeRO-2 CPU offload, fp16, clip 0.05, the scale growing at step 3: every quantity within
    its allowance). True where the clip acts at half the norm (DeepSpeed's coefficient, ``+ 1e-6``) on every
    growth step, the norm from the float64 oracle run free of DeepSpeed."""
    clip = _clip_of(c)
    if c.stage not in (1, 2) or c.offload == "none" or clip <= 0 or not _has_muon(c):
        return False
    norms = [n for used, _, sk, after, n in _max_update_cached(c.replace(name="plan").to_json())
             if not sk and after > used]
    return bool(norms) and all(n is not None and (n / 2 + 1e-6) / clip > 1 for n in norms)


def _nvme_resume_loses_state(c: Case) -> bool:
    if not (c.stage == 3 and c.offload == "nvme" and _resumes(c)):
        return False

    if any(not s["swapped"] for s in predict_swapped_subgroups(c)):
        return True
    if _z3_inmem(c) and _has_muon(c):
        return True
    return scale_plan(c)[c.checkpoint_at:] != scale_plan(c, restart_at=c.checkpoint_at)[c.checkpoint_at:]


def _nvme_resume_model(c: Case) -> dict | None:
    """DSM-010's model: the parameters of the sub-groups that were not swapped hold a fresh engine's state
    after the resume, in-memory Muon momentum is lost, the loss scaler restarts. None (not modelled) for
    a module case (its fresh init is the module's), or where only part of the Adam parameters restart."""

    if c.model:
        return None
    fresh = tuple(n for s in predict_swapped_subgroups(c) if not s["swapped"] for n in s["params"])
    adam = {p.name for p in c.params if not _is_muon(p)}
    if adam & set(fresh) and not adam <= set(fresh):
        return None
    out = {"fresh_after": c.checkpoint_at, "fresh_params": fresh}
    if _z3_inmem(c) and _has_muon(c):
        out["muon_momentum_lost_after"] = c.checkpoint_at
    return out


def _muon_in_new_scale(c: Case) -> dict | None:
    """DSM-003's model where the tree's code runs Muon on the unscaled gradient after the loss-scale update on
    the case's path (``versions.muon_after_scale_update``, a probe of the source, any ZeRO stage): the gradient
    is divided by the new scale and the update stored times it, so the Muon step is right and the norm counts
    ``O S' / S``; the reported norm as the stage's own step divides it (ZeRO-3 by the new scale). None where
    the code runs Muon before the update (0.19.8: the bug's own model)."""
    if c.stage not in (1, 2, 3) or _bf16_optimizer(c) or not _has_muon(c):
        return None
    if not versions.muon_after_scale_update(c.stage, c.offload != "none"):
        return None
    return {"scale_update_before_unscale": True, "muon_in_new_scale": True,
            "reported_norm": "clip_norm" if c.stage == 3 else "norm"}


def _z3_momentum_tail_past_end(c: Case) -> bool:
    """ZeRO-3 without offload writes a rank's momentum share with ``buffer[:n - r q]`` (stage3.py:1798-1801):
    a rank whose share starts past the end of a Muon matrix (``r q > n`` with ``r q - n < q``) raises. With
    ``q = ceil(n / W)`` the first rank past the end is ``ceil(n / q)``; it exists and starts strictly past
    ``n`` exactly when ``n % q != 0`` and ``ceil(n / q) < W``. Only a step that is not skipped runs Muon. Releases
    that run Muon in the reduce (0.19.0-0.19.7) write the momentum back the same way with offload too
    (measured: z3-cpu-fp32-ws4-emptyshare, 0.19.0-0.19.7, in ``_apply_distributed_muon_update``)."""
    if c.stage != 3 or c.dp_size < 2 or (c.offload != "none" and versions.z3_muon_placement(True) != "reduce"):
        return False
    W = c.dp_size
    for p in c.params:
        if not _is_muon(p):
            continue
        n = math.prod(p.shape)
        q = -(-n // W)
        if n % q and -(-n // q) < W:
            return any(not sk for _, _, sk in scale_plan(c))
    return False


# ------------------------------------------------------------------------------------------------
# the registry

WEIGHTS = frozenset({"momentum", "update", "master", "model", "global_norm"})
# Quantities the oracle computes; the others a bug may name ("swap", "swap-files", "crash") are facts
# about the run that no oracle switch reproduces, so a bug model excuses only those by name.
NUMERIC = frozenset({"grad", "momentum", "update", "master", "model", "global_norm", "muon_calls",
                     "skipped", "loss_scale", "loss_scale_after", "capture"})
SCALER = frozenset({"skipped", "loss_scale", "loss_scale_after"})

BUGS: tuple[Bug, ...] = (
    Bug(
        id="DSM-001",
        releases=measured(yes="0.18.9-0.19.8"),
        title="Muon momentum kept in 16 bit",
        symptom="For fp16/bf16 models the Muon momentum buffer, and the gradient and Nesterov blend fed to "
                "Newton-Schulz, are stored in the model/communication dtype, so every step rounds the "
                "momentum to fp16/bf16 (bf16 drops increments below 2^-9 relative); ZeRO-3 without offload "
                "also rounds the Muon update into the 16-bit gradient partition, ZeRO-3 offload forms g/S in "
                "gradient_accumulation_dtype. Measured (z2-none-bf16-ws2, 3 steps): momentum 4.9e-5 off "
                "(1.98e4x the fp32-storage allowance), master 2.7e-4 off (2.4e3x). Scope: ZeRO-1/2 without "
                "offload (grad_accum_dtype / communication_data_type fp32 do not help) and ZeRO-3 with any "
                "offload; not ZeRO-1/2 cpu/nvme offload (fp32 momentum), not BF16_Optimizer.",
        trigger=lambda c: _half(c) and _has_muon(c) and not _bf16_optimizer(c) and not _fp16_flushed(c) and (
            (c.stage in (1, 2) and c.offload == "none" and not _z1_fp32_accumulated(c))
            or (c.stage == 3 and c.offload == "none"
                and not (_comm(c) == "fp32" and (c.dtype == "fp16" or _gad(c) == "fp32")))
            or (c.stage == 3 and c.offload != "none" and not (_comm(c) == "fp32" and _gad(c) == "fp32"))),
        quantities=WEIGHTS,
        # Without offload the 16-bit buffer holds the loss-scaled momentum (S*M; DSM-004 is what that
        # does across a scale change): in fp16 a true-unit value below 2^-14 would be subnormal, the
        # scaled one is not, so the units decide the rounding even at a constant scale.
        # ZeRO-3 without offload with communication_data_type fp32 but a 16-bit gradient partition is
        # another shape of the bug: the momentum is fp32 (the communication dtype) and Newton-Schulz
        # reads the fp32 gather, but its update is copied back into the gradient partition of
        # gradient_accumulation_dtype (stage3.py:1855-1859) and rounded there before the norm and the
        # step (measured on z3-none-bf16-ws2-comm32: masters ~330x off the intended oracle).
        # Compiled, inductor fuses the two lerps: only the stored momentum is rounded to 16 bit, the
        # Nesterov blend Newton-Schulz reads is not (``Conventions.fused_blend``), so the update is held to
        # the blend's fp32 arithmetic instead of a 16-bit rounding amplified by Newton-Schulz.
        model=lambda c: {"update_store_dtype": _gad(c)} if (c.stage == 3 and c.offload == "none"
                                                            and _comm(c) == "fp32") else
        {"momentum_dtype": "model", **({"momentum_units": "scaled"} if c.offload == "none" else {}),
         **({"fused_blend": True} if c.compiled else {})},
        where="stage_1_and_2.py _muon_momentum_buffer (buffer follows the grad dtype); "
              "stage3.py _create_momentum_buffer (communication_data_type), _apply_muon_to_accumulated_grads "
              "(update copied into the gradient partition), _apply_muon_updates_cpu_offload (gather in "
              "gradient_accumulation_dtype)",
        reproducer="pipeline_case(2, 'none', 'bf16', 2, steps=3); pipeline_case(3, 'cpu', 'fp16', 1, steps=3)",
    ),
    Bug(
        id="DSM-002",
        releases=measured(yes="0.18.9-0.19.8"),
        title="ZeRO-1/2 accept NVMe optimizer offload and silently run CPU offload",
        symptom="offload_optimizer.device=nvme at stage 1/2 never writes to the swap folder; the user "
                "believes the optimizer state is on NVMe.",
        trigger=lambda c: c.offload == "nvme" and c.stage in (1, 2),
        # the refusal sits in DeepSpeedZeroOptimizer.__init__; the BF16_Optimizer route (an nvme device is
        # not the "cpu" that would keep ZeRO-1 bf16 + fp32 accumulation off it) never builds one
        fix_covers=lambda c: not _bf16_optimizer(c),
        quantities=frozenset({"swap"}),
        model=lambda c: {},  # runs as CPU offload: the numbers are the intended ones, only "swap" differs
        where="stage_1_and_2.py __init__ (cpu_offload = device in (cpu, nvme))",
        refused_when_patched="ZeRO stage 1/2 do not implement NVMe optimizer offload",
    ),
    Bug(
        id="DSM-003",
        releases=measured(yes="0.19.0-0.19.8"),
        title="Loss-scale growth applied before unscaling",
        symptom="On a step where the dynamic loss scale grows (S -> 2S), step() updates the scale before it "
                "multiplies the Muon update by S and unscales by S: every Adam gradient is halved, the clip "
                "norm is halved, ZeRO-3 reports half the gradient norm, and on cpu/nvme offload (S*O formed "
                "with the old scale) the Muon step is halved. Measured (z*-fp16-ws1, window 2, growth at step "
                "3): Adam master 9.3e-5 off (588x), offload Muon master 0.013 off (8.5e4x), ZeRO-3 norm 1.83 "
                "vs 3.66 (511x).",
        trigger=lambda c: _grows(c) and not _clip_undoes_growth(c) and (_has_adam(c) or c.offload != "none"
                                                                        or c.stage == 3 or _clip_of(c) > 0),
        quantities=frozenset({"master", "model", "global_norm", "update"}),
        # reported_norm only where it changes (ZeRO-3 reports the clip norm); elsewhere another model's
        # reading of the norm (DSM-016's raw one without ZeRO) stands
        # Without ZeRO, FP16_UnfusedOptimizer unscales every gradient, Muon's too, by the grown scale before
        # the inner step: Muon reads G S / S' (its update unchanged by the scale), Adam G S / S'
        model=lambda c: ({"scale_update_before_unscale": True, "muon_in_new_scale": True} if c.stage == 0 else
                         {"scale_update_before_unscale": True, "muon_update_in_old_scale": c.offload != "none",
                          **({"reported_norm": "clip_norm"} if c.stage == 3 else {})}),
        # Code that runs Muon after the scale update (tree.muon_after_scale_update; DeepSpeed PR #8464's
        # _apply_muon_updates_cpu_offload, after _update_scale in its stage_1_and_2.py step and from
        # _get_norm_groups in its stage3.py step): Muon reads G S / S' and the norm counts O S' / S
        variants=(_muon_in_new_scale,),
        where="stage_1_and_2.py step (_update_scale at :3047 before :3121 and unscale_and_clip_grads); "
              "stage3.py step (_loss_scale_update_and_overflow_cleanup at :2891 before :2915/:2918, "
              "_global_grad_norm = N / new scale at :2897); fp16/unfused_optimizer.py step (_update_scale at "
              ":227 before unscale_and_clip_grads at :228, without ZeRO)",
        reproducer="pipeline_case(st, off, 'fp16', 1, steps=5, loss_scale_window=2)",
    ),
    Bug(
        id="DSM-004",
        releases=measured(yes="0.19.0-0.19.6 0.19.8"),
        title="Non-offload Muon momentum accumulates loss-scaled gradients",
        symptom="Without optimizer offload the momentum holds S*g; after the loss scale changes (growth or "
                "backoff) old and new gradients are blended with weights skewed by S_new/S_old. Measured "
                "(fp16 ws2, overflow at step 2, S 256 -> 128): momentum 0.0196 off at step 3 (4.9e6x); "
                "growth 256 -> 512: 0.029 off at step 4 (3.8e6x).",
        # not stage 0: FP16_UnfusedOptimizer unscales the gradients before MuonWithAuxAdam steps them
        trigger=lambda c: _fp16_dynamic(c) and c.offload == "none" and c.stage != 0 and _has_muon(c)
        and not _bf16_optimizer(c) and _momentum_sees_scale_change(c),
        quantities=WEIGHTS,
        model=lambda c: {"momentum_units": "scaled"},
        where="stage_1_and_2.py get_flat_partition -> muon_update on the scaled gradient; stage3.py "
              "_apply_muon_to_accumulated_grads / _muon_update_sub_group (same)",
        reproducer="pipeline_case(2, 'none', 'fp16', 2, steps=4, hysteresis=1).replace(overflows=(Overflow(2, 1, 0),))",
    ),
    Bug(
        id="DSM-005",
        releases=measured(yes="0.19.8"),
        title="ZeRO-3 offload fp16: S*O formed in fp16 overflows (spurious skip)",
        symptom="ZeRO-3 cpu/nvme offload forms the loss-scaled Muon update S*O in gradient_accumulation_dtype; "
                "in fp16 it is inf as soon as S*max|O| >= 65520, so the norm is invalid, the step is skipped "
                "(with the momentum already advanced) and the scale backs off although no gradient overflowed. "
                "The default 2^16 scale can then never grow. Measured (z3-cpu-fp16-ws1, a (4096, 1) matrix, "
                "S=2^15, max|O|=2.39): step 3 skipped, scale 32768 instead of 65536; z3-none/z2-none with the "
                "same inputs skip nothing.",
        trigger=_z3_offload_fp16_update_overflows,
        quantities=WEIGHTS | SCALER,
        model=lambda c: {"scaled_update_dtype": "model"},
        where="stage3.py _apply_muon_updates_cpu_offload (:2628-2636 gather in gradient_accumulation_dtype, "
              ":2662 scaled_local_update = local_update * loss_scale)",
        reproducer="pipeline_case(3, 'cpu', 'fp16', 1, steps=3, initial_scale_power=14, loss_scale_window=1, "
                   "params=(ParamShape('w.weight', (4096, 1)), ParamShape('b.bias', (4,))))",
    ),
    Bug(
        id="DSM-006",
        releases=measured(yes="0.19.7-0.19.8"),
        title="ZeRO-3 applies the last Muon group's ns_method to every Muon group",
        symptom="Without offload ZeRO-3 keeps one muon_ns_method, overwritten by every Muon param group in "
                "turn, so all Muon sub-groups use the last group's method (momentum differing per group "
                "raises instead). Offload and ZeRO-1/2 honour each group's value.",
        trigger=lambda c: c.stage == 3 and c.offload == "none" and len(_muon_group_ns_methods(c)) > 1,
        quantities=frozenset({"update", "master", "model", "global_norm"}),
        where="stage3.py _create_fp16_partitions_with_defragmentation (:919-933), _muon_update_sub_group (:1758)",
        model=lambda c: {"muon_ns_method": _last_muon_group_ns_method(c)},
        reproducer="cases/patched/test_plain_script.py (two Muon param groups, gram and standard)",
    ),
    Bug(
        id="DSM-007",
        releases=measured(yes="0.19.8"),
        title="ZeRO-3 in-memory Muon momentum not restored by load_checkpoint",
        symptom="With save_muon_momentum_buffer_in_memory the update reads "
                "muon_momentum_buffer_partitioned_groups_flat, while the checkpoint restores "
                "optimizer.state[...]['momentum_buffer'] (a new tensor): the resumed run continues from zero "
                "momentum and then overwrites the restored one. Measured (z3-none-fp32-ws2, save after step 1): "
                "momentum 0.0196 off at step 2 (4.6e6x), update 1.07 off.",
        trigger=lambda c: (c.stage == 3 and c.offload in ("none", "cpu") and _z3_inmem(c) and _has_muon(c)
                           and _resumes(c) and any(not sk for _, _, sk in scale_plan(c)[:c.checkpoint_at])),
        quantities=WEIGHTS,
        # What the resume loses: the Muon momentum, once; the step after the resume starts from zero and
        # the run goes on from the (relinked) buffer it wrote.
        model=lambda c: {"muon_momentum_lost_after": c.checkpoint_at},
        where="stage3.py _rigid_load_state_dict (optimizer.load_state_dict replaces the state tensor; nothing "
              "relinks muon_momentum_buffer_partitioned_groups_flat)",
        reproducer="pipeline_case(3, 'none', 'fp32', 2, steps=3, save_muon_momentum_buffer_in_memory=True)"
                   ".replace(checkpoint_at=1)",
    ),
    Bug(
        id="DSM-008",
        releases=measured(yes="0.19.8"),
        title="ZeRO-1/2 with parameter_alignment drops per-head Muon",
        symptom="The padded branch of get_flat_partition calls muon_update without num_heads, so a per-head "
                "parameter is orthogonalised as one matrix. Measured (z1-none-fp32-ws2, (6,5) with 2 heads "
                "and a (3,3) matrix): update 0.56 off (5.2e6x).",
        trigger=lambda c: (c.stage in (1, 2) and c.offload == "none" and not _bf16_optimizer(c)
                           and _padded_head_group(c)),
        quantities=frozenset({"update", "master", "model", "global_norm"}),
        model=lambda c: {"honor_num_heads": False},
        where="stage_1_and_2.py get_flat_partition (:2756-2760; compare _get_flat_partition_unpadded :2865-2870)",
        reproducer="pipeline_case(1, 'none', 'fp32', 2, steps=2, extra_zero={'parameter_alignment': True}, "
                   "params=(ParamShape('attn.weight', (6, 5), num_heads=2), ParamShape('proj.weight', (3, 3)), "
                   "ParamShape('attn.bias', (6,))))",
    ),
    Bug(
        id="DSM-009",
        releases=measured(yes="0.19.8"),
        title="ZeRO-3 rounds the padded tail of the momentum partition to gradient_accumulation_dtype",
        symptom="When a Muon matrix's element count does not split evenly over the ranks, the rank holding "
                "the tail writes its momentum slice through a buffer of gradient_accumulation_dtype: with "
                "communication_data_type fp32 and a 16-bit model that slice alone is rounded to 16 bit. "
                "Measured (z3-none-fp16-ws2, communication_data_type fp32): layer1.weight (21 elements) "
                "momentum 2.1e-5 off (2.7e3x), layer0.weight (30) exact.",
        trigger=lambda c: (c.stage == 3 and c.offload == "none" and _comm(c) == "fp32" and _gad(c) in ("fp16", "bf16")
                           and _z3_padded_tail(c)),
        quantities=WEIGHTS,
        model=lambda c: {"padded_tail_momentum_dtype": _gad(c)},
        where="stage3.py _muon_update_sub_group (:1805 torch.zeros(chunk_sz, dtype=gradient_accumulation_dtype))",
    ),
    Bug(
        id="DSM-010",
        releases=measured(yes="0.19.8"),
        title="ZeRO-3 NVMe resume restores only the swap files",
        symptom="With offload_optimizer nvme, load_checkpoint skips _load_zero_checkpoint and only copies the "
                "swap files back: sub-groups below the 1 MiB swap threshold keep the fresh engine's masters, "
                "weights and optimizer state, in-memory Muon momentum is lost, and the fp16 loss scaler "
                "restarts. Measured (z3-nvme-fp32-ws2, save after step 1): Adam masters 0.88 off (5.5e6x).",
        trigger=_nvme_resume_loses_state,
        quantities=WEIGHTS | SCALER | frozenset({"grad"}),
        model=_nvme_resume_model,
        where="engine.py load_checkpoint (:4456 'not self.zero_nvme_offload_optimizer()', :4469-4482)",
        reproducer="pipeline_case(3, 'nvme', 'fp32', 2, steps=3).replace(checkpoint_at=1); "
                   "cases/harness/test_capture_reuse.py::test_nvme_resume_restores_in_memory_subgroups",
    ),
    Bug(
        id="DSM-011",
        unmodelled="it is about files left on disk, not a trajectory quantity",
        releases=measured(yes="0.19.8"),
        title="NVMe optimizer swap files left on disk after destroy()",
        symptom="DeepSpeedZeroOptimizer_Stage3.destroy leaves <nvme_path>/zero_stage_3/optimizer/rank<r>/"
                "*.tensor.swp (the size of the swapped optimizer state) behind.",
        trigger=lambda c: False,  # not a trajectory quantity; see reproducer
        # No model: files left on disk are no quantity the oracle computes; the reproducer test checks
        # the swap folder after destroy() directly.
        quantities=frozenset({"swap-files"}),
        where="stage3.py destroy (:539-550) never removes optimizer_swapper.swap_folder",
        reproducer="cases/patched/test_fixes.py::test_nvme_swap_files_removed_by_destroy",
    ),
    Bug(
        id="DSM-012",
        releases=measured(yes="0.18.9-0.19.8"),
        title="4-D (conv) parameters crash muon_update",
        symptom="muon_update reshapes a 4-D update to 2-D for Newton-Schulz, then torch.where broadcasts it "
                "against the 4-D gradient: RuntimeError at the first step, on every ZeRO path.",
        trigger=lambda c: (any(len(p.shape) == 4 and _is_muon(p) for p in c.params)
                           and (c.stage == 3 or not historical.muon_update_returns_2d_for_4d())),
        quantities=frozenset({"crash"}),
        crash=("RuntimeError", "must match the size of tensor", "muon_update"),
        # A 1x1 conv (k x c x 1 x 1): the 2-D update (k, c) broadcasts against the 4-D gradient instead of
        # raising, muon_update returns a (k, c, k, c) tensor, and ZeRO-3 fails copying it back into the
        # gradient (stage3.py _muon_update_sub_group :1760, g.data.copy_(update)). Measured:
        # resnet-z3-none-bf16-ws3-standard, rank 2 (its shortcut conv 16x8x1x1).
        crash_also=(("RuntimeError", "doesn't match the broadcast shape", "_muon_update_sub_group"),
                    # before 0.19.8 ZeRO-3 copies the 2-D update back into the 4-D gradient in the reduce
                    # (0.18.9 resnet-z3-none-fp32-ws2-standard; harness.registry.historical)
                    ("RuntimeError", "doesn't match the broadcast shape", "_apply_distributed_muon_update"),
                    # 0.19.0-0.19.6 with optimizer offload: a 3x3 filter's update against its gradient in the
                    # reduce (z3-cpu-fp32-ws2-conv2d: "size of tensor a (3) must match ... b (18)")
                    ("RuntimeError", "must match the size of tensor", "_apply_distributed_muon_update")),
        where="original_muon.py muon_update (:223-235)",
        reproducer="pipeline_case(2, 'none', 'fp32', 1, params=(ParamShape('conv.weight', (4, 2, 3, 3)), "
                   "ParamShape('conv.bias', (4,))))",
    ),
    Bug(
        id="DSM-013",
        releases=measured(yes="0.19.0-0.19.6 0.19.8"),
        title="BF16_Optimizer route clips raw gradients and reports their norm",
        symptom="bf16 + grad_accum_dtype fp32 + ZeRO-1 runs BF16_Optimizer, which takes the norm over the raw "
                "gradients, clips them before Muon and runs Muon unclipped: the same config means a different "
                "step than on every other path (which clip by the Muon-update norm), and "
                "get_global_grad_norm() is the raw-gradient norm. Measured (z1-none-bf16-ws2-gad32): reported "
                "norm 1.70 vs 3.85; with clip 0.05 the Muon master is 0.029 off (2e5x).",
        trigger=lambda c: _bf16_optimizer(c) and _has_muon(c),
        quantities=frozenset({"global_norm", "grad", "master", "model", "update", "momentum"}),
        # The clip before Muon over the raw gradients, their norm reported. The replay clips with the k
        # DeepSpeed applied (from its reported norm, checked against the oracle's), so Newton-Schulz reads
        # exactly DeepSpeed's 16-bit input (``oracles.step`` ``forced_clip_coef``): a k re-derived from the
        # oracle's norm moved that input by an fp32 ulp and the emulated update by 1e3x its allowance.
        model=lambda c: {"clip_norm_source": "gradient"},
        where="bf16_optimizer.py step (:383-420) and _prepare_muon_updates",
        reproducer="pipeline_case(1, 'none', 'bf16', 2) with data_types.grad_accum_dtype fp32 "
                   "(harness.catalog.matrix.bf16opt_cases)",
    ),
    Bug(
        id="DSM-014",
        releases=measured(yes="0.18.9-0.19.8"),
        title="fp16/bf16 without ZeRO: a warm-up optimizer step at initialize",
        symptom="Stage 0 wraps MuonWithAuxAdam in FP16_UnfusedOptimizer, whose initialize_optimizer_states runs a "
                "real optimizer step on zero gradients: the auxiliary Adam's step count starts at 1, so the first "
                "real step is bias-corrected as step 2 (0.735 lr instead of lr), and Muon's decoupled weight "
                "decay shrinks the fp32 masters once. Measured (z0-none-bf16-ws1): Adam master 2.65e-4 off "
                "(1.7e3x) at step 1.",
        trigger=lambda c: _z0_unfused(c) and (_has_adam(c) or _wd_of(c) > 0),
        quantities=frozenset({"master", "model"}),
        model=lambda c: {"warmup_step_at_init": True},
        where="fp16/unfused_optimizer.py initialize_optimizer_states (:412-433), called from __init__ (:108)",
        reproducer="pipeline_case(0, 'none', 'bf16', 1, steps=3)",
    ),
    Bug(
        id="DSM-015",
        releases=measured(yes="0.18.9-0.19.8"),
        title="fp16 without ZeRO: the loss is never scaled, the gradients are unscaled anyway",
        symptom="engine.backward multiplies the loss by the loss scale only for a ZeROOptimizer (scale_if_loss) or "
                "a torch-autocast scaler; FP16_UnfusedOptimizer is neither, so stage-0 fp16 back-propagates the "
                "raw loss and step() then divides by S: every gradient reaches the optimizer as g/S, the overflow "
                "check and norm see unscaled fp16 gradients. Measured (z0-none-fp16-ws2, S=256): Muon and Adam "
                "gradients 1/256 of the true ones (40x-60x their allowance).",
        trigger=lambda c: c.stage == 0 and c.dtype == "fp16",
        quantities=frozenset({"grad", "global_norm"}),
        model=lambda c: {"backward_loss_scaled": False},
        where="engine.py backward (:3415-3418, scale only for ZeROOptimizer); fp16/unfused_optimizer.py "
              "unscale_and_clip_grads (:243-258)",
        reproducer="pipeline_case(0, 'none', 'fp16', 2, steps=3)",
    ),
    Bug(
        id="DSM-016",
        releases=measured(yes="0.18.9-0.19.8"),
        title="Without ZeRO the reported norm (and the clip) is taken over the raw gradients",
        symptom="Stage 0 in fp16/bf16 (FP16_UnfusedOptimizer) takes the global norm over the raw gradients, "
                "clips them before Muon and reports that norm, like DSM-013 and unlike every ZeRO path (which "
                "take it over the Muon updates): the same config reports a different norm and, with clipping, "
                "takes a different step. Measured (z0-none-bf16-ws2): reported norm 1.92 vs 3.65. fp32 stage 0 "
                "clips the raw gradients too (engine clip_fp32_gradients) and reports no norm.",
        trigger=lambda c: c.stage == 0 and _has_muon(c) and (c.dtype in ("fp16", "bf16") or _clip_of(c) > 0),
        # grad: with a clip that acts, the gradient Muon reads is the clipped one
        quantities=frozenset({"global_norm", "grad"}),
        # The clip before Muon over the raw gradients, and their norm reported as the backward left them
        # (times the loss scale, where the backward was scaled: DSM-015 fixed). fp32 stage 0 reports no
        # norm; the clip is undone with the norm its engine's clip computed (the capture keeps it:
        # ``StepRecord.engine_clip_norm``), judged against the raw-gradient norm.
        model=lambda c: ({"clip_norm_source": "gradient", "reported_norm": "raw"} if c.dtype in ("fp16", "bf16")
                         else {"clip_norm_source": "gradient"}),
        where="fp16/unfused_optimizer.py step (:209-228); engine.py _take_model_step (:3505-3510)",
        # the fix is FP16_UnfusedOptimizer's; fp32 stage 0 clips in the engine (clip_fp32_gradients)
        fix_covers=lambda c: c.dtype in ("fp16", "bf16"),
        reproducer="pipeline_case(0, 'none', 'bf16', 2, steps=3)",
    ),
    Bug(
        id="DSM-017",
        releases=measured(yes="0.19.0-0.19.8"),
        title="ZeRO-3 crashes writing the momentum of a rank whose share starts past a small Muon matrix",
        symptom="Without optimizer offload, a Muon matrix of n elements on W ranks gives each rank q = "
                "ceil(n/W) elements; the momentum write-back slices buffer[:n - r q], which for a rank starting "
                "past the end (r q > n) is a negative bound: 'RuntimeError: The expanded size of the tensor (1) "
                "must match the existing size (0)' on that rank at the first step. Smallest: n = 5 on 4 ranks "
                "(1x5, 5x1); shown by the layout sweep's sweep-z3-none-ws4-L0-ga2 (a 1x5 among 3x1 and 1x1 "
                "matrices). Offload and ZeRO-1/2 are unaffected; world sizes 2 and 3 cannot trigger it.",
        trigger=_z3_momentum_tail_past_end,
        quantities=frozenset({"crash"}),
        where="stage3.py _muon_update_sub_group (:1795-1801, buffer_to_update[:grad.numel() - start_offset])",
        reproducer="pipeline_case(3, 'none', 'fp32', 4, params=(ParamShape('w.weight', (1, 5)),))",
        crash=("RuntimeError", "The expanded size of the tensor", "_muon_update_sub_group"),
        # 0.19.0-0.19.7: the same slice in the reduce's Muon update (z3-none/cpu-fp32-ws4-emptyshare)
        crash_also=(("RuntimeError", "The expanded size of the tensor", "_apply_distributed_muon_update"),),
    ),
    Bug(
        id="DSM-018",
        releases=measured(yes="0.19.8"),
        title="The universal checkpoint converter cannot convert a Muon checkpoint (no resume into another "
              "world size)",
        symptom="python -m deepspeed.checkpoint.ds_to_universal on a ZeRO-1, 2 or 3 checkpoint of a Muon run "
                "fails with KeyError: 'exp_avg': it copies exp_avg, exp_avg_sq and fp32 of every optimizer "
                "param group, and a Muon group's state holds momentum_buffer instead. The universal loader "
                "would read any state file, but no Muon checkpoint gets that far, so a run cannot resume into "
                "another world size with its Muon momentum. (ZeRO-1/2 also need the client to pass "
                "client_state={'universal_checkpoint_info': {}} to save_checkpoint, as Megatron does.)",
        trigger=lambda c: False,  # a case resuming into another world size is refused (Case.resume_world_size)
        quantities=frozenset({"crash"}),
        where="checkpoint/ds_to_universal.py extract_zero_shards (:153-156) and extract_zero_shards_stage3 "
              "(:195-198) index state['exp_avg']; _merge_zero_shards callers iterate ('fp32', 'exp_avg', "
              "'exp_avg_sq') only (:381, :547)",
        reproducer="cases/pipelines/test_universal.py::test_universal_checkpoint_cannot_convert_muon",
        crash=("KeyError", "'exp_avg'", "extract_zero_shards"),
    ),
    Bug(
        id="DSM-019",
        releases=measured(yes="0.19.8"),
        title="ZeRO-2 + bf16 + grad_accum_dtype fp32 at one rank: the auxiliary Adam's parameters never "
              "receive their gradient",
        symptom="With one data-parallel rank, every non-Muon parameter (biases, norms, embeddings) reaches "
                "the optimizer with a zero gradient, so Adam never moves it; the Muon matrices train. "
                "safe_get_full_grad returns the same zeros. Measured by the --full gate's gradient check "
                "(z2-none-bf16-ws1-knob-gad32: layer0.bias grad 0 vs 0.788, 19.7x its allowance); by hand, "
                "a Linear(5, 6) bias moved 0.0 in one step (0.02 without grad_accum_dtype). Two or three "
                "ranks, CPU offload or not, train normally; the patched runtime does not fix it.",
        trigger=lambda c: (c.stage == 2 and c.dtype == "bf16" and _gad(c) == "fp32" and c.dp_size == 1
                           and any(not _is_muon(p) for p in c.params)),
        quantities=frozenset({"grad"}),
        where="stage_1_and_2.py (separate fp32 gradient accumulation, use_separate_grad_accum, at a "
              "data-parallel world of 1): the non-Muon gradient partitions the step and the tensor_fragment "
              "helpers read stay zero; the exact line is not located",
        reproducer="python -m harness gate --full --only z2-none-bf16-ws1-knob-gad32",
        model=lambda c: {"adam_grads_lost": True},
    ),
    Bug(
        id="DSM-020",
        releases=measured(yes="0.19.8"),
        title="Without ZeRO (stage 0) per-head Muon is dropped",
        symptom="MuonWithAuxAdam.step calls muon_update without num_heads, so a parameter tagged per-head "
                "(muon_num_heads) is orthogonalised as one matrix on the non-ZeRO path, in every dtype; "
                "ZeRO-1/2/3 pass it. Measured on "
                "z0-none-fp32-ws2-heads (update 0.675 off against 8.7e-08 allowed).",
        trigger=lambda c: c.stage == 0 and _per_head(c),
        quantities=frozenset({"update", "master", "model", "global_norm"}),
        model=lambda c: {"honor_num_heads": False},
        where="zero/muon/muon_optimizer.py MuonWithAuxAdam.step (:78-82: muon_update(grad, momentum, beta=..., "
              "ns_method=...) with no num_heads)",
        reproducer="python -m harness gate --only z0-none-fp32-ws2-heads",
    ),
    Bug(
        id="DSM-021",
        unmodelled="it shows only in the gradient muon_update receives, and where the misplaced elements at "
                   "the tail come from is not derived yet: it excuses that one quantity",
        releases=measured(yes="0.19.8"),
        title="ZeRO-3 NVMe: a swapped Muon matrix that is not first in its sub-group is orthogonalised "
              "from a misplaced gradient",
        symptom="With optimizer offload to NVMe, muon_update receives the gradient of a large Muon matrix "
                "(its partition at least the 1 MiB swap threshold) shifted by the elements of the "
                "parameters sorted ahead of it in the swapped sub-group (DeepSpeed orders a Muon group by "
                "p.size(), descending, so a 4x65536 matrix comes after 7x3 and 6x5 ones). Measured "
                "(z3-nvme-part-fp32-ws1-sortedlast): the gradient DeepSpeed hands muon_update is the true "
                "one moved by 51 elements (their total size), 1.5e4x its allowance; without the harness's "
                "capture, the same run's weights after two steps differ from CPU offload's by 8.4e-4 in "
                "that matrix and are bit-identical with an 8x32768 matrix (sorted first).",
        trigger=lambda c: c.dtype in ("fp32", "fp16") and nvme.swapped_muon_matrix_not_first(c),
        # Teacher forcing feeds the oracle DeepSpeed's own (misplaced) gradient, so the update, momentum
        # and weights agree with it; the gradient check is where the bug shows. Not modelled yet (which
        # elements land where, and what fills the tail, is not derived): excused by quantity.
        quantities=frozenset({"grad"}),
        where="swap_tensor/partitioned_optimizer_swapper.py _swap_in_pinned_gradients (:195) and "
              "optimizer_utils.py get_swap_gradient_buffers (:125, the pipelined swapper): each swapped gradient is "
              "read into parameter.grad.narrow(0, offset, length), a view into a handle-locked buffer, and written "
              "back from it (_writeback_gradients); on this CPU build an aio read into, or write from, such a view "
              "at a nonzero offset moves nothing (measured standalone; at offset 0, or with a plain tensor, it "
              "works). After the swap-in the region holds what the pooled buffer held (the gradient as the "
              "swap-out staged it, from offset 0); the Muon update written back never reaches the file",
        reproducer="python -m harness gate --only z3-nvme-part-fp32-ws1-sortedlast",
        # Muon in the step reads the swapped-in gradient; with Muon in the reduce it is DSM-123
        present=lambda c: historical.swap_reads_views(c) and versions.z3_muon_placement(True) == "step",
    ),
    Bug(
        id="DSM-022",
        unmodelled="the same misplaced read in the Adam sub-group; it excuses the gradient and the norm over "
                   "it",
        releases=measured(yes="0.19.4-0.19.8"),
        title="ZeRO-3 NVMe: a swapped Adam parameter that is not first in its sub-group steps on a wrong "
              "gradient",
        symptom="DSM-021's mechanism in the auxiliary Adam's sub-group: a parameter whose partition reaches the "
                "1 MiB swap threshold behind smaller ones (an embedding-sized vector after the biases, model "
                "order) gets a gradient that is not its own: measured (z3-nvme-part-fp32-ws1-bigadam) 2.13 "
                "where the gradient is 2.1e-5, 262142 of 262144 elements, from step 1; the reported norm is "
                "taken over it (3.8 against 5.3). Adam then steps on it, so every embedding on NVMe that is "
                "not first in its sub-group trains on garbage. The case is the one that kills a swapper mutant "
                "(a buffer count off by one for three tensors).",
        trigger=lambda c: c.dtype in ("fp32", "fp16") and nvme.swapped_adam_param_not_first(c),
        # Teacher forcing feeds the oracle DeepSpeed's own gradient, so Adam's moments and the weights agree
        # with it; the gradient and the norm over it are where the bug shows. Not modelled: excused by quantity.
        quantities=frozenset({"grad", "global_norm"}),
        where="the same reads as DSM-021 (swap_tensor/partitioned_optimizer_swapper.py _swap_in_pinned_gradients "
              ":195): the swapped gradient read into parameter.grad.narrow(0, offset, length) at a nonzero offset "
              "moves nothing on this CPU build",
        reproducer="python -m harness gate --only z3-nvme-part-fp32-ws1-bigadam",
        present=historical.swap_reads_views,
    ),
    Bug(
        id="DSM-024",
        unmodelled="the same read on the pipelined swapper's prefetch, where Adam steps on the pooled "
                   "buffer's content (zeros at the first step, not derived after): it excuses the masters "
                   "and weights",
        releases=measured(yes="0.19.8"),
        title="ZeRO-3 NVMe, pipelined swapper prefetching: a swapped Adam parameter that is not first in its "
              "sub-group steps on a gradient it was never given",
        symptom="DSM-022's read with a second swapped sub-group on the pipelined swapper, as every real model "
                "on NVMe has: while one sub-group steps the swapper prefetches the next one's state, and the Adam "
                "parameter behind smaller ones in its sub-group (an embedding after the biases) then steps on "
                "neither its gradient nor DSM-022's wrong one. Measured "
                "(z3-nvme-pipe-fp32-ws1-bigadam: a swapped Muon matrix beside the Adam sub-group): every element "
                "of the 262144-element vector unchanged after the first step, and moved by Adam's step size with "
                "the wrong sign on part of it after the next; with the Adam sub-group swapped alone (nothing "
                "prefetched) the same case shows DSM-022 only, its weights following the gradient read. The "
                "case is the one that runs the pipelined swapper's prefetch.",
        trigger=lambda c: c.dtype in ("fp32", "fp16") and nvme.prefetches_swapped_adam(c)
        and nvme.swapped_adam_param_not_first(c),
        # Not modelled: measured, the first step reads zeros (no move) and later ones a gradient that is neither
        # zero nor the one the capture reads (the move has Adam's size, its sign differs by element), which is
        # the pooled buffer's content and not derived. Excused by quantity, with DSM-022 for the gradient.
        quantities=frozenset({"master", "model"}),
        where="the same reads as DSM-021 (a swapped gradient read into a view of a locked buffer at a nonzero "
              "offset moves nothing on this CPU build); with a prefetched sub-group the region Adam reads holds "
              "zeros rather than the staged gradient the capture sees (pipelined_optimizer_swapper.py "
              "swap_in_optimizer_state, its asynchronous swap-in)",
        reproducer="python -m harness gate --only z3-nvme-pipe-fp32-ws1-bigadam",
        present=historical.swap_reads_views,
    ),
    Bug(
        id="DSM-023",
        releases=measured(yes="0.19.4 0.19.7-0.19.8"),
        title="ZeRO-3, and ZeRO-1/2 with CPU offload: a parameter with no gradient in a step is stepped on "
              "the previous step's gradient buffer",
        symptom="A parameter the forward leaves out of one step (a skipped layer, an expert no token chose) "
                "must step on a zero gradient, as stage 0 (MuonWithAuxAdam fills zeros) and ZeRO-1/2 "
                "without offload do. Here it steps on whatever its gradient buffer still holds: an Adam "
                "parameter on the previous step's gradient again, bit for bit; a Muon matrix on the previous "
                "step's update (Newton-Schulz wrote it over the gradient), which Muon then folds into its "
                "momentum and orthogonalises a second time. The reported norm is taken over them. Measured "
                "(z1-cpu-fp32-ws2-skiplayer, a layer unused at step 2): the bias's gradient 0.488 where it "
                "is 0, the norm 3.62 against 3.73; the same on ZeRO-2 offload, ZeRO-3 with and without "
                "offload (NVMe too), and with managed_gradient_accumulation false. The "
                "-skiplayer cases are those that kill the source mutants of the unused-parameter branches.",
        trigger=lambda c: (any(k > 1 for _, k in c.unused)
                           and (c.stage == 3 or (c.stage in (1, 2) and c.offload != "none"))),
        quantities=frozenset({"grad", "global_norm"}),
        # fp32/bf16: the buffers hold true units. fp16 (what a loss-scaled buffer holds) is not derived.
        # The norm: ZeRO-3 without offload counts the stale gradient; the offload paths leave an unused Adam
        # parameter's term out (its norm is recorded only by its own reduction) and count a Muon matrix's new
        # update, as for any matrix (measured: 3.6218 = the norm without the bias's term, to 7 digits).
        model=lambda c: ({"stale_unused_grads": "norm-counts" if c.offload == "none" else "norm-drops-adam"}
                         if c.dtype != "fp16" else None),
        where="stage_1_and_2.py: with offload the fp32 CPU gradient partition of a parameter is written only by "
              "its own reduction (the copy in the reduce path, :2160-2175, or the unmanaged finalize, :1094-1108, "
              "which skips a parameter not in _offload_accumulated_param_ids); nothing zeroes it for a parameter "
              "without a gradient. stage3.py: the same for the gradient partition, into which the Muon update "
              "is written (_apply_muon_to_accumulated_grads)",
        fix_covers=lambda c: c.offload != "nvme",  # harness/fixes/stale.py: why NVMe is left alone
        reproducer="python -m harness gate --only skiplayer",
    ),
    Bug(
        id="DSM-025",
        releases=measured(yes="0.19.8"),
        title="ZeRO-3 bf16: a non-finite gradient reaches Muon, whose momentum advances on the skipped step",
        symptom="bf16.check_grad_overflow (documented default true) promises a non-finite gradient is "
                "detected before the optimizer step and the step skipped. ZeRO-3 tests the raw gradients "
                "for fp16 only, so in bf16 Muon runs on the step first: the momentum of every matrix whose "
                "gradient is finite advances (muon_update keeps a poisoned matrix's own), and only the "
                "invalid-norm test skips the step. Measured (z3-none-bf16-ws2-ga2-ovfloc-adaminf, one Adam "
                "vector's gradient inf on rank 1, micro-step 1 of step 2): the clean layer1.weight momentum "
                "0.0393 where it must stay 0.0187 (all 21 elements), layer0.weight all 30; weights and Adam "
                "state unchanged, as on a correct skip. ZeRO-1/2 (given the setting) skip before Muon.",
        # an overflow everywhere leaves no matrix for Muon to advance (muon_update keeps a poisoned one's)
        # fp32 too: no loss scaler, so the same fp16-only test lets the gradient through (measured:
        # ZeRO-3 fp32, one Muon matrix's gradient inf, the clean layer1.weight's momentum advanced)
        trigger=lambda c: c.stage == 3 and c.dtype in ("bf16", "fp32") and _has_muon(c)
        and c.overflow_leaves_muon_clean,
        quantities=WEIGHTS | frozenset({"skipped"}),
        model=lambda c: {"skip_on_nonfinite": "fp16_only", "momentum_committed_on_invalid_norm": True},
        where="stage3.py _overflow_check_and_loss_scale_update (check_overflow only when self.dtype is "
              "float16; engine.py _configure_zero_optimizer passes check_grad_overflow to ZeRO-1/2 only), then "
              "step: _apply_muon_to_accumulated_grads writes the momentum before is_invalid_grad_norm skips",
        fix_covers=lambda c: c.dtype == "bf16",  # the bundled fix tests bf16 gradients only
        reproducer="python -m harness gate --only z3-none-bf16-ws2-ga2-ovfloc-adaminf",
    ),
    Bug(
        id="DSM-026",
        releases=measured(yes="0.19.8"),
        title="fp16 without ZeRO ignores hysteresis: every overflow halves the loss scale",
        symptom="fp16.hysteresis (documented default 2) lets a first overflow skip the step without halving "
                "the scale. Without ZeRO the engine wraps Muon in FP16_UnfusedOptimizer, whose loss-scale "
                "config keeps no hysteresis, so every overflow halves the scale (consecutive_hysteresis is "
                "not read either). Measured (z0-none-fp16-ws2-ga2-ovfloc-adaminf-hdefault, hysteresis left "
                "out, one overflow at step 2): scale 128 after step 2 where it must stay 256, and with "
                "DSM-015's unscaled backward the reported norm of step 3 halves (222 against 444). ZeRO-1/2/3 "
                "honour it (DynamicLossScaler).",
        trigger=lambda c: (c.stage == 0 and _fp16_dynamic(c) and c.ds.fp16.hysteresis > 1
                           and _poisoned(c)),
        quantities=WEIGHTS | SCALER | frozenset({"grad"}),
        model=lambda c: {"loss_scaler_hysteresis": 1},
        where="fp16/loss_scaler.py LossScaleConfig (no delayed_shift kept from dynamic_loss_args); "
              "fp16/unfused_optimizer.py _update_scale (halves on every skip)",
        reproducer="python -m harness gate --full --only z0-none-fp16-ws2-ga2-ovfloc-adaminf-hdefault",
    ),
    Bug(
        id="DSM-028",
        releases=measured(yes="0.19.8"),
        title="ZeRO-1/2 with optimizer offload in fp32: Muon's momentum advances on a step skipped for a "
              "non-finite gradient",
        symptom="DSM-025's mechanism on the ZeRO-1/2 offload path: in fp32 no test looks at the gradients "
                "before the step (check_grad_overflow is False unless fp16/bf16), and "
                "_apply_muon_updates_cpu_offload runs Muon and writes each matrix's momentum into the optimizer "
                "state before the invalid-norm test skips the step; the path without offload stages the "
                "momentum and commits it only on a step that survives. Measured (z1-cpu-fp32-ws3-pair-033, a "
                "NaN in the Adam vector layer0.bias on rank 2 at steps 2 and 3): the clean layer0.weight "
                "momentum 1.554 where it must stay 1.192 (all 5 elements) after step 2; weights unchanged, as "
                "on a correct skip.",
        trigger=lambda c: (c.stage in (1, 2) and c.offload != "none" and c.dtype == "fp32" and _has_muon(c)
                           and c.overflow_leaves_muon_clean),
        quantities=WEIGHTS | frozenset({"skipped"}),
        model=lambda c: {"skip_on_nonfinite": "fp16_only", "momentum_committed_on_invalid_norm": True},
        where="stage_1_and_2.py step (check_overflow only under check_grad_overflow) and "
              "_apply_muon_updates_cpu_offload (momentum.narrow(...).copy_ before the norm test)",
        reproducer="python -m harness gate --only z1-cpu-fp32-ws3-pair-033",
    ),
    Bug(
        id="DSM-029",
        releases=measured(yes="0.19.8"),
        title="ZeRO-1/2 offload, 16-bit model, fp32 gradient accumulation: a skipped step's Adam gradients "
              "are added to the next step's",
        symptom="With the optimizer offloaded, a fp16/bf16 model and data_types.grad_accum_dtype fp32, a step "
                "skipped for a non-finite gradient leaves the auxiliary Adam's accumulated gradients in place: "
                "the next applied step reads their sum with its own. Muon's matrices are unaffected. Measured "
                "(z2-cpu-bf16-ws3-pair-021, an inf in layer0.weight on rank 2 at step 2): layer0.bias's "
                "gradient at step 3 is 1.0762 where it must be 0.3379, exactly step 2's 0.7383 plus step 3's; "
                "the same at ZeRO-1 and with fp16, not without offload or without grad_accum_dtype fp32.",
        trigger=lambda c: (c.stage in (1, 2) and c.offload != "none" and c.dtype in ("fp16", "bf16")
                           and _gad(c) == "fp32" and _has_adam(c) and not _bf16_optimizer(c)
                           and any(sk for _, _, sk in scale_plan(c)[:-1])),
        quantities=WEIGHTS | frozenset({"grad"}),
        model=lambda c: {"adam_grads_kept_on_skip": True},
        where="stage_1_and_2.py step's overflow branch (reset_cpu_buffers / averaged_gradients) with the fp32 "
              "accumulation buffer of the offload path",
        reproducer="python -m harness gate --only z2-cpu-bf16-ws3-pair-021",
    ),
    Bug(
        id="DSM-030",
        releases=measured(yes="0.19.8"),
        title="The BF16_Optimizer route drops per-head Muon",
        symptom="bf16 + grad_accum_dtype fp32 + ZeRO-1 runs BF16_Optimizer, whose _prepare_muon_updates calls "
                "muon_update without num_heads: a parameter tagged per-head (muon_num_heads) is orthogonalised "
                "as one matrix, as on stage 0 (DSM-020); the ZeRO optimizers pass it. Measured "
                "(a ZeRO-1 bf16 row of the triples, attn.qkv.weight 12x5 in 3 heads): its update 0.129 where the "
                "per-head one is -0.428, all 60 elements.",
        trigger=lambda c: _bf16_optimizer(c) and _per_head(c),
        quantities=frozenset({"update", "master", "model", "global_norm"}),
        model=lambda c: {"honor_num_heads": False},
        where="bf16_optimizer.py _prepare_muon_updates (:486-489: muon_update(..., beta=..., ns_method=...) "
              "with no num_heads)",
        reproducer="python -m harness gate --full --only z1-nvme-bf16-ws1-triple-075",
    ),
    Bug(
        id="DSM-027",
        releases=measured(yes="0.19.8"),
        title="fp32 where no norm is taken (no ZeRO, or ZeRO-1/2 with compute_grad_norm false) applies a "
              "non-finite gradient: the weights become inf/NaN",
        symptom="In fp32 nothing tests the gradients for inf/NaN (engine.py passes check_grad_overflow=False "
                "to ZeRO-1/2 unless fp16/bf16); only the invalid-norm test skips such a step. Where no norm is "
                "taken, nothing does: without ZeRO no loss scaler or test stands between the backward and "
                "MuonWithAuxAdam, and ZeRO-1/2 with compute_grad_norm false (documented only as 'disable when "
                "clipping is off and get_global_grad_norm() is not used') skip the norm and with it the test. "
                "A single non-finite element is stepped into the weights, and ZeRO-1/2 commit the clean Muon "
                "matrices' momentum. Measured (one inf on rank 3 at step 2): z0-cpu-fp32-ws4-pair-028, "
                "layer0.weight inf and layer0.bias NaN after step 2; z1-none-fp32-ws4-pair-040, layer0.weight "
                "NaN and the clean layer1.weight momentum 0.0600 where it must stay 0.0357. Every step must "
                "be skipped.",
        trigger=lambda c: (c.dtype == "fp32" and _has_muon(c) and (c.stage == 0 or c.ds.zero.compute_grad_norm is
                                                                    False and c.stage in (1, 2))
                           and _poisoned(c)),
        # lr: the scheduler advances on the step the intended oracle skips, so every later lr is one step on;
        # grad: with a clip, clip_grad_norm_'s coefficient of an infinite norm is 0, and 0 x inf turns every
        # gradient Muon reads NaN
        quantities=WEIGHTS | frozenset({"skipped", "lr", "grad"}),
        unmodelled="the step writes inf/NaN into the weights; which non-finite values Newton-Schulz makes of an "
                   "inf matrix (DeepSpeed's kernels give -inf where a float64 iteration gives NaN) is no "
                   "reference worth modelling, so the case is excused by quantity",
        where="engine.py _configure_zero_optimizer (check_grad_overflow False in fp32) and _take_model_step (no "
              "test without ZeRO); stage_1_and_2.py step (the invalid-norm test only under compute_grad_norm)",
        reproducer="python -m harness gate --only z1-none-fp32-ws4-pair-040",
    ),
)


def _muon_group_ns_methods(c: Case) -> set:
    """The ns_method of each user param group holding a Muon parameter (its own, else the config's)."""
    default = c.ds.optimizer.muon.ns_method
    return {g.ns_method or default for g in getattr(c, "groups", ())
            if any(_is_muon(p) for p in c.params if p.name in g.params)}


def _last_muon_group_ns_method(c: Case) -> str:
    """The ns_method of the last user param group holding a Muon parameter: the one ZeRO-3 keeps."""
    default = c.ds.optimizer.muon.ns_method
    last = [g.ns_method or default for g in c.groups if any(_is_muon(p) for p in c.params if p.name in g.params)]
    return last[-1]


def _z0_unfused(c: Case) -> bool:
    """Stage 0 in fp16/bf16: the engine wraps Muon in FP16_UnfusedOptimizer (engine.py:2360-2362, 2599)."""
    return c.stage == 0 and c.dtype in ("fp16", "bf16")


def _wd_of(c: Case) -> float:
    return c.ds.optimizer.muon.weight_decay


def _clip_of(c: Case) -> float:
    return c.ds.gradient_clipping

BY_ID = {b.id: b for b in BUGS}

# Bugs of releases older than 0.19.8 (harness/registry/historical.py), excused only where measured
# (their ``releases``); kept out of BUGS, which is the 0.19.8 registry.
HISTORICAL: tuple[Bug, ...] = tuple(Bug(**spec) for spec in historical.SPECS)

# bug id -> {release: affected?}, every registered bug's ``releases``
AFFECTED: dict[str, dict[str, bool]] = {b.id: dict(b.releases) for b in BUGS + HISTORICAL}


def excuses(bug_id: str, release: str | None = None) -> bool:
    """Whether bug ``bug_id`` may excuse a divergence on ``release`` (default: the installed one):
    only when a gate run on that release measured it there. On an unseen release nothing is excused."""
    if release is None and os.environ.get("MUON_HARNESS_MEASURE") == "1":
        # Measuring a release: every registered bug is a candidate, so the gate says which ones show
        # (xfailed with the id: present and as modelled; xpassed: expected and absent). A crash bug found
        # not to crash is set aside for the case's re-judgement (MUON_HARNESS_MEASURE_EXCLUDE, set by
        # harness.cli.measure_release), so the other candidates, numerical ones too, still judge it.
        return bug_id not in os.environ.get("MUON_HARNESS_MEASURE_EXCLUDE", "").split(",")
    release = release if release is not None else versions.judged_as()
    if release is None:
        return False
    return AFFECTED.get(bug_id, {}).get(release, False)


def unmeasured(b: Bug) -> bool:
    """Whether no gate run measured bug ``b`` on the tree under test (an unseen release, a source checkout:
    nothing is known of it there, so its model may be tried and its source signature may count)."""
    if os.environ.get("MUON_HARNESS_MEASURE") == "1":
        return False
    release = versions.judged_as()
    return release is None or release not in b.releases


def _expected(b: Bug, case: Case) -> bool:
    """Measured on the tree and triggered, or (unmeasured) triggered and shown by the tree's source
    (``Bug.present``, read only for a case the trigger selects: a probe the tree cannot answer then makes only
    those cases "cannot judge")."""
    if excuses(b.id):
        return b.trigger(case)
    return b.present is not None and unmeasured(b) and b.trigger(case) and b.present(case)


def bugs_for(case: Case, *, patched: bool = False) -> list[Bug]:
    """The bugs a case is expected to hit; with ``patched``, only those the patched runtime can't fix."""
    # as measured on the installed release (``excuses``), or shown by the tree's source where unmeasured
    # (``Bug.present``); older releases' own bugs too. A config DeepSpeed refuses reaches none of them.
    if refusals.expected(case):
        return []
    return _reachable([b for b in BUGS + HISTORICAL if _expected(b, case)], case, patched)


def candidates_for(case: Case, *, patched: bool = False) -> list[Bug]:
    """Bugs to try on a case that diverges, beyond those expected: every bug with a model for the case or a
    crash signature, on a tree where it was not measured. One is named only where its model (or its exact
    crash) matches at full strength; a bug measured absent on the tree is never tried."""
    expected = {b.id for b in bugs_for(case, patched=patched)}
    return _reachable([b for b in BUGS + HISTORICAL if b.id not in expected and unmeasured(b) and b.trigger(case)
                       and (b.crash is not None or (b.model is not None and b.model(case) is not None))],
                      case, patched)


def _reachable(hits: list[Bug], case: Case, patched: bool) -> list[Bug]:
    """Drop bugs whose code the case cannot reach given the others, and (patched) those the runtime fixes."""
    unreached = {f for b in hits for f in historical.SKIPPED_FRAMES.get(b.id, ())}
    hits = [b for b in hits if not (b.crash and b.crash[2] in unreached)]
    if any(b.id in historical.NO_MUON_GROUP for b in hits):
        hits = [b for b in hits if b.id not in historical.IN_MUON_CODE]
    if patched:
        from harness import fixes

        fixed = set(fixes.fix_names())
        hits = [b for b in hits if not set(b.fixed_by) & fixed
                or (b.fix_covers is not None and not b.fix_covers(case))]
    return hits


def refusals_for(case: Case) -> list[Bug]:
    """Bugs whose patched fix refuses this case (with the text each refusal must carry)."""

    fixed = set(fixes.fix_names())
    return [b for b in BUGS if b.refused_when_patched and set(b.fixed_by) & fixed and b.trigger(case)
            and (b.fix_covers is None or b.fix_covers(case))]
