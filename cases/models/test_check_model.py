"""``python -m harness check --model``: a real module next to ``--shapes``, and Hugging Face "auto"
values resolved as the Trainer would, each printed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.case import hf_auto


def test_auto_values_resolved_and_each_said():
    cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
           "optimizer": {"type": "Muon", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto"}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}}
    out, notes = hf_auto.resolve(cfg, 2, hidden_size=16, trainer_args=hf_auto.parse_trainer_args(
        ["learning_rate=3e-4", "bf16=true", "gradient_accumulation_steps=2"]))
    assert out["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.0, "betas": [0.9, 0.999]}
    assert out["gradient_accumulation_steps"] == 2 and out["train_batch_size"] == 8 * 2 * 2
    assert out["bf16"]["enabled"] is True and out["gradient_clipping"] == 1.0
    assert out["zero_optimization"]["stage3_param_persistence_threshold"] == 160
    assert "auto" not in json.dumps(out)
    assert len(notes) == 9 and all(n.startswith('"auto" ') for n in notes)
    with pytest.raises(ValueError, match="learning_rat"):
        hf_auto.parse_trainer_args(["learning_rat=1"])


def _check(*args):
    return subprocess.run([sys.executable, "-m", "harness", "check", *args], capture_output=True, text=True,
                          timeout=600)


def test_bad_model_is_bad_input_before_any_rank():
    r = _check("--ds-config", "examples/model_moe_zero3_fp32.json", "--model", "nosuch")
    assert r.returncode == 2 and "neither a built-in" in r.stdout + r.stderr
    r = _check("--ds-config", "examples/model_resnet_zero2_fp32.json", "--model", "moe", "--zero-init")
    assert r.returncode == 2 and "ZeRO-3" in r.stdout + r.stderr


@pytest.mark.pipeline
def test_check_model_zero_init_passes():
    r = _check("--ds-config", "examples/model_moe_zero3_fp32.json", "--model", "moe", "--zero-init", "--steps", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verdict: PASS" in r.stdout and "-zinit" in r.stdout
