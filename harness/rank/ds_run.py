"""Run one case on one rank of an already initialised process group and capture its trajectory.

``run_case_on_rank`` is what the pool calls on every rank after ``torch.distributed`` is up (gloo,
``file://`` rendezvous). DeepSpeed reuses that group: ``deepspeed.initialize`` ->
``comm.init_distributed`` finds ``cdb is None and torch.distributed.is_initialized()`` and wraps the
existing default group in a ``TorchBackend`` without calling ``init_process_group`` again
(``comm/comm.py:878-881``); later cases find ``cdb`` already set. The engine needs ``LOCAL_RANK``
in the environment (``engine.py:1966``); the pool sets it, and this module sets it if missing.

A process runs many cases, so everything process-wide that DeepSpeed changes is snapshotted before
and restored after each case (``ProcessState``: ZeRO-3's replaced ``F.linear``, its module stack and
lru cache that otherwise keep every ZeRO-3 engine alive, ...); the torch RNG is reseeded from
``case.seed``, and ZeRO-3's global parameter-id counter is reset so ``ds_id`` (and with it NVMe swap
file names, which an NVMe checkpoint resume depends on) is the same as in a fresh process. Each case
starts with ``gc.freeze()`` and ends with ``gc.collect()`` once nothing of it is referenced: the
collect then costs milliseconds instead of ~0.5 s, and nothing of a case outlives it.

Timing (this 2-core machine, warm rank, 4-tensor model, 2 steps, fp32): 20-45 ms per case at W=1,
40-170 ms at W=2 (ZeRO-3 the slower end); the first case in a process costs ~3-4 s (DeepSpeed
import and op loads).

Capture communication (``capture.DEFAULT_CAPTURE_MODE``, "coalesced"): during the steps every rank
only reads what it holds; after the last step ONE object gather brings every rank's pieces of every
step to rank 0, which builds the ``StepRecord``s. ``run_case_on_rank_reference`` (pool entry
``harness.rank.ds_run:run_case_on_rank_reference``) runs the same case through the public helpers (a
collective per parameter and quantity, a gather per step) and is the yardstick of
``cases/harness/test_capture_coalesced.py``. Harness bookkeeping per case at W=2, measured in-rank
on the 3-step bench cases (ms, shared 2-core machine): rank-local reads 1-2, the final gather 1-3
(mostly waiting for the slower rank), rank-0 assembly ~1, gc.collect 0.5-1.8, ProcessState snapshot +
restore 0.2-0.5, pickling the Trajectory 0.3-0.7 -- together ~5-10 % of a 50-100 ms case. The first
case a rank runs also loads the already-built JIT ops (``warm_rank``), so their one-off load does not
land in the first offload/NVMe case.

Step numbering: optimizer steps count from 1 (``StepRecord.step``, ``Overflow.step``,
``checkpoint_at``); micro-batches from 0.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from harness.rank import capture, gather_cache, resident
from harness.case import synthetic
from harness.case.spec import NVME_PATH_PLACEHOLDER, Case
from harness.case.trajectory import Trajectory
from harness.rank import patches
from types import SimpleNamespace
from harness.rank import module_runtime as model_rt
from harness.models import build_spec
from harness.rank import tp_case
import torch.distributed as tdist
import torch.nn.modules.module as mm

NS_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
             "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------------------------
# process-wide state


class ProcessState:
    """Globals DeepSpeed is known (or likely) to change, restored after every case.

    * ``torch.nn.functional.linear``: ZeRO-3 installs ``zero3_linear_wrap``
      (``partition_parameters.py:_enable_mem_efficient_linear``, "This will persist unless manually
      reset") and nothing puts it back; a later ZeRO-1/2 case then runs a different linear kernel
      (observed: 1 ULP differences).
    * the tensor constructors and ``Module.__init_subclass__`` that ``zero.Init`` patches.
    * torch's global module hooks (ZeRO-3 registers a global forward-pre hook; ``destroy`` removes
      it, but not if the case died half way).
    * default dtype, grad mode, thread count.
    * ``deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK``: every ZeRO-3 engine pushes its
      top module onto this module-level list (``setup_zero_stage3_hooks``) and ``destroy`` never pops
      it, so each ZeRO-3 case would keep its whole engine alive for the life of the process and
      leave a stale module at the bottom of the stack that external-parameter registration scans.
    * ``DeepSpeedZeRoOffload._register_deepspeed_module``'s mutable default ``count=[0]``, which
      numbers modules (``module.ds_id``) across engines.
    * ``PartitionedParameterCoordinator.__params_to_release`` is a method under
      ``functools.lru_cache(maxsize=None)``: the class-level cache keys on (coordinator, module,
      step) and so also pins every ZeRO-3 engine and model forever. Cleared after every case.
    """

    TORCH_FUNCS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")

    def __init__(self):

        self.mm = mm
        self.linear = torch.nn.functional.linear
        self.funcs = {n: getattr(torch, n) for n in self.TORCH_FUNCS}
        self.init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        self.hook_dicts = {n: dict(getattr(mm, n)) for n in dir(mm)
                           if n.startswith("_global_") and isinstance(getattr(mm, n), dict)}
        self.default_dtype = torch.get_default_dtype()
        self.grad_enabled = torch.is_grad_enabled()
        self.threads = torch.get_num_threads()
        from deepspeed.runtime.zero import parameter_offload as po  # late: DeepSpeed, rank side

        self.po = po
        self.fwd_stack = list(po.FWD_MODULE_STACK)
        self.module_counter = po.DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0]
        self.module_count = list(self.module_counter)
        from deepspeed.utils import groups as ds_groups  # late: DeepSpeed, rank side

        # ``deepspeed.utils.groups.mpu``: the engine stores the mpu it was given there (engine.py,
        # "Pass the mpu from here to groups") and every later engine's data-parallel group is read
        # from it; a model-parallel case (``Case.model_parallel``) must not leak its grid.
        self.ds_groups = ds_groups
        self.mpu = ds_groups.mpu

    def restore(self) -> list[str]:
        """Put everything back; return what had been changed."""
        changed = []
        if torch.nn.functional.linear is not self.linear:
            changed.append("torch.nn.functional.linear")
            torch.nn.functional.linear = self.linear
        for n, f in self.funcs.items():
            if getattr(torch, n) is not f:
                changed.append(f"torch.{n}")
                setattr(torch, n, f)
        if torch.nn.Module.__dict__.get("__init_subclass__") is not self.init_subclass:
            changed.append("torch.nn.Module.__init_subclass__")
            if self.init_subclass is None:
                with contextlib.suppress(AttributeError):
                    delattr(torch.nn.Module, "__init_subclass__")
            else:
                torch.nn.Module.__init_subclass__ = self.init_subclass
        for n, saved in self.hook_dicts.items():
            cur = getattr(self.mm, n)
            if dict(cur) != saved:
                changed.append(f"torch.nn.modules.module.{n}")
                cur.clear()
                cur.update(saved)
        if torch.get_default_dtype() != self.default_dtype:
            changed.append("default dtype")
            torch.set_default_dtype(self.default_dtype)
        if torch.is_grad_enabled() != self.grad_enabled:
            changed.append("grad mode")
            torch.set_grad_enabled(self.grad_enabled)
        if list(self.po.FWD_MODULE_STACK) != self.fwd_stack:
            changed.append("parameter_offload.FWD_MODULE_STACK")
            self.po.FWD_MODULE_STACK[:] = self.fwd_stack
        if list(self.module_counter) != self.module_count:
            changed.append("ZeRO-3 module ds_id counter")
            self.module_counter[:] = self.module_count
        if _clear_zero3_lru_caches():
            changed.append("PartitionedParameterCoordinator lru_cache")
        if self.ds_groups.mpu is not self.mpu:
            changed.append("deepspeed.utils.groups.mpu")
            self.ds_groups.mpu = self.mpu
        if torch.get_num_threads() != self.threads:
            changed.append("num_threads")
            torch.set_num_threads(self.threads)
        return changed


def _clear_zero3_lru_caches() -> int:
    """Empty the lru caches hidden under ``instrument_w_nvtx`` on the ZeRO-3 parameter coordinator;
    returns how many entries were dropped."""
    # late: DeepSpeed, rank side
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    dropped = 0
    for fn in vars(PartitionedParameterCoordinator).values():
        candidates = [fn] + [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                             if c.cell_contents is not None]
        for c in candidates:
            if hasattr(c, "cache_clear") and hasattr(c, "cache_info"):
                dropped += c.cache_info().currsize
                c.cache_clear()
    return dropped


def _reset_zero3_param_ids() -> None:
    # INTERNAL: class-level counter that numbers ZeRO-3 params (``ds_id``), partition_parameters.py:952,1320.
    # It only grows within a process; NVMe swap files are named after it.
    from deepspeed.runtime.zero.partition_parameters import Init  # late: DeepSpeed, rank side

    Init.param_id = 0


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (2**32))


# ------------------------------------------------------------------------------------------------
# case-scoped patches


@contextlib.contextmanager
def force_ns_dtype(name: str | None):
    """High-precision-NS mode: make every Newton-Schulz iteration run in ``name``
    (docs/deepspeed-0.19.8.md, sections 3, 12).

    ``zeropower_via_*`` look ``ns_compute_dtype`` up in ``original_muon``'s globals at call time.
    (The gram variant still normalises in the input dtype before the cast, ``original_muon.py:108-116``.)
    """
    if name is None:
        yield
        return
    from deepspeed.runtime.zero.muon import original_muon  # late: DeepSpeed, rank side

    dt = NS_DTYPES[name]
    orig = original_muon.ns_compute_dtype
    original_muon.ns_compute_dtype = lambda ns_method="gram": dt
    try:
        yield
    finally:
        original_muon.ns_compute_dtype = orig


@contextlib.contextmanager
def _gather_watch(case: Case, engine):
    """``[GatherCacheWatch]`` for ``Case.allgather_caps`` (a list: a resume replaces it), closed on exit."""
    box = [gather_cache.GatherCacheWatch(case, engine)]
    try:
        yield box
    finally:
        box[0].close()


@contextlib.contextmanager
def case_patches(case: Case, part: str = "all"):
    """THE single place where ``case.patched`` / ``case.mutant`` take effect: ``harness.rank.patches``
    installs the patched runtime and/or a known-bug mutant inside this rank for the case and always
    undoes them (``part``: "fixes" or "mutant" for one half, ``harness.rank.patches.enter``).
    """
    if not ((case.patched and part != "mutant") or (case.mutant and part != "fixes")):
        yield
        return

    patches.enter(case, part)
    try:
        yield
    finally:
        patches.exit(case)


@contextlib.contextmanager
def recorded_patches(case: Case):
    """The patched runtime, then the Muon call recorder, then a catalogued mutant: the mutant sits
    between DeepSpeed and the recorder, as a source bug would, so the recorder sees what the mutated
    DeepSpeed passes and what the real ``muon_update`` returns. Yields the recorder."""
    with case_patches(case, "fixes"), capture.MuonCallRecorder() as recorder, case_patches(case, "mutant"):
        yield recorder


# ------------------------------------------------------------------------------------------------
# engine


def _substitute(obj, old: str, new: str):
    if isinstance(obj, dict):
        return {k: _substitute(v, old, new) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_substitute(v, old, new) for v in obj]
    if isinstance(obj, str):
        return obj.replace(old, new)
    return obj


def rank_config(case: Case, nvme_dir: Path) -> dict:
    cfg = json.loads(case.ds_config)
    if NVME_PATH_PLACEHOLDER in case.ds_config:
        nvme_dir.mkdir(parents=True, exist_ok=True)
        cfg = _substitute(cfg, NVME_PATH_PLACEHOLDER, str(nvme_dir))
    return cfg


def build_engine(case: Case, nvme_dir: Path, variant: int = 0):
    import deepspeed  # late: DeepSpeed, rank side

    _reset_zero3_param_ids()
    cfg = rank_config(case, nvme_dir)
    if case.model:  # a real module (harness.models), optionally built under zero.Init
        from harness.rank import module_runtime as model_rt

        model, model_params, _ = model_rt.build_module(case, cfg, variant)
    else:
        from harness.rank.module_runtime import zero_init

        with zero_init(case, cfg):  # parameters are registered in __init__, so zero.Init partitions them
            model = synthetic.build_model(case, variant=variant)
        model_params = model_parameters(case, model)
    mpu = None
    if case.model_parallel > 1:
        from harness.rank.mpu import grid_mpu

        mpu = grid_mpu(case.model_parallel)
    ds_tags_heads = bool(case.ds.optimizer.per_head_muon)  # None: the release has no such option
    if ds_tags_heads and not case.model:
        model.config = head_config(case)
    optimizer = client_optimizer(case, model_params)
    with _fused_adam_failing(case.fused_adam_fails):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=None if optimizer else model_params,
                                               optimizer=optimizer, config=cfg, lr_scheduler=client_scheduler(case),
                                               mpu=mpu)
    named = dict(engine.module.named_parameters())
    for ps in case.params:
        if ps.num_heads and not ds_tags_heads:
            # Per-head Muon: DeepSpeed's own route (optimizer param "per_head_muon" + an HF-style
            # model.config) cannot describe a synthetic model, so the attribute its call sites read
            # (getattr(param, "muon_num_heads")) is set directly after initialize.
            p = named[ps.name]
            p.muon_num_heads = ps.num_heads
            p.muon_head_dim = ps.shape[0] // ps.num_heads
    return engine, named


@contextlib.contextmanager
def _fused_adam_failing(on: bool):
    """``Case.fused_adam_fails``: FusedAdam's constructor raises the RuntimeError an op that cannot be
    built raises, for the length of ``deepspeed.initialize`` only (the rank is reused by later cases)."""
    if not on:
        yield
        return
    from deepspeed.ops.adam.fused_adam import FusedAdam  # late: DeepSpeed, rank side

    original = FusedAdam.__dict__["__init__"]

    def fail(self, *args, **kwargs):
        raise RuntimeError("fused_adam op could not be built (harness: Case.fused_adam_fails)")

    FusedAdam.__init__ = fail
    try:
        yield
    finally:
        FusedAdam.__init__ = original


QUERY_LEAVES = ("q_proj",)  # the leaf names a Hugging Face config's head counts describe
KV_LEAVES = ("k_proj", "v_proj")


def head_config(case: Case):
    """The Hugging Face style ``model.config`` a user's attention model carries, for DeepSpeed's own
    per-head tagging (optimizer param ``per_head_muon``; docs/deepspeed-0.19.8.md, section 2): the
    query heads, the key/value heads and the head width, read from the case's per-head parameters
    (``q_proj`` / ``k_proj`` / ``v_proj`` leaves, one head width). DeepSpeed then decides itself which
    matrices are per-head and with how many heads; the oracle keeps the case's ``num_heads``."""

    heads = {ps.name.split(".")[-2]: ps for ps in case.params if ps.num_heads}
    widths = {ps.shape[0] // ps.num_heads for ps in heads.values()}
    q = [ps.num_heads for leaf, ps in heads.items() if leaf in QUERY_LEAVES]
    kv = {ps.num_heads for leaf, ps in heads.items() if leaf in KV_LEAVES}
    if len(widths) != 1 or len(q) != 1 or len(kv) > 1 or set(heads) - set(QUERY_LEAVES + KV_LEAVES):
        raise ValueError(f"{case.name}: per_head_muon needs one q_proj and k_proj/v_proj leaves of one head "
                         f"width to describe as a model config; got {sorted(heads)} with widths {sorted(widths)}")
    return SimpleNamespace(num_attention_heads=q[0], num_key_value_heads=(kv.pop() if kv else q[0]),
                           head_dim=widths.pop())


def client_scheduler(case: Case):
    """The torch LR scheduler a user passes to ``deepspeed.initialize`` (``case.client_scheduler``), as
    the callable DeepSpeed calls with the optimizer it builds (``engine._configure_lr_scheduler``)."""
    if not case.client_scheduler:
        return None
    spec = json.loads(case.client_scheduler)
    cls = getattr(torch.optim.lr_scheduler, spec["type"])
    params = dict(spec.get("params", {}))
    return lambda optimizer: cls(optimizer, **params)


def client_optimizer(case: Case, model_params):
    """The torch optimizer a user builds and hands ``deepspeed.initialize`` (``case.client_optimizer``),
    over the parameters the case would otherwise pass as ``model_parameters``; None: the config's."""
    if not case.client_optimizer:
        return None
    spec = json.loads(case.client_optimizer)
    return getattr(torch.optim, spec["type"])(list(model_params), **spec.get("params", {}))


def model_parameters(case: Case, model):
    """What the case hands ``deepspeed.initialize`` as ``model_parameters``: the user's param groups
    (``case.groups``, each a dict of its parameters and its own settings, a loose group's parameters as bare
    tensors ahead of them) or ``model.parameters()``."""
    if not case.groups:
        return model.parameters()
    named = dict(model.named_parameters())
    loose = [named[n] for g in case.groups if g.loose for n in g.params]  # first: DeepSpeed must move them last
    return loose + [{"params": [named[n] for n in g.params], **g.options()} for g in case.groups if not g.loose]


def _model_hooks(case: Case):
    """(forward, read_buffers) for a model case; (None, a reader of nothing) for the synthetic model,
    whose path stays exactly as it was (no buffers, no extra collective)."""
    if not case.model:
        return None, lambda engine: {}

    spec = build_spec(case.model, case.seed)
    return model_rt.feeder(case, spec), lambda engine: model_rt.read_buffers(engine.module)


def destroy_engine(engine) -> None:
    if engine is None:
        return
    engine.destroy()


# ------------------------------------------------------------------------------------------------
# once per rank process

# DeepSpeed JIT ops a case loads on first use (DeepSpeedCPUAdam for cpu/nvme optimizer offload, the
# aio op for NVMe swapping). Loading one that is already built still costs tens of ms (ninja and
# compiler probes in subprocesses; ~0.1 s on two busy cores), which would otherwise land in whichever
# case happens to be the first of its kind in the process.
PRELOAD_OPS = ("CPUAdamBuilder", "AsyncIOBuilder")
_rank_warmed = False


def warm_rank() -> list[str]:
    """Load the ``PRELOAD_OPS`` that are already built in ``TORCH_EXTENSIONS_DIR`` (never builds
    anything), once per process; called by the first case a rank runs. Returns the ops loaded."""
    global _rank_warmed
    if _rank_warmed:
        return []
    _rank_warmed = True
    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not ext:
        return []
    loaded = []
    for name in PRELOAD_OPS:
        with contextlib.suppress(Exception):  # best effort: the case itself loads (or builds) what it needs
            from deepspeed.accelerator import get_accelerator

            builder = get_accelerator().create_op_builder(name)
            if builder is not None and (Path(ext) / builder.NAME / f"{builder.NAME}.so").exists():
                builder.load(verbose=False)  # cached in OpBuilder._loaded_ops for every later load()
                loaded.append(builder.NAME)
    return loaded


# ------------------------------------------------------------------------------------------------
# the case


def run_case_on_rank(case: Case, rank: int, world_size: int, workdir: Path) -> Trajectory | None:

    if tp_case.autotp_size(case) > 1:  # AutoTP shards the model: the shard records of harness.rank.tp_case
        return tp_case.run_on_rank(case, rank, world_size, workdir, process_state=ProcessState,
                                   patches=recorded_patches, config=rank_config)
    return _run_case(case, rank, world_size, workdir, capture.DEFAULT_CAPTURE_MODE)


def run_case_on_rank_reference(case: Case, rank: int, world_size: int, workdir: Path) -> Trajectory | None:
    """``run_case_on_rank`` with every quantity read through the public helpers, one collective per
    parameter and quantity (``capture_mode="reference"``): the yardstick the coalesced capture is
    tested against bit for bit (cases/harness/test_capture_coalesced.py). Pool entry
    ``harness.rank.ds_run:run_case_on_rank_reference``."""
    return _run_case(case, rank, world_size, workdir, "reference")


def _assemble(traj: Trajectory, case: Case, gathered: list) -> None:
    """Rank 0, coalesced capture: ``traj``'s initial masters and steps from one data-parallel group's
    gathered (initial pieces, step dicts, initial buffers), in data-parallel rank order."""
    traj.initial = capture.resolve_all([g[0] for g in gathered], case, "initial master")
    traj.steps = [capture.assemble_step(case, [g[1][i] for g in gathered]) for i in range(len(gathered[0][1]))]
    if case.model:
        traj.initial_buffers = [g[2] for g in gathered]
        for i, rec in enumerate(traj.steps):
            rec.buffers = [g[1][i]["buffers"] for g in gathered]


def _read_pre_step(engine, case: Case, named: dict, swap, piece_rank: int | None) -> tuple[dict, dict]:
    """(group lrs, Adam gradients) as they stand before the boundary step, which steps the scheduler;
    ``piece_rank``: this rank's pieces without a collective (coalesced capture), None: gathered."""
    grads = (capture.read_adam_grads(engine, case, named, swap, piece_rank) if piece_rank is not None
             else capture.capture_adam_grads(engine, case, named, swap))
    return capture.group_lrs(engine), grads


def _step_reading_at_optimizer_entry(engine, read):
    """``engine.step()`` with ``read()`` taken as the engine hands over to its optimizer.

    Unmanaged accumulation reduces (stage 0/1) or finalizes (stage 2/3, the offload copy) inside
    ``engine.step()``, so before the call the accumulated gradient is not where DeepSpeed keeps it;
    at the optimizer's ``step`` it is, and the loss scale, clipping and the scheduler have not yet acted:
    the point the managed window reads before its boundary ``engine.step()``. Except the engine's own
    fp32 clip without ZeRO (``clip_fp32_gradients``), which scales the gradients in place before the
    optimizer's ``step``: where it runs, the read is taken just before it."""
    opt = engine.optimizer
    saved = [(obj, name, obj.__dict__.get(name), getattr(obj, name))
             for obj, name in ((opt, "step"), (engine, "clip_fp32_gradients"))]
    taken = []

    def reading(original):
        def call(*args, **kwargs):
            if not taken:
                taken.append(read())
            return original(*args, **kwargs)
        return call

    for obj, name, _, original in saved:
        setattr(obj, name, reading(original))
    try:
        engine.step()
    finally:
        for obj, name, own, _ in saved:
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
    if not taken:
        raise RuntimeError("engine.step() never called its optimizer's step: nothing was read for this step")
    return taken[0]


def _check_process_group(case: Case, rank: int, world_size: int, capture_mode: str) -> None:

    if capture_mode not in capture.CAPTURE_MODES:
        raise ValueError(f"capture_mode {capture_mode!r} is not one of {capture.CAPTURE_MODES}")
    if not tdist.is_initialized():
        raise RuntimeError("run_case_on_rank needs an initialised torch.distributed process group")
    if tdist.get_world_size() != world_size or tdist.get_rank() != rank:
        raise RuntimeError(f"process group is rank {tdist.get_rank()}/{tdist.get_world_size()}, "
                           f"case wants {rank}/{world_size}")
    if case.world_size != world_size:
        raise ValueError(f"case {case.name!r} is for world size {case.world_size}, not {world_size}")


class _CaseRun:
    """One case on this rank: the engine and what the capture keeps between steps, so that the build,
    a step, the checkpoint rebuild and the final gather read apart. No method keeps the engine or the
    model in a local past its own call, and ``_run_case``'s ``finally`` drops ``engine`` and ``named``:
    the end-of-case count of live engines and models would see anything that kept them."""

    def __init__(self, case: Case, rank: int, world_size: int, workdir: Path, capture_mode: str, recorder,
                 swap, t0: float):
        self.case, self.rank, self.world_size, self.workdir = case, rank, world_size, workdir
        self.capture_mode, self.recorder, self.swap, self.t0 = capture_mode, recorder, swap, t0
        self.engine = self.named = self.info = self.traj = self.watch = self.resident = None
        self.notes: list[str] = []
        self.pending: list[dict] = []  # coalesced: this rank's read_step dicts, one per step
        self.initial_pieces = None

    def build(self, stack: contextlib.ExitStack) -> None:
        """The engine, the capture mode, the initial masters and (rank 0) the trajectory."""
        case, recorder, swap = self.case, self.recorder, self.swap
        self.engine, self.named = build_engine(case, self.workdir / "nvme", variant=0)
        self.t_built = time.perf_counter()
        if recorder.count:
            self.notes.append(f"muon_update ran {recorder.count} times inside deepspeed.initialize")
        self.forward, self.read_buffers = _model_hooks(case)
        self.initial_buffers = self.read_buffers(self.engine)
        recorder.set_params(list(self.named.items()) + capture.z0_aliases(self.engine, self.named))
        self.info = capture.path_info(self.engine)
        init_w, init_r = swap.reset()
        if init_w or init_r:
            self.notes.append(f"swap bytes during initialize: written {init_w}, read {init_r}")
        self.notes.append(f"path {self.info.kind}")
        self.coalesced = self._coalesced()
        # Pieces are labelled by the rank's place in its data-parallel group (its partition).
        self.piece_rank = self.rank // case.model_parallel
        self.gather_model = self.coalesced and self.info.stage == 3 and capture.z3_model_needs_gather(self.engine)
        self._capture_initial()
        self.gas = self.engine.gradient_accumulation_steps()
        # Unmanaged accumulation (matrix.unmanaged_cases): every step() call is an update, so the
        # client calls it once, at the end of the window; managed, DeepSpeed counts the calls.
        # None: a release without the option, whose engine counts the micro-steps itself (managed)
        self.step_every_micro = case.ds.managed_gradient_accumulation is not False
        self.watch = stack.enter_context(_gather_watch(case, self.engine))
        self.resident = resident.ResidentMomentumWatch(case, self.engine)

    def _coalesced(self) -> bool:
        """Coalesced: every rank keeps what it holds of each step (no collective) and rank 0 gets it all
        in one gather after the last step; reference: public helpers + a gather per step."""
        case = self.case
        coalesced = self.capture_mode == "coalesced"
        blocker = None
        if coalesced:
            blocker = capture.coalescing_blocker(self.engine, self.named, case.dp_size)
            if blocker is not None:
                coalesced = False
                self.notes.append(f"capture: reference mode ({blocker})")
        if case.model_parallel > 1 and not coalesced:
            # the reference capture assembles one run from every rank; a model-parallel case is
            # model_parallel runs (one per replica), which only the coalesced assembly splits
            raise RuntimeError(f"case {case.name!r}: model_parallel {case.model_parallel} needs the "
                               "coalesced capture (MUON_HARNESS_CAPTURE_MODE=reference, or: "
                               f"{blocker})")
        return coalesced

    def _capture_initial(self) -> None:
        case, rank = self.case, self.rank
        if self.coalesced:
            self.initial_pieces = capture.read_masters(self.engine, case, self.named, self.swap)
            initial = {}  # filled on rank 0 after the final gather
        else:
            initial = capture.capture_masters(self.engine, case, self.named, self.swap)
        self.swap.reset()
        if not self.coalesced and case.model:
            self.initial_buffers = capture.gather_to_rank0(self.initial_buffers, rank, self.world_size)
        if rank == 0:
            self.traj = Trajectory(case_name=case.name, initial=initial,
                                   muon_params=tuple(ps.name for ps in case.params
                                                     if getattr(self.named[ps.name], "use_muon", False)))
            if not self.coalesced and case.model:
                self.traj.initial_buffers = self.initial_buffers

    def run_step(self, step: int) -> None:
        self.recorder.reset()
        self.swap.reset()
        self.watch[0].before_step()
        S = capture.loss_scale_of(self.engine)
        losses, lrs, adam = self._micro_batches(step)
        self._record_step(step, capture.PreStep(loss_scale=S, adam_grads=adam, group_lr=lrs), losses)
        if self.case.checkpoint_at is not None and step == self.case.checkpoint_at and step < self.case.steps:
            self._checkpoint_and_reload(step)

    def _micro_batches(self, step: int) -> tuple[list[float], dict, dict]:
        """The accumulation window: (losses, group lrs, Adam gradients) read before the boundary step."""
        case, rank, gas = self.case, self.rank, self.gas
        losses: list[float] = []
        adam: dict = {}
        lrs: dict = {}
        for micro in range(gas):
            if self.forward is None:
                loss = self.engine(synthetic.batch_data(case, rank, step, micro))
            else:
                loss = self.forward(self.engine, rank, step, micro)
            losses.append(float(loss.detach().float()))
            self.engine.backward(loss)
            loss = None  # its grad_fn graph reaches the parameters, and through them the engine
            if micro < gas - 1:
                if self.step_every_micro:
                    self.engine.step()
                continue
            piece = self.piece_rank if self.coalesced else None
            if self.step_every_micro:
                lrs, adam = _read_pre_step(self.engine, case, self.named, self.swap, piece)
                self.engine.step()
            else:
                lrs, adam = _step_reading_at_optimizer_entry(
                    self.engine, functools.partial(_read_pre_step, self.engine, case, self.named, self.swap, piece))
        return losses, lrs, adam

    def _record_step(self, step: int, pre, losses: list[float]) -> None:
        case, rank, world_size = self.case, self.rank, self.world_size
        if self.coalesced:
            self.pending.append(capture.read_step(self.engine, case, step, self.piece_rank, named=self.named,
                                                  id_to_name=self.recorder.id_to_name, info=self.info, pre=pre,
                                                  recorder=self.recorder, swap=self.swap, losses=losses,
                                                  gather_model=self.gather_model))
            self.pending[-1]["buffers"] = self.read_buffers(self.engine)
            self.pending[-1]["extra_notes"] = (self.watch[0].check_step(step, gather_cache.chunked(case))
                                               + self.resident.check_step(step))
            return
        rec = capture.capture_step(self.engine, case, step, rank, world_size, named=self.named,
                                   id_to_name=self.recorder.id_to_name, info=self.info, pre=pre,
                                   recorder=self.recorder, swap=self.swap, losses=losses)
        bufs = capture.gather_to_rank0(self.read_buffers(self.engine), rank, world_size) if case.model else None
        if rank == 0:
            if bufs is not None:
                rec.buffers = bufs
            self.traj.steps.append(rec)

    def _checkpoint_and_reload(self, step: int) -> None:
        """Save after ``step``, then load into a fresh engine on a model with a *different* init and
        (for NVMe) a fresh swap folder, so a load that restores nothing shows up in the next step."""
        case = self.case
        ckpt = self.workdir / "ckpt"
        tag = f"step{step}"
        self.engine.save_checkpoint(str(ckpt), tag=tag)
        destroy_engine(self.engine)
        self.engine = None
        self.resident.close()
        if self.coalesced:
            self.pending[-1]["extra_notes"] += self.watch[0].check_destroyed()
        # The rebuild's own initialize may call muon_update (stage 0 fp16/bf16: DSM-014's warm-up
        # step): with the old engine's parameters forgotten it is counted as an initialize call, as
        # on the first build, instead of failing to identify them.
        self.recorder.set_params([])
        self.engine, self.named = build_engine(case, self.workdir / "nvme-resumed", variant=1)
        self.recorder.set_params(list(self.named.items()) + capture.z0_aliases(self.engine, self.named))
        self.info = capture.path_info(self.engine)
        self.engine.load_checkpoint(str(ckpt), tag=tag)
        self.watch[0] = gather_cache.GatherCacheWatch(case, self.engine)
        self.resident = resident.ResidentMomentumWatch(case, self.engine)
        w, r = self.swap.reset()
        if self.rank == 0:
            self.traj.notes.append(f"checkpoint saved after step {step} and loaded into a fresh engine"
                                   f" (swap bytes during rebuild+load: written {w}, read {r})")

    def finish(self) -> None:
        """Destroy the engine; coalesced: the one gather and (rank 0) the assembly."""
        t_steps = time.perf_counter()
        destroy_engine(self.engine)
        self.engine = self.named = self.info = None
        self.resident.close()
        if self.coalesced and self.pending:
            self.pending[-1]["extra_notes"] += self.watch[0].check_destroyed()
        if self.coalesced:
            self._gather_and_assemble()
        self.notes.append(f"seconds: build {self.t_built - self.t0:.3f}, steps+capture {t_steps - self.t_built:.3f}")

    def _gather_and_assemble(self) -> None:
        """The case's only capture collective: every rank's pieces of every step to rank 0 (muon_update
        values once per step and parameter, digests for the other copies)."""
        case, rank, world_size = self.case, self.rank, self.world_size
        capture.share_calls_once(self.pending, rank, world_size, case.model_parallel)
        gathered = capture.gather_once_to_rank0((self.initial_pieces, self.pending, self.initial_buffers), rank,
                                                world_size)
        self.pending = self.initial_pieces = None
        if rank == 0:
            # One trajectory per model-parallel replica, from its data-parallel ranks' pieces
            # (rank order within the group); replica 0's is ``traj``, the others its replicas.
            mp = case.model_parallel
            for k in range(mp):
                t = self.traj if k == 0 else Trajectory(case_name=f"{case.name}#mp{k}", initial={},
                                                        muon_params=self.traj.muon_params)
                _assemble(t, case, gathered[k::mp])
                if k:
                    self.traj.replicas.append(t)


def _run_case(case: Case, rank: int, world_size: int, workdir: Path, capture_mode: str) -> Trajectory | None:
    _check_process_group(case, rank, world_size, capture_mode)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    # Everything alive now (torch, DeepSpeed, the previous case's survivors) is long-lived: move it
    # out of the collector's sight so the end-of-case gc.collect() scans only this case's objects
    # (0.5 s -> a few ms per case on this machine). Frozen objects are still freed by refcount.
    warm_rank()  # once per process; not part of the case (and not in its notes: they must not depend on order)
    gc.freeze()
    state = ProcessState()
    _seed_everything(case.seed)
    run = None
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            recorder = stack.enter_context(recorded_patches(case))  # patched runtime / mutants: here only
            swap = stack.enter_context(capture.SwapCounter())
            stack.enter_context(force_ns_dtype(case.ns_dtype))
            run = _CaseRun(case, rank, world_size, workdir, capture_mode, recorder, swap, t0)
            run.build(stack)
            for step in range(1, case.steps + 1):
                run.run_step(step)
            run.finish()
    finally:
        if run is not None:
            if run.engine is not None:
                with contextlib.suppress(Exception):
                    destroy_engine(run.engine)
            run.engine = run.named = run.resident = None
        if case.model_parallel > 1:
            state.ds_groups.mpu = state.mpu  # the grid this case handed the engine (expected, not a leak)
        changed = state.restore()
        # The engine is a web of reference cycles (hooks, optimizer <-> params); collect it now, with
        # nothing of this case left referencing it, so the next case's gc.freeze() cannot pin it.
        # Cheap because only this case's objects are unfrozen.
        gc.collect()
    traj = run.traj
    if rank == 0:
        traj.notes.extend(run.notes)
        if changed:
            traj.notes.append("process state restored after the case: " + ", ".join(changed))
        traj.notes.append(f"seconds: total {time.perf_counter() - t0:.3f} (rank 0)")
    return traj
