"""Two results folders, case-column by case-column: did anything change status or bug ids?

A restructuring of the harness, a change of case order, or one column run alone must leave every
verdict as it was; this is the check. A case-column present in one folder and missing from the other
is a difference too (a gate that silently ran fewer cases is not "unchanged").

    python -m harness.report.statuses reports/gate-results /tmp/before/gate-results
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.report.results import load_records


@dataclass(frozen=True)
class Outcome:
    status: str
    bug_ids: tuple[str, ...]
    strength: str | None  # how an xfail was excused (full / excused / crash / refusal): a change is a difference

    def __str__(self) -> str:
        bugs = f" [{', '.join(self.bug_ids)}]" if self.bug_ids else ""
        return self.status + bugs + (f" ({self.strength})" if self.strength else "")


def outcomes(root: Path) -> dict[tuple[str, str], Outcome]:
    """(case name, column) -> outcome, for every record under ``root``."""
    recs = load_records(root)
    if not recs:
        raise FileNotFoundError(f"{root}: no results-*.jsonl records (is this a gate's results folder?)")
    return {(r.case_name, r.column): Outcome(r.status, tuple(sorted(r.bug_ids)), r.strength) for r in recs}


def differences(a: dict, b: dict, *, common: bool = False) -> list[str]:
    """One line per case-column whose outcome differs, or (unless ``common``) that only one side has."""
    out = []
    for key in sorted(set(a) & set(b) if common else set(a) | set(b)):
        left, right = a.get(key), b.get(key)
        if left != right:
            out.append(f"{key[0]} [{key[1]}]: {left or 'missing'} -> {right or 'missing'}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report.statuses", description=__doc__.splitlines()[0],
                                 epilog="exit codes: 0 same outcomes, 1 some differ, 2 a folder has no results")
    ap.add_argument("a", type=Path, help="a results folder (the gate prints its path as 'results: ...')")
    ap.add_argument("b", type=Path, help="the results folder to compare it with")
    ap.add_argument("--common", action="store_true",
                    help="compare only the case-columns both folders hold (a gate against a test run of a subset); "
                         "how many each side holds alone is still printed")
    args = ap.parse_args(argv)
    try:
        a, b = outcomes(args.a), outcomes(args.b)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    diff = differences(a, b, common=args.common)
    for line in diff:
        print(line)
    both = len(set(a) & set(b))
    print(f"{len(a)} and {len(b)} case-columns, {both} in both ({len(a) - both} only in the first, "
          f"{len(b) - both} only in the second); {len(diff)} differ" + (" among those in both" if args.common else ""))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
