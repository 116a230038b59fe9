"""The HTML divergence report: one self-contained file rendered from stored results.

``render(records_root, out_html)`` reads what ``harness.results.ResultStore`` wrote (every writer's
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
     "verdict_reasons": ["extra reason the run failed", ...]}     # any entry makes the verdict FAIL
"""
from __future__ import annotations

import html
import io
import itertools
import json
import math
import os
import platform
import re
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Iterable

import numpy as np

from harness.results import CaseRecord, CheckRow, load_records

DETAIL_STATUSES = ("failed", "xpassed", "error", "xfailed")  # statuses that get a details section
BAD_STATUSES = ("failed", "xpassed", "error")  # statuses that make the verdict FAIL
MAIN_COLUMNS = ("stock", "patched")  # other columns are mutants: they feed the kill matrix
MAX_CELLS = 2048  # heatmap strip cells (max-pooled beyond this)
MAX_HEATMAPS_PER_CASE = 4
GRID_ROWS = 40  # rows per table of the case x column grid (longer grids wrap into side-by-side tables)
HUGE = 1e300  # results store non-finite ratios as +-1e308

_fig_counter = itertools.count()
_KNOWN_EXTRA = ("environment", "mutations", "mutation_cases", "notes", "verdict_reasons", "title")


# --------------------------------------------------------------------------------------------- API


def render(records_root, out_html, *, title: str | None = None, extra: dict | None = None,
           heatmaps_per_param: int = 1) -> Path:
    """Render the report of the results stored under ``records_root`` into ``out_html``.

    ``extra`` is merged over what is stored in ``records_root/extra-*.json`` (see the module doc).
    Returns the path written. Works on an empty or missing results folder (an empty report).
    """
    root = Path(records_root)
    records = load_records(root) if root.exists() else []
    merged = merge_extra(load_stored_extra(root), extra or {})
    page = build_html(records, lambda key: _LazyMaps(root / "maps" / f"{key}.npz"),
                      title=title, extra=merged, source=str(root), heatmaps_per_param=heatmaps_per_param)
    out = Path(out_html)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out


def verdict(records_root) -> tuple[bool, list[str]]:
    """The report's PASS/FAIL and its reasons, without rendering: the exit code of ``python -m
    harness report`` (a CI job that merges shards fails exactly when the merged report says FAIL)."""
    root = Path(records_root)
    records = load_records(root) if root.exists() else []
    extra = load_stored_extra(root)
    main = [r for r in records if not _is_mutant(r)]
    return _verdict(main, _mutation_rows(extra, [r for r in records if r not in main]), extra)


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


def environment_info(seed=None) -> dict:
    """What the summary shows about the machine; cheap (no import of torch or DeepSpeed)."""
    from importlib import metadata

    env = {}
    for dist in ("torch", "deepspeed", "numpy", "matplotlib"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = "not installed"
    env["python"] = platform.python_version()
    env["platform"] = platform.platform()
    env["cpu"] = _cpu_name()
    env["cpu_count"] = str(os.cpu_count())
    if seed is not None:
        env["seed"] = str(seed)
    env["collected"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return env


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------------------------ page building


def build_html(records: list[CaseRecord], maps_for, *, title: str | None = None, extra: dict | None = None,
               source: str = "", heatmaps_per_param: int = 1) -> str:
    """The whole page as a string; ``maps_for(key)`` returns the stored maps of a record."""
    extra = extra or {}
    title = title or extra.get("title") or "Muon / DeepSpeed ZeRO divergence report"
    main = [r for r in records if not _is_mutant(r)]
    mutant_recs = [r for r in records if r not in main]
    anchors = _anchors(main)
    mutations = _mutation_rows(extra, mutant_recs)
    verdict_ok, reasons = _verdict(main, mutations, extra)

    parts = [_head(title), "<body>"]
    parts.append(_verdict_block(title, verdict_ok, reasons, main, source))
    parts.append(_nav(main, mutations))
    parts.append(_counts_block(main))
    parts.append(_failure_list(main, anchors))
    if mutations:
        parts.append(_mutation_block(mutations, extra))
    parts.append(_env_block(extra, main))
    parts.append(_grid_block(main, anchors))
    parts.append(_details_block(main, anchors, maps_for, heatmaps_per_param))
    parts.append(_passed_block(main))
    if extra.get("notes"):
        parts.append("<section id='notes'><h2>Notes</h2><ul>" + "".join(
            f"<li>{_e(n)}</li>" for n in extra["notes"]) + "</ul></section>")
    parts.append(f"<footer>Rendered {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} by "
                 f"<code>harness.report</code> from {len(records)} stored outcome(s). "
                 f"Rebuild: <code>python -m harness report {_e(source or 'RESULTS_DIR')}</code></footer>")
    parts.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(parts)


def _is_mutant(r: CaseRecord) -> bool:
    if r.column in MAIN_COLUMNS:
        return False
    try:  # another column is a mutant's when its case installs one; otherwise it is shown in the grid
        return bool(json.loads(r.case_json).get("mutant"))
    except ValueError:
        return True


def _anchors(records: list[CaseRecord]) -> dict[str, str]:
    return {r.key: f"case-{re.sub(r'[^A-Za-z0-9_-]', '_', r.case_name)}-{r.column}-{r.key[:6]}" for r in records}


def _verdict(main, mutations, extra) -> tuple[bool, list[str]]:
    counts = Counter(r.status for r in main)
    reasons = []
    for st in BAD_STATUSES:
        if counts[st]:
            why = " (strict: an expected bug did not show)" if st == "xpassed" else ""
            reasons.append(f"{counts[st]} {st}{why}")
    survived = [m["mutant"] for m in mutations if not m["any_killed"]]
    if survived:
        reasons.append(f"{len(survived)} mutant(s) survived: {', '.join(survived)}")
    reasons += [str(x) for x in extra.get("verdict_reasons", [])]
    if not main and not mutations:
        reasons.append("no results stored")
    return not reasons, reasons


def _head(title: str) -> str:
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{_e(title)}</title><link rel='icon' href='data:,'>"
            f"<style>{_CSS}</style></head>")


def _verdict_block(title, ok, reasons, main, source) -> str:
    cls = "pass" if ok else "fail"
    word = "PASS" if ok else "FAIL"
    why = "all outcomes as expected" if ok else "; ".join(reasons)
    total_s = sum(r.seconds for r in main if math.isfinite(r.seconds))
    return (f"<header class='verdict {cls}' id='verdict'><h1>{_e(title)}</h1>"
            f"<div class='verdict-line'><span class='vword'>{word}</span> <span class='why'>{_e(why)}</span></div>"
            f"<div class='sub'>{len(main)} outcome(s), {total_s:.1f} s of case time; results: "
            f"<code>{_e(source)}</code></div></header>")


def _counts_block(main) -> str:
    counts = Counter(r.status for r in main)
    by_bug = Counter(b for r in main if r.status == "xfailed" for b in (r.bug_ids or ["(no bug id)"]))
    cells = []
    for st, label in (("passed", "passed"), ("failed", "failed"), ("xfailed", "strict xfail"),
                      ("xpassed", "xpassed"), ("error", "error"), ("skipped", "skipped")):
        cells.append(f"<div class='count st-{st}{' zero' if not counts[st] else ''}'>"
                     f"<span class='n'>{counts[st]}</span><span class='l'>{label}</span></div>")
    bugs = ""
    if by_bug:
        rows = []
        for bug_id, n in sorted(by_bug.items()):
            b = _bug(bug_id)
            rows.append(f"<tr><td><span class='bug'>{_e(bug_id)}</span></td><td class='num'>{n}</td>"
                        f"<td>{_e(b.title) if b else ''}</td>"
                        f"<td class='symptom'>{_e(b.symptom) if b else ''}</td></tr>")
        bugs = ("<table class='bugs'><thead><tr><th>bug</th><th>xfail</th><th>title</th><th>symptom</th></tr></thead>"
                "<tbody>" + "".join(rows) + "</tbody></table>")
    cols = sorted({r.column for r in main}, key=_col_order)
    per_col = ""
    if len(cols) > 1:
        head = "".join(f"<th>{_e(st)}</th>" for st in STATUS_ORDER)
        body = ""
        for c in cols:
            cc = Counter(r.status for r in main if r.column == c)
            body += f"<tr><th>{_e(c)}</th>" + "".join(
                f"<td class='num st-{st}'>{cc[st] or ''}</td>" for st in STATUS_ORDER) + "</tr>"
        per_col = f"<table class='percol'><thead><tr><th>column</th>{head}</tr></thead><tbody>{body}</tbody></table>"
    return f"<section id='counts'><div class='counts'>{''.join(cells)}</div>{per_col}{bugs}</section>"


STATUS_ORDER = ("passed", "failed", "xfailed", "xpassed", "error", "skipped")


def _col_order(c: str):
    return (MAIN_COLUMNS.index(c) if c in MAIN_COLUMNS else len(MAIN_COLUMNS), c)


def _nav(main, mutations) -> str:
    n_detail = sum(r.status in DETAIL_STATUSES for r in main)
    n_pass = len(main) - n_detail
    links = [("counts", "summary")]
    if any(r.status in BAD_STATUSES for r in main):
        links.append(("failures", "unexpected outcomes"))
    if mutations:
        links.append(("mutations", "mutation kill matrix"))
    links += [("environment", "environment"), ("grid", "cases \u00d7 columns")]
    if n_detail:
        links.append(("details", f"details ({n_detail})"))
    if n_pass:
        links.append(("passed", f"passing ({n_pass})"))
    return "<nav>" + " &middot; ".join(f"<a href='#{a}'>{_e(t)}</a>" for a, t in links) + "</nav>"


def _first_line(r: CaseRecord) -> str:
    first = (r.message.splitlines() or [""])[0]
    return first[len(r.case_name):].lstrip(" :") if first.startswith(r.case_name) else first


def _failure_list(main, anchors) -> str:
    """The outcomes that make the verdict FAIL (expected failures are in the grid and the details)."""
    bad = sorted((r for r in main if r.status in BAD_STATUSES),
                 key=lambda r: (DETAIL_STATUSES.index(r.status), r.case_name, _col_order(r.column)))
    if not bad:
        return ""
    items = []
    for r in bad:
        first = _first_line(r)
        items.append(f"<li><a href='#{anchors[r.key]}' class='open-case'>{_badge(r.status)} "
                     f"<b>{_e(r.case_name)}</b></a> "
                     f"<span class='col'>{_e(r.column)}</span> {_bugs(r.bug_ids)} "
                     f"<span class='ratio'>{_ratio_txt(r.worst_ratio)}</span> "
                     f"<span class='msg1'>{_e(first)}</span></li>")
    return (f"<section id='failures'><h2>Unexpected outcomes ({len(bad)})</h2>"
            f"<ul class='faillist'>{''.join(items)}</ul></section>")


def _grid_block(main, anchors) -> str:
    cols = sorted({r.column for r in main}, key=_col_order)
    by_name: dict[str, dict[str, CaseRecord]] = defaultdict(dict)
    for r in main:
        name = r.case_name
        n = 2
        while r.column in by_name[name]:  # same name, different case: keep both rows apart
            name = f"{r.case_name} #{n}"
            n += 1
        by_name[name][r.column] = r
    head = "".join(f"<th>{_e(c)}</th>" for c in cols)
    rows = []
    for name in sorted(by_name):
        cells = []
        for c in cols:
            r = by_name[name].get(c)
            if r is None:
                cells.append("<td class='cell none'>&ndash;</td>")
                continue
            inner = f"{_badge(r.status)} <span class='ratio'>{_ratio_txt(r.worst_ratio)}</span> {_bugs(r.bug_ids)}"
            if r.status in DETAIL_STATUSES:
                inner = f"<a href='#{anchors[r.key]}' class='open-case'>{inner}</a>"
            cells.append(f"<td class='cell st-{r.status}'>{inner}</td>")
        rows.append(f"<tr data-case='{_e(name)}'><th class='cname'>{_e(name)}</th>{''.join(cells)}</tr>")
    return ("<section id='grid'><h2>Cases &times; columns</h2>"
            "<div class='tools'>"
            "<input id='filter' type='search' placeholder='filter cases (substring)' aria-label='filter'>"
            " <button type='button' id='expand-all'>expand all failing</button>"
            " <button type='button' id='collapse-all'>collapse all</button></div>"
            + "<div class='gridwrap'>" + "".join(
                f"<table class='grid'><thead><tr><th>case</th>{head}</tr></thead>"
                f"<tbody>{''.join(chunk)}</tbody></table>"
                for chunk in _chunks(rows, GRID_ROWS)) + "</div>"
            "<p class='hint'>Cell: status, worst error/allowance ratio over all checks (&le;&nbsp;1 is within "
            "tolerance), bug ids of an expected failure. Click a failing cell for its details.</p></section>")


def _chunks(rows: list, size: int) -> list[list]:
    """Near-equal chunks of at most ``size`` rows, so a long grid sits in side-by-side tables."""
    if not rows:
        return [[]]
    k = -(-len(rows) // size)
    per = -(-len(rows) // k)
    return [rows[i:i + per] for i in range(0, len(rows), per)]


def _mutation_rows(extra: dict, mutant_recs: list[CaseRecord]) -> list[dict]:
    """Normalised kill-matrix rows: mutant, description, killed {case: bool|None}, killed_by, any_killed."""
    rows = []
    case_order = list(extra.get("mutation_cases", []))
    for m in extra.get("mutations", []) or []:
        killed = m.get("killed", {})
        if isinstance(killed, (list, tuple)):
            killed = {c: bool(k) for c, k in zip(case_order, killed)}
        else:
            killed = {str(c): (None if k is None else bool(k)) for c, k in killed.items()}
        kb = m.get("killed_by")
        if kb is None:
            kb = [c for c, k in killed.items() if k]
        elif isinstance(kb, str):
            kb = [kb] if kb else []
        rows.append({"mutant": str(m.get("mutant", "?")), "description": str(m.get("description", "")),
                     "killed": killed, "killed_by": list(kb),
                     "any_killed": bool(kb) or any(killed.values())})
    given = {r["mutant"] for r in rows}
    derived: dict[str, dict] = {}
    for r in mutant_recs:  # mutant columns in the stored results: killed = the case did not pass
        if r.column in given:
            continue
        d = derived.setdefault(r.column, {"mutant": r.column, "description": "", "killed": {}, "killed_by": []})
        k = r.status not in ("passed", "skipped")
        d["killed"][r.case_name] = k
        if k:
            d["killed_by"].append(r.case_name)
    if derived:
        try:  # the mutants' own descriptions (the module imports torch: only when mutant outcomes exist)
            from harness.known_bugs import MUTANTS
        except Exception:
            MUTANTS = {}
        for d in derived.values():
            m = MUTANTS.get(d["mutant"])
            d["description"] = str(getattr(m, "description", "") or "")
    for d in derived.values():
        d["any_killed"] = bool(d["killed_by"])
        rows.append(d)
    return rows


def _mutation_block(rows, extra) -> str:
    cases = list(extra.get("mutation_cases", []))
    for r in rows:
        for c in r["killed"]:
            if c not in cases:
                cases.append(c)
    head = "".join(f"<th class='rot'><span>{_e(c)}</span></th>" for c in cases)
    body = []
    for r in rows:
        cells = []
        for c in cases:
            k = r["killed"].get(c)
            cells.append("<td class='k none'>&middot;</td>" if k is None else
                         ("<td class='k yes' title='killed'>&#10003;</td>" if k else
                          "<td class='k no' title='survived'>&#10007;</td>"))
        status = "killed" if r["any_killed"] else "SURVIVED"
        body.append(f"<tr class='{'killed' if r['any_killed'] else 'survived'}'><th>{_e(r['mutant'])}</th>"
                    f"<td class='desc'>{_e(r['description'])}</td>{''.join(cells)}"
                    f"<td class='kb'><b>{status}</b> {_e(', '.join(r['killed_by']))}</td></tr>")
    n_k = sum(r["any_killed"] for r in rows)
    return (f"<section id='mutations'><h2>Mutation kill matrix ({n_k}/{len(rows)} killed)</h2>"
            "<div class='scroll'><table class='kill'><thead><tr><th>mutant</th><th>description</th>"
            f"{head}<th>killed by</th></tr></thead><tbody>{''.join(body)}</tbody></table></div></section>")


def _env_block(extra, main) -> str:
    env = dict(extra.get("environment") or {})
    if not env:
        env = environment_info()
        env["note"] = "collected when the report was rendered (no stored environment)"
    seeds = sorted({str(json.loads(r.case_json).get("seed")) for r in main if r.case_json})
    if "seed" not in env and seeds:
        env["seed"] = ", ".join(seeds)
    elif seeds and "case seeds" not in env and ", ".join(seeds) != str(env["seed"]):
        env["case seeds"] = ", ".join(seeds)
    for k, v in extra.items():  # other scalar extras (e.g. the gate's elapsed_s) are shown here too
        if k not in _KNOWN_EXTRA and isinstance(v, (str, int, float, bool)) and k not in env:
            env[k] = f"{v:.1f}" if isinstance(v, float) else v
    order = ["torch", "deepspeed", "python", "cpu", "cpu_count", "seed", "case seeds"]
    keys = [k for k in order if k in env] + sorted(k for k in env if k not in order)
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(env[k])}</td></tr>" for k in keys)
    return f"<section id='environment'><h2>Environment</h2><table class='env'>{rows}</table></section>"


def _passed_block(main) -> str:
    ok = sorted((r for r in main if r.status not in DETAIL_STATUSES),
                key=lambda r: (-_finite(r.worst_ratio), r.case_name))
    if not ok:
        return ""
    rows = []
    for r in ok:
        w = _finite(r.worst_ratio)
        # bar: log scale, 1e-4 .. 1 fills the cell
        frac = 0.0 if w <= 0 else min(max((math.log10(w) + 4) / 4, 0.0), 1.0)
        rows.append(f"<tr class='st-{r.status}' data-case='{_e(r.case_name)}'><td>{_badge(r.status)}</td>"
                    f"<td class='cname'>{_e(r.case_name)}</td><td>{_e(r.column)}</td><td>{_e(r.mode)}</td>"
                    f"<td class='num'>{_ratio_txt(r.worst_ratio)}</td>"
                    f"<td class='barcell'><span class='bar' style='width:{frac * 100:.0f}%'></span></td>"
                    f"<td class='num'>{r.seconds:.1f}s</td></tr>")
    return (f"<section id='passed'><h2>Passing ({len(ok)})</h2><table class='passed'><thead><tr><th></th><th>case</th>"
            "<th>column</th><th>mode</th><th>worst ratio</th><th>(log, 1e-4 &hellip; 1)</th><th>time</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></section>")


# ------------------------------------------------------------------------------------ case details


def _details_block(main, anchors, maps_for, heatmaps_per_param) -> str:
    bad = sorted((r for r in main if r.status in DETAIL_STATUSES),
                 key=lambda r: (DETAIL_STATUSES.index(r.status), r.case_name, _col_order(r.column)))
    if not bad:
        return ""
    parts = [f"<section id='details'><h2>Details of the outcomes that did not pass ({len(bad)})</h2>"]
    for r in bad:
        parts.append(case_details(r, anchors[r.key], maps_for(r.key) if r.status != "error" else {},
                                  heatmaps_per_param=heatmaps_per_param))
    parts.append("</section>")
    return "\n".join(parts)


def case_details(r: CaseRecord, anchor: str, maps: dict, *, heatmaps_per_param: int = 1) -> str:
    first = _first_line(r)
    out = [f"<details class='case st-{r.status}' id='{anchor}' data-case='{_e(r.case_name)}' "
           f"data-column='{_e(r.column)}'><summary>{_badge(r.status)} <b class='cname'>{_e(r.case_name)}</b> "
           f"<span class='col'>{_e(r.column)}</span> "
           f"{_bugs(r.bug_ids)} <span class='ratio'>worst {_ratio_txt(r.worst_ratio)}</span> "
           f"<span class='msg1'>{_e(first)}</span></summary><div class='body'>"]
    for b_id in r.bug_ids:
        b = _bug(b_id)
        if b:
            out.append(f"<p class='bugline'><span class='bug'>{_e(b.id)}</span> <b>{_e(b.title)}</b>: {_e(b.symptom)}"
                       f" <span class='where'>({_e(b.where)})</span></p>")
    out.append("<h4>Reproduce</h4><div class='repro'><button type='button' class='copy'>copy</button>"
               f"<pre class='cmd'>{_e(r.reproduce)}</pre></div>")
    out.append(f"<h4>Message</h4><pre class='message'>{_e(r.message)}</pre>")
    if r.checks:
        out.append("<h4>Quantities</h4>" + _checks_table(r.checks))
        svg = steps_svg(r.checks, case=r.case_name)
        if svg:
            out.append("<h4>Error vs step <span class='hint'>(solid: worst error; dashed: its allowance; "
                       "steps without a point stayed within tolerance and are not stored)</span></h4>"
                       f"<div class='plot steps'>{_lazy(svg)}</div>")
    chosen = choose_maps(r, maps, per_param=heatmaps_per_param)
    if chosen:
        out.append("<h4>Element-wise error / allowance over the flattened ZeRO layout</h4>")
        for key, (param, quantity, step) in chosen:
            lay = r.layout.get(param)
            ratio = np.asarray(maps[key])
            try:
                svg = heatmap_svg(ratio, lay, case=r.case_name, param=param, quantity=quantity,
                                  step=step, stage=_stage(r), world_size=_world(r))
            except Exception as exc:  # one broken map must not lose the whole report
                svg = f"<p class='warn'>heatmap failed: {_e(repr(exc))}</p>"
            out.append(f"<figure class='heatmap' data-case='{_e(r.case_name)}' data-column='{_e(r.column)}' "
                       f"data-param='{_e(param)}' data-quantity='{_e(quantity)}' data-step='{step}'>{_lazy(svg)}"
                       f"<figcaption>{_e(param)} {_e(quantity)}, step {step}: "
                       f"{_heat_caption(r, param, quantity, step, ratio)}"
                       "</figcaption></figure>")
        n_more = len(maps) - len(chosen)
        if n_more > 0:
            out.append(f"<p class='hint'>{n_more} more element map(s) stored for this outcome "
                       "(other quantities/steps); "
                       "shown: the first divergence of each parameter.</p>")
    elif r.status != "error":
        out.append("<p class='hint'>No element-wise map stored (only step-level quantities diverged, "
                   "or maps were not kept).</p>")
    out.append(f"<h4>Config (case JSON)</h4><pre class='config'>{_e(_pretty(r.case_json))}</pre>")
    if r.notes:
        out.append("<h4>Notes</h4><ul>" + "".join(f"<li>{_e(n)}</li>" for n in r.notes) + "</ul>")
    if r.swapped_bytes is not None:
        out.append(f"<p>bytes swapped to NVMe: {r.swapped_bytes}</p>")
    out.append(f"<p class='meta'>mode {_e(r.mode)} &middot; {r.seconds:.1f} s &middot; key {_e(r.key)}</p>"
               "</div></details>")
    return "".join(out)


def _lazy(svg: str) -> str:
    """Plots of a collapsed case are parsed only when it is opened: the SVG travels as the raw text
    of an inert script element (the page's script inserts it on the first toggle), which halves
    the load time of a 40-failure report. Without JavaScript the tables and text still show."""
    if not svg.startswith("<svg"):
        return svg
    assert "</script" not in svg.lower()
    return f"<script type='text/x-svg' class='lazy-svg'>{svg}</script><noscript>(plot needs JavaScript)</noscript>"


def _stage(r: CaseRecord) -> int:
    try:
        return int(json.loads(r.case_json)["ds_config"].get("zero_optimization", {}).get("stage", 0))
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0


def _world(r: CaseRecord) -> int:
    try:
        return int(json.loads(r.case_json).get("world_size", 1))
    except (ValueError, TypeError):
        return 1


def choose_maps(r: CaseRecord, maps: dict, *, per_param: int = 1, limit: int = MAX_HEATMAPS_PER_CASE):
    """Per parameter, the map(s) of its first divergence (earliest step, then largest ratio)."""
    ratio = {(c.param, c.quantity, c.step): c.worst_ratio for c in r.checks}
    per: dict[str, list] = defaultdict(list)
    for key in maps:
        try:
            param, quantity, step = key.rsplit("|", 2)
            step = int(step)
        except ValueError:
            continue
        per[param].append((step, -ratio.get((param, quantity, step), 0.0), key, (param, quantity, step)))
    chosen = []
    for param in per:
        per[param].sort()
        chosen += per[param][:per_param]
    chosen.sort()  # earliest divergence first across params
    return [(c[2], c[3]) for c in chosen[:limit]]


def _checks_table(checks: list[CheckRow]) -> str:
    groups: dict[tuple[str, str], list[CheckRow]] = defaultdict(list)
    for c in checks:
        groups[(c.param, c.quantity)].append(c)
    rows = []

    def sort_key(item):
        (p, q), cs = item
        bad = [c for c in cs if c.n_bad]
        return (0 if bad else 1, min((c.step for c in bad), default=0), -max(c.worst_ratio for c in cs), p, q)

    for (param, quantity), cs in sorted(groups.items(), key=sort_key):
        bad = [c for c in cs if c.n_bad]
        worst = max(cs, key=lambda c: c.worst_ratio)
        steps = _ranges(sorted({c.step for c in bad}))
        regions = Counter()
        for c in bad:
            regions.update(c.region_counts or {})
        where = "" if worst.rank is None else f"rank {worst.rank}, {worst.region}"
        cls = "bad" if bad else "ok"
        rows.append(
            f"<tr class='{cls}'><td>{_e(param)}</td><td>{_e(quantity)}</td><td>{_e(steps) if bad else 'ok'}</td>"
            f"<td class='num ratio'>{_ratio_txt(worst.worst_ratio)}</td><td class='num'>{_num(worst.error)}</td>"
            f"<td class='num'>{_num(worst.allowance)}</td><td class='num'>{worst.step}</td><td>{_e(where)}</td>"
            f"<td class='num'>{worst.n_bad}/{worst.numel}</td>"
            f"<td>{_e(', '.join(f'{k} {v}' for k, v in sorted(regions.items())))}</td>"
            f"<td class='num'>{_num(worst.actual)}</td><td class='num'>{_num(worst.expected)}</td></tr>")
    return ("<table class='checks'><thead><tr><th>param</th><th>quantity</th><th>failing steps</th><th>worst ratio</th>"
            "<th>worst error</th><th>allowance</th><th>at step</th><th>where</th><th>bad elements</th>"
            "<th>bad by region (all steps)</th><th>actual</th><th>oracle</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def _heat_caption(r: CaseRecord, param, quantity, step, ratio) -> str:
    ratio = np.asarray(ratio, dtype=np.float64).reshape(-1)
    n_bad = int((ratio > 1).sum())
    lay = r.layout.get(param) or {}
    ranks = lay.get("ranks", [])
    txt = f"{n_bad} of {ratio.size} elements above their allowance"
    if ranks:
        txt += "; rank slices " + ", ".join(f"r{rk} [{a}, {b})" for rk, a, b in ranks)
    tails = lay.get("regions", {}).get("padded_tail", [])
    if tails:
        txt += "; padded tail " + ", ".join(f"[{a}, {b})" for a, b in tails)
    if ratio.size > MAX_CELLS:
        txt += f"; max-pooled to {MAX_CELLS} cells"
    return _e(txt)


# ------------------------------------------------------------------------------------------- plots


_SVG_NS = "http://www.w3.org/2000/svg"
_XLINK = "http://www.w3.org/1999/xlink"
_OWN_GIDS = ("boundary-", "heat-axes", "quantity-", "padded-tail", "padding")


def _svg_of(fig) -> str:
    """The figure as inline SVG: no XML prologue, matplotlib's per-artist ``<g id=..>`` wrappers
    dropped (a third of the bytes), coordinates to 0.01 px, and the ids left (references and our
    own gids) made unique within the page, since many figures share one HTML document."""
    import xml.etree.ElementTree as ET

    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    ET.register_namespace("", _SVG_NS)
    ET.register_namespace("xlink", _XLINK)
    root = ET.fromstring(text)
    referenced = set(re.findall(r'(?:href="#|url\(#)([^")]+)', text))
    prefix = f"f{next(_fig_counter)}-"
    g_tag, meta_tag = f"{{{_SVG_NS}}}g", f"{{{_SVG_NS}}}metadata"
    href = f"{{{_XLINK}}}href"

    def clean(el):
        out = []
        for child in list(el):
            if child.tag == meta_tag:
                el.remove(child)
                continue
            clean(child)
            gid = child.get("id")
            if gid is not None and gid not in referenced and not gid.startswith(_OWN_GIDS):
                del child.attrib["id"]
            if child.tag == g_tag and not child.attrib:
                out.append((child, list(child)))
        for child, grandchildren in out:  # splice attribute-less groups into their parent
            i = list(el).index(child)
            el.remove(child)
            for j, gc in enumerate(grandchildren):
                el.insert(i + j, gc)

    clean(root)
    for el in root.iter():
        if el.get("id"):
            el.set("id", prefix + el.get("id"))
        for attr in (href, "href"):
            v = el.get(attr)
            if v and v.startswith("#"):
                el.set(attr, "#" + prefix + v[1:])
        for attr in ("clip-path", "mask", "fill", "style"):
            v = el.get(attr)
            if v and "url(#" in v:
                el.set(attr, v.replace("url(#", "url(#" + prefix))
        d = el.get("d")
        if d:
            el.set("d", re.sub(r"\s+", " ", d).strip())
        if el.text:
            el.text = el.text.strip() if el.tag != f"{{{_SVG_NS}}}text" else el.text
        el.tail = None
    use_tag = f"{{{_SVG_NS}}}use"
    for el in root.iter(use_tag):
        el.attrib.pop("style", None)  # repeats the style of the path it points at
    for el in root.iter(f"{{{_SVG_NS}}}text"):
        st = el.get("style")
        if st:  # the page's CSS gives the font family (see _CSS); keep size, anchor, colour
            el.set("style", re.sub(r"font-family:[^;]*;?\s*", "", st).strip("; "))
        tr = el.get("transform")
        if tr and re.fullmatch(r"rotate\(-?0 [^)]*\)", tr):
            del el.attrib["transform"]
    svg = ET.tostring(root, encoding="unicode")
    svg = re.sub(r"(\d\.\d\d)\d+", r"\1", svg)  # coordinates to 0.01 px (base64 PNG data has no '.')
    svg = re.sub(r"(\d\.\d)0(?=[\s\"])", r"\1", svg)
    return svg


def _rc():
    import matplotlib

    return matplotlib.rc_context({
        "svg.fonttype": "none", "svg.hashsalt": "divergence-report", "svg.image_inline": True,
        "font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "xtick.labelsize": 7, "ytick.labelsize": 7,
        "legend.fontsize": 7, "font.family": "sans-serif", "axes.linewidth": 0.6, "lines.linewidth": 1.1,
        "figure.dpi": 100, "savefig.dpi": 100, "savefig.transparent": True, "font.sans-serif": ["DejaVu Sans"]})


def maxpool(ratio: np.ndarray, max_cells: int = MAX_CELLS) -> np.ndarray:
    """Max-pool a flat map to at most ``max_cells`` cells (bin i covers [i*n/c, (i+1)*n/c))."""
    r = np.asarray(ratio, dtype=np.float64).reshape(-1)
    r = np.where(np.isnan(r), np.inf, r)
    n = r.size
    if n <= max_cells:
        return r
    edges = (np.arange(max_cells) * n) // max_cells
    return np.maximum.reduceat(r, edges)


def heatmap_svg(ratio, layout: dict | None, *, case: str, param: str, quantity: str, step: int, stage: int = 0,
                world_size: int | None = None, max_cells: int = MAX_CELLS) -> str:
    """Strip heatmap of |err|/allowance over the parameter's flat (row-major) elements, as ZeRO
    partitions them. One axes holds three bands sharing the element axis: the rank slices (bottom),
    the colour strip (middle) and a log profile of the same (max-pooled) ratios against the
    allowance line (top). Drawn over all three: the partition boundaries (``boundary-r<k>``, a
    line at the first element of rank k's slice), the padded-tail elements (``padded-tail-<i>``)
    and, for ZeRO-3, the padding appended after the last element (``padding``). One axes instead
    of four keeps a figure at ~50 ms."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    flat = np.asarray(ratio, dtype=np.float64).reshape(-1)
    n = flat.size
    layout = layout or {}
    ranks = [tuple(int(v) for v in x) for x in layout.get("ranks", [])]
    tails = [tuple(int(v) for v in x) for x in layout.get("regions", {}).get("padded_tail", [])]
    W = world_size or (max((rk for rk, _, _ in ranks), default=0) + 1)
    pad = 0
    if stage == 3 and W > 1 and n > 0:
        pad = -(-n // W) * W - n
    xmax = max(n + pad, 1)

    pooled = maxpool(flat, max_cells)
    ok = np.isfinite(pooled) & (pooled < HUGE)
    finite = pooled[ok]
    n_inf = int((~ok).sum())
    hi = float(finite.max()) if finite.size else 1.0
    pos = finite[finite > 0]
    lo = float(pos.min()) if pos.size else 1e-3
    vmax = max(1, math.ceil(math.log10(max(hi, 10.0))))
    vmin = min(-1, math.floor(math.log10(max(lo, 1e-6))))
    logr = np.log10(np.clip(np.where(ok, pooled, 10.0 ** vmax), 10.0 ** vmin, 10.0 ** vmax))

    R0, R1, S0, S1, P0, P1 = 0.0, 0.7, 0.85, 1.85, 2.1, 4.5  # bands: ranks, strip, profile
    top = P1 + 0.25

    def y_of(lr):
        return P0 + (np.asarray(lr) - vmin) / (vmax - vmin) * (P1 - P0)

    with _rc():
        fig = Figure(figsize=(8.6, 2.6))
        ax = fig.add_axes((0.075, 0.2, 0.835, 0.68))
        cax = fig.add_axes((0.925, 0.2 + 0.68 * S0 / top, 0.012, 0.68 * (P1 - S0) / top))
        ax.patch.set_gid("heat-axes")
        norm = TwoSlopeNorm(vmin=vmin, vcenter=0.0, vmax=vmax)
        cells = pooled.size
        ax.imshow(logr[None, :], aspect="auto", cmap="RdYlBu_r", norm=norm, interpolation="none",
                  extent=(0, n, S0, S1), origin="lower")
        # profile of the same ratios, log scale, against the allowance (ratio 1)
        xs = np.arange(cells + 1) * (n / max(cells, 1))
        if cells:
            st = ax.stairs(y_of(logr), xs, color="#333", linewidth=0.8, baseline=None)
            st.set_rasterized(cells > 200)  # a long profile is cheaper as a small PNG than as a path
        y1 = float(y_of(0.0))
        ax.add_patch(Rectangle((0, y1), xmax, P1 - y1, facecolor="#f5b7b1", alpha=0.35, linewidth=0))
        ax.plot([0, xmax], [y1, y1], color="#c0392b", linewidth=0.9, linestyle="--")
        ax.text(0.998 * xmax, y1, "allowance (ratio 1) ", ha="right", va="bottom", fontsize=6.5, color="#c0392b")
        ax.plot([0, xmax], [P0 - 0.08, P0 - 0.08], color="#bbb", linewidth=0.5)
        # rank slices
        colors = ("#d6eaf8", "#fdebd0", "#d5f5e3", "#ebdef0", "#fcf3cf", "#d6dbdf", "#fadbd8", "#d1f2eb")
        for rk, a, b in ranks:
            ax.add_patch(Rectangle((a, R0), b - a, R1 - R0, facecolor=colors[rk % len(colors)], linewidth=0))
            if (b - a) / xmax > 0.045:
                ax.text((a + b) / 2, (R0 + R1) / 2, f"rank {rk}", ha="center", va="center", fontsize=7)
        if pad:
            ax.add_patch(Rectangle((n, R0), pad, S1 - R0, facecolor="#eeeeee", edgecolor="#999999", hatch="////",
                                   linewidth=0)).set_gid("padding")
            if pad / xmax > 0.04:
                ax.text(n + pad / 2, (R0 + R1) / 2, "pad", ha="center", va="center", fontsize=6, color="#555")
        # padded tail: the elements next to the padding, at least a few px wide, marked on top
        min_w = xmax * 0.004
        for i, (a, b) in enumerate(tails):
            w = max(b - a, min_w)
            cx = (a + b) / 2
            ax.add_patch(Rectangle((cx - w / 2, R0), w, S1 - R0, facecolor="none", edgecolor="#8e44ad",
                                   linewidth=1.2, hatch="xx")).set_gid(f"padded-tail-{i}")
            ax.plot([cx], [P1 + 0.12], marker="v", color="#8e44ad", markersize=5)
        if tails:
            ax.text(0.005 * xmax, P1 + 0.12, "\u25bc padded tail", ha="left", va="center", fontsize=7, color="#8e44ad")
        # partition boundaries: at the first element of every rank slice but the first
        for rk, a, b in ranks:
            if a > 0:
                ax.plot([a, a], [R0, P1], color="black", linewidth=1.4)[0].set_gid(f"boundary-r{rk}")
        ax.set_xlim(0, xmax)
        ax.set_ylim(R0, top)
        xt = [t for t in MaxNLocator(nbins=8, integer=True).tick_values(0, xmax) if 0 <= t <= xmax]
        step_t = max(1, math.ceil((vmax - vmin) / 4))
        decades = list(range(vmin, vmax + 1, step_t))
        _ticks(ax, xt, [f"{int(t)}" for t in xt],
               [(R0 + R1) / 2, (S0 + S1) / 2] + [float(y_of(t)) for t in decades],
               ["ranks", "ratio"] + [_log_label(10.0 ** t) for t in decades])
        ax.text(0.5, -0.14, "flat element index (row-major)", transform=ax.transAxes, ha="center", va="top", fontsize=8)
        ax.text(0, 1.03, f"{case}: {param} {quantity}, step {step}  ({n} elements" + (f", {pad} padding" if pad else "")
                + ")" + (f"; {n_inf} non-finite" if n_inf else ""), transform=ax.transAxes, ha="left", va="bottom",
                fontsize=9)
        # colour scale
        cax.imshow(np.linspace(vmin, vmax, 128)[:, None], aspect="auto", cmap="RdYlBu_r", norm=norm,
                   interpolation="none", extent=(0, 1, vmin, vmax), origin="lower")
        _ticks(cax)
        cax.set_ylim(vmin, vmax)
        tr = cax.get_yaxis_transform()
        for t in decades:
            cax.text(1.0, t, " " + _log_label(10.0 ** t), transform=tr, ha="left", va="center", fontsize=6)
        cax.text(0.5, 1.1, "err/allow", transform=cax.transAxes, ha="center", va="bottom", fontsize=6)
        return _svg_of(fig)


def steps_svg(checks: list[CheckRow], *, case: str = "") -> str:
    """One small log-scale panel per quantity with a failing check: worst error (solid) and its
    allowance (dashed) per parameter vs optimizer step; failing points ringed in red."""
    from matplotlib.figure import Figure

    failing_q = []
    for c in sorted(checks, key=lambda c: (c.step, -c.worst_ratio)):
        if c.n_bad and c.quantity not in failing_q:
            failing_q.append(c.quantity)
    if not failing_q:
        return ""
    params = sorted({c.param for c in checks if c.quantity in failing_q and not math.isnan(_pos(c.error))})
    palette = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
    color = {p: palette[i % len(palette)] for i, p in enumerate(params)}
    ncols = min(4, len(failing_q))
    nrows = -(-len(failing_q) // ncols)
    steps_all = sorted({c.step for c in checks if c.quantity in failing_q})
    if len(steps_all) > 8:
        stride = -(-len(steps_all) // 8)
        steps_all = steps_all[::stride]
    W, H = 2.6 * ncols + 0.5, 1.6 * nrows + 0.3
    with _rc():
        fig = Figure(figsize=(W, H))
        left, right, top, bottom = 0.55 / W, 0.15 / W, 0.3 / H, 0.05 / H
        cw, ch = (1 - left - right) / ncols, (1 - top - bottom) / nrows
        for i, q in enumerate(failing_q):
            r, c_ = divmod(i, ncols)
            ax = fig.add_axes((left + c_ * cw + 0.1 / W, 1 - top - (r + 1) * ch + 0.32 / H,
                               cw - 0.55 / W, ch - 0.5 / H))
            ax.set_gid(f"quantity-{q}")
            ys = []
            for p in params:
                pts = sorted((c.step, _pos(c.error), _pos(c.allowance), c.n_bad > 0) for c in checks
                             if c.param == p and c.quantity == q)
                if not pts:
                    continue
                st = [x[0] for x in pts]
                err = np.log10([x[1] for x in pts])
                allow = np.log10([x[2] for x in pts])
                ys += [v for v in list(err) + list(allow) if np.isfinite(v)]
                ax.plot(st, err, "-o", color=color[p], markersize=3)
                ax.plot(st, allow, "--", color=color[p], linewidth=0.9, alpha=0.7)
                bad = [(x[0], math.log10(x[1])) for x in pts if x[3] and not math.isnan(x[1])]
                if bad:
                    ax.plot([b[0] for b in bad], [b[1] for b in bad], "o", markersize=5, markerfacecolor="none",
                            markeredgecolor="#c0392b", markeredgewidth=0.9)
            lo, hi = (math.floor(min(ys)), math.ceil(max(ys))) if ys else (-1, 0)
            if hi == lo:
                hi += 1
            ax.set_ylim(lo - 0.15, hi + 0.15)
            if steps_all:
                ax.set_xlim(min(steps_all) - 0.3, max(steps_all) + 0.3)
            stride = max(1, math.ceil((hi - lo) / 4))
            dec = list(range(lo, hi + 1, stride))
            _ticks(ax, steps_all, [str(v) for v in steps_all], dec, [_log_label(10.0 ** d) for d in dec],
                   grid_y=True)
            ax.text(0.5, 1.03, q, transform=ax.transAxes, ha="center", va="bottom", fontsize=8)
            if r == nrows - 1 or i + ncols >= len(failing_q):
                ax.text(0.5, -0.2, "step", transform=ax.transAxes, ha="center", va="top", fontsize=7)
        x = left + 0.1 / W  # legend as coloured texts (a Legend costs as much as a panel)
        for p in params:
            fig.text(x, 1 - 0.06 / H, "\u2501\u25cf " + p, color=color[p], ha="left", va="top", fontsize=7)
            x += (len(p) + 5) * 0.058 / W
        fig.text(1 - right, 1 - 0.06 / H, "solid: error   dashed: allowance   \u25cb failing", color="#555",
                 ha="right", va="top", fontsize=6.5)
        fig.text(0.1 / W, 0.5, "error (log)", rotation=90, ha="left", va="center", fontsize=7)
        return _svg_of(fig)


# ----------------------------------------------------------------------------------------- helpers


def _ticks(ax, x=(), xlabels=(), y=(), ylabels=(), *, size: float = 7, grid_y: bool = False) -> None:
    """Ticks drawn as one marker line plus plain texts. Matplotlib's own Tick objects (two lines
    and two texts each, laid out one by one, plus the title/label placement passes they trigger)
    are most of a small figure's cost; a report draws a hundred figures."""
    from matplotlib.ticker import NullLocator
    from matplotlib.transforms import offset_copy

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(NullLocator())
        axis.set_minor_locator(NullLocator())
    fig = ax.figure
    if len(x):
        tr = ax.get_xaxis_transform()
        ax.plot(list(x), [0.0] * len(x), linestyle="none", marker=3, markersize=2.5, markeredgewidth=0.6,
                color="black", transform=tr, clip_on=False)
        lab = offset_copy(tr, fig=fig, y=-4, units="points")
        for v, t in zip(x, xlabels):
            ax.text(v, 0, t, transform=lab, ha="center", va="top", fontsize=size)
    if len(y):
        tr = ax.get_yaxis_transform()
        ax.plot([0.0] * len(y), list(y), linestyle="none", marker=0, markersize=2.5, markeredgewidth=0.6,
                color="black", transform=tr, clip_on=False)
        lab = offset_copy(tr, fig=fig, x=-4, units="points")
        for v, t in zip(y, ylabels):
            ax.text(0, v, t, transform=lab, ha="right", va="center", fontsize=size)
        if grid_y:
            gx, gy = [], []
            for v in y:
                gx += [0, 1, float("nan")]
                gy += [v, v, float("nan")]
            ax.plot(gx, gy, color="#cccccc", linewidth=0.3, transform=tr)


def _log_label(v, _pos=None) -> str:
    """Tick label of a log axis as plain text ("1e-5"): mathtext costs a third of a figure's time."""
    if v <= 0:
        return ""
    e = math.log10(v)
    if abs(e - round(e)) < 1e-9:
        e = int(round(e))
        return "1" if e == 0 else ("10" if e == 1 else f"1e{e}")
    return f"{v:.2g}"


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _pos(x: float) -> float:
    x = abs(float(x))
    if not math.isfinite(x) or x >= HUGE:
        return float("nan")
    return x if x > 0 else float("nan")


def _finite(x: float) -> float:
    return float("inf") if (not math.isfinite(x) or abs(x) >= HUGE) else float(x)


def _ratio_txt(x: float) -> str:
    x = _finite(x)
    if math.isinf(x):
        return "inf&times;"
    if x == 0:
        return "0&times;"
    return f"{x:.3g}&times;"


def _num(x: float) -> str:
    x = float(x)
    if abs(x) >= HUGE or not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.6g}"


def _ranges(steps: list[int]) -> str:
    out = []
    for _, grp in itertools.groupby(enumerate(steps), key=lambda t: t[1] - t[0]):
        g = [s for _, s in grp]
        out.append(str(g[0]) if len(g) == 1 else f"{g[0]}\u2013{g[-1]}")
    return ", ".join(out)


def _pretty(case_json: str) -> str:
    try:
        return json.dumps(json.loads(case_json), indent=2, sort_keys=True)
    except ValueError:
        return case_json


_BADGE = {"passed": "PASS", "failed": "FAIL", "xfailed": "XFAIL", "xpassed": "XPASS", "error": "ERROR",
          "skipped": "SKIP"}


def _badge(status: str) -> str:
    return f"<span class='badge st-{_e(status)}'>{_BADGE.get(status, _e(status.upper()))}</span>"


def _bugs(ids: Iterable[str]) -> str:
    out = []
    for i in ids or ():
        b = _bug(i)
        out.append(f"<span class='bug' title='{_e(b.title) if b else ''}'>{_e(i)}</span>")
    return " ".join(out)


def _bug(bug_id: str):
    try:
        from harness.bugs import BY_ID
    except Exception:  # the registry is optional for rendering
        return None
    return BY_ID.get(bug_id)


_CSS = """
:root{--fail:#c0392b;--pass:#1e8449;--xfail:#b9770e;--err:#7d3c98;--muted:#666;--line:#ddd}
*{box-sizing:border-box}
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif;margin:0 auto;max-width:1280px;
padding:0 16px 40px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 6px}
h2{font-size:16px;margin:22px 0 8px;border-bottom:1px solid var(--line);padding-bottom:3px}
h4{margin:14px 0 6px;font-size:13px}
code,pre{font-family:ui-monospace,'DejaVu Sans Mono',Menlo,Consolas,monospace;font-size:12px}
pre{background:#f7f7f7;border:1px solid #e5e5e5;padding:8px;overflow:auto;margin:0}
pre.config{max-height:320px}pre.message{max-height:260px;white-space:pre-wrap;word-break:break-word}
.verdict{margin:12px 0 0;padding:12px 16px;border-radius:6px;border:2px solid}
.verdict.pass{background:#eafaf1;border-color:var(--pass)}.verdict.fail{background:#fdedec;border-color:var(--fail)}
.verdict-line{font-size:16px}.vword{font-weight:700;font-size:22px;margin-right:8px}
.verdict.pass .vword{color:var(--pass)}.verdict.fail .vword{color:var(--fail)}
.sub{color:var(--muted);font-size:12px;margin-top:4px}
.counts{display:flex;gap:10px;flex-wrap:wrap;margin:12px 0}
.count{border:1px solid var(--line);border-radius:6px;padding:6px 14px;min-width:96px;text-align:center}
.count .n{display:block;font-size:22px;font-weight:700}.count .l{font-size:12px;color:var(--muted)}
.count.zero{opacity:.45}
.count.st-failed .n,.count.st-xpassed .n{color:var(--fail)}.count.st-passed .n{color:var(--pass)}
.count.st-xfailed .n{color:var(--xfail)}.count.st-error .n{color:var(--err)}
table{border-collapse:collapse;font-size:12.5px}
th,td{border:1px solid var(--line);padding:3px 7px;text-align:left;vertical-align:top}
thead th{background:#f4f6f7}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.bugs,table.percol{margin:8px 0}
td.symptom{max-width:560px;color:#444}
.badge{display:inline-block;font-size:10.5px;font-weight:700;padding:1px 5px;border-radius:3px;color:#fff;
min-width:44px;text-align:center}
.badge.st-passed{background:var(--pass)}.badge.st-failed,.badge.st-xpassed{background:var(--fail)}
.badge.st-xfailed{background:var(--xfail)}.badge.st-error{background:var(--err)}.badge.st-skipped{background:#999}
.bug{display:inline-block;font-size:11px;background:#fef5e7;border:1px solid #f0b27a;color:#7e5109;padding:0 4px;
border-radius:3px;font-family:ui-monospace,monospace}
.col{font-size:11px;color:var(--muted);border:1px solid var(--line);border-radius:3px;padding:0 4px}
.ratio{font-variant-numeric:tabular-nums;white-space:nowrap}
.msg1{color:#555;font-size:12px}
ul.faillist{margin:0;padding-left:18px}ul.faillist li{margin:2px 0}
a{color:inherit}a.open-case{text-decoration:none}a.open-case:hover b{text-decoration:underline}
.tools{margin:6px 0}.tools input{padding:3px 6px;width:280px}
nav{margin:8px 0 0;font-size:12.5px}nav a{color:#1a5276}
.gridwrap{display:flex;flex-wrap:wrap;gap:14px;align-items:flex-start}
table.grid td,table.grid th{padding:1px 6px}table.grid .badge{font-size:10px;padding:0 4px}
table.grid td.cell{white-space:nowrap}
table.grid th.cname{font-weight:600;font-family:ui-monospace,monospace;font-size:12px}
td.cell.st-failed,td.cell.st-xpassed{background:#fdedec}td.cell.st-xfailed{background:#fef9e7}
td.cell.st-error{background:#f4ecf7}td.cell.none{color:#bbb;text-align:center}
.hint{color:var(--muted);font-size:12px;font-weight:normal}
.scroll{overflow-x:auto}
table.kill th.rot{height:140px;white-space:nowrap;vertical-align:bottom;padding:2px}
table.kill th.rot span{writing-mode:vertical-rl;transform:rotate(180deg);font-weight:500;font-size:11px}
td.k{text-align:center;font-weight:700}td.k.yes{color:var(--pass);background:#eafaf1}td.k.no{color:#bbb}
td.k.none{color:#bbb}tr.survived th,tr.survived td.kb{background:#fdedec;color:var(--fail)}td.desc{max-width:380px}
table.env th{background:#f4f6f7;font-weight:600}
details.case{border:1px solid var(--line);border-left:5px solid var(--fail);border-radius:4px;margin:8px 0}
details.case.st-xfailed{border-left-color:var(--xfail)}details.case.st-error{border-left-color:var(--err)}
details.case>summary{cursor:pointer;padding:7px 10px;background:#fafafa;list-style-position:inside}
details.case[open]>summary{border-bottom:1px solid var(--line)}
details.case .body{padding:4px 12px 12px}
.cname{font-family:ui-monospace,monospace}
.bugline{background:#fef9e7;border:1px solid #f8e5b9;padding:6px 8px;margin:8px 0}
.where{color:var(--muted);font-size:11px}
.repro{position:relative}.repro pre{padding-right:64px;white-space:pre-wrap;word-break:break-all;max-height:120px}
.repro button.copy{position:absolute;right:6px;top:6px;font-size:11px}
table.checks tr.bad td.ratio{color:var(--fail);font-weight:700}table.checks tr.ok{color:#777}
svg text{font-family:'DejaVu Sans',Verdana,Arial,sans-serif}
.plot svg{max-width:100%;height:auto;display:block}
figure.heatmap svg{width:100%;max-width:1060px;height:auto;display:block}
figure.heatmap{margin:8px 0 14px;border:1px solid #eee;padding:4px}
figure.heatmap figcaption{font-size:11.5px;color:#444;margin-top:2px}
table.passed td.cname{font-family:ui-monospace,monospace;font-size:12px}
table.passed td,table.passed th{padding:1px 6px}
td.barcell{width:130px}.bar{display:block;height:8px;background:#7fb3d5;border-radius:2px;margin-top:4px}
p.meta{color:#999;font-size:11px;margin-top:10px}.warn{color:var(--fail)}
footer{margin-top:28px;color:var(--muted);font-size:11.5px;border-top:1px solid var(--line);padding-top:8px}
.hidden{display:none}
"""

_JS = r"""
(function(){
  function materialize(root){
    root.querySelectorAll('script.lazy-svg').forEach(function(s){
      s.insertAdjacentHTML('afterend', s.textContent);
      s.parentNode.removeChild(s);
    });
  }
  document.querySelectorAll('details.case').forEach(function(d){
    d.addEventListener('toggle', function(){ if(d.open) materialize(d); });
    if(d.open) materialize(d);
  });
  // open a case and draw its plots now (the toggle event comes asynchronously)
  window.reportOpenCase = function(idOrEl){
    var d = typeof idOrEl === 'string' ? document.getElementById(idOrEl) : idOrEl;
    if(d && d.tagName === 'DETAILS'){ d.open = true; materialize(d); }
    return d;
  };
  function openTarget(){
    var id = decodeURIComponent(location.hash.slice(1));
    if(!id) return;
    var el = document.getElementById(id);
    if(el && el.tagName === 'DETAILS'){ window.reportOpenCase(el); el.scrollIntoView({block:'start'}); }
  }
  window.addEventListener('hashchange', openTarget);
  openTarget();
  document.querySelectorAll('a.open-case').forEach(function(a){
    a.addEventListener('click', function(){
      var el = document.getElementById(a.getAttribute('href').slice(1));
      if(el && el.tagName === 'DETAILS') window.reportOpenCase(el);
    });
  });
  document.querySelectorAll('button.copy').forEach(function(b){
    b.addEventListener('click', function(){
      var text = b.parentNode.querySelector('pre').textContent;
      function done(ok){
        b.textContent = ok ? 'copied' : 'select + copy';
        setTimeout(function(){ b.textContent = 'copy'; }, 1500);
      }
      function fallback(){
        var r = document.createRange(); r.selectNodeContents(b.parentNode.querySelector('pre'));
        var s = window.getSelection(); s.removeAllRanges(); s.addRange(r);
        var ok = false; try { ok = document.execCommand('copy'); } catch(e) { ok = false; }
        done(ok);
      }
      try {
        if(navigator.clipboard && window.isSecureContext){
          navigator.clipboard.writeText(text).then(function(){ done(true); }, fallback);
        } else { fallback(); }
      } catch(e) { fallback(); }
    });
  });
  var f = document.getElementById('filter');
  if(f){
    f.addEventListener('input', function(){
      var q = f.value.toLowerCase();
      document.querySelectorAll('[data-case]').forEach(function(el){
        if(el.tagName === 'FIGURE') return;
        var hit = !q || el.getAttribute('data-case').toLowerCase().indexOf(q) >= 0;
        el.classList.toggle('hidden', !hit);
      });
    });
  }
  function setAll(open){
    document.querySelectorAll('details.case').forEach(function(d){
      if(d.classList.contains('hidden')) return;
      if(open) window.reportOpenCase(d); else d.open = false;
    });
  }
  var ea = document.getElementById('expand-all'), ca = document.getElementById('collapse-all');
  if(ea) ea.addEventListener('click', function(){ setAll(true); });
  if(ca) ca.addEventListener('click', function(){ setAll(false); });
})();
"""
