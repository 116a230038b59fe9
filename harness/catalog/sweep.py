"""The deterministic layout sweep: partition layouts that partitioned Muon code must survive, run.

Why it exists: the fuzzer's strategies *draw* every layout class, but a draw is not a run, and a
probe matrix alone in its group never meets the neighbours a flat buffer gives it. The sweep is
enumerated, so its coverage is a fact computed from the layout oracle (``oracles.layout``), not a
probability:

for every ZeRO stage of :data:`STAGES`, offload none/cpu and world size 2, 3 and 4, and every layout
class of :data:`LAYOUT_CLASSES`, at least one case runs in which a Muon matrix shows the class while
other Muon matrices sit in the same group (ZeRO-1/2) or sub-group (ZeRO-3) before AND after it in
DeepSpeed's order (the Muon half sorted by shape, descending), next to several tiny matrices with
fewer elements than there are ranks.

Layout classes of one matrix (``W`` ranks; ZeRO-1/2: ``P`` the group's partition size, ``E`` the end
of the group's data in its flat buffer; ZeRO-3: ``q = ceil(n / W)`` the per-rank share):

* ``straddles-boundary``      two or more ranks hold part of it;
* ``padded-final-partition``  the partition that holds its last element ends in padding (ZeRO-1/2:
  it holds elements in the last data-bearing partition and ``E % P != 0``; ZeRO-3: ``n % q != 0``);
* ``rank-owns-none``          some rank holds none of its elements;
* ``padding-only-partition``  a rank's partition after the matrix's data is padding only (ZeRO-1/2:
  it sits in the last data-bearing partition and the group's padding fills a whole partition;
  ZeRO-3: the last rank's share of it is padding, ``(W - 1) q >= n``).

ZeRO-1/2 at world size 2 cannot give a padding-only partition a matrix with neighbours on both sides
(the group must then hold at most two elements), so that cell is met by two 1x1 matrices: one with a
neighbour after it, one with a neighbour before. :func:`coverage` marks such a cell ``B+A``.

The matrix lists are chosen per world size from :data:`LAYOUTS` (a short, reviewed catalogue; per
(stage, world size) the first lists that together cover every class are run), the parameters are
declared in an order DeepSpeed has to re-sort, and the cheap knobs (clipping, accumulation,
``ns_method``) cycle over the cases. Stage 0 (no partitioning) is added to :data:`STAGES` once the
harness runs it; its cases then run with no layout class to cover.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from oracles.layout import Zero12Layout, param_slices, placement

from harness.case.spec import Case, ParamShape, ds_config

STAGES = (1, 2, 3)  # the sweep's stages; add 0 here once stage 0 runs (no partitions: no class to cover)
OFFLOADS = ("none", "cpu")
WORLD_SIZES = (2, 3, 4)
STEPS = 2
DTYPE = "fp32"  # the one dtype every stage and offload runs bug-free on stock (harness.registry.bugs)
CLIP = 0.05  # below this model's Muon update norm: clips whenever it is on

LAYOUT_CLASSES = ("straddles-boundary", "padded-final-partition", "rank-owns-none", "padding-only-partition")

# Muon matrices per world size, in DeepSpeed's order (shape tuple descending). Each list puts its
# layout classes on a matrix with neighbours on both sides and holds at least two matrices with
# fewer elements than ranks, side by side; :func:`check_coverage` proves it from the oracle.
LAYOUTS: dict[int, tuple[tuple[tuple[int, int], ...], ...]] = {
    2: (((1, 4), (1, 3), (1, 1), (1, 1), (1, 1)),  # every class on ZeRO-3; all but padding-only on ZeRO-1/2
        ((1, 1), (1, 1))),                          # ZeRO-1/2: the group pads to 4, rank 1 holds padding only
    3: (((2, 1), (1, 3), (1, 1), (1, 1)),           # ZeRO-1/2: 7 elements in 12 (P = 4): every class
        ((2, 1), (1, 5), (1, 1), (1, 1))),          # ZeRO-3: 1x5 splits 2+2+1 (padded), 1x1 leaves 2 ranks empty
    4: (((3, 1), (1, 5), (1, 1), (1, 1)),),         # every class on every stage
}


def adam_vectors(world_size: int) -> tuple[int, ...]:
    """Adam-side vector lengths: one shorter than the world size, one not dividing by it."""
    return (1, world_size + 1)


# --------------------------------------------------------------------------------------------------
# classification (from the layout oracle)


def matrix_classes(layout, name: str) -> frozenset[str]:
    """The layout classes parameter ``name`` shows in ``layout`` (see the module docstring)."""
    W = layout.world_size
    p = placement(layout, name)
    slices = param_slices(layout, name)
    out = set()
    if len(slices) >= 2:
        out.add("straddles-boundary")
    if len(slices) < W:
        out.add("rank-owns-none")
    if isinstance(layout, Zero12Layout):
        P = layout.partition_size[p.group]
        end, total = layout.group_data_end[p.group], layout.group_numel[p.group]
        in_last = any(s.rank == (end - 1) // P for s in slices)
        if in_last and end % P:
            out.add("padded-final-partition")
        if in_last and total - end >= P:
            out.add("padding-only-partition")
    else:
        q = -(-p.numel // W)
        if p.numel % q:
            out.add("padded-final-partition")
        if (W - 1) * q >= p.numel:
            out.add("padding-only-partition")
    return frozenset(out)


@dataclass(frozen=True)
class Probe:
    """One Muon matrix of a case, where DeepSpeed puts it and what its layout shows."""
    name: str
    shape: tuple[int, ...]
    group: int  # ZeRO-1/2 param group / ZeRO-3 sub-group
    before: int  # Muon matrices before it in the same group / sub-group
    after: int
    classes: frozenset[str]


def probes(case: Case) -> list[Probe]:
    """Every Muon matrix of ``case`` with its classes and neighbours, in DeepSpeed's order; empty for a
    stage without partitions."""
    from harness.judge import verdict  # late: keeps this module numpy-free at import

    if case.stage == 0:
        return []
    sc = verdict.step_config(case)
    layout = verdict.layout_for(case, sc)
    muon = {p.name for p in sc.params if p.use_muon}
    shapes = {p.name: tuple(p.shape) for p in case.params}
    rows = [pl for pl in layout.placements if pl.name in muon]
    out = []
    for pl in rows:
        same = [r for r in rows if r.group == pl.group]
        i = same.index(pl)
        out.append(Probe(pl.name, shapes[pl.name], pl.group, i, len(same) - 1 - i, matrix_classes(layout, pl.name)))
    return out


def tiny_run(case: Case) -> int:
    """The longest run of consecutive Muon matrices (DeepSpeed's order) with fewer elements than ranks."""
    best = cur = 0
    prev_group = None
    for p in probes(case):
        n = 1
        for d in p.shape:
            n *= d
        cur = cur + 1 if n < case.world_size and p.group == prev_group else (1 if n < case.world_size else 0)
        prev_group = p.group
        best = max(best, cur)
    return best


def case_cells(case: Case) -> dict[str, str]:
    """Per layout class the case shows on a Muon matrix: ``"BA"`` (a matrix with neighbours before and
    after it), ``"B+A"`` (one with a neighbour before and another with one after), ``"B"``/``"A"``/
    ``"alone"`` otherwise."""
    ps = probes(case)
    out = {}
    for cls in LAYOUT_CLASSES:
        hits = [p for p in ps if cls in p.classes]
        if not hits:
            continue
        if any(p.before and p.after for p in hits):
            out[cls] = "BA"
        elif any(p.before for p in hits) and any(p.after for p in hits):
            out[cls] = "B+A"
        elif any(p.before for p in hits):
            out[cls] = "B"
        elif any(p.after for p in hits):
            out[cls] = "A"
        else:
            out[cls] = "alone"
    return out


_RANK = {"BA": 4, "B+A": 3, "B": 2, "A": 2, "alone": 1}


def _covers(mark: str | None, stage: int, ws: int, cls: str) -> bool:
    if mark == "BA":
        return True
    # the one geometric exception (module docstring): ZeRO-1/2, two ranks, a padding-only partition
    return mark == "B+A" and stage in (1, 2) and ws == 2 and cls == "padding-only-partition"


# --------------------------------------------------------------------------------------------------
# the cases


def _params(shapes, world_size: int) -> tuple[ParamShape, ...]:
    """Matrices declared smallest first, vectors between them: DeepSpeed re-sorts the Muon half, so
    model order and flat-buffer order differ (each parameter its own module ``l<i>``: declared order
    is ``named_parameters()`` order)."""
    mats = [("weight", s) for s in reversed(shapes)]
    vecs = [("bias", (n,)) for n in adam_vectors(world_size)]
    items = []
    for i, m in enumerate(mats):
        items.append(m)
        if i < len(vecs):
            items.append(vecs[i])
    items += vecs[len(mats):]
    return tuple(ParamShape(f"l{i}.{kind}", tuple(shape)) for i, (kind, shape) in enumerate(items))


def _knobs(i: int) -> dict:
    return {"clip": (0.0, CLIP)[i % 2], "grad_accum": (1, 2)[(i // 2) % 2],
            "ns_method": ("gram", "standard")[(i // 3) % 2]}


def build_case(stage: int, offload: str, world_size: int, layout_index: int, knobs: dict) -> Case:
    shapes = LAYOUTS[world_size][layout_index]
    name = f"sweep-z{stage}-{offload}-ws{world_size}-L{layout_index}"
    if knobs["grad_accum"] != 1:
        name += f"-ga{knobs['grad_accum']}"
    if knobs["clip"]:
        name += f"-clip{knobs['clip']:g}"
    if knobs["ns_method"] != "gram":
        name += f"-{knobs['ns_method']}"
    return Case(name=name, params=_params(shapes, world_size),
                ds_config=ds_config(stage=stage, dtype=DTYPE, offload=offload, world_size=world_size, **knobs),
                world_size=world_size, steps=STEPS)


def _layouts_needed(stage: int, world_size: int) -> list[int]:
    """Which lists of :data:`LAYOUTS` run for (stage, world size): the first that covers every class on
    its own, else the first lists that together do (greedy, in catalogue order)."""
    if stage == 0:
        return [0]
    cells = [case_cells(build_case(stage, "none", world_size, i, _knobs(0))) for i in range(len(LAYOUTS[world_size]))]

    def done(best):
        return all(_covers(best.get(c), stage, world_size, c) for c in LAYOUT_CLASSES)

    for i, cell in enumerate(cells):
        if done(cell):
            return [i]
    best: dict[str, str] = {}
    chosen = []
    for i, cell in enumerate(cells):
        gains = [c for c, m in cell.items() if _RANK[m] > _RANK.get(best.get(c), 0)]
        if gains:
            chosen.append(i)
            best.update({c: cell[c] for c in gains})
        if done(best):
            break
    return chosen


def sweep_cases(stages=STAGES) -> list[Case]:
    """The sweep, in a fixed order (stage, offload, world size, list)."""
    out = []
    i = 0
    for stage, offload, ws in itertools.product(stages, OFFLOADS, WORLD_SIZES):
        if stage == 0 and offload != "none":  # optimizer offload is a ZeRO feature
            continue
        for li in _layouts_needed(stage, ws):
            out.append(build_case(stage, offload, ws, li, _knobs(i)))
            i += 1
    return out


# --------------------------------------------------------------------------------------------------
# coverage


def coverage(cases) -> dict[tuple[int, str, int, str], list[tuple[str, str]]]:
    """(stage, offload, world size, class) -> [(case name, mark)] over ``cases``."""
    cov: dict = {}
    for c in cases:
        for cls, mark in case_cells(c).items():
            cov.setdefault((c.stage, c.offload, c.world_size, cls), []).append((c.name, mark))
    return cov


def missing_cells(cases, stages=STAGES) -> list[tuple[int, str, int, str]]:
    """Cells no case covers (with neighbours on both sides; see :func:`_covers`)."""
    cov = coverage(cases)
    out = []
    for stage, off, ws, cls in itertools.product(stages, OFFLOADS, WORLD_SIZES, LAYOUT_CLASSES):
        if stage == 0:  # no partitions, nothing to cover
            continue
        if not any(_covers(m, stage, ws, cls) for _, m in cov.get((stage, off, ws, cls), ())):
            out.append((stage, off, ws, cls))
    return out


SHORT = {"straddles-boundary": "straddles", "padded-final-partition": "padded-final",
         "rank-owns-none": "rank-owns-none", "padding-only-partition": "padding-only"}


def coverage_table(cases, statuses: dict[str, str] | None = None, seconds: dict[str, float] | None = None) -> str:
    """The (stage, offload, world size) x class table. A cell names the best mark and the number of the
    case giving it; with ``statuses`` (case name -> status, e.g. "passed", "xfailed [DSM-014]") each
    case's outcome is listed under the table, with ``seconds`` its time."""
    cases = list(cases)
    index = {c.name: i for i, c in enumerate(cases)}
    cov = coverage(cases)
    head = f"{'stage/offload/ws':18s}" + "".join(f"{SHORT[c]:>16s}" for c in LAYOUT_CLASSES)
    lines = [head]
    for stage, off, ws in itertools.product(sorted({c.stage for c in cases}), OFFLOADS, WORLD_SIZES):
        if not any(c.stage == stage and c.offload == off and c.world_size == ws for c in cases):
            continue
        row = f"z{stage} {off:4s} ws{ws:<8d}"
        for cls in LAYOUT_CLASSES:
            hits = cov.get((stage, off, ws, cls), [])
            if stage == 0:
                cell = "n/a"
            elif not hits:
                cell = "MISSING"
            else:
                name, mark = max(hits, key=lambda h: _RANK[h[1]])
                cell = f"{mark} #{index[name]}" + ("" if _covers(mark, stage, ws, cls) else " (!)")
            row += f"{cell:>16s}"
        lines.append(row)
    miss = missing_cells(cases, stages=sorted({c.stage for c in cases}))
    lines.append("legend: BA = a matrix with Muon neighbours before and after it in its group; B+A = "
                 "split over two matrices (ZeRO-1/2, ws2, padding-only only); (!) = not covered")
    total = sum(seconds.values()) if seconds else None
    covered = sum(1 for (st, _, ws, cls), hits in cov.items() if any(_covers(m, st, ws, cls) for _, m in hits))
    lines.append(f"{len(cases)} cases; {covered} (stage, offload, ws, class) cells covered, {len(miss)} missing"
                 + (f", {total:.1f}s" if total is not None else ""))
    if statuses is not None:
        for c in cases:
            st = statuses.get(c.name, "not run")
            t = f" {seconds[c.name]:.1f}s" if seconds and c.name in seconds else ""
            lines.append(f"  #{index[c.name]:<3d}{c.name:44s} {st}{t}")
    return "\n".join(lines)


def check_coverage(cases=None, stages=STAGES) -> None:
    """Raise unless every cell is covered and every case holds tiny matrices side by side."""
    cases = sweep_cases(stages) if cases is None else list(cases)
    miss = missing_cells(cases, stages)
    if miss:
        raise AssertionError(f"layout sweep leaves cells uncovered: {miss}\n{coverage_table(cases)}")
    lonely = [c.name for c in cases if c.stage and tiny_run(c) < 2]
    if lonely:
        raise AssertionError(f"sweep cases without two tiny matrices side by side: {lonely}")


def gate_summary(column: str, runs: dict[str, tuple[str, float]]) -> str:
    """The gate's print-out for one column: the table with each sweep case's status and time (``runs``:
    case name -> (status, seconds) over every case the gate ran; non-sweep cases are ignored)."""
    cases = [c for c in sweep_cases() if c.name in runs]
    if not cases:
        return ""
    statuses = {c.name: runs[c.name][0] for c in cases}
    seconds = {c.name: runs[c.name][1] for c in cases}
    return (f"\nlayout sweep [{column}]: {len(cases)} cases in {sum(seconds.values()):.1f}s\n"
            + coverage_table(cases, statuses, seconds))
