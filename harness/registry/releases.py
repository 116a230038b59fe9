"""The releases a registered bug was measured on, as each registry entry states them.

Why a module of its own: ``harness.registry.bugs`` and ``harness.registry.historical`` both write their
entries' ``releases`` with :func:`measured`, and ``historical`` must not import ``bugs`` (``bugs`` builds
its entries). The releases themselves, and which of them a gate run was made on, are the version
layer's (``harness.env.versions.RELEASES``, ``MEASURED``). Which slice and which cases each entry's
measurement came from is in the README's "DeepSpeed versions" section and in the comments of the table
these entries replace (``harness/env/versions.py`` at commit 4c8e889).
"""
from __future__ import annotations

from harness.env import versions


def _expand(spec: str) -> list[str]:
    """``"0.18.9 0.19.3-0.19.5"`` -> every known release named or inside a range (both ends included)."""
    out = []
    for part in spec.split():
        lo, _, hi = part.partition("-")
        hi = hi or lo
        for end in (lo, hi):
            if end not in versions.RELEASES:
                raise ValueError(f"{end!r} is not a release the harness knows ({versions.RELEASES})")
        out.extend(r for r in versions.RELEASES
                   if versions.in_range(r, lo, None) and (r == hi or versions.in_range(r, None, hi)))
    return out


def measured(yes: str = "", no: str = "") -> dict[str, bool]:
    """A bug's measured releases: ``yes`` where a gate run showed it (its cases diverged as its model says,
    or crashed or were refused as it says), ``no`` where its cases passed. A release in neither was not
    measured for the bug, which then excuses nothing there."""
    present, absent = _expand(yes), _expand(no)
    both = sorted(set(present) & set(absent))
    if both:
        raise ValueError(f"measured both present and absent on {both}")
    return {r: r in present for r in versions.RELEASES if r in present or r in absent}


def spans(releases) -> str:
    """The inverse of ``measured``'s reading: ``["0.19.0", "0.19.1", "0.19.8"]`` -> ``"0.19.0-0.19.1 0.19.8"``
    (runs of consecutive known releases)."""
    idx = sorted(versions.RELEASES.index(r) for r in releases)
    out: list[str] = []
    start = prev = None
    for i in idx + [None]:
        if prev is not None and (i is None or i != prev + 1):
            lo, hi = versions.RELEASES[start], versions.RELEASES[prev]
            out.append(lo if lo == hi else f"{lo}-{hi}")
            start = None
        if start is None:
            start = i
        prev = i
    return " ".join(out)
