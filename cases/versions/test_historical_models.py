"""Oracle models of bugs of releases older than 0.19.8 (``harness.registry.historical``): each switch changes
exactly what its bug's stated mechanism changes. Expected values come from the intended step and that
mechanism (a factor 1/S), not from runs of DeepSpeed. Pure: no ranks, well under a second."""
from __future__ import annotations

import math

import pytest
import torch

from harness.registry.bugs import HISTORICAL
from harness.case.scenarios import pipeline_case
from oracles import Conventions, LossScalerConfig, ParamSpec, StepConfig, initial_state, oracle_step

SPECS = (ParamSpec("w", (7, 3), True), ParamSpec("b", (5,), False))
S = 256.0  # initial_scale_power 8, as the gate's fp16 cases


def _weights():
    gen = torch.Generator().manual_seed(3)
    return {s.name: torch.randn(*s.shape, generator=gen, dtype=torch.float64) * 0.3 for s in SPECS}


def _grads():
    gen = torch.Generator().manual_seed(4)
    return [[{s.name: torch.randn(*s.shape, generator=gen, dtype=torch.float64) * 1e-2 for s in SPECS}]]


def _step(conv, clip=0.0):
    cfg = StepConfig(SPECS, model_dtype="fp16", gradient_clipping=clip,
                     loss_scaler=LossScalerConfig(initial_scale_power=8))
    conv = Conventions(round_master_to_fp32=False, **conv)
    return oracle_step(initial_state(cfg, _weights(), conv), _grads(), cfg, conv)[1]


def test_unscaled_muon_update_steps_o_over_s_and_leaves_adam_alone():
    good, bad = _step({}), _step({"muon_update_unscaled": True})
    assert good.loss_scale_used == bad.loss_scale_used == S
    # (update = theta_new - theta: float64 round-off of |theta| < 1, at most 2^-53 per operand)
    torch.testing.assert_close(bad.params["w"].update, good.params["w"].update / S, rtol=1e-12, atol=2.0**-51)
    torch.testing.assert_close(bad.params["w"].direction, good.params["w"].direction, rtol=0, atol=0)
    torch.testing.assert_close(bad.params["b"].update, good.params["b"].update, rtol=0, atol=0)
    # the norm counts the Muon update as O / S
    o, g = good.params["w"].direction, good.params["b"].grad
    assert math.isclose(bad.global_norm, math.sqrt(float((o / S).square().sum() + g.square().sum())), rel_tol=1e-12)


def test_unscaled_muon_update_clips_with_the_smaller_norm():
    clip = 0.01
    good, bad = _step({}, clip), _step({"muon_update_unscaled": True}, clip)
    assert good.clip_coef > 1 and bad.clip_coef < good.clip_coef
    k = max(1.0, (bad.global_norm + 1e-6) / clip)
    assert math.isclose(bad.clip_coef, k, rel_tol=1e-9)
    torch.testing.assert_close(bad.params["w"].update, good.params["w"].update * good.clip_coef / (S * bad.clip_coef),
                               rtol=1e-9, atol=2.0**-51)


@pytest.mark.parametrize("case, hit", [
    (pipeline_case(1, "none", "fp16", 2, ns_method="standard"), True),
    (pipeline_case(3, "cpu", "fp16", 1, ns_method="standard"), True),
    (pipeline_case(3, "none", "fp16", 2, ns_method="standard"), True),
    (pipeline_case(2, "cpu", "fp16", 2, ns_method="standard"), False),  # no Muon at all there (DSM-101)
    (pipeline_case(0, "none", "fp16", 2, ns_method="standard"), False),  # the fp16 wrapper unscales first
    (pipeline_case(1, "none", "bf16", 2, ns_method="standard"), False),  # S = 1
])
def test_dsm108_selects_the_paths_that_write_o_into_the_scaled_buffer(case, hit):
    bug = next(b for b in HISTORICAL if b.id == "DSM-108")
    assert bug.trigger(case) is hit
    if hit:  # its model is a real switch of the oracle
        assert Conventions(**bug.model(case)).muon_update_unscaled is True


def _ids(case):
    return {b.id for b in HISTORICAL if b.trigger(case)}


def test_zero3_triggers_follow_the_reduce_path_sub_groups_and_accumulation():
    """DSM-110 where a bucket skips the contiguous reduce, DSM-102 only where Muon runs and a round mixes
    shapes within one sub-group, DSM-111 with gradient accumulation (each as measured on 0.19.7)."""
    from harness.catalog.matrix import gate_cases

    cases = {c.name: c for c in gate_cases(False)}
    assert "DSM-110" in _ids(cases["z3-none-bf16-ws2-knob-buckets"])  # a 30-element gradient, 16-element buckets
    assert "DSM-110" in _ids(cases["z3-none-bf16-ws2-ga2-knob-nocontig"])
    assert "DSM-102" not in _ids(cases["z3-none-bf16-ws2-knob-buckets"])  # Muon never runs: nothing to gather
    assert _ids(cases["z3-none-fp32-ws2-subgroups"]) == set()  # one matrix per sub-group: rounds never mix
    assert "DSM-102" in _ids(cases["z3-nvme-part-fp32-ws2"])
    assert "DSM-111" in _ids(cases["z3-nvme-part-fp32-ws1-ga2"])
    assert "DSM-111" not in _ids(cases["z3-nvme-part-fp32-ws2"])
    plain = pipeline_case(3, "none", "fp32", 2, ns_method="standard")
    assert "DSM-110" not in _ids(plain)  # contiguous gradients, one bucket: Muon runs
    nocontig = plain.ds_config.replace('"stage":3', '"stage":3,"contiguous_gradients":false')
    assert nocontig != plain.ds_config and "DSM-110" in _ids(plain.replace(ds_config=nocontig))


def test_dsm112_needs_a_straddling_matrix_whose_fate_differs_between_its_holders():
    from harness.catalog.matrix import gate_cases

    cases = {c.name: c for c in gate_cases(False)}
    for name in ("z2-none-fp32-ws3", "sweep-z1-none-ws2-L0", "moe-z2-none-fp32-ws2-standard"):
        assert "DSM-112" in _ids(cases[name]), name
    # ws2 base grid: the shared matrix is the last of both partitions (measured: momentum alone diverges)
    assert "DSM-112" not in _ids(cases["z2-none-fp32-ws2-ga2-clip0.05-standard"])
    assert "DSM-112" not in _ids(pipeline_case(2, "none", "fp32", 1, ns_method="standard"))
    assert "DSM-112" not in _ids(pipeline_case(2, "cpu", "fp32", 3, ns_method="standard"))


def test_a_crash_inside_muon_update_is_not_expected_where_muon_update_never_runs(monkeypatch):
    """On 0.19.7 (DSM-012 and DSM-101 both measured) a conv case with ZeRO-1/2 offload never reaches
    muon_update (DSM-101), so DSM-012's crash there is not a candidate; without offload it is."""
    from harness.env import versions
    from harness.registry.bugs import bugs_for
    from harness.catalog.matrix import gate_cases

    monkeypatch.setattr(versions, "judged_as", lambda: "0.19.7")
    monkeypatch.delenv("MUON_HARNESS_MEASURE", raising=False)
    cases = {c.name: c for c in gate_cases(False)}
    assert [b.id for b in bugs_for(cases["resnet-z1-cpu-fp32-ws2-standard"])] == ["DSM-101"]
    assert "DSM-012" in [b.id for b in bugs_for(cases["resnet-z0-none-fp32-ws2-standard"])]


def test_every_historical_trigger_answers_for_every_ci_gate_case():
    """The triggers that read the case's partition layout (DSM-102, DSM-112) must answer a plain bool for
    every gate case, on any release (``bugs_for`` asks them only where the bug is measured, but the
    measuring runs ask every one)."""
    from harness.catalog.matrix import gate_cases

    for c in gate_cases(False):
        for b in HISTORICAL:
            assert isinstance(b.trigger(c), bool), (b.id, c.name)


def test_muon_as_sgd_moves_each_matrix_by_its_clipped_gradient_and_leaves_its_momentum():
    """DSM-114's model: the Muon matrix steps by lr x its gradient (after the clip before the step, DSM-013's
    rule), with the decoupled weight decay; no momentum, no Newton-Schulz; Adam's step unchanged."""
    specs = SPECS
    clip = 0.01
    cfg = StepConfig(specs, model_dtype="bf16", gradient_clipping=clip, muon_lr=0.05, weight_decay=0.1)
    conv = Conventions(round_master_to_fp32=False, clip_norm_source="gradient")
    bad_conv = Conventions(round_master_to_fp32=False, clip_norm_source="gradient", muon_as_sgd=True)
    w0 = _weights()
    good = oracle_step(initial_state(cfg, w0, conv), _grads(), cfg, conv)
    start = initial_state(cfg, w0, bad_conv)  # (its masters: the weights as the bf16 model holds them)
    new, bad = oracle_step(start, _grads(), cfg, bad_conv)
    g = bad.params["w"].grad
    k = bad.clip_coef
    assert k > 1  # the clip acts, so its placement before the step is tested
    norm = math.sqrt(sum(float(p.grad.square().sum()) for p in bad.params.values()))
    assert math.isclose(k, (norm + 1e-6) / clip, rel_tol=1e-9)
    want = start.master["w"] * (1 - 0.05 * 0.1) - 0.05 * g / k
    torch.testing.assert_close(bad.params["w"].master, want, rtol=1e-12, atol=2.0**-52)
    assert not new.momentum["w"].any()  # the momentum stays as it was (zero)
    assert not torch.equal(bad.params["w"].master, good[1].params["w"].master)  # a real switch
    torch.testing.assert_close(bad.params["b"].master, good[1].params["b"].master, rtol=0, atol=0)


def test_dsm114_is_modelled_on_the_bf16_optimizer_route_and_without_zero():
    from harness.catalog.matrix import gate_cases

    bug = next(b for b in HISTORICAL if b.id == "DSM-114")
    cases = {c.name: c for c in gate_cases(False)}
    for name in ("z1-none-bf16-ws1-gad32", "z1-none-bf16-ws2-ga2-clip0.05-gad32", "z1-none-bf16-ws3-clip0.05-gad32"):
        assert bug.trigger(cases[name]) and Conventions(**bug.model(cases[name])).muon_as_sgd is True, name
    for stage0 in (pipeline_case(0, "none", "bf16", 1, ns_method="standard"), cases["z0-none-fp32-ws1"]):
        assert bug.trigger(stage0) and Conventions(**bug.model(stage0)).muon_as_sgd is True, stage0.name
    for name in ("z2-none-bf16-ws2-knob-gad32", "z1-none-bf16-ws2-ga2-clip0.05-standard"):
        assert not bug.trigger(cases[name]), name  # ZeRO-2, or no fp32 accumulation: a ZeRO optimizer runs Muon


def _gram_step(conv, scale, ns_method="gram"):
    """One fp32 step of SPECS, every gradient times ``scale``; returns (record, the blend U Newton-Schulz read)."""
    from oracles.momentum import muon_momentum

    cfg = StepConfig(SPECS, model_dtype="fp32", ns_method=ns_method)
    conv = Conventions(round_master_to_fp32=False, **conv)
    grads = [[{n: g * scale for n, g in mb.items()} for mb in rank] for rank in _grads()]
    state = initial_state(cfg, _weights(), conv)
    rec = oracle_step(state, grads, cfg, conv)[1]
    return rec, muon_momentum(state.momentum["w"], rec.params["w"].grad, cfg.momentum)[1]


def test_gram_input_cast_flushes_a_tiny_matrix_to_a_zero_update():
    """DSM-119's model: every |U| below 2^-25 rounds to fp16 zero, so the Muon direction and step are zero,
    where the intended one is not (the 1e-7 in the normalisation leaves it small, but far from zero);
    Adam's step is untouched."""
    good, U = _gram_step({}, 1e-10)
    bad, _ = _gram_step({"gram_input_dtype": "fp16"}, 1e-10)
    assert 0 < float(U.abs().max()) < 2.0 ** -25
    assert float(good.params["w"].direction.abs().max()) > 1e-3
    assert not bad.params["w"].direction.any() and not bad.params["w"].update.any()
    torch.testing.assert_close(bad.params["b"].update, good.params["b"].update, rtol=0, atol=0)


def test_gram_input_cast_rounds_only_the_gram_input():
    """At ordinary gradients the switch is exactly Newton-Schulz of U rounded to fp16 (the mechanism, not a
    run of DeepSpeed); a standard-method matrix is untouched bit for bit (its bf16 cast keeps fp32's range)."""
    from oracles.momentum import round_to
    from oracles.newton_schulz import muon_direction

    good, U = _gram_step({}, 1.0)
    bad, _ = _gram_step({"gram_input_dtype": "fp16"}, 1.0)
    want = muon_direction(round_to(U, torch.float16), "gram")
    torch.testing.assert_close(bad.params["w"].direction, want, rtol=0, atol=0)
    assert not torch.equal(bad.params["w"].direction, good.params["w"].direction)  # a real switch
    std_good, _ = _gram_step({}, 1.0, "standard")
    std_bad, _ = _gram_step({"gram_input_dtype": "fp16"}, 1.0, "standard")
    torch.testing.assert_close(std_bad.params["w"].direction, std_good.params["w"].direction, rtol=0, atol=0)


def test_dsm119_claims_only_a_gram_matrix_flushed_whole_where_gram_runs_in_fp16(monkeypatch):
    from harness.env import device
    from harness.catalog.matrix import tiny_grad_cases

    bug = next(b for b in HISTORICAL if b.id == "DSM-119")
    gram, standard = (c for c in tiny_grad_cases() if c.name.endswith("-tinygrad"))
    assert "gram" in gram.ds_config and "standard" in standard.ds_config
    monkeypatch.setattr(device, "half_support", lambda accelerator=None: (True, True))
    assert bug.trigger(gram) and Conventions(**bug.model(gram)).gram_input_dtype == "fp16"
    assert not bug.trigger(standard)
    assert not bug.trigger(gram.replace(grad_scale=1.0))  # ordinary gradients: left to the tolerances
    assert not bug.trigger(pipeline_case(1, "cpu", "fp32", 2).replace(grad_scale=1e-10))  # no Muon there (DSM-101)
    monkeypatch.setattr(device, "half_support", lambda accelerator=None: (False, True))
    assert not bug.trigger(gram)  # no fp16 on the device: the iteration runs in fp32


def test_dsm120_selects_zero3_nvme_through_the_partitioned_swapper_on_the_cpu_accelerator(monkeypatch):
    from harness.catalog.matrix import gate_cases

    bug = next(b for b in HISTORICAL if b.id == "DSM-120")
    cases = {c.name: c for c in gate_cases(False)}
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert bug.trigger(cases["z3-nvme-part-fp32-ws1-ga2"]) and bug.trigger(cases["z3-nvme-part-fp32-ws2-resume"])
    assert not bug.trigger(cases["z3-nvme-pipe-fp32-ws2-ga2-standard"])  # the pipelined swapper: DSM-113's path
    assert not bug.trigger(cases["z1-nvme-part-fp32-ws2"]) and not bug.trigger(cases["z3-cpu-fp32-ws2-groups"])
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert not bug.trigger(cases["z3-nvme-part-fp32-ws1-ga2"])  # pinned buffers there: the writes are submitted


def test_dsm121_needs_a_warmup_without_its_peak_over_groups_of_different_lr():
    from harness.catalog.matrix import gate_cases

    bug = next(b for b in HISTORICAL if b.id == "DSM-121")
    cases = {c.name: c for c in gate_cases(False)}
    assert bug.trigger(cases["z0-none-fp32-ws2-sched-warmup"])
    assert not bug.trigger(cases["z1-none-fp32-ws2-sched-decay"])  # warmup_max_lr given: one peak for all, as meant
    assert not bug.trigger(cases["z2-none-bf16-ws2-sched-cosine"])  # another schedule
    assert not bug.trigger(cases["z1-none-fp32-ws2-ga2"])  # no schedule


def test_dsm121_model_warms_every_group_to_the_first_groups_lr_and_only_without_a_peak():
    from harness.judge import verdict
    from harness.catalog.matrix import gate_cases

    bug = next(b for b in HISTORICAL if b.id == "DSM-121")
    cases = {c.name: c for c in gate_cases(False)}
    warm, decay = cases["z0-none-fp32-ws2-sched-warmup"], cases["z1-none-fp32-ws2-sched-decay"]
    conv = Conventions(**bug.model(warm))
    differs = 0
    for applied in range(warm.steps + 1):
        good = verdict.expected_group_lrs(warm, verdict.step_config(warm, applied))
        bad = verdict.expected_group_lrs(warm, verdict.step_config(warm, applied, conv))
        first = next(iter(good))
        assert bad[first] == good[first]  # the first group's own schedule is the intended one
        assert all(lr == good[first] for lr in bad.values())  # and every other group follows it
        differs += any(bad[g] != good[g] for g in good)
    assert differs >= 2  # the case shows it (the groups' configured lrs differ), not only after warm-up
    for applied in range(decay.steps + 1):  # warmup_max_lr given: one peak for every group already
        assert (verdict.expected_group_lrs(decay, verdict.step_config(decay, applied, conv))
                == verdict.expected_group_lrs(decay, verdict.step_config(decay, applied)))
