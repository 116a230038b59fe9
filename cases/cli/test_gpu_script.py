"""The GPU run's case selection and launch plumbing, checked where no GPU is (the run itself needs one)."""
from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest

from harness.cli import gpu
from harness.launch.pool import CaseFailure
from harness.judge.verdict import comparison_mode

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_subset_covers_every_stage_offload_and_dtype_at_every_world_size():
    cases = gpu.gpu_cases((1, 4))
    eager = [c for c in cases if not c.compiled]
    for ws in (1, 4):
        got = {(c.stage, c.offload, c.dtype) for c in eager if c.world_size == ws}
        assert got == set(itertools.product(gpu.STAGES, gpu.OFFLOADS, gpu.DTYPES))
        assert {c.stage for c in cases if c.compiled and c.world_size == ws} == set(gpu.STAGES)
    assert len({c.name for c in cases}) == len(cases)


def test_gpu_cases_never_rely_on_the_cpu_bit_exact_emulation():
    # cuBLAS rounds 16-bit Newton-Schulz in its own order: eager cases are judged in hpns mode,
    # compiled ones in exact mode, never in the CPU-only emulated mode.
    modes = {comparison_mode(c) for c in gpu.gpu_cases((2,))}
    assert modes == {"hpns", "exact"}


class _FakeSingle:
    def __init__(self):
        self.ran = []

    def run(self, case, entry=None):
        self.ran.append(case.name)
        return "single"

    def close(self):
        pass


def test_a_failed_batch_launch_falls_back_to_one_launch_per_case(monkeypatch, tmp_path):
    import harness.launch.torchrun as tr

    cases = [c for c in gpu.gpu_cases((2,), compiled=False)][:3]

    def failing_batch(group, nproc, **kw):
        raise CaseFailure(group[0].name, "rank 1 raised")

    monkeypatch.setattr(tr, "run_cases_with_torchrun", failing_batch)
    m = gpu.PrelaunchedManager("cpu", tmp_path)
    m.single = _FakeSingle()
    m.prelaunch(cases)
    for c in cases:
        assert m.run(c) == "single"
    assert m.single.ran == [c.name for c in cases]


def test_a_batch_launch_answers_each_case_once(monkeypatch, tmp_path):
    import harness.launch.torchrun as tr

    cases = [c for c in gpu.gpu_cases((2,), compiled=False)][:3]
    monkeypatch.setattr(tr, "run_cases_with_torchrun", lambda group, nproc, **kw: [f"traj-{c.name}" for c in group])
    m = gpu.PrelaunchedManager("cpu", tmp_path)
    m.single = _FakeSingle()
    m.prelaunch(cases)
    assert [m.run(c).result for c in cases] == [f"traj-{c.name}" for c in cases]
    m.run(cases[0])  # a second run of the same case is a new launch, not a stale answer
    assert m.single.ran == [cases[0].name]


def test_gpu_script_refuses_a_machine_without_cuda():
    proc = subprocess.run(["bash", "scripts/gpu.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": f"{ROOT}/.venv/bin:/usr/bin:/bin", "HOME": str(Path.home())})
    assert proc.returncode == 2
    assert "sees no CUDA device" in proc.stderr


@pytest.mark.parametrize("argv", [["--accelerator", "cuda"]])
def test_gpu_entry_refuses_cuda_without_a_device(argv, capsys):
    assert gpu.main(argv + ["--only", "nothing"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
