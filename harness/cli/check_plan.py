"""The plan of ``python -m harness check``: everything decided before a rank starts -- the launcher,
the world size, the scaled model and the config rewritten for the harness (``validate``)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from harness.case.nvme import FP32_BYTES, expects_swap, min_swap_bytes, nvme_matrix, predict_swapped_subgroups
from harness.case.spec import NVME_PATH_PLACEHOLDER, Case, canonical_json
from harness.cli.check_config import (BadInput, ModelFailed, Refused, _is_num, _nvme_sections, _pos_int_or_none,
                                      check_data_types, check_no_auto,
                                      check_optimizer, check_writable_dir, check_zero, deepspeed_validate,
                                      load_config, view)
from harness.cli.check_shapes import _fmt_shape, build_params, parse_shapes, scale_shapes
from harness.registry import refusals as ds_refusals

MAX_WORLD_SIZE = 8
MAX_STEPS = 50
MAX_GAS = 64
MONITORS = ("tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger")


@dataclass
class Plan:
    config_path: str
    case: Case
    requested: list
    run_shapes: list
    factor: float
    notes: list[str] = field(default_factory=list)
    nvme_user_dirs: dict[str, Path] = field(default_factory=dict)  # key -> user's writable nvme_path
    launcher: str = "pool"
    accelerator: str = "cpu"


def _rewrite(cfg: dict, world_size: int, factor: float, notes: list[str], total_numel: int = 0) -> dict:
    cfg = json.loads(json.dumps(cfg))
    tb = _pos_int_or_none(cfg, "train_batch_size")
    mb = _pos_int_or_none(cfg, "train_micro_batch_size_per_gpu")
    gas = _pos_int_or_none(cfg, "gradient_accumulation_steps")
    how = "kept"
    if gas is None:
        if tb and mb and tb % (mb * world_size) == 0:
            gas = tb // (mb * world_size)
            how = f"derived from train_batch_size {tb} / (micro {mb} x {world_size} ranks)"
        else:
            gas, how = 1, "not given: 1"
    if gas > MAX_GAS:
        notes.append(f"gradient_accumulation_steps {gas} reduced to {MAX_GAS} (run time)")
        gas, how = MAX_GAS, "reduced"
    mb_new = mb or 1
    tb_new = mb_new * gas * world_size
    cfg["train_micro_batch_size_per_gpu"] = mb_new
    cfg["gradient_accumulation_steps"] = gas
    cfg["train_batch_size"] = tb_new
    notes.append(f"batch sizes rewritten for the harness's world size {world_size}: train_batch_size "
                 f"{tb if tb is not None else 'unset'} -> {tb_new} (micro batch {mb_new}"
                 f"{'' if mb else ', unset: 1'} x accumulation {gas} [{how}] x {world_size} ranks)")
    if "scheduler" in cfg:
        # Kept: the oracle computes each group's lr per step from the schedule (oracles.schedules).
        from oracles.schedules import validate as validate_schedule

        try:
            validate_schedule(cfg["scheduler"] if isinstance(cfg["scheduler"], dict) else {})
        except ValueError as e:
            raise BadInput(f"scheduler: {e}") from None
        notes.append(f"scheduler {cfg['scheduler'].get('type')} kept: each group's lr is checked per step")
    for key in MONITORS:
        sec = cfg.get(key)
        if isinstance(sec, dict) and sec.get("enabled"):
            sec["enabled"] = False
            notes.append(f"{key} disabled")
    if isinstance(cfg.get("elasticity"), dict) and cfg["elasticity"].get("enabled"):
        cfg["elasticity"]["enabled"] = False
        notes.append("elasticity disabled (it would override the batch sizes)")
    opt_params = cfg.get("optimizer", {}).get("params", {})
    if opt_params.pop("per_head_muon", None):
        notes.append("optimizer.params.per_head_muon removed: the synthetic model has no attention module for "
                     "DeepSpeed to tag (per-head Muon is covered by the gate's -heads cases)")
    cfg["steps_per_print"] = 10**9
    cfg["wall_clock_breakdown"] = False
    zero = cfg.get("zero_optimization", {})  # rewritten below: the user's explicit sub_group_size only
    if (factor < 1.0 and view(cfg).zero.stage == 3 and _is_num(zero.get("sub_group_size"))
            and zero["sub_group_size"] < total_numel):  # it cuts the user's model: cut the scaled one alike
        new = max(1, int(round(zero["sub_group_size"] * factor)))
        notes.append(f"zero_optimization.sub_group_size {zero['sub_group_size']:g} -> {new} (scaled with the model)")
        zero["sub_group_size"] = new
    for key, off in _nvme_sections(cfg):
        if off.get("nvme_path") in (None, ""):
            notes.append(f"{key}.nvme_path not given: a private swap folder per case")
        off["nvme_path"] = NVME_PATH_PLACEHOLDER  # the user's writable path is put back per run
    return cfg


def _case_name(config_path: str, cfg: dict, world_size: int) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(config_path).stem) or "config"
    c = Case(name="x", params=(), ds_config=canonical_json(cfg))
    return f"check-{stem}-z{c.stage}-{c.offload}-{c.dtype}-ws{world_size}"


def max_world_size(accelerator: str) -> int:
    if accelerator == "cuda":
        import torch

        return min(MAX_WORLD_SIZE, torch.cuda.device_count())
    return min(MAX_WORLD_SIZE, 2 * (os.cpu_count() or 1))


def validate(args) -> Plan:
    """Every check that needs no rank; raises ``BadInput``."""
    from harness.launch import torchrun

    launcher = args.launcher
    accel = args.accelerator
    if launcher == "pool":
        if accel == "cuda":
            raise BadInput("--launcher pool runs CPU ranks only; use --launcher torchrun for --accelerator cuda")
        accel = "cpu"
    else:
        accel = torchrun.resolve_accelerator(accel)
    W = args.world_size
    limit = max_world_size(accel)
    if W < 1 or W > limit:
        why = (f"{limit} GPU(s) visible" if accel == "cuda"
               else f"at most min({MAX_WORLD_SIZE}, 2 x {os.cpu_count()} CPUs) = {limit} ranks")
        raise BadInput(f"--world-size {W}: this machine cannot host it ({why})")
    if not 1 <= args.steps <= MAX_STEPS:
        raise BadInput(f"--steps {args.steps}: expected 1..{MAX_STEPS}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise BadInput(f"--timeout {args.timeout:g}: expected a positive number of seconds")
    spec = _model_spec(args)  # --model: a real module instead of --shapes (harness.models)
    requested = parse_shapes(args.shapes) if spec is None else [tuple(p.shape) for p in spec.module.parameters()]
    cfg = load_config(args.ds_config)
    cfg, auto_notes = _resolve_auto(cfg, W, args, spec, requested)
    check_optimizer(cfg)
    check_zero(cfg)
    check_data_types(cfg)
    check_no_auto(cfg)
    nvme_user = {}
    for key, off in _nvme_sections(cfg):
        if off.get("nvme_path") not in (None, ""):
            nvme_user[key] = check_writable_dir(f"{key}.nvme_path", off["nvme_path"])
    run_shapes, factor = scale_shapes(requested, W) if spec is None else (requested, 1.0)
    notes: list[str] = auto_notes + [f"{key}.nvme_path {path}: writable; each run swaps into a private "
                                     "sub-folder of it (removed afterwards)" for key, path in nvme_user.items()]
    new_cfg = _rewrite(cfg, W, factor, notes, total_numel=sum(math.prod(s) for s in requested))
    # DeepSpeed's own validation, in this process, before any rank exists.
    os.environ.update(torchrun.launch_env(accel))
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed_validate(new_cfg)
    params = build_params(run_shapes) if spec is None else _model_params(spec)
    case = Case(name=_case_name(args.ds_config, new_cfg, W), params=params, ds_config=canonical_json(new_cfg),
                world_size=W, steps=args.steps, seed=args.seed, timeout_s=float(args.timeout))
    case = _swap_sized(_model_case(case, args, spec), spec is not None, notes)
    refuse_as_deepspeed_would(case)
    return Plan(args.ds_config, case, requested, run_shapes, factor, notes, nvme_user, launcher, accel)


def refuse_as_deepspeed_would(case: Case) -> None:
    """A config the installed DeepSpeed refuses with Muon (``harness.registry.refusals``, read through the
    typed view, so ``"stage": "3"`` is stage 3 here as it is there) stops before any rank: ``Refused``."""
    refused = ds_refusals.expected(case)
    if refused:
        raise Refused("\n".join(r.sentence(case.ds.release) for r in refused))


def _swap_sized(case: Case, module: bool, notes: list[str]) -> Case:
    """ZeRO-3 NVMe swaps only sub-groups of ``min_swap_bytes`` per rank or more (``harness.case.nvme``). The
    synthetic model gets a swap-sized matrix where none of it is; a user's module is run as it is, so
    when none of its sub-groups is, swapping is not exercised: said here, before any rank starts, with what
    to pass to exercise it, and the ``swap`` quantity is then judged by that rule (nothing moved)."""
    if case.stage != 3 or case.offload != "nvme" or expects_swap(case):
        return case
    kib = min_swap_bytes(case) // 1024
    if not module:
        big = nvme_matrix(case.world_size, name="swap.weight", min_bytes=min_swap_bytes(case))
        notes.append(f"added matrix swap.weight {_fmt_shape(big.shape)}: DeepSpeed swaps only sub-groups of "
                     f">= {kib} KiB per rank to NVMe, and none of the scaled model is")
        return case.replace(params=case.params + (big,))
    largest = max(predict_swapped_subgroups(case), key=lambda sub: sub["partition_bytes"])
    notes.append(f"NVMe swapping will NOT be exercised: DeepSpeed swaps only ZeRO-3 sub-groups of >= {kib} KiB "
                 f"per rank and keeps smaller ones in memory (as with device cpu); the largest of {case.model!r} at "
                 f"world size {case.dp_size} is {largest['partition_bytes'] / 1024:.1f} KiB "
                 f"({', '.join(largest['params'][:3])}{', ...' if len(largest['params']) > 3 else ''}), so the "
                 "swap quantity is judged by that rule (nothing moved). To check the swap path itself, run "
                 f"--shapes instead of --model (a swap-sized matrix is then added), or a model with a sub-group of "
                 f">= {min_swap_bytes(case) // FP32_BYTES * case.dp_size} elements (fp32 masters) in all")
    return case


def _model_spec(args):
    """``--model``: the module's ModelSpec (validated), or None for the synthetic model."""
    name = getattr(args, "model", None)
    if not name:
        return None
    from harness import models

    try:
        spec = models.build_spec(name, args.seed)
        models.validate(spec, name)
    except models.ModelsUnavailable as e:
        raise BadInput(f"--model {name}: {e}") from None
    except (ValueError, TypeError, AttributeError, RuntimeError) as e:
        raise BadInput(f"--model {name}: {e}") from None
    except Exception as e:  # the user's factory itself failed (a missing file, a missing key): no run
        raise ModelFailed(f"--model {name}: the model factory raised {type(e).__name__}: {e}") from None
    return spec


def _model_params(spec):
    from harness import models

    return models.param_shapes(spec)


def _model_case(case: Case, args, spec) -> Case:
    """``--model`` and ``--zero-init`` on the case."""
    if getattr(args, "zero_init", False):
        if case.stage != 3:
            raise BadInput(f"--zero-init builds the model under deepspeed.zero.Init, a ZeRO-3 option; the config "
                           f"is ZeRO-{case.stage}")
        case = case.replace(zero_init=True, name=case.name + "-zinit")
    if spec is None:
        return case
    label = args.model if ":" not in args.model else args.model.rsplit(":", 1)[-1]
    return case.replace(name=case.name.replace("check-", f"check-{label}-", 1), model=args.model)


def _resolve_auto(cfg: dict, world_size: int, args, spec, shapes):
    """Hugging Face "auto" values filled as the Trainer fills them (harness.case.hf_auto); the hidden
    size is the named model's, or for --shapes the largest matrix dimension."""
    from harness.case import hf_auto

    hidden = hf_auto.hidden_size_of(spec.module) if spec is not None else None
    if hidden is None:
        hidden = max((max(s) for s in shapes if len(s) >= 2), default=None)
    try:
        trainer_args = hf_auto.parse_trainer_args(getattr(args, "trainer_arg", None))
        return hf_auto.resolve(cfg, world_size, hidden_size=hidden, trainer_args=trainer_args)
    except ValueError as e:
        raise BadInput(str(e)) from None
