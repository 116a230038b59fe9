"""Shapes for ``python -m harness check``: parsing ``--shapes`` and the scale-down rule
(``scale_shapes``; the rule and what it keeps are in ``harness.cli.check``'s docstring)."""
from __future__ import annotations

import math
import re

from harness.case.spec import ParamShape
from harness.cli.check_config import BadInput

MAX_TENSOR_NUMEL = 65_536
MAX_TOTAL_NUMEL = 262_144
MIN_DIM = 8
MAX_SHAPES = 16
MAX_DIMS = 4


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    entries = [e.strip() for e in text.split(",")]
    if not text.strip():
        raise BadInput("malformed --shapes: empty; expected e.g. 4096x4096,4096x11008")
    out = []
    for i, e in enumerate(entries, 1):
        parts = re.split(r"[xX*]", e)
        if not e or any(not re.fullmatch(r"\d+", p.strip()) for p in parts):
            raise BadInput(f"malformed --shapes: entry {i} {e!r} is not dimensions like 4096x11008 "
                           "(positive integers joined by 'x', entries separated by commas)")
        dims = tuple(int(p) for p in parts)
        if any(d < 1 for d in dims):
            raise BadInput(f"malformed --shapes: entry {i} {e!r} has a zero dimension")
        if len(dims) > MAX_DIMS:
            raise BadInput(f"malformed --shapes: entry {i} {e!r} has {len(dims)} dimensions (at most {MAX_DIMS})")
        out.append(dims)
    if len(out) > MAX_SHAPES:
        raise BadInput(f"malformed --shapes: {len(out)} entries (at most {MAX_SHAPES})")
    return out


def padded_ranks(numel: int, world_size: int) -> tuple[int, ...]:
    """ZeRO-3 ranks whose partition of a ``numel``-element parameter holds padding."""
    q = -(-numel // world_size)
    return tuple(r for r in range(world_size) if (r + 1) * q > numel)


def _scale_dim(d: int, lin: float, m: int) -> int:
    r = d % m
    lo = min(d, MIN_DIM)
    v = r + m * round((d * lin - r) / m)
    if v < lo:
        v = r + m * math.ceil((lo - r) / m)
    return max(1, min(v, d))


def scale_shapes(shapes, world_size: int, *, max_tensor: int = MAX_TENSOR_NUMEL,
                 max_total: int = MAX_TOTAL_NUMEL) -> tuple[list[tuple[int, ...]], float]:
    """The module docstring's rule: (scaled shapes, element factor f). Unscaled when within budget."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if not shapes:
        return [], 1.0
    numels = [math.prod(s) for s in shapes]
    f = min(1.0, max_tensor / max(numels), max_total / sum(numels))
    if f >= 1.0:
        return shapes, 1.0
    m = 2 * world_size
    out = []
    for s, n in zip(shapes, numels):
        # Dimensions already at or below MIN_DIM cannot shrink; the others share the factor.
        big = [i for i, d in enumerate(s) if d > MIN_DIM] or list(range(len(s)))
        lin = f ** (1.0 / len(big))
        dims = [_scale_dim(d, lin, m) if i in big else d for i, d in enumerate(s)]
        # Rounding and the floors can leave a tensor above its share: shrink its largest dimension
        # in steps of 2W (residues stay) while it can.
        limit = max(1.25 * n * f, 1.0)
        while math.prod(dims) > limit:
            can = [i for i in range(len(dims)) if dims[i] - m >= min(s[i], MIN_DIM)]
            if not can:
                break
            i = max(can, key=lambda j: dims[j])
            dims[i] -= m
        # Repair the ZeRO-3 padded-partition pattern (only small tensors can miss it).
        want = padded_ranks(n, world_size)
        while padded_ranks(math.prod(dims), world_size) != want:
            grow = [i for i in range(len(dims)) if dims[i] + m <= s[i]]
            if not grow:
                dims = list(s)
                break
            i = min(grow, key=lambda j: dims[j] / s[j])  # the most shrunk dimension first
            dims[i] += m
        out.append(tuple(dims))
    return out, f


def _fmt_shape(s) -> str:
    return "x".join(str(d) for d in s)


def build_params(shapes) -> tuple[ParamShape, ...]:
    """Matrices ``layers.<i>.weight`` (Muon) each followed by ``layers.<i>.bias`` (Adam, its rows);
    a 1-D shape is ``layers.<i>.scale`` (Adam)."""
    params = []
    for i, s in enumerate(shapes):
        if len(s) >= 2:
            params.append(ParamShape(f"layers.{i}.weight", tuple(s)))
            params.append(ParamShape(f"layers.{i}.bias", (s[0],)))
        else:
            params.append(ParamShape(f"layers.{i}.scale", tuple(s)))
    return tuple(params)


