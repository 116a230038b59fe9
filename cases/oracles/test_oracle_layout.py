"""ZeRO layout round trips: every element of every parameter located exactly once, padding counted,
regions consistent -- for W = 1..4 and odd/prime sizes (Hypothesis). The layout rules themselves are
cross-checked against DeepSpeed's own ``get_partition_info`` and ``_padding_size`` in
``test_oracle_vs_deepspeed.py``.
"""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import (ParamSpec, ds_param_groups, locate, locate_flat, param_slices, partition_padding, rank_segments,
                     region_indices, region_ranges, zero3_layout, zero12_layout)
from oracles.layout import Zero12Layout

numels = st.lists(st.integers(1, 41), min_size=1, max_size=5)


def _groups(sizes_per_group):
    k = 0
    groups = []
    for sizes in sizes_per_group:
        g = []
        for n in sizes:
            g.append((f"p{k}", n))
            k += 1
        groups.append(g)
    return groups


def _region_by_definition(lay, name, i, window):
    """The region of element ``i`` from the partition geometry, element by element (what ``locate``'s
    ranges must agree with): within ``window`` of a partition boundary, else within ``window`` of a
    padding run inside the same partition (ZeRO-1/2) or of the parameter's padded end (ZeRO-3)."""
    p = next(x for x in lay.placements if x.name == name)
    W = lay.world_size
    if isinstance(lay, Zero12Layout):
        P = lay.partition_size[p.group]
        f = p.offset + i
        if any(c - window <= f < c + window for c in (r * P for r in range(1, W))):
            return "boundary"
        for r in range(W):
            for s in rank_segments(lay, r):
                if s.kind != "param" and s.group == p.group:
                    a, b = r * P + s.start, r * P + s.end
                    if max(a - window, r * P) <= f < a or b <= f < min(b + window, (r + 1) * P):
                        return "padded_tail"
        return "interior"
    q = -(-p.numel // W)
    if any(c - window <= i < c + window for c in (r * q for r in range(1, W))):
        return "boundary"
    if W * q > p.numel and i >= max(p.numel - window, (p.numel // q) * q):
        return "padded_tail"
    return "interior"


def _check_round_trip(lay, groups, W, window):
    seen = {}
    for r in range(W):
        segs = rank_segments(lay, r)
        for s in segs:
            if s.kind == "param":
                for i in range(s.end - s.start):
                    key = (s.name, s.param_start + i)
                    assert key not in seen, key
                    seen[key] = (r, s.group, s.start + i)
    for g in groups:
        for name, n in g:
            for i in range(n):
                assert (name, i) in seen, (name, i)
                loc = locate(lay, name, i, window)
                assert (loc.rank, loc.group, loc.partition_offset) == seen[(name, i)]
                hit = locate_flat(lay, loc.rank, loc.group, loc.partition_offset)
                assert hit.kind == "param" and hit.name == name and hit.param_start == i
            # the range form of the regions agrees with locate() element by element, and covers once
            regions = region_indices(lay, name, window)
            assert sorted(i for idx in regions.values() for i in idx) == list(range(n))
            for region, idx in regions.items():
                assert all(locate(lay, name, i, window).region == region for i in idx)
                assert all(_region_by_definition(lay, name, i, window) == region for i in idx)
            # param_slices agree with the segments and tile the parameter in rank order
            sl = param_slices(lay, name)
            assert sl[0].param_start == 0 and sl[-1].param_end == n
            assert all(a.param_end == b.param_start for a, b in zip(sl, sl[1:]))
    assert len(seen) == sum(n for g in groups for _, n in g)


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(numels, min_size=1, max_size=2), W=st.integers(1, 4), align=st.booleans(),
       esize=st.sampled_from([2, 4]), rr=st.booleans(), window=st.integers(1, 2))
def test_zero12_round_trip_and_padding(sizes, W, align, esize, rr, window):
    groups = _groups(sizes)
    lay = zero12_layout(groups, W, parameter_alignment=align, element_size=esize, round_robin=rr)
    _check_round_trip(lay, groups, W, window)
    unit = 16 // math.gcd(16, esize) if align else 1
    for gi, g in enumerate(groups):
        total, P = lay.group_numel[gi], lay.partition_size[gi]
        assert total % (2 * W) == 0 and P * W == total
        pl = [p for p in lay.placements if p.group == gi]
        # parameter_alignment: every parameter but the last is followed up to a multiple of the unit
        for p in pl[:-1]:
            assert (p.offset + p.numel + p.pad_after) % unit == 0 and p.pad_after < unit
        assert pl[-1].pad_after == 0
        data = sum(p.numel + p.pad_after for p in pl)
        assert total == -(-data // (2 * W)) * 2 * W  # the smallest multiple of 2W that holds it
        # padding per rank adds up to everything that is not a parameter element
        pads = sum(s.end - s.start for r in range(W) for s in partition_padding(lay)[r] if s.group == gi)
        assert pads == total - sum(n for _, n in g)
        # each rank's segments tile [0, P)
        for r in range(W):
            segs = sorted((s for s in rank_segments(lay, r) if s.group == gi), key=lambda s: s.start)
            assert segs[0].start == 0 and segs[-1].end == P
            assert all(a.end == b.start for a, b in zip(segs, segs[1:]))


@settings(max_examples=80, deadline=None)
@given(sizes=numels, W=st.integers(1, 4), sub=st.one_of(st.none(), st.integers(1, 30)), window=st.integers(1, 2))
def test_zero3_round_trip_and_padding(sizes, W, sub, window):
    groups = _groups([sizes])
    lay = zero3_layout(groups, W, sub_group_size=sub)
    _check_round_trip(lay, groups, W, window)
    for p in lay.placements:
        q = -(-p.numel // W)
        assert p.pad_after == W * q - p.numel and 0 <= p.pad_after < W
        for s in param_slices(lay, p.name):
            assert (s.param_start, s.param_end) == (s.rank * q, min((s.rank + 1) * q, p.numel))
    # sub-groups: each closes once its partition numel reaches sub_group_size (or at the end)
    per_sub = {}
    for p in lay.placements:
        per_sub.setdefault(p.group, []).append(-(-p.numel // W))
    subs = [per_sub[k] for k in sorted(per_sub)]
    if sub is not None and sub < sum(map(sum, subs)):
        for qs in subs[:-1]:
            assert sum(qs) >= sub and sum(qs[:-1]) < sub
    else:
        assert len(subs) == 1
    for k, qs in enumerate(subs):
        assert lay.subgroup_partition_numel[k] == sum(qs)


def test_regions_near_cuts_and_padding():
    # one group, W=2: sizes 5 and 6 -> 11 elements padded to 12, P=6, cut at flat 6
    lay = zero12_layout([[("a", 5), ("b", 6)]], 2)
    reg_b = region_indices(lay, "b", window=1)
    # b occupies flat 5..10: flat 5 and 6 sit at the cut (b[0], b[1]); b[5] (flat 10) precedes padding
    assert reg_b["boundary"] == [0, 1] and reg_b["padded_tail"] == [5]
    assert region_indices(lay, "a", window=1)["boundary"] == []
    # ZeRO-3: n=7, W=3 -> q=3, cuts at 3 and 6, padding 2 after element 6 (on rank 2)
    lay3 = zero3_layout([("w", 7)], 3)
    r = region_indices(lay3, "w", window=1)
    assert r["boundary"] == [2, 3, 5, 6] and r["padded_tail"] == [] and r["interior"] == [0, 1, 4]
    assert locate(lay3, "w", 6).rank == 2


def test_region_ranges_scale_to_large_parameters():
    lay = zero12_layout([[("big", (4096, 4096)), ("bias", 4096)]], 4, parameter_alignment=True, element_size=2)
    rr = region_ranges(lay, "big", window=2)
    assert sum(b - a for r in rr.values() for a, b in r) == 4096 * 4096
    assert len(rr["boundary"]) == 3  # 3 cuts inside, each a 4-element window
    assert all(b - a == 4 for a, b in rr["boundary"])


def test_ds_param_groups_order():
    specs = [ParamSpec("emb", (10, 4), False), ParamSpec("a", (4, 8), True), ParamSpec("b", (8, 4), True),
             ParamSpec("bias", (4,), False), ParamSpec("c", (4, 8), True), ParamSpec("d", (4, 8, 2), True)]
    muon, adam = ds_param_groups(specs)
    # shape tuples descending: (8,4) > (4,8,2) > (4,8) == (4,8) (ties keep model order: a before c)
    assert [s.name for s in muon] == ["b", "d", "a", "c"]
    assert [s.name for s in adam] == ["emb", "bias"]
