"""Hugging Face ``"auto"`` values in a DeepSpeed config, resolved by transformers' own rules.

The Trainer fills every ``"auto"`` through ``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig``
(``trainer_config_process`` from its ``TrainingArguments``, ``trainer_config_finalize`` from the model's
hidden size and the number of training steps). ``resolve`` runs exactly those two methods, so the rules
(which key draws on which argument, warm-up from ``warmup_steps`` or ``warmup_ratio``, bucket sizes from
the hidden size) are transformers', not ours. What the check adds:

* the ``TrainingArguments`` values: the dataclass's own field defaults, overridden by ``--trainer-arg
  NAME=VALUE``. The dataclass is not instantiated: its ``__post_init__`` sets up a device and needs
  ``accelerate`` (and refuses ``bf16`` on a CPU), none of which decides a config value;
* the config accessors ``HfTrainerDeepSpeedConfig`` inherits from ``accelerate`` (``find_config_node``,
  ``get_value``, ``is_true``/``is_false``, ``is_zero3``), for the same reason;
* the number of training steps: ``max_steps``, else the config's own ``total_num_steps``; without either
  an ``"auto"`` that needs it cannot be resolved and is refused, naming the argument to pass;
* a mismatch between a concrete config value and a ``TrainingArguments`` value (the Trainer raises) is
  reported only for arguments the user passed: the defaults are not the user's run;
* a sentence per resolved value, with its source.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import types

STEP_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")
_SCALAR_TYPES = (bool, int, float, str)


def _training_arguments():
    """transformers' ``TrainingArguments`` (import on use: transformers is an optional dependency)."""
    try:
        from transformers import TrainingArguments
    except ImportError as e:
        raise ValueError(f'"auto" values need transformers to resolve them ({e}): pip install -e .[models]') from None
    return TrainingArguments


def _fields() -> dict:
    cls = _training_arguments()
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def parse_trainer_args(items) -> dict:
    """``--trainer-arg NAME=VALUE`` -> {name: value}, typed by the ``TrainingArguments`` field."""
    if not items:
        return {}
    fields = _fields()
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        f = fields.get(key)
        if not sep or f is None:
            raise ValueError(f"--trainer-arg {item!r}: expected NAME=VALUE with NAME a TrainingArguments field "
                             "(e.g. learning_rate, warmup_steps, warmup_ratio, max_steps, bf16)")
        if f.type not in _SCALAR_TYPES:
            raise ValueError(f"--trainer-arg {item!r}: {key} is not a plain number, flag or string")
        try:
            if f.type is bool:
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(raw)
                val = raw.lower() in ("true", "1")
            else:
                val = f.type(raw)
        except ValueError:
            raise ValueError(f"--trainer-arg {item!r}: {raw!r} is not a {f.type.__name__}") from None
        out[key] = val
    return out


def training_args(given: dict, world_size: int):
    """The ``TrainingArguments`` values the Trainer would hold: field defaults, the given ones on top,
    ``world_size`` the harness's, and transformers' own ``get_warmup_steps``."""
    cls = _training_arguments()
    values = {}
    for name, f in _fields().items():
        if f.default is not dataclasses.MISSING:
            values[name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[name] = f.default_factory()
    values.update(given)
    args = types.SimpleNamespace(**values, world_size=world_size)
    args.get_warmup_steps = types.MethodType(cls.get_warmup_steps, args)
    return args


def _resolver_class():
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    class Resolver(HfTrainerDeepSpeedConfig):
        """transformers' resolution, recording the argument each ``"auto"`` drew on."""

        def __init__(self, config: dict, given: set):
            self.config = config  # no set_hf_deepspeed_config: nothing global, no accelerate check
            self._dtype = None
            self.mismatches = []
            self.filled: dict[str, tuple[object, str | None]] = {}
            self.given = given

        def find_config_node(self, ds_key_long):
            path = ds_key_long.split(".")
            node = self.config
            for key in path[:-1]:
                node = node.get(key) if isinstance(node, dict) else None
                if node is None:
                    return None, path[-1]
            return (node if isinstance(node, dict) else None), path[-1]

        def get_value(self, ds_key_long, default=None):
            node, key = self.find_config_node(ds_key_long)
            return default if node is None else node.get(key, default)

        def is_true(self, ds_key_long):
            v = self.get_value(ds_key_long)
            return False if v is None else bool(v)

        def is_false(self, ds_key_long):
            v = self.get_value(ds_key_long)
            return False if v is None else not bool(v)

        def is_zero3(self):
            return self.get_value("zero_optimization.stage") == 3

        def fill_match(self, ds_key_long, hf_val, hf_key=None, must_match=True):
            was_auto = self.is_auto(ds_key_long)
            n = len(self.mismatches)
            HfTrainerDeepSpeedConfig.fill_match(self, ds_key_long, hf_val, hf_key, must_match)
            if was_auto:
                self.filled[ds_key_long] = (hf_val, hf_key)
            names = set(re.findall(r"[a-z_0-9]+", hf_key or ""))
            if len(self.mismatches) > n and not (names & self.given) or "(calculated)" in (hf_key or ""):
                del self.mismatches[n:]  # a default the user never passed, or the batch the harness rewrites

        def fill_only(self, ds_key_long, hf_val, hf_key=None):
            self.fill_match(ds_key_long, hf_val, hf_key, must_match=False)

    return Resolver


def _has_auto(obj) -> bool:
    if isinstance(obj, dict):
        return any(_has_auto(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_auto(v) for v in obj)
    return obj == "auto"


def _num_training_steps(cfg: dict, args) -> int | None:
    if args.max_steps and args.max_steps > 0:
        return int(args.max_steps)
    total = ((cfg.get("scheduler") or {}).get("params") or {}).get("total_num_steps")
    return total if isinstance(total, int) and not isinstance(total, bool) else None


class _HiddenSized:
    """A stand-in model for ``trainer_config_finalize``: only ``config.hidden_size`` is read."""

    def __init__(self, hidden_size):
        self.config = types.SimpleNamespace(hidden_size=hidden_size)


def resolve(cfg: dict, world_size: int, *, hidden_size: int | None = None, trainer_args: dict | None = None,
            model=None):
    """(config with every ``"auto"`` filled as the Trainer fills it, [one sentence per value, with its
    source]). Raises ``ValueError`` naming the ``--trainer-arg`` to pass for what cannot be resolved."""
    given = dict(trainer_args or {})
    if not _has_auto(cfg) and not given:
        return cfg, []
    cfg = copy.deepcopy(cfg)
    args = training_args(given, world_size)
    steps = _num_training_steps(cfg, args)
    r = _resolver_class()(cfg, set(given))
    needs_steps = [k for k in STEP_KEYS if r.is_auto(k)]
    if needs_steps and steps is None and not (needs_steps == [STEP_KEYS[1]] and args.warmup_steps > 0):
        raise ValueError(f'{", ".join(needs_steps)}: "auto" is the Trainer\'s number of training steps, which the '
                         "check cannot know: pass --trainer-arg max_steps=N (or put the number in the config)")
    if model is None or getattr(getattr(model, "config", None), "hidden_size", None) is None:
        model = _HiddenSized(hidden_size) if hidden_size else model
    r.trainer_config_process(args)
    r.trainer_config_finalize(args, model, steps or 0)  # ValueError: no hidden size; given-argument mismatches
    notes = [f'"auto" {key} -> {value!r} from {_source(key, hf_key, args, given, steps, hidden_size)}'
             for key, (value, hf_key) in r.filled.items()]
    _check_schedule(cfg, r.filled, notes)
    return cfg, notes


def _source(key: str, hf_key: str | None, args, given: dict, steps, hidden_size) -> str:
    def arg(name: str) -> str:
        return f"{name}={getattr(args, name)!r}" + ("" if name in given else " (TrainingArguments default)")

    if key == "scheduler.params.warmup_num_steps":
        if args.warmup_steps > 0:
            return f"TrainingArguments.get_warmup_steps: {arg('warmup_steps')}"
        return (f"TrainingArguments.get_warmup_steps: ceil({steps} training steps x {arg('warmup_ratio')}), "
                f"{arg('warmup_steps')}")
    if key == "scheduler.params.total_num_steps":
        return f"the number of training steps ({arg('max_steps') if args.max_steps > 0 else 'the config'})"
    if key.startswith("zero_optimization."):
        return f"the model's hidden size {hidden_size} (transformers' rule for {key.rsplit('.', 1)[-1]})"
    if key == "train_batch_size":
        return f"micro batch x accumulation x world size {args.world_size} (transformers' rule)"
    names = [n for n in re.findall(r"[a-z_0-9]+", hf_key or "") if hasattr(args, n)]
    return ", ".join(arg(n) for n in names) if names else "transformers' fixed value (no TrainingArguments field)"


def _check_schedule(cfg: dict, filled: dict, notes: list[str]) -> None:
    """A schedule the resolved values make invalid is refused here, naming the "auto" it came from."""
    sched = cfg.get("scheduler")
    auto = [n for n in notes if n.startswith('"auto" scheduler.')]
    if not isinstance(sched, dict) or not auto:
        return
    from oracles.schedules import validate

    try:
        validate(sched)
    except ValueError as e:
        hint = ""
        if filled.get("scheduler.params.warmup_num_steps", (None,))[0] == 0:
            hint = "; pass --trainer-arg warmup_steps=N or --trainer-arg warmup_ratio=R (with max_steps)"
        raise ValueError(f"scheduler: {e}; the value came from \"auto\": " + "; ".join(auto) + hint) from None


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

