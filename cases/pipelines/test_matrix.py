"""Every ZeRO / offload / precision path of Muon against the oracle, step by step.

The decision (passed / strict xfail by bug id / failed) is ``harness.gate.decide.evaluate``'s, the same
the main job makes. A case a registered stock bug triggers is a strict xfail that only accepts
``KnownBugDivergence``: a divergence the bug does not explain fails the test outright, and a bug
that no longer shows is an XPASS, which strict mode turns into a failure.
"""
from __future__ import annotations

import pytest

import oracles
from cases.pipelines._support import run_case, suite
from harness.catalog import matrix
from harness.judge.verdict import step_config

pytestmark = pytest.mark.pipeline


@pytest.mark.parametrize("case,column", suite(matrix.base_cases))
def test_base(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.nvme_cases))
def test_nvme(case, column, pool_manager, seed, request):
    o = run_case(case, column, pool_manager, seed, request)
    if not o.refused:  # a refused case (patched fix for DSM-002) never reached the swapper
        assert o.swapped_bytes and o.swapped_bytes > 0


@pytest.mark.parametrize("case,column", suite(matrix.inmem_cases))
def test_zero3_inmem_momentum(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.overflow_cases))
def test_overflow_skips_step(case, column, pool_manager, seed, request):
    o = run_case(case, column, pool_manager, seed, request)
    # Beyond the oracle's agreement, the promise itself: step 2 skipped, nothing else skipped, the
    # momentum untouched by the skipped step, the scale halved (hysteresis 1; fp32/bf16 have no scaler: 1)
    steps = {s.step: s for s in o.trajectory.steps}
    assert [s for s, r in steps.items() if r.skipped] == [2]
    halves = case.dtype == "fp16"
    assert steps[2].loss_scale_after == steps[2].loss_scale / (2 if halves else 1)
    for name in o.trajectory.muon_params:
        before, after = steps[1].params[name], steps[2].params[name]
        assert (before.momentum / before.momentum_scale == after.momentum / after.momentum_scale).all(), name
        assert (before.master == after.master).all(), name


@pytest.mark.parametrize("case,column", suite(matrix.local_overflow_cases))
def test_localized_overflow_holds_every_state(case, column, pool_manager, seed, request):
    """One parameter's gradient overflows, the rest stay finite. Beyond the oracle's agreement, the promise:
    exactly the poisoned steps are skipped, and across each of them every parameter's master and every Muon
    momentum (the clean matrices' included) is bit for bit what it was; the scale follows DeepSpeed's scaler
    rule with the case's resolved settings."""
    o = run_case(case, column, pool_manager, seed, request)
    steps = {s.step: s for s in o.trajectory.steps}
    poisoned = {ov.step for ov in case.overflows}
    assert {s for s, r in steps.items() if r.skipped} == poisoned
    sc = step_config(case).loss_scaler
    if sc is not None:
        plan = oracles.scale_plan(sc, case.steps, frozenset(poisoned))
        assert [(r.loss_scale, r.loss_scale_after) for r in o.trajectory.steps] == [p[:2] for p in plan]
    for s in sorted(poisoned):
        for name, after in steps[s].params.items():
            before = steps[s - 1].params[name]
            assert (before.master == after.master).all(), (s, name)
            if name in o.trajectory.muon_params:
                assert (before.momentum / before.momentum_scale == after.momentum / after.momentum_scale).all(), \
                    (s, name)


@pytest.mark.parametrize("case,column", suite(matrix.growth_cases))
def test_loss_scale_growth(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.stage0_cases))
def test_stage0(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.groups_cases))
def test_param_groups(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.schedule_cases))
def test_lr_schedules(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.bf16opt_cases))
def test_bf16_optimizer_and_comm32(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.tall_head_cases))
def test_tall_heads(case, column, pool_manager, seed, request):
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.unmanaged_cases))
def test_unmanaged_accumulation(case, column, pool_manager, seed, request):
    """managed_gradient_accumulation false: the client's one step() per window must apply the same
    update as the managed window (DeepSpeed reduces or finalizes inside that step())."""
    assert case.config["managed_gradient_accumulation"] is False and case.grad_accum > 1
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.inline_adam_cases))
def test_inline_adam_fallback(case, column, pool_manager, seed, request):
    """FusedAdam cannot be built: DeepSpeed's fallback steps Muon's auxiliary Adam inline, which must be
    the same AdamW (decoupled, or L2 where adam_w_mode is false)."""
    assert case.fused_adam_fails and case.offload == "none"
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.unused_cases))
def test_layer_left_out_of_a_step(case, column, pool_manager, seed, request):
    """A layer without a gradient at step 2 steps on zero (its momentum decaying), on every stage; stock
    ZeRO-3 and ZeRO-1/2 offload step it on the previous step's buffer instead (DSM-023, modelled)."""
    assert case.unused and all(k > 1 for _, k in case.unused)
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.defaults_cases))
def test_optimizer_defaults(case, column, pool_manager, seed, request):
    """No optimizer params (or only the choice of torch's AdamW as the auxiliary Adam): the step must
    follow MuonWithAuxAdam's documented defaults."""
    assert set(case.config["optimizer"]["params"]) <= {"torch_adam"}
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.ds_tagged_head_cases))
def test_per_head_tagged_by_deepspeed(case, column, pool_manager, seed, request):
    """per_head_muon: DeepSpeed tags the q/k projections from the model's config; the oracle keeps the
    case's head counts, so a wrong tag (a head count, a width, a projection left whole) fails."""
    assert case.config["optimizer"]["params"]["per_head_muon"] is True
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.conv3d_cases))
def test_conv3d_weight(case, column, pool_manager, seed, request):
    """A 5-D Muon weight: orthogonalised per leading index, not reshaped as a 4-D filter is."""
    assert any(len(p.shape) == 5 for p in case.params)
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.one_element_share_cases))
def test_one_element_share(case, column, pool_manager, seed, request):
    """A rank holds exactly one element of a Muon matrix (the layout oracle says so), and that element's
    update is copied like any other share."""
    from harness.judge import verdict
    from oracles.layout import param_slices

    layout = verdict.layout_for(case, verdict.step_config(case))
    split = [[s.param_end - s.param_start for s in param_slices(layout, p.name)] for p in case.params if p.uses_muon]
    assert any(len(shares) > 1 and 1 in shares for shares in split), split
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.one_matrix_cases))
def test_one_parameter_per_group(case, column, pool_manager, seed, request):
    """A one-layer model: the Muon group and the Adam group hold one parameter each."""
    assert sum(p.uses_muon for p in case.params) == 1 and len(case.params) == 2
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.empty_share_cases))
def test_rank_holding_none(case, column, pool_manager, seed, request):
    """Some rank holds no element of a group (ZeRO-1/2: its partition is all padding) or of a Muon matrix
    (ZeRO-3: its share starts at or past the matrix's end), as the layout oracle places them (-onerow: the
    one-row matrix alone, for its Muon group norm below 1)."""
    from harness.judge import verdict
    from oracles.layout import param_slices, rank_segments

    layout = verdict.layout_for(case, verdict.step_config(case))
    if case.name.endswith("-onerow"):
        assert [p.shape for p in case.params if p.uses_muon] == [(1, 5)]  # one singular value: norm ~0.7
    elif case.stage == 3:
        held = {s.rank for p in case.params if p.uses_muon for s in param_slices(layout, p.name)}
        assert held != set(range(case.dp_size)), held
    else:
        empty = [(r, g) for r in range(case.dp_size) for g in range(len(layout.group_numel))
                 if not any(s.group == g and s.kind == "param" for s in rank_segments(layout, r))]
        assert empty, "every rank holds data in every group"
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.aligned_cases))
def test_bf16_optimizer_exchange_layouts(case, column, pool_manager, seed, request):
    """-aligned: every Muon matrix ends exactly where a rank's partition ends, none split between ranks.
    -spanning: a matrix over three ranks, so one rank receives two pieces of it. -onesquare: one matrix, split.
    -bitsplit: a split matrix that only the split test's floor divisions tell apart from an unsplit one."""
    from harness.judge import verdict
    from oracles.layout import param_slices, placement

    layout = verdict.layout_for(case, verdict.step_config(case))
    muon = [p for p in case.params if p.uses_muon]
    if "-aligned" in case.name:
        for p in muon:
            end = placement(layout, p.name).offset + p.numel
            assert end % layout.partition_size[placement(layout, p.name).group] == 0, p.name
            assert len(param_slices(layout, p.name)) == 1, p.name
    elif "-spanning" in case.name:
        assert any(len(param_slices(layout, p.name)) == 3 for p in muon)
    elif "-bitsplit" in case.name:
        # the split test's floor divisions alone find the split one: start // P != (end - 1) // P, while
        # start & P == (end - 1) // P for every Muon matrix
        P = layout.partition_size[placement(layout, muon[0].name).group]
        spans = [(placement(layout, p.name).offset, placement(layout, p.name).offset + p.numel) for p in muon]
        assert [s // P != (e - 1) // P for s, e in spans] == [False, True]
        assert all((s & P) == (e - 1) // P for s, e in spans)
    else:
        assert len(muon) == 1 and len(param_slices(layout, muon[0].name)) == 2
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.aux_l2_cases))
def test_muon_aux_adam_l2(case, column, pool_manager, seed, request):
    """Muon's auxiliary Adam with adam_w_mode false: L2 weight decay (a non-zero decay, so the mode shows)."""
    params = case.config["optimizer"]["params"]
    assert params["adam_w_mode"] is False and params["weight_decay"] > 0
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.big_adam_nvme_cases))
def test_swapped_adam_subgroup(case, column, pool_manager, seed, request):
    """An Adam parameter big enough to be swapped, behind the test layers' biases (DSM-022 on stock)."""
    from harness.case import nvme

    assert nvme.swapped_adam_param_not_first(case)
    o = run_case(case, column, pool_manager, seed, request)
    assert o.swapped_bytes and o.swapped_bytes > 0


@pytest.mark.parametrize("case,column", suite(matrix.equal_betas_cases))
def test_zero3_accepts_equal_group_betas(case, column, pool_manager, seed, request):
    """Two Muon groups setting the same momentum: accepted (not one of harness.registry.refusals), stepped with it."""
    from harness.registry import refusals

    assert {g.momentum for g in case.groups} == {0.9} and refusals.expected(case) == []
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.conv2d_offload_cases))
def test_conv2d_weight_offloaded(case, column, pool_manager, seed, request):
    """A 4-D Muon weight on an offload path, or in a ZeRO-1 Muon group without padding (the unpadded partition
    path): reshaped to (out, in*kh*kw) for Newton-Schulz."""
    assert any(len(p.shape) == 4 for p in case.params)
    if case.name.endswith("-unpadded"):
        from harness.judge import verdict
        from oracles.layout import placement

        layout = verdict.layout_for(case, verdict.step_config(case))
        g = placement(layout, "conv.weight").group
        assert layout.group_data_end[g] == layout.group_numel[g]  # no padding in the Muon group
    else:
        assert case.offload == "cpu"
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.low_scale_cases))
def test_low_loss_scale(case, column, pool_manager, seed, request):
    """A dynamic scale starting at 2, or a static scale of 0.5."""
    fp16 = case.config["fp16"]
    assert fp16.get("loss_scale", 0) == 0.5 if case.name.endswith("-static0.5") else fp16["initial_scale_power"] == 1
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.low_momentum_cases))
def test_low_momentum(case, column, pool_manager, seed, request):
    assert case.config["optimizer"]["params"]["momentum"] < 0.5
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.tiny_grad_cases))
def test_tiny_gradients(case, column, pool_manager, seed, request):
    """Update norms far below the Newton-Schulz epsilon (1e-7): the epsilon decides the update. (-subnormal:
    fp16 gradients that stay subnormal times the loss scale, judged with the subnormal rounding term.)"""
    assert case.grad_scale == (matrix.SUBNORMAL_GRAD_SCALE if case.name.endswith("-subnormal")
                               else matrix.TINY_GRAD_SCALE)
    run_case(case, column, pool_manager, seed, request)


@pytest.mark.parametrize("case,column", suite(matrix.ds_refusal_cases))
def test_deepspeed_refuses(case, column, pool_manager, seed, request):
    """Configs DeepSpeed itself must refuse (harness.registry.refusals): passed only on that exact refusal."""
    o = run_case(case, column, pool_manager, seed, request)
    assert o.strength == "refusal", o.message


@pytest.mark.parametrize("case,column", suite(matrix.square_cases))
def test_square_matrices(case, column, pool_manager, seed, request):
    """A square matrix wider than 256 (and square head blocks): the gram kernel's square branch, and on ZeRO-2
    offload a Muon partition past 256 elements."""
    assert any(len(p.shape) == 2 and p.shape[0] == p.shape[1] > 256 for p in case.params)
    run_case(case, column, pool_manager, seed, request)
