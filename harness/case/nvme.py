"""When does an ``offload_optimizer.device = "nvme"`` case really touch the swap folder?

Facts (DeepSpeed 0.19.8):

* ZeRO-1/2 never swap: ``stage_1_and_2.py:219-224`` treats any optimizer offload device as CPU
  (``cpu_offload = True``), so an nvme case there is a cpu case and writes nothing to nvme_path.
* ZeRO-3 swaps a *sub-group* (not a parameter) whose per-rank partition holds at least
  ``OptimizerSwapper.min_aio_bytes = max(MIN_AIO_BYTES (1 MiB), aio.block_size)`` bytes counted at
  4 bytes/element (the fp32 master dtype), ``stage3.py:_swappable_optimizer_subgroup``,
  ``swap_tensor/optimizer_utils.py:is_swappable_tensor``. Anything smaller silently stays in memory
  and behaves exactly like ``device: "cpu"``.
* Sub-groups: one list per optimizer param group -- the Muon group first (its params sorted by
  ``p.size()`` descending, ``original_muon.py:380``), then the Adam group in model order -- cut
  greedily once the running sum of per-rank partition numels reaches ``sub_group_size``
  (the installed release's default where the config leaves it out: ``Case.ds.zero.sub_group_size``),
  ``stage3.py:_create_fp16_sub_groups``. A parameter's per-rank partition is
  ``ceil(numel / W)`` elements.

So at world size W a single Muon matrix needs ``numel >= W * 262144`` (1 MiB per rank) to be
swapped: 512x512 fp32 is enough at W=1 but not at W=2 (its partition is 512 KiB). There is no
supported knob to lower the threshold (the config's ``aio.block_size`` can only raise it), so the
harness sizes the matrix instead: ``nvme_matrix(world_size)``.

Its shape is wide and short (``4W x 65536`` from two ranks, ``8 x 32768`` at one), not square,
because of what that size costs twice:
DeepSpeed's gram Newton-Schulz runs in fp16 on this CPU accelerator, and a CPU without AVX512-FP16
(this machine's AMD EPYC) does fp16 matmuls in a scalar fallback about 50x slower than fp32, in
DeepSpeed's ranks (with optimizer offload every rank orthogonalises every matrix) and again in the
oracle's bit-exact emulation of them. The iteration costs about ``numel x min(rows, cols)``
multiply-adds, so the swap threshold is met with the smallest short side: measured here (one thread,
a loaded machine), the oracle's emulated gram iteration took 16 s on a 1536x512 matrix (the earlier
shape at W=3) and 1.3 s on 24x32768; halving the short side again (12x65536 at W=3, measured at 6b5929e) took
a 3-rank NVMe resume case from 12.3 to 10.4 s (the emulation 0.93 -> 0.40 s). A shorter side still
(2W rows) gained nothing: the data drawn per micro-batch grows with the long side. The swap path only
cares about the bytes; tall, square and transposed shapes are covered by the small matrices beside it.

The bytes that really moved are measured by ``harness.rank.capture.SwapCounter`` and land in
``StepRecord.swap_bytes_written/read``; ``predict_swapped_subgroups`` says in advance whether a
case should see any.
"""
from __future__ import annotations

import json
import math

from harness.case.spec import Case, ParamShape

MIN_AIO_BYTES = 1024**2  # deepspeed.runtime.swap_tensor.utils.MIN_AIO_BYTES (checked in the tests)
FP32_BYTES = 4


def min_swap_bytes(case: Case) -> int:
    return max(MIN_AIO_BYTES, case.ds.aio_block_size)


def nvme_matrix(world_size: int, name: str = "big.weight", cols: int | None = None,
                min_bytes: int = MIN_AIO_BYTES) -> ParamShape:
    """The smallest ``rows x cols`` fp32 Muon matrix whose ZeRO-3 partition reaches ``min_bytes`` on
    every rank of ``world_size`` (alone in its sub-group); wide and short for the reason above.

    Default ``cols``: 65536 from two ranks (rows 4W >= 8), 32768 at one (rows 8). The rows stay at 8 or
    more so that the swapped matrix sorts first among the cases' Muon matrices (DeepSpeed orders a Muon
    sub-group by ``p.size()``, descending, and the small ones have 6-7 rows): a swapped matrix sorted
    after them reaches ``muon_update`` with a misplaced gradient in fp32 and fp16 (DSM-021,
    ``harness.registry.bugs``), which only the ``-sortedlast`` cases (``harness.catalog.matrix.nvme_cases``) are for."""
    per_rank = math.ceil(min_bytes / FP32_BYTES)
    if cols is None:
        cols = 65536 if world_size >= 2 else 32768
    rows = math.ceil(per_rank * world_size / cols)
    return ParamShape(name, (rows, cols))


def predict_swapped_subgroups(case: Case, model_order: list[str] | None = None) -> list[dict]:
    """ZeRO-3 sub-groups of ``case`` with their per-rank partition bytes and whether DeepSpeed will
    swap them. Empty for stages 1/2 or without nvme optimizer offload.

    ``model_order`` is the order of ``model.named_parameters()`` (Adam group order); defaults to
    that of the model the case runs (``_model_order``).
    """
    if case.stage != 3 or case.offload != "nvme":
        return []
    sub_group_size = case.ds.zero.sub_group_size
    W = case.dp_size  # the data-parallel group ZeRO-3 partitions over
    threshold = min_swap_bytes(case)
    by_name = {p.name: p for p in case.params}
    order = model_order or _model_order(case)
    muon = sorted((by_name[n] for n in order if by_name[n].uses_muon), key=lambda p: tuple(p.shape), reverse=True)
    adam = [by_name[n] for n in order if not by_name[n].uses_muon]
    out = []
    for label, group in (("muon", muon), ("adam", adam)):
        if not group:
            continue
        total = sum(math.ceil(p.numel / W) for p in group)
        if sub_group_size >= total:
            subs = [group]
        else:
            subs, cur, run = [], [], 0
            for p in group:
                cur.append(p)
                run += math.ceil(p.numel / W)
                if run >= sub_group_size or p is group[-1]:
                    subs.append(cur)
                    cur, run = [], 0
        for sub in subs:
            nbytes = FP32_BYTES * sum(math.ceil(p.numel / W) for p in sub)
            out.append({"group": label, "params": [p.name for p in sub], "partition_bytes": nbytes,
                        "swapped": nbytes >= threshold})
    return out


def _model_order(case: Case) -> list[str]:
    """The ``named_parameters()`` order of the model the case runs. A module case (``case.model``)
    declares its parameters in that order already (``harness.models.param_shapes``), and its names
    (``embed_tokens``, ``lm_head``) are ones the synthetic model refuses, so it is never built for one;
    a synthetic case's order is that of ``harness.case.synthetic.build_model``."""
    if case.model:
        return [p.name for p in case.params]
    from harness.case.synthetic import build_model

    return [n for n, _ in build_model(case).named_parameters()]


def swapped_muon_matrix_not_first(case: Case) -> bool:
    """A ZeRO-3 swapped Muon sub-group in which a matrix whose own per-rank partition reaches the swap
    threshold does not come first (DeepSpeed orders the group by ``p.size()``, descending): where DSM-021
    (0.19.8) and DSM-123 (0.19.4-0.19.7) show."""
    return _swapped_big_param_not_first(case, "muon")


def swapped_adam_param_not_first(case: Case) -> bool:
    """The same in a swapped Adam sub-group (model order): a parameter whose own per-rank partition reaches
    the swap threshold behind smaller ones (an embedding-sized vector after the biases): DSM-022."""
    return _swapped_big_param_not_first(case, "adam")


def _swapped_big_param_not_first(case: Case, group: str) -> bool:
    if case.stage != 3 or case.offload != "nvme":
        return False
    by_name = {p.name: p for p in case.params}
    threshold = min_swap_bytes(case)
    for sub in predict_swapped_subgroups(case):
        if sub["group"] != group or not sub["swapped"]:
            continue
        for name in sub["params"][1:]:
            if FP32_BYTES * math.ceil(by_name[name].numel / case.dp_size) >= threshold:
                return True
    return False


def prefetches_swapped_adam(case: Case) -> bool:
    """The pipelined swapper with two or more swapped sub-groups, an Adam one among them: it reads the next
    sub-group's state while the current one steps (``pipelined_optimizer_swapper.py``), so the Adam
    sub-group's gradient buffer is a prefetched one (DSM-024)."""
    swapped = [s for s in predict_swapped_subgroups(case) if s["swapped"]]
    return (case.ds.zero.offload_optimizer.pipelined and len(swapped) >= 2
            and any(s["group"] == "adam" for s in swapped))


def expects_swap(case: Case) -> bool:
    return any(s["swapped"] for s in predict_swapped_subgroups(case))


def swap_expected(case: Case) -> bool:
    """Whether an NVMe case must move bytes through its swap folder. ZeRO-3 keeps a sub-group below the swap
    threshold in memory by its own rule, so a model with none above it correctly swaps nothing; ZeRO-1/2
    were asked for NVMe and must swap (that they run CPU offload instead is DSM-002)."""
    return case.offload == "nvme" and (case.stage != 3 or expects_swap(case))


def describe(case: Case) -> str:
    return json.dumps(predict_swapped_subgroups(case), indent=1)
