"""Checkpoint resume and NVMe housekeeping (ZeRO-3).

``z3-inmemory-momentum-resume`` (DSM-007). With ``save_muon_momentum_buffer_in_memory`` the Muon
update reads and writes ``muon_momentum_buffer_partitioned_groups_flat[i]``; the checkpoint restores
the momentum into ``optimizer.state[fp32_partition]["momentum_buffer"]``
(``_rigid_load_state_dict`` -> ``torch.optim.Optimizer.load_state_dict``, which builds new tensors).
Nothing reconnects the two, so after ``load_checkpoint`` Muon continues from the fresh engine's zero
momentum and then overwrites the restored one. The fix copies the restored momentum into the
resident buffer and points the optimizer state back at it.

``nvme-resume-unswapped-state`` (DSM-010). With ``offload_optimizer.device = nvme``
``DeepSpeedEngine.load_checkpoint`` skips ``_load_zero_checkpoint`` altogether (engine.py:4456) and
only copies the swap files back. Everything that is *not* in a swap file is therefore not restored:
sub-groups below the swap threshold (``MIN_AIO_BYTES`` = 1 MiB per rank, kept in memory) keep the fresh
model's fp32 masters, model weights and optimizer state (Adam m/v/step, Muon momentum); the
in-memory Muon momentum of every sub-group (``save_muon_momentum_buffer_in_memory``) is lost; and the
dynamic loss scaler restarts from its initial state. The fix, after the stock load, reads this
rank's ZeRO checkpoint file (which the save did write) and restores exactly those pieces.

``nvme-swap-cleanup`` (DSM-011). ``DeepSpeedZeroOptimizer_Stage3.destroy`` leaves the optimizer swap
files (``<nvme_path>/zero_stage_3/optimizer/rank<r>/*.tensor.swp``, as large as the swapped optimizer
state) on disk. The fix deletes the swap files this optimizer's swapper created, and its rank folder
if that is then empty.
"""
from __future__ import annotations

import os

import torch

from harness.fixes._registry import Fix, Target, active

INMEM = "z3-inmemory-momentum-resume"
NVME_RESUME = "nvme-resume-unswapped-state"
SWAP_CLEANUP = "nvme-swap-cleanup"

Z3_MOD, Z3 = "deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"
ENGINE_MOD = "deepspeed.runtime.engine"


def _relink_inmemory_momentum(opt, restored_state_of=None) -> int:
    """Copy the restored Muon momentum of every Muon sub-group into the resident in-memory buffer and
    make the optimizer state point at that buffer again. Returns how many sub-groups were relinked."""
    inmem = getattr(opt, "muon_momentum_buffer_partitioned_groups_flat", None)
    if not (getattr(opt, "use_muon", False) and opt.save_muon_momentum_buffer_in_memory and inmem is not None):
        return 0
    n = 0
    for i, uses in enumerate(opt.sub_groups_using_muon):
        if not uses or i not in inmem:
            continue
        fp32_flat = opt.fp32_partitioned_groups_flat[i]
        st = opt.optimizer.state.get(fp32_flat)
        restored = restored_state_of(i) if restored_state_of is not None else (
            st.get("momentum_buffer") if st is not None else None)
        if restored is None or not torch.is_tensor(restored):
            continue
        buf = inmem[i]
        if restored is not buf:
            if restored.numel() != buf.numel():
                raise RuntimeError(f"restored Muon momentum of sub-group {i} has {restored.numel()} elements, "
                                   f"the resident buffer {buf.numel()}")
            buf.data.copy_(restored.reshape(-1).to(buf.dtype))
        if st is None:
            opt.optimizer.state[fp32_flat] = st = {}
        st["momentum_buffer"] = buf
        n += 1
    return n


def make_rigid_load_state_dict(orig):

    def _rigid_load_state_dict(self, state_dict, load_optimizer_states=True):
        out = orig(self, state_dict, load_optimizer_states=load_optimizer_states)
        if active(INMEM) and load_optimizer_states:
            _relink_inmemory_momentum(self)
        return out

    return _rigid_load_state_dict


# ------------------------------------------------------------------------------------------------
# NVMe resume


def _resolve_tag(engine, load_dir, tag):
    if tag is not None:
        return tag
    latest = os.path.join(load_dir, "latest_universal" if engine.load_universal_checkpoint() else "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return f.read().strip()
    return None


def _live_params_by_saved_index(opt):
    """torch's optimizer state_dict numbers parameters in param-group order; ZeRO-3 fills the groups
    with the fp32 sub-group partitions just for the save (``_set_fp32_optimizer_param_groups``)."""
    opt._set_fp32_optimizer_param_groups()
    try:
        return [list(g["params"]) for g in opt.optimizer.param_groups]
    finally:
        opt._clear_fp32_optimizer_param_groups()


def restore_unswapped_state(engine, load_dir, tag) -> dict:
    """Restore, from this rank's ZeRO checkpoint file, what the NVMe resume path leaves out."""
    from deepspeed import comm as dist  # late: DeepSpeed, rank side
    # late: DeepSpeed, rank side
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

    opt = engine.optimizer
    sd_list = engine._get_all_zero_checkpoints(load_dir, tag)
    if sd_list is None:
        return {"restored": False, "why": "no ZeRO checkpoint files"}
    sd = sd_list[dist.get_rank(group=opt.dp_process_group)]
    if sd is None or sd.get(OPTIMIZER_STATE_DICT) is None:
        return {"restored": False, "why": "no state for this rank"}
    report = {"restored": True, "subgroups": [], "momentum": 0, "loss_scaler": False}
    # as the stock load does: work on partitioned parameters, then re-gather the persistent ones (small
    # parameters ZeRO-3 keeps whole on every rank), or the forward would keep using the stale values
    opt.checkpoint_event_prologue()
    try:
        _restore(opt, sd, report, LOSS_SCALER, OPTIMIZER_STATE_DICT, FP32_FLAT_GROUPS)
    finally:
        if len(opt.persistent_parameters) > 0:
            opt.persistent_parameters[0].partition(opt.persistent_parameters)
        opt.checkpoint_event_epilogue()
    return report


def _restore(opt, sd, report, LOSS_SCALER, OPTIMIZER_STATE_DICT, FP32_FLAT_GROUPS):

    if LOSS_SCALER in sd:
        opt.loss_scaler = sd[LOSS_SCALER]
        opt.dynamic_loss_scale = sd.get("dynamic_loss_scale", opt.dynamic_loss_scale)
        opt.overflow = sd.get("overflow", False)
        report["loss_scaler"] = True

    base = sd[OPTIMIZER_STATE_DICT]
    saved_state = base.get("state", {})
    live_groups = _live_params_by_saved_index(opt)
    sub_group_of = {id(p): i for i, p in enumerate(opt.fp32_partitioned_groups_flat)}
    saved_index_of_subgroup = {}
    for g, saved_group in enumerate(base.get("param_groups", [])):
        for j, idx in enumerate(saved_group["params"]):
            if g < len(live_groups) and j < len(live_groups[g]):
                i = sub_group_of.get(id(live_groups[g][j]))
                if i is not None:
                    saved_index_of_subgroup[i] = idx

    saved_fp32 = sd.get(FP32_FLAT_GROUPS)
    for i, fp32_flat in enumerate(opt.fp32_partitioned_groups_flat):
        if opt._swappable_optimizer_subgroup(i):
            continue  # lives in the swap files the stock load copied back
        if saved_fp32 is not None and i < len(saved_fp32) and saved_fp32[i].numel() == fp32_flat.numel():
            fp32_flat.data.copy_(saved_fp32[i].data)
            fp16_flat = opt.fp16_partitioned_groups_flat[i]
            if fp16_flat is not None and fp32_flat.numel() > 0:
                fp16_flat.data.copy_(fp32_flat.data)
                updated = opt.unflatten(fp16_flat, opt.fp16_partitioned_groups[i])
                for partitioned_param, q in zip(opt.fp16_partitioned_groups[i], updated):
                    partitioned_param.data = q.data
        idx = saved_index_of_subgroup.get(i)
        if idx is not None and idx in saved_state:
            live = opt.optimizer.state.setdefault(fp32_flat, {})
            for key, val in saved_state[idx].items():
                if torch.is_tensor(val):
                    cur = live.get(key)
                    if torch.is_tensor(cur) and cur.shape == val.shape and cur.numel() > 0:
                        cur.data.copy_(val.to(cur.dtype))
                    else:
                        live[key] = val.clone().to(fp32_flat.device)
                else:
                    live[key] = val
        report["subgroups"].append(i)

    def restored_momentum(i):
        idx = saved_index_of_subgroup.get(i)
        return saved_state.get(idx, {}).get("momentum_buffer") if idx is not None else None

    report["momentum"] = _relink_inmemory_momentum(opt, restored_momentum)


def make_load_checkpoint(orig):

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        out = orig(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                   load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
                   load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        load_path = out[0] if isinstance(out, tuple) else out
        if (active(NVME_RESUME) and load_path is not None and self.zero_optimization_stage() == 3
                and self.zero_nvme_offload_optimizer() and load_optimizer_states and not load_module_only
                and not self.load_universal_checkpoint()):
            resolved = _resolve_tag(self, load_dir, tag)
            if resolved is not None:
                self._dsm_nvme_resume_report = restore_unswapped_state(self, load_dir, resolved)
        return out

    return load_checkpoint


# ------------------------------------------------------------------------------------------------
# swap files after destroy


def make_destroy(orig):

    def destroy(self):
        try:
            return orig(self)
        finally:
            swapper = getattr(self, "optimizer_swapper", None)
            folder = getattr(swapper, "swap_folder", None)
            if active(SWAP_CLEANUP) and folder and os.path.isdir(folder):
                for name in os.listdir(folder):
                    if name.endswith(".tensor.swp"):
                        try:
                            os.remove(os.path.join(folder, name))
                        except FileNotFoundError:
                            pass
                try:
                    os.rmdir(folder)
                except OSError:
                    pass

    return destroy


T_RIGID_LOAD = Target(Z3_MOD, f"{Z3}._rigid_load_state_dict", "77da80dc68ede0da", make_rigid_load_state_dict)
T_LOAD_CKPT = Target(ENGINE_MOD, "DeepSpeedEngine.load_checkpoint", "b06341e8eb59be93", make_load_checkpoint)
T_DESTROY = Target(Z3_MOD, f"{Z3}.destroy", "1c8f6a96609fe60e", make_destroy)

FIXES = (
    Fix(name=INMEM, bugs=("DSM-007",),
        summary="`load_checkpoint` restores ZeRO-3's in-memory momentum",
        targets=(T_RIGID_LOAD,)),
    Fix(name=NVME_RESUME, bugs=("DSM-010", "DSM-007"),
        summary="ZeRO-3 NVMe resume restores the unswapped sub-groups, the in-memory momentum and the loss scaler",
        targets=(T_LOAD_CKPT,)),
    Fix(name=SWAP_CLEANUP, bugs=("DSM-011",),
        summary="`destroy()` removes the optimizer swap files",
        targets=(T_DESTROY,)),
)
