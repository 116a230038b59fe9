"""docs/bugs.md, the README's bug table, docs/departures.md's table and docs/patched-runtime.md's table of
fixes, generated from the registry entries and the fixes' declarations.

Why generated: a bug is declared once (``harness.registry.bugs.Bug``: trigger, model, symptom, fix,
releases), and so is each departure of DeepSpeed's Muon from Muon as defined
(``harness.registry.departures.Departure``); every page that lists them is derived from that declaration,
so a page cannot drift from the judge. ``python -m harness.registry.docs`` rewrites the files; ``--check``
exits 1 when a committed file differs from what the entries give (``cases/harness/test_bug_docs.py`` runs
that check). No DeepSpeed import: the fixes are read from their declarations (``harness.fixes.FIXES``),
never installed.
"""
from __future__ import annotations

import argparse
import dataclasses
import dis
import inspect
import sys
from pathlib import Path

import oracles
from harness import fixes
from harness.registry.bugs import BUGS, HISTORICAL, Bug
from harness.registry.departures import DEPARTURES, Departure
from harness.registry.releases import spans

ROOT = Path(__file__).resolve().parents[2]
BUGS_MD = ROOT / "docs" / "bugs.md"
README = ROOT / "README.md"
DEPARTURES_MD = ROOT / "docs" / "departures.md"
FIXES_MD = ROOT / "docs" / "patched-runtime.md"
BEGIN, END = "<!-- bugs:begin -->", "<!-- bugs:end -->"
DEP_BEGIN, DEP_END = "<!-- departures:begin -->", "<!-- departures:end -->"
FIX_BEGIN, FIX_END = "<!-- fixes:begin -->", "<!-- fixes:end -->"
COMMAND = "python -m harness.registry.docs"
_SWITCHES = tuple(f.name for f in dataclasses.fields(oracles.Conventions))


def _code_text(fn) -> str:
    """The source a function or lambda was written as: a lambda's body (the span of its code in the
    file), a named function's name and the first paragraph of its docstring."""
    if fn.__name__ != "<lambda>":
        doc = inspect.getdoc(fn)
        return f"`{fn.__name__}`" + (f": {' '.join(doc.split(chr(10) + chr(10))[0].split())}" if doc else "")
    lines = Path(inspect.getsourcefile(fn)).read_text().splitlines()
    spots = [i.positions for i in dis.get_instructions(fn) if i.positions and None not in i.positions]
    (l0, c0), (l1, c1) = min((p[0], p[2]) for p in spots), max((p[1], p[3]) for p in spots)
    if l1 == l0:
        text = lines[l0 - 1][c0:c1]
    else:
        text = " ".join(t.strip() for t in [lines[l0 - 1][c0:], *lines[l0:l1 - 1], lines[l1 - 1][:c1]])
    text = text.split("lambda c:", 1)[-1].strip()
    while text.count(")") > text.count("(") and text.endswith(")"):  # a paren the span cut in two
        text = text[:-1].rstrip()
    while text.count("(") > text.count(")") and text.startswith("("):
        text = text[1:]
    return f"`{text}`"


def switches(b: Bug) -> list[str]:
    """The ``oracles.Conventions`` fields a bug's model sets, read from the model's source."""
    if b.model is None:
        return []
    src = inspect.getsource(b.model) if b.model.__name__ != "<lambda>" else _code_text(b.model)
    return [s for s in _SWITCHES if f'"{s}"' in src]


def releases_text(b: Bug) -> str:
    present = spans(r for r, x in b.releases.items() if x)
    absent = spans(r for r, x in b.releases.items() if not x)
    return "; ".join(t for t in (present and f"shows on {present}", absent and f"absent on {absent}") if t) or \
        "not measured on any release"


def modelled_text(b: Bug) -> str:
    kind = b.modelled
    if kind == "yes":
        names = switches(b)
        return "yes (" + (", ".join(f"`{s}`" for s in names) if names else "numbers unchanged") + ")"
    return kind


def fix_text(b: Bug) -> str:
    if not b.fixed_by:
        return "none"
    out = ", ".join(f"`{f}`" for f in b.fixed_by)
    if b.refused_when_patched:
        out += f" (a refusal: the patched runtime raises ValueError \"{b.refused_when_patched}...\")"
    if b.fix_covers is not None:
        out += f"; covers only where {_code_text(b.fix_covers)}"
    notes = [(f, fixes.FIXES[f].notes.strip().rstrip(".")) for f in b.fixed_by if fixes.FIXES[f].notes]
    if not notes:
        return out
    if len(b.fixed_by) == 1:
        return f"{out}. {notes[0][1]}."
    return out + "." + "".join(f" `{f}`: {n}." for f, n in notes)


def bug_section(b: Bug) -> str:
    rows = [("releases", releases_text(b)), ("trigger", _code_text(b.trigger)), ("symptom", b.symptom),
            ("diverges in", ", ".join(sorted(b.quantities))), ("where", b.where),
            ("modelled", modelled_text(b) + (f": {b.unmodelled}" if b.unmodelled else "")),
            ("fix", fix_text(b)), ("reproducer", f"`{b.reproducer}`" if b.reproducer else "none")]
    if b.crash is not None:
        rows.insert(4, ("crash", "; ".join(f"{t} \"{m}\" in `{f}`" for t, m, f in (b.crash, *b.crash_also))))
    return f"### {b.id}: {b.title}\n\n" + "\n".join(f"- **{k}**: {v}" for k, v in rows) + "\n"


def bugs_md() -> str:
    head = (f"# Registered bugs\n\nGenerated from `harness/registry/bugs.py` and `harness/registry/historical.py` "
            f"by `{COMMAND}`; do not edit by hand.\n")
    return "\n".join([head, "## DeepSpeed 0.19.8\n", *map(bug_section, BUGS),
                      "## Older releases\n", *map(bug_section, HISTORICAL)])


def readme_table() -> str:
    lines = ["| id | bug | releases | fix in `harness.fixes` | modelled |", "|---|---|---|---|---|"]
    for b in BUGS:
        fix = ", ".join(f"`{f}`" for f in b.fixed_by) or "none"
        lines.append(f"| {b.id} | {b.title} | {releases_text(b)} | {fix} | {modelled_text(b)} |")
    return "\n".join(lines)


def _between(text: str, begin: str, end: str, body: str, what: str) -> str:
    """``text`` with what stands between the markers replaced by ``body``; a ValueError without them."""
    if begin not in text or end not in text:
        raise ValueError(f"{what} has no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def readme_with_table(text: str) -> str:
    """``text`` (the README) with the table between the markers replaced; a ValueError without them."""
    return _between(text, BEGIN, END, readme_table(), "README.md (the bug table)")


def upstream_text(d: Departure) -> str:
    """Each upstream thread as a link (GitHub sends an issue number that is a pull request to the pull)."""
    links = []
    for ref in d.upstream:
        repo, _, num = ref.partition("#")
        links.append(f"[{ref}](https://github.com/{repo}/issues/{num})")
    return ", ".join(links) or "none filed"


def departures_table() -> str:
    lines = ["| id | departure | upstream | applies when | removed by | measured as |", "|---|---|---|---|---|---|"]
    for d in DEPARTURES:
        lines.append(f"| {d.id} | {d.title} | {upstream_text(d)} | {_code_text(d.applies)} | {d.removed_by} | "
                     f"{d.measured_as} |")
    lines += ["", "Where the Muon-as-defined reference differs from DeepSpeed's intended one:", ""]
    lines += [f"- **{d.id}**: {d.switch}" for d in DEPARTURES]
    return "\n".join(lines)


def departures_with_table(text: str) -> str:
    """``text`` (docs/departures.md) with the generated table between its markers."""
    return _between(text, DEP_BEGIN, DEP_END, departures_table(), "docs/departures.md")


def fixes_table() -> str:
    """One row per fix of ``harness.fixes``, in the order they are applied: what each declares."""
    lines = ["| fix | bugs | what it changes |", "|---|---|---|"]
    for f in fixes.FIXES.values():
        lines.append(f"| `{f.name}` | {', '.join(f.bugs)} | {f.summary} |")
    return "\n".join(lines)


def fixes_with_table(text: str) -> str:
    """``text`` (docs/patched-runtime.md) with the generated table of fixes between its markers."""
    return _between(text, FIX_BEGIN, FIX_END, fixes_table(), "docs/patched-runtime.md")


_PAGES = ((DEPARTURES_MD, departures_with_table), (FIXES_MD, fixes_with_table))


def stale_files() -> list[str]:
    """The generated files whose committed text differs from what the registry gives."""
    out = []
    if not BUGS_MD.exists() or BUGS_MD.read_text() != bugs_md():
        out.append(str(BUGS_MD.relative_to(ROOT)))
    readme = README.read_text()
    if readme_with_table(readme) != readme:
        out.append(str(README.relative_to(ROOT)))
    for path, with_table in _PAGES:
        page = path.read_text() if path.exists() else ""
        if not page or with_table(page) != page:
            out.append(str(path.relative_to(ROOT)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale; write nothing")
    args = ap.parse_args(argv)
    if args.check:
        stale = stale_files()
        for f in stale:
            print(f"{f} differs from the registry: run `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    BUGS_MD.write_text(bugs_md())
    README.write_text(readme_with_table(README.read_text()))
    for path, with_table in _PAGES:
        path.write_text(with_table(path.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
