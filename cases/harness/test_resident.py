"""The resident-momentum watch (``harness.rank.resident``): each promise of
``save_muon_momentum_buffer_in_memory`` that the oracle cannot see is a note, on a stand-in ZeRO-3 optimizer.
The real-run kills are the ``resident-momentum-state-copy`` and ``resident-momentum-written-to-swap`` mutants
(``harness.registry.mutants``) on the ``-inmem`` cases."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from harness.case.scenarios import pipeline_case
from harness.rank.resident import ResidentMomentumWatch, applies

INMEM = pipeline_case(3, "nvme", "fp32", 2, save_muon_momentum_buffer_in_memory=True)


def _opt(folder=None):
    fp32 = [torch.empty(0), torch.empty(0)]
    bufs = {0: torch.zeros(6)}
    opt = SimpleNamespace(muon_momentum_buffer_partitioned_groups_flat=bufs, fp32_partitioned_groups_flat=fp32,
                          fp16_partitioned_groups_flat_numel=[6, 4],
                          optimizer=SimpleNamespace(state={fp32[0]: {"momentum_buffer": bufs[0]}}))
    if folder is not None:
        opt.optimizer_swapper = SimpleNamespace(swap_folder=str(folder))
    return opt


def _watch(opt, case=INMEM):
    return ResidentMomentumWatch(case, SimpleNamespace(optimizer=opt))


def test_silent_while_the_state_is_the_resident_buffer_and_the_folder_holds_other_files(tmp_path):
    (tmp_path / "exp_avg-7.tensor.swp").write_bytes(b"")
    (tmp_path / "3.tensor.swp").write_bytes(b"")
    assert _watch(_opt(tmp_path)).check_step(1) == []


def test_a_copy_in_the_optimizer_state_is_a_note():
    opt = _opt()
    state = opt.optimizer.state[opt.fp32_partitioned_groups_flat[0]]
    state["momentum_buffer"] = state["momentum_buffer"].clone()  # equal values, another tensor
    assert any("is not the resident buffer" in n for n in _watch(opt).check_step(2))


def test_a_released_buffer_and_a_momentum_file_in_the_swap_folder_are_notes(tmp_path):
    opt = _opt(tmp_path)
    opt.muon_momentum_buffer_partitioned_groups_flat[0].data = torch.empty(0)  # what a swap-out's release does
    (tmp_path / "momentum_buffer-5.tensor.swp").write_bytes(b"")
    notes = _watch(opt).check_step(3)
    assert any("holds 0 elements" in n for n in notes), notes
    assert any("momentum_buffer-5.tensor.swp" in n for n in notes), notes


def test_no_resident_buffer_is_a_note_and_the_watch_is_off_without_the_option():
    opt = _opt()
    opt.muon_momentum_buffer_partitioned_groups_flat.clear()
    assert any("no Muon sub-group has a resident" in n for n in _watch(opt).check_step(1))
    plain = pipeline_case(3, "nvme", "fp32", 2)
    assert not applies(plain) and applies(INMEM)
    assert _watch(_opt(), plain).check_step(1) == []
