"""Hypothesis strategies that draw whole harness cases, and the layout classification of a case.

A drawn case is plain frozen data (``harness.case.spec.Case``): it is drawn in the parent, shipped to the
ranks by the pool, judged by ``harness.judge.verdict.judge`` and printed as JSON for the reproducer.

What a case varies
------------------
* the Muon matrices (1 to 4 by default): any ``r x c`` with dims up to ``max_dim`` (24), with extra
  weight on 1xN, Nx1, tall, wide, odd and prime element counts; occasionally per-head Muon;
* the Adam-side vectors (0 to 3), lengths up to ``max_dim`` (primes included);
* the ORDER of all parameters (a permutation; DeepSpeed sorts the Muon group by shape tuple
  descending, ties in model order, so order moves partition boundaries mostly through the Adam
  group and through ties), and how consecutive parameters share modules. Names are generated so
  that the declared order is exactly ``model.named_parameters()`` order (checked by
  :func:`model_order_matches`), which is what DeepSpeed and the oracle both see;
* world size 1..4, ZeRO stage, optimizer offload (none / cpu; nvme rarely -- it needs a >= 1 MiB
  per-rank matrix, see ``harness.case.nvme``), model dtype (fp16 only where the CPU has fp16 kernels:
  :func:`device_dtypes`), gradient accumulation 1..3, clipping
  threshold (off, far below, near and above the update norm), steps 2..3, data seed,
  ``ns_method``, momentum, weight decay, the fp16 initial loss scale (2^4, 2^8, 2^12 and DeepSpeed's default
  2^16, which overflows this model's fp16 backward: FUZZ-001 in ``cases/fuzz/test_fuzz_muon_zero.py``) and forced
  overflows, ZeRO-3
  ``sub_group_size`` and ``save_muon_momentum_buffer_in_memory``, and rarely the float64-NS mode;
* the gradient spectrum. The synthetic loss has a data term of rank <= ``batch`` per micro-batch and
  a full-rank elementwise term about ``c**1.5`` times smaller; a small ``batch`` gives a nearly
  rank-deficient gradient (rank <= batch * W * GAS, plus that floor). Exactly rank-deficient,
  ill-conditioned (to 1e6) and near-zero gradients need the three optional ``Case`` knobs
  ``grad_scale`` / ``grad_elementwise`` / ``grad_cond`` (proposed change to ``harness.case.synthetic`` and
  ``harness.case.spec``); they are drawn only when ``Case`` has them (:data:`HAS_SPECTRUM_KNOBS`).

Runtime
-------
``runtimes=("stock",)`` draws only pipelines on which stock DeepSpeed has no catalogued bug
(``harness.registry.bugs.bugs_for`` is empty); ``"patched"`` draws ``patched=True`` cases on pipelines the
patched runtime leaves bug-free. :func:`available_runtimes` says which the checkout supports.

Layout
------
:func:`layout_classes` classifies a case's ZeRO layout with ``oracles.layout`` (through
``harness.judge.verdict.layout_for``, so it is exactly the layout the verdict judges against), with the
per-parameter definitions of ``harness.catalog.sweep.matrix_classes``: a matrix straddling a partition
boundary, a padded final partition, a rank owning none of it, a partition holding only padding.

:func:`layout_aimed_cases` builds cases aimed at one class, on a Muon matrix with Muon neighbours
before and after it in DeepSpeed's order and tiny matrices beside it (the layouts of the deterministic
sweep, ``harness.catalog.sweep``, plus drawn extras); :func:`cases` mixes them with the
free-form :func:`fuzz_cases`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from functools import lru_cache

from hypothesis import strategies as st

from harness.registry.bugs import bugs_for, refusals_for
from harness.case.spec import DTYPES, Case, Overflow, ParamShape, ds_config
from harness.case.nvme import nvme_matrix
from harness.catalog.sweep import LAYOUT_CLASSES  # one home for the class names and their definitions

MAX_DIM = 24
WORLD_SIZES = (1, 2, 3, 4)
STAGES = (1, 2, 3)
OFFLOADS = ("none", "cpu")  # nvme is drawn separately, rarely
PRIMES = tuple(p for p in range(2, 128) if all(p % q for q in range(2, int(p ** 0.5) + 1)))


SPECTRUM_KNOBS = ("grad_scale", "grad_elementwise", "grad_cond")
HAS_SPECTRUM_KNOBS = set(SPECTRUM_KNOBS) <= {f.name for f in dataclasses.fields(Case)}

CASE_TIMEOUT_S = 120.0  # a fuzz case takes well under a second; a hang is a finding, not a wait


# --------------------------------------------------------------------------------------------------
# runtime


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def available_runtimes() -> tuple[str, ...]:
    """``("stock",)``, plus ``"patched"`` when ``harness.fixes`` exists and ``harness.rank.patches``
    (which applies it on the ranks, ``harness.rank.ds_run.case_patches``) is there to install it."""
    if _module_exists("harness.fixes") and _module_exists("harness.rank.patches"):
        return ("stock", "patched")
    return ("stock",)


# --------------------------------------------------------------------------------------------------
# shapes and parameter lists


def _primes_upto(n: int) -> tuple[int, ...]:
    return tuple(p for p in PRIMES if p <= n)


def matrix_shapes(max_dim: int = MAX_DIM) -> st.SearchStrategy[tuple[int, int]]:
    """A Muon matrix shape. Shrinks towards (1, 1)."""
    d = st.integers(1, max_dim)
    long = st.integers(max(2, max_dim // 3), max_dim)
    short = st.integers(1, 3)
    odd = st.integers(0, (max_dim - 1) // 2).map(lambda k: 2 * k + 1)
    prime = st.tuples(st.sampled_from(_primes_upto(max_dim)), st.booleans()).map(
        lambda t: (1, t[0]) if t[1] else (t[0], 1))  # a prime element count is only 1xP or Px1
    return st.one_of(
        st.tuples(d, d),  # anything
        d.map(lambda n: (1, n)),  # 1xN
        d.map(lambda n: (n, 1)),  # Nx1
        st.tuples(long, short),  # tall
        st.tuples(short, long),  # wide
        st.tuples(odd, odd),  # odd element count
        prime,  # prime element count
    )


def vector_lengths(max_dim: int = MAX_DIM) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(1, max_dim), st.sampled_from(_primes_upto(max_dim)))


def _divisors(n: int) -> list[int]:
    return [h for h in range(2, n + 1) if n % h == 0]


@st.composite
def param_lists(draw, *, min_matrices: int = 1, max_matrices: int = 4, max_vectors: int = 3,
                max_dim: int = MAX_DIM, heads: bool = True, extra_matrices=()) -> tuple[ParamShape, ...]:
    """Muon matrices and Adam vectors in a drawn order, named so that declaration order is model order.

    ``extra_matrices``: shapes that must be among the matrices (the layout-aimed strategies use it).
    """
    # Counts are drawn uniformly (st.lists would make one matrix and no vector the usual case);
    # they still shrink towards the minimum.
    lo = max(0, min_matrices - len(extra_matrices))
    hi = max(lo, max_matrices - len(extra_matrices))
    n_mat = draw(st.sampled_from(range(lo, hi + 1)))
    mats = list(extra_matrices) + [draw(matrix_shapes(max_dim)) for _ in range(n_mat)]
    vecs = [draw(vector_lengths(max_dim)) for _ in range(draw(st.sampled_from(range(0, max_vectors + 1))))]
    items: list[tuple[tuple[int, ...], int | None]] = []
    for shape in mats:
        nh = None
        # Per-head Muon needs rows = heads * head_dim with at least two heads.
        if heads and shape[0] >= 2 and shape[1] >= 2 and draw(st.sampled_from((False,) * 7 + (True,))):
            nh = draw(st.sampled_from(_divisors(shape[0])))
        items.append((tuple(shape), nh))
    items += [((n,), None) for n in vecs]
    order = draw(st.permutations(range(len(items))))
    ordered = [items[i] for i in order]
    # Module structure: a parameter either opens a new module or joins the previous parameter's;
    # a module is sometimes nested one level (``m3.inner``). Every module is contiguous in the
    # declared order, so ``named_parameters()`` visits the parameters exactly in that order.
    joins = draw(st.lists(st.booleans(), min_size=len(ordered), max_size=len(ordered)))
    nested = draw(st.lists(st.booleans(), min_size=len(ordered), max_size=len(ordered)))
    out, module, k = [], None, -1
    for i, ((shape, nh), join, nest) in enumerate(zip(ordered, joins, nested)):
        if module is None or not join:
            k += 1
            module = f"m{k}.inner" if nest else f"m{k}"
        leaf = f"weight{i}" if len(shape) >= 2 else f"bias{i}"
        out.append(ParamShape(f"{module}.{leaf}", shape, nh))
    params = tuple(out)
    assert model_order_matches(params), params
    return params


def model_order(params) -> list[str]:
    """``named_parameters()`` order of ``harness.case.synthetic.build_model`` for these params, without torch:
    a module yields its own parameters (registration order) and then its children (creation order)."""
    tree: dict = {"own": [], "kids": {}}
    for p in params:
        node = tree
        parts = p.name.split(".")
        for part in parts[:-1]:
            node = node["kids"].setdefault(part, {"own": [], "kids": {}})
        node["own"].append(p.name)

    def walk(node):
        yield from node["own"]
        for kid in node["kids"].values():
            yield from walk(kid)

    return list(walk(tree))


def model_order_matches(params) -> bool:
    return model_order(params) == [p.name for p in params]


# --------------------------------------------------------------------------------------------------
# pipelines


@lru_cache(maxsize=None)
def clean_pipelines(runtime: str = "stock", nvme: bool = False) -> tuple[tuple[int, str, str], ...]:
    """(stage, offload, dtype) on which ``runtime`` has no catalogued bug, judged on a probe case
    (the final case is re-checked: a bug trigger may depend on more than the pipeline)."""
    from harness.case.scenarios import TINY_PARAMS

    patched = runtime == "patched"
    out = []
    for stage in STAGES:
        for offload in OFFLOADS + (("nvme",) if nvme else ()):
            for dtype in device_dtypes():
                probe = Case("probe", TINY_PARAMS, ds_config(stage=stage, dtype=dtype, offload=offload),
                             patched=patched)
                if case_is_clean(probe):
                    out.append((stage, offload, dtype))
    return tuple(out)


def device_dtypes() -> tuple[str, ...]:
    """Model dtypes the ranks' accelerator accepts: fp16 needs fp16 support, which the CPU stand-in
    provides on CPUs without oneDNN fp16 kernels (``harness.env.device``; FUZZ-002 in
    ``cases/fuzz/test_fuzz_muon_zero.py``); with ``MUON_HARNESS_NATIVE_FP16=1`` such a CPU refuses fp16."""
    from harness.env.device import half_support

    return DTYPES if half_support()[0] else tuple(d for d in DTYPES if d != "fp16")


def case_is_clean(case: Case) -> bool:
    """No catalogued bug expected on the runtime the case runs on, and (patched) no fix that refuses the
    case instead of running it (DSM-002's fix refuses ZeRO-1/2 NVMe: FUZZ-003)."""
    if bugs_for(case, patched=case.patched):
        return False
    return not (case.patched and refusals_for(case))


# --------------------------------------------------------------------------------------------------
# gradient spectrum

SPECTRA = ("natural", "low-rank-data", "rank-deficient", "ill-conditioned", "near-zero")


@st.composite
def spectra(draw, dtype: str) -> tuple[str, int, dict]:
    """(label, batch, knobs). Without the spectrum knobs only the batch size shapes the spectrum."""
    if not HAS_SPECTRUM_KNOBS:
        kind = draw(st.sampled_from(("natural", "low-rank-data")))
        batch = draw(st.integers(1, 8)) if kind == "natural" else draw(st.integers(1, 2))
        return kind, batch, {}
    kinds = SPECTRA if dtype == "fp32" else SPECTRA[:-1]  # a near-zero gradient underflows a 16-bit backward
    kind = draw(st.sampled_from(kinds))
    batch = draw(st.integers(1, 8))
    knobs: dict = {}
    if kind == "low-rank-data":
        batch = draw(st.integers(1, 2))
    elif kind == "rank-deficient":
        knobs = {"grad_elementwise": 0.0}
        batch = draw(st.integers(1, 3))
    elif kind == "ill-conditioned":
        knobs = {"grad_elementwise": 0.0, "grad_cond": float(10 ** draw(st.integers(1, 6)))}
        batch = draw(st.integers(8, 32))  # enough rows that the column scaling sets the spectrum
    elif kind == "near-zero":
        knobs = {"grad_scale": float(10.0 ** -draw(st.integers(5, 14)))}
    return kind, batch, knobs


# --------------------------------------------------------------------------------------------------
# whole cases

CLIPS = (0.0, 1e-3, 0.05, 1.0, 3.0, 1e3)  # off, always, usually, sometimes (update norm ~1-3), never


def clip_thresholds() -> st.SearchStrategy[float]:
    """Off about a third of the time; else a round threshold or any in [1e-3, 10]."""
    return st.one_of(st.just(0.0), st.sampled_from(CLIPS[1:]),
                     st.floats(1e-3, 10.0, allow_nan=False, allow_infinity=False))


def _rare(n: int) -> st.SearchStrategy[bool]:
    """True about once in ``n`` draws (shrinks to False)."""
    return st.sampled_from((False,) * (n - 1) + (True,))


# Swarm testing: each draw first picks which of these knobs it varies at all; the others keep their
# defaults. Every knob is then off in half the draws, so a case that varies only, say, sub-groups,
# in-memory momentum and accumulation -- rare when every knob is always drawn -- gets one draw in
# eight instead of a product of small probabilities, and a failure shrinks towards varying nothing.
SWARM_KNOBS = ("accumulation", "clipping", "spectrum", "ns_method", "momentum", "weight_decay", "steps",
               "loss_scale", "overflow", "sub_groups", "inmem_momentum", "float64_ns")


@st.composite
def swarms(draw) -> frozenset[str]:
    """The knobs a draw varies (each in or out with even odds; shrinks to none)."""
    on = draw(st.lists(st.booleans(), min_size=len(SWARM_KNOBS), max_size=len(SWARM_KNOBS)))
    return frozenset(k for k, v in zip(SWARM_KNOBS, on) if v)


@st.composite
def _assemble(draw, *, stage: int, offload: str, dtype: str, world_size: int, params, patched: bool,
              aim: str | None = None, sub_groups: bool = True) -> Case:
    swarm = draw(swarms())
    # a knob in the swarm takes a value other than its default (the default is what "out" means)
    grad_accum = draw(st.sampled_from((2, 3))) if "accumulation" in swarm else 1
    clip = draw(clip_thresholds()) if "clipping" in swarm else 0.0
    kind, batch, knobs = draw(spectra(dtype)) if "spectrum" in swarm else ("natural", 8, {})
    cfg: dict = dict(
        ns_method=draw(st.sampled_from(("gram", "standard"))) if "ns_method" in swarm else "gram",
        momentum=draw(st.sampled_from((0.95, 0.9, 0.5))) if "momentum" in swarm else 0.95,
        weight_decay=draw(st.sampled_from((0.0, 0.1))) if "weight_decay" in swarm else 0.0,
    )
    if dtype == "fp16" and "loss_scale" in swarm:
        # 2^8 (DeepSpeed's harness default), 2^4 and 2^12, and 2^16, whose fp16 backward overflows
        # this model itself (dL/dpred = 2 (pred - T) / (B r) * S): FUZZ-001, now predicted.
        cfg["initial_scale_power"] = draw(st.sampled_from((8, 4, 12, 16)))
    if stage == 3:
        if "sub_groups" in swarm and sub_groups:
            cfg["sub_group_size"] = draw(st.integers(1, 64))  # split the optimizer into sub-groups
        cfg["save_muon_momentum_buffer_in_memory"] = "inmem_momentum" in swarm and draw(st.booleans())
    steps = 3 if "steps" in swarm else 2
    overflows = ()
    if dtype == "fp16" and "overflow" in swarm:
        overflows = (Overflow(step=draw(st.integers(1, steps)), rank=draw(st.integers(0, world_size - 1)),
                              micro=draw(st.integers(0, grad_accum - 1))),)
    # FUZZ-004 (open, cases/fuzz/test_fuzz_muon_zero.py): the float64-NS mode's momentum allowance is
    # exceeded on 1x1 matrices; while the tolerance is open, that mode is not drawn with one (the
    # replays there keep the finding checked).
    scalar = any(len(p.shape) >= 2 and math.prod(p.shape) == 1 for p in params)
    ns_dtype = "float64" if "float64_ns" in swarm and not scalar and draw(_rare(3)) else None
    if offload == "nvme":
        params = tuple(params) + (nvme_matrix(world_size, name="nvme.weight"),)
    name = (f"fuzz-z{stage}-{offload}-{dtype}-ws{world_size}-m{sum(len(p.shape) >= 2 for p in params)}"
            f"v{sum(len(p.shape) == 1 for p in params)}-{kind}" + (f"-aim-{aim}" if aim else "")
            + ("-patched" if patched else ""))
    case = Case(
        name=name,
        params=tuple(params),
        ds_config=ds_config(stage=stage, dtype=dtype, offload=offload, world_size=world_size,
                            grad_accum=grad_accum, clip=clip, **cfg),
        world_size=world_size,
        steps=steps,
        seed=draw(st.integers(0, 2**16 - 1)),
        batch=batch,
        ns_dtype=ns_dtype,
        overflows=overflows,
        patched=patched,
        timeout_s=CASE_TIMEOUT_S,
        **knobs,
    )
    return case


@st.composite
def _pipeline(draw, runtimes, nvme_rarity: int, world_sizes):
    runtime = draw(st.sampled_from(tuple(runtimes)))
    nvme = nvme_rarity > 0 and draw(_rare(nvme_rarity))
    if nvme:
        choices = [p for p in clean_pipelines(runtime, nvme=True) if p[1] == "nvme"]
        if not choices:
            nvme = False
    if not nvme:
        choices = clean_pipelines(runtime)
    stage, offload, dtype = draw(st.sampled_from(tuple(choices)))
    ws = tuple(w for w in world_sizes if w <= 2) if nvme else tuple(world_sizes)  # keep NVMe cases bounded
    world_size = draw(st.sampled_from(ws))
    return runtime == "patched", stage, offload, dtype, world_size


def fuzz_cases(*, runtimes=("stock",), world_sizes=WORLD_SIZES, nvme_rarity: int = 40, max_matrices: int = 4,
               max_vectors: int = 3, max_dim: int = MAX_DIM) -> st.SearchStrategy[Case]:
    """Free-form cases on clean pipelines of ``runtimes``. Shrinks towards one 1x1 matrix, world size 1,
    ZeRO-1, no offload, fp32, no accumulation, no clipping. ``nvme_rarity``: one case in about that
    many is an NVMe case (0: never)."""

    @st.composite
    def build(draw):
        patched, stage, offload, dtype, W = draw(_pipeline(runtimes, nvme_rarity, world_sizes))
        params = draw(param_lists(max_matrices=max_matrices, max_vectors=max_vectors, max_dim=max_dim))
        return draw(_assemble(stage=stage, offload=offload, dtype=dtype, world_size=W, params=params,
                              patched=patched))

    return build().filter(case_is_clean)


# --------------------------------------------------------------------------------------------------
# layout-aimed cases


def _aimed_lists(aim: str, stage: int, world_size: int, patched: bool) -> tuple[int, ...]:
    """Indices of the sweep's matrix lists (``harness.catalog.sweep.LAYOUTS``) that show ``aim`` on a Muon matrix
    with Muon neighbours (before and after; ``B+A`` where the layout allows no more) on this pipeline and
    carry no catalogued bug for the runtime."""
    return _aimed_lists_cached(aim, stage, world_size, patched)


@lru_cache(maxsize=None)
def _aimed_lists_cached(aim, stage, world_size, patched):
    from harness.catalog import sweep

    out = []
    for i in range(len(sweep.LAYOUTS[world_size])):
        c = sweep.build_case(stage, "none", world_size, i, {"clip": 0.0, "grad_accum": 1, "ns_method": "gram"})
        c = c.replace(patched=patched)
        if sweep.case_cells(c).get(aim) in ("BA", "B+A") and case_is_clean(c):
            out.append(i)
    return tuple(out)


def _provisional(stage: int, offload: str, world_size: int, params, patched: bool) -> Case:
    return Case("provisional", tuple(params), ds_config(stage=stage, offload=offload, world_size=world_size),
                world_size=world_size, patched=patched)


def shows_with_neighbours(case: Case, aim: str) -> bool:
    """``aim`` occurs on a Muon matrix that has Muon matrices before and after it in its group."""
    from harness.catalog import sweep

    return sweep.case_cells(case).get(aim) in ("BA", "B+A")


def layout_aimed_cases(aim: str | None = None, *, runtimes=("stock",), world_sizes=(2, 3, 4),
                       max_dim: int = MAX_DIM) -> st.SearchStrategy[Case]:
    """Cases built to produce one layout class (``aim``; drawn when None) on a Muon matrix that shares
    its group (ZeRO-1/2) or sub-group (ZeRO-3) with other Muon matrices before and after it in
    DeepSpeed's order, next to tiny matrices with fewer elements than ranks.

    The matrices start from a list of the layout sweep (``harness.catalog.sweep.LAYOUTS``) that shows the class
    that way on the drawn pipeline; up to two more small matrices are added when the class survives
    them (checked on the layout oracle before anything runs); Adam vectors and the declared order are
    drawn freely, and the sub-group split is left off (it would separate the neighbours)."""
    aims = (aim,) if aim else LAYOUT_CLASSES
    ws = tuple(w for w in world_sizes if w >= 2) or (2,)
    from harness.catalog import sweep

    @st.composite
    def build(draw):
        a = draw(st.sampled_from(aims))
        patched, stage, offload, dtype, W = draw(_pipeline(runtimes, 0, ws))
        lists = _aimed_lists(a, stage, W, patched)
        if not lists:  # no list shows it here bug-free: take the first list, the filter drops the case
            lists = (0,)
        base = tuple(sweep.LAYOUTS[W][draw(st.sampled_from(lists))])
        extra = tuple(draw(st.lists(matrix_shapes(min(max_dim, 2 * W)), max_size=2)))
        params = None
        for mats in ((base + extra), base):
            cand = draw(param_lists(min_matrices=len(mats), max_matrices=len(mats), max_vectors=3,
                                    max_dim=max_dim, heads=False, extra_matrices=mats))
            if shows_with_neighbours(_provisional(stage, offload, W, cand, patched), a):
                params = cand
                break
        if params is None:
            params = cand
        return draw(_assemble(stage=stage, offload=offload, dtype=dtype, world_size=W, params=params,
                              patched=patched, aim=a, sub_groups=False))

    return build().filter(lambda c: case_is_clean(c) and (aim is None or shows_with_neighbours(c, aim)))


def cases(*, runtimes=("stock",), world_sizes=WORLD_SIZES, nvme_rarity: int = 40,
          max_dim: int = MAX_DIM) -> st.SearchStrategy[Case]:
    """What the fuzz test draws: free-form cases (shrink target) or layout-aimed ones."""
    return st.one_of(
        fuzz_cases(runtimes=runtimes, world_sizes=world_sizes, nvme_rarity=nvme_rarity, max_dim=max_dim),
        layout_aimed_cases(runtimes=runtimes, world_sizes=tuple(w for w in world_sizes if w >= 2) or (2,),
                           max_dim=max_dim),
    )


# --------------------------------------------------------------------------------------------------
# layout classification


def case_layout(case: Case):
    from harness.judge import verdict

    return verdict.layout_for(case, verdict.step_config(case))


def layout_details(case: Case) -> dict[str, set[str]]:
    """Per layout class, where it occurs (``"muon"`` / ``"adam"`` group, ``"subgroup"`` for a
    ZeRO-3 sub-group partition that is all padding); absent classes are absent. The classes of each
    parameter are ``harness.catalog.sweep.matrix_classes`` (one definition for the sweep and the fuzzer)."""
    from oracles.layout import Zero3Layout, rank_segments

    from harness.catalog import sweep
    from harness.judge import verdict

    if case.stage == 0:
        return {}
    sc = verdict.step_config(case)
    layout = verdict.layout_for(case, sc)
    use_muon = {p.name: p.use_muon for p in sc.params}
    out: dict[str, set[str]] = {}
    for p in layout.placements:
        kind = "muon" if use_muon[p.name] else "adam"
        for cls in sweep.matrix_classes(layout, p.name):
            out.setdefault(cls, set()).add(kind)
    if isinstance(layout, Zero3Layout):
        for r in range(case.world_size):
            by_sub: dict[int, list] = {}
            for sgm in rank_segments(layout, r):
                by_sub.setdefault(sgm.group, []).append(sgm)
            if any(all(sgm.kind != "param" for sgm in segs) for segs in by_sub.values()):
                out.setdefault("padding-only-partition", set()).add("subgroup")
    return out


def layout_classes(case: Case) -> frozenset[str]:
    return frozenset(layout_details(case))


def spectrum_of(case: Case) -> str:
    """The spectrum label of a case, read back from its fields (see :func:`spectra`)."""
    scale = getattr(case, "grad_scale", 1.0)
    elem = getattr(case, "grad_elementwise", 1.0)
    cond = getattr(case, "grad_cond", 1.0)
    if scale != 1.0:
        return "near-zero"
    if cond != 1.0:
        return "ill-conditioned"
    if elem == 0.0:
        return "rank-deficient"
    return "low-rank-data" if case.batch <= 2 else "natural"


def case_events(case: Case) -> list[str]:
    """The ``hypothesis.event`` labels of a case: path, world size, runtime, layout, spectrum."""
    ev = [f"path z{case.stage}/{case.offload}/{case.dtype}", f"world size {case.world_size}",
          f"runtime {'patched' if case.patched else 'stock'}", f"spectrum {spectrum_of(case)}"]
    details = layout_details(case)
    for cls in LAYOUT_CLASSES:
        if cls in details:
            ev.append(f"layout {cls}")
            ev += [f"layout {cls} ({where})" for where in sorted(details[cls])]
    if not details:
        ev.append("layout none of the targeted classes")
    n_muon = sum(len(p.shape) >= 2 for p in case.params)
    ev.append(f"muon matrices {n_muon}")
    if case.grad_accum > 1:
        ev.append("grad accumulation")
    if case.config.get("gradient_clipping", 0.0) > 0:
        ev.append("clipping")
    if case.overflows:
        ev.append("forced overflow")
    return ev
