"""A DeepSpeed change judged case by case: the same gate on a base tree and a head tree, classified.

Why a module of its own: a reviewer's question is not "does head pass" (an unseen tree fails many cases
for reasons older than the change) but "what did the change do". Each case-column of the stock column
falls in exactly one class:

* unchanged     -- passed on both (or deselected on both, for the same reason);
* fixed         -- failed on base (the bug ids its models matched there, if any), passed on head;
* still present -- failed on both with the same status and bug ids;
* changed       -- failed on both, otherwise (other bugs, another status);
* regressed     -- passed on base, fails on head: its localised message and a reproduce command naming
                   the interpreter and DeepSpeed tree it needs;
* cannot judge  -- the harness could not read a tree there (the probe or attribute is named), or a side has
                   no record of the case;
* not on both   -- one tree refuses the combination by design or lacks the feature (deselected there).

Pure functions of two results folders (``harness.report.results``); the runs are ``harness.cli.compare``'s.
"""
from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from harness.report.results import CaseRecord, load_records

CLASSES = ("regressed", "fixed", "still present", "changed", "cannot judge", "not on both", "unchanged")
GOOD = frozenset({"passed"})


@dataclass(frozen=True)
class Row:
    case: str
    cls: str
    base: CaseRecord | None
    head: CaseRecord | None
    why: str = ""  # for cannot judge / not on both: the reason, in the harness's words


def _first_line(rec: CaseRecord | None, needle: str = "") -> str:
    if rec is None:
        return "no record"
    lines = [ln.strip() for ln in rec.message.splitlines() if ln.strip()]
    hit = next((ln for ln in lines if needle and needle in ln), None)
    return (hit or (lines[0] if lines else rec.status))[:300]


def classify(base: CaseRecord | None, head: CaseRecord | None) -> tuple[str, str]:
    """(class, reason) of one case-column."""
    if base is None or head is None:
        side = "base" if base is None else "head"
        return "cannot judge", f"no record on {side} (an incomplete run)"
    for side, rec in (("base", base), ("head", head)):
        if rec.status == "unjudged":
            return "cannot judge", f"{side}: {_first_line(rec, 'cannot judge')}"
    skipped = [s for s, r in (("base", base), ("head", head)) if r.status == "skipped"]
    if len(skipped) == 2:
        return "unchanged", ""
    if skipped:
        rec = base if skipped[0] == "base" else head
        return "not on both", f"{skipped[0]}: {_first_line(rec)}"
    b_ok, h_ok = base.status in GOOD, head.status in GOOD
    if b_ok and h_ok:
        return "unchanged", ""
    if h_ok:
        return "fixed", ""
    if b_ok:
        return "regressed", ""
    same = base.status == head.status and sorted(base.bug_ids) == sorted(head.bug_ids)
    return ("still present" if same else "changed"), ""


def stock_records(root: Path) -> dict[str, CaseRecord]:
    recs = load_records(root)
    if not recs:
        raise FileNotFoundError(f"{root}: no results-*.jsonl records (is this a gate's results folder?)")
    return {r.case_name: r for r in recs if r.column == "stock"}


def compare(base_root: Path, head_root: Path) -> list[Row]:
    base, head = stock_records(base_root), stock_records(head_root)
    rows = []
    for name in sorted(set(base) | set(head)):
        cls, why = classify(base.get(name), head.get(name))
        rows.append(Row(name, cls, base.get(name), head.get(name), why))
    return rows


# a head outcome that stops the run before every quantity is judged: a bug of the base that does not show
# there is masked, not fixed
MASKING = frozenset({"error"})


def bug_lines(rows: list[Row]) -> list[str]:
    """One line per bug id: in how many case-columns the change fixed it (the head no longer shows it, whether
    or not the case now passes), left it, brought it, or hid it behind an error."""
    tally: dict[str, Counter] = {}
    for r in rows:
        b = set(r.base.bug_ids) if r.base else set()
        h = set(r.head.bug_ids) if r.head else set()
        for bug in b | h:
            c = tally.setdefault(bug, Counter())
            if bug in b and bug not in h:
                masked = r.head is None or r.head.status in MASKING or r.head.strength == "crash"
                c["masked by a head error or crash" if masked else "fixed"] += 1
                c["now passing"] += r.cls == "fixed"
            elif bug in b and bug in h:
                c["still present"] += 1
            else:
                c["new on head"] += 1
    order = ("fixed", "still present", "new on head", "masked by a head error or crash")

    def said(k: str, c: Counter) -> str:
        passing = f" (passing on head in {c['now passing']})" if k == "fixed" and c["now passing"] else ""
        return f"{k} in {c[k]}{passing}"
    return [f"- **{bug}**: " + ", ".join(said(k, c) for k in order if c[k]) for bug, c in sorted(tally.items())]


def summary(rows: list[Row], base_label: str, head_label: str) -> str:
    counts = Counter(r.cls for r in rows)
    out = [f"# DeepSpeed change: {base_label} -> {head_label}", "",
           f"{len(rows)} case-columns of the stock column, the same cases on both trees.", "",
           "| class | case-columns |", "|---|---|"]
    out += [f"| {c} | {counts[c]} |" for c in CLASSES]
    bugs = bug_lines(rows)
    out += ["", "## Bugs, by id", ""] + (bugs or ["- none named on either tree"])
    reg = [r for r in rows if r.cls == "regressed"]
    out += ["", f"## Regressions ({len(reg)})", ""]
    for r in reg:
        out += [f"- `{r.case}`: {r.head.status}"
                + (f" [{', '.join(r.head.bug_ids)}]" if r.head.bug_ids else "") + f": {_first_line(r.head)}",
                f"  - reproduce on head ({head_label}): `{r.head.reproduce}`"]
    if not reg:
        out.append("- none")
    out += _unexplained(rows, head_label)
    for cls in ("cannot judge", "not on both"):
        these = [r for r in rows if r.cls == cls]
        if these:
            out += ["", f"## {cls.capitalize()} ({len(these)})", ""]
            out += [f"- `{r.case}`: {r.why}" + _head_state(r, cls) for r in these]
    fixed = [r for r in rows if r.cls == "fixed"]
    if fixed:
        out += ["", f"## Fixed ({len(fixed)})", ""]
        out += [f"- `{r.case}`: was {r.base.status}" + (f" [{', '.join(r.base.bug_ids)}]" if r.base.bug_ids else
                                                       " (no bug id matched)") for r in fixed]
    return "\n".join(out) + "\n"


def _divergence(rec: CaseRecord) -> str:
    """The first localised divergence line of a record's message (what diverged, step, rank partition)."""
    lines = [ln.strip() for ln in rec.message.splitlines() if ln.strip()]
    hit = next((ln for ln in lines if " diverged at step " in ln), None)
    return (hit or _first_line(rec))[:300]


def _unexplained(rows: list[Row], head_label: str) -> list[str]:
    """Head failures no bug explains that are not regressions (the base failed too, or lacked the case):
    what a reviewer must still look at, since a base bug can hide what the change did."""
    these = [r for r in rows if r.head is not None and r.head.status in ("failed", "error") and not r.head.bug_ids
             and r.cls not in ("regressed", "unchanged")]
    if not these:
        return []
    out = ["", f"## Failing on head with no bug that explains it, not regressions ({len(these)})", ""]
    for r in these:
        was = (f"{r.base.status}" + (f" [{', '.join(r.base.bug_ids)}]" if r.base.bug_ids else "")) if r.base else "-"
        out += [f"- `{r.case}` ({r.cls}; base {was}): head {r.head.status}: {_divergence(r.head)}",
                f"  - reproduce on head ({head_label}): `{r.head.reproduce}`"]
    return out


def _head_state(r: Row, cls: str) -> str:
    if cls != "not on both" or r.head is None or r.head.status == "skipped":
        return ""
    ids = f" [{', '.join(r.head.bug_ids)}]" if r.head.bug_ids else ""
    return f"; head: {r.head.status}{ids}"


def _cell(rec: CaseRecord | None) -> str:
    if rec is None:
        return "<td>no record</td>"
    ids = f" [{', '.join(rec.bug_ids)}]" if rec.bug_ids else ""
    ratio = f" {rec.worst_ratio:.3g}x" if rec.worst_ratio == rec.worst_ratio and rec.status != "skipped" else ""
    return (f"<td class='st-{html.escape(rec.status)}'><b>{html.escape(rec.status)}</b>{html.escape(ids + ratio)}"
            f"<details><summary>message</summary><pre>{html.escape(rec.message[:4000])}</pre>"
            f"<p>reproduce: <code>{html.escape(rec.reproduce)}</code></p></details></td>")


def render_html(rows: list[Row], base_label: str, head_label: str, md: str) -> str:
    order = {c: i for i, c in enumerate(CLASSES)}
    body = "".join(f"<tr><td>{html.escape(r.case)}</td><td>{html.escape(r.cls)}"
                   + (f"<br><small>{html.escape(r.why)}</small>" if r.why else "") + f"</td>{_cell(r.base)}"
                   f"{_cell(r.head)}</tr>" for r in sorted(rows, key=lambda r: (order[r.cls], r.case)))
    style = ("body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
             "padding:3px 6px;vertical-align:top}.st-passed{background:#e6f4e6}.st-failed,.st-error{background:#fbe3e3}"
             ".st-xfailed{background:#fff3d6}.st-unjudged{background:#e3e8fb}pre{white-space:pre-wrap;max-width:60em}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(base_label)} -> "
            f"{html.escape(head_label)}</title><style>{style}</style></head><body>"
            f"<details open><summary>summary</summary><pre>{html.escape(md)}</pre></details>"
            f"<table><tr><th>case</th><th>class</th><th>base: {html.escape(base_label)}</th>"
            f"<th>head: {html.escape(head_label)}</th></tr>{body}</table></body></html>")
