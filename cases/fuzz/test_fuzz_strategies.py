"""The case strategies reach what they are meant to reach -- no DeepSpeed run involved.

Over 200 derandomised draws of ``cases.strategies.cases()`` every layout class appears (a matrix
straddling a partition boundary, a padded final partition, a rank owning no element of a matrix, a
partition holding only padding), each layout-aimed strategy always produces its class, and every
drawn case is well formed: valid names in model order, JSON round trip, no catalogued bug on the
runtime it targets.
"""
from __future__ import annotations

import collections
import math

import pytest
from hypothesis import HealthCheck
from hypothesis import strategies as st

from cases import strategies as S
from cases.fuzz import support
from harness.case.spec import Case
from harness.case.synthetic import check_params

pytestmark = pytest.mark.fuzz

DRAWS = 200
RUNTIMES = S.available_runtimes()


def draw_cases(strategy: st.SearchStrategy, n: int) -> list[Case]:
    return support.draw(strategy, n, suppress=(HealthCheck.too_slow, HealthCheck.filter_too_much,
                                              HealthCheck.data_too_large))


@pytest.fixture(scope="module")
def drawn() -> list[Case]:
    return draw_cases(S.cases(runtimes=RUNTIMES), DRAWS)


def test_every_layout_class_is_reached(drawn):
    counts = collections.Counter(cls for c in drawn for cls in S.layout_classes(c))
    where = collections.Counter(f"{cls} ({w})" for c in drawn for cls, ws in S.layout_details(c).items() for w in ws)
    print(f"layout classes over {len(drawn)} draws: {dict(counts)}; by group: {dict(where)}")
    missing = [cls for cls in S.LAYOUT_CLASSES if counts[cls] == 0]
    assert not missing, f"never drawn in {len(drawn)} cases: {missing} (counts {dict(counts)})"
    # ... and each of them in the Muon group, where Muon's whole-matrix gather has to cope with it
    missing_muon = [cls for cls in S.LAYOUT_CLASSES if where[f"{cls} (muon)"] == 0]
    assert not missing_muon, f"never in the Muon group: {missing_muon} ({dict(where)})"


def test_shapes_and_knobs_are_reached(drawn):
    mats = [p.shape for c in drawn for p in c.params if len(p.shape) >= 2]
    kinds = {
        "1xN": any(s[0] == 1 and s[1] > 1 for s in mats),
        "Nx1": any(s[1] == 1 and s[0] > 1 for s in mats),
        "tall": any(s[0] >= 3 * s[1] for s in mats),
        "wide": any(s[1] >= 3 * s[0] for s in mats),
        "odd numel": any(math.prod(s) % 2 for s in mats),
        "prime numel": any(math.prod(s) in S.PRIMES for s in mats),
        "several matrices": any(sum(len(p.shape) >= 2 for p in c.params) >= 3 for c in drawn),
        "adam vectors": any(any(len(p.shape) == 1 for p in c.params) for c in drawn),
        "vectors before matrices": any(len(c.params[0].shape) == 1 and any(len(p.shape) >= 2 for p in c.params)
                                       for c in drawn),
        "equal-shape tie": any(len(set(s for s in (p.shape for p in c.params if len(p.shape) >= 2)))
                               < sum(len(p.shape) >= 2 for p in c.params) for c in drawn),
        "per-head": any(p.num_heads for c in drawn for p in c.params),
    }
    knobs = {
        "world sizes": {c.world_size for c in drawn} == set(S.WORLD_SIZES),
        "stages": {c.stage for c in drawn} == set(S.STAGES),
        "offloads": {"none", "cpu"} <= {c.offload for c in drawn},
        "dtypes": {c.dtype for c in drawn} == set(S.device_dtypes()),
        "grad accumulation": {c.grad_accum for c in drawn} >= {1, 2, 3},
        "clipping on and off": {c.config["gradient_clipping"] > 0 for c in drawn} == {True, False},
        "low-rank data": any(c.batch <= 2 for c in drawn),
        "forced overflow": any(c.overflows for c in drawn) or "fp16" not in S.device_dtypes(),
    }
    missing = [k for k, ok in {**kinds, **knobs}.items() if not ok]
    assert not missing, f"not drawn in {len(drawn)} cases: {missing}"


def test_swarm_gives_rare_combinations_budget(drawn):
    """Swarm draws vary each knob in about half the cases and leave it at its default otherwise, so
    cases that change several knobs at once, and cases that change almost nothing, both occur."""
    def varied(c):
        opt = c.config["optimizer"]["params"]
        return {"accumulation": c.grad_accum > 1, "clipping": c.config["gradient_clipping"] > 0,
                "ns_method": opt["ns_method"] != "gram", "momentum": opt["momentum"] != 0.95,
                "weight_decay": opt["weight_decay"] != 0.0, "steps": c.steps != 2}

    rows = [varied(c) for c in drawn]
    for knob in rows[0]:
        share = sum(r[knob] for r in rows) / len(rows)
        assert 0.03 < share < 0.75, f"{knob} varied in {share:.0%} of {len(rows)} draws"
    counts = collections.Counter(sum(r.values()) for r in rows)
    assert counts[0] > 0 and sum(v for k, v in counts.items() if k >= 4) > 0, counts


def test_drawn_cases_are_well_formed(drawn):
    for c in drawn:
        check_params(c.params)
        assert S.model_order_matches(c.params), c.params
        assert Case.from_json(c.to_json()) == c
        assert S.case_is_clean(c), c.name
        assert c.world_size in S.WORLD_SIZES
        assert c.patched == (c.patched and "patched" in RUNTIMES)
        assert all(d <= S.MAX_DIM for p in c.params if p.name != "nvme.weight" for d in p.shape)


@pytest.mark.parametrize("aim", S.LAYOUT_CLASSES)
def test_layout_aimed_strategy_hits_its_class(aim):
    got = draw_cases(S.layout_aimed_cases(aim, runtimes=RUNTIMES), 40)
    misses = [c.to_json() for c in got if aim not in S.layout_classes(c)]
    assert not misses, f"{len(misses)} of {len(got)} aimed at {aim} missed it, e.g. {misses[0]}"
    assert any("muon" in S.layout_details(c)[aim] for c in got)
    assert all(S.shows_with_neighbours(c, aim) for c in got)


def test_stock_runtime_excludes_catalogued_bugs():
    """DSM-001 (16-bit momentum on ZeRO-3 or without offload) and DSM-002 (NVMe at ZeRO-1/2) are
    never drawn for stock DeepSpeed; fp16/bf16 are drawn only on ZeRO-1/2 with CPU offload."""
    pipes = set(S.clean_pipelines("stock", nvme=True))
    for stage, offload, dtype in pipes:
        if dtype != "fp32":
            assert stage in (1, 2) and offload == "cpu", (stage, offload, dtype)
        if offload == "nvme":
            assert stage == 3
    assert (3, "nvme", "fp32") in pipes and (1, "cpu", "bf16") in pipes
    assert ((2, "cpu", "fp16") in pipes) == ("fp16" in S.device_dtypes())  # FUZZ-002: fp16 only where supported


def test_patched_runtime_never_draws_a_refused_case():
    """FUZZ-003: the patched runtime's fix for DSM-002 refuses ZeRO-1/2 NVMe, so those pipelines are not
    drawn for it (the nightly profile drew fuzz-z1-nvme-fp32-ws2 patched and reported the refusal)."""
    if "patched" not in RUNTIMES:
        pytest.skip("no patched runtime in this checkout")
    pipes = set(S.clean_pipelines("patched", nvme=True))
    assert not {p for p in pipes if p[1] == "nvme" and p[0] in (1, 2)}, pipes
    assert (3, "nvme", "fp32") in pipes
