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


def _traj(steps):
    """A trajectory of a Muon matrix ``w`` and an Adam vector ``b``; ``steps``: (skipped, {group: lr},
    moved names) per step. A moved weight's master changes by one ulp-sized step, the rest stay bit-equal."""
    import numpy as np

    from harness.case.trajectory import ParamStep, StepRecord, Trajectory

    cur = {"w": np.ones((8, 4)), "b": np.zeros(8)}
    t = Trajectory("c", initial={k: v.copy() for k, v in cur.items()}, muon_params=("w",))
    for s, (skipped, lrs, moved) in enumerate(steps, 1):
        for name in moved:
            cur[name] = np.nextafter(cur[name], np.inf)
        params = {k: ParamStep(master=v.copy(), model=v.copy(), grad=None) for k, v in cur.items()}
        t.steps.append(StepRecord(s, 1.0, 1.0, skipped, None, 0, params, group_lr=dict(lrs)))
    return t


def _result(traj, status="passed", steps=3):
    from harness.case.spec import Case, ParamShape, canonical_json
    from harness.cli.check_plan import Plan
    from harness.gate.decide import Outcome

    case = Case(name="c", params=(ParamShape("w", (8, 4)), ParamShape("b", (8,))), ds_config=canonical_json(_cfg()),
                steps=steps)
    o = Outcome(case, "stock", status, [], "", 1.0, trajectory=traj)
    return o, check.CheckResult(plan=Plan("config.json", case, [], [], 1.0), columns=["stock"],
                                outcomes={"stock": o}, bugs=[], report_path=None, report_note="--no-report",
                                reproduce="r")


LR = {"muon-params": 0.02, "adam-params": 3e-4}
LR0 = {"muon-params": 0.0, "adam-params": 0.0}


def test_a_verdict_over_fewer_applied_steps_than_asked_says_so():
    o, result = _result(_traj([(True, {}, ()), (True, {}, ()), (False, LR, ("w", "b"))]))
    assert check.skipped_steps(o) == [1, 2]
    verdict = next(line for line, _ in result.text_lines() if line.startswith("verdict: "))
    assert "rests on 1 applied step(s) of 3, 2 skipped on overflow (steps 1, 2), weights moved at 1 (step 3)" in verdict
    assert result.exit_code == check.EXIT_OK


@pytest.mark.parametrize("steps, reason", [
    # the HF template's first step under fp16: two overflow skips, one step at lr 0 (warmup_min_lr "auto" = 0)
    ([(True, {}, ()), (True, {}, ()), (False, LR0, ())], "no applied step changed any weight (steps 1, 2 skipped "
                                                          "on overflow; step 3 applied at lr 0)"),
    ([(True, {}, ()), (True, {}, ()), (True, {}, ())], "no applied step changed any weight (steps 1, 2, 3 skipped"),
    ([(False, {"muon-params": 0.0, "adam-params": 3e-4}, ("b",))] * 3, "no applied step changed a Muon matrix"),
])
@pytest.mark.parametrize("status", ["passed", "xpassed"])
def test_a_run_that_moved_no_weight_cannot_be_judged_never_pass(steps, reason, status):
    o, result = _result(_traj(steps), status=status)
    assert result.exit_code == check.EXIT_CANNOT_JUDGE
    verdict = next(line for line, _ in result.text_lines() if line.startswith("verdict: "))
    assert reason in verdict and not verdict.startswith("verdict: PASS")
    js = result.to_json()
    assert (js["verdict"], js["exit_code"]) == ("cannot judge", 4) and reason in js["basis"]["cannot_judge"]


def test_steps_at_lr_0_are_named_beside_a_pass_and_a_later_step_moves_the_weights():
    o, result = _result(_traj([(False, LR0, ()), (False, LR, ("w", "b")), (False, LR, ("w", "b"))]))
    assert result.exit_code == check.EXIT_OK
    verdict = next(line for line, _ in result.text_lines() if line.startswith("verdict: "))
    assert "step 1 at lr 0 (adam-params, muon-params)" in verdict and "weights moved at 2 (steps 2, 3)" in verdict


def test_the_zero_lr_warm_up_is_named_with_the_steps_that_get_past_it(tmp_path):
    """WarmupLR from 0 (the HF template's warmup_min_lr "auto"): the first applied step runs at lr 0, so
    a run of one step judges nothing; the suggested --steps is the schedule's first lr > 0 after the skips."""
    from harness.case.spec import canonical_json
    from harness.cli.check_verdict import basis, steps_past_warmup
    from oracles.schedules import group_lr

    o, result = _result(_traj([(True, {}, ()), (False, LR0, ())]), steps=2)
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.02, "warmup_num_steps": 2}}
    case = o.case.replace(ds_config=canonical_json(_cfg(scheduler=sched)))
    n = steps_past_warmup(case, basis(o))
    first = next(k for k in range(10) if group_lr(sched, 0.02, k) > 0)
    assert n == 1 + first + 1  # one skip seen, then applied steps 0..first


def test_run_refuses_a_world_size_the_machine_cannot_host(capsys):
    """``run --case`` with a thousand ranks is bad input (exit 2) before any rank starts."""
    from harness.case.scenarios import pipeline_case
    from harness.cli.check_plan import max_world_size
    from harness.cli.main import main

    case = pipeline_case(stage=1, offload="none", dtype="fp32", world_size=2)
    big = case.replace(world_size=max_world_size("cpu") + 2)
    assert main(["run", "--case", big.to_json()]) == 2
    assert f"world size {big.world_size}" in capsys.readouterr().err


# Every refusal of harness/registry/refusals.py, as configs check can be handed (a zero_optimization section,
# or one with top-level keys), each also written the other ways DeepSpeed's config classes accept (strings for
# numbers and booleans, other spellings).
_REFUSED_CONFIGS = {
    "z3-muon-reduce-scatter": [{"stage": 3}, {"stage": "3"}, {"stage": 3.0}, {"stage": "3", "reduce_scatter": "yes"},
                               {"stage": 3, "reduce_scatter": 1}, {"stage": 3, "reduce_scatter": "ON"}],
    "bf16opt-muon-not-2d": [],  # configs with a 4-D shape: _REFUSED_WITH_SHAPES
    "z3-muon-all2all": [{"stage": 3, "reduce_scatter": False, "zero_quantized_gradients": True},
                        {"stage": "3", "reduce_scatter": "false", "zero_quantized_gradients": "true"},
                        {"stage": 3.0, "reduce_scatter": 0, "zero_quantized_gradients": "y"}],
    # gradient_clipping left out: DeepSpeed's default is 1.0
    "no-norm-with-clipping": [{"stage": 1, "compute_grad_norm": False}, {"stage": "2", "compute_grad_norm": "false"}],
    "no-norm-with-offload": [({"stage": 2, "compute_grad_norm": False, "offload_optimizer": {"device": "cpu"}},
                              {"gradient_clipping": 0})],
    "no-norm-on-bf16-optimizer": [({"stage": 1, "compute_grad_norm": 0},
                                   {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})],
    "z2-prescale-with-reduce-scatter": [({"stage": 2}, {"prescale_gradients": True}),
                                        ({"stage": "2", "reduce_scatter": "true"}, {"prescale_gradients": True})],
}
# The refusals no config of check's can reach, each with the knob check's own model takes away (asserted
# below, so a refusal that becomes reachable fails here until it has configs above).
_UNREACHABLE = {
    "per-head-not-2d": "per_head_muon", "per-head-indivisible": "per_head_muon", "per-head-tp-cut": "per_head_muon",
    "z3-muon-group-betas": "groups",
}


def test_every_refusal_of_the_registry_is_covered_here():
    from harness.registry.refusals import REFUSALS

    assert {r.name for r in REFUSALS} == set(_REFUSED_CONFIGS) | set(_UNREACHABLE)


# The BF16_Optimizer route's refusal needs a non-2-D Muon parameter: a 4-D kernel in --shapes.
BF16_ROUTE = ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
              {"bf16": {"enabled": "yes"}, "data_types": {"grad_accum_dtype": "float32"}},
              {"bfloat16": {"enabled": 1}, "data_types": {"grad_accum_dtype": "torch.float32"}})


def _refused_cases():
    for name, zeros in _REFUSED_CONFIGS.items():
        for z in zeros:
            z, top = z if isinstance(z, tuple) else (z, {})  # a zero section, or (zero section, top-level keys)
            yield name, _cfg(zero_optimization=z, **top), ()
    for top in BF16_ROUTE:
        yield "bf16opt-muon-not-2d", _cfg(zero_optimization={"stage": "1"}, **top), ("--shapes", "16x8,4x2x3x3")


@pytest.mark.parametrize("name, cfg, extra", list(_refused_cases()))
@pytest.mark.parametrize("json_mode", [True, False])
def test_a_config_deepspeed_refuses_exits_2_before_any_rank_never_pass(tmp_path, capfd, name, cfg, extra, json_mode):
    from harness.registry.refusals import REFUSALS

    refusal = next(r for r in REFUSALS if r.name == name)
    code, out, err = run_check(tmp_path, capfd, cfg, *(["--json"] if json_mode else []), *extra)
    assert code == check.EXIT_BAD_INPUT, err
    line = next(ln for ln in err.splitlines() if ln.startswith("error: "))
    assert f"refuses this config: {refusal.etype}: {refusal.fragment} ({refusal.frame})" in line
    assert "PASS" not in out + err
    if json_mode:
        result = json.loads(out)
        assert (result["verdict"], result["exit_code"]) == ("refused", 2) and refusal.fragment in result["message"]


@pytest.mark.parametrize("name", sorted(_UNREACHABLE))
def test_a_refusal_check_cannot_reach_is_unreachable_because_its_knob_is_taken_away(tmp_path, name):
    """per_head_muon: check's rewrite removes it (the synthetic model has no attention to tag); groups: check
    builds one parameter group. A config asking for either is planned without it."""
    from harness.cli import check_plan

    cfg = _cfg(zero_optimization={"stage": 3, "reduce_scatter": False})
    cfg["optimizer"]["params"]["per_head_muon"] = True
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    ap = argparse.ArgumentParser()
    parser.add_check_arguments(ap)
    plan = check_plan.validate(ap.parse_args(["--ds-config", str(path), "--shapes", "16x8,8x8"]))
    assert not plan.case.ds.optimizer.per_head_muon and not any(p.num_heads for p in plan.case.params)
    assert len(plan.case.groups) <= 1


def test_a_refusal_only_deepspeed_initialize_makes_exits_2_with_its_words(tmp_path):
    """A rank's traceback from inside ``deepspeed.initialize`` (a refusal the registry does not know) is the
    config refused, not a failed run: exit 2, DeepSpeed's words and frame, never a pass."""
    from cases.harness.test_raised import _load, _traceback_of

    ds = _load(tmp_path)
    tb = _traceback_of(lambda: ds.initialize({}))
    o, result = _result(None, status="error")
    o.message = f"case 'c': rank 0 raised\n{tb}"
    assert result.exit_code == check.EXIT_BAD_INPUT
    verdict = next(line for line, _ in result.text_lines() if line.startswith("verdict: "))
    assert verdict.startswith("verdict: REFUSED")
    assert ("refuses this config: ValueError: Muon and reduce scatter cannot be used together (stage3.py:build), "
            "raised inside deepspeed.initialize") in verdict
    js = result.to_json()
    assert (js["verdict"], js["exit_code"]) == ("refused", 2) and "stage3.py:build" in js["refused"]


def test_the_gates_refused_as_it_must_is_no_pass_for_a_user():
    o, result = _result(None, status="passed")
    o.strength = "refusal"
    o.message = ("c: DeepSpeed refused it as it must (z3-muon-reduce-scatter: ValueError: Muon and reduce scatter "
                 "cannot be used together, stage3.py:__init__)")
    assert result.exit_code == check.EXIT_BAD_INPUT
    assert result.to_json()["verdict"] == "refused"
    assert not any(line.startswith("verdict: PASS") for line, _ in result.text_lines())
