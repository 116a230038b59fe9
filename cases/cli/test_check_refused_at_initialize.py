"""A refusal only ``deepspeed.initialize`` makes reaches ``check`` from the ranks: exit 2 with DeepSpeed's own
words and the frame that raised them, never PASS and never "the run failed". Real ranks and a real
refusal: the registry's knowledge of it (``harness.registry.refusals``) is taken away in this process, so
the pre-check lets the config through, the gate does not expect the refusal, and DeepSpeed's ZeRO-3 raises
"Muon and reduce scatter cannot be used together" inside ``deepspeed.initialize``."""
from __future__ import annotations

import argparse
import json

import pytest

from harness.cli import check, check_plan, parser
from harness.gate import decide

pytestmark = pytest.mark.pipeline


def test_a_refusal_the_registry_does_not_know_exits_2_from_the_ranks_traceback(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(check_plan.ds_refusals, "expected", lambda case: [])
    monkeypatch.setattr(decide.ds_refusals, "expected", lambda case: [])
    cfg = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": "3"},
           "train_micro_batch_size_per_gpu": 1}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    ap = argparse.ArgumentParser()
    parser.add_check_arguments(ap)
    code = check.run_check(ap.parse_args(["--ds-config", str(path), "--no-report", "--shapes", "16x8", "--json"]))
    out, err = capfd.readouterr()
    result = json.loads(out.strip().splitlines()[-1])  # the one JSON object ends stdout (an op build may say more)
    assert code == check.EXIT_BAD_INPUT and (result["verdict"], result["exit_code"]) == ("refused", 2), err[-2000:]
    assert result["refused"].startswith("DeepSpeed 0.19.8 refuses this config: ValueError: Muon and reduce "
                                        "scatter cannot be used together (stage3.py:__init__)")
