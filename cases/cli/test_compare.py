"""``compare``: the classes of a base/head pair, the sharded path the CI workflow takes, and its input errors.

The results are synthetic (``cases.report.synth``): the classes are a function of two records, so each
is checked on records built to be in it; the runs themselves are the gate's, tested elsewhere.
"""
from __future__ import annotations

import json
import re
import shlex
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
    labels = {"base": "0.19.6 (source checkout) at /b", "head": "0.19.6 (source checkout) at /h"}
    a = _shard_out(tmp_path / "out-1", {"case-a": (("xfailed", ("DSM-101",)), ("passed",)),
                                        "case-b": (("passed",), ("failed",))}, labels)
    b = _shard_out(tmp_path / "out-2", {"case-c": (("xfailed", ("DSM-003",)), ("xfailed", ("DSM-003",))),
                                        "case-d": (("passed",), ("passed",))}, labels)
    rc = main(["compare", "--merge", str(a), str(b), "--out", str(tmp_path / "merged")])
    assert rc == 1  # case-b regressed
    md = (tmp_path / "merged" / "summary.md").read_text()
    counts = dict(re.findall(r"^\| ([a-z ]+) \| (\d+) \|$", md, re.M))
    assert counts == {"regressed": "1", "fixed": "1", "still present": "1", "changed": "0", "cannot judge": "0",
                      "not on both": "0", "unchanged": "1"}
    assert "- **DSM-101**: fixed in 1 (passing on head in 1)" in md and "- **DSM-003**: still present in 1" in md
    reg = md[md.index("## Regressions"):]
    assert "`case-b`: failed" in reg and "-m harness run --case" in reg
    assert f"reproduce on head ({labels['head']}): `" in reg  # the tree the command must run against
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
