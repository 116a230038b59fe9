"""The judge's fp16 overflow test (``harness.case.synthetic.backward_overflows``) decides which steps the
oracle skips and which gradients have a finite reference. DeepSpeed's overflow test reads the gradients
alone: the backward of ``scale * loss / GAS`` never reads the product's forward value (its derivative is
the scale), so a scaled loss past fp16's largest value with finite gradients is an applied step, and only
a scale that is itself past fp16's range (2^16, DeepSpeed's default) overflows whatever the data.

The preconditions are computed here from the float64 loss and gradient magnitudes, so each test says
why its expectation holds. No ranks.
"""
from __future__ import annotations

import pytest
import torch

from harness.case import synthetic
from harness.case.spec import Overflow, ParamShape
from harness.catalog.matrix import _case

FP16_MAX = float(torch.finfo(torch.float16).max)


# Matrices of the size ``check`` runs after its scale-down (the loss is a mean, so each gradient element
# is small next to the summed loss): the regime where a 3-step ``check`` at DeepSpeed's default scale
# applies its third step at 2^15 with a scaled loss near 10 x 2^15.
PARAMS = (ParamShape("layers.0.weight", (96, 64)), ParamShape("layers.0.bias", (96,)),
          ParamShape("layers.1.weight", (64, 200)), ParamShape("layers.1.bias", (64,)))


def _setup(grad_accum: int = 1):
    case = _case(1, "none", "fp16", 1, grad_accum=grad_accum, params=PARAMS)
    lp = {n: w.to(torch.float16).to(torch.float64) for n, w in synthetic.initial_weights(case).items()}
    return case, lp


def _scaled_loss_and_gradient(case, lp, scale: float) -> tuple[float, float]:
    """(the float64 scaled loss, the largest cancellation-free scaled gradient magnitude) of micro-batch 0
    of step 1. The magnitude (every product and residual taken positive) bounds each partial sum the
    backward forms, so below fp16's largest value no intermediate of the data's backward overflows."""
    loss = synthetic.local_loss(lp, case, 0, 1, 0) * scale / case.grad_accum
    mags = synthetic.gradient_magnitudes(lp, case, 0, 1, 0)
    return loss, max(float(m.abs().max()) for m in mags.values()) * scale / case.grad_accum


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_scaled_loss_past_fp16_range_with_small_gradients_is_an_applied_step(grad_accum):
    case, lp = _setup(grad_accum)
    scale = 2.0 ** 15
    loss, grad = _scaled_loss_and_gradient(case, lp, scale)
    assert loss > FP16_MAX, "precondition: the scaled loss itself is past fp16's range"
    assert grad < FP16_MAX / 2, "precondition: every scaled gradient is well inside fp16's range"
    assert scale / grad_accum < FP16_MAX, "precondition: the backward's first product is finite"
    assert not synthetic.backward_overflows(lp, case, 0, 1, 0, scale)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_scale_past_fp16_range_overflows_the_backward(grad_accum):
    """DeepSpeed divides the loss by GAS and then scales it: the backward's first product is the scale
    itself in fp16, which 2^16 is past, whatever GAS."""
    case, lp = _setup(grad_accum)
    scale = 2.0 ** 16
    assert scale > FP16_MAX, "precondition"
    _, grad = _scaled_loss_and_gradient(case, lp, scale)
    assert grad < FP16_MAX / 2, "precondition: the data alone would not overflow"
    assert synthetic.backward_overflows(lp, case, 0, 1, 0, scale)


def test_an_injected_inf_still_overflows():
    case, lp = _setup()
    poisoned = case.replace(overflows=(Overflow(step=1, rank=0, micro=0, value=float("inf")),))
    assert not synthetic.backward_overflows(lp, case, 0, 1, 0, 1.0)
    assert synthetic.backward_overflows(lp, poisoned, 0, 1, 0, 1.0)
