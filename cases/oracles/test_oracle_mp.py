"""The float64 oracle against 60-digit mpmath on small, deliberately awkward matrices.

Tolerances come from the tolerance model's Newton-Schulz bound evaluated at float64's unit
round-off (``ns_relative_error(2^-53, sigma_lo, long_dim)``), from the standard error bound of a
sum of squares (norm), and from counting roundings (momentum). None is fitted to these runs.
"""
from __future__ import annotations

import math

import mpmath
import pytest
import torch

from cases.oracles._matrices import with_singular_values as _with_singular_values
from oracles import mp, muon_momentum, normalised_sigma_lo, ns_gram, ns_relative_error, ns_standard

U64 = 2.0 ** -53


def _matrices():
    gen = torch.Generator().manual_seed(2024)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return {
        "random_wide_6x10": r(6, 10),
        "random_tall_10x6": r(10, 6),
        "random_square_5x5": r(5, 5),
        "rank2_6x9": r(6, 2) @ r(2, 9),
        "rank1_7x4": r(7, 1) @ r(1, 4),
        "cond1e3_7x7": _with_singular_values(7, 7, torch.logspace(0, -3, 7), 1),
        "cond1e6_5x12": _with_singular_values(5, 12, torch.logspace(0, -6, 5), 2),
        "cond1e6_tall_12x5": _with_singular_values(12, 5, torch.logspace(0, -6, 5), 3),
        "row_1x8": r(1, 8),
        "col_8x1": r(8, 1),
        "tiny_norm_4x6": r(4, 6) * 1e-6,  # the 1e-7 outside the norm matters here
    }


MATS = _matrices()


@pytest.fixture(scope="module")
def mp_results():
    out = {}
    for name, G in MATS.items():
        M = mp.from_torch(G)
        out[name] = (mp.ns_standard(M), mp.ns_gram(M))
    return out


@pytest.mark.parametrize("name", sorted(MATS))
def test_newton_schulz_float64_matches_mpmath(name, mp_results):
    G = MATS[name]
    ref_std, ref_gram = mp_results[name]
    # exact arithmetic: the two evaluation orders are the same map (60 digits leave ~1e-55)
    assert float(mp.max_abs_diff(ref_std, ref_gram)) <= 1e-50 * max(1.0, float(mp.max_abs(ref_std)))
    lo = normalised_sigma_lo(G)
    rtol = ns_relative_error(U64, lo, long_dim=max(G.shape))
    ref = mp.to_torch(ref_std)
    scale = ref.abs().max().item()
    for fn in (ns_standard, ns_gram):
        err = (fn(G) - ref).abs().max().item()
        assert err <= rtol * scale, (name, fn.__name__, err, rtol * scale)
        # and the float64 evaluation is genuinely accurate, not just within a wide bound
        assert err <= 1e-11 * scale


def test_mp_precision_is_60_digits():
    with mp.precision():
        assert mpmath.mp.dps == 60
    assert mp.DPS >= 50


@pytest.mark.parametrize("name", sorted(MATS))
def test_frobenius_norm_matches_mpmath(name):
    G = MATS[name]
    ref = mp.frobenius_norm(mp.from_torch(G))
    got = torch.linalg.vector_norm(G).item()
    # a sum of k squares: relative error <= (k/2 + 2) u (squares, k-1 additions, the sqrt)
    k = G.numel()
    assert abs(got - float(ref)) <= (k / 2 + 2) * U64 * float(ref)


def test_momentum_matches_mpmath():
    gen = torch.Generator().manual_seed(3)
    for beta in (0.9, 0.95, 0.99):
        m = torch.randn(5, 7, generator=gen, dtype=torch.float64)
        g = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 1e3  # very different magnitudes
        m_new, U = muon_momentum(m, g, beta)
        rm, rU = mp.muon_momentum(mp.from_torch(m), mp.from_torch(g), beta)
        scale = max(m.abs().max().item(), g.abs().max().item())
        # m_new: two products and a sum (3 roundings) plus 1-beta's own rounding -> 4u of the larger term
        assert (m_new - mp.to_torch(rm)).abs().max().item() <= 4 * U64 * scale
        # U reuses the rounded m_new: its 4u error scaled by beta, plus 4 more roundings
        assert (U - mp.to_torch(rU)).abs().max().item() <= 8 * U64 * scale


def test_nesterov_blend_algebra():
    """``U = (1-beta)(1+beta) g + beta^2 m``: the current gradient weighs 1-beta^2, not 1-beta."""
    m, g = mp.from_torch(torch.tensor([[1.0, -2.0]])), mp.from_torch(torch.tensor([[3.0, 0.5]]))
    beta = 0.95
    _, U = mp.muon_momentum(m, g, beta)
    with mp.precision():
        b = mpmath.mpf(beta)
        expect = [[(1 - b) * (1 + b) * gg + b * b * mm for gg, mm in zip(g[0], m[0])]]
        assert float(mp.max_abs_diff(U, expect)) < 1e-50


def test_scalar_map_float64_vs_mpmath():
    from oracles import phi, phi_derivative
    for s in [1e-6, 1e-3, 0.01, 0.1, 0.3, 0.5544, 0.7, 0.9, 1.0]:
        exact = float(mp.phi(s))
        # each of the 5 steps rounds ~6 times at most; later steps amplify by at most |phi'| ~ the gain
        bound = 6 * U64 * sum(abs(phi_derivative(phi(s, k), 5 - k)) * abs(phi(s, k)) for k in range(6))
        assert abs(phi(s) - exact) <= bound + 4 * U64 * abs(exact), s
    assert math.isclose(float(mp.phi(0.0)), 0.0, abs_tol=0)
