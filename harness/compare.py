"""Element-wise comparison of a captured quantity against the oracle, in the spirit of
``torch.testing.assert_close``: the message says which tensor, which step, which element, in
which rank's partition and which region (interior, partition boundary, padded tail), how far off it
was, what was allowed, and how to rerun exactly this case.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

class LayoutView:
    """What the comparison needs to know about ZeRO's flat layout: who owns an element, and the
    element ranges of each region of a parameter (so bad elements are counted per region in one
    vectorised pass, whatever the parameter's size)."""

    def locate(self, name: str, index: int) -> tuple[int, str]:  # pragma: no cover - interface
        raise NotImplementedError

    def ranges(self, name: str) -> dict[str, list[tuple[int, int]]]:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class Allowed:
    """Normwise max-norm allowance, the same metric as ``oracles.tolerance.Allowance``: a tensor
    passes when max|actual - expected| <= min(atol + rtol * max|expected|, cap). Errors are bounds on
    whole-tensor perturbations, so an entry that is small through cancellation is judged against the
    tensor's scale, not its own."""

    atol: float
    rtol: float
    why: str = ""
    cap: float = float("inf")

    @classmethod
    def of(cls, allowance) -> "Allowed":
        return cls(allowance.atol, allowance.rtol, getattr(allowance, "derivation", ""),
                   getattr(allowance, "cap", float("inf")))

    def bound(self, expected: np.ndarray) -> float:
        finite = expected[np.isfinite(expected)]
        scale = float(np.abs(finite).max()) if finite.size else 0.0
        return min(self.atol + self.rtol * scale, self.cap)


@dataclass
class Check:
    """One quantity of one parameter at one step, compared."""

    case: str
    param: str
    quantity: str
    step: int
    worst_ratio: float  # max over elements of |actual - expected| / allowance; <= 1 passes
    worst_index: int  # flat index of that element
    worst_error: float
    worst_allowance: float
    actual: float
    expected: float
    n_bad: int
    numel: int
    rank: int | None = None
    region: str | None = None
    region_counts: dict[str, int] = field(default_factory=dict)  # bad elements per region
    error_map: np.ndarray | None = None  # |err|/allowance per element (kept for the report)
    problem: str | None = None  # a check that had no data to compare (see ``missing``): always a failure

    @property
    def passed(self) -> bool:
        return self.n_bad == 0 and self.problem is None


def compare_arrays(case: str, param: str, quantity: str, step: int, actual, expected, allowed: Allowed,
                   layout: LayoutView | None = None, keep_map: bool = True) -> Check:
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    e = np.asarray(expected, dtype=np.float64).reshape(-1)
    if a.shape != e.shape:
        raise ValueError(f"{case}: {param}.{quantity} step {step}: shape {a.shape} vs oracle {e.shape}")
    bound = np.full(e.shape, allowed.bound(e))
    err = np.abs(a - e)
    # A non-finite value where the oracle is finite (or vice versa) is infinitely wrong.
    both_nonfinite_equal = ~np.isfinite(a) & ~np.isfinite(e) & (np.isnan(a) == np.isnan(e)) & (
        np.nan_to_num(a) == np.nan_to_num(e))
    err = np.where(both_nonfinite_equal, 0.0, err)
    err = np.where(np.isnan(err), np.inf, err)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(bound > 0, err / bound, np.where(err > 0, np.inf, 0.0))
    bad = ratio > 1.0
    worst = int(np.argmax(ratio)) if ratio.size else 0
    rank = region = None
    counts: dict[str, int] = {}
    if layout is not None and ratio.size:
        rank, region = layout.locate(param, worst)
        if bad.any():
            csum = np.concatenate([[0], np.cumsum(bad)])
            for reg, spans in layout.ranges(param).items():
                n = int(sum(csum[b] - csum[a] for a, b in spans))
                if n:
                    counts[reg] = n
    return Check(case=case, param=param, quantity=quantity, step=step,
                 worst_ratio=float(ratio[worst]) if ratio.size else 0.0, worst_index=worst,
                 worst_error=float(err[worst]) if ratio.size else 0.0,
                 worst_allowance=float(bound[worst]) if ratio.size else 0.0,
                 actual=float(a[worst]) if ratio.size else 0.0, expected=float(e[worst]) if ratio.size else 0.0,
                 n_bad=int(bad.sum()), numel=int(a.size), rank=rank, region=region, region_counts=counts,
                 error_map=ratio.astype(np.float32) if keep_map else None)


def missing(case: str, param: str, quantity: str, step: int, why: str) -> Check:
    """A check that could not be made (a quantity not captured, ranks that disagreed): a failure with
    its own message, never a skipped comparison."""
    return Check(case=case, param=param, quantity=quantity, step=step, worst_ratio=float("inf"), worst_index=0,
                 worst_error=float("nan"), worst_allowance=0.0, actual=float("nan"), expected=float("nan"),
                 n_bad=1, numel=0, problem=why)


def compare_scalar(case: str, name: str, step: int, actual: float, expected: float, allowed: Allowed) -> Check:
    return compare_arrays(case, "<step>", name, step, [actual], [expected], allowed, keep_map=False)


def first_divergence(checks: list[Check]) -> Check | None:
    """The earliest failing check: later ones are usually consequences of it."""
    failing = [c for c in checks if not c.passed]
    if not failing:
        return None
    return min(failing, key=lambda c: (c.step, -c.worst_ratio))


def describe(check: Check, reproduce: str, first: Check | None = None) -> str:
    if check.problem is not None:
        return (f"{check.case}: {check.param} {check.quantity} at step {check.step}: no data to check: "
                f"{check.problem}\n  reproduce: {reproduce}")
    where = ""
    if check.rank is not None:
        where = f", rank {check.rank} partition, {check.region}"
    lines = [
        f"{check.case}: {check.param} {check.quantity} diverged at step {check.step} "
        f"(element {check.worst_index}{where})",
        f"  actual {check.actual:.9g}, oracle {check.expected:.9g}: error {check.worst_error:.3g} "
        f"> allowed {check.worst_allowance:.3g} ({check.worst_ratio:.3g}x)",
        f"  {check.n_bad} of {check.numel} elements out of tolerance"
        + (f"; by region: {check.region_counts}" if check.region_counts else ""),
    ]
    if first is not None and (first.step, first.param, first.quantity) != (check.step, check.param, check.quantity):
        lines.append(f"  first divergence: {first.param} {first.quantity} at step {first.step}")
    lines.append(f"  reproduce: {reproduce}")
    return "\n".join(lines)
