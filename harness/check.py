"""``python -m harness check``: check *your* DeepSpeed config against the oracle.

Usage::

    python -m harness check --ds-config my_config.json [--shapes 4096x4096,4096x11008,...]
                            [--world-size N] [--steps K] [--seed S] [--report out.html | --no-report]
                            [--patched] [--launcher pool|torchrun] [--accelerator auto|cpu|cuda]
                            [--timeout SECONDS] [-q] [--json]

The config is taken as it is -- ZeRO stage, offload, precision, clipping, accumulation, Muon
parameters -- and run on a small synthetic model with the given matrix shapes (each matrix gets an
Adam-side bias vector of its row count; a 1-D entry in ``--shapes`` is an Adam vector of its own)
against the float64 oracle, through the gate's own decision (``harness.gate.evaluate``). It prints a
verdict per quantity, the known stock DeepSpeed bugs that explain a divergence, the report path and
the command that reruns exactly this case.

Exit codes: 0 within tolerance; 1 diverged (including divergences a known stock DeepSpeed bug
explains -- your config is affected); 2 bad input, reported before any rank starts; 3 the run itself
failed (a rank raised, died or timed out: no verdict; a known stock bug that crashes, e.g. DSM-012, is
named). With ``--patched`` both the stock and the
patched column run, the output says whether the bundled fixes change the verdict, and the exit code
is the patched column's (what you get with the fixes).

Scale-down rule (``scale_shapes``)
----------------------------------
A model whose largest tensor exceeds ``MAX_TENSOR_NUMEL`` (65,536 elements, 256x256) or whose total
exceeds ``MAX_TOTAL_NUMEL`` (262,144) is scaled down by one common element factor

    f = min(1, MAX_TENSOR_NUMEL / max numel, MAX_TOTAL_NUMEL / total numel)

Each dimension ``d`` of a ``k``-dimensional tensor becomes the value ``d'`` nearest to ``d * f**(1/k)``
with ``d' == d (mod 2W)`` (``W`` the harness world size), ``min(d, MIN_DIM) <= d' <= d`` (``MIN_DIM``
= 8). Consequences, all checked by ``cases/cli/test_check_units.py``:

* aspect ratios are kept (to one step of ``2W`` per dimension); relative sizes of the tensors too;
* ``numel mod 2W`` of every tensor is kept (a product of dimensions congruent mod ``2W`` is congruent),
  hence ``numel mod W``: a tensor divisible by the world size stays divisible, a padded one keeps its
  padding length -- ZeRO-3 pads each parameter to a multiple of ``W`` -- and the total of each
  optimizer group keeps its residue mod ``2W`` -- ZeRO-1/2 pad the flat group to a multiple of ``2W``;
* which ZeRO-3 partitions hold padding (ranks ``r`` with ``(r+1) * ceil(n/W) > n``) is the same as
  for the original shape: a tensor where that would differ (only possible for very small ones) gets
  its largest dimension grown by ``2W`` steps until it matches (the original always does);
* not kept: where a partition cut falls inside a tensor, and so which tensors straddle a cut in the
  ZeRO-1/2 flat buffer -- that depends on absolute sizes. Shapes within budget are run unscaled.

ZeRO-3 with NVMe offload swaps only sub-groups of at least 1 MiB per rank (``harness.nvme``); when the
scaled model has none, a swap-sized matrix (``harness.nvme.nvme_matrix``) is added and the output says
so. An explicit ``sub_group_size`` is multiplied by ``f``, so sub-group cuts scale with the model.

What is rewritten in the config (always said in the output)
-----------------------------------------------------------
* batch sizes, for the harness's world size: ``gradient_accumulation_steps`` is kept (it is what
  changes the numerics; derived as DeepSpeed would at the harness's world size when only
  ``train_batch_size`` and the micro batch are given, else 1), ``train_micro_batch_size_per_gpu`` is
  kept (1 if absent; the synthetic data has its own rows), and
  ``train_batch_size = micro x accumulation x W``. ``"auto"`` counts as absent;
* NVMe ``nvme_path`` (optimizer and parameter offload): absent -> a private swap folder per case;
  given -> it must be an existing, writable directory (else bad input), and each run uses a fresh
  private sub-folder of it, removed afterwards;
* ``scheduler`` removed (the oracle checks the optimizer step at the configured learning rate);
  monitors and profilers (tensorboard, wandb, csv_monitor, comet, flops_profiler, comms_logger) and
  ``elasticity`` disabled; ``optimizer.params.per_head_muon`` removed (the synthetic model has no
  attention module for DeepSpeed to tag); ``steps_per_print`` / ``wall_clock_breakdown`` silenced.

Bad input (exit 2, before any rank starts; ``validate``)
--------------------------------------------------------
* the file: unreadable, not strict JSON (line and column), not an object, duplicate keys (DeepSpeed
  rejects them too);
* ``--shapes`` malformed (which entry), ``--world-size`` outside ``1 .. min(8, 2 x cpu_count)`` (for
  CUDA: the number of visible GPUs), ``--steps`` outside 1..50;
* optimizer missing or not Muon;
* DeepSpeed's own validation: ``deepspeed.runtime.config.DeepSpeedConfig`` on the rewritten config
  (its pydantic models reject unknown keys and bad values: the message names the key), plus the
  Muon-specific rejections DeepSpeed 0.19.8 only makes inside ``deepspeed.initialize``: ZeRO-3 with
  ``reduce_scatter`` (on by default; ``stage3.py``: "Muon and reduce scatter cannot be used
  together"), ``ns_method`` not gram/standard, ``max_grad_norm`` in the optimizer params, non-numeric
  optimizer hyper-parameters or ``gradient_clipping``;
* outside what the harness covers: ZeRO stage 0 / no ``zero_optimization``;
* an NVMe path that is not an existing writable directory;
* ``--patched`` when ``harness.patched_runtime`` is not installed; ``--launcher pool`` with
  ``--accelerator cuda`` (the pool runs CPU ranks).

Launchers: ``pool`` (default; CPU ranks over gloo, ``harness.pool``) or ``torchrun``
(``harness.torchrun``: ``torch.distributed.run`` with ``env://`` and the accelerator's backend, nccl
on CUDA). Progress: a line when each case starts and ends, then one line per step once the case's
trajectory arrives (the ranks hand the whole trajectory back at the end). ``-q`` prints only the
verdict and report lines; ``--json`` prints exactly one JSON object on stdout (everything else,
DeepSpeed's logging included, goes to stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from harness import buildenv
from harness.case import NVME_PATH_PLACEHOLDER, Case, ParamShape, canonical_json

EXIT_OK, EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_RUN_FAILED = 0, 1, 2, 3

MAX_TENSOR_NUMEL = 65_536
MAX_TOTAL_NUMEL = 262_144
MIN_DIM = 8
MAX_SHAPES = 16
MAX_DIMS = 4
MAX_WORLD_SIZE = 8
MAX_STEPS = 50
MAX_GAS = 64
DEFAULT_SHAPES = "4096x4096,11008x4096"
DEFAULT_STEPS = 3
NS_METHODS = ("gram", "standard")  # deepspeed/runtime/zero/muon/original_muon.py NS_METHODS
MONITORS = ("tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger")
NUMERIC_OPT_KEYS = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "eps")
QUANTITY_ORDER = ("grad", "momentum", "update", "master", "model", "global_norm", "loss_scale",
                  "loss_scale_after", "skipped", "muon_calls", "swap")

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


# --------------------------------------------------------------------------------------------------
# shapes and the scale-down rule


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    entries = [e.strip() for e in text.split(",")]
    if not text.strip():
        raise BadInput("malformed --shapes: empty; expected e.g. 4096x4096,4096x11008")
    out = []
    for i, e in enumerate(entries, 1):
        parts = re.split(r"[xX*]", e)
        if not e or any(not re.fullmatch(r"\d+", p.strip()) for p in parts):
            raise BadInput(f"malformed --shapes: entry {i} {e!r} is not dimensions like 4096x11008 "
                           "(positive integers joined by 'x', entries separated by commas)")
        dims = tuple(int(p) for p in parts)
        if any(d < 1 for d in dims):
            raise BadInput(f"malformed --shapes: entry {i} {e!r} has a zero dimension")
        if len(dims) > MAX_DIMS:
            raise BadInput(f"malformed --shapes: entry {i} {e!r} has {len(dims)} dimensions (at most {MAX_DIMS})")
        out.append(dims)
    if len(out) > MAX_SHAPES:
        raise BadInput(f"malformed --shapes: {len(out)} entries (at most {MAX_SHAPES})")
    return out


def padded_ranks(numel: int, world_size: int) -> tuple[int, ...]:
    """ZeRO-3 ranks whose partition of a ``numel``-element parameter holds padding."""
    q = -(-numel // world_size)
    return tuple(r for r in range(world_size) if (r + 1) * q > numel)


def _scale_dim(d: int, lin: float, m: int) -> int:
    r = d % m
    lo = min(d, MIN_DIM)
    v = r + m * round((d * lin - r) / m)
    if v < lo:
        v = r + m * math.ceil((lo - r) / m)
    return max(1, min(v, d))


def scale_shapes(shapes, world_size: int, *, max_tensor: int = MAX_TENSOR_NUMEL,
                 max_total: int = MAX_TOTAL_NUMEL) -> tuple[list[tuple[int, ...]], float]:
    """The module docstring's rule: (scaled shapes, element factor f). Unscaled when within budget."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if not shapes:
        return [], 1.0
    numels = [math.prod(s) for s in shapes]
    f = min(1.0, max_tensor / max(numels), max_total / sum(numels))
    if f >= 1.0:
        return shapes, 1.0
    m = 2 * world_size
    out = []
    for s, n in zip(shapes, numels):
        # Dimensions already at or below MIN_DIM cannot shrink; the others share the factor.
        big = [i for i, d in enumerate(s) if d > MIN_DIM] or list(range(len(s)))
        lin = f ** (1.0 / len(big))
        dims = [_scale_dim(d, lin, m) if i in big else d for i, d in enumerate(s)]
        # Rounding and the floors can leave a tensor above its share: shrink its largest dimension
        # in steps of 2W (residues stay) while it can.
        limit = max(1.25 * n * f, 1.0)
        while math.prod(dims) > limit:
            can = [i for i in range(len(dims)) if dims[i] - m >= min(s[i], MIN_DIM)]
            if not can:
                break
            i = max(can, key=lambda j: dims[j])
            dims[i] -= m
        # Repair the ZeRO-3 padded-partition pattern (only small tensors can miss it).
        want = padded_ranks(n, world_size)
        while padded_ranks(math.prod(dims), world_size) != want:
            grow = [i for i in range(len(dims)) if dims[i] + m <= s[i]]
            if not grow:
                dims = list(s)
                break
            i = min(grow, key=lambda j: dims[j] / s[j])  # the most shrunk dimension first
            dims[i] += m
        out.append(tuple(dims))
    return out, f


def _fmt_shape(s) -> str:
    return "x".join(str(d) for d in s)


def build_params(shapes) -> tuple[ParamShape, ...]:
    """Matrices ``layers.<i>.weight`` (Muon) each followed by ``layers.<i>.bias`` (Adam, its rows);
    a 1-D shape is ``layers.<i>.scale`` (Adam)."""
    params = []
    for i, s in enumerate(shapes):
        if len(s) >= 2:
            params.append(ParamShape(f"layers.{i}.weight", tuple(s)))
            params.append(ParamShape(f"layers.{i}.bias", (s[0],)))
        else:
            params.append(ParamShape(f"layers.{i}.scale", tuple(s)))
    return tuple(params)


# --------------------------------------------------------------------------------------------------
# the config file


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
    ns = params.get("ns_method", "gram")
    if ns not in NS_METHODS:
        raise BadInput(f"optimizer.params.ns_method: {ns!r} is not one of {list(NS_METHODS)} "
                       "(MuonWithAuxAdam asserts this in deepspeed.initialize)")
    for k in NUMERIC_OPT_KEYS:
        if k in params and not _is_num(params[k]):
            raise BadInput(f"optimizer.params.{k}: {params[k]!r} is not a number")
    if "betas" in params:
        b = params["betas"]
        if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(_is_num(x) for x in b)):
            raise BadInput(f"optimizer.params.betas: {b!r} is not two numbers")


def check_zero(cfg: dict) -> int:
    zero = cfg.get("zero_optimization")
    if zero is None:
        raise BadInput("no 'zero_optimization' section: the harness checks ZeRO stages 1-3")
    if not isinstance(zero, dict):
        raise BadInput("zero_optimization must be an object")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        return -1  # DeepSpeed's own validation names it
    if stage == 0:
        raise BadInput("zero_optimization.stage is 0: the harness checks ZeRO stages 1, 2 and 3")
    if stage == 3 and zero.get("reduce_scatter", True) is not False:
        raise BadInput("zero_optimization.reduce_scatter must be false at stage 3 with Muon: DeepSpeed 0.19.8 "
                       "raises 'Muon and reduce scatter cannot be used together' in deepspeed.initialize "
                       "(reduce_scatter defaults to true)")
    gc = cfg.get("gradient_clipping", 0.0)
    if not _is_num(gc) or gc < 0:
        raise BadInput(f"gradient_clipping: {gc!r} is not a non-negative number")
    return stage


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
    zero = cfg.get("zero_optimization", {})
    for sec in ("offload_optimizer", "offload_param"):
        off = zero.get(sec)
        if isinstance(off, dict) and off.get("device") == "nvme":
            yield f"zero_optimization.{sec}", off


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


# --------------------------------------------------------------------------------------------------
# the plan: everything decided before a rank starts


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
            gas, how = tb // (mb * world_size), f"derived from train_batch_size {tb} / (micro {mb} x {world_size} ranks)"
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
        notes.append(f"scheduler {cfg['scheduler'].get('type', '?') if isinstance(cfg['scheduler'], dict) else ''} "
                     "removed: the oracle checks each optimizer step at the configured learning rate")
        del cfg["scheduler"]
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
    zero = cfg.get("zero_optimization", {})
    if (factor < 1.0 and zero.get("stage") == 3 and _is_num(zero.get("sub_group_size"))
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
    from harness import torchrun

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
    spec = _model_spec(args)  # --model: a real module instead of --shapes (harness.models)
    requested = parse_shapes(args.shapes) if spec is None else [tuple(p.shape) for p in spec.module.parameters()]
    if args.patched:
        from harness.gate import patched_available

        if not patched_available():
            raise BadInput("--patched: the bundled fixes (harness.patched_runtime) are not installed in this "
                           "checkout yet; run without --patched")
    cfg = load_config(args.ds_config)
    cfg, auto_notes = _resolve_auto(cfg, W, args, spec, requested)
    check_optimizer(cfg)
    check_zero(cfg)
    check_no_auto(cfg)
    nvme_user = {}
    for key, off in _nvme_sections(cfg):
        if off.get("nvme_path") not in (None, ""):
            nvme_user[key] = check_writable_dir(f"{key}.nvme_path", off["nvme_path"])
    run_shapes, factor = scale_shapes(requested, W) if spec is None else (requested, 1.0)
    notes: list[str] = auto_notes + [f"{key}.nvme_path {path}: writable; each run swaps into a private sub-folder of it "
                        "(removed afterwards)" for key, path in nvme_user.items()]
    new_cfg = _rewrite(cfg, W, factor, notes, total_numel=sum(math.prod(s) for s in requested))
    # DeepSpeed's own validation, in this process, before any rank exists.
    os.environ.update(torchrun.launch_env(accel))
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed_validate(new_cfg)
    params = build_params(run_shapes) if spec is None else _model_params(spec)
    case = Case(name=_case_name(args.ds_config, new_cfg, W), params=params, ds_config=canonical_json(new_cfg),
                world_size=W, steps=args.steps, seed=args.seed, timeout_s=float(args.timeout))
    case = _model_case(case, args, spec)
    if case.stage == 3 and case.offload == "nvme" and spec is None:
        from harness.nvme import expects_swap, min_swap_bytes, nvme_matrix

        if not expects_swap(case):
            big = nvme_matrix(W, name="swap.weight", min_bytes=min_swap_bytes(case))
            case = case.replace(params=case.params + (big,))
            notes.append(f"added matrix swap.weight {_fmt_shape(big.shape)}: DeepSpeed swaps only sub-groups of "
                         f">= {min_swap_bytes(case) // 1024} KiB per rank to NVMe, and none of the scaled model is")
    return Plan(args.ds_config, case, requested, run_shapes, factor, notes, nvme_user, launcher, accel)


# --------------------------------------------------------------------------------------------------
# running and reporting


class _Out:
    """Human output: stdout normally, stderr under --json, nothing but verdict lines under -q."""

    def __init__(self, quiet: bool, json_mode: bool, stream):
        self.quiet = quiet
        self.stream = stream

    def __call__(self, msg: str = "", *, essential: bool = False) -> None:
        if self.quiet and not essential:
            return
        print(msg, file=self.stream, flush=True)


def _finite(x):
    if x is None:
        return None
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _ratio_txt(x) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def worst_by_quantity(outcome) -> dict[str, float]:
    out: dict[str, float] = {}
    if outcome.verdict is not None:
        for c in outcome.verdict.checks:
            out[c.quantity] = max(out.get(c.quantity, 0.0), c.worst_ratio)
    return out


def _first_fail_by_quantity(outcome) -> dict[str, object]:
    firsts = {}
    if outcome.verdict is not None:
        for c in sorted(outcome.verdict.failures, key=lambda c: (c.step, -c.worst_ratio)):
            firsts.setdefault(c.quantity, c)
    return firsts


def _step_lines(outcome) -> list[str]:
    traj, verdict = outcome.trajectory, outcome.verdict
    if traj is None or verdict is None:
        return []
    lines = []
    for rec in traj.steps:
        checks = [c for c in verdict.checks if c.step == rec.step]
        worst = max(checks, key=lambda c: c.worst_ratio, default=None)
        loss = sum(rec.losses) / len(rec.losses) if rec.losses else float("nan")
        parts = [f"loss {loss:.5g}", f"loss scale {rec.loss_scale:g}"]
        if rec.skipped:
            parts.append("SKIPPED (overflow)")
        if rec.global_norm is not None:
            parts.append(f"global norm {rec.global_norm:.4g}")
        if rec.swap_bytes_written or rec.swap_bytes_read:
            parts.append(f"swap {rec.swap_bytes_written / 2**20:.1f}/{rec.swap_bytes_read / 2**20:.1f} MiB w/r")
        if worst is not None:
            bad = sum(1 for c in checks if not c.passed)
            parts.append(f"worst {_ratio_txt(worst.worst_ratio)}x allowance ({worst.param} {worst.quantity})"
                         + (f", {bad} of {len(checks)} checks out of tolerance" if bad else ", all within tolerance"))
        lines.append(f"    step {rec.step}: " + ", ".join(parts))
    return lines


def _status_text(o) -> str:
    if o.status == "passed":
        return "PASS"
    if o.status == "xpassed" and o.column == "patched":
        return f"PASS (the bundled fixes remove {', '.join(o.bug_ids)}, which the bug registry lists as unfixed)"
    if o.status == "xpassed":
        return f"PASS (known bug {', '.join(o.bug_ids)} was expected on this pipeline but did not show)"
    if o.status == "xfailed":
        return f"DIVERGED (known stock DeepSpeed bug {', '.join(o.bug_ids)})"
    if o.status == "failed":
        return "DIVERGED" + (f" (beyond known bug {', '.join(o.bug_ids)})" if o.bug_ids else "")
    return "ERROR (the run failed; no verdict)"


def _trim_message(msg: str, max_lines: int = 24) -> str:
    """The gate's message without its per-failure reproducer lines (printed once, at the end)."""
    lines = [ln for ln in msg.splitlines() if not ln.strip().startswith("reproduce: ")]
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines in the report)"]
    return "\n".join(lines)


def _exit_of(status: str) -> int:
    if status in ("passed", "xpassed"):
        return EXIT_OK
    if status in ("xfailed", "failed"):
        return EXIT_DIVERGED
    return EXIT_RUN_FAILED


def known_bug_info(case: Case) -> list[dict]:
    from harness.bugs import bugs_for
    from harness.gate import patched_available

    fixes = None
    if patched_available():
        from harness import patched_runtime

        fixes = set(patched_runtime.fix_names())
    out = []
    for b in bugs_for(case):
        fixed = None if fixes is None else (b.fix is not None and b.fix in fixes)
        out.append({"id": b.id, "title": b.title, "symptom": b.symptom, "where": b.where, "fix": b.fix,
                    "fixed_by_patched": fixed})
    return out


def _bug_sentence(b: dict) -> str:
    observed = b.get("observed_fixed_by_patched")
    if observed is not None:
        fix = "--patched FIXES it (observed in this run)" if observed else "--patched does NOT fix it (observed)"
    elif b["fixed_by_patched"] is True:
        fix = f"fixed by --patched (bundled fix {b['fix']!r})"
    elif b["fixed_by_patched"] is False:
        fix = ("not listed as fixed by the bundled fixes" if b["fix"] is None
               else f"its fix {b['fix']!r} is not in this patched runtime") + "; run with --patched to see"
    else:
        fix = "the bundled fixes (--patched) are not installed in this checkout"
    return f"{b['id']} ({b['title']}): {fix}"


def _pipeline_text(case: Case) -> str:
    cfg = case.config
    clip = cfg.get("gradient_clipping", 0.0)
    return (f"ZeRO-{case.stage}, offload {case.offload}, {case.dtype}, accumulation {case.grad_accum}, "
            f"clipping {clip if clip else 'off'}, world size {case.world_size}, {case.steps} steps")


@contextlib.contextmanager
def _stdout_to_stderr():
    """--json: fd 1 carries only the final JSON object; anything else printed (DeepSpeed's logger, C
    extensions) lands on stderr. Yields a file for the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(saved, "w")
    try:
        yield real
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        real.close()


def _columns_case(plan: Plan, column: str, uid: str) -> tuple[Case, list[Path]]:
    """The case one column runs: the user's writable NVMe path gets a fresh private sub-folder."""
    if not plan.nvme_user_dirs:
        return plan.case, []
    cfg = plan.case.config
    made = []
    zero = cfg["zero_optimization"]
    for key, base in plan.nvme_user_dirs.items():
        sec = key.split(".", 1)[1]
        sub = base / f"muon-harness-{uid}-{column}-{sec}"
        zero[sec]["nvme_path"] = str(sub)
        made.append(sub)
    return plan.case.replace(ds_config=canonical_json(cfg)), made


def _report(outcomes, report: str | None, extra: dict):
    if report is None:
        return None, "--no-report"
    try:
        from harness.report import render
    except ImportError:
        return None, "report unavailable: harness.report is not installed in this checkout"
    from harness import gate, results

    report_path = Path(report)
    results_dir = report_path.with_name(report_path.stem + "-results")
    shutil.rmtree(results_dir, ignore_errors=True)
    try:
        store = results.ResultStore(results_dir, writer="check")
        for o in outcomes:
            gate.record(store, o)
        out = render(results_dir, report_path, extra=extra)
        return str(out or report_path), None
    except Exception as exc:  # a broken report must not change the verdict
        return None, f"report failed: {type(exc).__name__}: {exc}"


def run_check(args) -> int:
    json_mode = bool(args.json)
    with contextlib.ExitStack() as stack:
        json_out = stack.enter_context(_stdout_to_stderr()) if json_mode else None
        out = _Out(args.quiet, json_mode, sys.stderr if json_mode else sys.stdout)
        result = {"config": args.ds_config, "verdict": "bad_input", "exit_code": EXIT_BAD_INPUT}
        try:
            plan = validate(args)
        except BadInput as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            result["message"] = str(exc)
            if json_out:
                json_out.write(json.dumps(result) + "\n")
            return EXIT_BAD_INPUT
        try:
            code, result = _execute(plan, args, out)
        except Exception as exc:  # the harness itself broke: no verdict, never "diverged"
            import traceback

            traceback.print_exc(file=sys.stderr)
            code = EXIT_RUN_FAILED
            result = {"config": args.ds_config, "verdict": "error", "exit_code": code,
                      "message": f"{type(exc).__name__}: {exc}"}
        if json_out:
            json_out.write(json.dumps(result) + "\n")
        return code


def _execute(plan: Plan, args, out: _Out) -> tuple[int, dict]:
    from harness.gate import environment, evaluate
    from harness.verdict import reproduce_command

    case = plan.case
    out(f"harness check: {plan.config_path}")
    out(f"  pipeline: {_pipeline_text(case)}; launcher {plan.launcher} ({plan.accelerator})")
    if plan.factor < 1.0:
        out(f"  model scaled down (element factor {plan.factor:.3g}; the rule: python -m harness check --help), "
            f"world size {case.world_size}:")
    else:
        out(f"  model (within budget, unscaled), world size {case.world_size}:")
    W = case.world_size
    for a, b in zip(plan.requested, plan.run_shapes):
        na, nb = math.prod(a), math.prod(b)
        out(f"    {_fmt_shape(a):>14s} -> {_fmt_shape(b):<12s} numel mod {W}: {na % W} -> {nb % W}; "
            f"ZeRO-3 padded partitions {list(padded_ranks(na, W)) or 'none'} -> {list(padded_ranks(nb, W)) or 'none'}")
    n_muon = sum(1 for p in case.params if len(p.shape) >= 2)
    out(f"    {len(case.params)} tensors: {n_muon} Muon matri{'x' if n_muon == 1 else 'ces'}, "
        f"{len(case.params) - n_muon} Adam vector{'' if len(case.params) - n_muon == 1 else 's'}")
    out("  config rewritten for the harness:")
    for n in plan.notes:
        out(f"    - {n}")
    bugs = known_bug_info(case)
    if bugs:
        out("  known stock DeepSpeed bug(s) on this pipeline: " + "; ".join(_bug_sentence(b) for b in bugs))

    columns = ["stock", "patched"] if args.patched else ["stock"]
    if plan.launcher == "torchrun":
        from harness.torchrun import TorchrunManager

        manager = TorchrunManager(plan.accelerator)
        out(f"  starting {W} rank(s) with torchrun ({plan.accelerator}) per case")
    else:
        from harness.pool import PoolManager

        manager = PoolManager()
        out(f"  starting {W} CPU rank(s) (the first start imports torch and DeepSpeed)")
    uid = uuid.uuid4().hex[:8]
    outcomes = {}
    made_dirs: list[Path] = []
    t_all = time.perf_counter()
    try:
        for i, col in enumerate(columns, 1):
            c, made = _columns_case(plan, col, uid)
            made_dirs += made
            out(f"[{i}/{len(columns)}] {col}: {c.name} start")
            o = evaluate(c, col, manager)
            outcomes[col] = o
            for line in _step_lines(o):
                out(line)
            out(f"[{i}/{len(columns)}] {col}: {c.name} done in {o.seconds:.1f}s: {_status_text(o)}")
    finally:
        manager.close()
        for d in made_dirs:
            shutil.rmtree(d, ignore_errors=True)

    decisive = outcomes[columns[-1]]
    # Per quantity, for every column run.
    per_col = {}
    for col, o in outcomes.items():
        worst = worst_by_quantity(o)
        firsts = _first_fail_by_quantity(o)
        if o.swapped_bytes is not None:
            worst["swap"] = 0.0 if o.swapped_bytes > 0 else float("inf")
        per_col[col] = (worst, firsts)
        if o.verdict is None:
            continue
        out(f"  {col}: per quantity, worst |error| / allowance over all parameters and steps (<= 1 is within "
            "tolerance):")
        for q in sorted(worst, key=lambda q: QUANTITY_ORDER.index(q) if q in QUANTITY_ORDER else 99):
            if q == "swap":
                line = (f"{o.swapped_bytes / 2**20:.1f} MiB moved to/from the swap folder" if o.swapped_bytes > 0
                        else "NOTHING written to the swap folder")
                out(f"    {'swap':18s} {'ok' if o.swapped_bytes > 0 else 'DIVERGED':9s} {line}")
                continue
            first = firsts.get(q)
            where = f"  first at step {first.step}, {first.param}" if first else ""
            out(f"    {q:18s} {'DIVERGED' if first else 'ok':9s} {_ratio_txt(worst[q]):>9s}x{where}")

    changes = None
    if args.patched:
        s, p = outcomes["stock"], outcomes["patched"]
        changes = _exit_of(s.status) != _exit_of(p.status)
        for b in bugs:
            if b["id"] in s.bug_ids and s.status == "xfailed":
                b["observed_fixed_by_patched"] = _exit_of(p.status) == EXIT_OK
        out(f"  --patched: stock {_status_text(s)} -> patched {_status_text(p)}: the bundled fixes "
            + ("CHANGE the verdict" if changes else "do not change the verdict"))
    for col in columns:
        o = outcomes[col]
        line = _status_text(o)
        if o.status == "xfailed":
            line = "DIVERGED: the divergence is known stock DeepSpeed bug " + "; ".join(
                _bug_sentence(b) for b in bugs if b["id"] in o.bug_ids)
        elif o.status == "passed" and o.verdict is not None:
            line += f": every quantity within tolerance (worst {_ratio_txt(o.verdict.worst_ratio)}x its allowance)"
        elif o.status == "error":
            line += ": " + (o.message.splitlines()[0] if o.message else "")
            if o.bug_ids:
                line += "; this pipeline hits known stock DeepSpeed bug " + "; ".join(
                    _bug_sentence(b) for b in bugs if b["id"] in o.bug_ids)
        label = "verdict" if not args.patched else f"verdict ({col})"
        out(f"{label}: {line}", essential=True)
    if decisive.status == "error" and decisive.message:
        tail = decisive.message.splitlines()[-15:]
        out("  ...\n  " + "\n  ".join(tail))
    elif decisive.status != "passed" and decisive.message:
        out("  " + _trim_message(decisive.message).replace("\n", "\n  "))

    extra = {"environment": environment(),
             "check": {"config": plan.config_path, "notes": plan.notes,
                       "shapes": [_fmt_shape(s) for s in plan.run_shapes]},
             "elapsed_s": time.perf_counter() - t_all}
    report = args.report if not args.no_report else None
    if report is None and not args.no_report:
        report = str(buildenv.PROJECT_ROOT / "reports" / f"{decisive.case.name}.html")
    report_path, report_note = _report(list(outcomes.values()), report, extra)
    out(f"report: {report_path}" if report_path else f"report: none ({report_note})", essential=True)
    repro = reproduce_command(decisive.case)
    out(f"reproduce: {repro}")
    if any(plan.nvme_user_dirs):
        out("  (the reproducer names the private swap sub-folder this run used; it is created again on rerun)")

    code = _exit_of(decisive.status)
    worst, firsts = per_col[columns[-1]]
    first = decisive.verdict.first if decisive.verdict is not None else None
    result = {
        "verdict": {EXIT_OK: "pass", EXIT_DIVERGED: "diverged", EXIT_RUN_FAILED: "error"}[code],
        "exit_code": code,
        "status": decisive.status,
        "column": columns[-1],
        "config": plan.config_path,
        "case": decisive.case.name,
        "pipeline": {"stage": case.stage, "offload": case.offload, "dtype": case.dtype,
                     "gradient_accumulation_steps": case.grad_accum,
                     "gradient_clipping": case.config.get("gradient_clipping", 0.0),
                     "world_size": case.world_size, "steps": case.steps},
        "launcher": plan.launcher,
        "accelerator": plan.accelerator,
        "shapes": {"requested": [list(s) for s in plan.requested], "run": [list(s) for s in plan.run_shapes],
                   "element_factor": plan.factor, "params": [[p.name, list(p.shape)] for p in case.params]},
        "rewrites": plan.notes,
        "worst_ratio": {q: _finite(v) for q, v in worst.items()},
        "first_divergence": None if first is None else {
            "param": first.param, "quantity": first.quantity, "step": first.step,
            "ratio": _finite(first.worst_ratio), "rank": first.rank, "region": first.region},
        "bug_ids": list(decisive.bug_ids) if decisive.status in ("xfailed", "failed", "xpassed") else [],
        "known_bugs": [{k: b.get(k) for k in ("id", "title", "fix", "fixed_by_patched", "observed_fixed_by_patched")}
                       for b in bugs],
        "columns": {col: {"status": o.status, "bug_ids": list(o.bug_ids), "seconds": round(o.seconds, 3),
                          "worst_ratio": {q: _finite(v) for q, v in per_col[col][0].items()},
                          "swapped_bytes": o.swapped_bytes}
                    for col, o in outcomes.items()},
        "patched_changes_verdict": changes,
        "report": report_path,
        "report_note": report_note,
        "reproduce": repro,
        "message": decisive.message,
    }
    return code, result


# --------------------------------------------------------------------------------------------------
# command line


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
    """Hugging Face "auto" values filled as the Trainer would (harness.models.hf_auto); the hidden size
    is the named model's, or for --shapes the largest matrix dimension."""
    from harness.models import hf_auto

    try:
        trainer_args = hf_auto.parse_trainer_args(getattr(args, "trainer_arg", None))
    except ValueError as e:
        raise BadInput(str(e)) from None
    hidden = hf_auto.hidden_size_of(spec.module) if spec is not None else None
    if hidden is None:
        hidden = max((max(s) for s in shapes if len(s) >= 2), default=None)
    return hf_auto.resolve(cfg, world_size, hidden_size=hidden, trainer_args=trainer_args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ds-config", required=True, help="your DeepSpeed config (JSON)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"matrix shapes, comma separated (default {DEFAULT_SHAPES}); scaled down when too big, "
                        "keeping aspect ratios and numel mod 2 x world size; a 1-D entry is an Adam vector")
    p.add_argument("--model", default=None,
                   help="run a real module instead of --shapes: a built-in (gpt2, llama, resnet, moe) or "
                        "package.module:factory (harness.models)")
    p.add_argument("--zero-init", action="store_true",
                   help="ZeRO-3: build the module under deepspeed.zero.Init, as Hugging Face does")
    p.add_argument("--trainer-arg", action="append", default=None, metavar="NAME=VALUE",
                   help="a TrainingArguments value for resolving \"auto\" (e.g. learning_rate=3e-4, bf16=true)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="HTML report path (default reports/<case>.html)")
    p.add_argument("--no-report", action="store_true", help="write no report")
    p.add_argument("--patched", action="store_true",
                   help="also run with the bundled fixes and say whether they change the verdict")
    p.add_argument("--launcher", choices=("pool", "torchrun"), default="pool",
                   help="pool: CPU ranks over gloo (default); torchrun: torch.distributed.run, env://, the "
                        "accelerator's backend (nccl on CUDA)")
    p.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto",
                   help="torchrun launcher only: auto picks cuda when a GPU is visible")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the verdict and report lines")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness check", description=__doc__.splitlines()[0],
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    buildenv.apply_base_env()
    return run_check(args)


if __name__ == "__main__":
    sys.exit(main())
