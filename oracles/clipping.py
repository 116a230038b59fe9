"""Global norm and clip coefficient.

Specifies ``runtime/zero/stage_1_and_2.py`` ``DeepSpeedZeroOptimizer.unscale_and_clip_grads`` and
``runtime/zero/stage3.py`` ``DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads`` (same rule), plus
the norm assembly of ``scaled_global_norm`` / ``_get_norm_groups`` (per-tensor norms in float64,
``runtime/zero/utils.py`` ``get_norm_dtype``, combined as a root of summed squares by
``runtime/utils.py`` ``combine_grad_norm_groups``).

Where the 1e-6 sits: DeepSpeed computes ``clip = ((N_scaled / S) + 1e-6) / c`` -- the 1e-6 is added to
the *unscaled* norm, before dividing by ``c``, and the coefficient is ``max(clip, 1)``. Every gradient
is then multiplied by ``1 / (S * clip)``. With ``c <= 0`` there is no clipping (coefficient 1). So a
norm exactly equal to ``c`` is still (barely) clipped by ``1 + 1e-6/c``; the oracle keeps that.

Which vectors enter the norm is a convention (``oracles.step.Conventions.clip_norm_source``): DeepSpeed
deliberately takes Muon parameters' *update* ``O`` (not their gradient) and Adam parameters'
gradient (docs/deepspeed-0.19.8.md section 7).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

CLIP_EPS = 1e-6


def global_norm(tensors: Iterable[torch.Tensor]) -> float:
    """``sqrt(sum ||t||_2^2)`` in float64; ``inf`` if any entry is non-finite."""
    total = 0.0
    for t in tensors:
        n = float(torch.linalg.vector_norm(t.to(torch.float64)))
        if not math.isfinite(n):
            return math.inf
        total += n * n
    return math.sqrt(total)


def clip_coefficient(norm: float, clip: float) -> float:
    """``k = max(1, (norm + 1e-6) / clip)`` if ``clip > 0`` else 1; updates are divided by ``k``."""
    if clip <= 0.0:
        return 1.0
    if not math.isfinite(norm):
        return math.inf
    return max(1.0, (norm + CLIP_EPS) / clip)
