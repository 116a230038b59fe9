"""A DeepSpeed change judged case by case: the same gate on a base tree and a head tree, classified.

Why a module of its own: a reviewer's question is not "does head pass" (an unseen tree fails many cases
for reasons older than the change) but "what did the change do", and the answer may credit only what the
records show. Each case-column of the stock column falls in exactly one class (docs/compare.md):

* unchanged     -- passes on both (passed, or xpassed: nothing diverged), or deselected on both;
* fixed         -- fails on base; on head it passes, or fails strictly less (``strictly_less``);
* flaky         -- a side's failure that no bug explains at full strength passed when that side ran the
                   case again (same seed, a fresh gate process); never credited as fixed or regressed;
* still present -- fails on both with the same status, the same bug ids and the same symptom (the first
                   failing quantity and tensor);
* changed       -- fails on both otherwise, named by the first quantity, step and tensor that differ on each side;
* regressed     -- passes on base, fails on head (errors and bug-excused failures included);
* cannot judge  -- the harness could not read a tree there (the probe is named), or a side has no record;
* not on both   -- one tree refuses the combination by design or lacks the feature (deselected there).

Pure functions of the records of the two results folders and of their reruns (``harness.report.results``);
the runs are ``harness.cli.compare``'s.
"""
from __future__ import annotations

import html
import re
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

from harness.case.spec import Case
from harness.registry import historical
from harness.report.results import CaseRecord, load_records

CLASSES = ("regressed", "fixed", "flaky", "still present", "changed", "cannot judge", "not on both", "unchanged")
PASSES = frozenset({"passed", "xpassed"})  # nothing diverged (an xpass: the registry expected a bug there)
FULL_STRENGTH = frozenset({"full", "crash", "refusal"})
# the quantities of one step in the order the step computes them: a later one is usually a consequence
STEP_ORDER = ("grad", "momentum", "update", "master", "model")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b")


@dataclass(frozen=True)
class Symptom:
    """One failing quantity of one tensor: where a record fails first, or where two records differ first."""
    param: str
    quantity: str
    step: int
    explained: bool  # a bug model the record matched predicts it
    ratio: float | None = None  # worst error/allowance there, where the record's checks hold it

    def __str__(self) -> str:
        ratio = f" ({self.ratio:.3g}x)" if self.ratio is not None and self.ratio < 1e300 else ""
        return f"{self.quantity} of {self.param} at step {self.step}{ratio}" + (", as modelled" if self.explained
                                                                               else "")


@dataclass(frozen=True)
class Failures:
    """What one record failed, per (param, quantity) with its first step: explained by the bug models the
    record matched, or not. Why not the record's checks alone: an xfail keeps the intended oracle's checks,
    a failure beyond a bug model the model's; only both say what failed and what a model explains."""
    explained: dict  # (param, quantity) -> first step
    unexplained: dict
    bugs: frozenset
    stopped: str  # "" or why the record holds no numbers past some point: an error, a crash, no checks at all
    complete: bool  # every quantity that diverged from the intended oracle is known
    ratios: dict  # (param, quantity) -> worst ratio at its first step, where the record's checks have it

    @property
    def where(self) -> set:
        return set(self.explained) | set(self.unexplained)

    def ordered(self) -> list[Symptom]:
        both = [(k, s, True) for k, s in self.explained.items()] + [(k, s, False) for k, s in self.unexplained.items()]
        rank = {q: i for i, q in enumerate(STEP_ORDER)}
        both.sort(key=lambda t: (t[1], rank.get(t[0][1], len(STEP_ORDER)), t[0][1], t[0][0]))
        return [Symptom(p, q, s, e, self.ratios.get((p, q))) for (p, q), s, e in both]

    def step_of(self, key: tuple) -> int | None:
        return self.explained.get(key, self.unexplained.get(key))

    @property
    def symptom(self) -> str:
        """The first failing quantity and tensor (or why there are none): what "the same failure" compares."""
        if self.stopped:
            return self.stopped
        first = self.ordered()
        return f"{first[0].quantity} of {first[0].param}" if first else "no failing check"


def _failing_rows(rec: CaseRecord) -> list:
    return [c for c in rec.checks if c.unjudged is None and (c.record is None or c.record.get("n_bad", 1) > 0)]


def _stop_reason(rec: CaseRecord) -> str:
    lines = [ln.strip() for ln in rec.message.splitlines() if ln.strip()]
    exc = next((ln for ln in reversed(lines) if EXCEPTION_LINE.match(ln)), None)
    text = (exc or (lines[0] if lines else rec.status))[:160]
    return ("crashed: " if rec.strength == "crash" else "stopped: " if rec.status == "error" else "no checks: ") + text


def failures(rec: CaseRecord) -> Failures:
    own: dict = {}
    ratios: dict = {}
    for c in _failing_rows(rec):
        key = (c.param, c.quantity)
        if key not in own or c.step < own[key]:
            own[key], ratios[key] = c.step, c.worst_ratio
        elif c.step == own[key]:
            ratios[key] = max(ratios[key], c.worst_ratio)
    stopped = _stop_reason(rec) if rec.status == "error" or rec.strength == "crash" else ""
    if rec.status == "xfailed":
        return Failures(own, {}, frozenset(rec.bug_ids), stopped, not stopped, ratios)
    intended = {(p, q): s for p, q, s in rec.intended_failed or []}
    explained = {k: s for k, s in intended.items() if k not in own}
    if rec.status == "failed" and not own and not intended:  # e.g. ran where DeepSpeed had to refuse it
        stopped = _stop_reason(rec)
    complete = not stopped and (rec.intended_failed is not None or not rec.bug_ids)
    return Failures(explained, own, frozenset(rec.bug_ids), stopped, complete, ratios)


def strictly_less(base: Failures, head: Failures) -> bool:
    """Whether head fails strictly less than base: nothing fails on head that did not fail on base; every
    quantity failing on both is, on head, predicted by a bug model, either where the base's failure was
    unexplained or by bugs the base showed too; and something is less (a quantity within tolerance, a
    failure a model now explains, fewer bugs). A record that stopped early (error, crash) or does not know
    all it failed is never less."""
    if base.stopped or head.stopped or not base.complete or not head.complete or head.unexplained:
        return False
    if not set(head.explained) <= base.where:
        return False
    if not head.bugs <= base.bugs and not set(head.explained) <= set(base.unexplained):
        return False
    return bool(base.where - set(head.explained) or set(head.explained) & set(base.unexplained)
                or head.bugs < base.bugs)


def first_difference(side: Failures, other: Failures) -> Symptom | None:
    """``side``'s first failure that ``other`` does not have the same way (not failing there, from another
    step, or explained on one side only)."""
    for s in side.ordered():
        key = (s.param, s.quantity)
        if key not in other.where or other.step_of(key) != s.step or (key in other.explained) != s.explained:
            return s
    return None


def tag(rec: CaseRecord) -> str:
    return rec.status + (f" [{', '.join(rec.bug_ids)}]" if rec.bug_ids else "")


def state(rec: CaseRecord) -> str:
    """Status, bug ids and first symptom of one record, in one short line: the first failure no bug model
    explains, where there is one (what a failure beyond its model is about)."""
    f = failures(rec)
    ordered = f.ordered()
    first = [s for s in ordered if not s.explained] or ordered
    what = f.stopped or (str(first[0]) if first else rec.status)
    return f"{tag(rec)}: {what}"


def _changed(base: CaseRecord, head: CaseRecord, bf: Failures, hf: Failures) -> str:
    bd, hd = first_difference(bf, hf), first_difference(hf, bf)
    if bd is None and hd is None:  # the same failures: the difference is in the status or the bugs
        bd, hd = (next(iter(f.ordered()), None) for f in (bf, hf))
    said = [f"{side} {tag(rec)}: " + (f.stopped or (f"first differs at {d}" if d else "nothing the other lacks"))
            for side, rec, f, d in (("base", base, bf, bd), ("head", head, hf, hd))]
    return "; ".join(said)


def needs_rerun(rec: CaseRecord | None) -> bool:
    """A failure no bug explains at full strength: it may be the tree's intermittent behaviour."""
    if rec is None:
        return False
    return rec.status in ("failed", "error") or (rec.status == "xfailed" and rec.strength not in FULL_STRENGTH)


def intermittent_bugs(rec: CaseRecord) -> list[str]:
    """The registered intermittent bugs whose trigger the case meets, whatever the tree (``historical``)."""
    try:
        case = Case.from_json(rec.case_json)
    except (ValueError, TypeError, KeyError):
        return []
    return [f"{b['id']} ({b['title'].split(':')[0]})" for b in historical.INTERMITTENT if b["trigger"](case)]


def _flaky(base: CaseRecord, head: CaseRecord, base_again: CaseRecord | None, head_again: CaseRecord | None) -> str:
    sides = (("base", base, base_again), ("head", head, head_again))
    flaky = [f"{side} {tag(rec)}, passed on its rerun" for side, rec, again in sides
             if needs_rerun(rec) and again is not None and again.status in PASSES]
    if not flaky:
        return ""
    others = [f"{side} {again.status} on its rerun too" for side, rec, again in sides
              if again is not None and again.status not in PASSES]
    explains = intermittent_bugs(base)
    return "; ".join(flaky + others) + (f"; {', '.join(explains)} can explain it" if explains else
                                        "; no registered intermittent bug explains it")


def _reproduced(side: str, rec: CaseRecord, again: CaseRecord | None) -> tuple[CaseRecord, str]:
    """The side's outcome to classify on, and a note: a failure whose rerun failed otherwise (another status,
    other bugs, another first symptom) did not reproduce, so the rerun's outcome is the side's -- a race that
    garbled the first run must not read as a fix or a change (a rerun that passed is ``_flaky``'s)."""
    if again is None or not needs_rerun(rec) or again.status in PASSES:
        return rec, ""
    if (again.status, set(again.bug_ids), failures(again).symptom) == (rec.status, set(rec.bug_ids),
                                                                      failures(rec).symptom):
        return rec, ""
    explains = intermittent_bugs(rec)
    return again, (f"{side}'s first run ({tag(rec)}) did not reproduce on its rerun ({tag(again)}), which is "
                   f"classified" + (f"; {', '.join(explains)} can explain it" if explains else ""))


def classify(base: CaseRecord | None, head: CaseRecord | None, base_again: CaseRecord | None = None,
             head_again: CaseRecord | None = None) -> tuple[str, str]:
    """(class, why) of one case-column, from its records and its reruns' (``*_again``; None: not rerun)."""
    if base is None or head is None:
        return "cannot judge", f"no record on {'base' if base is None else 'head'} (an incomplete run)"
    for side, rec in (("base", base), ("head", head)):
        if rec.status == "unjudged":
            return "cannot judge", f"{side}: {_first_line(rec, 'cannot judge')}"
    skipped = [(s, r) for s, r in (("base", base), ("head", head)) if r.status == "skipped"]
    if len(skipped) == 2:
        return "unchanged", "deselected on both"
    if skipped:
        return "not on both", f"{skipped[0][0]}: {_first_line(skipped[0][1])}"
    flaky = _flaky(base, head, base_again, head_again)
    if flaky:
        return "flaky", flaky
    (base, b_note), (head, h_note) = _reproduced("base", base, base_again), _reproduced("head", head, head_again)
    cls, why = _classify_reproduced(base, head)
    return cls, "; ".join(x for x in (why, b_note, h_note) if x)


def _classify_reproduced(base: CaseRecord, head: CaseRecord) -> tuple[str, str]:
    b_ok, h_ok = base.status in PASSES, head.status in PASSES
    if b_ok and h_ok:
        return "unchanged", ""
    if b_ok:
        return "regressed", f"head {state(head)}"
    if h_ok:
        return "fixed", f"base {state(base)}; head {head.status}"
    bf, hf = failures(base), failures(head)
    if strictly_less(bf, hf):
        return "fixed", f"base {state(base)}; head fails strictly less: {state(head)}"
    if base.status == head.status and set(base.bug_ids) == set(head.bug_ids) and bf.symptom == hf.symptom:
        return "still present", state(head)
    return "changed", _changed(base, head, bf, hf)


def _first_line(rec: CaseRecord, needle: str = "") -> str:
    lines = [ln.strip() for ln in rec.message.splitlines() if ln.strip()]
    hit = next((ln for ln in lines if needle and needle in ln), None)
    return (hit or (lines[0] if lines else rec.status))[:300]


@dataclass(frozen=True)
class Row:
    case: str
    cls: str
    base: CaseRecord | None
    head: CaseRecord | None
    why: str = ""
    base_again: CaseRecord | None = None  # the rerun's record, where the side was rerun
    head_again: CaseRecord | None = None

    @property
    def base_seen(self) -> CaseRecord | None:
        """The base outcome the case is classified on: the rerun's where the first run did not reproduce."""
        return None if self.base is None else _reproduced("base", self.base, self.base_again)[0]

    @property
    def head_seen(self) -> CaseRecord | None:
        return None if self.head is None else _reproduced("head", self.head, self.head_again)[0]


def stock_records(root: Path) -> dict[str, CaseRecord]:
    recs = load_records(root)
    if not recs:
        raise FileNotFoundError(f"{root}: no results-*.jsonl records (is this a gate's results folder?)")
    return {r.case_name: r for r in recs if r.column == "stock"}


def side_records(root: Path | None) -> dict[str, CaseRecord]:
    """A folder's stock records by case name; none where there is no folder (a side nothing was rerun on)."""
    if root is None or not Path(root).is_dir():
        return {}
    return {r.case_name: r for r in load_records(root) if r.column == "stock"}


def compare(base_root: Path, head_root: Path, base_rerun: Path | None = None,
            head_rerun: Path | None = None) -> list[Row]:
    base, head = stock_records(base_root), stock_records(head_root)
    b_again, h_again = side_records(base_rerun), side_records(head_rerun)
    rows = []
    for name in sorted(set(base) | set(head)):
        args = (base.get(name), head.get(name), b_again.get(name), h_again.get(name))
        cls, why = classify(*args)
        rows.append(Row(name, cls, args[0], args[1], why, args[2], args[3]))
    return rows


# --------------------------------------------------------------------------------------------------
# bugs, case-column by case-column

# how a bug id fares in one case-column; only "fixed" credits the change with a fix
INTRODUCED = ("new on head", "in code the base lacks")
TALLY = ("fixed", *INTRODUCED, "still present", "base crashed before reaching it", "gone, head fails otherwise",
         "masked by a head error or crash", "head lacks the case", "flaky")


def _shown(rec: CaseRecord | None) -> set[str]:
    """The bug ids a record says the tree shows (an xpass names bugs that did not show)."""
    return set(rec.bug_ids) if rec is not None and rec.status in ("xfailed", "failed") else set()


def _stopped(rec: CaseRecord) -> bool:
    return rec.status == "error" or rec.strength == "crash"


def _tally_kind(on_base: bool, on_head: bool, r: Row) -> str:
    if r.cls == "flaky":
        return "flaky"
    if on_base and on_head:
        return "still present"
    if on_base:
        if r.cls == "fixed":
            return "fixed"
        if r.head_seen.status == "skipped":
            return "head lacks the case"
        return "masked by a head error or crash" if _stopped(r.head_seen) else "gone, head fails otherwise"
    if r.base_seen.status == "skipped":
        return "in code the base lacks"
    return "base crashed before reaching it" if _stopped(r.base_seen) else "new on head"


def bug_tally(rows: list[Row]) -> dict[str, dict[str, list[str]]]:
    """Per bug id and kind (``TALLY``): the case-columns. A bug counts as fixed only in a case-column whose
    class is fixed: a head that merely stopped matching a bug's model is no fix of it."""
    tally: dict[str, dict[str, list[str]]] = {}
    for r in rows:
        if r.base is None or r.head is None or r.cls == "cannot judge":
            continue
        b, h = _shown(r.base_seen), _shown(r.head_seen)
        for bug in sorted(b | h):
            tally.setdefault(bug, {}).setdefault(_tally_kind(bug in b, bug in h, r), []).append(r.case)
    return dict(sorted(tally.items()))


def variants_matched(rows: list[Row], bug: str) -> list[str]:
    """The variant models of ``bug`` (``Bug.with_variants``) a head's record says it matched: the gate names one
    in its message as "<id> (variant: <name>)"; the record's bug ids carry the id alone."""
    said = re.compile(re.escape(bug) + r" \(variant: ([^)]+)\)")
    return sorted({m for r in rows if r.head is not None for m in said.findall(r.head_seen.message)})


def bug_line(bug: str, kinds: dict[str, list[str]], variants: list[str] = ()) -> str:
    def said(k: str) -> str:
        cases = kinds[k]
        example = f" (e.g. `{cases[0]}`)" if k in INTRODUCED + ("fixed",) else ""
        return f"{k} in {len(cases)}{example}"
    on_head = f" ({'; '.join(f'variant on head: {v}' for v in variants)})" if variants else ""
    return f"- **{bug}**{on_head}: " + ", ".join(said(k) for k in TALLY if kinds.get(k))


# --------------------------------------------------------------------------------------------------
# the summary: the answer first, every list cut so that the whole stays under 100 lines

CAPS = {"regressions": 10, "introduced": 6, "fixes": 8, "other bugs": 3, "unexplained": 10, "changed": 8,
        "flaky": 5, "cannot judge": 4, "not on both": 4}
MORE = "more in compare.html"


def _section(title: str, items: list[str], cap: int, empty: str | None = None) -> list[str]:
    if not items and empty is None:
        return []
    out = ["", f"## {title}"] + (items[:cap] or [f"- {empty}"])
    return out + ([f"- {len(items) - cap} {MORE}"] if len(items) > cap else [])


def unexplained(rows: list[Row]) -> list[Row]:
    """Head failures no bug explains, a failure beyond its bug's model included, that are not regressions
    or flakes: what a reviewer still has to read."""
    return [r for r in rows if r.head is not None and r.head.status in ("failed", "error")
            and r.cls not in ("regressed", "flaky")]


def _bug_sections(rows: list[Row]) -> list[str]:
    tally = bug_tally(rows)
    lines = {b: bug_line(b, k, variants_matched(rows, b)) for b, k in tally.items()}
    intro = [lines[b] for b, k in tally.items() if any(k.get(i) for i in INTRODUCED)]
    fixes = [lines[b] for b, k in tally.items() if k.get("fixed")]
    other = [lines[b] for b, k in tally.items() if not k.get("fixed") and not any(k.get(i) for i in INTRODUCED)]
    nameless = [r for r in rows if r.cls == "fixed" and not _shown(r.base)]
    if nameless:
        fixes.append(f"- failures without a bug id: fixed in {len(nameless)} (e.g. `{nameless[0].case}`)")
    return (_section(f"Bugs the change introduces or carries into new code ({len(intro)})", intro,
                     CAPS["introduced"])
            + _section(f"Bugs it fixes ({len(fixes)})", fixes, CAPS["fixes"])
            + _section(f"Other bugs on these trees ({len(other)})", other, CAPS["other bugs"]))


def summary(rows: list[Row], base_label: str, head_label: str, command: str | None = None) -> str:
    """``command``: the compare command a case name completes (``--only=CASE``) into its reproducer."""
    command = command or (f"bash scripts/run.sh compare --base {shlex.quote(base_label)} "
                          f"--head {shlex.quote(head_label)}")
    counts = Counter(r.cls for r in rows)
    line = " · ".join((f"**{c} {counts[c]}**" if c == "regressed" and counts[c] else f"{c} {counts[c]}")
                      for c in CLASSES)
    out = [f"# DeepSpeed change: {base_label} -> {head_label}", "",
           f"{len(rows)} case-columns of the stock column: {line}", "",
           f"Reproduce a case: `{command} --only=CASE`"]

    def repro(r: Row) -> str:
        return f"`{command} --only={shlex.quote(r.case)}`"
    regressed = sorted((r for r in rows if r.cls == "regressed"), key=lambda r: (r.head.status == "xfailed", r.case))
    reg = [f"- `{r.case}`: head {state(r.head)} · {repro(r)}" for r in regressed]  # no bug explains the first
    out += _section(f"Regressions ({len(reg)})", reg, CAPS["regressions"], empty="none")
    out += _bug_sections(rows)
    unex = [f"- `{r.case}` ({r.cls}; base {tag(r.base) if r.base else 'no record'}): head {state(r.head)}"
            + (" (beyond its bug model)" if r.head.status == "failed" and r.head.bug_ids else "") + f" · {repro(r)}"
            for r in unexplained(rows)]
    out += _section(f"Still unexplained on head ({len(unex)})", unex, CAPS["unexplained"])
    for cls, cap in (("changed", "changed"), ("flaky", "flaky"), ("cannot judge", "cannot judge"),
                     ("not on both", "not on both")):
        these = [f"- `{r.case}`: {r.why}" + _head_state(r) for r in rows if r.cls == cls]
        out += _section(f"{cls.capitalize()} ({len(these)})", these, CAPS[cap])
    return "\n".join(out) + "\n"


def _head_state(r: Row) -> str:
    if r.cls != "not on both" or r.head is None or r.head.status == "skipped":
        return ""
    return f"; head: {tag(r.head)}"


# --------------------------------------------------------------------------------------------------
# HTML: the summary rendered, then every case-column side by side

def markdown_html(md: str) -> str:
    """The summary as HTML, by a CommonMark parser (markdown-it-py): its lists nest by two spaces, which
    CommonMark reads as the summary means them; raw HTML in a case message stays text."""
    return MarkdownIt("commonmark", {"html": False}).render(md)


def _cell(rec: CaseRecord | None, again: CaseRecord | None) -> str:
    if rec is None:
        return "<td>no record</td>"
    ratio = f" {rec.worst_ratio:.3g}x" if rec.worst_ratio == rec.worst_ratio and rec.status != "skipped" else ""
    rerun = f"<br><small>rerun: {html.escape(tag(again))}</small>" if again is not None else ""
    return (f"<td class='st-{html.escape(rec.status)}'><b>{html.escape(tag(rec))}</b>{html.escape(ratio)}{rerun}"
            f"<details><summary>message</summary><pre>{html.escape(rec.message[:4000])}</pre>"
            f"<p>reproduce: <code>{html.escape(rec.reproduce)}</code></p></details></td>")


def render_html(rows: list[Row], base_label: str, head_label: str, md: str) -> str:
    order = {c: i for i, c in enumerate(CLASSES)}
    body = "".join(f"<tr><td>{html.escape(r.case)}</td><td>{html.escape(r.cls)}"
                   + (f"<br><small>{html.escape(r.why)}</small>" if r.why else "")
                   + f"</td>{_cell(r.base, r.base_again)}{_cell(r.head, r.head_again)}</tr>"
                   for r in sorted(rows, key=lambda r: (order[r.cls], r.case)))
    style = ("body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
             "padding:3px 6px;vertical-align:top}.st-passed{background:#e6f4e6}.st-failed,.st-error{background:#fbe3e3}"
             ".st-xfailed{background:#fff3d6}.st-unjudged{background:#e3e8fb}pre{white-space:pre-wrap;max-width:60em}"
             "code{background:#f3f3f3;padding:0 2px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(base_label)} -> "
            f"{html.escape(head_label)}</title><style>{style}</style></head><body>"
            f"<section id='summary'>{markdown_html(md)}</section>"
            f"<h2 id='cases'>Every case-column</h2>"
            f"<table><tr><th>case</th><th>class</th><th>base: {html.escape(base_label)}</th>"
            f"<th>head: {html.escape(head_label)}</th></tr>{body}</table></body></html>")
