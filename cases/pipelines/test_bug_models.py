"""A known bug excuses only what a model of that bug predicts.

On the stock column a case a registered bug triggers is judged twice (``harness.gate.decide.evaluate``):
against the intended oracle, where it must diverge, and against the oracle with the bug's switches on
(``Bug.model`` -> ``oracles.Conventions``) at the usual tolerances, where it must match. These tests
run real stock DeepSpeed on a few cheap cases: each is an xfail at full strength, and the same case
with an unrelated bug re-introduced (``harness.registry.mutants`` stock mutants) fails. A capture hole (a
quantity not recorded, a capture note) fails the judgement with its own message.
"""
from __future__ import annotations

import copy
import traceback
from dataclasses import replace

import pytest

from harness.fixes._registry import Refusal
from harness.registry.bugs import BUGS, BY_ID, NUMERIC, REFUSAL_LINE, bugs_for
from harness.case.spec import Overflow, ParamShape
from harness.gate.decide import evaluate, model_changes
from harness.catalog.matrix import _case
from harness.case.scenarios import pipeline_case
from harness.judge.verdict import bug_model, judge

def test_every_numerical_bug_a_case_can_trigger_has_a_model_or_says_why_not():
    """A bug is modelled (an oracle model), a crash (its exact exception), a refusal, or declares why it
    has no model; one of these, and a model names a numerical quantity it moves."""
    for b in BUGS:
        assert bool(b.unmodelled) == (b.modelled == "no"), (b.id, b.modelled, b.unmodelled)
        if b.model is not None and b.id != "DSM-002":
            assert b.quantities & NUMERIC, b.id
        if b.unmodelled:
            assert b.quantities & NUMERIC or b.quantities == {"swap"} or b.id == "DSM-011", b.id
    assert any(b.unmodelled for b in BUGS) and any(b.model for b in BUGS)  # the checks above see both kinds


@pytest.mark.parametrize("case", [
    pipeline_case(2, "none", "bf16", 2, steps=3),
    pipeline_case(3, "cpu", "fp16", 1, steps=5, loss_scale_window=2),
    pipeline_case(2, "none", "fp16", 2, steps=4, hysteresis=1).replace(overflows=(Overflow(2, 1, 0),)),
    pipeline_case(1, "none", "fp32", 2, steps=2, extra_zero={"parameter_alignment": True},
                  params=(ParamShape("attn.weight", (6, 5), num_heads=2), ParamShape("proj.weight", (3, 3)),
                          ParamShape("attn.bias", (6,)))),
], ids=lambda c: c.name)
def test_bug_models_compose_into_valid_conventions(case):
    bugs = bugs_for(case)
    assert bugs
    conv = bug_model(model_changes(case, bugs))
    assert conv != bug_model({})


STOCK_CASES = ["z2-none-bf16-ws1", "z3-none-bf16-ws2-ga2-clip0.05", "z3-cpu-bf16-ws2-heads",
               "z1-cpu-fp32-ws2-skiplayer", "z1-none-fp16-ws2-overflow", "z1-cpu-fp16-ws2-growth",
               "z3-none-bf16-ws2-comm32", "z0-none-fp16-ws2", "z0-none-bf16-ws2-ga2-standard",
               "z1-none-bf16-ws2-ga2-clip0.05-gad32", "z3-none-fp32-ws2-resume-inmem"]


def _gate_case(name):
    from harness.catalog.matrix import gate_cases, resume_cases

    # The resume group's CI subset cycles dtype and world size; its --full product holds every one.
    return next(c for c in gate_cases() + resume_cases(full=True) if c.name == name)


pytestmark = pytest.mark.pipeline


@pytest.mark.parametrize("name", STOCK_CASES)
def test_stock_bug_case_matches_its_model_and_an_extra_bug_fails_it(name, pool_manager, seed):
    case = _gate_case(name).replace(seed=seed)
    o = evaluate(case, "stock", pool_manager)
    assert o.status == "xfailed" and o.strength == "full", o.message
    assert not o.verdict.passed  # (a) the intended oracle sees the bug
    assert o.model_verdict is not None and o.model_verdict.passed  # (b) the model explains all of it
    for mutant in ("nesterov-dropped", "momentum-beta-offset-1e-3"):
        m = evaluate(case.replace(mutant=mutant), "stock", pool_manager)
        assert m.status == "failed", f"{mutant} on {name}: {m.status}\n{m.message}"
        assert "does not match the model" in m.message


def test_lost_adam_gradients_are_modelled_only_where_deepspeed_loses_them(pool_manager, seed):
    """DSM-019: at one rank the Adam half of ZeRO-2 bf16 + fp32 gradient accumulation reads zeros
    (its model predicts exactly that: an xfail at full strength, on both columns, since no fix
    exists); at two ranks it trains, and the same model judging that trajectory must fail on the
    gradients it claims lost."""
    from harness.catalog.matrix import gate_cases

    full = {c.name: c for c in gate_cases(full=True)}
    one = full["z2-none-bf16-ws1-knob-gad32"].replace(seed=seed)
    for column in ("stock", "patched"):
        o = evaluate(one, column, pool_manager)
        assert o.status == "xfailed" and "DSM-019" in o.bug_ids and o.strength == "full", o.message
    two = full["z2-cpu-bf16-ws2-knob-gad32"].replace(seed=seed)
    assert "DSM-019" not in {b.id for b in bugs_for(two)}
    traj = pool_manager.run(two).result
    wrong = judge(two, traj, conventions=bug_model({"adam_grads_lost": True}))
    assert not wrong.passed and {f.quantity for f in wrong.failures} == {"grad"}, wrong.message()


def test_dropped_rank_fails_a_bug_affected_stock_case(pool_manager, seed):
    case = _gate_case("z3-none-bf16-ws2-ga2-clip0.05").replace(seed=seed, mutant="rank-contribution-dropped")
    o = evaluate(case, "stock", pool_manager)
    assert o.status == "failed", o.message
    assert any(f.quantity == "grad" for f in o.verdict.failures), o.message


def test_conv_crash_is_accepted_only_as_the_exact_exception(pool_manager):
    c = pipeline_case(2, "none", "fp32", 1, steps=2,
                      params=(ParamShape("conv.weight", (4, 2, 3, 3)), ParamShape("conv.bias", (4,))))
    o = evaluate(c, "stock", pool_manager)
    assert o.status == "xfailed" and o.strength == "crash" and o.bug_ids == ["DSM-012"], o.message
    bug = BY_ID["DSM-012"]
    tb = 'File "x/original_muon.py", line 1, in muon_update\nRuntimeError: The size of tensor a (4) must match ' \
         'the size of tensor b (3)'
    assert bug.crash_matches(tb)
    assert not bug.crash_matches(tb.replace("RuntimeError", "ValueError"))
    assert not bug.crash_matches(tb.replace("in muon_update", "in step"))


def test_pointwise_conv_crash_is_accepted_at_zero3_copy_back(pool_manager):
    """A 1x1 conv: muon_update's 2-D update broadcasts against the 4-D gradient instead of raising, and
    ZeRO-3 fails copying the result back (DSM-012's second signature); only in that frame."""
    c = pipeline_case(3, "none", "fp32", 1, steps=2,
                      params=(ParamShape("conv.weight", (4, 2, 1, 1)), ParamShape("conv.bias", (4,))))
    o = evaluate(c, "stock", pool_manager)
    assert o.status == "xfailed" and o.strength == "crash" and o.bug_ids == ["DSM-012"], o.message
    bug = BY_ID["DSM-012"]
    tb = 'File "x/stage3.py", line 1, in _muon_update_sub_group\nRuntimeError: output with shape [4, 2, 1, 1] ' \
         "doesn't match the broadcast shape [4, 2, 4, 2]"
    assert bug.crash_matches(tb)
    assert not bug.crash_matches(tb.replace("in _muon_update_sub_group", "in step"))


def test_capture_holes_fail_with_their_own_message(pool_manager):
    c = _case(2, "none", "fp32", 2)
    traj = pool_manager.run(c).result
    assert judge(c, traj).passed
    holed = copy.deepcopy(traj)
    s2 = holed.steps[1]
    s2.params["layer0.weight"] = replace(s2.params["layer0.weight"], momentum=None, update=None, grad=None)
    s2.notes.append("step 2: stored momentum of layer1.weight not fully covered by any rank")
    holed.steps[2] = replace(holed.steps[2], global_norm=None)
    v = judge(c, holed)
    problems = {(f.param, f.quantity, f.step) for f in v.failures if f.problem}
    assert {("layer0.weight", "momentum", 2), ("layer0.weight", "update", 2), ("layer0.weight", "grad", 2),
            ("<step>", "capture", 2), ("<step>", "global_norm", 3)} <= problems, v.message()
    assert "not fully covered" in v.message(limit=20)


def test_refusal_is_accepted_only_as_the_patched_runtimes_refusal_carrying_the_fix_text():
    bug = BY_ID["DSM-002"]
    try:
        raise Refusal(f"{bug.refused_when_patched}: DeepSpeed 0.19.8 would ...")
    except Refusal:
        tb = traceback.format_exc()
    assert bug.refusal_matches(tb)
    line = tb.strip().splitlines()[-1]
    assert not bug.refusal_matches("Traceback ...\n" + line.replace(REFUSAL_LINE, "ValueError:"))
    assert not bug.refusal_matches("Traceback ...\n" + line.replace(REFUSAL_LINE, "RuntimeError:"))
    assert not bug.refusal_matches(f"Traceback ...\n{REFUSAL_LINE} something else")


def test_dsm020_stage0_orthogonalises_a_per_head_matrix_whole(pool_manager):
    """DSM-020: the non-ZeRO Muon step drops ``num_heads``; the intended oracle must see it in the
    update and the model (``honor_num_heads=False``) must explain every quantity."""
    case = _case(0, "none", "fp32", 2, heads=True)
    o = evaluate(case, "stock", pool_manager)
    assert o.status == "xfailed" and o.bug_ids == ["DSM-020"] and o.strength == "full", o.message
    heads = [p.name for p in case.params if (p.num_heads or 1) > 1]
    assert {c.param for c in o.verdict.failures if c.quantity == "update"} == set(heads), o.message
    assert o.model_verdict.passed, o.model_verdict.message()
    # The fix (z0-per-head) makes the same case match the intended oracle.
    fixed = evaluate(case, "patched", pool_manager)
    assert fixed.status == "passed", fixed.message
    assert "DSM-020" not in {b.id for b in bugs_for(_case(0, "none", "fp32", 2))}
    assert "DSM-020" not in {b.id for b in bugs_for(_case(1, "none", "fp32", 2, heads=True))}


def test_dsm021_a_swapped_matrix_sorted_after_others_gets_a_misplaced_gradient(pool_manager):
    """DSM-021: ZeRO-3 NVMe, fp32/fp16: the swapped matrix sorted after the small Muon matrices reaches
    muon_update with a misplaced gradient; nothing else in the case diverges (teacher forcing), the
    trigger selects exactly the layouts that show it, and the patched runtime's fix passes it."""
    from harness.catalog.matrix import nvme_cases

    cases = {c.name: c for c in nvme_cases(full=True)}
    case = cases["z3-nvme-part-fp32-ws1-sortedlast"]
    o = evaluate(case, "stock", pool_manager)
    assert o.status == "xfailed" and o.bug_ids == ["DSM-021"] and o.strength == "excused", o.message
    assert {(c.param, c.quantity) for c in o.verdict.failures} == {("big.weight", "grad")}, o.message
    trig = BY_ID["DSM-021"].trigger
    assert trig(case) and trig(cases["z3-nvme-pipe-fp16-ws2-sortedlast"])
    assert not trig(cases["z3-nvme-part-bf16-ws1-sortedlast"])  # bf16 has not shown it
    assert not any(trig(c) for n, c in cases.items() if not n.endswith("-sortedlast"))  # the matrix first
    assert not trig(case.replace(ds_config=case.ds_config.replace('"nvme"', '"cpu"')))
    # The fix (nvme-grad-offset-io) makes the same case match the intended oracle, gradient included.
    fixed = evaluate(case, "patched", pool_manager)
    assert fixed.status == "passed" and fixed.strength == "full", fixed.message


def test_stale_buffer_model_fails_where_deepspeed_steps_unused_parameters_on_zero(pool_manager, seed):
    """DSM-023: ZeRO-1 without offload gives a layer left out of a step a zero gradient (as intended);
    the stale-buffer model judging that trajectory must fail exactly on the gradients it claims stale.
    (Its norm rule leaves out a term that is zero here, so the norm agrees either way.)"""
    from harness.catalog.matrix import gate_cases

    case = next(c for c in gate_cases() if c.name == "z1-none-fp32-ws2-skiplayer").replace(seed=seed)
    assert "DSM-023" not in {b.id for b in bugs_for(case)}
    traj = pool_manager.run(case).result
    wrong = judge(case, traj, conventions=bug_model({"stale_unused_grads": "norm-drops-adam"}))
    assert not wrong.passed
    assert {(f.param, f.quantity) for f in wrong.failures} == {("layer1.weight", "grad"),
                                                             ("layer1.bias", "grad")}, wrong.message()
