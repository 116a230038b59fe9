"""The torchrun launch mode (``harness.launch.torchrun``) on CPU: gloo, ``env://``, two ranks.

The smoke cases (ZeRO 1/2/3 x offload none/cpu, fp32, world size 2) run in ONE torchrun launch (the
process start and the torch/DeepSpeed import are paid once), pass the oracle, and give trajectories
bit-identical to the rank pool's. A rank that raises is reported by rank, with its traceback, and
nothing of the launch is left running.
"""
from __future__ import annotations

import uuid

import pytest

from harness.env import buildenv
from harness.launch import torchrun
from harness.launch.pool import RankFailed
from harness.case.scenarios import pipeline_case
from harness.judge.verdict import judge

SMOKE = [pipeline_case(stage, offload, "fp32", 2) for stage in (1, 2, 3) for offload in ("none", "cpu")]


def test_launch_env_depends_on_the_accelerator():
    cpu = torchrun.launch_env("cpu")
    assert cpu["DS_ACCELERATOR"] == "cpu" and cpu["TORCH_EXTENSIONS_DIR"] == str(buildenv.extensions_dir())
    cuda = torchrun.launch_env("cuda")
    assert cuda["DS_ACCELERATOR"] == "cuda"  # never forced to cpu on a GPU machine
    assert cuda["TORCH_EXTENSIONS_DIR"] != cpu["TORCH_EXTENSIONS_DIR"]  # CUDA op builds in a folder of their own
    assert torchrun.backend_for("cpu") == "gloo" and torchrun.backend_for("cuda") == "nccl"
    with pytest.raises(ValueError):
        torchrun.launch_env("auto")  # resolve first
    with pytest.raises(ValueError):
        torchrun.resolve_accelerator("tpu")


def test_torchrun_command():
    cmd = torchrun.torchrun_command("c.json", "r.pkl", 2, accelerator="cpu", python="py")
    assert cmd[:4] == ["py", "-m", "torch.distributed.run", "--standalone"]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
    assert cmd[cmd.index("-m", 3) + 1] == "harness.launch.torchrun"
    assert cmd[-6:] == ["--case-file", "c.json", "--out", "r.pkl", "--accelerator", "cpu"]
    multi = torchrun.torchrun_command("c.json", "r.pkl", 8, accelerator="cuda", nnodes=2,
                                      rdzv_endpoint="node0:29400", python="py")
    assert "--standalone" not in multi
    assert multi[multi.index("--rdzv-endpoint") + 1] == "node0:29400"
    assert multi[multi.index("--nnodes") + 1] == "2"


@pytest.mark.pipeline
def test_smoke_cases_via_torchrun_match_the_pool_bit_for_bit(pool_manager):
    uid = uuid.uuid4().hex[:12]
    trajectories = torchrun.run_cases_with_torchrun(SMOKE, 2, accelerator="cpu", uid=uid)
    assert torchrun.marked_processes(uid) == []  # nothing of the launch is left
    assert len(trajectories) == len(SMOKE)
    for case, traj in zip(SMOKE, trajectories):
        assert traj.case_name == case.name and len(traj.steps) == case.steps
        verdict = judge(case, traj)
        assert verdict.passed, verdict.message()
        pooled = pool_manager.run(case).result
        assert traj.fingerprint() == pooled.fingerprint(), f"{case.name}: torchrun and pool trajectories differ"


@pytest.mark.pipeline
def test_a_failing_rank_is_named_with_its_traceback():
    uid = uuid.uuid4().hex[:12]
    case = SMOKE[0].replace(name="faulty", fault="raise:1")
    with pytest.raises(RankFailed) as e:
        torchrun.run_with_torchrun(case, 2, accelerator="cpu", uid=uid)
    assert e.value.rank == 1 and e.value.case_name == "faulty"
    assert "injected fault on rank 1" in str(e.value)
    assert torchrun.marked_processes(uid) == []


def test_a_parent_killed_from_outside_leaves_no_launch_behind(tmp_path):
    """A CI timeout kills the harness with SIGKILL: the torchrun launcher (its own session) and its
    ranks must go with it, not run on as orphans holding ports and build locks."""
    import signal
    import subprocess
    import sys
    import time

    uid = "orphan-check-" + uuid.uuid4().hex[:8]
    case = pipeline_case(1, "none", "fp32", 2, steps=1).replace(fault="hang:0", timeout_s=120.0)
    script = (f"from harness.launch import torchrun; from harness.case.spec import Case; "
              f"torchrun.run_cases_with_torchrun([Case.from_json({case.to_json()!r})], 2, uid={uid!r}, "
              f"root={str(tmp_path)!r})")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=str(buildenv.PROJECT_ROOT))
    deadline = time.time() + 90
    while time.time() < deadline and len(torchrun.marked_processes(uid)) < 3:  # launcher + 2 ranks
        time.sleep(0.5)
    assert len(torchrun.marked_processes(uid)) >= 3, "the launch never started"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 30
    while time.time() < deadline and torchrun.marked_processes(uid):
        time.sleep(0.5)
    assert torchrun.marked_processes(uid) == []
