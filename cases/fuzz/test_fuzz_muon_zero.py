"""Hypothesis search over whole Muon/ZeRO cases, judged by the oracle (``harness.judge.verdict.judge``).

``test_fuzz_muon_zero`` draws cases from ``cases.strategies.cases`` -- shapes, parameter order,
world size 1..4, ZeRO stage, offload, dtype, accumulation, clipping, gradient spectrum, and
layout-aimed cases -- on the runtimes the checkout has: stock DeepSpeed restricted to pipelines
with no catalogued bug (``harness.registry.bugs``), plus, once ``harness.fixes`` exists,
``patched=True`` cases on every pipeline the patched runtime leaves bug-free. Each case runs on the
session's rank pool and must pass the verdict; the search climbs the worst normalised error
(``hypothesis.target``), and the worst case judged is reported next to the shrunk failure (see
``plugin.py``). A failure prints the one-line reproducer and the case as JSON.

``test_fuzz_finds_padded_tail_mutant`` is the search's self-check (free-form half): under the catalogued layout
mutant ``padded-tail-misslice`` (``harness.registry.mutants``, installed on the ranks by
``harness.rank.patches``) the same search must find a failure within the active profile's budget and
shrink it to a case with one small matrix.

Profiles: ``MUON_FUZZ_PROFILE=ci|dev|nightly`` (default ci), see ``support.py``.
"""
from __future__ import annotations

import importlib
import math

import pytest
from hypothesis import example, find, given, target
from hypothesis.errors import NoSuchExample

from cases import strategies as S
from cases.fuzz import support

pytestmark = [pytest.mark.fuzz, pytest.mark.pipeline]

RUNTIMES = S.available_runtimes()
WORLD_SIZES = support.world_sizes(S.WORLD_SIZES)
MUTANT = "padded-tail-misslice"


# --------------------------------------------------------------------------------------------------
# the fuzz test


# DSM-017 (harness.registry.bugs), found by the layout sweep (harness.catalog.sweep) and replayed here: a ZeRO-3 1x5
# matrix on 4 ranks crashed stock DeepSpeed's momentum write-back (rank 3's share starts past the
# end); fixed by the patched runtime's z3-momentum-tail-past-end, so the replay runs patched. The
# stock draw never produces it again: its trigger makes the case unclean (strategies.case_is_clean).
DSM_017 = ('{"batch": 8, "checkpoint_at": null, "compiled": false, "ds_config": {"gradient_accumulation_steps": 1, '
           '"gradient_clipping": 0.0, "optimizer": {"params": {"adam_lr": 0.001, "lr": 0.02, "momentum": 0.95, '
           '"muon_lr": 0.02, "ns_method": "gram", "weight_decay": 0.0}, "type": "Muon"}, "steps_per_print": '
           '1000000000, "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "wall_clock_breakdown": false, '
           '"zero_optimization": {"reduce_scatter": false, "stage": 3}}, "fault": null, "mutant": null, '
           '"name": "z3-none-fp32-ws4-1x5-patched", "ns_dtype": null, "overflows": [], "params": [{"name": '
           '"w.weight", "num_heads": null, "shape": [1, 5]}, {"name": "t.weight", "num_heads": null, "shape": '
           '[1, 1]}, {"name": "t.bias", "num_heads": null, "shape": [3]}], "patched": true, "seed": 0, "steps": 2, '
           '"timeout_s": 120.0, "world_size": 4}')


def _replays():
    from harness.case.spec import Case

    out = []
    if "patched" in RUNTIMES:
        out.append(Case.from_json(DSM_017))
    return out


def _with_examples(test):
    for case in reversed(_replays()):
        test = example(case=case)(test)
    return test


@support.fuzz_settings
@_with_examples
@given(case=S.cases(runtimes=RUNTIMES, world_sizes=WORLD_SIZES))
def test_fuzz_muon_zero(case, pool_manager):
    support.check_case(pool_manager, case, support.tracker("test_fuzz_muon_zero"))


# --------------------------------------------------------------------------------------------------
# regressions found by the fuzzer
#
# Ids: DSM-nnn are DeepSpeed bugs (harness.registry.bugs); FUZZ-nnn are findings about the harness itself.
# A DeepSpeed bug found on a path believed clean goes into harness.registry.bugs and, as a replay of the
# shrunk case, into an ``@example`` of test_fuzz_muon_zero (with ``patched=True`` once fixed).

# FUZZ-001 (harness gap, not a DeepSpeed bug): with fp16 and a 2^16 initial loss scale -- DeepSpeed's
# own default -- the fp16 backward of the synthetic loss overflows (the elementwise term's backward
# multiplies the scale by D in [0.5, 1.5): 65536 * 1.42 > 65504), so DeepSpeed rightly reports a
# non-finite norm and skips the step. The oracle was fed the finite float64 gradient and predicted no
# skip, so every later step diverged. Found by the ci profile (first drawn fp16 case at 2^16), shrunk
# to this one 1x1 matrix. Fixed in the harness: the verdict now runs each rank's backward in the
# model dtype (harness.case.synthetic.backward_overflows) and marks an overflowing micro-batch non-finite for
# the oracle; this record is kept as a regression case.
FUZZ_001 = ('{"batch": 1, "checkpoint_at": null, "compiled": false, "ds_config": {"fp16": {"enabled": true, '
            '"hysteresis": 2, "initial_scale_power": 16, "loss_scale_window": 1000, "min_loss_scale": 1}, '
            '"gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "optimizer": {"params": {"adam_lr": 0.001, '
            '"lr": 0.02, "momentum": 0.95, "muon_lr": 0.02, "ns_method": "gram", "weight_decay": 0.0}, '
            '"type": "Muon"}, '
            '"steps_per_print": 1000000000, "train_batch_size": 1, '
            '"train_micro_batch_size_per_gpu": 1, '
            '"wall_clock_breakdown": false, "zero_optimization": {"offload_optimizer": {"device": "cpu"}, '
            '"stage": 1}}, '
            '"fault": null, "mutant": null, "name": "fuzz-z1-cpu-fp16-ws1-m1v0-natural", "ns_dtype": null, '
            '"overflows": [], "params": [{"name": "m0.weight0", "num_heads": null, "shape": [1, 1]}], '
            '"patched": false, '
            '"seed": 0, "steps": 2, "timeout_s": 120.0, "world_size": 1}')


# FUZZ-002 (harness gap, not a DeepSpeed bug): on a CPU without oneDNN fp16 kernels (no AVX512-FP16 /
# AMX-FP16; this machine) DeepSpeed's CPU accelerator reports no fp16 support, so (a) every fp16 case
# raises "Type fp16 is not supported on your device" at initialize, and (b) gram Newton-Schulz runs
# in fp32 instead of fp16 (original_muon.ns_compute_dtype), so the emulated oracle, which assumed fp16,
# failed every gram case by 1e3-1e5x its allowance. Found by the first sweep run here (every gram case
# diverged, every standard one passed). Fixed in the harness: oracles.emulate.ns_compute_dtype follows
# the device's fp16/bf16 support (harness.env.device), and on such a CPU the ranks report fp16 support (the
# CPU fp16 stand-in, as every fp16-capable accelerator does) so fp16 paths stay checkable.
# Regression: the oracle's gram dtype follows the device.


def test_fuzz_002_gram_dtype_follows_the_device(pool_manager):
    """Regression for FUZZ-002: a gram case of 1xN, Nx1 and 1x1 matrices (the shapes the sweep caught it
    with) passes on this machine whatever its fp16 support, and the oracle's dtype is the device's."""
    import torch

    from harness.case.spec import ParamShape
    from harness.case.scenarios import pipeline_case
    from harness.judge.verdict import judge
    from harness.env.device import half_support
    from oracles.emulate import ns_compute_dtype

    want = torch.float16 if half_support()[0] else torch.float32
    assert ns_compute_dtype("gram", *half_support()) == want
    assert ns_compute_dtype("standard", *half_support()) == torch.bfloat16
    c = pipeline_case(1, "none", "fp32", 2, params=(ParamShape("a.weight", (1, 4)), ParamShape("b.weight", (3, 1)),
                                                     ParamShape("c.weight", (1, 1))), ns_method="gram")
    v = judge(c, support.run_case(pool_manager, c))
    assert v.passed, v.message()


# FUZZ-003 (harness gap): the nightly profile's first failure, after 190 clean cases: a patched
# ZeRO-1 NVMe case (fuzz-z1-nvme-fp32-ws2-m5v0-natural-patched) "crashed" -- it was the patched
# runtime's fix for DSM-002 refusing ZeRO-1/2 NVMe, as designed; the strategy counted the pipeline
# clean because DSM-002 is fixed. Fixed in the strategies: case_is_clean also excludes cases a patched
# fix refuses (harness.registry.bugs.refusals_for); regression in test_fuzz_strategies.py.


@pytest.mark.skipif("fp16" not in S.device_dtypes(), reason="FUZZ-002: DeepSpeed refuses fp16 models on this CPU")
def test_fuzz_001_fp16_backward_overflow_is_predicted(pool_manager):
    """Regression for FUZZ-001: DeepSpeed's genuine fp16 backward overflow must be predicted by the
    oracle side (a skipped step, then the same skip again), not reported as a divergence."""
    from harness.case.spec import Case
    from harness.judge.verdict import judge

    case = Case.from_json(FUZZ_001)
    traj = support.run_case(pool_manager, case)
    first = traj.steps[0]
    # The premise: DeepSpeed saw a genuine overflow and skipped (if not, this record is stale).
    assert first.skipped and not math.isfinite(first.global_norm or math.inf), (
        f"FUZZ-001 premise changed: step 1 skipped={first.skipped} global_norm={first.global_norm}\n"
        f"{support.reproducer(case)}")
    v = judge(case, traj, keep_maps=False)
    assert v.passed, f"FUZZ-001 regressed: {support.verdict_summary(v)}\n{support.reproducer(case)}"


# FUZZ-004 (harness, OPEN): in the float64-NS mode (``Case.ns_dtype="float64"``, verdict mode hpns) the
# Muon momentum at step 2 of a 1x1 matrix exceeds its allowance by 1.5-14x (1.5-4 fp32 ulp): found by
# the ci profile after the swarm/layout-aimed strategies (z1 cpu bf16 ws3, 1.48x, shrunk from 502
# cases), the nightly profile (z1 none fp32 ws3, 3.66x) and seen at 14.4x (z3 cpu bf16 ws4, patched).
# The same cases pass in the default emulated mode, whose momentum is torch's fp32 lerp bit for bit.
# Likely cause: DeepSpeed's ``momentum.lerp_(g, 1 - beta)`` rounds the intermediate ``g - M``, which
# for a scalar whose g and M have opposite signs is larger than the result; the float64 oracle's
# momentum allowance counts round-off of the result only. A tolerance question (oracles/tolerance.py),
# not a DeepSpeed bug. These replays are strict xfails until the allowance is derived for it.
FUZZ_004_CI = ('{"batch": 2, "checkpoint_at": null, "compiled": false, "ds_config": {"bf16": {"enabled": true}, "gra'
             'dient_accumulation_steps": 3, "gradient_clipping": 0.0, "optimizer": {"params": {"adam_lr": 0.001, "'
             'lr": 0.02, "momentum": 0.95, "muon_lr": 0.02, "ns_method": "gram", "weight_decay": 0.0}, "type": "Mu'
             'on"}, "steps_per_print": 1000000000, "train_batch_size": 9, "train_micro_batch_size_per_gpu": 1, "wa'
             'll_clock_breakdown": false, "zero_optimization": {"offload_optimizer": {"device": "cpu"}, "stage": 1'
             '}}, "fault": null, "grad_cond": 1.0, "grad_elementwise": 1.0, "grad_scale": 1.0, "mutant": null, "na'
             'me": "fuzz-z1-cpu-bf16-ws3-m4v2-natural-aim-straddles-boundary", "ns_dtype": "float64", "overflows":'
             ' [], "params": [{"name": "m0.weight0", "num_heads": null, "shape": [2, 1]}, {"name": "m1.weight1", "'
             'num_heads": null, "shape": [1, 3]}, {"name": "m1.weight2", "num_heads": null, "shape": [1, 1]}, {"na'
             'me": "m1.weight3", "num_heads": null, "shape": [1, 1]}, {"name": "m2.bias4", "num_heads": null, "sha'
             'pe": [1]}, {"name": "m3.bias5", "num_heads": null, "shape": [1]}], "patched": false, "seed": 1108, "'
             'steps": 2, "timeout_s": 120.0, "world_size": 3}')
FUZZ_004_NIGHTLY = ('{"batch": 1, "checkpoint_at": null, "compiled": false, "ds_config": '
             '{"gradient_accumulation_steps": '
             '1, "gradient_clipping": 0.0, "optimizer": {"params": {"adam_lr": 0.001, "lr": 0.02, "momentum": 0.5,'
             ' "muon_lr": 0.02, "ns_method": "gram", "weight_decay": 0.0}, "type": "Muon"}, "steps_per_print": 100'
             '0000000, "train_batch_size": 3, "train_micro_batch_size_per_gpu": 1, "wall_clock_breakdown": false, '
             '"zero_optimization": {"stage": 1}}, "fault": null, "grad_cond": 1.0, "grad_elementwise": 1.0, "grad_'
             'scale": 1.0, "mutant": null, "name": "fuzz-z1-none-fp32-ws3-m4v1-low-rank-data-aim-padding-only-part'
             'ition", "ns_dtype": "float64", "overflows": [], "params": [{"name": "m0.weight0", "num_heads": null,'
             ' "shape": [1, 1]}, {"name": "m0.weight1", "num_heads": null, "shape": [2, 1]}, {"name": "m0.bias2", '
             '"num_heads": null, "shape": [13]}, {"name": "m0.weight3", "num_heads": null, "shape": [1, 1]}, {"nam'
             'e": "m0.weight4", "num_heads": null, "shape": [1, 3]}], "patched": false, "seed": 1686, "steps": 2, '
             '"timeout_s": 120.0, "world_size": 3}')


@pytest.mark.xfail(strict=True, reason="FUZZ-004 open: hpns momentum allowance omits lerp's g - M rounding")
@pytest.mark.parametrize("text", [FUZZ_004_CI, FUZZ_004_NIGHTLY],
                         ids=["ci-z1-cpu-bf16-ws3", "nightly-z1-none-fp32-ws3"])
def test_fuzz_004_hpns_momentum_of_a_scalar(text, pool_manager):
    from harness.case.spec import Case
    from harness.judge.verdict import judge

    case = Case.from_json(text)
    v = judge(case, support.run_case(pool_manager, case), keep_maps=False)
    assert v.passed, v.message(limit=1)
    # and the default mode judges the same run within tolerance (the divergence is the mode's)
    emulated = case.replace(ns_dtype=None)
    assert judge(emulated, support.run_case(pool_manager, emulated), keep_maps=False).passed


# --------------------------------------------------------------------------------------------------
# self-check against a layout mutant


def _catalogued(module, name: str) -> bool:
    """Whether ``module`` (``harness.registry.mutants``) lists a mutant called ``name``: a key of a
    module-level mapping, or an entry (or the ``name``/``id`` of an entry) of a module-level sequence."""
    for value in vars(module).values():
        if isinstance(value, dict) and name in value:
            return True
        if isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                if item == name or getattr(item, "name", None) == name or getattr(item, "id", None) == name:
                    return True
    return False


def mutant_unavailable(name: str) -> str | None:
    """Why a ``Case(mutant=name)`` cannot run here, or None."""
    if not S._module_exists("harness.rank.patches"):
        return ("harness.rank.patches does not exist yet (it installs mutants on the ranks, see "
                "harness.rank.ds_run.case_patches)")
    try:
        known = importlib.import_module("harness.registry.mutants")
    except ImportError as exc:
        return f"harness.registry.mutants cannot be imported ({exc})"
    if not _catalogued(known, name):
        return f"harness.registry.mutants catalogues no mutant {name!r}"
    return None


def search_for_failure(pool_manager, strategy, *, entry: str | None = None, **settings_overrides):
    """Search ``strategy`` for a case that fails its verdict (or crashes) under the active profile's
    budget, derandomised; returns (shrunk failing case, the worst case seen)."""
    worst = support.Worst()

    def fails(case) -> bool:
        try:
            v = support.judge_case(pool_manager, case, entry, worst)
        except support.CaseCrashed as exc:
            worst.update(case, math.inf, f"{case.name}: crashed: {str(exc).splitlines()[0]}")
            target(support.TARGET_CAP, label=support.TARGET_LABEL)
            return True
        worst.update(case, v.worst_ratio, support.verdict_summary(v))
        target(support.finite_score(v.worst_ratio), label=support.TARGET_LABEL)
        return not v.passed

    s = support.search_settings(derandomize=True, **settings_overrides)
    try:
        shrunk = find(strategy, fails, settings=s)
    except NoSuchExample:
        pytest.fail(f"profile {support.active_profile_name()}: no failing case in {s.max_examples} examples; "
                    f"{worst.describe()}")
    return shrunk, worst


def assert_one_small_matrix(shrunk, worst) -> None:
    muon = [p for p in shrunk.params if len(p.shape) >= 2]
    report = (f"shrunk to {shrunk.name} with params {[(p.name, p.shape) for p in shrunk.params]}\n"
              f"{support.reproducer(shrunk)}\n--- {worst.describe()}")
    assert len(muon) == 1, report
    assert muon[0].numel <= 2 * S.MAX_DIM and max(muon[0].shape) <= S.MAX_DIM, report
    print(report)


@pytest.mark.mutate
def test_fuzz_finds_padded_tail_mutant(pool_manager):
    reason = mutant_unavailable(MUTANT)
    if reason:
        pytest.skip(f"mutant {MUTANT!r} unavailable: {reason}")
    # the free-form half of the search: the layout-aimed half starts from the sweep's multi-matrix
    # layouts, which by design do not shrink to one matrix
    strategy = S.fuzz_cases(runtimes=("stock",)).map(
        lambda c: c.replace(name=f"{c.name}-mutant-{MUTANT}", mutant=MUTANT))
    shrunk, worst = search_for_failure(pool_manager, strategy)
    assert shrunk.mutant == MUTANT
    assert_one_small_matrix(shrunk, worst)
