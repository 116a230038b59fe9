"""Fixes for Muon without ZeRO (stage 0) in fp16/bf16, where the engine wraps ``MuonWithAuxAdam`` in
``FP16_UnfusedOptimizer`` (``engine.py _configure_fp16_optimizer``: Muon is not a fused optimizer).

``z0-no-init-step`` (DSM-014). ``FP16_UnfusedOptimizer.__init__`` calls ``initialize_optimizer_states``,
which runs one real ``optimizer.step()`` on zero gradients to create the optimizer state. For
``MuonWithAuxAdam`` that step is not free: the auxiliary Adam counts it (``state["step"] = 1``), so the
first real step is bias-corrected as step 2 (an Adam step of 0.735 lr instead of lr), and Muon's decoupled
weight decay shrinks the fp32 masters once (the model weights are not refreshed from them). Muon and its
Adam create their state lazily on the first real step, so the fix skips that warm-up step when the
inner optimizer is ``MuonWithAuxAdam``; any other optimizer keeps stock behaviour.

``z0-fp16-loss-scale`` (DSM-015). ``DeepSpeedEngine.backward`` multiplies the loss by the loss scale only
for a ``ZeROOptimizer`` (``scale_if_loss``) or a torch-autocast grad scaler; ``FP16_UnfusedOptimizer`` is
neither, so fp16 without ZeRO back-propagates the unscaled loss -- and then ``step`` divides the
gradients by the scale anyway: every gradient the optimizer sees is 1/S of the true one, the overflow
check and the reported norm are taken on unscaled fp16 gradients, and small fp16 gradients underflow as
if no loss scaling were configured. The fix divides the loss by the accumulation steps and multiplies
it by the optimizer's current scale in fp32 before the stock ``backward`` (exactly what
``FP16_UnfusedOptimizer.backward`` does with the engine's loss; scaling before the division would hand the
fp16 graph ``S / GAS``, where ZeRO hands it ``S``, and step through an overflow every other path skips) and
returns the stock return value divided by the scale again (a power of two: exact), so callers see the
loss they always saw.

``z0-fp16-hysteresis`` (DSM-026). ``FP16_UnfusedOptimizer._update_scale`` halves the scale on every overflow:
its ``LossScaleConfig`` keeps no ``delayed_shift``, so ``fp16.hysteresis`` (documented default 2) and
``consecutive_hysteresis`` are never read. The fix keeps the remaining hysteresis on the optimizer, read
from the engine's resolved fp16 config (``overflow_checker.deepspeed``): an overflow while more than one is
left spends one and leaves the scale (the iteration and the last-overflow mark still move, as on any
overflow); otherwise the stock update runs, and the hysteresis is refilled where DeepSpeed's dynamic scaler
refills it (on a growth step, or every clean step with ``consecutive_hysteresis``). Not kept in the
optimizer's state_dict, so a resume starts with full hysteresis.

``z0-muon-update-norm`` (DSM-016). ``FP16_UnfusedOptimizer.step`` takes the global norm over the raw
gradients and clips them before ``MuonWithAuxAdam.step`` runs Muon, where every ZeRO path takes it over each
Muon matrix's update ``O`` and the Adam gradients and clips ``O`` and the Adam step (the momentum sees the
unclipped gradient). For a ``MuonWithAuxAdam`` inner optimizer the fix unscales only, computes each Muon
matrix's ``O`` through the same ``muon_update`` binding and arguments the inner step uses (its momentum
buffer restored after, so the inner step recomputes exactly that ``O`` and commits the momentum once), takes
the norm over those and the Adam gradients (skipping the step where it is not finite, momentum untouched),
divides the Adam gradients by the clip coefficient ``k`` and, for the inner step only, steps the Muon group
with ``lr / k`` and ``weight_decay * k`` (the decay ``lr * wd`` unchanged, the update ``lr * O / k``).
It reports that norm in true units, as ZeRO does. Any other inner optimizer keeps the stock step.

``z0-fp32-skip-nonfinite`` (DSM-027, its stage-0 part). In fp32 without ZeRO nothing stands between the
backward and ``MuonWithAuxAdam.step``: no loss scaler, no overflow test, no norm (the engine's own clip, where
configured, turns an infinite norm into a zero coefficient and every gradient NaN). The fix asks, before the
engine's model step, whether any rank holds a non-finite gradient (one max all-reduce of a flag over the
world, so model-parallel ranks agree too); if so it marks the optimizer ``overflow`` and lets the stock
``_take_model_step`` run with the inner step made a no-op (a flag its patched ``MuonWithAuxAdam.step`` reads,
so wrappers set on the instance still run): the gradients are zeroed, ``skipped_steps`` counts
the step and the lr scheduler does not advance, as on an fp16 overflow. ZeRO-1/2 with ``compute_grad_norm:
false`` are ``z12-fp32-skip-nonfinite``'s (``scaler``).

``z0-per-head`` (DSM-020). Without ZeRO, ``MuonWithAuxAdam.step`` orthogonalises each 2-D weight itself
and calls ``muon_update`` without ``num_heads``, so a parameter tagged per-head (``muon_num_heads``, the
attribute ZeRO-1/2/3's call sites read) gets one whole-matrix Newton-Schulz. The stock step is kept
whole: while it runs it is published (``muon._Z0_STEP``) and stage 0's binding of ``muon_update``
recovers the parameter from the momentum buffer it is handed (``state[p]["momentum_buffer"]``, created
just before the call) and passes its head count. Only that binding consults it: ZeRO's call sites go
through ``original_muon`` and pass ``num_heads`` themselves, and under ZeRO the inner step sees flat
1-D partitions and never calls ``muon_update``. In fp16/bf16 the inner optimizer steps fp32 clones,
which carry no attributes, so each clone is linked to its model parameter when the wrapper is built.
"""
from __future__ import annotations

import torch

from harness.fixes._registry import Fix, Target, active
from harness.fixes.muon import _Z0_STEP, MODEL_PARAM_ATTR, T_MUON_UPDATE_Z0, T_Z0_STEP, Z0_HEADS, Z0_SKIP_STEP

INIT_STEP = "z0-no-init-step"
MUON_NORM = "z0-muon-update-norm"
SKIP_NONFINITE = "z0-fp32-skip-nonfinite"
LOSS_SCALE = "z0-fp16-loss-scale"
HYSTERESIS = "z0-fp16-hysteresis"
_LEFT = "_dsm_hysteresis_left"  # the hysteresis still to spend, on the optimizer (None: not read yet)


def _is_muon(opt) -> bool:
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # late: DeepSpeed, rank side

    return isinstance(opt, MuonWithAuxAdam)


def make_initialize_optimizer_states(orig):
    def initialize_optimizer_states(self):
        if active(Z0_HEADS):  # called at the end of __init__, once both groups exist
            for model_group, master_group in zip(self.fp16_groups, self.fp32_groups):
                for lp, hp in zip(model_group, master_group):
                    setattr(hp, MODEL_PARAM_ATTR, lp)
        if active(INIT_STEP) and _is_muon(self.optimizer):
            return  # Muon and its Adam create their state on the first real step
        return orig(self)

    return initialize_optimizer_states


def _unscaled_fp16_wrapper(engine):
    """The optimizer whose loss scale the engine forgets to apply, or None."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer  # late: DeepSpeed, rank side

    opt = engine.optimizer
    if engine.zero_optimization() or not engine.fp16_enabled() or not isinstance(opt, FP16_UnfusedOptimizer):
        return None
    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        return None
    return opt


def make_backward(orig):
    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        opt = _unscaled_fp16_wrapper(self) if active(LOSS_SCALE) else None
        if opt is None:
            return orig(self, loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        scale = float(opt.loss_scale_config.cur_scale)  # INTERNAL: the dynamic/static scale step() divides by
        # as FP16_UnfusedOptimizer.backward scales the engine's loss (unfused_optimizer.py:272): divided by
        # the accumulation steps first, then times the scale in fp32, so the backward reaches the model's
        # fp16 graph carrying S, as on every ZeRO path (scale_if_loss after the division)
        per_micro = self._scale_loss_by_gas(loss) if scale_wrt_gas else loss
        out = orig(self, per_micro.float() * scale, retain_graph=retain_graph, scale_wrt_gas=False)
        return (out / scale).to(loss.dtype)

    return backward


def _hysteresis_left(self, fp16) -> int:
    left = self.__dict__.get(_LEFT)
    return int(fp16.hysteresis) if left is None else left


def make_update_scale(orig):
    def _update_scale(self, skip):
        cfg = self.loss_scale_config
        engine = getattr(self.overflow_checker, "deepspeed", None)
        if not (active(HYSTERESIS) and cfg.dynamic_loss_scale and engine is not None):
            return orig(self, skip)
        fp16 = engine._config.float16_config  # INTERNAL: the resolved fp16 section (documented defaults)
        left = _hysteresis_left(self, fp16)
        if skip and left > 1:
            self.__dict__[_LEFT] = left - 1
            cfg.last_overflow_iter = cfg.cur_iter
            cfg.cur_iter += 1
            return None
        before = cfg.cur_scale
        out = orig(self, skip)
        if not skip and (fp16.consecutive_hysteresis or cfg.cur_scale > before):
            self.__dict__[_LEFT] = int(fp16.hysteresis)
        return out

    return _update_scale


def _muon_pass(inner) -> dict:
    """Each 2-D Muon master's update ``O``, through the ``muon_update`` binding the inner step calls and with
    its arguments, published as the inner step publishes itself (``z0-per-head`` reads it). Returns
    {param: (O, the momentum before)}: the momentum is committed, and restored by the caller on a skip."""
    from deepspeed.runtime.zero.muon import muon_optimizer  # late: DeepSpeed, rank side (the patched binding)

    out = {}
    outer, _Z0_STEP[0] = _Z0_STEP[0], inner
    try:
        for group in inner.param_groups:
            if not group.get("use_muon"):
                continue
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                state = inner.state[p]
                if len(state) == 0:
                    state["momentum_buffer"] = torch.zeros_like(p)
                before = state["momentum_buffer"].clone()
                O = muon_optimizer.muon_update(p.grad, state["momentum_buffer"], beta=group["momentum"],
                                               ns_method=group.get("ns_method", "gram"),
                                               is_expert_group=getattr(p, "is_expert_group", False))
                out[p] = (O, before)
    finally:
        _Z0_STEP[0] = outer
    return out


def _clip_after_muon(self) -> tuple[dict, float] | None:
    """Unscale, run Muon, take the norm over the Muon updates and the Adam gradients and clip the Adam
    gradients: (the Muon pass, the clip coefficient), or None where the norm is not finite (the momentum
    put back: the step is skipped)."""
    from deepspeed.runtime.fp16.unfused_optimizer import get_global_norm, is_invalid_grad_norm  # late: DeepSpeed

    for group in self.fp32_groups:
        for p in group:
            if p.grad is not None:
                p.grad.data.mul_(1.0 / self.loss_scale_config.cur_scale)
    done = _muon_pass(self.optimizer)
    adam = [p.grad for g in self.optimizer.param_groups if not g.get("use_muon") for p in g["params"]
            if p.grad is not None]
    norm = get_global_norm(norm_list=[float(torch.linalg.vector_norm(t.double()))
                                      for t in [o for o, _ in done.values()] + adam])
    self._global_grad_norm = norm
    if is_invalid_grad_norm(norm):
        for p, (_, before) in done.items():
            self.optimizer.state[p]["momentum_buffer"].copy_(before)
        return None
    k = max(1.0, (norm + 1e-6) / self.clip_grad) if self.clip_grad > 0 else 1.0
    for t in adam:
        t.mul_(1.0 / k)
    return done, k


def _step_muon_then_adam(inner, done: dict, k: float) -> None:
    """The Muon matrices stepped by ``lr O / k`` after their decoupled decay (what the inner step does with a
    ready update, the clip applied), then the inner step for the Adam groups alone."""
    muon = [g for g in inner.param_groups if g.get("use_muon")]
    with torch.no_grad():
        for g in muon:
            for p in g["params"]:
                O, _ = done[p]
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(O.reshape(p.shape), alpha=-g["lr"] / k)
    saved = [g["params"] for g in muon]
    for g in muon:
        g["params"] = []
    try:
        inner.step()
    finally:
        for g, params in zip(muon, saved):
            g["params"] = params


def make_unfused_step(orig):
    def step(self, closure=None):
        if not (active(MUON_NORM) and _is_muon(self.optimizer)) or self.fused_lamb_legacy:
            return orig(self, closure=closure)
        self.overflow = self.overflow_checker.check()
        if self.overflow:
            return self._skip_invalid_grad_norm()
        for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
            for fp32_param, fp16_param in zip(fp32_group, fp16_group):
                fp32_param.grad = (torch.zeros(fp16_param.size(), dtype=fp32_param.dtype, device=fp32_param.device)
                                   if fp16_param.grad is None else fp16_param.grad.to(fp32_param.dtype))
        clipped = _clip_after_muon(self)
        if clipped is None:
            return self._skip_invalid_grad_norm()
        self._update_scale(False)
        _step_muon_then_adam(self.optimizer, *clipped)
        for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
            for fp32_param, fp16_param in zip(fp32_group, fp16_group):
                fp32_param.grad = None
                fp16_param.data.copy_(fp32_param.data)
        return self.overflow

    return step


def _bare_muon(engine):
    """The engine's optimizer where nothing tests the gradients before ``MuonWithAuxAdam.step`` (stage 0,
    fp32, no autocast scaler), or None."""
    opt = engine.optimizer
    if engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled() or not _is_muon(opt):
        return None
    return None if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None else opt


def _any_rank_nonfinite(opt) -> bool:
    from deepspeed import comm as dist  # late: DeepSpeed, rank side
    from deepspeed.accelerator import get_accelerator  # late: DeepSpeed, rank side

    bad = any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
              for g in opt.param_groups for p in g["params"])
    flag = torch.tensor([float(bad)], device=get_accelerator().current_device_name())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def make_take_model_step(orig):
    def _take_model_step(self, lr_kwargs):
        opt = _bare_muon(self) if active(SKIP_NONFINITE) else None
        if opt is None:
            return orig(self, lr_kwargs)
        opt.overflow = _any_rank_nonfinite(opt)  # read by the stock step after the optimizer's step
        if not opt.overflow:
            return orig(self, lr_kwargs)
        opt.__dict__[Z0_SKIP_STEP] = True  # the inner step does nothing; the rest is stock: zero_grad,
        try:  # skipped_steps, no lr-scheduler step
            return orig(self, lr_kwargs)
        finally:
            opt.__dict__.pop(Z0_SKIP_STEP, None)

    return _take_model_step


T_UNFUSED_STEP = Target("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer.step", "e06fd288a7cc55a2",
                        make_unfused_step)
T_UPDATE_SCALE = Target("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer._update_scale",
                        "c60d63655d8a698b", make_update_scale)
T_INIT_STATES = Target("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer.initialize_optimizer_states",
                       "62fb3a529065019a", make_initialize_optimizer_states)
T_BACKWARD = Target("deepspeed.runtime.engine", "DeepSpeedEngine.backward", "99280baf44808c23", make_backward)
T_MODEL_STEP = Target("deepspeed.runtime.engine", "DeepSpeedEngine._take_model_step", "b5e1145cf37b0f2a",
                      make_take_model_step)

FIXES = (
    Fix(name=INIT_STEP, bugs=("DSM-014",),
        summary="no warm-up optimizer step at `initialize` without ZeRO",
        targets=(T_INIT_STATES,)),
    Fix(name=LOSS_SCALE, bugs=("DSM-015",),
        summary="`engine.backward` applies the loss scale without ZeRO",
        targets=(T_BACKWARD,)),
    Fix(name=HYSTERESIS, bugs=("DSM-026",),
        summary=("without ZeRO, fp16's loss scaler spends `hysteresis` before it halves (refilled on growth, or every"
                 " clean step with `consecutive_hysteresis`); the remaining hysteresis is not checkpointed"),
        targets=(T_UPDATE_SCALE,)),
    Fix(name=MUON_NORM, bugs=("DSM-016",),
        summary=("without ZeRO, `FP16_UnfusedOptimizer.step` with a `MuonWithAuxAdam` inside unscales, runs Muon "
                 "first (the momentum fed the unclipped gradient), takes the norm over the Muon updates and the Adam "
                 "gradients as every ZeRO path does, skips on a non-finite norm with the momentum put back, clips the"
                 " Adam gradients and steps each Muon matrix by `lr O / k` after its decay; the inner step then runs "
                 "for the Adam groups alone. fp32 stage 0 clips in the engine and keeps DSM-016"),
        targets=(T_UNFUSED_STEP,)),
    Fix(name=SKIP_NONFINITE, bugs=("DSM-027",),
        summary=("fp32 without ZeRO skips the model step when any rank holds a non-finite gradient (one all-reduce of"
                 " a flag): gradients zeroed, `skipped_steps` counted, no lr-scheduler step, as on an fp16 overflow"),
        targets=(T_MODEL_STEP, T_Z0_STEP)),
    Fix(name=Z0_HEADS, bugs=("DSM-020",),
        summary=("stage 0 passes each per-head parameter's head count to `muon_update` (looked up from the momentum "
                 "buffer the step hands it); fp16/bf16 masters linked to their model parameters"),
        targets=(T_MUON_UPDATE_Z0, T_Z0_STEP, T_INIT_STATES)),
)
