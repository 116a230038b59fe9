"""The raw-gradient overflow test of ZeRO-3 for bf16 models.

``z3-bf16-gradient-overflow-check`` (DSM-025). DeepSpeed documents ``bf16.check_grad_overflow``
(default true): detect a non-finite gradient before the optimizer step and skip the step.
ZeRO-1/2 receive the setting from the engine; ZeRO-3 does not, and its
``_overflow_check_and_loss_scale_update`` tests the gradients only for fp16 models. A bf16
non-finite gradient therefore reaches Muon, which writes every matrix's momentum before the
invalid-norm test skips the step. The fix runs ZeRO-3's own overflow test (``check_overflow``: the
partitioned gradients' inf/NaN tracker, MAX-reduced over the data-parallel and model-parallel
groups) for bf16 models too, before Muon, as the documented default says. A config that sets
``check_grad_overflow: false`` is not read here (ZeRO-3 is never given it).
"""
from __future__ import annotations

import torch

from harness.fixes._registry import Fix, Target, active

BF16_CHECK = "z3-bf16-gradient-overflow-check"

Z3_MOD, Z3 = "deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"


def make_overflow_check(orig):

    def _overflow_check_and_loss_scale_update(self, update_scale=True):
        if not active(BF16_CHECK) or self.dtype != torch.bfloat16:
            return orig(self, update_scale)
        orig(self, update_scale=False)  # the fp16-only test: clears the flag for bf16
        self.check_overflow()
        if not update_scale:
            return self.overflow
        return self._loss_scale_update_and_overflow_cleanup()

    return _overflow_check_and_loss_scale_update


T_Z3_OVERFLOW_CHECK = Target(Z3_MOD, f"{Z3}._overflow_check_and_loss_scale_update", "6b954b254505749b",
                             make_overflow_check)

FIXES = (
    Fix(name=BF16_CHECK, bugs=("DSM-025",),
        summary=("ZeRO-3 runs its inf/NaN test of the partitioned gradients for bf16 models too, before Muon, as "
                 "`bf16.check_grad_overflow`'s documented default says (ZeRO-3 is never given the setting, so `false`"
                 " is not honoured there)"),
        targets=(T_Z3_OVERFLOW_CHECK,),
        notes="One more inf/NaN test of the partitioned gradients per bf16 step (and its all-reduce), as "
              "fp16 models already run."),
)
