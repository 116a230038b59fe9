"""Rank side of the ZeRO-3 in-memory Muon momentum (``save_muon_momentum_buffer_in_memory``): what keeping
it resident promises beyond the numbers the oracle judges.

DeepSpeed 0.19.8 keeps each Muon sub-group's momentum in ``muon_momentum_buffer_partitioned_groups_flat[i]``,
marks it ``swappable = False`` so the optimizer swapper leaves it out of the sub-group's swap files
(``swap_tensor/optimizer_utils.py is_swappable_tensor``), and points ``optimizer.state[fp32]["momentum_buffer"]``
at it after every step (``stage3.py`` ``_muon_update_sub_group``, ``_apply_muon_updates_cpu_offload``). The
capture reads the momentum from the resident buffer, so two promises are invisible to the oracle: the
optimizer state (what ``save_checkpoint`` writes and ``load_checkpoint`` restores) is that same tensor, not
a copy that could go stale; and the buffer never reaches the swap folder (a swap-out that took it would
write a ``momentum_buffer-<ds_id>`` file and release its storage: IO the option exists to avoid, and a
momentum that then lives only on disk). Each broken promise is a capture note, which fails the case.
"""
from __future__ import annotations

import os

MOMENTUM_FILE_PREFIX = "momentum_buffer-"  # optimizer_utils.py _get_state_tensors: state name + "-" + ds_id


def applies(case) -> bool:
    return (case.stage == 3 and bool(case.ds.zero.save_muon_momentum_buffer_in_memory) and case.runs_muon
            and case.client_optimizer is None)


class ResidentMomentumWatch:
    """One engine's watch; ``check_step()`` after every optimizer step (also the one before a checkpoint is
    saved, and every step after it is loaded into a fresh engine)."""

    def __init__(self, case, engine):
        opt = getattr(engine, "optimizer", None)
        self.opt = opt if applies(case) and hasattr(opt, "muon_momentum_buffer_partitioned_groups_flat") else None

    @property
    def active(self) -> bool:
        return self.opt is not None

    def check_step(self, step: int) -> list[str]:
        if not self.active:
            return []
        opt = self.opt
        resident = opt.muon_momentum_buffer_partitioned_groups_flat  # INTERNAL
        if not resident:
            return [f"step {step}: save_muon_momentum_buffer_in_memory is on but no Muon sub-group has a "
                    "resident momentum buffer"]
        notes = []
        for i, buf in sorted(resident.items()):
            state = opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[i], {})  # INTERNAL
            if state.get("momentum_buffer") is not buf:
                notes.append(f"step {step}: sub-group {i}: optimizer.state's momentum_buffer is not the resident "
                             "buffer (a checkpoint saves, and a load restores, another tensor than the step uses)")
            want = int(opt.fp16_partitioned_groups_flat_numel[i])  # INTERNAL
            if buf.numel() != want:
                notes.append(f"step {step}: sub-group {i}: the resident momentum holds {buf.numel()} elements, "
                             f"not its partition's {want} (its storage was released, as a swap-out does)")
        notes += self._swapped_files(step)
        return notes

    def _swapped_files(self, step: int) -> list[str]:
        folder = getattr(getattr(self.opt, "optimizer_swapper", None), "swap_folder", None)
        if not folder or not os.path.isdir(folder):
            return []
        found = sorted(f for f in os.listdir(folder) if f.startswith(MOMENTUM_FILE_PREFIX))
        if not found:
            return []
        return [f"step {step}: the resident Muon momentum reached the swap folder: {', '.join(found)}"]

    def close(self) -> None:
        self.opt = None
