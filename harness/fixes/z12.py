"""ZeRO-1/2 without optimizer offload: where Muon runs inside the backward epilogue
(``stage_1_and_2.py`` ``get_flat_partition`` -> ``muon_update``).

One replacement of ``DeepSpeedZeroOptimizer.get_flat_partition`` carries two fixes:

* ``z12-fp32-muon-state`` (DSM-001, ZeRO-1/2 part). Stock feeds ``muon_update`` the accumulated
  gradient in the model dtype and sizes the momentum buffer after it
  (``_muon_momentum_buffer``: "the buffer has to follow the gradient"), so fp16/bf16 models keep an
  fp16/bf16 momentum, blend the Nesterov input in 16 bit, and get the Muon update back rounded to
  16 bit in the flat gradient partition. The fix hands ``muon_update`` fp32 copies of the gradients
  (an exact widening), which makes ``_muon_momentum_buffer`` convert the momentum (and with it the
  staged copy) to fp32, and builds the Muon group's flat partition in fp32, so the update reaches the
  fp32 gradient of the master partition unrounded. Norm, overflow test and ``step`` are dtype-agnostic.
* ``z12-nvme-refuse`` (DSM-002). ZeRO-1/2 accept ``offload_optimizer.device: nvme`` and silently run
  CPU offload (``__init__`` treats any device other than none as cpu). Implementing NVMe swapping for
  stage 1/2 is out of scope for a runtime patch; the fix turns the silent substitution into a clear
  refusal at engine construction, naming the cause and the alternatives, so nobody believes their
  optimizer state is on NVMe when it is in host memory.
* ``z12-per-head-with-alignment`` (DSM-008). With ``zero_optimization.parameter_alignment`` and at
  least one padded parameter the group takes the padded branch of ``get_flat_partition``, whose
  ``muon_update`` call does not pass ``num_heads`` (compare ``_get_flat_partition_unpadded``): per-head
  Muon silently becomes whole-matrix Muon. The fix runs the padded branch with ``num_heads``.
"""
from __future__ import annotations

import torch

from harness.fixes._registry import Fix, Refusal, Target, active, muon_input_scale
from harness.fixes.units import UNITS, sync_z12_group

FP32 = "z12-fp32-muon-state"
HEADS = "z12-per-head-with-alignment"
NVME_REFUSE = "z12-nvme-refuse"
NVME_REFUSAL = ("ZeRO stage 1/2 do not implement NVMe optimizer offload: DeepSpeed 0.19.8 would silently run "
                "CPU offload instead (bug DSM-002). Use offload_optimizer.device 'cpu', or ZeRO stage 3 for NVMe.")

MOD = "deepspeed.runtime.zero.stage_1_and_2"


def _padded_with_heads(self, tensor_list, first_offset, partition_size, dtype, device, param_group_idx,
                       return_tensor_list):
    """Stock 0.19.8 padded branch of ``get_flat_partition`` (stage_1_and_2.py:2734-2791) with the one
    change that ``muon_update`` receives ``num_heads`` like the unpadded branch does."""
    from deepspeed import comm as dist  # late: DeepSpeed, rank side

    flat_tensor_list = []
    current_size = 0
    flatten_copy = self.optimizer.param_groups[param_group_idx]['params'][0]
    staged_momentum = None
    if self._is_muon_group(tensor_list):
        self._muon_momentum_buffer(tensor_list, param_group_idx, dtype, device)
        self.groups_lacking_loss_scale.add(param_group_idx)
        staged_momentum = self._muon_staging_momentum(flatten_copy, param_group_idx)

    partition_id = dist.get_rank(group=self.real_dp_process_group[param_group_idx])
    buffer_idx = 0
    from deepspeed.runtime.zero.muon.original_muon import muon_update  # late: DeepSpeed, rank side
    for i, tensor in enumerate(tensor_list):
        grad_accum = self.all_grad_tensors[param_group_idx][i]
        if getattr(tensor, 'use_muon', False) and 'muon' in self.optimizer.__class__.__name__.lower():
            assert tensor.ndim > 1, f"if use muon, then tensor dim > 1, got {tensor.size()}"
            buffer = torch.narrow(staged_momentum, 0, buffer_idx, tensor.numel()).view(tensor.size())
            ns_method = self.optimizer.param_groups[param_group_idx].get('ns_method', 'gram')
            grad_accum = muon_update(grad_accum,
                                     buffer,
                                     self.optimizer.param_groups[param_group_idx]['momentum'],
                                     ns_method=ns_method,
                                     is_expert_group=getattr(tensor, 'is_expert_group', False),
                                     num_heads=getattr(tensor, 'muon_num_heads', None))
        tensor = grad_accum
        buffer_idx += tensor.numel()
        param_id = self.get_param_id(tensor_list[i])
        tensor_offset = self.grad_start_offset[param_group_idx][partition_id][param_id]
        dest_offset = self.grad_partition_insertion_offset[param_group_idx][partition_id][param_id]
        num_elements = min(tensor.numel() - tensor_offset, partition_size - dest_offset)

        if dest_offset > current_size:
            pad = torch.zeros(dest_offset - current_size, dtype=dtype, device=device)
            pad._zero_padding = True
            flat_tensor_list.append(pad)

        if tensor_offset > 0 or num_elements < tensor.numel():
            flat_tensor_list.append(tensor.contiguous().view(-1).narrow(0, int(tensor_offset), int(num_elements)))
        else:
            flat_tensor_list.append(tensor)

        current_size = dest_offset + num_elements

    if current_size < partition_size:
        pad = torch.zeros(int(partition_size - current_size), dtype=dtype, device=device)
        pad._zero_padding = True
        flat_tensor_list.append(pad)

    if return_tensor_list:
        return flat_tensor_list
    return self.flatten(flat_tensor_list)


def make_get_flat_partition(orig):

    def get_flat_partition(self, tensor_list, first_offset, partition_size, dtype, device, param_group_idx,
                           return_tensor_list=False):
        fp32, heads, units = active(FP32), active(HEADS), active(UNITS)
        if not (fp32 or heads or units) or len(tensor_list) == 0 or not self._is_muon_group(tensor_list):
            return orig(self, tensor_list, first_offset, partition_size, dtype, device, param_group_idx,
                        return_tensor_list)
        # the accumulated gradient here still carries this step's loss scale (the momentum too)
        with muon_input_scale(float(self.loss_scale) if units else None):
            return _get_flat_partition(self, orig, fp32, heads, tensor_list, first_offset, partition_size, dtype,
                                       device, param_group_idx, return_tensor_list)

    return get_flat_partition


def _get_flat_partition(self, orig, fp32, heads, tensor_list, first_offset, partition_size, dtype, device,
                        param_group_idx, return_tensor_list):
    sync_z12_group(self, param_group_idx)  # momentum into this step's loss-scale units (UNITS only)
    if fp32:
        grads = self.all_grad_tensors.get(param_group_idx)
        if grads is not None:
            # exact widening; muon_update then works (and keeps its momentum) in fp32
            self.all_grad_tensors[param_group_idx] = [g.float() for g in grads]
        dtype = torch.float32
    partition_size = int(partition_size)
    if heads and any(self.round_robin_bit16_padding[param_group_idx]):
        return _padded_with_heads(self, tensor_list, first_offset, partition_size, dtype, device,
                                  param_group_idx, return_tensor_list)
    return orig(self, tensor_list, first_offset, partition_size, dtype, device, param_group_idx,
                return_tensor_list)


GET_FLAT_PARTITION = Target(MOD, "DeepSpeedZeroOptimizer.get_flat_partition", "d01c98d11989f902",
                            make_get_flat_partition)

def make_init(orig):
    def __init__(self, *args, **kwargs):
        if active(NVME_REFUSE):
            cfg = kwargs.get("offload_optimizer_config")
            device = getattr(getattr(cfg, "device", None), "value", getattr(cfg, "device", None))
            if device == "nvme":
                raise Refusal(NVME_REFUSAL)
        return orig(self, *args, **kwargs)

    __init__.__wrapped__ = orig
    return __init__


INIT = Target(MOD, "DeepSpeedZeroOptimizer.__init__", "a381470af4e9e679", make_init)

FIXES = (
    Fix(name=NVME_REFUSE, bugs=("DSM-002",),
        summary=("ZeRO-1/2 with `offload_optimizer.device: nvme` raise a `ValueError` naming the cause and the "
                 "alternatives (a refusal, not an implementation)"),
        targets=(INIT,),
        notes="A refusal, not an implementation: the engine raises ValueError naming the cause before anything "
              "is allocated."),
    Fix(name=FP32, bugs=("DSM-001",),
        summary=("ZeRO-1/2 without offload keep the Muon momentum, its blend and the update in fp32 "
                 "(`get_flat_partition`)"),
        targets=(GET_FLAT_PARTITION,),
        notes="Costs one fp32 copy of each Muon matrix gradient per step on the owning ranks, and an fp32 "
              "momentum (2x the 16-bit one)."),
    Fix(name=HEADS, bugs=("DSM-008",),
        summary="ZeRO-1/2 keep per-head Muon with `parameter_alignment`",
        targets=(GET_FLAT_PARTITION,)),
)
