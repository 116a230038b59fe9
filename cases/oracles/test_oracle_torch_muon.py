"""The oracle's Muon step against ``torch.optim.Muon`` (torch 2.13), an independent implementation.

Mapping of torch's settings onto the oracle (``torch/optim/_muon.py``):

* ``ns_coefficients`` default ``(3.4445, -4.7750, 2.0315)``, ``ns_steps=5``: the same polynomial.
* ``nesterov=True``: ``buf.lerp_(grad, 1-momentum)``, ``update = grad.lerp(buf, momentum)`` -- the same
  two blends as the oracle's ``muon_momentum``.
* ``adjust_lr_fn="original"``: the lr is multiplied by ``sqrt(max(1, A/B))``; the oracle multiplies
  ``O`` by the same aspect scale -- identical step.
* ``weight_decay``: ``param.mul_(1 - lr*wd)`` with the *unadjusted* lr, as the oracle (and DeepSpeed)
  do. torch's default is 0.1, the oracle's 0: set explicitly.
* No loss scaling, no clipping, one rank, one micro-batch: ``gradient_clipping=0``, fp32 model with
  float64 masters (``round_master_to_fp32=False``) because the torch params are float64.

Differences that prevent agreement, and how each is handled:

* torch always runs Newton-Schulz in bf16 (``grad.bfloat16()``, hard-coded). For the tight test the
  method ``Tensor.bfloat16`` is patched, for the duration of the test only, to return a float64 copy,
  so torch's own code runs in float64. A second test keeps torch's bf16 and uses the exact-mode
  allowance for bf16 ("standard") Newton-Schulz.
* torch normalises by ``norm.clamp(min=eps)``, the oracle by ``norm + 1e-7``: relative difference
  ``1e-7/||U||``. Gradients of norm ~1e5 make that ~1e-12 and it is included in the tolerance as an
  input perturbation amplified by the Newton-Schulz gain.
* torch uses ``addmm`` (fused) where the oracle rounds separately; float64 round-off only.
"""
from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch

from oracles import (Conventions, ParamSpec, StepConfig, allowances, aspect_scale, initial_state, muon_direction,
                     normalised_sigma_lo, ns_relative_error, oracle_step)

U64 = 2.0 ** -53
SHAPES = {"tall": (12, 5), "wide": (5, 12), "square": (6, 6)}


def _float64_bfloat16(self, *args, **kwargs):
    return self.to(torch.float64, copy=True)


def _setup(seed, scale):
    gen = torch.Generator().manual_seed(seed)
    specs = tuple(ParamSpec(n, s, True) for n, s in SHAPES.items())
    weights = {n: torch.randn(*s, generator=gen, dtype=torch.float64) * 0.1 for n, s in SHAPES.items()}
    grads = [{n: torch.randn(*s, generator=gen, dtype=torch.float64) * scale for n, s in SHAPES.items()}
             for _ in range(3)]
    return specs, weights, grads


def _torch_run(weights, grads, lr, wd, beta):
    params = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    opt = torch.optim.Muon(list(params.values()), lr=lr, weight_decay=wd, momentum=beta, nesterov=True,
                           ns_steps=5, adjust_lr_fn="original")
    history = []
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
        history.append({n: p.detach().clone() for n, p in params.items()})
    return history


def _oracle_run(specs, weights, grads, lr, wd, beta):
    cfg = StepConfig(params=specs, muon_lr=lr, momentum=beta, weight_decay=wd, ns_method="standard")
    conv = Conventions(round_master_to_fp32=False)
    state = initial_state(cfg, weights, conv)
    state = replace(state, master={n: w.clone() for n, w in weights.items()})  # float64 masters, as torch has
    out, recs = [], []
    for g in grads:
        state, rec = oracle_step(state, [[g]], cfg, conv)
        out.append({n: t.clone() for n, t in state.master.items()})
        recs.append(rec)
    return out, recs


def test_oracle_matches_torch_muon_in_float64():
    lr, wd, beta, gscale = 0.02, 0.1, 0.95, 1e5
    specs, weights, grads = _setup(0, gscale)
    with mock.patch.object(torch.Tensor, "bfloat16", _float64_bfloat16):
        hist = _torch_run(weights, grads, lr, wd, beta)
    ours, recs = _oracle_run(specs, weights, grads, lr, wd, beta)
    for n, shape in SHAPES.items():
        s = aspect_scale(*shape)
        err_budget = 0.0
        for k, (theirs, mine, rec) in enumerate(zip(hist, ours, recs)):
            U = (1 - beta) * grads[k][n] + beta * rec.params[n].momentum  # the Newton-Schulz input
            lo = normalised_sigma_lo(U)
            eps_rel = 1e-7 / float(torch.linalg.vector_norm(U))  # clamp-vs-add difference, relative
            rtol_o = ns_relative_error(U64, lo, long_dim=max(shape), input_rel_err=8 * U64 + eps_rel)
            # per step: the direction error times lr*s, plus a few roundings of the weight update
            err_budget += lr * s * rtol_o * rec.params[n].direction.abs().max().item() \
                + 4 * U64 * mine[n].abs().max().item()
            err = (theirs[n] - mine[n]).abs().max().item()
            assert err <= err_budget, (n, k, err, err_budget)
        # and they are not trivially equal in a way that would hide a broken comparison
        assert not torch.equal(weights[n], hist[-1][n])


def test_oracle_is_not_fooled_by_a_mismatched_setting():
    """Sanity of the comparison: the same run with Nesterov off in torch must NOT match."""
    lr, wd, beta = 0.02, 0.0, 0.9
    specs, weights, grads = _setup(1, 1e5)
    with mock.patch.object(torch.Tensor, "bfloat16", _float64_bfloat16):
        params = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
        opt = torch.optim.Muon(list(params.values()), lr=lr, weight_decay=wd, momentum=beta, nesterov=False,
                               adjust_lr_fn="original")
        for g in grads:
            for n, p in params.items():
                p.grad = g[n].clone()
            opt.step()
    ours, _ = _oracle_run(specs, weights, grads, lr, wd, beta)
    assert max((params[n].detach() - ours[-1][n]).abs().max().item() for n in SHAPES) > 1e-4


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_torch_native_bf16_muon_within_exact_mode_allowance(name):
    """torch's shipping bf16 Newton-Schulz (a different bf16 evaluation order from DeepSpeed's) stays
    within the tolerance model's exact-mode allowance for bf16 ("standard") Newton-Schulz."""
    shape = SHAPES[name]
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(*shape, generator=gen, dtype=torch.float64)
    g = torch.randn(*shape, generator=gen, dtype=torch.float64)
    lr = 0.5
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.Muon([p], lr=lr, weight_decay=0.0, momentum=0.95, adjust_lr_fn="original")
    p.grad = g.clone()
    opt.step()
    s = aspect_scale(*shape)
    O_torch = (w - p.detach()) / (lr * s) * s  # the aspect-scaled direction torch applied
    U = (1 - 0.95) * (1 + 0.95) * g  # first step from zero momentum
    O = muon_direction(U, "standard")
    allow = allowances("exact", model_dtype="fp32", grad_dtype="fp64", shape=shape, ns_method="standard",
                       sigma_lo=normalised_sigma_lo(U))
    chk = allow.direction.check(O_torch, O)
    assert chk.ok, chk
    assert chk.error > 0  # bf16 really is inexact: the comparison is not vacuous
    assert chk.bound < allow.direction.cap  # the derived bound, not the saturation ceiling, decided
