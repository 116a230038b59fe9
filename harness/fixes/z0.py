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
if no loss scaling were configured. The fix multiplies the loss by the optimizer's current scale before
the stock ``backward`` (exactly what ``FP16_UnfusedOptimizer.backward`` would do) and returns the
stock return value divided by it again (a power of two: exact), so callers see the loss they always saw.

``z0-fp16-hysteresis`` (DSM-026). ``FP16_UnfusedOptimizer._update_scale`` halves the scale on every overflow:
its ``LossScaleConfig`` keeps no ``delayed_shift``, so ``fp16.hysteresis`` (documented default 2) and
``consecutive_hysteresis`` are never read. The fix keeps the remaining hysteresis on the optimizer, read
from the engine's resolved fp16 config (``overflow_checker.deepspeed``): an overflow while more than one is
left spends one and leaves the scale (the iteration and the last-overflow mark still move, as on any
overflow); otherwise the stock update runs, and the hysteresis is refilled where DeepSpeed's dynamic scaler
refills it (on a growth step, or every clean step with ``consecutive_hysteresis``). Not kept in the
optimizer's state_dict, so a resume starts with full hysteresis.

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

from harness.fixes._registry import Fix, Target, active
from harness.fixes.muon import MODEL_PARAM_ATTR, T_MUON_UPDATE_Z0, T_Z0_STEP, Z0_HEADS

INIT_STEP = "z0-no-init-step"
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
        # as FP16_UnfusedOptimizer.backward scales it (unfused_optimizer.py:272): in fp32
        out = orig(self, loss.float() * scale, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
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


T_UPDATE_SCALE = Target("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer._update_scale",
                        "c60d63655d8a698b", make_update_scale)
T_INIT_STATES = Target("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer.initialize_optimizer_states",
                       "62fb3a529065019a", make_initialize_optimizer_states)
T_BACKWARD = Target("deepspeed.runtime.engine", "DeepSpeedEngine.backward", "99280baf44808c23", make_backward)

FIXES = (
    Fix(name=INIT_STEP, bugs=("DSM-014",),
        targets=(T_INIT_STATES,)),
    Fix(name=LOSS_SCALE, bugs=("DSM-015",),
        targets=(T_BACKWARD,)),
    Fix(name=HYSTERESIS, bugs=("DSM-026",),
        targets=(T_UPDATE_SCALE,)),
    Fix(name=Z0_HEADS, bugs=("DSM-020",),
        targets=(T_MUON_UPDATE_Z0, T_Z0_STEP, T_INIT_STATES)),
)
