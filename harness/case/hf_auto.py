"""Hugging Face ``"auto"`` values in a DeepSpeed config, resolved the way the Trainer does.

The Trainer (``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig``
``trainer_config_process`` / ``trainer_config_finalize``) fills every ``"auto"`` from its
``TrainingArguments`` and, for the bucket sizes, from the model's hidden size. ``python -m harness
check`` has no TrainingArguments, so it uses their defaults unless ``--trainer-arg NAME=VALUE``
gives the run's own, and the hidden size of the model it runs (the scaled or the named one). Every
resolution is returned as a sentence, and the CLI prints each.
"""
from __future__ import annotations

import json

# TrainingArguments defaults (transformers), the ones "auto" can draw on.
TRAINER_DEFAULTS = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "fp16": False,
    "bf16": False,
}


def parse_trainer_args(items) -> dict:
    out = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or key not in TRAINER_DEFAULTS:
            raise ValueError(f"--trainer-arg {item!r}: expected NAME=VALUE with NAME one of {sorted(TRAINER_DEFAULTS)}")
        default = TRAINER_DEFAULTS[key]
        try:
            if isinstance(default, bool):
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(raw)
                val = raw.lower() in ("true", "1")
            else:
                val = type(default)(float(raw)) if isinstance(default, int) else float(raw)
        except ValueError:
            raise ValueError(f"--trainer-arg {item!r}: {raw!r} is not a {type(default).__name__}") from None
        out[key] = val
    return out


def resolve(cfg: dict, world_size: int, *, hidden_size: int | None = None, trainer_args: dict | None = None):
    """(config with every resolvable "auto" filled, [one sentence per resolution])."""
    cfg = json.loads(json.dumps(cfg))
    args = {**TRAINER_DEFAULTS, **(trainer_args or {})}
    given = set(trainer_args or ())
    notes: list[str] = []

    def src(*names) -> str:
        return ", ".join(f"{n}={args[n]!r}" + ("" if n in given else " (TrainingArguments default)") for n in names)

    def fill(container: dict, key: str, value, path: str, why: str) -> None:
        if isinstance(container, dict) and container.get(key) == "auto":
            container[key] = value
            notes.append(f'"auto" {path} -> {value!r} from {why}')

    mb, gas = args["per_device_train_batch_size"], args["gradient_accumulation_steps"]
    fill(cfg, "train_micro_batch_size_per_gpu", mb, "train_micro_batch_size_per_gpu",
         src("per_device_train_batch_size"))
    fill(cfg, "gradient_accumulation_steps", gas, "gradient_accumulation_steps", src("gradient_accumulation_steps"))
    fill(cfg, "train_batch_size", mb * gas * world_size, "train_batch_size",
         f"micro x accumulation x world size {world_size}")
    fill(cfg, "gradient_clipping", args["max_grad_norm"], "gradient_clipping", src("max_grad_norm"))
    params = (cfg.get("optimizer") or {}).get("params") or {}
    fill(params, "lr", args["learning_rate"], "optimizer.params.lr", src("learning_rate"))
    fill(params, "betas", [args["adam_beta1"], args["adam_beta2"]], "optimizer.params.betas",
         src("adam_beta1", "adam_beta2"))
    fill(params, "eps", args["adam_epsilon"], "optimizer.params.eps", src("adam_epsilon"))
    fill(params, "weight_decay", args["weight_decay"], "optimizer.params.weight_decay", src("weight_decay"))
    for sec, flag in (("fp16", "fp16"), ("bf16", "bf16")):
        fill(cfg.get(sec) or {}, "enabled", args[flag], f"{sec}.enabled", src(flag))
    sched = (cfg.get("scheduler") or {}).get("params") or {}
    for key in list(sched):
        if sched[key] == "auto":
            value = args["learning_rate"] if key == "warmup_max_lr" else 0
            fill(sched, key, value, f"scheduler.params.{key}",
                 "the Trainer's schedule (the harness removes the scheduler)")
    zero = cfg.get("zero_optimization") or {}
    if hidden_size:
        h = int(hidden_size)
        fill(zero, "reduce_bucket_size", h * h, "zero_optimization.reduce_bucket_size", f"hidden_size^2 ({h})")
        fill(zero, "stage3_prefetch_bucket_size", int(0.9 * h * h), "zero_optimization.stage3_prefetch_bucket_size",
             f"0.9 hidden_size^2 ({h})")
        fill(zero, "stage3_param_persistence_threshold", 10 * h, "zero_optimization.stage3_param_persistence_threshold",
             f"10 hidden_size ({h})")
    return cfg, notes


def hidden_size_of(module) -> int | None:
    """The model's hidden size as the Trainer reads it (``config.hidden_size``, or the largest
    ``hidden_sizes``); None for a module without a Hugging Face config."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        return None
    h = getattr(cfg, "hidden_size", None)
    if h is None and getattr(cfg, "hidden_sizes", None):
        h = max(cfg.hidden_sizes)
    return int(h) if h else None
