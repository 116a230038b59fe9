"""The checked-in equivalent mutants (``equivalents.txt`` beside this module).

One line per mutant: its key (``file:line:col operator#occurrence``, as the report prints it), ``|``,
and a one-line reason it cannot change what a Muon step computes on any path the gate runs (a
mutated log message, a branch dead on CPU, a guard whose both sides give the same value). A survivor
not listed here fails the sampled run.
"""
from __future__ import annotations

import os
from pathlib import Path

from harness.selfcheck.source_mutation import scope

EQUIVALENTS_FILE = Path(__file__).resolve().parents[2] / "data" / "equivalents.txt"
# Equivalent only with the patched runtime applied (a fix takes the mutated code off every path, e.g. no fp16
# tensor reaches it): listed apart, so that the stock column still judges them.
PATCHED_FILE = Path(__file__).resolve().parents[2] / "data" / "equivalents-patched.txt"


def load(column: str = "stock") -> dict[str, str]:
    """The equivalents of a column: ``equivalents.txt``, and on the patched column ``equivalents-patched.txt``
    too (a key may not be in both). None for another tree (``scope.TREE_ENV``): a key is a position in
    0.19.8's files, which on another tree names some other token, and its first run is judged untriaged."""
    if os.environ.get(scope.TREE_ENV):
        return {}
    out = read(EQUIVALENTS_FILE)
    if column == "patched":
        extra = read(PATCHED_FILE)
        both = sorted(set(out) & set(extra))
        if both:
            raise ValueError(f"{PATCHED_FILE.name}: already equivalent on both columns: {both}")
        out.update(extra)
    return out


def read(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, reason = line.partition("|")
        if not sep or not reason.strip():
            raise ValueError(f"{path}:{n}: expected 'KEY | reason', got {raw!r}")
        out[key.strip()] = reason.strip()
    return out
