"""ZeRO-1/2 with optimizer offload: what a skipped step leaves behind.

``z12-offload-momentum-on-skip`` (DSM-028). Without offload, ZeRO-1/2 stage each step's Muon momentum and
commit it only once the step survives its overflow and norm tests (``_stage_muon_momentum`` /
``_commit_muon_momentum``). With the optimizer offloaded, ``_apply_muon_updates_cpu_offload`` runs Muon
before the norm and writes the new momentum straight into the optimizer state; in fp32 (where no test
looks at the gradients first) a step the invalid-norm test then skips keeps that momentum. The fix keeps a
copy of each offloaded momentum partition as it was before Muon ran and puts it back when the step turns
out skipped (``reset_cpu_buffers``, which the offload path calls at the end of every step, the skipped
ones included, with ``self.overflow`` saying which).

``z12-offload-grads-on-skip`` (DSM-029). With a 16-bit model and ``grad_accum_dtype: fp32`` the non-Muon
groups accumulate into a compact fp32 partition buffer held in ``averaged_gradients``. An applied offload
step drops it after the optimizer step (a fresh zeroed buffer next time), and the skipped step without
offload drops it too; the skipped offload step only calls ``reset_cpu_buffers``, so the next step adds its
gradients to the skipped one's. The fix drops every group's buffer there on a skipped step, as the applied
step does.
"""
from __future__ import annotations

from harness.fixes._registry import Fix, Target, active

MOMENTUM_ON_SKIP = "z12-offload-momentum-on-skip"
GRADS_ON_SKIP = "z12-offload-grads-on-skip"

MOD, CLS = "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"
_SAVED = "_dsm_momentum_before_muon"


def _momentum_buffers(self) -> list:
    """The offloaded flat partitions' momentum buffers Muon writes (those that exist yet)."""
    out = []
    for flat in self.single_partition_of_fp32_groups:
        buf = self.optimizer.state.get(flat, {}).get("momentum_buffer")
        if buf is not None:
            out.append((flat, buf))
    return out


def make_apply_muon_updates_cpu_offload(orig):

    def _apply_muon_updates_cpu_offload(self):
        if active(MOMENTUM_ON_SKIP):
            setattr(self, _SAVED, {id(flat): (flat, buf.clone()) for flat, buf in _momentum_buffers(self)})
        return orig(self)

    return _apply_muon_updates_cpu_offload


def make_reset_cpu_buffers(orig):

    def reset_cpu_buffers(self):
        saved = getattr(self, _SAVED, None)
        if saved is not None:
            setattr(self, _SAVED, None)
            if self.overflow:
                for flat in self.single_partition_of_fp32_groups:
                    state = self.optimizer.state.get(flat, {})
                    if id(flat) in saved:
                        state["momentum_buffer"].copy_(saved[id(flat)][1])
                    else:  # created by this skipped step: as if never written (zero, Muon's start)
                        state.get("momentum_buffer", flat.new_zeros(0)).zero_()
        out = orig(self)  # waits for the offload copies, which may still read the buffers
        if active(GRADS_ON_SKIP) and self.overflow:
            for group_idx in list(self.averaged_gradients):
                self.averaged_gradients[group_idx] = None
        return out

    return reset_cpu_buffers


T_APPLY = Target(MOD, f"{CLS}._apply_muon_updates_cpu_offload", "edafbc95df5c357a", make_apply_muon_updates_cpu_offload)
T_RESET = Target(MOD, f"{CLS}.reset_cpu_buffers", "62a77ea9256e3ed6", make_reset_cpu_buffers)

FIXES = (
    Fix(name=MOMENTUM_ON_SKIP, bugs=("DSM-028",),
        summary=("ZeRO-1/2 with optimizer offload keep each rank's offloaded Muon momentum partition as it was before"
                 " Muon ran and put it back when the step is skipped (one host copy per step)"),
        targets=(T_APPLY, T_RESET),
        notes="One copy of each rank's offloaded Muon momentum partition per step, in host memory, held from "
              "Muon's update to the end of the step."),
    Fix(name=GRADS_ON_SKIP, bugs=("DSM-029",),
        summary=("a skipped ZeRO-1/2 offload step drops the fp32 accumulation buffers of the non-Muon groups, as an "
                 "applied step does, so the next step does not add its gradients to the skipped one's"),
        targets=(T_RESET,)),
)
