"""One optimizer step of Muon-with-auxiliary-Adam under data parallelism, as it SHOULD be computed.

What is specified
-----------------
The step that DeepSpeed 0.19.8 implements across ``runtime/engine.py`` (``backward``, ``step``),
``runtime/zero/stage_1_and_2.py`` (``independent_gradient_partition_epilogue`` ->
``get_flat_partition`` -> ``muon_update``; ``step``; ``scaled_global_norm``;
``unscale_and_clip_grads``; ``_apply_muon_updates_cpu_offload``), ``runtime/zero/stage3.py``
(``_apply_muon_to_accumulated_grads``, ``step``, ``unscale_and_clip_grads``),
``runtime/zero/muon/muon_optimizer.py`` (``MuonWithAuxAdam.step``: ``theta <- theta(1-lr wd) - lr *
update``) and ``runtime/fp16/loss_scaler.py``, reduced to its intended mathematics:

1. ``G_p = (1 / (W * GAS)) * sum_ranks sum_micro g[r][mu][p]`` -- the data-parallel average of the
   accumulated gradient of the *unscaled* loss (true units; DeepSpeed's ``/GAS``, ``*S`` and ``/W``
   cancel except for rounding).
2. Skip test: any non-finite ``G`` (and, for fp16 models, a loss-scaled gradient beyond fp16's range)
   skips the step: only the loss scaler moves (``update_scale(overflow=True)``); weights, Muon
   momentum and Adam ``m, v, t`` are unchanged.
3. Muon parameters: ``M' = beta M + (1-beta) G``, ``U = (1-beta) G + beta M'`` (Nesterov, always on),
   ``O = NS5(U) * sqrt(max(1, rows/cols))`` (per-head / batched / conv rules in
   :func:`oracles.newton_schulz.muon_direction`).
4. Global norm ``N = sqrt(sum_muon ||O_p||^2 + sum_adam ||G_p||^2)`` -- DeepSpeed deliberately clips on
   the Muon *update* (``Conventions.clip_norm_source``); ``k = max(1, (N + 1e-6)/c)`` if ``c > 0``.
5. Loss scaler ``update_scale(overflow=False)``.
6. Muon: ``theta <- theta (1 - lr_mu wd) - lr_mu O / k``. Adam on ``G / k`` (``oracles.adam``), with its
   step count ``t`` advanced only on applied steps.
7. Masters are fp32 storage: rounded to fp32 after the update (``Conventions.round_master_to_fp32``);
   the model weights are the masters rounded to the model dtype.

Inputs
------
``grads[rank][micro][name]``: for every data-parallel rank ``0..W-1`` and micro-batch ``0..GAS-1``, the
gradient of that rank's *unscaled* per-micro-batch loss ``l_{r,mu}`` with respect to the parameter,
as a float64 tensor of the parameter's shape -- i.e. BEFORE DeepSpeed divides the loss by ``GAS`` and
multiplies it by the loss scale, and before any averaging. The oracle applies ``1/GAS`` and ``1/W``
itself. (If you captured DeepSpeed's gradient of ``S * l / GAS``, multiply by ``GAS / S`` first.)
A non-finite entry marks an overflowed backward.

Teacher forcing: :class:`OracleState` is plain data; build it from DeepSpeed's previous fp32 masters,
Muon momentum (convert to the units and dtype ``Conventions`` describes), Adam ``m, v, t`` and scaler
state to check a single step in isolation.

Switches
--------
Every deliberate DeepSpeed convention, and every known DeepSpeed accident, is a named field of
:class:`Conventions`; the defaults are the intended mathematics. :func:`deepspeed_conventions` returns
the combination a given DeepSpeed path actually implements, so that a divergence can be attributed to
a named switch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

import torch

from . import emulate
from .adam import adam_step
from .clipping import clip_coefficient, global_norm
from .layout import deepspeed_uses_muon
from .loss_scaler import LossScalerConfig, LossScalerState, initial_state as scaler_initial_state, update_scale
from .momentum import muon_momentum, round_to
from .newton_schulz import NS_STEPS, muon_direction

MODEL_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_WORK_DTYPES = {"float64": torch.float64, "fp32": torch.float32}
# fp16 rounds a finite value to inf from 65520 (= max 65504 + half an ulp of 32) upwards.
FP16_OVERFLOW = 65520.0
NS_MODES = ("exact", "emulated")


@dataclass(frozen=True)
class ParamSpec:
    """A trainable parameter: ``use_muon`` selects Muon (True) or the auxiliary Adam (False);
    ``num_heads`` requests per-head Muon for a ``[H*hd, in]`` attention projection."""
    name: str
    shape: tuple[int, ...]
    use_muon: bool
    num_heads: Optional[int] = None

    @staticmethod
    def deepspeed_tagged(name: str, shape: Sequence[int], num_heads: Optional[int] = None) -> "ParamSpec":
        """DeepSpeed's automatic tag (``oracles.layout.deepspeed_uses_muon``)."""
        use = deepspeed_uses_muon(name, shape)
        return ParamSpec(name, tuple(shape), use, num_heads if use else None)


@dataclass(frozen=True)
class StepConfig:
    """Hyper-parameters and topology of the step (DeepSpeed defaults where it has them)."""
    params: tuple[ParamSpec, ...]
    muon_lr: float = 0.02
    adam_lr: float = 3e-4
    momentum: float = 0.95
    weight_decay: float = 0.0          # shared by both halves, as in DeepSpeed (no muon_wd / adam_wd)
    adam_weight_decay: Optional[float] = None  # per-group override; None = weight_decay
    ns_method: str = "gram"
    ns_steps: int = NS_STEPS
    # What the device supports decides the Newton-Schulz compute dtype (``emulate.ns_compute_dtype``).
    device_fp16: bool = True
    device_bf16: bool = True
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-10
    adam_w_mode: bool = True
    gradient_clipping: float = 0.0
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    model_dtype: str = "fp32"          # "fp32" | "fp16" | "bf16"
    # The data-parallel all-reduce sums the ranks' model-dtype gradients before dividing by the world size
    # (stage 0 without ``prescale_gradients``, ``engine.py`` ``allreduce_bucket``): the undivided sum can
    # overflow fp16 where no rank's own gradient does (``fp16_overflow``).
    reduction_sums_ranks: bool = False
    loss_scaler: Optional[LossScalerConfig] = None  # None: DeepSpeed's default for model_dtype
    # Per-parameter hyper-parameters where the user's param groups set their own:
    # ((name, (("lr", x), ("momentum", y), ("weight_decay", z), ("ns_method", m))), ...); anything a
    # parameter's entry leaves out is the half's value above (muon_lr/adam_lr, momentum, ...).
    param_hyper: tuple = ()

    def hyper(self, spec: "ParamSpec") -> dict:
        """lr, momentum, weight_decay, ns_method of one parameter (its half's, then its own entry)."""
        wd_adam = self.weight_decay if self.adam_weight_decay is None else self.adam_weight_decay
        out = ({"lr": self.muon_lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "ns_method": self.ns_method} if spec.use_muon else {"lr": self.adam_lr, "weight_decay": wd_adam})
        for name, items in self.param_hyper:
            if name == spec.name:
                out.update({k: v for k, v in items if k in out})
        return out

    def __post_init__(self):
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(f"model_dtype must be one of {tuple(MODEL_DTYPES)}")
        if self.ns_method not in ("gram", "standard"):
            raise ValueError("ns_method must be 'gram' or 'standard'")
        object.__setattr__(self, "params", tuple(self.params))
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError("parameter names must be unique")
        if self.loss_scaler is None:
            object.__setattr__(self, "loss_scaler", LossScalerConfig.for_model_dtype(self.model_dtype))

    def spec(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


@dataclass(frozen=True)
class Conventions:
    """Named choices. Defaults = the intended mathematics. Each field names the DeepSpeed code it models.

    clip_norm_source: ``"muon_update"`` (default; DeepSpeed's deliberate choice,
        ``stage_1_and_2.py`` ``scaled_global_norm`` / ``stage3.py`` ``_get_norm_groups``: the norm is over
        each Muon parameter's update ``O`` and each Adam parameter's gradient, and ``1/k`` scales both
        the Muon step and Adam's gradient) or ``"gradient"`` (the textbook rule, and what
        ``runtime/bf16_optimizer.py`` ``BF16_Optimizer.step`` does: the norm of all raw gradients, the
        gradients are divided by ``k`` *before* Muon's momentum, and ``O`` itself is not rescaled).
        That Adam is clipped by the combined norm follows from the source.
    scale_update_before_unscale: accident (``stage_1_and_2.py`` ``step``: ``_update_scale`` runs before
        ``unscale_and_clip_grads``; ``stage3.py`` ``step``: ``_loss_scale_update_and_overflow_cleanup``
        first). On a growth step ``S' = 2S`` the Adam gradient and the clip norm are divided by
        ``S'`` instead of ``S`` (halved). Default False.
    muon_update_in_old_scale: accident of the cpu/nvme offload paths
        (``stage_1_and_2.py`` ``_apply_muon_updates_cpu_offload``, ``stage3.py`` same name): ``S*O`` is
        formed with the old scale and divided by the new one, so the Muon step is multiplied by
        ``S/S'``. Only acts together with ``scale_update_before_unscale``. Default False.
    muon_in_new_scale: accident of a ZeRO-1/2 offload path that runs Muon after the scale update
        (DeepSpeed PR #8464's ``_apply_muon_updates_cpu_offload``, called after ``_update_scale``): on a
        growth step Muon's gradient is divided by the new scale ``S'`` (it reads ``G S / S'``) and its update is
        stored times ``S'``, so the step itself is unharmed but the norm counts the Muon update as
        ``O S' / S``. The gradient Muon reads is the caller's (``oracles.replay.stepped_gradients``); ``step``
        reads this field for the norm. Only acts together with ``scale_update_before_unscale``. Default False.
    momentum_units: ``"true"`` (default) or ``"scaled"`` -- accident of the non-offload paths
        (``stage_1_and_2.py`` ``get_flat_partition`` -> ``muon_update`` on the loss-scaled gradient;
        ``stage3.py`` ``_muon_update_sub_group``): the momentum accumulates ``S * G``, so a change of
        ``S`` re-weights history against the new gradient. The state's momentum is then in scaled
        units too.
    momentum_dtype: where the Muon momentum, and the gradient and ``U`` fed to it, are stored:
        ``"float64"`` (default, the oracle), ``"fp32"`` (ZeRO-1/2 offload), ``"model"`` (accident of
        ZeRO-1/2 non-offload and ZeRO-3, ``stage_1_and_2.py`` docstring near ``_muon_momentum_buffer``,
        ``stage3.py`` ``_create_momentum_buffer``: fp16/bf16 momentum for half models).
    fused_blend: False (default) or True -- how ``torch.compile`` evaluates a 16-bit Muon state
        (``momentum_dtype="model"``): inductor fuses ``muon_update``'s two lerps into Newton-Schulz's
        normalisation at fp32 or wider, so the Nesterov blend ``U`` reads the new momentum before it is
        rounded into its 16-bit buffer and is never rounded itself; only the stored momentum is (measured:
        compiled ZeRO-1/2/3 fp16/bf16 with float64 Newton-Schulz, ``U`` from float64 blends reproduces
        DeepSpeed's update bit for bit, a rounded ``U`` misses it by a 16-bit ulp in most elements). Read
        outside emulation only (``emulate`` follows eager's rounding points).
    grad_dtype: the dtype the averaged accumulated gradient is stored in (in DeepSpeed's units, i.e.
        multiplied by ``S``) before the optimizer reads it: ``"float64"`` (default), ``"fp32"``, or
        ``"model"`` (DeepSpeed's default ``communication_data_type`` / ``gradient_accumulation_dtype``,
        ``engine.py``, both the model dtype). One rounding models the storage; the rounding of the
        reduction's partial sums is left to the tolerance model.
    round_master_to_fp32: the masters are fp32 storage (all ZeRO paths), so the oracle rounds them to
        fp32 after each update. Default True; False keeps float64 masters (pure mathematics).
    skip_on_nonfinite: ``"always"`` (default: a non-finite averaged gradient never reaches the weights;
        ZeRO-1/2 behaviour for every dtype via ``has_overflow`` / the invalid-norm test) or
        ``"fp16_only"`` (``stage3.py`` ``_overflow_check_and_loss_scale_update`` checks the raw gradients
        only for fp16 models). With ``"fp16_only"`` the non-finite gradient reaches Muon and the norm, and
        the step is skipped by the second (invalid-norm) test instead, as in ZeRO-3: only
        ``StepRecord.skip_reason`` differs ("nonfinite_norm").
    detect_fp16_overflow: for fp16 models, also treat ``|S * g / GAS|`` of any per-micro-batch gradient,
        or of the running accumulated sum, reaching fp16's overflow threshold as an overflow -- what
        DeepSpeed's fp16 backward/accumulation turns into inf. Default True (it is a necessary, not a
        sufficient, condition: activations can overflow too, which the caller marks with inf).
    honor_num_heads: per-head Muon requested by ``ParamSpec.num_heads`` is applied (default). False models
        the paths that silently drop it (``stage_1_and_2.py`` ``get_flat_partition`` with
        ``parameter_alignment``; ``muon_optimizer.py`` without ZeRO; ``bf16_optimizer.py``).
    conv_aspect: 4-D kernels: ``"reshaped"`` (default, the aspect scale of the orthogonalised
        ``(out, in*kh*kw)`` matrix) or ``"last_two_dims"`` (Keller's inherited ``s(kh, kw)``).
    reported_norm: what ``get_global_grad_norm()`` returns: ``"norm"`` (default, the norm in true units),
        ``"clip_norm"`` (accident of ``stage3.py`` ``step``: the norm divided by the scale *after*
        ``update_scale``, so halved on a growth step; DSM-003) or ``"raw"`` (``fp16/unfused_optimizer.py``
        ``step``: the norm of the gradients as the backward left them, i.e. times the backward's loss
        scale; DSM-016).
    scaled_update_dtype: where the offload paths form the loss-scaled Muon update ``S*O`` before
        unscaling: ``"float64"`` (default: exact) or ``"model"`` (accident of ZeRO-3 cpu/nvme offload,
        ``stage3.py`` ``_apply_muon_updates_cpu_offload``: in gradient_accumulation_dtype, so an fp16
        ``S*O`` beyond 65504 is inf, the norm is invalid and the step is skipped with the Muon momentum
        already advanced; DSM-005).
    padded_tail_momentum_dtype: ``None`` (default) or a storage dtype (``"fp16"``/``"bf16"``): accident of
        ZeRO-3 without offload (``stage3.py`` ``_muon_update_sub_group``): the rank whose partition of a
        Muon matrix holds the padded tail writes its momentum slice through a buffer of
        gradient_accumulation_dtype, so that slice alone (flat elements ``r*ceil(n/W)`` to ``n``) is rounded
        to it after every step (DSM-009).
    update_store_dtype: ``None`` (default) or a storage dtype (``"fp16"``/``"bf16"``): accident of ZeRO-3
        without offload (``stage3.py`` ``_apply_muon_to_accumulated_grads``): Newton-Schulz runs on the
        gradient gathered in communication_data_type, but its update ``O`` is copied back into the
        gradient partition, which is gradient_accumulation_dtype; with communication_data_type fp32 over
        a 16-bit partition ``O`` is rounded to 16 bit there, before the norm and the step read it (DSM-001).
    warmup_step_at_init: accident of stage 0 in fp16/bf16 (``fp16/unfused_optimizer.py``
        ``initialize_optimizer_states``): at initialize the inner MuonWithAuxAdam steps once on zero
        gradients, without the loss scaler: Adam's step count starts at 1 (the first real step is
        bias-corrected as step 2), and each half's decoupled weight decay (AdamW's, Muon's) shrinks the
        fp32 masters once; the model weights are not refreshed until the first real step (DSM-014).
        Applied by :func:`initial_state`.
    backward_loss_scaled: True (default) or False -- accident of stage-0 fp16 (``engine.py`` ``backward``
        scales the loss only for a ZeRO optimizer; ``fp16/unfused_optimizer.py`` ``unscale_and_clip_grads``
        divides by ``S`` anyway): the backward runs on the raw loss, so the fp16 overflow test sees the
        raw gradients, the optimizer reads ``G / S`` and the clip coefficient comes from ``||G|| / S``
        (DSM-015).
    muon_update_unscaled: False (default) or True -- accident of DeepSpeed before 0.19.8 (0.19.7
        ``stage_1_and_2.py`` ``get_flat_partition``, ``stage3.py`` ``_apply_distributed_muon_update``; 0.19.8
        added ``groups_lacking_loss_scale``): the Muon update ``O`` is written where the loss-scaled
        gradient was, without the factor ``S``, and the step divides everything by ``S`` (``S'`` under
        ``scale_update_before_unscale``): the Muon step is ``O / S`` and the clip norm counts ``O / S``
        for each Muon parameter (DSM-108).
    muon_as_sgd: False (default) or True -- accident of DeepSpeed before 0.19.7 where no ZeRO optimizer runs
        Muon before ``MuonWithAuxAdam.step`` (0.19.6 ``muon_optimizer.py`` ``step``: stage 0, and the
        BF16_Optimizer route, whose param groups are flat fp32 partitions): each Muon matrix is moved by
        ``lr`` times the gradient the step reads (after a clip before the step, where one is taken:
        ``clip_norm_source="gradient"``), with the group's
        decoupled weight decay: no momentum (it stays as it was), no Newton-Schulz, no ``muon_update``
        call (DSM-114).
    gram_input_dtype: ``None`` (default) or ``"fp16"`` -- accident of the gram iteration before 0.19.8
        (0.19.0-0.19.7 ``original_muon.py`` ``zeropower_via_gram_newtonschulz``: ``X = G.to(compute_dtype)``,
        then ``X / (||X|| + 1e-7)``; 0.19.8 normalises first): the Nesterov blend ``U`` a gram-method Muon
        matrix feeds Newton-Schulz is rounded to fp16 *before* the normalisation, in fp16's range: entries
        below half its smallest subnormal (2^-25) flush to zero, subnormal ones (below 2^-14) keep fewer
        bits, and a matrix wholly below 2^-25 comes back as a zero update (DSM-119). Standard-method matrices
        are untouched (their bf16 cast keeps fp32's range).
    warmup_peak: ``"own"`` (default: a ``WarmupLR`` without ``warmup_max_lr`` warms each param group up
        to its own lr) or ``"first_group"`` -- accident of 0.19.3 (``lr_schedules.py`` ``WarmupLR.__init__``
        keeps only the first group's lr of the list it builds): every group warms up to the lr of
        DeepSpeed's first param group, so the Adam half follows Muon's lr (DSM-121). Read by the caller
        that computes the scheduled lrs (``oracles.schedules.group_lr``'s ``default_peak``).
    adam_l2_decoupled: False (default) or True -- accident of the CPU build of FusedAdam before 0.19.6
        (``csrc/cpu/adam/fused_adam.cpp``: one optimizer made at first use in AdamW mode, the ``mode`` argument
        never read): an Adam asked for L2 weight decay (``adam_w_mode`` false) decays decoupled, as AdamW
        (DSM-124).
    muon_momentum_lost_after: ``None`` (default) or a step count ``k``: accident of a ZeRO-3 resume with
        ``save_muon_momentum_buffer_in_memory`` (``stage3.py`` ``_rigid_load_state_dict`` restores the
        optimizer state's momentum tensor, but the update reads the in-memory buffer, which nothing
        relinks): the run resumed after step ``k`` starts step ``k + 1`` from zero Muon momentum (DSM-007).
    fresh_after / fresh_params: accident of a ZeRO-3 NVMe resume (``engine.py`` ``load_checkpoint`` copies
        only the swap files back): after step ``fresh_after`` the parameters of ``fresh_params`` (the
        sub-groups below the swap threshold) hold the fresh engine's masters, model weights and optimizer
        state (zero momentum and moments), Adam's step count restarts where every Adam parameter is among
        them, and the loss scaler restarts (DSM-010). What a fresh engine holds is the caller's to supply
        (its initial weights are the harness's choice): :func:`fresh_engine_state` builds the state, and
        ``step`` itself does not read these two fields.
    """
    clip_norm_source: str = "muon_update"
    scale_update_before_unscale: bool = False
    muon_update_in_old_scale: bool = False
    muon_in_new_scale: bool = False
    momentum_units: str = "true"
    momentum_dtype: str = "float64"
    grad_dtype: str = "float64"
    round_master_to_fp32: bool = True
    skip_on_nonfinite: str = "always"
    detect_fp16_overflow: bool = True
    honor_num_heads: bool = True
    conv_aspect: str = "reshaped"
    reported_norm: str = "norm"
    scaled_update_dtype: str = "float64"
    padded_tail_momentum_dtype: Optional[str] = None
    update_store_dtype: Optional[str] = None
    warmup_step_at_init: bool = False
    backward_loss_scaled: bool = True
    muon_momentum_lost_after: Optional[int] = None
    muon_update_unscaled: bool = False
    muon_as_sgd: bool = False
    gram_input_dtype: Optional[str] = None
    warmup_peak: str = "own"
    adam_l2_decoupled: bool = False
    # Accident of ZeRO-2 + bf16 + grad_accum_dtype fp32 at one data-parallel rank (DSM-019): every
    # non-Muon parameter's gradient is lost before the step, so the auxiliary Adam reads zeros.
    adam_grads_lost: bool = False
    # Accident of ZeRO-3 and of ZeRO-1/2 with optimizer offload (DSM-023): a parameter that gets no
    # gradient in a step (``Case.unused``) is stepped on what its gradient buffer still holds from the
    # step before, where the intended gradient is zero: the auxiliary Adam's parameter on that step's
    # gradient, a Muon matrix on that step's update (written over its gradient). The previous step is
    # the caller's record: ``step`` itself does not read this field (the verdict does). Its values say what
    # the reported norm counts of such a parameter: "norm-counts" (ZeRO-3 without offload: the stale
    # gradient, like any other) or "norm-drops-adam" (the offload paths: an Adam parameter's term is missing,
    # a Muon matrix's is its new update as usual). None: the intended zero gradient.
    stale_unused_grads: Optional[str] = None
    # Parameters whose term the global norm leaves out at this step (set per step by the caller, e.g. from
    # ``stale_unused_grads``); the step itself still uses their gradients.
    norm_excluded: frozenset = frozenset()
    fresh_after: Optional[int] = None
    fresh_params: tuple = ()
    # Accident of ZeRO-3 without offload (DSM-006, ``stage3.py`` ``_create_fp16_partitions_with_
    # defragmentation``): one ns_method, the last Muon group's, for every Muon parameter. None: each
    # parameter's own (its group's, else the config's).
    muon_ns_method: Optional[str] = None
    # Accident of ZeRO-3 with a bf16 model (DSM-025): a step skipped by the invalid-norm test (the second
    # one, after Muon ran; with ``skip_on_nonfinite="fp16_only"`` the only one a bf16 non-finite gradient
    # meets) keeps the Muon momentum Muon wrote: every matrix with a finite gradient advances (Muon leaves
    # a matrix with a non-finite one as it was). False: the skip leaves every momentum as it was.
    momentum_committed_on_invalid_norm: bool = False
    # Accident of fp16 without ZeRO (DSM-026, ``fp16/unfused_optimizer.py`` ``_update_scale``): the dynamic
    # scaler runs with this hysteresis whatever the config says (1: every overflow halves). None: the
    # configured one (``StepConfig.loss_scaler``).
    loss_scaler_hysteresis: Optional[int] = None
    fused_blend: bool = False
    # Accident of ZeRO-1/2 with optimizer offload, a 16-bit model and fp32 gradient accumulation (DSM-029):
    # a skipped step leaves the auxiliary Adam's accumulated gradients in place, so the next step's Adam
    # gradient adds every skipped step's since the last applied one (``oracles.replay.with_carried``).
    adam_grads_kept_on_skip: bool = False

    def __post_init__(self):
        checks = {"reported_norm": ("norm", "clip_norm", "raw"), "scaled_update_dtype": ("float64", "model"),
                  "padded_tail_momentum_dtype": (None, "fp16", "bf16"),
                  "update_store_dtype": (None, "fp16", "bf16"), "gram_input_dtype": (None, "fp16"),
                  "muon_ns_method": (None, "gram", "standard"),
                  "clip_norm_source": ("muon_update", "gradient"), "momentum_units": ("true", "scaled"),
                  "momentum_dtype": ("float64", "fp32", "model"), "grad_dtype": ("float64", "fp32", "model"),
                  "skip_on_nonfinite": ("always", "fp16_only"), "warmup_peak": ("own", "first_group"),
                  "conv_aspect": ("reshaped", "last_two_dims"),
                  "stale_unused_grads": (None, "norm-counts", "norm-drops-adam")}
        for name, allowed in checks.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"Conventions.{name} must be one of {allowed}, got {getattr(self, name)!r}")


def deepspeed_conventions(stage: int, offload: bool, model_dtype: str, *,
                          parameter_alignment: bool = False) -> Conventions:
    """The conventions DeepSpeed 0.19.8 actually implements on a path
    (docs/deepspeed-0.19.8.md sections 5-8, 13).

    Not modelled: ZeRO-3 offload's fp16 ``g/S`` underflow and ``S*O`` overflow (doc 10.3), ZeRO-3's
    momentum commit on an invalid-norm skip (doc 10.4), the BF16_Optimizer path (bf16 +
    ``grad_accum_dtype=fp32`` + ZeRO-1; use ``clip_norm_source="gradient"``).
    """
    if stage not in (1, 2, 3):
        raise ValueError("stage must be 1, 2 or 3")
    zero12 = stage in (1, 2)
    return Conventions(
        clip_norm_source="muon_update",
        scale_update_before_unscale=True,
        muon_update_in_old_scale=offload,
        momentum_units="true" if offload else "scaled",
        momentum_dtype="fp32" if (offload and zero12) else "model",
        # the averaged gradient passes through communication_data_type, which defaults to the model
        # dtype on every path (engine.py); offload only gathers it into fp32 afterwards
        grad_dtype="model",
        round_master_to_fp32=True,
        skip_on_nonfinite="always" if zero12 else "fp16_only",
        detect_fp16_overflow=True,
        honor_num_heads=not (zero12 and parameter_alignment and not offload),
        conv_aspect="last_two_dims",
        reported_norm="clip_norm" if stage == 3 else "norm",
    )


@dataclass(frozen=True)
class OracleState:
    """Everything a step reads and writes. Tensors are float64 (holding fp32 values when rounded).

    ``momentum`` is in the units/dtype of ``Conventions.momentum_units``/``momentum_dtype``. The
    mappings are never mutated by :func:`step`; it returns a new state.
    """
    master: Mapping[str, torch.Tensor]
    momentum: Mapping[str, torch.Tensor]   # Muon params only
    adam_m: Mapping[str, torch.Tensor]     # Adam params only
    adam_v: Mapping[str, torch.Tensor]
    adam_step: int
    scaler: LossScalerState
    step_count: int = 0     # optimizer steps taken, skipped ones included (DeepSpeed global_steps)
    skipped_steps: int = 0


@dataclass(frozen=True)
class ParamRecord:
    name: str
    use_muon: bool
    grad: torch.Tensor                    # averaged accumulated gradient, true units, float64
    momentum: Optional[torch.Tensor]      # Muon momentum after the step (state units); None for Adam
    direction: Optional[torch.Tensor]     # Muon O (NS * aspect), or Adam m_hat/(sqrt(v_hat)+eps); None if skipped
    update: torch.Tensor                  # change applied to the master, before its fp32 rounding
    master: torch.Tensor                  # master after the step
    model: torch.Tensor                   # model-dtype weights after the step (as float64)
    adam_m: Optional[torch.Tensor] = None
    adam_v: Optional[torch.Tensor] = None
    # a Muon master as the implementation's own update (``step(norm_directions=...)``) and the clip
    # coefficient of its own norm should have left it; None when no update was given
    master_own: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class StepRecord:
    skipped: bool
    # "nonfinite_grad" | "fp16_overflow" | "nonfinite_norm" | "update_overflow" | None
    skip_reason: Optional[str]
    loss_scale_used: float                # S of this step's backward
    loss_scale_after: float               # S after update_scale
    global_norm: Optional[float]          # true units, of the vectors clip_norm_source names
    clip_norm: Optional[float]            # the value that entered k (differs only on growth steps when
                                          # scale_update_before_unscale)
    clip_coef: float                      # k >= 1; 1 when clipping is off or the step was skipped
    params: Mapping[str, ParamRecord] = field(default_factory=dict)
    reported_norm: Optional[float] = None  # what get_global_grad_norm() returns (Conventions.reported_norm)
    # the same, taken over the implementation's own Muon updates (``step(norm_directions=...)``); None
    # when they were not given or the norm is another run's (``shared_norm``)
    reported_norm_own: Optional[float] = None


def _model_torch_dtype(cfg: StepConfig) -> torch.dtype:
    return MODEL_DTYPES[cfg.model_dtype]


def _resolve_dtype(choice: str, cfg: StepConfig) -> torch.dtype:
    return _model_torch_dtype(cfg) if choice == "model" else _WORK_DTYPES[choice]


def round_master(t: torch.Tensor, conv: Conventions) -> torch.Tensor:
    return round_to(t, torch.float32) if conv.round_master_to_fp32 else t.to(torch.float64)


def initial_state(cfg: StepConfig, weights: Mapping[str, torch.Tensor],
                  conv: Conventions = Conventions()) -> OracleState:
    """State before the first step. For fp16/bf16 models the fp32 masters start as the *rounded*
    initial weights (DeepSpeed converts the module to half before copying the masters: doc 4.5)."""
    lp = _model_torch_dtype(cfg)
    master, mom, am, av = {}, {}, {}, {}
    for spec in cfg.params:
        w = weights[spec.name].to(torch.float64)
        if tuple(w.shape) != tuple(spec.shape):
            raise ValueError(f"{spec.name}: weight shape {tuple(w.shape)} != spec {spec.shape}")
        master[spec.name] = round_master(round_to(w, lp), conv)
        zeros = torch.zeros(spec.shape, dtype=torch.float64)
        if spec.use_muon:
            mom[spec.name] = zeros
        else:
            am[spec.name] = zeros
            av[spec.name] = zeros.clone()
    state = OracleState(master, mom, am, av, 0, scaler_initial_state(cfg.loss_scaler))
    return _warmup_step(state, cfg, conv) if conv.warmup_step_at_init else state


def fresh_engine_state(state: OracleState, cfg: StepConfig, fresh_weights: Mapping[str, torch.Tensor],
                       conv: Conventions) -> OracleState:
    """``state`` with the parameters of ``conv.fresh_params`` replaced by what a fresh engine built on
    ``fresh_weights`` holds before its first step (``Conventions.fresh_after``): masters from the rounded
    weights, zero Muon momentum and Adam moments; Adam's step count 0 when every Adam parameter is fresh
    (else a ValueError: one count cannot hold two histories); a fresh loss scaler."""
    names = set(conv.fresh_params)
    adam = {p.name for p in cfg.params if not p.use_muon}
    if adam & names and not adam <= names:
        raise ValueError(f"a fresh Adam state for {sorted(adam & names)} only: Adam's single step count "
                         "cannot model part of the Adam parameters restarting")
    new = initial_state(cfg, {n: fresh_weights[n] if n in names else state.master[n] for n in state.master},
                        replace(conv, warmup_step_at_init=False))
    pick = lambda old, fresh: {n: (fresh[n] if n in names else t) for n, t in old.items()}  # noqa: E731
    return replace(state, master=pick(state.master, new.master), momentum=pick(state.momentum, new.momentum),
                   adam_m=pick(state.adam_m, new.adam_m), adam_v=pick(state.adam_v, new.adam_v),
                   adam_step=0 if (adam and adam <= names) else state.adam_step, scaler=new.scaler)


def _warmup_step(state: OracleState, cfg: StepConfig, conv: Conventions) -> OracleState:
    """The inner optimizer's step on zero gradients at initialize (``Conventions.warmup_step_at_init``):
    Muon's momentum and direction stay zero, so only its decoupled decay acts; Adam takes a full step on
    a zero gradient (``t = 1``; its L2 decay, if any, feeds ``m, v``). No loss-scaler step, no applied
    optimizer step counted."""
    master, am, av = dict(state.master), dict(state.adam_m), dict(state.adam_v)
    for spec in cfg.params:
        n, hp = spec.name, cfg.hyper(spec)
        theta = state.master[n].to(torch.float64)
        if spec.use_muon:
            master[n] = round_master(theta * (1.0 - hp["lr"] * hp["weight_decay"]), conv)
            continue
        res = adam_step(theta, torch.zeros_like(theta), state.adam_m[n], state.adam_v[n], 1, lr=hp["lr"],
                        betas=cfg.betas, eps=cfg.eps, weight_decay=hp["weight_decay"],
                        adam_w_mode=cfg.adam_w_mode or conv.adam_l2_decoupled)
        master[n], am[n], av[n] = round_master(res.theta, conv), res.m, res.v
    return replace(state, master=master, adam_m=am, adam_v=av, adam_step=1)


def accumulate(grads: Sequence[Sequence[Mapping[str, torch.Tensor]]], cfg: StepConfig) -> dict[str, torch.Tensor]:
    """``G_p = sum_r sum_mu g[r][mu][p] / (W * GAS)`` in float64 (one division at the end)."""
    W, GAS = cfg.world_size, cfg.gradient_accumulation_steps
    if len(grads) != W:
        raise ValueError(f"expected gradients for {W} ranks, got {len(grads)}")
    out = {}
    for spec in cfg.params:
        total = torch.zeros(spec.shape, dtype=torch.float64)
        for r in range(W):
            if len(grads[r]) != GAS:
                raise ValueError(f"rank {r}: expected {GAS} micro-batches, got {len(grads[r])}")
            for mu in range(GAS):
                g = grads[r][mu][spec.name]
                if tuple(g.shape) != tuple(spec.shape):
                    raise ValueError(f"{spec.name}: gradient shape {tuple(g.shape)} != {spec.shape}")
                total = total + g.to(torch.float64)
        out[spec.name] = total / (W * GAS)
    return out


def fp16_overflow(grads, cfg: StepConfig, scale: float) -> bool:
    """Does any loss-scaled per-micro gradient ``S g / GAS``, or the running accumulated average, reach
    fp16's overflow threshold? Models the pre-divided reduction (``reduce_scatter``: each rank's term
    is divided by ``W`` before summing); where the reduction sums first (``StepConfig.reduction_sums_ranks``:
    each rank accumulates its micro-batches, then the ranks' sums are added before the division), also the
    undivided sum of the ranks' accumulated gradients."""
    W, GAS = cfg.world_size, cfg.gradient_accumulation_steps
    for spec in cfg.params:
        running = torch.zeros(spec.shape, dtype=torch.float64)
        local = [torch.zeros(spec.shape, dtype=torch.float64) for _ in range(W)]
        for mu in range(GAS):
            step_avg = torch.zeros(spec.shape, dtype=torch.float64)
            for r in range(W):
                term = grads[r][mu][spec.name].to(torch.float64) * (scale / GAS)
                if bool((term.abs() >= FP16_OVERFLOW).any()):
                    return True
                step_avg = step_avg + term / W
                local[r] = local[r] + term
            running = running + step_avg
            if bool((running.abs() >= FP16_OVERFLOW).any()):
                return True
        if cfg.reduction_sums_ranks and bool((sum(local).abs() >= FP16_OVERFLOW).any()):
            return True
    return False


def _skip(state: OracleState, cfg: StepConfig, conv: Conventions, G: Mapping[str, torch.Tensor],
          reason: str, momentum: Optional[Mapping[str, torch.Tensor]] = None) -> tuple[OracleState, StepRecord]:
    """A skipped step; ``momentum``: Muon momentum a path commits although it skips (DSM-005)."""
    scaler = update_scale(state.scaler, True, cfg.loss_scaler)
    lp = _model_torch_dtype(cfg)
    moms = {**state.momentum, **(momentum or {})}
    recs = {}
    for spec in cfg.params:
        n = spec.name
        recs[n] = ParamRecord(n, spec.use_muon, G[n], moms.get(n), None,
                              torch.zeros(spec.shape, dtype=torch.float64), state.master[n],
                              round_to(state.master[n], lp), state.adam_m.get(n), state.adam_v.get(n))
    new = replace(state, momentum=moms, scaler=scaler, step_count=state.step_count + 1,
                  skipped_steps=state.skipped_steps + 1)
    return new, StepRecord(True, reason, state.scaler.scale, scaler.scale, None, None, 1.0, recs)


def step(state: OracleState, grads: Sequence[Sequence[Mapping[str, torch.Tensor]]], cfg: StepConfig,
         conv: Conventions = Conventions(), ns_mode: str = "exact",
         forced_clip_coef: Optional[float] = None,
         shared_norm: Optional[float] = None,
         norm_directions: Optional[Mapping[str, torch.Tensor]] = None) -> tuple[OracleState, StepRecord]:
    """One optimizer step. ``ns_mode``: ``"exact"`` (float64 Newton-Schulz) or ``"emulated"``
    (:mod:`oracles.emulate`: DeepSpeed's 16-bit iteration with its rounding points; when
    ``momentum_dtype`` is a storage dtype the momentum lerps are then also evaluated as DeepSpeed
    does, with ``torch.lerp`` in that dtype). Raises :class:`oracles.loss_scaler.LossScaleAtMinimum`
    where DeepSpeed would.

    ``forced_clip_coef``: teacher forcing of the clip coefficient where the clip acts before Muon
    (``clip_norm_source="gradient"``): the ``k`` the implementation applied, from its own norm (which
    the caller checks against this step's). Newton-Schulz then reads exactly the clipped gradient the
    implementation fed it; a ``k`` re-derived from a norm a few roundings apart would move that 16-bit
    input by an ulp, and the emulated iteration amplifies one flipped rounding far beyond its
    allowance. None: ``k`` from this step's norm.

    ``shared_norm``: the global norm (true units, before the scale-update ratio) as another run of the
    same step computed it, used for the clip, the non-finite-norm skip and the reported norm instead of
    this run's own: a model-parallel replica's, where DeepSpeed counts a parameter without
    model-parallel attributes only on model-parallel rank 0 (docs/deepspeed-0.19.8.md section 14).
    None: this run's norm.

    ``norm_directions``: teacher forcing of the reported norm and of the Muon masters: the Muon updates
    the implementation itself computed (every Muon parameter's). The record's ``reported_norm_own`` is
    then the norm ``get_global_grad_norm()`` should report given those updates, by the same rule and
    units as ``reported_norm``, and each Muon ``ParamRecord.master_own`` the master those updates and
    that norm's clip coefficient should give: the step's arithmetic (lr, weight decay, clip) judged
    without Newton-Schulz's error in it. The norm over the oracle's own directions inherits Newton-Schulz's allowance
    (rtol up to ~10 where the iteration is not emulated bit for bit, e.g. compiled), wide enough to
    hide a norm taken over the wrong vectors; over the implementation's own updates only its norm
    arithmetic is left to allow for. (Where the clip acts before Muon the norm is over the fed
    gradients already, and the two coincide.)"""
    if ns_mode not in NS_MODES:
        raise ValueError(f"ns_mode must be one of {NS_MODES}")
    if conv.loss_scaler_hysteresis is not None and cfg.loss_scaler is not None:
        cfg = replace(cfg, loss_scaler=replace(cfg.loss_scaler, hysteresis=conv.loss_scaler_hysteresis))
    if conv.muon_momentum_lost_after is not None and state.step_count == conv.muon_momentum_lost_after:
        state = replace(state, momentum={n: torch.zeros_like(m) for n, m in state.momentum.items()})
    G = accumulate(grads, cfg)
    reason = _raw_skip_reason(G, grads, cfg, conv, float(state.scaler.scale))
    if reason is not None:
        return _skip(state, cfg, conv, G, reason)
    Gs, read = _gradient_read(G, cfg, conv, float(state.scaler.scale))
    # -- 3. textbook clipping happens before Muon (clip_norm_source="gradient") -------------------
    pre_k, norm = 1.0, None
    if conv.clip_norm_source == "gradient":
        # the growth-step accident divides by S' where S was meant
        grow = scale_ratio(state, cfg, conv)
        norm = global_norm(_raw_norm_terms(Gs, cfg, conv, grow)) if shared_norm is None else shared_norm
        pre_k = clip_coefficient(norm * grow, cfg.gradient_clipping) if forced_clip_coef is None else forced_clip_coef
    new_mom, directions = _muon_directions(state, cfg, conv, Gs, pre_k, ns_mode)
    S = float(state.scaler.scale)
    if (conv.scaled_update_dtype == "model" and cfg.model_dtype == "fp16"
            and any(bool((d.abs() * S >= FP16_OVERFLOW).any()) for d in directions.values())):
        return _skip(state, cfg, conv, G, "update_overflow", momentum=new_mom)
    clip = _norm_and_clip(state, cfg, conv, Gs, directions, norm, pre_k, shared_norm, norm_directions)
    if clip is None:
        # what Muon wrote: muon_update keeps the momentum of a matrix whose gradient is not finite
        wrote = {n: m for n, m in new_mom.items() if bool(torch.isfinite(Gs[n]).all())}
        return _skip(state, cfg, conv, G, "nonfinite_norm",
                     momentum=wrote if conv.momentum_committed_on_invalid_norm else None)
    new_state, recs = _apply(state, cfg, conv, G, Gs, new_mom, directions, clip, norm_directions)
    backward_scale = S if conv.backward_loss_scaled else 1.0

    def as_reported(n: float) -> float:
        return {"norm": n, "clip_norm": n * clip.ratio, "raw": n / read * backward_scale}[conv.reported_norm]

    return new_state, StepRecord(False, None, S, clip.scaler.scale, clip.norm, clip.clip_norm, clip.k, recs,
                                 as_reported(clip.norm), None if clip.own is None else as_reported(clip.own))


def _raw_skip_reason(G: Mapping[str, torch.Tensor], grads, cfg: StepConfig, conv: Conventions,
                     S: float) -> Optional[str]:
    """-- 1. the skip test on the raw gradients: why the step is skipped before anything reads them."""
    nonfinite = any(not bool(torch.isfinite(g).all()) for g in G.values())
    if nonfinite and (conv.skip_on_nonfinite == "always" or cfg.model_dtype == "fp16"):
        return "nonfinite_grad"
    backward_scale = S if conv.backward_loss_scaled else 1.0
    if cfg.model_dtype == "fp16" and conv.detect_fp16_overflow and fp16_overflow(grads, cfg, backward_scale):
        return "fp16_overflow"
    return None


def _raw_norm_terms(Gs: Mapping[str, torch.Tensor], cfg: StepConfig, conv: Conventions, grow: float) -> list:
    """The gradients a clip before Muon takes its norm over: as read, except that a Muon matrix read in the
    grown scale (``muon_in_new_scale``: ``G S / S'``) entered that norm before the unscale, at ``G``."""
    if not conv.muon_in_new_scale or grow == 1.0:
        return list(Gs.values())
    muon = {p.name for p in cfg.params if p.use_muon}
    return [g / grow if n in muon else g for n, g in Gs.items()]


def _gradient_read(G: Mapping[str, torch.Tensor], cfg: StepConfig, conv: Conventions,
                   S: float) -> tuple[dict[str, torch.Tensor], float]:
    """-- 2. the gradient the optimizer reads (storage rounding in DeepSpeed's x S units), and the factor
    the read carries: a raw-loss backward divided by S anyway (DSM-015) reads G / S, norms included."""
    backward_scale = S if conv.backward_loss_scaled else 1.0
    gdt = _resolve_dtype(conv.grad_dtype, cfg)
    Gs = {n: (round_to(g * backward_scale, gdt) / backward_scale if gdt != torch.float64 else g) for n, g in G.items()}
    read = 1.0 if conv.backward_loss_scaled else 1.0 / S
    return {n: g * read for n, g in Gs.items()}, read


def _muon_directions(state: OracleState, cfg: StepConfig, conv: Conventions, Gs: Mapping[str, torch.Tensor],
                     pre_k: float, ns_mode: str) -> tuple[dict, dict]:
    """-- 4. each Muon parameter's new momentum and direction ``O`` (in the step's order)."""
    new_mom, directions = {}, {}
    for spec in cfg.params:
        if not spec.use_muon:
            continue
        n = spec.name
        if conv.muon_as_sgd:  # the (clipped) gradient is the step's direction; the momentum is untouched
            new_mom[n], directions[n] = state.momentum[n].to(torch.float64), Gs[n] / pre_k
            continue
        new_mom[n], directions[n] = _muon_direction(state, cfg, conv, spec, Gs[n] / pre_k, ns_mode)
    return new_mom, directions


def _muon_direction(state: OracleState, cfg: StepConfig, conv: Conventions, spec: ParamSpec, g: torch.Tensor,
                    ns_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One Muon parameter's (new momentum, direction) from its (clipped) gradient ``g``."""
    n = spec.name
    mdt = _resolve_dtype(conv.momentum_dtype, cfg)
    hp = cfg.hyper(spec)
    if conv.muon_ns_method is not None:
        hp = {**hp, "ns_method": conv.muon_ns_method}
    beta = hp["momentum"]
    g = g * (float(state.scaler.scale) if conv.momentum_units == "scaled" else 1.0)
    heads = spec.num_heads if conv.honor_num_heads else None
    if ns_mode == "emulated" and conv.fused_blend:
        raise ValueError("Conventions.fused_blend is compiled arithmetic; emulation follows eager's rounding")
    if ns_mode == "emulated" and mdt != torch.float64:
        m_new, U, _ = emulate.emulated_momentum(state.momentum[n].to(mdt), g.to(mdt), beta)
    elif mdt == torch.float64:
        m_new, U = muon_momentum(state.momentum[n].to(torch.float64), g, beta)
    else:
        # storage rounding: the gradient is held in mdt, each of the two blends is rounded once, unless
        # the blend is fused (then only the stored momentum is)
        g = round_to(g, mdt)
        m_wide, U = muon_momentum(state.momentum[n].to(torch.float64), g, beta)
        m_new = round_to(m_wide, mdt)
        U = U if conv.fused_blend else round_to((1.0 - beta) * g + beta * m_new, mdt)
    if conv.gram_input_dtype is not None and hp["ns_method"] == "gram":
        U = round_to(U, MODEL_DTYPES[conv.gram_input_dtype])  # DSM-119: cast before the normalisation
    if ns_mode == "emulated":
        O = emulate.emulated_direction(U.to(mdt), hp["ns_method"], heads, out_dtype=mdt,
                                       conv_aspect=conv.conv_aspect, steps=cfg.ns_steps,
                                       compute_dtype=emulate.ns_compute_dtype(hp["ns_method"], cfg.device_fp16,
                                                                              cfg.device_bf16))
    else:
        O = muon_direction(U.to(torch.float64), hp["ns_method"], heads, steps=cfg.ns_steps,
                           conv_aspect=conv.conv_aspect)
        if conv.momentum_dtype == "model" and mdt != torch.float64:
            # 16-bit Muon state (DSM-001's model): muon_update hands O back in the 16-bit dtype of
            # the gradient it was given, which is what the step applies (the emulated branch
            # rounds it through out_dtype); float64 or compiled Newton-Schulz does not change that.
            O = round_to(O, mdt)
    m_new = m_new.to(torch.float64)
    if conv.padded_tail_momentum_dtype is not None:
        m_new = _round_padded_tail(m_new, cfg.world_size, MODEL_DTYPES[conv.padded_tail_momentum_dtype])
    O = O.to(torch.float64)
    if conv.update_store_dtype is not None:
        O = round_to(O, MODEL_DTYPES[conv.update_store_dtype])
    return m_new, O


@dataclass(frozen=True)
class _Clip:
    """The step's norm and what it divides by: ``k`` (the record's clip coefficient), the Muon and Adam
    divisors, the divisor the implementation's own updates call for, the scale-update ratio ``S / S'``
    and the scaler after the step."""
    norm: float
    own: Optional[float]
    clip_norm: float
    k: float
    muon_div: float
    adam_div: float
    muon_div_own: Optional[float]
    ratio: float
    scaler: LossScalerState
    unscaled: float  # the factor a Muon update carries in true units (1 / S where it lacks S: DSM-108)


def _norm_and_clip(state: OracleState, cfg: StepConfig, conv: Conventions, Gs, directions, norm, pre_k: float,
                   shared_norm, norm_directions) -> Optional[_Clip]:
    """-- 5. the norm, the second skip test (None: a non-finite norm skips the step), the scaler."""
    S = float(state.scaler.scale)
    muon_specs = [p for p in cfg.params if p.use_muon]
    normed_adam = [p for p in cfg.params if not p.use_muon and p.name not in conv.norm_excluded]
    # DSM-108's model: O carries no S, so in true units it counts (and steps) as O / S (of the backward)
    unscaled = 1.0 / S if conv.muon_update_unscaled else 1.0
    if conv.muon_in_new_scale:  # stored as O S', counted in the norm as O S' / S
        unscaled /= scale_ratio(state, cfg, conv)
    own = None
    if conv.clip_norm_source == "muon_update":
        norm = global_norm([directions[p.name] * unscaled for p in muon_specs] + [Gs[p.name] for p in normed_adam])
        if norm_directions is not None and all(p.name in norm_directions for p in muon_specs):
            own = global_norm([norm_directions[p.name].to(torch.float64) * unscaled for p in muon_specs]
                              + [Gs[p.name] for p in normed_adam])
        if shared_norm is not None:
            norm, own = shared_norm, None
    elif shared_norm is None:
        own = norm  # the fed gradients' norm: the implementation's own by construction
    if not math.isfinite(norm):
        return None
    scaler = update_scale(state.scaler, False, cfg.loss_scaler)
    ratio = S / scaler.scale if conv.scale_update_before_unscale else 1.0
    c = cfg.gradient_clipping
    if conv.clip_norm_source == "muon_update":
        k = clip_coefficient(norm * ratio, c)
        # the divisor the implementation's own updates call for: the clip of their own norm
        div_own = clip_coefficient(own * ratio, c) if own is not None and math.isfinite(own) else None
        return _Clip(norm, own, norm * ratio, k, k, k, div_own, ratio, scaler, unscaled)
    return _Clip(norm, own, norm * ratio, pre_k, 1.0, pre_k, 1.0, ratio, scaler, unscaled)


def _apply(state: OracleState, cfg: StepConfig, conv: Conventions, G, Gs, new_mom, directions, clip: _Clip,
           norm_directions) -> tuple[OracleState, dict]:
    """-- 6. apply: Muon's and Adam's updates to the masters (and the records of both)."""
    lp = _model_torch_dtype(cfg)
    master, momentum = dict(state.master), dict(state.momentum)
    adam_m, adam_v = dict(state.adam_m), dict(state.adam_v)
    t = state.adam_step + 1
    recs = {}
    muon_factor = (clip.ratio if conv.muon_update_in_old_scale else 1.0) * (
        clip.unscaled * clip.ratio if conv.muon_update_unscaled else 1.0)
    for spec in cfg.params:
        n = spec.name
        theta = state.master[n].to(torch.float64)
        hp = cfg.hyper(spec)
        if spec.use_muon:
            lr, wd = hp["lr"], hp["weight_decay"]
            theta_new = theta * (1.0 - lr * wd) - lr * (directions[n] * (muon_factor / clip.muon_div))
            master[n] = round_master(theta_new, conv)
            momentum[n] = new_mom[n]
            own_master = None
            if norm_directions is not None and n in norm_directions and clip.muon_div_own is not None:
                O_own = norm_directions[n].to(torch.float64)
                if conv.update_store_dtype is not None:
                    O_own = round_to(O_own, MODEL_DTYPES[conv.update_store_dtype])
                own_master = round_master(theta * (1.0 - lr * wd) - lr * (O_own * (muon_factor / clip.muon_div_own)),
                                          conv)
            recs[n] = ParamRecord(n, True, G[n], new_mom[n], directions[n], theta_new - theta, master[n],
                                  round_to(master[n], lp), master_own=own_master)
            continue
        res = adam_step(theta, Gs[n] * (clip.ratio / clip.adam_div), state.adam_m[n], state.adam_v[n], t,
                        lr=hp["lr"], betas=cfg.betas, eps=cfg.eps, weight_decay=hp["weight_decay"],
                        adam_w_mode=cfg.adam_w_mode or conv.adam_l2_decoupled)
        master[n] = round_master(res.theta, conv)
        adam_m[n], adam_v[n] = res.m, res.v
        recs[n] = ParamRecord(n, False, G[n], None, res.direction, res.delta, master[n],
                              round_to(master[n], lp), res.m, res.v)
    recs = {**{p.name: recs[p.name] for p in cfg.params if p.use_muon},
            **{p.name: recs[p.name] for p in cfg.params if not p.use_muon}}
    return OracleState(master, momentum, adam_m, adam_v, t, clip.scaler, state.step_count + 1,
                       state.skipped_steps), recs


def _round_padded_tail(m: torch.Tensor, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Round the flat slice ``[r*chunk, n)`` of the rank ``r`` whose ZeRO-3 partition (``chunk =
    ceil(n/W)`` elements) holds the padded tail; unchanged when ``n`` splits evenly."""
    flat = m.reshape(-1).clone()
    n = flat.numel()
    chunk = -(-n // world_size)
    if world_size <= 1 or n % chunk == 0:
        return m
    start = ((n - 1) // chunk) * chunk
    flat[start:] = round_to(flat[start:], dtype)
    return flat.reshape(m.shape)


def scale_ratio(state: OracleState, cfg: StepConfig, conv: Conventions) -> float:
    """``S / S'`` for a clean step if the scale update precedes unscaling, else 1."""
    if not conv.scale_update_before_unscale:
        return 1.0
    after = update_scale(state.scaler, False, cfg.loss_scaler)
    return state.scaler.scale / after.scale


def run(state: OracleState, grad_steps: Sequence, cfg: StepConfig, conv: Conventions = Conventions(),
        ns_mode: str = "exact") -> tuple[OracleState, list[StepRecord]]:
    """Free-running: apply :func:`step` to each entry of ``grad_steps`` in turn."""
    records = []
    for grads in grad_steps:
        state, rec = step(state, grads, cfg, conv, ns_mode)
        records.append(rec)
    return state, records
