"""``unused-param-zero-grad`` (DSM-023): a parameter without a gradient in a step steps on zero.

Why here: ZeRO-3 (every offload) and ZeRO-1/2 with optimizer offload keep each parameter's gradient
partition in a buffer that the parameter's own reduction *overwrites* at the first micro-batch of a
window (stage3.py ``__partition_grads``: ``copy_`` when ``micro_step_id == 0``; stage_1_and_2.py the
offload copy into the fp32 CPU partition). Nothing else writes it, so a parameter the forward left out
keeps last step's content, and ZeRO-3 and the Muon offload paths also write the Muon update over it:
the next step reads that as this step's gradient. Stage 0 and ZeRO-1/2 without offload build their flat
gradient from zeros. The fix zeroes those buffers once a step is over (on every exit of ``step``, a
skipped step's too), so the next window starts from zeros as theirs does; a parameter that does get a
gradient overwrites its part as before.

Not covered: ZeRO-3 with NVMe. There a swapped sub-group's small gradients (below the swap size) are
kept beside the swap files only until the sub-group's next swap-in, and the step's second swap-in (after
Muon's write-back) reads them from the pooled swap buffer, which still holds them; a parameter without a
gradient in the next window is then read from that buffer too (measured: the Muon matrix steps on the
previous update). Zeroing the gaps at a swap-in would wipe the write-back the second swap-in relies on,
and zeroing the pool costs its whole size every step; so the fix leaves an NVMe run as stock runs it, and
DSM-023 stays expected there on the patched column (``Bug.fix_covers``).
"""
from __future__ import annotations

from harness.fixes._registry import Fix, active

STALE = "unused-param-zero-grad"


def clear_gradient_stores(opt) -> None:
    """Zero what the next window's reductions overwrite, for the parameters that get no gradient."""
    if not active(STALE) or getattr(opt, "optimizer_swapper", None) is not None:
        return  # NVMe: not covered (module docstring); the step stays stock's, which DSM-023's model describes
    flat = getattr(opt, "grad_partitions_flat_buffer", None)  # ZeRO-3
    if flat is not None:
        flat.zero_()
    if getattr(opt, "offload_optimizer", False):  # ZeRO-3 offload: the fp32 copies the CPU step reads
        for p in getattr(opt, "fp32_partitioned_groups_flat", ()):
            if p.grad is not None:
                p.grad.zero_()
    if getattr(opt, "cpu_offload", False):  # ZeRO-1/2 offload
        for p in getattr(opt, "single_partition_of_fp32_groups", ()):
            if p.grad is not None:
                p.grad.zero_()


def fixes(step_targets) -> tuple:
    return (Fix(name=STALE, bugs=("DSM-023",),
                summary=("after every `step()` of ZeRO-1/2 and ZeRO-3, the gradient buffers that only a parameter's "
                         "own reduction writes are zeroed; not ZeRO-3 NVMe (the pooled swap buffer is reused by the "
                         "step's own second swap-in)"),
                targets=tuple(step_targets),
                notes="Zeroes ZeRO-3's gradient partition buffer and the offload paths' fp32 gradient partitions "
                      "after each step(), so the next window's copies start from zeros."),)
