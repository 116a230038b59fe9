"""Gather, per optimizer step, the full (unpartitioned) values out of DeepSpeed's partitioned state.

Everything here runs on every rank and takes part in the same collectives in the same order; only
rank 0 assembles the ``StepRecord``. Public DeepSpeed helpers are used where they exist; every read of
an internal attribute is marked ``# INTERNAL`` with what it is.

What is read, per path (``path_kind``):

=================  ==========================================================================================
quantity           source
=================  ==========================================================================================
master (all)       ``deepspeed.utils.safe_get_full_fp32_param`` (Z1/2 & BF16_Optimizer: ``_hp_mapping``
                   fragment + all_reduce; Z3: partition all-gather, swapping an NVMe sub-group in and
                   releasing it again without writing back)
model (all)        ``param.data`` inside ``deepspeed.zero.GatheredParameters`` (a no-op below ZeRO-3)
Adam grad (all)    ``deepspeed.utils.safe_get_full_grad`` after the last micro-batch's backward, before the
                   boundary ``engine.step()``: the accumulated, DP-averaged gradient, still x S
Muon grad/update   the arguments / return value of ``original_muon.muon_update`` (wrapped for the case;
                   every DeepSpeed call site imports it from that module at call time). The grad is cloned
                   *before* the call because ``muon_update`` lerps it in place. The parameter is found in
                   the caller's frame (local ``param`` or ``tensor``, the names every call site uses)
momentum z12       ``opt.optimizer.state[flat]["momentum_buffer"]`` with ``flat =
                   opt.optimizer.param_groups[g]["params"][0]``: flat over the FULL tensors of
                   ``opt.params_in_partition[g]`` in that order (``stage_1_and_2.py:_muon_momentum_buffer``);
                   read after the step, i.e. the committed buffer (staged copy discarded on a skip)
momentum z12 off   ``opt.optimizer.state[opt.single_partition_of_fp32_groups[g]]["momentum_buffer"]``, the
                   fp32 partition layout; each param's slice located by its ``_hp_mapping``
                   (``hp_fragment_address`` in the partition, ``lp_fragment_address`` in the param) -- the
                   addressing checkpoints use, not the one the Muon writer uses, so a writer bug shows
momentum bf16opt   as z12 offload, with ``opt.fp32_groups_flat_partition[g]``
momentum z3        ``deepspeed.utils.safe_get_full_optimizer_state(p, "momentum_buffer")`` (partition layout
                   per sub-group, swapped in for NVMe); with ``save_muon_momentum_buffer_in_memory``
                   ``opt.muon_momentum_buffer_partitioned_groups_flat[sub_group]`` narrowed by
                   ``opt.grad_position[param_id]`` and all-gathered here
loss scale         ``engine.optimizer.loss_scale`` before the first micro-batch and after the step
skipped            ``not engine.was_step_applied()``
global norm        ``engine.get_global_grad_norm()``
swap bytes         ``SwapCounter``: every NVMe transfer of DeepSpeed's swappers goes through the two module
                   functions ``deepspeed.runtime.swap_tensor.utils.swap_in_tensors`` /
                   ``swap_out_tensors`` (imported by name into the optimizer/param swapper modules, so
                   each importing module's binding is wrapped); bytes = numel * element_size of each
                   buffer handed to ``aio_handle.async_pread/async_pwrite``. The capture's own swap-ins
                   are not counted.
=================  ==========================================================================================

Units (``grad_scale`` / ``momentum_scale`` = loss scale S the captured value still carries; S is the
scale used in this step's backward):

* z12 / z3 without offload: Muon grad and momentum x S (momentum: x S of *this* step; after a scale
  change it mixes units, semantics doc 4.2). Muon input dtype = model dtype (z12) / comm dtype (z3).
* z12 / z3 with cpu or nvme offload, and BF16_Optimizer: Muon grad and momentum in true units (1).
* Adam grad: x S on every path. Update: unit-free Newton-Schulz output, as returned.

``muon_calls`` (calls of ``muon_update`` per optimizer step, summed over ranks; per rank in
``muon_calls_per_rank``):

* z12 no offload: each matrix once per rank whose partition it touches (>= n_muon; a matrix
  straddling a partition boundary is computed by every owner).
* z12 cpu/nvme offload: every rank computes every matrix: W * n_muon.
* z3 no offload: round robin, each matrix on exactly one rank: n_muon.
* z3 cpu/nvme offload: every rank computes every matrix: W * n_muon.
* BF16_Optimizer: each matrix once per owning rank (like z12 no offload).
* A step skipped for a raw-gradient overflow makes no calls on the paths that check overflow before
  Muon (z12 offload, z3 fp16); z12 no offload has already run Muon inside the backward.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as tdist

from harness.trajectory import ParamStep, StepRecord

# ------------------------------------------------------------------------------------------------
# small helpers


def to_np(t: torch.Tensor | None) -> np.ndarray | None:
    if t is None:
        return None
    return t.detach().to(device="cpu", dtype=torch.float64).contiguous().numpy().copy()


def gather_to_rank0(obj, rank: int, world_size: int):
    """Python-object gather on the default (gloo) group; list on rank 0, None elsewhere."""
    if world_size == 1:
        return [obj]
    out = [None] * world_size if rank == 0 else None
    tdist.gather_object(obj, out, dst=0)
    return out


# ------------------------------------------------------------------------------------------------
# muon_update recorder


@dataclass
class MuonCall:
    name: str
    grad: np.ndarray  # input gradient, float64 copy of its values, taken before the call
    grad_dtype: str
    update: np.ndarray  # what muon_update returned
    momentum: np.ndarray  # momentum argument after the call (it is updated in place)
    momentum_dtype: str
    finite: bool


class MuonCallRecorder:
    """Wraps ``deepspeed.runtime.zero.muon.original_muon.muon_update`` while installed.

    Call sites do ``from deepspeed.runtime.zero.muon.original_muon import muon_update`` inside the
    function (``stage_1_and_2.py`` get_flat_partition / _apply_muon_updates_cpu_offload,
    ``stage3.py`` _muon_update_sub_group / _apply_muon_updates_cpu_offload, ``bf16_optimizer.py``
    _prepare_muon_updates), so replacing the module attribute reaches all of them.
    """

    CALLER_PARAM_LOCALS = ("param", "tensor")

    def __init__(self, id_to_name: dict[int, str] | None = None, keep_values: bool = True):
        self.id_to_name = id_to_name or {}
        self.keep_values = keep_values
        self.calls: list[MuonCall] = []
        self.count = 0
        self._orig = None
        self._module = None

    def set_params(self, named_params) -> None:
        self.id_to_name = {id(p): n for n, p in named_params}

    def reset(self) -> None:
        self.calls = []
        self.count = 0

    def _identify(self, frame, grad) -> str:
        loc = frame.f_locals
        for key in self.CALLER_PARAM_LOCALS:
            v = loc.get(key)
            if v is not None and id(v) in self.id_to_name:
                return self.id_to_name[id(v)]
        # Fallback: exactly one model parameter among the caller's locals with the grad's shape.
        cands = set()
        for v in loc.values():
            if isinstance(v, torch.nn.Parameter) and id(v) in self.id_to_name:
                shape = tuple(getattr(v, "ds_shape", v.shape))
                if shape == tuple(grad.shape):
                    cands.add(self.id_to_name[id(v)])
        if len(cands) == 1:
            return cands.pop()
        raise RuntimeError(f"muon_update called from {frame.f_code.co_filename}:{frame.f_lineno} "
                           f"({frame.f_code.co_name}); cannot tell which parameter (candidates {sorted(cands)})")

    def _wrapper(self, grad, momentum, *args, **kwargs):
        frame = sys._getframe(1)
        try:
            name = self._identify(frame, grad)
        finally:
            del frame
        grad_in = grad.detach().clone() if self.keep_values else None
        update = self._orig(grad, momentum, *args, **kwargs)
        self.count += 1
        if self.keep_values:
            self.calls.append(MuonCall(
                name=name,
                grad=to_np(grad_in),
                grad_dtype=str(grad_in.dtype).replace("torch.", ""),
                update=to_np(update),
                momentum=to_np(momentum),
                momentum_dtype=str(momentum.dtype).replace("torch.", ""),
                finite=bool(torch.isfinite(grad_in).all()),
            ))
        else:
            self.calls.append(MuonCall(name, None, "", None, None, "", True))
        return update

    def __enter__(self):
        from deepspeed.runtime.zero.muon import original_muon

        self._module = original_muon
        self._orig = original_muon.muon_update
        original_muon.muon_update = self._wrapper
        return self

    def __exit__(self, *exc):
        if self._module is not None:
            self._module.muon_update = self._orig
        self._module = None
        return False


# ------------------------------------------------------------------------------------------------
# NVMe swap byte counter


SWAP_MODULES = (
    "deepspeed.runtime.swap_tensor.utils",
    "deepspeed.runtime.swap_tensor.optimizer_utils",
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.async_swapper",
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
)


class SwapCounter:
    """Counts bytes DeepSpeed hands to the aio handle for NVMe reads and writes.

    All optimizer/parameter swapping in DeepSpeed 0.19.8 goes through
    ``swap_tensor.utils.swap_in_tensors(handle, buffers, paths)`` (``handle.async_pread``) and
    ``swap_out_tensors`` (``handle.async_pwrite``), each importing module holding its own binding;
    every binding is wrapped. The byte count is of the buffers submitted (whole, IO-aligned
    buffers: what reaches the file).
    """

    def __init__(self):
        self.written = 0
        self.read = 0
        self.paused = 0
        self._saved: list = []

    def reset(self) -> tuple[int, int]:
        w, r = self.written, self.read
        self.written = self.read = 0
        return w, r

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    @staticmethod
    def _nbytes(buffers) -> int:
        return sum(int(b.numel()) * int(b.element_size()) for b in buffers)

    def __enter__(self):
        import importlib

        from deepspeed.runtime.swap_tensor import utils as swap_utils

        orig_in, orig_out = swap_utils.swap_in_tensors, swap_utils.swap_out_tensors
        counter = self

        def swap_in_tensors(swap_handle, tensor_buffers, swap_paths):
            tensor_buffers = list(tensor_buffers)
            if not counter.paused:
                counter.read += counter._nbytes(tensor_buffers)
            return orig_in(swap_handle, tensor_buffers, swap_paths)

        def swap_out_tensors(swap_handle, tensor_buffers, swap_paths):
            tensor_buffers = list(tensor_buffers)
            if not counter.paused:
                counter.written += counter._nbytes(tensor_buffers)
            return orig_out(swap_handle, tensor_buffers, swap_paths)

        for modname in SWAP_MODULES:
            mod = importlib.import_module(modname)
            for attr, new in (("swap_in_tensors", swap_in_tensors), ("swap_out_tensors", swap_out_tensors)):
                if hasattr(mod, attr):
                    self._saved.append((mod, attr, getattr(mod, attr)))
                    setattr(mod, attr, new)
        return self

    def __exit__(self, *exc):
        for mod, attr, old in reversed(self._saved):
            setattr(mod, attr, old)
        self._saved = []
        return False


# ------------------------------------------------------------------------------------------------
# path detection


@dataclass
class PathInfo:
    kind: str  # "z12", "z12_offload", "z3", "z3_offload", "bf16_opt", "other"
    stage: int
    offload: bool
    muon_true_units: bool  # Muon grad/momentum divided by S before Muon
    notes: list[str] = field(default_factory=list)


def path_info(engine) -> PathInfo:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        off = bool(opt.offload_optimizer)  # INTERNAL: True for cpu and nvme optimizer offload
        return PathInfo("z3_offload" if off else "z3", 3, off, off)
    if isinstance(opt, DeepSpeedZeroOptimizer):
        off = bool(opt.cpu_offload)  # INTERNAL: True for cpu and nvme (stage 1/2 treat nvme as cpu)
        return PathInfo("z12_offload" if off else "z12", stage, off, off)
    if isinstance(opt, BF16_Optimizer):
        return PathInfo("bf16_opt", stage, False, True)
    return PathInfo("other", stage, False, False)


# ------------------------------------------------------------------------------------------------
# momentum readers (per rank -> fragments)

# A fragment is (name, flat_offset_in_param, float64 values); rank 0 assembles them.


def _z12_momentum_fragments(engine, info: PathInfo, id_to_name, rank: int):
    opt = engine.optimizer
    frags, dtypes = [], {}
    if info.kind == "z12":
        for g, params in enumerate(opt.params_in_partition):  # INTERNAL: bit16 params touching this rank's partition
            if not params or not getattr(params[0], "use_muon", False):
                continue
            flat = opt.optimizer.param_groups[g]["params"][0]  # INTERNAL: the fp32 partition (state key)
            buf = opt.optimizer.state.get(flat, {}).get("momentum_buffer")  # INTERNAL: committed Muon momentum
            if buf is None:
                continue
            off = 0
            for p in params:
                n = p.numel()
                name = id_to_name[id(p)]
                frags.append((name, 0, to_np(buf.narrow(0, off, n))))
                dtypes[name] = str(buf.dtype).replace("torch.", "")
                off += n
        return frags, dtypes
    # partition layout: z12_offload (single_partition_of_fp32_groups) or bf16_opt (fp32_groups_flat_partition)
    flats = (opt.single_partition_of_fp32_groups if info.kind == "z12_offload"  # INTERNAL
             else opt.fp32_groups_flat_partition)  # INTERNAL (BF16_Optimizer)
    groups = opt.bit16_groups if info.kind == "z12_offload" else opt.bf16_groups  # INTERNAL
    for g, params in enumerate(groups):
        if not params or not getattr(params[0], "use_muon", False):
            continue
        buf = opt.optimizer.state.get(flats[g], {}).get("momentum_buffer")
        if buf is None:
            continue
        for p in params:
            m = getattr(p, "_hp_mapping", None)  # INTERNAL: set for params with a fragment on this rank
            if m is None:
                continue
            hp, lp = m.hp_fragment_address, m.lp_fragment_address  # INTERNAL: (start, numel) in partition / param
            name = id_to_name[id(p)]
            frags.append((name, int(lp.start), to_np(buf.narrow(0, int(hp.start), int(hp.numel)))))
            dtypes[name] = str(buf.dtype).replace("torch.", "")
    return frags, dtypes


def _z3_momentum(engine, p, swap: SwapCounter):
    """Full momentum of one ZeRO-3 Muon param (collective). Returns (tensor, dtype-string)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    opt = engine.optimizer
    group_idx, dest_offset, num_elements = opt.grad_position[opt.get_param_id(p)]  # INTERNAL: (sub-group, offset, numel)
    if getattr(opt, "save_muon_momentum_buffer_in_memory", False):  # INTERNAL config mirror
        buf = opt.muon_momentum_buffer_partitioned_groups_flat.get(group_idx)  # INTERNAL
        if buf is None:  # same on every rank: created on all of them at once
            return None, None
        local = buf.narrow(0, dest_offset, num_elements).to(torch.float32).contiguous()
        group = opt._get_param_partition_group(p)  # INTERNAL: the group p is partitioned over
        out = torch.empty(local.numel() * tdist.get_world_size(group), dtype=torch.float32)
        tdist.all_gather_into_tensor(out, local, group=group)
        # rank r holds elements [r * ceil(n/W), (r+1) * ceil(n/W)) of the flattened parameter
        return out.narrow(0, 0, p.ds_numel).view(p.ds_shape), str(buf.dtype).replace("torch.", "")
    # INTERNAL: the sub-group's fp32 partition is the optimizer-state key. The entry survives a swap-out
    # (only its storage is released), so its presence can be tested without swapping in; it is
    # absent until Muon first ran for a swapped sub-group (created lazily, stage3.py:1122-1124).
    st = opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[group_idx], {})
    if "momentum_buffer" not in st:
        return None, None
    if opt._swappable_optimizer_subgroup(group_idx):  # INTERNAL
        # After the first swap-in the buffer lives in the swapper's fp32 pinned buffers (it is
        # created in communication_data_type, swapped out through fp32 buffers and comes back fp32).
        dtype = "float32(nvme-swapped)"
    else:
        dtype = str(st["momentum_buffer"].dtype).replace("torch.", "")
    with swap.pause():
        full = safe_get_full_optimizer_state(p, "momentum_buffer")
    return full, dtype


# ------------------------------------------------------------------------------------------------
# the per-step capture


@dataclass
class PreStep:
    """What has to be read before the boundary ``engine.step()``."""

    loss_scale: float
    adam_grads: dict  # name -> np (rank 0 only meaningful)


def loss_scale_of(engine) -> float:
    opt = engine.optimizer
    s = getattr(opt, "loss_scale", None)
    if s is None:
        s = getattr(opt, "cur_scale", 1.0)
    return float(s) if s is not None else 1.0


def capture_adam_grads(engine, case, named: dict, swap: SwapCounter) -> dict:
    """Accumulated, averaged, still-scaled gradient of every Adam param (collective)."""
    from deepspeed.utils import safe_get_full_grad

    out = {}
    with swap.pause():
        for ps in case.params:
            p = named[ps.name]
            if getattr(p, "use_muon", False):
                continue
            g = safe_get_full_grad(p)
            out[ps.name] = to_np(g.reshape(ps.shape)) if g is not None else None
    return out


def capture_masters(engine, case, named: dict, swap: SwapCounter) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    with swap.pause():
        for ps in case.params:
            v = safe_get_full_fp32_param(named[ps.name])
            out[ps.name] = to_np(v.reshape(ps.shape)) if v is not None else None
    return out


def capture_model_weights(engine, case, named: dict) -> dict:
    import deepspeed

    params = [named[ps.name] for ps in case.params]
    out = {}
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        for ps, p in zip(case.params, params):
            out[ps.name] = to_np(p.data.reshape(ps.shape))
    return out


def capture_step(engine, case, step: int, rank: int, world_size: int, *, named: dict, id_to_name: dict,
                 info: PathInfo, pre: PreStep, recorder: MuonCallRecorder, swap: SwapCounter,
                 losses: list[float]) -> StepRecord | None:
    """After the boundary ``engine.step()``: read everything, gather to rank 0, build the record."""
    skipped = not engine.was_step_applied()
    scale_after = loss_scale_of(engine)
    gn = engine.get_global_grad_norm()
    gn = None if gn is None else float(gn)
    written, read = swap.reset()
    calls, ncalls = recorder.calls, recorder.count
    recorder.reset()

    masters = capture_masters(engine, case, named, swap)
    model_w = capture_model_weights(engine, case, named)

    # momentum
    mom_frags, mom_dtypes, mom_full = [], {}, {}
    if info.kind in ("z12", "z12_offload", "bf16_opt"):
        mom_frags, mom_dtypes = _z12_momentum_fragments(engine, info, id_to_name, rank)
    elif info.kind in ("z3", "z3_offload"):
        for ps in case.params:
            p = named[ps.name]
            if not getattr(p, "use_muon", False):
                continue
            full, dt = _z3_momentum(engine, p, swap)
            if full is not None:
                mom_full[ps.name] = to_np(full.reshape(ps.shape)) if rank == 0 else None
                mom_dtypes[ps.name] = dt

    local = {
        "rank": rank,
        "calls": calls,
        "ncalls": ncalls,
        "mom_frags": mom_frags,
        "mom_dtypes": mom_dtypes,
        "losses": list(losses),
        "swap": (written, read),
    }
    gathered = gather_to_rank0(local, rank, world_size)
    if rank != 0:
        return None

    notes = []
    S = pre.loss_scale
    muon_scale = 1.0 if info.muon_true_units else S
    # Muon calls: first call per (rank, param) in rank order; duplicates checked for agreement.
    per_param_calls: dict[str, list[tuple[int, MuonCall]]] = {}
    for loc in gathered:
        for c in loc["calls"]:
            per_param_calls.setdefault(c.name, []).append((loc["rank"], c))
    for name, lst in per_param_calls.items():
        ranks = [r for r, _ in lst]
        if len(set(ranks)) != len(ranks):
            notes.append(f"step {step}: muon_update ran {len(ranks)} times for {name} (ranks {ranks})")
        ref = lst[0][1]
        for r, c in lst[1:]:
            for q in ("grad", "update", "momentum"):
                a, b = getattr(ref, q), getattr(c, q)
                if a.shape != b.shape or not np.array_equal(a, b, equal_nan=True):
                    notes.append(f"step {step}: muon_update {q} of {name} differs between rank {lst[0][0]} and rank {r}")

    # Momentum assembly from fragments (z12 paths).
    momentum: dict[str, np.ndarray] = dict(mom_full)
    if info.kind in ("z12", "z12_offload", "bf16_opt"):
        shapes = {ps.name: ps.shape for ps in case.params}
        flat: dict[str, np.ndarray] = {}
        covered: dict[str, np.ndarray] = {}
        for loc in gathered:
            for name, off, vals in loc["mom_frags"]:
                n = int(np.prod(shapes[name]))
                if name not in flat:
                    flat[name] = np.full(n, np.nan)
                    covered[name] = np.zeros(n, dtype=bool)
                seg = slice(off, off + vals.size)
                prev = flat[name][seg]
                both = covered[name][seg]
                if both.any() and not np.array_equal(prev[both], vals[both], equal_nan=True):
                    notes.append(f"step {step}: stored momentum of {name} differs between ranks")
                flat[name][seg] = vals
                covered[name][seg] = True
        for name, arr in flat.items():
            if not covered[name].all():
                notes.append(f"step {step}: stored momentum of {name} not fully covered by any rank")
            momentum[name] = arr.reshape(shapes[name])
        for loc in gathered:
            mom_dtypes.update(loc["mom_dtypes"])

    params: dict[str, ParamStep] = {}
    for ps in case.params:
        p = named[ps.name]
        is_muon = bool(getattr(p, "use_muon", False))
        if is_muon:
            lst = per_param_calls.get(ps.name)
            call = lst[0][1] if lst else None  # lowest rank's first call; repeats are noted above
            params[ps.name] = ParamStep(
                master=masters[ps.name],
                model=model_w[ps.name],
                grad=None if call is None else call.grad.reshape(ps.shape),
                grad_scale=muon_scale,
                momentum=momentum.get(ps.name),
                momentum_scale=muon_scale,
                momentum_dtype=mom_dtypes.get(ps.name),
                update=None if call is None else call.update.reshape(ps.shape),
                grad_dtype=None if call is None else call.grad_dtype,
            )
        else:
            params[ps.name] = ParamStep(
                master=masters[ps.name],
                model=model_w[ps.name],
                grad=pre.adam_grads.get(ps.name),
                grad_scale=S,
            )

    rec = StepRecord(
        step=step,
        loss_scale=S,
        loss_scale_after=scale_after,
        skipped=skipped,
        global_norm=gn,
        muon_calls=sum(loc["ncalls"] for loc in gathered),
        params=params,
        swap_bytes_written=sum(loc["swap"][0] for loc in gathered),
        swap_bytes_read=sum(loc["swap"][1] for loc in gathered),
        losses=[x for loc in gathered for x in loc["losses"]],
        muon_calls_per_rank=[loc["ncalls"] for loc in gathered],
        notes=notes,
    )
    return rec
