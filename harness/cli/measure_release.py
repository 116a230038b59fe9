"""Measure which registered bugs one DeepSpeed release shows, on a slice that is the same for every
release (``python -m harness.cli.measure_release --slice base-ws2``).

Why a module and not a gate ``--only``: the comparison across releases needs exactly the same cases on
each, and the base grid at world size 2 has no common name substring. Every registered bug is a
candidate excuse (``MUON_HARNESS_MEASURE=1``, ``harness.registry.bugs.excuses``): xfailed with an id says the
bug showed as its model predicts, xpassed that it was expected and absent, failed/error a divergence no
bug explains (a new finding). One line per case, then the counts and the ids seen; ``--json`` writes the
outcomes for the README's version table (each registry entry's ``releases`` is filled from them by hand, with care).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
import itertools
from harness.env import buildenv, versions


def slice_cases(name: str) -> list:
    """``base-ws2``: the gate's 18 base-grid cases at world size 2 (ZeRO-1/2/3 x no offload / cpu offload x
    fp32/fp16/bf16, with the gate's knobs: grad accumulation, clipping, gram/standard Newton-Schulz), each
    without its per-head matrix (per-head Muon exists only from 0.19.8: with it, half the slice would be
    deselected on every older release). Gram cases are deselected before 0.19.0. ``gate``: the CI gate's
    cases (to re-measure a whole-gate run's failures by name, ``--names``)."""

    from harness.catalog import matrix  # late: keeps this module torch-free at import

    if name == "base-ws2":
        grid = list(itertools.product(matrix.STAGES, ("none", "cpu"), matrix.DTYPES, matrix.WORLD_SIZES))
        return [matrix._case(st, off, dt, ws, **dict(matrix._knobs(i), heads=False))
                for i, (st, off, dt, ws) in enumerate(grid) if ws == 2]
    if name == "gate":
        return list(matrix.gate_cases(False))
    raise SystemExit(f"--slice {name}: unknown (base-ws2, gate)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slice", default="base-ws2")
    ap.add_argument("--json", default=None, help="write the outcomes here")
    ap.add_argument("--only", default=None, help="substring filter on the slice's case names (a re-check)")
    ap.add_argument("--names", default=None, help="a file of exact case names, one a line (e.g. a gate run's "
                    "failures and errors)")
    ap.add_argument("--exclude-absent", action="store_true",
                    help="bugs measured absent on this release (their registry entry's releases: False) are no "
                         "candidates: an "
                    "unmodelled bug cannot then excuse a divergence its release was measured not to have")
    args = ap.parse_args(argv)
    os.environ["MUON_HARNESS_MEASURE"] = "1"

    buildenv.apply_base_env()
    from harness.gate.decide import evaluate  # late: keeps this module numpy-free at import
    from harness.launch.pool import PoolManager  # late: keeps this module torch-free at import
    from harness.registry import bugs as registered_bugs  # late: keeps this module torch-free at import

    # bugs set aside by hand (MUON_HARNESS_MEASURE_EXCLUDE as given), plus, with --exclude-absent, the measured-absent
    base_exclude = [b for b in os.environ.get("MUON_HARNESS_MEASURE_EXCLUDE", "").split(",") if b]
    if args.exclude_absent:
        rel = versions.judged_as()
        base_exclude = sorted(set(base_exclude) | {b for b, row in registered_bugs.AFFECTED.items()
                                                   if rel and row.get(rel) is False})
    os.environ["MUON_HARNESS_MEASURE_EXCLUDE"] = ",".join(base_exclude)
    print(f"measure: {versions.banner()}" + (f"; not candidates (measured absent): {base_exclude}"
                                             if base_exclude else ""), flush=True)
    wanted = set(Path(args.names).read_text().split()) if args.names else None
    cases = [c for c in slice_cases(args.slice) if (not args.only or args.only in c.name)
             and (wanted is None or c.name in wanted)]
    if wanted is not None and len(cases) != len(wanted):
        missing = sorted(wanted - {c.name for c in cases})
        raise SystemExit(f"--names: not in slice {args.slice}: {missing}")
    manager = PoolManager()
    rows = []
    t0 = time.perf_counter()
    try:
        for c in cases:
            o = evaluate(c, "stock", manager)
            absent = []
            if o.message.startswith(f"{c.name}: expected the crash of "):
                # a candidate crash bug that did not crash is absent here; judge the case again without it
                from harness.registry.bugs import BUGS, HISTORICAL

                absent = [b.id for b in BUGS + HISTORICAL if b.id in o.bug_ids and b.crash is not None]
                os.environ["MUON_HARNESS_MEASURE_EXCLUDE"] = ",".join(base_exclude + absent)
                try:
                    o = evaluate(c, "stock", manager)
                finally:
                    os.environ["MUON_HARNESS_MEASURE_EXCLUDE"] = ",".join(base_exclude)
            head = o.message.strip().splitlines()[0][:200] if o.message.strip() else ""
            note = f" (crash absent: {','.join(absent)})" if absent else ""
            ids = ",".join(o.bug_ids) or "-"
            print(f"{o.status:9s} {ids:24s} {o.seconds:6.1f}s {c.name}{note}  {head}", flush=True)
            rows.append({"case": c.name, "status": o.status, "bug_ids": o.bug_ids, "crash_absent": absent,
                         "seconds": round(o.seconds, 1), "message": o.message[:4000]})
    finally:
        manager.close()
    counts = Counter(r["status"] for r in rows)
    shown = sorted({b for r in rows if r["status"] == "xfailed" for b in r["bug_ids"]})
    absent = sorted({b for r in rows if r["status"] == "xpassed" for b in r["bug_ids"]}
                    | {b for r in rows for b in r["crash_absent"]})
    print(f"measure: DeepSpeed {versions.installed().label}, slice {args.slice}: {len(rows)} cases in "
          f"{time.perf_counter() - t0:.0f}s: {dict(counts)}; shown {shown}; expected and absent {absent}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"release": versions.installed().version, "slice": args.slice,
                                               "outcomes": rows}, indent=1))
    return 0 if not (counts["failed"] or counts["error"]) else 1


if __name__ == "__main__":
    sys.exit(main())
