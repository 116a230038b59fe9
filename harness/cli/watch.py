"""``python -m harness watch [options] -- COMMAND``: your own training, its first steps judged.

The stages are ``harness.watch``'s (run the command with the capture in its ranks, read the ranks'
records, judge them with the gate's decision); this module states the plan before the command starts
and prints the verdict as ``check`` prints its own: per quantity, the known bug that explains a
divergence, what the verdict rests on, the report, and the same exit codes.
"""
from __future__ import annotations

import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.cli.check import (QUANTITY_ORDER, _bug_sentence, _first_fail_by_quantity, _ratio_txt, _report,
                               _status_text, _step_lines, _trim_message, basis_text, departure_lines,
                               known_bug_info, worst_by_quantity)
from harness.cli.check_verdict import EXIT_BAD_INPUT, EXIT_OK, EXIT_RUN_FAILED, user_exit
from harness.env import buildenv
from harness.judge import departures as departure_judge
from harness.registry.departures import DEPARTURES
from harness.rank.watch_hook import Settings
from harness.registry import mutants
from harness.watch import judge, launch, records


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def case_name(command: list[str], case) -> str:
    script = next((Path(a).stem for a in command if a.endswith(".py")), Path(command[0]).name if command else "run")
    return f"watch-{script}-z{case.stage}-{case.offload}-{case.dtype}-ws{case.world_size}"


def _plan_lines(args, settings: Settings, folder: Path) -> list[str]:
    watched = ("--params " + " ".join(settings.params)) if settings.params else (
        "the default set: a Muon matrix straddling a partition boundary, one next to padding, the first and a "
        "non-first parameter of a ZeRO-3 sub-group, an Adam vector")
    return [f"watch: {shlex.join(args.command)}",
            f"  recording the first {settings.steps} optimizer step(s) of every rank into {folder}",
            f"  watched: {watched}",
            f"  memory bound: {settings.max_mib:g} MiB per rank (float64 copies of the watched parameters; "
            "parameters past it are left out and named)",
            "  fixes: " + ("the bundled fixes applied in every rank (--patched)" if settings.patched else
                           "as the command sets them (harness.fixes.apply() in the script counts)")
            + (f"; mutant {settings.mutant} installed in every rank" if settings.mutant else "")]


def _watched_lines(run: records.WatchedRun) -> list[str]:
    tags = {p.name: p.uses_muon for p in run.case.params}
    lines = [f"  watched {len(run.case.params)} of {len(run.full.params)} parameters ({run.path} path):"]
    for p in run.case.params:
        shape = "x".join(map(str, p.shape))
        lines.append(f"    {p.name:32s} {shape:>12s} {'Muon' if tags[p.name] else 'Adam'}  {run.reasons[p.name]}")
    if run.dropped:
        lines.append(f"    left out for the memory bound: {', '.join(run.dropped)}")
    return lines


def cost_lines(run: records.WatchedRun) -> list[str]:
    """The capture's measured cost: per watched step, its time against the step window's, and what each
    rank kept (its record file)."""
    cap = [t["capture_s"] for rank in run.timing for t in rank]
    win = [t["window_s"] for rank in run.timing for t in rank[1:]] or [t["window_s"] for rank in run.timing
                                                                       for t in rank]
    if not cap:
        return []
    return [f"  capture cost: {statistics.median(cap) * 1e3:.2f} ms per watched step and rank (median; worst "
            f"{max(cap) * 1e3:.2f} ms), against a step window of {statistics.median(win) * 1e3:.1f} ms (median, "
            f"first step left out); records {max(run.file_bytes) / 2**20:.2f} MiB on the largest rank"]


def _quantity_lines(o) -> list[str]:
    worst, firsts = worst_by_quantity(o), _first_fail_by_quantity(o)
    lines = ["  per quantity, worst |error| / allowance over the watched parameters and steps (<= 1 is within "
             "tolerance):"]
    for q in sorted(worst, key=lambda q: QUANTITY_ORDER.index(q) if q in QUANTITY_ORDER else 99):
        first = firsts.get(q)
        where = f"  first at step {first.step}, {first.param}" if first else ""
        lines.append(f"    {q:18s} {'DIVERGED' if first else 'ok':9s} {_ratio_txt(worst[q]):>9s}x{where}")
    return lines


def _first_line(o) -> list[str]:
    """The earliest divergence of a tensor (what a user looks for first), else the earliest of any kind."""
    if o.verdict is None or not o.verdict.failures:
        return []
    fails = sorted(o.verdict.failures, key=lambda c: (c.step, c.param.startswith("<"), -c.worst_ratio))
    first = fails[0]
    where = f"rank {first.rank}" if first.rank is not None else "no single rank"
    return [f"first divergence: {first.param} {first.quantity} at step {first.step}, {where}"
            + (f" ({first.region})" if first.region else "") + f", {_ratio_txt(first.worst_ratio)}x its allowance"]


def _departure_lines(run: records.WatchedRun, o) -> list[str]:
    """check's second reference, Muon as defined: its sizes (the clip's, the raw gradients' norm) are sums
    over every parameter, so they are measured only where every parameter was watched."""
    if o.trajectory is None or not o.trajectory.muon_params:
        return []
    if run.partial:
        return ["muon as defined: not measured on a watched subset (--params '*' measures the departures of "
                "DeepSpeed's Muon from Muon as defined, docs/departures.md)"]
    found = departure_judge.findings(o.case, o.trajectory, departures=DEPARTURES)
    return [line.replace(" (--strict-muon does)", "") for line, _ in departure_lines(found, False)]


def verdict_lines(run: records.WatchedRun, o) -> list[str]:
    lines = _watched_lines(run) + _step_lines(o) + cost_lines(run)
    if o.verdict is not None:
        lines += _quantity_lines(o) + [f"  note: {n}" for n in o.verdict.notes] + _departure_lines(run, o)
    line = _status_text(o)
    if o.status == "xfailed":
        line = "DIVERGED: the divergence is known stock DeepSpeed bug " + "; ".join(
            _bug_sentence(b) for b in known_bug_info(o.case) if b["id"] in o.bug_ids)
    elif o.status == "passed" and o.verdict is not None and user_exit(o) == EXIT_OK:
        line += f": every watched quantity within tolerance (worst {_ratio_txt(o.verdict.worst_ratio)}x its allowance)"
    lines.append(f"verdict ({o.column}): {line}{basis_text(o)}")
    lines += _first_line(o)
    if o.status != "passed" and o.message:
        lines.append("  " + _trim_message(o.message).replace("\n", "\n  "))
    return lines


def _settings(args, folder: Path) -> Settings:
    own_ops = args.user_env.get("TORCH_EXTENSIONS_DIR") == str(buildenv.extensions_dir())
    return Settings(out=str(folder), steps=args.steps, params=tuple(args.params), max_mib=args.max_mib,
                    stop_after=args.stop_after, patched=args.patched, mutant=args.mutant, preload_ops=own_ops)


def _prepare(args) -> tuple[Path, Settings | None]:
    """The records folder (emptied of an earlier run's records: they would be judged as this one's) and
    the settings; ``--judge``: the folder as it is, no settings."""
    if args.judge:
        return Path(args.judge), None
    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="watch-"))
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for f in records.rank_files(folder) + list(folder.glob(".rank*.pkl.tmp")):
        f.unlink()
    return folder, _settings(args, folder)


NODE_WAIT_S = 60.0  # how long a node waits for the other nodes' records on a shared --out


def _load_waiting(folder: Path) -> records.WatchedRun:
    """The records, once every rank's file is there: under ``torchrun --nnodes`` each node's ``watch`` sees
    its own ranks' files at once and the other nodes' as the shared folder brings them (every rank writes
    its file at the same watched step, long before the training ends)."""
    deadline = time.monotonic() + NODE_WAIT_S
    while True:
        try:
            return records.load(folder, "watch")
        except records.RanksMissing as exc:
            if time.monotonic() > deadline:
                raise records.RecordsError(f"{exc}; the other ranks' records never arrived (a folder the nodes "
                                           "share? judge where they all are: python -m harness watch --judge "
                                           f"{folder})") from None
            time.sleep(0.5)


def run_watch(args) -> int:
    """Plan, run, judge, print; every early end says why in one line."""
    if args.mutant and args.mutant not in mutants.MUTANTS:
        print(f"error: unknown mutant {args.mutant!r}; known: {', '.join(sorted(mutants.MUTANTS))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    folder, settings = _prepare(args)
    rc = 0
    if settings is not None:
        for line in _plan_lines(args, settings, folder):
            _say(line)
        t0 = time.perf_counter()
        try:
            rc = launch.run_command(args.command, launch.command_env(args.user_env, settings), args.timeout)
        except subprocess.TimeoutExpired:
            print(f"error: no verdict: the command ran past --timeout {args.timeout:g} s and was ended",
                  file=sys.stderr)
            return EXIT_RUN_FAILED
        _say(f"watch: the command exited with status {rc} after {time.perf_counter() - t0:.1f} s")
    try:
        run = _load_waiting(folder)
    except records.RecordsError as exc:
        print(f"error: no verdict: {exc}" + (f" (the command exited with status {rc})" if rc else ""),
              file=sys.stderr)
        return EXIT_RUN_FAILED
    run.case = run.case.replace(name=case_name(args.command, run.case))
    run.trajectory.case_name = run.case.name
    o = judge.decide_run(run)
    for line in verdict_lines(run, o):
        _say(line)
    path, note = _report([o], None if args.no_report else (
        args.report or str(buildenv.PROJECT_ROOT / "reports" / f"{run.case.name}.html")), {})
    _say(f"report: {path}" if path else f"report: none ({note})")
    code = user_exit(o)
    if rc != 0 and code == EXIT_OK:
        _say(f"the command itself failed after the watched steps (status {rc}): exit {EXIT_RUN_FAILED}")
        return EXIT_RUN_FAILED
    return code
