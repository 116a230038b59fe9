"""The oracle against DeepSpeed 0.19.8's own code (run in a subprocess, eager, CPU accelerator).

* ``emulated`` mode vs DeepSpeed's eager ``muon_update``: bit equality of direction and momentum.
* float64 oracle vs DeepSpeed with Newton-Schulz forced to float64 ("hpns"): within the derived
  ``hpns`` allowance; and DeepSpeed as shipped (16-bit NS) within the ``exact`` allowance.
* ZeRO-1/2 ``get_partition_info``, ZeRO-3 ``_padding_size`` and ``DynamicLossScaler`` vs the oracle's
  layout and scaler.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from harness.env.device import half_support
from oracles import (LossScalerConfig, LossScalerState, allowances, emulated_muon_update, muon_direction,
                     muon_momentum, normalised_sigma_lo, param_slices, update_scale, zero12_layout, zero3_layout)
from oracles.emulate import PRODUCTION_NS_DTYPE, ns_compute_dtype

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")

HERE = Path(__file__).resolve().parent
THREADS = 1


@contextmanager
def threads(n):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _low_rank(gen, shape, rank):
    a = torch.randn(*shape[:-1], rank, generator=gen, dtype=torch.float64)
    b = torch.randn(rank, shape[-1], generator=gen, dtype=torch.float64)
    return a @ b


def _muon_cases():
    gen = torch.Generator().manual_seed(1234)
    geoms = [((8, 24), None, False, None), ((24, 8), None, False, None), ((16, 16), None, False, None),
             ((1, 9), None, False, None), ((9, 1), None, False, None), ((16, 40), None, False, 2),
             ((12, 20), 3, False, None), ((3, 8, 20), None, True, None), ((40, 12), None, False, 3)]
    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for method in ("gram", "standard"):
            for shape, heads, expert, rank in geoms:
                g = _low_rank(gen, shape, rank) if rank else torch.randn(*shape, generator=gen, dtype=torch.float64)
                m = 0.3 * torch.randn(*shape, generator=gen, dtype=torch.float64)
                if dtype == torch.float16:  # a loss-scaled fp16 gradient: large but in range
                    g, m = g * 2.0 ** 10, m * 2.0 ** 10
                cases.append(dict(grad=g.to(dtype), momentum=m.to(dtype), beta=0.95, ns_method=method,
                                  expert=expert, num_heads=heads))
    # overflowed gradients: the finite guard (2-D) and its absence on the per-head path
    for heads in (None, 2):
        g = torch.randn(8, 24, generator=gen).to(torch.float16)
        g[3, 5] = float("inf")
        cases.append(dict(grad=g, momentum=torch.randn(8, 24, generator=gen).to(torch.float16), beta=0.9,
                          ns_method="gram", expert=False, num_heads=heads))
    return cases


def _hpns_cases():
    gen = torch.Generator().manual_seed(99)
    cases = []
    for method in ("gram", "standard"):
        for shape, rank, heads in [((12, 30), None, None), ((30, 12), None, None), ((20, 20), None, None),
                                   ((16, 40), 3, None), ((12, 20), None, 2)]:
            g = _low_rank(gen, shape, rank) if rank else torch.randn(*shape, generator=gen, dtype=torch.float64)
            m = 0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)
            cases.append(dict(grad=g.float(), momentum=m.float(), beta=0.95, ns_method=method, num_heads=heads))
    return cases


def _partition_cases():
    out = []
    for numels, W, align, esize in [([7, 13, 5, 11], 2, False, 4), ([7, 13, 5, 11], 3, True, 2),
                                    ([1, 2, 3], 4, True, 4), ([31, 17, 2], 3, False, 2), ([64], 4, True, 2),
                                    ([5, 5, 5, 5, 5], 4, True, 4)]:
        lay = zero12_layout([[(f"p{i}", n) for i, n in enumerate(numels)]], W, parameter_alignment=align,
                            element_size=esize)
        pads = [p.pad_after for p in lay.placements]
        for r in range(W):
            out.append(dict(numels=numels, partition_size=lay.partition_size[0], rank=r, param_padding=pads,
                            layout=lay))
    return out


def _scaler_cases():
    gen = torch.Generator().manual_seed(5)
    out = []
    for window, hyst, cons in [(1, 1, False), (2, 2, False), (3, 2, True), (2, 3, False), (4, 1, True)]:
        ovf = (torch.rand(40, generator=gen) < 0.25).tolist()
        out.append(dict(init_scale=2.0 ** 8, window=window, min_scale=1.0, hysteresis=hyst, consecutive=cons,
                        overflows=ovf))
    return out


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds_ref")
    spec = dict(muon_cases=_muon_cases(), hpns_cases=_hpns_cases(),
                partition_cases=[{k: v for k, v in c.items() if k != "layout"} for c in _partition_cases()],
                z3_cases=[(n, w) for n in (1, 2, 3, 7, 8, 13, 64) for w in (1, 2, 3, 4)],
                scaler_cases=_scaler_cases())
    torch.save(spec, tmp / "in.pt")
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCHDYNAMO_DISABLE="1", ORACLE_TEST_THREADS=str(THREADS),
               OMP_NUM_THREADS=str(THREADS))
    proc = subprocess.run([sys.executable, str(HERE / "_ds_reference.py"), str(tmp / "in.pt"), str(tmp / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return spec, torch.load(tmp / "out.pt")


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _ns_dtype(method):
    """The oracle's rule for this machine's device (harness.env.device: oneDNN fp16 kernels or not)."""
    return ns_compute_dtype(method, *half_support())


def test_production_ns_dtypes_match_deepspeed(ds):
    _, res = ds
    assert res["ns_dtypes"] == (_ns_dtype("gram"), _ns_dtype("standard"))
    # ... and the rule itself: 16 bit where the device has it, fp32 where it does not.
    assert ns_compute_dtype("gram", True, True) == PRODUCTION_NS_DTYPE["gram"]
    assert ns_compute_dtype("gram", False, True) == torch.float32
    assert ns_compute_dtype("standard", True, False) == torch.float32


def test_emulated_muon_update_is_bit_equal_to_deepspeed_eager(ds):
    spec, res = ds
    mismatches = []
    with threads(THREADS):
        for i, (c, r) in enumerate(zip(spec["muon_cases"], res["muon"])):
            m, o = emulated_muon_update(c["grad"], c["momentum"], c["beta"], c["ns_method"], c["num_heads"],
                                        batched=c["expert"], compute_dtype=_ns_dtype(c["ns_method"]))
            if not (_same_bits(o, r["direction"]) and _same_bits(m, r["momentum"])):
                d = (o.double() - r["direction"].double()).abs().max().item()
                mismatches.append((i, c["grad"].dtype, c["ns_method"], tuple(c["grad"].shape), d))
    assert not mismatches, mismatches
    assert len(spec["muon_cases"]) >= 50


def test_emulated_direction_check_resolves_one_16bit_rounding_of_the_input(ds):
    """The emulated-mode direction check is sensitive at the resolution of its 16-bit input: a
    perturbation of the gradient that moves the Nesterov blend ``U`` by about one fp16 unit round-off
    (``U`` weights the gradient by ``1 - beta^2``, so the gradient moves by ``2^-11 / (1 - beta^2)``,
    relative, random signs) is flagged in every case.

    Measured while building this test: at 10x the fp32 *grad* allowance (~1.2e-6 relative) only 4 of
    12 fp32 cases changed at all -- most such perturbations vanish in the cast to fp16/bf16. So fp32-level
    gradient errors must be caught by the grad and momentum comparisons, not by the direction.
    """
    spec, res = ds
    gen = torch.Generator().manual_seed(7)
    checked = flagged = 0
    with threads(THREADS):
        for c, r in zip(spec["muon_cases"], res["muon"]):
            if c["grad"].dtype != torch.float32 or c["grad"].ndim != 2:
                continue
            g = c["grad"].double()
            signs = torch.sign(torch.randn(g.shape, generator=gen, dtype=torch.float64))
            bumped = (g * (1 + 2.0 ** -11 / (1 - c["beta"] ** 2) * signs)).float()
            _, o = emulated_muon_update(bumped, c["momentum"], c["beta"], c["ns_method"], c["num_heads"],
                                        compute_dtype=_ns_dtype(c["ns_method"]))
            allow = allowances("emulated", model_dtype="fp32", shape=tuple(g.shape))
            checked += 1
            flagged += not allow.direction.check(o, r["direction"]).ok
    assert checked >= 12 and flagged == checked


def test_float64_oracle_vs_deepspeed_with_float64_newton_schulz(ds):
    spec, res = ds
    worst = 0.0
    for c, r in zip(spec["hpns_cases"], res["hpns"]):
        g, m = c["grad"].double(), c["momentum"].double()
        m_new, U = muon_momentum(m, g, c["beta"])
        O = muon_direction(U, c["ns_method"], c["num_heads"])
        lo = normalised_sigma_lo(U.reshape(c["num_heads"], -1, U.size(-1)) if c["num_heads"] else U)
        allow = allowances("hpns", model_dtype="fp32", shape=tuple(g.shape), ns_method=c["ns_method"],
                           sigma_lo=lo, num_heads=c["num_heads"],
                           grad_to_momentum=float(g.abs().max() / m_new.abs().max()))
        chk_o = allow.direction.check(r["direction"], O)
        chk_m = allow.momentum.check(r["momentum"], m_new)
        assert chk_o.ok, (c["ns_method"], tuple(g.shape), chk_o)
        assert chk_m.ok, (c["ns_method"], tuple(g.shape), chk_m)
        worst = max(worst, chk_o.ratio)
    assert worst > 0.0  # DeepSpeed's fp32 path is not bit-identical to float64: the check has teeth


def test_deepspeed_16bit_newton_schulz_within_exact_mode_allowance(ds):
    spec, res = ds
    for c, r in zip(spec["muon_cases"], res["muon"]):
        if c["grad"].dtype != torch.float32 or c["num_heads"] or c["expert"]:
            continue
        g, m = c["grad"].double(), c["momentum"].double()
        m_new, U = muon_momentum(m, g, c["beta"])
        O = muon_direction(U, c["ns_method"])
        allow = allowances("exact", model_dtype="fp32", shape=tuple(g.shape), ns_method=c["ns_method"],
                           sigma_lo=normalised_sigma_lo(U), grad_to_momentum=float(g.abs().max() / m_new.abs().max()))
        chk = allow.direction.check(r["direction"], O)
        assert chk.ok, (c["ns_method"], tuple(g.shape), chk)


def test_zero12_layout_matches_deepspeed_partition_info(ds):
    spec, res = ds
    for c, r in zip(_partition_cases(), res["partition"]):
        lay, rank = c["layout"], c["rank"]
        held = [i for i in range(len(c["numels"])) if any(s.rank == rank for s in param_slices(lay, f"p{i}"))]
        assert held == r["in"], (c["numels"], rank)
        # DeepSpeed's first_offset: how far into the first held parameter this partition starts
        first = [s for i in held for s in param_slices(lay, f"p{i}") if s.rank == rank][:1]
        expected_first = first[0].param_start if first else 0
        assert expected_first == r["first_offset"], (c["numels"], rank)


def test_zero3_padding_matches_deepspeed(ds):
    spec, res = ds
    for (n, w), pad in zip(spec["z3_cases"], res["z3_padding"]):
        lay = zero3_layout([("p", n)], w)
        assert lay.placements[0].pad_after == pad, (n, w)


def test_loss_scaler_matches_deepspeed_dynamic_loss_scaler(ds):
    spec, res = ds
    for c, trace in zip(spec["scaler_cases"], res["scaler"]):
        cfg = LossScalerConfig(initial_scale_power=int(math.log2(c["init_scale"])), loss_scale_window=c["window"],
                               hysteresis=c["hysteresis"], consecutive_hysteresis=c["consecutive"],
                               min_loss_scale=c["min_scale"], raise_error_at_min_scale=False)
        st = LossScalerState(c["init_scale"], cur_hysteresis=c["hysteresis"])
        for ovf, (scale, it, last, h) in zip(c["overflows"], trace):
            st = update_scale(st, ovf, cfg)
            assert (st.scale, st.cur_iter, st.last_overflow_iter, st.cur_hysteresis) == (scale, it, last, h)
