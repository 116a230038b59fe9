"""``python -m harness``: the command line.

  gate    run the pipeline matrix against the oracle and write the HTML report (the main job)
  run     rerun exactly one case (the reproducer every divergence message prints)
  bench   pool vs spawn-per-case vs bare DeepSpeed timings, measured in one run
  report  re-render the HTML divergence report from stored results (nothing reruns)
  mutate  the mutation self-check: every known-bug mutant against the kill cases, as a table;
          with --engine cosmic-ray: source mutants of DeepSpeed's Muon code (harness/selfcheck/source_mutation)
  gpu     the fixed GPU subset through torchrun and NCCL (scripts/gpu.sh installs, then runs it)
  check   check your own DeepSpeed config (Muon) against the oracle on a scaled model (harness/cli/check.py)
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from harness.env import buildenv

    # First, before any import of torch (``harness.cli.check``, imported below for its options, imports it):
    # torch sizes its OpenMP team when it is imported, so a parent that set OMP_NUM_THREADS=1 after that
    # judged on two threads contending with its own ranks and, having two, never forked a rank pool
    # (``harness.launch.pool._fork_is_safe``): every pool of the gate was spawned, ~15 s per crashing case.
    buildenv.apply_base_env()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["mutate"] and any(a == "--engine" or a.startswith("--engine=") for a in argv[1:]):
        # source mutation of DeepSpeed's own code (harness/selfcheck/source_mutation); must run before anything
        # imports deepspeed, which then comes from the mutated copy
        from harness.selfcheck.source_mutation.cli import main as source_mutation_main

        return source_mutation_main(argv[1:])
    if argv[:1] == ["mutate"]:
        # its options belong to harness.selfcheck.kill_matrix: argparse's REMAINDER after a sub-command refuses
        # anything that looks like an option (``mutate --only X`` was "unrecognized arguments")
        from harness.selfcheck.kill_matrix import main as mutate_main

        return mutate_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m harness", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("gate", help="check every pipeline against the oracle; write the HTML report")
    g.add_argument("--report", default="reports/gate.html")
    g.add_argument("--full", action="store_true", help="the whole product instead of the CI covering subset")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--only", default=None, help="substring filter on case names")
    g.add_argument("-q", "--quiet", action="store_true")
    g.add_argument("--no-mutate", action="store_true", help="skip the mutation self-check")
    g.add_argument("--shard", default=None, metavar="K/N",
                   help="run only shard K of N cost-balanced shards (merge with: python -m harness report DIR...)")
    g.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run the gate as N local shards side by side and merge them into one report "
                        "(overlaps one shard's oracle replay with another's ranks; 2 on a 2-core machine)")
    g.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)  # a --jobs shard: the parent renders

    mu = sub.add_parser("mutate", help="run every known-bug mutant against the kill cases; print the kill matrix")
    mu.add_argument("rest", nargs=argparse.REMAINDER,
                    help="options for harness.selfcheck.kill_matrix (--mutant, --only, --stock, -v)")

    r = sub.add_parser("run", help="rerun one case given as JSON (what divergence messages print)")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--case", help="the case as JSON text")
    src.add_argument("--case-file", help="a file holding the case as JSON")
    r.add_argument("--report", default=None)

    b = sub.add_parser("bench", help="pool vs spawn-per-case vs bare DeepSpeed, measured in one run")
    b.add_argument("--cases", type=int, default=6)
    b.add_argument("--world-size", type=int, default=2)
    b.add_argument("--gate", action="store_true", help="time the gate's cases by group and stage; refresh "
                                                       "data/case_times.json (the shards' costs)")
    b.add_argument("--full", action="store_true", help="with --gate: the whole product")
    b.add_argument("--only", default=None, help="with --gate: substring filter (does not refresh the costs)")
    b.add_argument("--from-results", default=None, metavar="DIR",
                   help="refresh data/case_times.json from a gate run's results folder instead of rerunning")

    rp = sub.add_parser("report", help="re-render the HTML divergence report from stored results (nothing reruns)")
    rp.add_argument("results", nargs="+",
                    help="results folder(s) (results-*.jsonl, maps/, extra-*.json); several are merged into one "
                         "report with one verdict (the shards of a gate)")
    rp.add_argument("-o", "--out", default=None, help="output HTML (default: divergence.html next to the folder)")
    rp.add_argument("--title", default=None)
    rp.add_argument("--only", default=None, metavar="SUBSTR",
                    help="only the cases whose name contains SUBSTR (the verdict is then the subset's)")
    rp.add_argument("--all-plots", action="store_true",
                    help="inline the plots of every outcome shown (by default the worst few per kind)")

    sub.add_parser("gpu", help="the fixed GPU subset through torchrun (NCCL); see scripts/gpu.sh", add_help=False)

    from harness.cli import check as check_cli

    ck = sub.add_parser("check", help="check your DeepSpeed config against the oracle (exit 0 ok, 1 diverged, "
                                      "2 bad input, 3 run failed)",
                        description=check_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    check_cli.add_arguments(ck)

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gpu"]:
        from harness.cli.gpu import main as gpu_main

        return gpu_main(argv[1:])
    args = ap.parse_args(argv)
    if args.cmd == "check":
        return check_cli.run_check(args)
    if args.cmd == "gate":
        from harness.cli.main_job import run_gate

        from harness.launch.shard import Shard

        if args.shard:
            try:
                Shard.parse(args.shard)
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        if args.jobs < 1 or (args.jobs > 1 and args.shard):
            print(f"error: --jobs {args.jobs}: N must be >= 1, and a --shard K/N is already one part of a "
                  "split (run the N shards side by side with --jobs N instead)", file=sys.stderr)
            return 2
        return run_gate(report=args.report, full=args.full, seed=args.seed, only=args.only, quiet=args.quiet,
                        mutate=not args.no_mutate, shard=args.shard, jobs=args.jobs,
                        render_report=not args.no_report)
    if args.cmd == "run":
        from harness.case.spec import Case
        from harness.cli.main_job import run_single

        text = args.case if args.case is not None else open(args.case_file).read()
        try:
            case = Case.from_json(text)
        except (ValueError, TypeError, KeyError) as exc:
            print(f"error: not a valid case: {exc}", file=sys.stderr)
            return 2
        return run_single(case, report=args.report)
    if args.cmd == "report":
        from pathlib import Path

        from harness.report.build import render
        from harness.report.build import verdict as report_verdict

        from harness.launch.shard import merge_results

        folders = [Path(p) for p in args.results]
        missing = [str(p) for p in folders if not p.is_dir()]
        if missing:
            print(f"error: no results folder at {', '.join(missing)}", file=sys.stderr)
            return 2
        results = folders[0]
        if len(folders) > 1:
            out_html = Path(args.out or "reports/merged.html")
            results = merge_results(folders, out_html.parent / (out_html.stem + "-results"))
        out = render(results, args.out or results.resolve().parent / "divergence.html", title=args.title,
                     only=args.only, all_plots=args.all_plots)
        ok, reasons = report_verdict(results, only=args.only)
        print(out)
        print("verdict: " + ("PASS" if ok else "FAIL: " + "; ".join(reasons)))
        return 0 if ok else 1
    if args.cmd == "bench":
        from harness.cli.bench import gate_bench
        from harness.cli.bench import main as bench_main

        if args.from_results:
            from pathlib import Path

            from harness.cli.bench import times_from_results

            return times_from_results(Path(args.from_results),
                                      f"python -m harness bench --from-results {args.from_results}")
        if args.gate:
            return gate_bench(full=args.full, only=args.only)
        return bench_main(cases=args.cases, world_size=args.world_size)
    return 2


if __name__ == "__main__":
    sys.exit(main())
