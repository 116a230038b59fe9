"""Synthetic stored results shaped like the real ones (``harness.report.results.from_verdict``), built
without torch or DeepSpeed so the rendering tests are fast and exact: the layout, the element maps
and hence where the heatmap must draw everything are known here.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from harness.case.spec import ParamShape
from harness.report.results import CaseRecord, CheckRow, ResultStore
from harness.case.scenarios import TINY_PARAMS, pipeline_case
from harness.judge.verdict import reproduce_command

BIG = ParamShape("big.weight", (512, 1024))  # 524288 elements: the NVMe-sized matrix class


def _key(*parts) -> str:
    return f"{zlib.crc32(repr(parts).encode()):08x}{zlib.adler32(repr(parts).encode()):08x}"


def reproduce(case) -> str:
    return reproduce_command(case)


def zero_layout(params, world_size: int, stage: int) -> dict:
    """Per param: shape, rank slices, regions; ZeRO-3 slices each parameter (q = ceil(n/W), the
    tail padded), ZeRO-1/2 slice the flat concatenation of all parameters into W equal partitions."""
    out = {}
    W = world_size
    total = sum(p.numel for p in params)
    P = -(-total // W)
    offset = 0
    for p in params:
        n = p.numel
        if stage == 3:
            q = -(-n // W)
            ranks = [[r, r * q, min((r + 1) * q, n)] for r in range(W) if r * q < n]
            cuts = [r * q for r in range(1, W) if r * q < n]
            tail = [[n - 1, n]] if W * q > n else []
        else:
            ranks = []
            for r in range(W):
                lo, hi = max(offset, r * P), min(offset + n, (r + 1) * P)
                if lo < hi:
                    ranks.append([r, lo - offset, hi - offset])
            cuts = [a for _, a, _ in ranks if a > 0]
            tail = [[n - 1, n]] if offset + n == total and W * P > total else []
            offset += n
        boundary = [[max(c - 1, 0), min(c + 1, n)] for c in cuts]
        special = sorted(boundary + tail)
        interior, cur = [], 0
        for a, b in special:
            if a > cur:
                interior.append([cur, a])
            cur = max(cur, b)
        if cur < n:
            interior.append([cur, n])
        out[p.name] = {"shape": list(p.shape), "ranks": ranks,
                       "regions": {"interior": interior, "boundary": boundary, "padded_tail": tail}}
    return out


def _check(param, quantity, step, ratio_map, allowance, numel, rank=0, region="interior", counts=None):
    worst = float(np.max(ratio_map)) if np.size(ratio_map) else 0.0
    n_bad = int((np.asarray(ratio_map) > 1).sum())
    return CheckRow(param=param, quantity=quantity, step=step, rank=rank, region=region,
                    region_counts=counts or ({"interior": n_bad} if n_bad else {}),
                    record=_record(worst, worst * allowance, allowance, 0.5 + worst * allowance, 0.5, n_bad, numel))


def _record(ratio, error, bound, actual, expected, n_bad, numel) -> dict:
    """A stored ``oracles.Divergence`` (as ``harness.report.results`` keeps it)."""
    return dict(atol=0.0, rtol=bound / max(abs(expected), 1e-300), derivation="synthetic", bound=bound, ratio=ratio,
                index=[0], flat_index=0, abs_error=error, rel_error=error / max(abs(expected), 1e-300),
                rel_index=[0], actual=actual, expected=expected, n_bad=n_bad, numel=numel)


def failing(name_suffix: str = "", *, stage: int = 1, dtype: str = "fp16", world_size: int = 2, column: str = "stock",
            status: str = "xfailed", bug_ids=("DSM-001",), steps: int = 3, big: bool = False, pattern: str = "noise",
            seed: int = 0) -> tuple[CaseRecord, dict]:
    """A not-passing outcome with element maps. ``pattern``: "noise" (log-uniform ratios over the
    Muon matrices, like DSM-001) or "edges" (only the elements at the partition boundaries and the
    padded tail are wrong, like a slicing or padding bug)."""
    params = TINY_PARAMS + ((BIG,) if big else ())
    case = pipeline_case(stage, "none", dtype, world_size, steps=steps, params=params, seed=seed)
    case = case.replace(name=case.name + name_suffix, patched=(column == "patched"))
    layout = zero_layout(params, world_size, stage)
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    checks, maps = [], {}
    matrices = [p for p in params if len(p.shape) >= 2]
    for s in range(1, steps + 1):
        for p in matrices:
            for q, scale in (("momentum", 3e3), ("update", 8.0), ("master", 1e3)):
                if pattern == "edges":  # a slicing/padding bug: only the elements at ZeRO's cuts
                    m = rng.uniform(0, 0.5, p.numel)
                    regions = layout[p.name]["regions"]
                    for a, b in regions["padded_tail"] + regions["boundary"]:
                        m[a:b] = scale
                    if not (regions["padded_tail"] + regions["boundary"]):
                        m[-1] = scale
                else:
                    m = 10 ** rng.uniform(-2, np.log10(scale), p.numel)
                m = m.astype(np.float32)
                maps[f"{p.name}|{q}|{s}"] = m
                checks.append(_check(p.name, q, s, m, 1e-6 * scale, p.numel))
    for q in ("grad", "model"):
        checks.append(_check("layer0.bias", q, steps, np.array([0.3]), 1e-3, 6))
    checks.append(CheckRow("<step>", "global_norm", steps, None, None, {},
                           _record(0.9, 5e-3, 5.6e-3, 3.85, 3.84, 0, 1)))
    worst = max(c.worst_ratio for c in checks)
    first = min((c for c in checks if c.n_bad), key=lambda c: (c.step, -c.worst_ratio))
    cmd = reproduce(case)
    n_bad = sum(1 for c in checks if c.n_bad)
    msg = (f"{case.name} [emulated]: {n_bad} of {len(checks) + 20} checks out of tolerance\n"
           f"{case.name}: {first.param} {first.quantity} diverged at step {first.step} "
           "(element 8, rank 1 partition, interior)\n"
           f"  actual {first.actual:.9g}, oracle {first.expected:.9g}: error {first.error:.3g} > allowed "
           f"{first.allowance:.3g} ({first.worst_ratio:.3g}x)\n  reproduce: {cmd}")
    rec = CaseRecord(key=_key(case.to_json(), column), case_name=case.name, column=column,
                     status=status, bug_ids=list(bug_ids), mode="emulated", message=msg, reproduce=cmd,
                     case_json=case.to_json(), seconds=0.3, worst_ratio=worst, checks=checks, layout=layout)
    return rec, maps


def passing(name_suffix: str = "", *, stage: int = 1, dtype: str = "fp32", world_size: int = 2, column: str = "stock",
            ratio: float = 0.3, status: str = "passed", name: str | None = None) -> tuple[CaseRecord, dict]:
    case = pipeline_case(stage, "none", dtype, world_size, steps=3)
    case = case.replace(name=name or case.name + name_suffix, patched=(column == "patched"))
    checks = [_check("layer0.weight", q, 2, np.array([ratio * f]), 1e-6, 30) for q, f in
              (("momentum", 1.0), ("update", 0.5), ("master", 0.2))]
    rec = CaseRecord(key=_key(case.to_json(), column), case_name=case.name, column=column,
                     status=status, bug_ids=[], mode="emulated",
                     message=f"{case.name}: all {len(checks)} checks within tolerance (worst {ratio:.3g}x)",
                     reproduce=reproduce(case), case_json=case.to_json(), seconds=0.2, worst_ratio=ratio, checks=checks)
    return rec, {}


def error(name_suffix: str = "", *, column: str = "stock") -> tuple[CaseRecord, dict]:
    case = pipeline_case(2, "cpu", "bf16", 2, steps=3)
    case = case.replace(name=case.name + name_suffix)
    rec = CaseRecord(key=_key(case.to_json(), column, "err"), case_name=case.name,
                     column=column, status="error", bug_ids=[], mode="-",
                     message=f"case {case.name!r}: rank 1 raised\nTraceback (most recent call last):\n  ...\n"
                             "RuntimeError: <boom> & friends",
                     reproduce=reproduce(case), case_json=case.to_json(), seconds=1.0, worst_ratio=float("inf"))
    return rec, {}


def write(root: Path, items, writer: str = "main") -> ResultStore:
    store = ResultStore(root, writer=writer)
    for rec, maps in items:
        store.add(rec, maps)
    return store


BUG_MIX = ("DSM-001", "DSM-001", "DSM-001", "DSM-003", "DSM-005", "DSM-009", "DSM-004", "DSM-006")


def gate_sized(root: Path, *, n_cases: int = 75, n_failing: int = 40, big_every: int = 10, n_failed: int = 0) -> None:
    """A gate-sized result set: ``n_cases`` cases x (stock, patched) = 150 outcomes, ``n_failing``
    of the stock ones not passing (every ``big_every``-th with the 0.5 M-element matrix; strict
    xfails of the bugs in ``BUG_MIX``, DSM-001 the most common as on a real gate, and the first
    ``n_failed`` unexpected failures), the patched ones passing; two writers, as under pytest-xdist."""
    stock_items, patched_items = [], []
    for i in range(n_cases):
        stage, dtype, ws = (1, 2, 3)[i % 3], ("fp16", "bf16", "fp32")[(i // 3) % 3], (1, 2, 4)[(i // 9) % 3]
        suffix = f"-v{i}"
        if i < n_failing:
            bad = dict(status="failed", bug_ids=()) if i < n_failed else dict(bug_ids=(BUG_MIX[i % len(BUG_MIX)],))
            stock_items.append(failing(suffix, stage=stage, dtype="bf16" if dtype == "fp32" else dtype,
                                       world_size=max(ws, 2), big=bool(big_every) and i % big_every == big_every - 1,
                                       pattern="edges" if i % 7 == 3 else "noise", **bad))
        else:
            stock_items.append(passing(suffix, stage=stage, dtype=dtype, world_size=ws, ratio=0.05 + (i % 9) / 10))
        patched_items.append(passing(suffix, stage=stage, dtype=dtype, world_size=ws, column="patched",
                                     ratio=0.02 + (i % 5) / 10, name=stock_items[-1][0].case_name))
    write(root, stock_items, writer="gw0")
    write(root, patched_items, writer="gw1")


def dump(rec: CaseRecord) -> dict:
    return json.loads(rec.case_json)
