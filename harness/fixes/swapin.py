"""``nvme-grad-offset-io`` (DSM-021): ZeRO-3 NVMe hands Muon a misplaced gradient.

Both optimizer swappers move a sub-group's swapped gradients between their swap files and views of
one locked buffer at each gradient's offset in the sub-group (``parameter.grad.narrow(0, offset,
length)``): read in ``swap_in_optimizer_state`` (``PartitionedOptimizerSwapper.
_swap_in_pinned_gradients``, ``OptimizerSwapInfo.get_swap_gradient_buffers`` for the pipelined
swapper) and written back in ``writeback_optimizer_state_and_gradients`` (``_writeback_gradients``).
On the CPU accelerator an aio read into, or write from, a view of a handle-locked tensor at a
nonzero offset moves nothing (measured standalone; at offset 0, or with a plain tensor at any
offset, it works). A sub-group's first tensor sits at offset 0, so only a swapped matrix sorted after
other parameters is hit (DeepSpeed orders a Muon group by ``p.size()``, descending): its region keeps
whatever the pooled buffer held (measured: the gradient as the swap-out staged it, from offset 0),
Muon orthogonalises that, and the update written back never reaches the file either.

The fix keeps both stock functions whole and, after each, moves every swapped gradient at a nonzero
offset once more with ordinary file I/O: after a swap-in (both swappers have waited for the
sub-group's reads by then) from its file into its place; after a write-back from its place into its
file, so the step's second swap-in reads the Muon update ``_apply_muon_updates_cpu_offload`` wrote.
Ordinary I/O rather than the swapper's aio handle: the pipelined swapper may have the next
sub-group's prefetch in flight on it, and a ``wait()`` here would consume that prefetch's
completions. A file holds its gradient's ``length`` elements first (each is written from the start
of an aligned buffer).
"""
from __future__ import annotations

from harness.fixes._registry import Fix, Target, active
import torch

NAME = "nvme-grad-offset-io"


def _offset_gradients(swapper, parameter):
    """(swap info of a swapped gradient at a nonzero offset, its region of ``parameter.grad``)."""
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper  # late: DeepSpeed, rank side

    info = swapper.swap_params_info.get(OptimizerSwapper.parameter_id(parameter))
    grad = getattr(parameter, "grad", None)
    if info is None or grad is None:
        return []
    return [(g, grad.narrow(0, g.offset, g.length)) for g in info.swapped_gradients.values() if g.offset != 0]


def _np_dtype(t):

    return torch.empty(0, dtype=t.dtype).numpy().dtype


def make_swap_in(orig):
    def swap_in_optimizer_state(self, parameter, async_parameter=None):
        out = orig(self, parameter, async_parameter)
        if active(NAME):
            import numpy as np
            import torch

            for g, region in _offset_gradients(self, parameter):
                values = np.fromfile(g.path, dtype=_np_dtype(region), count=g.length)
                if values.size != g.length:
                    raise RuntimeError(f"{NAME}: {g.path} holds {values.size} of {g.length} gradient elements")
                region.copy_(torch.from_numpy(values))
        return out

    return swap_in_optimizer_state


def make_writeback(orig):
    def writeback_optimizer_state_and_gradients(self, parameter, write_opt_state, write_gradients):
        out = orig(self, parameter, write_opt_state, write_gradients)
        if active(NAME) and write_gradients:
            for g, region in _offset_gradients(self, parameter):
                with open(g.path, "r+b") as f:  # in place: the file keeps its aligned length
                    f.write(region.detach().contiguous().numpy().tobytes())
        return out

    return writeback_optimizer_state_and_gradients


_P = "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper"
_Q = "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper"
T_IN_PARTITIONED = Target(_P, "PartitionedOptimizerSwapper.swap_in_optimizer_state", "536d7279bc73e629", make_swap_in)
T_IN_PIPELINED = Target(_Q, "PipelinedOptimizerSwapper.swap_in_optimizer_state", "18b8fb3acaa2e598", make_swap_in)
T_WB_PARTITIONED = Target(_P, "PartitionedOptimizerSwapper.writeback_optimizer_state_and_gradients",
                          "8bb4847f3c3dd799", make_writeback)
T_WB_PIPELINED = Target(_Q, "PipelinedOptimizerSwapper.writeback_optimizer_state_and_gradients",
                        "2acaec008cc4b33d", make_writeback)

FIXES = (
    Fix(name=NAME, bugs=("DSM-021", "DSM-022", "DSM-024"),
        summary=("after each stock swap-in and write-back, every swapped gradient at a nonzero offset is moved once "
                 "more with ordinary file I/O"),
        targets=(T_IN_PARTITIONED, T_IN_PIPELINED, T_WB_PARTITIONED, T_WB_PIPELINED)),
)
