"""Mutation self-check: plausible and historical Muon/ZeRO bugs re-introduced into DeepSpeed 0.19.8
at run time, to prove the harness (capture + oracle + verdict) catches them.

``MUTANTS[name] = Mutant(name, description, install, catches)``; ``install(name)`` installs one and
returns the callable that undoes it. A case asks for one with ``Case(..., mutant=name)``; it takes
effect inside every rank through ``harness.rank.patches`` -- on top of the patched runtime when the case
is also ``patched=True``, which is how ``harness.selfcheck.kill_matrix`` runs them, so the unmutated baseline is clean.

How they are built. Every mutant *wraps* whatever is installed (stock DeepSpeed or the patched
runtime's replacement) and never replaces a function with a copy of stock code, so it composes with
the patched runtime. Most act at ``original_muon.muon_update`` (the one function every ZeRO path calls
Muon through, looked up at call time); they find out which path called them by walking up to the
innermost frame whose ``self`` is a ZeRO optimizer (``_ds_context``), and read the layout from that
optimizer, as the buggy code would have. They are installed *outside* the Muon call recorder
(``harness.rank.ds_run.recorded_patches``: patched runtime, recorder, mutant), so the recorder sees what the
mutated DeepSpeed passes to ``muon_update`` and what the real ``muon_update`` returns -- as it would
for a bug in DeepSpeed's source -- never clean inputs and a doctored output.

``catches`` is a predicate on a case: True where the mutant is *expected* to make the verdict fail.
``harness.selfcheck.kill_matrix`` (the parent-side driver, ``python -m harness mutate``) checks the expectation
as well as measuring kills. This module is imported inside the ranks, so it imports nothing that
starts or drives ranks.
"""
from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from harness.case.nvme import expects_swap
from harness.case.spec import Case, ParamShape
from oracles.layout import zero3_padded_tail
from harness import models
from harness.registry import module_mutants as mutants

# ------------------------------------------------------------------------------------------------
# plumbing


@dataclass(frozen=True)
class Mutant:
    name: str
    description: str
    install: Callable[[], Callable[[], None]]  # installs; returns undo
    catches: Callable[[Case], bool] | tuple = ()  # predicate, or case-name substrings
    history: str = ""  # where the bug is from (a DeepSpeed issue/PR, or "plausible")

    def expected(self, case: Case) -> bool:
        if callable(self.catches):
            return bool(self.catches(case))
        return any(p in case.name for p in self.catches)


def _setattr(owner, attr, new):
    old = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    setattr(owner, attr, new)

    def undo():
        setattr(owner, attr, old)

    return old, undo


def _ds_classes():
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # late: DeepSpeed, rank side
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3  # late: DeepSpeed, rank side
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # late: DeepSpeed, rank side

    return DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer


def _ds_context():
    """(optimizer, path, frame locals) of the innermost caller frame whose ``self`` is a ZeRO optimizer.
    path: "z12", "z12_offload", "z3", "z3_offload", "bf16_opt" or None."""
    Z12, Z3, BF16 = _ds_classes()
    f = sys._getframe(2)
    try:
        while f is not None:
            s = f.f_locals.get("self")
            if isinstance(s, Z12):
                return s, ("z12_offload" if s.cpu_offload else "z12"), dict(f.f_locals)
            if isinstance(s, Z3):
                return s, ("z3_offload" if s.offload_optimizer else "z3"), dict(f.f_locals)
            if isinstance(s, BF16):
                return s, "bf16_opt", dict(f.f_locals)
            f = f.f_back
        return None, None, {}
    finally:
        del f


_MU_SIG = None


def _bind(args, kwargs) -> dict:
    global _MU_SIG
    if _MU_SIG is None:
        def ref(grad, momentum, beta=0.95, ns_steps=5, nesterov=True, ns_method="gram", is_expert_group=False,
                num_heads=None):
            pass
        _MU_SIG = inspect.signature(ref)
    b = _MU_SIG.bind(*args, **kwargs)
    b.apply_defaults()
    return dict(b.arguments)


def _wrap_muon_update(body):
    """Install ``body(inner, a: dict) -> update`` around the current ``original_muon.muon_update``;
    ``a`` holds every argument by name, ``inner(**a)`` calls the wrapped function."""
    from deepspeed.runtime.zero.muon import original_muon  # late: DeepSpeed, rank side

    def install():
        from deepspeed.runtime.zero.muon import muon_optimizer  # late: DeepSpeed, rank side

        undos = []
        # Without ZeRO, MuonWithAuxAdam.step calls the binding muon_optimizer took at import.
        for mod in (original_muon, muon_optimizer):
            cur = mod.muon_update

            def muon_update(*args, _cur=cur, **kwargs):
                return body(_cur, _bind(args, kwargs))

            undos.append(_setattr(mod, "muon_update", muon_update)[1])

        def undo():
            for u in reversed(undos):
                u()

        return undo

    return install


def _wrap_method(cls_index: tuple[int, ...], attr: str, make):
    """Wrap ``attr`` on the ZeRO optimizer classes picked by ``cls_index`` (0: ZeRO-1/2, 1: ZeRO-3);
    ``make(cur) -> new``."""
    def install():
        classes = _ds_classes()
        undos = []
        for i in cls_index:
            cls = classes[i]
            cur = cls.__dict__[attr]
            undos.append(_setattr(cls, attr, make(cur))[1])

        def undo():
            for u in reversed(undos):
                u()

        return undo

    return install


def _owned_range(opt, path, loc, grad):
    """This rank's flat element range [lo, hi) of the parameter being orthogonalised, or None."""
    from deepspeed import comm as dist  # late: DeepSpeed, rank side

    n = grad.numel()
    if path == "z12":
        tl, i, g = loc.get("tensor_list"), loc.get("i"), loc.get("param_group_idx")
        if tl is None or i is None or g is None:
            return None
        param = tl[i]
        pid = dist.get_rank(group=opt.real_dp_process_group[g])
    elif path == "z12_offload":
        param, g, pid = loc.get("param"), loc.get("group_idx"), loc.get("rank")
        if param is None or g is None or pid is None:
            return None
    elif path == "z3_offload":
        param = loc.get("param")
        if param is None:
            return None
        pn = param.partition_numel()
        lo = opt._get_param_partition_rank(param) * pn
        return (lo, min(n, lo + pn)) if lo < n else None
    else:
        return None
    param_id = opt.get_param_id(param)
    if pid not in opt.param_to_partition_ids[g][param_id]:
        return None
    lo = int(opt.grad_start_offset[g][pid][param_id])
    dest = int(opt.grad_partition_insertion_offset[g][pid][param_id])
    num = int(min(n - lo, int(opt.partition_size[g]) - dest))
    return lo, lo + num


def _rows_only(inner, a, lo, hi):
    """Orthogonalise only the rows holding flat elements [lo, hi) (what a rank that holds just that
    slice could do); other rows of the result are zero."""
    grad, mom = a["grad"], a["momentum"]
    rows = grad.shape[0]
    cols = grad.numel() // rows
    r0, r1 = lo // cols, -(-hi // cols)
    if r0 == 0 and r1 >= rows:
        return inner(**a)
    b = dict(a, grad=grad.view(rows, cols)[r0:r1], momentum=mom.view(rows, cols)[r0:r1], num_heads=None)
    sub = inner(**b)
    out = torch.zeros(grad.shape, dtype=sub.dtype, device=sub.device)
    out.view(rows, cols)[r0:r1] = sub
    return out


# ------------------------------------------------------------------------------------------------
# the mutants


def _m_own_rows(paths: tuple[str, ...]):
    """On ``paths``, each rank orthogonalises only the rows of the matrix it owns."""
    def body(inner, a):
        opt, path, loc = _ds_context()
        if path in paths and a["grad"].ndim >= 2:
            r = _owned_range(opt, path, loc, a["grad"])
            if r is not None:
                return _rows_only(inner, a, *r)
        return inner(**a)

    return body


def _m_ns_per_micro(inner, a):
    opt, path, _ = _ds_context()
    gas = int(getattr(opt, "gradient_accumulation_steps", 1) or 1) if path in ("z3", "z3_offload") else 1
    if gas <= 1:
        return inner(**a)
    share = a["grad"] / gas
    out = None
    for _ in range(gas):  # the momentum advances once per micro-batch, each time with a partial gradient
        out = inner(**dict(a, grad=share.clone()))
    return out


def _m_fp16_momentum(inner, a):
    out = inner(**a)
    m = a["momentum"]
    m.copy_(m.to(torch.float16).to(m.dtype))
    return out


def _m_beta_off(inner, a):
    return inner(**dict(a, beta=a["beta"] - 0.05))


def _m_nesterov_dropped(inner, a):
    return inner(**dict(a, nesterov=False))


def _m_aspect_dropped(inner, a):
    out = inner(**a)
    if a["num_heads"] is None and out.ndim == 2 and out.shape[0] > out.shape[1]:
        out = out / math.sqrt(out.shape[0] / out.shape[1])
    return out


def _m_per_head_dropped(inner, a):
    return inner(**dict(a, num_heads=None))


def _m_offload_scale_not_divided(inner, a):
    opt, path, _ = _ds_context()
    S = float(getattr(opt, "loss_scale", 1.0)) if opt is not None else 1.0  # BF16_Optimizer has none
    if path in ("z12_offload", "z3_offload") and S != 1.0:
        return inner(**dict(a, grad=a["grad"] * S))  # undoes the caller's grad.div_(loss_scale)
    return inner(**a)


def _m_offload_dp_sum(inner, a):
    opt, path, _ = _ds_context()
    if path in ("z12_offload", "z3_offload"):
        from deepspeed import comm as dist

        W = dist.get_world_size(group=opt.dp_process_group)
        if W > 1:
            return inner(**dict(a, grad=a["grad"] * W))  # summed over ranks, never averaged
    return inner(**a)


def _padded_tail_range(opt, path, loc, grad):
    """The mis-sliced range: where a matrix whose element count is not divisible by the world size
    lies in a padded partition. ZeRO-3 pads every parameter to a multiple of W, so the padded tail is
    the slice of the rank whose partition the matrix's end cuts short (``oracles.layout.zero3_padded_tail``);
    ZeRO-1/2 pad the group, so the matrix must reach into the last partition of a group that has padding."""
    from deepspeed import comm as dist  # late: DeepSpeed, rank side

    n = grad.numel()
    if path in ("z3", "z3_offload"):
        param = loc.get("param")
        group = opt._get_param_partition_group(param) if param is not None else opt.dp_process_group
        return zero3_padded_tail(n, dist.get_world_size(group=group))
    if path in ("z12", "z12_offload"):
        if path == "z12":
            tl, i, g = loc.get("tensor_list"), loc.get("i"), loc.get("param_group_idx")
            param = tl[i] if tl is not None and i is not None else None
        else:
            param, g = loc.get("param"), loc.get("group_idx")
        if param is None or g is None:
            return None
        W = dist.get_world_size(group=opt.real_dp_process_group[g])
        if W <= 1 or n % W == 0:
            return None
        last = W - 1
        param_id = opt.get_param_id(param)
        P = int(opt.partition_size[g])
        total = sum(p.numel() for p in opt.bit16_groups[g])
        if last not in opt.param_to_partition_ids[g][param_id] or P * W <= total:
            return None
        lo = int(opt.grad_start_offset[g][last][param_id])
        dest = int(opt.grad_partition_insertion_offset[g][last][param_id])
        return lo, lo + int(min(n - lo, P - dest))
    return None


def _m_padded_tail_misslice(inner, a):
    opt, path, loc = _ds_context()
    out = inner(**a)
    r = _padded_tail_range(opt, path, loc, a["grad"]) if opt is not None else None
    if r is None or r[0] < 1:
        return out
    lo, hi = r
    flat = out.reshape(-1).clone()
    flat[lo:hi] = out.reshape(-1)[lo - 1:hi - 1]  # the tail's slice taken one element early
    return flat.view(out.shape)


def _muon_group_of_unscale(self, args, kwargs) -> bool:
    Z12, Z3, _ = _ds_classes()
    if isinstance(self, Z3):
        sg = args[0] if args else kwargs.get("sub_group_id")
        return bool(getattr(self, "use_muon", False) and self.sub_groups_using_muon[sg])
    f = sys._getframe(2)
    try:
        i = f.f_locals.get("i")
    finally:
        del f
    return i is not None and bool(self._is_muon_group(self.bit16_groups[i]))


def _make_clip_skips_muon(cur):
    def unscale_and_clip_grads(self, *args, **kwargs):
        if self.clip_grad > 0 and _muon_group_of_unscale(self, args, kwargs):
            saved = self.clip_grad
            self.clip_grad = 0.0  # the clip was applied to the gradient before NS, which normalised it away
            try:
                return cur(self, *args, **kwargs)
            finally:
                self.clip_grad = saved
        return cur(self, *args, **kwargs)

    return unscale_and_clip_grads


def _make_norm_excludes_muon(pos):
    """``pos``: where ``params`` sits -- get_grad_norm_direct(self, gradients, params, norm_type=2): 1;
    complete_grad_norm_calculation_for_cpu_offload(self, params): 0."""
    def make(cur):
        def norm(self, *args, **kwargs):
            out = cur(self, *args, **kwargs)  # still called: it takes part in collectives
            params = kwargs.get("params", args[pos] if len(args) > pos else None)
            if params and getattr(params[0], "use_muon", False):
                return torch.zeros_like(out) if torch.is_tensor(out) else 0.0
            return out

        return norm

    return make


def _make_not_rescaled(cur):
    def _muon_update_lacks_loss_scale(self, *args, **kwargs):
        return False  # the Muon update is treated as if it carried the loss scale

    return _muon_update_lacks_loss_scale


def _install_norm_excludes_muon():
    u1 = _wrap_method((0, 1), "get_grad_norm_direct", _make_norm_excludes_muon(1))()
    u2 = _wrap_method((0, 1), "complete_grad_norm_calculation_for_cpu_offload", _make_norm_excludes_muon(0))()

    def undo():
        u2()
        u1()

    return undo


def _install_weight_decay_twice():
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # late: DeepSpeed, rank side

    cur = MuonWithAuxAdam.__dict__["step"]

    @torch.no_grad()
    def step(self, *args, **kwargs):
        for group in self.param_groups:
            if group.get("use_muon") and group.get("weight_decay", 0.0):
                for p in group["params"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
        return cur(self, *args, **kwargs)

    return _setattr(MuonWithAuxAdam, "step", step)[1]


def _install_muon_as_sgd():
    """Without ZeRO, ``MuonWithAuxAdam.step`` takes every Muon weight for an already-orthogonalised flat
    ZeRO partition (its ``p.dim() < 2`` branch): the raw gradient is the update, no momentum, no
    Newton-Schulz -- plain SGD. The ZeRO paths call ``original_muon`` and are untouched."""
    from deepspeed.runtime.zero.muon import muon_optimizer  # late: DeepSpeed, rank side

    def muon_update(grad, momentum, *args, **kwargs):
        return grad

    return _setattr(muon_optimizer, "muon_update", muon_update)[1]


def _install_groups_flattened():
    """The user's param groups are flattened into one list before Muon builds its halves, so every
    group's own lr / momentum / weight_decay / ns_method is silently replaced by the config's."""
    from deepspeed.runtime.engine import DeepSpeedEngine  # late: DeepSpeed, rank side

    cur = DeepSpeedEngine.__dict__["_muon_param_groups"].__func__

    def _muon_param_groups(model_parameters, optimizer_parameters):
        flat = [p for item in model_parameters for p in (item["params"] if isinstance(item, dict) else [item])]
        return cur(flat, optimizer_parameters)

    return _setattr(DeepSpeedEngine, "_muon_param_groups", staticmethod(_muon_param_groups))[1]


def _install_scheduler_stepped_early():
    """The engine steps the lr scheduler before the optimizer step as well as after it, so every step
    runs at the next step's lr (an off-by-one in where the schedule is advanced)."""
    from deepspeed.runtime.engine import DeepSpeedEngine  # late: DeepSpeed, rank side

    cur = DeepSpeedEngine.__dict__["_take_model_step"]

    def _take_model_step(self, *args, **kwargs):
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return cur(self, *args, **kwargs)

    return _setattr(DeepSpeedEngine, "_take_model_step", _take_model_step)[1]


def _make_skip_muon(cur):
    def _prepare_muon_updates(self, *args, **kwargs):
        return None  # the partitions keep the raw gradients: Muon groups take an SGD step

    return _prepare_muon_updates


def _install_stale_momentum():
    from deepspeed.runtime.engine import DeepSpeedEngine  # late: DeepSpeed, rank side

    cur = DeepSpeedEngine.__dict__["load_checkpoint"]

    def load_checkpoint(self, *args, **kwargs):
        out = cur(self, *args, **kwargs)
        Z12, Z3, _ = _ds_classes()
        opt = self.optimizer
        bufs = []
        if isinstance(opt, Z12):
            for g, params in enumerate(opt.bit16_groups):
                if params and getattr(params[0], "use_muon", False):
                    key = (opt.single_partition_of_fp32_groups[g] if opt.cpu_offload
                           else opt.optimizer.param_groups[g]["params"][0])
                    bufs.append(opt.optimizer.state.get(key, {}).get("momentum_buffer"))
        elif isinstance(opt, Z3) and opt.use_muon:
            for i, uses in enumerate(opt.sub_groups_using_muon):
                if uses:
                    bufs.append(opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[i], {}).get("momentum_buffer"))
                    bufs.append((getattr(opt, "muon_momentum_buffer_partitioned_groups_flat", None) or {}).get(i))
        for b in bufs:
            if torch.is_tensor(b) and b.numel():
                b.zero_()  # the resumed run starts from a fresh, zero momentum
        return out

    return _setattr(DeepSpeedEngine, "load_checkpoint", load_checkpoint)[1]


# ------------------------------------------------------------------------------------------------
# expectations (predicates on a case)


def _muon(c: Case):
    return [p for p in c.params if p.uses_muon]


def _muon_groups(c: Case) -> list[list[ParamShape]]:
    """The Muon half of each user param group (one group when the case has none)."""
    if not c.groups:
        return [_muon(c)]
    by_name = {p.name: p for p in _muon(c)}
    return [[by_name[n] for n in g.params if n in by_name] for g in c.groups]


def _z12_layout(c: Case, muon=None):
    """[(param, lo, hi)] of a ZeRO-1/2 Muon group's flat layout and the partition size (no alignment)."""
    muon = sorted(_muon(c) if muon is None else muon, key=lambda p: tuple(p.shape), reverse=True)
    total = sum(p.numel for p in muon)
    align = 2 * c.dp_size
    P = math.ceil(total / align) * align // c.dp_size
    out, off = [], 0
    for p in muon:
        out.append((p, off, off + p.numel))
        off += p.numel
    return out, P, total


def _z12_straddles(c: Case) -> bool:
    if c.dp_size < 2:
        return False
    for muon in _muon_groups(c):
        layout, P, _ = _z12_layout(c, muon)
        if any(lo // P != (hi - 1) // P for _, lo, hi in layout):
            return True
    return False


def _z12_padded_tail(c: Case) -> bool:
    W = c.dp_size
    for muon in _muon_groups(c):
        layout, P, total = _z12_layout(c, muon)
        if W > 1 and P * W > total and any(p.numel % W and hi > (W - 1) * P for p, lo, hi in layout):
            return True
    return False


def _z3_padded_tail(c: Case) -> bool:
    return any(zero3_padded_tail(p.numel, c.dp_size) is not None for p in _muon(c))


def _offload_straddles(c: Case) -> bool:
    if c.dp_size < 2 or c.offload == "none":
        return False
    if c.stage == 3:
        return any(p.numel > math.ceil(p.numel / c.dp_size) and p.shape[0] > 1 for p in _muon(c))
    return _z12_straddles(c)


def _bf16_route(c: Case) -> bool:
    return c.ds.bf16_optimizer_route


def _clip(c: Case) -> float:
    return c.ds.gradient_clipping


def _wd(c: Case) -> float:
    return c.ds.optimizer.muon.weight_decay


def _tall(c: Case) -> bool:
    return any(p.num_heads is None and len(p.shape) == 2 and p.shape[0] > p.shape[1] for p in _muon(c))


MUTANTS: dict[str, Mutant] = {m.name: m for m in (
    Mutant("partition-slice-muon",
           "ZeRO-1/2 (no offload): each owner orthogonalises only the rows of its own partition slice instead "
           "of the full averaged matrix (a matrix straddling a partition boundary gets two half updates).",
           _wrap_muon_update(_m_own_rows(("z12",))),
           lambda c: c.stage in (1, 2) and c.offload == "none" and not _bf16_route(c) and _z12_straddles(c),
           "the pre-#7727 ZeRO-1/2 Muon ran on the partition's flat slice"),
    Mutant("offload-shard-orthogonalized",
           "cpu/nvme offload: each rank orthogonalises its own shard of the matrix, not the gathered whole.",
           _wrap_muon_update(_m_own_rows(("z12_offload", "z3_offload"))),
           lambda c: c.offload != "none" and _offload_straddles(c),
           "plausible: the offload paths gather (_muon_all_gather_partitions) exactly to avoid this"),
    Mutant("ns-per-micro-batch",
           "ZeRO-3: Muon runs once per micro-batch under gradient accumulation (momentum advanced GAS times "
           "per step, each time with a partial gradient).",
           _wrap_muon_update(_m_ns_per_micro),
           lambda c: c.stage == 3 and c.grad_accum > 1,
           "DeepSpeed #8443 (stage3.py _apply_muon_to_accumulated_grads docstring)"),
    Mutant("clip-skips-muon",
           "Clipping applied to the gradient before Newton-Schulz, which normalises it away: the Muon step is "
           "never clipped (Adam still is).",
           _wrap_method((0, 1), "unscale_and_clip_grads", _make_clip_skips_muon),
           lambda c: _clip(c) > 0 and bool(_muon(c)),
           "plausible (the textbook clip-then-optimise order)"),
    Mutant("clip-norm-excludes-muon",
           "The global norm (clip coefficient and reported norm) is taken over the Adam gradients only, "
           "leaving out the Muon updates.",
           _install_norm_excludes_muon,
           # stage 0 and the BF16_Optimizer route have no ZeRO-1/2/3 norm routine to break
           lambda c: bool(_muon(c)) and c.stage != 0 and not _bf16_route(c),
           "plausible: the wrong norm"),
    Mutant("fp16-momentum",
           "The Muon momentum is stored in fp16 whatever the model dtype.",
           _wrap_muon_update(_m_fp16_momentum),
           lambda c: bool(_muon(c)),
           "DSM-001 generalised"),
    Mutant("stale-momentum-after-resume",
           "After load_checkpoint the Muon momentum the update reads is a fresh zero buffer, not the "
           "restored one.",
           _install_stale_momentum,
           lambda c: c.checkpoint_at is not None and c.checkpoint_at < c.steps and bool(_muon(c)),
           "DSM-007 generalised to every path"),
    Mutant("padded-tail-misslice",
           "The padded tail is mis-sliced: for a matrix whose element count is not divisible by the world "
           "size, the slice of the Muon update that lies in a padded partition (ZeRO-3: the partition the "
           "matrix's end cuts short; ZeRO-1/2: the group's last, padded partition) is taken one element "
           "early.",
           _wrap_muon_update(_m_padded_tail_misslice),
           lambda c: (c.stage == 3 and _z3_padded_tail(c)) or (c.stage in (1, 2) and not _bf16_route(c)
                                                                and _z12_padded_tail(c)),
           "plausible: off-by-one in the last rank's narrow() for odd element counts"),
    Mutant("momentum-beta-off",
           "The Muon momentum uses beta - 0.05 instead of the configured beta.",
           _wrap_muon_update(_m_beta_off),
           lambda c: bool(_muon(c)),
           "plausible: a wrong group key / default"),
    Mutant("nesterov-dropped",
           "Muon uses the plain momentum instead of the Nesterov blend.",
           _wrap_muon_update(_m_nesterov_dropped),
           lambda c: bool(_muon(c)) and c.steps >= 2,
           "plausible: nesterov=False default"),
    Mutant("aspect-scale-dropped",
           "The aspect-ratio scale sqrt(max(1, rows/cols)) of the Muon update is dropped.",
           _wrap_muon_update(_m_aspect_dropped),
           _tall,
           "plausible"),
    Mutant("per-head-dropped",
           "Per-head Muon (muon_num_heads) is ignored: the whole matrix is orthogonalised.",
           _wrap_muon_update(_m_per_head_dropped),
           lambda c: any((p.num_heads or 1) > 1 for p in _muon(c)),
           "DSM-008 generalised (also bf16_optimizer.py and muon_optimizer.py drop it)"),
    Mutant("weight-decay-twice",
           "Muon parameters get their decoupled weight decay applied twice per step.",
           _install_weight_decay_twice,
           lambda c: _wd(c) > 0 and bool(_muon(c)),
           "plausible: decay in both the ZeRO wrapper and MuonWithAuxAdam"),
    Mutant("offload-loss-scale-not-divided",
           "cpu/nvme offload: the gathered gradient is not divided by the loss scale before Muon (momentum in "
           "loss-scaled units).",
           _wrap_muon_update(_m_offload_scale_not_divided),
           lambda c: c.offload != "none" and c.dtype == "fp16" and bool(_muon(c)),
           "plausible (the offload paths' grad.div_(loss_scale))"),
    Mutant("offload-dp-average-missing",
           "cpu/nvme offload: the Muon input is the sum over data-parallel ranks instead of the average.",
           _wrap_muon_update(_m_offload_dp_sum),
           lambda c: c.offload != "none" and c.dp_size > 1 and bool(_muon(c)),
           "plausible: averaging by W missing on one path"),
    Mutant("muon-update-not-rescaled",
           "Non-offload: the Muon update is not multiplied back by the loss scale before unscaling, so the "
           "Muon step is divided by S (and the norm misses the factor).",
           _wrap_method((0, 1), "_muon_update_lacks_loss_scale", _make_not_rescaled),
           lambda c: c.offload == "none" and c.dtype == "fp16" and bool(_muon(c)),
           "groups_lacking_loss_scale (stage_1_and_2.py / stage3.py) removed"),
    Mutant("muon-as-sgd-without-zero",
           "Without ZeRO (stage 0) Muon weights take the flat-partition branch of MuonWithAuxAdam.step: the raw "
           "gradient is the update (no momentum, no Newton-Schulz), i.e. plain SGD.",
           _install_muon_as_sgd,
           lambda c: c.stage == 0 and bool(_muon(c)),
           "historical: Muon turned into SGD without ZeRO (the p.dim() < 2 test in muon_optimizer.py)"),
    Mutant("param-groups-flattened",
           "The user's param groups are flattened into one list before the Muon/Adam split: every group's own "
           "lr, momentum, weight_decay and ns_method is replaced by the config's.",
           _install_groups_flattened,
           # the user's groups (Case.groups) or a real model's own (harness.registry.module_mutants.catches_groups)
           lambda c: any(g.options() for g in c.groups) or _model_catches("catches_groups")(c),
           "historical: engine.py _muon_param_groups docstring (groups flattened, recipes' no-decay groups ignored)"),
    Mutant("scheduler-stepped-early",
           "The lr scheduler is advanced before the optimizer step as well as after it: every step runs at the "
           "next step's learning rate.",
           _install_scheduler_stepped_early,
           lambda c: bool(c.schedule),
           "plausible: off-by-one in where the engine advances the schedule"),
    Mutant("muon-skipped-bf16-optimizer",
           "On the BF16_Optimizer route Muon never runs: the Muon groups' partitions keep the raw gradients "
           "and take a plain SGD step.",
           _wrap_method((2,), "_prepare_muon_updates", _make_skip_muon),
           lambda c: _bf16_route(c) and bool(_muon(c)),
           "historical: Muon skipped on the BF16_Optimizer route (issue 13)"),
)}


# -- stock-column mutants (issue 11). Re-introduced into STOCK DeepSpeed, each must fail every stock
# case whose path it reaches, the cases a registered bug makes xfail included: a known bug excuses only
# what its model predicts. ``stock_kill_matrix`` runs them through the gate's own decision.


def _m_beta_offset_small(inner, a):
    return inner(**dict(a, beta=a["beta"] - 1e-3))


def _install_rank_contribution_dropped():
    """The last data-parallel rank's gradient never reaches the reduction (its loss is multiplied by 0
    before the backward), on every path: the average is over W ranks of which one contributes nothing."""
    from deepspeed import comm as dist  # late: DeepSpeed, rank side
    from deepspeed.runtime.engine import DeepSpeedEngine  # late: DeepSpeed, rank side

    cur = DeepSpeedEngine.__dict__["backward"]

    def backward(self, loss, *args, **kwargs):
        W = dist.get_world_size()
        if W > 1 and dist.get_rank() == W - 1:
            loss = loss * 0.0
        return cur(self, loss, *args, **kwargs)

    return _setattr(DeepSpeedEngine, "backward", backward)[1]


MUTANTS.update({m.name: m for m in (
    Mutant("momentum-beta-offset-1e-3",
           "The Muon momentum uses beta - 1e-3 instead of the configured beta (a 2% change of 1 - beta).",
           _wrap_muon_update(_m_beta_offset_small),
           lambda c: bool(_muon(c)),
           "plausible: a rounded or defaulted beta"),
    Mutant("rank-contribution-dropped",
           "One data-parallel rank's gradient is left out of the average (it still divides by W).",
           _install_rank_contribution_dropped,
           lambda c: c.world_size > 1,
           "plausible: a reduction that skips a rank / a wrong process group"),
)})

# ------------------------------------------------------------------------------------------------
# real-model mutants (harness.registry.module_mutants): only model cases can kill them


def _model_mutant(name: str):
    def install():

        return mutants.INSTALL[name]()
    return install


def _model_catches(pred: str):
    def catches(case: Case) -> bool:

        return getattr(mutants, pred)(case)
    return catches


MUTANTS.update({m.name: m for m in (
    Mutant("muon-tag-from-placeholder",
           "Muon decided from the parameter's shape as it reports it: under zero.Init a 1-D placeholder, so every "
           "matrix goes to Adam", _model_mutant("muon-tag-from-placeholder"), _model_catches("catches_placeholder"),
           "historical: DeepSpeed tagged on param.dim() before reading the layer shape (deepspeed/__init__.py)"),
    Mutant("muon-on-embeddings",
           "the name rule dropped: embeddings and lm_head get Muon", _model_mutant("muon-on-embeddings"),
           _model_catches("catches_embeddings"), "historical: the rule excluding embed/lm_head came later"),
    Mutant("embeddings-to-adam-by-type",
           "nn.Embedding weights go to Adam by module type (Muon's definition), hiding the departure MUON-BY-NAME",
           _model_mutant("embeddings-to-adam-by-type"), _model_catches("catches_embeddings_by_type"),
           "plausible (the fix users ask for in place of the name rule)"),
)})


def _model_group_decays_muon(case: Case) -> bool:
    """A model case whose parameter groups give the Muon half a weight decay the config does not."""
    if not case.model:
        return False

    return any(dict(g.settings).get("weight_decay", 0.0) > 0
               for g in models.build_spec(case.model, case.seed).param_groups)


# weight-decay-twice also shows wherever a parameter group (not the config) decays the Muon half.
MUTANTS["weight-decay-twice"] = Mutant(
    MUTANTS["weight-decay-twice"].name, MUTANTS["weight-decay-twice"].description,
    MUTANTS["weight-decay-twice"].install,
    (lambda old: lambda c: old.expected(c) or (_model_group_decays_muon(c) and bool(_muon(c))))(
        MUTANTS["weight-decay-twice"]),
    MUTANTS["weight-decay-twice"].history)


def install(name: str) -> Callable[[], None]:
    """Install mutant ``name``; returns the callable that undoes it."""
    if name not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; known: {sorted(MUTANTS)}")
    return MUTANTS[name].install()


# ------------------------------------------------------------------------------------------------
# issue 13, groups 5-10: one mutant per new path group


def _install_compiled_aspect_truncated():
    """Only while dynamo traces ``muon_update`` (``torch.compiler.is_compiling()``, a constant True in
    the traced graph, False in eager), the aspect scale ``sqrt(rows/cols)`` is taken of the integer
    quotient ``rows // cols``: a tall 6x5 matrix gets scale 1 instead of 1.095, a 7x3 one sqrt(2)
    instead of 1.528. Eager runs are untouched, so only compiled cases can see it."""
    from deepspeed.runtime.zero.muon import original_muon  # late: DeepSpeed, rank side

    cur = original_muon._aspect_ratio_scale

    def _aspect_ratio_scale(rows, cols):
        if torch.compiler.is_compiling():
            return math.sqrt(rows // cols) if rows > cols else 1.0
        return cur(rows, cols)

    return _setattr(original_muon, "_aspect_ratio_scale", _aspect_ratio_scale)[1]


def _tall_muon(c: Case) -> bool:
    return any(len(p.shape) >= 2 and p.shape[-2] > p.shape[-1] and p.uses_muon and not p.num_heads
               for p in c.params)


def _muon_update_compiled() -> bool:
    """Whether DeepSpeed's ``muon_update`` runs under torch.compile in this rank: ``compiler.compile()``
    wrapped ``original_muon``'s functions at import (``TORCHDYNAMO_DISABLE`` unset); an eager rank holds the
    plain functions. Read from the Newton-Schulz kernel, which no fix or recorder replaces."""
    from deepspeed.runtime.zero.muon import original_muon  # late: DeepSpeed, rank side

    return hasattr(original_muon.zeropower_via_newtonschulz5, "_torchdynamo_orig_callable")


def _m_compiled_nesterov_dropped(inner, a):
    return inner(**dict(a, nesterov=False)) if _muon_update_compiled() else inner(**a)


MUTANTS.update({m.name: m for m in (
    Mutant("compiled-nesterov-dropped",
           "Where muon_update runs compiled, it is called without the Nesterov blend: the plain momentum "
           "goes to Newton-Schulz (eager unchanged).",
           _wrap_muon_update(_m_compiled_nesterov_dropped),
           lambda c: c.compiled and bool(_muon(c)) and c.steps >= 2,
           "plausible: a compiled call path that runs muon_update with nesterov=False (the Nesterov switch in "
           "DeepSpeed's source, which DSM-001's model once excused in the compiled 16-bit cases)"),
    Mutant("compiled-aspect-truncated",
           "Under torch.compile only, the aspect scale sqrt(rows/cols) of a tall Muon matrix is taken of the "
           "integer quotient rows//cols (eager unchanged).",
           _install_compiled_aspect_truncated,
           lambda c: c.compiled and _tall_muon(c),
           "historical: original_muon.py _aspect_ratio_scale comment (symbolic max() cast to int64 once "
           "muon_update was recompiled for a second shape)"),
)})


def _install_optimizer_state_not_loaded():
    """``load_checkpoint`` restores the module but not the optimizer: as if ``load_optimizer_states``
    defaulted to False, so the Muon momentum, the Adam moments (and, on ZeRO, the fp32 partitions'
    optimizer state) restart from the fresh engine's."""
    from deepspeed.runtime.engine import DeepSpeedEngine  # late: DeepSpeed, rank side

    cur = DeepSpeedEngine.__dict__["load_checkpoint"]

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True, **kwargs):
        return cur(self, load_dir, tag, load_module_strict, False, **kwargs)

    return _setattr(DeepSpeedEngine, "load_checkpoint", load_checkpoint)[1]


MUTANTS.update({m.name: m for m in (
    Mutant("optimizer-state-not-loaded",
           "load_checkpoint restores the module weights but not the optimizer state (Muon momentum, Adam "
           "moments): a resumed run restarts them from zero.",
           _install_optimizer_state_not_loaded,
           lambda c: c.checkpoint_at is not None and c.checkpoint_at < c.steps,
           "plausible: load_optimizer_states off (a module-only load) on resume"),
)})


def _install_muon_flag_per_param_group():
    """ZeRO-3 records "uses Muon" once per *param group* (``append``) instead of once per sub-group
    (``extend([flag] * n_sub_groups)``, stage3.py _create_fp16_partitions_with_defragmentation), but
    reads it by sub-group index: with one sub-group per param group nothing changes; with several,
    sub-group k takes param group k's flag (or False past the end), so Muon sub-groups after the first
    skip Newton-Schulz and an Adam sub-group may take Muon."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z3  # late: DeepSpeed, rank side

    cur = Z3.__dict__["_create_fp16_partitions_with_defragmentation"]

    def _create_fp16_partitions_with_defragmentation(self, fp16_param_groups):
        out = cur(self, fp16_param_groups)
        if getattr(self, "use_muon", False):
            per_group = [bool(getattr(g["params"][0], "use_muon", False)) for g in fp16_param_groups]
            n = len(self.sub_groups_using_muon)
            self.sub_groups_using_muon = (per_group + [False] * n)[:n]
        return out

    return _setattr(Z3, "_create_fp16_partitions_with_defragmentation",
                    _create_fp16_partitions_with_defragmentation)[1]


def _z3_several_muon_subgroups(c: Case) -> bool:
    """ZeRO-3 whose Muon param group spans more than one sub-group (stage3.py _create_fp16_sub_groups:
    a sub-group closes once its per-rank partition elements reach ``sub_group_size``, default 1e9)."""
    if c.stage != 3:
        return False
    size = c.ds.zero.sub_group_size
    n, acc = 0, 0
    for p in _muon(c):
        if acc == 0:
            n += 1
        acc += -(-p.numel // c.dp_size)
        if acc >= size:
            acc = 0
    return n > 1


MUTANTS.update({m.name: m for m in (
    Mutant("muon-flag-per-param-group",
           "ZeRO-3 keeps one uses-Muon flag per param group but indexes it by sub-group: with several "
           "sub-groups, Muon sub-groups after the first take a plain step.",
           _install_muon_flag_per_param_group,
           _z3_several_muon_subgroups,
           "plausible: append vs extend of sub_groups_using_muon (stage3.py:919-933)"),
)})


def _install_muon_first_bucket_only():
    """ZeRO-3 without offload gathers a Muon sub-group's gradients in chunks of at most
    ``reduce_bucket_size`` elements (stage3.py _apply_muon_to_accumulated_grads); here only the first
    chunk of each sub-group runs Muon per step, the later ones keep their raw averaged gradient and
    their momentum. With the default bucket (5e8) every sub-group is one chunk and nothing changes."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z3  # late: DeepSpeed, rank side

    apply_cur = Z3.__dict__["_apply_muon_to_accumulated_grads"]
    sub_cur = Z3.__dict__["_muon_update_sub_group"]

    def _apply_muon_to_accumulated_grads(self):
        self._mutant_seen_sub_groups = set()
        try:
            return apply_cur(self)
        finally:
            self._mutant_seen_sub_groups = None

    def _muon_update_sub_group(self, i, group_items, communication_data_type):
        seen = getattr(self, "_mutant_seen_sub_groups", None)
        if seen is not None and not self.offload_optimizer:
            if i in seen:
                return None
            seen.add(i)
        return sub_cur(self, i, group_items, communication_data_type)

    undo_a = _setattr(Z3, "_apply_muon_to_accumulated_grads", _apply_muon_to_accumulated_grads)[1]
    undo_s = _setattr(Z3, "_muon_update_sub_group", _muon_update_sub_group)[1]

    def undo():
        undo_s()
        undo_a()

    return undo


def _z3_muon_in_several_buckets(c: Case) -> bool:
    """ZeRO-3 without offload where the (single-sub-group) Muon parameters do not fit one
    ``reduce_bucket_size`` chunk (stage3.py _apply_muon_to_accumulated_grads)."""
    if c.stage != 3 or c.offload != "none" or _z3_several_muon_subgroups(c):
        return False
    bucket = c.ds.zero.reduce_bucket_size
    muon = _muon(c)
    return len(muon) > 1 and sum(p.numel for p in muon) > bucket


MUTANTS.update({m.name: m for m in (
    Mutant("muon-first-bucket-only",
           "ZeRO-3 without offload: when reduce_bucket_size splits a Muon sub-group into several gather chunks, "
           "only the first chunk is orthogonalised; the rest step with the raw gradient.",
           _install_muon_first_bucket_only,
           _z3_muon_in_several_buckets,
           "plausible: a chunk loop that stops after the first bucket (stage3.py #8443 rewrite)"),
)})


def _wrap_gathers(make):
    """Wrap both Muon all-gathers (ZeRO-1/2's ``_muon_all_gather_partitions``, ZeRO-3's
    ``_partitioned_buffers_all_gather``) with ``make(current)``; returns the undo of both."""
    Z12, Z3, _ = _ds_classes()
    undos = [_setattr(Z12, "_muon_all_gather_partitions", make(Z12.__dict__["_muon_all_gather_partitions"]))[1],
             _setattr(Z3, "_partitioned_buffers_all_gather",
                      make(Z3.__dict__["_partitioned_buffers_all_gather"]))[1]]

    def undo():
        for u in reversed(undos):
            u()

    return undo


def _install_gather_cache_unbounded():
    """The Muon gather-buffer cache never evicts: its cap is ignored while a gather stores its buffers
    (ZeRO-1/2 ``_muon_all_gather_partitions``, ZeRO-3 ``_partitioned_buffers_all_gather``), so the
    cache grows past ``_muon_allgather_max_cached_bytes``. Numbers unchanged; only the cache check sees
    it, and only where the cap is low enough to matter (``Case.allgather_caps``)."""
    def make(cur):
        def gather(self, *args, **kwargs):
            cap = self._muon_allgather_max_cached_bytes
            self._muon_allgather_max_cached_bytes = float("inf")
            try:
                return cur(self, *args, **kwargs)
            finally:
                self._muon_allgather_max_cached_bytes = cap
        return gather

    return _wrap_gathers(make)


MUTANTS.update({m.name: m for m in (
    Mutant("gather-cache-unbounded",
           "The Muon all-gather buffer cache ignores its byte cap (no LRU eviction): it grows with every "
           "distinct chunk shape.",
           _install_gather_cache_unbounded,
           # ZeRO-1/2 offload (two entry shapes: gradient only, then gradient + momentum) and ZeRO-3
           # offload overflow the cap; ZeRO-3 without offload reuses one entry here
           # a case that claims eviction (Case.allgather_evicts) fills its cap by construction
           lambda c: c.allgather_caps is not None and bool(_muon(c))
           and ((c.stage in (1, 2, 3) and c.offload != "none") or c.allgather_evicts),
           "plausible: the eviction loop of the gather cache (stage_1_and_2.py _muon_all_gather_partitions)"),
)})


def _install_dp_average_over_world():
    """The gradient average divides by the world size instead of the data-parallel group's size
    (``dist.get_world_size()`` without ``group=``): modelled on the engine's backward, whose loss is
    scaled by ``dp / world`` on every rank, so every averaged gradient is ``dp / world`` of the true
    one. With an ``mpu`` (a data-parallel group smaller than the world) this halves the gradient at
    2 x 2; everywhere else ``dp == world`` and it does nothing, so only those cases can kill it."""
    from deepspeed import comm as dist  # late: DeepSpeed, rank side
    from deepspeed.runtime.engine import DeepSpeedEngine  # late: DeepSpeed, rank side

    cur = DeepSpeedEngine.__dict__["backward"]

    def backward(self, loss, *args, **kwargs):
        dp, world = dist.get_world_size(group=self.data_parallel_group), dist.get_world_size()
        if dp != world:
            loss = loss * (dp / world)
        return cur(self, loss, *args, **kwargs)

    return _setattr(DeepSpeedEngine, "backward", backward)[1]


def _install_momentum_committed_on_skip():
    """ZeRO-1/2 without offload run Muon inside the boundary backward into a staged copy of each Muon group's
    momentum and commit it in ``step()`` only when the step survives (``_commit_muon_momentum``). The mutant
    commits, on a skipped step too, every group whose staged momentum is finite: a commit guarded by the
    momentum's own finiteness instead of the step's overflow flag. ``muon_update`` keeps the momentum of a
    matrix whose gradient is non-finite, so every staged group is finite; on a step poisoned everywhere it
    also equals the committed one, and only an overflow in one place (``Overflow.param``) shows the commit."""
    Z12, _, _ = _ds_classes()
    cur = Z12.__dict__["step"]

    def step(self, *args, **kwargs):
        out = cur(self, *args, **kwargs)
        if self.overflow and not self.cpu_offload:
            for staged, flat in getattr(self, "_muon_pending_momentum", {}).values():
                if bool(torch.isfinite(staged).all()):
                    self.optimizer.state[flat]["momentum_buffer"].copy_(staged)
        return out

    return _setattr(Z12, "step", step)[1]


def _z12_clean_matrix_on_skip(c: Case) -> bool:
    """ZeRO-1/2 without offload (where the momentum is staged and committed) with a skipped step that leaves a
    Muon matrix's gradient finite: its staged momentum advanced, which a commit on the skip keeps."""
    return (c.stage in (1, 2) and c.offload == "none" and c.runs_muon and not _bf16_route(c)
            and c.overflow_leaves_muon_clean)


MUTANTS.update({m.name: m for m in (
    Mutant("momentum-committed-on-skip",
           "ZeRO-1/2 (no offload): on a skipped step, the staged Muon momentum of every group whose momentum "
           "is finite is committed anyway, so a clean matrix's momentum advances on a step that was discarded.",
           _install_momentum_committed_on_skip,
           _z12_clean_matrix_on_skip,
           "plausible: the commit tested per group (its momentum finite) instead of the step's overflow"),
    Mutant("dp-average-over-world",
           "The data-parallel gradient average divides by the world size, not by the data-parallel "
           "group's size (a data-parallel group smaller than the world averages too little).",
           _install_dp_average_over_world,
           lambda c: c.dp_size != c.world_size,
           "plausible: dist.get_world_size() where dist.get_world_size(group=dp_process_group) was meant"),
)})


def _install_gather_cache_kept_after_destroy():
    """``destroy()`` no longer empties the Muon gather-buffer cache (``_clear_muon_allgather_buffers``,
    ZeRO-1/2 and ZeRO-3, is a no-op): the buffers outlive the engine. Numbers unchanged; only the
    gathers cases' after-``destroy()`` check sees it (``harness.rank.gather_cache``)."""
    Z12, Z3, _ = _ds_classes()

    def keep(self):
        return None

    undos = [_setattr(Z12, "_clear_muon_allgather_buffers", keep)[1],
             _setattr(Z3, "_clear_muon_allgather_buffers", keep)[1]]

    def undo():
        for u in reversed(undos):
            u()

    return undo


MUTANTS.update({m.name: m for m in (
    Mutant("gather-cache-kept-after-destroy",
           "destroy() leaves the Muon all-gather buffer cache filled (the buffers outlive the engine).",
           _install_gather_cache_kept_after_destroy,
           # the cache holds buffers at destroy() where Muon gathers into buffers under the cap: ZeRO-1/2
           # with offload (chunked) and ZeRO-3 without offload; ZeRO-3 offload gathers gradient and
           # momentum in one buffer larger than the gathers cases' cap (harness.catalog.matrix.GATHER_CAPS), so
           # it caches nothing there (what gather-cache-unbounded's kills show)
           lambda c: c.allgather_caps is not None and bool(_muon(c))
           and ((c.stage in (1, 2) and c.offload != "none") or (c.stage == 3 and c.offload == "none")
                or c.allgather_evicts),
           "plausible: a destroy() that forgets a cache (stage_1_and_2.py / stage3.py destroy)"),
)})


def _install_gather_cache_keeps_oldest():
    """The Muon gather-buffer cache keeps the entries it has and refuses newer ones once full: every gather
    call that pushed an entry out is undone afterwards (its old entries and byte count put back into the
    same ``OrderedDict``, the new entry dropped). Numbers unchanged, never above the cap, nothing left after
    ``destroy()``: only the eviction count of a case that claims eviction (``Case.allgather_evicts``,
    ``harness.rank.gather_cache``) sees it, as it would see a cache that never fills."""
    def make(cur):
        def gather(self, *args, **kwargs):
            cache = self._muon_allgather_buffers
            kept, nbytes = list(cache.items()), self._muon_allgather_buffer_bytes
            try:
                return cur(self, *args, **kwargs)
            finally:
                if any(k not in cache for k, _ in kept):
                    cache.clear()
                    cache.update(kept)
                    self._muon_allgather_buffer_bytes = nbytes
        return gather

    return _wrap_gathers(make)


MUTANTS.update({m.name: m for m in (
    Mutant("gather-cache-keeps-oldest",
           "The Muon all-gather buffer cache never evicts: once full it keeps its oldest entries and caches "
           "no newer one (bounded, but not least-recently-used).",
           _install_gather_cache_keeps_oldest,
           lambda c: c.allgather_evicts and bool(_muon(c)),
           "plausible: an eviction loop whose condition never holds (stage_1_and_2.py "
           "_muon_all_gather_partitions, stage3.py _partitioned_buffers_all_gather)"),
)})


def _z3_inmem(c: Case) -> bool:
    return c.stage == 3 and bool(c.ds.zero.save_muon_momentum_buffer_in_memory) and bool(_muon(c))


def _install_resident_momentum_state_copy():
    """After every ZeRO-3 step the optimizer state's ``momentum_buffer`` of each Muon sub-group is a copy of
    the resident in-memory buffer instead of the buffer itself (``save_muon_momentum_buffer_in_memory``). The
    step reads and writes the resident buffer and rebinds the state to it first thing, so the numbers and a
    checkpoint saved right after a step are unchanged: only the resident watch's same-tensor check
    (``harness.rank.resident``) sees the two copies that a later writer of either would split."""
    _, Z3, _ = _ds_classes()
    cur = Z3.__dict__["step"]

    def step(self, *args, **kwargs):
        out = cur(self, *args, **kwargs)
        if self.save_muon_momentum_buffer_in_memory:
            for i, buf in self.muon_momentum_buffer_partitioned_groups_flat.items():
                state = self.optimizer.state.get(self.fp32_partitioned_groups_flat[i])
                if state is not None and state.get("momentum_buffer") is buf:
                    copy = buf.clone()
                    copy.swappable = False  # kept out of the swap files like the buffer it copies
                    state["momentum_buffer"] = copy
        return out

    return _setattr(Z3, "step", step)[1]


def _install_resident_momentum_written_to_swap():
    """After every ZeRO-3 step the resident Muon momentum of each swapped sub-group is also written to the
    swap folder under the name the swapper gives an optimizer state (``momentum_buffer-<ds_id>.tensor.swp``)
    and kept in memory: the IO ``save_muon_momentum_buffer_in_memory`` exists to avoid, with the numbers
    unchanged. Only the resident watch's swap-folder check (``harness.rank.resident``) sees it."""
    _, Z3, _ = _ds_classes()
    cur = Z3.__dict__["step"]

    def step(self, *args, **kwargs):
        import os  # late: rank side

        out = cur(self, *args, **kwargs)
        swapper = getattr(self, "optimizer_swapper", None)
        if self.save_muon_momentum_buffer_in_memory and swapper is not None:
            for i, buf in self.muon_momentum_buffer_partitioned_groups_flat.items():
                if self._swappable_optimizer_subgroup(i):
                    ds_id = self.fp32_partitioned_groups_flat[i].ds_id
                    path = os.path.join(swapper.swap_folder, f"momentum_buffer-{ds_id}.tensor.swp")
                    buf.detach().float().cpu().numpy().tofile(path)
        return out

    return _setattr(Z3, "step", step)[1]


MUTANTS.update({m.name: m for m in (
    Mutant("resident-momentum-state-copy",
           "ZeRO-3 with the Muon momentum kept in memory: after each step the optimizer state holds a copy of "
           "the resident momentum buffer, not the buffer itself.",
           _install_resident_momentum_state_copy,
           _z3_inmem,
           "plausible: a rebinding that clones (stage3.py _muon_update_sub_group / _apply_muon_updates_cpu_offload "
           "'optimizer.state[...][\"momentum_buffer\"] = ...'; PR #8464 _adopt_restored_muon_momentum rebinds it)"),
    Mutant("resident-momentum-written-to-swap",
           "ZeRO-3 NVMe with the Muon momentum kept in memory: each swapped sub-group's resident momentum is also "
           "written to the swap folder after every step.",
           _install_resident_momentum_written_to_swap,
           lambda c: _z3_inmem(c) and c.offload == "nvme" and expects_swap(c),
           "plausible: the resident buffer treated as a swappable state (0.19.7 lacked swappable=False, DSM-109; "
           "PR #8464 adds is_resident to is_swappable_tensor)"),
)})


def _install_unswapped_grads_released_on_read():
    """The swapper forgets a swapped sub-group's in-memory gradient fragments (those below the swap
    threshold, ``OptimizerStateSwapInfo.unswapped_gradients``) as soon as it has read them into the
    gradient buffer, as ``_retrieve_unswapped_grad_partitions`` did before PR #8464 moved the release to the
    swap-out: the Muon update ZeRO-3 writes back into those fragments (``_writeback_swap_state``) then has
    nowhere to go, and the optimizer step reads the fragments again from what the buffer happens to hold."""
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper  # late: DeepSpeed, rank side

    cur = OptimizerSwapper.__dict__["_retrieve_unswapped_grad_partitions"]

    def retrieve(self, swap_info, dest_buffer):
        out = cur(self, swap_info, dest_buffer)
        swap_info.release_unswapped_gradients()
        return out

    return _setattr(OptimizerSwapper, "_retrieve_unswapped_grad_partitions", retrieve)[1]


def _swapped_muon_only_unswapped_fragments(c: Case) -> bool:
    """A swapped ZeRO-3 Muon sub-group in which every matrix's own per-rank gradient fragment is below the swap
    threshold (``matrix.unswapped_grad_cases``): there the step has no gradient left to read and rank 0
    raises (measured on both swappers). Where a swapped matrix shares the sub-group (every other NVMe case)
    the mutant survives (measured on z3-nvme-part-fp32-ws2, -ws1-ga2 and z3-nvme-pipe-fp32-ws2-ga2-standard):
    the numbers come out right, so the gradient buffer the step reads still holds the lost update."""
    from harness.case import nvme  # late: the swap rule's helpers

    if not (c.stage == 3 and c.offload == "nvme" and c.runs_muon):
        return False
    by_name = {p.name: p for p in c.params}
    return any(sub["group"] == "muon" and sub["swapped"] and all(
        nvme.FP32_BYTES * math.ceil(by_name[n].numel / c.dp_size) < nvme.min_swap_bytes(c) for n in sub["params"])
        for sub in nvme.predict_swapped_subgroups(c))


MUTANTS.update({m.name: m for m in (
    Mutant("unswapped-grads-released-on-read",
           "ZeRO-3 NVMe: a swapped sub-group's in-memory (sub-threshold) gradient fragments are dropped once read, "
           "so the Muon update written back into them is lost before the optimizer step reads them.",
           _install_unswapped_grads_released_on_read,
           _swapped_muon_only_unswapped_fragments,
           "historical: swap_tensor/optimizer_utils.py _retrieve_unswapped_grad_partitions before PR #8464"),
)})
