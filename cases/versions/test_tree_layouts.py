"""Probes that read how a tree lays out what the harness looks into, and the bugs keyed on a tree's code.

Why: a tree that stores a structure differently (DeepSpeed PR #8464's ZeRO-3 gather cache holds 4-tuples
where 0.19.8 holds 3-tuples) or lacks a feature (its ZeRO-1/2 gathers in one call, without chunks) must give
"not on both" (a deselection naming the probe), never a harness exception or a failure of the case; and a bug
whose code moved (DSM-003 after the scale update on any stage) or has no model (DSM-115, DSM-118, DSM-021/022/
024, DSM-123) must be named where the tree's source shows its mechanism, not where a release number says.
The probes read source text, so each is held to a small synthetic file of each shape and to the released
trees it was written for. Pure: no ranks.
"""
from __future__ import annotations

import textwrap
from collections import OrderedDict
from types import SimpleNamespace

import pytest

from harness.catalog import matrix
from harness.env import tree, versions
from harness.rank.gather_cache import GatherCacheWatch
from harness.registry import bugs as registry
from harness.registry import historical

from cases.versions.trees import caps

# The probes are held to the installed tree as 0.19.8's (the pinned release they were written against); the
# version run on another release (.ci/run's 0.19.7 part) has no 0.19.8 installed to read.
pytestmark = pytest.mark.skipif(versions.installed().release != "0.19.8",
                                reason="reads the installed tree as DeepSpeed 0.19.8's")


@pytest.fixture(scope="module")
def gate():
    return {c.name: c for c in matrix.gate_cases()}


def _tree(tmp_path, files: dict[str, str]) -> tree.Capabilities:
    """A tree made of the given files (paths under the ``deepspeed`` package; ``../`` beside it)."""
    root = tmp_path / "deepspeed"
    for rel, text in files.items():
        path = (root / rel).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tree.capabilities(str(root))


def _like_0198(**answers) -> tree.Capabilities:
    """The installed 0.19.8's probe answers with some replaced (a tree that differs there only)."""
    base = tree.capabilities()
    return tree.Capabilities(base.root, {**base.answers, **answers})


def _probes(k: tree.Capabilities, prefix: str) -> dict:
    return {n: v for n, v in k.answers.items() if n.startswith(prefix)}


# ------------------------------------------------------------------------------------------------
# the Muon all-gather cache: its entries' layout, and chunking

Z3_CACHE = """
class DeepSpeedZeroOptimizer_Stage3:
    def __init__(self):
        self._muon_allgather_buffers = {{}}
        self._muon_allgather_buffer_bytes = 0

    def _partitioned_buffers_all_gather(self, key):
        cache_bytes = 8
{store}
"""
STORES = {
    "3-tuple": ("        self._muon_allgather_buffers[key] = (local_buffer, reduce_buffer, cache_bytes)\n"
                "        self._muon_allgather_buffer_bytes += cache_bytes"),
    "4-tuple": ("        self._muon_allgather_buffers[key] = (local_buffer, reduce_buffer, rearrange, cache_bytes)\n"
                "        self._muon_allgather_buffer_bytes += cache_bytes"),
    "by name": ("        entry = (local_buffer, cache_bytes)\n        self._muon_allgather_buffers[key] = entry\n"
                "        self._muon_allgather_buffer_bytes += cache_bytes"),
}


@pytest.mark.parametrize("store, want", [("3-tuple", (3, 2)), ("4-tuple", (4, 3))])
def test_the_cache_entry_layout_is_read_where_the_tree_stores_an_entry(tmp_path, store, want):
    k = _tree(tmp_path, {tree.STAGE3[0]: Z3_CACHE.format(store=STORES[store])})
    assert k["muon_allgather_entry(z3)"] == want
    assert tree.capabilities()["muon_allgather_entry(z3)"] == tree.capabilities()["muon_allgather_entry(z12)"] \
        == (3, 2)  # 0.19.8: (local, gathered, bytes) on both stages
    assert caps("0.19.7")["muon_allgather_entry(z3)"] is None  # no cache before 0.19.8


def test_an_entry_the_probe_cannot_read_deselects_the_gather_cases_naming_the_probe(tmp_path, gate):
    unread = _tree(tmp_path, {tree.STAGE3[0]: Z3_CACHE.format(store=STORES["by name"])})
    k = _like_0198(**_probes(unread, "muon_allgather_entry(z3)"))
    evict = versions.adapt(gate["z3-none-fp32-ws2-gather-evict"], k)
    assert evict.case is None
    assert "probe muon_allgather_entry(z3)" in evict.deselected and "(muon-allgather-entry)" in evict.deselected
    assert versions.adapt(gate["z3-cpu-fp16-ws2-growth"], k).case is not None  # no gather caps: nothing to read
    assert versions.adapt(gate["z1-cpu-fp32-ws2-gather"], k).case is not None  # ZeRO-1/2 reads its own
    assert versions.adapt(gate["z3-none-fp32-ws2-gather-evict"], tree.capabilities()).case is not None


def test_a_cache_of_another_entry_layout_deselects_only_the_cases_whose_cap_is_sized_for_0198s(tmp_path, gate):
    """PR #8464's ZeRO-3 entry keeps three buffers: a cap that holds one 0.19.8 entry may hold none of its, so
    the eviction claims do not carry over; the cap, counter and destroy checks do."""
    four = _tree(tmp_path, {tree.STAGE3[0]: Z3_CACHE.format(store=STORES["4-tuple"])})
    k = _like_0198(**_probes(four, "muon_allgather_entry(z3)"))
    z3 = {n: c for n, c in gate.items() if c.allgather_caps is not None and c.stage == 3}
    out = {n: versions.adapt(c, k) for n, c in z3.items()}
    assert {n for n, a in out.items() if a.case is None} == {n for n, c in z3.items() if c.allgather_evicts} \
        == {"z3-none-fp32-ws2-gather-evict", "z3-cpu-fp32-ws2-gather-evict"}
    assert all("(muon-allgather-evict-sizes)" in a.deselected and "probe muon_allgather_entry(z3): (4, 3)"
               in a.deselected for a in out.values() if a.case is None)


Z12_GATHER = """
class DeepSpeedZeroOptimizer:
    def _muon_all_gather_partitions(self, chunks, out):
{body}
"""
ONE_CALL = "        dist.all_gather_into_tensor(out, chunks)"
CHUNKED = "        for chunk in chunks:\n            dist.all_gather_into_tensor(out, chunk)"
CHUNK_CLAIMS = {"z1-cpu-fp32-ws2-gather", "z2-cpu-bf16-ws3-ga2-gather", "z1-cpu-fp32-ws2-gather-pack",
                "z1-cpu-fp32-ws2-gather-nocache", "z2-cpu-fp32-ws2-gather-oneelem"}


def test_a_zero12_that_gathers_in_one_call_deselects_exactly_the_cases_that_claim_chunks(tmp_path, gate):
    one = _tree(tmp_path / "one", {tree.STAGE12[0]: Z12_GATHER.format(body=ONE_CALL)})
    chunked = _tree(tmp_path / "chunked", {tree.STAGE12[0]: Z12_GATHER.format(body=CHUNKED)})
    assert (one["muon_allgather_chunked(z12)"], chunked["muon_allgather_chunked(z12)"]) == (False, True)
    assert tree.capabilities()["muon_allgather_chunked(z12)"] is True  # 0.19.8 chunks
    gathers = {n: c for n, c in gate.items() if c.allgather_caps is not None}
    assert {n for n, c in gathers.items() if versions.chunked_gathers(c)} == CHUNK_CLAIMS
    k = _like_0198(**_probes(one, "muon_allgather_chunked"))
    out = {n: versions.adapt(c, k) for n, c in gathers.items()}
    assert {n for n, a in out.items() if a.case is None} == CHUNK_CLAIMS
    assert all("probe muon_allgather_chunked(z12)" in out[n].deselected for n in CHUNK_CLAIMS)
    assert all(versions.adapt(c, tree.capabilities()).case is not None for c in gathers.values())


class _Opt:
    def __init__(self, entries):
        self._muon_allgather_max_buffer_bytes = 1 << 26
        self._muon_allgather_max_cached_bytes = 1 << 28
        self._muon_allgather_buffers = OrderedDict(entries)
        self._muon_allgather_buffer_bytes = sum(e[-1] for e in entries.values())


def _watch(entry, entries, stage=3):
    case = SimpleNamespace(allgather_caps=(96, 128), allgather_evicts=False, stage=stage)
    opt = _Opt(entries)
    k = _like_0198(**{f"muon_allgather_entry({'z3' if stage == 3 else 'z12'})": entry})
    return GatherCacheWatch(case, SimpleNamespace(optimizer=opt), k), opt


def test_the_watch_reads_each_entrys_bytes_where_the_trees_source_puts_them():
    """PR #8464's ZeRO-3 entry (local, reduce, rearrange, bytes): the bytes are the fourth element; read at
    0.19.8's index the third (a buffer) is no count. An entry of another length than the source stores is a
    note naming the probe, never an exception."""
    four = {"a": ([0.0], [0.0], [0.0], 96), "b": ([0.0], [0.0], [0.0], 96)}
    w, opt = _watch((4, 3), four)
    try:
        assert any("192 bytes > its cap 128" in n for n in w.check_step(1, chunked=False))
        opt._muon_allgather_buffers.clear()
        opt._muon_allgather_buffer_bytes = 0
        assert w.check_destroyed() == []
    finally:
        w.close()
    w, opt = _watch((3, 2), four)
    try:
        notes = w.check_step(1, chunked=False)
        assert len(notes) == 1 and "holds 4 element(s) where this tree's source stores 3" in notes[0]
        assert "probe muon_allgather_entry(z3)" in notes[0]
        assert any("probe muon_allgather_entry(z3)" in n for n in w.check_destroyed())
    finally:
        w.close()


# ------------------------------------------------------------------------------------------------
# Muon after the loss-scale update (DSM-003's variant), on any stage

Z3_0198 = """
class DeepSpeedZeroOptimizer_Stage3:
    def step(self):
        self._overflow_check_and_loss_scale_update(update_scale=False)
        if not self.overflow:
            self._apply_muon_to_accumulated_grads()
        if self._loss_scale_update_and_overflow_cleanup():
            return

    def _overflow_check_and_loss_scale_update(self, update_scale=True):
        if not update_scale:
            return self.overflow
        return self._loss_scale_update_and_overflow_cleanup()

    def _loss_scale_update_and_overflow_cleanup(self):
        self._update_scale(self.overflow)

    def _apply_muon_to_accumulated_grads(self):
        if self.offload_optimizer:
            self._apply_muon_updates_cpu_offload()
            return

    def _apply_muon_updates_cpu_offload(self):
        muon_update(g / self.loss_scale, m)
"""
Z3_PR = """
class DeepSpeedZeroOptimizer_Stage3:
    def step(self):
        if self._overflow_check_and_loss_scale_update():
            return
        norm_groups = self._get_norm_groups()

    def _overflow_check_and_loss_scale_update(self):
        self._update_scale(self.overflow)
        return self.overflow

    def _get_norm_groups(self):
        if self.offload_optimizer:
            self._apply_muon_updates_cpu_offload()
        return []

    def _apply_muon_updates_cpu_offload(self):
        muon_update(g / self.loss_scale, m)
"""


@pytest.mark.parametrize("text, want", [(Z3_0198, (False, False)), (Z3_PR, (False, True))])
def test_muon_after_the_scale_update_is_read_from_the_order_of_the_steps_calls(tmp_path, text, want):
    """0.19.8 checks overflow with ``update_scale=False`` (the guard returns before the update), runs Muon, and
    only then updates the scale; PR #8464's ZeRO-3 updates the scale first and runs Muon from
    ``_get_norm_groups``, on the offload path only."""
    k = _tree(tmp_path, {tree.STAGE3[0]: text})
    assert (k["muon_after_scale_update(z3,none)"], k["muon_after_scale_update(z3,offload)"]) == want
    assert not any(_probes(tree.capabilities(), "muon_after_scale_update").values())  # the installed 0.19.8


def test_dsm003s_variant_applies_wherever_the_tree_runs_muon_after_the_scale_update(tmp_path, monkeypatch, gate):
    """z3-cpu-fp16-ws2-growth on PR #8464's ZeRO-3 offload path: Muon's gradient divided by the grown scale is
    DSM-003's variant model, with ZeRO-3's reported norm (divided by the new scale); ZeRO-1/2 keep theirs.
    On 0.19.8's code the variant is not tried."""
    pr = _like_0198(**_probes(_tree(tmp_path, {tree.STAGE3[0]: Z3_PR}), "muon_after_scale_update(z3"))
    z12, stock = _like_0198(**{"muon_after_scale_update(z12,offload)": True}), _like_0198()
    variant = registry.BY_ID["DSM-003"].with_variants()[1]
    z3, z1 = gate["z3-cpu-fp16-ws2-growth"], gate["z1-cpu-fp16-ws2-growth"]
    assert variant.trigger(z3) and variant.trigger(z1)
    monkeypatch.setattr(tree, "capabilities", lambda root=None: pr)
    assert variant.model(z3) == {"scale_update_before_unscale": True, "muon_in_new_scale": True,
                                 "reported_norm": "clip_norm"}
    assert variant.model(gate["z3-none-fp16-ws2-growth"]) is None  # Muon runs before the update there
    assert variant.model(z1) is None  # this tree's ZeRO-1/2 is 0.19.8's
    monkeypatch.setattr(tree, "capabilities", lambda root=None: z12)
    assert variant.model(z1)["reported_norm"] == "norm" and variant.model(z3) is None
    monkeypatch.setattr(tree, "capabilities", lambda root=None: stock)
    assert variant.model(z3) is None and variant.model(z1) is None


# ------------------------------------------------------------------------------------------------
# DSM-124: the Adam that steps the parameters, as the tree's code says

MUON_OPT_INLINE = "class MuonWithAuxAdam:\n    def __init__(self, *args, **kwargs):\n        pass\n"
MUON_OPT_MODE = "class MuonWithAuxAdam:\n    def __init__(self, params, adam_w_mode=True):\n        pass\n"
FUSED_ONE = "void multi_tensor_adam(int mode) {\n    ds_adam_step(0, step, lr);\n}\n"
FUSED_PER_MODE = "void multi_tensor_adam(int mode) {\n    ds_adam_step(optimizer_id, step, lr);\n}\n"


def test_the_aux_adams_mode_and_the_cpu_fused_adam_op_are_read_from_the_source(tmp_path):
    before = _tree(tmp_path / "a", {tree.MUON_OPT[0]: MUON_OPT_INLINE, "../csrc/cpu/adam/fused_adam.cpp": FUSED_ONE})
    after = _tree(tmp_path / "b", {tree.MUON_OPT[0]: MUON_OPT_MODE, "ops/csrc/cpu/adam/fused_adam.cpp": FUSED_PER_MODE})
    assert (before["aux_adam_takes_mode"], before["cpu_fused_adam_one_mode"]) == (False, True)
    assert (after["aux_adam_takes_mode"], after["cpu_fused_adam_one_mode"]) == (True, False)
    for release, want in (("0.19.5", (False, True)), ("0.19.6", (True, False))):
        assert (caps(release)["aux_adam_takes_mode"], caps(release)["cpu_fused_adam_one_mode"]) == want
    assert tree.capabilities()["cpu_fused_adam_one_mode"] is False  # the installed wheel's ops/csrc


@pytest.mark.parametrize("aux_mode, one_mode, want", [
    (False, True, {"z2-cpu-fp32-ws2-auxl2", "z1-none-fp32-ws2-auxl2", "z2-none-fp32-ws2-adam-l2"}),
    (True, True, {"z1-none-fp32-ws2-auxl2", "z2-none-fp32-ws2-adam-l2"}),
    (True, False, set()),
])
def test_dsm124_triggers_where_the_adam_that_steps_ignores_the_mode(monkeypatch, gate, aux_mode, one_mode, want):
    """An inline auxiliary Adam (MuonWithAuxAdam without adam_w_mode, the master DeepSpeed PR #8464 branched
    from) decays decoupled with offload too; FusedAdam only without offload (with it the CPU Adam keeps the
    mode), and only where its CPU op steps every mode with one optimizer."""
    k = _like_0198(aux_adam_takes_mode=aux_mode, cpu_fused_adam_one_mode=one_mode)
    monkeypatch.setattr(tree, "capabilities", lambda root=None: k)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    l2 = ("z2-cpu-fp32-ws2-auxl2", "z1-none-fp32-ws2-auxl2", "z2-none-fp32-ws2-adam-l2", "z3-cpu-fp16-ws2-growth")
    assert {n for n in l2 if historical._adam_ignores_l2(gate[n])} == want


# ------------------------------------------------------------------------------------------------
# unmodelled bugs named by the tree's source (Bug.present)

SPLIT_BY_TYPE = """
def split_half_float_double(tensors):
    dtypes = ["torch.{}.FloatTensor".format(get_accelerator().device_name())]
    return [[t for t in tensors if t.type() == d] for d in dtypes]
"""
SPLIT_BY_DTYPE = """
def split_half_float_double(tensors):
    return [[t for t in tensors if t.dtype == d] for d in (torch.half, torch.float)]
"""
MUON_LERP = "def muon_update(grad, momentum, beta=0.95):\n    momentum.lerp_(grad, 1 - beta)\n    return grad\n"
MUON_GUARD = ("def muon_update(grad, momentum, beta=0.95):\n    ok = torch.isfinite(grad).all()\n"
              "    momentum.copy_(torch.where(ok, momentum.lerp(grad, 1 - beta), momentum))\n    return grad\n")
SWAP_VIEWS = """
class PartitionedOptimizerSwapper:
    def _swap_in_pinned_gradients(self, aio_handle, parameter, gradient_tensor):
        swap_buffers = [gradient_tensor.narrow(0, grad.offset, grad.length) for grad in grads]
        swap_in_tensors(aio_handle, swap_buffers, paths)
"""
SWAP_WHOLE = """
class PartitionedOptimizerSwapper:
    def _swap_in_pinned_gradients(self, aio_handle, parameter, gradient_tensor):
        swap_in_tensors(aio_handle, [gradient_tensor], paths)
"""


@pytest.mark.parametrize("probe, files, want", [
    ("z12_buckets_by_type_string", {tree.STAGE12[0]: SPLIT_BY_TYPE}, True),
    ("z12_buckets_by_type_string", {tree.STAGE12[0]: SPLIT_BY_DTYPE}, False),
    ("muon_update_guards_nonfinite", {tree.MUON_FN: MUON_LERP}, False),
    ("muon_update_guards_nonfinite", {tree.MUON_FN: MUON_GUARD}, True),
    ("swap_gradient_views(partitioned)", {tree.SWAP_PART[0]: SWAP_VIEWS}, True),
    ("swap_gradient_views(partitioned)", {tree.SWAP_PART[0]: SWAP_WHOLE}, False),
])
def test_the_mechanism_probes_read_the_source(tmp_path, probe, files, want):
    assert _tree(tmp_path, files)[probe] is want


def test_the_mechanism_probes_read_the_released_trees_as_their_bugs_were_measured():
    """DSM-115 measured on 0.19.0-0.19.7 (0.19.8 compares dtypes); DSM-118 on 0.19.0-0.19.6 (0.19.7 keeps a
    non-finite gradient out of the momentum); the swappers read through views on every release."""
    assert (caps("0.19.7")["z12_buckets_by_type_string"], tree.capabilities()["z12_buckets_by_type_string"]) \
        == (True, False)
    assert (caps("0.19.6")["muon_update_guards_nonfinite"], caps("0.19.7")["muon_update_guards_nonfinite"]) \
        == (False, True)
    for release in ("0.19.5", "0.19.8"):
        assert caps(release)["swap_gradient_views(partitioned)"] and caps(release)["swap_gradient_views(pipelined)"]


def test_unmodelled_bugs_are_expected_where_the_source_shows_their_mechanism(monkeypatch, gate):
    """On a source checkout: DSM-115 where ZeRO-1/2 bucket by type strings, DSM-118 where muon_update folds a
    non-finite gradient into the momentum, DSM-022/024 where the swapper reads through views, and the swapped
    Muon matrix sorted last as DSM-123 with Muon in the reduce (the update written back is lost) or DSM-021
    with Muon in the step (the gradient read is); on 0.19.8's code none of DSM-115, DSM-118, DSM-123."""
    monkeypatch.setattr(versions, "installed", lambda: versions.Installed("0.19.6+abc", True, "/src"))
    monkeypatch.delenv("MUON_HARNESS_MEASURE", raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    cases = {"DSM-115": "z1-none-fp32-ws2-knob-nocontig", "DSM-118": "z1-none-fp16-ws2-overflow",
             "DSM-022": "z3-nvme-part-fp32-ws1-bigadam", "DSM-024": "z3-nvme-pipe-fp32-ws1-bigadam"}
    sorted_last = gate["z3-nvme-part-fp32-ws1-sortedlast"]
    trees = {
        "base": _like_0198(z12_buckets_by_type_string=True, muon_update_guards_nonfinite=False,
                           **{"z3_muon_placement(offload)": "reduce", "z3_muon_placement(none)": "reduce"}),
        "0.19.8": _like_0198(),
    }
    for name, k in trees.items():
        monkeypatch.setattr(tree, "capabilities", lambda root=None, k=k: k)
        for bug, case in cases.items():
            shows = name == "base" or bug in ("DSM-022", "DSM-024")
            assert (bug in {b.id for b in registry.bugs_for(gate[case])}) is shows, (name, bug)
        at_sorted_last = {b.id for b in registry.bugs_for(sorted_last)} & {"DSM-021", "DSM-123"}
        assert at_sorted_last == ({"DSM-123"} if name == "base" else {"DSM-021"}), name
