"""Read a Cosmic Ray session back (``cosmic-ray dump``) and summarise it: the score, a per-function
table, survivors with their diffs and the nearest case, and the not-reached lines; as text and as
``reports/mutation.html`` (one self-contained file).

Score = killed / (killed + survived) over mutants a case reached that are not in the equivalents
file. Not-reached mutants (no candidate case executes the line) are coverage gaps, listed by
function and line, and are not in the score; neither are runs where the harness itself failed. On the
patched column a mutant inside a function the patched runtime replaces is "replaced-by-fix"
(``harness.selfcheck.source_mutation.patched``): counted apart, with the function and its fixes, never scored.
"""
from __future__ import annotations

import html
import json
from collections import defaultdict
from dataclasses import dataclass, field

from harness.selfcheck.source_mutation.session import RESULT_TAG, mutant_key


@dataclass
class Mutant:
    key: str
    function: str
    status: str  # killed, survived, equivalent, not-reached, replaced-by-fix, pending, harness-error, no-change
    diff: str = ""
    record: dict = field(default_factory=dict)
    reason: str = ""  # for an equivalent


def _record(output: str | None) -> dict:
    for line in (output or "").splitlines()[::-1]:
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return {}


def read_dump(lines, resolved, equivalents: dict[str, str]) -> list[Mutant]:
    from harness.selfcheck.source_mutation import scope

    out = []
    for raw in lines:
        raw = raw.strip()
        if not raw:
            continue
        item, result = json.loads(raw)
        m = item["mutations"][0]
        rel = str(m["module_path"])
        start = m["start_pos"]
        key = mutant_key(rel, m["operator_name"], m["occurrence"], start)
        fn = scope.owner(resolved, rel, start[0])
        name = fn.name if fn else f"{rel}:?"
        if result is None:
            out.append(Mutant(key, name, "pending"))
            continue
        rec = _record(result.get("output"))
        status = rec.get("status") or ("harness-error" if result.get("worker_outcome") != "skipped" else "not-reached")
        if key in equivalents and status == "survived":
            status = "equivalent"
        elif status == "equivalent" and key not in equivalents:  # recorded unjudged, then taken off the list
            status = "pending"
            rec = dict(rec, detail="recorded as a listed equivalent without a run, no longer listed: "
                                   "rerun with --retry equivalent")
        out.append(Mutant(key, name, status, result.get("diff") or "", rec, equivalents.get(key, "")))
    return sorted(out, key=lambda x: sort_key(x.key))


def sort_key(key: str):
    """file, line, column, operator, occurrence: line 99 before line 100."""
    where, _, op = key.partition(" ")
    rel, line, col = where.rsplit(":", 2)
    name, _, occ = op.rpartition("#")
    return rel, int(line), int(col), name, int(occ)


@dataclass
class Summary:
    mutants: list[Mutant]
    seconds: float = 0.0
    title: str = "source mutation"
    # every scoped function (the whole scope, not only the sample): {"mutants": n, "reached": n}
    scope: dict[str, dict[str, int]] = field(default_factory=dict)

    def scope_lines(self) -> list[str]:
        from harness.selfcheck.source_mutation.scope import NOT_REACHED_WHY

        out = []
        for fn, c in sorted(self.scope.items()):
            if c["mutants"] == 0:
                out.append(f"no mutation site: {fn} (its selected lines hold nothing Cosmic Ray's operators change)")
            elif c["reached"] == 0:
                out.append(f"not reached: {fn} ({c['mutants']} mutants): "
                           + NOT_REACHED_WHY.get(fn, "no candidate case executes it"))
        return out

    def count(self, status: str) -> int:
        return sum(m.status == status for m in self.mutants)

    @property
    def score(self) -> float | None:
        k, s = self.count("killed"), self.count("survived")
        return None if k + s == 0 else k / (k + s)

    def by_function(self) -> dict[str, dict[str, int]]:
        t: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for m in self.mutants:
            t[m.function][m.status] += 1
        return t

    def survivors(self) -> list[Mutant]:
        return [m for m in self.mutants if m.status == "survived"]

    def ran(self) -> list[Mutant]:
        return [m for m in self.mutants if m.record.get("seconds") is not None]

    def text(self) -> str:
        sc = self.score
        ran = self.ran()
        per = sum(m.record["seconds"] for m in ran) / len(ran) if ran else 0.0
        lines = [f"{self.title}: {len(self.mutants)} mutants: " + ", ".join(
            f"{s} {self.count(s)}" for s in ("killed", "survived", "equivalent", "not-reached", "replaced-by-fix",
                                             "pending", "harness-error") if self.count(s)),
            "score over reached, non-equivalent mutants: "
            + ("n/a" if sc is None else f"{self.count('killed')}/{self.count('killed') + self.count('survived')}"
               f" = {100 * sc:.1f}%"),
            f"judging time: {len(ran)} mutants run, {per:.1f} s each on average (worker's own time, pool start-up "
            f"included; {self.seconds:.0f} s wall for this invocation)"]
        carried = [m for m in self.mutants if m.record.get("from_ledger")]
        if carried:
            commits = sorted({m.record["from_ledger"] for m in carried})
            lines.append(f"carried from the ledger: {len(carried)} of those results, judged at "
                         f"{', '.join(commits[:6])}{' ...' if len(commits) > 6 else ''} (--fresh judges them anew)")
        if self.scope:
            tot = sum(c["mutants"] for c in self.scope.values())
            rea = sum(c["reached"] for c in self.scope.values())
            lines.append(f"scope: {len(self.scope)} functions, {tot} mutants, {rea} on lines a candidate case "
                         f"executes ({100 * rea / max(1, tot):.0f}%)")
            lines.extend(self.scope_lines())
        for m in self.survivors():
            lines.append(f"SURVIVED {m.key} ({m.function}); nearest case {m.record.get('nearest')}")
            lines.extend("    " + d for d in m.diff.splitlines() if d.startswith(("+", "-")) and
                         not d.startswith(("+++", "---")))
        for m in self.mutants:
            if m.status == "replaced-by-fix":
                fixes = ", ".join(m.record.get("fixes", []))
                lines.append(f"REPLACED BY A FIX {m.key}: {m.record.get('replaced')} ({fixes})")
        for m in self.mutants:
            if m.status == "harness-error":
                lines.append(f"HARNESS ERROR {m.key}: {m.record.get('detail', '')}")
        return "\n".join(lines)


def verdict(mutants: list[Mutant]) -> tuple[bool, list[str]]:
    """The run passes when no reached, non-equivalent mutant survived and every mutant was judged
    (a pending mutant or one the harness failed to judge is not a pass)."""
    reasons = [f"survived: {m.key} ({m.function})" for m in mutants if m.status == "survived"]
    reasons += [f"{m.status}: {m.key}" for m in mutants if m.status in ("pending", "harness-error", "no-change")]
    return not reasons, reasons


def render_html(summary: Summary) -> str:
    e = html.escape
    sc = summary.score
    rows = []
    for fn, counts in sorted(summary.by_function().items()):
        k, s = counts.get("killed", 0), counts.get("survived", 0)
        score = "not reached" if k + s == 0 and counts.get("not-reached") else (
            "-" if k + s == 0 else f"{100 * k / (k + s):.0f}%")
        rows.append("<tr>" + "".join(f"<td>{e(str(x))}</td>" for x in (
            fn, sum(counts.values()), k, s, counts.get("equivalent", 0), counts.get("not-reached", 0),
            counts.get("replaced-by-fix", 0), counts.get("pending", 0) + counts.get("harness-error", 0), score))
            + "</tr>")
    surv = []
    for m in summary.survivors():
        surv.append(f"<details open><summary><code>{e(m.key)}</code> in {e(m.function)}; nearest case "
                    f"<code>{e(str(m.record.get('nearest')))}</code></summary>"
                    f"<pre>{e(m.diff)}</pre><p>{e(m.record.get('detail', ''))}; tried: "
                    f"{e(', '.join(t['case'] + '=' + t['status'] for t in m.record.get('tried', [])))}</p></details>")
    unreached = [f"<li><code>{e(m.key)}</code> ({e(m.function)})</li>" for m in summary.mutants
                 if m.status == "not-reached"]
    replaced = [f"<li><code>{e(m.key)}</code>: {e(str(m.record.get('detail', '')))}</li>" for m in summary.mutants
                if m.status == "replaced-by-fix"]
    equiv = [f"<li><code>{e(m.key)}</code>: {e(m.reason)}</li>" for m in summary.mutants if m.status == "equivalent"]
    killed = [f"<tr><td><code>{e(m.key)}</code></td><td>{e(str(m.record.get('by')))}</td>"
              f"<td>{e(str(m.record.get('how')))}</td><td>{e(str(m.record.get('detail', ''))[:160])}</td></tr>"
              for m in summary.mutants if m.status == "killed"]
    from harness.selfcheck.source_mutation.scope import NOT_REACHED_WHY

    scope_rows = "".join(
        f"<tr><td>{e(fn)}</td><td>{c['mutants']}</td><td>{c['reached']}</td><td>"
        f"{e(NOT_REACHED_WHY.get(fn, 'no candidate case executes it') if c['reached'] == 0 < c['mutants'] else '')}"
        "</td></tr>"
        for fn, c in sorted(summary.scope.items()))
    verdict = "no survivors" if not summary.survivors() else f"{len(summary.survivors())} survivor(s)"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{e(summary.title)}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:2px 6px;font-size:90%}}pre{{background:#f6f6f6;padding:6px}}</style></head><body>
<h1>{e(summary.title)}</h1>
<pre>{e(chr(10).join(ln for ln in summary.text().split(chr(10) + 'SURVIVED')[0].splitlines()
                  if not ln.startswith(('not reached:', 'no mutation site:'))))}</pre>
<p><b>Score</b> (killed / reached non-equivalent): {'n/a' if sc is None else f'{100 * sc:.1f}%'}; {e(verdict)}.</p>
<h2>Per function</h2><table><tr><th>function</th><th>mutants</th><th>killed</th><th>survived</th>
<th>equivalent</th><th>not reached</th><th>replaced by a fix</th><th>pending / harness error</th><th>score</th></tr>
{''.join(rows)}</table>
<h2>Scope: every function, all its mutants</h2><table><tr><th>function</th><th>mutants</th>
<th>on lines a candidate case executes</th><th>not reached: why</th></tr>{scope_rows}</table>
<h2>Survivors</h2>{''.join(surv) or '<p>none</p>'}
<h2>Equivalent (equivalents.txt)</h2><ul>{''.join(equiv) or '<li>none in this run</li>'}</ul>
<h2>Not reached (coverage gaps)</h2><ul>{''.join(unreached) or '<li>none</li>'}</ul>
<h2>Replaced by a fix (patched column: not judged)</h2><ul>{''.join(replaced) or '<li>none</li>'}</ul>
<h2>Killed</h2><table><tr><th>mutant</th><th>killed by</th><th>how</th><th>first line</th></tr>{''.join(killed)}</table>
</body></html>"""
