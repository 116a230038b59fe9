"""ZeRO-3: Muon state and arithmetic in fp32, per-group ``ns_method``.

``z3-fp32-muon-state`` (DSM-001 ZeRO-3 part, DSM-005, DSM-009):

* ``_create_momentum_buffer`` makes the Muon momentum in ``communication_data_type`` (fp16/bf16 by
  default); the fix makes it fp32.
* no offload (``_apply_muon_to_accumulated_grads`` -> ``_muon_update_sub_group``): stock gathers the
  gradient and momentum in ``communication_data_type``, runs Muon there and copies the update back
  into the ``gradient_accumulation_dtype`` gradient partition (rounded to 16 bit). The fix gathers
  in fp32 and replaces the Muon parameters' entries of ``averaged_gradients`` by fp32 partitions of
  the update, which ``_prepare_fp32_grad_for_sub_group`` flattens into the fp32 master gradient.
  It also writes the padded tail of the last rank's momentum partition in the momentum's dtype
  (stock: ``gradient_accumulation_dtype``, DSM-009).
* cpu/nvme offload (``_apply_muon_updates_cpu_offload``): stock gathers the fp32 offloaded gradient
  and the momentum *into gradient_accumulation_dtype*, forms ``g/S`` and ``S*O`` there (fp16: ``S*O``
  overflows once ``S*max|O| > 65504`` -- a spurious skip and backoff, DSM-005 -- and ``g/S`` flushes
  gradients below ~6e-5 to subnormals), and stores the momentum in ``communication_data_type``. The
  fix does all of it in fp32.

``z3-per-group-ns-method`` (DSM-006): without offload every Muon sub-group uses
``self.muon_ns_method``, the *last* Muon param group's value (``_create_fp16_partitions_with_defragmentation``).
The fix reads ``ns_method`` (and ``momentum``) from the sub-group's own param group, as the offload
path already does.

``z3-momentum-tail-past-end`` (DSM-017): without offload, ``_muon_update_sub_group`` writes each rank's
share of a Muon matrix's momentum back through ``buffer[:n - start] = gathered[start:n]`` whenever the
share runs past the matrix's ``n`` elements. For a rank whose share starts *past* the end (``start =
r q > n``, e.g. a 1x5 matrix on 4 ranks: q = 2, rank 3 starts at 6) ``n - start`` is negative, the
left side is ``q - (start - n)`` elements long and the right side empty: a RuntimeError on that rank
at the first optimizer step (the other ranks then wait in the next collective). The fix writes
``max(0, n - start)`` elements: such a rank's share is all padding, and its momentum stays zero.
"""
from __future__ import annotations

import math

import torch

from harness.fixes._registry import Fix, Target, active, muon_input_scale
from harness.fixes.units import UNITS

FP32 = "z3-fp32-muon-state"
NS = "z3-per-group-ns-method"
TAIL = "z3-momentum-tail-past-end"
MOD = "deepspeed.runtime.zero.stage3"
CLS = "DeepSpeedZeroOptimizer_Stage3"


def _fp32_momentum(self, i):
    """Make sub-group ``i``'s Muon momentum fp32 wherever it is held (a buffer created by stock code or
    restored from a checkpoint may be 16 bit); returns it (None if it does not exist yet)."""
    fp32_flat = self.fp32_partitioned_groups_flat[i]
    st = self.optimizer.state.get(fp32_flat)
    inmem = getattr(self, "muon_momentum_buffer_partitioned_groups_flat", None)
    if self.save_muon_momentum_buffer_in_memory and inmem is not None and i in inmem:
        buf = inmem[i]
        if buf.dtype != torch.float32:
            new = buf.to(torch.float32)
            new.requires_grad = False
            new.swappable = False
            new.ds_id = getattr(buf, "ds_id", None)
            inmem[i] = new
            if st is not None and st.get("momentum_buffer") is buf:
                st["momentum_buffer"] = new
            buf = new
        return buf
    if st is None or st.get("momentum_buffer") is None:
        return None
    buf = st["momentum_buffer"]
    if buf.dtype != torch.float32 and buf.numel() > 0:
        st["momentum_buffer"] = buf = buf.to(torch.float32)
    return buf


def make_create_momentum_buffer(orig):

    def _create_momentum_buffer(self, num_elements, i, ds_id):
        if not active(FP32):
            return orig(self, num_elements, i, ds_id)
        if self.use_muon and self.sub_groups_using_muon[i]:
            buf = torch.zeros(num_elements, device=self.device, dtype=torch.float32)
            buf.requires_grad = False
            if self.save_muon_momentum_buffer_in_memory:
                buf.swappable = False
                self.muon_momentum_buffer_partitioned_groups_flat[i] = buf
                self.muon_momentum_buffer_partitioned_groups_flat[i].ds_id = ds_id
            if self.fp32_partitioned_groups_flat[i] not in self.optimizer.state:
                self.optimizer.state[self.fp32_partitioned_groups_flat[i]] = {}
            self.optimizer.state[self.fp32_partitioned_groups_flat[i]]["momentum_buffer"] = buf

    return _create_momentum_buffer


def _beta_and_ns(self, i):
    if active(NS):
        group = self.optimizer.param_groups[self.sub_group_to_group_id[i]]
        return group["momentum"], group.get("ns_method", "gram")
    return self.muon_beta, getattr(self, "muon_ns_method", "gram")


def make_muon_update_sub_group(orig):

    def _muon_update_sub_group(self, i, group_items, communication_data_type):
        """Stock 0.19.8 ``_muon_update_sub_group`` (stage3.py:1697-1819) with: fp32 gather/momentum
        (FP32), the padded tail kept in the momentum's dtype (FP32), per-group beta/ns_method (NS)."""
        fp32, ns, units, tail = active(FP32), active(NS), active(UNITS), active(TAIL)
        if not (fp32 or ns or units or tail):
            return orig(self, i, group_items, communication_data_type)
        # only the non-offload path calls this: gradients and momentum carry the loss scale
        with muon_input_scale(float(self.loss_scale) if units else None):
            if not (fp32 or ns or tail):
                return orig(self, i, group_items, communication_data_type)
            return _sub_group(self, i, group_items, communication_data_type, fp32)

    return _muon_update_sub_group


def _sub_group_momentum(self, i, fp32):
    """Swap the sub-group's optimizer state in where it is swapped, create the momentum where it is
    missing; (swapped, the momentum buffer: fp32 under FP32)."""
    swapped = self._swappable_optimizer_subgroup(i) and not self.save_muon_momentum_buffer_in_memory
    if swapped:
        self.optimizer_swapper.swap_in_optimizer_state(parameter=self.fp32_partitioned_groups_flat[i])
    if not self.save_muon_momentum_buffer_in_memory and \
            "momentum_buffer" not in self.optimizer.state.get(self.fp32_partitioned_groups_flat[i], {}):
        self._create_momentum_buffer(self.fp16_partitioned_groups_flat_numel[i], i,
                                     self.fp32_partitioned_groups_flat[i].ds_id)
    if fp32:
        state_buffer = _fp32_momentum(self, i)
    elif self.save_muon_momentum_buffer_in_memory:
        state_buffer = self.muon_momentum_buffer_partitioned_groups_flat[i]
    else:
        state_buffer = self.optimizer.state[self.fp32_partitioned_groups_flat[i]]["momentum_buffer"]
    return swapped, state_buffer


def _sub_group_round(round_params, round_grads, round_momentums, beta, ns_method, process_group):
    """One round of up to world-size matrices: rank r runs Muon on the r-th, then every rank gathers
    every updated gradient and momentum (padded to the largest when the shapes differ)."""
    from deepspeed import comm as dist  # rank side: DeepSpeed
    from deepspeed.runtime.zero.muon.original_muon import muon_update  # late: DeepSpeed, rank side

    world_sz = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    round_count = len(round_grads)
    numels = [g.numel() for g in round_grads]
    uniform_shape = round_count == world_sz and all(g.shape == round_grads[0].shape for g in round_grads)

    if rank < round_count:
        param = round_params[rank]
        g = round_grads[rank]
        m = round_momentums[rank]
        update = muon_update(g, m, beta=beta, ns_method=ns_method,
                             num_heads=getattr(param, 'muon_num_heads', None))
        g.data.copy_(update, non_blocking=False)

    if uniform_shape:
        local_grad = round_grads[rank]
        local_momentum = round_momentums[rank]
        grad_out = round_grads
        momentum_out = round_momentums
    else:
        max_numel = max(numels)
        if rank < round_count:
            local_grad = torch.zeros(max_numel, dtype=g.dtype, device=g.device)
            local_grad[:g.numel()] = g.view(-1)
            local_momentum = torch.zeros(max_numel, dtype=m.dtype, device=m.device)
            local_momentum[:m.numel()] = m.view(-1)
        else:
            ref_grad = round_grads[0]
            ref_momentum = round_momentums[0]
            local_grad = torch.zeros(max_numel, dtype=ref_grad.dtype, device=ref_grad.device)
            local_momentum = torch.zeros(max_numel, dtype=ref_momentum.dtype, device=ref_momentum.device)
        grad_out = [torch.empty_like(local_grad) for _ in range(world_sz)]
        momentum_out = [torch.empty_like(local_momentum) for _ in range(world_sz)]

    grad_handle = dist.all_gather(grad_out, local_grad, group=process_group, async_op=True)
    momentum_handle = dist.all_gather(momentum_out, local_momentum, group=process_group, async_op=True)
    momentum_handle.wait()
    grad_handle.wait()
    if not uniform_shape:
        for grad, momentum, gathered_grad, gathered_momentum in zip(round_grads, round_momentums, grad_out,
                                                                    momentum_out):
            grad.data.copy_(gathered_grad[:grad.numel()].view_as(grad), non_blocking=False)
            momentum.view(-1).data.copy_(gathered_momentum[:momentum.numel()], non_blocking=False)


def _store_momentum_shares(self, i, group_items, gathered_params_momentums, process_group, swapped, fp32):
    """Each rank's share of every matrix's new momentum back into its partition (the padded tail in
    the momentum's dtype under FP32; a share past the matrix's end written empty under TAIL)."""
    from deepspeed import comm as dist  # rank side: DeepSpeed

    world_sz = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    for idx, (param, dest_offset, grad) in enumerate(group_items):
        gathered_momentum = gathered_params_momentums[idx]
        chunk_sz = math.ceil(grad.numel() / world_sz)
        start_offset = rank * chunk_sz
        end_offset = start_offset + chunk_sz
        if end_offset > grad.numel():
            tail_dtype = gathered_momentum.dtype if fp32 else self.gradient_accumulation_dtype
            buffer_to_update = torch.zeros(chunk_sz, device=grad.device, dtype=tail_dtype)
            real = max(0, grad.numel() - start_offset) if active(TAIL) else grad.numel() - start_offset
            buffer_to_update[:real] = gathered_momentum.view(-1).data[start_offset:grad.numel()]
        else:
            buffer_to_update = gathered_momentum.view(-1).data[start_offset:end_offset]
        if swapped:
            self.optimizer.state[self.fp32_partitioned_groups_flat[i]]["momentum_buffer"].narrow(
                0, dest_offset, param.partition_numel()).data.copy_(buffer_to_update, non_blocking=False)
        elif self.save_muon_momentum_buffer_in_memory:
            self.muon_momentum_buffer_partitioned_groups_flat[i].narrow(
                0, dest_offset, param.partition_numel()).data.copy_(buffer_to_update, non_blocking=False)
            self.optimizer.state[self.fp32_partitioned_groups_flat[i]][
                "momentum_buffer"] = self.muon_momentum_buffer_partitioned_groups_flat[i]
        else:
            self.optimizer.state[self.fp32_partitioned_groups_flat[i]]["momentum_buffer"].narrow(
                0, dest_offset, param.partition_numel()).data.copy_(buffer_to_update, non_blocking=False)


def _sub_group(self, i, group_items, communication_data_type, fp32):
    from deepspeed import comm as dist  # rank side: DeepSpeed

    if fp32:
        communication_data_type = torch.float32
    params = [param for param, _, _ in group_items]
    grads = [grad for _, _, grad in group_items]
    if not params:
        return

    swapped, state_buffer = _sub_group_momentum(self, i, fp32)
    momentum_buffer = []
    for param, dest_offset, _ in group_items:
        momentum_buffer.append(state_buffer.narrow(0, dest_offset, param.partition_numel()).clone())

    gathered_params_momentums = self._partitioned_buffers_all_gather(params, momentum_buffer,
                                                                     communication_data_type)
    beta, ns_method = _beta_and_ns(self, i)

    process_group = self._get_sub_group_process_group(i)
    world_sz = dist.get_world_size(process_group)
    for base_i in range(0, len(params), world_sz):
        _sub_group_round(params[base_i:base_i + world_sz], grads[base_i:base_i + world_sz],
                         gathered_params_momentums[base_i:base_i + world_sz], beta, ns_method, process_group)
    _store_momentum_shares(self, i, group_items, gathered_params_momentums, process_group, swapped, fp32)
    if swapped:
        self.optimizer_swapper.swap_out_optimizer_state(parameter=self.fp32_partitioned_groups_flat[i])


def make_apply_muon_to_accumulated_grads(orig):

    def _apply_muon_to_accumulated_grads(self):
        """Stock (stage3.py:1821-1858) with fp32 gather and fp32 update partitions (FP32)."""
        if not active(FP32) or not self.use_muon or self.offload_optimizer:
            return orig(self)
        from deepspeed import comm as dist  # late: DeepSpeed, rank side

        for i, group in enumerate(self.fp16_groups):
            if not self.sub_groups_using_muon[i] or not group:
                continue
            self.sub_groups_lacking_loss_scale.add(i)
            rank = dist.get_rank(group=self._get_sub_group_process_group(i))
            partitions = self.averaged_gradients[i]
            start = 0
            while start < len(group):
                end, numel = start, 0
                while end < len(group) and (end == start or numel + group[end].ds_numel <= self.reduce_bucket_size):
                    numel += group[end].ds_numel
                    end += 1
                params, chunk = group[start:end], partitions[start:end]
                full_grads = self._partitioned_buffers_all_gather(params, chunk, torch.float32)
                group_items = [(param, self.grad_position[self.get_param_id(param)][1], full_grad)
                               for param, full_grad in zip(params, full_grads)]
                self._muon_update_sub_group(i, group_items, torch.float32)
                for k, (param, partition, update) in enumerate(zip(params, chunk, full_grads)):
                    offset = rank * param.partition_numel()
                    num_elements = max(0, min(param.partition_numel(), param.ds_numel - offset))
                    local = torch.zeros(param.partition_numel(), dtype=torch.float32, device=partition.device)
                    if num_elements > 0:
                        local.narrow(0, 0, num_elements).copy_(update.reshape(-1).narrow(0, offset, num_elements))
                    partitions[start + k] = local  # the fp32 update replaces the 16-bit gradient partition
                start = end

    return _apply_muon_to_accumulated_grads


def _offload_momentum(self, sub_group_id, fp32_param, subgroup_numel):
    """(the sub-group's fp32 momentum, whether it was created just now: then it is zero, not gathered)."""
    if self.save_muon_momentum_buffer_in_memory:
        momentum = self.muon_momentum_buffer_partitioned_groups_flat.get(sub_group_id)
    else:
        state = self.optimizer.state.setdefault(fp32_param, {})
        momentum = state.get("momentum_buffer")
    momentum_was_created = momentum is None or momentum.numel() != subgroup_numel
    if momentum_was_created:
        self._create_momentum_buffer(subgroup_numel, sub_group_id, fp32_param.ds_id)
    return _fp32_momentum(self, sub_group_id), momentum_was_created


def _offload_gather(self, muon_params, fp32_param, momentum, momentum_was_created, device):
    """The full fp32 gradients and momenta of the sub-group's Muon matrices (stock: in
    gradient_accumulation_dtype)."""
    local_grad_parts = []
    local_momentum_parts = []
    for param in muon_params:
        _, dest_offset, _ = self.grad_position[self.get_param_id(param)]
        numel = param.partition_numel()
        local_grad_parts.append(fp32_param.grad.narrow(0, dest_offset, numel).to(device))
        if not momentum_was_created:
            local_momentum_parts.append(momentum.narrow(0, dest_offset, numel).to(device))
    if momentum_was_created:
        full_grads = self._partitioned_buffers_all_gather(muon_params, local_grad_parts, torch.float32)
        return full_grads, [torch.zeros_like(full_grad) for full_grad in full_grads]
    return self._partitioned_buffers_all_gather(muon_params, local_grad_parts, torch.float32,
                                                additional_buffers_to_allgather=local_momentum_parts)


def _offload_update_param(self, param, full_grad, full_momentum, fp32_param, momentum, optimizer_group,
                          loss_scale, device):
    """Muon on one full matrix; this rank's partition of the update (times S) into the fp32 gradient, of
    the momentum into its buffer, and the update's norm for clipping."""
    from deepspeed.runtime.zero.muon.original_muon import muon_update  # rank side: DeepSpeed
    from deepspeed.runtime.zero.utils import get_norm_dtype  # late: DeepSpeed, rank side

    update = muon_update(full_grad,
                         full_momentum,
                         beta=optimizer_group["momentum"],
                         ns_method=optimizer_group.get("ns_method", "gram"),
                         is_expert_group=getattr(param, "is_expert_group", False),
                         num_heads=getattr(param, "muon_num_heads", None))
    partition_numel = param.partition_numel()
    partition_rank = self._get_param_partition_rank(param)
    start = partition_rank * partition_numel
    real_numel = min(partition_numel, max(0, param.ds_numel - start))
    local_update = torch.zeros(partition_numel, dtype=torch.float32, device=device)
    if real_numel > 0:
        local_update[:real_numel].copy_(update.reshape(-1).narrow(0, start, real_numel))
    _, dest_offset, _ = self.grad_position[self.get_param_id(param)]
    scaled_local_update = local_update * loss_scale if loss_scale != 1.0 else local_update
    fp32_param.grad.narrow(0, dest_offset,
                           partition_numel).copy_(scaled_local_update.to(fp32_param.grad.dtype))
    local_momentum = torch.zeros(partition_numel, dtype=torch.float32, device=device)
    if real_numel > 0:
        local_momentum[:real_numel].copy_(full_momentum.reshape(-1).narrow(0, start, real_numel))
    momentum.narrow(0, dest_offset, partition_numel).copy_(local_momentum.to(momentum.dtype))
    self.norm_for_param_grads[self.get_param_id(param)] = scaled_local_update.to(get_norm_dtype()).norm(2)


def _offload_sub_group(self, sub_group_id, muon_params, device):
    if self._swappable_optimizer_subgroup(sub_group_id):
        self._optimizer_states_and_gradient_swap_in(sub_group_id)

    fp32_param = self.fp32_partitioned_groups_flat[sub_group_id]
    subgroup_numel = int(self.fp16_partitioned_groups_flat_numel[sub_group_id])
    momentum, momentum_was_created = _offload_momentum(self, sub_group_id, fp32_param, subgroup_numel)
    full_grads, full_momentums = _offload_gather(self, muon_params, fp32_param, momentum, momentum_was_created,
                                                 device)
    loss_scale = float(self.loss_scale)
    if loss_scale != 1.0:
        for grad in full_grads:
            grad.div_(loss_scale)

    optimizer_group = self.optimizer.param_groups[self.sub_group_to_group_id[sub_group_id]]
    for param, full_grad, full_momentum in zip(muon_params, full_grads, full_momentums):
        _offload_update_param(self, param, full_grad, full_momentum, fp32_param, momentum, optimizer_group,
                              loss_scale, device)

    if self.save_muon_momentum_buffer_in_memory and fp32_param in self.optimizer.state:
        self.optimizer.state[fp32_param]["momentum_buffer"] = momentum

    if self._swappable_optimizer_subgroup(sub_group_id):
        self._writeback_swap_state(sub_group_id,
                                   write_opt_state=not self.save_muon_momentum_buffer_in_memory,
                                   write_gradients=True)


def make_apply_muon_updates_cpu_offload(orig):

    @torch.no_grad()
    def _apply_muon_updates_cpu_offload(self):
        """Stock (stage3.py:2588-2680) with the gather, g/S, the momentum and S*O in fp32 (FP32)."""
        if not active(FP32) or not self.use_muon:
            return orig(self)
        from deepspeed.accelerator import get_accelerator  # rank side: DeepSpeed

        accelerator_device = get_accelerator().current_device_name()
        for sub_group_id, params in enumerate(self.fp16_groups):
            muon_params = [param for param in params if getattr(param, "use_muon", False)]
            if muon_params:
                _offload_sub_group(self, sub_group_id, muon_params, accelerator_device)

    return _apply_muon_updates_cpu_offload


T_CREATE = Target(MOD, f"{CLS}._create_momentum_buffer", "8186c5a29fe28725", make_create_momentum_buffer)
T_SUBGROUP = Target(MOD, f"{CLS}._muon_update_sub_group", "5ccd645108e1cd1d", make_muon_update_sub_group)
T_ACCUM = Target(MOD, f"{CLS}._apply_muon_to_accumulated_grads", "b267fa92278f2641",
                 make_apply_muon_to_accumulated_grads)
T_OFFLOAD = Target(MOD, f"{CLS}._apply_muon_updates_cpu_offload", "8bf7b89176bda107",
                   make_apply_muon_updates_cpu_offload)

FIXES = (
    Fix(name=FP32, bugs=("DSM-001", "DSM-005", "DSM-009"),
        summary="ZeRO-3 keeps Muon's state and arithmetic in fp32 on every offload path",
        targets=(T_CREATE, T_SUBGROUP, T_ACCUM, T_OFFLOAD),
        notes="fp32 momentum doubles the 16-bit buffer; NVMe-swapped momentum was already swapped through fp32 "
              "buffers."),
    Fix(name=NS, bugs=("DSM-006",),
        summary="ZeRO-3 applies each Muon group's own `ns_method`",
        targets=(T_SUBGROUP,)),
    Fix(name=TAIL, bugs=("DSM-017",),
        summary="ZeRO-3 handles a rank whose share starts past a small Muon matrix's end",
        targets=(T_SUBGROUP,)),
)
