"""Resuming into another world size (issue 13, group 5): DeepSpeed's route is the universal
checkpoint, and 0.19.8's converter cannot convert a Muon checkpoint on any ZeRO stage (DSM-018), so
the harness refuses such a case before any rank starts (``Case.resume_world_size``). The stock fact
is tested here, so that a DeepSpeed whose converter carries Muon's momentum fails this test and the
refusal can be replaced by gate cases."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.registry.bugs import BY_ID
from harness.case.spec import Case
from harness.case.scenarios import pipeline_case


def save_and_convert(case, rank, world_size, workdir):
    """Pool entry: two steps, ``save_checkpoint`` (with the client state the converter requires), then
    rank 0 runs ``ds_to_universal`` on it; returns (return code, stderr) on rank 0."""
    import torch.distributed as tdist

    from harness.case import synthetic
    from harness.rank.ds_run import build_engine, destroy_engine

    engine, _ = build_engine(case, Path(workdir) / "nvme")
    for step in (1, 2):
        loss = engine(synthetic.batch_data(case, rank, step, 0))
        engine.backward(loss)
        engine.step()
    ckpt = Path(workdir) / "ckpt"
    engine.save_checkpoint(str(ckpt), tag="t", client_state={"universal_checkpoint_info": {}})
    destroy_engine(engine)
    tdist.barrier()
    if rank != 0:
        return None
    r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        str(ckpt / "t"), "--output_folder", str(Path(workdir) / "universal" / "t"),
                        "--num_extract_workers", "1"], capture_output=True, text=True, timeout=240)
    return r.returncode, r.stderr


# ZeRO-1 converts through ZeRO-2's code (extract_zero_shards) and fails the same way (measured); the
# test keeps one conversion per code path (~12 s each here: a DeepSpeed import in a subprocess).
@pytest.mark.pipeline
@pytest.mark.parametrize("stage", [2, 3])
def test_universal_checkpoint_cannot_convert_muon(stage, pool_manager):
    case = pipeline_case(stage, "none", "fp32", 2, steps=2)
    rc, err = pool_manager.run(case.replace(name=case.name + "-universal"),
                               entry="cases.pipelines.test_universal:save_and_convert").result
    assert rc != 0 and BY_ID["DSM-018"].crash_matches(err), (rc, err[-2000:])


def test_a_resume_into_another_world_size_is_refused_naming_the_cause():
    c = pipeline_case(2, "none", "fp32", 2, steps=4).replace(checkpoint_at=2)
    assert c.replace(resume_world_size=2).resume_world_size == 2  # the same world size: a plain resume
    for ws in (1, 3):
        with pytest.raises(ValueError, match=r"universal checkpoint.*KeyError 'exp_avg'.*DSM-018"):
            c.replace(resume_world_size=ws)
    with pytest.raises(ValueError, match="universal checkpoint"):
        Case.from_json(c.to_json().replace('"resume_world_size": null', '"resume_world_size": 3'))
