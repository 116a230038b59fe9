"""``python -m harness mutate --engine cosmic-ray``: source mutation of DeepSpeed's Muon code.

Steps, each skipped when its result is already there: make the private copy of DeepSpeed; record
the coverage map (once per DeepSpeed source, scope and candidate set); build the Cosmic Ray session
(all scoped mutants, or a seeded ``--sample``; mutants the checked-in ledger has judged take their
result from it unless ``--fresh``); run ``cosmic-ray exec`` on it (it runs only pending mutants, so an
interrupted run resumes where it stopped); read the results back, add the judged ones to the ledger
and write the report.

Cosmic Ray lives in its own virtual environment (``.venv-mutation``, made by ``scripts/run.sh
mutation``; or ``MUON_COSMIC_RAY`` naming its ``cosmic-ray`` executable): nothing of it is imported
by the harness or the ranks.

Exit status: 0 when every reached, non-equivalent mutant was killed; 1 on a survivor not in the
equivalents file or a mutant the harness failed to judge; 2 on bad input or a missing engine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness.env import buildenv
from harness.selfcheck.source_mutation import scope, tree_run

ENGINE_ENV = "MUON_COSMIC_RAY"


def engine_executable() -> Path | None:
    cands = [os.environ.get(ENGINE_ENV), str(buildenv.PROJECT_ROOT / ".venv-mutation" / "bin" / "cosmic-ray"),
             shutil.which("cosmic-ray")]
    for c in cands:
        if c and Path(c).exists():
            return Path(c)
    return None


def session_tag(sample: int | None, seed: int, only: str | None, column: str = "stock",
                tree: str | None = None) -> str:
    tag = "full" if sample is None else f"sample{sample}-seed{seed}"
    if only:
        tag += "-only-" + "".join(ch if ch.isalnum() else "_" for ch in only)[:40]
    if column != "stock":  # the stock column's sessions keep their first names
        tag += f"-{column}"
    if tree:  # another tree's sessions and reports never take a 0.19.8 run's name
        tag += f"-tree-{tree}"
    return tag


def write_config(path: Path, site: Path, pristine: Path, cmap: Path, distributor: str, urls: list[str],
                 column: str = "stock") -> None:
    py = Path(sys.executable)
    test = (f"env PYTHONPATH={buildenv.PROJECT_ROOT} {py} -m harness.selfcheck.source_mutation.worker "
            f"--site {site} --pristine {pristine} --map {cmap} --column {column}")
    text = ["[cosmic-ray]", 'module-path = "."', "timeout = 3600.0", "excluded-modules = []",
            f'test-command = "{test}"', "", "[cosmic-ray.distributor]", f'name = "{distributor}"']
    if distributor == "http":
        text += ["", "[cosmic-ray.distributor.http]", "worker-urls = [" + ", ".join(f'"{u}"' for u in urls) + "]"]
    path.write_text("\n".join(text) + "\n")


def _engine_env() -> dict:
    """The environment of the engine's processes: without the copy on PYTHONPATH (the worker puts it
    first itself) and with the checkout importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(buildenv.PROJECT_ROOT)
    return env


def _start_zygote(env: dict):
    """Start ``harness.selfcheck.source_mutation.zygote`` and wait for its socket: (process, socket path), or
    None when it does not come up (the workers then judge in their own processes)."""
    import tempfile

    from harness.selfcheck.source_mutation import workspace

    folder = Path(tempfile.mkdtemp(prefix="muon-zygote-"))  # short: a unix socket path is <= 107 bytes
    sock = folder / "judge.sock"
    log = workspace.state_dir() / "zygote.log"
    proc = subprocess.Popen([sys.executable, "-m", "harness.selfcheck.source_mutation.zygote", "--socket", str(sock),
                             "--log", str(log)], env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not sock.exists():
        time.sleep(0.2)
    if not sock.exists():
        proc.kill()
        proc.wait()
        print(f"zygote did not start (see {log}); judging each mutant in a fresh process", flush=True)
        return None
    print(f"zygote: {sock} (log {log})", flush=True)
    return proc, str(sock)


def _commit() -> str:
    """The checkout's commit (with -dirty for local changes): what judged a ledger line."""
    r = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=10"], cwd=buildenv.PROJECT_ROOT,
                       capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def _bad_args(args) -> str | None:
    if args.sample is not None and args.sample < 1:
        return "--sample must be >= 1"
    if args.distributor == "http" and not args.worker_url:
        return "--distributor http needs at least one --worker-url"
    return tree_run.problem(args)


def _session_cmd(engine_py: Path, session: Path, cmap_path: Path, args, replaced: list[str],
                 ledger_file: Path) -> list[str]:
    """The command that builds the Cosmic Ray session (``harness.selfcheck.source_mutation.session``)."""
    cmd = [str(engine_py), "-m", "harness.selfcheck.source_mutation.session", "--session", str(session),
           "--map", str(cmap_path), "--seed", str(args.seed)]
    if args.sample is not None:
        cmd += ["--sample", str(args.sample)]
    if args.only:
        cmd += [f"--only={args.only}"]  # one token: a filter may start with "-"
    cmd += replaced + (["--judge-equivalents"] if args.judge_equivalents else [])
    if not args.fresh and not args.no_ledger:
        cmd += ["--ledger", str(ledger_file)]
    return cmd


def _open_session(engine_py: Path, copy: Path, session: Path, cmap_path: Path, args, replaced: list[str],
                  ledger_file: Path, env: dict) -> bool:
    """Build the session (or resume it) and make the ``--retry`` statuses pending; False when that failed."""
    if args.fresh or not session.exists():
        r = subprocess.run(_session_cmd(engine_py, session, cmap_path, args, replaced, ledger_file), cwd=copy,
                           env=env, capture_output=True, text=True)
        if r.returncode:
            print(r.stdout + r.stderr, file=sys.stderr)
            return False
        print(f"session {session.name}: {r.stdout.strip()}", flush=True)
        if args.prepare:
            print("session mutants: " + r.stderr.strip().rpartition("KEYS ")[2], flush=True)
    else:
        print(f"session {session.name}: resuming", flush=True)
    if args.retry and not args.fresh:
        r = subprocess.run([str(engine_py), "-m", "harness.selfcheck.source_mutation.session",
                            "--session", str(session), "--map", str(cmap_path), "--retry", args.retry,
                            *replaced], cwd=copy, env=env, capture_output=True, text=True)
        if r.returncode:
            print(r.stdout + r.stderr, file=sys.stderr)
            return False
        print(f"retry: {r.stdout.strip()}", flush=True)
    return True


def _exec(engine: Path, config: Path, session: Path, copy: Path, env: dict, args) -> None:
    """``cosmic-ray exec``: judge the pending mutants (in children of a warm zygote where it comes up)."""
    from harness.selfcheck.source_mutation import zygote

    server = _start_zygote(env) if args.zygote and args.distributor == "local" else None
    try:
        exec_env = env if server is None else dict(env, **{zygote.SOCKET_ENV: server[1]})
        r = subprocess.run([str(engine), "exec", str(config), str(session)], cwd=copy, env=exec_env)
    finally:
        if server is not None:
            server[0].kill()
            server[0].wait()
            shutil.rmtree(Path(server[1]).parent, ignore_errors=True)
    if r.returncode:
        print(f"cosmic-ray exec exited {r.returncode}", file=sys.stderr)


def _report(mutants, session: Path, tag: str, args, seconds: float) -> int:
    """Write the HTML report, print the summary and the verdict; the exit code."""
    from harness.selfcheck.source_mutation import report

    scope_file = Path(str(session) + ".scope.json")
    summary = report.Summary(mutants, seconds, title=f"Cosmic Ray source mutation ({tag}, {args.column} column)",
                             scope=json.loads(scope_file.read_text()) if scope_file.exists() else {})
    out = Path(args.report or ("reports/mutation.html" if args.sample is None and not args.only
                               else f"reports/mutation-{tag}.html"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.render_html(summary))
    print(summary.text())
    if len(mutants) <= 60:
        print("mutants: " + "; ".join(f"{m.key}={m.status}" for m in mutants))
    print(out)
    ok, reasons = report.verdict(mutants)
    print("verdict: " + ("PASS" if ok else "FAIL: " + "; ".join(reasons)))
    return 0 if ok else 1


def _coverage_map(column: str):
    """The coverage map (recorded once per source, scope and candidate set) and its path; says which
    candidate cases have no usable baseline."""
    from harness.selfcheck.source_mutation import coverage_map

    cmap, cmap_path = coverage_map.load_or_record(progress=lambda s: print(s, flush=True), column=column)
    usable = [n for n in cmap.cases if cmap.usable(n)]
    unusable = [f"{n} ({cmap.cases[n].status})" for n in cmap.cases if n not in usable]
    print(f"coverage map: {len(cmap.cases)} candidate cases, {len(usable)} usable baselines"
          + (f"; not usable: {', '.join(unusable)}" if unusable else ""), flush=True)
    return cmap, cmap_path


def run(args) -> int:
    """``python -m harness mutate --engine cosmic-ray`` with its options parsed (``harness.cli.parser``)."""
    problem = _bad_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    engine = engine_executable()
    if engine is None:
        print(f"error: Cosmic Ray not found: run `bash scripts/run.sh mutation` (makes .venv-mutation) or set "
              f"{ENGINE_ENV} to its cosmic-ray executable", file=sys.stderr)
        return 2
    if args.tree:
        checkout = tree_run.checkout_of(args.tree)
        if not tree_run.runs_here(checkout):
            return tree_run.run_in_tree(args, checkout)
        os.environ[scope.TREE_ENV] = str(checkout / "deepspeed")
    engine_py = engine.parent / "python"
    buildenv.apply_base_env()
    from harness.selfcheck.source_mutation import coverage_map, equivalents, ledger, patched, report, workspace

    t0 = time.perf_counter()
    lock = workspace.lock_copy(progress=lambda s: print(s, flush=True))  # noqa: F841 - held until exit
    pristine = workspace.installed_deepspeed()
    copy = workspace.ensure_copy(pristine)
    resolved = scope.resolve(pristine)
    workspace.use_copy()
    _, cmap_path = _coverage_map(args.column)
    state = workspace.state_dir()
    tag = session_tag(args.sample, args.seed, args.only, args.column, workspace.tree_key())
    session = state / "sessions" / f"{tag}.sqlite"
    session.parent.mkdir(parents=True, exist_ok=True)
    config = state / f"cosmic-ray-{args.distributor}{'' if args.column == 'stock' else '-' + args.column}.toml"
    write_config(config, workspace.site_dir(), pristine, cmap_path, args.distributor, args.worker_url, args.column)
    ledger_file = ledger.path_for(args.column if not args.tree else f"tree-{workspace.tree_key()}-{args.column}",
                                  coverage_map.source_digest())
    replaced: list[str] = []
    if args.column == "patched":
        spans_file = state / "patched-replaced.json"
        patched.dump(patched.spans(pristine), spans_file)
        replaced = ["--replaced", str(spans_file)]
    env = _engine_env()
    if not _open_session(engine_py, copy, session, cmap_path, args, replaced, ledger_file, env):
        return 2
    print(f"config: {config}\nsession: {session}", flush=True)
    if args.prepare:
        return 0
    _exec(engine, config, session, copy, env, args)
    workspace.ensure_copy(pristine)  # a killed exec may leave a mutant in the copy
    dump = subprocess.run([str(engine), "dump", str(session)], cwd=copy, env=env, capture_output=True, text=True)
    if dump.returncode:
        print(dump.stderr, file=sys.stderr)
        return 1
    mutants = report.read_dump(dump.stdout.splitlines(), resolved, equivalents.load(args.column))
    if not args.no_ledger:
        wrote = ledger.append(ledger_file, {m.key: m.record for m in mutants}, _commit())
        print(f"ledger: {wrote} new judged result(s) -> {ledger_file.relative_to(buildenv.PROJECT_ROOT)}", flush=True)
    return _report(mutants, session, tag, args, time.perf_counter() - t0)
