"""A captured quantity the oracle has no finite reference for is "cannot judge": never a pass, never a
divergence. From the judge's own check (``harness.judge.checks.unjudged_gradients``) through the gate's
decision (status ``unjudged``), ``check``'s exit code (4), its text, its ``--json`` and its report, to the
gate's page (a bad outcome of its own). No ranks here; ``test_check_user_configs.py`` runs the real thing.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from harness.case.spec import Case, ParamShape, canonical_json
from harness.cli import check
from harness.cli.check_plan import Plan
from harness.gate import decide
from harness.judge import checks
from harness.judge.compare import compare_arrays
from harness.judge.verdict import Verdict
from harness.report.html import BAD_STATUSES, build_html, page_verdict
from harness.report import results
import oracles
from cases.pipelines._support import settle

CFG = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": 2},
       "train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}}
CASE = Case(name="c-fp16", params=(ParamShape("layer.weight", (8, 4)), ParamShape("layer.bias", (8,))),
            ds_config=canonical_json(CFG))
SCALE = 32768.0


def _verdict(*, unjudged_step: int | None = 3, skipped: bool = False, diverged: str | None = None) -> Verdict:
    """A verdict whose checks the judge's own functions made: one passing momentum check per step, a
    gradient the oracle could not judge at ``unjudged_step``, and optionally a diverging ``diverged``."""
    v = Verdict(CASE, "emulated")
    run = checks.Run(CASE, None, "emulated", None, {}, CASE.name, None, v.checks, v.notes)
    exact = oracles.Allowance(0.0, 0.0, "deterministic")
    for s in (1, 2, 3):
        v.checks.append(compare_arrays(CASE.name, "layer.weight", "momentum", s, [1.0], [1.0], exact))
    if diverged:
        v.checks.append(compare_arrays(CASE.name, "layer.weight", diverged, 3, [1.0], [2.0], exact))
    if unjudged_step is not None:
        checks.unjudged_gradients(run, {"layer.weight"}, SimpleNamespace(skipped=skipped), unjudged_step, SCALE)
    return v


def test_an_applied_step_without_a_reference_is_cannot_judge_naming_step_tensor_and_scale():
    v = _verdict()
    assert not v.passed and v.failures == [] and len(v.unjudged) == 1
    why = v.unjudged[0].unjudged
    assert "layer.weight" in why and "step 3" in why and "32768" in why
    assert "cannot judge" in v.message() and why in v.message()
    assert v.worst_ratio == 0.0  # an unjudged check has no ratio to be "worst" with
    assert v.first is None  # nor is it a divergence


def test_a_skipped_step_has_no_gradient_to_judge():
    v = _verdict(skipped=True)
    assert v.passed and v.unjudged == []


class _Traj:
    swapped_bytes = 0
    muon_params = ()
    initial: dict = {}
    steps = [SimpleNamespace(step=s, skipped=False, losses=[1.0], loss_scale=SCALE, global_norm=1.0,
                             swap_bytes_written=0, swap_bytes_read=0, params={}, group_lr={}) for s in (1, 2, 3)]

    def judged_bits(self):
        return None


def _decide(monkeypatch, verdicts: dict, bugs=()):
    """The gate's decision on a run whose verdicts (by conventions: None is the intended oracle) are given."""
    monkeypatch.setattr(decide, "judged", lambda c, traj, conventions=None, bits=None: verdicts[
        None if conventions is None else "model"])
    return decide._judge_trajectory(CASE, "stock", list(bugs), _Traj(), 0.0)


def test_the_gate_calls_it_unjudged_not_passed_and_not_failed(monkeypatch):
    o = _decide(monkeypatch, {None: _verdict()})
    assert o.status == "unjudged" and o.strength == "unjudged"
    assert "cannot judge" in o.message
    assert "unjudged" in BAD_STATUSES
    o = _decide(monkeypatch, {None: _verdict(diverged="master")})
    assert o.status == "failed"  # a divergence is the stronger statement
    o = _decide(monkeypatch, {None: _verdict(unjudged_step=None)})
    assert o.status == "passed"


def test_a_bug_model_that_matches_elsewhere_does_not_make_it_an_xfail(monkeypatch):
    bug = SimpleNamespace(id="DSM-001", label="DSM-001", crash=None, quantities=frozenset({"momentum"}),
                          model=lambda c: {"momentum_dtype": "model"})
    verdicts = {None: _verdict(diverged="momentum"), "model": _verdict()}
    o = _decide(monkeypatch, verdicts, [bug])
    assert o.status == "unjudged" and o.bug_ids == ["DSM-001"], o.message
    assert "cannot judge" in o.message and "32768" in o.message
    verdicts["model"] = _verdict(unjudged_step=None)
    assert _decide(monkeypatch, verdicts, [bug]).status == "xfailed"


def _result(tmp_path, monkeypatch) -> check.CheckResult:
    o = _decide(monkeypatch, {None: _verdict()})
    plan = Plan(str(tmp_path / "my.json"), CASE, [], [], 1.0)
    return check.CheckResult(plan, ["stock"], {"stock": o}, [], None, "--no-report", "r")


def test_check_exits_4_and_says_cannot_judge_in_its_text_and_json(tmp_path, monkeypatch):
    r = _result(tmp_path, monkeypatch)
    assert r.exit_code == check.EXIT_CANNOT_JUDGE == 4
    assert check.EXIT_CANNOT_JUDGE not in (check.EXIT_OK, check.EXIT_DIVERGED, check.EXIT_BAD_INPUT,
                                           check.EXIT_RUN_FAILED)
    text = "\n".join(line for line, _ in r.text_lines())
    verdict = next(line for line in text.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith("verdict: CANNOT JUDGE") and "step 3" in verdict and "32768" in verdict
    assert "PASS" not in verdict and "DIVERGED" not in verdict
    grad = next(line for line in text.splitlines() if line.strip().startswith("grad "))
    assert "CANNOT JUDGE 1 at step(s) [3] (layer.weight)" in grad
    js = json.loads(json.dumps(r.to_json()))
    assert js["verdict"] == "cannot judge" and js["exit_code"] == 4 and js["status"] == "unjudged"
    assert js["cannot_judge"] == [{"param": "layer.weight", "quantity": "grad", "step": 3,
                                   "reason": r.decisive.verdict.unjudged[0].unjudged}]
    assert js["first_divergence"] is None


def test_the_check_report_and_the_gate_page_are_not_green(tmp_path, monkeypatch):
    r = _result(tmp_path, monkeypatch)
    facts = check.report_facts(r)
    assert facts["exit_code"] == 4
    store = results.ResultStore(tmp_path / "res", writer="t")
    decide.record(store, r.decisive)
    recs = results.load_records(tmp_path / "res")
    assert [x.status for x in recs] == ["unjudged"]
    assert any(row.unjudged and "32768" in row.derivation for row in recs[0].checks)
    page = build_html(recs, lambda key: {}, extra={"check": facts})
    assert "class='verdict fail'" in page and "verdict: CANNOT JUDGE" in page
    assert "CANNOT JUDGE</b>" in page  # the outcome's badge
    ok, reasons = page_verdict(recs, {})
    assert not ok and reasons == ["1 unjudged"]


def test_the_pipeline_suite_fails_a_case_that_cannot_be_judged():
    o = SimpleNamespace(status="unjudged", message="cannot judge: ...")
    request = SimpleNamespace(config=SimpleNamespace(stash={}))
    with pytest.raises(pytest.fail.Exception):
        settle(o, request)
