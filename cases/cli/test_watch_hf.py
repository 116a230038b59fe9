"""``python -m harness watch`` on a Hugging Face ``Trainer`` script (``cases/cli/watch_hf.py``: a small GPT-2
built in code, random tokens, the ``examples/`` Muon templates with ``"auto"`` entries) launched by
``torchrun --nproc_per_node 2`` on CPU, ZeRO-2 and ZeRO-3 (both with CPU offload, as the templates have
it): with the bundled fixes the watched steps pass, and the verdict rests on a step that moved the
weights (the templates' warm-up starts at lr 0)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness.env import buildenv
from harness.watch import records

from cases.cli._watch_run import watch, verdict_line

pytest.importorskip("accelerate")  # the Trainer runs DeepSpeed through it (the "models" extra)

SCRIPT = str(Path(__file__).with_name("watch_hf.py"))
EXAMPLES = buildenv.PROJECT_ROOT / "examples"

pytestmark = pytest.mark.pipeline


@pytest.mark.parametrize("template, path", [("hf_zero2_muon.json", "z12_offload"),
                                            ("hf_zero3_muon.json", "z3_offload")])
def test_trainer_script_is_watched_and_passes_patched(tmp_path, template, path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
               "--ds-config", str(EXAMPLES / template), "--patched", "--steps", "3", "--out", str(tmp_path / "hf")]
    res = watch(tmp_path / "records", command, "--steps", "3")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    line = verdict_line(res)
    assert line.startswith("verdict (patched): PASS") and "weights moved at" in line, line
    run = records.load(tmp_path / "records", "x")
    assert run.path == path
    assert any(p.uses_muon for p in run.case.params) and any(not p.uses_muon for p in run.case.params)
