"""The oracle side of a model case: exact gradients by float64 autograd, buffers, parameter groups.

For a real module there is no closed-form gradient. The gradient DeepSpeed averaged is judged
against float64 autograd of a float64 copy of the same module, loaded with DeepSpeed's own model
weights of that step (teacher forcing, as for the synthetic model) and BatchNorm-style buffers as
that rank held them before the step, on the same micro-batches rounded to the model dtype. The
optimizer step itself is judged by the existing oracle on DeepSpeed's own averaged gradient.

Gradient allowance. The half-precision (or fp32) forward and backward through a deep module rounds
far more than the synthetic model's four intermediates, and that error has no closed-form bound
here. It is measured, per case and step, by running the SAME module in the model dtype with plain
torch (no DeepSpeed) on the same micro-batches at the same weights: ``e_p = max over (rank, micro)
of max|g_lp - g_64|`` for parameter ``p``. DeepSpeed's backward is the same sequence of kernels in the
same dtype, so its error is another draw of the same size; the average over W*GAS micro-batches is
no larger than the worst one. The allowance adds ``2 e_p`` (two draws: DeepSpeed's and the one
measured) to the reduction allowance the synthetic model uses (``oracles.allowances``, grad). A
mis-averaged, mis-scaled or missing micro-batch gradient is a whole-gradient error, orders of
magnitude above ``e_p`` (``cases/models/test_model_oracle.py`` shows one is caught).

Buffers (BatchNorm running statistics, rotary tables, counters) are compared per rank after every
step with the same construction: ``2 |b_lp - b_64| + 2 u_lp |b_64|`` (one storage rounding of the
buffer in the model dtype on each side); integer buffers exactly.

Parameter groups: DeepSpeed splits every incoming group into its Muon and Adam halves and resolves
each half's settings config-first, then ``muon_lr`` / ``adam_lr``, then the group's own values
(``engine.py`` ``_muon_param_groups``). The step oracle has one setting per half, so a model's
groups must give all Muon parameters one setting and all Adam parameters one; anything else is
refused here rather than judged wrongly.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

import oracles
from harness import models
from harness.case.synthetic import MODEL_DTYPES

GROUP_KEYS = {"lr", "weight_decay"}


def with_param_groups(case, sc: oracles.StepConfig) -> oracles.StepConfig:
    """The step config with the model's parameter-group overrides applied per Muon/Adam half."""
    spec = models.build_spec(case.model, case.seed)
    if not spec.param_groups:
        return sc
    muon = {p.name for p in sc.params if p.use_muon}
    per_half: dict[bool, dict[str, set]] = {True: {}, False: {}}
    grouped = set()
    for g in spec.param_groups:
        settings = dict(g.settings)
        unknown = set(settings) - GROUP_KEYS
        if unknown:
            raise ValueError(f"model {case.model!r}: parameter-group settings {sorted(unknown)} are not modelled "
                             f"by the oracle (only {sorted(GROUP_KEYS)})")
        grouped.update(g.names)
        for n in g.names:
            for k, v in settings.items():
                per_half[n in muon].setdefault(k, set()).add(float(v))
    ungrouped = {p.name for p in sc.params} - grouped
    for n in ungrouped:  # DeepSpeed puts them in a group of their own with the config's settings
        for k in GROUP_KEYS:
            per_half[n in muon].setdefault(k, set()).add(None)
    changes = {}
    for is_muon, settings in per_half.items():
        for k, values in settings.items():
            if len(values) != 1:
                raise ValueError(f"model {case.model!r}: the {'Muon' if is_muon else 'Adam'} parameters get "
                                 f"different {k!r} values {sorted(map(str, values))}; the oracle has one per half")
            v = next(iter(values))
            if v is None:
                continue
            if k == "lr":
                changes["muon_lr" if is_muon else "adam_lr"] = v
            elif is_muon:
                changes["weight_decay"] = v
            else:
                changes["adam_weight_decay"] = v
    if "weight_decay" in changes and "adam_weight_decay" not in changes:
        changes["adam_weight_decay"] = sc.weight_decay if sc.adam_weight_decay is None else sc.adam_weight_decay
    return replace(sc, **changes)


def _load(module: torch.nn.Module, weights: dict, buffers: dict) -> None:
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(weights[n].to(p.dtype))
        for n, b in module.named_buffers():
            b.copy_(torch.as_tensor(np.asarray(buffers[n])).to(b.dtype))


def _model_dtype_copy(module: torch.nn.Module, dtype: torch.dtype, zero_init: bool) -> torch.nn.Module:
    """The module as DeepSpeed holds it: parameters in the model dtype; floating buffers stay fp32
    (``engine.py`` ``_cast_module_mixed_precision`` casts parameters only) except under
    ``zero.Init``, whose patched tensor constructors create them in the model dtype."""
    for p in module.parameters():
        p.data = p.data.to(dtype)
    if zero_init:
        for b in module.buffers():
            if b.is_floating_point():
                b.data = b.data.to(dtype)
    return module.train()


def float64_gradients(m64: torch.nn.Module, names: list[str], b64: dict, extra) -> dict[str, torch.Tensor]:
    """The float64 gradient of one unscaled micro-batch loss of ``m64`` (at its current weights) on the
    micro-batch ``b64`` (rounded to the model dtype, then promoted); a parameter the loss does not reach
    gets DeepSpeed's zero gradient."""
    p64 = dict(m64.named_parameters())
    loss = models.loss_of(m64(**b64, **extra(b64, torch.float64)))
    g64 = torch.autograd.grad(loss, [p64[n] for n in names], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p64[n])).detach() for n, g in zip(names, g64)}


def free_gradients(case):
    """(initial weights, ``grads(weights, step)``) of the case's own module, free of DeepSpeed: the module's
    float32 initial weights in float64, and at given weights the float64 gradient of every (rank, micro)
    batch as ``grads[rank][micro][name]``. For what must be known before any rank runs (a registry trigger
    replaying the oracle); the buffers are the float64 copy's own as it runs, since none is captured yet."""
    spec = models.build_spec(case.model, case.seed)
    m64 = spec.module.to(torch.float64).train()
    names = [p.name for p in case.params]
    extra = spec.oracle_inputs or (lambda batch, dtype: {})
    lp = MODEL_DTYPES[case.dtype]
    init = {n: p.detach().clone() for n, p in m64.named_parameters()}

    def grads(weights: dict, step: int) -> list:
        with torch.no_grad():
            for n, p in m64.named_parameters():
                p.copy_(weights[n])
        return [[float64_gradients(m64, names, models.batch_in(models.batch_in(spec.batch(r, step, mu), lp),
                                                                 torch.float64), extra)
                 for mu in range(case.grad_accum)] for r in range(case.world_size)]
    return init, grads


class ModuleOracle:
    """One per judged case: a float64 copy and a model-dtype copy of the case's module."""

    def __init__(self, case, traj):
        self.case, self.traj = case, traj
        self.lp_dtype = MODEL_DTYPES[case.dtype]
        spec = models.build_spec(case.model, case.seed)
        self.batch = spec.batch
        self.extra = spec.oracle_inputs or (lambda batch, dtype: {})
        self.m64 = spec.module.to(torch.float64).train()
        self.mlp = _model_dtype_copy(models.build_spec(case.model, case.seed).module, self.lp_dtype, case.zero_init)
        self.names = [p.name for p in case.params]
        self.grad_err: dict[str, float] = {}
        self.expected_buffers: list[dict] = []
        self.buffer_err: list[dict] = []
        self._memo: dict[tuple, tuple] = {}  # (step, scale) -> what ``gradients`` computed
        if not traj.initial_buffers and any(True for _ in self.m64.buffers()):
            raise RuntimeError(f"{case.name}: the trajectory holds no buffers although the module has some")

    def _buffers_before(self, step: int, rank: int) -> dict:
        if step == 1:
            return self.traj.initial_buffers[rank] if self.traj.initial_buffers else {}
        return self.traj.steps[step - 2].buffers[rank]

    def gradients(self, step: int, lp_weights: dict, scale: float):
        """``grads[rank][micro][name]``: float64 gradients of each unscaled micro-batch loss at
        ``lp_weights`` (DeepSpeed's model-dtype weights as float64). fp16: a micro-batch whose
        model-dtype backward of ``scale * loss / GAS`` overflows is marked non-finite, as the engine
        would see it. Also measures the model-dtype error (``grad_err``) and the buffers."""
        memo = self._memo.get((step, scale))
        if memo is not None:  # the same replay asked again (the stock column's bug-model judgement)
            grads, self.expected_buffers, self.buffer_err, self.grad_err = memo
            return grads
        W, GAS = self.case.world_size, self.case.grad_accum
        plp = dict(self.mlp.named_parameters())
        err = {n: 0.0 for n in self.names}
        grads, self.expected_buffers, self.buffer_err = [], [], []
        for r in range(W):
            before = self._buffers_before(step, r)
            _load(self.m64, lp_weights, before)
            _load(self.mlp, lp_weights, before)
            per_rank = []
            for mu in range(GAS):
                b_lp = models.batch_in(self.batch(r, step, mu), self.lp_dtype)
                b64 = models.batch_in(b_lp, torch.float64)
                g64 = float64_gradients(self.m64, self.names, b64, self.extra)
                loss_lp = models.loss_of(self.mlp(**b_lp, **self.extra(b_lp, self.lp_dtype)))
                scaled = loss_lp / GAS * scale if GAS > 1 or scale != 1.0 else loss_lp
                glp = torch.autograd.grad(scaled, [plp[n] for n in self.names], allow_unused=True)
                overflow = False
                for n, g in zip(self.names, glp):
                    if g is None:
                        continue
                    g = g.to(torch.float64) * (GAS / scale)
                    if not bool(torch.isfinite(g).all()):
                        overflow = True
                        continue
                    err[n] = max(err[n], float((g - g64[n]).abs().max()))
                if overflow and self.case.dtype == "fp16":
                    g64 = {n: torch.full_like(g, math.inf) for n, g in g64.items()}
                per_rank.append(g64)
            grads.append(per_rank)
            exp, berr = {}, {}
            lp_buf = dict(self.mlp.named_buffers())
            for n, b in self.m64.named_buffers():
                exp[n] = b.detach().to(torch.float64).clone()
                if lp_buf[n].is_floating_point():
                    berr[n] = (float((lp_buf[n].to(torch.float64) - exp[n]).abs().max()),
                               oracles.unit_roundoff(self.case.dtype))
                else:
                    berr[n] = (0.0, 0.0)
            self.expected_buffers.append(exp)
            self.buffer_err.append(berr)
        self.grad_err = err
        self._memo[(step, scale)] = (grads, self.expected_buffers, self.buffer_err, self.grad_err)
        return grads


    def grad_allowance(self, name: str, base: oracles.Allowance) -> oracles.Allowance:
        e = self.grad_err.get(name, 0.0)
        return oracles.Allowance(base.atol + 2.0 * e, base.rtol,
                                 base.derivation + f" + 2 e_lp (measured model-dtype backward error {e:.3g})", base.cap)

    def check_buffers(self, rec, add) -> None:
        """Every buffer of every rank after the step against the float64 replay."""
        if not self.expected_buffers:
            return
        if len(rec.buffers) != self.case.world_size:
            raise RuntimeError(f"{self.case.name}: step {rec.step} holds buffers of {len(rec.buffers)} ranks, "
                               f"not {self.case.world_size}")
        for r, (exp, errs) in enumerate(zip(self.expected_buffers, self.buffer_err)):
            for n, e in exp.items():
                if n not in rec.buffers[r]:
                    raise RuntimeError(f"{self.case.name}: buffer {n} of rank {r} was not captured at step {rec.step}")
                lp_err, u = errs[n]
                scale = float(e.abs().max()) if e.numel() else 0.0
                a = oracles.Allowance(2.0 * lp_err + 2.0 * u * scale, 0.0,
                                      f"2 e_lp ({lp_err:.3g}) + 2 u_lp |b| (one storage rounding each side)")
                add(f"{n}@rank{r}", "buffer", rec.step, np.asarray(rec.buffers[r][n]), e.numpy(), a)


_LAST: tuple = ()  # (trajectory, oracle): the one trajectory being judged


def module_oracle_for(case, traj) -> ModuleOracle:
    """The module oracle of ``traj``, built once however often the trajectory is judged.

    A stock case that a registered bug affects is judged twice (against the intended oracle and
    against the bug's model); both replays are teacher-forced at DeepSpeed's own weights, so the
    float64 and model-dtype backward passes (~80% of a real-model case's time) are the same at the
    same loss scale. One slot, holding the trajectory itself so its id cannot be reused: the gate
    judges one trajectory at a time and its memory stays flat."""
    global _LAST
    if _LAST and _LAST[0] is traj and _LAST[1].case == case:
        return _LAST[1]
    mo = ModuleOracle(case, traj)
    _LAST = (traj, mo)
    return mo
