"""A command's processes end with it, however it ends, and its scratch folder goes with them
(``harness.launch.lifecycle``); a results folder says what its runs planned and did not judge
(``harness.report.results`` plans), and the report never calls such a folder PASS."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.catalog import matrix as catalog
from harness.launch import lifecycle
from harness.report import results
from harness.report.build import render
from harness.report.build import verdict as report_verdict

ROOT = Path(__file__).resolve().parents[2]

# A command inside a scope that starts the three kinds of process the harness starts: an exec'd child
# (a shard, a torchrun rank), a child in a session of its own (a pool rank) with a grandchild (its JIT
# build), and a forked child that never execs. It prints "ready" and waits to be ended.
# It exits as ``python -m harness`` does when stopped (``harness.cli.main``).
TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from harness.launch import lifecycle
    try:
        with lifecycle.command_scope() as scratch:
            kids = [subprocess.Popen(["sleep", "300"]),
                    subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"], start_new_session=True)]
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a pool rank does
                time.sleep(300)
                os._exit(0)
            time.sleep(1.5)  # the reaper records the descendants twice a second
            print("ready", scratch, flush=True)
            time.sleep(300)
    except lifecycle.Interrupted as exc:
        sys.exit(exc.exit_code)
""")


def _start_tree(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MUON_HARNESS_SCRATCH_BASE=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    line = proc.stdout.readline().split()
    assert line and line[0] == "ready", line
    return proc, Path(line[1])


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_nothing_of_a_command_outlives_it(tmp_path, sig):
    proc, scratch = _start_tree(tmp_path)
    run_id = lifecycle.run_id_of(scratch)
    assert len(lifecycle.marked(run_id)) >= 3  # the marker is seen: the check below can fail
    os.kill(proc.pid, sig)
    rc = proc.wait(timeout=30)
    assert rc == (-9 if sig == signal.SIGKILL else 143)  # SIGTERM: Interrupted, 128 + 15
    time.sleep(5)
    assert lifecycle.survivors(run_id, group=proc.pid, parent=proc.pid) == []
    assert not scratch.exists()


def test_a_dead_commands_scratch_folder_is_cleaned_at_the_next_start(tmp_path):
    stale = tmp_path / f"{lifecycle.SCRATCH_PREFIX}0123456789ab-xyz"
    (stale / "pool").mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (stale / "owner").write_text(json.dumps({"pid": dead.pid, "start": 1}))
    live = tmp_path / f"{lifecycle.SCRATCH_PREFIX}ba9876543210-xyz"
    live.mkdir()
    (live / "owner").write_text(json.dumps({"pid": os.getpid(), "start": lifecycle.start_time(os.getpid())}))
    assert lifecycle.clean_stale(tmp_path) == [stale]
    assert not stale.exists() and live.exists()


def _record(name: str, column: str) -> results.CaseRecord:
    case = next(c for c in catalog.gate_cases(False) if c.name == "z1-none-fp32-ws1").replace(name=name)
    return results.error_record(case, column=column, message="m", seconds=0.1, status="passed")


def test_a_folder_missing_planned_case_columns_is_incomplete_never_pass(tmp_path):
    root = tmp_path / "gate-results"
    planned = [results.Planned(n, col) for n in ("a", "b") for col in ("stock", "patched")]
    results.write_plan(root, "gate", planned, ["patched"], {"report": "x"})
    store = results.ResultStore(root, writer="gate")
    for p in planned[:3]:
        store.add(_record(p.case_name, p.column))
    with open(root / "results-gate.jsonl", "a") as f:
        f.write('{"key": "torn')  # a writer killed mid-line
    state = results.completeness(root)
    assert (state.planned, state.judged, state.missing) == (4, 3, [results.Planned("b", "patched")])
    assert state.selfchecks_missing == ["patched"] and not state.complete
    ok, reasons = report_verdict(root)
    assert not ok and reasons[0].startswith("INCOMPLETE: judged 3 of 4")
    page = render(root, tmp_path / "r.html").read_text()
    assert "class='vword'>INCOMPLETE" in page and "PASS" not in page.split("</header>")[0]
    # the last case-column and the self-check arrive (a resume): complete, and PASS
    store.add(_record("b", "patched"))
    results.write_plan(root, "gate-resume1", [], ["patched"], {"report": "x"})
    results.finish_plan(root, "gate-resume1", selfchecks_done=["patched"], interrupted=None)
    assert results.completeness(root).complete
    assert report_verdict(root) == (True, [])


def test_a_gates_end_reads_its_folder_once_and_the_report_verdict_never_compares_records(tmp_path, monkeypatch,
                                                                                          capsys):
    """The end of a gate (the report, the completeness, the map pruning, the summary) reads the records
    once: a ``--full`` folder takes ~2 s per read. ``harness report``'s verdict sorts the records by
    kind, never by comparing them pairwise (4856 records: 18 s)."""
    from harness.cli import main as cli_main
    from harness.cli import main_job
    from harness.report import build

    root = tmp_path / "gate-results"
    planned = [results.Planned(n, col) for n in ("a", "b") for col in ("stock", "patched")]
    results.write_plan(root, "gate", planned, [], {"report": "x"})
    store = results.ResultStore(root, writer="gate")
    for p in planned:
        store.add(_record(p.case_name, p.column))
    reads = []
    real = results.load_records
    counted = lambda folder: reads.append(folder) or real(folder)  # noqa: E731
    for module in (results, build, main_job):
        monkeypatch.setattr(module, "load_records", counted)
    args = main_job.GateArgs(report=str(tmp_path / "gate.html"), results=str(root))
    assert main_job._report_run(args, "gate: 2 cases", None, None) == 0
    assert len(reads) == 1 and (tmp_path / "gate.html").exists()
    assert "gate: 2 cases: 4 passed" in capsys.readouterr().out
    monkeypatch.setattr(results.CaseRecord, "__eq__", lambda self, other: pytest.fail("records compared"))
    reads.clear()
    assert cli_main.main(["report", str(root), "-o", str(tmp_path / "again.html")]) == 0
    assert len(reads) == 1 and capsys.readouterr().out.endswith("verdict: PASS\n")


def test_a_command_run_inside_a_process_spares_the_children_it_already_had(tmp_path, monkeypatch):
    """``main`` called in a process that already has children (a pytest worker's rank pools): the scope's
    reaper ends only what the command started."""
    monkeypatch.setenv("MUON_HARNESS_SCRATCH_BASE", str(tmp_path))
    older = subprocess.Popen(["sleep", "60"])
    try:
        with lifecycle.command_scope():
            newer = subprocess.Popen(["sleep", "60"])
            time.sleep(1.5)  # recorded by the reaper
        newer.wait(timeout=10)  # ended by the reaper
        assert older.poll() is None
    finally:
        older.kill()
