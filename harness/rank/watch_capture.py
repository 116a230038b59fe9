"""Inside one rank of a user's own training: record the first optimizer steps of the engine
``deepspeed.initialize`` returned, with the capture the harness's own cases use (``harness.rank.capture``,
coalesced mode: rank-local reads only), and write them to ``<out>/rank<R>.pkl`` for the parent to judge.

What is added to the user's process, and why it leaves the run bit for bit as it was:

* ``muon_update`` is wrapped by the recorder; it clones the gradient before the call and returns what
  DeepSpeed's own function returned (values kept only for the watched matrices);
* a tensor hook on each watched parameter copies the local gradient of every micro-batch (it returns
  None, so autograd goes on with the same tensor);
* ``engine.backward`` and ``engine.step`` are wrapped on the instance to read the loss scale, the group
  lrs and the rank's fragments before and after the boundary step. Every read is a copy out of
  DeepSpeed's state; none is a collective (ZeRO-3 layouts that keep no local partition in memory --
  NVMe parameter offload, hpZ, quantized weights -- are read through ``GatheredParameters``, which moves
  data but changes no value).

After the last watched step everything is taken out again and the training goes on (or ends, with
``stop_after``). Anything that goes wrong in the capture is written to the rank's file and the capture
is removed: the user's training is never stopped by it.
"""
from __future__ import annotations

import copy
import os
import pickle
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as tdist

from harness import fixes
from harness.case.spec import Case, ParamShape, canonical_json
from harness.rank import capture, watch_select
from harness.registry import mutants

FORMAT = 1
UNIDENTIFIED = "<unidentified>"


class WatchedRecorder(capture.MuonCallRecorder):
    """The Muon call recorder with values kept only for the watched matrices (the others are counted),
    and a call it cannot attribute named as such instead of raising into the user's training. ``retired``:
    after the watched steps, where a test's mutant wraps it and so it cannot be taken out, it only passes
    the calls through (nothing is kept for the rest of the training)."""

    def __init__(self):
        super().__init__()
        self.watched: set[str] | None = None  # None: keep every call (inside initialize)
        self.unidentified: list[str] = []
        self.retired = False

    def _record_from(self, frame, grad, momentum, args, kwargs):
        if self.retired:
            del frame
            return self._orig(grad, momentum, *args, **kwargs)
        return super()._record_from(frame, grad, momentum, args, kwargs)

    def _identify(self, frame, grad) -> str:
        try:
            return super()._identify(frame, grad)
        except RuntimeError as exc:
            self.unidentified.append(str(exc))
            return UNIDENTIFIED

    def _record(self, name, grad, momentum, args, kwargs):
        self.keep_values = self.watched is None or name in self.watched
        return super()._record(name, grad, momentum, args, kwargs)


def initialize_watched(original, settings, args, kwargs):
    """``deepspeed.initialize`` with the capture around it: the patched runtime first (as
    ``harness.fixes.apply()`` in a script), then the recorder, then a catalogued mutant (so it sits between
    DeepSpeed and the recorder, as a source bug would), then the engine and the session."""
    if settings.patched:
        fixes.apply()
    recorder = WatchedRecorder()
    recorder.__enter__()
    undo_mutant = None
    try:
        if settings.mutant:
            undo_mutant = mutants.install(settings.mutant)
    except Exception:
        recorder.__exit__(None, None, None)
        raise
    result = original(*args, **kwargs)
    try:
        session = Session(result[0], settings, recorder, undo_mutant is not None)
        result[0]._muon_watch = session  # keeps the session alive as long as the engine
    except Exception:
        if undo_mutant is None:
            recorder.__exit__(None, None, None)
        recorder.retired = True
        write_rank_file(settings, _rank(), {"error": traceback.format_exc()})
    return result


def _unwatched_setup(engine, full: Case) -> str | None:
    """What of the engine the judge cannot take yet (None: nothing). Param groups of the user's own give
    each half several settings where the judged case holds one; an unmanaged accumulation window ends
    where the user calls ``step()``, which the recorder's window does not follow."""
    groups = getattr(getattr(engine, "basic_optimizer", None), "param_groups", ())  # INTERNAL
    if len(groups) > 2:
        return (f"the optimizer has {len(groups)} param groups (DeepSpeed's own Muon/Adam split is 2): param groups "
                "of your own")
    if full.ds.managed_gradient_accumulation is False:  # the typed view; None: a release without the option
        return "managed_gradient_accumulation false (the accumulation window is the script's own)"
    return None


def _rank() -> int:
    return tdist.get_rank() if tdist.is_initialized() else int(os.environ.get("RANK", "0"))


def _device_name() -> str:
    from deepspeed.accelerator import get_accelerator  # late: DeepSpeed, rank side

    return str(get_accelerator().device_name())


def resolved_config(engine) -> dict:
    """The config as the engine runs it: the dict it was given (``"auto"`` already filled in by Hugging
    Face), with the batch sizes the engine derived written out."""
    cfg = copy.deepcopy(engine._config._param_dict)  # INTERNAL: the config dict DeepSpeedConfig parsed
    cfg["train_batch_size"] = engine.train_batch_size()
    cfg["train_micro_batch_size_per_gpu"] = engine.train_micro_batch_size_per_gpu()
    cfg["gradient_accumulation_steps"] = engine.gradient_accumulation_steps()
    return cfg


def write_rank_file(settings, rank: int, data: dict) -> Path:
    """Atomically (a half-written file is never read as a rank's record). ``settings``: the
    ``harness.rank.watch_hook.Settings`` the capture was installed with (not imported: that module
    imports this one, late)."""
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "rank": rank, **data}
    tmp = out / f".rank{rank}.pkl.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
    final = out / f"rank{rank}.pkl"
    os.replace(tmp, final)
    return final


class Session:
    """One watched engine on this rank: what the wrappers keep between the micro-steps of a window."""

    def __init__(self, engine, settings, recorder: WatchedRecorder, keep_recorder: bool):
        self.engine, self.settings, self.recorder, self.keep_recorder = engine, settings, recorder, keep_recorder
        self.rank, self.world = _rank(), tdist.get_world_size() if tdist.is_initialized() else 1
        if getattr(engine, "dp_world_size", self.world) != self.world:
            raise RuntimeError(f"data-parallel world {engine.dp_world_size} of {self.world} ranks: model and "
                               "tensor parallelism are not watched")
        self.named = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
        params = tuple(ParamShape(n, tuple(getattr(p, "ds_shape", p.shape))) for n, p in self.named.items())
        self.gas = engine.gradient_accumulation_steps()
        self.full = Case(name="watch", params=params, ds_config=canonical_json(resolved_config(engine)),
                         world_size=self.world, steps=settings.steps, patched=bool(fixes.applied()),
                         mutant=settings.mutant)
        unsupported = _unwatched_setup(engine, self.full)
        if unsupported:
            raise RuntimeError(f"{unsupported}: not watched yet, so no verdict rather than a false one")
        self.reasons, self.dropped = watch_select.select(self.full, settings.params, settings.max_mib * 2**20,
                                                         self.gas)
        if not self.reasons:
            raise ValueError(f"no parameter to watch (--params {list(settings.params)}, memory bound "
                             f"{settings.max_mib} MiB; left out: {self.dropped})")
        self.case = self.full.replace(params=tuple(p for p in params if p.name in self.reasons))
        self.info = capture.path_info(engine)
        blocker = capture.coalescing_blocker(engine, self.named, self.world)
        if blocker is not None:
            raise RuntimeError(f"the rank-local capture cannot read this engine: {blocker}")
        self.gather_model = self.info.stage == 3 and capture.z3_model_needs_gather(engine)
        self.swap = capture.SwapCounter().__enter__()
        recorder.set_params(list(self.named.items()) + capture.z0_aliases(engine, self.named))
        recorder.watched = set(self.reasons)
        # what the step's reads follow: the watched parameters only (and their fp32 copies without ZeRO)
        self.watched = {n: p for n, p in self.named.items() if n in self.reasons}
        self.watched_ids = {k: n for k, n in recorder.id_to_name.items() if n in self.reasons}
        recorder.reset()
        self.initial = capture.read_masters(engine, self.case, self.named, self.swap)
        self.swap.reset()
        self.pending: list[dict] = []
        self.timing: list[dict] = []
        self._new_window()
        self.handles = [self.named[n].register_hook(self._hook(n)) for n in self.reasons]
        self._orig_step, self._orig_backward = engine.step, engine.backward
        engine.step, engine.backward = self._step, self._backward
        self.active = True

    def _new_window(self) -> None:
        self.local: dict[str, list] = {}
        self.losses: list[float] = []
        self.scale = None
        self.hook_s = 0.0
        self.t_window = None

    def _hook(self, name: str):
        def hook(grad):
            if self.active:
                t0 = time.perf_counter()
                self.local.setdefault(name, []).append(capture.to_np(grad))
                self.hook_s += time.perf_counter() - t0
            return None
        return hook

    def _backward(self, loss, *args, **kwargs):
        if self.active and self.scale is None:
            self.t_window = time.perf_counter()
            self.scale = capture.loss_scale_of(self.engine)
        if self.active:
            self.losses.append(float(loss.detach().float()))
        return self._orig_backward(loss, *args, **kwargs)

    def _step(self, *args, **kwargs):
        if not self.active or not self.engine.is_gradient_accumulation_boundary():
            return self._orig_step(*args, **kwargs)
        t0 = time.perf_counter()
        pre = self._guarded(self._pre)
        t1 = time.perf_counter()
        out = self._orig_step(*args, **kwargs)
        t2 = time.perf_counter()
        if pre is not None:
            self._guarded(lambda: self._after(pre))
        t3 = time.perf_counter()
        if self.active:
            self.timing.append({"capture_s": (t1 - t0) + (t3 - t2) + self.hook_s, "step_s": t2 - t1,
                                "window_s": t3 - (self.t_window or t0)})
            self._new_window()
            if len(self.pending) >= self.settings.steps:
                self._guarded(self._finish)
        return out

    def _guarded(self, fn):
        try:
            return fn()
        except Exception:
            self._remove()
            write_rank_file(self.settings, self.rank, {"error": traceback.format_exc(), "world_size": self.world})
            return None

    def _pre(self) -> capture.PreStep:
        adam = capture.read_adam_grads(self.engine, self.case, self.named, self.swap, self.rank)
        scale = self.scale if self.scale is not None else capture.loss_scale_of(self.engine)
        return capture.PreStep(loss_scale=scale, adam_grads=adam, group_lr=capture.group_lrs(self.engine))

    def _after(self, pre: capture.PreStep) -> None:
        step = len(self.pending) + 1
        rec = capture.read_step(self.engine, self.case, step, self.rank, named=self.watched,
                                id_to_name=self.watched_ids, info=self.info, pre=pre,
                                recorder=self.recorder, swap=self.swap, losses=self.losses,
                                gather_model=self.gather_model)
        rec["calls"] = [c for c in rec["calls"] if c.name in self.reasons]
        rec["ncalls"] = len(rec["calls"])
        rec["local_grads"] = self.local
        rec["grad_factor"] = self.gas / pre.loss_scale  # raw hook gradient -> one micro-batch's own, true units
        rec["extra_notes"] = [f"muon_update call not attributed: {u}" for u in self.recorder.unidentified]
        rec["buffers"] = {}
        self.recorder.unidentified = []
        self.pending.append(rec)

    def _remove(self) -> None:
        """Take every wrapper and hook out; the mutant of a test stays (the DeepSpeed under test stays
        broken) and with it the recorder it wraps, which then only passes the calls through."""
        if not self.active:
            return
        self.active = False
        for h in self.handles:
            h.remove()
        for attr in ("step", "backward"):
            self.engine.__dict__.pop(attr, None)
        if self.keep_recorder:
            self.recorder.retired = True
        else:
            self.recorder.__exit__(None, None, None)
        self.swap.__exit__(None, None, None)

    def _finish(self) -> None:
        self._remove()
        write_rank_file(self.settings, self.rank, {
            "world_size": self.world, "full": self.full.to_json(), "case": self.case.to_json(),
            "reasons": self.reasons, "dropped": self.dropped, "error": None,
            "tags": {n: bool(getattr(p, "use_muon", False)) for n, p in self.named.items()},
            "initial": self.initial, "steps": self.pending, "timing": self.timing,
            "fixes": fixes.applied(), "mutant": self.settings.mutant, "path": self.info.kind,
            "gathered_model": self.gather_model, "device": _device_name()})
        self.pending = []
        if self.settings.stop_after:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
