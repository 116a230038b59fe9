"""``bf16-optimizer-muon-norm`` (DSM-013): the BF16_Optimizer route (bf16 + ``grad_accum_dtype: fp32`` +
ZeRO-1, no offload) takes the global norm over the raw gradients, clips them before Muon and reports
that norm, while every ZeRO path takes the norm over what the optimizer applies (the Muon updates and
the Adam gradients) and clips that.

The fix reorders ``BF16_Optimizer.step`` for a Muon optimizer: the raw-gradient norm is still taken
first, only to detect a non-finite step (skipped as stock does); then the gradients are handed to the
fp32 partitions, Muon runs on the unclipped gradients (``_prepare_muon_updates`` writes each rank's
slice of every update into its partition), and the norm is taken over the partitions -- which tile the
flat groups without overlap (padding zeroed), so one all-reduce of the squared local norms over the
data-parallel group gives the global norm of the Muon updates and Adam gradients. That norm is
reported and clips the partitions (``clip_tensors_by_global_norm``: max_norm / (norm + 1e-6), as the
ZeRO paths scale). Then the inner step and the rest of stock ``step``. MoE layers keep stock behaviour.

``bf16-optimizer-per-head`` (DSM-030): ``_prepare_muon_updates`` calls ``muon_update`` without
``num_heads``, so a matrix tagged ``muon_num_heads`` is orthogonalised whole. The stock loop is kept: while
it runs, the head counts of its matrices are published in its own call order (its Muon groups, then each
group's ``local_matrices`` of the exchange layout, tags read from the model parameters as ZeRO's call sites
read them, at the step), and ``original_muon``'s binding of ``muon_update`` (``harness.fixes.muon``) passes
the next one, checking the matrix's shape against it.
"""
from __future__ import annotations

import torch

from harness.fixes._registry import Fix, Target, active
from harness.fixes.muon import BF16_HEADS, T_MUON_UPDATE

NAME = "bf16-optimizer-muon-norm"
HEADS = "bf16-optimizer-per-head"


def make_step(orig):
    @torch.no_grad()
    def step(self, closure=None):
        if not (active(NAME) and getattr(self, "_uses_muon", False)) or self.has_moe_layers or closure is not None:
            return orig(self, closure)
        from deepspeed import comm as dist  # late: DeepSpeed, rank side
        from deepspeed.runtime.utils import (clip_tensors_by_global_norm, get_global_norm_of_tensors,
                                             is_invalid_grad_norm)  # late: DeepSpeed, rank side

        self.overflow = False
        raw, _ = self.get_grads_for_norm()
        raw_norm = get_global_norm_of_tensors(input_tensors=raw, mpu=self.mpu, norm_type=self.norm_type)
        if is_invalid_grad_norm(raw_norm):
            self.overflow = True
            self._global_grad_norm = float("inf")
            self.clear_hp_grads()
            self.clear_lp_grads()
            return
        for param_partition, grad_partition in zip(self.fp32_groups_flat_partition,
                                                   self.fp32_groups_gradient_flat_partition):
            param_partition.grad = grad_partition.to(
                param_partition.dtype) if grad_partition.dtype != param_partition.dtype else grad_partition
        self._prepare_muon_updates()
        grads = [p.grad for p in self.fp32_groups_flat_partition]
        local = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
        dist.all_reduce(local, group=self.real_dp_process_group[0])
        norm = local.sqrt()
        self._global_grad_norm = norm
        if self.clip_grad > 0.:
            clip_tensors_by_global_norm(input_tensors=grads, max_norm=self.clip_grad, global_norm=norm, mpu=self.mpu)
        self.optimizer.step()
        if self.grad_acc_dtype is not torch.float32:
            for param_partition in self.fp32_groups_flat_partition:
                param_partition.grad = None
        self._lazy_init_hp_params_optimizer_state()
        self.update_lp_params()
        self.clear_hp_grads()

    return step


def _heads_in_call_order(self) -> list:
    """(shape, head count) of each matrix ``_prepare_muon_updates`` orthogonalises, in its loop's order."""
    out = []
    for group_index, group in enumerate(self.optimizer.param_groups):
        if not group.get("use_muon", False):
            continue
        params = self.bf16_groups[group_index]
        for param_index, *_ in self._muon_exchange_layouts[group_index]["local_matrices"]:
            p = params[param_index]
            out.append((tuple(p.shape), getattr(p, "muon_num_heads", None)))
    return out


def make_prepare_muon_updates(orig):
    def _prepare_muon_updates(self):
        if not active(HEADS):
            return orig(self)
        outer, BF16_HEADS[0] = BF16_HEADS[0], iter(_heads_in_call_order(self))
        try:
            return orig(self)
        finally:
            BF16_HEADS[0] = outer

    return _prepare_muon_updates


T_STEP = Target("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer.step", "2106bc88c518d5fb", make_step)
T_PREPARE = Target("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer._prepare_muon_updates", "f89b0d1bea8b5b20",
                   make_prepare_muon_updates)

FIXES = (
    Fix(name=NAME, bugs=("DSM-013",),
        summary=("the BF16_Optimizer route runs Muon on the unclipped gradients, then takes the norm (one all-reduce "
                 "of the partitions' squared norms) and the clip over the Muon updates and Adam gradients, as the "
                 "ZeRO paths do"),
        targets=(T_STEP,)),
    # the binding that passes the head counts is original_muon's muon_update
    Fix(name=HEADS, bugs=("DSM-030",),
        summary=("the BF16_Optimizer route passes each matrix's `muon_num_heads` to `muon_update` (published in the "
                 "stock loop's own call order, checked against the matrix's shape)"),
        targets=(T_PREPARE, T_MUON_UPDATE)),
)
