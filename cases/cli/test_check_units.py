"""``harness.cli.check`` without ranks: the scale-down rule, --shapes parsing and the config rewrite."""
from __future__ import annotations

import math
import random
import re

import pytest

from harness.cli import check_config, check_plan, check_shapes
from harness.cli.check_config import BadInput
from harness.cli.check_shapes import padded_ranks, parse_shapes, scale_shapes

WORLD_SIZES = range(1, 9)


def _random_models(seed: int, n: int):
    rnd = random.Random(seed)
    def dims():
        return rnd.choice([rnd.randint(1, 24), rnd.randint(25, 6000), rnd.choice([4096, 4097, 1023, 11008, 128256])])

    for _ in range(n):
        W = rnd.choice(list(WORLD_SIZES))
        model = [tuple(dims() for _ in range(rnd.choice([1, 2, 2, 2, 3]))) for _ in range(rnd.randint(1, 5))]
        yield W, model


def test_parse_shapes():
    assert parse_shapes("4096x4096, 4096X11008,7*3,5") == [(4096, 4096), (4096, 11008), (7, 3), (5,)]
    for bad, where in [("4096x", "entry 1"), ("64x64,abc", "entry 2"), ("64x0", "zero dimension"), ("", "empty"),
                       ("64x64,,32x32", "entry 2"), ("2x2x2x2x2", "dimensions")]:
        with pytest.raises(BadInput, match="malformed --shapes") as e:
            parse_shapes(bad)
        assert where in str(e.value)


def test_llama_like_shapes_scale_as_documented():
    (a, b), f = scale_shapes([(4096, 4096), (11008, 4096)], 2)
    assert (a, b) == ((156, 156), (420, 156))
    # the largest tensor binds here: f = MAX_TENSOR_NUMEL / (11008 * 4096)
    assert f == pytest.approx(min(check_shapes.MAX_TENSOR_NUMEL / (11008 * 4096),
                                  check_shapes.MAX_TOTAL_NUMEL / (4096 * 4096 + 11008 * 4096)))
    assert f == pytest.approx(check_shapes.MAX_TENSOR_NUMEL / (11008 * 4096))


def test_small_models_are_not_scaled():
    shapes = [(6, 5), (7, 3), (256, 256)]
    assert scale_shapes(shapes, 2) == (shapes, 1.0)


def test_scale_rule_invariants():
    """numel mod 2W (so mod W), the ZeRO-3 padded partitions, never growing, aspect ratio, budget."""
    for W, model in _random_models(seed=0, n=1500):
        scaled, f = scale_shapes(model, W)
        assert len(scaled) == len(model)
        if f == 1.0:
            assert scaled == model
            continue
        for a, b in zip(model, scaled):
            na, nb = math.prod(a), math.prod(b)
            assert len(a) == len(b)
            assert na % (2 * W) == nb % (2 * W), (a, b, W)  # ZeRO-1/2 group padding, ZeRO-3 padding length
            assert (na % W == 0) == (nb % W == 0)  # divisible by the world size stays divisible
            assert padded_ranks(na, W) == padded_ranks(nb, W), (a, b, W)  # which partition is padded
            assert all(1 <= y <= x for x, y in zip(a, b))
            assert all(y == x for x, y in zip(a, b) if x <= check_shapes.MIN_DIM)
            if len(a) == 2 and min(b) >= 64:
                # aspect ratio within one 2W step per dimension
                tol = (1 + 2 * W / b[0]) * (1 + 2 * W / b[1]) * 1.01
                ratio = (a[0] / a[1]) / (b[0] / b[1])
                assert 1 / tol <= ratio <= tol, (a, b, W)
        # The element budget holds up to rounding, and the floors of tiny tensors.
        floor = sum(max(W * W + 2 * W, check_shapes.MIN_DIM ** 2) for _ in model)
        assert sum(math.prod(s) for s in scaled) <= 1.3 * check_shapes.MAX_TOTAL_NUMEL + floor
        assert max(math.prod(s) for s in scaled) <= 1.3 * check_shapes.MAX_TENSOR_NUMEL + floor


def test_group_residue_with_biases_is_kept():
    """The model check builds (matrix + bias of its rows): each optimizer group's total keeps its
    residue mod 2W, so ZeRO-1/2 pad the flat group by the same amount."""
    for W, model in _random_models(seed=1, n=400):
        scaled, _ = scale_shapes(model, W)
        for group in ("muon", "adam"):
            def total(shapes, group=group):
                params = check_shapes.build_params(shapes)
                return sum(p.numel for p in params if p.uses_muon == (group == "muon"))
            assert total(model) % (2 * W) == total(scaled) % (2 * W)


def test_padded_ranks():
    assert padded_ranks(30, 2) == ()
    assert padded_ranks(21, 2) == (1,)
    assert padded_ranks(5, 4) == (2, 3)  # q=2: rank 2 holds one element and a pad, rank 3 only padding
    assert padded_ranks(1, 1) == ()


def test_build_params_adds_biases():
    params = check_shapes.build_params([(8, 4), (5,), (3, 2, 2)])
    assert [(p.name, p.shape) for p in params] == [
        ("layers.0.weight", (8, 4)), ("layers.0.bias", (8,)), ("layers.1.scale", (5,)),
        ("layers.2.weight", (3, 2, 2)), ("layers.2.bias", (3,))]


def _cfg(**top):
    cfg = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": 2}}
    cfg.update(top)
    return cfg


@pytest.mark.parametrize("given, W, expect", [
    (dict(train_batch_size=1024, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 2, (4, 2, 16)),
    (dict(train_batch_size=64, train_micro_batch_size_per_gpu=4), 2, (4, 8, 64)),  # gas derived at W=2
    (dict(train_batch_size=60, train_micro_batch_size_per_gpu=4), 4, (4, 1, 16)),  # not derivable: 1
    (dict(train_batch_size="auto", train_micro_batch_size_per_gpu="auto"), 3, (1, 1, 3)),
    ({}, 1, (1, 1, 1)),
])
def test_batch_sizes_rewritten_for_the_world_size(given, W, expect):
    notes: list[str] = []
    out = check_plan._rewrite(_cfg(**given), W, 1.0, notes)
    mb, gas, tb = expect
    got = (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"], out["train_batch_size"])
    assert got == expect
    assert tb == mb * gas * W
    assert any("batch sizes rewritten" in n and f"world size {W}" in n for n in notes)


def test_rewrite_keeps_scheduler_strips_monitors_and_sets_nvme_placeholder():
    cfg = _cfg(scheduler={"type": "WarmupLR", "params": {}}, tensorboard={"enabled": True},
               zero_optimization={"stage": 3, "reduce_scatter": False, "sub_group_size": 1000,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": "/somewhere"}})
    cfg["optimizer"]["params"]["per_head_muon"] = True
    notes: list[str] = []
    out = check_plan._rewrite(cfg, 2, 0.01, notes, total_numel=10**6)
    assert out["scheduler"] == {"type": "WarmupLR", "params": {}} and out["tensorboard"]["enabled"] is False
    assert "per_head_muon" not in out["optimizer"]["params"]
    assert out["zero_optimization"]["offload_optimizer"]["nvme_path"] == "@NVME@"
    assert out["zero_optimization"]["sub_group_size"] == 10
    text = "\n".join(notes)
    for word in ("scheduler", "tensorboard", "per_head_muon", "sub_group_size"):
        assert word in text
    assert cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/somewhere"  # input untouched


def test_rewrite_refuses_a_schedule_the_oracle_cannot_compute():
    cfg = _cfg(scheduler={"type": "OneCycle", "params": {}})
    with pytest.raises(BadInput, match="scheduler type 'OneCycle'"):
        check_plan._rewrite(cfg, 2, 0.01, [], total_numel=10**6)


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.pop("optimizer"), "no 'optimizer' section"),
    (lambda c: c["optimizer"].update(type="Adam"), "not Muon"),
    (lambda c: c["optimizer"]["params"].update(ns_method="newton"), "ns_method"),
    (lambda c: c["optimizer"]["params"].update(max_grad_norm=1.0), "max_grad_norm"),
    (lambda c: c["optimizer"]["params"].update(momentum="high"), "optimizer.params.momentum"),
    (lambda c: c.update(zero_optimization={"stage": 0}), "stages 1, 2 and 3"),
    (lambda c: c.update(gradient_clipping=-1), "gradient_clipping"),
    (lambda c: c.update(fp16={"enabled": "auto"}), "fp16.enabled"),
])
def test_config_checks_without_deepspeed(mutate, message):
    cfg = _cfg()
    mutate(cfg)
    with pytest.raises(BadInput, match=re.escape(message)):
        check_config.check_optimizer(cfg)
        check_config.check_zero(cfg)
        check_config.check_no_auto(cfg)


def test_load_config_reports_line_and_column(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{\n  "a": 1,\n  "b": }\n')
    with pytest.raises(BadInput, match="line 3, column 8"):
        check_config.load_config(str(p))
    p.write_text('{"a": 1, "a": 2}')
    with pytest.raises(BadInput, match="duplicate key 'a'"):
        check_config.load_config(str(p))
    with pytest.raises(BadInput, match="no such file"):
        check_config.load_config(str(tmp_path / "missing.json"))


def test_writable_dir(tmp_path):
    assert check_config.check_writable_dir("k", str(tmp_path)) == tmp_path
    assert list(tmp_path.iterdir()) == []  # the probe cleans up
    with pytest.raises(BadInput, match="does not exist"):
        check_config.check_writable_dir("k", str(tmp_path / "nope"))
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(BadInput, match="not a directory"):
        check_config.check_writable_dir("k", str(f))


@pytest.mark.parametrize("given", [None, 0.0, 0.5])
def test_check_prints_each_resolved_value_with_its_source(given):
    """A config without gradient_clipping clips at the installed release's default, and says so."""
    from importlib import metadata

    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from harness.case.spec import Case, canonical_json
    from harness.cli import check

    cfg = _cfg() if given is None else _cfg(gradient_clipping=given)
    case = Case(name="x", params=(), ds_config=canonical_json(cfg))
    want = float(GRADIENT_CLIPPING_DEFAULT) if given is None else given
    source = f"DeepSpeed {metadata.version('deepspeed')} default" if given is None else "config"
    lines = check.resolved_lines(case)
    assert f"    gradient_clipping = {want!r}  ({source})" in lines
    assert f"clipping {want if want else 'off'}," in check._pipeline_text(case)
    assert any(ln.startswith("    optimizer.muon.lr = 0.02  (config (optimizer.params.lr))") for ln in lines)
    assert not any(ln.startswith("    fp16.hysteresis") for ln in lines)  # not an fp16 pipeline


def test_check_warns_of_keys_deepspeed_does_not_know():
    from deepspeed.runtime import constants

    from harness.case.spec import Case, canonical_json
    from harness.cli import check

    cfg = _cfg(gradient_cliping=0.5, train_mirco_batch_size_per_gpu=2)
    lines = check.unknown_key_lines(Case(name="x", params=(), ds_config=canonical_json(cfg)))
    assert len(lines) == 2
    for typo, meant in (("gradient_cliping", constants.GRADIENT_CLIPPING),
                        ("train_mirco_batch_size_per_gpu", constants.TRAIN_MICRO_BATCH_SIZE_PER_GPU)):
        assert any(f"warning: {typo} " in ln and f"did you mean {meant}?" in ln for ln in lines), typo
    assert check.unknown_key_lines(Case(name="x", params=(), ds_config=canonical_json(_cfg()))) == []


def test_nvme_planning_of_a_module_case_with_an_embedding(tmp_path, monkeypatch):
    """A module case on ZeRO-3 NVMe is planned from the module's own parameter order: the names a real
    model has (``embed_tokens``, ``lm_head``) are ones the synthetic model refuses, so building it to
    learn the order would crash the check before any rank starts."""
    from harness.case import nvme
    from harness.case.spec import Case, canonical_json
    from harness.cli import check

    from cases.cli import _user_model
    from harness import models

    cfg = _cfg(fp16={"enabled": True}, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
               train_batch_size=2,
               zero_optimization={"stage": 3, "reduce_scatter": False, "offload_optimizer": {"device": "nvme"}})
    monkeypatch.syspath_prepend(str(tmp_path))
    model = _user_model.write(tmp_path)
    params = models.param_shapes(models.build_spec(model, 0))
    case = Case(name="x", params=params, ds_config=canonical_json(cfg), model=model, world_size=2)
    subs = nvme.predict_swapped_subgroups(case)
    assert [s["params"] for s in subs] == [["out_proj.weight", "hidden.weight"],
                                           ["embed.weight", "hidden.bias"]]
    assert "DSM-001" in {b["id"] for b in check.known_bug_info(case)}
    with pytest.raises(ValueError, match="embed"):  # the synthetic model still refuses the names
        nvme.predict_swapped_subgroups(case.replace(model=None))


NVME_Z3 = {"stage": 3, "reduce_scatter": False, "offload_optimizer": {"device": "nvme"}}


def _nvme_module_plan(tmp_path, monkeypatch, **zero):
    from cases.cli import _plan, _user_model

    monkeypatch.syspath_prepend(str(tmp_path))
    model = _user_model.write(tmp_path)
    cfg = _cfg(train_micro_batch_size_per_gpu=1, zero_optimization={**NVME_Z3, **zero})
    return _plan.plan(tmp_path, cfg, "--model", model)


def test_a_small_module_on_zero3_nvme_is_told_it_will_not_swap_and_what_to_pass(tmp_path, monkeypatch):
    """A user's module whose ZeRO-3 sub-groups are all below the swap threshold: the plan says, before any
    rank, that swapping is not exercised, why (the threshold, the largest sub-group) and what to pass; the
    module runs as it is (no matrix added), and its swap quantity is expected empty."""
    from harness import models
    from harness.case import nvme

    p = _nvme_module_plan(tmp_path, monkeypatch)
    note = next((n for n in p.notes if "swapping will NOT be exercised" in n), None)
    assert note is not None, p.notes
    subs = nvme.predict_swapped_subgroups(p.case)
    largest = max(s["partition_bytes"] for s in subs)
    assert largest < nvme.MIN_AIO_BYTES  # the premise, from DeepSpeed's rule
    assert f"{largest / 1024:.1f} KiB" in note and f">= {nvme.MIN_AIO_BYTES // 1024} KiB" in note
    assert "--shapes" in note
    assert p.case.params == models.param_shapes(models.build_spec(p.case.model, 0))
    assert not nvme.swap_expected(p.case)


def test_a_synthetic_model_on_zero3_nvme_still_gets_a_swap_sized_matrix(tmp_path):
    from cases.cli import _plan
    from harness.case import nvme

    p = _plan.plan(tmp_path, _cfg(zero_optimization=NVME_Z3))
    assert any(par.name == "swap.weight" for par in p.case.params)
    assert nvme.swap_expected(p.case) and not any("NOT be exercised" in n for n in p.notes)


def test_the_swap_quantity_follows_deepspeeds_swap_rule(tmp_path, monkeypatch):
    """No bytes is right for a module with no sub-group at the threshold and wrong for a swap-sized model; bytes
    moved for the former is wrong too; ZeRO-1/2 NVMe must swap (DSM-002 is that they do not)."""
    from types import SimpleNamespace

    from cases.cli import _plan
    from harness.cli import check
    from harness.gate import decide

    small = _nvme_module_plan(tmp_path, monkeypatch).case
    big = _plan.plan(tmp_path, _cfg(zero_optimization=NVME_Z3)).case
    z2 = _plan.plan(tmp_path, _cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}})).case
    empty = SimpleNamespace(failures=[])

    def swap_problem(case, moved):
        problems, msgs = decide._problems(case, empty, SimpleNamespace(swapped_bytes=moved))
        return ("<case>", "swap") in problems

    assert not swap_problem(small, 0) and swap_problem(small, 4096)
    assert swap_problem(big, 0) and not swap_problem(big, 4096)
    assert swap_problem(z2, 0)
    o = SimpleNamespace(case=small, swapped_bytes=0)
    assert check._swap_text(o).startswith("nothing swapped, as DeepSpeed's swap threshold says")
    assert "NVMe swapping not exercised" in check.swap_not_exercised_text(small)
    assert check.swap_not_exercised_text(big) == "" and check.swap_not_exercised_text(z2) == ""

