"""A case is plain, frozen, picklable data so that Hypothesis can draw it in the parent process and
the pool can ship it to ranks; nothing in it refers to a live object.

The DeepSpeed config travels as canonical JSON text (a frozen dataclass cannot hold a dict), which is
also exactly what a user hands to ``python -m harness check``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

from harness.case.dsconfig import DTYPE_ALIASES, DSConfig
from oracles.layout import deepspeed_uses_muon

DTYPES = tuple(DTYPE_ALIASES)  # the model dtypes a case names: fp32, fp16, bf16
# Optimizers that are not Muon, as a user names them (torch.optim class names, which are also
# DeepSpeed config types): the oracle steps every parameter with Adam, decoupled decay for AdamW and
# L2 for Adam (oracles.adam), whatever DeepSpeed tags them.
NON_MUON_OPTIMIZERS = ("AdamW", "Adam")
OFFLOADS = ("none", "cpu", "nvme")
SWAPPERS = ("partitioned", "pipelined")


@dataclass(frozen=True)
class ParamShape:
    """One trainable tensor of the synthetic model.

    ``shape`` with two or more dims is tagged Muon by DeepSpeed (unless the name holds "embed" or
    "lm_head"); a 1-D shape goes to the auxiliary Adam (``uses_muon``).
    """

    name: str
    shape: tuple[int, ...]
    num_heads: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def uses_muon(self) -> bool:
        return deepspeed_uses_muon(self.name, self.shape)


@dataclass(frozen=True)
class Overflow:
    """A non-finite gradient at (optimizer step, rank, micro-step) that must make DeepSpeed skip the step.

    ``param`` None: every parameter's data of that rank and micro-batch is poisoned, so the loss and every
    gradient there go non-finite together. ``param`` a name: only that parameter's gradient contribution
    is (its first element, through the backward; ``harness.case.synthetic``), as a real overflow starts in
    one place, while the loss and every other gradient stay finite. Only then does a skipped step still
    hold clean Muon momentum whose advancing would show."""

    step: int
    rank: int = 0
    micro: int = 0
    value: float = float("inf")
    param: str | None = None

    def __post_init__(self):
        for key, low in (("step", 1), ("rank", 0), ("micro", 0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"Overflow {key} {v!r}: must be an integer >= {low} (steps count from 1, ranks "
                                 "and micro-steps from 0)")
        if not isinstance(self.value, (int, float)) or isinstance(self.value, bool) or math.isfinite(self.value):
            raise ValueError(f"Overflow value {self.value!r}: must be inf, -inf or nan (a finite value forces "
                             "no skip; to model a large finite gradient use Case.grad_scale)")
        if self.param is not None and (not isinstance(self.param, str) or not self.param):
            raise ValueError(f"Overflow param {self.param!r}: a parameter name of the case, or None to poison "
                             "every parameter of that rank and micro-step")


@dataclass(frozen=True)
class ParamGroup:
    """One param group the user passes to ``deepspeed.initialize(model_parameters=[...])``: the named
    parameters and the settings the group itself sets (None: not set, the config's value applies).

    DeepSpeed splits each group into a Muon and an Adam half; a group's ``lr`` and ``weight_decay``
    reach both halves, ``momentum`` and ``ns_method`` only the Muon half (``engine.py
    _muon_param_groups``). ``use_muon`` is passed through as a group key, as a user would write it.

    ``loose``: the parameters are passed as bare tensors beside the dicts, not as a group. DeepSpeed
    collects them, wherever they stand in the list, into one group of the config's settings placed after
    the dict groups (``engine.py`` ``_muon_param_groups``), so a loose group sets nothing and comes last
    in ``Case.groups`` (DeepSpeed's order); the harness hands its tensors over first.
    """

    params: tuple[str, ...]
    lr: float | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    ns_method: str | None = None
    use_muon: bool | None = None
    loose: bool = False

    def options(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("params", "loose") and v is not None}


@dataclass(frozen=True)
class Case:
    name: str
    params: tuple[ParamShape, ...]
    ds_config: str  # canonical JSON text of the DeepSpeed config, as DeepSpeed would receive it
    world_size: int = 1
    steps: int = 3
    seed: int = 0
    batch: int = 8  # rows of synthetic data per rank and micro-batch
    # Harness-side switches; none of them changes DeepSpeed's config.
    ns_dtype: str | None = None  # "float64": force Newton-Schulz compute dtype (high-precision-NS mode)
    compiled: bool = False  # run muon_update under torch.compile, as users do
    overflows: tuple[Overflow, ...] = ()
    checkpoint_at: int | None = None  # save after this step, reload into a fresh engine, continue
    patched: bool = False  # run with harness.fixes applied
    mutant: str | None = None  # name of a known-bug mutant to install (harness.registry.mutants)
    timeout_s: float = 300.0
    fault: str | None = None  # test-only: "raise:R", "exit:R", "hang:R", "spawn-child:R" (harness.launch.pool)
    # Gradient spectrum of the synthetic model (harness.case.synthetic.batch_data); defaults leave the data alone.
    grad_scale: float = 1.0  # every gradient times this (near-zero gradients: NS normalisation epsilon)
    grad_elementwise: float = 1.0  # weight of the full-rank elementwise term; 0: rank <= batch*W*GAS
    grad_cond: float = 1.0  # X's columns scaled from 1 down to 1/grad_cond (ill-conditioned data term)
    # The user's param groups (model_parameters); empty: model.parameters(), one group.
    groups: tuple[ParamGroup, ...] = ()
    # A torch LR scheduler passed to deepspeed.initialize (lr_scheduler=), as JSON text
    # '{"type": "StepLR", "params": {...}}'; a config scheduler lives in ds_config["scheduler"].
    client_scheduler: str | None = None
    # A torch optimizer the user builds and passes to ``deepspeed.initialize`` (``optimizer=``), as JSON
    # text '{"type": "AdamW", "params": {...}}' (``NON_MUON_OPTIMIZERS``); the config then names no
    # optimizer, so DeepSpeed's ``optimizer_name`` is None. The oracle steps every parameter with it.
    client_optimizer: str | None = None

    # A real module instead of the synthetic one (harness.models): a built-in name or
    # "package.module:factory"; ``params`` then lists the module's parameters (filled by
    # harness.models.model_case from its structure). ``zero_init``: build the module under
    # ``deepspeed.zero.Init`` (ZeRO-3), as Hugging Face builds every ZeRO-3 model.
    model: str | None = None
    zero_init: bool = False
    # Chunked Muon all-gathers and their buffer cache (harness.rank.gather_cache): (max_buffer_bytes,
    # max_cached_bytes) set on the ZeRO optimizer after initialize (DeepSpeed reads them from
    # ``_muon_allgather_max_buffer_bytes`` / ``_muon_allgather_max_cached_bytes``; no config key), so
    # that a matrix is gathered in several chunks and the cache evicts. None: DeepSpeed's defaults.
    allgather_caps: tuple[int, int] | None = None
    # The case claims that its caps make DeepSpeed's gather cache evict: an older entry pushed out by a newer
    # one at least once per engine, counted in DeepSpeed's own cache object (harness.rank.gather_cache). A cap
    # the gathers never fill passes the cap check too, so without the count the claim would be unchecked.
    allgather_evicts: bool = False
    # Model-parallel ranks per data-parallel rank (harness.rank.mpu): > 1 hands DeepSpeed an ``mpu`` that
    # splits the world into ``model_parallel`` independent data-parallel runs of ``dp_size`` ranks
    # each (Megatron layout: model-parallel peers are consecutive ranks), each fed its own data.
    model_parallel: int = 1
    # Resume the checkpoint saved after ``checkpoint_at`` into a run of this many ranks (None: the
    # case's own world size). Another world size needs DeepSpeed's universal checkpoint, which cannot
    # convert a Muon checkpoint in 0.19.8 (DSM-018): refused before any rank starts.
    resume_world_size: int | None = None
    # (parameter, step): the parameter takes no part in the loss at that step, on any rank and micro-batch
    # (a layer a real model skips: a conditional branch, an expert no token chose). Its gradient is then
    # None on every rank; DeepSpeed steps it on a zero gradient on every path (its momentum decays, Adam's
    # moments too, weight decay applies), which the oracle reads as a zero gradient (harness.case.synthetic).
    unused: tuple[tuple[str, int], ...] = ()
    # FusedAdam's construction fails on the ranks, as where its op cannot be built (no compiler): DeepSpeed
    # then steps Muon's auxiliary Adam inline (muon_optimizer.py, its fallback). Needs Muon without
    # offload (offload uses DeepSpeedCPUAdam) and without torch_adam (torch's AdamW needs no build).
    fused_adam_fails: bool = False
    # The departures from Muon as defined (ids of ``harness.registry.departures``) the case claims apply to
    # its run, exactly: the gate holds the run's findings to the claim and each one's size to a second
    # computation (``harness.judge.departure_pins``). None: the case claims nothing about them.
    departs: tuple[str, ...] | None = None

    @property
    def dp_size(self) -> int:
        """The data-parallel world ZeRO averages, partitions and gathers over."""
        return self.world_size // self.model_parallel

    def data_rank(self, dp_rank: int, mp_rank: int = 0) -> int:
        """The global rank (whose data ``harness.case.synthetic.batch_data`` draws) of data-parallel rank
        ``dp_rank`` in model-parallel replica ``mp_rank``."""
        return dp_rank * self.model_parallel + mp_rank

    @property
    def schedule(self) -> dict | None:
        """The lr schedule the run uses: the client scheduler, else the config's ``scheduler``."""
        if self.client_scheduler:
            return json.loads(self.client_scheduler)
        return self.ds.scheduler

    def __post_init__(self):
        if self.unused:
            self._check_unused()
        if self.overflows:
            self._check_overflows()
        if self.fused_adam_fails:
            if (not self.runs_muon or self.offload != "none" or self.ds.optimizer.torch_adam
                    or self.client_optimizer is not None):
                raise ValueError(f"case {self.name!r}: fused_adam_fails needs Muon without optimizer offload and "
                                 "without torch_adam: only there does DeepSpeed build FusedAdam for Muon's auxiliary "
                                 "Adam and fall back to its inline Adam when that fails")
        if self.model_parallel != 1:
            self._check_model_parallel()
        if self.resume_world_size is not None and self.resume_world_size != self.world_size:
            raise ValueError(
                f"case {self.name!r}: resume_world_size {self.resume_world_size!r} (saved at world size "
                f"{self.world_size}): resuming into another world size needs DeepSpeed's universal checkpoint, "
                "and DeepSpeed 0.19.8's converter (deepspeed.checkpoint.ds_to_universal) reads Adam's "
                "exp_avg/exp_avg_sq for every parameter group, so a Muon checkpoint fails with KeyError "
                "'exp_avg' on ZeRO-1, 2 and 3 and Muon's momentum cannot be carried over (DSM-018, "
                "harness/registry/bugs.py); resume at the same world size (resume_world_size null)")
        if self.schedule:
            from oracles.schedules import validate

            try:
                validate(self.schedule)
            except ValueError as e:
                raise ValueError(f"case {self.name!r}: {e}") from None
        if self.client_optimizer is not None:
            spec = json.loads(self.client_optimizer)
            if spec.get("type") not in NON_MUON_OPTIMIZERS or self.ds.optimizer.type is not None:
                raise ValueError(f"case {self.name!r}: client_optimizer {spec.get('type')!r} must be one of "
                                 f"{NON_MUON_OPTIMIZERS}, with no optimizer in the DeepSpeed config")
        if self.groups:
            names = [p.name for p in self.params]
            listed = [n for g in self.groups for n in g.params]
            unknown = sorted(set(listed) - set(names))
            dup = sorted({n for n in listed if listed.count(n) > 1})
            missing = [n for n in names if n not in listed]
            if unknown or dup or missing:
                raise ValueError(f"case {self.name!r}: param groups must list every parameter exactly once "
                                 f"(unknown {unknown}, listed twice {dup}, in no group {missing})")
            for g in self.groups:
                if g.ns_method not in (None, "gram", "standard"):
                    raise ValueError(f"case {self.name!r}: group ns_method {g.ns_method!r} is not gram/standard")
            loose = [i for i, g in enumerate(self.groups) if g.loose]
            if loose and (loose != [len(self.groups) - 1] or self.groups[-1].options()):
                raise ValueError(f"case {self.name!r}: a loose group (bare tensors) must be the only one, the last, "
                                 "and set nothing: DeepSpeed puts the bare tensors in one group of the config's "
                                 "settings after the dict groups")

    def _check_unused(self) -> None:
        names = {p.name for p in self.params}
        bad = [u for u in self.unused if len(u) != 2 or u[0] not in names or isinstance(u[1], bool)
               or not isinstance(u[1], int) or not 1 <= u[1] <= self.steps]
        if bad:
            raise ValueError(f"case {self.name!r}: unused {bad}: each entry is (a parameter of the case, a step "
                             f"from 1 to {self.steps})")
        if self.model:
            raise ValueError(f"case {self.name!r}: unused needs the synthetic model (a real module's forward "
                             "decides for itself which parameters it uses)")
        for step in {u[1] for u in self.unused}:
            if names <= {n for n, s in self.unused if s == step}:
                raise ValueError(f"case {self.name!r}: every parameter unused at step {step}: no loss to "
                                 "differentiate")

    def _check_overflows(self) -> None:
        """Where each overflow lands must exist in the run, or it would silently poison nothing."""
        names = {p.name for p in self.params}
        for o in self.overflows:
            where = f"case {self.name!r}: overflow {o}"
            if o.step > self.steps or o.rank >= self.world_size:
                raise ValueError(f"{where}: step must be 1..{self.steps} and rank 0..{self.world_size - 1}")
            if o.param is None:
                continue
            if self.model:
                raise ValueError(f"{where}: a localized overflow (param) needs the synthetic model; a real "
                                 "module's forward is its own (param None poisons every gradient)")
            if o.param not in names:
                raise ValueError(f"{where}: param {o.param!r} is not a parameter of the case ({sorted(names)})")
            if (o.param, o.step) in self.unused:
                raise ValueError(f"{where}: {o.param!r} is unused at step {o.step}, so it has no gradient to poison")
            gas = self.ds.gradient_accumulation_steps
            if gas is not None and o.micro >= gas:
                raise ValueError(f"{where}: micro must be 0..{gas - 1} (gradient_accumulation_steps {gas})")

    def _check_model_parallel(self) -> None:
        mp = self.model_parallel
        if isinstance(mp, bool) or not isinstance(mp, int) or mp < 1 or self.world_size % mp:
            raise ValueError(f"case {self.name!r}: model_parallel {mp!r} must be an integer >= 1 dividing "
                             f"world_size {self.world_size}")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"case {self.name!r}: model_parallel {mp} needs ZeRO-1/2/3 (an mpu without ZeRO "
                             "only sets the data-parallel group of the engine's own all-reduce)")
        if self.overflows:
            # DeepSpeed MAX-reduces the overflow flag over the model-parallel group
            # (docs/deepspeed-0.19.8.md, "Data-parallel group smaller than the world"): the replicas here
            # see different data, so an overflow in one skips the step in all, which the per-replica
            # oracle does not replay. (The shared clip norm it does: harness.judge.verdict.judge.)
            raise ValueError(f"case {self.name!r}: model_parallel {mp} with injected overflows: DeepSpeed "
                             "skips the step on every model-parallel replica when one overflows, which the "
                             "per-replica oracle does not model")
        if self.checkpoint_at is not None or self.model or self.zero_init:
            raise ValueError(f"case {self.name!r}: model_parallel {mp} runs the synthetic model without "
                             "checkpoint resume or zero.Init")

    @property
    def config(self) -> dict:
        return json.loads(self.ds_config)  # a fresh dict each time: callers may edit their copy

    # The scalars below are read ~200 times per case-column (triggers, allowances, layouts); each read
    # parsed the whole config (~5 ms a case-column). A case is frozen, so the view is resolved once.
    @functools.cached_property
    def ds(self) -> DSConfig:
        """The config as DeepSpeed resolves it (``harness.case.dsconfig``): every reader goes through it."""
        return DSConfig.of(self)

    @property
    def stage(self) -> int:
        return self.ds.zero.stage

    @property
    def dtype(self) -> str:
        return self.ds.model_dtype

    @property
    def offload(self) -> str:
        return self.ds.offload

    @property
    def grad_accum(self) -> int:
        return self.ds.gradient_accumulation_steps

    @functools.cached_property
    def runs_muon(self) -> bool:
        """The config's optimizer is Muon (``DSConfig.names_muon``; no client optimizer) and at least one
        parameter takes its route: what every bug of Muon's own paths needs. A non-Muon case has
        Muon-shaped matrices but no Muon step, and a config without an optimizer section has no Muon."""
        return self.client_optimizer is None and self.ds.names_muon and any(p.uses_muon for p in self.params)

    @property
    def overflow_leaves_muon_clean(self) -> bool:
        """Some step's injected overflows are all localized (``Overflow.param``) and leave a Muon matrix's
        gradient finite: only there does a skipped step hold Muon momentum that could wrongly advance
        (``muon_update`` keeps the momentum of a matrix whose gradient is non-finite)."""
        muon = {p.name for p in self.params if p.uses_muon}
        for s in {o.step for o in self.overflows}:
            here = {o.param for o in self.overflows if o.step == s}
            if None not in here and muon - here:
                return True
        return False

    def replace(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["ds_config"] = json.loads(self.ds_config)
        if d["client_optimizer"] is None:
            # absent, not null: every case without one keeps the JSON (reproducers, the mutation run's
            # stored coverage and baselines) it had before the field existed
            del d["client_optimizer"]
        if not d["unused"]:
            del d["unused"]  # the same for cases without unused parameters
        if not d["fused_adam_fails"]:
            del d["fused_adam_fails"]
        if not d["allgather_evicts"]:
            del d["allgather_evicts"]  # the same for cases that claim no eviction
        if d["departs"] is None:
            del d["departs"]  # the same for cases that claim nothing about departures
        for o in d["overflows"]:
            if o["param"] is None:
                del o["param"]  # an overflow everywhere keeps the JSON it had before ``param`` existed
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Case":
        """A case from its JSON (what a divergence's reproducer prints); ``ValueError`` naming what is
        missing or wrong, before any rank starts."""
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"a case is a JSON object, got {type(d).__name__}")
        missing = [k for k in ("name", "params", "ds_config") if k not in d]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}: a case needs name, params (a list of "
                             "{name, shape[, num_heads]}) and ds_config")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        for key in ("world_size", "steps", "model_parallel"):
            v = d.get(key, 1)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} {v!r}: must be an integer >= 1")
        if not isinstance(d["params"], list):
            raise ValueError("params: expected a list of {name, shape[, num_heads]}")
        for i, p in enumerate(d["params"]):
            lacks = [k for k in ("name", "shape") if not isinstance(p, dict) or k not in p]
            if lacks:
                raise ValueError(f"params[{i}] lacks {', '.join(lacks)}: each parameter is "
                                 "{name, shape[, num_heads]}")
        d["params"] = tuple(ParamShape(p["name"], tuple(p["shape"]), p.get("num_heads")) for p in d["params"])
        d["overflows"] = tuple(Overflow(**o) for o in d.get("overflows", ()))
        d["groups"] = tuple(ParamGroup(**dict(g, params=tuple(g["params"]))) for g in d.get("groups", ()))
        d["ds_config"] = canonical_json(d["ds_config"])
        d["unused"] = tuple((str(u[0]), u[1]) for u in d.get("unused", ()))
        if d.get("allgather_caps") is not None:
            d["allgather_caps"] = tuple(int(x) for x in d["allgather_caps"])
        if d.get("departs") is not None:
            d["departs"] = tuple(str(x) for x in d["departs"])
        return cls(**d)


def canonical_json(cfg: dict | str) -> str:
    if isinstance(cfg, str):
        cfg = json.loads(cfg)
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


NVME_PATH_PLACEHOLDER = "@NVME@"  # replaced on the rank by the case's private swap folder


def ds_config(
    *,
    stage: int,
    dtype: str = "fp32",
    offload: str = "none",
    swapper: str = "partitioned",
    grad_accum: int = 1,
    micro_batch: int = 1,
    world_size: int = 1,
    clip: float = 0.0,
    lr: float = 0.02,
    adam_lr: float = 1e-3,
    momentum: float = 0.95,
    weight_decay: float = 0.0,
    ns_method: str = "gram",
    initial_scale_power: int = 8,
    loss_scale_window: int = 1000,
    hysteresis: int | None = 2,  # None: left out, DeepSpeed's documented default applies
    save_muon_momentum_buffer_in_memory: bool = False,
    sub_group_size: int | None = None,
    extra_zero: dict | None = None,
) -> str:
    """Build the DeepSpeed JSON for one pipeline; keeps the matrix of cases readable."""
    if dtype not in DTYPES or offload not in OFFLOADS or swapper not in SWAPPERS:
        raise ValueError(f"bad pipeline: dtype={dtype} offload={offload} swapper={swapper}")
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["reduce_scatter"] = False  # ZeRO-3 + Muon refuses reduce_scatter (stage3.py:360)
        if save_muon_momentum_buffer_in_memory:
            zero["save_muon_momentum_buffer_in_memory"] = True
        if sub_group_size is not None:
            zero["sub_group_size"] = sub_group_size
    if offload != "none":
        off: dict = {"device": offload}
        if offload == "nvme":
            off["nvme_path"] = NVME_PATH_PLACEHOLDER
            if swapper == "pipelined":
                off["pipeline_read"] = True
                off["pipeline_write"] = True
        zero["offload_optimizer"] = off
    if extra_zero:
        zero.update(extra_zero)
    cfg: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "optimizer": {
            "type": "Muon",
            "params": {
                "lr": lr,
                "muon_lr": lr,
                "adam_lr": adam_lr,
                "momentum": momentum,
                "weight_decay": weight_decay,
                "ns_method": ns_method,
            },
        },
        "zero_optimization": zero,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if offload == "nvme":
        cfg["aio"] = {"block_size": 131072, "queue_depth": 8, "intra_op_parallelism": 1,
                      "single_submit": False, "overlap_events": True}
    if dtype == "fp16":
        fp16 = {"enabled": True, "initial_scale_power": initial_scale_power,
                "loss_scale_window": loss_scale_window, "min_loss_scale": 1}
        if hysteresis is not None:  # left out: DeepSpeed's documented default applies
            fp16["hysteresis"] = hysteresis
        cfg["fp16"] = fp16
    elif dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return canonical_json(cfg)
