"""The checked-in equivalent mutants (``equivalents.txt`` beside this module).

One line per mutant: its key (``file:line:col operator#occurrence``, as the report prints it), ``|``,
and a one-line reason it cannot change what a Muon step computes on any path the gate runs (a
mutated log message, a branch dead on CPU, a guard whose both sides give the same value). A survivor
not listed here fails the sampled run.
"""
from __future__ import annotations

from pathlib import Path

EQUIVALENTS_FILE = Path(__file__).with_name("equivalents.txt")


def load(path: Path = EQUIVALENTS_FILE) -> dict[str, str]:
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
