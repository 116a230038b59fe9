"""Gather, per optimizer step, the full (unpartitioned) values out of DeepSpeed's partitioned state.

Everything here runs on every rank and takes part in the same collectives in the same order; only
rank 0 assembles the ``StepRecord``. Public DeepSpeed helpers are used where they exist; every read of
an internal attribute is marked ``# INTERNAL`` with what it is.

Two capture modes give bit-identical trajectories (``cases/harness/test_capture_coalesced.py``):

* ``reference``: the table below literally -- one public-helper collective per parameter and quantity,
  and a gather to rank 0 after every step (~35 collectives per 3-step case, ~1 ms each on gloo).
* ``coalesced`` (the default, ``DEFAULT_CAPTURE_MODE``): each rank reads, with no collective, the
  same fragments/partitions the helpers start from, located the same way (Z1/2: ``_hp_mapping``;
  ZeRO-3: the public *local* helpers ``safe_get_local_fp32_param`` / ``safe_get_local_grad`` /
  ``safe_get_local_optimizer_state`` and ``ds_tensor``), keeps them until the case ends and ships them
  all to rank 0 in one object gather, where the helpers' assembly is redone (section "rank-local
  reads"). The case's only capture collective is that gather, so DeepSpeed runs exactly the
  collectives of an uncaptured run (``GatheredParameters`` would also re-partition persistent ZeRO-3
  params, which the next forward then gathers again).

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
  change it mixes units, docs/deepspeed-0.19.8.md section 5). Muon input dtype = model dtype (z12) /
  comm dtype (z3).
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
import hashlib
import math
import os
import pickle
import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as tdist

from harness.rank import capture_adapters
from harness.case.trajectory import ParamStep, StepRecord
from harness.rank.capture_adapters import group_name
import importlib

# ------------------------------------------------------------------------------------------------
# small helpers


def to_np(t: torch.Tensor | None) -> np.ndarray | None:
    if t is None:
        return None
    # one copy: ``copy=True`` makes a fresh tensor even when the source is already cpu float64
    return t.detach().to(device="cpu", dtype=torch.float64, copy=True).contiguous().numpy()


def gather_to_rank0(obj, rank: int, world_size: int):
    """Python-object gather on the default (gloo) group; list on rank 0, None elsewhere."""
    if world_size == 1:
        return [obj]
    out = [None] * world_size if rank == 0 else None
    tdist.gather_object(obj, out, dst=0)
    return out


GATHER_CHUNK_BYTES = 1 << 16


def gather_once_to_rank0(obj, rank: int, world_size: int):
    """``gather_to_rank0`` in ONE collective when every rank's pickle fits ``GATHER_CHUNK_BYTES``.

    ``gather_object`` costs two collectives (an all_gather of the sizes, then the gather). Here every
    rank sends a fixed-size frame (8-byte length + the first ``GATHER_CHUNK_BYTES`` of its pickle) in
    one gather; a rank whose pickle is longer sends the rest point-to-point, and rank 0, which learns
    the lengths from the frames, receives exactly those. Rank 0's own object is returned as is (not
    round-tripped through pickle). gloo only (the CPU pool); other backends use ``gather_to_rank0``.
    """
    if world_size == 1:
        return [obj]
    if tdist.get_backend() != "gloo":
        return gather_to_rank0(obj, rank, world_size)
    chunk = GATHER_CHUNK_BYTES
    frame = torch.zeros(8 + chunk, dtype=torch.uint8)
    data = b""
    if rank != 0:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        frame[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        head = data[:chunk]
        if head:
            frame[8:8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    frames = [torch.empty_like(frame) for _ in range(world_size)] if rank == 0 else None
    tdist.gather(frame, frames, dst=0)
    if rank != 0:
        if len(data) > chunk:
            tdist.send(torch.frombuffer(bytearray(data[chunk:]), dtype=torch.uint8), dst=0)
        return None
    out = [obj]
    for r in range(1, world_size):
        n = int(frames[r][:8].view(torch.int64)[0])
        body = frames[r][8:8 + min(n, chunk)].numpy().tobytes()
        if n > chunk:
            rest = torch.empty(n - chunk, dtype=torch.uint8)
            tdist.recv(rest, src=r)
            body += rest.numpy().tobytes()
        out.append(pickle.loads(body))
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
    # (grad, update, momentum) digests (``value_digest``), set where a rank's values are compared on rank
    # 0 without being shipped (``share_calls_once``); None: compare the arrays themselves.
    digest: tuple | None = None


def value_digest(a: np.ndarray | None) -> bytes | None:
    """Equal exactly when the shapes are equal and ``np.array_equal(a, b, equal_nan=True)`` holds:
    every NaN hashed as one NaN and -0.0 as 0.0 (``x + 0.0`` is +0.0 for either zero)."""
    if a is None:
        return None
    h = hashlib.sha256(repr((a.shape, str(a.dtype))).encode())  # sha256: hardware-assisted here, 1.7x blake2b
    c = a
    if a.dtype.kind == "f":
        c = a + 0.0
        nan = np.isnan(c)
        if nan.any():
            c[nan] = np.nan
    h.update(np.ascontiguousarray(c).reshape(-1).view(np.uint8))
    return h.digest()


def share_calls_once(pending: list[dict], rank: int, world_size: int, model_parallel: int = 1) -> None:
    """Before the case's one gather: keep a ``muon_update`` call's values only on the lowest rank that
    made it in that step (its first call there), and digests elsewhere.

    With optimizer offload every rank orthogonalises every matrix (``muon_calls`` above), and rank 0
    only checks that the copies agree (``_build_record``); shipping W full copies of each gradient,
    update and momentum to compare them was a third of rank 0's time on a 3-rank NVMe case (a 1 MiB
    per rank matrix). One small all-gather of the call names tells each rank which calls a lower
    rank already ships. Every rank must call this with its steps in the same order (collective). With
    model parallelism a record is assembled per replica (ranks ``k::model_parallel``), so a call counts
    as shipped only by a lower rank of the same replica."""
    if world_size == 1:
        return
    names = [[c.name for c in loc["calls"]] for loc in pending]
    everyone: list = [None] * world_size
    tdist.all_gather_object(everyone, names)
    replica = range(rank % model_parallel, world_size, model_parallel)
    for s, loc in enumerate(pending):
        below = {n for r in replica if r < rank for n in everyone[r][s]}
        made = Counter(n for r in replica for n in everyone[r][s])
        seen: set = set()
        for c in loc["calls"]:
            if c.grad is None and c.update is None:
                continue  # a count-only recorder: nothing to compare or ship
            if made[c.name] > 1:  # a call made once (no offload: one owner) has nothing to agree with
                c.digest = (value_digest(c.grad), value_digest(c.update), value_digest(c.momentum))
            if c.name in below or c.name in seen:
                c.grad = c.update = c.momentum = None
            seen.add(c.name)


INIT_CALL = "<during initialize>"


class MuonCallRecorder:
    """Wraps ``deepspeed.runtime.zero.muon.original_muon.muon_update`` while installed.

    Call sites do ``from deepspeed.runtime.zero.muon.original_muon import muon_update`` inside the
    function (``stage_1_and_2.py`` get_flat_partition / _apply_muon_updates_cpu_offload,
    ``stage3.py`` _muon_update_sub_group / _apply_muon_updates_cpu_offload, ``bf16_optimizer.py``
    _prepare_muon_updates), so replacing the module attribute reaches all of them.

    Also keeps the norm the engine's own clip computed (``engine_clip_norm``): without ZeRO in fp32,
    ``clip_fp32_gradients`` clips the gradients before Muon reads them and drops the norm
    ``clip_grad_norm_`` returned, so ``get_global_grad_norm()`` is None and the clip could not be undone
    from the captured gradient otherwise. The engine's binding is wrapped, the call itself unchanged.
    """

    CALLER_PARAM_LOCALS = ("param", "tensor", "p")
    # Without ZeRO, ``MuonWithAuxAdam.step`` calls the ``muon_update`` that ``muon_optimizer`` bound at
    # import (``from ...original_muon import muon_update``), with the parameter (or FP16_UnfusedOptimizer's
    # fp32 copy of it) in local ``p``: that binding is wrapped as well.
    EXTRA_BINDINGS = ("deepspeed.runtime.zero.muon.muon_optimizer",)

    def __init__(self, id_to_name: dict[int, str] | None = None, keep_values: bool = True):
        self.id_to_name = id_to_name or {}
        self.keep_values = keep_values
        self.calls: list[MuonCall] = []
        self.count = 0
        self.engine_clip_norm: float | None = None
        self._orig = None
        self._module = None
        self._engine_clip = None

    def set_params(self, named_params) -> None:
        self.id_to_name = {id(p): n for n, p in named_params}

    def reset(self) -> None:
        self.calls = []
        self.count = 0
        self.engine_clip_norm = None

    def _identify(self, frame, grad) -> str:
        if not self.id_to_name:
            # Before ``set_params``: a call inside ``deepspeed.initialize`` (FP16_UnfusedOptimizer's
            # ``initialize_optimizer_states`` steps once on zero gradients). Counted, named as such.
            return INIT_CALL
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

    # Frames of a catalogued mutant (``harness.registry.mutants``) installed between DeepSpeed and the
    # recorder: the parameter is in DeepSpeed's calling frame, above them.
    WRAPPER_MODULES = ("harness.registry.mutants",)

    def _caller(self, frame):
        while frame.f_back is not None and frame.f_globals.get("__name__") in self.WRAPPER_MODULES:
            frame = frame.f_back
        return frame

    def _wrapper(self, grad, momentum, *args, **kwargs):
        return self._record_from(self._caller(sys._getframe(1)), grad, momentum, args, kwargs)

    def _record_from(self, frame, grad, momentum, args, kwargs):
        """Identify the parameter from the caller's ``frame`` (dropped at once: frames hold tensors),
        then record the call."""
        try:
            name = self._identify(frame, grad)
        finally:
            del frame
        return self._record(name, grad, momentum, args, kwargs)

    def _record(self, name, grad, momentum, args, kwargs):
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

        from deepspeed.runtime.zero.muon import original_muon  # late: DeepSpeed, rank side

        # Imported first: a module imported after the replacement below would bind the wrapper itself.
        bindings = self.EXTRA_BINDINGS + capture_adapters.adapter_for().muon_bindings  # the release's own
        extra_mods = [importlib.import_module(m) for m in bindings]
        self._module = original_muon
        self._orig = original_muon.muon_update
        original_muon.muon_update = self._wrapper
        self._extra = []
        for mod in extra_mods:
            cur = getattr(mod, "muon_update", None)
            if cur is None:
                continue
            self._extra.append((mod, cur))
            mod.muon_update = self._make_extra(cur)
        self._wrap_engine_clip()
        return self

    def _wrap_engine_clip(self) -> None:
        from deepspeed.runtime import engine as ds_engine  # late: DeepSpeed, rank side

        cur = getattr(ds_engine, "clip_grad_norm_", None)
        if cur is None:
            return

        def clip_grad_norm_(*args, **kwargs):
            norm = cur(*args, **kwargs)
            self.engine_clip_norm = None if norm is None else float(norm)
            return norm

        self._engine_clip = (ds_engine, cur)
        ds_engine.clip_grad_norm_ = clip_grad_norm_

    def _make_extra(self, cur):
        """A wrapper for a module's own binding of ``muon_update`` (which may be a mutant or a fix, not
        ``self._orig``): recorded like the main one, but calling what that module had bound."""
        def muon_update(grad, momentum, *args, **kwargs):
            saved = self._orig
            self._orig = cur
            try:
                return self._record_from(self._caller(sys._getframe(1)), grad, momentum, args, kwargs)
            finally:
                self._orig = saved

        return muon_update

    def __exit__(self, *exc):
        if self._module is not None:
            self._module.muon_update = self._orig
        for mod, cur in reversed(getattr(self, "_extra", [])):
            mod.muon_update = cur
        self._extra = []
        if self._engine_clip is not None:
            mod, cur = self._engine_clip
            mod.clip_grad_norm_ = cur
            self._engine_clip = None
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

        from deepspeed.runtime.swap_tensor import utils as swap_utils  # late: DeepSpeed, rank side

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
    kind: str  # "z12", "z12_offload", "z3", "z3_offload", "bf16_opt", "z0", "other"
    stage: int
    offload: bool
    muon_true_units: bool  # Muon grad/momentum divided by S before Muon
    notes: list[str] = field(default_factory=list)


def path_info(engine) -> PathInfo:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # late: DeepSpeed, rank side
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3  # late: DeepSpeed, rank side
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # late: DeepSpeed, rank side

    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        off = bool(opt.offload_optimizer)  # INTERNAL: True for cpu and nvme optimizer offload
        from harness.env import versions

        # Muon inside the gradient reduce runs on the loss-scaled bucket (versions.z3_muon_placement); the
        # offload path that runs it in the step divides by S first.
        return PathInfo("z3_offload" if off else "z3", 3, off, off and versions.z3_muon_placement(True) == "step")
    if isinstance(opt, DeepSpeedZeroOptimizer):
        off = bool(opt.cpu_offload)  # INTERNAL: True for cpu and nvme (stage 1/2 treat nvme as cpu)
        return PathInfo("z12_offload" if off else "z12", stage, off, off)
    if isinstance(opt, BF16_Optimizer):
        return PathInfo("bf16_opt", stage, False, True)
    if stage == 0 and z0_muon_optimizer(engine) is not None:
        # No ZeRO: MuonWithAuxAdam itself (fp32) or under FP16_(Unfused)Optimizer (fp16/bf16), which
        # unscales the fp32 gradient copies before the inner step, so Muon sees true units.
        return PathInfo("z0", 0, False, True)
    return PathInfo("other", stage, False, False)


# ------------------------------------------------------------------------------------------------
# stage 0 (no ZeRO): where the fp32 master of each model parameter lives


def z0_muon_optimizer(engine):
    """The MuonWithAuxAdam an engine without ZeRO steps (bare, or inside FP16_(Unfused)Optimizer)."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # late: DeepSpeed, rank side

    opt = engine.optimizer
    for cand in (opt, getattr(opt, "optimizer", None)):
        if isinstance(cand, MuonWithAuxAdam):
            return cand
    return None


def z0_masters(engine) -> dict[int, torch.Tensor]:
    """id(model parameter) -> the fp32 tensor the optimizer steps, for an engine without ZeRO.

    fp32: the parameter itself. FP16_UnfusedOptimizer (fp16 and bf16 without ZeRO):
    ``fp32_groups[g][i]`` is the fp32 copy of ``fp16_groups[g][i]`` (``unfused_optimizer.py:__init__``).
    FP16_Optimizer (fused, flat fp32 groups) keeps no per-parameter copy: not mapped (None -> a
    missing-master failure, never a silent pass)."""
    opt = engine.optimizer
    out: dict[int, torch.Tensor] = {}
    lp_groups = getattr(opt, "fp16_groups", None)  # INTERNAL: model params per group (FP16_*Optimizer)
    hp_groups = getattr(opt, "fp32_groups", None)  # INTERNAL: their fp32 copies (FP16_UnfusedOptimizer)
    if lp_groups is not None:
        if hp_groups is None:
            return out
        for lps, hps in zip(lp_groups, hp_groups):
            for lp, hp in zip(lps, hps):
                out[id(lp)] = hp
        return out
    for group in opt.param_groups:
        for p in group["params"]:
            out[id(p)] = p
    return out


def z0_aliases(engine, named: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor) pairs so the Muon recorder can name the fp32 copy ``MuonWithAuxAdam.step``
    passes as ``p``."""
    m = z0_masters(engine)
    return [(n, m[id(p)]) for n, p in named.items() if id(p) in m and m[id(p)] is not p]


def _z0_momentum_fragments(engine, id_to_name, named: dict):
    """Every rank holds every momentum whole (``MuonWithAuxAdam.state[fp32 param]``); each rank sends
    its copy so rank 0 checks that the replicas agree."""
    inner = z0_muon_optimizer(engine)
    masters = z0_masters(engine)
    frags, dtypes = [], {}
    for name, p in named.items():
        if not getattr(p, "use_muon", False):
            continue
        hp = masters.get(id(p))
        buf = None if hp is None else inner.state.get(hp, {}).get("momentum_buffer")  # INTERNAL: Muon state
        if buf is None:
            continue
        frags.append((name, 0, to_np(buf.reshape(-1))))
        dtypes[name] = str(buf.dtype).replace("torch.", "")
    return frags, dtypes


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
                name = id_to_name.get(id(p))  # None: a parameter the capture does not follow (watch)
                if name is not None:
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
            name = id_to_name.get(id(p))
            if name is None:  # a parameter the capture does not follow (watch)
                continue
            frags.append((name, int(lp.start), to_np(buf.narrow(0, int(hp.start), int(hp.numel)))))
            dtypes[name] = str(buf.dtype).replace("torch.", "")
    return frags, dtypes


def _z3_momentum(engine, p, swap: SwapCounter):
    """Full momentum of one ZeRO-3 Muon param (collective). Returns (tensor, dtype-string)."""
    from deepspeed.utils import safe_get_full_optimizer_state  # late: DeepSpeed, rank side

    opt = engine.optimizer
    # INTERNAL: (sub-group, offset, numel)
    group_idx, dest_offset, num_elements = opt.grad_position[opt.get_param_id(p)]
    if getattr(opt, "save_muon_momentum_buffer_in_memory", False):  # INTERNAL config mirror
        buf = opt.muon_momentum_buffer_partitioned_groups_flat.get(group_idx)  # INTERNAL
        if buf is None:  # same on every rank: created on all of them at once
            return None, None
        local = buf.narrow(0, dest_offset, num_elements).to(torch.float32).contiguous()
        group = capture_adapters.z3_partition_group(opt, p)  # INTERNAL: the group p is partitioned over
        out = torch.empty(local.numel() * tdist.get_world_size(group), dtype=torch.float32)
        tdist.all_gather_into_tensor(out, local, group=group)
        # rank r holds elements [r * ceil(n/W), (r+1) * ceil(n/W)) of the flattened parameter
        return out.narrow(0, 0, p.ds_numel).view(p.ds_shape), str(buf.dtype).replace("torch.", "")
    dtype = _z3_state_momentum_dtype(opt, group_idx)
    if dtype is None:
        return None, None
    with swap.pause():
        full = safe_get_full_optimizer_state(p, "momentum_buffer")
    return full, dtype


def _momentum_by_path(engine, info, case, named, id_to_name, rank, z3_read):
    """(fragments, dtypes, ZeRO-3 values by name) of the Muon momentum on this path. ``z3_read(p)``
    gives a ZeRO-3 parameter's (value, dtype): this rank's piece (coalesced capture) or the gathered
    whole (reference capture)."""
    frags, dtypes, z3 = [], {}, {}
    if info.kind in ("z12", "z12_offload", "bf16_opt"):
        frags, dtypes = _z12_momentum_fragments(engine, info, id_to_name, rank)
    elif info.kind == "z0":
        frags, dtypes = _z0_momentum_fragments(engine, id_to_name, named)
    elif info.kind in ("z3", "z3_offload"):
        for ps in case.params:
            p = named[ps.name]
            if getattr(p, "use_muon", False):
                z3[ps.name], dtypes[ps.name] = z3_read(p)
    return frags, dtypes, z3


def _z3_state_momentum_dtype(opt, group_idx: int) -> str | None:
    """The storage dtype of a ZeRO-3 sub-group's optimizer-state momentum, None while it has none.

    INTERNAL: the sub-group's fp32 partition is the optimizer-state key. The entry survives a swap-out
    (only its storage is released), so its presence can be tested without swapping in; it is absent
    until Muon first ran for a swapped sub-group (created lazily, stage3.py:1122-1124). After the
    first swap-in the buffer lives in the swapper's fp32 pinned buffers (it is created in
    communication_data_type, swapped out through fp32 buffers and comes back fp32)."""
    st = opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[group_idx], {})
    if "momentum_buffer" not in st:
        return None
    if opt._swappable_optimizer_subgroup(group_idx):  # INTERNAL
        return "float32(nvme-swapped)"
    return str(st["momentum_buffer"].dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------------
# capture modes
#
# "reference": every quantity through the public helpers, one collective per parameter and quantity
#   (``safe_get_full_fp32_param`` / ``safe_get_full_grad``: an all_reduce on Z1/2, an all-gather on
#   ZeRO-3; ``GatheredParameters`` for the model weights), and a gather of the step to rank 0 after
#   every step. Simple and slow: on the CPU pool each collective costs ~1 ms, 30-40 per case.
# "coalesced" (default): every rank reads only what it holds -- the same fragments/partitions the
#   public helpers start from, located the same way -- with no collective at all during the case; the
#   pieces of every step travel to rank 0 in ONE object gather at the end of the case, where rank 0
#   redoes exactly the helpers' assembly (zero-filled float32 buffer + sum for Z1/2, concatenation in
#   partition-rank order cut to ``ds_numel`` for ZeRO-3). Bit-identical to "reference"
#   (cases/harness/test_capture_coalesced.py).

CAPTURE_MODES = ("coalesced", "reference")
# MUON_HARNESS_CAPTURE_MODE=reference (in the environment the ranks start with) switches a whole run
# back to the public-helper path, e.g. to rule the capture out when triaging a divergence.
DEFAULT_CAPTURE_MODE = os.environ.get("MUON_HARNESS_CAPTURE_MODE", "coalesced")
if DEFAULT_CAPTURE_MODE not in CAPTURE_MODES:
    raise ValueError(f"MUON_HARNESS_CAPTURE_MODE={DEFAULT_CAPTURE_MODE!r} is not one of {CAPTURE_MODES}")


def coalescing_blocker(engine, named: dict, world_size: int) -> str | None:
    """Why this engine's state cannot be read rank-locally (then the case runs in "reference" mode),
    or None. The assembly on rank 0 assumes every parameter is partitioned over the whole world in
    rank order, which is what every case here configures; anything else keeps the public helpers."""
    for name, p in named.items():
        if hasattr(p, "ds_id"):
            group = capture_adapters.z3_partition_group(engine.optimizer, p)  # the group p is partitioned over
            if tdist.get_world_size(group) != world_size:
                return f"{name} is partitioned over {tdist.get_world_size(group)} of {world_size} ranks"
        elif getattr(p, "_dp_group", None) is not None:  # INTERNAL: the group get_full_hp_param all_reduces over
            if tdist.get_world_size(p._dp_group) != world_size:
                return f"{name} is partitioned over {tdist.get_world_size(p._dp_group)} of {world_size} ranks"
    return None


def z3_model_needs_gather(engine) -> bool:
    """ZeRO-3 model weights whose local partition is not simply ``ds_tensor`` in memory (NVMe parameter
    offload, hpZ secondary partitions, quantized weights): read through ``GatheredParameters`` even in
    coalesced mode."""
    off = engine.zero_offload_param()
    dev = getattr(off, "device", None) if off else None
    return (str(dev).endswith("nvme") or engine.zero_hpz_partition_size() > 1 or bool(engine.zero_quantized_weights())
            or bool(engine.zero_quantized_nontrainable_weights()))


# ------------------------------------------------------------------------------------------------
# rank-local reads ("coalesced")
#
# A *piece* is what one rank contributes to one quantity of one parameter:
#   ("sum", [(flat_offset, float32 ndarray), ...])  Z1/2 and BF16_Optimizer. The public helper
#        (``tensor_fragment.get_full_hp_param`` / ``get_full_hp_grad``) zero-fills a float32 buffer of the
#        parameter's size, copies this rank's fragment in at ``lp_fragment_address.start`` and
#        all_reduces (SUM); rank 0 redoes that sum in float32 (0 + x, so even -0.0 -> +0.0 as in gloo).
#   ("cat", partition_rank, ndarray)  ZeRO-3. The helper (``stage3._fp32_state_allgather``, or the
#        parameter all-gather for model weights) all-gathers equal-sized partitions, rank r's at
#        r * size, into a buffer of the helper's dtype and cuts it to ``ds_numel``; rank 0 concatenates.
#   ("full", ndarray or None)  the value is whole on every rank (``param.grad``, Z1/2 model weights,
#        ZeRO-3 params that are already gathered): rank 0's own; other ranks send None.
#   None  the public helper returns None for this parameter.
# Arrays keep the dtype the helper's result has (float16/32/64; anything else as float64, exactly).

_NP_EXACT = (torch.float16, torch.float32, torch.float64)


def _np_exact(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype not in _NP_EXACT:
        t = t.to(torch.float64)  # bf16 and friends: float64 holds every value exactly
    return t.to("cpu").contiguous().numpy().copy()  # a copy: DeepSpeed reuses its buffers


def _hp_piece(p, grad: bool, index: int | None = None):
    """This rank's contribution to ``get_full_hp_param`` / ``get_full_hp_grad`` of a Z1/2 or
    BF16_Optimizer param, read the way those helpers read it (``utils/tensor_fragment.py``). ``index``:
    where the gradient list holds p's gradient, if not at ``p._index_in_param_group`` (BF16_Optimizer
    before 0.19.8, ``capture_adapters.bf16_grad_index``)."""
    m = p._hp_mapping  # INTERNAL: this rank's tensor_fragment of p; None when p has nothing in this partition
    if m is None:
        return ("sum", [])
    lp = m.lp_fragment_address  # INTERNAL: (start, numel) of the fragment inside the flattened p
    if grad:
        # INTERNAL: averaged_gradients / offload_gradient_dict entry of p (raises outside backward..step,
        # as the helper does); _index_in_param_group is p's index in that list
        index = p._index_in_param_group if index is None else index
        v = m.get_lp_grad_fragment(index).to(torch.float32).flatten()
        if v.numel() == p.numel():  # BF16_Optimizer keeps a full-size accumulation buffer
            v = v.narrow(0, int(lp.start), int(lp.numel))
    else:
        v = m.get_hp_fragment().to(torch.float32).flatten()  # INTERNAL: the fp32 master fragment
    if v.numel() != int(lp.numel):
        raise RuntimeError(f"fragment of {tuple(p.shape)} param has {v.numel()} elements, address says {lp.numel}")
    return ("sum", [(int(lp.start), _np_exact(v))])


def _cat_piece(opt, p, local: torch.Tensor, dtype: torch.dtype):
    group = capture_adapters.z3_partition_group(opt, p)  # INTERNAL: the group p is partitioned over
    return ("cat", tdist.get_rank(group), _np_exact(local.to(dtype)))


def _z3_helper_dtype(opt) -> torch.dtype:
    # INTERNAL: dtype of the buffer stage3._fp32_state_allgather gathers into (fp32 unless configured)
    return getattr(opt, "master_weights_and_grads_dtype", None) or torch.float32


def master_piece(engine, p):
    """Local counterpart of ``safe_get_full_fp32_param`` (same dispatch order)."""
    if hasattr(p, "ds_id"):
        from deepspeed.utils import safe_get_local_fp32_param

        v = safe_get_local_fp32_param(p)  # swaps an NVMe sub-group in and releases it, as the full helper
        return None if v is None else _cat_piece(engine.optimizer, p, v, _z3_helper_dtype(engine.optimizer))
    if hasattr(p, "_hp_mapping"):
        return _hp_piece(p, grad=False)
    if engine.zero_optimization_stage() == 0:
        hp = z0_masters(engine).get(id(p))  # no ZeRO: the whole fp32 master is on every rank
        return None if hp is None else ("full", _np_exact(hp))
    return None


def grad_piece(engine, p, rank: int):
    """Local counterpart of ``safe_get_full_grad`` (same dispatch order)."""
    if getattr(p, "_hp_grad", None) is not None:  # INTERNAL: BF16_Optimizer's accumulation buffer (tested first)
        return _hp_piece(p, grad=True, index=capture_adapters.bf16_grad_index(engine.optimizer, p))
    if p.grad is not None:
        return ("full", _np_exact(p.grad) if rank == 0 else None)
    if hasattr(p, "ds_id"):
        from deepspeed.utils import safe_get_local_grad

        v = safe_get_local_grad(p)
        return None if v is None else _cat_piece(engine.optimizer, p, v, _z3_helper_dtype(engine.optimizer))
    if hasattr(p, "_hp_mapping"):
        return _hp_piece(p, grad=True)
    return None


def model_piece(engine, p, rank: int):
    """Local counterpart of ``param.data`` inside ``GatheredParameters``: that gathers exactly the
    ZeRO-3 params that are NOT_AVAILABLE, by all-gathering their ``ds_tensor`` partitions."""
    if hasattr(p, "ds_id"):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if p.ds_status == ZeroParamStatus.NOT_AVAILABLE:  # INTERNAL: ZeRO-3 gather state of p
            group = capture_adapters.z3_partition_group(engine.optimizer, p)  # INTERNAL (== p.ds_process_group)
            # INTERNAL: p.ds_tensor is this rank's partition of the low-precision param, ds_tensor.ds_numel
            # elements (the last rank's zero-padded), exactly what the all-gather sends
            return ("cat", tdist.get_rank(group), _np_exact(p.ds_tensor))
    return ("full", _np_exact(p.data) if rank == 0 else None)


def z3_momentum_piece(engine, p, swap: SwapCounter):
    """Local counterpart of ``_z3_momentum``: (piece, dtype-string) or (None, None)."""
    from deepspeed.utils import safe_get_local_optimizer_state  # late: DeepSpeed, rank side

    opt = engine.optimizer
    # INTERNAL: (sub-group, offset, numel)
    group_idx, dest_offset, num_elements = opt.grad_position[opt.get_param_id(p)]
    if getattr(opt, "save_muon_momentum_buffer_in_memory", False):  # INTERNAL config mirror
        buf = opt.muon_momentum_buffer_partitioned_groups_flat.get(group_idx)  # INTERNAL
        if buf is None:
            return None, None
        return (_cat_piece(opt, p, buf.narrow(0, dest_offset, num_elements), torch.float32),
                str(buf.dtype).replace("torch.", ""))
    dtype = _z3_state_momentum_dtype(opt, group_idx)
    if dtype is None:
        return None, None
    with swap.pause():
        v = safe_get_local_optimizer_state(p, "momentum_buffer")
    return _cat_piece(opt, p, v, _z3_helper_dtype(opt)), dtype


def resolve_pieces(pieces: list, shape: tuple, what: str) -> np.ndarray | None:
    """Rank 0: the full float64 value from every rank's piece (rank order), as the helper builds it."""
    first = pieces[0]
    if first is None:
        return None
    kind = first[0]
    if kind == "full":
        return first[1].astype(np.float64).reshape(shape)
    if any(pc is None or pc[0] != kind for pc in pieces):
        # the public helper would have deadlocked or mixed collectives here
        kinds = [None if pc is None else pc[0] for pc in pieces]
        raise RuntimeError(f"{what}: ranks disagree on how the value is held: {kinds}")
    n = math.prod(shape)
    if kind == "sum":
        buf = np.zeros(n, dtype=np.float32)
        for pc in pieces:
            for off, vals in pc[1]:
                seg = buf[off:off + vals.size]
                seg += vals  # float32, in place: the all_reduce's 0 + x
        return buf.astype(np.float64).reshape(shape)
    parts = sorted(pieces, key=lambda pc: pc[1])
    if [pc[1] for pc in parts] != list(range(len(parts))) or len({pc[2].size for pc in parts}) != 1:
        raise RuntimeError(f"{what}: partitions do not tile: ranks {[pc[1] for pc in parts]}, "
                           f"sizes {[pc[2].size for pc in parts]}")
    flat = np.concatenate([pc[2] for pc in parts])
    if flat.size < n:
        raise RuntimeError(f"{what}: partitions hold {flat.size} elements, the parameter {n}")
    return flat[:n].astype(np.float64).reshape(shape)


def read_masters(engine, case, named: dict, swap: SwapCounter) -> dict:
    """Rank-local pieces of every master (no collective)."""
    with swap.pause():
        return {ps.name: master_piece(engine, named[ps.name]) for ps in case.params}


def read_adam_grads(engine, case, named: dict, swap: SwapCounter, rank: int) -> dict:
    """Rank-local pieces of every Adam param's gradient (no collective); before the boundary step. Also
    the Muon matrices' where the release steps them without ``muon_update`` (no call hands their
    gradient over: ``capture_adapters.muon_grads_before_step``)."""
    out = {}
    muon_too = capture_adapters.muon_grads_before_step(path_info(engine).kind)
    with swap.pause():
        for ps in case.params:
            p = named[ps.name]
            if muon_too or not getattr(p, "use_muon", False):
                out[ps.name] = grad_piece(engine, p, rank)
    return out


def resolve_all(per_rank: list[dict], case, what: str) -> dict:
    """Rank 0: {name: float64 array or None} from every rank's {name: piece}."""
    out = {}
    for ps in case.params:
        if ps.name in per_rank[0]:
            out[ps.name] = resolve_pieces([d[ps.name] for d in per_rank], tuple(ps.shape), f"{what} of {ps.name}")
    return out


# ------------------------------------------------------------------------------------------------
# the per-step capture


@dataclass
class PreStep:
    """What has to be read before the boundary ``engine.step()``."""

    loss_scale: float
    adam_grads: dict  # reference: name -> np (rank 0 only meaningful); coalesced: name -> this rank's piece
    group_lr: dict = field(default_factory=dict)  # param-group name -> lr, as the step will read it


def group_lrs(engine) -> dict:
    """The lr of every param group of the optimizer Muon and Adam step with (``basic_optimizer``, whose
    groups every ZeRO / fp16 wrapper shares), read before the boundary ``step()``: what the step uses.
    Keyed by the group's ``name`` (DeepSpeed names each Muon/Adam half, ``engine.py _muon_param_groups``)."""
    opt = engine.basic_optimizer  # INTERNAL: the MuonWithAuxAdam the engine built

    return {group_name(g, i): float(g["lr"]) for i, g in enumerate(opt.param_groups)}


def loss_scale_of(engine) -> float:
    opt = engine.optimizer
    s = getattr(opt, "loss_scale", None)
    if s is None:
        s = getattr(opt, "cur_scale", 1.0)
    return float(s) if s is not None else 1.0


def capture_adam_grads(engine, case, named: dict, swap: SwapCounter) -> dict:
    """Accumulated, averaged, still-scaled gradient of every Adam param (collective). Reference mode."""
    from deepspeed.utils import safe_get_full_grad  # late: DeepSpeed, rank side

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
    """Every master through ``safe_get_full_fp32_param`` (collective). Reference mode."""
    from deepspeed.utils import safe_get_full_fp32_param  # late: DeepSpeed, rank side

    out = {}
    with swap.pause():
        for ps in case.params:
            v = safe_get_full_fp32_param(named[ps.name])
            if v is None and engine.zero_optimization_stage() == 0:
                v = z0_masters(engine).get(id(named[ps.name]))  # no ZeRO: the helper knows no master
            out[ps.name] = to_np(v.reshape(ps.shape)) if v is not None else None
    return out


def capture_model_weights(engine, case, named: dict) -> dict:
    """Every model weight inside ``GatheredParameters`` (collective on ZeRO-3). Reference mode."""
    import deepspeed  # late: DeepSpeed, rank side

    params = [named[ps.name] for ps in case.params]
    out = {}
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        for ps, p in zip(case.params, params):
            out[ps.name] = to_np(p.data.reshape(ps.shape))
    return out


def _step_common(engine, recorder: MuonCallRecorder, swap: SwapCounter):
    skipped = not engine.was_step_applied()
    scale_after = loss_scale_of(engine)
    gn = engine.get_global_grad_norm()
    gn = None if gn is None else float(gn)
    written, read = swap.reset()
    calls, ncalls, clip_norm = recorder.calls, recorder.count, recorder.engine_clip_norm
    recorder.reset()
    return skipped, scale_after, (gn, clip_norm), written, read, calls, ncalls


def read_step(engine, case, step: int, rank: int, *, named: dict, id_to_name: dict, info: PathInfo,
              pre: PreStep, recorder: MuonCallRecorder, swap: SwapCounter, losses: list[float],
              gather_model: bool = False) -> dict:
    """Coalesced mode, after the boundary ``engine.step()``: everything this rank holds of the step, with
    no collective (``gather_model``: model weights through ``GatheredParameters``, a collective, for
    the layouts ``z3_model_needs_gather`` names). Rank 0 turns the list of every rank's dicts into
    the ``StepRecord`` with ``assemble_step``."""
    skipped, scale_after, gn, written, read, calls, ncalls = _step_common(engine, recorder, swap)
    masters = read_masters(engine, case, named, swap)
    if gather_model:
        full = capture_model_weights(engine, case, named)
        model_w = {k: ("full", v if rank == 0 else None) for k, v in full.items()}
    else:
        model_w = {ps.name: model_piece(engine, named[ps.name], rank) for ps in case.params}
    mom_frags, mom_dtypes, mom_z3 = _momentum_by_path(engine, info, case, named, id_to_name, rank,
                                                      lambda p: z3_momentum_piece(engine, p, swap))
    return {
        "rank": rank,
        "calls": calls,
        "ncalls": ncalls,
        "mom_frags": mom_frags,
        "mom_dtypes": mom_dtypes,
        "losses": list(losses),
        "swap": (written, read),
        # rank 0's values are the record's
        "step": step, "skipped": skipped, "scale_after": scale_after, "gn": gn,
        "loss_scale": pre.loss_scale, "kind": info.kind, "muon_true_units": info.muon_true_units,
        "group_lr": dict(pre.group_lr),
        "muon_names": frozenset(n for n, p in named.items() if getattr(p, "use_muon", False)),
        # pieces
        "adam": pre.adam_grads,
        "masters": masters,
        "model": model_w,
        "mom_z3": mom_z3,
    }


def assemble_step(case, gathered: list[dict]) -> StepRecord:
    """Rank 0, coalesced mode: the StepRecord from every rank's ``read_step`` dict (rank order)."""
    r0 = gathered[0]
    step = r0["step"]
    adam = resolve_all([g["adam"] for g in gathered], case, f"step {step}: Adam grad")
    masters = resolve_all([g["masters"] for g in gathered], case, f"step {step}: master")
    model_w = resolve_all([g["model"] for g in gathered], case, f"step {step}: model weight")
    mom_full = {}
    mom_dtypes = dict(r0["mom_dtypes"])
    for ps in case.params:
        if ps.name in r0["mom_z3"]:
            pcs = [g["mom_z3"].get(ps.name) for g in gathered]
            if pcs[0] is None:
                mom_dtypes.pop(ps.name, None)
                continue
            mom_full[ps.name] = resolve_pieces(pcs, tuple(ps.shape), f"step {step}: momentum of {ps.name}")
    return _build_record(case, gathered, step=step, kind=r0["kind"], muon_true_units=r0["muon_true_units"],
                         muon_names=r0["muon_names"], S=r0["loss_scale"], adam_grads=adam, masters=masters,
                         model_w=model_w, mom_full=mom_full, mom_dtypes=mom_dtypes, skipped=r0["skipped"],
                         scale_after=r0["scale_after"], gn=r0["gn"], group_lr=r0.get("group_lr", {}))


def capture_step(engine, case, step: int, rank: int, world_size: int, *, named: dict, id_to_name: dict,
                 info: PathInfo, pre: PreStep, recorder: MuonCallRecorder, swap: SwapCounter,
                 losses: list[float]) -> StepRecord | None:
    """Reference mode, after the boundary ``engine.step()``: read everything through the public helpers,
    gather to rank 0, build the record."""
    skipped, scale_after, gn, written, read, calls, ncalls = _step_common(engine, recorder, swap)

    masters = capture_masters(engine, case, named, swap)
    model_w = capture_model_weights(engine, case, named)

    # momentum (ZeRO-3: the gathered whole; a sub-group without a buffer yet records nothing)
    mom_frags, mom_dtypes, z3_full = _momentum_by_path(engine, info, case, named, id_to_name, rank,
                                                       lambda p: _z3_momentum(engine, p, swap))
    shapes = {ps.name: ps.shape for ps in case.params}
    mom_full = {}
    for name, full in z3_full.items():
        if full is None:
            del mom_dtypes[name]
        else:
            mom_full[name] = to_np(full.reshape(shapes[name])) if rank == 0 else None

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
    return _build_record(case, gathered, step=step, kind=info.kind, muon_true_units=info.muon_true_units,
                         muon_names={n for n, p in named.items() if getattr(p, "use_muon", False)},
                         S=pre.loss_scale, adam_grads=pre.adam_grads, masters=masters, model_w=model_w,
                         mom_full=mom_full, mom_dtypes=mom_dtypes, skipped=skipped, scale_after=scale_after, gn=gn,
                         group_lr=pre.group_lr)


def calls_by_param(gathered: list[dict], step: int) -> tuple[dict[str, list[tuple[int, MuonCall]]], list[str]]:
    """Every rank's ``muon_update`` calls of one step per parameter, in rank order, and a note for each
    parameter computed more than once on a rank and for each copy that disagrees with the lowest
    rank's first (by digest where ``share_calls_once`` left one, else by value)."""
    notes = []
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
            for i, q in enumerate(("grad", "update", "momentum")):
                if ref.digest is not None and c.digest is not None:
                    differs = ref.digest[i] != c.digest[i]
                else:
                    a, b = getattr(ref, q), getattr(c, q)
                    differs = a.shape != b.shape or not np.array_equal(a, b, equal_nan=True)
                if differs:
                    notes.append(f"step {step}: muon_update {q} of {name} differs between rank {lst[0][0]} "
                                 f"and rank {r}")
    return per_param_calls, notes


def _build_record(case, gathered: list[dict], *, step: int, kind: str, muon_true_units: bool, muon_names,
                  S: float, adam_grads: dict, masters: dict, model_w: dict, mom_full: dict, mom_dtypes: dict,
                  skipped: bool, scale_after: float, gn, group_lr: dict | None = None) -> StepRecord:
    """Rank 0, both modes: the StepRecord from the full values and every rank's calls/fragments. ``gn``:
    (the norm ``get_global_grad_norm()`` reported, the norm the engine's own clip computed)."""
    gn, engine_clip_norm = gn
    notes = [f"rank {loc['rank']}: {n}" for loc in gathered for n in loc.get("extra_notes", ())]
    muon_scale = 1.0 if muon_true_units else S
    per_param_calls, call_notes = calls_by_param(gathered, step)
    notes += call_notes

    # Momentum assembly from fragments (z12 paths).
    momentum: dict[str, np.ndarray] = dict(mom_full)
    if kind in ("z12", "z12_offload", "bf16_opt", "z0"):
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
        if ps.name in muon_names:
            lst = per_param_calls.get(ps.name)
            call = lst[0][1] if lst else None  # lowest rank's first call; repeats are noted above
            # no call: the gradient read before the step, where the release steps Muon without muon_update
            before = adam_grads.get(ps.name) if call is None else None
            params[ps.name] = ParamStep(
                master=masters[ps.name],
                model=model_w[ps.name],
                grad=before if call is None else call.grad.reshape(ps.shape),
                grad_scale=S if call is None else muon_scale,
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
                grad=adam_grads.get(ps.name),
                grad_scale=S,
            )

    rec = StepRecord(
        step=step,
        loss_scale=S,
        loss_scale_after=scale_after,
        skipped=skipped,
        global_norm=gn,
        engine_clip_norm=engine_clip_norm,
        muon_calls=sum(loc["ncalls"] for loc in gathered),
        params=params,
        swap_bytes_written=sum(loc["swap"][0] for loc in gathered),
        swap_bytes_read=sum(loc["swap"][1] for loc in gathered),
        losses=[x for loc in gathered for x in loc["losses"]],
        muon_calls_per_rank=[loc["ncalls"] for loc in gathered],
        notes=notes,
        group_lr=dict(group_lr or {}),
    )
    return rec
