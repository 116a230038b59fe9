"""The config space of the covering-array family (``harness.catalog.pairs``): a domain for every key the
typed view (``harness.case.dsconfig``) reads, one for the scheduler, and one for each scenario knob the
harness controls (overflow pattern and position, gradient scale, world size, shapes, parameter groups).

Why a module of the catalog and not a field of the view: the view states how the installed DeepSpeed
resolves a config, facts of the release read from its source; a domain is the gate's choice of which
values to try (what recipes set, where the code changes behaviour), a fact of the gate's design that only
the gate's families read. The one fact the two share, each key's default, stays the view's: a config
knob's default is the key left out (``ABSENT``), which DeepSpeed resolves to the default the view reads
from the installed release, so no default is written here and none can go stale.

Why the rules (``RULES``) live beside the domains: a covering array can only cover combinations that can
run, and which ones cannot is decided pair by pair (or by a few keys at once) while the array is built,
before any case exists. Each rule names who refuses: DeepSpeed (its words and file, checked against the
installed source by ``cases/harness/test_space.py``), the refusals registry
(``harness.registry.refusals``, checked there to refuse the same rows), or the harness (what a case kind
does not run).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from harness.case import dsconfig
from harness.case.scenarios import TINY_PARAMS
from harness.case.spec import NVME_PATH_PLACEHOLDER, ParamShape


class _Absent:
    """The key left out of the config: DeepSpeed's default, as the view reads it from the release, applies."""

    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()


@dataclass(frozen=True)
class Knob:
    """One column of the covering array. A config knob (``reads`` non-empty) is written at the dotted path
    ``name`` and sets the view's keys ``reads``; its domain is ``ABSENT`` (DeepSpeed's default) and
    ``values``. A scenario knob (``reads`` empty) is the harness's: its domain is ``default`` and ``values``."""

    name: str
    values: tuple
    why: str
    reads: tuple[str, ...] = ()
    default: object = ABSENT

    @property
    def domain(self) -> tuple:
        return (self.default,) + tuple(self.values)


def _key(path: str, values: tuple, why: str, reads: tuple[str, ...] | None = None) -> Knob:
    return Knob(path, values, why, reads if reads is not None else (path,))


# lr schedules over the family's 4 steps, each as its DeepSpeed docs example writes it, shortened to the run.
# WarmupLR without warmup_max_lr warms each half up to its own lr; the others give one lr to both halves.
SCHEDULES = {
    "warmup": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_num_steps": 2,
                                              "warmup_type": "linear"}},
    "decay": {"type": "WarmupDecayLR", "params": {"total_num_steps": 4, "warmup_min_lr": 0.001,
                                                  "warmup_max_lr": 0.01, "warmup_num_steps": 2}},
    "cosine": {"type": "WarmupCosineLR", "params": {"total_num_steps": 4, "warmup_num_steps": 1,
                                                    "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}},
}

CONFIG_KNOBS = (
    _key("fp16.enabled", (True,), "fp16 training (the Hugging Face templates' \"auto\" with --fp16)"),
    _key("bf16.enabled", (True,), "bf16 training (the templates' \"auto\" with --bf16)"),
    _key("zero_optimization.stage", (1, 2, 3), "every ZeRO stage; 0 (the default) is the engine's own step"),
    _key("zero_optimization.contiguous_gradients", (False,), "the templates set true (the default); false takes "
         "the non-contiguous reduce path"),
    _key("zero_optimization.reduce_scatter", (False,), "the ZeRO-2 template sets true (the default); false "
         "all-reduces, and is what ZeRO-3 Muon needs"),
    _key("zero_optimization.reduce_bucket_size", (200000000, 16), "2e8 as the ZeRO-2 template wrote it; 16 "
         "elements puts every parameter in its own bucket"),
    _key("zero_optimization.sub_group_size", (4,), "the ZeRO-3 template sets 1e9 (the default); 4 gives each "
         "matrix its own sub-group"),
    _key("zero_optimization.parameter_alignment", (True,), "pads each parameter: ZeRO-1/2's padded partition path"),
    _key("zero_optimization.compute_grad_norm", (False,), "skips the norm where nothing needs it (ZeRO-1/2, no "
         "clipping, no offload)"),
    _key("zero_optimization.save_muon_momentum_buffer_in_memory", (True,), "ZeRO-3's resident Muon momentum"),
    _key("zero_optimization.zero_quantized_gradients", (True,), "ZeRO++ quantized gradients, as its tutorial sets"),
    _key("zero_optimization.offload_optimizer.device", ("cpu", "nvme"), "the ZeRO-3 template's cpu; nvme swaps"),
    _key("zero_optimization.offload_optimizer.buffer_count", (8,), "the templates' 4 is the default; 8 as "
         "DeepSpeed asks for when a prefetch runs out"),
    _key("zero_optimization.offload_optimizer.pipeline_read", (True,), "the pipelined swapper (read side)"),
    _key("zero_optimization.offload_optimizer.pipeline_write", (True,), "the pipelined swapper (write side)"),
    _key("zero_optimization.offload_param.device", ("cpu",), "the ZeRO-3 template offloads parameters to cpu"),
    _key("zero_optimization.offload_param.buffer_count", (4,), "the NVMe parameter-offload example's 4"),
    _key("data_types.grad_accum_dtype", ("fp32",), "fp32 accumulation; bf16 ZeRO-1 then takes BF16_Optimizer"),
    _key("communication_data_type", ("fp32",), "fp32 reductions of 16-bit gradients"),
    _key("fp16.loss_scale", (128.0, 0.5), "a static scale as older recipes set; 0.5 is below 1, where the "
         "rescale's comparison with 1.0 changes direction"),
    _key("fp16.initial_scale_power", (12, 1), "12 as Megatron recipes set; 1 (a scale of 2) near the 1.0 test"),
    _key("fp16.loss_scale_window", (2,), "the templates' 1000 is the default; 2 grows the scale inside the run"),
    _key("fp16.hysteresis", (1,), "the templates' 2 is the default; 1 halves the scale on the first overflow"),
    _key("fp16.consecutive_hysteresis", (True,), "hysteresis refilled by a good step"),
    _key("fp16.min_loss_scale", (256.0,), "the templates' 1 is the default; 256 is a floor that binds"),
    _key("gradient_clipping", (0.0, 0.05), "the templates' 1.0 is the default; 0 turns clipping off, 0.05 clips "
         "every step of this model"),
    _key("gradient_accumulation_steps", (2,), "two micro-batches per step"),
    _key("managed_gradient_accumulation", (False,), "the client owns the accumulation boundary"),
    _key("prescale_gradients", (True,), "stage 0 divides each rank's gradient before the all-reduce, not the "
         "sum after it"),
    _key("optimizer.params.muon_lr", (0.01,), "a Muon lr beside the default 0.02", ("optimizer.muon.lr",)),
    _key("optimizer.params.momentum", (0.9, 0.3), "0.9 as SGD recipes set; 0.3 is below 0.5, where 1 - b and "
         "1 % b differ", ("optimizer.muon.momentum",)),
    _key("optimizer.params.weight_decay", (0.1,), "the AdamW recipes' 0.1 (one key for both halves)",
         ("optimizer.muon.weight_decay", "optimizer.adam.weight_decay")),
    _key("optimizer.params.ns_method", ("standard",), "the standard quintic beside the gram default",
         ("optimizer.muon.ns_method",)),
    _key("optimizer.params.adam_lr", (1e-3,), "the usual AdamW lr", ("optimizer.adam.lr",)),
    _key("optimizer.params.betas", ((0.9, 0.999),), "torch's and the templates' AdamW betas",
         ("optimizer.adam.betas",)),
    _key("optimizer.params.eps", (1e-8,), "torch's and the templates' AdamW eps", ("optimizer.adam.eps",)),
    _key("optimizer.params.adam_w_mode", (False,), "L2 decay on the Adam half"),
    _key("optimizer.params.per_head_muon", (True,), "DeepSpeed's own per-head tagging from the model config"),
    _key("optimizer.params.torch_adam", (True,), "torch.optim.AdamW as the Adam half"),
    _key("aio.block_size", (2097152,), "the templates' 1 MiB is the default; 2 MiB raises the swap threshold"),
    _key("tensor_parallel.autotp_size", (2,), "AutoTP over two ranks, as its tutorial sets"),
    Knob("scheduler", tuple(SCHEDULES), "DeepSpeed's three warm-up schedules (docs examples)", ("scheduler",)),
)


def _tp_block(heads: int = 4, head_dim: int = 2, hidden: int = 4) -> tuple[ParamShape, ...]:
    """A Llama-style attention block for AutoTP (``harness.case.tp.geometry``): two whole heads per shard."""
    cols = tuple(ParamShape(f"layers.0.self_attn.{leaf}.weight", (heads * head_dim, hidden), heads)
                 for leaf in ("q_proj", "k_proj", "v_proj"))
    return cols + (ParamShape("layers.0.self_attn.o_proj.weight", (hidden, heads * head_dim)),)


# The models a row runs; their own shapes, beside the other families' (more layouts met, not fewer).
SHAPES = {
    "tiny": TINY_PARAMS,
    # a per-head matrix the harness tags (3 heads of 4 rows, wider than tall)
    "heads": TINY_PARAMS + (ParamShape("attn.qkv.weight", (12, 5), num_heads=3),),
    # q/k projections DeepSpeed tags itself with per_head_muon (harness.rank.ds_run.head_config)
    "dsheads": TINY_PARAMS + (ParamShape("attn.q_proj.weight", (8, 4), num_heads=2),
                              ParamShape("attn.k_proj.weight", (4, 4), num_heads=1)),
    "conv": TINY_PARAMS + (ParamShape("conv.weight", (3, 2, 3, 3)),),  # a 4-D filter, reshaped to (out, rest)
    "onerow": (ParamShape("layer0.weight", (1, 5)), ParamShape("layer0.bias", (1,))),  # ranks with nothing
    "autotp": _tp_block(),
}
OVERFLOW_AT = ("first", "last", "row")  # step 2 micro 0; step 2's last micro-batch; steps 2 and 3

SCENARIO_KNOBS = (
    Knob("world_size", (1, 3, 4), "one to four ranks", default=2),
    Knob("shapes", tuple(s for s in SHAPES if s != "tiny"), "the models of SHAPES", default="tiny"),
    Knob("groups", ("two",), "one group, or two user groups with their own lr, decay, momentum 0.9 and "
         "ns_method", default="none"),
    Knob("overflow", ("all", "muon", "adam"), "an inf on every gradient of the last rank, or on one Muon "
         "matrix, or a NaN on one Adam vector", default="none"),
    Knob("overflow_at", OVERFLOW_AT[1:], "where the overflow lands", default=OVERFLOW_AT[0]),
    Knob("grad_scale", (1e-8,), "gradients times 1e-8: subnormal in fp16, near Newton-Schulz's epsilon",
         default=1.0),
)
STEPS = 4


def knobs() -> tuple[Knob, ...]:
    """Every column, the most constrained first: the array's search decides those before the free ones."""
    first = ("tensor_parallel.autotp_size", "shapes", "world_size", "zero_optimization.stage", "fp16.enabled",
             "bf16.enabled", "data_types.grad_accum_dtype", "zero_optimization.offload_optimizer.device",
             "gradient_clipping", "zero_optimization.compute_grad_norm", "groups", "optimizer.params.momentum",
             "overflow", "grad_scale", "gradient_accumulation_steps", "scheduler",
             "optimizer.params.per_head_muon", "zero_optimization.reduce_scatter",
             "zero_optimization.zero_quantized_gradients")
    every = {k.name: k for k in SCENARIO_KNOBS + CONFIG_KNOBS}
    return tuple(every[n] for n in first) + tuple(k for n, k in every.items() if n not in first)


@functools.cache
def by_name() -> dict[str, Knob]:
    return {k.name: k for k in knobs()}


def resolved(row: dict, name: str):
    """The value a row gives knob ``name`` as DeepSpeed takes it: ``ABSENT`` is the view's default of the
    key it reads (the scheduler's: none)."""
    v = row[name]
    if v is not ABSENT:
        return v
    return view_default(by_name()[name].reads[0])


@functools.cache
def view_default(key: str):
    """The view's default of ``key``: the release's documented default, else what the view resolves for a
    config that leaves the key out (the batch rule's accumulation steps); the scheduler's is none."""
    if key == "scheduler":
        return None
    d = dsconfig.defaults().get(key)
    if d is not dsconfig.UNDOCUMENTED:
        return d
    return next(s.value for s in dsconfig.resolve({"train_batch_size": 1}).settings if s.key == key)


def model_dtype(row: dict) -> str:
    return "fp16" if resolved(row, "fp16.enabled") else "bf16" if resolved(row, "bf16.enabled") else "fp32"


@dataclass(frozen=True)
class Rule:
    """Rows that cannot run: ``forbids(row)`` (a row holding at least ``keys``) is true for them. ``by``:
    "deepspeed" (``said_by`` is "file:fragment" of its source), "registry" (``said_by`` names the
    ``harness.registry.refusals`` entry) or "harness" (``said_by`` names the module that cannot run it).
    A rule reads as few keys as its reason needs, so pairs it forbids are provably forbidden; where DeepSpeed
    raises another refusal first (the norm checks before the reduce-scatter's), that row is forbidden by
    that refusal's rule too. A "registry" rule agrees with its entry over its keys, the rest at defaults."""

    keys: tuple[str, ...]
    forbids: object
    by: str
    said_by: str


ST, CGN, OFF = "zero_optimization.stage", "zero_optimization.compute_grad_norm", \
    "zero_optimization.offload_optimizer.device"
DT = ("fp16.enabled", "bf16.enabled")
TP = "tensor_parallel.autotp_size"


def _gad(row: dict) -> str:
    """``data_types.grad_accum_dtype`` as the engine takes it: None is the model dtype."""
    return dsconfig.canonical_dtype(resolved(row, "data_types.grad_accum_dtype")) or model_dtype(row)


def _bf16_optimizer_route(row: dict) -> bool:
    """The view's ``DSConfig.bf16_optimizer_route`` read off a row: bf16 ZeRO-1, fp32 accumulation, no CPU offload."""
    return (resolved(row, ST) == 1 and model_dtype(row) == "bf16" and _gad(row) == "fp32"
            and resolved(row, OFF) != "cpu")


# What a tensor-parallel row must hold (harness.rank.tp_case runs fp32 ZeRO-1/2 on two ranks, one backward
# and one step per step, unclipped, unscheduled, with no injected data; harness.judge.tp_verdict judges it).
TP_NEEDS = {"shapes": ("autotp",), "world_size": (2,), ST: (1, 2), "fp16.enabled": (False,),
            "bf16.enabled": (False,), "gradient_clipping": (0.0,), "gradient_accumulation_steps": (1,),
            "overflow": ("none",), "groups": ("none",), "grad_scale": (1.0,), "scheduler": (None,),
            OFF: ("none",)}


def _tp_rule(key: str, allowed: tuple) -> Rule:
    return Rule((TP, key), lambda r: (resolved(r, TP) or 0) > 1 and resolved(r, key) not in allowed, "harness",
                "harness/rank/tp_case.py: the tensor-parallel case kind")


RULES = (
    Rule(DT, lambda r: resolved(r, DT[0]) and resolved(r, DT[1]), "deepspeed",
         "runtime/config.py:bfloat16 and fp16 modes cannot be simultaneously enabled"),
    Rule((CGN, ST), lambda r: not resolved(r, CGN) and resolved(r, ST) not in (1, 2), "deepspeed",
         "runtime/zero/config.py:compute_grad_norm=false is supported only with ZeRO Stage 1 or 2"),
    # the registry's no-norm-with-clipping and -offload, read with two keys each: at stage 0 and 3 (the view's
    # default stage is 0) DeepSpeed's config refuses compute_grad_norm false first (the rule above)
    Rule((CGN, "gradient_clipping"), lambda r: not resolved(r, CGN) and resolved(r, "gradient_clipping") > 0,
         "deepspeed", "runtime/zero/stage_1_and_2.py:compute_grad_norm=false requires gradient_clipping=0"),
    Rule((CGN, OFF), lambda r: not resolved(r, CGN) and resolved(r, OFF) != "none", "deepspeed",
         "runtime/zero/stage_1_and_2.py:compute_grad_norm=false does not support optimizer offload"),
    Rule((CGN, ST, *DT, "data_types.grad_accum_dtype", OFF),
         lambda r: resolved(r, CGN) is False and _bf16_optimizer_route(r), "registry", "no-norm-on-bf16-optimizer"),
    Rule((ST, *DT, "data_types.grad_accum_dtype"), lambda r: resolved(r, ST) == 0 and _gad(r) != model_dtype(r),
         "deepspeed", "runtime/engine.py:unsupported mix of"),
    Rule((ST, *DT, "data_types.grad_accum_dtype", OFF, "shapes"),
         lambda r: _bf16_optimizer_route(r) and any(p.uses_muon and len(p.shape) != 2 for p in SHAPES[r["shapes"]]),
         "deepspeed", "runtime/bf16_optimizer.py:BF16 Muon currently supports dense two-dimensional matrices only"),
    Rule((ST, "zero_optimization.reduce_scatter"),
         lambda r: resolved(r, ST) == 3 and resolved(r, "zero_optimization.reduce_scatter"), "registry",
         "z3-muon-reduce-scatter"),
    Rule((ST, "zero_optimization.reduce_scatter", "prescale_gradients"),
         lambda r: resolved(r, ST) == 2 and resolved(r, "zero_optimization.reduce_scatter")
         and resolved(r, "prescale_gradients"), "registry", "z2-prescale-with-reduce-scatter"),
    Rule((ST, "zero_optimization.zero_quantized_gradients"),
         lambda r: resolved(r, ST) == 3 and resolved(r, "zero_optimization.zero_quantized_gradients"), "registry",
         "z3-muon-all2all"),
    Rule((ST, "groups", "optimizer.params.momentum"),
         lambda r: resolved(r, ST) == 3 and r["groups"] == "two" and resolved(r, "optimizer.params.momentum") != 0.9,
         "registry", "z3-muon-group-betas"),
    Rule(("optimizer.params.per_head_muon", "shapes"),
         lambda r: resolved(r, "optimizer.params.per_head_muon") and r["shapes"] not in ("dsheads", "autotp"),
         "harness", "harness/rank/ds_run.py: head_config describes q/k/v projections only"),
    Rule((TP, "shapes"), lambda r: ((resolved(r, TP) or 0) > 1) != (r["shapes"] == "autotp"), "harness",
         "harness/rank/tp_case.py: the tensor-parallel case kind holds exactly one attention block"),
    Rule(("groups", "shapes"), lambda r: r["groups"] == "two" and r["shapes"] == "onerow", "harness",
         "harness/catalog/pairs.py: two groups need two layers"),
    *(_tp_rule(k, v) for k, v in TP_NEEDS.items() if k != "shapes"),
)


def _put(cfg: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        cfg = cfg.setdefault(p, {})
    cfg[leaf] = list(value) if isinstance(value, tuple) else value


def config_of(row: dict) -> dict:
    """The DeepSpeed config of a row: each config knob not ``ABSENT`` written at its path, one micro-batch
    per rank, the batch sizes consistent with the world size, and a private swap folder for NVMe."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon", "params": {}},
           "steps_per_print": 10**9, "wall_clock_breakdown": False}
    for k in CONFIG_KNOBS:
        v = row[k.name]
        if v is not ABSENT:
            _put(cfg, k.name, SCHEDULES[v] if k.name == "scheduler" else v)
    cfg["train_batch_size"] = resolved(row, "gradient_accumulation_steps") * row["world_size"]
    for sec in ("offload_optimizer", "offload_param"):
        if resolved(row, f"zero_optimization.{sec}.device") == "nvme":
            cfg["zero_optimization"][sec]["nvme_path"] = NVME_PATH_PLACEHOLDER
    return cfg


def view_keys() -> tuple[str, ...]:
    """Every key the typed view reads: it notes each one it reads, given or not, so a config that sets nothing
    lists them all."""
    return tuple(s.key for s in dsconfig.resolve({"train_batch_size": 1}).settings)


def keys_without_domain() -> list[str]:
    """The view's keys no knob of the space reads: a key DeepSpeed reads that the covering array never varies."""
    have = {r for k in CONFIG_KNOBS for r in k.reads}
    return [k for k in view_keys() if k not in have]
