"""``python -m harness check``'s exits without ranks: each refusal exits 2 with its cause before a rank
starts, a model factory that raises exits 3 with a one-line cause (and JSON under --json), and a run
that died is never blamed on a numerical bug. In process: none of these reaches a launcher."""
from __future__ import annotations

import argparse
import json

import pytest

from harness.cli import check, parser


def _cfg(**top) -> dict:
    cfg = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": 2},
           "train_micro_batch_size_per_gpu": 1}
    cfg.update(top)
    return cfg


def run_check(tmp_path, capfd, cfg: dict, *extra: str) -> tuple[int, str, str]:
    """``check`` on ``cfg`` in this process, no report; a launcher start fails the test."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    ap = argparse.ArgumentParser()
    parser.add_check_arguments(ap)
    args = ap.parse_args(["--ds-config", str(path), "--no-report", "--shapes", "16x8", *extra])
    code = check.run_check(args)
    out, err = capfd.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _no_ranks(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a launcher was started")

    monkeypatch.setattr(check, "_launcher", refuse)


@pytest.mark.parametrize("extra, cfg, cause", [
    ((), _cfg(data_types={"grad_accum_dtype": "fp8"}), "data_types.grad_accum_dtype: 'fp8' is not a dtype"),
    ((), _cfg(optimizer={"type": "Muon", "params": {"lr": -0.02}}), "optimizer.params.lr: -0.02 is negative"),
    ((), _cfg(optimizer={"type": "Muon", "params": {"lr": 0.02, "adam_lr": -1e-3}}),
     "optimizer.params.adam_lr: -0.001 is negative"),
    (("--timeout", "-5"), _cfg(), "--timeout -5: expected a positive number"),
    (("--timeout", "nan"), _cfg(), "--timeout nan: expected a positive number"),
    (("--world-size", "100000"), _cfg(), "--world-size 100000: this machine cannot host it (at most min(8,"),
])
def test_bad_input_exits_2_before_any_rank(tmp_path, capfd, extra, cfg, cause):
    code, out, err = run_check(tmp_path, capfd, cfg, "--json", *extra)
    assert code == check.EXIT_BAD_INPUT, err
    assert f"error: {cause}" in err
    result = json.loads(out)
    assert result["exit_code"] == 2 and cause in result["message"]


@pytest.mark.parametrize("factory, raised", [("broken_oserror", "OSError: weights.bin: no such file"),
                                             ("broken_keyerror", "KeyError: 'hidden_size'")])
@pytest.mark.parametrize("json_mode", [True, False])
def test_a_model_factory_that_raises_exits_3_with_its_cause(tmp_path, capfd, monkeypatch, factory, raised,
                                                             json_mode):
    from cases.cli import _user_model

    monkeypatch.syspath_prepend(str(tmp_path))
    model = _user_model.write(tmp_path).replace(":factory", f":{factory}")
    code, out, err = run_check(tmp_path, capfd, _cfg(), "--model", model, *(["--json"] if json_mode else []))
    assert code == check.EXIT_RUN_FAILED, err
    cause = f"--model {model}: the model factory raised {raised}"
    assert [ln for ln in err.splitlines() if ln.startswith("error: ")] == [f"error: {cause}"]
    assert "Traceback" not in err
    if json_mode:
        result = json.loads(out)
        assert (result["verdict"], result["exit_code"], result["message"]) == ("error", 3, cause)
    else:
        assert out == ""


def test_a_run_that_died_is_not_blamed_on_a_numerical_bug():
    """The gate lists every bug the pipeline triggers on an error outcome; the check shows none of them."""
    from harness.case.spec import Case, ParamShape, canonical_json
    from harness.gate.decide import Outcome

    case = Case(name="c", params=(ParamShape("w", (8, 4)),), ds_config=canonical_json(_cfg()))
    died = Outcome(case, "stock", "error", ["DSM-001"], "rank 0 died with exit code -9", 1.0, strength=None)
    shown = check._without_unmatched_bugs(died)
    assert shown.bug_ids == [] and shown.message == died.message
    diverged = Outcome(case, "stock", "xfailed", ["DSM-001"], "m", 1.0)
    assert check._without_unmatched_bugs(diverged).bug_ids == ["DSM-001"]
    from harness.cli.check_plan import Plan

    result = check.CheckResult(plan=Plan("config.json", case, [], [], 1.0), columns=["stock"],
                               outcomes={"stock": shown}, bugs=[{"id": "DSM-001", "title": "t"}],
                               report_path=None, report_note="--no-report", reproduce="r")
    text = "\n".join(line for line, _ in result.text_lines())
    assert "verdict: ERROR (the run failed; no verdict): rank 0 died with exit code -9" in text
    assert "DSM-001" not in text


def test_a_verdict_over_fewer_applied_steps_than_asked_says_so():
    from types import SimpleNamespace

    from harness.case.spec import Case, ParamShape, canonical_json
    from harness.cli.check_plan import Plan
    from harness.gate.decide import Outcome

    case = Case(name="c", params=(ParamShape("w", (8, 4)),), ds_config=canonical_json(_cfg()), steps=3)
    steps = [SimpleNamespace(step=s, skipped=s < 3) for s in (1, 2, 3)]
    o = Outcome(case, "stock", "passed", [], "", 1.0, trajectory=SimpleNamespace(steps=steps))
    assert check.skipped_steps(o) == [1, 2]
    result = check.CheckResult(plan=Plan("config.json", case, [], [], 1.0), columns=["stock"],
                               outcomes={"stock": o}, bugs=[], report_path=None, report_note="--no-report",
                               reproduce="r")
    verdict = next(line for line, _ in result.text_lines() if line.startswith("verdict: "))
    assert "[over 1 applied step(s) of 3 asked: step(s) 1, 2 skipped on overflow" in verdict
    applied = Outcome(case, "stock", "passed", [], "", 1.0,
                      trajectory=SimpleNamespace(steps=[SimpleNamespace(step=s, skipped=False) for s in (1, 2, 3)]))
    assert check.applied_steps_text(applied) == ""


def test_run_refuses_a_world_size_the_machine_cannot_host(capsys):
    """``run --case`` with a thousand ranks is bad input (exit 2) before any rank starts."""
    from harness.case.scenarios import pipeline_case
    from harness.cli.check_plan import max_world_size
    from harness.cli.main import main

    case = pipeline_case(stage=1, offload="none", dtype="fp32", world_size=2)
    big = case.replace(world_size=max_world_size("cpu") + 2)
    assert main(["run", "--case", big.to_json()]) == 2
    assert f"world size {big.world_size}" in capsys.readouterr().err
