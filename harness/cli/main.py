"""``python -m harness``: parse with the one argparse tree (``harness.cli.parser``), run one subcommand.

Each handler imports the module that does the work when it runs, not at the top: those modules
reach torch and DeepSpeed (seconds to import), and ``--help`` must answer without them.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.cli.parser import parse_args
from harness.env import buildenv
from harness.launch import lifecycle


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _gate(args: argparse.Namespace) -> int:
    from harness.cli.main_job import GateInputError, run_gate  # late: torch and DeepSpeed (see the module doc)
    from harness.launch.shard import Shard

    if args.shard:
        try:
            Shard.parse(args.shard)
        except ValueError as exc:
            return _error(str(exc))
    if args.jobs < 1 or (args.jobs > 1 and args.shard):
        return _error(f"--jobs {args.jobs}: N must be >= 1, and a --shard K/N is already one part of a split "
                      "(run the N shards side by side with --jobs N instead)")
    if args.resume and not Path(args.resume).is_dir():
        return _error(f"--resume {args.resume}: no results folder there")
    try:
        return run_gate(report=args.report, full=args.full, seed=args.seed, only=args.only, quiet=args.quiet,
                        mutate=not args.no_mutate, shard=args.shard, jobs=args.jobs,
                        render_report=not args.no_report, results=args.resume or args.results,
                        resume=bool(args.resume), append=args.append, shuffle=args.shuffle, column=args.column,
                        steal=args.steal)
    except GateInputError as exc:
        return _error(str(exc))


def _run(args: argparse.Namespace) -> int:
    from harness.case.spec import Case  # late: torch and DeepSpeed (see the module doc)
    from harness.cli.check_plan import MAX_WORLD_SIZE, max_world_size
    from harness.cli.main_job import run_single

    try:
        text = args.case if args.case is not None else Path(args.case_file).read_text()
    except OSError as exc:
        return _error(f"cannot read the case file: {exc}")
    try:
        case = Case.from_json(text)
    except (ValueError, TypeError, KeyError) as exc:
        return _error(f"not a valid case: {exc}")
    limit = max_world_size("cpu")
    if case.world_size > limit:  # before any rank starts: a thousand ranks would never come up
        return _error(f"the case's world size {case.world_size}: this machine hosts at most {limit} ranks "
                      f"(min({MAX_WORLD_SIZE}, 2 x CPUs))")
    return run_single(case, report=args.report)


def _report(args: argparse.Namespace) -> int:
    from harness.launch.shard import merge_results  # late: torch and DeepSpeed (see the module doc)
    from harness.report.build import render
    from harness.report.build import incomplete as report_incomplete
    from harness.report.build import verdict as report_verdict
    from harness.report.results import load_records

    folders = [Path(p) for p in args.results]
    missing = [str(p) for p in folders if not p.is_dir()]
    if missing:
        return _error(f"no results folder at {', '.join(missing)}")
    results = folders[0]
    if len(folders) > 1:
        out_html = Path(args.out or "reports/merged.html")
        results = merge_results(folders, out_html.parent / (out_html.stem + "-results"))
    records = load_records(results)  # once: a --full folder takes ~2 s to read
    out = render(results, args.out or results.resolve().parent / "divergence.html", title=args.title,
                 only=args.only, all_plots=args.all_plots, records=records)
    ok, reasons = report_verdict(results, only=args.only, records=records)
    print(out)
    if report_incomplete(results, records):
        print("verdict: " + "; ".join(reasons))
        return 4
    print("verdict: " + ("PASS" if ok else "FAIL: " + "; ".join(reasons)))
    return 0 if ok else 1


def _bench(args: argparse.Namespace) -> int:
    from harness.cli import bench  # late: torch and DeepSpeed (see the module doc)

    if args.from_results:
        return bench.times_from_results(Path(args.from_results),
                                        f"python -m harness bench --from-results {args.from_results}")
    if args.gate:
        return bench.gate_bench(full=args.full, only=args.only)
    return bench.main(cases=args.cases, world_size=args.world_size, quick=args.quick)


def _mutate(args: argparse.Namespace) -> int:
    if args.engine == "cosmic-ray":
        # late, and before anything imports deepspeed, which then comes from the mutated copy
        from harness.selfcheck.source_mutation.cli import run as source_mutation

        return source_mutation(args)
    from harness.selfcheck.kill_matrix import run as kill_matrix  # late: torch and DeepSpeed (see the module doc)

    return kill_matrix(mutants=args.mutant, only=args.only, stock=args.stock, case_names=args.case,
                       verbose=args.verbose)


def _gpu(args: argparse.Namespace) -> int:
    from harness.cli.gpu import run  # late: torch and DeepSpeed (see the module doc)

    return run(args)


def _check(args: argparse.Namespace) -> int:
    from harness.cli.check import run_check  # late: torch and DeepSpeed (see the module doc)

    return run_check(args)


def _compare(args: argparse.Namespace) -> int:
    from harness.cli import compare  # late: the report's loader reaches numpy

    try:
        if args.merge:
            return compare.merge([Path(p) for p in args.merge], Path(args.out))
        if not (args.base and args.head):
            return _error("compare: give --base and --head (or --merge DIR...)")
        return compare.run(args.base, args.head, Path(args.out), compare.gate_args_of(args), rerun=not args.no_rerun)
    except (compare.CompareInputError, ValueError) as exc:
        return _error(str(exc))


def _watch(args: argparse.Namespace) -> int:
    from harness.cli.watch import run_watch  # late: torch and DeepSpeed (see the module doc)

    return run_watch(args)


HANDLERS = {"gate": _gate, "run": _run, "compare": _compare, "report": _report, "bench": _bench, "mutate": _mutate,
            "gpu": _gpu, "check": _check, "watch": _watch}


def main(argv=None) -> int:
    # Parsing imports neither torch nor DeepSpeed, so ``--help`` answers where neither is installed. Then,
    # before anything imports torch: torch sizes its OpenMP team when it is imported, so a parent that set
    # OMP_NUM_THREADS=1 after that judged on two threads contending with its own ranks and, having two,
    # never forked a rank pool (``harness.launch.pool._fork_is_safe``).
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.cmd == "watch":  # the user's command runs in the user's environment, not the harness's
        args.user_env = dict(os.environ)
    buildenv.apply_base_env()
    if args.cmd == "report":  # starts no process
        return HANDLERS[args.cmd](args)
    try:
        with lifecycle.command_scope():
            return HANDLERS[args.cmd](args)
    except lifecycle.Interrupted as exc:  # stopped outside a handler's own summary: one line, no traceback
        print(f"{args.cmd}: stopped by {exc.name}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
