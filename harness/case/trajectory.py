"""The result of a case: per optimizer step, the full (unpartitioned) values gathered out of
DeepSpeed's partitioned state, as plain numpy data so it pickles across ranks and saves to .npz.

Raw values are kept in the units DeepSpeed stores them in; ``grad_scale``/``momentum_scale`` say
which loss scale they carry, so that the comparison (not the capture) decides what a unit bug is.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field

import numpy as np
import hashlib
import pickle


@dataclass
class ParamStep:
    master: np.ndarray  # fp32 master weights after the step, full shape
    model: np.ndarray  # low-precision model weights after the step (as float64 of their values)
    grad: np.ndarray | None  # what entered the optimizer: Muon's input (averaged, accumulated) or Adam's grad
    grad_scale: float = 1.0  # loss scale that ``grad`` still carries
    momentum: np.ndarray | None = None  # Muon momentum after the step (None for Adam params)
    momentum_scale: float = 1.0
    momentum_dtype: str | None = None
    update: np.ndarray | None = None  # Muon's orthogonalized update as muon_update returned it
    grad_dtype: str | None = None  # dtype ``grad`` had when captured (Muon: muon_update's input dtype)


@dataclass
class StepRecord:
    step: int
    loss_scale: float  # scale used in this step's backward
    loss_scale_after: float
    skipped: bool
    global_norm: float | None  # engine.get_global_grad_norm() as DeepSpeed reports it
    muon_calls: int  # muon_update applications in this optimizer step, all ranks summed
    params: dict[str, ParamStep] = field(default_factory=dict)
    swap_bytes_written: int = 0
    swap_bytes_read: int = 0
    losses: list[float] = field(default_factory=list)  # unscaled micro-batch losses, rank-major
    muon_calls_per_rank: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # capture-side observations (rank disagreement, ...)
    group_lr: dict = field(default_factory=dict)  # optimizer param-group name -> lr it used in this step
    buffers: list[dict] = field(default_factory=list)  # model cases: per rank, buffer name -> values after the step
    # the norm the engine's own clip computed where get_global_grad_norm() reports none (stage 0 fp32:
    # clip_fp32_gradients); None where the engine did not clip
    engine_clip_norm: float | None = None


@dataclass
class Trajectory:
    case_name: str
    initial: dict[str, np.ndarray]  # master weights before step 1
    steps: list[StepRecord] = field(default_factory=list)
    muon_params: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    initial_buffers: list[dict] = field(default_factory=list)  # model cases: per rank, before step 1
    # ``Case.model_parallel`` > 1: the runs of model-parallel replicas 1.. (this one is replica 0)
    replicas: list["Trajectory"] = field(default_factory=list)

    @property
    def swapped_bytes(self) -> int:
        return sum(s.swap_bytes_written + s.swap_bytes_read for s in self.steps)

    def array_items(self):
        """(key, array) for every array in the trajectory: the .npz layout."""
        for name, arr in self.initial.items():
            yield f"initial/{name}", arr
        for s in self.steps:
            for pname, ps in s.params.items():
                for q in ("master", "model", "grad", "momentum", "update"):
                    a = getattr(ps, q)
                    if a is not None:
                        yield f"step{s.step}/{pname}/{q}", a

    def fingerprint(self) -> bytes:
        """Bit-exact digest input: determinism tests compare these."""
        buf = io.BytesIO()
        for key, arr in self.array_items():
            buf.write(key.encode())
            buf.write(np.ascontiguousarray(arr).tobytes())
        for s in self.steps:
            buf.write(json.dumps([s.loss_scale, s.loss_scale_after, s.skipped, s.global_norm, s.muon_calls]).encode())
        for k, r in enumerate(self.replicas, 1):
            buf.write(f"replica{k}".encode())
            buf.write(r.fingerprint())
        return buf.getvalue()

    def judged_bits(self) -> "RunBits":
        """Everything the judge reads (every field of every step, the initial weights and buffers, the
        Muon tags, the replicas), so that two runs with the same bits get one verdict
        (``harness.gate.decide``: the patched column of a case whose run is bit-identical to the stock one).
        Only the run-level ``notes`` are left out: they hold the ranks' timings, which the judge never
        reads. Pickle keeps every bit (a -0.0, a NaN payload, a dtype); content pickled differently
        only costs a second judge, never a wrong one.

        Protocol 5 hands each contiguous array's memory out of band (its dtype and shape stay in the
        stream): compared or hashed in place, never copied into the pickle."""
        buffers: list = []
        head = pickle.dumps((self.case_name, self.initial, self.initial_buffers, self.muon_params, self.steps),
                            protocol=5, buffer_callback=buffers.append)
        return RunBits(head, tuple(b.raw() for b in buffers), tuple(r.judged_bits() for r in self.replicas))

    def judged_digest(self) -> str:
        """``judged_bits`` as a sha256 digest: equal exactly when the bits are (a run kept elsewhere)."""
        return self.judged_bits().digest()


@dataclass(frozen=True, eq=False)
class RunBits:
    """``Trajectory.judged_bits``: the pickle's stream and the raw memory of its arrays. The gate compares
    a patched run with the stock run it follows bit for bit, at memory speed and stopping at the first
    difference, instead of hashing both runs (sha256 runs at ~1.7 GB/s here: ~14 CPU-s of a ``--full``
    gate). Holding one keeps its run's arrays alive."""

    head: bytes
    buffers: tuple  # memoryviews, format "B"
    replicas: tuple  # RunBits of the replicas

    def same(self, other: "RunBits") -> bool:
        if self is other:
            return True
        return (self.head == other.head and len(self.buffers) == len(other.buffers)
                and len(self.replicas) == len(other.replicas)
                and all(_same_memory(a, b) for a, b in zip(self.buffers, other.buffers))
                and all(a.same(b) for a, b in zip(self.replicas, other.replicas)))

    def digest(self) -> str:
        h = hashlib.sha256(self.head)
        for b in self.buffers:
            h.update(b)
        for r in self.replicas:
            h.update(r.digest().encode())
        return h.hexdigest()


def _same_memory(a: memoryview, b: memoryview) -> bool:
    """Byte equality in 8-byte words (numpy compares uint64 ~20x faster than bytes or memoryviews do)."""
    if a.nbytes != b.nbytes:
        return False
    words = a.nbytes // 8
    return (np.array_equal(np.frombuffer(a, np.uint64, words), np.frombuffer(b, np.uint64, words))
            and a[words * 8:] == b[words * 8:])

