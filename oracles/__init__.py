"""Reference ("oracle") computations for Muon-with-auxiliary-Adam under DeepSpeed ZeRO.

The oracle states what an optimizer step SHOULD compute: Muon on the true, unscaled,
data-parallel-averaged, accumulated gradient, momentum in true units and high precision, loss scaling
and clipping that do not change a non-skipped step. DeepSpeed 0.19.8's deliberate conventions (and,
opt-in, its known accidents) are named switches of :class:`Conventions`. Nothing here imports
DeepSpeed.

Modules: ``newton_schulz`` (float64 NS, the Muon direction), ``emulate`` (DeepSpeed's 16-bit NS bit for
bit), ``momentum``, ``adam``, ``loss_scaler``, ``clipping``, ``layout`` (ZeRO partitions), ``step`` (the
full step), ``replay`` (how a teacher-forced replay reads the conventions), ``checkpoint``, ``mp``
(mpmath twins), ``tolerance`` (allowed errors per quantity).
"""
from .adam import AdamResult, adam_step
from .checkpoint import CHECKPOINT_FIELDS, StateDifference, StateField, checkpoint_state, compare_states, restore_state
from .clipping import CLIP_EPS, clip_coefficient, global_norm
from .emulate import (emulated_direction, emulated_momentum, emulated_muon_update, emulated_ns, emulated_ns_gram,
                      emulated_ns_standard, ns_compute_dtype)
from .layout import (REGIONS, LayoutParam, Location, Placement, RankSlice, Segment, Zero3Layout, Zero12Layout,
                     ds_param_groups, locate, locate_flat, param_slices, partition_padding, placement, rank_segments,
                     region_indices, region_ranges, zero3_layout, zero12_layout)
from .loss_scaler import LossScaleAtMinimum, LossScalerConfig, LossScalerState, scale_plan, update_scale
from .loss_scaler import initial_state as initial_scaler_state
from .momentum import muon_momentum, round_to
from .newton_schulz import (NS_A, NS_B, NS_C, NS_COEFFICIENTS, NS_EPS, NS_STEPS, aspect_scale, band_entry_threshold,
                            muon_direction, ns_gram, ns_standard, phi, phi_derivative, quintic,
                            quintic_band)
from .step import (MODEL_DTYPES, Conventions, OracleState, ParamRecord, ParamSpec, StepConfig, StepRecord, accumulate,
                   deepspeed_conventions, fp16_overflow, initial_state, run, scale_ratio)
from .step import step as oracle_step  # the function; ``oracles.step`` stays the module
from .tolerance import (MODES, RATIO_SHOWN_MAX, UNIT_ROUNDOFF, Allowance, Allowances, Check, Divergence, allowances,
                        compare, grad_term_scale,
                        normalised_sigma_lo, ns_gains, perturbed_sigma_lo,
                        ns_relative_error, own_master_allowance, own_norm_allowance, ratio_text, subnormal_half_spacing,
                        unit_roundoff)

import types as _types

__all__ = [_n for _n, _v in dict(globals()).items()
           if not _n.startswith("_") and not isinstance(_v, _types.ModuleType)]
