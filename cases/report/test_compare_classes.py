"""``compare``'s classes held to their definitions (docs/compare.md) on synthetic results folders: fixed only
when the head fails strictly less, changed named by what differs on each side, a moved symptom is no "still
present", a flake is never a fix, a bug is credited fixed only where its case-column is, a failure beyond its
bug model is unexplained, a bug the base crashed before is not "new on head", and the summary stays short.

The records go through ``ResultStore`` and ``load_records``, as a gate's do; the runs are the gate's, tested
elsewhere.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from harness.case.scenarios import pipeline_case
from harness.gate import decide
from harness.judge.compare import compare_arrays
from harness.judge.verdict import Verdict
from oracles import Allowance
from harness.cli import compare as cli_compare
from harness.cli.main import main
from harness.judge.verdict import reproduce_command
from harness.registry import historical
from harness.report import compare
from harness.report.results import CaseRecord, CheckRow, ResultStore, load_records, write_plan

W, W1 = "layer0.weight", "layer1.weight"
A, B, C, D = "DSM-001", "DSM-005", "DSM-003", "DSM-012"
M1, U1, S1, S2, G2 = (W, "momentum", 1), (W, "update", 1), (W, "master", 1), (W, "master", 2), (W1, "grad", 2)
CASE = pipeline_case(1, "none", "fp32", 2)


def _row(param: str, quantity: str, step: int, ratio: float) -> CheckRow:
    bad = int(ratio > 1)
    return CheckRow(param, quantity, step, 0, "interior", {"interior": bad} if bad else {},
                    dict(atol=0.0, rtol=1e-3, derivation="synthetic", bound=1e-3, ratio=ratio, index=[0], flat_index=0,
                         abs_error=ratio * 1e-3, rel_error=ratio * 1e-3, rel_index=[0], actual=0.5 + ratio * 1e-3,
                         expected=0.5, n_bad=bad, numel=30))


def rec(status: str, fails=(), bugs=(), *, name: str = "c", strength: str | None = "full", intended="same",
        case=CASE) -> CaseRecord:
    """A stored outcome failing ``fails`` ((param, quantity, step), 3x its allowance). ``intended``: what failed
    against the intended oracle ("same": ``fails``, as the gate stores for an xfail or a plain failure;
    None: a record from before the field)."""
    case = case.replace(name=name)
    checks = [_row(*f, 3.0) for f in fails] + [_row("<step>", "global_norm", 1, 0.2)]
    if status in ("error", "skipped", "unjudged") or strength == "crash":
        checks = []
    intended_failed = ([[p, q, s] for p, q, s in sorted(fails)] if intended == "same" else
                       None if intended is None else [list(f) for f in sorted(intended)])
    message = {"error": f"case {name!r}: rank 1 raised\nTraceback (most recent call last):\nRuntimeError: boom",
               "skipped": f"{name}: deselected on DeepSpeed X: no such feature",
               "unjudged": f"{name}: cannot judge: probe z3_muon_placement(none): no known shape"}.get(status, name)
    return CaseRecord(key=f"{name}-stock", case_name=name, column="stock", status=status, bug_ids=list(bugs),
                      mode="emulated", message=message, reproduce=reproduce_command(case), case_json=case.to_json(),
                      seconds=0.1, worst_ratio=3.0 if fails else 0.2, checks=checks,
                      strength=None if status in ("error", "skipped") else strength,
                      intended_failed=intended_failed if checks else None)


FOLDERS = ("base-results", "head-results", "base-rerun-results", "head-rerun-results")


def _store(root: Path, quads) -> None:
    """``quads``: (base, head, base rerun, head rerun) records per case, None where there is none."""
    for i, folder in enumerate(FOLDERS):
        recs = [q[i] for q in quads if len(q) > i and q[i] is not None]
        if recs:
            store = ResultStore(root / folder, writer="main")
            for r in recs:
                store.add(r)


def classified(root: Path, quads) -> dict[str, compare.Row]:
    _store(root, quads)
    return {r.case: r for r in compare.compare(*(root / f for f in FOLDERS))}


def _pair(tmp_path, base, head, base_again=None, head_again=None) -> compare.Row:
    return classified(tmp_path, [(base, head, base_again, head_again)])["c"]


def symptom(param: str, quantity: str, step: int) -> str:
    return f"{quantity} of {param} at step {step}"


@pytest.mark.parametrize("base, head, want", [
    pytest.param(rec("xfailed", [M1, S1], [A]), rec("passed"), "fixed", id="head-passes"),
    pytest.param(rec("xfailed", [M1, U1], [A, B]), rec("xfailed", [U1], [B]), "fixed", id="one-bug-less"),
    pytest.param(rec("failed", [S1], [A], intended=[M1, S1]), rec("xfailed", [M1, S1], [A]), "fixed",
                 id="the-residual-now-matches-the-model"),
    pytest.param(rec("failed", [M1]), rec("xfailed", [M1], [C]), "fixed", id="an-unexplained-failure-now-modelled"),
    pytest.param(rec("xfailed", [S1], [A]), rec("xfailed", [M1, S1], [A]), "changed", id="something-new-fails"),
    pytest.param(rec("xfailed", [M1], [A]), rec("xfailed", [M1, G2], [A]), "still present",
                 id="more-of-the-same-modelled-bug"),
    pytest.param(rec("xfailed", [M1], [A]), rec("xfailed", [M1], [C]), "changed", id="another-bug"),
    pytest.param(rec("failed", [S1], [A], intended=None), rec("xfailed", [M1, S1], [A]), "changed",
                 id="an-old-record-cannot-show-less"),
    pytest.param(rec("xfailed", [M1, S1], [A]), rec("failed", [M1, S1]), "changed", id="stopped-matching-the-model"),
    pytest.param(rec("xfailed", [M1], [A]), rec("failed", [M1], [A]), "changed", id="beyond-its-model"),
    pytest.param(rec("xfailed", [M1], [A]), rec("error"), "changed", id="head-errors"),
    pytest.param(rec("xfailed", [M1], [A]), rec("xfailed", (), [D], strength="crash"), "changed", id="head-crashes"),
    pytest.param(rec("xfailed", [M1, S1], [A]), rec("xfailed", [M1, S1], [A]), "still present", id="the-same"),
])
def test_fixed_only_when_the_head_passes_or_fails_strictly_less(tmp_path, base, head, want):
    row = _pair(tmp_path, base, head)
    assert row.cls == want, row.why
    less = compare.strictly_less(compare.failures(row.base), compare.failures(row.head))
    assert (want == "fixed") == (head.status in compare.PASSES or less)


def test_changed_names_the_first_quantity_step_and_tensor_that_differ_on_each_side(tmp_path):
    base_only, head_only = S2, (W1, "grad", 3)
    row = _pair(tmp_path, rec("xfailed", [M1, base_only], [A]), rec("xfailed", [M1, head_only], [A, C]))
    assert row.cls == "changed"
    base_part, head_part = row.why.split("; head ")
    assert symptom(*base_only) in base_part and symptom(*head_only) in head_part
    assert symptom(*M1) not in row.why  # the step-1 symptom both sides share is not what changed


def test_a_symptom_that_moved_is_changed_not_still_present(tmp_path):
    was, now = (W, "master", 1), (W, "grad", 1)
    moved = _pair(tmp_path / "moved", rec("xfailed", [was], [A]), rec("xfailed", [now], [A]))
    assert moved.cls == "changed"
    assert symptom(*was) in moved.why.split("; head ")[0] and symptom(*now) in moved.why.split("; head ")[1]
    same = _pair(tmp_path / "same", rec("xfailed", [was], [A]), rec("xfailed", [was], [A]))
    assert same.cls == "still present" and symptom(*was) in same.why


Z3 = pipeline_case(3, "none", "fp32", 3)


def _intermittent(case) -> list[str]:
    return [b["id"] for b in historical.INTERMITTENT if b["trigger"](case)]


def test_a_failure_that_passes_on_its_rerun_is_flaky_never_fixed_or_regressed(tmp_path):
    assert _intermittent(Z3) and not _intermittent(CASE)  # the cases below mean what they say
    rows = classified(tmp_path, [
        (rec("failed", [M1], name="base-flake", case=Z3), rec("passed", name="base-flake", case=Z3),
         rec("passed", name="base-flake", case=Z3)),
        (rec("passed", name="head-flake", case=Z3), rec("failed", [M1], name="head-flake", case=Z3), None,
         rec("passed", name="head-flake", case=Z3)),
        (rec("failed", [M1], name="fails-again"), rec("passed", name="fails-again"),
         rec("failed", [M1], name="fails-again")),
        (rec("failed", [M1], name="not-rerun"), rec("passed", name="not-rerun")),
        (rec("xfailed", [M1], [A], name="explained"), rec("passed", name="explained"), rec("passed", name="explained")),
        (rec("error", name="stage1-flake"), rec("error", name="stage1-flake"), rec("passed", name="stage1-flake")),
    ])
    cls = {n: r.cls for n, r in rows.items()}
    assert cls == {"base-flake": "flaky", "head-flake": "flaky", "fails-again": "fixed", "not-rerun": "fixed",
                   "explained": "fixed", "stage1-flake": "flaky"}
    for name in ("base-flake", "head-flake"):
        assert all(i in rows[name].why for i in _intermittent(Z3)), rows[name].why
    assert "no registered intermittent bug" in rows["stage1-flake"].why
    assert "head error on its rerun too" not in rows["stage1-flake"].why  # the head was not rerun
    tally = compare.bug_tally(list(rows.values()))
    assert "fixed" not in tally.get(A, {}) or tally[A]["fixed"] == ["explained"]


def test_what_is_rerun_is_every_failure_not_explained_at_full_strength():
    want = {("failed", "full"): True, ("error", None): True, ("xfailed", "excused"): True,
            ("xfailed", "full"): False, ("xfailed", "crash"): False, ("passed", "refusal"): False,
            ("passed", "full"): False, ("skipped", None): False, ("unjudged", "unjudged"): False}
    for (status, strength), rerun in want.items():
        r = rec(status, [M1] if status in ("failed", "xfailed") and strength != "crash" else (), [A], strength=strength)
        assert compare.needs_rerun(r) == rerun, (status, strength)


def test_a_bug_is_credited_fixed_only_where_its_case_column_is_fixed(tmp_path):
    rows = classified(tmp_path, [
        (rec("xfailed", [M1, S1], [A], name="worse"), rec("failed", [M1, S1, G2], name="worse")),
        (rec("xfailed", [M1, S1], [A], name="errs"), rec("error", name="errs")),
        (rec("xfailed", [M1, S1], [A], name="passes"), rec("passed", name="passes")),
        (rec("xfailed", [M1, U1], [A, B], name="less"), rec("xfailed", [U1], [B], name="less")),
    ])
    tally = compare.bug_tally(list(rows.values()))
    fixed_rows = sorted(n for n, r in rows.items() if r.cls == "fixed")
    assert sorted(tally[A]["fixed"]) == fixed_rows == ["less", "passes"]
    assert tally[A]["gone, head fails otherwise"] == ["worse"] and rows["worse"].cls == "changed"
    assert tally[A]["masked by a head error or crash"] == ["errs"]
    assert tally[B] == {"still present": ["less"]}
    md = compare.summary(list(rows.values()), "base", "head")
    fixes = md[md.index("## Bugs it fixes"):].split("\n## ")[0]
    assert f"- **{A}**: fixed in {len(fixed_rows)} " in fixes and B not in fixes


def test_a_bug_the_base_crashed_before_is_not_new_on_head(tmp_path):
    rows = classified(tmp_path, [
        (rec("error", name="base-error"), rec("xfailed", [M1], [A], name="base-error")),
        (rec("xfailed", (), [D], strength="crash", name="base-crash"), rec("xfailed", [M1], [A], name="base-crash")),
        (rec("passed", name="base-passes"), rec("xfailed", [M1], [A], name="base-passes")),
        (rec("skipped", name="base-lacks"), rec("xfailed", [M1], [A], name="base-lacks")),
    ])
    tally = compare.bug_tally(list(rows.values()))[A]
    assert sorted(tally["base crashed before reaching it"]) == ["base-crash", "base-error"]
    assert tally["new on head"] == ["base-passes"] and rows["base-passes"].cls == "regressed"
    assert tally["in code the base lacks"] == ["base-lacks"]
    md = compare.summary(list(rows.values()), "base", "head")
    intro = md[md.index("## Bugs the change introduces"):].split("\n## ")[0]
    assert "new on head in 1 " in intro and "base crashed before reaching it in 2" in intro


def test_a_head_failure_beyond_its_bug_model_is_on_the_unexplained_list(tmp_path):
    rows = classified(tmp_path, [
        (rec("xfailed", [M1], [A], name="beyond"), rec("failed", [S1], [A], intended=[M1, S1], name="beyond")),
        (rec("xfailed", [M1], [A], name="modelled"), rec("xfailed", [M1, S1], [A], name="modelled")),
        (rec("xfailed", [M1], [A], name="plain"), rec("failed", [M1], name="plain")),
    ])
    listed = {r.case for r in compare.unexplained(list(rows.values()))}
    assert listed == {"beyond", "plain"}
    md = compare.summary(list(rows.values()), "base", "head")
    section = md[md.index("## Still unexplained on head"):].split("\n## ")[0]
    line = next(ln for ln in section.splitlines() if "`beyond`" in ln)
    assert "(beyond its bug model)" in line and symptom(*S1) in line and "--only=beyond" in line


def test_a_record_from_before_intended_failed_loads_and_claims_nothing_it_cannot_show(tmp_path):
    _store(tmp_path, [(rec("failed", [S1], [A], intended=[M1, S1]),)])
    path = next((tmp_path / "base-results").glob("results-*.jsonl"))
    d = json.loads(path.read_text())
    assert d.pop("intended_failed") == sorted([[*M1], [*S1]])
    path.write_text(json.dumps(d) + "\n")
    (old,) = load_records(tmp_path / "base-results")
    assert old.intended_failed is None and not compare.failures(old).complete
    assert compare.failures(rec("failed", [S1], [A], intended=[M1, S1])).complete


def test_the_gate_stores_what_a_failure_beyond_its_bug_model_failed_against_the_intended_oracle(tmp_path):
    """``decide.record`` keeps the model's checks of such a failure and, beside them, every quantity that
    diverged from the intended oracle: what tells a head that fails strictly less from one that fails otherwise."""
    case = CASE.replace(name="beyond")
    unit = Allowance(atol=1e-3, rtol=0.0, derivation="unit test")

    def verdict(errors: dict) -> Verdict:
        return Verdict(case, "emulated", [compare_arrays(case.name, W, q, s, np.array([e, 0.0]), np.zeros(2), unit,
                                                         keep_map=False) for (q, s), e in errors.items()])
    intended = verdict({("momentum", 1): 3.0, ("master", 2): 2.0, ("update", 1): 1e-4})
    model = verdict({("momentum", 1): 1e-4, ("master", 2): 2e-3})  # the master diverges beyond the model
    store = ResultStore(tmp_path / "base-results", writer="main")
    decide.record(store, decide.Outcome(case, "stock", "failed", [A], "beyond", 0.1, model,
                                        [(W, "master")], intended=intended))
    (stored,) = load_records(tmp_path / "base-results")
    want_failed = sorted([c.param, c.quantity, c.step] for c in intended.failures)
    assert stored.intended_failed == want_failed and len(want_failed) == 2
    f = compare.failures(stored)
    assert f.unexplained == {(c.param, c.quantity): c.step for c in model.failures} and f.complete
    assert set(f.explained) == {(p, q) for p, q, _ in want_failed} - set(f.unexplained)


# (what the records are, the class they are in): a bug new on head regresses a passing base
CLASS_MAKERS = {
    ("regressed", "regressed"): lambda n, bug: (rec("passed", name=n), rec("failed", [M1], name=n)),
    ("introduced", "regressed"): lambda n, bug: (rec("passed", name=n), rec("xfailed", [M1], [bug], name=n)),
    ("fixed", "fixed"): lambda n, bug: (rec("xfailed", [M1], [bug], name=n), rec("passed", name=n)),
    ("flaky", "flaky"): lambda n, bug: (rec("failed", [M1], name=n), rec("passed", name=n), rec("passed", name=n)),
    ("still present", "still present"): lambda n, bug: (rec("xfailed", [M1], [bug], name=n),
                                                        rec("xfailed", [M1], [bug], name=n)),
    ("changed", "changed"): lambda n, bug: (rec("xfailed", [M1], [bug], name=n), rec("failed", [S1], [bug], name=n)),
    ("cannot judge", "cannot judge"): lambda n, bug: (rec("unjudged", name=n), rec("passed", name=n)),
    ("not on both", "not on both"): lambda n, bug: (rec("skipped", name=n), rec("failed", [M1], name=n)),
    ("unchanged", "unchanged"): lambda n, bug: (rec("passed", name=n), rec("passed", name=n)),
}


def test_the_summary_of_hundreds_of_cases_stays_under_100_lines_and_leads_with_regressions(tmp_path):
    out = tmp_path / "out"
    quads = [make(f"{kind.replace(' ', '-')}-{i:03d}", f"DSM-{i % 40 + 200:03d}")
             for (kind, _), make in CLASS_MAKERS.items() for i in range(60)]
    _store(out, quads)
    (out / "compare.json").write_text(json.dumps({"labels": {"base": "DeepSpeed-master", "head": "DeepSpeed-pr"},
                                                  "command": "bash scripts/run.sh compare --base /b --head /h"}))
    assert main(["compare", "--merge", str(out), "--out", str(tmp_path / "m")]) == 1
    md = (tmp_path / "m" / "summary.md").read_text()
    lines = md.splitlines()
    assert len(lines) < 100, len(lines)
    rows = compare.compare(*(out / f for f in FOLDERS))
    counts = Counter(r.cls for r in rows)
    assert counts == Counter({cls: 60 for _, cls in CLASS_MAKERS} | {"regressed": 120})  # as built
    said = {m.group(1): int(m.group(2)) for m in (re.fullmatch(r"\**([a-z ]+) (\d+)\**", part)
                                                  for part in lines[2].split(": ", 1)[1].split(" · "))}
    assert said == {c: counts[c] for c in compare.CLASSES}
    headings = [ln for ln in lines if ln.startswith("## ")]
    assert headings[0] == f"## Regressions ({counts['regressed']})"
    for title, n in (("Regressions", counts["regressed"]), ("Flaky", counts["flaky"]), ("Changed", counts["changed"])):
        section = md[md.index(f"## {title} ("):].split("\n## ")[0].splitlines()[1:]
        more = [int(m) for ln in section for m in re.findall(r"^- (\d+) more in compare.html$", ln)]
        assert len(section) - len(more) + sum(more) == n, title
    reg = lines[lines.index(headings[0]) + 1]
    row = next(r for r in rows if reg.startswith(f"- `{r.case}`: "))
    assert compare.state(row.head) in reg and symptom(*M1) in reg
    assert reg.endswith(f"`bash scripts/run.sh compare --base /b --head /h --only={row.case}`")
    assert all(len(ln) < 400 for ln in lines)  # no case JSON


def test_the_page_renders_the_summary_and_names_each_side(tmp_path):
    _store(tmp_path / "out", [CLASS_MAKERS["regressed", "regressed"]("r", A), CLASS_MAKERS["fixed", "fixed"]("f", A)])
    (tmp_path / "out" / "compare.json").write_text(json.dumps({"labels": {"base": "DeepSpeed-master",
                                                                          "head": "DeepSpeed-pr"}}))
    main(["compare", "--merge", str(tmp_path / "out"), "--out", str(tmp_path / "m")])
    page = (tmp_path / "m" / "compare.html").read_text()
    md = (tmp_path / "m" / "summary.md").read_text()
    summary = page[page.index("<section id='summary'>"):page.index("</section>")]
    assert "## " not in summary and "<pre>" not in summary
    for heading in re.findall(r"^## (.*)$", md, re.M):
        assert f"<h2>{heading}</h2>" in summary
    assert "<code>bash scripts/run.sh compare" in summary and "<ul>\n<li>" in summary
    assert "<th>base: DeepSpeed-master</th>" in page and "<th>head: DeepSpeed-pr</th>" in page


def test_the_summarys_nested_lists_render_nested_and_a_message_stays_text():
    """The summary nests a case's detail under it by two spaces (CommonMark's rule); a divergence message
    quoting markup must not become markup on the page."""
    got = compare.markdown_html("# T\n\n- a `x`\n  - b **y** <script>\n- c\n\ntext")
    outer = got[got.index("<li>a"):got.index("<li>c")]
    assert "<ul>" in outer and "<li>b <strong>y</strong> &lt;script&gt;</li>" in outer
    assert "<code>x</code>" in outer and "<script>" not in got and got.rstrip().endswith("<p>text</p>")


def _checkout(path: Path) -> str:
    (path / "deepspeed").mkdir(parents=True)
    (path / "setup.py").write_text("")
    return str(path)


def test_each_side_is_named_by_what_it_is(tmp_path):
    parse = cli_compare.parse_side
    pr, master = _checkout(tmp_path / "DeepSpeed-pr"), _checkout(tmp_path / "DeepSpeed-master")
    assert cli_compare.side_names([parse("base", master), parse("head", pr)]) == {"base": "DeepSpeed-master",
                                                                                  "head": "DeepSpeed-pr"}
    a, b = _checkout(tmp_path / "a" / "DeepSpeed"), _checkout(tmp_path / "b" / "DeepSpeed")
    got = cli_compare.side_names([parse("base", a), parse("head", b)])
    assert got == {"base": "a/DeepSpeed", "head": "b/DeepSpeed"}
    commit = "0123456789abcdef0123"
    got = cli_compare.side_names([parse("base", "0.19.7"), parse("head", f"{pr}@{commit}")])
    assert got == {"base": "0.19.7", "head": f"{Path(pr).name}@{commit[:12]}"}


def test_the_reruns_are_one_fresh_gate_process_judging_exactly_the_unexplained_failures(tmp_path, monkeypatch):
    from harness.catalog import matrix
    from harness.cli.main_job import GateArgs, _resumed

    names = [c.name for c in matrix.gate_cases()[:6]]
    recs = [rec("failed", [M1], name=names[0]), rec("error", name=names[1]),
            rec("xfailed", [M1], [A], strength="excused", name=names[2]), rec("xfailed", [M1], [A], name=names[3]),
            rec("passed", name=names[4]), rec("skipped", name=names[5])]
    results, again = tmp_path / "base-results", tmp_path / "base-rerun-results"
    _store(tmp_path, [(r,) for r in recs])
    args = GateArgs(seed=7, mutate=False, column="stock", results=str(results))
    write_plan(results, "gate", [], [], args.plan_args())
    ran = []
    monkeypatch.setattr(cli_compare.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or
                        type("Done", (), {"returncode": 1})())
    cli_compare.rerun_side("PY", results, again)
    assert ran == [["PY", "-m", "harness", "gate", "--no-report", "--resume", str(again)]]
    _, pairs, selfchecks = _resumed(GateArgs(results=str(again), resume=True))
    assert sorted(c.name for c, _ in pairs) == sorted(r.case_name for r in recs if compare.needs_rerun(r))
    assert {col for _, col in pairs} == {"stock"} and {c.seed for c, _ in pairs} == {7} and not selfchecks


def test_a_first_run_its_rerun_does_not_reproduce_is_classified_on_the_rerun_never_fixed_by_a_race(tmp_path):
    """The PR tree's `z3-none-bf16-ws2-ga2-knob-nocontig`: base's first run garbled (the ZeRO-3 gather race),
    its rerun xfailed a bug; head xfailed that bug too. Still present, with the first run named, never fixed."""
    rows = classified(tmp_path, [
        (rec("failed", [M1], name="race-then-bug", case=Z3), rec("xfailed", [M1], [A], name="race-then-bug", case=Z3),
         rec("xfailed", [M1], [A], name="race-then-bug", case=Z3)),
        (rec("failed", [M1], name="reproduced", case=Z3), rec("xfailed", [M1], [A], name="reproduced", case=Z3),
         rec("failed", [M1], name="reproduced", case=Z3)),
    ])
    assert rows["race-then-bug"].cls == "still present", rows["race-then-bug"].why
    assert "base's first run (failed) did not reproduce" in rows["race-then-bug"].why
    assert all(i in rows["race-then-bug"].why for i in _intermittent(Z3))
    assert rows["reproduced"].cls == "fixed"  # the same failure twice: the head's xfail explains strictly more
    # the tally reads the outcome the case was classified on: the base's rerun shows the bug too
    assert compare.bug_tally([rows["race-then-bug"]])[A] == {"still present": ["race-then-bug"]}


def test_a_variant_model_the_head_matched_is_named_beside_its_bug(tmp_path):
    """DeepSpeed PR #8464's growth cases match DSM-003's variant (Muon after the scale update), not its own
    model: the summary says which, as the gate's record does; the base's own model is no variant."""
    import dataclasses

    from harness.registry.bugs import BUGS

    variant = next(v for v in next(b for b in BUGS if b.id == C).with_variants() if v.variant)
    assert variant.label == f"{C} (variant: {variant.variant})" and variant.model is not None
    said = f"g: diverges ... matches the bug model(s) ({variant.label}: {{...}}) within the usual tolerances"
    head = dataclasses.replace(rec("xfailed", [S2], [C], name="g"), message=said)
    rows = classified(tmp_path, [(rec("passed", name="g"), head),
                                 (rec("passed", name="own"), rec("xfailed", [S2], [C], name="own"))])
    line = next(ln for ln in compare.summary(list(rows.values()), "base", "head").splitlines()
                if ln.startswith(f"- **{C}**"))
    assert f"variant on head: {variant.variant}" in line
    assert compare.variants_matched([rows["own"]], C) == []
