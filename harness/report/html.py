"""The report's HTML: the page (verdict, counts, grid, kill matrix, environment), each case's details
and the small formatting helpers; styles and script are the static files in ``report_static/``."""
from __future__ import annotations

import html
import itertools
import json
import math
import os
import platform
import re
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable


from harness.case import dsconfig
from oracles.tolerance import RATIO_SHOWN_MAX, ratio_text
from harness.report.plots import HUGE, MAX_CELLS, _finite, heatmap_svg, steps_svg
from harness.report.results import CaseRecord, CheckRow, map_cells, strength_line, strength_summary

DETAIL_STATUSES = ("failed", "unjudged", "xpassed", "error", "xfailed")  # statuses that get a details section
# Statuses that make the verdict FAIL. "unjudged" (a captured quantity without a finite reference) is one: the
# gate's cases are the harness's own choice, so one it cannot judge is a hole in the coverage the gate
# claims, and it must block like a failure; it is counted under its own name because it is no evidence that
# DeepSpeed is wrong.
BAD_STATUSES = ("failed", "unjudged", "xpassed", "error")
MAIN_COLUMNS = ("stock", "patched")  # other columns are mutants: they feed the kill matrix
MAX_HEATMAPS_PER_CASE = 4
# The plot budget. Plots are ~95% of a report's bytes and nearly all of its render time (matplotlib),
# and a --full run has hundreds of expected failures whose plots all look alike (DSM-001 on every
# 16-bit case). So the page inlines plots only for the outcomes a reader opens first: the worst few
# of each kind of unexpected failure and of each bug's strict xfails. Every other outcome keeps its
# text (message, reproducer, quantities) and names the command that renders its plots.
PLOTS_PER_FAILURE_KIND = 3  # failed / xpassed outcomes with the same status and worst quantity
PLOTS_PER_BUG = 2  # strict xfails with the same bug ids
MAX_PLOTTED = 40  # outcomes with plots in one page, failures first
MAX_CHECK_ROWS = 12  # quantity rows of an outcome shown without plots (the worst first)
_KNOWN_EXTRA = ("environment", "mutations", "mutation_cases", "notes", "verdict_reasons", "title")
GRID_ROWS = 40  # rows per table of the case x column grid (longer grids wrap into side-by-side tables)



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
               source: str = "", heatmaps_per_param: int = 1, all_plots: bool = False) -> str:
    """The whole page as a string; ``maps_for(key)`` returns the stored maps of a record."""
    extra = extra or {}
    title = title or extra.get("title") or "Muon / DeepSpeed ZeRO divergence report"
    main, mutant_recs = [], []
    for r in records:
        (mutant_recs if _is_mutant(r) else main).append(r)
    anchors = _anchors(main)
    mutations = _mutation_rows(extra, mutant_recs)
    verdict_ok, reasons = _verdict(main, mutations, extra)

    parts = [_head(title), "<body>"]
    if extra.get("check"):  # a check's page leads with the check's own verdict, as the CLI printed it
        parts.append(_check_block(title, extra["check"], main, source))
    else:
        parts.append(_verdict_block(title, verdict_ok, reasons, main, source, bool(extra.get("incomplete"))))
    parts.append(_nav(main, mutations))
    parts.append(_counts_block(main))
    parts.append(_failure_list(main, anchors))
    if mutations:
        parts.append(_mutation_block(mutations, extra))
    parts.append(_env_block(extra, main))
    parts.append(_grid_block(main, anchors))
    parts.append(_details_block(main, anchors, maps_for, heatmaps_per_param, all_plots, source))
    parts.append(_passed_block(main))
    if extra.get("notes"):
        parts.append("<section id='notes'><h2>Notes</h2><ul>" + "".join(
            f"<li>{_e(n)}</li>" for n in extra["notes"]) + "</ul></section>")
    parts.append(f"<footer>Rendered {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} by "
                 f"<code>harness.report.build</code> from {len(records)} stored outcome(s). "
                 f"Rebuild: <code>python -m harness report {_e(source or 'RESULTS_DIR')}</code></footer>")
    parts.append(_bug_titles_json(records))
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
    if extra.get("incomplete"):  # never PASS over case-columns that never ran
        reasons.insert(0, str(extra["incomplete"]))
    if not main and not mutations:
        reasons.append("no results stored")
    return not reasons, reasons


def _head(title: str) -> str:
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{_e(title)}</title><link rel='icon' href='data:,'>"
            f"<style>{_CSS}</style></head>")


def page_verdict(records: list[CaseRecord], extra: dict) -> tuple[bool, list[str]]:
    """PASS/FAIL and its reasons for stored records, as the page's verdict block states them."""
    main = [r for r in records if not _is_mutant(r)]
    return _verdict(main, _mutation_rows(extra, [r for r in records if _is_mutant(r)]), extra)


def _verdict_block(title, ok, reasons, main, source, incomplete: bool = False) -> str:
    cls = "pass" if ok else "fail"
    word = "INCOMPLETE" if incomplete else "PASS" if ok else "FAIL"
    why = "all outcomes as expected" if ok else "; ".join(r.removeprefix("INCOMPLETE: ") for r in reasons)
    total_s = sum(r.seconds for r in main if math.isfinite(r.seconds))
    return (f"<header class='verdict {cls}' id='verdict'><h1>{_e(title)}</h1>"
            f"<div class='verdict-line'><span class='vword'>{word}</span> <span class='why'>{_e(why)}</span></div>"
            f"<div class='sub'>{len(main)} outcome(s), {total_s:.1f} s of case time; results: "
            f"<code>{_e(source)}</code></div></header>")


def _check_block(title, facts: dict, main, source) -> str:
    """The head of a ``python -m harness check`` report: the CLI's verdict lines and exit code (the
    gate's PASS means "as expected", and a known bug diverging is expected there, but not to a user
    whose config it hits), then the config path, each resolved value with its source, the rewrites and
    which parameters went to Muon or Adam, and why."""
    code = facts.get("exit_code")
    cls = "pass" if code == 0 else "fail"
    lines = facts.get("verdict_lines") or ["verdict: (none recorded)"]
    head = "".join(f"<div class='verdict-line'><span class='why'>{_e(v)}</span></div>" for v in lines)
    total_s = sum(r.seconds for r in main if math.isfinite(r.seconds))

    def table(cols, rows) -> str:
        return ("<table class='checks'><thead><tr>" + "".join(f"<th>{_e(c)}</th>" for c in cols) + "</tr></thead>"
                "<tbody>" + "".join("<tr>" + "".join(f"<td>{_e(x)}</td>" for x in row) + "</tr>" for row in rows)
                + "</tbody></table>")

    body = [f"<p>config: <code>{_e(facts.get('config', ''))}</code>; exit code {_e(code)}</p>"]
    body += [f"<p class='hint'>{_e(w.strip())}</p>" for w in facts.get("unknown_keys", [])]
    body.append("<h3>Resolved settings</h3>" + table(("key", "value", "source"), facts.get("resolved", [])))
    body.append("<h3>Config rewritten for the harness</h3><ul>"
                + "".join(f"<li>{_e(n)}</li>" for n in facts.get("notes", [])) + "</ul>")
    body.append("<h3>Parameters</h3>" + table(("name", "shape", "optimizer", "why"), facts.get("params", [])))
    body.append(_departures_block(facts))
    return (f"<header class='verdict {cls}' id='verdict'><h1>{_e(title)}</h1>{head}"
            f"<div class='sub'>{len(main)} outcome(s), {total_s:.1f} s of case time; results: "
            f"<code>{_e(source)}</code></div></header><section id='check'>" + "".join(body) + "</section>")


def _departures_block(facts: dict) -> str:
    """Muon as defined, reported apart from DeepSpeed's intended reference (the verdict above): each
    departure DeepSpeed makes by design on this run, its size and the change that removes it."""
    rows = facts.get("departures") or []
    said = "".join(f"<p>{_e(line)}</p>" for line in facts.get("departure_lines", []))
    if not rows:
        return "<h3>Muon as defined</h3>" + said
    cells = "".join("<tr>" + "".join(f"<td>{_e(x)}</td>" for x in row) + "</tr>" for row in rows)
    return ("<h3>Muon as defined (a second reference; docs/departures.md)</h3>" + said
            + "<table class='checks'><thead><tr><th>id</th><th>departure</th><th>on this run</th><th>removed by</th>"
            "</tr></thead><tbody>" + cells + "</tbody></table>")


def _counts_block(main) -> str:
    counts = Counter(r.status for r in main)
    by_bug = Counter(b for r in main if r.status == "xfailed" for b in (r.bug_ids or ["(no bug id)"]))
    cells = []
    for st, label in (("passed", "passed"), ("failed", "failed"), ("unjudged", "cannot judge"),
                      ("xfailed", "strict xfail"), ("xpassed", "xpassed"), ("error", "error"),
                      ("skipped", "skipped")):
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
        # folded: a --full run's table (each bug's symptom in full) was most of a screen above the grid
        bugs = (f"<details class='bugtable'><summary>Strict xfails by bug: {sum(by_bug.values())} xfail(s) of "
                f"{len(by_bug)} bug(s) (titles and symptoms)</summary>"
                "<table class='bugs'><thead><tr><th>bug</th><th>xfail</th><th>title</th><th>symptom</th></tr></thead>"
                "<tbody>" + "".join(rows) + "</tbody></table></details>")
    strength = strength_line(strength_summary((r.column, r.strength) for r in main))
    bugs = f"<p class='strength'>{_e(strength)}</p>" + bugs
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


STATUS_ORDER = ("passed", "failed", "unjudged", "xfailed", "xpassed", "error", "skipped")


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
                     f"{_shown_ratio_html(r)} <span class='msg1'>{_e(first)}</span></li>")
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
            chips = _bugs(r.bug_ids, titled=False)
            inner = f"{_badge(r.status)} <span class='ratio'>{_shown_ratio_html(r, titled=False)}</span> {chips}"
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
            f"<p class='hint'>{_GRID_LEGEND}</p></section>")


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
            from harness.registry.mutants import MUTANTS
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
            f"{_KILL_LEGEND}<div class='scroll'><table class='kill'><thead><tr><th>mutant</th><th>description</th>"
            f"{head}<th>killed by</th></tr></thead><tbody>{''.join(body)}</tbody></table></div></section>")


# A grey cross read as a failure: it is the ordinary result of most cells (a mutant needs one killer).
_KILL_LEGEND = (
    "<p class='legend kill-legend'>Each row is DeepSpeed with one deliberate bug (a mutant); each column a case "
    "run against it. <span class='k yes'>&#10003;</span> killed: the case did not pass with the mutant in "
    "place, which is what the harness must achieve. <span class='k no'>&#10007;</span> not killed by this "
    "case: the case passed with the mutant in place; not a failure, since one killing case per mutant is "
    "enough and most cases never reach a given mutant's code. <span class='k none'>&middot;</span> this case "
    "was not run against this mutant. A row fails the run only when it says <b>SURVIVED</b> (no case killed "
    "it, shown in red).</p>")


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
                    f"<td class='num'>{_shown_ratio(r)[0]}</td>"
                    f"<td class='barcell'><i style='width:{frac * 100:.0f}%'></i></td>"
                    f"<td class='num'>{r.seconds:.1f}s</td></tr>")
    return (f"<section id='passed'><h2>Passing ({len(ok)})</h2><table class='passed'><thead><tr><th></th><th>case</th>"
            "<th>column</th><th>mode</th><th>worst ratio</th><th>(log, 1e-4 &hellip; 1)</th><th>time</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></section>")


# ------------------------------------------------------------------------------------ case details


def _details_block(main, anchors, maps_for, heatmaps_per_param, all_plots=False, source="") -> str:
    """Every unexpected outcome in full (plots within the budget); strict xfails in full only where
    they are plotted, the rest as one compact row each (they matched their bug's model: the row, its
    ratio and the command to draw it are what a reader needs of the 900th DSM-001 case)."""
    bad = sorted((r for r in main if r.status in DETAIL_STATUSES),
                 key=lambda r: (DETAIL_STATUSES.index(r.status), r.case_name, _col_order(r.column)))
    if not bad:
        return ""
    plotted = {r.key for r in bad} if all_plots else plotted_outcomes(bad)
    full = [r for r in bad if r.status != "xfailed" or r.key in plotted]
    compact = [r for r in bad if r.status == "xfailed" and r.key not in plotted]
    n_unplotted = sum(1 for r in full if r.key not in plotted and r.status != "error")
    parts = [f"<section id='details'><h2>Details of the outcomes that did not pass ({len(bad)})</h2>"]
    if n_unplotted or compact:
        parts.append(f"<p class='hint'>Plots are inlined for {len(plotted)} outcome(s): the worst "
                     f"{PLOTS_PER_FAILURE_KIND} of each kind of failure and the worst {PLOTS_PER_BUG} of each bug's "
                     f"strict xfails, at most {MAX_PLOTTED}. Every element map stays in the results folder; "
                     f"<code>python -m harness report {_e(source or 'RESULTS_DIR')} --only NAME --all-plots</code> "
                     "draws any case's.</p>")
    for r in full:
        if r.key in plotted or r.status == "error":
            parts.append(case_details(r, anchors[r.key], maps_for(r.key) if r.status != "error" else {},
                                      heatmaps_per_param=heatmaps_per_param))
        else:
            parts.append(case_details(r, anchors[r.key], {}, plots=False, source=source))
    if compact:
        # grouped by bug, a first line said once per run of equal lines (ditto mark after): 900 rows of
        # one DSM-001 sentence were a fifth of a --full page
        compact.sort(key=lambda r: (tuple(sorted(r.bug_ids)), r.case_name, _col_order(r.column)))
        rows, prev = [], None
        for r in compact:
            line = _first_line(r)
            msg = "<td class='msg1 same' title='as the row above'>&#8243;</td>" if line == prev else \
                f"<td class='msg1'>{_e(line)}</td>"
            prev = line
            rows.append(f"<tr id='{anchors[r.key]}' class='st-{r.status}' data-case='{_e(r.case_name)}'>"
                        f"<td>{_badge(r.status)}</td><td class='cname'>{_e(r.case_name)}</td><td>{_e(r.column)}</td>"
                        f"<td>{_bugs(r.bug_ids, titled=False)}</td>"
                        f"<td class='num'>{_shown_ratio_html(r, titled=False)}</td>"
                        f"{msg}</tr>")
        rows = "".join(rows)
        parts.append(f"<h3 id='more-xfails'>Other strict xfails ({len(compact)}), each matching its bug's model</h3>"
                     "<table class='passed xfails'><thead><tr><th></th><th>case</th><th>column</th><th>bug</th>"
                     f"<th>deciding ratio</th><th>first line</th></tr></thead><tbody>{rows}</tbody></table>")
    parts.append("</section>")
    return "\n".join(parts)


def failure_kind(r: CaseRecord) -> tuple:
    """What makes two not-passing outcomes "the same kind" for the plot budget: a strict xfail by its
    bugs; a failure by its status and the quantity of its worst check (a second bug in momentum
    on another case is another example of the same kind; one in the gradient is not)."""
    if r.status == "xfailed":
        return ("xfailed", tuple(sorted(r.bug_ids)))
    worst = max(r.checks, key=lambda c: _finite(c.worst_ratio), default=None)
    return (r.status, worst.quantity if worst is not None else "-")


def plotted_outcomes(bad: list[CaseRecord]) -> set[str]:
    """The keys of the outcomes whose plots the page inlines: per kind (``failure_kind``) the worst
    few, unexpected failures before strict xfails, at most ``MAX_PLOTTED`` in all."""
    by_kind: dict[tuple, list[CaseRecord]] = defaultdict(list)
    for r in bad:
        if r.status != "error":  # an error has no element maps to draw
            by_kind[failure_kind(r)].append(r)
    picks = []
    for kind, rs in by_kind.items():
        per = PLOTS_PER_BUG if kind[0] == "xfailed" else PLOTS_PER_FAILURE_KIND
        rs.sort(key=lambda r: (-_finite(r.worst_ratio), r.case_name, _col_order(r.column)))
        picks += [(DETAIL_STATUSES.index(r.status), i, -_finite(r.worst_ratio), r.case_name, r.key)
                  for i, r in enumerate(rs[:per])]
    picks.sort()  # failures first, then each kind's worst before any kind's second
    return {p[-1] for p in picks[:MAX_PLOTTED]}


def case_details(r: CaseRecord, anchor: str, maps: dict, *, heatmaps_per_param: int = 1, plots: bool = True,
                 source: str = "") -> str:
    first = _first_line(r)
    out = [f"<details class='case st-{r.status}' id='{anchor}' data-case='{_e(r.case_name)}' "
           f"data-column='{_e(r.column)}'><summary>{_badge(r.status)} <b class='cname'>{_e(r.case_name)}</b> "
           f"<span class='col'>{_e(r.column)}</span> "
           f"{_bugs(r.bug_ids)} {_shown_ratio_html(r, lead='worst ')} "
           f"<span class='msg1'>{_e(first)}</span></summary><div class='body'>"]
    judged = _judged_line(r)
    if judged:
        out.append(f"<p class='judged'>{judged}</p>")
    for b_id in r.bug_ids:
        b = _bug(b_id)
        if b:
            out.append(f"<p class='bugline'><span class='bug'>{_e(b.id)}</span> <b>{_e(b.title)}</b>: {_e(b.symptom)}"
                       f" <span class='where'>({_e(b.where)})</span></p>")
    out.append("<h4>Reproduce</h4><div class='repro'><button type='button' class='copy'>copy</button>"
               f"<pre class='cmd'>{_e(r.reproduce)}</pre></div>")
    out.append(f"<h4>Message</h4><pre class='message'>{_e(r.message)}</pre>")
    if not plots:
        if r.checks:
            out.append("<h4>Quantities</h4>" + _checks_table(r.checks, max_rows=MAX_CHECK_ROWS))
        cmd = (f"python -m harness report {source or 'RESULTS_DIR'} --only {r.case_name} "
               f"-o {r.case_name}.html --all-plots")
        out.append("<p class='hint'>Plots not inlined (plot budget). Render them with:</p>"
                   f"<div class='repro'><button type='button' class='copy'>copy</button>"
                   f"<pre class='cmd'>{_e(cmd)}</pre></div>")
    elif r.checks:
        out.append("<h4>Quantities</h4>" + _checks_table(r.checks))
        svg = steps_svg(r.checks, case=r.case_name)
        if svg:
            out.append("<h4>Error vs step <span class='hint'>(solid: worst error; dashed: its allowance; "
                       "steps without a point stayed within tolerance and are not stored)</span></h4>"
                       f"<div class='plot steps'>{_lazy(svg)}</div>")
    chosen = choose_maps(r, maps, per_param=heatmaps_per_param) if plots else []
    if chosen:
        out.append("<h4>Element-wise error / allowance over the flattened ZeRO layout</h4>")
        for key, (param, quantity, step) in chosen:
            lay = r.layout.get(param)
            ratio = maps[key]
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
    elif r.status != "error" and plots:
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
        return dsconfig.resolve(json.loads(r.case_json)["ds_config"]).zero.stage
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
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


def _checks_table(checks: list[CheckRow], max_rows: int | None = None) -> str:
    groups: dict[tuple[str, str], list[CheckRow]] = defaultdict(list)
    for c in checks:
        groups[(c.param, c.quantity)].append(c)
    rows = []

    def sort_key(item):
        (p, q), cs = item
        bad = [c for c in cs if c.n_bad]
        return (0 if bad else 1, min((c.step for c in bad), default=0), -max(c.worst_ratio for c in cs), p, q)

    ordered = sorted(groups.items(), key=sort_key)
    hidden = len(ordered) - max_rows if max_rows is not None and len(ordered) > max_rows else 0
    for (param, quantity), cs in ordered[:len(ordered) - hidden]:
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
            + (f"<td class='num ratio' title='{_e(worst.unjudged)}'>cannot judge</td>" if worst.unjudged else
               f"<td class='num ratio'>{_ratio_txt(worst.worst_ratio)}</td>")
            + f"<td class='num'>{_num(worst.error)}</td>"
            f"<td class='num' title='{_e(worst.derivation or '')}'>{_num(worst.allowance)}</td>"
            f"<td class='num'>{worst.step}</td><td>{_e(where)}</td>"
            f"<td class='num'>{worst.n_bad}/{worst.numel}</td>"
            f"<td>{_e(', '.join(f'{k} {v}' for k, v in sorted(regions.items())))}</td>"
            f"<td class='num'>{_num(worst.actual)}</td><td class='num'>{_num(worst.expected)}</td></tr>")
    return ("<table class='checks'><thead><tr><th>param</th><th>quantity</th><th>failing steps</th><th>worst ratio</th>"
            "<th>worst error</th><th>allowance</th><th>at step</th><th>where</th><th>bad elements</th>"
            "<th>bad by region (all steps)</th><th>actual</th><th>oracle</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>"
            + (f"<p class='hint'>{hidden} more (param, quantity) row(s), all in the results folder.</p>"
               if hidden else ""))


def _heat_caption(r: CaseRecord, param, quantity, step, ratio) -> str:
    _, size, n_bad = map_cells(ratio)
    lay = r.layout.get(param) or {}
    ranks = lay.get("ranks", [])
    txt = f"{n_bad} of {size} elements above their allowance"
    if ranks:
        txt += "; rank slices " + ", ".join(f"r{rk} [{a}, {b})" for rk, a, b in ranks)
    tails = lay.get("regions", {}).get("padded_tail", [])
    if tails:
        txt += "; padded tail " + ", ".join(f"[{a}, {b})" for a, b in tails)
    if size > MAX_CELLS:
        txt += f"; max-pooled to {MAX_CELLS} cells"
    return _e(txt)


# ----------------------------------------------------------------------------------------- helpers


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _ratio_txt(x: float) -> str:
    return _e(ratio_text(_finite(x))) + "&times;"


def _ratio_plain(x: float) -> str:
    return ratio_text(_finite(x)) + "\u00d7"


# What the grid's, the lists' and the details' ratio means, said once under the grid.
_GRID_LEGEND = (
    "Cell: status, then the figure that decided it. A pass, or a failure no known bug is expected in: the worst "
    "error/allowance ratio over all checks against the intended oracle (&le;&nbsp;1 is within tolerance). "
    "A strict xfail: the worst ratio "
    "against the oracle with its bug's model switched on, marked <i>model</i> (&le;&nbsp;1: DeepSpeed did what "
    "the bug predicts; the case's details give the ratio against the intended oracle too); <i>excused</i> "
    "where a bug without a model excused quantities by name (the ratio is then the intended oracle's); "
    "a failure of a case with a known bug: its worst ratio against that bug's model, marked <i>model</i> too "
    "(above 1: beyond what the bug predicts); "
    "<i>crash</i> where the expected crash happened; <i>refused</i> where the expected refusal did; "
    "<i>no check</i> where the status came from how a run ended, with nothing compared; "
    f"<i>no result</i> for an error. A ratio above {RATIO_SHOWN_MAX:.0e} is written "
    f"&gt;&nbsp;{RATIO_SHOWN_MAX:.0e}: it comes from an allowance at its rounding floor (an oracle of zero), "
    "where its digits would mean nothing. Click a failing cell for its details.").replace("e+", "e")


def _shown_ratio(r: CaseRecord) -> tuple[str, str, str]:
    """(figure as HTML, label, why as plain text) of the number that decided an outcome's status: the
    intended oracle's worst ratio says how far an excused case is from the intended maths, not whether
    it matches its bug, and a crash or a refusal compared no numbers at all."""
    if r.strength == "crash":
        return "crash", "", ("the case crashed exactly as its bug's crash signature says (exception, message, "
                             "frame); no numbers were compared")
    if r.strength == "refusal":
        return "refused", "", "the config was refused exactly as required; no numbers were compared"
    if r.status == "error":
        return "no result", "", "the case produced no trajectory: nothing was compared"
    if r.status == "skipped":
        return "&ndash;", "", "not run"
    if not r.checks:  # e.g. a config that had to be refused, or to crash, ran: its message says which
        return "no check", "", "no numbers were compared: the status comes from how the run ended"
    why = "worst error/allowance against the intended oracle (\u2264 1 is within tolerance)"
    if _finite(r.worst_ratio) > RATIO_SHOWN_MAX:
        why += (f"; above {ratio_text(RATIO_SHOWN_MAX)} it comes from an allowance at its rounding floor "
                "(an oracle of zero): the case's quantities give the error and the allowance")
    bugs = ", ".join(r.bug_ids) or "its bug"
    if r.status != "xfailed" and r.model_ratio is not None:
        return _ratio_txt(r.model_ratio), "model", (
            f"worst error/allowance against the oracle with the model of {bugs} switched on: above 1, DeepSpeed "
            "diverged beyond what the bug predicts")
    if r.status != "xfailed":
        return _ratio_txt(r.worst_ratio), "", why
    if r.strength == "excused":
        return _ratio_txt(r.worst_ratio), "excused", (
            f"{bugs} has no model for this case and excuses its quantities by name; " + why)
    if r.model_ratio is None:
        return _ratio_txt(r.worst_ratio), "intended", "no bug-model ratio stored; " + why
    return _ratio_txt(r.model_ratio), "model", (
        f"worst error/allowance against the oracle with the model of {bugs} switched on, the figure that decided "
        f"that the run matches its bug (\u2264 1); against the intended oracle: {_ratio_plain(r.worst_ratio)}")


def _shown_ratio_html(r: CaseRecord, lead: str = "", titled: bool = True) -> str:
    """The figure with its label; ``titled`` adds why as a tooltip. Grid cells and compact rows leave it
    out (thousands on a --full page, 0.6 MB): the legend under the grid says it once."""
    text, label, why = _shown_ratio(r)
    tag = f" <i>{label}</i>" if label else ""
    lead = lead if text.endswith("&times;") else ""
    if not titled:
        return f"{lead}{text}{tag}"
    return f"<span class='ratio' title='{_e(why)}'>{lead}{text}{tag}</span>"


def _judged_line(r: CaseRecord) -> str:
    """The two judgements of a strict xfail, side by side: where the bug shows against the intended
    oracle, and how closely the run matches the bug's model (what decided the status)."""
    if r.status != "xfailed" or r.strength in ("crash", None):
        return ""
    text, label, _ = _shown_ratio(r)
    if label not in ("model", "excused"):
        return ""
    ids = _e(", ".join(r.bug_ids))
    named = sorted({q for b in map(_bug, r.bug_ids) if b for q in b.quantities})
    shows = f"{ids} predicts a divergence in {_e(', '.join(named))}" if named else f"as {ids} predicts"
    if r.swapped_bytes is not None and "swap" in named:
        shows += f"; {r.swapped_bytes} bytes swapped to NVMe"
    if label == "excused":
        return (f"Against the intended oracle: worst {text} ({shows}). Not judged against a bug model: "
                "the bug excuses its quantities by name.")
    return (f"Against the intended oracle: worst {_ratio_txt(r.worst_ratio)} ({shows}). Against the oracle with "
            f"the model of {ids} switched on: worst {text} (&le; 1: the run matches what the bug predicts). "
            "The second decided the status.")


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


_BADGE = {"passed": "PASS", "failed": "FAIL", "unjudged": "CANNOT JUDGE", "xfailed": "XFAIL", "xpassed": "XPASS",
          "error": "ERROR", "skipped": "SKIP"}


def _badge(status: str) -> str:
    return f"<b class='badge st-{_e(status)}'>{_BADGE.get(status, _e(status.upper()))}</b>"


def _bugs(ids: Iterable[str], titled: bool = True) -> str:
    """Bug-id chips. A grid cell or compact row leaves its title out (``titled=False``): a ``--full``
    page has ~2,500 of them and the titles alone were 0.2 MB; the page's script takes each title from
    the one ``bug-titles`` table (``_bug_titles_json``) on load."""
    out = []
    for i in ids or ():
        b = _bug(i)
        title = f" title='{_e(b.title) if b else ''}'" if titled else ""
        out.append(f"<span class='bug'{title}>{_e(i)}</span>")
    return " ".join(out)


def _bug_titles_json(records) -> str:
    """The titles of the bugs the page names, once, for the script to put on the untitled chips."""
    ids = sorted({i for r in records for i in (r.bug_ids or ())})
    table = {i: b.title for i in ids if (b := _bug(i))}
    text = json.dumps(table).replace("</", "<\\/")
    return f"<script type='application/json' id='bug-titles'>{text}</script>"


def _bug(bug_id: str):
    from harness.registry.bugs import BY_ID

    return BY_ID.get(bug_id)


_STATIC = Path(__file__).with_name("static")
_CSS = (_STATIC / "report.css").read_text()
_JS = (_STATIC / "report.js").read_text()
