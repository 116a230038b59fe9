"""The synthetic model: exactly the parameters a case declares, each with its own loss term.

Every parameter is independent of every other one, so any shape works (1xN, Nx1, primes, 3-D) and
the exact float64 gradient of a micro-batch is a closed form (``local_gradients``) that the oracle
side can evaluate without DeepSpeed.

Loss of one (rank, step, micro) batch, summed over the parameters (unscaled, not divided by GAS):

* matrix ``W`` (any ``ndim >= 2``; viewed as ``r x c`` with ``r = shape[0]``, ``c = prod(shape[1:])``)::

      mean_{B x r}((X W^T - T)^2)  +  mean_{r x c}(D * (W - C)^2)

  with ``X: B x c``, ``T: B x r``, ``D, C: r x c`` and ``D`` in [0.5, 1.5). The first term is the
  usual linear-layer data term (it goes through ``torch.nn.functional.linear``, which ZeRO-3 swaps
  for its own implementation); its gradient has rank <= B. The second, elementwise term makes the
  gradient full rank whatever ``B`` is, because Newton-Schulz in 16 bit is badly conditioned on
  rank-deficient input (docs/deepspeed-0.19.8.md, section 12).

* vector ``v`` (1-D)::

      mean_{B x n}((v * Z - T)^2)          Z, T: B x n

``B = case.batch``. All data is drawn in float32 from a ``torch.Generator`` seeded from
``(case.seed, rank, step, micro, crc32(name))`` and then rounded to the model dtype: the model sees
that rounded data, and ``local_gradients`` differentiates the loss of the same rounded data exactly.

Conventions (shared with ``harness.rank.ds_run`` and the oracles):
* ``step`` counts optimizer steps from 1; ``micro`` counts micro-batches within a step from 0.
* An ``Overflow(step, rank, micro, value)`` of the case without ``param`` sets ``T[0, 0] = value`` in
  *every* parameter's batch of that (rank, step, micro): the loss and every gradient of that rank become
  non-finite there (rows of ``W`` touching ``T[0,0]``; the vector entry 0), all other ranks are clean.
  ``local_gradients`` sees the same poisoned data.
* With ``param``, only that parameter's batch carries ``poison`` (a 0-d tensor of ``value``): its forward
  passes the weight through ``poison_grad``, which is the identity forward and in the backward sets the
  first element of the gradient reaching the weight to ``value``. The loss and every other gradient stay
  finite; ``local_gradients`` sets the same element of the same micro-batch's gradient.
"""
from __future__ import annotations

import functools
import math
import zlib

import numpy as np
import torch

FORBIDDEN_NAME_PARTS = ("embed", "lm_head")  # DeepSpeed would silently route these to Adam

MODEL_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------------------------
# deterministic data


def _seed(*parts: int) -> int:
    state = np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31 | int(state[1])) & ((1 << 63) - 1)


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode())


def _generator(*parts: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(_seed(*parts))
    return g


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) the loss sees a >= 2-D parameter as."""
    return shape[0], math.prod(shape[1:])


def check_params(params) -> None:
    seen = set()
    for p in params:
        low = p.name.lower()
        if any(k in low for k in FORBIDDEN_NAME_PARTS):
            raise ValueError(f"parameter name {p.name!r} contains one of {FORBIDDEN_NAME_PARTS}: "
                             "DeepSpeed would not route it the way its shape says")
        if p.name in seen:
            raise ValueError(f"duplicate parameter name {p.name!r}")
        seen.add(p.name)
        if any(not part or not part.isidentifier() and not part.isdigit() for part in p.name.split(".")):
            raise ValueError(f"parameter name {p.name!r} is not a dotted module path")
        if len(p.shape) == 0 or any(d < 1 for d in p.shape):
            raise ValueError(f"parameter {p.name!r} has an empty shape {p.shape}")
    # A name may not be both a parameter and a module prefix of another one.
    names = {p.name for p in params}
    for n in names:
        parts = n.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[:i]) in names:
                raise ValueError(f"{'.'.join(parts[:i])!r} is both a parameter and a module")


def initial_weights(case, variant: int = 0) -> dict[str, torch.Tensor]:
    """float32 initial values, full shape. ``variant`` != 0 gives a different, equally valid init
    (the checkpoint test loads into a model built with variant 1, so a load that silently did
    nothing shows)."""
    out = {}
    for p in case.params:
        g = _generator(case.seed, 0x1A17, variant, _name_key(p.name))
        if len(p.shape) >= 2:
            _, cols = matrix_view(p.shape)
            w = torch.randn(p.shape, generator=g, dtype=torch.float32) / math.sqrt(cols)
        else:
            w = 1.0 + 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float32)
        out[p.name] = w
    return out


def batch_data(case, rank: int, step: int, micro: int, dtype: torch.dtype | None = None) -> dict[str, dict]:
    """Per parameter name, the data of one micro-batch as float32 tensors rounded to ``dtype``
    (the case's model dtype by default) and stored in that dtype."""
    if dtype is None:
        dtype = MODEL_DTYPES[case.dtype]
    here = [o for o in case.overflows if o.step == step and o.rank == rank and o.micro == micro]
    poison = [o.value for o in here if o.param is None]
    local = {o.param: o.value for o in here if o.param is not None}
    B = case.batch
    out = {}
    skipped = {name for name, s in case.unused if s == step}
    for p in case.params:
        if p.name in skipped:
            continue  # no term in this step's loss (Case.unused): the forward leaves the parameter out
        g = _generator(case.seed, 0xDA7A, rank, step, micro, _name_key(p.name))
        if len(p.shape) >= 2:
            r, c = matrix_view(p.shape)
            d = {
                "X": torch.randn(B, c, generator=g, dtype=torch.float32),
                "T": torch.randn(B, r, generator=g, dtype=torch.float32),
                "D": 0.5 + torch.rand(r, c, generator=g, dtype=torch.float32),
                "C": torch.randn(r, c, generator=g, dtype=torch.float32) / math.sqrt(c),
            }
        else:
            n = p.shape[0]
            d = {
                "Z": torch.randn(B, n, generator=g, dtype=torch.float32),
                "T": torch.randn(B, n, generator=g, dtype=torch.float32),
            }
        _shape_spectrum(case, d)
        for v in poison:
            d["T"][0, 0] = v
        if p.name in local:
            d["poison"] = torch.tensor(local[p.name], dtype=torch.float32)
        out[p.name] = {k: t.to(dtype) for k, t in d.items()}
    return out


def _shape_spectrum(case, d: dict) -> None:
    """Case knobs ``grad_cond`` / ``grad_elementwise`` / ``grad_scale`` (defaults 1: no change).
    ``grad_cond``: column j of X scaled by cond**(-j/(c-1)), so the data term's gradient
    ``R^T X`` has singular values spread over ~cond. ``grad_elementwise``: D scaled (0 removes the
    full-rank elementwise term). ``grad_scale`` = s: X, Z, T times sqrt(s) and D times s, so every
    loss term, and every gradient, is s times the unscaled one."""
    cond = float(getattr(case, "grad_cond", 1.0))
    elem = float(getattr(case, "grad_elementwise", 1.0))
    scale = float(getattr(case, "grad_scale", 1.0))
    if "X" in d:
        c = d["X"].shape[1]
        if cond != 1.0 and c > 1:
            d["X"] *= torch.tensor(cond, dtype=torch.float64).pow(
                -torch.arange(c, dtype=torch.float64) / (c - 1)).to(torch.float32)
        if elem != 1.0:
            d["D"] *= elem
    if scale != 1.0:
        r = math.sqrt(scale)
        for k in ("X", "Z", "T"):
            if k in d:
                d[k] *= r
        if "D" in d:
            d["D"] *= scale


# ------------------------------------------------------------------------------------------------
# the module


class _PoisonGrad(torch.autograd.Function):
    """The identity forward; backward: the incoming gradient with its first element set to the poison,
    so one parameter's gradient goes non-finite exactly where the oracle's does, and nothing upstream."""

    @staticmethod
    def forward(ctx, w, value):
        ctx.save_for_backward(value)
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        (value,) = ctx.saved_tensors
        out = grad.contiguous().clone()
        out.view(-1)[0] = value.to(out.dtype)
        return out, None


def poison_grad(w: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return _PoisonGrad.apply(w, value)


def term_loss(w: torch.Tensor, d: dict[str, torch.Tensor]) -> torch.Tensor:
    """One parameter's loss term, in the dtype of ``w`` (autograd-friendly; also used in float64)."""
    if "X" in d:
        w2 = w.reshape(w.shape[0], -1)
        pred = torch.nn.functional.linear(d["X"], w2)
        return ((pred - d["T"]) ** 2).mean() + (d["D"] * (w2 - d["C"]) ** 2).mean()
    return ((w * d["Z"] - d["T"]) ** 2).mean()


class Node(torch.nn.Module):
    """One module of the dotted-name tree. Its forward adds the loss terms of the parameters it
    owns directly (so ZeRO-3's per-module gather hooks see every parameter used in its own
    module's forward) and then those of its children.

    Parameters and children are registered inside ``__init__`` (children are built first): under
    ``deepspeed.zero.Init`` a module's parameters are partitioned when its ``__init__`` returns, and
    one registered later would escape that."""

    def __init__(self, own: tuple = (), children: tuple = ()):
        super().__init__()
        self._own: list[str] = []  # local parameter name -> full name order
        self._full: dict[str, str] = {}
        for local, full, value in own:
            self.register_parameter(local, torch.nn.Parameter(value))
            self._own.append(local)
            self._full[local] = full
        for name, child in children:
            self.add_module(name, child)

    def forward(self, batch: dict):
        total = None
        for local in self._own:
            if self._full[local] not in batch:  # unused at this step (Case.unused)
                continue
            d = batch[self._full[local]]
            w = getattr(self, local)
            if "poison" in d:  # a localized overflow (Overflow.param) of this micro-batch
                w = poison_grad(w, d["poison"])
            t = term_loss(w, d)
            total = t if total is None else total + t
        for child in self.children():
            t = child(batch)
            if t is not None:
                total = t if total is None else total + t
        return total


class SyntheticModel(Node):
    """Root of the tree; ``forward(batch)`` returns the scalar micro-batch loss."""


def _tree(case) -> dict:
    """{"own": [(local, full)], "children": {name: subtree}} in first-appearance order, which is
    the ``named_parameters()`` order of the built model."""
    root: dict = {"own": [], "children": {}}
    for p in case.params:
        parts = p.name.split(".")
        node = root
        for part in parts[:-1]:
            node = node["children"].setdefault(part, {"own": [], "children": {}})
        node["own"].append((parts[-1], p.name))
    return root


def build_model(case, variant: int = 0, dtype: torch.dtype = torch.float32) -> SyntheticModel:
    check_params(case.params)
    init = initial_weights(case, variant)

    def make(tree: dict, cls=Node) -> Node:
        children = tuple((name, make(sub)) for name, sub in tree["children"].items())
        own = tuple((local, full, init[full].to(dtype).clone()) for local, full in tree["own"])
        return cls(own, children)

    root = make(_tree(case), SyntheticModel)
    names = [n for n, _ in root.named_parameters()]
    if sorted(names) != sorted(p.name for p in case.params):
        raise AssertionError(f"model names {names} differ from the case's {[p.name for p in case.params]}")
    return root


# ------------------------------------------------------------------------------------------------
# exact gradients


@functools.lru_cache(maxsize=16)
def _model_dtype_data(case, rank: int, step: int, micro: int) -> dict[str, dict[str, torch.Tensor]]:
    """``batch_data`` of one micro-batch, drawn once for the judge's float64 promotion and its
    half-precision backward replay (``backward_overflows``); shared like ``_float64_data``."""
    return batch_data(case, rank, step, micro)


@functools.lru_cache(maxsize=16)
def _float64_data(case, rank: int, step: int, micro: int) -> dict[str, dict[str, torch.Tensor]]:
    """``batch_data`` promoted to float64, shared by the verdict's consumers of one micro-batch.

    The judge asks for the same micro-batch several times (the exact gradient, its magnitudes, the
    bug model's second replay); on the NVMe cases' 1 MiB-per-rank matrix drawing and promoting it
    was a quarter of the judge. Cases are frozen, so the case itself is the key; 16 entries hold
    every micro-batch of a 3-step, 3-rank, 2-micro case's step and bound the parent's memory. The
    tensors are shared: callers must not modify them (none does)."""
    return {name: {k: v.to(torch.float64) for k, v in d.items()}
            for name, d in _model_dtype_data(case, rank, step, micro).items()}


def local_gradients(params_f64: dict[str, torch.Tensor], case, rank: int, step: int,
                    micro: int) -> dict[str, torch.Tensor]:
    """Exact float64 gradient of one rank's UNSCALED micro-batch loss (no 1/GAS, no 1/W, no loss
    scale) at the weights ``params_f64`` (name -> tensor of the declared shape; values are used as
    given, so pass the low-precision model weights as float64 to mirror a half-precision forward).
    The data is the model-dtype-rounded data DeepSpeed sees, promoted exactly to float64."""
    data = _float64_data(case, rank, step, micro)
    B = case.batch
    out = {}
    for p in case.params:
        w = params_f64[p.name].to(torch.float64)
        if p.name not in data:  # unused at this step: DeepSpeed's zero gradient
            out[p.name] = torch.zeros_like(w)
            continue
        d = data[p.name]
        if len(p.shape) >= 2:
            r, c = matrix_view(p.shape)
            w2 = w.reshape(r, c)
            R = d["X"] @ w2.T - d["T"]  # B x r
            g = (2.0 / (B * r)) * (R.T @ d["X"]) + (2.0 / (r * c)) * d["D"] * (w2 - d["C"])
            out[p.name] = g.reshape(p.shape)
        else:
            n = p.shape[0]
            R = w * d["Z"] - d["T"]
            out[p.name] = (2.0 / (B * n)) * (R * d["Z"]).sum(dim=0)
        if "poison" in d:  # the element the model's backward poisons (poison_grad)
            out[p.name].view(-1)[0] = float(d["poison"])
    return out


def gradient_magnitudes(params_f64: dict[str, torch.Tensor], case, rank: int, step: int,
                        micro: int) -> dict[str, torch.Tensor]:
    """Per gradient element, the sum of the absolute values of everything that adds up to it in
    ``local_gradients`` (every product, residual part and elementwise term taken positive). The
    model-dtype backward rounds those intermediates, so its error is relative to this scale, not to
    the gradient itself, which cancellation can make far smaller (a 1x1 matrix whose batch rows
    nearly cancel: FUZZ-005)."""
    data = _float64_data(case, rank, step, micro)
    B = case.batch
    out = {}
    for p in case.params:
        w = params_f64[p.name].to(torch.float64).abs()
        if p.name not in data:
            out[p.name] = torch.zeros_like(w)
            continue
        d = {k: v.abs() for k, v in data[p.name].items()}
        if len(p.shape) >= 2:
            r, c = matrix_view(p.shape)
            w2 = w.reshape(r, c)
            R = d["X"] @ w2.T + d["T"]
            g = (2.0 / (B * r)) * (R.T @ d["X"]) + (2.0 / (r * c)) * d["D"] * (w2 + d["C"])
            out[p.name] = g.reshape(p.shape)
        else:
            n = p.shape[0]
            R = w * d["Z"] + d["T"]
            out[p.name] = (2.0 / (B * n)) * (R * d["Z"]).sum(dim=0)
    return out


def backward_overflows(lp_weights: dict[str, torch.Tensor], case, rank: int, step: int, micro: int,
                       scale: float) -> bool:
    """Whether this rank's half-precision backward of ``scale * loss / GAS`` produces a non-finite
    gradient. The float64 gradient cannot say: an *intermediate* of the fp16 backward (e.g. the
    scaled elementwise term ``S * D``) can pass 65504 while the final gradient stays small, and
    DeepSpeed then (rightly) skips the step. Run the same loss in the model dtype, as the engine
    does (``loss / GAS`` first, then times the scale), and look. Only meaningful for fp16 (bf16 and
    fp32 have fp32's range).

    Only the gradients decide, as in DeepSpeed, whose overflow test reads the gradients alone: the
    forward value of the scaled loss is never read by the backward (the product's derivative is the
    scale itself), so a scaled loss past 65504 (10.8 x 2^15) with finite gradients is an applied step.
    A scale of 2^16 itself is past fp16's range: the backward's first product is already inf."""
    dtype = MODEL_DTYPES[case.dtype]
    data = _model_dtype_data(case, rank, step, micro)
    leaves = {p.name: lp_weights[p.name].to(dtype).clone().requires_grad_(True) for p in case.params}
    total = None
    for p in case.params:
        if p.name not in data:
            continue
        t = term_loss(leaves[p.name], data[p.name])
        total = t if total is None else total + t
    ((total / case.grad_accum) * scale).backward()
    return any(not bool(torch.isfinite(leaves[n].grad).all()) for n in data)


def local_loss(params_f64: dict[str, torch.Tensor], case, rank: int, step: int, micro: int) -> float:
    """float64 value of the same loss (for cross-checks)."""
    data = batch_data(case, rank, step, micro)
    total = 0.0
    for p in case.params:
        if p.name not in data:
            continue
        d = {k: v.to(torch.float64) for k, v in data[p.name].items()}
        total += float(term_loss(params_f64[p.name].to(torch.float64), d))
    return total
