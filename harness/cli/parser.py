"""The one argparse tree of ``python -m harness``: every subcommand, every option, every exit code.

Kept apart from ``harness.cli.main`` (which runs the subcommands) and free of imports that reach torch
or DeepSpeed, so that ``--help`` answers at once, and so that ``harness.cli.check``, run as a module
of its own, can take its options from here without an import cycle through ``main``.
"""
from __future__ import annotations

import argparse
import ast
import textwrap
from pathlib import Path

DESCRIPTION = ("Check, step after step and on every rank, that DeepSpeed ZeRO computes the Muon update the "
               "float64 reference says. Each subcommand's --help lists its options and exit codes.")
DEFAULT_SHAPES = "4096x4096,11008x4096"
DEFAULT_STEPS = 3
USAGE_ERROR = "an unknown option or a malformed value"
# Python's own exit status for an exception nobody caught; ``check`` catches its own (exit 3).
RAISED = "or the harness itself raised an exception (its traceback is printed)"
WIDTH = 100
BENCH_CASES, BENCH_QUICK_CASES = 3, 1  # bench: a fresh-interpreter case costs up to a minute on 2 loaded cores
# bench's targets: the pool at least this many times faster than a fresh interpreter per case, and at
# most this many times the time of a bare DeepSpeed run in warm ranks (harness.cli.bench)
BENCH_FRESH_TARGET, BENCH_BARE_TARGET = 10.0, 1.3


STOPPED = ("130  stopped by SIGINT (Ctrl-C): what was judged is kept, nothing of the run is left running",
           "143  stopped by SIGTERM: the same")


def _epilog(codes: tuple[str, ...], raised: bool = True, stoppable: bool = True) -> str:
    """The exit codes, one a line; argparse's own usage errors exit 2 too, so code 2 says so, and an
    uncaught exception exits 1, so code 1 says so (``raised``); every command that starts processes
    can be stopped (``harness.launch.lifecycle``), which ``stoppable`` lists."""
    codes = codes + (STOPPED if stoppable else ())
    if raised:
        codes = tuple(c + f"; {RAISED}" if c.startswith("1 ") else c for c in codes)
    if any(c.startswith("2 ") for c in codes):
        lines = [c + f"; or {USAGE_ERROR}" if c.startswith("2 ") else c for c in codes]
    else:
        lines = [*codes, f"2  {USAGE_ERROR}"]
    return "exit codes:\n" + "\n".join(textwrap.fill(c, WIDTH, initial_indent="  ", subsequent_indent="     ")
                                         for c in lines)


def _sub(sub, name: str, help: str, codes: tuple[str, ...], description: str | None = None, raised: bool = True):
    text = description or textwrap.fill(help[:1].upper() + help[1:] + ".", WIDTH)
    return sub.add_parser(name, help=help, description=text, epilog=_epilog(codes, raised, name != "report"),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _int_list(text: str) -> str:
    """A comma list of positive integers, checked at parse time (a usage error, exit 2) and kept as given."""
    try:
        ok = all(int(x) >= 1 for x in text.split(","))
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers separated by commas, e.g. 1,2")
    return text


def _gate(sub) -> None:
    g = _sub(sub, "gate", "check every pipeline against the oracle; write the HTML report", (
        "0  every outcome as expected (passed, or failed as a known bug predicts) and the mutation self-checks held",
        "1  an outcome failed, could not be judged, passed unexpectedly or errored (a crashed rank is an error), a "
        "mutation self-check failed, or a --jobs shard exited non-zero",
        "2  bad input: --shard not K/N, --jobs below 1 or with --shard, an --only that matches no case, --resume of "
        "a folder with no run plan",
        "4  the results folder is incomplete (planned case-columns not judged; finish with --resume)"))
    g.add_argument("--report", default="reports/gate.html",
                   help="the HTML report (default %(default)s); the results go to a folder next to it, <stem>-results")
    g.add_argument("--full", action="store_true", help="the whole product instead of the CI covering subset")
    g.add_argument("--seed", type=int, default=0, help="the seed of every case's data and model (default 0)")
    g.add_argument("--only", default=None, help="substring filter on case names (skips the mutation self-check)")
    g.add_argument("-q", "--quiet", action="store_true", help="no line per case, only the summary")
    g.add_argument("--no-mutate", action="store_true", help="skip the mutation self-check")
    g.add_argument("--shard", default=None, metavar="K/N",
                   help="run only shard K of N cost-balanced shards (merge with: python -m harness report DIR...)")
    g.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run the gate as N local shards side by side and merge them into one report "
                        "(overlaps one shard's oracle replay with another's ranks; 2 on a 2-core machine)")
    g.add_argument("--results", default=None, metavar="DIR",
                   help="the results folder (default: <report stem>-results next to the report); a plain rerun "
                        "moves an existing one aside to DIR.prev-<time>, keeping the last two")
    g.add_argument("--resume", default=None, metavar="DIR",
                   help="judge only what the run that wrote DIR planned and did not judge (stopped, killed, a "
                        "shard lost), with that run's own arguments, appending to DIR; then report the whole")
    g.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                   help="run the case-columns in this seed's random order (a verdict must not depend on what "
                        "ran before it in the same ranks); skips the mutation self-checks")
    g.add_argument("--column", default=None, choices=("stock", "patched"),
                   help="run this column alone; skips the mutation self-checks")
    g.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)  # a --jobs shard: the parent renders
    g.add_argument("--append", action="store_true", help=argparse.SUPPRESS)  # a --jobs shard: the parent made DIR
    g.add_argument("--steal", action="store_true", help=argparse.SUPPRESS)  # a --jobs shard: takes untouched cases


def _compare(sub) -> None:
    c = _sub(sub, "compare", "judge a DeepSpeed change: the same gate on a base and a head tree, case by case", (
        "0  nothing regressed (every case-column unchanged, fixed, flaky, still present, changed, not on both, or "
        "cannot judge: summary.md counts each)",
        "1  a case-column that passed on base fails on head (a regression)",
        "2  bad input: a side that is no release, source checkout, REPO@COMMIT or 'installed'; --shard not K/N; "
        "--merge of a folder that is no compare output, or of shards that compared different trees",
        "4  a side's gate was incomplete (its exit code is passed on)"))
    c.add_argument("--base", help="the tree before the change: a release (0.19.7), a source checkout's folder, "
                                  "REPO@COMMIT, or 'installed'")
    c.add_argument("--head", help="the tree after the change (the same forms)")
    c.add_argument("--out", default="reports/compare", help="the output folder: base-results/, head-results/, "
                                                            "summary.md, compare.html (default %(default)s)")
    c.add_argument("--full", action="store_true", help="the whole product instead of the CI covering subset")
    c.add_argument("--only", default=None, help="substring filter on case names")
    c.add_argument("--seed", type=int, default=0, help="the seed of every case's data and model (default 0)")
    c.add_argument("--shard", default=None, metavar="K/N",
                   help="only shard K of N (the same cases on both trees); join the N outputs with --merge")
    c.add_argument("--jobs", type=int, default=1, metavar="N", help="each side's gate as N local shards")
    c.add_argument("--no-rerun", action="store_true",
                   help="classify without running again the cases a side failed with no bug that explains it at "
                        "full strength (a flake then reads as a fix or a regression)")
    c.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="instead of running: join the --out folders of --shard runs into --out and classify")


def _run(sub) -> None:
    r = _sub(sub, "run", "rerun one case given as JSON (what divergence messages print)", (
        "0  passed, or failed as a known bug predicts",
        "1  diverged, could not be judged, passed unexpectedly, or the run itself failed (a rank raised, died or "
        "timed out); or the installed DeepSpeed release cannot run the case (skipped)",
        "2  bad input: not a valid case, the case file cannot be read, or a world size this machine cannot host"))
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--case", help="the case as JSON text")
    src.add_argument("--case-file", help="a file holding the case as JSON")
    r.add_argument("--report", default=None, help="also write an HTML report here (default: none)")


def _bench(sub) -> None:
    b = _sub(sub, "bench", "the rank pool against a fresh interpreter per case (as DeepSpeed's DistributedTest), "
                           "bare DeepSpeed in warm ranks and a forked pool per case, measured in one run", (
        f"0  the targets met (the pool >= {BENCH_FRESH_TARGET:g}x faster than a fresh interpreter per case, "
        f"<= {BENCH_BARE_TARGET:g}x the time of bare DeepSpeed); with --gate or --from-results: the times were "
        "measured",
        "1  a target missed (each missed one printed after TARGET MISSED)",
        "2  --from-results: no gate outcomes stored in DIR"))
    b.add_argument("--cases", type=int, default=BENCH_CASES, help="how many cases to time (default %(default)s)")
    b.add_argument("--quick", action="store_true",
                   help=f"time {BENCH_QUICK_CASES} cases instead of --cases (a smoke run: the ratios are noisier)")
    b.add_argument("--world-size", type=int, default=2, help="ranks per case (default %(default)s)")
    b.add_argument("--gate", action="store_true", help="time the gate's cases by group and stage; refresh "
                                                       "data/case_times.json (the shards' costs)")
    b.add_argument("--full", action="store_true", help="with --gate: the whole product")
    b.add_argument("--only", default=None, help="with --gate: substring filter (does not refresh the costs)")
    b.add_argument("--from-results", default=None, metavar="DIR",
                   help="refresh data/case_times.json from a gate run's results folder instead of rerunning")


def _report(sub) -> None:
    rp = _sub(sub, "report", "re-render the HTML divergence report from stored results (nothing reruns)", (
        "0  verdict PASS", "1  verdict FAIL (the reasons are printed)", "2  a results folder does not exist",
        "4  INCOMPLETE: the runs that wrote the folder(s) planned case-columns they did not judge"))
    rp.add_argument("results", nargs="+",
                    help="results folder(s) (results-*.jsonl, maps/, extra-*.json); several are merged into one "
                         "report with one verdict (the shards of a gate)")
    rp.add_argument("-o", "--out", default=None, help="output HTML (default: divergence.html next to the folder)")
    rp.add_argument("--title", default=None, help="the report's title (default: one naming the results)")
    rp.add_argument("--only", default=None, metavar="SUBSTR",
                    help="only the cases whose name contains SUBSTR (the verdict is then the subset's)")
    rp.add_argument("--all-plots", action="store_true",
                    help="inline the plots of every outcome shown (by default the worst few per kind)")


_KILL_MATRIX_OPTIONS = (
    (("--mutant",), dict(action="append", help="only these mutants (repeatable)")),
    (("--stock",), dict(action="store_true", help="run on stock DeepSpeed with the gate's decision (bug-affected "
                                                   "cases must still match their bug models); default mutants: "
                                                   "STOCK_KILL_MUTANTS")),
    (("--case",), dict(action="append", default=None,
                       help="gate case names to use instead of the default kill set (repeatable)")),
    (("-v", "--verbose"), dict(action="store_true", help="a line per case and mutant as it runs")),
)
_SOURCE_MUTATION_OPTIONS = (
    (("--sample",), dict(type=int, default=None, help="a seeded sample of N scoped mutants (default: all)")),
    (("--seed",), dict(type=int, default=0, help="the seed of --sample (default 0)")),
    (("--fresh",), dict(action="store_true", help="rebuild the session (default: resume it)")),
    (("--retry",), dict(default=None, metavar="STATUSES",
                        help="make mutants of these recorded statuses pending again, e.g. survived,not-reached "
                             "(after adding a case or sharpening a tolerance)")),
    (("--judge-equivalents",), dict(action="store_true",
                                    help="judge the mutants listed in equivalents.txt too (default: recorded as "
                                         "equivalent without a run; with --fresh, to audit the list: a listed "
                                         "mutant a case kills is wrong there)")),
    (("--no-ledger",), dict(action="store_true",
                            help="neither take results from nor add them to the checked-in ledger (ledger.py); "
                                 "--fresh judges every mutant anew but still adds its results")),
    (("--prepare",), dict(action="store_true",
                          help="make the copy, the coverage map, the session and the config, then stop (a worker "
                               "machine of the HTTP distributor, or the main machine before exec)")),
    (("--column",), dict(choices=("stock", "patched"), default="stock",
                         help="judge on stock DeepSpeed, or with the patched runtime applied (a mutant in a "
                              "function the patched runtime replaces is then 'replaced-by-fix', counted apart)")),
    (("--zygote",), dict(action=argparse.BooleanOptionalAction, default=True,
                         help="local distributor: judge in children forked from one warm process (torch and the "
                              "harness imported once) instead of a fresh interpreter per mutant (default: on)")),
    (("--distributor",), dict(choices=("local", "http"), default="local",
                              help="Cosmic Ray's distributor: local processes, or HTTP workers (--worker-url)")),
    (("--worker-url",), dict(action="append", default=[], help="an HTTP worker (repeatable)")),
    (("--report",), dict(default=None, help="HTML report (default: reports/mutation.html for a full run, "
                                            "reports/mutation-<session>.html for a sample or --only)")),
    (("--tree",), dict(default=None, metavar="PATH",
                       help="mutate another DeepSpeed source checkout's Muon code (scope derived from its source, "
                            "judged in its own venv from scripts/deepspeed_venv.sh; its own state, session and "
                            "ledger; stock column, local distributor)")),
)


def _mutate(sub) -> None:
    mu = _sub(sub, "mutate", "the mutation self-check: every known-bug mutant against the kill cases, as a table; "
                             "with --engine cosmic-ray, source mutants of DeepSpeed's Muon code", (
        "0  every mutant killed and every prediction held (cosmic-ray: every reached, non-equivalent mutant killed; "
        "with --prepare: the session was built)",
        "1  a mutant survived or a prediction failed (cosmic-ray: a survivor not in the equivalents file, a "
        "mutant the harness failed to judge, or Cosmic Ray's results unreadable)",
        "2  bad input: an unknown --case, an option of the other engine, --sample below 1, --distributor http "
        "without --worker-url, a --tree that is no DeepSpeed source checkout (or with --column patched or "
        "--distributor http), Cosmic Ray not installed, or its session not built"))
    mu.add_argument("--engine", choices=("cosmic-ray",), default=None,
                    help="cosmic-ray: mutate DeepSpeed's own Muon source with Cosmic Ray instead of running the "
                         "catalogued known-bug mutants (options under 'source mutation')")
    mu.add_argument("--only", default=None,
                    help="kill matrix: only the cases whose name contains this; cosmic-ray: only the mutants of "
                         "this scoped function (exact qualified name) or whose key contains this (a file, file:line)")
    engines = {None: ("kill matrix (without --engine)", _KILL_MATRIX_OPTIONS),
               "cosmic-ray": ("source mutation (--engine cosmic-ray)", _SOURCE_MUTATION_OPTIONS)}
    own = {}
    for engine, (title, table) in engines.items():
        group = mu.add_argument_group(title)
        own[engine] = [group.add_argument(*flags, **kw) for flags, kw in table]
    mu.set_defaults(engine_options=own)


def _gpu(sub) -> None:
    gp = _sub(sub, "gpu", "the fixed GPU subset through torchrun (NCCL); scripts/gpu.sh installs, then runs it",
              ("0  every outcome as expected", "1  an outcome failed, passed unexpectedly or errored",
                     "2  --accelerator cuda but torch sees no CUDA device"))
    gp.add_argument("--accelerator", default="cuda", choices=("cuda", "cpu", "auto"),
                    help="cpu only to rehearse the script where no GPU is (gloo instead of NCCL)")
    gp.add_argument("--world-sizes", type=_int_list, default=None, metavar="N[,N...]",
                    help="the world sizes to run, comma separated (default: 1 and the number of local GPUs)")
    gp.add_argument("--no-compiled", action="store_true", help="leave out the torch.compile'd cases")
    gp.add_argument("--only", default=None, help="substring filter on case names")
    gp.add_argument("--report", default="reports/gpu.html", help="the HTML report (default %(default)s)")


def check_manual() -> str:
    """``harness.cli.check``'s docstring, its manual, read without importing it (it imports torch), with
    the reStructuredText literal markup taken out for a terminal."""
    source = Path(__file__).with_name("check.py").read_text()
    return (ast.get_docstring(ast.parse(source)) or "").replace("``", "").replace("::\n", ":\n")


CHECK_EXIT_CODES = (
    "0  within tolerance",
    "1  diverged (including divergences a known stock DeepSpeed bug explains: your config is affected)",
    "2  bad input, or a config DeepSpeed refuses (its words, and where): reported before any rank starts where "
    "the refusals registry knows it, else as soon as deepspeed.initialize raised it",
    "3  the run itself failed: a rank raised, died or timed out, or the harness crashed (no verdict)",
    "4  cannot judge: nothing diverged, but a captured quantity has no finite reference (the message names the "
    "step, tensor and loss scale), or no applied step moved a weight (all skipped or at lr 0): not a pass",
)


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ds-config", required=True, help="your DeepSpeed config (JSON)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"matrix shapes, comma separated (default {DEFAULT_SHAPES}); scaled down when too big, "
                        "keeping aspect ratios and numel mod 2 x world size; a 1-D entry is an Adam vector")
    p.add_argument("--model", default=None,
                   help="run a real module instead of --shapes: a built-in (gpt2, llama, resnet, moe) or "
                        "package.module:factory (harness.models)")
    p.add_argument("--zero-init", action="store_true",
                   help="ZeRO-3: build the module under deepspeed.zero.Init, as Hugging Face does")
    p.add_argument("--trainer-arg", action="append", default=None, metavar="NAME=VALUE",
                   help="a TrainingArguments value for resolving \"auto\" (e.g. learning_rate=3e-4, bf16=true)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default %(default)s)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the model and data (default %(default)s)")
    p.add_argument("--report", default=None, help="HTML report path (default reports/<case>.html)")
    p.add_argument("--no-report", action="store_true", help="write no report")
    p.add_argument("--patched", action="store_true",
                   help="also run with the bundled fixes and say whether they change the verdict")
    p.add_argument("--strict-muon", action="store_true",
                   help="exit 1 on any departure of DeepSpeed's Muon from Muon as defined (docs/departures.md), "
                        "which DeepSpeed intends and the plain exit code does not count")
    p.add_argument("--launcher", choices=("pool", "torchrun"), default="pool",
                   help="pool: CPU ranks over gloo (default); torchrun: torch.distributed.run, env://, the "
                        "accelerator's backend (nccl on CUDA)")
    p.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto",
                   help="torchrun launcher only: auto picks cuda when a GPU is visible")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the verdict and report lines")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _check(sub) -> None:
    ck = _sub(sub, "check", "check your DeepSpeed config against the oracle on a scaled model",
              CHECK_EXIT_CODES, description=check_manual(), raised=False)  # check's own crashes exit 3
    add_check_arguments(ck)


WATCH_MAX_STEPS = 50
WATCH_DESCRIPTION = """\
Run your own training command unchanged (torchrun, the deepspeed launcher, plain python), record the
first --steps optimizer steps of every rank and judge them against the oracle, teacher-forced from
DeepSpeed's own previous state, with check's per-quantity verdict, report and exit codes. The capture is
installed in every Python process of the command through a sitecustomize on PYTHONPATH; it wraps
deepspeed.initialize and is taken out after the watched steps, and the training goes on (--stop-after
ends it there). Watching does not change the run: the weights are bit-identical with and without it.

Watched by default: a Muon matrix straddling a partition boundary, one next to padding, the first and a
non-first parameter of a ZeRO-3 sub-group, an Adam vector; --params replaces the set. Each rank keeps
float64 copies of the watched parameters only, within --max-mib (parameters past it are left out and
named). Several nodes: run watch on every node with the same --out on a shared folder; the node that
finds every rank's file judges. A script can install the same capture itself:
harness.rank.watch_hook.install(out=DIR, steps=K) before deepspeed.initialize, then
python -m harness watch --judge DIR. Details: docs/watch.md."""

WATCH_EXIT_CODES = (
    "0  within tolerance on every recorded quantity",
    "1  diverged (the message names tensor, quantity, step, rank and region), including a divergence a known "
    "stock DeepSpeed bug explains",
    "2  bad input: no command after --, --steps outside 1..50, --max-mib not positive, an unknown --mutant",
    "3  no verdict: the command failed or ended before the watched steps, the capture failed on a rank, or "
    "the command failed after them (the verdict is printed)",
    "4  cannot judge: nothing diverged, but a recorded quantity has no finite reference, or no applied step "
    "moved a weight",
)


def _watch_steps(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        k = 0
    if not 1 <= k <= WATCH_MAX_STEPS:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer from 1 to {WATCH_MAX_STEPS}")
    return k


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive number")
    return v


def _watch(sub) -> None:
    w = _sub(sub, "watch", "watch the first steps of your own training command and judge them",
             WATCH_EXIT_CODES, description=WATCH_DESCRIPTION)
    w.add_argument("--steps", type=_watch_steps, default=DEFAULT_STEPS,
                   help=f"optimizer steps recorded, 1..{WATCH_MAX_STEPS} (default %(default)s)")
    w.add_argument("--params", action="append", default=[], metavar="GLOB",
                   help="watch the parameters whose names match (fnmatch, repeatable) instead of the default set")
    w.add_argument("--max-mib", type=_positive, default=512.0,
                   help="memory bound of the capture per rank, MiB (default %(default)s)")
    w.add_argument("--out", default=None, help="folder for the ranks' records (default: a temporary one)")
    w.add_argument("--stop-after", action="store_true", help="end the training after the watched steps")
    w.add_argument("--patched", action="store_true",
                   help="apply the bundled fixes in every rank (as harness.fixes.apply() in the script)")
    w.add_argument("--mutant", default=None,
                   help="install a catalogued mutant (harness.registry.mutants) in every rank: a broken Muon "
                        "path, to see that watch catches it")
    w.add_argument("--judge", default=None, metavar="DIR",
                   help="judge the records in DIR (a script that installed the capture itself); runs nothing")
    w.add_argument("--timeout", type=_positive, default=None, help="seconds the command may run (default: no limit)")
    w.add_argument("--report", default=None, help="HTML report path (default reports/<case>.html)")
    w.add_argument("--no-report", action="store_true", help="write no report")
    w.add_argument("command", nargs=argparse.REMAINDER, help="-- then your launch command, as you run it")


TOP_EPILOG = ("exit codes:\n  those of the subcommand, which its --help lists; 2 also for an unknown command, "
              f"{USAGE_ERROR.replace('an unknown ', '')}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m harness", description=textwrap.fill(DESCRIPTION, WIDTH),
                                 epilog=TOP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND",
                            help="the subcommand; python -m harness COMMAND --help gives its options and exit codes")
    for add in (_gate, _run, _compare, _bench, _report, _mutate, _gpu, _check, _watch):
        add(sub)
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The tree's parse plus the one rule argparse cannot state: an option of the other mutate engine
    is bad input (``mutate --sample 3`` without ``--engine`` would otherwise be silently ignored)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd == "mutate":
        for engine, actions in args.engine_options.items():
            given = [a.option_strings[-1] for a in actions if getattr(args, a.dest) != a.default]
            if engine != args.engine and given:
                need = f"--engine {engine}" if engine else "no --engine"
                ap.error(f"mutate: {', '.join(given)} needs {need}")
        # the options as plain data (flag, dest, default, kind) for a run handed to another interpreter
        args.engine_options = {engine: tuple((a.option_strings[0], a.dest, a.default, type(a).__name__)
                                             for a in actions) for engine, actions in args.engine_options.items()}
    if args.cmd == "watch":
        args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not args.command and not args.judge:
            ap.error("watch: no command after --; e.g. python -m harness watch -- torchrun --nproc_per_node 2 train.py")
        if args.command and args.judge:
            ap.error("watch: --judge DIR judges records already written; give it no command")
    return args
