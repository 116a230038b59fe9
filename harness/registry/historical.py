"""Bugs of DeepSpeed releases older than 0.19.8, shown by running the gate on them.

Why a module of its own: ``harness.registry.bugs`` is the registry of 0.19.8, with oracle models and fixes in
the patched runtime written against that release. The bugs here exist only in older releases (the
releases each one affects, as measured, are in its ``releases``); they have no fix in
this project (upgrade DeepSpeed) and, so far, no oracle model: a numerical one excuses the quantities
it names (strength "excused", not full), a crash one only its exact exception, message and frame.
Ids start at DSM-101 so they never collide with the 0.19.8 registry's. Each entry holds the fields of
``harness.registry.bugs.Bug`` as a dict; ``harness.registry.bugs`` builds them (so this module does not import it back).
"""
from __future__ import annotations

import functools
import os

from harness.case import nvme
from harness.case.spec import Case
from harness.registry.releases import measured
from harness.env import tree, versions
from oracles.layout import param_slices
from oracles.layout import placement
from harness.env import device
import torch
import oracles
from oracles.momentum import muon_momentum


def _has_muon(c: Case) -> bool:
    return c.runs_muon


def bf16_optimizer_route(c: Case) -> bool:
    """Where DeepSpeed runs BF16_Optimizer instead of the ZeRO optimizer (``DSConfig.bf16_optimizer_route``)."""
    return c.ds.bf16_optimizer_route


def _muon_stepped_as_sgd(c: Case) -> bool:
    """Where no ZeRO optimizer runs Muon before ``MuonWithAuxAdam.step`` (stage 0, the BF16_Optimizer route)."""
    return _has_muon(c) and (c.stage == 0 or bf16_optimizer_route(c))


def _z12_offload_muon(c: Case) -> bool:
    return c.stage in (1, 2) and c.offload in ("cpu", "nvme") and _has_muon(c)


def _muon_shapes_by_group(c: Case) -> list[list[tuple]]:
    """Muon matrix shapes per optimizer param group, in reverse model order (the order backward fills
    ZeRO-3's reduce bucket)."""
    muon = [p for p in reversed(c.params) if p.uses_muon]
    if not c.groups:
        return [[p.shape for p in muon]]
    return [[p.shape for p in muon if p.name in g.params] for g in c.groups]


def _z3_dist_muon_mixed_shapes(c: Case) -> bool:
    """0.19.7 ZeRO-3 runs Muon during the gradient reduce (``stage3.py:1623-1700``
    ``_apply_distributed_muon_update``): the Muon parameters of a sub-group are dealt out one per rank
    in rounds of W, and each round all-gathers every rank's gradient; gloo (and NCCL) need equal sizes,
    so a round holding matrices of different shapes raises. Rounds are per sub-group (``sub_group_size``
    splits them: measured, z3-none-fp32-ws2-subgroups runs on 0.19.7); a case whose buckets skip Muon
    (DSM-110) never reaches the all-gather."""
    if c.stage != 3 or c.world_size < 2 or _z3_muon_skipped(c):
        return False
    if c.groups and groups_flattened():
        c = c.replace(groups=())  # DSM-104: the release merges the user's groups into one Muon group
    return any(len(set(r)) > 1 for r in _z3_rounds(c))


def groups_flattened() -> bool:
    """Whether the tree under test flattens user param groups into one Muon and one Adam group (DSM-104:
    ``tree.groups_flattened``): the ZeRO-3 deal then runs over all the Muon matrices together (measured:
    0.19.6 z3-none-bf16-ws2-groups and z3-cpu-fp32-ws2-groups crash as DSM-102 says)."""

    return bool(tree.capabilities()["groups_flattened"])


def muon_update_returns_2d_for_4d() -> bool:
    """Whether the release judged hands a 4-D (conv) Muon update back as the 2-D matrix it orthogonalised
    (0.18.9-0.19.6; 0.19.7 added the ``torch.where`` against the 4-D gradient that raises, DSM-012's crash in
    ``muon_update``). ZeRO-1/2 flatten that 2-D update into the partition unharmed (measured:
    ``z1-none-fp32-ws2-conv2d-unpadded`` matches the oracle on 0.19.3-0.19.6); ZeRO-3's reduce copies it into
    the 4-D gradient and raises there (``_apply_distributed_muon_update``)."""
    return _judged_release_in("0.18.9", "0.19.7")


def _judged_release_in(lo: str, hi: str) -> bool:
    """Whether the release judged (a measured one; never an unseen release) is in ``[lo, hi)``."""

    rel = versions.judged_as()
    return rel is not None and versions.in_range(rel, lo, hi)


def _z12_group_with_two_muon(c: Case) -> bool:
    """ZeRO-1/2 without offload, a param group with two or more Muon matrices (the staging reset only
    loses the momentum of a matrix that is not the last one a rank updates in its group)."""
    if not (_z12_optimizer(c) and _has_muon(c)):
        return False
    return any(len(shapes) >= 2 for shapes in _muon_shapes_by_group(c))


def _z12_optimizer(c: Case) -> bool:
    """ZeRO-1/2 without optimizer offload through DeepSpeed's ZeRO-1/2 optimizer (``stage_1_and_2.py``,
    which runs Muon in ``get_flat_partition``), not the BF16_Optimizer route (measured on 0.19.6: the
    ZeRO-1/2 bugs' candidates there excused nothing DSM-013 and DSM-114's models leave)."""
    return c.stage in (1, 2) and c.offload == "none" and not bf16_optimizer_route(c)


def _z12_no_offload_muon_ws2(c: Case) -> bool:
    return _z12_optimizer(c) and c.world_size >= 2 and _has_muon(c)


def _z12_muon_matrix_straddles(c: Case) -> bool:
    """DSM-107's trigger: ZeRO-1/2 without offload and a Muon matrix whose flat elements lie in two or more
    ranks' partitions (measured on 0.19.0's whole gate: the sweep layouts whose rank boundary falls between
    matrices show nothing)."""
    if not _z12_no_offload_muon_ws2(c):
        return False
    from harness.judge import verdict  # late: keeps this module numpy-free at import

    layout = verdict.layout_for(c, verdict.step_config(c))
    return any(len({s.rank for s in param_slices(layout, p.name)}) > 1 for p in c.params if p.uses_muon)


def _fp16_scale(c: Case) -> bool:
    """fp16 with a loss scale other than 1 (a static ``loss_scale`` of 1 leaves nothing to unscale)."""
    return c.dtype == "fp16" and c.ds.fp16.loss_scale != 1.0


def _muon_update_in_scaled_buffer(c: Case) -> bool:
    """Where a release before 0.19.8 writes the Muon update into the loss-scaled gradient buffer: ZeRO-1/2
    without offload (``get_flat_partition``) and ZeRO-3 with or without offload (in the gradient reduce).
    Not ZeRO-1/2 with offload (no Muon at all there: DSM-101) nor stage 0 (the fp16 wrapper unscales the
    gradients before MuonWithAuxAdam runs)."""
    if not (_has_muon(c) and _fp16_scale(c)):
        return False
    return c.stage == 3 or _z12_optimizer(c)


def _z3_muon_skipped(c: Case) -> bool:
    """ZeRO-3 before 0.19.8 runs Muon only in ``__avg_scatter_contiguous_grads`` (0.19.7 stage3.py:1772), which
    a bucket reaches only with contiguous_gradients on and the bucket within reduce_bucket_size
    (stage3.py:1599; reduce_scatter on is refused with Muon at construction, stage3.py:352): otherwise the
    bucket's Muon matrices are stepped with their raw gradient. True when some Muon matrix of the case goes
    that way (a gradient larger than the bucket size is put in a bucket of its own, which then exceeds it:
    stage3.py:1552-1569)."""
    if c.stage != 3 or not _has_muon(c):
        return False
    z = c.ds.zero
    if not z.contiguous_gradients:
        return True
    bucket = z.reduce_bucket_size
    return any(p.numel > bucket for p in c.params if p.uses_muon)


def _z3_rounds(c: Case) -> list[list[tuple]]:
    """The shapes of each round of ZeRO-3's one-matrix-per-rank deal before 0.19.8: per sub-group (the
    layout's, ``sub_group_size``), the Muon matrices in the order backward fills the bucket (reverse model
    order), W at a time. Assumes one reduce bucket (the cases' models are far below the default size)."""
    from harness.judge import verdict  # late: keeps this module numpy-free at import

    layout = verdict.layout_for(c, verdict.step_config(c))
    W = c.world_size
    by_sub: dict[int, list[tuple]] = {}
    for p in reversed(c.params):
        if p.uses_muon:
            by_sub.setdefault(placement(layout, p.name).group, []).append(tuple(p.shape))
    return [shapes[i:i + W] for shapes in by_sub.values() for i in range(0, len(shapes), W)]


def _z3_dist_muon_model_parallel(c: Case) -> bool:
    """DSM-122's trigger: ZeRO-3 distributed Muon (Muon reached in the gradient reduce) with a data-parallel
    group smaller than the world (``Case.model_parallel`` > 1): the deal's rounds are sized by the group and
    gathered over the world."""
    return c.stage == 3 and c.model_parallel > 1 and _has_muon(c) and not _z3_muon_skipped(c)


def swap_reads_views(c: Case) -> bool:
    """The case's NVMe swapper reads swapped gradients into views at their offsets (``tree.swap_gradient_views``:
    the mechanism of DSM-021, DSM-022, DSM-024 and DSM-123)."""
    swapper = "pipelined" if c.ds.zero.offload_optimizer.pipelined else "partitioned"
    return bool(tree.capabilities()[f"swap_gradient_views({swapper})"])


def _adam_ignores_l2(c: Case) -> bool:
    """DSM-124's trigger: L2 weight decay is asked for (``adam_w_mode`` false, some Adam parameter with weight
    decay, no client optimizer) and the Adam that steps the parameters ignores the mode, as the tree's code says:
    Muon's auxiliary Adam where ``MuonWithAuxAdam`` takes no mode (``tree.aux_adam_takes_mode``: its inline
    Adam decouples on every path, offload included), else FusedAdam, which the engine builds without optimizer
    offload (with it, the CPU Adam, which keeps the mode), on the CPU accelerator where its op steps every mode
    with one optimizer (``tree.cpu_fused_adam_one_mode``)."""
    from harness.judge import verdict  # late: keeps this module numpy-free at import

    if c.client_optimizer:
        return False
    sc = verdict.step_config(c)
    if sc.adam_w_mode or not any(sc.hyper(p)["weight_decay"] > 0 for p in sc.params if not p.use_muon):
        return False
    k = tree.capabilities()
    if c.runs_muon and not k["aux_adam_takes_mode"]:
        return True
    return (os.environ.get("DS_ACCELERATOR", "cpu") == "cpu" and c.offload == "none"
            and bool(k["cpu_fused_adam_one_mode"]))


def _z12_momentum_split(c: Case) -> bool:
    """DSM-103 on a matrix that straddles ranks: on each rank only the last Muon matrix of its partition keeps
    this step's momentum, so a matrix that is the last on one holder and not on another ends the step with
    different momentum on each (and each rank's part of its next update comes from a different momentum)."""
    if not _z12_optimizer(c) or c.world_size < 2 or not _has_muon(c):
        return False
    from harness.judge import verdict  # late: keeps this module numpy-free at import
    from oracles.layout import param_slices, rank_segments

    layout = verdict.layout_for(c, verdict.step_config(c))
    muon = {p.name for p in c.params if p.uses_muon}
    last: dict[tuple[int, int], str] = {}  # (rank, group) -> the last Muon matrix of that partition
    for r in range(c.world_size):
        for seg in rank_segments(layout, r):
            if seg.kind == "param" and seg.name in muon:
                last[(r, seg.group)] = seg.name
    for name in muon:
        fates = {last.get((s.rank, s.group)) == name for s in param_slices(layout, name)}
        if len(fates) > 1:
            return True
    return False


def _passes_group_dicts(c: Case) -> bool:
    """The case's own groups, or a model that declares groups (measured: 0.19.6 moe-z1-cpu-bf16-ws2-standard's
    group lrs are the config's)."""

    return versions._passes_group_dicts(c)


def _zinit_muon(c: Case) -> bool:
    """ZeRO-3 under ``zero.Init`` with a matrix DeepSpeed would tag Muon (any world size: a partitioned
    parameter's data is a flat placeholder on every rank)."""
    return c.stage == 3 and bool(c.zero_init) and _has_muon(c)


def _z12_momentum_dtype_mismatch(c: Case) -> bool:
    """ZeRO-1/2 without offload, a 16-bit model with Muon, where the flat momentum (created in
    gradient_accumulation_dtype, or restored by load_checkpoint in the fp32 master's dtype) and the gradient
    muon_update reads (param.grad, model dtype, at stage 2; grad_accum, gradient_accumulation_dtype, at stage 1)
    differ in dtype: stage 2 with grad_accum_dtype fp32, or any resumed run whose gradient is 16-bit."""
    if c.stage not in (1, 2) or c.offload != "none" or c.dtype == "fp32" or not _has_muon(c):
        return False
    gad32 = c.ds.grad_accum_dtype == "fp32"
    grad_is_16bit = not (c.stage == 1 and gad32)
    return (c.stage == 2 and gad32) or (c.checkpoint_at is not None and grad_is_16bit)


def _muon_sees_overflow(c: Case) -> bool:
    """A forced overflow reaching muon_update before the overflow test: ZeRO-1/2 without offload (not ZeRO-1/2
    offload: DSM-101; not stage 0: DSM-114). ZeRO-3 runs muon_update in the reduce too, but its overflow cases
    crash first (DSM-102) on the releases measured, so it is left out until measured."""
    return _has_muon(c) and bool(c.overflows) and _z12_optimizer(c)


def _z12_nocontig_unreduced(c: Case) -> bool:
    """ZeRO-1/2 without optimizer offload (offload forces contiguous gradients, 0.19.7 stage_1_and_2.py:274),
    contiguous_gradients off, world size >= 2, on the CPU accelerator (on CUDA the type strings match)."""
    return (_z12_optimizer(c) and c.world_size >= 2
            and not c.ds.zero.contiguous_gradients and os.environ.get("DS_ACCELERATOR", "cpu") == "cpu")


def _warmup_peak_from_first_group(c: Case) -> bool:
    """A WarmupLR/WarmupDecayLR schedule without warmup_max_lr over a Muon and an Adam group whose lrs differ."""
    sched = c.ds.scheduler or {}
    if sched.get("type") not in ("WarmupLR", "WarmupDecayLR") or "warmup_max_lr" in sched.get("params", {}):
        return False
    opt = c.ds.optimizer
    return _has_muon(c) and any(not p.uses_muon for p in c.params) and opt.muon.lr != opt.adam.lr


# fp16 flushes a value to zero below half its smallest subnormal (2^-24 / 2)
FP16_FLUSH = 2.0 ** -25


def _gram_input_flushed(c: Case) -> bool:
    """Where DSM-119 shows outright: a gram-method Muon matrix whose Nesterov blend ``U`` lies wholly below
    fp16's flush point at some step, so the release's cast before the normalisation hands Newton-Schulz a
    zero matrix and the update is zero (the intended one has norm ~1). Only where gram runs in fp16 (the
    device has fp16: ``harness.env.device.half_support``), on the path measured (ZeRO-1/2 without offload's
    ``get_flat_partition``), for fp32/bf16 models (an fp16 model's ``U`` is loss-scaled there: not measured).
    A matrix flushed in part only, or wholly subnormal, is left to the tolerances (a smaller, case-by-case
    effect), so the trigger replays the intended float64 oracle for ``max|U|`` and claims only the whole flush.
    Per-head matrices are left out: only 0.19.8 has per-head Muon, and it normalises first."""
    if not (_z12_optimizer(c) and _has_muon(c) and c.dtype in ("fp32", "bf16") and not c.model
            and not any(p.num_heads for p in c.params)):
        return False

    if not device.half_support()[0]:
        return False
    return _flushed_gram_step(c.replace(name="plan").to_json())


@functools.lru_cache(maxsize=64)
def _flushed_gram_step(case_json: str) -> bool:

    from harness.case import synthetic  # late: keeps this module numpy-free at import
    from harness.judge.verdict import INTENDED, step_config  # late: keeps this module numpy-free at import

    c = Case.from_json(case_json)
    sc = step_config(c)
    gram = {p.name: sc.hyper(p)["momentum"] for p in sc.params if p.use_muon and sc.hyper(p)["ns_method"] == "gram"}
    if not gram:
        return False
    lp = oracles.MODEL_DTYPES[c.dtype]
    state = oracles.initial_state(sc, {n: t.to(torch.float64) for n, t in synthetic.initial_weights(c).items()},
                                  INTENDED)
    for s in range(1, c.steps + 1):
        w = {n: m.to(lp).to(torch.float64) for n, m in state.master.items()}
        grads = [[synthetic.local_gradients(w, c, c.data_rank(r), s, mu) for mu in range(c.grad_accum)]
                 for r in range(c.dp_size)]
        before = state.momentum
        state, rec = oracles.oracle_step(state, grads, sc, INTENDED, ns_mode="exact")
        if rec.skipped:
            continue
        for n, beta in gram.items():
            _, U = muon_momentum(before[n].to(torch.float64), rec.params[n].grad, beta)
            if float(U.abs().max()) < FP16_FLUSH:
                return True
    return False


# Bugs that show only now and then. A strict xfail cannot hold one (it passes most runs), and excusing its
# quantities would blind every case it could touch, so none of these is ever an excuse: a case it can explain
# still fails, and the failure names it (``intermittent_notes``, appended by ``harness.gate.decide.evaluate``).
INTERMITTENT: tuple[dict, ...] = (
    dict(
        id="DSM-125",
        title="ZeRO-3 on gloo waits only for the last all-gather of a multi-parameter gather: a parameter now and "
              "then holds garbage",
        symptom="_allgather_params launches one async all_gather per parameter and waits only for the last "
                "handle (its comment: 'Wait ensures the operation is enqueued'), which orders the others on one "
                "NCCL stream but not on gloo, whose handles are independent. The gathered weights of an earlier "
                "parameter are then read before they arrive: model weights of 1e-38 or 9.8e37 at some step, the "
                "gradients computed from them, everything after.",
        releases=("0.18.9", "0.19.0", "0.19.1", "0.19.2", "0.19.3", "0.19.4", "0.19.5", "0.19.6", "0.19.7"),
        trigger=lambda c: c.stage == 3 and c.world_size > 1,
        where="partition_parameters.py _allgather_params (0.19.7 :2091-2092, launch_handles[-1].wait(); the same "
              "line in every sdist from 0.18.9); 0.19.8 waits for every handle (:2109-2112)",
        measured="z3-none-fp32-ws3-onematrix on 0.19.7: 13 of 48 runs; with that one line waiting for every "
                 "handle in a copy of the 0.19.7 sdist, 0 of 16; earlier rates: 0.19.3 "
                 "onematrix 2/30, 0.19.1 nocontig 1/20, 0.19.7 groups 1/10; 0.19.8 0/30",
    ),
)


def intermittent_notes(c: Case, release: str | None) -> list[str]:
    """One line per intermittent bug of ``release`` that could explain a failure of ``c``."""
    return [f"note: {b['id']} shows now and then on DeepSpeed {release} ({b['title']}; {b['where']}); it "
            f"excuses nothing: rerun the case, and a rerun that passes points at it"
            for b in INTERMITTENT if release in b["releases"] and b["trigger"](c)]


# Bugs under which the release never runs a Muon code path for the case, and the crash frames that then
# cannot be reached: a crash bug whose frame is one of them does not show there (measured: DSM-012, a 4-D
# matrix, resnet-z1-cpu-fp32-ws2-standard on 0.19.7 runs under DSM-101; DSM-102, 0.18.9
# z3-none-fp32-ws2-standard-zinit runs under DSM-116: no Muon group, nothing dealt out).
SKIPPED_FRAMES: dict[str, frozenset] = {
    "DSM-101": frozenset({"muon_update"}),
    "DSM-114": frozenset({"muon_update"}),
    "DSM-116": frozenset({"muon_update", "_apply_distributed_muon_update"}),
}
# Bugs under which the case has no Muon group at all, and the bugs that live in Muon's own code (the Muon
# momentum, update, Newton-Schulz, the Muon partitions of ZeRO), which then cannot show: measured, 0.18.9
# resnet-z3-none-bf16-ws2-standard-zinit (DSM-116) otherwise also carried DSM-001 (16-bit Muon momentum).
NO_MUON_GROUP = frozenset({"DSM-116"})
IN_MUON_CODE = frozenset({"DSM-001", "DSM-004", "DSM-005", "DSM-006", "DSM-007", "DSM-008", "DSM-009", "DSM-012",
                          "DSM-017", "DSM-101", "DSM-102", "DSM-103", "DSM-107", "DSM-108", "DSM-109", "DSM-110",
                          "DSM-111", "DSM-112", "DSM-114", "DSM-119"})
# what a Muon matrix stepped without its muon_update moves: everything from its gradient on
MUON_NOT_RUN = frozenset({"grad", "momentum", "update", "muon_calls", "master", "model", "global_norm"})


SPECS: tuple[dict, ...] = (
    dict(
        id="DSM-101",
        releases=measured(yes="0.18.9-0.19.7", no="0.19.8"),
        title="ZeRO-1/2 with optimizer offload never runs Muon",
        symptom="On ZeRO-1/2 with cpu/nvme optimizer offload (reduce_scatter off: the only setting the release "
                "accepts with Muon and offload) muon_update is never called: Muon-tagged matrices are stepped "
                "without orthogonalization (masters ~1e5x their allowance at step 1), and the clip norm is the "
                "raw gradient's.",
        trigger=_z12_offload_muon,
        quantities=MUON_NOT_RUN,
        where="0.19.7 stage_1_and_2.py:994-1011: get_flat_partition (the only caller of muon_update) runs "
              "only when cpu_offload is False; the offload epilogue copies raw gradients to the CPU optimizer",
        reproducer="z1-cpu-fp16-ws2-ga2 (gate case) on DeepSpeed 0.19.7",
        present=lambda c: not tree.capabilities()["z12_offload_runs_muon"],
        unmodelled="the step the offloaded Muon matrices get instead was not derived",
    ),
    dict(
        id="DSM-102",
        releases=measured(yes="0.18.9-0.19.7", no="0.19.8"),
        title="ZeRO-3 distributed Muon crashes when a round holds matrices of different shapes",
        symptom="RuntimeError from all_gather ('invalid tensor size') in the first backward at world size >= 2 "
                "whenever one round of the one-matrix-per-rank distribution mixes shapes.",
        trigger=_z3_dist_muon_mixed_shapes,
        quantities=frozenset({"crash"}),
        where="0.19.7 stage3.py:1687-1700 _apply_distributed_muon_update: all_gather over grads_pad[base_i:"
              "base_i + world_sz] of unequal shapes",
        reproducer="z3-cpu-fp32-ws2-inmem (gate case) on DeepSpeed 0.19.7",
        crash=("RuntimeError", "invalid tensor size", "_apply_distributed_muon_update"),
    ),
    dict(
        id="DSM-122",
        releases=measured(yes="0.19.0-0.19.2", no="0.19.3"),
        title="ZeRO-3 distributed Muon all-gathers over the whole world, not the data-parallel group",
        symptom="With model parallelism (a data-parallel group smaller than the world) the first backward raises "
                "RuntimeError from gloo's all_gather ('invalid output tensor list at index 0 (expected length 4, "
                "got 2)'): each round of the one-matrix-per-rank deal is sized by the data-parallel group but "
                "gathered over the default (world) group (0.19.0 z3-none-fp32-ws4-clip0.05-mp2, "
                "z3-cpu-bf16-ws4-ga2-mp2).",
        trigger=_z3_dist_muon_model_parallel,
        quantities=frozenset({"crash"}),
        where="0.19.0-0.19.2 stage3.py _apply_distributed_muon_update (0.19.0 :1507-1527): world_sz = "
              "dist.get_world_size(self.dp_process_group), then dist.all_gather(grads_pad[base_i:base_i + "
              "world_sz], ...) and the momentum's all_gather with no group= argument; 0.19.3 passes "
              "group=process_group",
        reproducer="z3-none-fp32-ws4-clip0.05-mp2 (gate case) on DeepSpeed 0.19.0",
        crash=("RuntimeError", "invalid output tensor list", "_apply_distributed_muon_update"),
    ),
    dict(
        id="DSM-123",
        releases=measured(yes="0.19.4-0.19.7", no="0.19.8"),
        title="ZeRO-3 NVMe before 0.19.8: the Muon update of a swapped matrix sorted after others never steps it",
        symptom="A swapped Muon matrix that DeepSpeed sorts after smaller ones in its sub-group (0.19.4-0.19.6 "
                "z3-nvme-part-fp32-ws1-sortedlast, big.weight 8 x 32768) reaches muon_update with the right "
                "gradient, but its masters then move by something else: every element off from step 1 "
                "(~5e-4, 2e5x the allowance) while the matrices ahead of it are right. The same sub-group "
                "ordering as DSM-021 on 0.19.8, where the gradient read is what breaks; here the capture sees a "
                "right gradient and momentum.",
        trigger=lambda c: c.dtype in ("fp32", "fp16") and nvme.swapped_muon_matrix_not_first(c),
        quantities=frozenset({"master", "model"}),
        where="0.19.4 stage3.py:1877 swap_out_gradients after the Muon update in the gradient reduce "
              "(optimizer_utils.py _swap_out_gradients writes each gradient at its offset in the swap file); not "
              "located further: DSM-021's mechanism (aio through a view of a locked buffer at a nonzero offset "
              "moves nothing on this CPU build) is the likely cause, unverified here",
        reproducer="z3-nvme-part-fp32-ws1-sortedlast (gate case) on DeepSpeed 0.19.4",
        # the swapper's reads through views (tree.swap_gradient_views) with Muon in the reduce; in the step, DSM-021
        present=lambda c: swap_reads_views(c) and versions.z3_muon_placement(True) == "reduce",
    ),
    dict(
        id="DSM-124",
        releases=measured(yes="0.19.0-0.19.5", no="0.19.6-0.19.8"),
        title="CPU FusedAdam ignores adam_w_mode=False: L2 weight decay is applied decoupled (AdamW)",
        symptom="An Adam asked for L2 weight decay (\"Adam\" with adam_w_mode false; Muon's auxiliary Adam with "
                "it) steps as AdamW on the CPU accelerator: 0.19.5 z2-none-fp32-ws2-adam-l2, layer1.weight master "
                "0.29304409 at step 1 where L2 gives 0.29107332 (1.3e4x the allowance) and decoupled decay gives "
                "exactly what DeepSpeed wrote.",
        trigger=_adam_ignores_l2,
        quantities=frozenset({"master", "model"}),
        where="before 0.19.6 csrc/cpu/adam/fused_adam.cpp multi_tensor_adam: create_adam_optimizer(0) once, with "
              "its default adamw_mode=true, and ds_adam_step(0, ...) never reads the mode argument; 0.19.6 keeps "
              "one optimizer per mode. Muon's auxiliary Adam before 0.19.6: MuonWithAuxAdam takes no adam_w_mode "
              "and steps it inline on every path, offload included (0.19.5 muon_optimizer.py:43-45, adam_update "
              "then p.mul_(1 - lr * weight_decay))",
        reproducer="z2-none-fp32-ws2-adam-l2 (gate case) on DeepSpeed 0.19.5",
        model=lambda c: {"adam_l2_decoupled": True},
    ),
    dict(
        id="DSM-103",
        releases=measured(yes="0.19.7", no="0.19.0-0.19.6 0.19.8"),
        title="ZeRO-1/2 keep the Muon momentum of only the last matrix of a group",
        symptom="Without offload every Muon matrix restages the group's momentum from the committed copy "
                "(per parameter), wiping what the matrices before it wrote this step: their momentum never "
                "advances (stays at its initial zeros), ~8e6x its allowance from step 1.",
        trigger=_z12_group_with_two_muon,
        quantities=frozenset({"momentum"}),
        where="0.19.7 stage_1_and_2.py:2249 / 2344: _muon_staging_momentum (which copies the committed "
              "momentum over the whole staging buffer) called inside the per-parameter loop; 0.19.8 stages "
              "once per partition (its stage_1_and_2.py:2743-2745)",
        reproducer="z2-none-fp32-ws2-ga2-clip0.05-standard (gate case) on DeepSpeed 0.19.7",
    ),
    dict(
        id="DSM-104",
        releases=measured(yes="0.19.2-0.19.6", no="0.19.7-0.19.8"),
        title="User parameter groups flattened into one Muon and one Adam group",
        symptom="The groups passed as model_parameters are merged (their parameters kept, their own lr, "
                "weight_decay, momentum and ns_method dropped for the config's); the optimizer's groups are "
                "'muon-params' / 'adam-params' only, so no user group's lr is in effect. ZeRO-1/2 partition "
                "each optimizer group on its own, so the merged Muon group is laid out otherwise and the number "
                "of matrix pieces muon_update runs on changes (0.19.6 z2-none-fp32-ws2-groups: 3 calls a step "
                "where the user's two groups give 4).",
        trigger=lambda c: _passes_group_dicts(c) and _has_muon(c),
        quantities=frozenset({"lr", "master", "model", "momentum", "update", "global_norm", "muon_calls"}),
        where="source checkout edaa72212 (version.txt 0.19.6; the same code in the 0.19.2-0.19.6 sdists) "
              "engine.py:2199-2235 _configure_basic_optimizer: 'Flatten param group dicts' then two groups "
              "from the config; 0.19.7 splits each user group (engine.py _muon_param_groups)",
        reproducer="z2-cpu-fp16-ws2-groups (gate case) on the source checkout",
        present=lambda c: groups_flattened(),
    ),
    dict(
        id="DSM-105",
        releases=measured(yes="0.18.9", no="0.19.0-0.19.8"),
        title="ZeRO-1/2 at world size >= 2 crash in the parameter all-gather (0.18.9 under torch 2.13)",
        symptom="RuntimeError 'Output 0 of Split is a view and is being modified inplace' from the all-gather "
                "of the updated partitions at the first optimizer step, world size >= 2, with or without optimizer "
                "offload (the whole CI gate on 0.18.9: z1/z2-none cases crash the same way).",
        trigger=lambda c: c.stage in (1, 2) and c.world_size >= 2,
        quantities=frozenset({"crash"}),
        where="0.18.9 stage_1_and_2.py:2205 step -> runtime/utils.py:1013-1019 all_gather_into_tensor_dp_groups: "
              "all_gather_into_tensor into views returned by split",
        reproducer="sweep-z1-cpu-ws2-L0-standard (gate case) on DeepSpeed 0.18.9",
        crash=("RuntimeError", "Output 0 of Split is a view and is being modified inplace",
               "all_gather_into_tensor_dp_groups"),
    ),
    dict(
        id="DSM-106",
        releases=measured(yes="0.19.4-0.19.7", no="0.19.8"),
        title="safe_get_local_fp32_param raises with the pipelined NVMe swapper (ZeRO-3)",
        symptom="AttributeError 'PipelinedOptimizerSwapper' object has no attribute 'release_swap_buffers' from "
                "the public deepspeed.utils.safe_get_local_fp32_param on ZeRO-3 with pipeline_read/write NVMe.",
        trigger=lambda c: c.stage == 3 and c.offload == "nvme"
        and c.ds.zero.offload_optimizer.pipeline_read,
        quantities=frozenset({"crash"}),
        where="0.19.7 stage3.py:2965 get_local_fp32_param -> 2890 _get_fp32_opt_state_partition -> 2508 "
              "_release_swap_buffers calls optimizer_swapper.release_swap_buffers, which the pipelined "
              "swapper lacks",
        reproducer="z3-nvme-pipe-fp32-ws2-ga2-standard (gate case) on DeepSpeed 0.19.7",
        crash=("AttributeError", "has no attribute 'release_swap_buffers'", "_release_swap_buffers"),
    ),
    dict(
        id="DSM-107",
        releases=measured(yes="0.19.0-0.19.2", no="0.19.3-0.19.8"),
        title="ZeRO-1/2 without offload: muon_update reads a different gradient on each rank",
        symptom="At world size >= 2 the gradient muon_update orthogonalises differs between the ranks and is not "
                "the data-parallel average (0.19.0 z1-none-fp32-ws2-ga2, layer0.weight at (1, 3): -0.207 where "
                "the average is -0.412): the capture notes the ranks' disagreement, and the update, master and "
                "model diverge from step 1 (fp32: 6.6x the master allowance). Seen on layer0.weight, the Muon "
                "matrix that the two ranks' partitions share.",
        trigger=_z12_muon_matrix_straddles,
        # global_norm: the norm counts each Muon matrix's update O (DeepSpeed's clip_norm_source), made from
        # that gradient (0.19.0's whole gate: the norm alone diverged in 8 such cases)
        quantities=frozenset({"capture", "grad", "momentum", "update", "master", "model", "global_norm"}),
        where="0.19.0-0.19.2 stage_1_and_2.py get_flat_partition (0.19.0: lines 2003-2013): muon_update over "
              "the whole matrix's self.all_grad_tensors entry on each rank; which part of it holds the averaged "
              "gradient was not investigated",
        reproducer="z1-none-fp32-ws2-ga2 (gate case) on DeepSpeed 0.19.0",
    ),
    dict(
        id="DSM-108",
        releases=measured(yes="0.18.9-0.19.7", no="0.19.8"),
        title="fp16: the Muon step is divided by the loss scale",
        symptom="The Muon update O replaces the loss-scaled gradient without the factor S, and the step then "
                "divides every gradient by S: the Muon step is O/S (1/256 of what it should be at the gate's "
                "initial_scale_power 8) and the clip norm counts O/S. Seen on 0.19.7 as the fp16 ZeRO-1/2 "
                "masters barely moving (z1-none-fp16-ws2-groups layer1.weight step 1: 0.6477 where the oracle "
                "has 0.6251, 18x the allowance) and on ZeRO-3 fp16 (z3-cpu-fp16-ws1-standard).",
        trigger=_muon_update_in_scaled_buffer,
        quantities=frozenset({"master", "model", "global_norm"}),
        where="0.19.7 stage_1_and_2.py get_flat_partition (muon_update's output stored in averaged_gradients) "
              "then step -> unscale_and_clip_grads (:2651-2661, combined_scale = clip * loss_scale); stage3.py "
              "_apply_distributed_muon_update (:1688-1697) then unscale_and_clip_grads (:2705-2710). 0.19.8 "
              "marks such groups (groups_lacking_loss_scale, stage_1_and_2.py:2742, :3120-3121; "
              "sub_groups_lacking_loss_scale, stage3.py:1840) and multiplies the update by S first",
        reproducer="z1-none-fp16-ws2-groups (gate case) on DeepSpeed 0.19.7",
        model=lambda c: {"muon_update_unscaled": True},
    ),
    dict(
        id="DSM-109",
        releases=measured(yes="0.19.0-0.19.7", no="0.19.8"),
        title="ZeRO-3 NVMe offload with the Muon momentum kept in memory crashes at initialize",
        symptom="deepspeed.initialize raises a bare AssertionError (swap_in_tensors: async_pread did not return 0) "
                "while initialize_optimizer_states swaps the first Muon sub-group in, with "
                "save_muon_momentum_buffer_in_memory on and the optimizer offloaded to NVMe.",
        trigger=lambda c: c.stage == 3 and c.offload == "nvme" and _has_muon(c)
        and bool(c.ds.zero.save_muon_momentum_buffer_in_memory),
        quantities=frozenset({"crash"}),
        where="0.19.7 stage3.py:1285 initialize_optimizer_states -> 2446 _optimizer_states_and_gradient_swap_in -> "
              "partitioned_optimizer_swapper.py:182 -> swap_tensor/utils.py:21; _create_momentum_buffer "
              "(stage3.py:1021-1033) puts the in-memory buffer into the optimizer state, which the swapper then "
              "reads from a file never written; 0.19.8 marks that buffer swappable=False (its stage3.py:1073)",
        reproducer="z3-nvme-part-fp32-ws2-inmem (gate case) on DeepSpeed 0.19.7",
        crash=("AssertionError", "", "_optimizer_states_and_gradient_swap_in"),
    ),
    dict(
        id="DSM-110",
        releases=measured(yes="0.19.0-0.19.7", no="0.19.8"),
        title="ZeRO-3: Muon silently skipped for a bucket reduced outside the contiguous path",
        symptom="With contiguous_gradients off or a Muon gradient larger than reduce_bucket_size, "
                "the bucket is averaged by __avg_scatter_grads, which never calls muon_update: its Muon matrices "
                "are stepped with the raw averaged gradient (the capture sees no muon_update gradient; measured "
                "on 0.19.7 z3-none-bf16-ws2-knob-buckets and -ga2-knob-nocontig).",
        trigger=_z3_muon_skipped,
        quantities=MUON_NOT_RUN,
        where="0.19.7 stage3.py:1599-1604 __reduce_and_partition_ipg_grads: only __avg_scatter_contiguous_grads "
              "(:1772) calls _apply_distributed_muon_update",
        reproducer="z3-none-bf16-ws2-knob-buckets (gate case) on DeepSpeed 0.19.7",
        present=lambda c: versions.z3_muon_placement(c.offload != "none") == "reduce",
    ),
    dict(
        id="DSM-111",
        releases=measured(yes="0.19.0-0.19.7", no="0.19.8"),
        title="ZeRO-3 with gradient accumulation runs Muon on every micro-batch",
        symptom="ZeRO-3 reduces each micro-batch's gradients, and before 0.19.8 Muon runs inside that reduce: "
                "with gradient_accumulation_steps k each Muon matrix is orthogonalised k times per step, on each "
                "micro-batch's averaged gradient, its momentum advances k times, and the partition accumulates the "
                "sum of the k updates (capture: 'muon_update ran 2 times', z3-nvme-part-fp32-ws1-ga2 on 0.19.7).",
        trigger=lambda c: c.stage == 3 and _has_muon(c) and c.grad_accum > 1
        and not _z3_muon_skipped(c),
        quantities=frozenset({"capture", "muon_calls", "grad", "momentum", "update", "master", "model",
                              "global_norm"}),
        where="0.19.7 stage3.py:1772 _apply_distributed_muon_update in __avg_scatter_contiguous_grads, called on "
              "every backward's reduce (no gradient-accumulation-boundary test); 0.19.8 runs Muon in the step",
        reproducer="z3-nvme-part-fp32-ws1-ga2 (gate case) on DeepSpeed 0.19.7",
        present=lambda c: versions.z3_muon_placement(c.offload != "none") == "reduce",
    ),
    dict(
        id="DSM-112",
        releases=measured(yes="0.19.7", no="0.19.0-0.19.2 0.19.8"),
        title="ZeRO-1/2: ranks end a step with different momentum for a matrix they share (DSM-103 on a "
              "straddling matrix)",
        symptom="A Muon matrix split between two ranks' partitions that is the last Muon matrix of one rank's "
                "partition and not of the other's keeps this step's momentum on the first rank only (DSM-103's "
                "restaging); the capture finds the ranks' stored momentum different, and the next update is "
                "assembled from parts computed from different momenta (0.19.7: z2-none-fp32-ws3, the ws3 and "
                "layout-sweep cases, moe-z2-none-fp32-ws2).",
        trigger=_z12_momentum_split,
        quantities=frozenset({"capture", "momentum", "update", "master", "model", "global_norm"}),
        where="as DSM-103 (0.19.7 stage_1_and_2.py:2249 / 2344 _muon_staging_momentum inside the per-parameter "
              "loop), on each rank's own partition list; registered apart because it diverges in more quantities",
        reproducer="z2-none-fp32-ws3 (gate case) on DeepSpeed 0.19.7",
    ),
    dict(
        id="DSM-113",
        releases=measured(yes="0.18.9-0.19.3", no="0.19.4 0.19.7-0.19.8"),
        title="ZeRO-3 with the pipelined NVMe swapper crashes at initialize (0.18.9)",
        symptom="deepspeed.initialize raises a bare AssertionError (len(swap_paths) == len(swap_buffers)) while "
                "initialize_optimizer_states swaps the optimizer state out through PipelinedOptimizerSwapper.",
        trigger=lambda c: c.stage == 3 and c.offload == "nvme" and _has_muon(c)
        and c.ds.zero.offload_optimizer.pipeline_write,
        quantities=frozenset({"crash"}),
        where="0.18.9 stage3.py:1214 initialize_optimizer_states -> 2329 _optimizer_states_and_gradient_swap_out -> "
              "pipelined_optimizer_swapper.py:140 swap_out_optimizer_state -> :191 _swap_out_optimizer_state",
        reproducer="z3-nvme-pipe-fp32-ws1-clip0.05-standard (gate case) on DeepSpeed 0.18.9",
        crash=("AssertionError", "", "_swap_out_optimizer_state"),
    ),
    dict(
        id="DSM-114",
        releases=measured(yes="0.18.9-0.19.6", no="0.19.7-0.19.8"),
        title="Without ZeRO, and on the BF16_Optimizer route, Muon parameters are stepped by plain SGD",
        symptom="At stage 0, and on the BF16_Optimizer route (ZeRO-1 bf16 with grad_accum_dtype fp32, whose param "
                "groups are flat fp32 partitions), MuonWithAuxAdam.step moves each Muon parameter by lr times its "
                "gradient (with the decoupled weight decay): no momentum, no Newton-Schulz, muon_update never called "
                "(the capture sees no Muon call; masters diverge from step 1). Modelled on both "
                "(Conventions.muon_as_sgd: with DSM-013's clip of the raw gradients before the step on the "
                "BF16_Optimizer route; at stage 0 "
                "with the fp16 wrapper's own accidents DSM-014..016 where they apply, measured on 0.19.5 and "
                "0.19.6's stage-0 gate cases).",
        trigger=_muon_stepped_as_sgd,
        quantities=MUON_NOT_RUN,
        where="0.18.9 muon_optimizer.py:25-31 (0.19.6 :61-67) MuonWithAuxAdam.step: 'we move the muon update part "
              "to the deepspeed's optimizer', p.add_(p.grad, alpha=-lr); 0.19.7 calls muon_update there at stage "
              "0 and refuses Muon on the BF16_Optimizer route (engine.py _check_muon_can_reach_its_parameters)",
        reproducer="z0-none-bf16-ws1-standard (gate case) on DeepSpeed 0.18.9; z1-none-bf16-ws1-gad32 on 0.19.6",
        model=lambda c: {"muon_as_sgd": True},
    ),
    dict(
        id="DSM-115",
        releases=measured(yes="0.19.0-0.19.7", no="0.19.8"),
        title="ZeRO-1/2 with contiguous_gradients off on the CPU accelerator: gradients never averaged across ranks",
        symptom="No gradient is data-parallel reduced: each rank steps its partition, and runs muon_update, on its "
                "own micro-batches' gradient (0.19.7 z1-none-fp32-ws2-knob-nocontig: the capture finds the ranks' "
                "muon_update gradient of layer0.weight different; every parameter's gradient, Adam's too, is off "
                "from step 1, layer1.weight by 3.9e5x its allowance). Every parameter, Muon or not.",
        trigger=_z12_nocontig_unreduced,
        quantities=frozenset({"capture", "grad", "momentum", "update", "master", "model", "global_norm"}),
        where="0.18.9-0.19.7 stage_1_and_2.py split_half_float_double (0.19.7 :66-77) matches t.type() against "
              "'torch.cpu.FloatTensor' etc.; a CPU tensor's type() is 'torch.FloatTensor', so every bucket is "
              "empty and buffered_reduce_fallback (reduce_ipg_grads' path without contiguous gradients, :1809) "
              "all-reduces nothing. 0.19.8 compares dtypes (its :66-77). Measured: 0.19.7 with only that function "
              "replaced by 0.19.8's, the case xfails with DSM-103 alone",
        reproducer="z1-none-fp32-ws2-knob-nocontig (gate case) on DeepSpeed 0.19.7",
        present=lambda c: tree.capabilities()["z12_buckets_by_type_string"],
    ),
    dict(
        id="DSM-116",
        releases=measured(yes="0.18.9-0.19.6", no="0.19.7-0.19.8"),
        title="zero.Init: no parameter is tagged Muon, the whole model is stepped by Adam",
        symptom="Under deepspeed.zero.Init every partitioned parameter's data is a flat placeholder, so "
                "set_optimizer_flags (p.ndim >= 2) tags no parameter use_muon: the optimizer has no Muon group "
                "(the capture reads no Muon group lr: NaN), muon_update is never called, and the matrices are "
                "stepped by the auxiliary Adam with adam_lr (0.18.9 z3-none-fp32-ws2-standard-zinit, "
                "z3-cpu-fp32-ws2-standard-zinit, resnet-z3-none-bf16-ws2-standard-zinit).",
        trigger=_zinit_muon,
        quantities=MUON_NOT_RUN | frozenset({"lr", "capture"}),
        where="0.18.9-0.19.6 deepspeed/__init__.py set_optimizer_flags (0.18.9 :71-77, 0.19.6 :84-90) tests "
              "p.ndim, which zero.Init has made 1-D; 0.19.7 tests the layer's shape (ds_shape, its "
              "_layer_shape, :84-105)",
        reproducer="z3-none-fp32-ws2-standard-zinit (gate case) on DeepSpeed 0.18.9",
        present=lambda c: not tree.capabilities()["muon_tag_reads_layer_shape"],
    ),
    dict(
        id="DSM-117",
        releases=measured(yes="0.19.0-0.19.6", no="0.19.7-0.19.8"),
        title="ZeRO-1/2 16-bit: muon_update crashes when the Muon momentum and the gradient differ in dtype",
        symptom="RuntimeError \"expected dtype float for `end` but got dtype c10::BFloat16\" (or c10::Half) from "
                "momentum.lerp_(grad) in muon_update at the first step that reaches it: ZeRO-2 bf16/fp16 with "
                "grad_accum_dtype fp32 (0.19.6 z2-none-bf16-ws2-knob-gad32), and a resumed 16-bit run (the "
                "restored momentum is fp32: 0.19.6 z2-none-bf16-ws3-resume, z1-none-fp16-ws2-resume-overflow).",
        trigger=_z12_momentum_dtype_mismatch,
        quantities=frozenset({"crash"}),
        where="0.19.6 stage_1_and_2.py get_flat_partition (:2150-2155) creates the flat momentum_buffer in "
              "gradient_accumulation_dtype, while at stage 2 the gradient is param.grad in the model dtype (:1152); "
              "load_checkpoint restores the state in the fp32 master's dtype. 0.19.7 sizes the buffer by the "
              "gradient's dtype (its _muon_momentum_buffer, :2292-2330)",
        reproducer="z2-none-bf16-ws2-knob-gad32 (gate case) on DeepSpeed 0.19.6",
        crash=("RuntimeError", "expected dtype float for `end`", "muon_update"),
    ),
    dict(
        id="DSM-118",
        releases=measured(yes="0.19.0-0.19.6", no="0.19.7-0.19.8"),
        title="An overflowed step leaves the Muon momentum non-finite",
        symptom="muon_update folds the gradient into the momentum (momentum.lerp_) before the loss scaler finds "
                "the overflow and skips the step, so one inf/NaN gradient makes the Muon momentum non-finite for "
                "the rest of the run: the following steps' updates are non-finite, are skipped as overflows in "
                "turn, and the scale backs off (0.19.6 z1-none-fp16-ws2-overflow, z2-none-fp16-ws2-overflow).",
        trigger=_muon_sees_overflow,
        quantities=frozenset({"capture", "grad", "momentum", "update", "master", "model", "global_norm",
                              "skipped", "loss_scale", "loss_scale_after"}),
        where="0.19.0-0.19.6 original_muon.py muon_update (0.19.6 :146-148): momentum.lerp_(grad, 1 - beta) "
              "unconditionally; 0.19.7 keeps the momentum when the gradient is not finite (its grad_is_finite, "
              "torch.where) and returns the non-finite gradient so the step is still skipped",
        reproducer="z1-none-fp16-ws2-overflow (gate case) on DeepSpeed 0.19.6",
        present=lambda c: not tree.capabilities()["muon_update_guards_nonfinite"],
    ),
    dict(
        id="DSM-120",
        releases=measured(yes="0.19.0-0.19.3", no="0.19.4"),
        title="ZeRO-3 NVMe optimizer offload aborts the process at initialize on the CPU accelerator (0.19.3)",
        symptom="deepspeed.initialize kills the rank with SIGABRT (C++ assert `_num_pending_ops > 0' in the async_io "
                "handle's wait(), no Python exception) while initialize_optimizer_states swaps the optimizer state "
                "out through the partitioned swapper: on the CPU accelerator no state tensor counts as pinned, so "
                "nothing is submitted and the swapper then waits on an empty queue (0.19.3 z3-nvme-part-fp32-ws1-ga2, "
                "every z3-nvme-part case without the in-memory momentum).",
        trigger=lambda c: c.stage == 3 and c.offload == "nvme"
        and not c.ds.zero.offload_optimizer.pipeline_write
        and os.environ.get("DS_ACCELERATOR", "cpu") == "cpu",
        quantities=frozenset({"crash"}),
        where="0.19.3 partitioned_optimizer_swapper.py:106-107 _swap_out_optimizer_state: swap_out_tensors over "
              "get_swap_buffers_and_paths(True) (optimizer_utils.py:96 selects by get_accelerator().is_pinned, "
              "False for every CPU tensor) then assert aio_handle.wait() == len(...); "
              "csrc/aio/py_lib/deepspeed_py_io_handle.cpp:203 asserts a pending op. 0.19.4 asks the aio handle "
              "(its own pinned-tensor manager) instead",
        reproducer="z3-nvme-part-fp32-ws1-ga2 (gate case) on DeepSpeed 0.19.3",
        crash=("Fatal Python error", "Aborted", "_swap_out_optimizer_state"),
    ),
    dict(
        id="DSM-121",
        releases=measured(yes="0.19.0-0.19.3", no="0.19.4"),
        title="WarmupLR without warmup_max_lr warms every param group up to the first group's lr (0.19.3)",
        symptom="Without warmup_max_lr, WarmupLR (and WarmupDecayLR, its subclass) takes the first param group's lr "
                "as the peak of every group, so the Adam group warms up to Muon's lr (0.19.3 "
                "z0-none-fp32-ws2-sched-warmup: the Adam group's lr at step 3 is 0.008 = 0.002 + (0.02 - 0.002) / 3 "
                "where its own lr 0.001 gives 0.00167; the Adam masters follow).",
        trigger=lambda c: _warmup_peak_from_first_group(c),
        quantities=frozenset({"lr", "master", "model"}),
        where="0.19.3 lr_schedules.py WarmupLR.__init__ (:672-673): warmup_max_lr = [group['lr'] for group in "
              "self.optimizer.param_groups][0]; 0.19.4 keeps the list (one peak per group)",
        reproducer="z0-none-fp32-ws2-sched-warmup (gate case) on DeepSpeed 0.19.3",
        model=lambda c: {"warmup_peak": "first_group"},
    ),
    dict(
        id="DSM-119",
        releases=measured(yes="0.19.0-0.19.7", no="0.19.8"),
        title="Gram Newton-Schulz casts to fp16 before it normalises: tiny updates flush to zero",
        symptom="The gram iteration rounds its input to fp16 and only then divides by its norm, so a Muon matrix "
                "whose momentum blend lies below fp16's flush point (2^-25, ~3e-8) becomes a zero matrix and its "
                "update is zero where the intended one is an orthogonalised matrix of norm ~1; subnormal entries "
                "(below 2^-14) keep fewer bits (0.19.5-0.19.7 z1-none-fp32-ws2-tinygrad, every gradient x1e-10: "
                "update 0 where the oracle has 0.031, the masters 15-19x their allowance from step 1).",
        trigger=_gram_input_flushed,
        quantities=frozenset({"update", "master", "model", "global_norm"}),
        where="0.19.0-0.19.7 original_muon.py zeropower_via_gram_newtonschulz (0.19.7 :89-97): X = G.to(fp16) "
              "then X / (X.norm() + 1e-7); 0.19.8 normalises in the input's dtype (fp32 for fp16 input) and "
              "casts after (its :108-115). Where the accelerator has no fp16 the iteration runs in fp32: no flush",
        reproducer="z1-none-fp32-ws2-tinygrad (gate case) on DeepSpeed 0.19.5",
        model=lambda c: {"gram_input_dtype": "fp16"},
    ),
)
