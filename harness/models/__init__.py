"""Real modules as cases: a case may name a model factory instead of a list of shapes.

Why: the synthetic model decides nothing the way a real training run does -- which parameters get
Muon (embeddings and ``lm_head`` are excluded by name), tied input/output embeddings (one
parameter), norms, 4-D conv kernels, 3-D expert weights, buffers (BatchNorm statistics) and
``deepspeed.zero.Init``, where every parameter is a 1-D placeholder at construction.

The factory contract (a built-in name from ``BUILTIN`` or ``"package.module:factory"``)::

    factory(seed: int) -> ModelSpec            # or the tuple (module, batch)

* ``module``: a ``torch.nn.Module`` in float32 whose weights depend only on ``seed``; its forward
  takes the batch as keyword arguments and returns the scalar loss (or an object with ``.loss``,
  as Hugging Face models do). No dropout: the oracle replays the forward and must see the same
  function.
* ``batch(rank, step, micro) -> dict``: the micro-batch of one rank, deterministic from ``seed`` and
  its arguments; floating tensors in float32 (the harness rounds them to the model dtype, and the
  oracle sees the same rounded values), integer tensors as they are.
* ``param_groups`` (optional): parameter groups by parameter name, each with its own settings
  (``weight_decay``, ``lr``, ...), handed to ``deepspeed.initialize`` as ``model_parameters``.

The case's ``params`` are filled from the module's structure in the parent process
(``model_case``): name and shape of every parameter in ``named_parameters()`` order (a tied weight
is one parameter), so the capture, the layout and the oracle's Muon/Adam split
(``oracles.ParamSpec.deepspeed_tagged``) come from the module, never from DeepSpeed.

Built-ins need the ``models`` extra (``pip install -e .[models]``, i.e. ``transformers``) only for the
two language models; the conv net and the mixture-of-experts block are plain torch.
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Callable

import torch
from harness.case.spec import ParamShape
from harness.case.spec import Case, canonical_json
from harness.case.spec import ds_config as make_config
from harness.case.scenarios import pipeline_name

EXTRA_HINT = "pip install -e .[models]"

# name -> "module:factory"; every built-in is small (2 layers, hidden 16, vocab 64), random-init from
# a config, nothing downloaded.
BUILTIN: dict[str, str] = {
    "gpt2": "harness.models.lm:gpt2",  # GPT-2 style, tied input/output embedding, Conv1D projections
    "llama": "harness.models.lm:llama",  # Llama style, untied embed_tokens / lm_head, RMSNorm, GQA, RoPE
    "resnet": "harness.models.resnet:resnet",  # ResNet style conv net: 4-D kernels, BatchNorm buffers
    # mixture-of-experts LM block: 3-D expert weights, embed/lm_head, groups (plain torch)
    "moe": "harness.models.moe:moe",
    # ... with its experts tagged is_expert_group, as DeepSpeed's grouped experts (AutoEP) tag theirs
    "moe-ep": "harness.models.moe:moe_ep",
}
NEEDS_TRANSFORMERS = ("gpt2", "llama")


class ModelsUnavailable(ImportError):
    """A built-in model needs an optional package that is not installed."""


@dataclass(frozen=True)
class ParamGroup:
    """One ``model_parameters`` group: parameter names and the settings it overrides."""

    names: tuple[str, ...]
    settings: tuple[tuple[str, float], ...] = ()


@dataclass
class ModelSpec:
    module: torch.nn.Module
    batch: Callable[[int, int, int], dict]
    param_groups: tuple[ParamGroup, ...] = ()
    notes: list[str] = field(default_factory=list)
    # Extra forward keyword arguments for the oracle's replays, given a batch and the replay's dtype:
    # inputs the module would otherwise rebuild on every forward, handed over ready and equal to what
    # it builds (a causal LM's attention mask: transformers builds it with vmap, ~40% of an LM's
    # judge). Never passed to DeepSpeed's ranks, which run the module as a user does.
    oracle_inputs: Callable[[dict, torch.dtype], dict] | None = None


def factory_path(model: str) -> str:
    if model in BUILTIN:
        return BUILTIN[model]
    if ":" not in model:
        raise ValueError(f"model {model!r} is neither a built-in ({', '.join(BUILTIN)}) nor a "
                         "'package.module:factory' path")
    return model


def transformers_available() -> bool:
    try:
        importlib.import_module("transformers")
    except ImportError:
        return False
    return True


def load_factory(model: str) -> Callable:
    path = factory_path(model)
    mod_name, _, attr = path.partition(":")
    if model in NEEDS_TRANSFORMERS and not transformers_available():
        raise ModelsUnavailable(f"built-in model {model!r} needs the 'transformers' package: {EXTRA_HINT}")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"model factory {path!r}: cannot import {mod_name!r} ({e})") from e
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise ValueError(f"model factory {path!r}: {mod_name!r} has no callable {attr!r}")
    return fn


def build_spec(model: str, seed: int) -> ModelSpec:
    out = load_factory(model)(seed)
    if isinstance(out, tuple) and len(out) == 2:
        out = ModelSpec(out[0], out[1])
    if not isinstance(out, ModelSpec) or not isinstance(out.module, torch.nn.Module) or not callable(out.batch):
        raise ValueError(f"model factory {factory_path(model)!r} must return a ModelSpec or (module, batch_fn), "
                         f"got {type(out).__name__}")
    return out


def loss_of(output) -> torch.Tensor:
    """The scalar loss of a forward: the tensor itself, ``.loss`` (Hugging Face) or element 0."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0]
    else:
        raise ValueError(f"cannot find the loss in a forward output of type {type(output).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"the forward's loss has shape {tuple(loss.shape)}, not a scalar")
    return loss.reshape(())


def batch_in(batch: dict, dtype: torch.dtype) -> dict:
    """Floating tensors rounded to ``dtype`` (the model dtype: what the engine's module sees)."""
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in batch.items()}


# ------------------------------------------------------------------------------------------------
# checks on a user's module (before any rank starts)


DROPOUT_ATTRS = ("dropout", "pdrop", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")


def validate(spec: ModelSpec, model: str) -> None:
    """Refuse what the oracle cannot replay: dropout, frozen parameters, a batch that is not
    deterministic, a forward without a scalar loss."""
    bad = [n for n, m in spec.module.named_modules()
           if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    cfg = getattr(spec.module, "config", None)
    if cfg is not None:
        for attr in dir(cfg):
            if any(k in attr for k in DROPOUT_ATTRS) and not attr.startswith("_"):
                v = getattr(cfg, attr, None)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                    bad.append(f"config.{attr}={v}")
    if bad:
        raise ValueError(f"model {model!r} has dropout switched on ({', '.join(bad[:4])}): the oracle replays the "
                         "forward and needs the same function every time; set every dropout to 0")
    frozen = [n for n, p in spec.module.named_parameters() if not p.requires_grad]
    if frozen:
        raise ValueError(f"model {model!r} has frozen parameters {frozen[:4]}: not supported")
    a, b = spec.batch(0, 1, 0), spec.batch(0, 1, 0)
    if not isinstance(a, dict) or a.keys() != b.keys() or any(
            not torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor)):
        raise ValueError(f"model {model!r}: batch(rank, step, micro) must return the same dict of tensors "
                         "every time it is called with the same arguments")
    names = {n for n, _ in spec.module.named_parameters()}
    for g in spec.param_groups:
        missing = set(g.names) - names
        if missing:
            raise ValueError(f"model {model!r}: parameter group names unknown parameters {sorted(missing)[:4]}")


def param_shapes(spec: ModelSpec):
    """The case's ``params``: every parameter of the module, ``named_parameters()`` order."""

    return tuple(ParamShape(n, tuple(p.shape)) for n, p in spec.module.named_parameters())


def incoming_groups(spec: ModelSpec) -> list[tuple[str, ...]]:
    """The parameter names of each group ``model_parameters`` hands DeepSpeed, in order (one group of
    every parameter when the model declares none): what DeepSpeed splits into Muon and Adam halves."""
    names = [n for n, _ in spec.module.named_parameters()]
    if not spec.param_groups:
        return [tuple(names)]
    grouped = [tuple(g.names) for g in spec.param_groups]
    rest = tuple(n for n in names if not any(n in g for g in grouped))
    return grouped + ([rest] if rest else [])


def model_parameters(spec: ModelSpec, module: torch.nn.Module | None = None):
    """What ``deepspeed.initialize`` gets as ``model_parameters``: the groups, or all parameters."""
    module = module if module is not None else spec.module
    if not spec.param_groups:
        return list(module.parameters())
    named = dict(module.named_parameters())
    groups = []
    grouped = set()
    for g in spec.param_groups:
        groups.append({"params": [named[n] for n in g.names], **dict(g.settings)})
        grouped.update(g.names)
    rest = [p for n, p in named.items() if n not in grouped]
    if rest:
        groups.append({"params": rest})
    return groups


def model_case(model: str, stage: int, offload: str = "none", dtype: str = "fp32", world_size: int = 2, *,
               zero_init: bool = False, steps: int = 2, seed: int = 0, name: str | None = None,
               ds_config: str | dict | None = None, **cfg):
    """A case that runs ``model`` (built-in or factory path) on one pipeline."""

    if zero_init and stage != 3:
        raise ValueError("zero_init (deepspeed.zero.Init) is a ZeRO-3 option")
    spec = build_spec(model, seed)
    validate(spec, model)
    if ds_config is None:
        ds_config = make_config(stage=stage, dtype=dtype, offload=offload, world_size=world_size, **cfg)
    label = model if model in BUILTIN else model.rsplit(":", 1)[-1]
    default = f"{label}-" + pipeline_name(stage, offload, dtype, world_size, **cfg) + ("-zinit" if zero_init else "")
    return Case(name=name or default, params=param_shapes(spec), ds_config=canonical_json(ds_config),
                world_size=world_size, steps=steps, seed=seed, model=model, zero_init=zero_init)


def describe(model: str, seed: int = 0) -> str:
    spec = build_spec(model, seed)
    n = sum(p.numel() for p in spec.module.parameters())
    return json.dumps({"model": model, "parameters": n,
                       "tensors": [[k, list(v.shape)] for k, v in spec.module.named_parameters()]})
