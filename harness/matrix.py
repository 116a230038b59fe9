"""The pipeline matrix: which cases the CI gate runs and which only ``--full`` runs.

Fewer distinct models, more distinct paths. The CI gate is a covering design:

* base grid, all of it: ZeRO stage {1,2,3} x offload {none, cpu} x dtype {fp32, fp16, bf16} x world
  size {1, 2, 3} (54 cases). The four binary knobs -- gradient accumulation {1, 2}, clipping
  {off, on}, ns_method {gram, standard}, a per-head parameter {no, yes} -- are assigned so that every
  combination of the knobs occurs, and every knob value meets every stage, dtype and world size
  (each knob cycles with a different period over the grid's enumeration).
* NVMe (swapping needs a >= 1 MiB per-rank matrix, so these cost seconds each): stage x swapper
  {partitioned, pipelined} x dtype at world size 2, plus fp32 at world sizes 1 and 3.
* ZeRO-3 with ``save_muon_momentum_buffer_in_memory`` on: offload none/cpu/nvme at fp32 and fp16.
* Loss-scale dynamics, checkpoint resume and the compiled subset are separate cases
  (``overflow_cases``, ``resume_cases``, ``compiled_cases``).

``--full`` runs the whole product of base grid x knobs, NVMe at every world size and dtype.
"""
from __future__ import annotations

import itertools

from harness.case import Case, Overflow, ParamShape
from harness.scenarios import TINY_PARAMS, nvme_params, pipeline_case

STAGES = (1, 2, 3)
DTYPES = ("fp32", "fp16", "bf16")
WORLD_SIZES = (1, 2, 3)
HEAD_PARAM = ParamShape("attn.qkv.weight", (8, 6), num_heads=2)  # [H*hd, in] with H=2, hd=4
CLIP = 0.05  # well below the Muon update norm of this model (~2-3): clips on every step
STEPS = 3


def _knobs(i: int) -> dict:
    return {
        "grad_accum": (1, 2)[i % 2],
        "clip": (0.0, CLIP)[(i // 2) % 2],
        "ns_method": ("gram", "standard")[(i // 5) % 2],
        "heads": bool((i // 3) % 2),
    }


def _case(stage, offload, dtype, ws, *, grad_accum=1, clip=0.0, ns_method="gram", heads=False, swapper="partitioned",
          params=None, steps=STEPS, suffix="", **cfg) -> Case:
    if params is None:
        params = nvme_params(ws) if offload == "nvme" else TINY_PARAMS
    if heads:
        params = tuple(params) + (HEAD_PARAM,)
    c = pipeline_case(stage, offload, dtype, ws, steps=steps, swapper=swapper, params=params,
                      grad_accum=grad_accum, clip=clip, ns_method=ns_method, **cfg)
    name = c.name + ("-heads" if heads else "") + suffix
    return c.replace(name=name)


def base_cases(full: bool = False) -> list[Case]:
    out = []
    grid = list(itertools.product(STAGES, ("none", "cpu"), DTYPES, WORLD_SIZES))
    if full:
        for (st, off, dt, ws), (ga, cl, ns, hd) in itertools.product(
                grid, itertools.product((1, 2), (0.0, CLIP), ("gram", "standard"), (False, True))):
            out.append(_case(st, off, dt, ws, grad_accum=ga, clip=cl, ns_method=ns, heads=hd))
        return out
    for i, (st, off, dt, ws) in enumerate(grid):
        out.append(_case(st, off, dt, ws, **_knobs(i)))
    return out


def nvme_cases(full: bool = False) -> list[Case]:
    out = []
    combos = []
    for st, sw, dt in itertools.product(STAGES, ("partitioned", "pipelined"), DTYPES):
        combos.append((st, sw, dt, 2))
        if dt == "fp32" or full:
            combos += [(st, sw, dt, 1), (st, sw, dt, 3)]
    for i, (st, sw, dt, ws) in enumerate(combos):
        k = _knobs(i)
        k["heads"] = False
        out.append(_case(st, "nvme", dt, ws, swapper=sw, **k))
    return out


def inmem_cases(full: bool = False) -> list[Case]:
    out = []
    for off, dt in itertools.product(("none", "cpu", "nvme"), ("fp32", "fp16") if not full else DTYPES):
        out.append(_case(3, off, dt, 2, save_muon_momentum_buffer_in_memory=True, suffix="-inmem"))
    return out


def overflow_cases(full: bool = False) -> list[Case]:
    """An inf injected on rank 1 at step 2: a skipped step, unchanged momentum, a halved scale
    (hysteresis 1 so the very first overflow halves)."""
    out = []
    for st, off in itertools.product(STAGES, ("none", "cpu")):
        for dt in (("fp16",) if not full else DTYPES):
            c = _case(st, off, dt, 2, steps=4, hysteresis=1, suffix="-overflow")
            out.append(c.replace(overflows=(Overflow(step=2, rank=1, micro=0),)))
    return out


def growth_cases(full: bool = False) -> list[Case]:
    """fp16 with a loss-scale window of 2: the scale grows at step 4, the step after growth matters."""
    out = []
    for st, off in itertools.product(STAGES, ("none", "cpu")):
        out.append(_case(st, off, "fp16", 2, steps=5, loss_scale_window=2, suffix="-growth"))
    return out


def resume_cases(full: bool = False) -> list[Case]:
    """Save after step 2, load into a fresh engine (different init), continue to step 4."""
    out = []
    combos = [(st, off, False) for st in STAGES for off in ("none", "cpu", "nvme")]
    combos += [(3, off, True) for off in ("none", "cpu", "nvme")]
    for st, off, inmem in combos:
        extra = {"save_muon_momentum_buffer_in_memory": True} if inmem else {}
        c = _case(st, off, "fp32", 2, steps=4, suffix="-resume" + ("-inmem" if inmem else ""), **extra)
        out.append(c.replace(checkpoint_at=2))
    return out


def compiled_cases(full: bool = False) -> list[Case]:
    """torch.compile as users run it; each in fresh ranks (PoolManager never reuses a compiled pool)."""
    combos = [(1, "none", "fp32"), (2, "cpu", "bf16"), (3, "none", "fp32")]
    if full:
        combos = list(itertools.product(STAGES, ("none", "cpu"), DTYPES))
    return [_case(st, off, dt, 2, suffix="-compiled").replace(compiled=True, timeout_s=900.0)
            for st, off, dt in combos]


def model_cases(full: bool = False) -> list[Case]:
    """Real modules (GPT-2 and Llama style LMs, a ResNet-style conv net, a mixture-of-experts LM) on
    every stage, with and without zero.Init: ``harness.models.matrix``."""
    from harness.models.matrix import gate_model_cases

    return gate_model_cases(full)


def gate_cases(full: bool = False) -> list[Case]:
    cases = (base_cases(full) + nvme_cases(full) + inmem_cases(full) + overflow_cases(full)
             + growth_cases(full) + model_cases(full))
    names = [c.name for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise AssertionError(f"duplicate case names in the matrix: {sorted(dup)}")
    return cases
