"""Which gate cases can kill a mutant on a given line: the coverage map and its reading.

The map (``coverage.json`` in the mutation state folder, written by
``harness.selfcheck.source_mutation.coverage_map.record``) holds, per scoped file, the lines each candidate case
executed on any rank of the unmutated copy, plus each case's unmutated time and gate status. A mutant
runs only against the cases that executed its line, cheapest first; a mutant on a line no case
executed is "not reached" (a coverage gap), never "survived".

A mutation on a function's signature (a default argument value) runs at import, not during a case,
so line coverage never sees it: it is reached by every case that executed the function's body. A
mutation on a continuation line of a statement head (``while (a\n and b):``, a call over lines) is
reached by every case that executed any line of that head: a case whose ``a`` short-circuited never ran
line 2, yet ``and`` -> ``or`` there changes what it does (measured at 1bc3b90: ``stage_1_and_2.py:1998`` survived
the one case it needed, which never executed that line).

Standard library only (the engine's virtual environment reads the map to mark unreached mutants).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.selfcheck.source_mutation import scope as scope_mod


@dataclass
class CaseInfo:
    name: str
    seconds: float  # unmutated, under coverage (an upper bound of the plain run)
    status: str  # the gate's status of the unmutated case on the stock column
    world_size: int
    case_json: str


@dataclass
class CoverageMap:
    lines: dict[str, dict[int, list[str]]]  # file -> line -> case names
    cases: dict[str, CaseInfo]
    scope_digest: str = ""

    @classmethod
    def load(cls, path: Path) -> CoverageMap:
        d = json.loads(Path(path).read_text())
        return cls(lines={f: {int(k): v for k, v in ls.items()} for f, ls in d["lines"].items()},
                   cases={n: CaseInfo(**c) for n, c in d["cases"].items()}, scope_digest=d.get("scope_digest", ""))

    def dump(self, path: Path) -> None:
        Path(path).write_text(json.dumps({
            "scope_digest": self.scope_digest,
            "lines": {f: {str(k): v for k, v in sorted(ls.items())} for f, ls in sorted(self.lines.items())},
            "cases": {n: vars(c) for n, c in self.cases.items()}}, indent=1))

    def usable(self, name: str) -> bool:
        return self.cases[name].status in ("passed", "xfailed")

    def cases_for(self, resolved: list[scope_mod.Resolved], rel: str, lines) -> list[str]:
        """Usable cases that executed any of ``lines`` of ``rel``, cheapest first (empty: not reached)."""
        hit: set[str] = set()
        file_lines = self.lines.get(rel, {})
        for line in lines:
            hit.update(file_lines.get(line, ()))
            fn = next((r for r in resolved if r.entry.file == rel and r.first <= line <= r.last), None)
            for first, last in (fn.heads if fn is not None else ()):
                if first <= line <= last:  # a continuation line: the cases that ran any line of the head
                    for head_line in range(first, last + 1):
                        hit.update(file_lines.get(head_line, ()))
            if fn is not None and line < fn.body_first:
                for body_line in range(fn.body_first, fn.last + 1):
                    hit.update(file_lines.get(body_line, ()))
        return sorted((n for n in hit if n in self.cases and self.usable(n)),
                      key=lambda n: (self.cases[n].seconds, n))


def changed_lines(original: str, mutated: str) -> list[int]:
    """1-based lines of ``original`` that the mutation replaced or deleted (or inserted before)."""
    import difflib

    a, b = original.splitlines(), mutated.splitlines()
    out: list[int] = []
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        out.extend(range(i1 + 1, i2 + 1) if i2 > i1 else [i1 + 1])
    return out
