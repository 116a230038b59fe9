"""The catalogued mutants (harness/registry/mutants.py) sit between DeepSpeed and the Muon call recorder, as
a source bug would: the recorder sees what the mutated DeepSpeed passes to ``muon_update`` and what
the real ``muon_update`` returns, not clean inputs and a mutated output (``harness.rank.ds_run.recorded_patches``:
the patched runtime, then the recorder, then the mutant).

No ranks: ``recorded_patches`` is entered in this process and ``muon_update`` is called the way a
DeepSpeed call site does (through the module attribute)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.env import buildenv
from harness.rank import patches
from harness.case.scenarios import pipeline_case

buildenv.apply_base_env()


def _call(mutant: str | None, grad, momentum, **kw):
    from deepspeed.runtime.zero.muon import original_muon

    from harness.rank.ds_run import recorded_patches

    case = pipeline_case(1, "none", "fp32", 1).replace(mutant=mutant)
    with recorded_patches(case) as rec:
        out = original_muon.muon_update(grad, momentum, **kw)
    return rec.calls, out


def test_the_recorder_sees_the_momentum_muon_update_left_not_the_mutants_rounding():
    """fp16-momentum rounds the momentum to fp16 after ``muon_update``: inside the recorder that
    rounding happens after the recorder read it (in the old order the recorder read it rounded)."""
    torch.manual_seed(0)
    g = torch.randn(6, 4, dtype=torch.float32)
    m = torch.full((6, 4), 1 / 3, dtype=torch.float32)
    calls, _ = _call("fp16-momentum", g.clone(), m)
    assert len(calls) == 1
    seen = calls[0].momentum
    assert torch.equal(m, m.half().float())  # what DeepSpeed's state holds: rounded by the mutant
    assert not np.array_equal(seen, m.double().numpy())  # what muon_update produced: not yet rounded


def test_the_recorder_sees_the_arguments_the_mutant_passes():
    """momentum-beta-off passes beta - 0.05: the recorder's update equals a clean call with that beta,
    and the update a clean call with the configured beta differs. The momentum buffer starts non-zero
    and independent of the gradient: from a zero buffer beta only scales the update's input, which
    Newton-Schulz normalises away, so the two betas can round to the same update (they did on an
    Intel Xeon, 2026-12-02) and the test could not tell them apart."""
    torch.manual_seed(1)
    g = torch.randn(6, 4, dtype=torch.float32)
    m = torch.randn(6, 4, dtype=torch.float32)
    calls, out = _call("momentum-beta-off", g.clone(), m.clone(), beta=0.95)
    ref_off, _ = _call(None, g.clone(), m.clone(), beta=0.90)
    ref_on, _ = _call(None, g.clone(), m.clone(), beta=0.95)
    assert np.array_equal(calls[0].update, ref_off[0].update)
    assert not np.array_equal(calls[0].update, ref_on[0].update)
    assert np.array_equal(calls[0].update, out.double().numpy())


def test_part_must_be_known():
    with pytest.raises(ValueError, match="part"):
        patches.enter(pipeline_case(1, "none", "fp32", 1), "everything")
