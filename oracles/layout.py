"""Where each element of each parameter lives under ZeRO data-parallel partitioning.

Layout has no numerical effect (each Muon matrix is orthogonalised whole), but the partition
boundaries and the padding are where partitioned code goes wrong, so the harness draws its probe
elements from named regions. This module specifies the layout of DeepSpeed 0.19.8:

ZeRO-1/2 (``runtime/zero/stage_1_and_2.py`` ``DeepSpeedZeroOptimizer.__init__``, the flattening loop,
``flatten_dense_tensors_aligned``, ``get_data_parallel_partitions``, ``get_partition_info``;
``runtime/utils.py`` ``align_dense_tensors``):

* One flat buffer per optimizer param group, in group order. For Muon, DeepSpeed's groups are, per
  incoming group, the Muon half then the Adam half (``runtime/engine.py`` ``_muon_param_groups``); the
  Muon half is sorted by ``p.size()`` -- the shape *tuple*, lexicographically, descending, ties kept in
  model order (Python's stable ``sorted(..., reverse=True)``; ``original_muon.py``
  ``MuonWithAuxAdam.__init__``); the Adam half stays in model order. :func:`ds_param_groups` builds
  that order.
* Optional ``round_robin_gradients`` reorder (``_round_robin_reorder``): params ``i`` with the same
  ``i % W`` are brought together, classes in order of first appearance.
* With ``parameter_alignment`` every parameter but the last is followed by zeros up to a multiple of
  ``16 / gcd(16, element_size)`` elements (4 for fp32, 8 for fp16/bf16).
* The group is padded with zeros to a multiple of ``2 * W`` (``nccl_start_alignment_factor = 2``)
  and cut into ``W`` equal partitions of ``P`` elements; rank ``r`` owns flat ``[r P, (r+1) P)``.

ZeRO-3 (``runtime/zero/partition_parameters.py`` ``Init._padding_size`` / ``_aligned_size`` /
``_partition_param``; ``runtime/zero/stage3.py`` ``_create_fp16_sub_groups``):

* Each parameter on its own: padded to a multiple of ``W``; with ``q = ceil(n / W)`` rank ``r`` holds
  elements ``[r q, (r+1) q)`` of the flattened parameter (its ``ds_tensor``), the tail past ``n``
  being zero padding (a rank can hold padding only, e.g. ``n < W``).
* A rank's optimizer partition for a sub-group is the concatenation of its ``ds_tensor`` s (``q``
  elements each, padding included) in group order; a sub-group closes once its cumulative partition
  numel reaches ``sub_group_size`` (or at the group's last parameter).

Regions (``locate``): ``"boundary"`` -- within ``window`` elements of a partition cut (the element just
before or just after a cut, for ``window=1``); ``"padded_tail"`` -- within ``window`` elements of a
run of padding in the same rank's partition (the elements that a wrong padding length would
corrupt); ``"interior"`` -- everything else. Boundary wins over padded_tail.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

REGIONS = ("interior", "boundary", "padded_tail")


@dataclass(frozen=True)
class LayoutParam:
    """A parameter as far as layout cares: name and shape (numel derived)."""
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _as_layout_param(p) -> LayoutParam:
    if isinstance(p, LayoutParam):
        return p
    if hasattr(p, "name") and hasattr(p, "shape"):
        return LayoutParam(p.name, tuple(p.shape))
    name, shape = p
    if isinstance(shape, int):
        shape = (shape,)
    return LayoutParam(name, tuple(shape))


# Name parts that keep a matrix on the auxiliary Adam (``deepspeed/__init__.py:369``).
ADAM_NAME_PARTS = ("embed", "lm_head")


def deepspeed_uses_muon(name: str, shape: Sequence[int]) -> bool:
    """DeepSpeed's automatic Muon tag (``deepspeed/__init__.py:357`` ``set_optimizer_flags``, the test at
    :369): Muon iff the parameter has two or more dims and its lower-cased name contains none of
    ``ADAM_NAME_PARTS``. The one home of the rule: the oracle's ``ParamSpec``, ``ParamShape`` and
    every bug/mutant trigger ask this function."""
    low = name.lower()
    return len(tuple(shape)) >= 2 and not any(k in low for k in ADAM_NAME_PARTS)


def deepspeed_muon_reason(name: str, shape: Sequence[int]) -> str:
    """Why ``deepspeed_uses_muon`` decides as it does for this parameter, in words a user can check
    against their model (an output projection without ``lm_head`` in its name goes to Muon)."""
    hit = [k for k in ADAM_NAME_PARTS if k in name.lower()]
    if len(tuple(shape)) < 2:
        return f"{len(tuple(shape))}-D: Adam"
    if hit:
        return f"its name contains {hit[0]!r}: Adam, whatever its shape"
    return f"{len(tuple(shape))}-D and no {' or '.join(repr(k) for k in ADAM_NAME_PARTS)} in its name: Muon"


def zero3_padded_tail(numel: int, world_size: int) -> Optional[tuple[int, int]]:
    """The elements ``[lo, hi)`` of a ZeRO-3 parameter that share a rank's partition with padding,
    or None when no rank holds data and padding together.

    DeepSpeed pads the parameter to ``W * q`` with ``q = ceil(numel / W)`` (``partition_parameters.py``
    ``_padding_size`` :1693, ``_partition_param`` :1816-1878): rank ``r`` holds ``[r q, (r+1) q)``, the
    part past ``numel`` being zeros. The rank whose slice is cut short by ``numel`` holds the tail
    ``[floor(numel / q) q, numel)``. That rank need not be the last one: for 5 elements on 4 ranks
    (q = 2) it is rank 2 (``[4, 5)`` and one zero), and rank 3 holds padding only.
    """
    if world_size < 1 or numel < 1:
        raise ValueError(f"need numel >= 1 and world_size >= 1, got {numel}, {world_size}")
    q = -(-numel // world_size)
    lo = (numel // q) * q
    return (lo, numel) if lo < numel else None


def ds_param_groups(specs: Sequence) -> list[list]:
    """DeepSpeed's optimizer group order for one incoming group of params with ``use_muon`` flags.

    Returns ``[muon_half, adam_half]`` (empty halves dropped): the Muon half sorted by shape tuple,
    descending, stable; the Adam half in the given (model) order.
    """
    muon = [s for s in specs if getattr(s, "use_muon", False)]
    adam = [s for s in specs if not getattr(s, "use_muon", False)]
    muon = sorted(muon, key=lambda s: tuple(s.shape), reverse=True)
    return [g for g in (muon, adam) if g]


def _round_robin(params: list, world_size: int) -> list:
    classes: dict[int, list] = {}
    for i, p in enumerate(params):
        classes.setdefault(i % world_size, []).append(p)
    return [p for k in classes for p in classes[k]]


# --------------------------------------------------------------------------------------------------
# Layout objects
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """One parameter in its flat buffer.

    ZeRO-1/2: ``group`` is the param group, ``offset`` the flat start of the parameter in the group
    buffer, ``pad_after`` the ``parameter_alignment`` zeros following it.
    ZeRO-3: ``group`` is the sub-group, ``offset`` the start of this parameter's ``ds_tensor`` within
    every rank's sub-group partition, ``pad_after`` the ZeRO-3 padding ``W*q - n``.
    """
    name: str
    numel: int
    group: int
    offset: int
    pad_after: int


@dataclass(frozen=True)
class Zero12Layout:
    world_size: int
    placements: tuple[Placement, ...]
    group_numel: tuple[int, ...]       # padded flat size of each group (multiple of 2W)
    group_data_end: tuple[int, ...]    # end of the last parameter's data (group tail padding after it)
    partition_size: tuple[int, ...]    # P per group
    stage: str = "zero12"


@dataclass(frozen=True)
class Zero3Layout:
    world_size: int
    placements: tuple[Placement, ...]
    subgroup_partition_numel: tuple[int, ...]   # per sub-group: sum of q over its params
    stage: str = "zero3"


Layout = Union[Zero12Layout, Zero3Layout]


@dataclass(frozen=True)
class RankSlice:
    """The part ``[param_start, param_end)`` of a (flattened) parameter that ``rank`` holds, and where it
    begins in that rank's partition (ZeRO-1/2: of the group partition; ZeRO-3: of the sub-group
    partition, i.e. ``Placement.offset`` + the position inside the ``ds_tensor``)."""
    rank: int
    group: int
    param_start: int
    param_end: int
    partition_offset: int


@dataclass(frozen=True)
class Segment:
    """A run of one rank's partition: ``[start, end)`` in partition coordinates.

    ``kind``: ``"param"`` (elements ``param_start..`` of ``name``), ``"param_pad"`` (padding that follows
    parameter ``name``: ZeRO-1/2 ``parameter_alignment`` zeros, ZeRO-3 per-parameter padding) or
    ``"group_pad"`` (ZeRO-1/2 padding of the group to a multiple of ``2W``).
    """
    group: int
    start: int
    end: int
    kind: str
    name: Optional[str] = None
    param_start: Optional[int] = None


@dataclass(frozen=True)
class Location:
    rank: int
    region: str           # one of REGIONS
    group: int
    partition_offset: int  # position in the rank's partition of that group / sub-group


# --------------------------------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------------------------------

def _is_param_like(x) -> bool:
    return (hasattr(x, "name") and hasattr(x, "shape")) or (
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str))


def _normalise_groups(groups) -> list[list[LayoutParam]]:
    groups = list(groups)
    if groups and _is_param_like(groups[0]):
        groups = [groups]  # a single group given flat
    out = [[_as_layout_param(p) for p in g] for g in groups]
    names = [p.name for g in out for p in g]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    return out


def zero12_layout(groups, world_size: int, *, parameter_alignment: bool = False, element_size: int = 4,
                  round_robin: bool = False, nccl_start_alignment_factor: int = 2) -> Zero12Layout:
    """ZeRO-1/2 layout of ``groups`` (a list of groups, each a list of params in group order).

    A param is a ``ParamSpec``/``LayoutParam`` or a ``(name, shape_or_numel)`` pair; a flat list of
    params is taken as one group. ``element_size`` is the byte size of the model (bit16) dtype, which
    sets the ``parameter_alignment`` unit.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    placements: list[Placement] = []
    group_numel, data_end, part = [], [], []
    unit = 16 // math.gcd(16, element_size) if parameter_alignment else 1
    align = nccl_start_alignment_factor * world_size
    for gi, group in enumerate(_normalise_groups(groups)):
        params = _round_robin(group, world_size) if round_robin else list(group)
        offset = 0
        for j, p in enumerate(params):
            start = offset
            offset += p.numel
            pad = 0 if j == len(params) - 1 else (-offset) % unit
            offset += pad
            placements.append(Placement(p.name, p.numel, gi, start, pad))
        total = -(-offset // align) * align if offset else 0
        group_numel.append(total)
        data_end.append(offset)
        part.append(total // world_size)
    return Zero12Layout(world_size, tuple(placements), tuple(group_numel), tuple(data_end), tuple(part))


def zero3_layout(groups, world_size: int, *, sub_group_size: Optional[int] = None) -> Zero3Layout:
    """ZeRO-3 layout: per-parameter partitions, and their concatenation into sub-group partitions."""
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    placements: list[Placement] = []
    sub_numel: list[int] = []
    for group in _normalise_groups(groups):
        q_total = sum(-(-p.numel // world_size) for p in group)
        split = sub_group_size is not None and sub_group_size < q_total
        current, offset = len(sub_numel), 0
        sub_numel.append(0)
        for j, p in enumerate(group):
            q = -(-p.numel // world_size)
            placements.append(Placement(p.name, p.numel, current, offset, world_size * q - p.numel))
            offset += q
            sub_numel[current] = offset
            if split and offset >= sub_group_size and j != len(group) - 1:
                current, offset = len(sub_numel), 0
                sub_numel.append(0)
    return Zero3Layout(world_size, tuple(placements), tuple(sub_numel))


# --------------------------------------------------------------------------------------------------
# Queries
# --------------------------------------------------------------------------------------------------

def placement(layout: Layout, name: str) -> Placement:
    for p in layout.placements:
        if p.name == name:
            return p
    raise KeyError(name)


def _q(p: Placement, W: int) -> int:
    return -(-p.numel // W)


def param_slices(layout: Layout, name: str) -> list[RankSlice]:
    """Per rank, the slice of parameter ``name`` it holds (ranks holding none of it omitted)."""
    p = placement(layout, name)
    W = layout.world_size
    out = []
    if isinstance(layout, Zero12Layout):
        P = layout.partition_size[p.group]
        for r in range(W):
            lo, hi = max(p.offset, r * P), min(p.offset + p.numel, (r + 1) * P)
            if lo < hi:
                out.append(RankSlice(r, p.group, lo - p.offset, hi - p.offset, lo - r * P))
    else:
        q = _q(p, W)
        for r in range(W):
            lo, hi = r * q, min((r + 1) * q, p.numel)
            if lo < hi:
                out.append(RankSlice(r, p.group, lo, hi, p.offset))
    return out


def rank_segments(layout: Layout, rank: int) -> list[Segment]:
    """The full content of ``rank``'s partitions, as consecutive segments covering each of them."""
    W = layout.world_size
    segs: list[Segment] = []
    if isinstance(layout, Zero12Layout):
        for g, (total, P) in enumerate(zip(layout.group_numel, layout.partition_size)):
            lo, hi = rank * P, (rank + 1) * P
            pieces = []
            for p in (x for x in layout.placements if x.group == g):
                pieces.append((p.offset, p.offset + p.numel, "param", p.name, p.offset))
                if p.pad_after:
                    pieces.append((p.offset + p.numel, p.offset + p.numel + p.pad_after, "param_pad", p.name, None))
            if layout.group_data_end[g] < total:
                pieces.append((layout.group_data_end[g], total, "group_pad", None, None))
            for s, e, kind, name, base in pieces:
                a, b = max(s, lo), min(e, hi)
                if a < b:
                    segs.append(Segment(g, a - lo, b - lo, kind, name, (a - base) if base is not None else None))
    else:
        for p in layout.placements:
            q = _q(p, W)
            real = max(0, min(q, p.numel - rank * q))
            if real:
                segs.append(Segment(p.group, p.offset, p.offset + real, "param", p.name, rank * q))
            if real < q:
                segs.append(Segment(p.group, p.offset + real, p.offset + q, "param_pad", p.name, None))
    return segs


def partition_padding(layout: Layout) -> dict[int, list[Segment]]:
    """Per rank, the padding segments of its partitions (``param_pad`` and ``group_pad``)."""
    return {r: [s for s in rank_segments(layout, r) if s.kind != "param"] for r in range(layout.world_size)}


def _special_ranges(layout: Layout, p: Placement, window: int
                    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(boundary, padded_tail) candidate ranges of ``p``'s element indices (unclipped, unmerged)."""
    W = layout.world_size
    boundary, padded = [], []
    if isinstance(layout, Zero12Layout):
        P = layout.partition_size[p.group]
        base = p.offset
        for r in range(1, W):
            c = r * P
            boundary.append((c - window - base, c + window - base))
        for r in range(W):
            lo = r * P
            for sgm in rank_segments(layout, r):
                if sgm.kind == "param" or sgm.group != p.group:
                    continue
                a, b = lo + sgm.start, lo + sgm.end  # flat padding run, inside rank r's partition
                padded.append((max(a - window, lo) - base, a - base))            # just before it
                padded.append((b - base, min(b + window, lo + P) - base))        # just after it
    else:
        q = _q(p, W)
        for r in range(1, W):
            boundary.append((r * q - window, r * q + window))
        if W * q > p.numel:
            first_pad_rank_start = (p.numel // q) * q
            padded.append((max(p.numel - window, first_pad_rank_start), p.numel))
    return boundary, padded


def _in_any(i: int, ranges) -> bool:
    return any(a <= i < b for a, b in ranges)


def locate(layout: Layout, name: str, index: int, window: int = 1,
           ranges: dict[str, list[tuple[int, int]]] | None = None) -> Location:
    """Rank and region of element ``index`` (row-major flat index) of parameter ``name``.

    ``ranges``: :func:`region_ranges` of ``name`` (same ``window``) when the caller locates many
    elements; the regions are computed from every rank's segments, which costs O(world x params)."""
    p = placement(layout, name)
    if not 0 <= index < p.numel:
        raise IndexError(f"{name}: index {index} outside [0, {p.numel})")
    W = layout.world_size
    if isinstance(layout, Zero12Layout):
        P = layout.partition_size[p.group]
        f = p.offset + index
        rank = f // P
        off = f - rank * P
    else:
        q = _q(p, W)
        rank = index // q
        off = p.offset + (index - rank * q)
    ranges = ranges if ranges is not None else region_ranges(layout, name, window)
    region = next(r for r in ("boundary", "padded_tail", "interior") if _in_any(index, ranges[r]))
    return Location(rank, region, p.group, off)


def _merge(ranges, n: int) -> list[tuple[int, int]]:
    clipped = sorted((max(a, 0), min(b, n)) for a, b in ranges if min(b, n) > max(a, 0))
    out: list[tuple[int, int]] = []
    for a, b in clipped:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _subtract(ranges, minus) -> list[tuple[int, int]]:
    out = []
    for a, b in ranges:
        pieces = [(a, b)]
        for c, d in minus:
            pieces = [x for (s, e) in pieces for x in ((s, min(e, c)), (max(s, d), e)) if x[1] > x[0]]
        out.extend(pieces)
    return out


def region_ranges(layout: Layout, name: str, window: int = 1) -> dict[str, list[tuple[int, int]]]:
    """Element-index ranges ``[start, end)`` of ``name`` per region (cheap for any parameter size)."""
    p = placement(layout, name)
    boundary, padded = _special_ranges(layout, p, window)
    b = _merge(boundary, p.numel)
    t = _merge(_subtract(_merge(padded, p.numel), b), p.numel)
    interior = _subtract([(0, p.numel)], b + t)
    return {"interior": interior, "boundary": b, "padded_tail": t}


def locate_flat(layout: Layout, rank: int, group: int, offset: int) -> Segment:
    """What sits at ``offset`` of ``rank``'s partition of ``group`` (a one-element :class:`Segment`)."""
    for s in rank_segments(layout, rank):
        if s.group == group and s.start <= offset < s.end:
            ps = None if s.param_start is None else s.param_start + (offset - s.start)
            return Segment(group, offset, offset + 1, s.kind, s.name, ps)
    raise IndexError(f"rank {rank} group {group} has no offset {offset}")


def region_indices(layout: Layout, name: str, window: int = 1) -> dict[str, list[int]]:
    """All element indices of ``name`` grouped by region (small parameters; see :func:`region_ranges`)."""
    return {r: [i for a, b in rr for i in range(a, b)] for r, rr in region_ranges(layout, name, window).items()}
