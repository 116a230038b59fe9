"""``compare``: the classes of a base/head pair, the sharded path the CI workflow takes, and its input errors.

The results are synthetic (``cases.report.synth``): the classes are a function of two records, so each
is checked on records built to be in it; the runs themselves are the gate's, tested elsewhere.
"""
from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest
import yaml

from cases.report import synth
from harness.cli import compare as cli_compare
from harness.cli.main import main
from harness.cli.parser import build_parser
from harness.report import compare
from harness.report.results import ResultStore

ROOT = Path(__file__).resolve().parents[2]


def _rec(kind: str, name: str, bug_ids=()):
    if kind == "passed":
        return synth.passing(name=name)[0]
    if kind == "skipped":
        rec = synth.passing(name=name)[0]
        rec.status, rec.message = "skipped", f"{name}: deselected on DeepSpeed X: no such feature (per-head-muon)"
        return rec
    if kind == "unjudged":
        rec = synth.passing(name=name)[0]
        rec.status, rec.message = "unjudged", f"{name}: cannot judge: probe z3_muon_placement(none): no known shape"
        return rec
    rec = synth.failing(status=kind, bug_ids=bug_ids)[0]
    rec.case_name, rec.key = name, f"{name}-stock"  # the record key is per case-column
    return rec


@pytest.mark.parametrize("base, head, want", [
    (("passed",), ("passed",), "unchanged"),
    (("xfailed", ("DSM-101",)), ("passed",), "fixed"),
    (("failed",), ("passed",), "fixed"),
    (("passed",), ("failed",), "regressed"),
    (("passed",), ("error",), "regressed"),
    (("passed",), ("xfailed", ("DSM-003",)), "regressed"),
    (("xfailed", ("DSM-003",)), ("xfailed", ("DSM-003",)), "still present"),
    (("xfailed", ("DSM-003",)), ("xfailed", ("DSM-003", "DSM-108")), "changed"),
    (("failed",), ("error",), "changed"),
    (("passed",), ("unjudged",), "cannot judge"),
    (("unjudged",), ("passed",), "cannot judge"),
    (("skipped",), ("passed",), "not on both"),
    (("skipped",), ("skipped",), "unchanged"),
])
def test_each_class_of_a_case_column(base, head, want):
    got, why = compare.classify(_rec(*base[:1], "c", *base[1:]), _rec(*head[:1], "c", *head[1:]))
    assert got == want
    if want in ("cannot judge", "not on both"):
        assert why and ("probe" in why or "deselected" in why), why


def test_a_case_missing_on_one_side_cannot_be_judged():
    assert compare.classify(None, _rec("passed", "c"))[0] == "cannot judge"


def _shard_out(root: Path, records: dict[str, tuple], labels: dict) -> Path:
    root.mkdir(parents=True)
    for role in ("base", "head"):
        store = ResultStore(root / f"{role}-results", writer="main")
        for name, (b, h) in records.items():
            store.add(_rec(*(b if role == "base" else h)[:1], name, *(b if role == "base" else h)[1:]))
    (root / "compare.json").write_text(json.dumps({"labels": labels}))
    return root


def test_shards_merge_into_one_summary_with_the_regression_and_its_reproducer(tmp_path):
    labels = {"base": "DeepSpeed-master", "head": "DeepSpeed-pr"}
    records = [{"case-a": (("xfailed", ("DSM-101",)), ("passed",)), "case-b": (("passed",), ("failed",))},
               {"case-c": (("xfailed", ("DSM-003",)), ("xfailed", ("DSM-003",))), "case-d": (("passed",), ("passed",))}]
    parts = [_shard_out(tmp_path / f"out-{i}", recs, labels) for i, recs in enumerate(records, 1)]
    rc = main(["compare", "--merge", *map(str, parts), "--out", str(tmp_path / "merged")])
    assert rc == 1  # case-b regressed
    md = (tmp_path / "merged" / "summary.md").read_text()
    every = {k: v for recs in records for k, v in recs.items()}
    want = Counter(compare.classify(_rec(*b[:1], k, *b[1:]), _rec(*h[:1], k, *h[1:]))[0] for k, (b, h) in every.items())
    counts_line = next(ln for ln in md.splitlines() if "case-columns of the stock column" in ln)
    said = dict(re.findall(r"([a-z ]+) (\d+)", counts_line.split(": ", 1)[1].replace("*", "").replace(" · ", ",")))
    assert {k.strip(","): int(v) for k, v in said.items()} == {c: want[c] for c in compare.CLASSES}
    assert "- **DSM-101**: fixed in 1 (e.g. `case-a`)" in md and "- **DSM-003**: still present in 1" in md
    reg = md[md.index("## Regressions"):]
    assert "`case-b`: head failed" in reg and "diverged" not in reg.splitlines()[1]  # the symptom, not the message
    assert "`bash scripts/run.sh compare --base DeepSpeed-master --head DeepSpeed-pr --only=case-b`" in reg
    assert "case-b" in (tmp_path / "merged" / "compare.html").read_text()


def test_merging_shards_of_different_trees_is_bad_input(tmp_path):
    a = _shard_out(tmp_path / "a", {"x": (("passed",), ("passed",))}, {"base": "A", "head": "B"})
    b = _shard_out(tmp_path / "b", {"y": (("passed",), ("passed",))}, {"base": "A", "head": "C"})
    assert main(["compare", "--merge", str(a), str(b), "--out", str(tmp_path / "m")]) == 2
    assert main(["compare", "--merge", str(tmp_path), "--out", str(tmp_path / "m")]) == 2


@pytest.mark.parametrize("spec", ["0.19", "no/such/folder", "/tmp@nothex"])
def test_a_side_that_names_no_tree_is_refused_before_anything_runs(spec, tmp_path, capsys):
    assert main(["compare", "--base", spec, "--head", "installed", "--out", str(tmp_path / "o")]) == 2
    assert "give a release" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_folder_that_is_no_deepspeed_checkout_is_refused(tmp_path):
    with pytest.raises(cli_compare.CompareInputError, match="not a DeepSpeed source checkout"):
        cli_compare.parse_side("base", str(tmp_path))


def test_the_workflow_runs_the_shard_and_merge_commands_tested_here():
    """Every ``run.sh compare`` line of the workflow parses as a compare command, one shards with the
    matrix's K/N over as many jobs as the matrix has, and one merges the shards' folders."""
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "compare.yml").read_text())
    jobs = flow["jobs"]
    shards = len(jobs["shard"]["strategy"]["matrix"]["k"])
    assert int(flow["env"]["SHARDS"]) == shards
    lines = [ln for job in jobs.values() for step in job["steps"] for ln in step.get("run", "").splitlines()
             if "run.sh compare" in ln]
    parsed = []
    for ln in lines:
        text = (ln.replace("${{ matrix.k }}", "1").replace("$SHARDS", str(shards)).replace('"$base"', "A")
                .replace('"$head"', "B"))
        argv = shlex.split(text.split("run.sh", 1)[1].split("|")[0])
        parsed.append(build_parser().parse_args(argv))
    assert any(a.shard == f"1/{shards}" and a.base and a.head for a in parsed)
    assert any(a.merge for a in parsed)


def test_a_filter_that_starts_with_a_dash_reaches_each_side_as_one_token():
    args = build_parser().parse_args(["compare", "--base", "0.19.7", "--head", "installed", "--only=-none-fp32-"])
    extra = cli_compare.gate_args_of(args)
    gate = build_parser().parse_args(["gate", *extra])
    assert gate.only == "-none-fp32-"
