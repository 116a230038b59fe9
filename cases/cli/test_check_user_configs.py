"""Configs as users write them, through ``check``'s planning (no ranks): the minimal Muon config, a full
one with each optional key left out in turn, and the Hugging Face Trainer's ZeRO-2 and ZeRO-3 templates
with their "auto" values resolved from TrainingArguments values. A handful run for real (pipeline)."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cases.cli._plan import plan
from harness.cli.check_config import BadInput, Refused

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"optimizer": {"type": "Muon"}, "zero_optimization": {"stage": 2}}
FULL = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-4, "momentum": 0.95,
                                                 "weight_decay": 0.01, "ns_method": "gram"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.02,
                                                     "warmup_num_steps": 2}},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}}
OPTIONAL = [("train_batch_size",), ("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",),
            ("gradient_clipping",), ("bf16",), ("optimizer", "params"), ("optimizer", "params", "lr"),
            ("optimizer", "params", "adam_lr"), ("optimizer", "params", "momentum"),
            ("optimizer", "params", "weight_decay"), ("optimizer", "params", "ns_method"), ("scheduler",),
            ("zero_optimization", "overlap_comm"), ("zero_optimization", "contiguous_gradients")]

# The Trainer's documented templates (docs: "DeepSpeed" / "ZeRO-2 example", "ZeRO-3 example"), with the
# optimizer a Muon user puts in and, at ZeRO-3, the reduce_scatter Muon needs.
HF_SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                           "warmup_num_steps": "auto"}}
HF_OPT = {"type": "Muon", "params": {"lr": "auto", "weight_decay": "auto"}}
HF_COMMON = {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                      "hysteresis": 2, "min_loss_scale": 1}, "bf16": {"enabled": "auto"},
             "optimizer": HF_OPT, "scheduler": HF_SCHED, "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "steps_per_print": 2000, "train_batch_size": "auto",
             "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
HF_ZERO2 = {**HF_COMMON, "zero_optimization": {
    "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
    "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": "auto",
    "contiguous_gradients": True}}
HF_ZERO3 = {**HF_COMMON, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}}
TRAINER = ["--trainer-arg", "learning_rate=0.02", "--trainer-arg", "warmup_steps=2",
           "--trainer-arg", "per_device_train_batch_size=2", "--trainer-arg", "gradient_accumulation_steps=2"]


def _without(cfg: dict, path: tuple) -> dict:
    cfg = copy.deepcopy(cfg)
    node = cfg
    for k in path[:-1]:
        node = node[k]
    del node[path[-1]]
    return cfg


def test_the_minimal_muon_config_plans_on_documented_defaults(tmp_path):
    p = plan(tmp_path, MINIMAL)
    ds = p.case.ds
    assert ds.source("gradient_clipping").endswith("default")
    assert ds.optimizer.muon.lr is not None and ds.source("optimizer.muon.lr").endswith("default")
    assert (p.case.stage, p.case.dtype, p.case.grad_accum) == (2, "fp32", 1)


@pytest.mark.parametrize("path", OPTIONAL, ids=".".join)
def test_each_optional_key_left_out_plans_on_its_default(tmp_path, path):
    p = plan(tmp_path, _without(FULL, path))
    full = plan(tmp_path, FULL)
    key = {("gradient_clipping",): "gradient_clipping", ("optimizer", "params", "lr"): "optimizer.muon.lr",
           ("optimizer", "params", "momentum"): "optimizer.muon.momentum"}.get(path)
    if key:  # the value now comes from the installed release's documented default, and says so
        assert p.case.ds.source(key).endswith("default") and full.case.ds.source(key).startswith("config")
    if path == ("scheduler",):
        assert p.case.schedule is None and not any("scheduler" in n for n in p.notes)
    if path == ("bf16",):
        assert p.case.dtype == "fp32"
    cfg = p.case.config
    assert cfg["train_batch_size"] == (cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
                                       * p.case.world_size)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_hf_zero2_template_resolves_from_training_arguments(tmp_path, dtype):
    p = plan(tmp_path, HF_ZERO2, *TRAINER, "--trainer-arg", f"{dtype}=true")
    cfg = p.case.config
    assert "auto" not in json.dumps(cfg)
    assert p.case.dtype == dtype and p.case.ds.optimizer.muon.lr == 0.02
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.02, "warmup_num_steps": 2}
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 2)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == max(max(s) for s in p.requested) ** 2
    notes = "\n".join(p.notes)
    for key in ("optimizer.params.lr", "optimizer.params.weight_decay", "gradient_clipping", f"{dtype}.enabled",
                "scheduler.params.warmup_num_steps", "zero_optimization.reduce_bucket_size"):
        assert f'"auto" {key} -> ' in notes, key


def test_the_hf_zero3_template_needs_reduce_scatter_off_for_muon_and_then_resolves(tmp_path):
    words = "refuses this config: ValueError: Muon and reduce scatter cannot be used together"
    with pytest.raises(Refused, match=re.escape(words)):
        plan(tmp_path, HF_ZERO3, *TRAINER, "--trainer-arg", "bf16=true")
    cfg = copy.deepcopy(HF_ZERO3)
    cfg["zero_optimization"]["reduce_scatter"] = False
    p = plan(tmp_path, cfg, *TRAINER, "--trainer-arg", "bf16=true")
    z = p.case.config["zero_optimization"]
    h = max(max(s) for s in p.requested)
    assert (z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (int(0.9 * h * h), 10 * h)
    assert "auto" not in json.dumps(p.case.config) and p.case.dtype == "bf16"


def test_a_template_without_trainer_arguments_is_refused_naming_what_to_pass(tmp_path):
    with pytest.raises(BadInput, match="pass --trainer-arg max_steps=N"):
        plan(tmp_path, HF_ZERO2)


# ------------------------------------------------------------------------------------------------
# a handful for real


def _check(tmp_path, cfg: dict, *extra: str, env: dict | None = None) -> dict:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "harness", "check", "--ds-config", str(path), "--json",
                        "--no-report", "--shapes", "24x16", "--steps", "2", *extra], cwd=ROOT, capture_output=True,
                       text=True, timeout=900, env=env)
    result = json.loads(r.stdout)
    assert r.returncode == result["exit_code"], r.stderr[-2000:]
    return result


@pytest.mark.pipeline
def test_the_minimal_config_passes_for_real(tmp_path):
    result = _check(tmp_path, MINIMAL)
    assert (result["verdict"], result["exit_code"]) == ("pass", 0), result["message"]
    assert result["resolved"]["gradient_clipping"]["source"].endswith("default")


@pytest.mark.pipeline
def test_the_hf_zero2_template_runs_for_real(tmp_path):
    # past the warm-up: its "auto" warmup_min_lr is 0, so the steps before it move no weight (exit 4)
    result = _check(tmp_path, HF_ZERO2, *TRAINER, "--trainer-arg", "bf16=true", "--steps", "4")
    assert result["basis"]["moved"], result["basis"]
    assert result["exit_code"] in (0, 1) and result["pipeline"]["dtype"] == "bf16"
    assert result["verdict"] == "pass" or result["bug_ids"], result["message"]


NVME_Z3 = {"stage": 3, "reduce_scatter": False, "offload_optimizer": {"device": "nvme"}}


@pytest.mark.pipeline
def test_zero3_fp16_nvme_at_the_default_loss_scale_judges_the_applied_steps_gradient(tmp_path):
    """DeepSpeed's default scale 2^16 is past fp16's range, so the first steps skip until the scale is 2^15;
    the step then applied has a scaled loss past 65504 and finite gradients, and its gradient is judged."""
    cfg = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "fp16": {"enabled": True},
           "train_micro_batch_size_per_gpu": 2, "zero_optimization": NVME_Z3}
    result = _check(tmp_path, cfg, "--steps", "3", "--world-size", "1", "--patched")
    assert result["resolved"]["fp16.initial_scale_power"] == {"value": 16, "source": "DeepSpeed 0.19.8 default"}
    applied = [s for s in range(1, 4) if s not in result["skipped_steps"]]
    assert applied, result["message"]
    assert result["cannot_judge"] == [], result["cannot_judge"]
    assert (result["verdict"], result["exit_code"]) == ("pass", 0), result["message"]
    assert 0.0 <= result["columns"]["patched"]["worst_ratio"]["grad"] <= 1.0


@pytest.mark.pipeline
def test_a_small_module_on_zero3_nvme_passes_without_swapping_and_says_so(tmp_path):
    """None of the module's sub-groups reaches DeepSpeed's swap threshold: nothing is swapped, which is what
    DeepSpeed should do, so it is no divergence; the plan and the verdict say swapping was not exercised."""
    import os

    from cases.cli import _user_model

    model = _user_model.write(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    cfg = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "train_micro_batch_size_per_gpu": 1,
           "zero_optimization": NVME_Z3}
    result = _check(tmp_path, cfg, "--model", model, env=env)
    assert (result["verdict"], result["exit_code"]) == ("pass", 0), result["message"]
    assert result["columns"]["stock"]["swapped_bytes"] == 0 and result["worst_ratio"]["swap"] == 0.0
    assert any("swapping will NOT be exercised" in n and "--shapes" in n for n in result["rewrites"])
