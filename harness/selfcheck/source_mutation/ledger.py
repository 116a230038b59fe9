"""The record of judged source mutants (``<column>-<source digest>.jsonl`` under ``reports/mutation-ledger``,
or ``$MUON_HARNESS_LEDGER``): an output of ``python -m harness mutate``, never committed.

Why it exists: the whole scope is ~3800 mutants, ~3000 of them judged by running cases (the rest are
not reached, listed equivalent, or replaced by a fix); at a few seconds per kill and a minute or more
per survivor that is most of a working day on two cores, longer than a machine is usually kept,
and the engine's sqlite sessions live in a per-machine cache that a fresh machine does not have. So
every judged result (killed or survived) of any session, sample or ``--only`` run is appended there, and
a session built without ``--fresh`` takes its results for those keys from here instead of judging them
again: the whole-scope run resumes after an interruption (copy the folder to resume on another machine),
and since Cosmic Ray's job ids order
the pending mutants at random, a part-way run is a uniform sample of the scope.

What a line claims: this mutant, of the scoped source with this digest, on this column, was killed
(by which case) or survived every case that executed its line, as judged by the harness at ``commit``.
A kill carries over while its case still exists; a survivor is made pending again by ``--retry
survived`` after a new case. ``--fresh`` ignores the ledger and judges everything (the CI sample
does). Standard library only: the engine's interpreter reads it when it builds a session.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

LEDGER_DIR = Path(os.environ.get("MUON_HARNESS_LEDGER")
                  or Path(__file__).resolve().parents[3] / "reports" / "mutation-ledger")
JUDGED = ("killed", "survived")  # the statuses worth carrying: each cost a run of cases
_KEEP = ("status", "by", "how", "nearest", "seconds", "column")


def path_for(column: str, digest: str, root: Path = LEDGER_DIR) -> Path:
    return root / f"{column}-{digest}.jsonl"


def load(path: Path) -> dict[str, dict]:
    """key -> the newest line for it (a later line supersedes an earlier one)."""
    out: dict[str, dict] = {}
    if not path.exists():
        return out
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            out[rec["key"]] = rec
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{path}:{n}: not a ledger line ({exc}): {raw[:120]!r}") from None
    return out


def append(path: Path, results: dict[str, dict], commit: str) -> int:
    """Add the judged ones of ``results`` (key -> the worker's record) that differ from what the ledger
    already says; returns how many lines were written."""
    have = load(path)
    lines = []
    for key in sorted(results):
        rec = results[key]
        if rec.get("status") not in JUDGED or rec.get("from_ledger"):
            continue
        entry = {"key": key, **{k: rec[k] for k in _KEEP if k in rec}, "commit": commit}
        old = have.get(key)
        if old is not None and all(old.get(k) == entry.get(k) for k in ("status", "by", "nearest")):
            continue
        lines.append(json.dumps(entry, sort_keys=True))
    if lines:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write("\n".join(lines) + "\n")
    return len(lines)


def as_record(entry: dict) -> dict:
    """The worker-style record a session stores for a mutant taken from the ledger."""
    rec = {k: entry[k] for k in _KEEP if k in entry}
    rec["from_ledger"] = entry.get("commit", "?")
    return rec
