"""Loss-scale bookkeeping around Muon (ZeRO-1/2 and ZeRO-3).

``loss-scale-update-after-unscale`` (DSM-003). ``step()`` updates the dynamic loss scale
(``_update_scale``, stage_1_and_2.py:3047; stage3.py:2891 via ``_loss_scale_update_and_overflow_cleanup``)
*before* it multiplies the Muon update by ``self.loss_scale`` and unscales every gradient by
``self.loss_scale`` (``unscale_and_clip_grads``). On a growth step (S -> 2S) every Adam gradient is
therefore halved, the clip norm is halved, ZeRO-3 reports half the gradient norm, and on the
cpu/nvme offload paths (where ``S*O`` was formed with the old scale) the Muon step is halved too.
The fix defers the scale update to the end of ``step()``: inside ``step`` the replaced
``_update_scale`` only records the overflow flag, and the recorded update runs after the stock body
returned (on every exit, the early return of a skipped step included).

``muon-momentum-scale-units`` (DSM-004). Without optimizer offload the Muon momentum accumulates the
loss-*scaled* gradient ``S*g`` (ZeRO-1/2 ``get_flat_partition``, ZeRO-3 ``_muon_update_sub_group``).
When S changes (growth, or backoff after an overflow) the stored history is in the old units and
the new gradient is blended in as if S had not changed: the effective weights are skewed by
``S_new/S_old`` (a growth step weighs the new gradient 2x). The fix keeps the momentum in units of
the loss scale of the step in progress: it records the scale the stored momentum is in, and before
Muon touches it in a step whose scale differs (ZeRO-1/2: in ``get_flat_partition``, inside the
backward; ZeRO-3: at the start of ``step``, so a skipped step's momentum is converted too) multiplies
it by ``S_now/S_stored`` -- a power of two, so exact. It also runs ``muon_update`` itself in true
units (the stored momentum stays S times the true one, which is what checkpoints and
``harness.rank.capture`` read). The record of which scale the momentum is in lives on the loss scaler
object, which checkpoints pickle whole, so a resume keeps it.

``z12-fp32-skip-nonfinite`` (DSM-027, its ZeRO-1/2 part). In fp32 the engine builds ZeRO-1/2 with
``check_grad_overflow`` off, leaving the invalid-norm test as the only one; ``compute_grad_norm: false``
drops that too, and a non-finite gradient is stepped into the weights (the clean Muon matrices' staged
momentum committed with it). For such a step the fix turns ZeRO's own inf/NaN test of the averaged
gradients on (``check_overflow``, all-reduced over the data- and model-parallel groups): the step is
skipped as a 16-bit overflow is, the staged momentum left uncommitted. (Offload is excluded by DeepSpeed
itself: it requires the norm.)
"""
from __future__ import annotations

from harness.fixes._registry import Fix, Target, active
from harness.fixes.muon import T_MUON_UPDATE
from harness.fixes.stale import clear_gradient_stores, fixes as stale_fixes
from harness.fixes.units import UNITS, sync_z3
from harness.fixes.z3 import T_SUBGROUP
from harness.fixes.z12 import GET_FLAT_PARTITION

GROWTH = "loss-scale-update-after-unscale"
Z12_NONFINITE = "z12-fp32-skip-nonfinite"

Z12_MOD, Z12 = "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"
Z3_MOD, Z3 = "deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"

_DEFER = "_dsm_deferred_scale_updates"


def make_update_scale(orig):

    def _update_scale(self, has_overflow=False):
        pending = self.__dict__.get(_DEFER)
        if pending is not None:  # inside a patched step(): apply once the step is done
            pending.append(has_overflow)
            return
        return orig(self, has_overflow)

    return _update_scale


def _tests_nothing(self) -> bool:
    """ZeRO-1/2 where nothing looks at the gradients before the step: no inf/NaN test (fp32) and no norm."""
    return getattr(self, "compute_grad_norm", True) is False and getattr(self, "check_grad_overflow", True) is False


def make_step(sync):

    def make(orig):

        def step(self, closure=None):
            tested = active(Z12_NONFINITE) and _tests_nothing(self)
            if tested:
                self.check_grad_overflow = True
            try:
                return deferred(self, closure)
            finally:
                if tested:
                    self.check_grad_overflow = False
                clear_gradient_stores(self)  # DSM-023's fix (harness.fixes.stale), when active

        def deferred(self, closure):
            if sync is not None:
                sync(self)
            if not active(GROWTH) or _DEFER in self.__dict__:
                return orig(self, closure)
            self.__dict__[_DEFER] = []
            try:
                return orig(self, closure)
            finally:
                pending = self.__dict__.pop(_DEFER)
                for overflow in pending:
                    self._update_scale(overflow)

        return step

    return make


T_Z12_UPDATE = Target(Z12_MOD, f"{Z12}._update_scale", "fbe7ea00dd9856f0", make_update_scale)
T_Z3_UPDATE = Target(Z3_MOD, f"{Z3}._update_scale", "fbe7ea00dd9856f0", make_update_scale)
T_Z12_STEP = Target(Z12_MOD, f"{Z12}.step", "279ae7c6a4e87667", make_step(None))
T_Z3_STEP = Target(Z3_MOD, f"{Z3}.step", "1dfecf4f2fb70970", make_step(sync_z3))

FIXES = (
    Fix(name=GROWTH, bugs=("DSM-003",),
        summary="the loss scale is updated after unscaling on a growth step",
        targets=(T_Z12_UPDATE, T_Z3_UPDATE, T_Z12_STEP, T_Z3_STEP)),
    Fix(name=UNITS, bugs=("DSM-004",),
        summary="the momentum holds gradients in true units without offload",
        targets=(GET_FLAT_PARTITION, T_Z3_STEP, T_SUBGROUP, T_MUON_UPDATE),
        notes="Also runs Muon on the true-unit gradient (divides gradient and momentum by S around muon_update and "
              "multiplies the momentum back, exactly): Newton-Schulz normalises by ||X|| + 1e-7, so S*U and U "
              "round differently in the last fp32 bit, which 16-bit Newton-Schulz then amplifies."),
    Fix(name=Z12_NONFINITE, bugs=("DSM-027",),
        summary=("fp32 ZeRO-1/2 with `compute_grad_norm: false` run ZeRO's own inf/NaN test of the averaged gradients"
                 " before the step, so a non-finite gradient skips it and the staged Muon momentum stays uncommitted"),
        targets=(T_Z12_STEP,)),
) + stale_fixes((T_Z12_STEP, T_Z3_STEP))  # the step wrappers are these targets'; the fix is stale.py's
