"""Sharding the gate over machines: the split is a partition, the same everywhere, balanced on cost,
and N shards run in separate processes merge into the statuses of the unsharded gate."""
from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest

from harness.launch import shard as sharding
from harness.catalog.matrix import gate_cases
from harness.report.results import load_records, record_files, record_lines

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text", ["", "3", "0/2", "3/2", "1/0", "a/b", "1/2/3"])
def test_bad_shard_is_refused_with_the_form_it_takes(text):
    with pytest.raises(ValueError, match="K/N"):
        sharding.Shard.parse(text)


def test_bad_shard_on_the_command_line_exits_2_before_any_rank(capsys):
    from harness.cli.main import main

    assert main(["gate", "--shard", "5/4", "--only", "no-such-case"]) == 2
    assert "K between 1 and N" in capsys.readouterr().err


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_partition_the_full_product(count):
    cases = gate_cases(full=True)
    parts = [sharding.select(cases, sharding.Shard(k, count)) for k in range(1, count + 1)]
    names = [c.name for p in parts for c in p]
    assert sorted(names) == sorted(c.name for c in cases)  # every case once, none twice


def test_split_is_deterministic_and_independent_of_input_order():
    costs = {f"c{i}": float((i * 37) % 11 + 1) for i in range(50)}
    a = sharding.assign(costs, 4)
    b = sharding.assign(dict(reversed(list(costs.items()))), 4)
    assert a == b


def test_split_is_balanced_within_the_lpt_bound():
    # Greedy LPT: no shard exceeds the mean load by more than the largest single cost.
    costs = {f"c{i}": float((i * 7919) % 97 + 1) for i in range(200)}
    for n in (2, 3, 5, 8):
        loads = [sum(costs[x] for x in s) for s in sharding.assign(costs, n)]
        assert max(loads) <= sum(costs.values()) / n + max(costs.values())
    # ... and a split by count would not be: the one expensive case must sit alone.
    skew = {"big": 100.0, **{f"s{i}": 1.0 for i in range(10)}}
    shards = sharding.assign(skew, 2)
    assert ["big"] in shards


def test_unknown_cases_are_costed_by_what_drives_their_cost():
    base = next(c for c in gate_cases() if c.offload == "none" and c.world_size == 2)
    assert sharding.estimate(base.replace(compiled=True)) > sharding.estimate(base)
    assert sharding.estimate(base.replace(world_size=3)) > sharding.estimate(base)


def test_recorded_times_cover_only_known_case_names():
    times = sharding.load_times()
    known = {c.name for c in gate_cases(full=True)}
    stale = sorted(set(times) - known)
    # A stale entry is harmless for correctness but means the bench was not rerun after a rename.
    assert len(stale) <= len(times) // 2, f"case_times.json is stale: {stale[:5]}..."


# 8 CI cases, ~5 s of case time over both columns, passes and strict xfails of four paths: a gate run
# here is mostly its start-up (imports, ranks), so a larger family adds time and no other property
SHARD_FAMILY = "z2-none-fp16-ws2"


def _gate(tmp: Path, name: str, *extra: str, out: list | None = None) -> Path:
    report = tmp / f"{name}.html"
    proc = subprocess.run([sys.executable, "-m", "harness", "gate", "--only", SHARD_FAMILY, "--no-mutate", "-q",
                           "--report", str(report), *extra], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    if out is not None:
        out.append(proc.stdout)
    return tmp / f"{name}-results"


def _statuses(folder: Path) -> dict[tuple[str, str], str]:
    return {(r.case_name, r.column): r.status for r in load_records(folder)}


@pytest.mark.pipeline
def test_two_shards_in_separate_processes_merge_into_the_unsharded_statuses(tmp_path):
    whole = _statuses(_gate(tmp_path, "whole"))
    s1 = _gate(tmp_path, "s1", "--shard", "1/2")
    s2 = _gate(tmp_path, "s2", "--shard", "2/2")
    one, two = _statuses(s1), _statuses(s2)
    assert one and two and not set(one) & set(two)  # both shards ran something, nothing twice
    merged_html = tmp_path / "merged.html"
    proc = subprocess.run([sys.executable, "-m", "harness", "report", str(s1), str(s2), "-o", str(merged_html)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    merged = _statuses(tmp_path / "merged-results")
    assert merged == whole
    bad = any(s in ("failed", "error", "xpassed") for s in whole.values())
    assert proc.returncode == (1 if bad else 0), proc.stdout + proc.stderr
    assert merged_html.exists() and "verdict: " in proc.stdout
    # --jobs 2: the same two shards run side by side by one command, merged into one report
    out: list[str] = []
    jobs = _statuses(_gate(tmp_path, "jobs", "--jobs", "2", out=out))
    assert jobs == whole
    assert "gate (all 2 shards)" in out[0] and (tmp_path / "jobs.html").exists()
    assert sorted(p.name for p in (tmp_path / "jobs-results").glob("run-*.json")) == [
        "run-gate-shard1of2.json", "run-gate-shard2of2.json", "run-gate.json"]  # one folder, each writer its plan
    assert _recorded_once(tmp_path / "jobs-results") and not (tmp_path / "jobs-results" / sharding.CLAIMS).exists()
    # a --jobs shard whose partner never ran: its own cases, then every one of the other's, so the folder
    # holds the whole gate, each case-column judged once, all by this shard
    alone = _gate(tmp_path, "alone", "--shard", "2/2", "--steal")
    assert _statuses(alone) == whole and _recorded_once(alone)
    assert [p.name for p in alone.glob("results-*")] == ["results-gate-shard2of2.jsonl.gz"]


def _recorded_once(folder: Path) -> bool:
    """No case-column has two records in the folder (``load_records`` keeps the last of two)."""
    keys = [(r["case_name"], r["column"]) for path in record_files(folder)
            for r in map(json.loads, record_lines(path))]
    return bool(keys) and len(keys) == len(set(keys))


def test_a_shard_takes_the_others_cases_from_their_ends_in_turn():
    """A --jobs shard out of work takes what the others would reach last, one shard after another, and
    never one of its own."""
    cases = gate_cases(False)
    for k in (1, 2, 3):
        part = sharding.Shard(k, 3)
        parts = sharding.assign(sharding.costs_for(cases), 3)
        mine = {c.name for c in sharding.select(cases, part)}
        taken = [c.name for c in sharding.taken_from_the_end(cases, part, parts)]
        assert len(taken) == len(set(taken)) and set(taken) == {c.name for c in cases} - mine
        order = [c.name for c in cases]
        others = [sorted(parts[j], key=order.index) for j in range(3) if j != k - 1]
        assert taken[:2] == [others[0][-1], others[1][-1]]  # each other shard's last case first, in turn
        assert [n for n in taken if n in set(others[0])] == others[0][::-1]


def _claim_all(root: str, keys: list[str], out) -> None:
    out.put([k for k in keys if sharding.claim(Path(root), k)])


def test_each_case_column_is_claimed_by_exactly_one_of_several_processes(tmp_path):
    keys = [f"case-{i}\tstock" for i in range(200)]
    q = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=_claim_all, args=(str(tmp_path), keys, q)) for _ in range(3)]
    for proc in procs:
        proc.start()
    got = [q.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    claimed = [k for part in got for k in part]
    assert sorted(claimed) == sorted(keys)  # every key once, whoever got there first
    sharding.clear_claims(tmp_path)
    assert sharding.claim(tmp_path, keys[0])  # a stopped run's claims are cleared before the next


def test_case_times_refreshed_from_a_gate_runs_stored_outcomes(tmp_path):
    """``bench --from-results``: a gate run's own outcomes give the shards' costs, summed per case over
    the columns, without rerunning anything."""
    import json

    sys.path.insert(0, str(ROOT / "cases" / "report"))
    import synth

    from harness.cli.bench import times_from_results

    root = tmp_path / "results"
    a_stock, _ = synth.passing("-a")
    a_patched, _ = synth.passing("-a", column="patched", name=a_stock.case_name)
    b_stock, _ = synth.passing("-b")
    a_stock.seconds, a_patched.seconds, b_stock.seconds = 1.5, 2.0, 4.0
    synth.write(root, [(a_stock, {}), (a_patched, {}), (b_stock, {})])
    (root / "extra-gate-shard1of2.json").write_text(json.dumps({"selfcheck_seconds": {"patched": 128.4}}))
    (root / "extra-gate-shard2of2.json").write_text(json.dumps({"selfcheck_seconds": {"stock": 12.0}}))
    out = tmp_path / "times.json"
    assert times_from_results(root, "cmd", path=out) == 0
    data = json.loads(out.read_text())
    assert data["cases"] == {a_stock.case_name: 3.5, b_stock.case_name: 4.0} and data["measured_by"] == "cmd"
    # the self-checks' measured seconds: what the shard that runs one is given fewer cases for
    assert data["selfchecks"] == {"patched": 128.4, "stock": 12.0}
    assert sharding.load_selfcheck_times(out) == {"patched": 128.4, "stock": 12.0}
    assert times_from_results(tmp_path / "empty", "cmd", path=out) == 2  # no outcomes: an error, not an empty table


def test_a_slice_measured_refreshes_its_cases_and_keeps_the_others(tmp_path):
    """A results folder of a slice (``--only``, one shard) must not erase the recorded costs of the
    cases it did not run: once it did, and the next split balanced 213 cases on guesses."""
    import json

    from harness.launch import shard as sharding

    path = tmp_path / "times.json"
    sharding.write_times({"a": 1.0, "b": 2.0}, "first", path)
    sharding.write_times({"b": 5.0, "c": 3.0}, "second", path)
    data = json.loads(path.read_text())
    assert data["cases"] == {"a": 1.0, "b": 5.0, "c": 3.0} and data["measured_by"] == "second"


def test_a_jobs_shard_gets_a_dash_filter_as_one_token(tmp_path):
    """``gate --only=-none-fp32- --jobs 2``: each shard's command line must parse back to the same filter
    (as two tokens its parser read "-none-fp32-" as an option and every shard exited 2)."""
    from harness.cli.main_job import GateArgs, shard_args
    from harness.cli.parser import build_parser

    a = GateArgs(report=str(tmp_path / "g.html"), only="-none-fp32-", jobs=2, results=str(tmp_path / "r"))
    for argv in shard_args(a):
        assert build_parser().parse_args(["gate", *argv]).only == "-none-fp32-"


def test_the_progress_line_counts_the_self_checks_in_its_eta(tmp_path):
    """After a gate's last case-column the shards still run the mutation self-checks: the line says so,
    and its share and ETA count their planned seconds (an ETA of 0 for minutes read as a hang, and at
    the halfway point an ETA without them was short by their whole cost)."""
    import json

    from harness.case.scenarios import pipeline_case
    from harness.cli.main_job import Progress

    c = pipeline_case(1, "none", "fp32", 1)
    pairs = [(c, "stock"), (c, "patched")]
    with open(tmp_path / "results-x.jsonl", "w") as f:
        for col in ("stock", "patched"):
            f.write(json.dumps({"case_name": c.name, "column": col, "status": "passed", "message": ""}) + "\n")
    cases_s = sharding.costs_for([c])[c.name]
    p = Progress(tmp_path, pairs, selfcheck_s=3 * cases_s)
    p()
    assert "self-checks are running" in p.line(60.0) and "25% of the measured cost" in p.line(60.0), p.line(60.0)
    assert "ETA 3m00s" in p.line(60.0), p.line(60.0)  # a quarter done in 60 s: 180 s to go
    with open(tmp_path / "selfcheck-x.jsonl", "w") as f:
        f.write(json.dumps({"check": "patched", "case": c.name, "mutant": None, "cost": 1.4 * cases_s}) + "\n")
    p()
    assert "60% of the measured cost" in p.line(60.0), p.line(60.0)
    plain = Progress(tmp_path, pairs)
    plain()
    assert "2/2 case-columns (100% of the measured cost)" in plain.line(65.0), plain.line(65.0)
    assert "self-checks" not in plain.line(65.0)


def test_the_self_checks_cost_is_planned_from_the_runs_the_kill_matrix_makes():
    """The estimate counts the runs ``_run_matrix`` makes (baselines, then each mutant where it runs), so
    the shard that runs a self-check gets that many seconds fewer cases."""
    from harness.registry.mutants import MUTANTS
    from harness.selfcheck import kill_matrix as km

    cases = km.default_kill_cases()
    runs = km.planned_runs(cases, list(MUTANTS))
    assert runs[:len(cases)] == [(c, None) for c in cases]
    skipped = [(c.name, m) for m in MUTANTS for c in cases if (c, m) not in runs[len(cases):]]
    assert skipped and all(km._skip_reason(next(x for x in cases if x.name == n), m) for n, m in skipped)
    costs = {c.name: 2.0 for c in cases}
    assert km.selfcheck_cost("patched", costs) == len(runs)
    loads = [10.0, 0.0]
    names = {f"c{i}": 1.0 for i in range(10)}
    split = sharding.assign(names, 2, loads)
    assert len(split[0]) == 0 and len(split[1]) == 10


def test_the_self_check_runs_noted_add_up_to_the_seconds_the_progress_line_planned(tmp_path):
    """Each self-check run is noted at its case's share of the planned seconds (measured, where
    recorded), so the progress line reaches its total when the last run ends, not before or after."""
    import json

    from harness.cli.main_job import GateArgs, _selfcheck_note
    from harness.selfcheck import kill_matrix as km

    a = GateArgs(report=str(tmp_path / "g.html"), results=str(tmp_path / "r"))
    a.results_dir.mkdir(parents=True)
    note = _selfcheck_note(a, "w")
    for c, m in km.planned_runs(km.stock_kill_cases(), list(km.STOCK_KILL_MUTANTS)):
        note("stock", c, m)
    rows = [json.loads(x) for x in (a.results_dir / "selfcheck-w.jsonl").read_text().splitlines()]
    assert len(rows) == len(km.planned_runs(km.stock_kill_cases(), list(km.STOCK_KILL_MUTANTS)))
    assert abs(sum(r["cost"] for r in rows) - km.selfcheck_cost("stock")) < 1e-6 * km.selfcheck_cost("stock")
