"""How far an implementation may legitimately be from the oracle, per compared quantity.

Metric
------
Every allowance is *normwise in the max-norm*: a tensor ``actual`` matches ``expected`` when

    max|actual - expected|  <=  min(atol + rtol * max|expected|, cap)

Normwise (not elementwise) because the errors below are bounds on whole-tensor perturbations
(rounding noise is spread over all entries; an entry that is small through cancellation carries an
absolute, not a relative, error). ``cap`` is an absolute ceiling used where the quantity is bounded
whatever the rounding does (the Newton-Schulz output).

Comparison modes (what the implementation under test computes)
----------------------------------------------------------------
* ``"exact"``: DeepSpeed as shipped -- Newton-Schulz in 16 bit (gram: fp16, standard: bf16;
  ``original_muon.py`` ``ns_compute_dtype``) -- against the float64 oracle.
* ``"hpns"``: DeepSpeed with its Newton-Schulz forced to float64 (``ns_compute_dtype`` patched), so the
  rest of the step is checked at fp32 round-off.
* ``"emulated"``: DeepSpeed as shipped against the oracle's ``ns_mode="emulated"`` (``oracles.emulate``).

Derivation
----------
Unit round-offs ``u``: fp64 2^-53, fp32 2^-24, fp16 2^-11, bf16 2^-8. ``W`` ranks, ``GAS`` micro-batches,
``n = W*GAS``. ``T`` = steps since the states were last synchronised (1 under teacher forcing).

* grad (averaged accumulated gradient): a sum of ``n`` terms and one scaling, each rounded in the
  storage dtype: ``rtol = (n + 1) u_g`` (+ ``backward_rel_err`` if the oracle's per-micro gradients are
  not DeepSpeed's own). A sum with cancellation has an absolute error relative to its terms: pass
  ``grad_term_scale`` to add ``atol = (n + 1) u_g * grad_term_scale``. The term scale is *that
  parameter's own* (:func:`grad_term_scale`): ``max over ranks r, micro-batches mu and elements of
  |g[r][mu][p]|``, the largest addend that reaches this parameter's reduction. Each partial sum of the
  reduction (``n - 1`` of them, pre-divided by ``W`` and ``GAS``) and the final storage round once, at
  most ``u_g`` of a value no larger than that addend, hence ``(n + 1) u_g`` times it. One global maximum
  over all parameters would let a parameter whose gradients are small next to another's (the large
  NVMe matrix next to a bias: its per-element gradient is ~1/numel of the loss) absorb a whole missing
  rank, a wrong ``1/W`` or a lost micro-batch inside an allowance sized for a different tensor.
  Such an error is ``|G|/n`` or more of the parameter's own average, far above ``(n + 1) u_g`` of its
  own addends for every storage dtype (bf16 included: ``1/n >> (n + 1) 2^-8`` for ``n <= 8``), which
  ``cases/harness/test_grad_check.py`` checks on each dtype and layout. When the oracle's per-micro
  gradients are exact and DeepSpeed's come from a backward in the model dtype, each addend carries that
  backward's own rounding, at most ``backward_term_err`` of the term scale (``harness.judge.verdict``: four
  rounded intermediates per loss term, two terms: ``8 u_lp``); an average of ``n`` such addends carries
  no more than one of them, so it enters ``atol`` once, not ``n + 1`` times. Below the smallest normal
  a rounding is off by up to half the subnormal spacing, not ``u`` of the value: ``atol`` adds
  ``(n + 1)`` of those, in true units (divided by the loss scale where the gradient is stored scaled).
  Only fp16 reaches it (2^-25 under 6.1e-5: a gradient of 1e-9 times a scale of 256).
* momentum: each step adds ``(1-beta)`` times the gradient error and two lerp roundings ``2 u_m``;
  older errors decay by ``beta``: ``rtol = ((1-beta) rtol_g rho + 2 u_m) (1-beta^T)/(1-beta)`` where
  ``rho = max|G| / max|M|`` (default ``1/(1-beta)``, the first-step worst case).
* Newton-Schulz. The iteration maps each normalised singular value ``s`` to ``phi_5(s)`` with the
  singular vectors fixed. A perturbation ``E`` of ``X`` is amplified, to first order, by at most
  ``max(|phi'(s)|, phi(s)/s)`` over the singular values involved (divided differences of ``phi`` and
  ``phi(s)/s`` for the mixed and null directions), which tends to ``a^5 ~ 485`` at ``s -> 0``: a
  rank-deficient (or very ill-conditioned) update amplifies rounding noise by ~485. Rounding noise
  injected before iteration ``k`` is amplified by the *remaining* ``5-k`` iterations at the singular
  values it meets there: ``Ghat_k = max over s in [sigma_lo, 1] of the gain of phi_{5-k} at phi_k(s)``
  (:func:`ns_gains`, computed from the polynomial; ``sigma_lo`` = smallest normalised singular value,
  0 when rank-deficient). With ``C_IN`` roundings of the input, ``C_ITER`` per iteration, matmul
  accumulation over the long dimension ``m`` at ``u_acc`` (fp32 for 16-bit compute, as CPU and tensor
  cores accumulate), and ``KAPPA`` converting a Frobenius-relative error into the max-norm metric::

      rtol_NS = KAPPA * [ (C_IN u_c + delta_in) Ghat_0 + C_ITER (u_c + m u_acc) sum_{k>=1} Ghat_k ]

  ``C_IN = 1`` (the cast of the normalised input), ``C_ITER = 2`` (the output rounding of ``a X + B X``
  plus the rounding of ``a X``, which enters unamplified by ``B``), ``KAPPA = 2`` (max-abs-relative /
  Frobenius-relative error, measured <= 1.6 on the families below). Checked
  (``cases/oracles/test_oracle_tolerance.py``) against the measured 16-bit-vs-float64 error on
  full-rank, rank-1/4/16, cond 10..1e6, square, tall, wide, 1xN and Nx1 matrices: measured/allowed
  between 0.006 (random square 64x64: one isolated tiny singular value, the worst-case gain is met
  by one direction only) and 0.67 (a bf16 1x50 row), never above 1; median ~0.09. The bound is a
  worst case over the spectrum: for a DeepSpeed fp32 path with float64 NS ("hpns") it is ~100x the
  measured error (1e-7 measured vs ~1e-5 allowed), which still resolves any error at 16-bit level.
  The output is bounded whatever happens (every singular value of either result is at most the band
  top ``H ~ 1.2`` times the aspect scale ``s``), so ``cap = 2 H s`` (with 5% margin).
* update direction ``O``: exact mode: ``rtol_NS`` with ``u_c`` the 16-bit unit, ``delta_in`` the
  momentum/``U`` error, plus one output rounding to the gradient dtype. hpns: ``u_c = u_fp64``; the
  input carries the fp32 storage error and the gram variant's fp32 normalisation. emulated with
  bit-identical inputs: bit-equality is expected (measured: 0 on CPU eager), the allowance is one
  ulp of the output dtype at the largest entry (``2 u_out``). emulated with inputs that differ even in
  the last fp32 bit: measured that one flipped 16-bit rounding cascades into a difference as large as
  a fresh 16-bit evaluation, so the allowance is twice the exact-mode one.
* norm ``N`` and clip coefficient ``k``: a root-sum-square's relative error is at most the largest
  relative (Frobenius) error of its parts: ``max(rtol_NS/KAPPA, rtol_g)`` plus float64 summation.
* Adam direction ``m_hat/(sqrt(v_hat)+eps)``: ``2 (rtol_g + rtol_k)`` from the moments plus about
  ten fp32 roundings (two lerps each, sqrt, divisions, bias corrections) and ``2 u_w min(T, 1/(1-beta2))``
  of state rounding carried over steps; plus the betas held as fp32 scalars (CPU Adam's C++ floats, a
  fp32 kernel's scalar arguments): ``beta`` off by ``u_w beta`` moves each weight ``(1-beta) beta^(t-i) /
  (1-beta^t)`` of ``m_hat`` by at most ``u_w beta (1/(1-beta) + t/beta + t beta^(t-1)/(1-beta^t))`` <=
  ``u_w (2 beta/(1-beta) + t)`` relative (``t``: Adam's step count), and ``sqrt`` halves ``v_hat``'s:
  ``u_w (2 b1/(1-b1) + t) + u_w (b2/(1-b2) + t/2)``. With ``beta2 = 0.999`` that is ~1000 ``u_w``: measured
  1.3e-5 of the step (220 ``u_w``) on ZeRO-2 CPU offload at t = 3.
* applied update ``Delta theta`` (Muon ``-lr wd theta - lr O/k``, Adam likewise): ``rtol_O + rtol_k +
  2 u_w``; ``atol = 2 u_w * weight_scale`` when the update is read back as a difference of fp32 masters.
* master weights (fp32): per step two roundings (DeepSpeed's ``mul_`` and ``add_``) ``2 u_w`` of the
  weight, plus the update error times the step size: ``rtol = T (2 u_w + rtol_update * step_to_weight)``
  with ``step_to_weight = max|Delta theta| / max|theta|`` (default 1: conservative; pass the real ratio).
* model weights: the master allowance plus one rounding to the model dtype that a master difference
  may flip: ``+ 2 u_lp`` (nothing for an fp32 model, whose weights are the masters).
* loss scale: a deterministic power of two: exact (``atol = rtol = 0``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch

from .newton_schulz import NS_A, NS_STEPS, aspect_scale, quintic_band
from .newton_schulz import NS_B, NS_C

UNIT_ROUNDOFF = {"fp64": 2.0 ** -53, "fp32": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
_ALIASES = {"float64": "fp64", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16",
            torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
MODES = ("exact", "hpns", "emulated")
NS_DTYPE = {"gram": "fp16", "standard": "bf16"}

C_IN = 1.0
C_ITER = 2.0
KAPPA = 2.0


def unit_roundoff(dtype) -> float:
    key = _ALIASES.get(dtype, dtype)
    try:
        return UNIT_ROUNDOFF[key]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


# Half the spacing of the subnormals (the smallest subnormal over two): the absolute error of one rounding
# below the smallest normal, where ``u`` times the value no longer bounds it. fp16's 2^-25 (values under
# 6.1e-5) is what an fp16 gradient far below one reaches times a small loss scale; the others are far
# below anything a step holds.
SUBNORMAL_HALF_SPACING = {"fp64": 2.0 ** -1075, "fp32": 2.0 ** -150, "fp16": 2.0 ** -25, "bf16": 2.0 ** -134}


def subnormal_half_spacing(dtype) -> float:
    unit_roundoff(dtype)  # the same dtype check
    return SUBNORMAL_HALF_SPACING[_ALIASES.get(dtype, dtype)]


# Above this an error-to-allowance ratio is shown as "> 1e30", not as its digits. A ratio that large
# only comes from an allowance at its rounding floor (an oracle of zero: ``atol`` alone, down to
# 2^-150 for fp32), so "5.4e+44x" would read as a measurement of how wrong the value is when it only
# says "nonzero where zero was due"; the error and the allowance, shown next to it, say the rest.
RATIO_SHOWN_MAX = 1e30


def ratio_text(ratio: float) -> str:
    """How every message and report writes an error-to-allowance ratio (no unit sign: the caller's)."""
    if not math.isfinite(ratio):
        return str(ratio)  # inf, nan
    if ratio > RATIO_SHOWN_MAX:
        return f"> {RATIO_SHOWN_MAX:.0e}".replace("e+", "e")
    return f"{ratio:.3g}"


@dataclass(frozen=True)
class Divergence:
    """The one record of a comparison (the verdict's, the assertion message's, the stored results' and
    the report's), in the spirit of ``torch.testing.assert_close``: which allowance and why, the worst
    element as a per-dimension index, its absolute and relative error, and the share of elements out
    of tolerance. Plain floats and tuples only, so it serialises as it is."""
    atol: float
    rtol: float
    derivation: str
    bound: float               # min(atol + rtol * max|finite expected|, cap)
    ratio: float               # worst |actual - expected| / bound (inf when bound is 0 and the error is not)
    index: tuple[int, ...]     # per-dimension index of the worst element
    flat_index: int            # the same, flat (row-major): what the ZeRO layout locates
    abs_error: float           # |actual - expected| there
    rel_error: float           # the greatest |actual - expected| / |expected| over nonzero expected entries
    rel_index: tuple[int, ...]  # where that greatest relative error is
    actual: float              # the worst element's values
    expected: float
    n_bad: int                 # elements out of tolerance
    numel: int

    @property
    def ok(self) -> bool:
        return self.n_bad == 0

    @property
    def share_bad(self) -> float:
        return self.n_bad / self.numel if self.numel else 0.0

    # the names the earlier two-field result used (``error``: the worst absolute error)
    @property
    def error(self) -> float:
        return self.abs_error

    def lines(self) -> list[str]:
        """assert_close-style text, one fact per line."""
        return [f"mismatched elements: {self.n_bad} / {self.numel} ({100.0 * self.share_bad:.1f}%)",
                f"greatest absolute difference: {self.abs_error:.3g} at index {self.index} "
                f"(actual {self.actual:.9g}, oracle {self.expected:.9g}; up to {self.bound:.3g} allowed, "
                f"{ratio_text(self.ratio)}x)",
                f"greatest relative difference: {self.rel_error:.3g} at index {self.rel_index}",
                f"allowance: atol {self.atol:.3g} + rtol {self.rtol:.3g} * max|oracle|: {self.derivation}"]


def _as_array(x):
    import numpy as np  # late: keeps this module numpy-free at import

    if torch.is_tensor(x):
        x = x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def compare(actual, expected, allowance: "Allowance", *, keep_map: bool = False):
    """Compare element-wise under ``allowance``; returns ``(Divergence, ratio map or None)``. The map
    (``keep_map``) is made only for a comparison that fails: a report draws and stores no other, and the
    judge makes ~140 comparisons per case-column.

    Identical non-finite entries (the same inf, NaN against NaN) match; any other non-finite entry is
    an infinite error. The bound is taken over the finite entries of ``expected``."""
    import numpy as np  # late: keeps this module numpy-free at import

    a, e = _as_array(actual), _as_array(expected)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {e.shape}")
    shape = a.shape
    a, e = a.reshape(-1), e.reshape(-1)
    if np.isfinite(a).all() and np.isfinite(e).all():
        err, ratio, rel, bound = _errors_finite(a, e, allowance)
    else:
        err, ratio, rel, bound = _errors_general(a, e, allowance)
    n = int(a.size)
    worst = int(np.argmax(ratio)) if n else 0
    wrel = int(np.argmax(rel)) if n else 0
    unravel = (lambda i: tuple(int(k) for k in np.unravel_index(i, shape)) if shape else ()) if n else (lambda i: ())
    div = Divergence(atol=float(allowance.atol), rtol=float(allowance.rtol), derivation=allowance.derivation,
                     bound=float(bound), ratio=float(ratio[worst]) if n else 0.0, index=unravel(worst),
                     flat_index=worst, abs_error=float(err[worst]) if n else 0.0,
                     rel_error=float(rel[wrel]) if n else 0.0, rel_index=unravel(wrel),
                     actual=float(a[worst]) if n else 0.0, expected=float(e[worst]) if n else 0.0,
                     n_bad=int((ratio > 1.0).sum()), numel=n)
    return div, (_map_f32(ratio) if keep_map and div.n_bad else None)


def _map_f32(ratio):
    """The element map as stored (float32: it is only drawn, and a wide NVMe case keeps several).
    A ratio beyond float32's range is stored as inf on purpose rather than by an overflowing cast;
    the record's own ``ratio`` stays the float64 value."""
    import numpy as np  # late: keeps this module numpy-free at import

    big = float(np.finfo(np.float32).max)
    return np.where(ratio > big, np.inf, ratio).astype(np.float32)


def _errors_general(a, e, allowance: "Allowance"):
    """(error, error / bound, relative error, bound) element-wise, any entries."""
    import numpy as np  # late: keeps this module numpy-free at import

    bound = allowance.bound(e)
    with np.errstate(invalid="ignore"):
        err = np.abs(a - e)
    same_nonfinite = ~np.isfinite(a) & ~np.isfinite(e) & ((a == e) | (np.isnan(a) & np.isnan(e)))
    err = np.where(same_nonfinite, 0.0, err)
    err = np.where(np.isnan(err), np.inf, err)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = err / bound if bound > 0 else np.where(err > 0, np.inf, 0.0)
        rel = np.where((e != 0) & np.isfinite(e), err / np.abs(e), np.where(err > 0, np.inf, 0.0))
    return err, ratio, rel, bound


def _errors_finite(a, e, allowance: "Allowance"):
    """``_errors_general`` for all-finite entries (nearly every check), in a third of the array passes:
    the judge of a wide NVMe case spends most of its time here. The same numbers, bit for bit
    (``cases/oracles/test_oracle_tolerance.py`` holds the two to it)."""
    import numpy as np  # late: keeps this module numpy-free at import

    abs_e = np.abs(e)
    bound = min(allowance.atol + allowance.rtol * (float(abs_e.max()) if abs_e.size else 0.0), allowance.cap)
    err = np.abs(a - e)
    if bound > 0:
        ratio = err / bound
    else:
        ratio = np.where(err > 0, np.inf, 0.0)
    rel = np.where(err > 0, np.inf, 0.0)
    np.divide(err, abs_e, out=rel, where=e != 0)
    return err, ratio, rel, bound


Check = Divergence  # the earlier name of the result of ``Allowance.check``


@dataclass(frozen=True)
class Allowance:
    """The one allowance type: ``max|actual - expected| <= min(atol + rtol * max|expected|, cap)``
    (module docstring, "Metric"). ``derivation`` says where the numbers come from."""
    atol: float
    rtol: float
    derivation: str
    cap: float = math.inf

    def bound(self, expected) -> float:
        """The allowed error for this reference, from its finite entries."""
        import numpy as np  # late: keeps this module numpy-free at import

        e = _as_array(expected)
        finite = e[np.isfinite(e)]
        scale = float(np.abs(finite).max()) if finite.size else 0.0
        return min(self.atol + self.rtol * scale, self.cap)

    def check(self, actual, expected) -> Divergence:
        return compare(actual, expected, self)[0]

    def scaled(self, factor: float) -> "Allowance":
        return Allowance(self.atol * factor, self.rtol * factor, self.derivation + f" (x{factor:g})",
                         self.cap * factor if math.isfinite(self.cap) else self.cap)


def grad_term_scale(terms) -> float:
    """The largest finite ``|g|`` over one parameter's per-(rank, micro-batch) gradients: the addend
    scale of its reduction (module docstring, "grad"). ``terms``: an iterable of tensors of that one
    parameter; non-finite terms (an injected overflow) are left out, 0 when none is finite."""
    scale = 0.0
    for g in terms:
        t = torch.as_tensor(g, dtype=torch.float64)
        if t.numel() and bool(torch.isfinite(t).all()):
            scale = max(scale, float(t.abs().max()))
    return scale


@dataclass(frozen=True)
class Allowances:
    grad: Allowance
    momentum: Allowance
    direction: Allowance        # Muon O
    adam_direction: Allowance   # m_hat / (sqrt(v_hat) + eps)
    update: Allowance           # applied change of a Muon master
    adam_update: Allowance      # applied change of an Adam master
    master: Allowance
    model: Allowance
    loss_scale: Allowance
    norm: Allowance
    clip_coef: Allowance

    def items(self):
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


# --------------------------------------------------------------------------------------------------
# Newton-Schulz gain, from the polynomial
# --------------------------------------------------------------------------------------------------

def _grid(sigma_lo: float) -> torch.Tensor:
    lo = max(sigma_lo, 1e-12)
    g = torch.cat([torch.logspace(math.log10(lo), 0.0, 2000, dtype=torch.float64),
                   torch.linspace(lo, 1.0, 2000, dtype=torch.float64)])
    return torch.unique(g)


def _p(s):
    s2 = s * s
    return s * (NS_A + s2 * (NS_B + NS_C * s2))


def _dp(s):
    s2 = s * s
    return NS_A + s2 * (3.0 * NS_B + 5.0 * NS_C * s2)


@functools.lru_cache(maxsize=4096)
def ns_gains(sigma_lo: float, steps: int = NS_STEPS) -> tuple[float, ...]:
    """``(Ghat_0, ..., Ghat_steps)``: worst first-order amplification of noise injected before
    iteration ``k``, over normalised singular values in ``[sigma_lo, 1]`` (see module docstring).
    ``Ghat_steps = 1``; ``sigma_lo = 0`` gives ``a^(steps-k)`` (plus band effects)."""
    if not 0.0 <= sigma_lo <= 1.0:
        raise ValueError("sigma_lo is a normalised singular value in [0, 1]")
    s0 = _grid(sigma_lo)
    traj = [s0]
    for _ in range(steps):
        traj.append(_p(traj[-1]))
    out = []
    for k in range(steps + 1):
        s = traj[k]
        d = torch.ones_like(s)
        t = s.clone()
        for _ in range(steps - k):
            d = d * _dp(t)
            t = _p(t)
        g = max(float(d.abs().max()), float((t / s).max()))
        if sigma_lo == 0.0:
            g = max(g, NS_A ** (steps - k))
        out.append(g)
    return tuple(out)


def ns_output_bound(steps: int = NS_STEPS) -> float:
    """Largest singular value either evaluation can produce, per unit aspect scale (band top, with a
    small margin for rounding)."""
    return quintic_band()[1] * 1.05


def ns_relative_error(u_compute: float, sigma_lo: float, *, long_dim: int, u_accumulate: Optional[float] = None,
                      input_rel_err: float = 0.0, steps: int = NS_STEPS) -> float:
    """``rtol_NS`` of the module docstring (max-norm relative error of the NS output)."""
    gains = ns_gains(sigma_lo, steps)
    u_acc = u_compute if u_accumulate is None else u_accumulate
    per_iter = u_compute + long_dim * u_acc
    return KAPPA * ((C_IN * u_compute + input_rel_err) * gains[0] + C_ITER * per_iter * sum(gains[1:]))


def own_norm_allowance(n_elements: int, model_dtype: str, store_dtype: str) -> Allowance:
    """The reported global norm against the same norm taken in float64 over the implementation's *own*
    Muon updates and gradients (``oracles.step`` ``norm_directions``): no Newton-Schulz error enters,
    only the implementation's norm arithmetic. Derived, worst case:

    * summing ``n`` squares in fp32 (DeepSpeed's ZeRO paths widen to float64, ``get_norm_dtype``; a
      path that did not is still covered): ``gamma_n(u32)`` on the sum of squares, half that on its root;
    * a partial norm returned as a tensor of the model dtype (``torch.linalg.vector_norm`` of a 16-bit
      partition) and squared, summed over partitions and rooted again: ``2 u_model``;
    * the update written into a buffer of another dtype than the one it was captured in: ``u_store``;
    * a few fp32 operations on the combined value (square root, unscale by a power of two): ``4 u32``.
    """
    u32 = UNIT_ROUNDOFF["fp32"]
    nu = n_elements * u32
    gamma = nu / (1.0 - nu) if nu < 0.5 else 1.0
    rtol = 0.5 * gamma + 2.0 * unit_roundoff(model_dtype) + unit_roundoff(store_dtype) + 4.0 * u32
    return Allowance(0.0, rtol, f"norm of DeepSpeed's own updates: gamma_n(u32)/2 (n={n_elements}) + 2 u_model "
                                f"({model_dtype}) + u_store ({store_dtype}) + 4 u32")


def own_master_allowance(step_to_weight: float, clip_rtol: float, u_store: float) -> Allowance:
    """A Muon master against the one the implementation's *own* update should give
    (``oracles.step`` ``ParamRecord.master_own``): ``theta (1 - lr wd) - lr O / k`` with ``O`` as
    captured and ``k`` from the norm of the captured updates. No Newton-Schulz error enters. Derived:
    the fp32 weight update rounds twice (``mul_``, ``add_``: ``2 u_w`` of the weight); the applied
    update ``lr O / k`` carries the unscale and lr products and the add's operand (``4 u_w``), ``O``
    stored once in the dtype of the buffer it is applied from where that is not the dtype it was
    captured in (ZeRO-3 offload forms ``S O`` in the 16-bit accumulation dtype: ``u_store``) and ``k``'s
    relative error ``clip_rtol`` (the own norm's allowance where clipping is on), scaled to the weight
    by ``step_to_weight``."""
    u_w = UNIT_ROUNDOFF["fp32"]
    rtol = 2.0 * u_w + (4.0 * u_w + u_store + clip_rtol) * step_to_weight
    return Allowance(0.0, rtol, f"own update: 2 u_w + (4 u_w + u_store + rtol_k) * step_to_weight, "
                                f"u_store={u_store:.3g}, rtol_k={clip_rtol:.3g}, step_to_weight={step_to_weight:.3g}")


def normalised_sigma_lo(U: torch.Tensor, rank_tol: float = 1e-10) -> float:
    """``sigma_min(U)/(||U||_F)`` over the min(rows, cols) singular values; 0 if numerically
    rank-deficient. Batched (3-D) input: the minimum over the batch."""
    X = U.to(torch.float64)
    if X.ndim == 2:
        X = X.unsqueeze(0)
    X = X.reshape(-1, X.size(-2), X.size(-1))
    lo = 1.0
    for M in X:
        nrm = float(torch.linalg.vector_norm(M))
        if nrm == 0.0:
            return 0.0
        sv = torch.linalg.svdvals(M / nrm)
        s = float(sv[-1])
        lo = min(lo, 0.0 if s < rank_tol * float(sv[0]) else s)
    return lo


def perturbed_sigma_lo(U: torch.Tensor, rel_err: float, rank_tol: float = 1e-10) -> float:
    """A lower bound of :func:`normalised_sigma_lo` over every matrix within ``rel_err`` of ``U`` in
    this module's metric (``max|E| <= rel_err * max|U|``): what the implementation fed Newton-Schulz is
    only known to be that close to the oracle's ``U``. By Weyl, ``sigma_min(U + E) >= sigma_min(U) -
    ||E||_2`` and ``||U + E||_F <= ||U||_F + ||E||_F``, with ``||E||_2 <= ||E||_F <= sqrt(numel) max|E|``;
    so the bound is ``(sigma_min - e) / (||U||_F + e)``, ``e = sqrt(numel) rel_err max|U|``, per matrix
    of a batch (each is normalised on its own), 0 where that is not positive or ``U`` is numerically
    rank-deficient. Lets exact mode use the step's own spectrum instead of the worst case 0."""
    X = U.to(torch.float64)
    if X.ndim == 2:
        X = X.unsqueeze(0)
    X = X.reshape(-1, X.size(-2), X.size(-1))
    e = math.sqrt(X[0].numel()) * rel_err * float(X.abs().max()) if X.numel() else 0.0
    lo = 1.0
    for M in X:
        nrm = float(torch.linalg.vector_norm(M))
        if nrm == 0.0:
            return 0.0
        sv = torch.linalg.svdvals(M)
        s = float(sv[-1])
        if s < rank_tol * float(sv[0]):
            return 0.0
        lo = min(lo, max(0.0, (s - e) / (nrm + e)))
    return lo


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------

def allowances(mode: str, *, model_dtype: str = "fp32", shape: Sequence[int] = (64, 64), steps: int = 1,
               ns_method: str = "gram", world_size: int = 1, gas: int = 1, beta: float = 0.95,
               sigma_lo: float = 0.0, grad_dtype: Optional[str] = None, momentum_dtype: Optional[str] = None,
               num_heads: Optional[int] = None, ns_inputs_identical: bool = True,
               adam_betas: tuple[float, float] = (0.9, 0.95), grad_term_scale: Optional[float] = None,
               grad_to_momentum: Optional[float] = None, weight_scale: float = 0.0,
               step_to_weight: float = 1.0, backward_rel_err: float = 0.0, backward_term_err: float = 0.0,
               clipping_active: bool = True, use_muon: Optional[bool] = None,
               grad_units: float = 1.0, adam_step: int = 1,
               backward_units: Optional[float] = None) -> Allowances:
    """The allowance per quantity for one Muon parameter of ``shape`` (see the module docstring).

    ``use_muon``: which update the parameter's weights take, for the master and model allowances:
    ``False`` (an auxiliary-Adam parameter) counts Adam's update error only, so Newton-Schulz's (rtol
    up to ~1 where it is not emulated bit for bit) does not widen them; None: the worse of the two.

    ``grad_dtype``/``momentum_dtype`` default to the model dtype (DeepSpeed's non-offload storage);
    pass ``"fp32"`` for the offload paths. ``sigma_lo``: :func:`normalised_sigma_lo` of the NS input
    (0 = rank-deficient, the worst case). ``grad_units``: the factor the stored gradient carries (the loss
    scale where DeepSpeed keeps it scaled, else 1): each of the ``n + 1`` roundings of a subnormal is off
    by up to half the subnormal spacing in those units, which ``u`` times the value does not bound.
    ``backward_units``: the factor the model-dtype backward's own output carried (its loss scale; None: the
    same as ``grad_units``); where the gradient is then stored in another dtype or other units (an offload
    path's fp32, unscaled), each of the ``n`` addends was already rounded to the model dtype's subnormal
    spacing in the backward's units.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if steps < 1:
        raise ValueError("steps >= 1")
    u_g = unit_roundoff(grad_dtype or model_dtype)
    u_m = unit_roundoff(momentum_dtype or grad_dtype or model_dtype)
    u_w = UNIT_ROUNDOFF["fp32"]
    u_lp = unit_roundoff(model_dtype)
    u64 = UNIT_ROUNDOFF["fp64"]
    n = world_size * gas
    T = steps

    grad = _grad_allowance(n, u_g, grad_dtype or model_dtype, backward_rel_err, backward_term_err, grad_term_scale,
                           grad_units)
    if (backward_units is not None and (grad_dtype or model_dtype, grad_units) != (model_dtype, backward_units)
            and model_dtype != "fp32"):
        sub_bw = n * subnormal_half_spacing(model_dtype) / backward_units
        grad = Allowance(grad.atol + sub_bw, grad.rtol, grad.derivation + f" + backward subnormals W*GAS "
                         f"{subnormal_half_spacing(model_dtype):.3g} / {backward_units:g}")
    rtol_g = grad.rtol

    # -- momentum
    rho = (1.0 / (1.0 - beta)) if grad_to_momentum is None else grad_to_momentum
    decay = (1.0 - beta ** T) / (1.0 - beta)
    rtol_m = ((1.0 - beta) * rtol_g * rho + 2.0 * u_m) * decay
    momentum = Allowance(0.0, rtol_m, f"((1-b) rtol_g rho + 2u_m) (1-b^T)/(1-b), rho={rho:.3g}, T={T}")

    # -- Newton-Schulz direction
    direction = _direction_allowance(mode, shape, num_heads, ns_method, sigma_lo, rtol_m + 2.0 * u_m, u_g,
                                     ns_inputs_identical)
    cap = direction.cap

    # -- norm and clip coefficient
    if mode == "emulated" and ns_inputs_identical:
        ns_fro = 2.0 * u_g
    else:
        ns_fro = direction.rtol / KAPPA
    rtol_n = max(ns_fro, rtol_g) + 4.0 * u64 + u_w
    norm = Allowance(0.0, rtol_n, "max(part Frobenius errors) + float64 sum")
    rtol_k = rtol_n if clipping_active else 0.0
    clip_coef = Allowance(0.0, rtol_k, "k = (N + 1e-6)/c inherits the norm's relative error"
                          if clipping_active else "no clipping: k = 1 exactly")

    # -- Adam
    b1, b2 = adam_betas
    t = max(adam_step, 1)
    rtol_betas = u_w * (2.0 * b1 / (1.0 - b1) + t) + u_w * (b2 / (1.0 - b2) + 0.5 * t)
    rtol_ad = 2.0 * (rtol_g + rtol_k) + 10.0 * u_w + 2.0 * u_w * min(T, 1.0 / (1.0 - b2)) + rtol_betas
    adam_direction = Allowance(0.0, rtol_ad, "2(rtol_g + rtol_k) + 10 u_w + 2 u_w min(T, 1/(1-b2)) + fp32 betas "
                                             f"(b=({b1:g}, {b2:g}), t={t})")

    # -- applied updates
    atol_u = 2.0 * u_w * weight_scale
    update = Allowance(atol_u, direction.rtol + rtol_k + 2.0 * u_w, "rtol_O + rtol_k + 2 u_w",
                       (cap + 2.0 * u_w * weight_scale) if math.isfinite(direction.cap) else math.inf)
    adam_update = Allowance(atol_u, rtol_ad + 2.0 * u_w, "rtol_adam + 2 u_w")

    # -- weights
    worst_update = {True: update.rtol, False: adam_update.rtol}.get(use_muon, max(update.rtol, adam_update.rtol))
    rtol_w = T * (2.0 * u_w + worst_update * step_to_weight)
    master = Allowance(0.0, rtol_w, f"T (2 u_w + rtol_update * step_to_weight), T={T}, "
                                    f"step_to_weight={step_to_weight:.3g}")
    extra = 0.0 if model_dtype == "fp32" else 2.0 * u_lp
    model = Allowance(0.0, rtol_w + extra, "master + one model-dtype rounding flip (2 u_lp)")
    loss_scale = Allowance(0.0, 0.0, "deterministic power of two: exact")
    return Allowances(grad, momentum, direction, adam_direction, update, adam_update, master, model,
                      loss_scale, norm, clip_coef)


def _grad_allowance(n: int, u_g: float, grad_dtype: str, backward_rel_err: float, backward_term_err: float,
                    grad_term_scale: Optional[float], grad_units: float) -> Allowance:
    """The averaged gradient's: ``n + 1`` roundings of the ``n = W * GAS`` addends' sum, the backward's own
    error, and the subnormals' half spacing in the stored gradient's units."""
    rtol_g = (n + 1) * u_g + backward_rel_err
    atol_g = ((n + 1) * u_g + backward_term_err) * grad_term_scale if grad_term_scale else 0.0
    sub_g = (n + 1) * subnormal_half_spacing(grad_dtype) / grad_units
    return Allowance(atol_g + sub_g, rtol_g, f"(W*GAS+1) u_g = ({n}+1)*{u_g:.3g}"
                     + (f" + backward {backward_rel_err:.3g}" if backward_rel_err else "")
                     + (f"; atol ((W*GAS+1) u_g + {backward_term_err:.3g}) * term {grad_term_scale:.3g}"
                        if grad_term_scale else "")
                     + (f" + subnormals (W*GAS+1) {subnormal_half_spacing(grad_dtype):.3g}"
                        f" / {grad_units:g}" if sub_g > 1e-30 else ""))


def _direction_allowance(mode: str, shape: Sequence[int], num_heads: Optional[int], ns_method: str, sigma_lo: float,
                         delta_u: float, u_g: float, ns_inputs_identical: bool) -> Allowance:
    """The Newton-Schulz direction's, per comparison mode, from the NS input's relative error ``delta_u``
    (``U = lerp(g, M', beta)``: the momentum's allowance and one more rounding)."""
    rows, cols = int(shape[-2]) if len(shape) >= 2 else 1, int(shape[-1])
    if len(shape) == 4:
        rows, cols = int(shape[0]), int(math.prod(shape[1:]))
    if num_heads:
        rows = rows // num_heads
    s = aspect_scale(rows, cols)
    long_dim = max(rows, cols)
    cap = 2.0 * ns_output_bound() * s
    u_c = unit_roundoff(NS_DTYPE[ns_method])
    exact_ns = ns_relative_error(u_c, sigma_lo, long_dim=long_dim, u_accumulate=UNIT_ROUNDOFF["fp32"],
                                 input_rel_err=delta_u)
    if mode == "exact":
        how = (f"KAPPA[(C_IN u_c + dU) G0 + C_ITER (u_c + m u_acc) sum G], u_c={u_c:.3g}, "
               f"sigma_lo={sigma_lo:.3g}, m={long_dim}; + u_out")
        return Allowance(0.0, exact_ns + u_g, how, cap)
    if mode == "hpns":
        norm_in = 2.0 * u_g if ns_method == "gram" else 0.0
        rtol_o = ns_relative_error(UNIT_ROUNDOFF["fp64"], sigma_lo, long_dim=long_dim,
                                   input_rel_err=delta_u + norm_in) + u_g
        return Allowance(0.0, rtol_o, f"float64 NS on fp32-stored input: KAPPA (dU + norm) G0 + ..., "
                                      f"sigma_lo={sigma_lo:.3g}", cap)
    if ns_inputs_identical:
        return Allowance(0.0, 2.0 * u_g, "bit-faithful emulation: one ulp of the output dtype")
    return Allowance(0.0, 2.0 * exact_ns + u_g, "emulated with differing inputs: 2x exact-mode NS bound "
                                                "(a flipped 16-bit rounding cascades)", cap)
