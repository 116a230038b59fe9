"""The HTML divergence report: one self-contained file rendered from stored results.

``render(records_root, out_html)`` reads what ``harness.report.results.ResultStore`` wrote (every writer's
``results-*.jsonl``, the ``maps/<key>.npz`` element-wise error maps, and any ``extra-*.json`` the
pytest plugin or the gate stored next to them) and writes one HTML file with no external reference
(no network, no CDN: it is opened from CI artifacts). Rebuilding a report never reruns a case::

    python -m harness report reports/results -o reports/divergence.html

Layout of the page, summary first:

* the verdict and the counts (passed / failed / strict xfail by bug id / xpassed / error / skipped);
* the case x column grid (stock vs patched), each cell linking to the case's details;
* the mutation kill matrix, when the gate (``extra["mutations"]``) or mutant columns supply one;
* the environment (torch, DeepSpeed, Python, CPU, seed);
* one collapsed ``<details>`` per failed / xfailed / xpassed / error outcome: bug, reproducer, the
  message, a table of quantities (worst error vs its allowance), an error-vs-step plot per quantity,
  a heatmap of the element-wise error/allowance ratio over the flattened ZeRO layout of each failing
  parameter (rank partition boundaries and padded tail drawn), and the case JSON;
* the passing outcomes as compact rows with their worst error-to-allowance ratio.

Plots are inlined under a budget (``report_html.plotted_outcomes``: the worst few outcomes of each
kind of failure and of each bug), so that a ``--full`` run's page stays a few MB and renders in
seconds; the other outcomes name the ``--only NAME --all-plots`` command that draws theirs.

Where it lives: this module reads the stored results (``render``, the ``extra`` files);
``harness.report.html`` builds the page, ``harness.report.plots`` draws the plots, and the page's
styles and script are plain files in ``harness/report/static/``.

Plots are drawn by matplotlib (``Figure`` objects, no pyplot state; SVG backend) and inlined as SVG
with text kept as text, coordinates rounded, ids made unique per figure and images (the heatmap
strip, the colour bar) embedded as small PNGs, so ~40 failing cases stay well under a few MB.

``extra`` (all keys optional)::

    {"environment": {"torch": "...", ...},                       # shown as given, over the defaults
     "mutations": [{"mutant": "M1", "description": "...",
                    "killed": {"case-a": True, "case-b": False},  # or a list + "mutation_cases"
                    "killed_by": ["case-a"]}, ...],
     "mutation_cases": ["case-a", "case-b"],                      # column order when killed is a list
     "notes": ["free text", ...],
     "verdict_reasons": ["extra reason the run failed", ...],    # any entry makes the verdict FAIL
     "check": {"verdict_lines": [...], "exit_code": 1, "config": "/abs/config.json",
               "resolved": [[key, value, source], ...], "unknown_keys": [...], "notes": [...],
               "params": [[name, shape, "Muon"|"Adam", why], ...]}}  # python -m harness check: the page
                                                                     # leads with the check's verdict, not PASS/FAIL
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from harness.report.html import DETAIL_STATUSES, build_html, page_verdict, plotted_outcomes
from harness.report.html import environment_info  # noqa: F401 - the report's API
from harness.report.plots import MAX_CELLS, heatmap_svg, maxpool, steps_svg  # noqa: F401 - the report's API
from harness.report.results import completeness, load_records

# --------------------------------------------------------------------------------------------- API


def render(records_root, out_html, *, title: str | None = None, extra: dict | None = None,
           heatmaps_per_param: int = 1, only: str | None = None, all_plots: bool = False,
           records: list | None = None) -> Path:
    """Render the report of the results stored under ``records_root`` into ``out_html``.

    ``extra`` is merged over what is stored in ``records_root/extra-*.json`` (see the module doc).
    ``only``: keep the outcomes whose case name contains it (the page then says so: its verdict is
    the subset's). ``all_plots``: lift the plot budget (``report_html.plotted_outcomes``), for a
    page of a few cases. ``records``: the folder's records where the caller has read them already
    (``load_records``; a ``--full`` folder takes ~2 s to read). Returns the path written. Works on an
    empty or missing results folder.
    """
    root = Path(records_root)
    if records is None:
        records = load_records(root) if root.exists() else []
    merged = merge_extra(_with_completeness(root, records), extra or {})
    if only:
        records = [r for r in records if only in r.case_name]
        merged = merge_extra(merged, {"notes": [f"Only the outcomes of cases whose name contains {only!r}: "
                                                "the verdict is this subset's, not the run's."]})
        merged.pop("mutations", None)
    page = build_html(records, lambda key: _LazyMaps(root / "maps" / f"{key}.npz"),
                      title=title, extra=merged, source=str(root), heatmaps_per_param=heatmaps_per_param,
                      all_plots=all_plots)
    out = Path(out_html)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out


def verdict(records_root, only: str | None = None, records: list | None = None) -> tuple[bool, list[str]]:
    """The report's PASS/FAIL and its reasons, without rendering: the exit code of ``python -m
    harness report`` (a CI job that merges shards fails exactly when the merged report says FAIL).
    ``records``: the folder's, where the caller has read them (as for ``render``)."""
    root = Path(records_root)
    if records is None:
        records = load_records(root) if root.exists() else []
    extra = _with_completeness(root, records)
    if only:
        records = [r for r in records if only in r.case_name]
        extra.pop("mutations", None)
    return page_verdict(records, extra)


def prune_maps(records_root, records: list | None = None) -> tuple[int, int]:
    """Drop the element maps the report does not draw (``html.plotted_outcomes``: the worst few per kind
    of failure): they are most of a gate's results folder (a 6 MB map of one large model's strict xfail),
    and the record keeps every number of every check. Only for a complete folder: a resumed run's new
    failures may push another outcome into the drawn set. Returns (maps kept, maps removed); an
    outcome's full maps come back with ``python -m harness run --case ... --report``."""
    root = Path(records_root)
    bad = [r for r in (load_records(root) if records is None else records) if r.status in DETAIL_STATUSES]
    keep = plotted_outcomes(bad)
    kept = removed = 0
    for path in sorted((root / "maps").glob("*.npz")):
        if path.stem in keep:
            kept += 1
        else:
            path.unlink()
            removed += 1
    return kept, removed


def incomplete(records_root, records: list | None = None) -> str | None:
    """The INCOMPLETE headline of a folder whose runs did not judge all they planned, else None."""
    return _with_completeness(Path(records_root), records).get("incomplete")


def _with_completeness(root: Path, records) -> dict:
    """The stored extra, with the INCOMPLETE headline when the folder's runs planned more than it holds."""
    extra = load_stored_extra(root)
    if root.exists():
        state = completeness(root, records)
        if not state.complete:
            extra["incomplete"] = state.headline(root)
    return extra


class _LazyMaps(Mapping):
    """The element maps of one outcome, read from its ``.npz`` only when drawn: an outcome keeps a
    map per failing (param, quantity, step), a few of which the report shows."""

    def __init__(self, path: Path):
        self.path = path
        self._keys = None
        self._cache: dict[str, np.ndarray] = {}

    def _files(self) -> list[str]:
        if self._keys is None:
            self._keys = []
            if self.path.exists():
                with np.load(self.path) as z:
                    self._keys = list(z.files)
        return self._keys

    def __iter__(self):
        return iter(self._files())

    def __len__(self) -> int:
        return len(self._files())

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._cache:
            if key not in self._files():
                raise KeyError(key)
            with np.load(self.path) as z:
                self._cache[key] = z[key]
        return self._cache[key]


def save_extra(records_root, extra: dict, name: str = "main") -> Path:
    """Store ``extra`` next to the results (``extra-<name>.json``) so a rebuilt report shows it too."""
    root = Path(records_root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"extra-{name}.json"
    path.write_text(json.dumps(extra, sort_keys=True, default=str, indent=1))
    return path


def load_stored_extra(records_root) -> dict:
    out: dict = {}
    root = Path(records_root)
    if not root.exists():
        return out
    for path in sorted(root.glob("extra-*.json")):
        try:
            out = merge_extra(out, json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def merge_extra(base: dict, over: dict) -> dict:
    """Dicts merge key by key, mutation rows by mutant name (later wins), other lists concatenate."""
    out = dict(base)
    for k, v in over.items():
        if k == "mutations":
            rows = {r.get("mutant", str(i)): r for i, r in enumerate(out.get(k, []))}
            for i, r in enumerate(v or []):
                rows[r.get("mutant", f"#{len(rows) + i}")] = r
            out[k] = list(rows.values())
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        elif isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = out[k] + [x for x in v if x not in out[k]]
        else:
            out[k] = v
    return out
