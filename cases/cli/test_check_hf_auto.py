"""Hugging Face "auto" in ``check``: every value resolved by transformers' own rules from the
TrainingArguments the user passes (``--trainer-arg``), each said with its source; what cannot be
resolved refused, naming the argument to pass."""
from __future__ import annotations

import dataclasses

import pytest

from cases.cli._plan import plan
from harness.cli.check_config import BadInput

transformers = pytest.importorskip("transformers")


def _default(name: str):
    return next(f.default for f in dataclasses.fields(transformers.TrainingArguments) if f.name == name)


def _cfg(**top) -> dict:
    cfg = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": 2},
           "train_micro_batch_size_per_gpu": 1}
    cfg.update(top)
    return cfg


def _decay(**params) -> dict:
    return {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto", "total_num_steps": "auto", **params}}


def _config(p) -> dict:
    return p.case.config


def test_steps_the_check_cannot_know_are_refused_naming_max_steps(tmp_path):
    with pytest.raises(BadInput, match="pass --trainer-arg max_steps=N") as e:
        plan(tmp_path, _cfg(scheduler=_decay()))
    assert "scheduler.params.total_num_steps" in str(e.value)


def test_a_zero_warmup_from_auto_says_where_it_came_from(tmp_path):
    with pytest.raises(BadInput) as e:
        plan(tmp_path, _cfg(scheduler=_decay()), "--trainer-arg", "max_steps=10")
    msg = str(e.value)
    assert "warmup_num_steps" in msg and 'came from "auto"' in msg
    assert "warmup_steps=0 (TrainingArguments default)" in msg
    assert "--trainer-arg warmup_steps=N or --trainer-arg warmup_ratio=R" in msg


@pytest.mark.parametrize("warmup, expect", [(("warmup_ratio=0.25",), 3), (("warmup_steps=4",), 4)])
def test_the_schedule_resolves_from_the_arguments_given(tmp_path, warmup, expect):
    args = [a for w in ("max_steps=10", "learning_rate=0.003", *warmup) for a in ("--trainer-arg", w)]
    p = plan(tmp_path, _cfg(scheduler=_decay(), optimizer={"type": "Muon", "params": {"lr": "auto"}}), *args)
    sched = _config(p)["scheduler"]["params"]
    assert sched == {"warmup_min_lr": 0, "warmup_max_lr": 0.003, "warmup_num_steps": expect, "total_num_steps": 10}
    notes = "\n".join(p.notes)
    assert '"auto" scheduler.params.warmup_max_lr -> 0.003 from learning_rate=0.003\n' in notes + "\n"
    assert '"auto" scheduler.params.total_num_steps -> 10 from the number of training steps (max_steps=10)' in notes
    assert "scheduler WarmupDecayLR kept" in notes and "removes the scheduler" not in notes


def test_lr_auto_takes_the_training_arguments_default_and_says_so(tmp_path):
    p = plan(tmp_path, _cfg(optimizer={"type": "Muon", "params": {"lr": "auto"}}))
    lr = _default("learning_rate")
    assert _config(p)["optimizer"]["params"]["lr"] == lr
    assert f'"auto" optimizer.params.lr -> {lr!r} from learning_rate={lr!r} (TrainingArguments default)' in p.notes
    assert p.case.ds.optimizer.muon.lr == lr


def test_a_mismatch_is_refused_only_against_an_argument_the_user_gave(tmp_path):
    plan(tmp_path, _cfg())  # concrete lr 0.02 beside the default learning_rate: the user's run is unknown
    with pytest.raises(BadInput, match="optimizer.params.lr=0.02 vs hf learning_rate=0.0003"):
        plan(tmp_path, _cfg(), "--trainer-arg", "learning_rate=3e-4")


def test_trainer_args_are_typed_by_the_training_arguments_field(tmp_path):
    with pytest.raises(BadInput, match="'ten' is not a int"):
        plan(tmp_path, _cfg(), "--trainer-arg", "max_steps=ten")
    with pytest.raises(BadInput, match="learning_rat=1.*TrainingArguments field"):
        plan(tmp_path, _cfg(), "--trainer-arg", "learning_rat=1")
