"""The report's numbers mean what they say: each outcome shows the figure that decided its status,
labelled (an xfail's ratio against its bug's model, "crash" for an expected crash), a ratio from an
allowance at its rounding floor is not printed as digits, and the marks of the kill matrix are
explained on the page.

The records are built by the code the gate stores them with (``harness.judge.compare`` checks into a
``Verdict``, ``harness.gate.decide.record`` into a ``ResultStore``), so a figure lost on the way from
the judge to the page fails here.
"""
from __future__ import annotations

import dataclasses
import html
import json
import re

import numpy as np
import pytest

import synth
from harness.case.scenarios import pipeline_case
from harness.gate import decide
from harness.judge.compare import compare_arrays
from harness.judge.verdict import Verdict
from harness.report import build as report
from harness.report.results import ResultStore, error_record, load_records
from oracles import Allowance, subnormal_half_spacing

UNIT = Allowance(atol=1e-3, rtol=0.0, derivation="unit test")
FLOOR = Allowance(atol=subnormal_half_spacing("fp32"), rtol=0.0, derivation="oracle of zero: the fp32 rounding floor")


def _verdict(case, quantities: dict[str, float], allowance: Allowance = UNIT) -> Verdict:
    """A verdict whose check of each quantity has exactly the given error (its ratio: error / atol)."""
    checks = [compare_arrays(case.name, "layer0.weight", q, 1, np.array([err, 0.0]), np.zeros(2), allowance,
                             keep_map=False) for q, err in quantities.items()]
    return Verdict(case=case, mode="emulated", checks=checks)


def _stored(tmp_path, outcomes) -> tuple[str, dict]:
    """(page, records by case name) after ``decide.record`` stored each outcome and the report rendered."""
    root = tmp_path / "results"
    store = ResultStore(root)
    for o in outcomes:
        decide.record(store, o)
    page = report.render(root, tmp_path / "r.html").read_text()
    return page, {r.case_name: r for r in load_records(root)}


def _cell(page: str, name: str) -> str:
    grid = page[page.index("id='grid'"):page.index("id='details'")]
    row = re.search(r"<tr data-case='%s'>(.*?)</tr>" % re.escape(name), grid, re.S)
    assert row, f"no grid row for {name}"
    return row.group(1)


def _judged_line(page: str, name: str) -> str:
    details = re.search(r"<details class='case [^']*' id='[^']+' data-case='%s'.*?</details>" % re.escape(name),
                        page, re.S)
    assert details, f"no details section for {name}"
    line = re.search(r"<p class='judged'>(.*?)</p>", details.group(0))
    assert line, f"no judged line in the details of {name}"
    return line.group(1)


def _case(suffix: str, **kw):
    c = pipeline_case(kw.pop("stage", 2), kw.pop("offload", "none"), kw.pop("dtype", "fp32"), 2, steps=2, **kw)
    return c.replace(name=c.name + suffix)


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """A DSM-001-like xfail (far from the intended oracle, close to its bug's model), a DSM-002 NVMe xfail
    (the numbers are the intended ones, only the swap differs), an unused-layer xfail whose intended ratio
    is ~7e44 (a gradient of 0.488 where the oracle is 0), a crash xfail and a plain pass."""
    tmp = tmp_path_factory.mktemp("judged")
    far, nvme, unused, crash, ok = (_case("-far"), _case("-nvme", offload="nvme", stage=1), _case("-unused"),
                                    _case("-crash"), _case("-ok"))
    outcomes = [
        decide.Outcome(far, "stock", "xfailed", ["DSM-001"], f"{far.name}: diverges as DSM-001 predicts", 0.1,
                       _verdict(far, {"momentum": 3.0, "master": 0.2}), strength="full",
                       model_verdict=_verdict(far, {"momentum": 2.5e-4, "master": 1e-4})),
        decide.Outcome(nvme, "stock", "xfailed", ["DSM-002"], f"{nvme.name}: diverges as DSM-002 predicts", 0.1,
                       _verdict(nvme, {"momentum": 4.1e-4}), swapped_bytes=0, strength="full",
                       model_verdict=_verdict(nvme, {"momentum": 4.1e-4})),
        decide.Outcome(unused, "stock", "xfailed", ["DSM-023"], f"{unused.name}: diverges as DSM-023 predicts", 0.1,
                       _verdict(unused, {"grad": 0.488}, FLOOR), strength="full",
                       model_verdict=_verdict(unused, {"grad": 3e-4})),
        decide.Outcome(crash, "stock", "xfailed", ["DSM-012"], f"{crash.name}: crashed exactly as DSM-012 predicts",
                       0.1, strength="crash"),
        decide.Outcome(ok, "stock", "passed", [], f"{ok.name}: all checks within tolerance", 0.1,
                       _verdict(ok, {"momentum": 5e-4})),
    ]
    page, recs = _stored(tmp, outcomes)
    return page, recs, {o.case.name: o for o in outcomes}


def test_an_xfail_stores_and_shows_its_ratio_against_the_bug_model(judged):
    page, recs, outcomes = judged
    name = next(n for n in recs if n.endswith("-far"))
    rec, o = recs[name], outcomes[name]
    assert rec.model_ratio == pytest.approx(o.model_verdict.worst_ratio) and rec.model_ratio == pytest.approx(0.25)
    assert rec.worst_ratio == pytest.approx(o.verdict.worst_ratio) and rec.worst_ratio == pytest.approx(3000.0)
    cell = _cell(page, name)
    assert "<span class='ratio'>0.25&times; <i>model</i></span>" in cell, cell
    assert re.search(r"<span class='ratio' title='[^']*model of DSM-001[^']*'>worst 0\.25&times; "
                     r"<i>model</i></span>", page)  # the details' summary says why
    assert "3e+03&times;" not in cell  # the intended ratio is not what decided an excused case
    judged_line = _judged_line(page, name)
    assert "intended oracle: worst 3e+03&times;" in judged_line and "switched on: worst 0.25&times;" in judged_line


def test_a_nvme_xfail_says_the_swap_decided_and_its_numbers_matched_the_model(judged):
    page, recs, _ = judged
    name = next(n for n in recs if n.endswith("-nvme"))
    cell = _cell(page, name)
    assert "0.41&times; <i>model</i>" in cell  # labelled: within the model, not "diverged 0.41x"
    judged_line = _judged_line(page, name)
    assert "DSM-002 predicts a divergence in swap; 0 bytes swapped to NVMe" in judged_line


def test_a_ratio_from_a_floor_allowance_is_not_shown_as_digits(judged):
    page, recs, _ = judged
    name = next(n for n in recs if n.endswith("-unused"))
    rec = recs[name]
    assert rec.worst_ratio == pytest.approx(0.488 / FLOOR.atol) and rec.worst_ratio > 1e44  # stored as it is
    assert "e+44" not in page and "e+45" not in page
    judged_line = _judged_line(page, name)
    assert "intended oracle: worst &gt; 1e30&times;" in judged_line
    details = page[page.index(f"data-case='{name}' data-column='stock'>"):]
    rows = re.findall(r"<td class='num ratio'>([^<]+)</td>", details)
    assert rows and rows[0] == "&gt; 1e30&times;"  # the quantities table, next to the error and its allowance


def test_a_crash_xfail_shows_crash_not_a_zero_ratio(judged):
    page, recs, _ = judged
    name = next(n for n in recs if n.endswith("-crash"))
    cell = _cell(page, name)
    assert ">crash</span>" in cell and "0&times;" not in cell
    titles = [html.unescape(t) for t in re.findall(r"<span class='ratio' title='([^']*)'>crash</span>", page)]
    assert titles and all("crashed exactly as its bug" in t for t in titles)


def test_a_pass_still_shows_its_worst_ratio_unlabelled(judged):
    page, recs, _ = judged
    name = next(n for n in recs if n.endswith("-ok"))
    cell = _cell(page, name)
    assert "0.5&times;</span>" in cell and "<i>" not in cell


def test_a_record_without_a_model_ratio_labels_its_ratio_as_the_intended_oracles(tmp_path):
    """Records stored before the field existed load with ``model_ratio`` None and do not claim a model."""
    root = tmp_path / "results"
    rec, maps = synth.failing("-old")
    synth.write(root, [(rec, maps)])
    page = report.render(root, tmp_path / "r.html").read_text()
    (loaded,) = load_records(root)
    assert loaded.model_ratio is None
    assert "<i>intended</i>" in _cell(page, rec.case_name)


def test_an_error_record_shows_no_result(tmp_path):
    root = tmp_path / "results"
    case = _case("-boom")
    ResultStore(root).add(error_record(case, column="stock", message="rank 1 raised", seconds=1.0))
    page = report.render(root, tmp_path / "r.html").read_text()
    cell = _cell(page, case.name)
    assert ">no result</span>" in cell and "inf&times;" not in cell


def test_the_kill_matrix_says_what_each_mark_means(tmp_path):
    root = tmp_path / "results"
    synth.write(root, [synth.passing("-a"), synth.passing("-b")])
    extra = {"mutations": [{"mutant": "M-pad", "description": "skip the padded tail",
                            "killed": {"z1-none-fp32-ws2-a": True, "z1-none-fp32-ws2-b": False, "x": None}}]}
    page = report.render(root, tmp_path / "r.html", extra=extra).read_text()
    block = page[page.index("id='mutations'"):page.index("</section>", page.index("id='mutations'"))]
    legend = re.search(r"<p class='legend kill-legend'>(.*?)</p>", block, re.S)
    assert legend, "no legend above the kill matrix"
    text = legend.group(1)
    marks = {"yes": "&#10003;", "no": "&#10007;", "none": "&middot;"}
    for cls, mark in marks.items():  # every mark the table uses is in the legend, in its table styling
        assert f"<td class='k {cls}'" in block and f"<span class='k {cls}'>{mark}</span>" in text
    assert "not a failure" in text.split(marks["no"])[1].split(marks["none"])[0]  # the grey cross
    assert "SURVIVED" in text


def test_grid_cells_carry_no_tooltip_of_their_own(judged):
    """A --full page has thousands of cells: the legend under the grid explains the figures once."""
    page, recs, _ = judged
    grid = page[page.index("id='grid'"):page.index("id='details'")]
    assert "<span class='ratio'>" in grid and "<span class='ratio' title=" not in grid
    assert "marked <i>model</i>" in grid and "<i>crash</i>" in grid  # the legend


def test_the_bug_table_is_folded(tmp_path):
    root = tmp_path / "results"
    synth.write(root, [synth.failing("-x"), synth.failing("-y", bug_ids=("DSM-003",)), synth.passing("-ok")])
    page = report.render(root, tmp_path / "r.html").read_text()
    counts = page[page.index("id='counts'"):page.index("</section>", page.index("id='counts'"))]
    fold = re.search(r"<details class='bugtable'>(<summary>[^<]*</summary>)(.*?)</details>", counts, re.S)
    assert fold, "the bug table is not inside a closed <details>"
    assert "2 xfail(s) of 2 bug(s)" in fold.group(1)
    assert "<table class='bugs'>" in fold.group(2) and counts.count("<table class='bugs'>") == 1


def test_a_failure_beyond_its_bug_model_shows_the_model_ratio_and_one_without_numbers_says_so(tmp_path):
    """``_judge_models``' failure stores the model's verdict (the intended one as ``intended``); a case
    that had to be refused and ran has no verdict at all."""
    beyond, ran = _case("-beyond"), _case("-ran")
    intended = _verdict(beyond, {"momentum": 3.0})
    model = _verdict(beyond, {"momentum": 2e-3})  # 2x its allowance: more than the bug explains
    page, recs = _stored(tmp_path, [
        decide.Outcome(beyond, "stock", "failed", ["DSM-001"], f"{beyond.name}: does not match the model", 0.1,
                       model, [("layer0.weight", "momentum")], intended=intended),
        decide.Outcome(ran, "stock", "failed", [], f"{ran.name}: DeepSpeed must refuse this config but ran it", 0.1),
    ])
    assert recs[beyond.name].model_ratio == pytest.approx(2.0)
    assert "2&times; <i>model</i>" in _cell(page, beyond.name)
    cell = _cell(page, ran.name)
    assert ">no check</span>" in cell and "0&times;" not in cell


def test_a_stored_record_is_its_fields_as_json_and_loads_back_equal(tmp_path):
    """A record is written as the JSON of every field, nested rows and divergence included, in the
    format ``dataclasses.asdict`` gives (the format the results folders of earlier runs have), and
    reads back field for field: a writer that dropped or renamed a nested field fails here."""
    case = _case("-stored")
    checks = [compare_arrays(case.name, "layer0.weight", "param", 2, np.array([2e-3, 5e-3]), np.zeros(2), UNIT,
                             keep_map=False)]
    store = ResultStore(tmp_path)
    verdict = Verdict(case, "emulated", checks)
    decide.record(store, decide.Outcome(case, "stock", "failed", [], "diverged", 0.5, verdict=verdict))
    line = next(tmp_path.glob("results-*.jsonl")).read_text().splitlines()[0]
    (back,) = load_records(tmp_path)
    assert line == json.dumps(dataclasses.asdict(back), sort_keys=True)
    row = back.checks[0]
    assert (row.param, row.quantity, row.step) == ("layer0.weight", "param", 2)
    assert row.record["abs_error"] == 5e-3 and row.record["index"] == [1] and row.record["n_bad"] == 2
