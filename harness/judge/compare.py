"""Element-wise comparison of a captured quantity against the oracle, in the spirit of
``torch.testing.assert_close``: the message says which tensor, which step, which element, in
which rank's partition and which region (interior, partition boundary, padded tail), how far off it
was, what was allowed, and how to rerun exactly this case.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from oracles.tolerance import Allowance, Divergence, compare, ratio_text

class LayoutView:
    """What the comparison needs to know about ZeRO's flat layout: who owns an element, and the
    element ranges of each region of a parameter (so bad elements are counted per region in one
    vectorised pass, whatever the parameter's size)."""

    def locate(self, name: str, index: int) -> tuple[int, str]:  # pragma: no cover - interface
        raise NotImplementedError

    def ranges(self, name: str) -> dict[str, list[tuple[int, int]]]:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass
class Check:
    """One quantity of one parameter at one step, compared: where (case, parameter, quantity, step,
    rank partition, region) around the one divergence record ``oracles.Divergence`` (what). The
    ``worst_*`` names read that record; nothing is copied out of it."""

    case: str
    param: str
    quantity: str
    step: int
    record: Divergence | None  # None only when there was nothing to compare (``problem``)
    rank: int | None = None
    region: str | None = None
    region_counts: dict[str, int] = field(default_factory=dict)  # bad elements per region
    error_map: np.ndarray | None = None  # |err|/allowance per element (kept for the report)
    problem: str | None = None  # a check that had no data to compare (see ``missing``): always a failure
    # a captured quantity with no finite reference to compare it against (see ``cannot_judge``): never a
    # pass, and not a divergence either
    unjudged: str | None = None

    @property
    def passed(self) -> bool:
        return self.problem is None and self.record is not None and self.record.ok

    @property
    def worst_ratio(self) -> float:
        return self.record.ratio if self.record is not None else float("inf")

    @property
    def worst_index(self) -> int:
        return self.record.flat_index if self.record is not None else 0

    @property
    def worst_error(self) -> float:
        return self.record.abs_error if self.record is not None else float("nan")

    @property
    def worst_allowance(self) -> float:
        return self.record.bound if self.record is not None else 0.0

    @property
    def actual(self) -> float:
        return self.record.actual if self.record is not None else float("nan")

    @property
    def expected(self) -> float:
        return self.record.expected if self.record is not None else float("nan")

    @property
    def n_bad(self) -> int:
        return self.record.n_bad if self.record is not None else 1

    @property
    def numel(self) -> int:
        return self.record.numel if self.record is not None else 0


def compare_arrays(case: str, param: str, quantity: str, step: int, actual, expected, allowance: Allowance,
                   layout: LayoutView | None = None, keep_map: bool = True) -> Check:
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.size != e.size:
        raise ValueError(f"{case}: {param}.{quantity} step {step}: shape {a.shape} vs oracle {e.shape}")
    if a.shape != e.shape:
        a = a.reshape(e.shape)
    rec, ratio = compare(a, e, allowance, keep_map=True)
    rank = region = None
    counts: dict[str, int] = {}
    if layout is not None and rec.numel:
        rank, region = layout.locate(param, rec.flat_index)
        if rec.n_bad:
            bad = ratio.reshape(-1) > 1.0
            csum = np.concatenate([[0], np.cumsum(bad)])
            for reg, spans in layout.ranges(param).items():
                n = int(sum(csum[hi] - csum[lo] for lo, hi in spans))
                if n:
                    counts[reg] = n
    return Check(case=case, param=param, quantity=quantity, step=step, record=rec, rank=rank, region=region,
                 region_counts=counts, error_map=ratio.reshape(-1) if keep_map and ratio is not None else None)


def missing(case: str, param: str, quantity: str, step: int, why: str) -> Check:
    """A check that could not be made (a quantity not captured, ranks that disagreed): a failure with
    its own message, never a skipped comparison."""
    return Check(case=case, param=param, quantity=quantity, step=step, record=None, problem=why)


def cannot_judge(case: str, param: str, quantity: str, step: int, why: str) -> Check:
    """A quantity DeepSpeed did produce but the oracle has no finite reference for: neither a pass (the
    verdict would then cover less than was captured) nor a divergence (nothing says DeepSpeed is wrong),
    so it has a verdict of its own, "cannot judge", with ``why`` naming the step, tensor and cause."""
    return Check(case=case, param=param, quantity=quantity, step=step, record=None, unjudged=why)


def first_divergence(checks: list[Check]) -> Check | None:
    """The earliest failing check: later ones are usually consequences of it."""
    failing = [c for c in checks if not c.passed and c.unjudged is None]
    if not failing:
        return None
    return min(failing, key=lambda c: (c.step, -c.worst_ratio))


def describe(check: Check, reproduce: str, first: Check | None = None) -> str:
    if check.unjudged is not None:
        return f"{check.case}: cannot judge: {check.unjudged}\n  reproduce: {reproduce}"
    if check.problem is not None:
        return (f"{check.case}: {check.param} {check.quantity} at step {check.step}: no data to check: "
                f"{check.problem}\n  reproduce: {reproduce}")
    where = ""
    if check.rank is not None:
        where = f", rank {check.rank} partition, {check.region}"
    rec = check.record
    lines = [
        f"{check.case}: {check.param} {check.quantity} diverged at step {check.step} "
        f"(element {rec.index}, flat {rec.flat_index}{where})",
        f"  actual {rec.actual:.9g}, oracle {rec.expected:.9g}: error {rec.abs_error:.3g} "
        f"> allowed {rec.bound:.3g} ({ratio_text(rec.ratio)}x); greatest relative difference {rec.rel_error:.3g} "
        f"at {rec.rel_index}",
        f"  {rec.n_bad} of {rec.numel} elements out of tolerance ({100.0 * rec.share_bad:.1f}%)"
        + (f"; by region: {check.region_counts}" if check.region_counts else ""),
        f"  allowance: {rec.derivation}",
    ]
    if first is not None and (first.step, first.param, first.quantity) != (check.step, check.param, check.quantity):
        lines.append(f"  first divergence: {first.param} {first.quantity} at step {first.step}")
    lines.append(f"  reproduce: {reproduce}")
    return "\n".join(lines)
