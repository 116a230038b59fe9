"""The config file of ``python -m harness check``: reading it and every refusal that needs no rank
(``BadInput``, exit 2), DeepSpeed's own validation included."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from harness.case import dsconfig

NS_METHODS = ("gram", "standard")  # deepspeed/runtime/zero/muon/original_muon.py NS_METHODS
NUMERIC_OPT_KEYS = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "eps")

# pydantic model of DeepSpeed's config -> the key it validates (for "which key" in messages)
_MODEL_KEYS = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
    "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
    "DeepSpeedFP16Config": "fp16",
    "DeepSpeedBF16Config": "bf16",
    "CompileConfig": "compile",
    "HybridEngineConfig": "hybrid_engine",
    "TensorBoardConfig": "tensorboard",
    "WandbConfig": "wandb",
    "CSVConfig": "csv_monitor",
    "CometConfig": "comet",
    "DeepSpeedFlopsProfilerConfig": "flops_profiler",
    "DeepSpeedCommsConfig": "comms_logger",
    "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing",
}


class BadInput(Exception):
    """Input the check refuses, with a message that says what and where."""


class Refused(BadInput):
    """A config the installed DeepSpeed refuses (``harness.registry.refusals``, or ``deepspeed.initialize``
    raising): the user's training would crash at start-up, so never a pass; exit 2 like bad input."""


class ModelFailed(Exception):
    """The user's model factory raised while the check planned the run: nothing to judge (exit 3), and
    no input of ours to blame."""



def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise BadInput(f"duplicate key {k!r} (DeepSpeed rejects duplicate keys too)")
        d[k] = v
    return d


def load_config(path: str) -> dict:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: cannot read it: {exc}") from None
    try:
        cfg = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except BadInput as exc:
        raise BadInput(f"{path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise BadInput(f"{path}: the DeepSpeed config must be a JSON object, not {type(cfg).__name__}")
    return cfg


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _pos_int_or_none(cfg: dict, key: str):
    v = cfg.get(key)
    if v is None or v == "auto":
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise BadInput(f"{key}: {v!r} is not a positive integer (DeepSpeed would reject it)")
    return v


def check_optimizer(cfg: dict) -> None:
    opt = cfg.get("optimizer")
    if opt is None:
        raise BadInput("no 'optimizer' section: this harness checks the Muon optimizer "
                       "(\"optimizer\": {\"type\": \"Muon\", ...})")
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str):
        raise BadInput("optimizer.type is missing: expected \"Muon\"")
    if opt["type"].lower() != "muon":
        raise BadInput(f"optimizer.type is {opt['type']!r}, not Muon: this harness checks the Muon optimizer "
                       "(MuonWithAuxAdam) only")
    params = opt.get("params", {})
    if not isinstance(params, dict):
        raise BadInput("optimizer.params must be an object")
    if "max_grad_norm" in params:
        raise BadInput("optimizer.params.max_grad_norm: DeepSpeed rejects it (use the top-level "
                       "gradient_clipping)")
    for k in NUMERIC_OPT_KEYS:
        if k in params and not _is_num(params[k]):
            raise BadInput(f"optimizer.params.{k}: {params[k]!r} is not a number")
        if k in params and params[k] < 0:  # torch.optim refuses these too ("Invalid learning rate: -0.02")
            raise BadInput(f"optimizer.params.{k}: {params[k]!r} is negative (the optimizer refuses it)")
    if "betas" in params:
        b = params["betas"]
        if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(_is_num(x) for x in b)):
            raise BadInput(f"optimizer.params.betas: {b!r} is not two numbers")
    ns = view(cfg).optimizer.muon.ns_method
    if ns is not None and ns not in NS_METHODS:
        raise BadInput(f"optimizer.params.ns_method: {ns!r} is not one of {list(NS_METHODS)} "
                       "(MuonWithAuxAdam asserts this in deepspeed.initialize)")


def check_data_types(cfg: dict) -> None:
    """``data_types.grad_accum_dtype``: DeepSpeed's config model takes any string and only
    ``deepspeed.initialize`` converts it (``engine.get_data_types``: ``DtypeEnum(value)``), so a name it
    does not know would start every rank before failing."""
    from deepspeed.runtime.config import DtypeEnum

    key = "data_types.grad_accum_dtype"
    ds = view(cfg)
    if not ds.source(key).startswith("config"):
        return  # the default: the model dtype
    value = ds.grad_accum_dtype
    names = sorted(k for k in DtypeEnum._value2member_map_ if isinstance(k, str) and not k.startswith("torch."))
    try:
        DtypeEnum(value)
    except (ValueError, TypeError):
        raise BadInput(f"{key}: {value!r} is not a dtype DeepSpeed knows (one of {names}); deepspeed.initialize "
                       "would raise ValueError") from None


def check_zero(cfg: dict) -> int:
    """The stage, read as DeepSpeed reads it (the typed view: "3" and 3.0 are stage 3). Whether DeepSpeed
    refuses the ZeRO settings with Muon is the refusals registry's to say (``refusal_of``), once the case
    is built."""
    zero = cfg.get("zero_optimization")
    if zero is None:
        raise BadInput("no 'zero_optimization' section: the harness checks ZeRO stages 1-3")
    if not isinstance(zero, dict):
        raise BadInput("zero_optimization must be an object")
    if "gradient_clipping" in cfg and (not _is_num(cfg["gradient_clipping"]) or cfg["gradient_clipping"] < 0):
        raise BadInput(f"gradient_clipping: {cfg['gradient_clipping']!r} is not a non-negative number")
    z = view(cfg).zero
    if z.stage not in (0, 1, 2, 3):
        return -1  # DeepSpeed's own validation names it
    if z.stage == 0:
        raise BadInput(f"zero_optimization.stage is 0 ({view(cfg).source('zero_optimization.stage')}): the harness "
                       "checks ZeRO stages 1, 2 and 3")
    return z.stage


def view(cfg: dict) -> dsconfig.DSConfig:
    """The typed view of the user's config; a value it cannot read is bad input."""
    try:
        return dsconfig.resolve(cfg)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_no_auto(cfg: dict) -> None:
    """``"auto"`` is the Hugging Face Trainer's placeholder; DeepSpeed itself does not fill it in (and
    some of its models even accept the string, e.g. ``fp16.enabled``, and fail later)."""
    found = []

    def walk(obj, path):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, path + (str(k),))
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, path + (str(i),))
        elif obj == "auto" and path not in {(k,) for k in BATCH_KEYS}:
            found.append(".".join(path))

    walk(cfg, ())
    if found:
        raise BadInput(f"{', '.join(found)}: \"auto\" is filled in by the Hugging Face Trainer, not by DeepSpeed; "
                       "put the concrete value(s) your run uses")


def check_writable_dir(key: str, path) -> Path:
    if not isinstance(path, str) or not path:
        raise BadInput(f"{key}: {path!r} is not a path")
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{key}: {path} does not exist (leave nvme_path out to let the check use a private "
                       "swap folder)")
    if not p.is_dir():
        raise BadInput(f"{key}: {path} is not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=".muon-harness-probe-", dir=p)
        with open(os.path.join(probe, "probe"), "wb") as f:
            f.write(b"x")
        shutil.rmtree(probe, ignore_errors=True)
    except OSError as exc:
        raise BadInput(f"{key}: {path} is not writable ({exc.strerror or exc})") from None
    return p


def _nvme_sections(cfg: dict):
    """The user's NVMe offload sections, as the dicts to rewrite (their ``nvme_path``)."""
    z = view(cfg).zero
    for sec, off in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param)):
        if off.device == "nvme":
            yield f"zero_optimization.{sec}", cfg["zero_optimization"][sec]


def _key_of_error(cfg: dict, title: str, loc: tuple) -> str:
    loc = tuple(str(x) for x in loc)
    if title in _MODEL_KEYS:
        return ".".join((_MODEL_KEYS[title],) + loc)
    hits = []

    def walk(obj, path):
        if isinstance(obj, dict):
            for k, v in obj.items():
                p = path + (str(k),)
                if p[-len(loc):] == loc:
                    hits.append(p)
                walk(v, p)

    walk(cfg, ())
    if len(hits) == 1:
        return ".".join(hits[0])
    return f"{title}: " + ".".join(loc)


def deepspeed_validate(cfg: dict) -> None:
    """DeepSpeed's own config classes on ``cfg`` (batch sizes made consistent for the world size of 1
    DeepSpeedConfig assumes without a process group)."""
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = json.loads(json.dumps(cfg))
    probe["train_batch_size"] = probe["train_micro_batch_size_per_gpu"] * probe["gradient_accumulation_steps"]
    hint = ""
    if "auto" in json.dumps(cfg):
        hint = " ('auto' values are filled in by the Hugging Face Trainer; DeepSpeed itself needs concrete values)"
    try:
        DeepSpeedConfig(probe)
    except pydantic.ValidationError as exc:
        lines = []
        for err in exc.errors():
            key = _key_of_error(cfg, exc.title, err.get("loc", ()))
            lines.append(f"{key}: {err.get('msg')} (got {err.get('input')!r})")
        raise BadInput(f"DeepSpeed rejects the config ({exc.title}):\n  " + "\n  ".join(lines) + hint) from None
    except (AssertionError, ValueError, TypeError, KeyError) as exc:
        raise BadInput(f"DeepSpeed rejects the config: {type(exc).__name__}: {exc}{hint}") from None


