"""``harness.fixes`` as a library: apply / remove / applied / fix_names, idempotence, the
version guard, the source-hash guard, and the link between fixes and the bug registry. No ranks."""
from __future__ import annotations

import pytest

from harness.registry import bugs
from harness import fixes as patched_runtime
from harness.fixes import PatchedRuntimeError, _registry


@pytest.fixture(autouse=True)
def clean():
    patched_runtime.remove()
    yield
    patched_runtime.remove()


def _targets():
    out = {}
    for f in patched_runtime.FIXES.values():
        for t in f.targets:
            out[t.key] = t
    return out


def _current(t):
    owner, attr = t.owner_and_attr()
    return owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)


def test_apply_remove_round_trip_restores_the_very_same_functions():
    before = {k: _current(t) for k, t in _targets().items()}
    assert patched_runtime.applied() == []
    names = patched_runtime.apply()
    assert names == patched_runtime.fix_names() == patched_runtime.applied()
    for k, t in _targets().items():
        assert _current(t) is not before[k], k
    assert patched_runtime.apply() == names  # idempotent
    assert patched_runtime.remove() == []
    for k, t in _targets().items():
        assert _current(t) is before[k], k


def test_subsets_share_targets_and_keep_them_while_needed():
    t = patched_runtime.z3.T_SUBGROUP  # needed by the fp32 fix, the ns_method fix and the units fix
    stock = _current(t)
    patched_runtime.apply(["z3-per-group-ns-method", "z3-fp32-muon-state"])
    patched = _current(t)
    assert patched is not stock
    patched_runtime.remove("z3-fp32-muon-state")
    assert _current(t) is patched and patched_runtime.applied() == ["z3-per-group-ns-method"]
    patched_runtime.remove("z3-per-group-ns-method")
    assert _current(t) is stock


def test_refuses_another_deepspeed_version(monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.19.9")
    with pytest.raises(PatchedRuntimeError, match="0.19.8"):
        patched_runtime.apply()
    assert patched_runtime.applied() == []


def test_refuses_a_function_it_was_not_written_against_and_installs_nothing():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z3

    orig = Z3.__dict__["destroy"]
    before = {k: _current(t) for k, t in _targets().items()}

    def destroy(self):  # somebody else's patch
        return orig(self)

    Z3.destroy = destroy
    try:
        with pytest.raises(PatchedRuntimeError, match="source hash"):
            patched_runtime.apply()
        assert patched_runtime.applied() == []
        for k, t in _targets().items():
            if k.endswith("DeepSpeedZeroOptimizer_Stage3.destroy"):
                continue
            assert _current(t) is before[k], f"{k} left installed after a refused apply"
        patched_runtime.apply(["z12-fp32-muon-state"])  # fixes that do not touch it still install
    finally:
        Z3.destroy = orig


def test_recorded_hashes_are_those_of_the_installed_deepspeed():
    for k, t in _targets().items():
        owner, attr = t.owner_and_attr()
        assert _registry.source_hash(_current(t), attr) == t.sha256_16, k


def test_every_fix_names_a_registered_bug_which_reads_it_back():
    for f in patched_runtime.FIXES.values():
        assert f.bugs and f.targets and f.summary, f"{f.name}: a fix declares its bugs, targets and summary"
        for b in f.bugs:
            assert b in bugs.BY_ID, (f.name, b)
            assert f.name in bugs.BY_ID[b].fixed_by, (f.name, b)


def test_bugs_for_patched_keeps_only_unfixed_bugs():
    from harness.case.scenarios import pipeline_case

    c = pipeline_case(1, "none", "bf16", 2, steps=3)
    assert [b.id for b in bugs.bugs_for(c)] == ["DSM-001"]
    assert bugs.bugs_for(c.replace(patched=True), patched=True) == []
    nv = pipeline_case(2, "nvme", "fp32", 1)
    # DSM-002's fix is a refusal: no longer an expected divergence, but an expected refusal.
    assert bugs.bugs_for(nv.replace(patched=True), patched=True) == []
    assert [b.id for b in bugs.refusals_for(nv)] == ["DSM-002"]
    unfixed = pipeline_case(1, "none", "bf16", 2, steps=3, extra_zero=None)
    assert bugs.refusals_for(unfixed) == []


def test_zero12_nvme_is_refused_with_its_cause_when_patched(pool_manager):
    """DSM-002's fix: stock silently runs CPU offload (0 bytes swapped); patched refuses, naming why."""
    from harness.gate.decide import evaluate
    from harness.case.scenarios import pipeline_case

    case = pipeline_case(1, "nvme", "fp32", 1, steps=1)
    stock = evaluate(case, "stock", pool_manager)
    assert stock.status == "xfailed" and stock.bug_ids == ["DSM-002"] and stock.swapped_bytes == 0
    patched = evaluate(case, "patched", pool_manager)
    assert patched.status == "passed" and patched.refused, patched.message
    assert "do not implement NVMe optimizer offload" in patched.message


def test_describe_lists_every_fix():
    text = patched_runtime.describe()
    for name, f in patched_runtime.FIXES.items():
        assert name in text and all(b in text for b in f.bugs)


def test_a_function_is_read_back_once_and_a_replacement_is_hashed_on_its_own(monkeypatch):
    import inspect

    reads = []
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: reads.append(obj) or real(obj))
    monkeypatch.setattr(_registry, "_HASHED", {})

    def f(x):
        return x + 1

    first = _registry.source_hash(f)
    assert _registry.source_hash(f) == first and len(reads) == 1  # every patched case verifies: read once

    def f(x):  # noqa: F811 -- the same name, another body: a mutant or somebody else's patch
        return x - 1

    assert _registry.source_hash(f) != first and len(reads) == 2


def test_a_fix_that_covers_part_of_a_bug_leaves_it_expected_elsewhere():
    """DSM-023's fix leaves ZeRO-3 NVMe as stock runs it (harness/fixes/stale.py says why):
    the patched column still expects the bug there, and only there."""
    from harness.catalog import matrix

    by_name = {c.name: c for c in matrix.unused_cases()}
    nvme, cpu = by_name["z3-nvme-part-fp32-ws2-skiplayer"], by_name["z3-cpu-fp32-ws2-skiplayer"]
    for c in (nvme, cpu):
        assert "DSM-023" in {b.id for b in bugs.bugs_for(c)}
    assert "DSM-023" in {b.id for b in bugs.bugs_for(nvme, patched=True)}
    assert "DSM-023" not in {b.id for b in bugs.bugs_for(cpu, patched=True)}
